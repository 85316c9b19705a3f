// The CPU side of the emulated device: a C entry point per kernel that runs
// its grid. Thread-independent kernels (plan_step, batched_copy) run every
// (block, thread) in turn; kernels whose threads exchange values (the
// codecs' warp shuffles) run the threads of each CUDA block as fibers that
// meet at every shuffle (walk_grid_cooperatively). Built and loaded on first
// use by collectives/devices/emulated.py:
//
//     g++ -std=c++17 -O2 -ffp-contract=off -fPIC -shared
//         -include kernels/emulation/cuda_host.h -I<CUDA include> launch.cpp
//
// Element and op numbers (plan_step) follow COLLECTIVES_FOR_EACH_ELEMENT and
// collectives::Op; collectives/kernels.py uses the same numbering.

#include <ucontext.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "../plan_step.cu"
#include "../batched_copy.cu"
#include "../codec.cu"

thread_local uint3 threadIdx;
thread_local uint3 blockIdx;
thread_local dim3 blockDim;
thread_local dim3 gridDim;

namespace {

using collectives::BufferTable;

// Every (block, thread) of a grid, one after another: exact, since the
// kernels are thread-independent.
template <typename Body>
void walk_grid(dim3 grid, dim3 block, Body body) {
    gridDim = grid;
    blockDim = block;
    for (unsigned y = 0; y < grid.y; ++y) {
        for (unsigned x = 0; x < grid.x; ++x) {
            blockIdx = uint3{x, y, 0};
            for (unsigned t = 0; t < block.x; ++t) {
                threadIdx = uint3{t, 0, 0};
                body();
            }
        }
    }
}

// -- fibers: the threads of one CUDA block, meeting at each shuffle ------------
//
// Each thread of the block runs on a fiber (ucontext) of its own; the
// scheduler resumes them in rounds, each fiber until its next shuffle or its
// end, so a round is a barrier for the whole block. At its k-th shuffle a
// thread deposits its value in slot k % 2 and yields; when it resumes (the
// next round), every thread of the block has deposited its k-th value, and
// none has yet deposited its (k+2)-th, which is the next write to that slot;
// so it reads its partner's slot k % 2 and goes on. A partner that has left
// the kernel or is at another shuffle (a warp that diverges at a shuffle,
// undefined on a GPU) stops the run with a message.

struct Fiber {
    ucontext_t context;
    unsigned long long deposit[2] = {0, 0};   // values offered at even and odd shuffles
    unsigned long long meetings = 0;          // shuffles entered so far
    bool done = false;
};

struct BlockRun {
    ucontext_t scheduler;
    std::vector<Fiber> fibers;
    unsigned current = 0;
    const std::function<void()>* body = nullptr;
};

thread_local BlockRun* running = nullptr;
constexpr std::size_t kFiberStack = 64 << 10;

// Fiber stacks, kept for the next launch on this OS thread (not zeroed:
// allocating and clearing them per launch cost more than the kernels).
char* fiber_stack(unsigned thread) {
    thread_local std::vector<std::unique_ptr<char[]>> stacks;
    while (stacks.size() <= thread) stacks.emplace_back(new char[kFiberStack]);
    return stacks[thread].get();
}

void fiber_entry() {
    (*running->body)();
    running->fibers[running->current].done = true;   // then uc_link: back to the scheduler
}

// Every (block, thread) of the grid, the threads of a block as fibers.
template <typename Body>
void walk_grid_cooperatively(dim3 grid, dim3 block, Body body) {
    const std::function<void()> call = body;
    BlockRun run;
    run.body = &call;
    run.fibers.resize(block.x);
    BlockRun* outer = running;
    running = &run;
    gridDim = grid;
    blockDim = block;
    for (unsigned y = 0; y < grid.y; ++y) {
        for (unsigned x = 0; x < grid.x; ++x) {
            blockIdx = uint3{x, y, 0};
            for (unsigned t = 0; t < block.x; ++t) {
                Fiber& fiber = run.fibers[t];
                fiber.done = false;
                fiber.meetings = 0;
                getcontext(&fiber.context);
                fiber.context.uc_stack.ss_sp = fiber_stack(t);
                fiber.context.uc_stack.ss_size = kFiberStack;
                fiber.context.uc_link = &run.scheduler;
                makecontext(&fiber.context, fiber_entry, 0);
            }
            for (bool live = true; live;) {   // one round: every fiber to its next shuffle or its end
                live = false;
                for (unsigned t = 0; t < block.x; ++t) {
                    if (run.fibers[t].done) continue;
                    run.current = t;
                    threadIdx = uint3{t, 0, 0};
                    swapcontext(&run.scheduler, &run.fibers[t].context);
                    live = live || !run.fibers[t].done;
                }
            }
        }
    }
    running = outer;
}

}  // namespace

