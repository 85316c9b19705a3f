"""Halving-doubling (Rabenseifner): recursive halving, then recursive doubling.

For n = p a power of two the buffer is cut into p chunks; chunk c ends with
rank c. Ranks pair up across a distance d that halves, then doubles:

Reduce-scatter by recursive halving, d = p/2, p/4, ..., 1:
    rank r and its partner r xor d are responsible for the same chunks. Each
    keeps the half that goes to its own side of d and reduces it with the
    partner's copy of those chunks (lower rank first). The halves are
    disjoint, so nothing is read and written in one step. After log2 p steps
    rank r holds chunk r complete.

All-gather by recursive doubling, d = 1, 2, ..., p/2:
    rank r copies from r xor d every chunk the partner holds complete, so
    what each rank holds doubles each step.

Allreduce is both: 2 log2 p steps, each rank sending 2(p-1)/p of the
buffer, as the ring does, in far fewer steps. Each chunk is reduced only
along its final owner's chain, then copied, so every rank gets the same bits.

n not a power of two, the usual fix: with p the largest power of two <= n,
the e = n - p extra ranks p..n-1 first fold their buffer into rank r - p, the
p ranks run halving-doubling, and the extras copy their result from r - p at
the end: two more steps. Reduce-scatter and allgather cut the buffer into n
chunks (one per rank); rank q < p then stands for the group of chunks c with
c mod p = q: its own and, for q < e, its extra's (for allgather the extra
hands its chunk to rank r - p instead of folding its buffer).

Costs for n ranks and N bytes (busiest rank; a reduce moves 3 chunks, a copy 2).
n a power of two:

    collective       steps      sent           moved
    allreduce        2 log2 n   2(n-1)/n N     5(n-1)/n N
    reduce_scatter   log2 n     (n-1)/n N      3(n-1)/n N
    allgather        log2 n     (n-1)/n N      2(n-1)/n N

otherwise, with p = 2^k the largest power of two <= n, e = n - p, and
S = 2^(m+1) - 1 + e(k-1-m), m = floor(log2 e): the extras' chunks in rank
0's blocks of 1, 2, ..., p/2 ranks together (the sum of min(e, 2^j), j < k),
which rank 0 keeps while halving and hands on while doubling:

    collective       steps      sent                moved
    allreduce        2k + 2     (3p-2)/p N          (8p-5)/p N            (the extras' partners)
    reduce_scatter   k + 2      N                   3(n+p-1+S)/n N        (sent: an extra; moved: rank 0)
    allgather        k + 2      (n+p-2+S)/n N       2(n-1)/n N            (sent: rank 0; moved: every rank)
"""

from .schedule import (
    ALLGATHER, ALLREDUCE, NO_COSTS, REDUCE_SCATTER, WORK,
    Costs, Region, Schedule, copy, largest_power_of_two_at_most, reduce,
)

HALVING_DOUBLING_COLLECTIVES = (ALLREDUCE, REDUCE_SCATTER, ALLGATHER)


def _distances(p):
    """p/2, p/4, ..., 1: the halving order (doubling runs it backwards)."""
    return [p >> level for level in range(1, p.bit_length())]


def _block(rank, distance):
    """Ranks agreeing with `rank` above `distance` form its block of `distance` ranks."""
    return rank // distance


def _halving_phase(p, nchunks):
    # Before the step at distance d, rank r holds partial sums of the chunks
    # whose owner (c mod p) is in r's block of 2d ranks; it keeps the half in
    # its block of d ranks, the half its partner gives away.
    steps = []
    for distance in _distances(p):
        step = []
        for r in range(p):
            partner = r ^ distance
            first, second = sorted((r, partner))
            for c in range(nchunks):
                if _block(c % p, distance) == _block(r, distance):
                    mine = Region(r, WORK, c)
                    step.append(reduce([Region(first, WORK, c), Region(second, WORK, c)], dst=mine))
        steps.append(tuple(step))
    return steps


