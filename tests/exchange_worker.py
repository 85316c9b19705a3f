"""One rank of tests/test_exchange_single_copy.py: the exchanges between host
processes in one copy (plan.single_copy_plan, run by _host_plan.c), and the
folds' and broadcast's single copies that push (plan.pushed_plan, spread_plan).

    mpiexec -n N python tests/exchange_worker.py SCENARIO

The test sets COLLECTIVES_EXCHANGE_SINGLE_COPY_MIN low, so that small
calls take the single copy too. Each rank prints "OK <scenario> <rank>"
when what it checked held.
"""

import os
import sys
import threading
import time

import numpy as np

import collectives
from cases import run_scenario
from collectives import CollectiveTimeoutError, RankFailedError
from collectives.config import BROADCAST_PULL_MAX
from collectives.executors import _host_plan
from collectives.transport import shm

TIMEOUT = 30.0
DTYPES = (np.float32, np.int8, np.float64, np.uint16)


def data(seed, rank, dtype, count):
    rng = np.random.default_rng([seed, rank, count])
    return rng.integers(0, 256, count * np.dtype(dtype).itemsize, dtype=np.uint8).view(dtype)


def same_bits(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.shape, want.shape)
    assert np.array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8)), \
        f"{what}: {got.reshape(-1)[:6]} {want.reshape(-1)[:6]}"


def counting_single_copies():
    """A list that grows by one at each single-copy run of this rank."""
    runs = []
    run = shm.ShmRank._run_single_plan

    def counted(self, *args):
        runs.append(1)
        return run(self, *args)
    shm.ShmRank._run_single_plan = counted
    return runs


def calls(comm, reference, seed):
    """Every exchange, in and out of place, against the one-process
    interpreter; yields (what, this rank's result, the reference's)."""
    r, n = comm.rank, comm.size
    rng = np.random.default_rng(seed)
    for dtype in DTYPES:
        k = int(rng.integers(2000, 9000))
        xs = [data(seed, q, dtype, n * k) for q in range(n)]
        want = reference.all_to_all([x.copy() for x in xs], out=[np.empty_like(x) for x in xs])
        yield "all_to_all out of place", comm.all_to_all(xs[r].copy(), out=np.empty_like(xs[r])), want[r]
        for _ in range(2):   # the second a repeat: the bound call
            x = xs[r].copy()
            yield "all_to_all in place", comm.all_to_all(x), want[r]
        x = xs[r].copy()
        yield "all_to_all out=x", comm.all_to_all(x, out=x), want[r]
        for root in range(n):
            wants = reference.gather([x[:k].copy() for x in xs], root=root)
            got = comm.gather(xs[r][:k].copy(), root=root)
            if r == root:
                yield f"gather root {root}", got, wants[root]
            out = np.zeros(n * k, dtype)
            out[r * k:(r + 1) * k] = xs[r][:k]
            comm.gather(out[r * k:(r + 1) * k], root=root, out=out)   # the root's x is its block of out
            if r == root:
                yield f"gather root {root} in place", out, wants[root]
            wants = reference.scatter([x.copy() for x in xs], root=root, out=[np.empty(k, dtype) for _ in xs])
            yield f"scatter root {root}", comm.scatter(xs[r].copy(), root=root, out=np.empty(k, dtype)), wants[r]
            yield f"scatter root {root} in place", comm.scatter(xs[r].copy(), root=root).copy(), wants[r]
        # all_to_all_v: uneven blocks, some of them empty, a rank that sends nothing
        matrix = [[0 if (q + c + seed) % 3 == 0 else int(rng.integers(1, 3 * k)) for c in range(n)] for q in range(n)]
        matrix[n - 1] = [0] * n
        vs = [data(seed + 1, q, dtype, sum(matrix[q])) for q in range(n)]
        wants = reference.all_to_all_v([v.copy() for v in vs], matrix)
        yield "all_to_all_v", comm.all_to_all_v(vs[r].copy(), matrix[r]), wants[r]
        receives = sum(matrix[q][r] for q in range(n))
        yield "all_to_all_v out", comm.all_to_all_v(vs[r].copy(), matrix[r], out=np.empty(receives, dtype)), wants[r]
        both = np.empty(max(receives, len(vs[r])), dtype)   # out overlapping x: read through a private copy
        both[:len(vs[r])] = vs[r]
        yield "all_to_all_v overlapping", comm.all_to_all_v(both[:len(vs[r])], matrix[r], out=both[:receives]), \
            wants[r]


