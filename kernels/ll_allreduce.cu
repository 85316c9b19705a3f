// One-shot allreduce of a small message between ranks in separate processes,
// with no host in the loop: the kernel itself waits for its peers' data.
//
// NCCL's LL ("low latency") protocol is the model. Every rank owns an LL
// area (device memory its peers map through CUDA IPC) of 2 slot sets x
// kLLLines lines of 16 bytes. A line carries 8 bytes of payload as two
// 64-bit words, each {32 bits of data, 32-bit flag}:
//
//     word 0 = flag << 32 | payload bytes 0..3
//     word 1 = flag << 32 | payload bytes 4..7
//
// written with one 16-byte store (st.volatile.global.v2.u64). PTX's memory
// model treats a vector access as scalar accesses to its elements (in no
// particular order), and a scalar access of up to 64 aligned bits as one
// (volatile: relaxed, system scope), so each 64-bit word, not the whole
// line, is seen whole or not at all: a reader that sees this call's
// flag in a word sees the data of that same word: no fence between data and
// flag, and no separate flag location a reader could see before the data.
// The reader checks the flag of both words. (NCCL's LL pairs 32-bit data and
// flag fields in one v4.u32 store and relies on 8-byte granularity in
// practice; 64-bit elements make that guarantee an architectural one.)
//
// Call number g = 1, 2, ... (the generation: the host counts LL calls, the
// same on every rank, and passes g; nothing is read back) uses slot set
// g % 2 and flag F(g) = (g mod 2^16) << 16 | the call's signature (16 bits
// of a hash of count, dtype and op, also from the host). Thread t of every
// rank handles the same lines i = t, t + T, ... (T threads in the grid,
// equal on all ranks), so a thread only ever waits for the same thread of
// its peers:
//
//   1. (g >= 2) wait until every peer's line (t mod prev_lines) of set
//      (g - 1) % 2 carries flag F(g - 1)                  (ld.acquire.sys)
//   2. for each of its lines i: store line i of its own set g % 2 with
//      (input word i, F(g))                                (16-byte store)
//   3. for each of its lines i: for q = 0 .. n - 1 in rank order, spin on
//      line i of q's set g % 2 until both flags equal F(g), fold the word
//      in; write output word i                             (plain stores)
//
// A line whose flag has g's generation half but another signature is a
// peer making a different call as its call g: the thread records a
// mismatch naming it and stops at once (the host raises InvalidUsageError),
// instead of reading a call of another size or type, or waiting out the
// timeout. (A different call with the same 16-bit signature goes unseen:
// one in 65536.)
//
// Every rank folds the same words in the same order (0, 1, .., n - 1), one
// accumulator per element, rounded once: the fold of the `direct` plan's one
// REDUCE_FINAL row (elements.cuh), so every rank holds the bits the NumPy
// interpreter gives. No __syncthreads, no shuffles, no waits between blocks
// of one rank: each (block, thread) depends only on the same (block,
// thread) of its peers, which is why running the threads of a grid one
// after another (the emulated device) is exact while the ranks themselves
// run concurrently in their processes.
//
// Why step 3 never reads a stale or a later call's line: set g % 2 holds
// calls g - 2, g, g + 2, ...; flags are compared for equality with g, and a
// rank writes call g + 2 only after step 1 of g + 2 saw this reader's line
// of call g + 1 in the other set, i.e. after this reader finished call g
// (stream order, below). The generation half wraps after 2^16 calls; only
// equality is ever tested, and a set's old lines carry g - 2, never equal
// to g modulo 2^16.
//
// Why overwriting set g % 2 in step 2 is safe (the slot-reuse argument):
// the set's previous contents (call g - 2) are read only by the peers'
// calls g - 2. A peer p that has stored any line of its call g - 1 has
// finished its call g - 2 entirely: p's kernels run in stream order (the
// executor orders a call after the previous one even across streams), and
// a kernel's loads are all performed before the next kernel on the stream
// starts. Step 1 sees such a line with an acquire load, so every load of
// p's call g - 2 happens before this thread's stores of call g. The line
// looked at, t mod prev_lines, exists in call g - 1 whatever the sizes of
// the two calls (prev_lines >= 1: the host never counts an empty call).
// Given stream order on this rank too, step 1 is already satisfied when it
// runs: this rank's call g - 1 read every line of every peer's call g - 1,
// so those flags were g - 1, and no peer can move on to g + 1 in that set
// before this rank's call g writes its own lines. So step 1 costs n - 1
// loads that succeed at once; it is kept because it turns a broken
// precondition (calls overlapping on two streams, ranks out of step) into
// a timeout instead of silently wrong data, and because it is the ordering
// the argument above needs on paper (an acquire, not a control dependency).
//
// Memory order and scope. Lines are written and polled with volatile
// 16-byte accesses, which PTX treats as relaxed at system scope: enough for
// step 3, because the data rides in the flag's own atomic word. The step 1
// load is ld.acquire.sys. `.sys` because peers may run on other GPUs; ranks
// sharing one GPU would do with `.gpu`, but the cost is the same for loads
// that hit. Peer lines are never read through the non-coherent path
// (__ldg / const __restrict__): they change while the kernel runs.
//
// Timeouts: a thread that spins on a peer polls the clock and the abort
// words every kLLCheckEvery polls (after kLLSpinPolls tight polls, with a
// growing __nanosleep in between). At `timeout_ns` after its wait began
// (%globaltimer on the GPU, a steady clock on the emulated device) it
// stores a fault code {timed out, the peer it waited for, g} in its rank's
// fault word and returns. A thread that sees any rank's fault word, or the
// communicator's abort flag (set by a host: a dead peer, a failed call),
// records {stopped, whose fault} (if its own word is still clear) and
// returns. Fault words and the abort flag live in the control segment
// (host shared memory, mapped into the GPU's address space), so hosts read
// them without a CUDA call: at the next call or synchronize() they raise
// CollectiveTimeoutError, RankFailedError or InvalidUsageError naming the
// peer (collectives/executors/ll_allreduce.py). The output of a failed call
// is undefined, and the communicator is aborted.
//
// Preconditions: every rank makes the same LL calls in the same order (a
// different one is caught by its signature, above); a rank's calls run in
// stream order; all ranks' grids are resident at once (a thread spins for
// a thread of another process; several processes on one GPU need MPS).

