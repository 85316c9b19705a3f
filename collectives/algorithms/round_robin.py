"""Round robin (pairwise exchange): in round k every rank meets the rank k
places before it.

The buffer is cut into n chunks; rank r owns chunk r.

Reduce-scatter phase, rounds k = 1 .. n-1:
    rank r reduces its chunk r with chunk r of rank (r - k) mod n. It folds
    its own value first, then r-1, r-2, ...: one fixed order per chunk. Each
    rank writes only the chunk it owns and reads only chunks their ranks
    never write, so the rounds never collide. After n-1 rounds rank r holds
    chunk r complete.

All-gather phase, rounds k = 1 .. n-1:
    rank r copies chunk (r - k) mod n from its owner, rank (r - k) mod n.

All-to-all, rounds k = 0 .. n-1 (round 0 is the rank's own block):
    rank r copies block r of rank (r - k) mod n into its block (r - k) mod n.
    Every rank reads one block a round, from a different peer, and every
    peer is read by one rank a round: MPI's pairwise exchange.

Allreduce is both phases: 2(n-1) steps and 2(n-1)/n of the buffer sent per
rank, like the ring, but every round pairs each rank with a new peer instead
of relaying through neighbours: no chunk waits on a chain of hops. Every
chunk is reduced once, by its owner, then copied, so every rank gets the
same bits.

Costs for n ranks and N bytes (every rank alike; a reduce moves 3 chunks, a copy 2):

    collective       steps    sent           moved
    allreduce        2(n-1)   2(n-1)/n N     5(n-1)/n N
    reduce_scatter   n-1      (n-1)/n N      3(n-1)/n N
    allgather        n-1      (n-1)/n N      2(n-1)/n N
    all_to_all       n        (n-1)/n N      2N
"""

from .ring import ring_costs
from .schedule import (
    ALL_TO_ALL, ALLGATHER, ALLREDUCE, REDUCE_SCATTER, SCRATCH, WORK,
    NO_COSTS, Costs, Region, Schedule, copy, reduce,
)

ROUND_ROBIN_COLLECTIVES = (ALLREDUCE, REDUCE_SCATTER, ALLGATHER, ALL_TO_ALL)


def _reduce_scatter_phase(n):
    # Before round k, rank r's chunk r folds r, r-1, ..., r-k+1 (mod n).
    steps = []
    for k in range(1, n):
        step = []
        for r in range(n):
            own = Region(r, WORK, r)
            step.append(reduce([own, Region((r - k) % n, WORK, r)], dst=own))
        steps.append(tuple(step))
    return steps


def _all_gather_phase(n):
    # Before round k, rank r holds chunks r, r-1, ..., r-k+1 (mod n) complete.
    steps = []
    for k in range(1, n):
        step = []
        for r in range(n):
            owner = (r - k) % n
            step.append(copy(Region(owner, WORK, owner), dst=Region(r, WORK, owner)))
        steps.append(tuple(step))
    return steps


def _exchange_phase(n):
    # Round k writes only blocks (r - k) mod n, which no other round writes,
    # and reads only WORK, which no round writes.
    return [tuple(copy(Region((r - k) % n, WORK, r), dst=Region(r, SCRATCH, (r - k) % n)) for r in range(n))
            for k in range(n)]


def round_robin(collective, nranks, root=None):
    n = nranks
    if n == 1:
        return Schedule(collective, 1, 1, ())
    if collective == ALL_TO_ALL:
        return Schedule(collective, n, n, tuple(_exchange_phase(n)), result_buffer=SCRATCH)
    if collective == ALLREDUCE:
        steps = _reduce_scatter_phase(n) + _all_gather_phase(n)
    elif collective == REDUCE_SCATTER:
        steps = _reduce_scatter_phase(n)
    elif collective == ALLGATHER:
        steps = _all_gather_phase(n)
    else:
        raise ValueError(f"round_robin has no schedule for {collective!r}")
    return Schedule(collective, n, n, tuple(steps))


def round_robin_costs(collective, nranks, nbytes):
    """The table in the module doc: a round moves one chunk per rank, as a ring
    step does (only the peer changes), so the costs are the ring's."""
    if collective not in ROUND_ROBIN_COLLECTIVES:
        raise KeyError(collective)
    if collective == ALL_TO_ALL:
        n = nranks
        return NO_COSTS if n == 1 else Costs(n, (n - 1) / n * nbytes, 2 * nbytes)
    return ring_costs(collective, nranks, nbytes)
