"""One rank of tests/test_ll_mpi.py, started N times under mpiexec with
$COLLECTIVES_ONE_KERNEL_ALLREDUCE=1:

    mpiexec -n N python tests/ll_worker.py SCENARIO [DEVICE]

DEVICE is "emulated" (the default, CI) or "cuda" (CuPy arrays on a GPU;
several processes may share one under MPS).

"bits": every dtype and op, counts 0, 1, odd, and up to the LL capacity, in
place and out of place, then a long run of calls of random sizes (both slot
sets reused many times, generations far past 2) with a plan-path call mixed
in: every result has the bits the NumPy interpreter gives (the `direct`
plan on host ranks in this process), every call of the LL's kind ran as one
kernel (the rank's LL generation counts them, its step-protocol counter
does not move), and all ranks hold the same bytes.
"stalled", "killed": rank FAILING stops calling, or dies, after one call;
every other rank must raise CollectiveTimeoutError (within the timeout and
a second) or RankFailedError (within 1.5 s), naming it.
"mismatch": rank FAILING's second call has another count: every rank is
told of a different call (InvalidUsageError) well before the timeout.

Each rank prints "OK <scenario> <rank>" when every check held.
"""

import os
import sys
import time

import numpy as np
from mpi4py import MPI

import collectives
from cases import DTYPES, OPS, expect_a_different_call, run_scenario
from collectives import CollectiveTimeoutError, RankFailedError, kernels
from collectives.transport.layout import COUNTER
from peer_failure_worker import FAILING, TIMEOUT, expect


def rank_input(seed, rank, dtype, count):
    """Random bits for integers, random values for floats (no NaN: bits compare)."""
    rng = np.random.default_rng([seed, rank, count])
    if dtype.kind in "iu":
        return rng.integers(0, 256, count * dtype.itemsize, dtype=np.uint8).view(dtype)
    return (rng.standard_normal(count) * 4).astype(dtype)


DEVICE = "emulated"


def on_device(array):
    if DEVICE == "cuda":
        import cupy
        return cupy.asarray(array)
    return array


def on_host(array):
    if DEVICE == "cuda":
        import cupy
        return cupy.asnumpy(array)   # on the current stream: after the call's kernel
    return array


class Checker:
    """Runs an allreduce on `comm` and on in-process host ranks, compares."""

    def __init__(self, comm, reference):
        self.comm, self.reference = comm, reference
        self.ll = comm._ranks._ll   # noqa: SLF001 - the test looks inside on purpose
        self.calls = 0              # calls with at least one element: the LL's generations
        self.seed = 0

    def allreduce(self, dtype, op, count, in_place, algorithm="auto"):
        comm, n, r = self.comm, self.comm.size, self.comm.rank
        self.seed += 1
        inputs = [rank_input(self.seed, q, dtype, count) for q in range(n)]
        x = on_device(inputs[r].copy())
        result = comm.allreduce(x, op=op, algorithm=algorithm) if in_place else \
            comm.allreduce(x, op=op, out=on_device(np.empty(count, dtype)), algorithm=algorithm)
        got = on_host(result)
        want = self.reference.allreduce(inputs, op=op, algorithm="direct" if algorithm == "auto" else algorithm)[r]
        case = f"allreduce {dtype} {op} count={count} in_place={in_place} algorithm={algorithm}"
        assert got.tobytes() == want.tobytes(), f"{case}: {got[:6]} != {want[:6]}"
        assert not in_place or result is x, case
        if algorithm == "auto" and count:
            self.calls += 1
        assert self.ll._generation == self.calls, (case, self.ll._generation, self.calls)   # noqa: SLF001
        return got


def scenario_bits(comm):
    group = comm._ranks.group   # noqa: SLF001
    counter = int(group._rows[comm.rank, COUNTER])   # noqa: SLF001
    with collectives.Communicator.local(comm.size) as reference:
        check = Checker(comm, reference)
        in_place = False
        for dtype in DTYPES:
            capacity = kernels.LL_MAX_BYTES // dtype.itemsize
            for op in OPS:
                for count in (0, 1, 7, 1001, capacity):
                    in_place = not in_place
                    check.allreduce(dtype, op, count, in_place)
        assert int(group._rows[comm.rank, COUNTER]) == counter, "a call took the step protocol"   # noqa: SLF001
        rng = np.random.default_rng(7)   # the same on every rank
        for i in range(150):
            dtype = DTYPES[rng.integers(len(DTYPES))]
            count = int(rng.integers(0, kernels.LL_MAX_BYTES // dtype.itemsize + 1)) if i % 10 == 0 else \
                int(rng.integers(1, 64))
            if i == 75:   # the step protocol in between, then the LL again
                check.allreduce(np.dtype(np.float32), "sum", 5000, False, algorithm="ring")
            last = check.allreduce(dtype, OPS[rng.integers(len(OPS))], count, bool(rng.integers(2)))
    everyone = MPI.COMM_WORLD.allgather(last.tobytes())
    assert all(b == everyone[0] for b in everyone), "ranks disagree"
    comm.synchronize()
    comm.barrier()


def one_call(comm):
    """An allreduce and synchronize(): on a GPU the call returns once queued,
    and a kernel that gave up is reported at synchronize() (or the next call)."""
    x = on_device(np.ones(1000, np.float32))

    def run():
        comm.allreduce(x)
        comm.synchronize()
    return run


def scenario_stalled(comm):
    run = one_call(comm)
    run()
    if comm.rank == FAILING:
        time.sleep(TIMEOUT + 1.5)   # the others gave up by now, and aborted the communicator
        expect(CollectiveTimeoutError, run, names=["aborted"], within=0.5)
        return
    expect(CollectiveTimeoutError, run, names=[f"waiting for rank {FAILING}", "allreduce"], within=TIMEOUT + 1.0)


def scenario_mismatch(comm):
    one_call(comm)()
    count = 1001 if comm.rank == FAILING else 1000
    x = on_device(np.ones(count, np.float32))
    start = time.perf_counter()
    expect_a_different_call(lambda: (comm.allreduce(x), comm.synchronize()), "an allreduce of another count")
    assert time.perf_counter() - start < TIMEOUT / 2, "the mismatch was found by the timeout"


def scenario_killed(comm):
    run = one_call(comm)
    run()
    if comm.rank == FAILING:
        os._exit(0)
    expect(RankFailedError, run, names=[f"rank {FAILING} (pid", "died"], within=1.5)


def main():
    global DEVICE
    scenario = sys.argv[1]
    DEVICE = sys.argv[2] if len(sys.argv) > 2 else "emulated"
    comm = collectives.init(timeout=TIMEOUT, device=DEVICE)
    assert comm._ranks._ll is not None, "run with COLLECTIVES_ONE_KERNEL_ALLREDUCE=1"   # noqa: SLF001
    killed = scenario == "killed"
    run_scenario(lambda: globals()[f"scenario_{scenario}"](comm), ranks_leave=killed)
    print(f"OK {scenario} {comm.rank}", flush=True)
    if killed:
        os._exit(0)   # MPI_Finalize would wait for the dead rank
    comm.close()


if __name__ == "__main__":
    main()
