"""One rank of tests/test_host_plans.py: host ranks in separate processes
running their plans in the compiled executor (executors/host_process.py).

    mpiexec -n N python tests/host_plan_worker.py SCENARIO [MODULE]

MODULE, where given, is a build of _host_plan.c (broken on purpose by the
test) that this rank uses instead of the installed one. Each rank prints
"OK <scenario> <rank>" when what it checked held, or "CAUGHT <scenario>
<rank>: ..." when a result differed from the interpreter's.
"""

import importlib.util
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import collectives
from collectives.algorithms import REGISTRY
from collectives.executors import host, host_process

TIMEOUT = 30.0
ALGORITHMS = ("direct", "ring", "star", "tree", "halving_doubling", "two_shot", "round_robin", "butterfly")


def random_floats(seed, count):
    return np.random.default_rng([seed, count]).standard_normal(count).astype(np.float32)


def calls(comm, reference, rounds):
    """Every collective over several algorithms and sizes, on random
    floats; yields (case, this rank's result, the interpreter's)."""
    r, n = comm.rank, comm.size
    rng = np.random.default_rng(7)
    for k in range(rounds):
        for algorithm in ALGORITHMS:
            implemented = REGISTRY[algorithm].collectives
            size = int(rng.integers(1, 5000))
            if k % 2 and r == 1:   # one rank late: a wait that is missing reads what is not there yet
                time.sleep(0.002)
            inputs = [random_floats(q + 100 * k, n * size) for q in range(n)]
            if "allreduce" in implemented:
                got = comm.allreduce(inputs[r].copy(), op="sum", out=np.empty(n * size, np.float32),
                                     algorithm=algorithm)
                yield f"allreduce {algorithm} {n * size}", got, reference.allreduce(
                    [x.copy() for x in inputs], algorithm=algorithm)[r]
            if "reduce_scatter" in implemented:
                got = comm.reduce_scatter(inputs[r].copy(), op="max", out=np.empty(size, np.float32),
                                          algorithm=algorithm)
                yield f"reduce_scatter {algorithm} {size}", got, reference.reduce_scatter(
                    [x.copy() for x in inputs], op="max", algorithm=algorithm)[r]
            if "allgather" in implemented:
                got = comm.allgather(inputs[r][:size].copy(), algorithm=algorithm)
                yield f"allgather {algorithm} {size}", got, np.concatenate([x[:size] for x in inputs])
            if "reduce" in implemented:
                x = inputs[r].copy()
                comm.reduce(x, root=n - 1, op="sum", algorithm=algorithm)
                want = reference.reduce([y.copy() for y in inputs], root=n - 1, algorithm=algorithm)[r]
                yield f"reduce {algorithm} {n * size}", x, want
            if "broadcast" in implemented:
                x = inputs[r].copy()
                comm.broadcast(x, root=n // 2, algorithm=algorithm)
                yield f"broadcast {algorithm} {n * size}", x, inputs[n // 2]


def scenario_bits(comm):
    """Every call gives the interpreter's bits, whichever executor each rank runs."""
    with collectives.Communicator.local(comm.size) as reference:
        for case, got, want in calls(comm, reference, rounds=4):
            assert np.array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8)), f"{case}: {got[:4]} {want[:4]}"


def scenario_takes_the_plans(comm):
    """The compiled executor runs every uncompressed plan of the ten dtypes
    it folds (the interpreter none of them), and leaves float16 to the
    interpreter: counted, not assumed."""
    compiled = comm._ranks.compiled  # noqa: SLF001
    assert compiled is not None, "the compiled executor is not built"
    interpreted = []
    execute = host.execute
    host.execute = lambda *a, **k: (interpreted.append(1), execute(*a, **k))[1]
    before = compiled.waits_made
    for dtype in (np.float32, np.int8, np.uint64):
        x = np.arange(4 * comm.size, dtype=dtype)
        # (named algorithms but direct: with `auto` or `direct`, the compiled loop takes these calls)
        comm.reduce_scatter(x, out=np.empty(4, dtype), algorithm="ring")
        comm.allgather(x[:4], algorithm="ring")
        comm.broadcast(x, root=0, algorithm="tree")
        comm.reduce(x, root=0, op="max", algorithm="tree")
        comm.allreduce(x, algorithm="ring")
    assert not interpreted and compiled.waits_made > before, (len(interpreted), compiled.waits_made)
    comm.allreduce(np.ones(8, np.float16), algorithm="ring")
    assert interpreted, "float16 did not go to the interpreter"
    # chosen_algorithm names the path
    assert comm.chosen_algorithm("reduce_scatter", 1024, dtype=np.float32, algorithm="ring").path == "compiled_plan"
    assert comm.chosen_algorithm("allgather", 1024, dtype=np.float16).path == "step"
    for collective in ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce"):
        assert comm.chosen_algorithm(collective, 1024, dtype=np.float32).path == "compiled_loop"


