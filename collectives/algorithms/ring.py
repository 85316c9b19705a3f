"""Ring: ranks pass chunks to their right neighbour, one hop per step.

The buffer is cut into n chunks. Rank r receives from r-1 ("left") only.

Reduce-scatter phase, steps s = 0 .. n-2:
    rank r sends chunk (r - s - 1) mod n to rank r+1, which adds it to its own
    copy. Chunk c starts at rank c+1 and travels the ring once, picking up one
    contribution per hop, so after n-1 steps rank r owns chunk r complete.

All-gather phase, steps s = 0 .. n-2:
    rank r sends chunk (r - s) mod n to rank r+1, which copies it. At s = 0
    that is the chunk r owns; afterwards it is the one r received a step ago.

Allreduce is both phases: 2(n-1) steps, each rank sending 2(n-1)/n of the
buffer, which is optimal in bytes sent per rank. Every chunk is reduced along
one path, so every rank ends with the same bits.

Broadcast and reduce use the ring as a pipelined chain rooted at `root`: chunk
c leaves (or reaches) the root at step c and moves one hop per step, so n
chunks cross n-1 hops in 2n-2 steps.

Costs for n ranks and N bytes (busiest rank; a reduce moves 3 chunks, a copy 2):

    collective       steps    sent           moved
    allreduce        2(n-1)   2(n-1)/n N     5(n-1)/n N
    reduce_scatter   n-1      (n-1)/n N      3(n-1)/n N
    allgather        n-1      (n-1)/n N      2(n-1)/n N
    broadcast        2n-2     N              2N
    reduce           2n-2     N              3N
"""

from .schedule import (
    ALLGATHER, ALLREDUCE, BROADCAST, NO_COSTS, REDUCE_SCATTER, REDUCE_TO_ROOT, WORK,
    Costs, Region, Schedule, copy, reduce,
)


def _reduce_scatter_phase(n):
    steps = []
    for s in range(n - 1):
        step = []
        for r in range(n):
            right, chunk = (r + 1) % n, (r - s - 1) % n
            incoming, own = Region(r, WORK, chunk), Region(right, WORK, chunk)
            step.append(reduce([incoming, own], dst=own))
        steps.append(tuple(step))
    return steps


def _all_gather_phase(n):
    steps = []
    for s in range(n - 1):
        step = []
        for r in range(n):
            right, chunk = (r + 1) % n, (r - s) % n
            step.append(copy(Region(r, WORK, chunk), dst=Region(right, WORK, chunk)))
        steps.append(tuple(step))
    return steps


def _chain(n, root, toward_root):
    """The ring as a pipeline: position p is rank root + p (or root + 1 + p
    when reducing toward the root, so that the root is the last position)."""
    position_rank = (lambda p: (root + 1 + p) % n) if toward_root else (lambda p: (root + p) % n)
    steps = []
    for s in range(2 * n - 2):
        step = []
        for p in range(1, n):
            chunk = s - (p - 1)  # chunk c enters hop p at step c + p - 1
            if not 0 <= chunk < n:
                continue
            sender = Region(position_rank(p - 1), WORK, chunk)
            receiver = Region(position_rank(p), WORK, chunk)
            if toward_root:
                step.append(reduce([sender, receiver], dst=receiver))
            else:
                step.append(copy(sender, dst=receiver))
        steps.append(tuple(step))
    return steps


def ring(collective, nranks, root=None):
    n = nranks
    if n == 1:
        return Schedule(collective, 1, 1, (), root=root)
    if collective == ALLREDUCE:
        steps = _reduce_scatter_phase(n) + _all_gather_phase(n)
    elif collective == REDUCE_SCATTER:
        steps = _reduce_scatter_phase(n)
    elif collective == ALLGATHER:
        steps = _all_gather_phase(n)
    elif collective == BROADCAST:
        steps = _chain(n, root, toward_root=False)
    elif collective == REDUCE_TO_ROOT:
        steps = _chain(n, root, toward_root=True)
    else:
        raise ValueError(f"ring has no schedule for {collective!r}")
    return Schedule(collective, n, n, tuple(steps), root=root)


def ring_costs(collective, nranks, nbytes):
    """The table in the module doc."""
    n, N = nranks, nbytes
    if n == 1:
        return NO_COSTS
    share = (n - 1) / n * N
    return {
        ALLREDUCE: Costs(2 * (n - 1), 2 * share, 5 * share),
        REDUCE_SCATTER: Costs(n - 1, share, 3 * share),
        ALLGATHER: Costs(n - 1, share, 2 * share),
        BROADCAST: Costs(2 * n - 2, N, 2 * N),
        REDUCE_TO_ROOT: Costs(2 * n - 2, N, 3 * N),
    }[collective]
