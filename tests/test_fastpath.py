"""Host ranks' allreduce in the compiled loop (collectives/transport/fastpath.py,
_shmloop.c), across processes under mpiexec: the same bits as the plan
interpreter, with and without the loop, and every fault case of the host
SPMD tests on both of its paths (the merged small step, the pipeline)."""

import functools
import os
import re
from pathlib import Path

import pytest

from test_mpi import mpi_launch, run_launch

pytest.importorskip("mpi4py", reason="the multi-process tests need mpi4py: pip install '.[test]'")
pytestmark = pytest.mark.mpi

WORKER = Path(__file__).with_name("fastpath_worker.py")


def run_worker(n, scenario, *extra, env=None, limit=300, launcher_flags=()):
    env = dict(os.environ, **(env or {}), PYTHONPATH=os.pathsep.join([str(WORKER.parent),
                                                                       os.environ.get("PYTHONPATH", "")]))
    env.pop("COLLECTIVES_TIMEOUT", None)
    done = run_launch([*mpi_launch(n, *launcher_flags), str(WORKER), scenario, *extra], limit, env)
    report = f"exit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    assert done.returncode == 0, report
    return re.findall(rf"OK {scenario} (\d+) ([0-9a-f]{{16}})", done.stdout), report


def test_the_compiled_loop_was_built():
    """setup.py builds it where a C compiler is (CI has one): the fast path
    must not silently fall back to the interpreter there."""
    from collectives.transport import fastpath
    assert fastpath.available(), "collectives.transport._shmloop is missing: was `pip install -e .` run?"


# The two ways to move a large message (fastpath.py): through staging
# slots, or straight out of and into peers' buffers (process_vm_readv and
# writev). Each test below runs every pipelined size through one of them.
# (the single copy at every large size: messages up to
# COLLECTIVES_STAGED_MAX, 4 MiB a rank by default, stage even where the
# ranks may single copy; past it the plans single copy them)
LARGE_PATHS = {
    "single-copy": {"COLLECTIVES_FAST_SINGLE_COPY": "1", "COLLECTIVES_STAGED_MAX": "0"},
    "staged": {"COLLECTIVES_FAST_SINGLE_COPY": "0"},
}


def check_large_path(report, large_path):
    """The path the ranks took is the one asked for; a machine where ranks
    may not read each other's memory falls back to staging, and says so."""
    # mpiexec may splice one rank's line into another's: match the names themselves
    taken = set(re.findall(r"LARGE PATH \d+ (single-copy|staged)", report))
    if large_path == "single-copy" and taken == {"staged"}:
        pytest.skip("this machine lets no rank read and write another's memory (process_vm_readv/writev: Yama "
                    "ptrace_scope, seccomp): the single-copy path cannot run here; the staged path took the calls")
    assert taken == {large_path}, report


# How the ranks come by the loop's staging limit, all five collectives' (FastCollectives.choose_staged_max):
# measured, measured with the single copy's reads slowed (so staging must
# win), pinned by the variable, and no probe where every message stages.
STAGING_LIMITS = {
    "measured": {},
    # (20 ms a read: more than a staged 1 MiB allreduce takes on a loaded 2-core machine, whose
    # chunk-by-chunk waits each may wait out a time slice; at 2 ms, CI once saw both ways at 6.3 ms)
    "measured, single copy slowed": {"COLLECTIVES_TEST_READ_STALL": "0.02"},
    "pinned": {"COLLECTIVES_STAGED_MAX": str(2 << 20)},
    "every message staged": {"COLLECTIVES_FAST_SINGLE_COPY": "0"},
}