def scenario_repeats(comm):
    """Calls repeated on the same arrays, new values in them each time: from
    the first repeat on the runner recognises and runs them from C (its
    Shapes: the first call's shape, on arrays that differ at most in their
    addresses; counted), with the interpreter's bits. An array reshaped or
    made read-only in place is not taken for what it was (the checks run:
    a read-only out raises, nothing written), and neither is a new array
    that took a gone one's id."""
    compiled = comm._ranks.compiled  # noqa: SLF001
    assert compiled is not None and compiled.repeat is not None, "the runner's repeats are not built"
    r, n = comm.rank, comm.size
    k = 6
    x, out = np.empty(n * k, np.float32), np.empty(n * k, np.float32)
    block, gathered = np.empty(k, np.float32), np.empty(n * n * k, np.float32)
    calls = {   # what each call is: (run it, what every rank's inputs make of it in the interpreter)
        "all_to_all direct": (lambda: comm.all_to_all(x, out=out),
                              lambda ref, xs: ref.all_to_all(xs, out=[np.empty_like(a) for a in xs])),
        "all_to_all round_robin in place": (lambda: comm.all_to_all(x, algorithm="round_robin"),
                                            lambda ref, xs: ref.all_to_all(xs, algorithm="round_robin")),
        "gather": (lambda: comm.gather(x, root=n - 1, out=gathered),
                   lambda ref, xs: ref.gather(xs, root=n - 1, out=[np.zeros(n * n * k, np.float32) for _ in xs])),
        "scatter": (lambda: comm.scatter(x, root=0, out=block),
                    lambda ref, xs: ref.scatter(xs, root=0, out=[np.empty(k, np.float32) for _ in xs])),
        "allreduce ring": (lambda: comm.allreduce(x, op="max", out=out, algorithm="ring"),
                           lambda ref, xs: ref.allreduce(xs, op="max", out=[np.empty_like(a) for a in xs],
                                                         algorithm="ring")),
        "broadcast tree in place": (lambda: comm.broadcast(x, root=1, algorithm="tree"),
                                    lambda ref, xs: ref.broadcast(xs, root=1, algorithm="tree")),
        "scatter, own block": (lambda: comm.scatter(x, root=0),
                               lambda ref, xs: ref.scatter(xs, root=0)),
        "reduce_scatter ring, own block": (lambda: comm.reduce_scatter(x, algorithm="ring"),
                                           lambda ref, xs: ref.reduce_scatter(xs, algorithm="ring")),
    }
    rounds = 5
    with collectives.Communicator.local(n) as reference:
        for name, (call, expected) in calls.items():
            before = compiled.repeats_run
            for i in range(rounds):
                inputs = [random_floats(1000 * i + q, n * k) for q in range(n)]
                x[...] = inputs[r]
                if name.startswith("gather") and r != n - 1:
                    gathered[...] = 0   # (only the root's out is written)
                result = call()
                if name.endswith("own block"):   # a view of x's own block, as the Python path returns it
                    assert result.base is x and result.__array_interface__["data"][0] == x[r * k:].ctypes.data, name
                got = np.array(result, copy=True)
                want = expected(reference, [a.copy() for a in inputs])
                want = np.asarray(want[r] if want[r] is not None else got)
                if name.startswith("gather") and r != n - 1:
                    want = np.zeros_like(gathered)
                assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), f"{name}, round {i}: {got} {want}"
            ran = compiled.repeats_run - before
            assert ran == rounds - 1, f"{name}: {ran} of {rounds} calls ran from C, not {rounds - 1}"

        # the other ranks' workspaces grown by a larger gather in between,
        # which only its root read: the next repeat from C stops on the
        # others to open their peers' new workspaces, and goes on in Python
        comm.all_to_all(x, out=out)
        comm.all_to_all(x, out=out)
        big = np.full(1 << 16, r, np.float32)
        comm.gather(big, root=n - 1, algorithm="direct")
        before = compiled.repeats_run
        x[...] = r + 1
        got = comm.all_to_all(x, out=out)
        assert compiled.repeats_run == before + 1, "the repeat after the growth did not run from C"
        assert np.array_equal(got, np.repeat(np.arange(1, n + 1, dtype=np.float32), k)), got

        # reshaped in place: the checks run again (a new call), and it is remembered anew
        before = compiled.repeats_run
        x[...] = r
        x.shape = (n, k)
        out.shape = (n, k)
        got = comm.all_to_all(x, out=out)
        assert compiled.repeats_run == before and got.shape == (n, k), (compiled.repeats_run, got.shape)
        assert np.array_equal(got, np.repeat(np.arange(n, dtype=np.float32), k).reshape(n, k)), got
        x.shape = out.shape = (n * k,)

        # made read-only: refused by the checks, nothing written
        comm.all_to_all(x, out=out)
        comm.all_to_all(x, out=out)
        before = compiled.repeats_run
        refused_read_only(lambda read_only: comm.all_to_all(x, out=read_only), out)
        assert compiled.repeats_run == before
        out.flags.writeable = True

        # a gone array's id taken by another: not the remembered call
        for size in (k, 2 * k, k):
            y = np.full(n * size, r, np.float32)
            o = np.empty(n * size, np.float32)
            for _ in range(3):
                got = comm.all_to_all(y, out=o)
                assert np.array_equal(got, np.repeat(np.arange(n, dtype=np.float32), size)), (size, got)
            del y, o

        new_arrays_of_a_shape(comm, compiled, reference)


