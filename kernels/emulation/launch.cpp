// The CPU side of the emulated device: a C entry point per kernel that runs
// every (block, thread) of a grid in turn. Built and loaded on first use by
// collectives/devices/emulated.py:
//
//     g++ -std=c++17 -O2 -ffp-contract=off -fPIC -shared
//         -include kernels/emulation/cuda_host.h -I<CUDA include> launch.cpp
//
// Element and op numbers (plan_step) follow COLLECTIVES_FOR_EACH_ELEMENT and
// collectives::Op; collectives/kernels.py uses the same numbering.

#include <cstring>

#include "../plan_step.cu"
#include "../batched_copy.cu"

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

}  // namespace

extern "C" {

// Sizes the Python side checks before the first launch, so that a stale or
// mismatched build fails loudly instead of reading the wrong memory.
int collectives_emulated_max_ranks() { return collectives::kMaxRanks; }
int collectives_emulated_buffers() { return collectives::kBuffers; }
int collectives_emulated_copy_columns() { return collectives::kCopyColumns; }

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

}  // extern "C"
