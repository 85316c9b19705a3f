"""One rank of tests/test_recovery.py: ranks fail, the others shrink and go on.

    mpiexec -disable-auto-cleanup -n N sh -c 'trap "" USR1; python tests/recovery_worker.py SCENARIO ARGS...; exit $?'

(the survivors' way under MPICH's mpiexec: docs/api.md, "Going on after a
failure").

$RECOVERY_DEVICE is what collectives.init(device=...) takes (default "host").
Scenarios (each rank prints "OK <scenario> <rank>" when every check held):

    killed PATH HOW VICTIMS SEED
        every rank makes allreduces in a loop, checking each result; the
        ranks VICTIMS ("1" or "1,2") die at a random moment (SEED) of the
        loop, by HOW: "exit" (os._exit) or "sigkill" (SIGKILL from a thread
        of their own, wherever the rank is). PATH is the allreduce: "fast"
        (1 KiB, the compiled loop), "ring" (the ring plan, the step
        protocol) or "large" (4 MiB, the compiled loop's pipeline). Every
        survivor must raise RankFailedError, shrink to the same membership
        (the ranks not in VICTIMS), and its next allreduce must be bitwise
        right.
    agree       agree on a healthy communicator, then after rank 1 died
                (False: it gave no flag), then on the shrunk one.
    revoke      rank 0 revokes while the others wait in a barrier: they
                raise RevokedError at once (not after the timeout), and all
                shrink to every rank.
    twice       two failures, two shrinks: epochs 1 and 2, old ranks chained.
    shrink_again
                3 ranks shrink; rank 0 makes the shrunk communicator only
                once rank 1's shrink timed out (1 s) and it called it
                again: that second call goes on with a new round, rank 2
                (10 s) follows it there, and all end on [0, 1, 2].
    stalled PATH
                rank 1 stops (SIGSTOP): the others time out and shrink
                without it, then continue it; its own shrink raises
                RankExcludedError.
    in_shrink SEED
                rank 1 dies, then rank 2 at a random moment of its shrink:
                the survivors shrink until a collective passes, and end on
                the same ranks.
    maker_dies_in_barrier
                3 ranks shrink; rank 0, the maker of the shrunk
                communicator, dies once it and rank 1 are in the round's
                barrier, and rank 2 maps it only after that (so it fails
                the round before entering the barrier): ranks 1 and 2 must
                both go on to the next round and end on [1, 2] at once.
"""

import os
import signal
import sys
import threading
import time

import numpy as np

import collectives
from cases import run_scenario
from collectives import CollectiveTimeoutError, RankExcludedError, RankFailedError, RevokedError

TIMEOUT = 10.0
COUNTS = {"fast": 256, "ring": 256, "large": 1 << 20}


def allreduce_once(comm, path, values):
    """One allreduce of `values` (a float per rank of `comm`) on PATH; checks the sum bitwise."""
    x = np.full(COUNTS[path], values[comm.rank], np.float32)
    out = comm.allreduce(x, algorithm="ring" if path == "ring" else "auto")
    expected = np.float32(sum(values))
    assert np.array_equal(out, np.full_like(x, expected)), (out[:4], expected)


def die(how):
    if how == "exit":
        os._exit(0)
    os.kill(os.getpid(), signal.SIGKILL)


def until_failure(comm, path, values):
    """Allreduces until one raises; returns the error."""
    for _ in range(1_000_000):
        try:
            allreduce_once(comm, path, values)
        except collectives.CollectiveError as error:
            return error
    raise AssertionError("no allreduce failed, yet a rank was meant to die")


def check_shrunk(comm, shrunk, members, epoch, staged_max=None):
    """`staged_max`: the loop's in `comm` (where it had one), which the
    shrunk communicator keeps, measuring nothing while the survivors recover."""
    assert shrunk.size == len(members), (shrunk.size, members)
    loop = getattr(shrunk._ranks, "fast", None)   # noqa: SLF001
    if staged_max is not None and loop is not None:
        assert loop.staged_max == staged_max and loop.probe_seconds is None, (loop.staged_max, staged_max)
    assert shrunk.old_ranks == tuple(members), (shrunk.old_ranks, members)
    assert shrunk.old_ranks[shrunk.rank] == comm.rank
    assert shrunk.epoch == epoch, shrunk.epoch
    assert comm.closed
    values = [float(old + 1) for old in shrunk.old_ranks]
    for path in ("fast", "ring", "large"):
        allreduce_once(shrunk, path, values)


