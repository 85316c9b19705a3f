"""Direct (one-shot): every rank reads what it needs straight from its peers.

One step, whatever the number of ranks:

* allreduce:      every rank reduces all ranks' buffers, in rank order 0..n-1,
                  into its SCRATCH. Same order everywhere, so same bits.
* reduce_scatter: rank r reduces chunk r of all ranks, in rank order.
* reduce:         the root alone reduces all ranks' buffers, in rank order.
* allgather:      rank r copies chunk q from each rank q.
* broadcast:      every rank copies the root's buffer.
* gather:         the root copies block q from each rank q.
* scatter:        rank r copies block r of the root's buffer.
* all_to_all:     rank r copies block r of each rank q into its block q
                  (its own block too, within its memory).

It sends (n-1)/n of the data per rank for allgather and broadcast, but every
rank reads all n buffers for allreduce: fewest steps (lowest latency), most
bytes. `auto` takes it for small messages.

Costs for n ranks and N bytes (busiest rank):

    collective       steps    sent           moved
    allreduce        1        (n-1) N        (n+1) N
    reduce_scatter   1        (n-1)/n N      (n+1)/n N
    allgather        1        (n-1)/n N      2(n-1)/n N
    broadcast        1        (n-1) N        2N          (the root sends to all)
    reduce           1        N              (n+1) N     (the root reads all)
    gather           1        N/n            2(n-1)/n N  (the root reads n-1 blocks)
    scatter          1        (n-1)/n N      2/n N       (each rank reads its block)
    all_to_all       1        (n-1)/n N      2N          (every rank reads n blocks)
"""

from .schedule import (
    ALL_TO_ALL, ALLGATHER, ALLREDUCE, BROADCAST, GATHER, NO_COSTS, REDUCE_SCATTER, REDUCE_TO_ROOT, SCATTER,
    SCRATCH, WORK, Costs, Region, Schedule, copy, reduce,
)


def direct(collective, nranks, root=None):
    n = nranks
    if n == 1:
        return Schedule(collective, 1, 1, (), root=root)
    every_rank = range(n)
    if collective == ALLREDUCE:
        step = [reduce([Region(q, WORK, 0) for q in every_rank], dst=Region(r, SCRATCH, 0)) for r in every_rank]
        return Schedule(collective, n, 1, (tuple(step),), result_buffer=SCRATCH)
    if collective == REDUCE_SCATTER:
        step = [reduce([Region(q, WORK, r) for q in every_rank], dst=Region(r, SCRATCH, r)) for r in every_rank]
        return Schedule(collective, n, n, (tuple(step),), result_buffer=SCRATCH)
    if collective == REDUCE_TO_ROOT:
        step = [reduce([Region(q, WORK, 0) for q in every_rank], dst=Region(root, SCRATCH, 0))]
        return Schedule(collective, n, 1, (tuple(step),), result_buffer=SCRATCH, root=root)
    if collective == ALLGATHER:
        step = [copy(Region(q, WORK, q), dst=Region(r, WORK, q)) for r in every_rank for q in every_rank if q != r]
        return Schedule(collective, n, n, (tuple(step),))
    if collective == BROADCAST:
        step = [copy(Region(root, WORK, 0), dst=Region(r, WORK, 0)) for r in every_rank if r != root]
        return Schedule(collective, n, 1, (tuple(step),), root=root)
    if collective == GATHER:
        step = [copy(Region(q, WORK, q), dst=Region(root, WORK, q)) for q in every_rank if q != root]
        return Schedule(collective, n, n, (tuple(step),), root=root)
    if collective == SCATTER:
        step = [copy(Region(root, WORK, r), dst=Region(r, WORK, r)) for r in every_rank if r != root]
        return Schedule(collective, n, n, (tuple(step),), root=root)
    if collective == ALL_TO_ALL:
        step = [copy(Region(q, WORK, r), dst=Region(r, SCRATCH, q)) for r in every_rank for q in every_rank]
        return Schedule(collective, n, n, (tuple(step),), result_buffer=SCRATCH)
    raise ValueError(f"direct has no schedule for {collective!r}")


def direct_costs(collective, nranks, nbytes):
    """The table in the module doc."""
    n, N = nranks, nbytes
    if n == 1:
        return NO_COSTS
    return {
        ALLREDUCE: Costs(1, (n - 1) * N, (n + 1) * N),
        REDUCE_SCATTER: Costs(1, (n - 1) / n * N, (n + 1) / n * N),
        ALLGATHER: Costs(1, (n - 1) / n * N, 2 * (n - 1) / n * N),
        BROADCAST: Costs(1, (n - 1) * N, 2 * N),
        REDUCE_TO_ROOT: Costs(1, N, (n + 1) * N),
        GATHER: Costs(1, N / n, 2 * (n - 1) / n * N),
        SCATTER: Costs(1, (n - 1) / n * N, 2 / n * N),
        ALL_TO_ALL: Costs(1, (n - 1) / n * N, 2 * N),
    }[collective]