def new_arrays_of_a_shape(comm, compiled, reference):
    """New arrays each call, of a shape a call ran before: run from C (the
    runner's Shapes) with the interpreter's bits; arrays that differ in
    more than their addresses, or an out that overlaps x, go to the checks."""
    r, n, k, rounds = comm.rank, comm.size, 5, 4
    calls = {   # (run it on new arrays, what every rank's inputs make of it in the interpreter)
        "all_to_all direct": (lambda x: comm.all_to_all(x, out=np.empty(n * k, np.float32)),
                              lambda xs: reference.all_to_all(xs, out=[np.empty_like(a) for a in xs])),
        "gather": (lambda x: comm.gather(x, root=1, out=np.full(n * n * k, -1, np.float32)),
                   lambda xs: reference.gather(xs, root=1, out=[np.full(n * n * k, -1, np.float32) for _ in xs])),
        "allreduce ring in place": (lambda x: comm.allreduce(x, op="min", algorithm="ring"),
                                    lambda xs: reference.allreduce(xs, op="min", algorithm="ring")),
        "reduce_scatter ring, own block": (lambda x: comm.reduce_scatter(x, algorithm="ring"),
                                           lambda xs: reference.reduce_scatter(xs, algorithm="ring")),
        "allgather ring, a new out": (lambda x: comm.allgather(x, algorithm="ring"),
                                      lambda xs: reference.allgather(xs, algorithm="ring")),
        "gather, a new out": (lambda x: comm.gather(x, root=2 % n), lambda xs: reference.gather(xs, root=2 % n)),
    }
    for name, (call, expected) in calls.items():
        before = compiled.repeats_run
        for i in range(rounds):
            inputs = [random_floats(50 * i + q, n * k) for q in range(n)]
            x = inputs[r].copy()
            result = call(x)
            want = expected([a.copy() for a in inputs])[r]
            if name.startswith("gather, a new out") and want is None:   # (a rank not the root gets None)
                assert result is None, (name, result)
                continue
            got = np.array(result, copy=True)
            want = np.full_like(got, -1) if want is None else np.asarray(want)
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), f"{name} on new arrays, {i}: {got} {want}"
        ran = compiled.repeats_run - before
        assert ran == rounds - 1, f"{name}: {ran} of {rounds} calls on new arrays ran from C, not {rounds - 1}"

    before = compiled.repeats_run
    x = np.full(n * k, r, np.float32)
    comm.all_to_all(x.astype(np.float64), out=np.empty(n * k, np.float64))          # another dtype
    comm.all_to_all(np.full((n, k), r, np.float32), out=np.empty((n, k), np.float32))   # another shape
    # views of one buffer: apart (a shape of views, run from C from the
    # second call on), then an out that overlaps x, which the checks bind
    # through a workspace
    buffer = np.zeros(3 * n * k, np.float32)
    for _ in range(2):
        buffer[:n * k] = r
        got = comm.all_to_all(buffer[:n * k], out=buffer[2 * n * k:])
        assert np.array_equal(got, np.repeat(np.arange(n, dtype=np.float32), k)), got
    assert compiled.repeats_run == before + 1, compiled.repeats_run - before
    buffer[:n * k] = r
    got = comm.all_to_all(buffer[:n * k], out=buffer[k:k + n * k])
    assert np.array_equal(got, np.repeat(np.arange(n, dtype=np.float32), k)), got
    assert compiled.repeats_run == before + 1, compiled.repeats_run - before
    before = compiled.repeats_run
    refused_read_only(lambda read_only: comm.all_to_all(x, out=read_only), np.empty(n * k, np.float32))
    assert compiled.repeats_run == before, compiled.repeats_run - before


