"""One rank of tests/test_ll_mpi.py, started N times under mpiexec with
$COLLECTIVES_ONE_KERNEL_ALLREDUCE=1:

    mpiexec -n N python tests/ll_worker.py SCENARIO [DEVICE [COLLECTIVE]]

DEVICE is "emulated" (the default, CI) or "cuda" (CuPy arrays on a GPU;
several processes may share one under MPS). COLLECTIVE is the one under
test (allreduce, the default, allgather, broadcast, reduce_scatter, reduce).

"bits": every dtype and op (one op for the copies), counts 0, 1, odd, and up
to the LL capacity, in place and out of place, roots varying, then a long
run of calls of random sizes (both slot sets reused many times, generations
far past 2), allreduces mixed in, and step-protocol calls of the same
collective (another algorithm; one element too many): every result has the
bits the NumPy interpreter gives (the `direct` plan on host ranks in this
process), exactly the calls that fit ran as one kernel (the rank's LL
generation counts them, its step-protocol counter does not move in the
first part), and all ranks hold the same bytes where they should.
"stalled", "killed": rank FAILING stops calling, or dies, after one call;
every other rank must raise CollectiveTimeoutError (within the timeout and
a second) or RankFailedError (within 1.5 s), naming it.
"mismatch": rank FAILING's second call has another count: every rank is
told of a different call (InvalidUsageError) well before the timeout.
A rank that reads no peer in a call (a broadcast's root, a reduce's other
ranks) is told at its next call, whose kernel waits for the peers.
"graph": a CUDA graph (comm.graph()) of several calls of different
collectives, dtypes and sizes, replayed many times with new inputs written
into its arrays and direct calls of other shapes in between, directly after
one another or not: every result has the interpreter's bits, the kernels'
call count (the device's state words, which the host does not keep) is the
number of calls made and replayed, a step-protocol call is refused while
capturing, and a call made after the graph's last replay is right too.
"graph_stalled": rank FAILING stops replaying the graph after one replay:
every other rank's replay raises CollectiveTimeoutError naming it (within
the timeout and a second), and rank FAILING's next replay the abort.

Each rank prints "OK <scenario> <rank>" when every check held.
"""

import os
import sys
import time

import numpy as np
from mpi4py import MPI

import collectives
from cases import (OPS, all_dtypes, capacity, expect_a_different_call, expected, gave_up_on, rank_input, run_scenario,
                   stall_until_the_others_gave_up)
from collectives import CollectiveTimeoutError, RankFailedError, kernels
from collectives.executors.paths import ONE_PASS_COLLECTIVES
from collectives.transport.layout import COUNTER
from peer_failure_worker import FAILING, STALL_TIMEOUT, TIMEOUT, expect


DEVICE = "emulated"
COLLECTIVE = "allreduce"
EVERY = "every"   # COLLECTIVE: each of ONE_PASS in turn, in one launch (scenario_bits)
ONE_PASS = sorted(ONE_PASS_COLLECTIVES, key=lambda name: (name != "allreduce", name))


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