def scenario_killed(comm, path, how, victims, seed):
    victims = [int(v) for v in victims.split(",")]
    values = [float(r + 1) for r in range(comm.size)]
    allreduce_once(comm, path, values)   # every rank past its first call (which may compile or map)
    loop = getattr(comm._ranks, "fast", None)   # noqa: SLF001
    staged_max = None if loop is None else loop.staged_max
    if comm.rank in victims:
        rng = np.random.default_rng([int(seed), comm.rank])
        delay = float(rng.uniform(0, 0.05))
        if how == "exit":
            time.sleep(delay)
            die(how)
        threading.Timer(delay, die, (how,)).start()
    error = until_failure(comm, path, values)
    if comm.rank in victims:   # another victim died first: this one must not join the shrink
        die(how)
    assert isinstance(error, RankFailedError), f"{type(error).__name__}: {error}"
    start = time.perf_counter()
    shrunk = comm.shrink()
    took = time.perf_counter() - start
    check_shrunk(comm, shrunk, [r for r in range(comm.size) if r not in victims], 1, staged_max)
    print(f"SHRINK {took * 1e3:.1f} ms rank {comm.rank}", flush=True)
    shrunk.close()


def scenario_in_shrink(comm, seed):
    """Rank 1 dies in the loop; rank 2 at a random moment from the start of
    its shrink (before, during or after the round). The survivors shrink
    until a collective passes: they must end on the same ranks, 0 and 3."""
    values = [float(r + 1) for r in range(comm.size)]
    allreduce_once(comm, "fast", values)
    if comm.rank == 1:
        time.sleep(float(np.random.default_rng([int(seed), 1]).uniform(0, 0.02)))
        die("exit")
    assert isinstance(until_failure(comm, "fast", values), RankFailedError)
    if comm.rank == 2:
        threading.Timer(float(np.random.default_rng([int(seed), 2]).uniform(0, 0.01)), die, ("sigkill",)).start()
    current, original = comm.shrink(), list(range(comm.size))   # original[r]: current rank r's rank in comm
    original = [original[old] for old in current.old_ranks]
    # Until every member agrees that rank 2 has had the time to die (it
    # dies within 10 ms): each failure shrinks again.
    stop = time.perf_counter() + 0.2
    while True:
        try:
            allreduce_once(current, "fast", [float(r + 1) for r in original])
        except RankFailedError:
            current = current.shrink()
            original = [original[old] for old in current.old_ranks]
            continue
        if current.agree(time.perf_counter() > stop):
            break
    print(f"MEMBERS {original} rank {comm.rank}", flush=True)
    assert original == [0, 3], original
    current.close()


