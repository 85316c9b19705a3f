// The emulated device's entry point for kernels/ll_allreduce.cu, built into
// the same library as launch.cpp (collectives/devices/emulated.py). Every
// (block, thread) of the grid runs in turn, which is exact: a thread waits
// only for the same thread of its peers, which run in their own processes.
// The grid must be the same on every call of a rank (the kernel's state
// words, one per thread: see its header); devices/emulated.py launches
// LL_BLOCKS x LL_THREADS always.

#include "../ll_allreduce.cu"

namespace {

using collectives::LLAllreduceArgs;

template <typename E, int Op>
void run_ll_grid(unsigned blocks, unsigned threads, const LLAllreduceArgs& args) {
    gridDim = dim3(blocks, 1, 1);
    blockDim = dim3(threads, 1, 1);
    for (unsigned b = 0; b < blocks; ++b) {
        blockIdx = uint3{b, 0, 0};
        for (unsigned t = 0; t < threads; ++t) {
            threadIdx = uint3{t, 0, 0};
            collectives::ll_allreduce<E, Op>(args);
        }
    }
}

template <typename E>
int run_ll_for_op(int op, unsigned blocks, unsigned threads, const LLAllreduceArgs& args) {
    switch (op) {
        case collectives::kSum: run_ll_grid<E, collectives::kSum>(blocks, threads, args); return 0;
        case collectives::kProd: run_ll_grid<E, collectives::kProd>(blocks, threads, args); return 0;
        case collectives::kMax: run_ll_grid<E, collectives::kMax>(blocks, threads, args); return 0;
        case collectives::kMin: run_ll_grid<E, collectives::kMin>(blocks, threads, args); return 0;
        default: return -2;
    }
}

}  // namespace

extern "C" {

// Sizes the Python side checks (collectives/kernels.py), so that a stale
// build fails loudly instead of addressing the wrong lines.
long long collectives_emulated_ll_layout(int what) {
    switch (what) {
        case 0: return collectives::kLLMaxBytes;
        case 1: return collectives::kLLMaxRanks;
        case 2: return collectives::kLLRegionWords;
        case 3: return sizeof(LLAllreduceArgs);
        case 4: return collectives::kLLStateSlots;
        case 5: return collectives::kLLThreads;
        case 6: return collectives::kLLBarrierOffset;
        default: return -1;
    }
}

// Runs ll_allreduce<element, op> over `blocks` x `threads`. Returns 0, or
// -1 for an unknown element, -2 for an unknown op, -3 for an empty grid or
// one with more threads than state words.
int collectives_emulated_ll_allreduce(int element, int op, unsigned blocks, unsigned threads,
                                      const LLAllreduceArgs* args) {
    if (blocks == 0 || threads == 0 ||
        static_cast<long long>(blocks) * threads > collectives::kLLStateSlots) return -3;
    int index = 0;
#define COLLECTIVES_DISPATCH(Element) \
    if (element == index++) return run_ll_for_op<collectives::Element>(op, blocks, threads, *args);
    COLLECTIVES_FOR_EACH_ELEMENT(COLLECTIVES_DISPATCH)
#undef COLLECTIVES_DISPATCH
    return -1;
}

// Runs ll_barrier: its one thread (a barrier of a call on symmetric memory).
int collectives_emulated_ll_barrier(const LLAllreduceArgs* args) {
    gridDim = dim3(1, 1, 1);
    blockDim = dim3(1, 1, 1);
    blockIdx = uint3{0, 0, 0};
    threadIdx = uint3{0, 0, 0};
    collectives::ll_barrier(*args);
    return 0;
}

}  // extern "C"