def scenario_bits(comm):
    """The interpreter's bits, in one copy."""
    runs = counting_single_copies()
    assert comm.chosen_algorithm("all_to_all", 1 << 20, dtype=np.float32).path == "single_copy"
    assert comm.chosen_algorithm("gather", 1 << 20, dtype=np.float16).path == "step"   # float16: staged, interpreted
    with collectives.Communicator.local(comm.size) as reference:
        for seed in range(2):
            for what, got, want in calls(comm, reference, seed):
                same_bits(got, want, what)
    assert len(runs) > 50, len(runs)


def scenario_moves_without_the_loop(comm):
    """allgather and broadcast on the plans' path (the test turns the loop
    off), in and out of place, every root: the interpreter's bits, each call
    in one copy."""
    runs = counting_single_copies()
    r, n, k = comm.rank, comm.size, 5000   # (an int8 broadcast too at least the test's limit, 4096 bytes)
    assert comm.chosen_algorithm("allgather", 4 * k, dtype=np.float32).path == "single_copy"
    with collectives.Communicator.local(n) as reference:
        for dtype in DTYPES:
            xs = [data(7, q, dtype, k) for q in range(n)]
            want = reference.allgather([x.copy() for x in xs])[r]
            same_bits(comm.allgather(xs[r].copy()), want, "allgather")
            out = np.zeros(n * k, dtype)
            out[r * k:(r + 1) * k] = xs[r]
            same_bits(comm.allgather(out[r * k:(r + 1) * k], out=out), want, "allgather in place")
            for root in range(n):
                same_bits(comm.broadcast(xs[r].copy(), root=root, out=np.empty(k, dtype)), xs[root],
                          f"broadcast root {root}")
                same_bits(comm.broadcast(xs[r].copy(), root=root), xs[root], f"broadcast root {root} in place")
    assert len(runs) == len(DTYPES) * (2 + 2 * n), len(runs)


