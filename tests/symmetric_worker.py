"""One rank of tests/test_symmetric.py's multi-process tests, started N
times under mpiexec with $COLLECTIVES_ONE_KERNEL_ALLREDUCE=1:

    mpiexec -n N python tests/symmetric_worker.py SCENARIO [DEVICE]

Calls on symmetric memory (Communicator.alloc, executors/symmetric.py):
each rank's step kernel reads the peers' inputs and writes their outputs
between two device barriers.

"bits": every collective, dtypes and ops, sizes past the one-kernel (LL)
path's capacity, in place and out of place (given outputs in symmetric
memory, reduce_scatter's own block, allgather's block of its output),
roots varying: every result has the NumPy interpreter's bits; every call
ran on symmetric memory (the barrier word counts 2 phases per call) and
none took the step protocol (its counter does not move); calls on plain
small calls on symmetric memory take the LL path, compressed ones the step
protocol; reduce_scatter's output and
allgather's input, which only their rank touches, may be plain arrays; an
output that overlaps its input goes through staging; alloc is refused
while capturing.
"staged": the same on plain arrays, through the staging buffers (no step
protocol), sizes that make the buffers grow and shrink back, outputs that
overlap their inputs; a growth refused while capturing.
"sizes": ranks asking alloc for different sizes all raise InvalidUsageError.
"mismatch": rank FAILING's input lies at another offset: every rank is told
of a different call (InvalidUsageError), well before the timeout, and no
rank's memory was written.
"staged_mismatch": the same on plain arrays (through staging): no output
written either.
"mixed": rank FAILING passes a plain array where its peers pass symmetric
memory: every rank is told of a different call (not a timeout).
"growth_fails": rank FAILING cannot allocate a larger staging buffer:
every other rank raises the abort well before the timeout.
"killed": rank FAILING dies after one call: every other rank raises
RankFailedError naming it within 1.5 s.
"stalled": rank FAILING stops calling after one call: every other rank
raises CollectiveTimeoutError naming it, and no rank's memory was written
by the failed call.
"graph": calls on symmetric memory and on plain arrays (staged) captured
in a graph and replayed with new inputs, direct calls in between: the
interpreter's bits.

Each rank prints "OK <scenario> <rank>" when every check held. With
$COLLECTIVES_TEST_BROKEN_KERNELS set to a folder of kernel sources, the
emulated device runs those instead (the tests break ll_barrier on purpose).
"""

import os
import sys
import time

import numpy as np
from mpi4py import MPI

import collectives
from cases import expect_a_different_call, expected, rank_input
from collectives import InvalidUsageError, RankFailedError, kernels
from collectives.transport.layout import COUNTER
import ll_worker
from ll_worker import stop_on_failing_rank
from peer_failure_worker import FAILING, STALL_TIMEOUT, TIMEOUT, expect

DEVICE = "emulated"
BROKEN_KERNELS = "COLLECTIVES_TEST_BROKEN_KERNELS"   # a folder of kernel sources the emulated device builds instead
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")


def to_host(array):
    if DEVICE == "cuda":
        import cupy
        return cupy.asnumpy(array)
    return np.asarray(array)


def write(array, values):
    if DEVICE == "cuda":
        import cupy
        array[...] = cupy.asarray(values)
    else:
        array[...] = values


def barrier_phases(comm):
    """The rank's barrier count (its word in the LL area), once its work is done."""
    area = comm._ranks.protocol.own_area
    if area is None:
        return 0
    word = comm._ranks.device.download(area.address + kernels.LL_BARRIER_OFFSET, 8)
    return int(np.frombuffer(word, np.uint64)[0]) & 0xFFFFFFFF


