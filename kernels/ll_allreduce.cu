// One-shot collectives of a small message between ranks in separate
// processes, with no host in the loop: the kernel itself waits for its
// peers' data. The allreduce is the model; the other four collectives are
// the same kernel with another last step (args.collective, below).
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
// Call number g = 1, 2, ... (the generation, the same on every rank because
// every rank makes the same calls) uses slot set g % 2 and flag
// F(g) = (g mod 2^16) << 16 | the call's signature (16 bits of a hash of the
// collective, count, dtype, op and root, an argument from the host). The
// kernel, not the host, counts g (the per-thread state, below), so a launch's
// arguments are the same every time the call is made: a CUDA graph replays
// it. What a rank publishes is its input cut into `chunks` chunks of
// args.count elements, chunk c on lines c * L .. c * L + L - 1 (L lines of
// 8 bytes per chunk): one chunk, but n for reduce_scatter, whose rank r
// reads chunk r of every rank. Thread t of every rank handles the same
// chunk lines j = t, t + T, ... (T threads in the grid, equal on all ranks;
// line j of every chunk), so a thread only ever waits for the same thread
// of its peers:
//
//   0. read and advance this thread's state word: g, F(g - 1), prev_lines
//   1. (a call before) wait until every peer's line (t mod prev_lines) of set
//      (g - 1) % 2 carries flag F(g - 1), or a flag of call g + 1
//                                                          (ld.acquire.sys)
//   2. for each of its j, each chunk c: store line c * L + j of its own set
//      g % 2 with (input word j of chunk c, F(g))          (16-byte store)
//   3. for each of its j: read what this rank needs of its peers' lines of
//      set g % 2, spinning on each until both flags equal F(g)  (plain stores)
//        allreduce       fold line j of q = 0 .. n - 1, in rank order;
//                        write output word j
//        reduce          the same on the root; the other ranks stop after 2
//        reduce_scatter  fold line r * L + j of every q, in rank order;
//                        write output word j (the rank's own block)
//        allgather       copy line j of every q to word j of output block q
//        broadcast       copy line j of the root to output word j
//
// The per-thread state: where g comes from. Each rank's LL area ends with
// kLLStateSlots 64-bit words, one per thread of the grid, zeroed with the
// area. Word t holds what thread t of this rank knows of its last call:
//
//     bits  0..31  g' (that call's generation; 0: no call yet)
//     bits 32..47  that call's signature (F(g') = (g' mod 2^16) << 16 | it)
//     bits 48..63  that call's lines per chunk, L' (>= 1; kLLLines < 2^16)
//
// Thread t reads its word first, takes g = g' + 1, F(g - 1) and
// prev_lines = L' from it, and writes (g, this call's signature, L) back at
// once, before anything that may return early. Invariant: at the start of a
// call, every word of the rank holds the rank's previous call. It holds
// because the word has one writer and one reader, the same thread t, in
// consecutive calls of the rank, which run in stream order (a kernel's
// stores are visible to the next kernel on its stream; the executor adds an
// event when the caller switches streams, also before a graph's replay,
// whose launches are in stream order too); and because every call is launched with the same grid
// (kLLGridBlocks x kLLThreads on a GPU, the emulated device's own fixed grid
// there), so that every thread runs, and writes its word, in every call,
// also a thread with no lines. (A grid that depended on the call's size, as
// the first version's did, would leave the words of the threads it did not
// run one call or more behind.) Plain loads and stores: no other thread or
// rank ever touches the word. The whole state is 32 bits of generation:
// F(g) needs g mod 2^16, the set g mod 2 (2^32 is even, so the sets keep
// alternating when g wraps), and "is there a call before" is L' != 0, not
// g >= 2, so the wrap after 2^32 calls is harmless. The host reads the
// generation only to report it: from the fault word (below), or from the
// words once the device is idle (tests: they must all agree).
//
// Every rank publishes every call, also where nobody reads its lines (a
// broadcast's other ranks, whose input is the output they will receive):
// step 1 of the next call looks at a line of every peer, and that line is
// the peer's word that it is done with the call before (below). (Line j of
// chunk c is stored by the thread that reads line j of every chunk: the
// same-thread rule holds for reduce_scatter's chunk r too.)
//
// A line whose flag has g's generation half but another signature is a
// peer making a different call as its call g: the thread records a
// mismatch naming it and stops at once (the host raises InvalidUsageError),
// instead of reading a call of another size or type, or waiting out the
// timeout. (A different call with the same 16-bit signature goes unseen:
// one in 65536.)
//
// Every reducing rank folds the same words in the same order (0, 1, ..,
// n - 1), one accumulator per element, rounded once: the fold of the `direct`
// plan's REDUCE_FINAL rows (elements.cuh), so every rank holds the bits the
// NumPy interpreter gives; copies are bits. No __syncthreads, no shuffles,
// no waits between blocks of one rank: each (block, thread) depends only on
// the same (block, thread) of its peers, which is why running the threads
// of a grid one after another (the emulated device) is exact while the
// ranks themselves run concurrently in their processes.
//
// Why step 3 never reads a stale or a later call's line: set g % 2 holds
// calls g - 2, g, g + 2, ...; flags are compared for equality with g, and a
// rank writes call g + 2 only after step 1 of g + 2 saw this reader's line
// of call g + 1 in the other set, i.e. after this reader finished call g
// (stream order, below). The generation half wraps after 2^16 calls and
// only equality is ever tested, so no line of a set may be 2^16 calls old
// (nor, for step 1's "call g + 1", 2^16 - 1): line i of set g % 2 holds
// the last call of that parity that had more than i lines, which could be
// any age, or never written (zero). The scrub bounds it: in the calls g
// with g mod kLLScrubPeriod < 2, one per set, every thread of the grid,
// after step 1, also overwrites the set's lines that the call does not
// publish with the flag of generation g - 2 and signature 0 (no call's
// signature is 0: kernels.ll_signature), so no line is ever more than
// kLLScrubPeriod + 2 < 2^15 calls old. Step 1 makes the scrub as safe as
// step 2's stores (below); no reader of this call reads those lines.
//
// Why overwriting set g % 2 in step 2 is safe (the slot-reuse argument):
// the set's previous contents (call g - 2) are read only by the peers'
// calls g - 2. A peer p that has stored any line of its call g - 1 has
// finished its call g - 2 entirely: p's kernels run in stream order (the
// executor orders a call after the previous one even across streams), and
// a kernel's loads are all performed before the next kernel on the stream
// starts. Step 1 sees such a line with an acquire load, so every load of
// p's call g - 2 happens before this thread's stores of call g. The line
// looked at, t mod prev_lines, exists in call g - 1 whatever the sizes and
// collectives of the two calls (prev_lines is L of call g - 1, and line
// t mod L of chunk 0 is published by every rank; prev_lines >= 1: the host
// never launches an empty call). Where this rank's call g - 1 read every peer
// (allreduce, reduce_scatter, allgather) and runs in stream order, step 1 is
// already satisfied when it runs: those flags were g - 1, and no peer can
// move on to g + 1 in that set before this rank's call g writes its own
// lines. So step 1 costs n - 1 loads that succeed at once; it is kept
// because it turns a broken precondition (calls overlapping on two streams,
// ranks out of step) into a timeout instead of silently wrong data, and
// because it is the ordering the argument above needs on paper (an acquire,
// not a control dependency). After a broadcast or a reduce, whose ranks
// read only the root (or nobody), it is a real wait, and a needed one
// (without it such a rank runs two calls ahead: tests/ll_protocol_model.py):
// for the peers to have published the previous call, which they do without
// waiting for anyone.
// And the line may already carry call g + 1 (same set): a peer that reads
// nobody in call g (a broadcast's root, a reduce's other ranks) may finish
// it, and store its call g + 1 over the line that this rank's later threads
// of call g have yet to look at. Such a line says more than F(g - 1) (the
// peer finished call g - 2 long ago), so step 1 takes it too. (Without it
// those threads would wait for F(g - 1) until the timeout.) Nothing newer
// can be there: call g + 3 would need this rank's lines of call g + 2.
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
// stores a fault code {timed out, the peer it waited for, the collective,
// g mod 2^32} in its rank's
// fault word and returns. A thread that sees any rank's fault word, or the
// communicator's abort flag (set by a host: a dead peer, a failed call),
// records {stopped, whose fault} (if its own word is still clear) and
// returns. Fault words and the abort flag live in the control segment
// (host shared memory, mapped into the GPU's address space), so hosts read
// them without a CUDA call: at the next call or synchronize() they raise
// CollectiveTimeoutError, RankFailedError or InvalidUsageError naming the
// peer (collectives/executors/ll_allreduce.py). The output of a failed call
// is undefined, and the communicator is aborted. A rank that reads nobody in
// a call (a reduce's other ranks) learns of a fault there at its next call,
// whose step 1 waits for the peers that stopped.
//
// Preconditions: every rank makes the same LL calls in the same order (a
// different one is caught by its signature, above), directly or by
// replaying a graph that holds them; a rank's calls run in stream order,
// each on the same grid; all ranks' grids are resident at once (a thread
// spins for a thread of another process; several processes on one GPU need
// MPS).

