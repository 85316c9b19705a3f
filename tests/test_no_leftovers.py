"""No shared memory of the library outlives its job as a file in /dev/shm,
however the job ends: a normal close, or every rank killed with SIGKILL
(collectives/transport/segments.py: anonymous shared memory, which the
kernel frees with the last process that holds or maps it).

The mpiexec tests run this file as their worker:

    mpiexec -n N python tests/test_no_leftovers.py SCENARIO DEVICE

Each rank prints "RANK <rank> <pid> <prefix>" once it has made a host (or
emulated-device) communicator and grown its workspace with a 1 MiB ring
allreduce; in the `killed` scenario every rank then kills itself with
SIGKILL, in `closed` it closes the communicator. The test compares /dev/shm
before and after, restricted to the names the library would make: those
that start with `coll-<pid of a worker>-`.

The other tests, in this process and a child it starts, check that a peer
whose holder died before the segment was opened gets RankFailedError.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mpi_launch
from bench import mpis

THIS = Path(__file__).resolve()
SHM = "/dev/shm"


# -- the worker, under mpiexec ------------------------------------------------------------------------


def worker(scenario, device):
    import numpy as np
    from mpi4py import MPI

    import collectives

    comm = collectives.init(timeout=30.0, device=device)
    prefix = comm._ranks.prefix  # noqa: SLF001 - the test looks at the transport on purpose
    x = np.full(1 << 18, comm.rank + 1, np.float32)      # 1 MiB: every rank's workspace grows
    got = comm.allreduce(x, algorithm="ring")
    assert np.all(got == comm.size * (comm.size + 1) / 2), got[:4]
    print(f"RANK {comm.rank} {os.getpid()} {prefix}", flush=True)
    MPI.COMM_WORLD.Barrier()   # every rank has mapped every peer's workspace
    if scenario == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    visible = [name for name in os.listdir(SHM) if name.startswith(prefix)]
    comm.close()
    MPI.COMM_WORLD.Barrier()
    print(f"OK {scenario} {comm.rank} visible-while-open={visible}", flush=True)


# -- the tests -----------------------------------------------------------------------------------------


def mpiexec():
    """The chosen launcher (tests/mpi_launch.py), None where there is none."""
    try:
        return mpi_launch.mpiexec()
    except pytest.skip.Exception:
        return None


def library_names(pids, names=None):
    """The names (in /dev/shm now, or in `names`) that the library would give
    a communicator of one of `pids` (new_prefix: coll-<pid>-<token>)."""
    starts = tuple(f"coll-{pid}-" for pid in pids)
    return sorted(name for name in (os.listdir(SHM) if names is None else names) if name.startswith(starts))


def run_job(n, scenario, device, limit=180):
    """Run the worker on `n` ranks; (mpiexec's result, {rank: (pid, prefix)})."""
    if mpiexec() is None:
        pytest.skip("no mpiexec beside this Python (pip install '.[test]' brings MPICH's)")
    pytest.importorskip("mpi4py", reason="the multi-process tests need mpi4py: pip install '.[test]'")
    # (the repository's root too: this module, the ranks' script, imports mpi_launch, which imports bench; an
    # empty PYTHONPATH entry gave them the current folder, and a PYTHONPATH of the caller's did not)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(THIS.parent), str(THIS.parent.parent),
                                                       os.environ.get("PYTHONPATH", "")]))
    env.pop("COLLECTIVES_TIMEOUT", None)
    # -disable-auto-cleanup: each rank dies by its own SIGKILL, not by Hydra's hand.
    done = mpi_launch.run_launch([*mpi_launch.mpi_launch(n, "-disable-auto-cleanup"), str(THIS), scenario, device],
                                 limit, env)
    ranks = {int(r): (int(pid), prefix) for r, pid, prefix in
             re.findall(r"RANK (\d+) (\d+) (coll-\d+-[0-9a-f]+)", done.stdout)}
    report = f"exit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    assert sorted(ranks) == list(range(n)), report
    assert len({prefix for _, prefix in ranks.values()}) == 1, report
    return done, ranks, report