class Arrays:
    """A call's arrays, x (the input) and out, laid out as the collective and
    `in_place` say: in symmetric memory, or plain arrays (`symmetric` False)."""

    def __init__(self, comm, collective, dtype, count, in_place, symmetric=True):
        n, r = comm.size, comm.rank
        make = comm.alloc if symmetric else plain
        self.elements = n * count if collective == "reduce_scatter" else count
        if collective in ("allreduce", "broadcast", "reduce") and in_place:
            self.x = self.out = make(self.elements, dtype)
        elif collective == "reduce_scatter":
            self.x = make(self.elements, dtype)
            self.out = self.x[r * count:(r + 1) * count] if in_place else make(count, dtype)
        elif collective == "allgather":
            self.out = make(n * count, dtype)
            self.x = self.out[r * count:(r + 1) * count] if in_place else make(count, dtype)
        else:
            self.x, self.out = make(count, dtype), make(count, dtype)

    def call(self, comm, collective, op, root, algorithm="auto"):
        x, out = self.x, self.out
        if collective == "allreduce":
            return comm.allreduce(x, op=op, out=None if out is x else out, algorithm=algorithm)
        if collective == "reduce_scatter":
            return comm.reduce_scatter(x, op=op, out=out, algorithm=algorithm)
        if collective == "allgather":
            return comm.allgather(x, out=out, algorithm=algorithm)
        if collective == "broadcast":
            return comm.broadcast(x, root=root, out=None if out is x else out, algorithm=algorithm)
        return comm.reduce(x, root=root, op=op, out=None if out is x else out, algorithm=algorithm)


def check_call(comm, reference, arrays, collective, dtype, op, root, seed, algorithm="auto"):
    """Fill the input, call, compare with the interpreter's plan of the call."""
    n, r = comm.size, comm.rank
    inputs = [rank_input(seed, q, dtype, arrays.elements) for q in range(n)]
    write(arrays.x, inputs[r])
    rooted_out_of_place = collective in ("broadcast", "reduce") and arrays.out is not arrays.x
    if rooted_out_of_place:   # what a reduce's other ranks keep in out
        untouched = rank_input(seed + 1000, r, dtype, arrays.elements)
        write(arrays.out, untouched)
    result = arrays.call(comm, collective, op, root, algorithm)
    assert result is arrays.out or collective == "reduce_scatter" and result.base is not None, \
        f"{collective}: the result is not the array given"
    picked = comm.chosen_algorithm(collective, arrays.elements * dtype.itemsize, root=root) \
        if algorithm == "auto" else algorithm
    want = expected(reference, collective, inputs, op, root, picked)[r]
    if rooted_out_of_place:
        assert to_host(arrays.x).tobytes() == inputs[r].tobytes(), f"{collective}: x changed out of place"
        if collective == "reduce" and r != root:
            want = untouched
    got = to_host(arrays.out)
    case = f"{collective} {dtype} {op} elements={arrays.elements} root={root}"
    assert got.tobytes() == want.tobytes(), f"{case}: {got[:6]} != {want[:6]}"


def beyond_the_ll(collective, n, dtype, extra):
    """A count (reduce_scatter: per block) that the LL path does not take."""
    lines = kernels.LL_MAX_BYTES // 8 // (n if collective == "reduce_scatter" else 1)
    return lines * 8 // dtype.itemsize + extra


def cases():
    """The (dtype, op) pairs every_collective runs. A function, not a
    constant: the scenarios that do not run them (and paths_worker.py, which
    imports this module) need not import ml_dtypes for bfloat16, 0.6 CPU-s a
    process with ml_dtypes 0.7."""
    return [(np.dtype(np.float32), "sum"), (np.dtype(np.float16), "avg"), (np.dtype(np.int8), "max"),
            (np.dtype(np.float64), "prod"), (np.dtype("int32"), "min"), (collectives.ops.bfloat16(), "sum")]