def refused_read_only(call, out):
    """`call(out)`, `out` filled with -1 and made read-only: the checks
    refuse it (InvalidUsageError), nothing written."""
    out[...] = -1
    out.flags.writeable = False
    try:
        call(out)
    except collectives.InvalidUsageError:
        pass
    else:
        raise AssertionError("a read-only out was taken")
    assert (out == -1).all(), "a read-only out was written"


def scenario_repeat_killed(comm):
    """Rank 1 dies between repeats that run from C: the others' next repeat
    raises RankFailedError within a second (the runner's waits read the dead
    rank's pid), and so does every later one (the communicator is aborted)."""
    r, n = comm.rank, comm.size
    x, out = np.full(4 * n, r, np.float32), np.empty(4 * n, np.float32)
    before = comm._ranks.compiled.repeats_run   # noqa: SLF001 - (the start's probe made some)
    for _ in range(6):   # (from the second on, from C)
        comm.all_to_all(x, out=out)
    assert comm._ranks.compiled.repeats_run == before + 5  # noqa: SLF001
    comm.barrier()
    if r == 1:
        os._exit(0)
    for attempt in ("the first", "a later"):
        start = time.perf_counter()
        try:
            comm.all_to_all(x, out=out)
        except collectives.RankFailedError as error:
            assert time.perf_counter() - start < 1.0, f"{attempt} repeat took {time.perf_counter() - start:.2f} s"
            assert "rank 1" in str(error), error
        else:
            raise AssertionError(f"{attempt} repeat completed without rank 1")
    print(f"OK repeat_killed {r}", flush=True)
    os._exit(0)   # (MPI_Finalize would wait for the dead rank)


def plan_that_ran(comm):
    """The plan of this rank's last call on the plans, whichever executor ran it."""
    ranks = comm._ranks  # noqa: SLF001
    return ranks._interpreted or ranks._single.last_plan  # noqa: SLF001


def scenario_segments(comm):
    """With $COLLECTIVES_PLAN_SEGMENT_BYTES small (the test's), the five
    collectives of more than two segments run their plans in segments (the
    plan that ran says so: counted, not assumed) with the bits of the same
    calls made on the segments one after the other (reduce_scatter's and
    allgather's segments are slices of every rank's block): every
    algorithm, in place and out of place, with and without a shorter last
    segment; a call of two segments runs whole."""
    segment_bytes = int(os.environ["COLLECTIVES_PLAN_SEGMENT_BYTES"])
    r, n, root = comm.rank, comm.size, 1
    segmented = 0
    with collectives.Communicator.local(n) as reference:
        for collective in ("allreduce", "broadcast", "reduce", "reduce_scatter", "allgather"):
            blocks = n if collective in ("reduce_scatter", "allgather") else 1
            per_block = segment_bytes // 4 // blocks   # (the segment's elements of each rank's block)
            for block in (3 * per_block, 4 * per_block + 37, 2 * per_block):
                inputs = [random_floats(q, blocks * block) for q in range(n)]
                in_segments = block > 2 * per_block
                runs = [(s, min(per_block, block - s)) for s in range(0, block, per_block)] if in_segments \
                    else [(0, block)]
                for algorithm in ("auto",) + ALGORITHMS:
                    if algorithm != "auto" and collective not in REGISTRY[algorithm].collectives:
                        continue
                    for in_place in (False, True):
                        case = f"{collective} {algorithm} of {block} {'in place' if in_place else 'out of place'}"
                        comm._ranks.forget_what_ran()  # noqa: SLF001
                        got = segments_call(comm, collective, inputs[r], block, root, algorithm, in_place)
                        plan = plan_that_ran(comm)
                        assert plan.segment == (per_block * blocks if in_segments else 0), (case, plan.segment)
                        segmented += in_segments
                        if collective == "reduce" and r != root:
                            continue
                        if collective in ("broadcast", "allgather"):   # (copies: the same bits however cut)
                            want = inputs[root] if collective == "broadcast" else \
                                np.concatenate([a[:block] for a in inputs])
                        else:   # the same algorithm's calls on the segments, one after the other (or one call)
                            method = getattr(reference, collective)
                            rooted = {"root": root} if collective == "reduce" else {}
                            want = np.concatenate([method(
                                [np.concatenate([a[b * block + s:b * block + s + length] for b in range(blocks)])
                                 for a in inputs], algorithm=plan.algorithm, **rooted)[r] for s, length in runs])
                        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (case, got[:4], want[:4])
    assert segmented > 60, segmented
    # A message larger than every workspace so far (the start's probes grew them to about 1 MiB): each
    # rank's workspace holds one segment, and both executors address no more of it.
    x = np.full(1 << 20, r + 1, np.float32)
    comm.allreduce(x, algorithm="ring")
    assert plan_that_ran(comm).segment == segment_bytes // 4 and (x == n * (n + 1) // 2).all()