def assert_nothing_left(before, ranks, report):
    """Nothing new in /dev/shm since `before` (a listing) under a name of ours."""
    pids = [pid for pid, _ in ranks.values()]
    prefix = ranks[0][1]
    assert prefix.startswith(f"coll-{ranks[0][0]}-"), report    # so coll-<pid>- covers the prefix
    deadline = time.monotonic() + 5.0
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)   # the workers are gone (mpiexec has returned; this is belt and braces)
    left = library_names(pids, set(os.listdir(SHM)) - before)
    assert not left, f"left in {SHM} by the job (prefix {prefix}): {left}\n{report}"


@pytest.mark.mpi
@pytest.mark.parametrize("n,device", [(2, "host"), (4, "host"), (2, "emulated")])
def test_a_job_whose_every_rank_is_killed_leaves_no_file(n, device):
    before = set(os.listdir(SHM))
    done, ranks, report = run_job(n, "killed", device)
    assert "OK killed" not in done.stdout, report   # they did die by SIGKILL
    assert done.returncode != 0 or not mpi_launch.killed_ranks_fail_the_launch(), report
    assert_nothing_left(before, ranks, report)


@pytest.mark.mpi
@pytest.mark.parametrize("device", ["host", "emulated"])
def test_a_closed_job_leaves_no_file_and_made_none(device):
    before = set(os.listdir(SHM))
    done, ranks, report = run_job(2, "closed", device)
    assert done.returncode == 0, report
    oks = re.findall(r"OK closed \d+ visible-while-open=(\[.*?\])", done.stdout)
    assert oks == ["[]", "[]"], report    # not even while the communicator was open
    assert_nothing_left(before, ranks, report)


@pytest.mark.skipif(not os.path.isdir(SHM), reason="no /dev/shm")
def test_mpichs_files_that_no_process_maps_are_removed_and_mapped_ones_kept():
    """What the session's end does (conftest.py): MPICH's files that killed
    ranks left behind go; one a live process maps, and one older than the
    run, stay."""
    import mmap

    since = time.time() - 1
    names = [f"mpich_shm_collectives_test_{os.getpid()}_{what}" for what in ("orphan", "mapped", "older")]
    paths = [Path(SHM) / name for name in names]
    for path in paths:
        path.write_bytes(b"\0" * 4096)
    os.utime(paths[2], (since - 60, since - 60))
    try:
        with open(paths[1], "r+b") as f, mmap.mmap(f.fileno(), 4096):
            removed = mpis.remove_orphaned_mpich_segments(since)
        assert names[0] in removed and names[1] not in removed and names[2] not in removed, removed
        assert [path.exists() for path in paths] == [False, True, True]
    finally:
        for path in paths:
            path.unlink(missing_ok=True)


# -- a holder that died: in this process, against a child ------------------------------------------

CHILD = r"""
import sys
from collectives.transport.protocol import new_prefix
from collectives.transport.segments import HostMemory
from collectives.transport.shm import ShmRank
what = sys.argv[1]
if what == "segment":
    segment = HostMemory.create(new_prefix() + "-r1-g1", 1 << 16)
    segment.buf[:5] = b"hello"
    print(segment.handle.decode(), flush=True)
else:
    rank = ShmRank(0, 2, new_prefix())
    if what == "workspace":
        rank.group.ensure_capacity(1 << 20)
    print(rank.prefix, flush=True)
sys.stdin.readline()   # until the test kills it
"""


class Child:
    def __init__(self, what):
        env = dict(os.environ)
        env.pop("COLLECTIVES_TIMEOUT", None)
        self.process = subprocess.Popen([sys.executable, "-c", CHILD, what], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=env)
        self.line = self.process.stdout.readline().strip()
        assert self.line, "the child printed nothing"

    def kill(self, reap):
        self.process.send_signal(signal.SIGKILL)
        if reap:
            self.process.wait(10)
        else:   # a zombie until reaped: dead, and holding nothing
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                with open(f"/proc/{self.process.pid}/stat") as stat:
                    if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                        break
                time.sleep(0.01)

    def close(self):
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)
        self.process.stdin.close()
        self.process.stdout.close()


@pytest.fixture
def child():
    made = []

    def start(what):
        made.append(Child(what))
        return made[-1]

    yield start
    for c in made:
        c.close()


def test_a_segment_is_shared_across_processes_with_no_file_and_outlives_its_holder_in_its_peers(child):
    from collectives.transport.segments import HostMemory

    holder = child("segment")
    assert not library_names([holder.process.pid])
    peer = HostMemory.open(holder.line.encode().ljust(64, b"\0"))
    try:
        assert bytes(peer.buf[:5]) == b"hello"
        holder.kill(reap=True)
        peer.buf[5:7] = b"!!"
        assert bytes(peer.buf[:7]) == b"hello!!"   # a mapping keeps the memory
    finally:
        HostMemory.release(peer, own=False)
    assert not library_names([holder.process.pid])