def scenario_folds(comm):
    """reduce_scatter, reduce and allreduce on the plans' path (the test
    turns the loop off), every root and op, several dtypes, slices of a
    peer's input and a tail (the executor folds up to PEER_SLICE_MAX bytes
    at a time): the interpreter's bits, out of place in one copy (`auto`'s:
    direct's reduce_scatter, two_shot's reduce and allreduce, whose ranks
    each fold a chunk into their workspace for the root, or every rank, to
    copy; and direct's reduce, whose root folds everything); in place
    allreduce and reduce_scatter in one copy too (the start found that
    reads work), and two_shot's reduce, pushed into the root's x (the
    start found that pushes work), `direct`'s staged (it has no in-place
    read form: plan.single_copy_plan says why); then a
    read refused, in an allreduce out of place (pushed: its peers push into
    the refusing rank) and a reduce_scatter, each run staged on every rank,
    and in an in-place reduce_scatter, which raises on every rank (x may be
    partly written; a refused read of the allreduce's read form in place:
    scenario_pushes_probe_refused)."""
    runs = counting_single_copies()
    r, n = comm.rank, comm.size
    k = (512 << 10) // 4 + 1000   # float32 and float64: a block past one slice of a peer's input
    for collective, algorithm in (("reduce_scatter", "direct"), ("reduce", "two_shot"), ("allreduce", "two_shot")):
        choice = comm.chosen_algorithm(collective, 4 * n * k, dtype=np.float32, in_place=False)
        assert (choice, choice.path) == (algorithm, "single_copy"), (choice, choice.path)
        choice = comm.chosen_algorithm(collective, 4 * n * k, dtype=np.float32, in_place=True)
        assert (choice, choice.path) == (algorithm, "single_copy"), (collective, choice, choice.path)
    # (reduce in place has no read form: `direct` named stages, two_shot's pushes into the root's x)
    choice = comm.chosen_algorithm("reduce", 4 * n * k, dtype=np.float32, in_place=True, algorithm="direct")
    assert (choice, choice.path) == ("direct", "compiled_plan"), (choice, choice.path)
    # (two_shot folds each element in rank order, as direct does: the
    # reference's bits are direct's, the in-place calls name it)
    single_copies = 0
    with collectives.Communicator.local(n) as reference:
        for dtype, op in [(np.float32, "sum"), (np.int8, "max"), (np.float64, "avg"), (np.uint16, "min"),
                          (np.float32, "prod")]:
            xs = [data(11, q, dtype, n * k) for q in range(n)]
            if np.dtype(dtype).kind == "f":   # finite values, whose folds' bits then mean something
                xs = [np.random.default_rng([11, q]).standard_normal(n * k).astype(dtype) for q in range(n)]
            want = reference.reduce_scatter([x.copy() for x in xs], op=op, algorithm="direct")
            same_bits(comm.reduce_scatter(xs[r].copy(), op=op, out=np.empty(k, dtype)), want[r],
                      f"reduce_scatter {op}")
            x = xs[r].copy()
            comm.reduce_scatter(x, op=op, algorithm="direct", out=x[r * k:(r + 1) * k])
            same_bits(x[r * k:(r + 1) * k], want[r], f"reduce_scatter {op} in place")
            same_bits(np.delete(x, np.s_[r * k:(r + 1) * k]), np.delete(xs[r], np.s_[r * k:(r + 1) * k]),
                      f"reduce_scatter {op} in place, the other blocks of x")
            single_copies += 2
            want = reference.allreduce([x.copy() for x in xs], op=op, algorithm="two_shot")
            same_bits(comm.allreduce(xs[r].copy(), op=op, out=np.empty(n * k, dtype)), want[r], f"allreduce {op}")
            x = xs[r].copy()
            same_bits(comm.allreduce(x, op=op), want[r], f"allreduce {op} in place")
            same_bits(x, want[r], f"allreduce {op} in place, x")
            single_copies += 2
            for root in range(n):
                wants = reference.reduce([x.copy() for x in xs], op=op, root=root, algorithm="direct")
                for algorithm in ("auto", "direct"):
                    got = comm.reduce(xs[r].copy(), op=op, root=root, algorithm=algorithm, out=np.empty(n * k, dtype))
                    if r == root:
                        same_bits(got, wants[root], f"reduce {op} root {root} ({algorithm})")
                    single_copies += 1
                for algorithm in ("auto", "direct"):
                    x = xs[r].copy()
                    comm.reduce(x, op=op, root=root, algorithm=algorithm)
                    same_bits(x, wants[root] if r == root else xs[r], f"reduce {op} root {root} in place ({algorithm})")
                single_copies += 1   # (auto's)
        assert len(runs) == single_copies, (len(runs), single_copies)
        # a repeated in-place reduce_scatter whose out, a view of x, is made anew each call runs from C (the
        # runner's Shapes take an out at the offset from x's data the remembered one had), with the
        # interpreter's bits; an out overlapping x at another offset runs from Python, with the same bits
        compiled = comm._ranks.compiled   # noqa: SLF001
        xs = [data(13, q, np.float32, n * k) for q in range(n)]
        want = reference.reduce_scatter([x.copy() for x in xs], algorithm="direct")
        repeats = compiled.repeats_run
        for _ in range(3):
            x = xs[r].copy()
            same_bits(comm.reduce_scatter(x, out=x[r * k:(r + 1) * k]), want[r], "a repeated in-place reduce_scatter")
        assert compiled.repeats_run == repeats + 2 and len(runs) == single_copies + 1, (compiled.repeats_run, runs)
        room = np.zeros((n + 1) * k, np.float32)
        x = room[:n * k]
        x[:] = xs[r]
        same_bits(comm.reduce_scatter(x, out=room[n * k - k // 2:][:k]), want[r], "a reduce_scatter whose out "
                  "overlaps x elsewhere")
        assert compiled.repeats_run == repeats + 2, compiled.repeats_run
        single_copies = len(runs)
        if r == 1:
            _host_plan.test_refuse_reads(True)
        xs = [data(12, q, np.float32, n * k) for q in range(n)]
        want = reference.allreduce([x.copy() for x in xs], algorithm="two_shot")
        same_bits(comm.allreduce(xs[r].copy(), out=np.empty(n * k, np.float32)), want[r], "the refused allreduce")
        assert comm._ranks._refused and len(runs) == single_copies + 1   # noqa: SLF001
        want = reference.reduce_scatter([x.copy() for x in xs], algorithm="direct")
        same_bits(comm.reduce_scatter(xs[r].copy(), out=np.empty(k, np.float32)), want[r],
                  "a reduce_scatter after the refusal")
        assert len(runs) == single_copies + 1, (len(runs), single_copies)   # (staged)
        for collective in ("reduce_scatter", "allreduce"):
            assert comm.chosen_algorithm(collective, 4 * n * k, dtype=np.float32, in_place=False).path \
                == "compiled_plan"
        comm._ranks._refused = False   # noqa: SLF001 - as if the refusal had not been seen: the start's verdict stands
        x = xs[r].copy()
        try:
            comm.reduce_scatter(x, algorithm="direct", out=x[r * k:(r + 1) * k])
        except collectives.CollectiveError as error:
            assert "x is partly overwritten" in str(error), error
        else:
            raise AssertionError("a refused read in an in-place reduce_scatter did not raise")
        assert comm._ranks._refused and len(runs) == single_copies + 2, len(runs)   # noqa: SLF001


def scenario_refused(comm):
    """Rank 1 may not read its peers: the first call (in place, so that an
    input overwritten before the verdict would show) falls back to the
    staged plan on every rank, and every later call stages."""
    runs = counting_single_copies()
    r, n = comm.rank, comm.size
    if r == 1:
        _host_plan.test_refuse_reads(True)
    k = 5000
    xs = [data(3, q, np.float32, n * k) for q in range(n)]
    with collectives.Communicator.local(n) as reference:
        want = reference.all_to_all([x.copy() for x in xs], out=[np.empty_like(x) for x in xs])
        x = xs[r].copy()
        same_bits(comm.all_to_all(x), want[r], "the refused all_to_all, in place")
        assert len(runs) == 1 and comm._ranks._refused, (len(runs), comm._ranks._refused)   # noqa: SLF001
        choice = comm.chosen_algorithm("all_to_all", n * k * 4, dtype=np.float32)
        assert choice.path == "compiled_plan", (choice, choice.path)
        for what, got, want in calls(comm, reference, 5):
            same_bits(got, want, f"{what} after the refusal")
        assert len(runs) == 1, len(runs)
    loop = comm._ranks.fast   # noqa: SLF001
    if loop is not None:   # the refusal is the loop's too: a large allreduce, which it left to the plans, stages there
        assert loop.large_path == "staged", loop.large_path
        x = np.ones(1 << 18, np.float32)
        choice = comm.chosen_algorithm("allreduce", x.nbytes, dtype=np.float32)
        got = comm.allreduce(x, out=np.empty_like(x))
        assert (choice.step, loop.last_step) == ("staged", "staged") and (got == n).all(), (choice, loop.last_step)


def scenario_pushes(comm):
    """allreduce on the plans' path (the test turns the loop off) pushes
    (plan.pushed_plan), in and out of place from the first call (the start
    found that every rank may push: ShmRank._learn_reach); the
    interpreter's bits, on new arrays and
    on the same ones (whose repeats the runner runs from C). Then rank 1's
    pushes are refused, first in a call the runner repeats from C, then
    (the refusal forgotten, white-box) in one from Python: `first` says
    which placement comes first. Out of place, after its peers have pushed
    into it, every rank runs the call again staged, with the same bits; in
    place every rank raises, x being partly overwritten. A reduce in place
    pushes too, from the first call, into the root's x, and raises so
    once rank 1's pushes are refused."""
    first = sys.argv[2]
    runs = counting_single_copies()
    r, n = comm.rank, comm.size
    compiled = comm._ranks._single   # noqa: SLF001
    assert compiled.pushes_reached == 1, compiled.pushes_reached
    k = (600 << 10) // 4   # past a push slice on each rank
    cases = [(20, np.float32, "sum"), (21, np.int16, "max"), (22, np.float64, "avg")]
    with collectives.Communicator.local(n) as reference:
        for in_place in (True, False):
            for seed, dtype, op in cases:
                xs = [data(seed, q, dtype, n * k) for q in range(n)]
                if np.dtype(dtype).kind == "f":
                    xs = [np.random.default_rng([seed, q]).standard_normal(n * k).astype(dtype) for q in range(n)]
                want = reference.allreduce([x.copy() for x in xs], op=op, algorithm="two_shot")
                x = xs[r].copy()
                got = comm.allreduce(x, op=op, out=None if in_place else np.empty(n * k, dtype))
                same_bits(got, want[r], f"allreduce {op} {'in place' if in_place else ''}")
                same_bits(x, want[r] if in_place else xs[r], "x")
                assert compiled.last_plan.pushes and compiled.pushes_reached == 1, (in_place, seed)
        assert len(runs) == 2 * len(cases), runs
        for root in range(n):   # reduce in place pushes into the root's x (x its output), from the first call
            xs = [data(24 + root, q, np.float32, n * k) for q in range(n)]
            want = reference.reduce([x.copy() for x in xs], root=root, algorithm="two_shot")
            x = xs[r].copy()
            got = comm.reduce(x, root=root)
            same_bits(x, want[root] if r == root else xs[r], f"reduce in place to {root}: x")
            assert r != root or np.shares_memory(got, x), "the root's result is its x"
            single = compiled.last_plan
            assert (single.collective, single.pushes, single.binding) == ("reduce", True, "in_place"), single
        xs = [data(23, q, np.int32, n * k) for q in range(n)]
        want = reference.allreduce([x.copy() for x in xs], algorithm="two_shot")
        x, y, out = xs[r].copy(), xs[r].copy(), np.empty(n * k, np.int32)
        wants = [xs]
        repeats = compiled.repeats_run
        for _ in range(4):   # the first from Python, the others from C (its shape's, then the bound call's)
            wants.append(reference.allreduce([w.copy() for w in wants[-1]], algorithm="two_shot"))
            same_bits(comm.allreduce(x), wants[-1][r], "a repeated allreduce in place")
            same_bits(comm.allreduce(y, out=out), want[r], "a repeated allreduce out of place")
        assert compiled.repeats_run == repeats + 6 and compiled.last_plan.pushes, (compiled.repeats_run, repeats)
        if r == 1:
            _host_plan.test_refuse_pushes(True)
        for placement in (first, "in" if first == "out" else "out"):
            if placement == "out":
                out[:] = -1   # (the last call's result is this one's too)
                same_bits(comm.allreduce(y, out=out), want[r], "the refused allreduce")
            else:
                try:
                    comm.allreduce(x)
                except collectives.CollectiveError as error:
                    assert "x is partly overwritten" in str(error), error
                else:
                    raise AssertionError("a refused in-place push did not raise")
            assert comm._ranks._refused   # noqa: SLF001
            assert comm.chosen_algorithm("allreduce", 4 * n * k, dtype=np.int32).path == "compiled_plan"
            comm._ranks._refused = False   # noqa: SLF001 - as if the refusal had not been seen
        try:   # a reduce in place whose pushes into the root's x are refused (rank 1's, into root 0)
            comm.reduce(xs[r].copy(), root=0)
        except collectives.CollectiveError as error:
            assert "x is partly overwritten" in str(error), error
        else:
            raise AssertionError("a refused in-place reduce did not raise")
        comm._ranks._refused = True   # noqa: SLF001
        x = xs[r].copy()
        same_bits(comm.allreduce(x), want[r], "the in-place allreduce after the refusals")


def scenario_spread(comm):
    """broadcast on the plans' path (the test turns the loop off): past the
    pull limit it spreads (plan.spread_plan), below it every rank reads the
    root's x (where ranks outnumber cores, it spreads at every size); in
    and out of place, every root, the root's bits; ranks that differ in
    placement, likewise. Then the pushes of rank
    1, the root, are refused in an in-place spread: every rank runs it
    again staged (the root's x only read), with its bits."""
    runs = counting_single_copies()
    r, n = comm.rank, comm.size
    compiled = comm._ranks._single   # noqa: SLF001
    oversubscribed = comm._ranks.transport == "host-processes-oversubscribed"   # noqa: SLF001 - spreads at any size
    calls = 0
    for k, spreads in ((BROADCAST_PULL_MAX // 4 + 1000, True), (20000, oversubscribed)):
        for seed, dtype in ((40, np.float32), (41, np.int8)):
            kk = k * 4 // np.dtype(dtype).itemsize
            xs = [data(seed, q, dtype, kk) for q in range(n)]
            for root in range(n):
                same_bits(comm.broadcast(xs[r].copy(), root=root, out=np.empty(kk, dtype)), xs[root],
                          f"broadcast root {root}")
                assert compiled.last_plan.pushes == spreads, (k, compiled.last_plan.pushes)
                x = xs[r].copy()
                same_bits(comm.broadcast(x, root=root), xs[root], f"broadcast root {root} in place")
                assert compiled.last_plan.pushes == spreads
                calls += 2
    assert len(runs) == calls, (len(runs), calls)
    # Ranks that differ in placement, the root in place and the others not,
    # and the other way round: each builds its plan from its own, so no
    # peer may take the root's output for its x (the second half of an
    # out-of-place root's output was left unwritten across nodes so).
    k = BROADCAST_PULL_MAX // 4 + 1000
    xs = [data(43, q, np.float32, k) for q in range(n)]
    for root in range(n):
        for root_in_place in (True, False):
            in_place = root_in_place == (r == root)
            got = comm.broadcast(xs[r].copy(), root=root, out=None if in_place else np.zeros(k, np.float32))
            same_bits(got, xs[root], f"broadcast root {root}, the root in place {root_in_place}")
            assert compiled.last_plan.pushes
    calls = len(runs)
    if r == 1:   # (in place, only the root pushes where n is 2)
        _host_plan.test_refuse_pushes(True)
    k = BROADCAST_PULL_MAX // 4 + 2000   # (a shape not run before: from Python, counted)
    xs = [data(42, q, np.float32, k) for q in range(n)]
    x = xs[r].copy()
    same_bits(comm.broadcast(x, root=1), xs[1], "the refused broadcast in place")
    assert comm._ranks._refused and len(runs) == calls + 1, (comm._ranks._refused, len(runs))   # noqa: SLF001


def scenario_pushes_probe_refused(comm):
    """Rank 1 may not write into its peers (from before the start, main):
    the start finds it (ShmRank._learn_reach), every rank's pushes_reached
    is -1, and allreduces (the plans' path, the loop off) read, in place
    and out of place (where pushing first would have been refused), with
    the interpreter's bits, and a reduce in place stages, with the same
    bits; nothing is refused. Then rank 1 may not read either: an
    in-place call is refused before it wrote any x, which the staged rerun
    reads whole."""
    r, n = comm.rank, comm.size
    compiled = comm._ranks._single   # noqa: SLF001
    assert compiled.pushes_reached == -1 and not comm._ranks._refused, compiled.pushes_reached   # noqa: SLF001
    k = (300 << 10) // 4
    with collectives.Communicator.local(n) as reference:
        for seed in (30, 31):
            xs = [data(seed, q, np.int32, n * k) for q in range(n)]
            want = reference.allreduce([x.copy() for x in xs], algorithm="two_shot")
            x = xs[r].copy()
            same_bits(comm.allreduce(x), want[r], "allreduce in place")
            same_bits(x, want[r], "x")
            assert not compiled.last_plan.pushes and compiled.pushes_reached == -1, compiled.pushes_reached
            same_bits(comm.allreduce(xs[r], out=np.empty(n * k, np.int32)), want[r], "allreduce out of place")
            assert not compiled.last_plan.pushes, "an out-of-place allreduce pushed"
            wants = reference.reduce([x.copy() for x in xs], root=0, algorithm="two_shot")
            x = xs[r].copy()
            comm.reduce(x, root=0)   # (in place it stages: a reduce has no in-place read form)
            same_bits(x, wants[0] if r == 0 else xs[r], "reduce in place")
            assert comm.chosen_algorithm("reduce", x.nbytes, dtype=np.int32, in_place=True).path == "compiled_plan"
        assert not comm._ranks._refused   # noqa: SLF001
        if r == 1:
            _host_plan.test_refuse_reads(True)
        x = xs[r].copy()
        same_bits(comm.allreduce(x), want[r], "the refused allreduce in place")
        same_bits(x, want[r], "the refused allreduce in place, x")
        assert comm._ranks._refused   # noqa: SLF001


# pushes_fenced: rank 1 holds each push this long inside its window; rank 0
# gives up after PUSH_FENCED_TIMEOUT, by when rank 1 is inside its first push.
PUSH_FENCED_STALL = 2.5
PUSH_FENCED_TIMEOUT = 0.8


def scenario_pushes_fenced(comm):
    """Rank 0 gives up while rank 1 is inside its first push into rank 0's
    output (a pushed allreduce on the plans' path): the failed call raises
    only once that push is done (the executor's fence), so rank 0's output
    does not change after the call raised; rank 1 learns of the abort
    before its next push. Out of place ("out"); in place, once a call
    found that pushes work ("in"); and a writer held longer than rank 0's
    fence waits, named in its error ("held", out of place)."""
    case = sys.argv[2]
    count = (4 << 20) // 4
    x = np.ones(count, np.float32)
    out = x if case == "in" else np.zeros_like(x)
    if case == "in":   # (a pushed allreduce in place only where the start found that pushes work)
        assert comm._ranks._single.pushes_reached == 1   # noqa: SLF001
    if comm.rank == 0:
        comm.timeout = PUSH_FENCED_TIMEOUT
    else:
        _host_plan.test_stall_writes(PUSH_FENCED_STALL)
    start = time.perf_counter()
    try:
        comm.allreduce(x, out=out)
    except collectives.CollectiveError as error:
        if comm.rank == 1:
            assert "aborted" in str(error) and "timed out" in str(error), error
            return
        if case == "held":
            assert "rank 1 was still writing into peers' outputs" in str(error), error
            return
        assert "timed out waiting for rank 1" in str(error) and "still writing" not in str(error), error
    else:
        raise AssertionError("the call completed although rank 0 gave up")
    assert time.perf_counter() - start >= PUSH_FENCED_STALL - 0.1, "raised before rank 1's push was done"
    pushed = out[count // 2: count // 2 + plan_slice()]
    assert (pushed == 2).all(), pushed[:4]   # rank 1's held slice landed before the call raised ...
    after_the_call = out.copy()
    time.sleep(PUSH_FENCED_STALL + 0.5)
    changed = np.flatnonzero(out != after_the_call)   # ... and nothing after it
    assert changed.size == 0, f"{changed.size} elements changed after the call raised, from {changed[0]}"


def plan_slice():
    from collectives.plan import PUSH_SLICE_BYTES
    return PUSH_SLICE_BYTES // 4


def scenario_slow_readers(comm):
    """Every reader but rank 0 is held before each read, and rank 0
    scribbles over its input as soon as its call returns: it must not
    return before they are done reading it."""
    r, n = comm.rank, comm.size
    if r != 0:
        _host_plan.test_stall_reads(0.02)
    k = 4000
    with collectives.Communicator.local(n) as reference:
        for seed in range(3):
            xs = [data(seed, q, np.int32, n * k) for q in range(n)]
            want = reference.all_to_all([x.copy() for x in xs], out=[np.empty_like(x) for x in xs])
            x = xs[r].copy()
            got = comm.all_to_all(x, out=np.empty_like(x))
            x[:] = -1
            same_bits(got, want[r], f"all_to_all {seed}")
            x = xs[0].copy()
            got = comm.scatter(x, root=0, out=np.empty(k, np.int32))
            x[:] = -1
            same_bits(got, xs[0][r * k:(r + 1) * k], f"scatter {seed}")


def expect(error_class, run, within, names):
    start = time.perf_counter()
    try:
        run()
    except Exception as error:   # noqa: BLE001 - the class is what is checked
        elapsed = time.perf_counter() - start
        message = f"{type(error).__name__}: {error}"
        assert type(error) is error_class, message
        assert all(name in str(error) for name in names), (names, message)
        assert elapsed < within, f"raised after {elapsed:.1f} s: {message}"
        return
    raise AssertionError("the call completed although rank 1 failed")


def scenario_killed(comm):
    """Rank 1 dies in the middle of an all_to_all (held in its reads): the
    others raise RankFailedError naming it, long before the timeout."""
    r, n = comm.rank, comm.size
    x = data(0, r, np.float32, n * 100000)
    comm.all_to_all(x, out=np.empty_like(x))
    if r == 1:
        _host_plan.test_stall_reads(1.0)
        threading.Timer(0.2, os._exit, (0,)).start()
    expect(RankFailedError, lambda: comm.all_to_all(x, out=np.empty_like(x)), 3.0, ["rank 1 (pid", "died"])


def scenario_killed_pushing(comm):
    """Rank 1 dies inside a pushed allreduce (held in its first push into
    rank 0, the loop off): the others raise RankFailedError naming it, long
    before the timeout, whether they were pushing into it or waiting for it."""
    r, n = comm.rank, comm.size
    x = data(0, r, np.float32, n * 100000)
    comm.allreduce(x, out=np.empty_like(x))
    assert comm._ranks._single.last_plan.pushes   # noqa: SLF001
    if r == 1:
        _host_plan.test_stall_writes(1.0)
        threading.Timer(0.2, os._exit, (0,)).start()
    expect(RankFailedError, lambda: comm.allreduce(x, out=np.empty_like(x)), 3.0, ["rank 1 (pid", "died"])


def scenario_stalled(comm):
    """Rank 1 is held in its reads past the timeout: the others raise
    CollectiveTimeoutError naming it, within the timeout and a margin."""
    r, n = comm.rank, comm.size
    x = data(0, r, np.float32, n * 100000)
    comm.all_to_all(x, out=np.empty_like(x))
    comm.timeout = 1.0
    if r == 1:
        _host_plan.test_stall_reads(3.0)
        try:
            comm.all_to_all(x, out=np.empty_like(x))
        except CollectiveTimeoutError:
            return
        raise AssertionError("the stalled rank's call completed")
    expect(CollectiveTimeoutError, lambda: comm.all_to_all(x, out=np.empty_like(x)), 3.0, ["rank 1"])


def scenario_measured(comm):
    """What the ranks chose for the exchanges' single-copy limit as the
    communicator started (ShmRank.measure), and the paths an all_to_all of
    the probe's size takes out of place and in place, as answered and as
    run: "MEASURED rank limit single-copy staged out-path in-path" (the
    probe's microseconds, None where none ran)."""
    tuning = comm.tuning
    probe = tuning["exchange_probe_us"] or {}
    x = data(0, comm.rank, np.float32, shm.EXCHANGE_PROBE_BYTES // 4 // comm.size * comm.size)
    paths = []
    for in_place in (False, True):
        answer = comm.chosen_algorithm("all_to_all", x.nbytes, dtype=np.float32, in_place=in_place)
        comm.all_to_all(x.copy(), out=None if in_place else np.empty_like(x))
        assert comm._ranks.what_ran() == ("direct", answer.path), (answer, comm._ranks.what_ran())   # noqa: SLF001
        paths.append(answer.path)
    print(f"MEASURED {comm.rank} {tuning['exchange_single_copy_min']} {probe.get('single_copy')!r} "
          f"{probe.get('staged')!r} {paths[0]} {paths[1]}", flush=True)


def limit_differs():
    """Rank 1 pins $COLLECTIVES_EXCHANGE_SINGLE_COPY_MIN, the others leave it
    unset: every rank's start raises InvalidUsageError naming it (rank 1
    would not probe while the others do), none waits for the timeout."""
    rank = int(os.environ["PMI_RANK"])
    if rank == 1:
        os.environ["COLLECTIVES_EXCHANGE_SINGLE_COPY_MIN"] = "65536"
    try:
        collectives.init(timeout=TIMEOUT)
    except collectives.InvalidUsageError as error:
        assert "COLLECTIVES_EXCHANGE_SINGLE_COPY_MIN differs among the ranks" in str(error), error
        print(f"OK limit_differs {rank}", flush=True)
        return
    raise AssertionError("a start whose ranks disagree on COLLECTIVES_EXCHANGE_SINGLE_COPY_MIN went on")


def main():
    scenario = sys.argv[1]
    if scenario == "limit_differs":
        return limit_differs()
    if scenario == "measured" and sys.argv[2:] == ["slow"]:
        _host_plan.test_stall_reads(0.002)   # every rank's probe: the single copy must lose
    if scenario == "pushes_fenced" and sys.argv[2:] == ["held"] and int(os.environ["PMI_RANK"]) == 0:
        os.environ["COLLECTIVES_FENCE_SECONDS"] = "0.2"   # rank 1 is held longer than its fence waits
    if scenario == "measured" and sys.argv[2:] == ["refused"] and int(os.environ["PMI_RANK"]) == 1:
        _host_plan.test_refuse_reads(True)   # the start's pushed call falls back: nothing to time
    if scenario == "pushes_probe_refused" and int(os.environ["PMI_RANK"]) == 1:
        _host_plan.test_refuse_pushes(True)
    comm = collectives.init(timeout=TIMEOUT)
    leaves = scenario in ("killed", "killed_pushing")
    run_scenario(lambda: globals()[f"scenario_{scenario}"](comm), ranks_leave=leaves)
    print(f"OK {scenario} {comm.rank}", flush=True)
    if leaves:
        os._exit(0)   # MPI_Finalize would wait for the dead rank
    comm.close()


if __name__ == "__main__":
    main()