def gone(pid):
    """Whether process `pid` has exited (a zombie, or reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except OSError:
        return True


def scenario_maker_dies_in_barrier(comm):
    """The interleaving of a chaos trial that once ended a survivor (forced
    here, in each rank's process): rank 1 waited in the round's barrier for
    rank 2, which was alive but had left the round (it could not map the
    dead maker's segment), until the timeout; rank 2 waited for rank 1 in
    the next round as long, and went on alone."""
    from collectives.transport import protocol
    comm.barrier()
    old = comm._ranks   # noqa: SLF001 - the test steers this rank's part of the round
    if comm.rank == 0:
        wait_for = protocol.ProcessGroup._wait_for

        def wait_then_die(group, peer, phases_done, waiter, *rest):
            # In the new communicator's barrier, after publishing its entry:
            # once rank 1 has entered too, die.
            if group is not old.group and phases_done >= 1:
                wait_for(group, 1, phases_done, waiter, *rest)
                die("sigkill")
            return wait_for(group, peer, phases_done, waiter, *rest)
        protocol.ProcessGroup._wait_for = wait_then_die
    elif comm.rank == 2:
        remake = old.remake

        def remake_after_the_maker_died(*arguments):
            # Until rank 0 is a zombie or reaped: an exiting process still
            # holds its descriptors for a moment, and a peer could map.
            end = time.perf_counter() + comm.timeout
            while not gone(old.group.pid_of(0)) and time.perf_counter() < end:
                time.sleep(1e-3)
            return remake(*arguments)
        old.remake = remake_after_the_maker_died
    comm.timeout = 5.0   # what the old code's ranks waited out before rank 1 raised and rank 2 went on alone
    shrunk = comm.shrink()
    check_shrunk(comm, shrunk, [1, 2], 1)
    shrunk.close()


def scenario_shrink_again(comm):
    """A shrink that timed out leaves the communicator open: shrink() again
    goes on with the next round, with the ranks that are still there. (Only
    rank 1 times out: had rank 2 too, it could come to the next round with
    its deadline spent, and decide without rank 0 at once.)"""
    from collectives.transport.layout import JOINED
    comm.barrier()
    old = comm._ranks   # noqa: SLF001 - the test steers this rank's part of the round
    if comm.rank == 0:
        remake, rows = old.remake, old._recovery()._rows   # noqa: SLF001

        def remake_once_the_others_came_again(*arguments):
            # Until ranks 1 and 2 joined round 1: rank 1 timed out waiting
            # for this rank's communicator of round 0 and called shrink()
            # again; rank 2 saw it leave the round, and followed.
            end = time.perf_counter() + 8
            while min(int(rows[q, JOINED]) for q in (1, 2)) < 2 and time.perf_counter() < end:
                time.sleep(1e-3)
            old.remake = remake
            return remake(*arguments)
        old.remake = remake_once_the_others_came_again
    elif comm.rank == 1:
        comm.timeout = 1.0
        try:
            comm.shrink()
        except CollectiveTimeoutError as error:
            assert not isinstance(error, RankFailedError) and not comm.closed, error
        else:
            raise AssertionError("the shrink met without rank 0's communicator")
        comm.timeout = TIMEOUT
    shrunk = comm.shrink()
    check_shrunk(comm, shrunk, [0, 1, 2], 1)
    shrunk.close()


def scenario_stalled(comm, path):
    """Rank 1 stops (SIGSTOP) after a first call: the others time out, shrink
    without it (a stopped process is not waited for), and continue it; once
    running it raises too, and its shrink says it was left out."""
    values = [float(r + 1) for r in range(comm.size)]
    allreduce_once(comm, path, values)
    comm.timeout = 1.0
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        error = until_failure(comm, path, values)   # the others aborted while it was stopped
        assert isinstance(error, CollectiveTimeoutError), f"{type(error).__name__}: {error}"
        try:
            comm.shrink()
        except RankExcludedError as excluded:
            assert "left out" in str(excluded), excluded
            return
        raise AssertionError("the stopped rank was let into the shrunk communicator")
    error = until_failure(comm, path, values)
    assert type(error) is CollectiveTimeoutError, f"{type(error).__name__}: {error}"
    stopped = comm._ranks.group.pid_of(1)   # noqa: SLF001 - the test's way to continue it
    shrunk = comm.shrink()
    check_shrunk(comm, shrunk, [0, 2], 1)
    if shrunk.rank == 0:
        os.kill(stopped, signal.SIGCONT)
    shrunk.close()


def scenario_agree(comm):
    assert comm.agree(True) is True
    assert comm.agree(comm.rank != 1) is False
    assert comm.agree(1) is True
    if comm.rank == 1:
        os._exit(0)
    assert comm.agree(True) is False    # rank 1 died before giving its flag
    shrunk = comm.shrink()
    assert shrunk.agree(True) is True
    assert shrunk.agree(shrunk.rank != 0) is False
    check_shrunk(comm, shrunk, [r for r in range(comm.size) if r != 1], 1)
    shrunk.close()


def scenario_revoke(comm):
    comm.barrier()
    if comm.rank == 0:
        time.sleep(0.3)
        comm.revoke()
        comm.revoke()   # again: nothing more
    else:
        start = time.perf_counter()
        try:
            comm.barrier()
        except RevokedError as error:
            assert "rank 0 revoked" in str(error), error
            assert time.perf_counter() - start < 3, "the revoke reached this rank only after its timeout"
        else:
            raise AssertionError("the barrier completed although rank 0 revoked the communicator")
    shrunk = comm.shrink()
    check_shrunk(comm, shrunk, list(range(comm.size)), 1)
    shrunk.close()


def scenario_twice(comm):
    values = [float(r + 1) for r in range(comm.size)]
    allreduce_once(comm, "fast", values)
    if comm.rank == 1:
        os._exit(0)
    assert isinstance(until_failure(comm, "fast", values), RankFailedError)
    first = comm.shrink()
    check_shrunk(comm, first, [r for r in range(comm.size) if r != 1], 1)
    if first.rank == 1:   # old rank 2
        os._exit(0)
    values = [float(old + 1) for old in first.old_ranks]
    assert isinstance(until_failure(first, "ring", values), RankFailedError)
    second = first.shrink()
    check_shrunk(first, second, [r for r in range(first.size) if r != 1], 2)
    assert [first.old_ranks[r] for r in second.old_ranks] == [r for r in range(comm.size) if r not in (1, 2)]
    second.close()


def main():
    scenario, arguments = sys.argv[1], sys.argv[2:]
    comm = collectives.init(timeout=TIMEOUT, device=os.environ.get("RECOVERY_DEVICE", "host"))
    rank = comm.rank
    run_scenario(lambda: globals()[f"scenario_{scenario}"](comm, *arguments), ranks_leave=True)
    print(f"OK {scenario} {rank}", flush=True)
    os._exit(0)   # MPI_Finalize would wait for the dead ranks


if __name__ == "__main__":
    main()