@pytest.mark.parametrize("reap", [False, True], ids=["zombie", "reaped"])
def test_a_segment_whose_holder_died_before_it_was_opened_raises_rank_failed(child, reap):
    from collectives.errors import RankFailedError
    from collectives.transport.segments import HostMemory

    holder = child("segment")
    holder.kill(reap)
    start = time.perf_counter()
    with pytest.raises(RankFailedError, match=f"process {holder.process.pid}.*exited"):
        HostMemory.open(holder.line.encode())
    assert time.perf_counter() - start < 1.0


def test_a_holder_in_the_kernels_exit_path_counts_as_exited():
    # Between closing its descriptors and turning into a zombie, a dying
    # process is still "R" or "D"; only its PF_EXITING flag says it is going.
    from collectives.transport.segments import PF_EXITING, exited, gone_or_going

    def stat(state, flags, name=b"python3"):
        return b"4242 (" + name + b") " + state + b" 1 4242 4242 0 -1 " + str(flags).encode() + b" 0 0 0 0"

    assert not gone_or_going(stat(b"R", 0x400100))
    assert gone_or_going(stat(b"R", 0x400100 | PF_EXITING))
    assert gone_or_going(stat(b"D", PF_EXITING, name=b"a) R 1 2 (odd"))
    assert not gone_or_going(stat(b"S", 0x400000, name=b"x) Z 1 (y"))
    assert gone_or_going(stat(b"Z", 0))
    assert not exited(os.getpid())


def test_rank_0_dead_before_a_peer_attached_raises_rank_failed(child):
    from collectives.errors import RankFailedError
    from collectives.transport.shm import ShmRank

    rank0 = child("control")
    rank0.kill(reap=True)
    with pytest.raises(RankFailedError, match="exited"):
        ShmRank(1, 2, rank0.line)
    assert not library_names([rank0.process.pid])


def test_a_peer_whose_workspace_holder_died_before_it_was_opened_raises_rank_failed(child):
    from collectives.errors import RankFailedError
    from collectives.transport.shm import ShmRank

    rank0 = child("workspace")
    rank1 = ShmRank(1, 2, rank0.line)
    try:
        assert rank1.group.generation(0) == 1
        rank0.kill(reap=False)
        with pytest.raises(RankFailedError, match="exited"):
            rank1.group.workspace(0)
    finally:
        rank1.close()
    assert not library_names([rank0.process.pid])


def test_a_workspace_released_by_a_rank_leaving_an_aborted_communicator_reports_the_abort():
    # The race of test_hierarchy's killed[0,0,1,1]: rank 0 gave up and closed
    # while rank 1 was about to map rank 0's workspace.
    from collectives.errors import CollectiveError
    from collectives.transport.protocol import new_prefix
    from collectives.transport.shm import ShmRank

    rank0 = ShmRank(0, 2, new_prefix())
    rank1 = ShmRank(1, 2, rank0.prefix)
    try:
        rank0.group.ensure_capacity(1 << 20)
        rank0.group.abort("RankFailedError: rank 3 died before completing the collective")
        rank0.close()
        with pytest.raises(CollectiveError, match="rank 0 aborted the communicator: .*died"):
            rank1.group.workspace(0)
    finally:
        rank1.close()


def test_a_prefix_must_come_from_new_prefix():
    from collectives.errors import InvalidUsageError
    from collectives.transport.shm import ShmRank

    with pytest.raises(InvalidUsageError, match="new_prefix"):
        ShmRank(0, 2, "my-job")


if __name__ == "__main__":
    worker(*sys.argv[1:3])


def test_a_wait_whose_peer_published_then_died_returns():
    # The peer publishes and exits between the wait's ready() and its health
    # check: the wait got what it waited for, and must not report the death.
    from collectives.errors import RankFailedError
    from collectives.transport.protocol import Waiter
    published = []

    def peer_published_then_died():
        published.append(True)
        raise RankFailedError("rank 1 (pid 1) died before completing the collective")

    Waiter(time.perf_counter() + 5).until(lambda: bool(published), lambda: "rank 1", peer_published_then_died)
    assert published
