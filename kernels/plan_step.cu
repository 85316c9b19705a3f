// The plan-step kernel: one launch runs every op-table row of one phase that
// belongs to the ranks living on one device.
//
// A row is the int64 record collectives/plan.py defines and
// collectives/executors/host.py interprets with NumPy (the reference meaning):
//
//     RANK KIND COUNT DST_BUF DST_OFF NSRC (SRC_RANK SRC_BUF SRC_OFF) * max_sources
//
//     COPY          dst = src0                                  the bits, as they are
//     REDUCE        dst = ((src0 op src1) op src2) ...      folded left to right
//     REDUCE_FINAL  the same, then / divisor when the op is avg (divisor > 0)
//
// A fold runs in the element type's accumulator (elements.cuh): for float16
// and bfloat16, float32, rounded to 16 bits once per row, when dst is written.
//
// Offsets and counts are in elements. A (rank, buffer) pair is resolved
// through `buffers`, passed by value: the byte address of each rank's WORK,
// SCRATCH, INPUT and OUTPUT for this call. The table itself never changes
// for a plan, so it is uploaded once; only the addresses travel per launch.
//
// Fan-out: rows that fold the same sources the same way (same KIND, COUNT
// and sources; only the destination differs) may come as a group of
// `fanout` consecutive rows, as the executor sorts them for ranks that share
// a device (direct allreduce: every rank's output is the fold of every
// input). The group's first row gives the sources; its value is folded once
// and stored to each row's destination. Rows of one phase never read what
// another writes, so this is the table's meaning exactly, and it reads the
// sources once instead of `fanout` times: for ranks on one GPU, one pass at
// the memory floor (each input read once, each output written once).
//
// Grid: blockIdx.y is the row (the group), blockIdx.x and threadIdx.x stride over its
// elements. Every thread's work depends only on its indices: no shared
// memory, barriers, shuffles or atomics. That makes running each (block,
// thread) one after another on the CPU exact (emulation/), and it is why the
// plan, not the kernel, orders the rows that depend on each other.
//
// Memory access: when the row's destination and every source are 16-byte
// aligned, elements move as 16-byte packs (128-bit loads and stores) and the
// last count % lanes elements go one by one; otherwise the whole row goes one
// element at a time. The fold order per element is the same on both paths.

#include "elements.cuh"

// Packs each thread keeps in flight per loop iteration; results do not
// depend on it. bench/gpu_check.py measures 1, 2 and 4 against a device copy
// (bench/results/gpu_check_cuda.json).
#ifndef COLLECTIVES_STEP_UNROLL
#define COLLECTIVES_STEP_UNROLL 2
#endif

// Blocks of kStepThreads that must fit on one multiprocessor at once, which
// caps registers per thread (4: 64 registers). Left unsaid, nvcc 13.5 chose
// 32 registers for some instances and spilled; 8 (32 registers) spills in
// many more (kernels/check.py refuses both). gpu_check measures the variants.
#ifndef COLLECTIVES_STEP_MIN_BLOCKS
#define COLLECTIVES_STEP_MIN_BLOCKS 4
#endif

// Loads through a pointer taken from the buffer table compile to generic
// LD.E instead of global LDG.E unless the compiler knows the space.
#if defined(__CUDA_ARCH__)
#define COLLECTIVES_ASSUME_GLOBAL(p) __builtin_assume(__isGlobal(p))
#else
#define COLLECTIVES_ASSUME_GLOBAL(p) ((void)0)
#endif

