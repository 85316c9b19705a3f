"""Star (master-worker): one master gathers everything, then hands it back.

The master is rank 0 for allreduce and the root for reduce and broadcast.

Step 0, reduce: the master folds every rank's WORK, in rank order 0..n-1,
    into its SCRATCH. One fold, one order, so the result has one set of bits.
Step 1, copy back: every other rank copies the master's result.

Allreduce is both steps, reduce the first alone (into the root's SCRATCH),
broadcast the second alone (every rank copies the root's WORK). The master's
links carry everything: it receives (n-1) N and sends (n-1) N, while the
workers move N each way.

The textbook count is 2K rounds for K nodes, one message at the master at a
time; here the master reads all its peers in one step, so there are 2 steps.

Costs for n ranks and N bytes (busiest rank: the master):

    collective       steps    sent           moved
    allreduce        2        (n-1) N        (n+1) N
    reduce           1        N              (n+1) N     (each worker sends N)
    broadcast        1        (n-1) N        2N          (each worker copies N)
"""

from .schedule import (
    ALLREDUCE, BROADCAST, NO_COSTS, REDUCE_TO_ROOT, SCRATCH, WORK,
    Costs, Region, Schedule, copy, reduce,
)

STAR_COLLECTIVES = (ALLREDUCE, REDUCE_TO_ROOT, BROADCAST)


def _master_reduces(n, master):
    return (reduce([Region(q, WORK, 0) for q in range(n)], dst=Region(master, SCRATCH, 0)),)


def _workers_copy(n, master, buffer):
    return tuple(copy(Region(master, buffer, 0), dst=Region(r, buffer, 0)) for r in range(n) if r != master)


def star(collective, nranks, root=None):
    n = nranks
    if n == 1:
        return Schedule(collective, 1, 1, (), root=root)
    if collective == ALLREDUCE:
        steps = (_master_reduces(n, 0), _workers_copy(n, 0, SCRATCH))
        return Schedule(collective, n, 1, steps, result_buffer=SCRATCH)
    if collective == REDUCE_TO_ROOT:
        return Schedule(collective, n, 1, (_master_reduces(n, root),), result_buffer=SCRATCH, root=root)
    if collective == BROADCAST:
        return Schedule(collective, n, 1, (_workers_copy(n, root, WORK),), root=root)
    raise ValueError(f"star has no schedule for {collective!r}")


def star_costs(collective, nranks, nbytes):
    """The table in the module doc."""
    n, N = nranks, nbytes
    if n == 1:
        return NO_COSTS
    return {
        ALLREDUCE: Costs(2, (n - 1) * N, (n + 1) * N),
        REDUCE_TO_ROOT: Costs(1, N, (n + 1) * N),
        BROADCAST: Costs(1, (n - 1) * N, 2 * N),
    }[collective]
