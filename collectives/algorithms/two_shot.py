"""Two-shot: reduce your own chunk from everyone, then gather everyone's.

The buffer is cut into n chunks; rank r owns chunk r. Two steps, whatever
the number of ranks:

    step 1  rank r reduces chunk r of all ranks, in rank order 0..n-1, into
            its SCRATCH: direct's reduce-scatter.
    step 2  rank r copies chunk q from every other rank q's SCRATCH: direct's
            allgather, on the reduced chunks. A reduce: the root alone
            gathers them (direct's gather).

This is the one-shot/two-shot pair GPU libraries switch between: one-shot
(`direct`) has every rank read all n buffers whole, in one step; two-shot
takes one more step, but each rank reads only 2(n-1)/n of the buffer from its
peers instead of (n-1) times it, so it wins once messages are no longer tiny.
Each chunk is reduced once, by its owner, in rank order, then copied, so every
rank gets the same bits.

Costs for n ranks and N bytes (every rank alike; a reduce of n sources moves
n+1 chunks, a copy 2):

    collective       steps    sent           moved
    allreduce        2        2(n-1)/n N     (3n-1)/n N
    reduce           2        N              (3n-1)/n N  (each rank folds a
                                                          chunk; the root copies
                                                          n-1 of them)
"""

from .schedule import ALLREDUCE, NO_COSTS, REDUCE_TO_ROOT, SCRATCH, WORK, Costs, Region, Schedule, copy, reduce

TWO_SHOT_COLLECTIVES = (ALLREDUCE, REDUCE_TO_ROOT)


def two_shot(collective, nranks, root=None):
    n = nranks
    if collective not in TWO_SHOT_COLLECTIVES:
        raise ValueError(f"two_shot has no schedule for {collective!r}")
    if n == 1:
        return Schedule(collective, 1, 1, (), root=root)
    every_rank = range(n)
    reduce_own_chunk = tuple(
        reduce([Region(q, WORK, r) for q in every_rank], dst=Region(r, SCRATCH, r)) for r in every_rank
    )
    receivers = every_rank if collective == ALLREDUCE else (root,)
    gather_reduced_chunks = tuple(
        copy(Region(q, SCRATCH, q), dst=Region(r, SCRATCH, q)) for r in receivers for q in every_rank if q != r
    )
    return Schedule(collective, n, n, (reduce_own_chunk, gather_reduced_chunks), result_buffer=SCRATCH,
                    root=None if collective == ALLREDUCE else root)


def two_shot_costs(collective, nranks, nbytes):
    """The table in the module doc."""
    n, N = nranks, nbytes
    if n == 1:
        return NO_COSTS
    return {
        ALLREDUCE: Costs(2, 2 * (n - 1) / n * N, (3 * n - 1) / n * N),
        REDUCE_TO_ROOT: Costs(2, N, (3 * n - 1) / n * N),
    }[collective]
