"""Schedules, checked without any array library: closed-form costs and the
symbolic trace (every output element holds each rank once, in one order)."""

import pytest

from collectives.algorithms import MODELS, REGISTRY, bytes_moved, choose, schedule_for, synchronisations
from collectives.algorithms.schedule import (
    ALL_TO_ALL, ALLGATHER, ALLREDUCE, BROADCAST, COLLECTIVES, GATHER, REDUCE_SCATTER, REDUCE_TO_ROOT,
    REDUCING_COLLECTIVES, ROOTED_COLLECTIVES as ROOTED, SCATTER, SCRATCH, WORK, Region, Schedule, ScheduleError,
    contributions, copy, reduce,
)


def make(algorithm, collective, n, root=0):
    return schedule_for(algorithm, collective, n, root if collective in ROOTED else None)


@pytest.mark.parametrize("n", range(1, 9))
def test_ring_allreduce_closed_form(n):
    s = make("ring", ALLREDUCE, n)
    assert s.nsteps == 2 * (n - 1)
    nbytes = 1024 * n  # divisible by n chunks
    for rank in range(n):
        assert s.bytes_sent(rank, nbytes) == pytest.approx(2 * (n - 1) / n * nbytes)


@pytest.mark.parametrize("n", range(1, 9))
def test_ring_reduce_scatter_and_allgather_closed_form(n):
    for collective in (REDUCE_SCATTER, ALLGATHER):
        s = make("ring", collective, n)
        assert s.nsteps == n - 1
        assert all(s.bytes_sent(r, 1024 * n) == pytest.approx((n - 1) / n * 1024 * n) for r in range(n))


@pytest.mark.parametrize("n", range(2, 9))
def test_direct_closed_form(n):
    nbytes = 1024 * n
    allreduce = make("direct", ALLREDUCE, n)
    assert allreduce.nsteps == 1
    # Every peer reads the whole buffer of every rank.
    assert all(allreduce.bytes_sent(r, nbytes) == (n - 1) * nbytes for r in range(n))
    allgather = make("direct", ALLGATHER, n)
    assert allgather.nsteps == 1
    assert all(allgather.bytes_sent(r, nbytes) == pytest.approx((n - 1) / n * nbytes) for r in range(n))
    broadcast = make("direct", BROADCAST, n, root=1)
    assert broadcast.bytes_sent(1, nbytes) == (n - 1) * nbytes
    assert all(broadcast.bytes_sent(r, nbytes) == 0 for r in range(n) if r != 1)


@pytest.mark.parametrize("n", range(2, 9))
def test_ring_chain_is_pipelined(n):
    for collective in (BROADCAST, REDUCE_TO_ROOT):
        s = make("ring", collective, n, root=n - 1)
        assert s.nsteps == 2 * n - 2
        # Each rank but the last on the chain forwards every chunk once.
        assert sorted(s.chunks_sent(r) for r in range(n)) == [0] + [n] * (n - 1)


# Every registered algorithm, on every collective it implements, for 1 to 12
# ranks and every root: all of them, not a sample (about a second).
EVERY_SCHEDULE = [
    (algorithm, collective, n, root)
    for algorithm, spec in sorted(REGISTRY.items()) for collective in spec.collectives for n in range(1, 13)
    for root in (range(n) if collective in ROOTED else [0])
]
every_schedule = pytest.mark.parametrize("case", [pytest.param(c, id="-".join(map(str, c))) for c in EVERY_SCHEDULE])


@every_schedule
def test_every_output_holds_each_rank_once_in_one_order(case):
    algorithm, collective, n, root = case
    s = make(algorithm, collective, n, root)
    trace = s.trace()
    if collective == ALL_TO_ALL:   # each rank gets other blocks: no one expression per chunk
        for r in range(n):
            for chunk in s.output_chunks(r):
                assert trace.origin[Region(r, s.result_buffer, chunk)] == Region(chunk, WORK, r)
        return
    for chunk in range(s.nchunks):
        receivers = [r for r in range(n) if chunk in s.output_chunks(r)]
        expressions = {trace.final[Region(r, s.result_buffer, chunk)] for r in receivers}
        # One expression per chunk: every rank folds the same values in the
        # same order, so floats come out bitwise identical everywhere.
        assert len(expressions) <= 1
        for expression in expressions:
            held = sorted(contributions(expression))
            if collective in REDUCING_COLLECTIVES:
                assert held == list(range(n))
            elif collective in (ALLGATHER, GATHER):
                assert held == [chunk]
            else:
                assert held == [root]
        for r in receivers:   # and a copy of the very block that belongs there
            origin = trace.origin.get(Region(r, s.result_buffer, chunk))
            if collective in (ALLGATHER, GATHER):
                assert origin == Region(chunk, WORK, chunk)
            elif collective in (BROADCAST, SCATTER):
                assert origin == Region(root, WORK, chunk)
            else:
                assert origin is None or n == 1   # a fold


