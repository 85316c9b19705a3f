// The compression codecs on the GPU: encode, decode, decode-add and add
// (each of the last two optionally encoding its result, the fused step of a
// compressed ring hop), for bf16, fp16 and int8. The arithmetic is
// codec.cuh's, shared with the CPU loops; this file adds memory access.
//
// Layout: 8 lanes per block of 32 elements, each lane 4 consecutive elements
// (one 16-byte float4), so a warp covers 4 blocks, 128 elements, and reads
// 512 contiguous bytes of float32 per instruction; payloads move 8 bytes
// (fp16, bf16) or 4 bytes (int8) per lane, contiguous across the warp. A
// block's largest |v| is the maximum over its 8 lanes by __shfl_xor_sync
// with masks 1, 2, 4 (within the group of 8); the group's lane 0 writes the
// scale byte. Each lane keeps its 4 values in registers between the two
// passes (largest, then encoding), so out may be acc (in place).
//
// Grid-stride loop over groups of 4 blocks, whole warps at a time: the loop
// condition is the same for every lane of a warp, so every shuffle has all
// 32 lanes (lanes past the last block take part with nothing to do). The
// launcher sizes the grid to the device (multiprocessors x blocks per SM,
// capped by the work; collectives/compression/kernels.py: codec_grid).
//
// Alignment: a call's regions start on block boundaries of their buffers, so
// each lane's first element is 16-byte aligned exactly when the call's base
// pointers are (float32 at 16, 16-bit payloads at 8, int8 at 4 bytes).
// When they are not (user arrays that start at an odd element), and for the
// partial last block, lanes move elements one at a time; the values, and so
// the bits, are the same on both paths.
//
// Results equal the CPU loops and tests/codec_reference.py bit for bit: the
// emulated device compiles this file for the CPU and runs the threads of a
// CUDA block as fibers that meet at every shuffle (emulation/launch.cpp).

#include "codec.cuh"

#if defined(__CUDA_ARCH__)
#define COLLECTIVES_CODEC_GLOBAL(p) __builtin_assume(__isGlobal(p))
#else
#define COLLECTIVES_CODEC_GLOBAL(p) ((void)0)
#endif

namespace collectives {

constexpr int kCodecThreads = 256;       // threads per CUDA block (kernels.py: CODEC_THREADS)
constexpr int kCodecLanes = 8;           // lanes per block of 32 elements
constexpr int kCodecPerLane = 4;         // elements per lane: one float4

// What a codec kernel does, its second template argument (compression/kernels.py:
// KERNELS); kCodecCopy only as a row of codec_batch (compression/kernels.py: COPY).
enum CodecOp { kEncode = 0, kDecode = 1, kDecodeAdd = 2, kAdd = 3, kCodecCopy = 4 };

// CodecArgs.flags.
enum CodecFlag { kEncodeOut = 1, kWriteOut = 2 };

// The one (by-value) argument of every codec kernel: byte addresses (0 for
// an absent array) and sizes, laid out as kernels.py's CodecArgs.
//
//     encode       x = acc; payload, scales = out_payload, out_scales;
//                  kWriteOut: x = decode(encode(x)) (out = x)
//     decode       payload, scales -> out
//     decode_add   out = (acc + decode(payload, scales)) [/ divisor],
//                  kEncodeOut: encoded into out_payload, out_scales, and
//                  (kWriteOut) out = its decoding
//     add          the same with acc + b
struct CodecArgs {
    unsigned long long acc, b, payload, scales, out, out_payload, out_scales;
    long long n;           // elements
    float divisor;         // > 0: divide the sums by it
    int flags;             // CodecFlag
};

namespace codec {

// 16- and 8-byte stores. Written as PTX on the GPU: as plain C++, NVVM merged
// each vector store with the element-wise store of the other path into
// 32-bit stores (nvcc 13.5); kernels/check.py holds it to STG.E.128.
__device__ __forceinline__ void store_16_bytes(float* p, float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__)
    asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
#else
    float4 w;
    w.x = a, w.y = b, w.z = c, w.w = d;
    *reinterpret_cast<float4*>(p) = w;
#endif
}

__device__ __forceinline__ void store_8_bytes(void* p, unsigned int a, unsigned int b) {
#if defined(__CUDA_ARCH__)
    asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(a), "r"(b) : "memory");
#else
    uint2 w;
    w.x = a, w.y = b;
    *reinterpret_cast<uint2*>(p) = w;
#endif
}

