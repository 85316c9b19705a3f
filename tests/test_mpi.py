"""Ranks in separate processes, started with mpiexec as users do: host
ranks, and GPU ranks on emulated devices (every test body runs on both), or
on a real GPU when one is usable (marked `gpu`).

Each test has a hard time limit: a hang fails the test instead of CI.
"""

import os
from pathlib import Path

import pytest

from backends import gpu_unavailable_reason
from mpi_launch import (  # noqa: F401 (the other modules import them from here)
    launcher_flags, mpi_launch, mpich_mpiexec, mpiexec, ok_lines, run_launch, scenarios_not_held, survivable_launch,
    worker_python)

pytest.importorskip("mpi4py", reason="the multi-process tests need mpi4py: pip install '.[test]'")
pytestmark = pytest.mark.mpi

WORKER = Path(__file__).with_name("mpi_worker.py")
DEVICES = ["host", "emulated", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES)
def device(request):
    if request.param == "cuda" and gpu_unavailable_reason():
        pytest.skip(gpu_unavailable_reason())
    return request.param


def run_worker(worker, n, scenario, *arguments, launcher_flags=(), limit=240, environment=None):
    """Run `worker scenario *arguments` on n ranks under mpiexec (the tests'
    folder importable, no inherited COLLECTIVES_TIMEOUT); it must exit 0.
    Returns the ranks' "OK <scenario> <rank>" lines and a report to show."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(worker.parent), os.environ.get("PYTHONPATH", "")]),
               **(environment or {}))
    env.pop("COLLECTIVES_TIMEOUT", None)
    done = run_launch([*mpi_launch(n, *launcher_flags), str(worker), scenario, *arguments], limit, env)
    report = f"exit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    assert done.returncode == 0, report
    return ok_lines(done.stdout, scenario), report


def run_ranks(n, scenario, *launcher_flags, device="host", limit=240):
    return run_worker(WORKER, n, scenario, device, launcher_flags=launcher_flags, limit=limit)


# What each scenario of tests/mpi_worker.py that leaves every rank alive
# checks, and the rank counts each runs on. Those of one count run in one
# launch, in turn, each on a communicator of its own: a rank's start costs
# about 0.36 CPU-s, as much as a short scenario's calls.
CHECKED_BY = {
    "collectives": "every collective, dtype and op across processes",
    "exchanges": "gather, scatter and all_to_all with every algorithm, in and out of place, against closed forms",
    "point_to_point": "send, recv, isend and irecv: sizes around the mailbox's slots, tags, any source, oneself",
    "growth": "workspaces grow across calls",
    "prepared": "prepared calls across processes",
    "fusion": "compressed allreduce, allreduce_many and fusion_buffer: the bits of ranks in one process",
}
SCENARIOS_ON = {
    2: ("collectives", "exchanges", "point_to_point"),
    3: ("collectives", "exchanges", "point_to_point", "growth", "prepared", "fusion"),
    4: ("collectives",),
}


@pytest.mark.slow
@pytest.mark.parametrize("n", list(SCENARIOS_ON))
def test_every_scenario_that_leaves_the_ranks_alive_holds_across_processes(n, device):
    """CHECKED_BY's scenarios on n ranks, in one launch: every rank says OK to each."""
    scenarios = SCENARIOS_ON[n]
    oks, report = run_ranks(n, ",".join(scenarios), device=device)
    failed = scenarios_not_held(oks, scenarios, n, CHECKED_BY)
    assert not failed, f"did not hold on every rank: {failed}\n{report}"


def test_a_receive_from_a_stalled_rank_times_out():
    oks, report = run_ranks(2, "point_to_point_failures")
    assert len(oks) == 2, report


def test_an_all_to_all_v_that_meets_an_allgather_is_named_on_both_ranks():
    oks, report = run_ranks(2, "all_to_all_v_mismatch")
    assert len(oks) == 2, report


def test_a_receive_that_comes_after_its_sends_timeout_raises():
    oks, report = run_ranks(2, "point_to_point_late_receiver")
    assert len(oks) == 2, report


def test_a_receive_from_a_rank_that_died_mid_message_raises_at_once():
    oks, report = run_ranks(2, "point_to_point_killed", "-disable-auto-cleanup")
    assert len(oks) == 1, report


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["stalled", "stalled_barrier", "mismatch"])
def test_a_rank_that_stops_calling_in_or_disagrees_raises_instead_of_hanging(scenario, device):
    oks, report = run_ranks(3, scenario, device=device)
    assert len(oks) == 3, report


def test_a_killed_rank_is_reported_quickly(device):
    # Hydra would otherwise kill the survivors itself when one rank exits.
    oks, report = run_ranks(3, "killed", "-disable-auto-cleanup", device=device)
    assert len(oks) == 2, report


def test_a_killed_rank_surfaces_at_a_fusion_buffers_wait(device):
    oks, report = run_ranks(3, "fusion_killed", "-disable-auto-cleanup", device=device)
    assert len(oks) == 2, report


def test_close_removes_shared_memory(device):
    oks, report = run_ranks(2, "shared_segments_are_removed", device=device)
    assert len(oks) == 2, report


def test_gpu_ranks_without_a_gpu_fail_at_once_on_every_rank():
    if not gpu_unavailable_reason():
        pytest.skip("this machine has a GPU; the test is of a machine without one")
    oks, report = run_ranks(2, "no_gpu")
    assert len(oks) == 2, report