namespace collectives {

constexpr int kStepThreads = 256;  // threads per block (collectives/kernels.py: STEP_THREADS)
constexpr int kStepMinBlocks = COLLECTIVES_STEP_MIN_BLOCKS;
constexpr int kMaxRanks = 64;      // ranks a BufferTable addresses (kernels.py: MAX_RANKS)
constexpr int kBuffers = 4;        // WORK, SCRATCH, INPUT, OUTPUT (plan.py numbers them 0..3)
constexpr int kUnroll = COLLECTIVES_STEP_UNROLL;

// Op-table columns and row kinds, as in collectives/plan.py.
enum Column { kRank = 0, kKind = 1, kCount = 2, kDstBuf = 3, kDstOff = 4, kNumSrc = 5, kSrc0 = 6 };
enum RowKind { kCopy = 0, kReduce = 1, kReduceFinal = 2 };

struct BufferTable {
    unsigned long long address[kMaxRanks * kBuffers];  // [rank * kBuffers + buffer]
};

// 16 bytes as the four 32-bit words a 128-bit load brings in. Lanes (the
// elements) are read and written with shifts at indices the unrolled loops
// make constant, so a pack lives in registers.
struct alignas(16) Pack {
    unsigned int word[4];
};

template <typename S>
__device__ __forceinline__ S lane(const Pack& p, int i) {
    if (sizeof(S) == 8)
        return Bits<S>::from(static_cast<unsigned long long>(p.word[2 * i + 1]) << 32 | p.word[2 * i]);
    constexpr int kPerWord = 4 / (sizeof(S) < 4 ? sizeof(S) : 4);
    constexpr int kBits = 8 * sizeof(S);
    return Bits<S>::from((p.word[i / kPerWord] >> (kBits * (i % kPerWord) % 32)) & (kBits == 32 ? ~0u : (1u << (kBits % 32)) - 1));
}

template <typename S>
__device__ __forceinline__ void set_lane(Pack& p, int i, S value) {
    const unsigned long long bits = Bits<S>::to(value);
    if (sizeof(S) == 8) {
        p.word[2 * i] = static_cast<unsigned int>(bits);
        p.word[2 * i + 1] = static_cast<unsigned int>(bits >> 32);
        return;
    }
    constexpr int kPerWord = 4 / (sizeof(S) < 4 ? sizeof(S) : 4);
    constexpr int kBits = 8 * sizeof(S);
    constexpr unsigned int kMask = kBits == 32 ? ~0u : (1u << (kBits % 32)) - 1;
    const int shift = kBits * (i % kPerWord) % 32;
    unsigned int& word = p.word[i / kPerWord];
    word = (word & ~(kMask << shift)) | (static_cast<unsigned int>(bits) << shift);
}

template <typename S>
__device__ __forceinline__ S* element_address(const BufferTable& buffers, long long rank, long long buffer,
                                              long long offset) {
    S* p = reinterpret_cast<S*>(buffers.address[rank * kBuffers + buffer]) + offset;
    COLLECTIVES_ASSUME_GLOBAL(p);
    return p;
}

template <typename S>
__device__ __forceinline__ const S* source(const long long* row, const BufferTable& buffers, int i) {
    const long long* src = row + kSrc0 + 3 * i;
    return element_address<S>(buffers, src[0], src[1], src[2]);
}

// The destination of the d-th row of a fan-out group that starts at `row`.
template <typename S>
__device__ __forceinline__ S* destination(const long long* row, int width, const BufferTable& buffers, int d) {
    const long long* other = row + static_cast<long long>(d) * width;
    return element_address<S>(buffers, other[kRank], other[kDstBuf], other[kDstOff]);
}

__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

template <typename E, int Op>
__device__ __forceinline__ void combine_into(Pack& acc, const Pack& x) {
    using S = typename E::Storage;
    if constexpr (E::template kWordwise<Op>) {
#pragma unroll
        for (int w = 0; w < 4; ++w) acc.word[w] = E::template combine_word<Op>(acc.word[w], x.word[w]);
    } else {
#pragma unroll
        for (int i = 0; i < int(16 / sizeof(S)); ++i)
            set_lane<S>(acc, i, E::template combine<Op>(lane<S>(acc, i), lane<S>(x, i)));
    }
}

template <typename E>
__device__ __forceinline__ void divide_all(Pack& acc, int divisor) {
    using S = typename E::Storage;
#pragma unroll
    for (int i = 0; i < int(16 / sizeof(S)); ++i) set_lane<S>(acc, i, E::divide(lane<S>(acc, i), divisor));
}

// How a 16-byte pack `acc` folds. Where the accumulator is the storage type,
// in place: load and store do nothing, and the code is the pack's own.
template <typename E, bool kWide = (sizeof(typename E::Accumulator) > sizeof(typename E::Storage))>
struct PackFold {
    __device__ __forceinline__ void load(const Pack&) {}
    template <int Op>
    __device__ __forceinline__ void combine(Pack& acc, const Pack& x) { combine_into<E, Op>(acc, x); }
    __device__ __forceinline__ void divide(Pack& acc, int divisor) { divide_all<E>(acc, divisor); }
    __device__ __forceinline__ void store(Pack&) {}
};

// Where it is wider (float for the 16-bit floats), in one accumulator per
// lane beside the pack, which store overwrites with the rounded results:
// 8 float registers for a pack of 8 halves, on top of the pack's 4.
template <typename E>
struct PackFold<E, true> {
    using S = typename E::Storage;
    static constexpr int kLanes = 16 / sizeof(S);
    typename E::Accumulator lanes[kLanes];