unsigned long long shuffle_exchange(unsigned long long value, int source_lane) {
    if (running == nullptr) {
        std::fprintf(stderr, "emulated device: a shuffle outside a cooperative launch\n");
        std::abort();
    }
    const unsigned me = running->current;
    Fiber& self = running->fibers[me];
    const unsigned slot = self.meetings % 2;
    self.deposit[slot] = value;
    self.meetings += 1;
    swapcontext(&self.context, &running->scheduler);   // every thread of the block deposits
    const Fiber& partner = running->fibers[(me & ~31u) + static_cast<unsigned>(source_lane)];
    // The partner has entered this shuffle (and, if it has run this round, the next one at most).
    if (partner.meetings != self.meetings && !(partner.meetings == self.meetings + 1 && !partner.done)) {
        std::fprintf(stderr, "emulated device: thread %u shuffles with lane %d, which is not at the same shuffle "
                     "(a warp that diverges at a shuffle)\n", me, source_lane);
        std::abort();
    }
    return partner.deposit[slot];
}

namespace {

template <typename E, int Op>
void run_grid(dim3 grid, dim3 block, const long long* table, int width, const BufferTable& buffers, int divisor,
              int fanout) {
    walk_grid(grid, block, [&] { collectives::plan_step<E, Op>(table, width, buffers, divisor, fanout); });
}

template <typename E>
int run_for_op(int op, dim3 grid, dim3 block, const long long* table, int width, const BufferTable& buffers,
               int divisor, int fanout) {
    switch (op) {
        case collectives::kSum: run_grid<E, collectives::kSum>(grid, block, table, width, buffers, divisor, fanout); return 0;
        case collectives::kProd: run_grid<E, collectives::kProd>(grid, block, table, width, buffers, divisor, fanout); return 0;
        case collectives::kMax: run_grid<E, collectives::kMax>(grid, block, table, width, buffers, divisor, fanout); return 0;
        case collectives::kMin: run_grid<E, collectives::kMin>(grid, block, table, width, buffers, divisor, fanout); return 0;
        default: return -2;
    }
}

void run_copy_grid(dim3 grid, dim3 block, const long long* table, int rows) {
    walk_grid(grid, block, [&] { collectives::batched_copy(table, rows); });
}

template <int Codec, int Op>
void run_codec_grid(unsigned grid_x, unsigned block_x, const collectives::CodecArgs& args) {
    walk_grid_cooperatively(dim3(grid_x, 1, 1), dim3(block_x, 1, 1),
                            [&] { collectives::codec_kernel<Codec, Op>(args); });
}

template <int Codec>
void run_codec_batch_grid(unsigned grid_x, unsigned grid_y, unsigned block_x, const collectives::CodecBatch& batch) {
    walk_grid_cooperatively(dim3(grid_x, grid_y, 1), dim3(block_x, 1, 1),
                            [&] { collectives::codec_batch<Codec>(batch); });
}

template <int Codec>
void run_codec_round_sum_grid(unsigned grid_x, unsigned block_x, const collectives::CodecSumArgs& args) {
    walk_grid_cooperatively(dim3(grid_x, 1, 1), dim3(block_x, 1, 1),
                            [&] { collectives::codec_round_sum<Codec>(args); });
}

}  // namespace

