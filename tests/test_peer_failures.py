"""A peer that stalls or dies: every other rank raises the same class.

Ranks in separate processes (mpiexec, as tests/test_mpi.py starts them), 3
and 4 of them, on the host and on emulated devices. One rank stops calling
(longer than a 2 s timeout) or is killed in the middle of a run of calls;
every other rank must raise CollectiveTimeoutError (for the stall) or
RankFailedError (for the death) naming that rank, whether it waited for the
failing rank itself or learnt of it through a peer's abort: a program that
catches TimeoutError handles the same event on every rank. The checks of
each rank are in tests/peer_failure_worker.py.
"""

from pathlib import Path

import pytest

from collectives.transport import fastpath
from test_mpi import run_worker

pytest.importorskip("mpi4py", reason="the multi-process tests need mpi4py: pip install '.[test]'")
pytestmark = pytest.mark.mpi

WORKER = Path(__file__).with_name("peer_failure_worker.py")

needs_the_loop = pytest.mark.skipif(not fastpath.available(), reason="the compiled loop (_shmloop) is not built: "
                                    "python setup.py build_ext --inplace")
# Which call the surviving ranks wait in (see the worker): host ranks run an
# allreduce of `auto` in the compiled loop and a ring allreduce in the step
# protocol; ranks on emulated devices run every plan through the step protocol.
PATHS = [
    pytest.param("host", "fast", marks=needs_the_loop, id="host-compiled-loop"),
    pytest.param("host", "ring", id="host-step-protocol"),
    pytest.param("emulated", "ring", id="emulated-step-protocol"),
]


def run_failure(n, event, device, path, limit=60):
    """Run the worker's `event` on `n` ranks; every rank but a killed one must report OK."""
    # Hydra would otherwise kill the survivors itself when one rank exits.
    flags = ["-disable-auto-cleanup"] if event == "killed" else []
    oks, report = run_worker(WORKER, n, event, path, device, launcher_flags=flags, limit=limit)
    assert len(oks) == (n - 1 if event == "killed" else n), report


@pytest.mark.slow
@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("device, path", PATHS)
def test_every_rank_waiting_on_a_stalled_peer_raises_a_timeout_naming_it(n, device, path):
    run_failure(n, "stalled", device, path)


@pytest.mark.slow
def test_a_stalled_peer_in_a_barrier_is_a_timeout_on_every_rank():
    run_failure(3, "stalled", "host", "barrier")


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("device, path", PATHS)
def test_every_rank_waiting_on_a_killed_peer_raises_rank_failed_naming_it(n, device, path):
    run_failure(n, "killed", device, path)


def test_a_peer_that_aborted_then_died_while_this_rank_looked_is_reported_as_its_abort(monkeypatch):
    """check_health looks at the abort flag, then at the peer's process: a
    peer that aborts and exits between the two looks (a rank preempted
    there, on a loaded machine) did abort first, and its abort is what the
    others must raise, not its death."""
    from collectives.errors import CollectiveTimeoutError, RankFailedError
    from collectives.transport import protocol
    from collectives.transport.segments import HostMemory

    group = protocol.ProcessGroup(0, 2, protocol.new_prefix(), HostMemory)
    try:
        group._rows[1, protocol.PID] = 2 ** 22 + 7     # the peer's process, as its row names it

        def peer_aborts_then_exits(pid):
            group.abort("CollectiveTimeoutError on rank 1: waiting for rank 2", CollectiveTimeoutError)
            return False
        monkeypatch.setattr(protocol, "_alive", peer_aborts_then_exits)
        with pytest.raises(CollectiveTimeoutError, match="aborted the communicator: CollectiveTimeoutError on rank 1"):
            group.check_health(1, "call #1")

        monkeypatch.setattr(protocol, "_alive", lambda pid: False)   # and a peer that died without aborting
        fresh = protocol.ProcessGroup(0, 2, protocol.new_prefix(), HostMemory)
        try:
            fresh._rows[1, protocol.PID] = 2 ** 22 + 7
            with pytest.raises(RankFailedError, match=r"rank 1 \(pid 4194311\) died before completing call #1"):
                fresh.check_health(1, "call #1")
        finally:
            fresh.close()
    finally:
        group.close()