def takes_the_path(comm, collective, x_bytes, root, algorithm):
    """Whether a call should run as one kernel, by the rule the executor
    must follow, worked out here apart from it: a plan whose bits are the
    `direct` plan's (direct itself, picked by `auto` or named, and two_shot; any plan of
    allgather and broadcast, which only copy; any plan of 2 ranks, one
    commutative fold), and what a rank publishes (its x: all its blocks for
    reduce_scatter, laid out per block) fits in LL_MAX_BYTES."""
    if algorithm == "auto":
        algorithm = comm.chosen_algorithm(collective, x_bytes, root=root)
    blocks = comm.size if collective == "reduce_scatter" else 1
    published = blocks * -(-(x_bytes // blocks) // 8) * 8
    direct_bits = algorithm in ("direct", "two_shot") or collective in ("allgather", "broadcast") or comm.size == 2
    return direct_bits and published <= kernels.LL_MAX_BYTES and x_bytes > 0


class Checker:
    """Runs a collective on `comm` and on in-process host ranks, compares."""

    def __init__(self, comm, reference):
        self.comm, self.reference = comm, reference
        self.ll = comm._ranks.protocol   # the device protocol, whose generation() counts the LL calls
        self.calls = self.ll.generation()   # calls that take the path: the LL's generation (from earlier ones on)
        self.seed = 0

    def call(self, collective, dtype, op, count, in_place, algorithm="auto", root=0):
        """`count`: elements of x (reduce_scatter: of each of its n blocks).
        Out of place: `out` given (reduce_scatter, broadcast, reduce: filled
        first, which a reduce's other ranks keep), a new array (allgather)."""
        comm, n, r = self.comm, self.comm.size, self.comm.rank
        self.seed += 1
        elements = n * count if collective == "reduce_scatter" else count
        inputs = [rank_input(self.seed, q, dtype, elements) for q in range(n)]
        x = on_device(inputs[r].copy())
        if collective == "allreduce":
            result = comm.allreduce(x, op=op, algorithm=algorithm) if in_place else \
                comm.allreduce(x, op=op, out=on_device(np.empty(count, dtype)), algorithm=algorithm)
        elif collective == "reduce_scatter":
            result = comm.reduce_scatter(x, op=op, algorithm=algorithm) if in_place else \
                comm.reduce_scatter(x, op=op, out=on_device(np.empty(count, dtype)), algorithm=algorithm)
        elif collective == "allgather":
            if in_place:   # x is this rank's block of the output
                out = on_device(np.zeros(n * count, dtype))
                out[r * count:(r + 1) * count] = x
                result = comm.allgather(out[r * count:(r + 1) * count], out=out, algorithm=algorithm)
            else:
                result = comm.allgather(x, algorithm=algorithm)
        else:
            untouched = rank_input(self.seed + 1000, r, dtype, elements)
            out = None if in_place else on_device(untouched)
            if collective == "broadcast":
                result = comm.broadcast(x, root=root, out=out, algorithm=algorithm)
            else:
                result = comm.reduce(x, root=root, op=op, out=out, algorithm=algorithm)
            assert result is (x if in_place else out)
            assert in_place or on_host(x).tobytes() == inputs[r].tobytes(), f"{collective}: x changed out of place"
        got = on_host(result)
        # The plan `auto` picks on the host reference: on the path the kernel
        # must give that plan's bits too (the path takes only plans whose
        # bits are direct's).
        picked = comm.chosen_algorithm(collective, elements * dtype.itemsize, root=root) \
            if algorithm == "auto" else algorithm
        want = self.expected(collective, inputs, op, root, picked)[r]
        if collective == "reduce" and not in_place and r != root:
            want = untouched
        case = f"{collective} {dtype} {op} count={count} in_place={in_place} algorithm={algorithm} root={root}"
        assert got.tobytes() == want.tobytes(), f"{case}: {got[:6]} != {want[:6]}"
        if takes_the_path(comm, collective, elements * dtype.itemsize, root, algorithm):
            self.calls += 1
        assert self.ll.generation() == self.calls, (case, self.ll.generation(), self.calls)
        return got

    def expected(self, collective, inputs, op, root, algorithm):
        return expected(self.reference, collective, inputs, op, root, algorithm)


def scenario_bits(comm):
    """COLLECTIVE's calls (every collective of the path, one after another,
    where it is "every": one launch for all) give the interpreter's bits."""
    for collective in ONE_PASS if COLLECTIVE == EVERY else (COLLECTIVE,):
        bits(comm, collective)


def bits(comm, collective_on_the_path):
    COLLECTIVE = collective_on_the_path   # noqa: N806 - (what the scenario's checks below call it)
    group = comm._ranks.group   # noqa: SLF001
    counter = int(group._rows[comm.rank, COUNTER])   # noqa: SLF001
    generation = comm._ranks.protocol.generation()   # noqa: SLF001 - (the LL calls of earlier collectives)
    n = comm.size
    # `auto`, as users call: for 2 ranks it picks ring for allgather and
    # reduce_scatter, whose bits are direct's there, and which the path takes.
    algorithm = "auto"
    ops = OPS if COLLECTIVE in ("allreduce", "reduce_scatter", "reduce") else OPS[:1]
    with collectives.Communicator.local(n) as reference:
        check = Checker(comm, reference)
        in_place = False
        for dtype in all_dtypes():
            for op in ops:
                for count in (0, 1, 7, 1001, capacity(COLLECTIVE, n, dtype)):
                    in_place = not in_place
                    check.call(COLLECTIVE, dtype, op, count, in_place, algorithm, root=count % n)
        assert int(group._rows[comm.rank, COUNTER]) == counter, "a call took the step protocol"   # noqa: SLF001
        assert check.calls == check.ll.generation() > generation
        rng = np.random.default_rng(7)   # the same on every rank
        for i in range(150):
            collective = COLLECTIVE if rng.random() < 0.7 else "allreduce"   # another kind of LL call between
            dtypes = all_dtypes()
            dtype = dtypes[rng.integers(len(dtypes))]
            count = int(rng.integers(0, capacity(collective, n, dtype) + 1)) if i % 10 == 0 else \
                int(rng.integers(1, 64))
            if i == 75:   # the step protocol in between (another algorithm), then the LL again
                check.call(COLLECTIVE, np.dtype(np.float32), "sum", 5000, False, algorithm="ring")
            if i == 76:   # too large for the LL: the step protocol too
                check.call(COLLECTIVE, np.dtype(np.float32), "sum", capacity(COLLECTIVE, n, np.dtype(np.float32)) + 1,
                           False, algorithm="direct")
            last = check.call(collective, dtype, OPS[rng.integers(len(OPS))], count, bool(rng.integers(2)),
                              algorithm if collective == COLLECTIVE else "auto", root=int(rng.integers(n)))
    everyone = MPI.COMM_WORLD.allgather(last.tobytes())
    if collective in ("allreduce", "allgather", "broadcast"):   # the last call gives every rank the same
        assert all(b == everyone[0] for b in everyone), "ranks disagree"
    comm.synchronize()
    comm.barrier()


class GraphCall:
    """One call of a graph: its arrays, made once (a graph replays on the
    same memory), its new inputs before each replay, its result's check."""

    def __init__(self, check, collective, dtype, op, count, in_place, root=0):
        comm, n = check.comm, check.comm.size
        self.check, self.collective, self.dtype, self.op, self.count, self.root = \
            check, collective, collectives.ops.as_dtype(dtype), op, count, root
        self.elements = n * count if collective == "reduce_scatter" else count   # x's
        self.x = on_device(np.zeros(self.elements, self.dtype))
        r = comm.rank
        if collective in ("broadcast", "reduce") or in_place and collective == "allreduce":
            self.out = self.x
        elif collective == "reduce_scatter":
            self.out = self.x[r * count:(r + 1) * count] if in_place else on_device(np.zeros(count, self.dtype))
        elif collective == "allgather":
            self.out = on_device(np.zeros(n * count, self.dtype))
            if in_place:
                self.x = self.out[r * count:(r + 1) * count]
        else:
            self.out = on_device(np.zeros(count, self.dtype))
        self.inputs = None

    def issue(self):
        """The call (made directly, or captured)."""
        comm, x, out, op = self.check.comm, self.x, self.out, self.op
        algorithm = "direct"   # what `auto` picks but for allgather and reduce_scatter on 2 ranks
        if self.collective == "allreduce":
            comm.allreduce(x, op=op, out=None if out is x else out, algorithm=algorithm)
        elif self.collective == "reduce_scatter":
            comm.reduce_scatter(x, op=op, out=out, algorithm=algorithm)
        elif self.collective == "allgather":
            comm.allgather(x, out=out, algorithm=algorithm)
        elif self.collective == "broadcast":
            comm.broadcast(x, root=self.root, algorithm=algorithm)
        else:
            comm.reduce(x, root=self.root, op=op, algorithm=algorithm)

    def fill(self, seed):
        """New inputs, written into the arrays the graph reads."""
        comm = self.check.comm
        self.inputs = [rank_input(seed, q, self.dtype, self.elements) for q in range(comm.size)]
        self.x[:] = on_device(self.inputs[comm.rank])

    def verify(self, case):
        want = self.check.expected(self.collective, self.inputs, self.op, self.root, "direct")[self.check.comm.rank]
        got = on_host(self.out)
        assert got.tobytes() == want.tobytes(), f"{case} {self.collective} {self.dtype} {self.op}: " \
                                                f"{got[:6]} != {want[:6]}"


def scenario_graph(comm):
    from collectives import InvalidUsageError
    n = comm.size
    with collectives.Communicator.local(n) as reference:
        check = Checker(comm, reference)
        calls = [GraphCall(check, "allreduce", np.float32, "sum", 1001, False),
                 GraphCall(check, "reduce_scatter", np.int32, "max", 37, True),
                 GraphCall(check, "allgather", np.float16, "sum", 5, False),
                 GraphCall(check, "broadcast", "bfloat16", "sum", 300, True, root=n - 1),
                 GraphCall(check, "reduce", np.float64, "avg", 11, True, root=1 % n),
                 GraphCall(check, "allreduce", np.int8, "prod", capacity("allreduce", n, np.dtype(np.int8)), True),
                 GraphCall(check, "allreduce", np.float32, "min", 1, True)]
        made = 0   # one-kernel calls run so far: the device's state words must say so
        for k, call in enumerate(calls):   # each once before capturing (first-call set-up is not capturable)
            call.fill(1000 + k)
            call.issue()
            call.verify("direct, before capturing")
            made += 1
        assert check.ll.generation() == made
        with comm.graph() as graph:
            for call in calls:
                call.issue()
            try:   # the step protocol waits on the host between phases: refused, nothing captured
                comm.allreduce(on_device(np.ones(kernels.LL_MAX_BYTES // 4 + 1000, np.float32)), algorithm="ring")
                raise AssertionError("a step-protocol call was captured")
            except InvalidUsageError as error:
                assert "cannot be captured" in str(error), error
        assert check.ll.generation() == made, "capturing ran something"
        rng = np.random.default_rng(11)   # the same on every rank: the same calls in the same order
        for replay in range(40):
            for k, call in enumerate(calls):
                call.fill(replay * 100 + k)
            graph.replay()
            made += len(calls)
            for call in calls:
                call.verify(f"replay {replay}")
            if replay % 8 == 7:
                assert check.ll.generation() == made, (replay, check.ll.generation(), made)
            for _ in range(int(rng.integers(3))):   # direct calls in between, 0 to 2 (replays back to back too)
                collective = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter")[rng.integers(5)]
                check.calls = made
                dtypes = all_dtypes()
                check.call(collective, dtypes[rng.integers(len(dtypes))], OPS[rng.integers(len(OPS))],
                           int(rng.integers(1, 200)), bool(rng.integers(2)), "direct", root=int(rng.integers(n)))
                made += 1
        check.calls = made
        check.call("allreduce", np.dtype(np.float32), "sum", 123, False)   # a direct call right after a replay
    comm.synchronize()
    comm.barrier()


def scenario_graph_stalled(comm):
    n = comm.size
    x = on_device(np.ones(1000, np.float32))
    y = on_device(np.ones(7, np.int32))
    comm.allreduce(x)
    comm.broadcast(y, root=n - 1, algorithm="direct")
    with comm.graph() as graph:   # calls 3 and 4, 5 and 6, ...; an allreduce first: it waits for every peer
        comm.allreduce(x)
        comm.broadcast(y, root=n - 1, algorithm="direct")

    def replay():
        graph.replay()
        comm.synchronize()
    replay()
    stop_on_failing_rank(comm, replay, names=[f"waiting for rank {FAILING}", "allreduce #5"])


def stop_on_failing_rank(comm, run, names, timeout=TIMEOUT):
    """Rank FAILING stops calling `run` (made once already by every rank):
    every other rank's next `run`, made with `timeout`, must raise
    CollectiveTimeoutError naming `names` within the timeout and a second,
    and rank FAILING's the abort. (A replayed graph keeps the timeout it was
    captured with: pass comm's.)"""
    comm.timeout = timeout
    if comm.rank == FAILING:
        stall_until_the_others_gave_up(FAILING, longest=timeout + 1.5)   # and aborted the communicator
        expect(CollectiveTimeoutError, run, names=["aborted"], within=0.5)
        return
    expect(CollectiveTimeoutError, run, names=names, within=timeout + 1.0)
    gave_up_on(FAILING)


def one_call(comm):
    """A call of the collective under test and synchronize(): on a GPU the
    call returns once queued, and a kernel that gave up is reported at
    synchronize() (or the next call)."""
    n = comm.size
    x = on_device(np.ones(1000 * (n if COLLECTIVE == "reduce_scatter" else 1), np.float32))

    def run():
        collective_call(comm, x)
        comm.synchronize()
    return run


def collective_call(comm, x):
    """The collective under test on x, by the `direct` plan (root 0)."""
    if COLLECTIVE == "allreduce":
        return comm.allreduce(x)   # `auto`: the path as users take it
    if COLLECTIVE == "reduce_scatter":
        return comm.reduce_scatter(x, algorithm="direct")
    if COLLECTIVE == "allgather":
        return comm.allgather(x, algorithm="direct")
    if COLLECTIVE == "broadcast":
        return comm.broadcast(x, algorithm="direct")
    return comm.reduce(x, algorithm="direct")


def scenario_stalled(comm):
    run = one_call(comm)
    run()
    comm.timeout = STALL_TIMEOUT
    if comm.rank == FAILING:
        stall_until_the_others_gave_up(FAILING, longest=STALL_TIMEOUT + 1.5)   # and aborted the communicator
        expect(CollectiveTimeoutError, run, names=["aborted"], within=0.5)
        return
    # A rank that reads nobody in this call (a broadcast's root, a reduce's
    # other ranks) learns of the stall in the next one (the kernel's step 1).
    expect(CollectiveTimeoutError, lambda: (run(), run()), names=[f"waiting for rank {FAILING}", COLLECTIVE],
           within=STALL_TIMEOUT + 1.0)
    gave_up_on(FAILING)


def scenario_mismatch(comm):
    one_call(comm)()
    MPI.COMM_WORLD.Barrier()   # every rank's first call checked: the mismatch below is all that fails
    n = comm.size
    count = (1001 if comm.rank == FAILING else 1000) * (n if COLLECTIVE == "reduce_scatter" else 1)
    x = on_device(np.ones(count, np.float32))
    start = time.perf_counter()

    def calls():   # again, for a rank that reads nobody in the first (see scenario_stalled)
        for _ in range(2):
            collective_call(comm, x)
            comm.synchronize()
    expect_a_different_call(calls, f"a {COLLECTIVE} of another count")
    assert time.perf_counter() - start < TIMEOUT / 2, "the mismatch was found by the timeout"


def scenario_killed(comm):
    run = one_call(comm)
    run()
    # Every rank's first call done before rank FAILING dies: a reduce's
    # other ranks wait for nobody, and rank FAILING could die while a peer
    # still opens its LL area (which reports the death, but in the call
    # this scenario wants to succeed).
    MPI.COMM_WORLD.Barrier()
    if comm.rank == FAILING:
        os._exit(0)
    expect(RankFailedError, lambda: (run(), run()), names=[f"rank {FAILING} (pid", "died"], within=1.5)


def main():
    global DEVICE, COLLECTIVE
    scenario = sys.argv[1]
    DEVICE = sys.argv[2] if len(sys.argv) > 2 else "emulated"
    COLLECTIVE = sys.argv[3] if len(sys.argv) > 3 else "allreduce"
    run_one_kernel_rank(scenario, globals())


def run_one_kernel_rank(scenario, scenarios):
    """This rank of a one-kernel worker: `scenarios[f"scenario_{scenario}"]`
    on a communicator of DEVICE ranks in processes, then "OK <scenario>
    <rank>". In "killed" a rank dies: the others leave without MPI_Finalize,
    which would wait for it."""
    comm = collectives.init(timeout=TIMEOUT, device=DEVICE)
    assert comm._ranks.protocol is not None, "run with COLLECTIVES_ONE_KERNEL_ALLREDUCE=1"
    killed = scenario == "killed"
    run_scenario(lambda: scenarios[f"scenario_{scenario}"](comm), ranks_leave=killed)
    print(f"OK {scenario} {comm.rank}", flush=True)
    if killed:
        os._exit(0)
    comm.close()


if __name__ == "__main__":
    main()