@pytest.mark.parametrize("setting", STAGING_LIMITS)
def test_the_ranks_choose_the_staging_limit_alike_as_they_start(setting, monkeypatch):
    """Unpinned, the ranks time a 1 MiB allreduce both ways and all take the
    faster (the same probe times on every rank: the slowest rank's); a
    1 MiB allreduce then takes the step that limit names, and every one of
    the five collectives stages up to the limit and not past it (the
    worker asks the loop's step_for)."""
    from collectives.config import DEFAULT_STAGED_MAX
    monkeypatch.delenv("COLLECTIVES_STAGED_MAX", raising=False)
    oks, report = run_worker(2, "measured", env=STAGING_LIMITS[setting])
    assert len(oks) == 2, report
    # (mpiexec may splice one rank's line into another's: match the fields themselves)
    seconds = r"(None|[0-9.]+(?:e-?[0-9]+)?)"
    chosen = set(re.findall(rf"MEASURED \d+ (\d+) {seconds} {seconds} (single_copy|staged)", report))
    assert len(chosen) == 1, report   # every rank alike
    ((staged_max, single_copy, staged, step),) = chosen
    staged_max = int(staged_max)
    if setting.startswith("measured") and single_copy == "None":
        check_large_path(report, "single-copy")   # (skips where no rank may read another's memory)
    if setting == "pinned":
        assert (staged_max, single_copy, step) == (2 << 20, "None", "staged"), report
    elif setting == "every message staged":
        assert (staged_max, single_copy, step) == (DEFAULT_STAGED_MAX, "None", "staged"), report
    else:
        faster_staged = float(staged) < float(single_copy)
        assert staged_max == (DEFAULT_STAGED_MAX if faster_staged else 0), report
        assert step == ("staged" if faster_staged else "single_copy"), report
        if setting == "measured, single copy slowed":   # 20 ms a read, at least one read a call
            assert float(single_copy) > 20000 and faster_staged, report   # (microseconds)


def test_ranks_that_disagree_on_the_pinned_staging_limit_are_told_as_they_start(monkeypatch):
    monkeypatch.delenv("COLLECTIVES_STAGED_MAX", raising=False)
    oks, report = run_worker(3, "staged_max_differs")
    assert len(oks) == 3, report


@functools.lru_cache(maxsize=None)
def interpreter_digests(n):
    without_loop, report = run_worker(n, "bits", "no-loop")
    assert len(without_loop) == n, report
    return {digest for _, digest in without_loop}


@pytest.mark.skipif((os.cpu_count() or 1) >= 3, reason="3 ranks must outnumber the cores for the allgathers' "
                    "staging limit to apply (COLLECTIVES_SPREAD_STAGED_MAX)")
def test_ranks_that_disagree_on_the_staging_limit_are_named_at_once():
    oks, report = run_worker(3, "spread_mismatch", env=LARGE_PATHS["single-copy"],
                             launcher_flags=["-disable-auto-cleanup"])
    assert len(oks) == 3, report


@pytest.mark.slow
@pytest.mark.parametrize("large_path", LARGE_PATHS)
@pytest.mark.parametrize("n", [2, 3])
def test_bits_equal_the_interpreter_with_and_without_the_loop(n, large_path):
    with_loop, report = run_worker(n, "bits", env=LARGE_PATHS[large_path])
    assert len(with_loop) == n, report
    assert {digest for _, digest in with_loop} == interpreter_digests(n), report
    check_large_path(report, large_path)


@pytest.mark.parametrize("large_path", [*LARGE_PATHS, "single-copy, not staged when oversubscribed"])
@pytest.mark.parametrize("n", [2, 3])
def test_the_other_collectives_equal_the_direct_plan(n, large_path):
    """reduce_scatter, allgather, broadcast and reduce in the loop: the
    worker compares every result with the `direct` plan's, in the same run,
    and checks which large calls were staged (where the ranks outnumber the
    cores, allgather and broadcast up to LoopTunables.spread_staged_max
    are, even on the single copy; the third case turns that off, so that
    they read in place with 3 ranks on any machine)."""
    env = LARGE_PATHS.get(large_path, {**LARGE_PATHS["single-copy"], "COLLECTIVES_SPREAD_STAGED_MAX": "0"})
    oks, report = run_worker(n, "collectives", env=env)
    assert len(oks) == n, report
    check_large_path(report, large_path.split(",")[0])