__device__ __forceinline__ void store_4_bytes(void* p, unsigned int a) {
#if defined(__CUDA_ARCH__)
    asm volatile("st.global.u32 [%0], %1;" ::"l"(p), "r"(a) : "memory");
#else
    *reinterpret_cast<unsigned int*>(p) = a;
#endif
}

template <int C> struct Payload { using type = unsigned short; };
template <> struct Payload<kInt8> { using type = unsigned char; };

// Up to 4 payloads of a lane, as the low bits of 4 uint32.
template <int C>
__device__ __forceinline__ void load_payload(const typename Payload<C>::type* p, bool vector, int count,
                                             unsigned int (&out)[kCodecPerLane]) {
    if (vector) {
        if (C == kInt8) {
            const unsigned int w = *reinterpret_cast<const unsigned int*>(p);
            for (int j = 0; j < kCodecPerLane; ++j) out[j] = (w >> (8 * j)) & 0xFFu;
        } else {
            const uint2 w = *reinterpret_cast<const uint2*>(p);
            out[0] = w.x & 0xFFFFu, out[1] = w.x >> 16, out[2] = w.y & 0xFFFFu, out[3] = w.y >> 16;
        }
        return;
    }
    for (int j = 0; j < kCodecPerLane; ++j) out[j] = j < count ? static_cast<unsigned int>(p[j]) : 0u;
}

template <int C>
__device__ __forceinline__ void store_payload(typename Payload<C>::type* p, bool vector, int count,
                                              const unsigned int (&in)[kCodecPerLane]) {
    if (vector) {
        if (C == kInt8) {
            store_4_bytes(p, (in[0] & 0xFFu) | (in[1] & 0xFFu) << 8 | (in[2] & 0xFFu) << 16 | (in[3] & 0xFFu) << 24);
        } else {
            store_8_bytes(p, (in[0] & 0xFFFFu) | in[1] << 16, (in[2] & 0xFFFFu) | in[3] << 16);
        }
        return;
    }
    for (int j = 0; j < kCodecPerLane; ++j)
        if (j < count) p[j] = static_cast<typename Payload<C>::type>(in[j]);
}

__device__ __forceinline__ void load_floats(const float* p, bool vector, int count, float (&out)[kCodecPerLane]) {
    if (vector) {
        const float4 w = *reinterpret_cast<const float4*>(p);
        out[0] = w.x, out[1] = w.y, out[2] = w.z, out[3] = w.w;
        return;
    }
    for (int j = 0; j < kCodecPerLane; ++j) out[j] = j < count ? p[j] : 0.0f;
}

__device__ __forceinline__ void store_floats(float* p, bool vector, int count, const float (&in)[kCodecPerLane]) {
    if (vector) {
        store_16_bytes(p, in[0], in[1], in[2], in[3]);
        return;
    }
    for (int j = 0; j < kCodecPerLane; ++j)
        if (j < count) p[j] = in[j];
}

// The largest of the 8 lanes' values of a group (lanes 8g .. 8g + 7 of a warp).
__device__ __forceinline__ unsigned int group_max(unsigned int m) {
    for (int mask = 1; mask < kCodecLanes; mask <<= 1) {
        const unsigned int other = __shfl_xor_sync(0xFFFFFFFFu, m, mask);
        m = other > m ? other : m;
    }
    return m;
}

// What lane `lane_in_warp` of the warp at step w of a grid-stride loop works
// on: its block of 32 elements, its first element, how many of its 4
// elements exist (0 past the end: the lane still takes part in shuffles),
// and whether they move as one vector.
struct LaneSpan {
    long long blk, first;
    int count;
    bool vector;
};

__device__ __forceinline__ LaneSpan lane_span(long long w, int lane_in_warp, long long n, bool aligned) {
    LaneSpan span;
    span.blk = w * (32 / kCodecLanes) + lane_in_warp / kCodecLanes;
    span.first = span.blk * kBlock + (lane_in_warp & (kCodecLanes - 1)) * kCodecPerLane;
    const long long left = n - span.first;
    span.count = left <= 0 ? 0 : left >= kCodecPerLane ? kCodecPerLane : static_cast<int>(left);
    span.vector = aligned && span.count == kCodecPerLane;
    return span;
}