    __device__ __forceinline__ void load(const Pack& acc) {
#pragma unroll
        for (int i = 0; i < kLanes; ++i) lanes[i] = E::load(lane<S>(acc, i));
    }
    template <int Op>
    __device__ __forceinline__ void combine(Pack&, const Pack& x) {
#pragma unroll
        for (int i = 0; i < kLanes; ++i) lanes[i] = E::template combine<Op>(lanes[i], E::load(lane<S>(x, i)));
    }
    __device__ __forceinline__ void divide(Pack&, int divisor) {
#pragma unroll
        for (int i = 0; i < kLanes; ++i) lanes[i] = E::divide(lanes[i], divisor);
    }
    // The loop is spelled as combine_into's, which tests/test_kernels.py
    // breaks on purpose (one lane dropped) to see the comparison fail.
    __device__ __forceinline__ void store(Pack& acc) {
#pragma unroll
        for (int i = 0; i < int(16 / sizeof(S)); ++i)
            set_lane<S>(acc, i, E::store(lanes[i]));
    }
};

// The table of addresses is a kernel parameter, passed by value on the GPU
// (2 KiB of its parameter space). The emulation calls this function once per
// (block, thread) and takes it by reference (emulation/cuda_host.h): by
// value, copying it was nine tenths of a small launch's time there.
#ifndef COLLECTIVES_BUFFER_TABLE_PARAMETER
#define COLLECTIVES_BUFFER_TABLE_PARAMETER BufferTable
#endif

template <typename E, int Op>
__global__ void __launch_bounds__(kStepThreads, kStepMinBlocks)
plan_step(const long long* __restrict__ table, int width, COLLECTIVES_BUFFER_TABLE_PARAMETER buffers, int divisor,
          int fanout) {
    using S = typename E::Storage;
    using A = typename E::Accumulator;
    constexpr long long kLanes = 16 / sizeof(S);

    const long long* row = table + static_cast<long long>(blockIdx.y) * fanout * width;
    const long long count = row[kCount];
    const int nsrc = static_cast<int>(row[kNumSrc]);
    // avg folds as a sum; no other op ever divides, so its instances carry
    // no division code (which costs registers, and a call for 64-bit types).
    const bool divides = Op == kSum && row[kKind] == kReduceFinal && divisor > 0;
    const S* first = source<S>(row, buffers, 0);
    const S* second = nsrc > 1 ? source<S>(row, buffers, 1) : first;

    // Destinations are read from the table where they are stored to, not
    // kept in registers through the fold (the 16-bit sums would spill).
    bool vectorized = aligned16(first) && aligned16(second);
    for (int s = 2; s < nsrc; ++s) vectorized = vectorized && aligned16(source<S>(row, buffers, s));
    for (int d = 0; d < fanout; ++d) vectorized = vectorized && aligned16(destination<S>(row, width, buffers, d));

    const long long thread = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const long long threads = static_cast<long long>(gridDim.x) * blockDim.x;
    long long scalar_start = 0;

    if (vectorized) {
        const long long packs = count / kLanes;
        const Pack* first_packs = reinterpret_cast<const Pack*>(first);
        const Pack* second_packs = reinterpret_cast<const Pack*>(second);
        for (long long base = thread; base < packs; base += threads * kUnroll) {
            Pack acc[kUnroll];
            PackFold<E> fold[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const long long p = base + u * threads;
                if (p < packs) acc[u] = first_packs[p];
            }
            if (nsrc > 1) {
#pragma unroll
                for (int u = 0; u < kUnroll; ++u) {
                    const long long p = base + u * threads;
                    if (p < packs) {
                        fold[u].load(acc[u]);
                        fold[u].template combine<Op>(acc[u], second_packs[p]);
                    }
                }
                for (int s = 2; s < nsrc; ++s) {
                    const Pack* more = reinterpret_cast<const Pack*>(source<S>(row, buffers, s));
#pragma unroll
                    for (int u = 0; u < kUnroll; ++u) {
                        const long long p = base + u * threads;
                        if (p < packs) fold[u].template combine<Op>(acc[u], more[p]);
                    }
                }
                if (divides) {
#pragma unroll
                    for (int u = 0; u < kUnroll; ++u)
                        if (base + u * threads < packs) fold[u].divide(acc[u], divisor);
                }
            }
            if (nsrc > 1) {
#pragma unroll
                for (int u = 0; u < kUnroll; ++u)
                    if (base + u * threads < packs) fold[u].store(acc[u]);  // the fold's one rounding
            }
            // Every destination of the group (one without fan-out) gets the same packs.
            for (int d = 0; d < fanout; ++d) {
                Pack* out = reinterpret_cast<Pack*>(destination<S>(row, width, buffers, d));
#pragma unroll
                for (int u = 0; u < kUnroll; ++u) {
                    const long long p = base + u * threads;
                    if (p < packs) out[p] = acc[u];
                }
            }
        }
        scalar_start = packs * kLanes;
    }

    for (long long i = scalar_start + thread; i < count; i += threads) {
        S acc = first[i];  // a copy moves the bits as they are, NaN payloads too
        if (nsrc > 1) {
            A folded = E::template combine<Op>(E::load(acc), E::load(second[i]));
            for (int s = 2; s < nsrc; ++s)
                folded = E::template combine<Op>(folded, E::load(source<S>(row, buffers, s)[i]));
            if (divides) folded = E::divide(folded, divisor);
            acc = E::store(folded);
        }
        for (int d = 0; d < fanout; ++d) destination<S>(row, width, buffers, d)[i] = acc;
    }
}

}  // namespace collectives