def segments_call(comm, collective, values, block, root, algorithm, in_place):
    """scenario_segments' call of `collective` on this rank's `values`
    (blocks of `block` elements): its result (x or out; reduce_scatter's,
    this rank's block)."""
    n, r = comm.size, comm.rank
    if collective == "allgather":
        out = np.zeros(n * block, np.float32)
        if in_place:   # (x is the rank's block of out)
            out[r * block:(r + 1) * block] = values[:block]
            return comm.allgather(out[r * block:(r + 1) * block], out=out, algorithm=algorithm)
        return comm.allgather(values[:block].copy(), out=out, algorithm=algorithm)
    x = values.copy()
    out = None if in_place else np.empty(block, np.float32)
    if collective == "reduce_scatter":
        return comm.reduce_scatter(x, out=out, algorithm=algorithm)   # (in place: x's block of this rank)
    rooted = {} if collective == "allreduce" else {"root": root}
    getattr(comm, collective)(x, out=out, algorithm=algorithm, **rooted)
    return x if in_place else out


def scenario_segments_differ(comm):
    """Ranks that cut a call into segments of different sizes: each names the
    mismatch (the call's signature says how it is cut), nothing is exchanged."""
    segment = int(os.environ["COLLECTIVES_PLAN_SEGMENT_BYTES"]) // 4
    try:
        comm.allreduce(np.ones(9 * segment, np.float32), algorithm="ring")
    except collectives.InvalidUsageError as error:
        assert "a different call" in str(error) and "in segments of" in str(error), error
    else:
        raise AssertionError("ranks that cut a call differently were not told")
    print(f"OK segments_differ {comm.rank}", flush=True)
    MPI.COMM_WORLD.Barrier()
    os._exit(0)   # (the communicator is aborted: its close would say so again)


def scenario_broken(comm):
    """A broken build: some rank's result differs from the interpreter's.
    The first call grows every workspace past what the others need, so that
    a build that skips waits reads stale data, not memory a peer has yet to
    grow (which would crash it: caught too, but not by the comparison)."""
    comm.allreduce(np.zeros(1 << 20, np.float32), algorithm="direct")
    wrong = None
    with collectives.Communicator.local(comm.size) as reference:
        for case, got, want in calls(comm, reference, rounds=6):
            if wrong is None and not np.array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8)):
                wrong = case
    everyone = MPI.COMM_WORLD.allgather(wrong)
    caught = [w for w in everyone if w is not None]
    return f"CAUGHT broken {comm.rank}: {caught[0]}" if caught else None


def load_build(path):
    """The _host_plan module built at `path`, in place of the installed one."""
    spec = importlib.util.spec_from_file_location("collectives.executors._host_plan", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    host_process._host_plan = module


def main():
    scenario = sys.argv[1]
    if len(sys.argv) > 2:
        load_build(sys.argv[2])
    comm = collectives.init(timeout=TIMEOUT)
    result = globals()[f"scenario_{scenario}"](comm)
    comm.barrier()
    print(result or f"OK {scenario} {comm.rank}", flush=True)
    comm.close()


if __name__ == "__main__":
    main()
