"""Tree: a binomial tree, partial sums climbing toward the root in log steps.

Ranks are numbered relative to the root: v = (r - root) mod n (allreduce
uses root 0). Let L = ceil(log2 n).

Reduce, steps k = 0 .. L-1:
    rank v with v mod 2^(k+1) == 2^k is folded into rank v - 2^k, which adds
    it after its own partial sum. Before step k each surviving rank holds the
    sum of its 2^k-wide subtree, so after L steps the root holds everything.

Broadcast, steps k = L-1 .. 0 (the same tree walked back down):
    rank v with v mod 2^(k+1) == 2^k copies from rank v - 2^k, which has held
    the data since an earlier step. The number of ranks holding it doubles.

Gather and scatter walk the same tree with blocks instead of the whole
buffer (block c is rank c's): in gather's step k each child v hands its
parent the blocks of its subtree, relative ranks v .. v + 2^k - 1, and in
scatter's step k (from L-1 down) each child v takes those blocks from its
parent. MPI's binomial gather and scatter: log steps, n - 1 blocks through
the root.

Allreduce is reduce toward rank 0, then broadcast from it: 2 ceil(log2 n)
steps. The sum is formed once, at the root, so every rank gets the same bits.
Each step moves the whole buffer, so the root reads L buffers (reduce) or
sends L (broadcast): few steps, but L N through the busiest rank.

Costs for n ranks and N bytes, L = ceil(log2 n) (busiest rank: the root):

    collective       steps    sent           moved
    allreduce        2L       L N            3L N
    reduce           L        N              3L N        (each non-root sends N once)
    broadcast        L        L N            2N          (each non-root copies N once)
    gather           L        S/n N          2(n-1)/n N  (S: the largest subtree below the root,
    scatter          L        (n-1)/n N      2S/n N       max over k < L of min(2^k, n - 2^k))
"""

from .schedule import (
    ALLREDUCE, BROADCAST, GATHER, NO_COSTS, REDUCE_TO_ROOT, SCATTER, WORK,
    Costs, Region, Schedule, copy, reduce,
)

TREE_COLLECTIVES = (ALLREDUCE, REDUCE_TO_ROOT, BROADCAST, GATHER, SCATTER)


def _levels(n):
    """ceil(log2 n), in exact integer arithmetic."""
    return (n - 1).bit_length()


def _children_at(k, n):
    """The relative ranks v < n with v mod 2^(k+1) == 2^k: at level k each
    meets its parent v - 2^k."""
    return range(2 ** k, n, 2 ** (k + 1))


def _buffer_of(n, root):
    """Relative rank -> its WORK buffer, the only one the tree uses."""
    return lambda v: Region((v + root) % n, WORK, 0)


def _reduce_phase(n, root):
    # A parent v - 2^k is never a child at level k, so it is written while
    # only its own children are read.
    at = _buffer_of(n, root)
    return [
        tuple(reduce([at(v - 2 ** k), at(v)], dst=at(v - 2 ** k)) for v in _children_at(k, n))
        for k in range(_levels(n))
    ]


def _broadcast_phase(n, root):
    # A parent v - 2^k is the root or a child of a higher level, so it holds
    # the data by level k; it is read, never written, at that level.
    at = _buffer_of(n, root)
    return [
        tuple(copy(at(v - 2 ** k), dst=at(v)) for v in _children_at(k, n))
        for k in reversed(range(_levels(n)))
    ]


def _subtree_blocks(v, k, n, root):
    """The blocks of relative rank v's subtree at level k: the chunks of
    relative ranks v .. v + 2^k - 1."""
    return [(u + root) % n for u in range(v, min(v + 2 ** k, n))]


def _gather_phase(n, root):
    # Before step k, v holds its subtree's blocks; a parent v - 2^k is not a
    # child at level k, so it is written while only children are read.
    def rank(v): return (v + root) % n
    return [
        tuple(copy(Region(rank(v), WORK, c), dst=Region(rank(v - 2 ** k), WORK, c))
              for v in _children_at(k, n) for c in _subtree_blocks(v, k, n, root))
        for k in range(_levels(n))
    ]


def _scatter_phase(n, root):
    # A parent v - 2^k has held its whole subtree's blocks since a higher level.
    def rank(v): return (v + root) % n
    return [
        tuple(copy(Region(rank(v - 2 ** k), WORK, c), dst=Region(rank(v), WORK, c))
              for v in _children_at(k, n) for c in _subtree_blocks(v, k, n, root))
        for k in reversed(range(_levels(n)))
    ]


def tree(collective, nranks, root=None):
    n = nranks
    if n == 1:
        return Schedule(collective, 1, 1, (), root=root)
    if collective == ALLREDUCE:
        steps = _reduce_phase(n, 0) + _broadcast_phase(n, 0)
    elif collective == REDUCE_TO_ROOT:
        steps = _reduce_phase(n, root)
    elif collective == BROADCAST:
        steps = _broadcast_phase(n, root)
    elif collective == GATHER:
        return Schedule(collective, n, n, tuple(_gather_phase(n, root)), root=root)
    elif collective == SCATTER:
        return Schedule(collective, n, n, tuple(_scatter_phase(n, root)), root=root)
    else:
        raise ValueError(f"tree has no schedule for {collective!r}")
    return Schedule(collective, n, 1, tuple(steps), root=root)


def tree_costs(collective, nranks, nbytes):
    """The table in the module doc."""
    n, N = nranks, nbytes
    if n == 1:
        return NO_COSTS
    L = _levels(n)
    S = max(min(2 ** k, n - 2 ** k) for k in range(L))
    return {
        ALLREDUCE: Costs(2 * L, L * N, 3 * L * N),
        REDUCE_TO_ROOT: Costs(L, N, 3 * L * N),
        BROADCAST: Costs(L, L * N, 2 * N),
        GATHER: Costs(L, S / n * N, 2 * (n - 1) / n * N),
        SCATTER: Costs(L, (n - 1) / n * N, 2 * S / n * N),
    }[collective]