extern "C" {

// Sizes the Python side checks before the first launch, so that a stale or
// mismatched build fails loudly instead of reading the wrong memory.
int collectives_emulated_max_ranks() { return collectives::kMaxRanks; }
int collectives_emulated_buffers() { return collectives::kBuffers; }
int collectives_emulated_copy_columns() { return collectives::kCopyColumns; }
int collectives_emulated_codec_args_size() { return static_cast<int>(sizeof(collectives::CodecArgs)); }
int collectives_emulated_codec_batch_size() { return static_cast<int>(sizeof(collectives::CodecBatch)); }
int collectives_emulated_codec_sum_args_size() { return static_cast<int>(sizeof(collectives::CodecSumArgs)); }

// Runs plan_step<element, op> over a grid_x * grid_y grid of block_x threads,
// grid_y groups of `fanout` rows. `addresses` holds max_ranks * buffers byte
// addresses (a BufferTable). Returns 0, or -1 for an unknown element, -2 for
// an unknown op, -3 for a fan-out below 1.
int collectives_emulated_plan_step(int element, int op, unsigned grid_x, unsigned grid_y, unsigned block_x,
                                   const long long* table, int width, const unsigned long long* addresses,
                                   int divisor, int fanout) {
    if (fanout < 1) return -3;
    BufferTable buffers;
    std::memcpy(buffers.address, addresses, sizeof buffers.address);
    const dim3 grid(grid_x, grid_y, 1), block(block_x, 1, 1);
    int index = 0;
#define COLLECTIVES_DISPATCH(Element)                                                                \
    if (element == index++)                                                                          \
        return run_for_op<collectives::Element>(op, grid, block, table, width, buffers, divisor, fanout);
    COLLECTIVES_FOR_EACH_ELEMENT(COLLECTIVES_DISPATCH)
#undef COLLECTIVES_DISPATCH
    return -1;
}

// Runs batched_copy over a grid_x * grid_y grid of block_x threads: every
// row (src, dst, nbytes) of the `rows`-row table is copied. Returns 0, or
// -1 for an empty grid (which CUDA refuses to launch too).
int collectives_emulated_batched_copy(unsigned grid_x, unsigned grid_y, unsigned block_x, const long long* table,
                                      int rows) {
    if (grid_x == 0 || grid_y == 0 || block_x == 0) return -1;
    run_copy_grid(dim3(grid_x, grid_y, 1), dim3(block_x, 1, 1), table, rows);
    return 0;
}

// Runs codec_kernel<codec, op> over a grid_x grid of block_x threads (whole
// warps). Returns 0, or -1 for an unknown codec or op, -2 for a grid CUDA
// would refuse.
int collectives_emulated_codec(int codec, int op, unsigned grid_x, unsigned block_x,
                               const collectives::CodecArgs* args) {
    if (grid_x == 0 || block_x == 0 || block_x % 32 || block_x > 1024) return -2;
#define COLLECTIVES_CODEC_DISPATCH(Codec, Op)                              \
    if (codec == Codec && op == Op) {                                      \
        run_codec_grid<Codec, Op>(grid_x, block_x, *args);                 \
        return 0;                                                          \
    }
    COLLECTIVES_FOR_EACH_CODEC_KERNEL(COLLECTIVES_CODEC_DISPATCH)
#undef COLLECTIVES_CODEC_DISPATCH
    return -1;
}

// Runs codec_batch<codec> over a grid_x * grid_y grid of block_x threads:
// grid row y runs the batch's row y. Returns 0, or -1 for an unknown codec,
// -2 for a grid CUDA would refuse or one with more rows than a batch holds.
int collectives_emulated_codec_batch(int codec, unsigned grid_x, unsigned grid_y, unsigned block_x,
                                     const collectives::CodecBatch* batch) {
    if (grid_x == 0 || grid_y == 0 || grid_y > collectives::kCodecBatchRows || block_x == 0 || block_x % 32 ||
        block_x > 1024)
        return -2;
#define COLLECTIVES_CODEC_BATCH_DISPATCH(Codec)                        \
    if (codec == Codec) {                                              \
        run_codec_batch_grid<Codec>(grid_x, grid_y, block_x, *batch);  \
        return 0;                                                      \
    }
    COLLECTIVES_FOR_EACH_CODEC(COLLECTIVES_CODEC_BATCH_DISPATCH)
#undef COLLECTIVES_CODEC_BATCH_DISPATCH
    return -1;
}

// Runs codec_round_sum<codec> over a grid_x grid of block_x threads.
// Returns 0, or -1 for an unknown codec, -2 for a grid CUDA would refuse.
int collectives_emulated_codec_round_sum(int codec, unsigned grid_x, unsigned block_x,
                                         const collectives::CodecSumArgs* args) {
    if (grid_x == 0 || block_x == 0 || block_x % 32 || block_x > 1024) return -2;
#define COLLECTIVES_CODEC_SUM_DISPATCH(Codec)                        \
    if (codec == Codec) {                                            \
        run_codec_round_sum_grid<Codec>(grid_x, block_x, *args);     \
        return 0;                                                    \
    }
    COLLECTIVES_FOR_EACH_CODEC(COLLECTIVES_CODEC_SUM_DISPATCH)
#undef COLLECTIVES_CODEC_SUM_DISPATCH
    return -1;
}

}  // extern "C"