@every_schedule
def test_the_traces_masks_agree_with_the_expressions(case):
    # validate() checks outputs through `held`, without walking expressions
    s = make(*case)
    trace = s.trace()
    assert trace.held.keys() == trace.final.keys()
    for region, expression in trace.final.items():
        ranks = contributions(expression)
        assert trace.held[region] == (sum(1 << r for r in set(ranks)), len(ranks)), region


@every_schedule
def test_avg_divides_only_where_a_reduction_completes(case):
    algorithm, collective, n, root = case
    s = make(algorithm, collective, n, root)
    completing = s.trace().completing
    if collective not in REDUCING_COLLECTIVES or n == 1:
        assert not completing
        return
    # Each chunk completes on the ranks that reduce it last, and only there.
    for s_index, t_index in completing:
        t = s.steps[s_index][t_index]
        assert sorted(contributions(s.trace().final[t.dst])) == list(range(n))


def test_rules_are_enforced():
    a, b = Region(0, WORK, 0), Region(1, WORK, 0)
    with pytest.raises(ScheduleError, match="read and written"):
        Schedule(ALLREDUCE, 2, 1, ((copy(a, dst=b), copy(b, dst=a)),))
    with pytest.raises(ScheduleError, match="between chunk"):
        Schedule(ALLREDUCE, 2, 2, ((copy(Region(0, WORK, 1), dst=b),),))
    with pytest.raises(ScheduleError, match="twice"):
        Schedule(ALLREDUCE, 2, 1, ((reduce([a, b], dst=b),), (reduce([a, b], dst=b),)))
    with pytest.raises(ScheduleError, match="before it holds data"):
        Schedule(ALLREDUCE, 2, 1, ((copy(Region(0, SCRATCH, 0), dst=b),),))
    with pytest.raises(ScheduleError, match="holds contributions"):
        Schedule(ALLREDUCE, 2, 1, ())  # nothing reduced
    with pytest.raises(ScheduleError, match="later source"):
        Schedule(ALLREDUCE, 3, 1, ((reduce([a, Region(2, WORK, 0), b], dst=b),),))


def test_block_moving_rules_are_enforced():
    # all_to_all alone may copy between chunk indices, and only the right block
    swap = [copy(Region(q, WORK, r), dst=Region(r, SCRATCH, q)) for r in range(2) for q in range(2)]
    Schedule(ALL_TO_ALL, 2, 2, (tuple(swap),), result_buffer=SCRATCH)
    with pytest.raises(ScheduleError, match="between chunk"):
        Schedule(ALLGATHER, 2, 2, ((copy(Region(0, WORK, 0), dst=Region(1, WORK, 1)),),))
    wrong = [copy(Region(q, WORK, q), dst=Region(r, SCRATCH, q)) for r in range(2) for q in range(2)]
    with pytest.raises(ScheduleError, match=r"rank0.SCRATCH\[1\] holds rank1.WORK\[1\], expected a copy of rank1.WORK\[0\]"):
        Schedule(ALL_TO_ALL, 2, 2, (tuple(wrong),), result_buffer=SCRATCH)
    with pytest.raises(ScheduleError, match="one chunk per rank"):
        Schedule(GATHER, 2, 1, (), root=0)
    with pytest.raises(ScheduleError, match="needs a root"):
        Schedule(SCATTER, 2, 2, ())


@pytest.mark.parametrize("transport", sorted(MODELS))
def test_auto_takes_fewest_steps_for_tiny_and_fewest_bytes_for_huge_messages(transport):
    """Whatever a model's two constants, the fixed cost (per step, or per
    transfer) dominates an 8-byte message and bytes dominate a 1 TB one."""
    for n in (2, 3, 4, 8):
        schedules = {name: make(name, ALLREDUCE, n) for name, spec in REGISTRY.items() if ALLREDUCE in spec.collectives}
        model = MODELS[transport]
        fewest = min(synchronisations(s, model) for s in schedules.values())  # steps, or transfers
        small = choose(ALLREDUCE, n, 8, 0, transport)
        assert synchronisations(schedules[small], model) == fewest, (n, small)
        moved = {name: bytes_moved(s, 1, MODELS[transport]) for name, s in schedules.items()}
        huge = choose(ALLREDUCE, n, 1 << 40, 0, transport)
        assert moved[huge] == pytest.approx(min(moved.values())), (n, huge, moved)
    assert choose(ALLREDUCE, 1, 1 << 20, 0, transport) in REGISTRY


def test_every_textbook_algorithm_is_registered():
    assert {"ring", "direct", "star", "tree", "butterfly", "halving_doubling", "round_robin", "two_shot"} <= set(REGISTRY)