def _doubling_phase(p, nchunks):
    # Before the step at distance d, rank r holds complete the chunks whose
    # owner is in r's block of d ranks; it copies its partner's block.
    steps = []
    for distance in reversed(_distances(p)):
        step = []
        for r in range(p):
            partner = r ^ distance
            for c in range(nchunks):
                if _block(c % p, distance) == _block(partner, distance):
                    step.append(copy(Region(partner, WORK, c), dst=Region(r, WORK, c)))
        steps.append(tuple(step))
    return steps


def _extras_fold_in(n, p, nchunks):
    """Extra rank r adds its whole buffer into rank r - p's (partner first)."""
    return [tuple(
        reduce([Region(r - p, WORK, c), Region(r, WORK, c)], dst=Region(r - p, WORK, c))
        for r in range(p, n) for c in range(nchunks)
    )]


def _extras_hand_in(n, p):
    """Extra rank r gives rank r - p its allgather block."""
    return [tuple(copy(Region(r, WORK, r), dst=Region(r - p, WORK, r)) for r in range(p, n))]


def _extras_copy_out(p, chunks_by_extra):
    """Extra rank r copies its result chunks from rank r - p."""
    return [tuple(
        copy(Region(r - p, WORK, c), dst=Region(r, WORK, c)) for r, chunks in chunks_by_extra.items() for c in chunks
    )]


def halving_doubling(collective, nranks, root=None):
    n = nranks
    if n == 1:
        return Schedule(collective, 1, 1, ())
    p = largest_power_of_two_at_most(n)
    extras = range(p, n)
    if collective == ALLREDUCE:
        nchunks = p
        steps = _halving_phase(p, nchunks) + _doubling_phase(p, nchunks)
        if extras:
            whole_buffer = {r: range(nchunks) for r in extras}
            steps = _extras_fold_in(n, p, nchunks) + steps + _extras_copy_out(p, whole_buffer)
    elif collective == REDUCE_SCATTER:
        nchunks = n
        steps = _halving_phase(p, nchunks)
        if extras:
            own_block = {r: (r,) for r in extras}
            steps = _extras_fold_in(n, p, nchunks) + steps + _extras_copy_out(p, own_block)
    elif collective == ALLGATHER:
        nchunks = n
        steps = _doubling_phase(p, nchunks)
        if extras:
            others_blocks = {r: [c for c in range(nchunks) if c != r] for r in extras}
            steps = _extras_hand_in(n, p) + steps + _extras_copy_out(p, others_blocks)
    else:
        raise ValueError(f"halving_doubling has no schedule for {collective!r}")
    return Schedule(collective, n, nchunks, tuple(steps))


def _extra_chunks_in_rank0_blocks(e, k):
    """S in the module doc: the sum of min(e, 2^j) for j < k, for 1 <= e < 2^k."""
    m = e.bit_length() - 1  # 2^j <= e exactly for j <= m
    return 2 ** (m + 1) - 1 + e * (k - 1 - m)


def halving_doubling_costs(collective, nranks, nbytes):
    """The tables in the module doc."""
    n, N = nranks, nbytes
    if n == 1:
        return NO_COSTS
    p = largest_power_of_two_at_most(n)
    k = p.bit_length() - 1
    e = n - p
    if e == 0:
        share = (n - 1) / n * N
        return {
            ALLREDUCE: Costs(2 * k, 2 * share, 5 * share),
            REDUCE_SCATTER: Costs(k, share, 3 * share),
            ALLGATHER: Costs(k, share, 2 * share),
        }[collective]
    S = _extra_chunks_in_rank0_blocks(e, k)
    return {
        ALLREDUCE: Costs(2 * k + 2, (3 * p - 2) / p * N, (8 * p - 5) / p * N),
        REDUCE_SCATTER: Costs(k + 2, N, 3 * (n + p - 1 + S) / n * N),
        ALLGATHER: Costs(k + 2, (n + p - 2 + S) / n * N, 2 * (n - 1) / n * N),
    }[collective]
