"""Butterfly (recursive doubling): partners 1, 2, 4, ... apart swap everything.

For n a power of two, steps k = 0 .. log2(n)-1:
    rank r and its partner r XOR 2^k exchange what they hold and both
    combine it. Before step k each rank holds the result for its 2^k-aligned
    block of ranks; the partner holds the neighbouring block, so after step k
    both hold the result for the 2^(k+1) block. log2 n steps in all.

Allreduce: both partners fold the lower rank's partial sum first, so they
    compute the same expression and every rank ends with the same bits.
    A rank may not overwrite its buffer while the partner pulls from it, so
    the steps alternate buffers: step 0 reads WORK and writes SCRATCH, step 1
    reads SCRATCH and writes WORK, and so on; the result is in WORK after an
    even number of butterfly steps, in SCRATCH after an odd one.
Allgather: the buffer is cut into n chunks, rank r starting with chunk r.
    At step k each rank copies the chunks its partner holds into the same
    chunks of its own WORK. It writes only chunks it lacks while the partner
    reads only chunks it has, so one buffer suffices.

Other n, the usual fix ("fold the extras in, then out"): with p the largest
power of two <= n, extra rank r in p..n-1 is paired with rank r - p. One step
hands each extra's data to its partner (allreduce folds it in, partner
first; allgather copies chunk r), the p ranks run the butterfly, and a last
step has each extra copy its partner's result: log2 p + 2 steps.

Every step moves the whole vector, so butterfly allreduce sends log2 n
buffers per rank: few steps for small messages, about log2(n)/2 times the
bytes of ring for large ones.

Costs for n ranks and N bytes, p = 2^floor(log2 n), L = log2 p, e = n - p the
number of extras and j = floor(log2 e) + 1 the bit length of e (busiest rank:
rank 0, which also serves an extra when n > p):

    collective   ranks    steps   sent                              moved
    allreduce    n == p   L       L N                               3L N
    allreduce    n > p    L+2     (L+1) N                           3(L+1) N
    allgather    n == p   L       (n-1)/n N                         2(n-1)/n N
    allgather    n > p    L+2     (n + p - 3 + 2^j + (L-j) e)/n N   2(n-1)/n N

(allgather, n > p: at step k rank 0 sends its 2^k chunks plus the
min(2^k, e) extras' chunks among them, p - 1 + 2^j - 1 + (L-j) e in all,
then n - 1 chunks to its extra.)
"""

from .schedule import (
    ALLGATHER, ALLREDUCE, NO_COSTS, SCRATCH, WORK,
    Costs, Region, Schedule, copy, largest_power_of_two_at_most, reduce,
)

BUTTERFLY_COLLECTIVES = (ALLREDUCE, ALLGATHER)

OTHER_BUFFER = {WORK: SCRATCH, SCRATCH: WORK}


def _allreduce(n):
    p = largest_power_of_two_at_most(n)
    extras = range(p, n)
    steps = []
    if extras:
        steps.append(tuple(
            reduce([Region(r - p, WORK, 0), Region(r, WORK, 0)], dst=Region(r - p, WORK, 0)) for r in extras))
    reading = WORK  # the buffer holding each rank's partial result before the step
    for k in range(p.bit_length() - 1):
        writing = OTHER_BUFFER[reading]
        step = []
        for r in range(p):
            # Both partners fold the lower rank first: one expression, one result.
            lower, upper = sorted((r, r ^ (1 << k)))
            step.append(reduce([Region(lower, reading, 0), Region(upper, reading, 0)], dst=Region(r, writing, 0)))
        steps.append(tuple(step))
        reading = writing
    if extras:
        steps.append(tuple(copy(Region(r - p, reading, 0), dst=Region(r, reading, 0)) for r in extras))
    return Schedule(ALLREDUCE, n, 1, tuple(steps), result_buffer=reading)


def _allgather(n):
    p = largest_power_of_two_at_most(n)
    extras = range(p, n)

    def held(rank, k):
        """The chunks `rank` holds before butterfly step k: those whose owner
        (for an extra's chunk c, its partner c - p) lies in `rank`'s
        2^k-aligned block."""
        return [c for c in range(n) if (c % p) >> k == rank >> k]

    steps = []
    if extras:
        steps.append(tuple(copy(Region(r, WORK, r), dst=Region(r - p, WORK, r)) for r in extras))
    for k in range(p.bit_length() - 1):
        steps.append(tuple(
            copy(Region(r ^ (1 << k), WORK, c), dst=Region(r, WORK, c))
            for r in range(p) for c in held(r ^ (1 << k), k)
        ))
    if extras:
        steps.append(tuple(
            copy(Region(r - p, WORK, c), dst=Region(r, WORK, c)) for r in extras for c in range(n) if c != r))
    return Schedule(ALLGATHER, n, n, tuple(steps))


def butterfly(collective, nranks, root=None):
    n = nranks
    if n == 1:
        return Schedule(collective, 1, 1, (), root=root)
    if collective == ALLREDUCE:
        return _allreduce(n)
    if collective == ALLGATHER:
        return _allgather(n)
    raise ValueError(f"butterfly has no schedule for {collective!r}")


def butterfly_costs(collective, nranks, nbytes):
    """The table in the module doc."""
    n, N = nranks, nbytes
    if n == 1:
        return NO_COSTS
    p = largest_power_of_two_at_most(n)
    L = p.bit_length() - 1
    e = n - p
    j = e.bit_length()
    if n == p:
        return {
            ALLREDUCE: Costs(L, L * N, 3 * L * N),
            ALLGATHER: Costs(L, (n - 1) / n * N, 2 * (n - 1) / n * N),
        }[collective]
    return {
        ALLREDUCE: Costs(L + 2, (L + 1) * N, 3 * (L + 1) * N),
        ALLGATHER: Costs(L + 2, (n + p - 3 + 2 ** j + (L - j) * e) / n * N, 2 * (n - 1) / n * N),
    }[collective]
