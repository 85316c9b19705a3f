"""Every registered algorithm's closed-form costs (its module's docstring
table, as its `costs` function) against what its schedules actually do, for
1 to 16 ranks and every collective it implements."""

import pytest

from collectives.algorithms import REGISTRY, schedule_for
from collectives.algorithms.schedule import ROOTED_COLLECTIVES

RANKS = range(1, 17)


def measured(schedule, nbytes):
    """(steps, bytes sent, bytes moved) of the schedule's busiest rank."""
    n, chunk = schedule.nranks, nbytes / schedule.nchunks
    return (schedule.nsteps,
            max(schedule.bytes_sent(r, nbytes) for r in range(n)),
            max(schedule.chunks_moved(r) for r in range(n)) * chunk)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_closed_forms_match_the_schedules(name):
    spec = REGISTRY[name]
    for collective in spec.collectives:
        for n in RANKS:
            roots = range(n) if collective in ROOTED_COLLECTIVES else [None]
            for root in roots:
                schedule = schedule_for(name, collective, n, root)
                nbytes = 720720 * schedule.nchunks  # divisible by every chunk count
                want = spec.costs(collective, n, nbytes)
                got = measured(schedule, nbytes)
                assert want.steps == got[0], (name, collective, n, root, "steps")
                assert want.sent == pytest.approx(got[1]), (name, collective, n, root, "sent")
                assert want.moved == pytest.approx(got[2]), (name, collective, n, root, "moved")


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_rank_at_once_equals_rank_by_rank(name):
    # auto weighs the one-pass tables; the costs above check the per-rank ones
    for collective in REGISTRY[name].collectives:
        for n in (1, 2, 3, 5, 8, 13):
            schedule = schedule_for(name, collective, n, 0 if collective in ROOTED_COLLECTIVES else None)
            for fused in (True, False):
                assert schedule.chunks_moved_by_rank_and_step(fused) == [
                    schedule.chunks_moved_by_step(r, fused) for r in range(n)], (name, collective, n, fused)
            assert schedule.peers_read_by_rank_and_step() == [
                [schedule.peers_read(r, s) for s in range(schedule.nsteps)] for r in range(n)], (name, collective, n)