// A lane's 4 values v through the codec: the block's scale byte from all 8
// lanes of its group (returned; 127, e = 0, for bf16, which has none), then
// each value's payload q and the value that payload decodes to. Every lane
// of the warp calls it (the shuffles); lanes with count 0 give nothing.
template <int C>
__device__ __forceinline__ unsigned int encode_lanes(const float (&v)[kCodecPerLane], int count,
                                                     unsigned int (&q)[kCodecPerLane],
                                                     float (&decoded)[kCodecPerLane]) {
    unsigned int byte = 127;
    if (C != kBf16) {
        unsigned int largest = 0;
        for (int j = 0; j < kCodecPerLane; ++j) {
            const unsigned int m = j < count ? magnitude_bits(v[j]) : 0u;
            largest = m > largest ? m : largest;
        }
        byte = scale_byte(C, group_max(largest));
    }
    if (byte == kSpecialScale) {   // inf or NaN in the block: payload zeros, values NaN
        for (int j = 0; j < kCodecPerLane; ++j) q[j] = 0u, decoded[j] = nan32();
    } else {
        const float inverse = inverse_scale_of(byte), scale = pow2(static_cast<int>(byte) - 127);
        for (int j = 0; j < kCodecPerLane; ++j) {
            float value;
            q[j] = encode_value<C>(v[j], inverse, &value);
            decoded[j] = rescale<C>(value, scale);
        }
    }
    return byte;
}

}  // namespace codec

// One codec operation over args.n elements, by the warps `warp`, `warp +
// warps`, ... of the threads running it (whole warps: see the loop below).
template <int Codec, int Op>
__device__ __forceinline__ void codec_op(const CodecArgs& args, long long warp, long long warps) {
    using namespace codec;
    using P = typename Payload<Codec>::type;
    const float* acc = reinterpret_cast<const float*>(args.acc);
    const float* b = reinterpret_cast<const float*>(args.b);
    const P* payload = reinterpret_cast<const P*>(args.payload);
    const unsigned char* scales = reinterpret_cast<const unsigned char*>(args.scales);
    float* out = reinterpret_cast<float*>(args.out);
    P* out_payload = reinterpret_cast<P*>(args.out_payload);
    unsigned char* out_scales = reinterpret_cast<unsigned char*>(args.out_scales);
    COLLECTIVES_CODEC_GLOBAL(acc);
    COLLECTIVES_CODEC_GLOBAL(b);
    COLLECTIVES_CODEC_GLOBAL(payload);
    COLLECTIVES_CODEC_GLOBAL(scales);
    COLLECTIVES_CODEC_GLOBAL(out);
    COLLECTIVES_CODEC_GLOBAL(out_payload);
    COLLECTIVES_CODEC_GLOBAL(out_scales);

    const bool encode_out = Op == kEncode || (Op != kDecode && (args.flags & kEncodeOut));
    const bool write_out = Op == kDecode || (args.flags & kWriteOut) || !encode_out;
    const bool divide = Op >= kDecodeAdd && args.divisor > 0.0f;
    // Each lane's 4 elements start at a multiple of 4 elements: 16-byte
    // accesses are possible exactly when every base pointer allows them.
    const unsigned long long payload_align = sizeof(P) * kCodecPerLane - 1;
    const bool aligned = ((args.acc | args.b | args.out) & 15u) == 0 &&
                         ((args.payload | args.out_payload) & payload_align) == 0;

    const long long n = args.n;
    const long long nblocks = (n + kBlock - 1) / kBlock;
    const int lane_in_warp = threadIdx.x & 31;
    const int lane = lane_in_warp & (kCodecLanes - 1);
    constexpr int kBlocksPerWarp = 32 / kCodecLanes;

    for (long long w = warp; w * kBlocksPerWarp < nblocks; w += warps) {
        const LaneSpan span = lane_span(w, lane_in_warp, n, aligned);
        const long long blk = span.blk, first = span.first;
        const int count = span.count;
        const bool vector = span.vector;

        // The values v of the lane's elements.
        float v[kCodecPerLane] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (Op == kEncode) {
            if (count) load_floats(acc + first, vector, count, v);
        } else {
            unsigned int p[kCodecPerLane] = {0u, 0u, 0u, 0u};
            float other[kCodecPerLane] = {0.0f, 0.0f, 0.0f, 0.0f};
            if (Op != kAdd) {
                if (count) load_payload<Codec>(payload + first, vector, count, p);
                const float scale = Codec == kBf16 || count == 0 ? 0.0f : scale_of(scales[blk]);
                for (int j = 0; j < kCodecPerLane; ++j) other[j] = decode_value<Codec>(p[j], scale, false);
            } else if (count) {
                load_floats(b + first, vector, count, other);
            }
            if (Op == kDecode) {
                for (int j = 0; j < kCodecPerLane; ++j) v[j] = other[j];
            } else {
                if (count) load_floats(acc + first, vector, count, v);
                for (int j = 0; j < kCodecPerLane; ++j) {
                    const float sum = add(v[j], other[j]);
                    v[j] = divide ? __fdiv_rn(sum, args.divisor) : sum;
                }
            }
        }
        if (!encode_out) {
            if (count) store_floats(out + first, vector, count, v);
            continue;
        }

        // Encode: the block's scale (from all 8 lanes), then each value.
        unsigned int q[kCodecPerLane];
        float decoded[kCodecPerLane];
        const unsigned int byte = encode_lanes<Codec>(v, count, q, decoded);
        if (Codec != kBf16 && lane == 0 && count) out_scales[blk] = static_cast<unsigned char>(byte);
        if (count) {
            store_payload<Codec>(out_payload + first, vector, count, q);
            if (write_out) store_floats(out + first, vector, count, decoded);
        }
    }
}

