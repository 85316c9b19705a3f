// The batched copy kernel: one launch copies every row of a table, wherever
// its source and destination lie. Tensor fusion packs many user arrays into
// one fusion buffer and unpacks them with one launch each way, whatever the
// number of arrays.
//
// A row is three int64 (collectives/kernels.py: copy_table builds them):
//
//     SRC DST NBYTES          byte addresses in device memory, byte count
//
// No row's destination may overlap its own source or any other row's source
// or destination (rows may share sources: reading the same bytes twice is
// harmless). Blocks run in no particular order on a GPU, so such an overlap
// would give an order-dependent result (and the emulation one fixed order).
//
// Grid: blockIdx.y walks the rows (row y, y + gridDim.y, ...: gridDim.y is
// at most 65535, a table may have more rows), blockIdx.x and threadIdx.x
// stride over the row's bytes. Why rows x blocks and not one flat index over
// all bytes: a flat index needs each block to find its row, which means a
// prefix sum over the row lengths, stored in the table or computed by
// cooperating threads; the 2-D grid needs neither. Its weakness, one long row
// among many short ones getting as few blocks as they do, is taken away on
// the host: copy_table splits rows longer than COPY_ROW_BYTES, as apex's
// multi_tensor_apply splits tensors into chunks. A block with no share of a
// row (the row is shorter than the grid is wide) reads it and moves on.
//
// Every thread's work depends only on its indices: no shared memory,
// barriers, shuffles or atomics. That makes running each (block, thread) one
// after another on the CPU exact (emulation/).
//
// Memory access: a row moves in words of W bytes, W the widest of 16, 8, 4,
// 2, 1 with src = dst (mod W), so that both are W-aligned at the same
// offset: the bytes before that offset (the head, < W) and after the last
// whole word (the tail, < W) go one byte at a time. Source and destination
// 16-byte aligned (what allocators give, and the fusion buffer's layout
// keeps) is the common case: 16-byte words, 128-bit loads and stores, no
// head, and a byte tail only when the length is not a multiple of 16.

// Words each thread keeps in flight per loop iteration; results do not
// depend on it. A copy has no arithmetic to hide latency behind: bytes in
// flight are what reach bandwidth. With unroll 1, 2 and 4 nvcc 13.5 uses 32,
// 48 and 64 registers; at 4 (so 4 blocks, 1024 threads and 64 KiB of loads
// in flight per multiprocessor) that is several times what Little's law
// asks of HBM (about 3 TB/s x 700 ns / 132 SMs: 16 KiB). Not yet measured
// on a GPU: CudaDevice(defines=...) compiles variants for a comparison
// against a device copy, as bench/gpu_check.py does for plan_step.
#ifndef COLLECTIVES_COPY_UNROLL
#define COLLECTIVES_COPY_UNROLL 4
#endif

// Blocks of kCopyThreads that must fit on one multiprocessor at once: caps
// registers at 64, what unroll 4 uses, so a compiler that wanted more would
// show up as spills in kernels/check.py rather than as lost occupancy.
// (8, a cap of 32, spills 128+ bytes with unroll 4.)
#ifndef COLLECTIVES_COPY_MIN_BLOCKS
#define COLLECTIVES_COPY_MIN_BLOCKS 4
#endif

// Loads through a pointer read from a table compile to generic LD.E instead
// of global LDG.E unless the compiler knows the space. plan_step.cu defines
// the same macro, token for token (a redefinition the preprocessor allows);
// the guard lets this file also be compiled alone (NVRTC) or first.
#ifndef COLLECTIVES_ASSUME_GLOBAL
#if defined(__CUDA_ARCH__)
#define COLLECTIVES_ASSUME_GLOBAL(p) __builtin_assume(__isGlobal(p))
#else
#define COLLECTIVES_ASSUME_GLOBAL(p) ((void)0)
#endif
#endif