#include "elements.cuh"

namespace collectives {

constexpr int kLLThreads = 256;            // threads per block on a GPU (kernels.py: LL_THREADS)
constexpr int kLLGridBlocks = 32;          // blocks of every launch on a GPU (kernels.py: LL_GRID_BLOCKS)
constexpr int kLLStateSlots = kLLGridBlocks * kLLThreads;   // state words: one per thread of the grid
constexpr int kLLMaxRanks = 64;            // ranks whose areas the arguments name (kernels.py: LL_MAX_RANKS)
constexpr long long kLLMaxBytes = 64 << 10;   // payload per call (kernels.py: LL_MAX_BYTES)
constexpr long long kLLLines = kLLMaxBytes / 8;  // lines per slot set: 8 payload bytes each
constexpr int kLLLineWords = 2;            // 64-bit words per line
constexpr int kLLSlotSets = 2;             // calls alternate between them
constexpr unsigned kLLScrubPeriod = 1u << 14;   // calls between scrubs of a set's unpublished lines (header)
constexpr long long kLLStateOffset = kLLSlotSets * kLLLines * kLLLineWords;   // words: the state after the sets
constexpr long long kLLBarrierOffset = kLLStateOffset + kLLStateSlots;   // words: ll_barrier's word after the state
static_assert(kLLLines < (1 << 16), "a state word keeps a call's lines in 16 bits");
constexpr int kLLSpinPolls = 64;           // polls before the first clock read and sleep
constexpr int kLLCheckEvery = 16;          // polls between clock and abort checks after that
constexpr unsigned kLLMaxSleepNs = 1024;

// The fault words, in the control segment (transport/layout.py: the LL
// region, LL_REGION_WORDS int64 per rank, the fault word first).
constexpr int kLLRegionWords = 32;
enum LLFault { kLLTimedOut = 1, kLLStopped = 2, kLLMismatch = 3 };

// What a call computes (kernels.py: LL_COLLECTIVES, in this order).
enum LLCollective { kLLAllreduce = 0, kLLReduceScatter = 1, kLLAllgather = 2, kLLBroadcast = 3, kLLReduce = 4 };

// Nothing in it changes from one call of the same collective, arrays and
// sizes to the next: a captured launch is correct every time it is replayed.
struct LLAllreduceArgs {
    const void* input;                      // this rank's chunks (n for reduce_scatter, else 1)
    void* output;                           // may be the input (or hold it: see step 3)
    long long count;                        // elements of one chunk; chunks * lines <= kLLLines
    unsigned long long timeout_ns;          // how long one wait may last
    const unsigned long long* abort_word;   // the communicator's abort flag (nonzero: stop)
    unsigned long long* faults;             // rank q's fault word: faults[q * kLLRegionWords]
    int rank;
    int nranks;
    int divisor;                            // avg: nranks; else 0
    unsigned signature;                     // this call's 16 bits: F(g)'s low half
    int collective;                         // LLCollective
    int root;                               // broadcast and reduce: the rank sent from, or to
    unsigned long long areas[kLLMaxRanks];  // every rank's LL area, mapped in this process (its
                                            // own ends with its state words: kLLStateOffset)
};

// The state word of a call (see the header): generation, signature, lines.
__device__ __forceinline__ unsigned long long ll_state(unsigned generation, unsigned signature, long long lines) {
    return generation | static_cast<unsigned long long>(signature & 0xffffu) << 32 |
           static_cast<unsigned long long>(lines) << 48;
}

// F(g) of generation g and a signature.
__device__ __forceinline__ unsigned ll_flag(unsigned generation, unsigned signature) {
    return (generation & 0xffffu) << 16 | (signature & 0xffffu);
}

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
__device__ __forceinline__ void sys_store_release(unsigned long long* p, unsigned long long v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
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
    unsigned generation;                    // g, for the fault word
    unsigned long long started;
    unsigned polls;
    unsigned sleep_ns;

    __device__ LLWatch(const LLAllreduceArgs& a, unsigned g)
        : args(a), generation(g), started(0), polls(0), sleep_ns(32) {}

    __device__ void record(unsigned long long reason, int whom) {
        unsigned long long* mine = args.faults + static_cast<long long>(args.rank) * kLLRegionWords;
        // A stop only says why when nothing was said: a timeout's peer is the news.
        if (reason == kLLStopped && sys_load_relaxed(mine) != 0) return;
        sys_store_relaxed(mine, reason | (static_cast<unsigned long long>(whom + 1) & 0xffffu) << 8 |
                                    (static_cast<unsigned long long>(args.collective) & 0xffu) << 24 |
                                    static_cast<unsigned long long>(generation) << 32);
    }

    // Whether the communicator was aborted or any rank's kernel gave up
    // (recorded as this thread's reason to stop).
    __device__ bool stopped() {
        if (sys_load_relaxed(args.abort_word) != 0) {
            record(kLLStopped, -1);
            return true;
        }
        for (int q = 0; q < args.nranks; ++q) {
            if (sys_load_relaxed(args.faults + static_cast<long long>(q) * kLLRegionWords) != 0) {
                record(kLLStopped, q);
                return true;
            }
        }
        return false;
    }

    // False when the wait must end: `peer` is the rank waited for.
    __device__ bool keep_waiting(int peer) {
        ++polls;
        if (polls < kLLSpinPolls) return true;
        if (polls % kLLCheckEvery == 0 || started == 0) {
            if (stopped()) return false;
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

    // Wait for line i of `rank`'s set to carry `flag` in both words; its 8
    // payload bytes come back in `word`.
    __device__ bool payload(int rank, int set, long long i, unsigned flag, unsigned long long& word) {
        const unsigned long long* p = ll_line(args.areas[rank], set, i);
        for (;;) {
            unsigned long long w0, w1;
            sys_load_line(p, w0, w1);
            if (has_flag(w0, w1, flag)) {
                word = (w0 & 0xffffffffull) | (w1 << 32);
                return true;
            }
            if (other_call(w0, flag) || other_call(w1, flag)) {
                record(kLLMismatch, rank);
                return false;
            }
            if (!keep_waiting(rank)) return false;
        }
    }

    // Wait, with an acquire, until `rank`'s barrier word has reached `phase`
    // (ll_barrier, below); a word at `phase` with another signature is a
    // peer making a different call.
    __device__ bool reached(int rank, unsigned phase, unsigned signature) {
        const unsigned long long* p = reinterpret_cast<const unsigned long long*>(args.areas[rank]) + kLLBarrierOffset;
        for (;;) {
            const unsigned long long word = sys_load_acquire(p);
            const int ahead = static_cast<int>(static_cast<unsigned>(word) - phase);   // wraps with the count
            if (ahead == 0 && static_cast<unsigned>(word >> 32) != signature) {
                record(kLLMismatch, rank);
                return false;
            }
            if (ahead >= 0) return true;
            if (!keep_waiting(rank)) return false;
        }
    }

    // Wait, with an acquire, for the first word of line i to carry `flag`,
    // or any flag of generation `later` (mod 2^16): step 1's wait.
    __device__ bool acquire(int rank, int set, long long i, unsigned flag, unsigned later) {
        const unsigned long long* p = ll_line(args.areas[rank], set, i);
        for (;;) {
            const unsigned seen = static_cast<unsigned>(sys_load_acquire(p) >> 32);
            if (seen == flag || seen >> 16 == (later & 0xffffu)) return true;
            if (!keep_waiting(rank)) return false;
        }
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

// Chunk c of `count` elements at p.
template <typename S>
__device__ __forceinline__ const S* chunk_at(const void* p, long long c, long long count) {
    return static_cast<const S*>(p) + c * count;
}
template <typename S>
__device__ __forceinline__ S* chunk_at(void* p, long long c, long long count) {
    return static_cast<S*>(p) + c * count;
}

// At least one block per SM: all the occupancy a grid of at most 32 blocks
// needs. Without it ptxas holds some instances to a register count that
// makes them spill (kernels/check.py finds it).
template <typename E, int Op>
__global__ void __launch_bounds__(kLLThreads, 1) ll_allreduce(const LLAllreduceArgs args) {
    using S = typename E::Storage;
    using A = typename E::Accumulator;
    constexpr int kLanes = 8 / sizeof(S);
    constexpr int kLaneBits = 8 * sizeof(S);
    const long long lines = (args.count + kLanes - 1) / kLanes;   // L: lines of one chunk
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    const long long first = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;

    // 0. This thread's state: its last call, then this one (see the header:
    // every thread of the fixed grid, before any return).
    unsigned long long* state = reinterpret_cast<unsigned long long*>(args.areas[args.rank]) + kLLStateOffset + first;
    const unsigned long long last = *state;
    const unsigned generation = static_cast<unsigned>(last) + 1;
    const long long prev_lines = static_cast<long long>(last >> 48);   // 0: no call before
    *state = ll_state(generation, args.signature, lines);
    const bool scrub = (generation & (kLLScrubPeriod - 1)) < static_cast<unsigned>(kLLSlotSets);
    if (first >= lines && !scrub) return;
    const unsigned flag = ll_flag(generation, args.signature);
    const int set = static_cast<int>(generation % kLLSlotSets);
    const int chunks = args.collective == kLLReduceScatter ? args.nranks : 1;
    LLWatch watch(args, generation);

    // 1. The peers are done with this set (see the header: at once, in order).
    if (prev_lines != 0) {
        const long long probe = first % prev_lines;
        const unsigned prev_flag = ll_flag(generation - 1, static_cast<unsigned>(last >> 32));
        const int previous = static_cast<int>((generation - 1) % kLLSlotSets);
        for (int p = 0; p < args.nranks; ++p)
            if (p != args.rank && !watch.acquire(p, previous, probe, prev_flag, generation + 1)) return;
    }

    // 1b. The scrub (see the header): the lines past what this call
    // publishes get an old flag, so none is ever 2^15 calls old.
    if (scrub) {
        const unsigned long long old_tag = static_cast<unsigned long long>(ll_flag(generation - kLLSlotSets, 0)) << 32;
        for (long long i = chunks * lines + first; i < kLLLines; i += stride)
            sys_store_line(ll_line(args.areas[args.rank], set, i), old_tag, old_tag);
        if (first >= lines) return;
    }

    // 2. Publish this thread's lines: its line j of every chunk.
    const unsigned long long tag = static_cast<unsigned long long>(flag) << 32;
    for (long long j = first; j < lines; j += stride) {
        for (int c = 0; c < chunks; ++c) {
            const long long i = c * lines + j;
            const unsigned long long word = load_word<S>(chunk_at<S>(args.input, c, args.count), args.count, j);
            sys_store_line(ll_line(args.areas[args.rank], set, i), tag | (word & 0xffffffffull), tag | (word >> 32));
        }
    }

    // 3. Read what this rank needs, rank by rank (its own lines come back
    // at once). A reducing collective folds the ranks' words in rank order
    // 0 .. n - 1, one accumulator per element, rounded once (avg divides at
    // the end): the `direct` plan's REDUCE_FINAL row. The output word j this
    // thread writes is its own: the only input word it overlaps in place is
    // word j of the same chunk, which step 2 has read.
    if (args.collective == kLLReduce && args.rank != args.root) return;   // only the root receives
    const bool reduces = args.collective != kLLAllgather && args.collective != kLLBroadcast;
    const int from = args.collective == kLLBroadcast ? args.root : 0;       // broadcast: the root only
    const int to = args.collective == kLLBroadcast ? args.root + 1 : args.nranks;
    const long long chunk = args.collective == kLLReduceScatter ? args.rank : 0;   // rank r's block: chunk r
    for (long long j = first; j < lines; j += stride) {
        if (!reduces) {   // allgather: rank q's chunk is block q; broadcast: the root's is the output
            for (int q = from; q < to; ++q) {
                unsigned long long word;
                if (!watch.payload(q, set, j, flag, word)) return;
                store_word<S>(chunk_at<S>(args.output, args.collective == kLLAllgather ? q : 0, args.count),
                              args.count, j, word);
            }
            continue;
        }
        A acc[kLanes];
        for (int q = 0; q < args.nranks; ++q) {
            unsigned long long word;
            if (!watch.payload(q, set, chunk * lines + j, flag, word)) return;
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
        store_word<S>(args.output, args.count, j, result);
    }
}

// The barrier of a call on symmetric memory (collectives/executors/
// symmetric.py), where every rank's step kernel reads its peers' inputs and
// writes their outputs directly, with no copy through a workspace. A call
// is three launches on the caller's stream:
//
//     ll_barrier   enter: every peer has reached this call, so its input
//                  holds the call's data and nothing of its still reads its
//                  output (its stream got here)
//     plan_step    this rank's share: fold chunk r of every rank's input,
//                  store it to every rank's output (collective by collective:
//                  symmetric.py)
//     ll_barrier   leave: every peer is done with this rank's input and
//                  output, so the caller's next work on its stream may
//                  write the one and read the other
//
// One thread, one 64-bit word per rank after its LL state words (zeroed
// with the area): bits 0..31 a count of barrier phases, bits 32..63 the
// call's 32-bit signature (a hash of the collective, sizes, dtype, op, root
// and the arrays' places in symmetric memory: symmetric.py). Phase 2g - 1
// enters call g, phase 2g leaves it. The thread reads its own word (its one
// writer: the rank's previous barrier, before it on the stream, as the LL
// state words), stores phase p = that + 1 with a release at system scope,
// after a system fence that puts the step kernel before it on the stream
// (its stores into peers' outputs, its loads of their inputs) ahead of the
// word; then waits, with acquires, until every peer's count is at least p.
// A peer's count is never more than p + 1: to store p + 2 it must have seen
// this rank's p + 1. So "at least p" is a signed difference of the 32-bit
// counts, which wrap harmlessly; a peer at exactly p with another
// signature made a different call (a mismatch, as the LL lines report it).
// A peer already at p + 1 compared its signature with this rank's p itself.
// Timeouts, the abort flag and the fault word are the LL kernel's (LLWatch).
//
// A barrier that gives up (a timeout, a mismatch, a fault or the abort flag
// seen) also disarms the step kernel queued behind it: it zeroes the
// args.count 64-bit words at args.output, that call's op table, so every
// row moves 0 elements and the step touches no one's arrays (a peer that
// never came, or made another call, keeps what it had). The communicator
// is aborted after any failure, so no later call runs that table again
// (and a barrier of a later call queued meanwhile gives up in turn: it
// sees the fault words). Nor does a barrier after a failure advance the
// phase (it looks at the fault words and the abort flag first): the leave
// barrier of a call whose enter barrier gave up would otherwise store p + 1,
// which a slower peer still waiting at p takes for a pass (found by the
// mismatch test: that peer's step then ran).
__global__ void __launch_bounds__(32, 1) ll_barrier(const LLAllreduceArgs args) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    unsigned long long* mine = reinterpret_cast<unsigned long long*>(args.areas[args.rank]) + kLLBarrierOffset;
    const unsigned phase = static_cast<unsigned>(sys_load_relaxed(mine)) + 1;
    LLWatch watch(args, (phase + 1) / 2);   // the call's number, for the fault word
    bool passed = !watch.stopped();   // after a failure no phase advances: a peer would take it for a pass
    if (passed) {
        __threadfence_system();
        sys_store_release(mine, phase | static_cast<unsigned long long>(args.signature) << 32);
        for (int p = 0; p < args.nranks && passed; ++p)
            passed = p == args.rank || watch.reached(p, phase, args.signature);
    }
    if (!passed) {
        long long* table = static_cast<long long*>(args.output);
        for (long long i = 0; i < args.count; ++i) table[i] = 0;
    }
}

}  // namespace collectives