#include "elements.cuh"

namespace collectives {

constexpr int kLLThreads = 256;            // threads per block on a GPU (kernels.py: LL_THREADS)
constexpr int kLLMaxRanks = 64;            // ranks whose areas the arguments name (kernels.py: LL_MAX_RANKS)
constexpr long long kLLMaxBytes = 64 << 10;   // payload per call (kernels.py: LL_MAX_BYTES)
constexpr long long kLLLines = kLLMaxBytes / 8;  // lines per slot set: 8 payload bytes each
constexpr int kLLLineWords = 2;            // 64-bit words per line
constexpr int kLLSlotSets = 2;             // calls alternate between them
constexpr int kLLSpinPolls = 64;           // polls before the first clock read and sleep
constexpr int kLLCheckEvery = 16;          // polls between clock and abort checks after that
constexpr unsigned kLLMaxSleepNs = 1024;

// The fault words, in the control segment (transport/layout.py: the LL
// region, LL_REGION_WORDS int64 per rank, the fault word first).
constexpr int kLLRegionWords = 16;
enum LLFault { kLLTimedOut = 1, kLLStopped = 2, kLLMismatch = 3 };

struct LLAllreduceArgs {
    const void* input;                      // this rank's count elements
    void* output;                           // may be the input
    long long count;                        // elements; count * size <= kLLMaxBytes
    long long prev_lines;                   // lines of call g - 1 (>= 1 when g >= 2)
    unsigned long long generation;          // g >= 1, counted by the host
    unsigned long long timeout_ns;          // how long one wait may last
    const unsigned long long* abort_word;   // the communicator's abort flag (nonzero: stop)
    unsigned long long* faults;             // rank q's fault word: faults[q * kLLRegionWords]
    int rank;
    int nranks;
    int divisor;                            // avg: nranks; else 0
    unsigned flag;                          // F(g): (g mod 2^16) << 16 | this call's signature
    unsigned prev_flag;                     // F(g - 1), of the previous call
    int pad;
    unsigned long long areas[kLLMaxRanks];  // every rank's LL area, mapped in this process
};

// System-scope accesses. On the GPU, PTX; on the emulated device,
// kernels/emulation/cuda_host.h defines the same functions with GCC's
// __atomic builtins on the shared mapping.
#if defined(__CUDACC__)
__device__ __forceinline__ void sys_store_line(unsigned long long* line, unsigned long long w0,
                                               unsigned long long w1) {
    asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(line), "l"(w0), "l"(w1) : "memory");
}
__device__ __forceinline__ void sys_load_line(const unsigned long long* line, unsigned long long& w0,
                                              unsigned long long& w1) {
    asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(w0), "=l"(w1) : "l"(line) : "memory");
}
__device__ __forceinline__ unsigned long long sys_load_acquire(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ unsigned long long sys_load_relaxed(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void sys_store_relaxed(unsigned long long* p, unsigned long long v) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned long long clock_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
#endif

__device__ __forceinline__ unsigned long long* ll_line(unsigned long long area, int set, long long i) {
    return reinterpret_cast<unsigned long long*>(area) + (set * kLLLines + i) * kLLLineWords;
}

__device__ __forceinline__ bool has_flag(unsigned long long w0, unsigned long long w1, unsigned flag) {
    return static_cast<unsigned>(w0 >> 32) == flag && static_cast<unsigned>(w1 >> 32) == flag;
}

// A word of this call's generation but another call's signature: the
// owner makes a different call as its call g. (A word with this call's
// whole flag is no such thing: the line's other word may just lag.)
__device__ __forceinline__ bool other_call(unsigned long long word, unsigned flag) {
    const unsigned seen = static_cast<unsigned>(word >> 32);
    return seen != flag && seen >> 16 == flag >> 16;
}

// One thread's waits: tight polls first, then sleeps that grow, with the
// clock and every rank's abort words looked at every kLLCheckEvery polls.
struct LLWatch {
    const LLAllreduceArgs& args;
    unsigned long long started;
    unsigned polls;
    unsigned sleep_ns;

    __device__ explicit LLWatch(const LLAllreduceArgs& a) : args(a), started(0), polls(0), sleep_ns(32) {}

    __device__ void record(unsigned long long reason, int whom) {
        unsigned long long* mine = args.faults + static_cast<long long>(args.rank) * kLLRegionWords;
        // A stop only says why when nothing was said: a timeout's peer is the news.
        if (reason == kLLStopped && sys_load_relaxed(mine) != 0) return;
        sys_store_relaxed(mine, reason | (static_cast<unsigned long long>(whom + 1) & 0xffffu) << 8 |
                                    (args.generation & 0xffffffffull) << 32);
    }

    // False when the wait must end: `peer` is the rank waited for.
    __device__ bool keep_waiting(int peer) {
        ++polls;
        if (polls < kLLSpinPolls) return true;
        if (polls % kLLCheckEvery == 0 || started == 0) {
            if (sys_load_relaxed(args.abort_word) != 0) {
                record(kLLStopped, -1);
                return false;
            }
            for (int q = 0; q < args.nranks; ++q) {
                if (sys_load_relaxed(args.faults + static_cast<long long>(q) * kLLRegionWords) != 0) {
                    record(kLLStopped, q);
                    return false;
                }
            }
            const unsigned long long now = clock_ns();
            if (started == 0) {
                started = now;
            } else if (now - started > args.timeout_ns) {
                record(kLLTimedOut, peer);
                return false;
            }
        }
        __nanosleep(sleep_ns);
        sleep_ns = sleep_ns < kLLMaxSleepNs ? 2 * sleep_ns : kLLMaxSleepNs;
        return true;
    }

    // Wait for line i of `rank`'s set; its two words come back in w0, w1.
    __device__ bool line(int rank, int set, long long i, unsigned flag, unsigned long long& w0,
                         unsigned long long& w1) {
        const unsigned long long* p = ll_line(args.areas[rank], set, i);
        for (;;) {
            sys_load_line(p, w0, w1);
            if (has_flag(w0, w1, flag)) return true;
            if (other_call(w0, flag) || other_call(w1, flag)) {
                record(kLLMismatch, rank);
                return false;
            }
            if (!keep_waiting(rank)) return false;
        }
    }

    // Wait, with an acquire, for the first word of line i to carry `flag`.
    __device__ bool acquire(int rank, int set, long long i, unsigned flag) {
        const unsigned long long* p = ll_line(args.areas[rank], set, i);
        while (static_cast<unsigned>(sys_load_acquire(p) >> 32) != flag) {
            if (!keep_waiting(rank)) return false;
        }
        return true;
    }
};

__device__ __forceinline__ bool aligned8(const void* p) {
    return (reinterpret_cast<unsigned long long>(p) & 7ull) == 0;
}

// Payload word i of `count` elements at p: bytes 8i .. 8i + 7, zero past the end.
template <typename S>
__device__ __forceinline__ unsigned long long load_word(const void* p, long long count, long long i) {
    constexpr int kLanes = 8 / sizeof(S);
    const S* elements = static_cast<const S*>(p) + i * kLanes;
    const long long left = count - i * kLanes;
    if (left >= kLanes && aligned8(elements)) return *reinterpret_cast<const unsigned long long*>(elements);
    unsigned long long word = 0;
#pragma unroll
    for (int l = 0; l < kLanes; ++l)
        if (l < left) word |= Bits<S>::to(elements[l]) << (8 * sizeof(S) * l);
    return word;
}

template <typename S>
__device__ __forceinline__ void store_word(void* p, long long count, long long i, unsigned long long word) {
    constexpr int kLanes = 8 / sizeof(S);
    S* elements = static_cast<S*>(p) + i * kLanes;
    const long long left = count - i * kLanes;
    if (left >= kLanes && aligned8(elements)) {
        *reinterpret_cast<unsigned long long*>(elements) = word;
        return;
    }
#pragma unroll
    for (int l = 0; l < kLanes; ++l)
        if (l < left) elements[l] = Bits<S>::from(word >> (8 * sizeof(S) * l));
}

template <typename E, int Op>
__global__ void __launch_bounds__(kLLThreads) ll_allreduce(const LLAllreduceArgs args) {
    using S = typename E::Storage;
    using A = typename E::Accumulator;
    constexpr int kLanes = 8 / sizeof(S);
    constexpr int kLaneBits = 8 * sizeof(S);
    const long long lines = (args.count + kLanes - 1) / kLanes;
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    const long long first = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (first >= lines) return;
    const unsigned flag = args.flag;
    const int set = static_cast<int>(args.generation % kLLSlotSets);
    LLWatch watch(args);

    // 1. The peers are done with this set (see the header: at once, in order).
    if (args.generation >= 2) {
        const long long probe = first % args.prev_lines;
        const int previous = static_cast<int>((args.generation - 1) % kLLSlotSets);
        for (int p = 0; p < args.nranks; ++p)
            if (p != args.rank && !watch.acquire(p, previous, probe, args.prev_flag)) return;
    }

    // 2. Publish this thread's lines.
    const unsigned long long tag = static_cast<unsigned long long>(flag) << 32;
    for (long long i = first; i < lines; i += stride) {
        const unsigned long long word = load_word<S>(args.input, args.count, i);
        sys_store_line(ll_line(args.areas[args.rank], set, i), tag | (word & 0xffffffffull), tag | (word >> 32));
    }

    // 3. Fold every rank's line i in rank order (this rank's own comes back at once).
    for (long long i = first; i < lines; i += stride) {
        A acc[kLanes];
        for (int q = 0; q < args.nranks; ++q) {
            unsigned long long w0, w1;
            if (!watch.line(q, set, i, flag, w0, w1)) return;
            const unsigned long long word = (w0 & 0xffffffffull) | (w1 << 32);
#pragma unroll
            for (int l = 0; l < kLanes; ++l) {
                const A x = E::load(Bits<S>::from(word >> (kLaneBits * l)));
                acc[l] = q == 0 ? x : E::template combine<Op>(acc[l], x);
            }
        }
        unsigned long long result = 0;
#pragma unroll
        for (int l = 0; l < kLanes; ++l) {
            const A value = args.divisor > 0 ? E::divide(acc[l], args.divisor) : acc[l];
            result |= Bits<S>::to(E::store(value)) << (kLaneBits * l);
        }
        store_word<S>(args.output, args.count, i, result);
    }
}

}  // namespace collectives