namespace collectives {

constexpr int kCopyThreads = 256;  // threads per block (collectives/kernels.py: COPY_THREADS)
constexpr int kCopyColumns = 3;    // int64 per row (kernels.py: COPY_COLUMNS)
constexpr int kCopyUnroll = COLLECTIVES_COPY_UNROLL;
constexpr int kCopyMinBlocks = COLLECTIVES_COPY_MIN_BLOCKS;

// Table columns, as in collectives/kernels.py (COPY_SRC, COPY_DST, COPY_NBYTES).
enum CopyColumn { kCopySrc = 0, kCopyDst = 1, kCopyBytes = 2 };

// A word of W bytes. uint4 is CUDA's 16-byte aligned vector type: its loads
// and stores are single 128-bit instructions (LDG.E.128, STG.E.128).
template <int W> struct Word;
template <> struct Word<16> { using type = uint4; };
template <> struct Word<8> { using type = unsigned long long; };
template <> struct Word<4> { using type = unsigned int; };
template <> struct Word<2> { using type = unsigned short; };
template <> struct Word<1> { using type = unsigned char; };

// Copies nbytes from src to dst, src = dst (mod W); this thread's share of
// `threads` threads is every threads-th byte of the head and the tail and
// every threads-th word in between.
template <int W>
__device__ __forceinline__ void copy_span(const unsigned char* src, unsigned char* dst, long long nbytes,
                                          long long thread, long long threads) {
    using T = typename Word<W>::type;
    // Bytes up to the first W-aligned address of dst (of src too, as they
    // agree modulo W), never more than the row.
    long long head = static_cast<long long>((0ull - reinterpret_cast<unsigned long long>(dst)) & (W - 1));
    if (head > nbytes) head = nbytes;
    const long long words = (nbytes - head) / W;
    const long long tail = head + words * W;

    for (long long i = thread; i < head; i += threads) dst[i] = src[i];

    const T* from = reinterpret_cast<const T*>(src + head);
    T* to = reinterpret_cast<T*>(dst + head);
    for (long long base = thread; base < words; base += threads * kCopyUnroll) {
        // All loads first, then all stores: kCopyUnroll loads in flight.
        T word[kCopyUnroll];
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
            const long long w = base + u * threads;
            if (w < words) word[u] = from[w];
        }
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
            const long long w = base + u * threads;
            if (w < words) to[w] = word[u];
        }
    }

    for (long long i = tail + thread; i < nbytes; i += threads) dst[i] = src[i];
}

__global__ void __launch_bounds__(kCopyThreads, kCopyMinBlocks)
batched_copy(const long long* __restrict__ table, int rows) {
    const long long thread = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const long long threads = static_cast<long long>(gridDim.x) * blockDim.x;

    for (long long r = blockIdx.y; r < rows; r += gridDim.y) {
        const long long* row = table + r * kCopyColumns;
        const unsigned char* src = reinterpret_cast<const unsigned char*>(row[kCopySrc]);
        unsigned char* dst = reinterpret_cast<unsigned char*>(row[kCopyDst]);
        COLLECTIVES_ASSUME_GLOBAL(src);
        COLLECTIVES_ASSUME_GLOBAL(dst);
        const long long nbytes = row[kCopyBytes];
        // The low bits in which src and dst differ decide the word width.
        const unsigned long long skew =
            (reinterpret_cast<unsigned long long>(src) ^ reinterpret_cast<unsigned long long>(dst)) & 15ull;
        if (skew == 0)
            copy_span<16>(src, dst, nbytes, thread, threads);
        else if ((skew & 7ull) == 0)
            copy_span<8>(src, dst, nbytes, thread, threads);
        else if ((skew & 3ull) == 0)
            copy_span<4>(src, dst, nbytes, thread, threads);
        else if ((skew & 1ull) == 0)
            copy_span<2>(src, dst, nbytes, thread, threads);
        else
            copy_span<1>(src, dst, nbytes, thread, threads);
    }
}

}  // namespace collectives