def every_collective(comm, reference, symmetric):
    """Every collective, the cases()' dtypes and ops, beyond the LL, in place
    and out of place, each call made twice on its arrays: the interpreter's
    bits. Returns the calls made."""
    n, made = comm.size, 0
    for k, collective in enumerate(COLLECTIVES):
        for j, (dtype, op) in enumerate(cases()):
            extra = (1, 13, 4096 + 3)[(j + k) % 3]   # odd tails, and chunks past one
            count = beyond_the_ll(collective, n, dtype, extra)
            for in_place in (False, True):
                arrays = Arrays(comm, collective, dtype, count, in_place, symmetric)
                root = (j + in_place) % n
                check_call(comm, reference, arrays, collective, dtype, op, root, seed=100 * k + 10 * j + in_place)
                check_call(comm, reference, arrays, collective, dtype, op, root, seed=7 + made)   # a repeat
                made += 2
    return made


def step_count(comm):
    return int(comm._ranks.group._rows[comm.rank, COUNTER])   # noqa: SLF001 - the step protocol's calls


def scenario_bits(comm):
    n = comm.size
    counter = step_count(comm)
    with collectives.Communicator.local(n) as reference:
        made = every_collective(comm, reference, symmetric=True)
        # two_shot, what `auto` picks for large allreduces of 3 ranks and more, has direct's bits: it runs here.
        dtype = np.dtype(np.float32)
        arrays = Arrays(comm, "allreduce", dtype, beyond_the_ll("allreduce", n, dtype, 5), False)
        check_call(comm, reference, arrays, "allreduce", dtype, "avg", 0, seed=400, algorithm="two_shot")
        made += 1
        # Arrays that only their own rank touches may lie anywhere: reduce_scatter's
        # output, allgather's input.
        for collective in ("reduce_scatter", "allgather"):
            count = beyond_the_ll(collective, n, dtype, 3)
            arrays = Arrays(comm, collective, dtype, count, False)
            if collective == "reduce_scatter":
                arrays.out = plain(count, dtype)
            else:
                arrays.x = plain(count, dtype)
            check_call(comm, reference, arrays, collective, dtype, "sum", 0, seed=500 + made)
            made += 1
        assert step_count(comm) == counter, "a call took the step protocol"
        comm.synchronize()
        assert barrier_phases(comm) == 2 * made, (barrier_phases(comm), made)
        # An output overlapping its input (not the same array) would race in
        # one pass over the arrays: it goes through staging instead, as plain arrays do.
        count = beyond_the_ll("allreduce", n, dtype, 7)
        memory = comm.alloc(count + 4, dtype)
        overlapping = Arrays.__new__(Arrays)
        overlapping.elements, overlapping.x, overlapping.out = count, memory[:count], memory[4:]
        check_call(comm, reference, overlapping, "allreduce", dtype, "sum", 0, seed=77)
        made += 1
        # No allocating while capturing: the handles' exchange would be captured.
        with comm.graph():
            try:
                comm.alloc(4, dtype)
                raise AssertionError("alloc ran while capturing")
            except InvalidUsageError as error:
                assert "captured" in str(error), error
        # Small calls on symmetric memory take the LL path; compressed ones the step protocol.
        small = Arrays(comm, "allreduce", dtype, 1000, True)
        check_call(comm, reference, small, "allreduce", dtype, "sum", 0, seed=3)
        comm.synchronize()
        assert barrier_phases(comm) == 2 * made, "a small call on symmetric memory skipped the LL path"
        assert step_count(comm) == counter
        x = comm.alloc(beyond_the_ll("allreduce", n, dtype, 0), dtype)
        write(x, np.ones(x.size, dtype))
        got = to_host(comm.allreduce(x, compression="fp16"))
        assert (got == n).all() and step_count(comm) != counter, "a compressed call skipped the step protocol"
    comm.barrier()