@pytest.mark.parametrize("large_path", LARGE_PATHS)
@pytest.mark.parametrize("scenario", ["stalled_large", "killed_large", "abort"])
def test_faults_on_the_pipelined_path(scenario, large_path):
    # Hydra would otherwise kill the survivors itself when one rank exits.
    oks, report = run_worker(3, scenario, env=LARGE_PATHS[large_path], launcher_flags=["-disable-auto-cleanup"])
    # The ranks that wait on a failed peer must each have seen the failure
    # (the stalled or killed rank 1, or the aborting rank 0, may not report).
    must_report = {"stalled_large": {"0", "2"}, "killed_large": {"0", "2"}, "abort": {"1", "2"}}[scenario]
    assert must_report <= {rank for rank, _ in oks}, report


def test_a_communicator_dropped_without_close_frees_its_memory_at_once():
    oks, report = run_worker(2, "dropped")
    assert len(oks) == 2, report


def test_the_loops_sizes_are_the_environments_when_a_communicator_is_made():
    oks, report = run_worker(2, "sizes", env={"COLLECTIVES_FAST_SMALL_MAX": "4096", "COLLECTIVES_FAST_CHUNK": "65536"})
    assert len(oks) == 2, report


@pytest.mark.parametrize("case", [0, 1, 2], ids=["merged-vs-pipelined", "different-op", "fast-vs-interpreted"])
def test_mismatched_calls_are_named(case):
    oks, report = run_worker(2, "mismatch", env={"FASTPATH_CASE": str(case)}, launcher_flags=["-disable-auto-cleanup"])
    assert len(oks) == 2, report


@pytest.mark.parametrize("n", [2, 3])
def test_arrays_that_differ_between_ranks_are_taken_alike(n):
    """Overlapping outputs on one rank only, memory-mapped arrays, NumPy
    integer roots, read-only outputs the call does not write: the worker
    checks the results; here, that the first large call (a reduce into
    read-only outputs on the other ranks) still found the single copy."""
    oks, report = run_worker(n, "edge_arrays", env=LARGE_PATHS["single-copy"], launcher_flags=["-disable-auto-cleanup"])
    assert len(oks) == n, report
    check_large_path(report, "single-copy")


@pytest.mark.parametrize("case", range(7), ids=["stalled-merged", "stalled-large", "killed", "another-collective",
                                                 "another-root", "plan-vs-loop", "barrier-vs-allreduce"])
def test_the_other_collectives_fail_as_allreduce_does(case):
    oks, report = run_worker(3, "collective_faults", env={"FASTPATH_CASE": str(case)},
                             launcher_flags=["-disable-auto-cleanup"])
    # the ranks that wait on the stalled or killed rank 1 must each have seen it
    must_report = {"0", "2"} if case < 3 else {"0", "1", "2"}
    assert must_report <= {rank for rank, _ in oks}, report


def test_a_rank_returns_only_once_its_readers_are_done_with_its_input():
    """The single copy's last wait: rank 0's readers are held before every
    read ($COLLECTIVES_TEST_READ_STALL), rank 0 overwrites its input as soon as
    its call returns, and every rank's result must still be the inputs'.
    Without that wait (the single-copy plans' phase 2: _host_plan.c), the
    calls give wrong results."""
    oks, report = run_worker(3, "slow_reader", env=LARGE_PATHS["single-copy"])
    check_large_path(report, "single-copy")
    assert len(oks) == 3, report


@pytest.mark.slow
@pytest.mark.parametrize("case", ["reduce", "broadcast"])
def test_a_failed_call_raises_only_once_no_peer_writes_into_its_output(case):
    oks, report = run_worker(2, "fenced", env={**LARGE_PATHS["single-copy"], "FASTPATH_CASE": case},
                             launcher_flags=["-disable-auto-cleanup"])
    check_large_path(report, "single-copy")
    assert len(oks) == 2, report


def test_waits_that_fall_asleep_wake_with_the_right_result():
    # 4 ranks on this 2-core machine (and any with fewer than 4): the
    # oversubscribed waits spin briefly, then sleep on the futex.
    oks, report = run_worker(4, "late")
    assert len(oks) == 4, report


@pytest.mark.slow
def test_ctrl_c_in_a_waiting_call_raises_at_once_and_aborts_the_others():
    oks, report = run_worker(3, "interrupted", launcher_flags=["-disable-auto-cleanup"])
    assert {"0", "2"} <= {rank for rank, _ in oks}, report
