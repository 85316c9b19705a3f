"""One rank of tests/test_peer_failures.py, started N times under mpiexec.

    mpiexec -n N python tests/peer_failure_worker.py EVENT PATH DEVICE

EVENT is what happens to rank FAILING (1) in the middle of a run of calls:
"stalled" (it stops calling for longer than the timeout) or "killed" (it
dies, os._exit). PATH is the call every other rank is waiting in:
"fast" (allreduce of one NumPy array with `auto`: host ranks run it in the
compiled loop, fastpath.py), "ring" (allreduce by the ring plan, run by the
step protocol, protocol.py: most ranks wait on a live neighbour that waits
on rank FAILING, so they learn of the failure through its abort) or
"barrier". DEVICE is what collectives.init(device=...) takes.

Every other rank must raise the same class for the same event, whether it
waited for rank FAILING itself or learnt of it from a peer's abort:
CollectiveTimeoutError (not RankFailedError) for a stall, naming the stalled
rank and the call; RankFailedError for a death, naming the dead rank and the
call. Each rank prints "OK <event> <rank>" when every check held.
"""

import os
import sys
import time

import numpy as np

import collectives
from cases import gave_up_on, run_scenario, stall_until_the_others_gave_up
from collectives import CollectiveTimeoutError, RankFailedError

TIMEOUT = 2.0
# What init may wait: ranks under Open MPI's mpirun on a loaded machine
# came to start-up more than TIMEOUT apart (2 of 14 launches timed out
# there once); the calls then wait TIMEOUT (comm.timeout).
STARTUP_TIMEOUT = 30.0
# What the calls wait once a stalled scenario's ranks have all made one
# call (the first may load or compile what it runs): the wait is the
# scenario's whole cost.
STALL_TIMEOUT = 1.0
FAILING = 1
COUNT = 1000


def call(comm, path):
    """The call every rank makes, and its name in messages."""
    if path == "barrier":
        return comm.barrier, "barrier"
    x = np.ones(COUNT, np.float32)
    algorithm = "auto" if path == "fast" else "ring"
    return (lambda: comm.allreduce(x, algorithm=algorithm)), "allreduce"


def expect(error_class, run, *, absent_from=None, names, within):
    """Run `run`; it must raise `error_class` (exactly that class, so a
    timeout is not mistaken for a death) within `within` seconds, with a
    message that holds every string of `names`."""
    start = time.perf_counter()
    try:
        run()
    except Exception as error:   # noqa: BLE001 - the class is what is checked
        elapsed = time.perf_counter() - start
        message = f"{type(error).__name__}: {error}"
        assert type(error) is error_class, message
        assert all(name in str(error) for name in names), (names, message)
        assert elapsed < within, f"raised after {elapsed:.1f} s, expected within {within} s: {message}"
        return
    raise AssertionError(f"the call completed although rank {FAILING} failed")


def scenario_stalled(comm, path):
    run, what = call(comm, path)
    run()   # one call that every rank makes: the failure comes in the middle of a run
    comm.timeout = STALL_TIMEOUT
    if comm.rank == FAILING:
        stall_until_the_others_gave_up(FAILING, longest=STALL_TIMEOUT + 1.5)
        # By now the others gave up and aborted: this rank's next call
        # raises at once, as a timeout too.
        expect(CollectiveTimeoutError, run, names=["aborted"], within=0.5)
        return
    # Every other rank: the stalled rank is named, whether this rank waited
    # for it or for a peer that waited for it (the note of the ranks that
    # never entered the call, carried in the abort's reason).
    expect(CollectiveTimeoutError, run, names=[f"rank {FAILING} has not entered call", what], within=STALL_TIMEOUT + 1.5)
    gave_up_on(FAILING)


def scenario_killed(comm, path):
    run, what = call(comm, path)
    run()
    if comm.rank == FAILING:
        os._exit(0)
    # Learnt from the dead rank's pid (by this rank or the peer whose abort
    # reaches it) long before the timeout.
    expect(RankFailedError, run, names=[f"rank {FAILING} (pid", "died", what], within=1.5)


def main():
    event, path, device = sys.argv[1:4]
    comm = collectives.init(timeout=STARTUP_TIMEOUT, device=device)
    comm.timeout = TIMEOUT
    if path == "fast":   # the compiled loop must be what runs the call
        assert comm.chosen_algorithm("allreduce", COUNT * 4, dtype=np.float32).path == "compiled_loop"
    run_scenario(lambda: globals()[f"scenario_{event}"](comm, path), ranks_leave=event == "killed")
    print(f"OK {event} {comm.rank}", flush=True)
    if event == "killed":
        os._exit(0)   # MPI_Finalize would wait for the dead rank
    comm.close()


if __name__ == "__main__":
    main()