def scenario_staged(comm):
    """Calls on plain arrays beyond the LL: through the staging buffers,
    which grow at the same calls on every rank; the step protocol idle."""
    n = comm.size
    counter = step_count(comm)
    staging = comm._ranks.memory   # SymmetricMemory
    with collectives.Communicator.local(n) as reference:
        made = every_collective(comm, reference, symmetric=False)
        first = staging.staging.nbytes
        for k, collective in enumerate(COLLECTIVES):   # larger (3 MiB and more): the buffers grow
            dtype = np.dtype(np.float32)
            arrays = Arrays(comm, collective, dtype, (3 << 20) // 4 // (n if collective == "reduce_scatter" else 1)
                            + 5 * k, k % 2 == 0, symmetric=False)
            check_call(comm, reference, arrays, collective, dtype, "sum", k % n, seed=600 + k)
            made += 1
        grown = staging.staging.nbytes > first and staging._old_staging   # noqa: SLF001
        assert grown, "the staging buffers did not grow"
        made += every_collective(comm, reference, symmetric=False)   # smaller again, in the grown buffers
        # An output overlapping its input in any way: the input is staged whole first.
        dtype = np.dtype(np.int32)
        count = beyond_the_ll("allreduce", n, dtype, 7)
        for shift in (3, -5):
            memory = plain(count + 16, dtype)
            overlapping = Arrays.__new__(Arrays)
            overlapping.elements, overlapping.x, overlapping.out = count, memory[8:8 + count], \
                memory[8 + shift:8 + shift + count]
            check_call(comm, reference, overlapping, "allreduce", dtype, "sum", 0, seed=80 + shift)
            made += 1
        assert step_count(comm) == counter, "a call took the step protocol"
        comm.synchronize()
        assert barrier_phases(comm) == 2 * made, (barrier_phases(comm), made)
        # A call larger than any before cannot be captured: growing waits on the host.
        big = plain(8 * staging.staging.nbytes // 4, np.dtype(np.float32))
        with comm.graph():
            try:
                comm.allreduce(big)
                raise AssertionError("a staging buffer grew while capturing")
            except InvalidUsageError as error:
                assert "cannot be captured" in str(error), error
    comm.barrier()


def plain(count, dtype):
    """An array outside symmetric memory."""
    return to_device(np.zeros(count, dtype)) if DEVICE == "cuda" else np.zeros(count, dtype)


def to_device(array):
    import cupy
    return cupy.asarray(array)


def scenario_sizes(comm):
    comm.alloc(10, "float32")   # the same on every rank
    try:
        comm.alloc(10 + comm.rank, "float32")
    except InvalidUsageError as error:
        assert "same bytes" in str(error), error
    else:
        raise AssertionError("ranks allocated different sizes")
    x = comm.alloc((3, 4), "int16")   # and the communicator still works
    assert x.shape == (3, 4) and x.dtype == np.int16
    comm.barrier()


def one_call(comm, offset):
    """An allreduce on symmetric memory beyond the LL, starting `offset`
    elements in, of ones times (rank + 1); and the memory."""
    count = beyond_the_ll("allreduce", comm.size, np.dtype(np.float32), 100)
    memory = comm.alloc(count + 64, "float32")
    write(memory, np.full(count + 64, comm.rank + 1, np.float32))
    x = memory[offset:offset + count]

    def run():
        comm.allreduce(x)
        comm.synchronize()
    return run, memory


def scenario_mismatch(comm):
    one_call(comm, 0)[0]()
    run, memory = one_call(comm, 16 if comm.rank == FAILING else 0)
    before = to_host(memory).copy()
    MPI.COMM_WORLD.Barrier()   # every rank's alloc done: the mismatch below is all that fails
    start = time.perf_counter()
    expect_a_different_call(run, "an allreduce at another offset")
    assert time.perf_counter() - start < TIMEOUT / 2, "the mismatch was found by the timeout"
    # The barrier that found it disarmed the step kernel: no rank's memory was touched.
    assert np.array_equal(to_host(memory), before), \
        f"a failed call wrote into rank {comm.rank}'s symmetric memory: {to_host(memory)[:3]}, was {before[:3]}"


def scenario_staged_mismatch(comm):
    """A staged call whose count differs on rank FAILING: every rank raises,
    and no output is written (the leave barrier disarms the copy out)."""
    n = comm.size
    count = beyond_the_ll("allreduce", n, np.dtype(np.float32), 100)
    # The staging buffers hold a call's sums: a call of the same shape as the
    # peers' failing one, whose staged form the peers then reuse. (After an
    # in-place call, whose plan is another for ranks in processes, the
    # failing call's staged form is made anew, and a broken disarm went
    # unseen in some runs: docs/noticed.md.)
    comm.allreduce(plain(count, np.float32) + 1, out=plain(count, np.float32))
    comm.synchronize()
    mine = count + (16 if comm.rank == FAILING else 0)
    x = plain(mine, np.float32) + 5
    out = plain(mine, np.float32) - 1
    MPI.COMM_WORLD.Barrier()
    start = time.perf_counter()
    expect_a_different_call(lambda: (comm.allreduce(x, out=out), comm.synchronize()), "an allreduce of another count")
    assert time.perf_counter() - start < TIMEOUT / 2, "the mismatch was found by the timeout"
    assert (to_host(out) == -1).all() and (to_host(x) == 5).all(), "a failed staged call wrote an output"


def scenario_mixed(comm):
    """Rank FAILING passes a plain array where its peers pass symmetric
    memory: the two paths' barriers meet with different signatures, and
    every rank is told of a different call, well before the timeout."""
    n = comm.size
    count = beyond_the_ll("allreduce", n, np.dtype(np.float32), 100)
    comm.allreduce(plain(count, np.float32))   # the staging buffers exist: the first call is no growth
    x = comm.alloc(count, np.float32)   # on every rank (alloc is collective); rank FAILING does not use it
    if comm.rank == FAILING:
        x = plain(count, np.float32)
    MPI.COMM_WORLD.Barrier()
    start = time.perf_counter()
    expect_a_different_call(lambda: (comm.allreduce(x), comm.synchronize()), "an allreduce on other memory")
    assert time.perf_counter() - start < TIMEOUT / 2, "the mismatch was found by the timeout"


def scenario_growth_fails(comm):
    """Rank FAILING cannot allocate its larger staging buffer: it aborts, and
    every other rank learns of it at once, not at the timeout."""
    n = comm.size
    comm.allreduce(plain(beyond_the_ll("allreduce", n, np.dtype(np.float32), 1), np.float32))
    comm.synchronize()
    device = comm._ranks.device   # noqa: SLF001
    if comm.rank == FAILING:
        def no_memory(*_):
            raise MemoryError("no device memory for the staging buffer (the test's)")
        device.allocate_shared = no_memory
    big = plain((4 << 20) // 4, np.float32)   # 4 MiB: past the first buffer's 1 MiB
    MPI.COMM_WORLD.Barrier()
    start = time.perf_counter()
    try:
        comm.allreduce(big)
        comm.synchronize()
        raise AssertionError("the call completed although a rank could not grow its staging buffer")
    except MemoryError:
        assert comm.rank == FAILING
    except collectives.CollectiveError as error:
        assert "staging" in str(error) and "aborted" in str(error), error
    assert time.perf_counter() - start < TIMEOUT / 2, "a failed growth was found by the timeout"


def scenario_killed(comm):
    """Rank FAILING dies after one call: every other rank's next call (its
    barrier waiting for the dead rank) raises RankFailedError naming it,
    within 1.5 s (the watchdog sees the pid gone and sets the abort flag)."""
    run, _ = one_call(comm, 0)
    run()
    MPI.COMM_WORLD.Barrier()
    if comm.rank == FAILING:
        os._exit(0)
    expect(RankFailedError, run, names=[f"rank {FAILING} (pid", "died"], within=1.5)


def scenario_stalled(comm):
    run, memory = one_call(comm, 0)
    run()
    after_the_first = to_host(memory).copy()
    stop_on_failing_rank(comm, run, names=[f"waiting for rank {FAILING}", "symmetric memory"], timeout=STALL_TIMEOUT)
    # Neither the ranks that timed out nor the one that stopped calling had their memory written.
    assert np.array_equal(to_host(memory), after_the_first), "a failed call wrote into symmetric memory"


def scenario_graph(comm):
    n = comm.size
    dtype = np.dtype(np.float32)
    with collectives.Communicator.local(n) as reference:
        # On symmetric memory, then on plain arrays (through staging: the copies are captured too).
        plans = [("allreduce", "sum", False, True), ("reduce_scatter", "max", True, True),
                 ("allgather", "sum", False, True), ("broadcast", "sum", True, True), ("reduce", "avg", True, True),
                 ("allreduce", "min", True, False), ("reduce_scatter", "sum", False, False),
                 ("allgather", "sum", True, False), ("broadcast", "sum", True, False), ("reduce", "sum", True, False)]
        calls = [(collective, op, Arrays(comm, collective, dtype, beyond_the_ll(collective, n, dtype, 9), in_place,
                                         symmetric))
                 for collective, op, in_place, symmetric in plans]
        for k, (collective, op, arrays) in enumerate(calls):   # once before capturing
            check_call(comm, reference, arrays, collective, dtype, op, k % n, seed=k, algorithm="direct")
        with comm.graph() as graph:
            for k, (collective, op, arrays) in enumerate(calls):
                arrays.call(comm, collective, op, k % n, "direct")
        for replay in range(6):
            inputs = []
            for k, (collective, op, arrays) in enumerate(calls):
                inputs.append([rank_input(50 + 10 * replay + k, q, dtype, arrays.elements) for q in range(n)])
                write(arrays.x, inputs[-1][comm.rank])
            graph.replay()
            for k, (collective, op, arrays) in enumerate(calls):
                want = expected(reference, collective, inputs[k], op, k % n, "direct")[comm.rank]
                got = to_host(arrays.out)
                assert got.tobytes() == want.tobytes(), f"replay {replay} {collective}: {got[:4]} != {want[:4]}"
            collective, op, arrays = calls[replay % len(calls)]   # a direct call in between
            check_call(comm, reference, arrays, collective, dtype, op, replay % n, seed=900 + replay,
                       algorithm="direct")
        comm.synchronize()
        assert barrier_phases(comm) == 2 * (len(calls) * 7 + 6)
        # A capture whose calls come on two of its streams is refused: its
        # replay could run them at once (here a second capturing stream
        # stands for one forked from the capture by an event).
        device = comm._ranks.device   # noqa: SLF001
        if DEVICE == "emulated":
            collective, op, arrays = calls[0]
            try:
                with comm.graph():
                    arrays.call(comm, collective, op, 0, "direct")
                    forked = device.new_stream()
                    forked.capturing, captured = True, device._current   # noqa: SLF001
                    device._current = forked   # noqa: SLF001
                    try:
                        arrays.call(comm, collective, op, 0, "direct")
                    finally:
                        device._current, forked.capturing = captured, False   # noqa: SLF001
                raise AssertionError("a capture on two streams was taken")
            except InvalidUsageError as error:
                assert "two streams" in str(error), error
    comm.barrier()


def main():
    global DEVICE
    scenario = sys.argv[1]
    DEVICE = sys.argv[2] if len(sys.argv) > 2 else "emulated"
    broken = os.environ.get(BROKEN_KERNELS)
    if broken:   # tests/test_symmetric.py: the emulated device runs a broken copy of the kernels
        from pathlib import Path
        from collectives.devices import emulated
        emulated._LOADED[Path(kernels.source_dir())] = emulated.library(broken)   # noqa: SLF001
    ll_worker.DEVICE = DEVICE
    ll_worker.run_one_kernel_rank(scenario, globals())


if __name__ == "__main__":
    main()