// This thread's warp among the warps of the grid's x dimension.
__device__ __forceinline__ long long grid_warp() {
    return (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
}

__device__ __forceinline__ long long grid_warps() {
    return (static_cast<long long>(gridDim.x) * blockDim.x) >> 5;
}

template <int Codec, int Op>
__global__ void __launch_bounds__(kCodecThreads) codec_kernel(CodecArgs args) {
    codec_op<Codec, Op>(args, grid_warp(), grid_warps());
}

// -- a batch of operations in one launch ----------------------------------------
//
// A compressed allreduce is a few dozen small operations per call (the
// lowering of compression/wire.py); launched one by one, the host spends
// several microseconds on each. The executor groups those that touch no
// common memory (compression/kernels.py: batch_rows) and launches each group
// as one codec_batch: row y of the batch is run by the blocks of grid row y,
// so the rows run side by side. A row is one of the four operations above
// or a copy of bytes (the encoded chunk a ring hop forwards as it is, a
// float32 region into or out of the workspace).
//
// The batch goes by value (the driver copies it into constant memory at the
// launch); __grid_constant__ lets a block read its row there, at an index
// known only at run time, without a copy into local memory.

constexpr int kCodecBatchRows = 40;      // kernels.py: CODEC_BATCH_ROWS (40 x 80 bytes: inside the 4 KiB of parameters)

struct CodecRow {
    CodecArgs args;
    int op;                // CodecOp; kCodecCopy: args.n bytes from args.acc to args.out
    int unused;            // keeps the row a multiple of 8 bytes
};

struct CodecBatch {
    CodecRow rows[kCodecBatchRows];
};

// args.n bytes from args.acc to args.out by every thread of the grid's x
// dimension: 16 bytes a thread where both ends allow it, the rest (and all
// of a copy that is not 16-byte aligned: the scale bytes of a chunk) a byte
// at a time.
__device__ __forceinline__ void copy_bytes(const CodecArgs& args) {
    const unsigned char* src = reinterpret_cast<const unsigned char*>(args.acc);
    unsigned char* dst = reinterpret_cast<unsigned char*>(args.out);
    COLLECTIVES_CODEC_GLOBAL(src);
    COLLECTIVES_CODEC_GLOBAL(dst);
    const long long n = args.n;
    const long long thread = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const long long threads = static_cast<long long>(gridDim.x) * blockDim.x;
    long long vectors = 0;
    if (((args.acc | args.out) & 15u) == 0) {
        vectors = n / 16;
        for (long long i = thread; i < vectors; i += threads) {
            const float4 v = reinterpret_cast<const float4*>(src)[i];
            codec::store_16_bytes(reinterpret_cast<float*>(dst) + 4 * i, v.x, v.y, v.z, v.w);
        }
    }
    for (long long i = 16 * vectors + thread; i < n; i += threads) dst[i] = src[i];
}

template <int Codec>
__global__ void __launch_bounds__(kCodecThreads) codec_batch(const __grid_constant__ CodecBatch batch) {
    const CodecRow& row = batch.rows[blockIdx.y];
    switch (row.op) {   // the same for every thread of a block: whole warps stay together
        case kEncode: codec_op<Codec, kEncode>(row.args, grid_warp(), grid_warps()); break;
        case kDecode: codec_op<Codec, kDecode>(row.args, grid_warp(), grid_warps()); break;
        case kDecodeAdd: codec_op<Codec, kDecodeAdd>(row.args, grid_warp(), grid_warps()); break;
        case kAdd: codec_op<Codec, kAdd>(row.args, grid_warp(), grid_warps()); break;
        case kCodecCopy: copy_bytes(row.args); break;
        default: break;
    }
}

// -- ranks that share one GPU: the codec's rounding, fused with the sum ------------
//
// A compressed direct allreduce gives every rank
//
//     out = ((round(x_0) + round(x_1)) + round(x_2)) + ... [/ divisor]
//
// where round(x) = decode(encode(x)), block by block from each input's
// start, and the sum goes in rank order (compression/wire.py lowers it so;
// every rank folds the same values in the same order). Ranks on one GPU
// read each other's memory directly, so the wire form need not exist: one
// pass reads each input once, rounds it in registers (encode_lanes, the
// same arithmetic the encode kernel stores), adds, and writes every output
// once: the memory floor of an uncompressed allreduce, with the bits of the
// compressed one. A lane group reads its block of every input before it
// writes that block of any output, so outputs may be the inputs (in place).

constexpr int kCodecSumRanks = 64;       // kernels.py: MAX_RANKS

struct CodecSumArgs {
    unsigned long long inputs[kCodecSumRanks];    // float32, in the order of the sum
    unsigned long long outputs[kCodecSumRanks];   // float32, each gets the result
    long long n;           // elements of every input and output
    int ninputs, noutputs;
    float divisor;         // > 0: divide the sum by it (avg)
    int unused;
};

template <int Codec>
__global__ void __launch_bounds__(kCodecThreads) codec_round_sum(const __grid_constant__ CodecSumArgs args) {
    using namespace codec;
    unsigned long long bases = 0;
    for (int s = 0; s < args.ninputs; ++s) bases |= args.inputs[s];
    for (int o = 0; o < args.noutputs; ++o) bases |= args.outputs[o];
    const bool aligned = (bases & 15u) == 0;
    const bool divide = args.divisor > 0.0f;

    const long long n = args.n;
    const long long nblocks = (n + kBlock - 1) / kBlock;
    const int lane_in_warp = threadIdx.x & 31;
    constexpr int kBlocksPerWarp = 32 / kCodecLanes;
    for (long long w = grid_warp(); w * kBlocksPerWarp < nblocks; w += grid_warps()) {
        const LaneSpan span = lane_span(w, lane_in_warp, n, aligned);
        const long long blk = span.blk, first = span.first;
        const int count = span.count;
        const bool vector = span.vector;

        float sum[kCodecPerLane] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int s = 0; s < args.ninputs; ++s) {
            const float* x = reinterpret_cast<const float*>(args.inputs[s]);
            COLLECTIVES_CODEC_GLOBAL(x);
            float v[kCodecPerLane] = {0.0f, 0.0f, 0.0f, 0.0f};
            if (count) load_floats(x + first, vector, count, v);
            unsigned int q[kCodecPerLane];
            float rounded[kCodecPerLane];
            encode_lanes<Codec>(v, count, q, rounded);
            for (int j = 0; j < kCodecPerLane; ++j) sum[j] = s == 0 ? rounded[j] : add(sum[j], rounded[j]);
        }
        if (divide)
            for (int j = 0; j < kCodecPerLane; ++j) sum[j] = __fdiv_rn(sum[j], args.divisor);
        if (count) {
            for (int o = 0; o < args.noutputs; ++o) {
                float* out = reinterpret_cast<float*>(args.outputs[o]);
                COLLECTIVES_CODEC_GLOBAL(out);
                store_floats(out + first, vector, count, sum);
            }
        }
    }
}

}  // namespace collectives

// Every instance, for the nvcc build (instances.cu) and the emulated device.
#define COLLECTIVES_FOR_EACH_CODEC_KERNEL(X)                                            \
    X(0, 0) X(0, 1) X(0, 2) X(0, 3) X(1, 0) X(1, 1) X(1, 2) X(1, 3) X(2, 0) X(2, 1) X(2, 2) X(2, 3)
#define COLLECTIVES_FOR_EACH_CODEC(X) X(0) X(1) X(2)
