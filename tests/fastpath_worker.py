"""One rank of tests/test_fastpath.py, under mpiexec: host ranks' allreduce
in the compiled loop (collectives/transport/fastpath.py).

    python fastpath_worker.py <scenario> [no-loop]

`no-loop` hides the compiled loop before collectives is imported, so the
same scenario runs on the NumPy interpreter alone. Each rank prints
"OK <scenario> <rank> <digest>"; the digest covers every result, so two runs
can be compared bit for bit.
"""

import gc
import hashlib
import os
import signal
import sys
import threading
import time
import weakref

if len(sys.argv) > 2 and sys.argv[2] == "no-loop":
    sys.modules["collectives.transport._shmloop"] = None   # import now raises ImportError

import numpy as np
from mpi4py import MPI

import collectives
from cases import expect_a_different_call, gave_up_on, run_scenario, stall_until_the_others_gave_up
from collectives.errors import CollectiveError, CollectiveTimeoutError, InvalidUsageError, RankFailedError
from collectives.transport import fastpath
from collectives.plan import SINGLE_COPY_ALGORITHMS

TIMEOUT = 5.0
# The loop's sizes, as the communicators made here resolve them (config.FastSizes).
SIZES = collectives.config.resolve_fast_sizes()
STALL_TIMEOUT = 1.0   # what a stalled-rank scenario waits: its waiting is the test's whole cost
LOOP = sys.argv[2:] != ["no-loop"]
DTYPES = [np.float32, np.float64, np.int8, np.uint8, np.int16, np.int32, np.uint32, np.int64, np.uint64]


def declined_dtypes():   # 16-bit floats accumulate in float32: the interpreter's
    return [np.dtype(np.float16), collectives.ops.bfloat16()]
OPS = ["sum", "prod", "max", "min", "avg"]


def sizes_to_cover(itemsize):
    """Element counts on both sides of the loop's boundaries: the merged
    step's limit, one pipeline chunk per block, ragged blocks."""
    small = SIZES.small_max // itemsize
    chunk = SIZES.chunk // itemsize
    return sorted({1, 3, 1000, small - 1, small, small + 1, 2 * chunk - 1, 2 * chunk + 7, 5 * chunk + 3})


def inputs(rank, count, dtype, rng):
    dtype = np.dtype(dtype)
    if collectives.ops.is_floating(dtype):
        x = rng.standard_normal(count).astype(np.float32) * 3
        if count > 10:   # the IEEE corner cases of max/min and sums: NaN, -0 and +0, inf
            x[:6] = [np.nan if rank == 1 else 1.0, -0.0 if rank % 2 else 0.0, np.inf, -np.inf if rank else 2.0,
                     0.0, -0.0]
        return x.astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(max(info.min, -100), min(info.max, 100), count, endpoint=True).astype(dtype)


def scenario_bits(comm, digest):
    """Out of place and in place, every dtype and op, equal to the `direct`
    plan's bits and the same on every rank; other collectives in between."""
    rng = np.random.default_rng(1234 + comm.rank)
    world = MPI.COMM_WORLD
    for dtype in DTYPES:
        for count in sizes_to_cover(np.dtype(dtype).itemsize):
            for op in OPS:
                x = inputs(comm.rank, count, dtype, rng).reshape(-1, 1) if count % 2 else inputs(
                    comm.rank, count, dtype, rng)
                # The interpreter's direct plan folds in rank order, as the loop does.
                reference = planned(comm.allreduce, x.copy(), op=op)
                out = np.empty_like(x)
                got = comm.allreduce(x, op=op, out=out)
                assert got is out
                in_place = x.copy()
                assert comm.allreduce(in_place, op=op) is in_place
                for result, how in ((out, "out of place"), (in_place, "in place")):
                    # Without the loop, `auto` is the interpreter's pick, whose fold order may differ.
                    if LOOP and result.tobytes() != reference.tobytes():
                        raise AssertionError(f"{np.dtype(dtype).name} {count} {op} {how}: "
                                             + which_is_wrong(x, op, result, reference))
                everyone = world.allgather(hashlib.blake2b(out.tobytes()).hexdigest())
                assert len(set(everyone)) == 1, (np.dtype(dtype).name, count, op, "ranks differ")
                digest.update(reference.tobytes())   # with the loop, also `out`'s and `in_place`'s bits
            # A planned collective between fast ones keeps the counters in step.
            block = planned(comm.broadcast, np.arange(8, dtype=np.float64) + comm.rank, root=comm.size - 1)
            assert block[0] == comm.size - 1


def planned(method, x, out=None, op="sum", root=0):
    """`method` (a Communicator's collective, named as the registry names
    it) run by the `direct` plan, the loop's reference: through
    _collective, which plans every call on a list (a single array naming
    `direct` takes the loop: fastpath.runs_as; so does a list of one given
    to the collective itself)."""
    comm = method.__self__
    return comm._collective(method.__name__, [x], op, None if out is None else [out], root, "direct")[0]   # noqa: SLF001


def counts_to_cover(itemsize, n, collective):
    """Elements of x on both sides of the merged step's limit, and over
    several staging segments (nranks chunks each); reduce_scatter's a
    multiple of the rank count, as it must be."""
    small = SIZES.small_max // itemsize
    segment = n * SIZES.chunk // itemsize
    counts = [1, 1000, small, small + 1, segment + 3, 2 * segment + 11]
    return [c * n for c in {c // n or 1 for c in counts}] if collective == "reduce_scatter" else counts


def calls_of(comm, collective, x, root, op):
    """The four ways to make the call: (name, fast call, reference call); the
    reference is the `direct` plan, which folds in rank order as the loop does."""
    n, r = comm.size, comm.rank
    if collective == "reduce_scatter":   # in place: the result is a view of x's own block
        block = x.size // n
        reference = lambda: planned(comm.reduce_scatter, x, op=op, out=np.empty(block, x.dtype))
        yield "out", lambda: comm.reduce_scatter(x, op=op, out=np.empty(block, x.dtype)), reference
        yield "in place", lambda: comm.reduce_scatter(x.copy(), op=op), reference
    elif collective == "allgather":
        yield ("new", lambda: comm.allgather(x), lambda: planned(comm.allgather, x))
        out = np.zeros((n * x.size,), x.dtype)
        out[r * x.size:(r + 1) * x.size] = x.reshape(-1)
        yield ("in place", lambda: comm.allgather(out[r * x.size:(r + 1) * x.size], out=out),
               lambda: planned(comm.allgather, x))
    elif collective == "broadcast":
        yield ("out", lambda: comm.broadcast(x, root=root, out=np.zeros_like(x)),
               lambda: planned(comm.broadcast, x, root=root, out=np.zeros_like(x)))
        yield ("in place", lambda: comm.broadcast(x.copy(), root=root),
               lambda: planned(comm.broadcast, x.copy(), root=root))
    else:
        yield ("out", lambda: comm.reduce(x, root=root, op=op, out=np.zeros_like(x)),
               lambda: planned(comm.reduce, x, root=root, op=op, out=np.zeros_like(x)))
        yield ("in place", lambda: comm.reduce(x.copy(), root=root, op=op),
               lambda: planned(comm.reduce, x.copy(), root=root, op=op))


def scenario_collectives(comm, digest):
    """reduce_scatter, allgather, broadcast and reduce with `auto`: the
    loop's bits equal the `direct` plan's on every rank, out of place and in
    place (reduce_scatter's own block, allgather's block of `out`), for every
    dtype on the merged step and three over staging segments or the single
    copy (a fold's the loop leaves to the plans: theirs); every
    op; both ends for the root. Inputs are left as they were."""
    rng = np.random.default_rng(99 + comm.rank)
    n = comm.size
    compiled = comm._ranks.compiled   # noqa: SLF001 - its waits tell a plan's run from the loop's
    loop = comm._ranks.fast   # noqa: SLF001 - its channel counts the large calls it staged
    stages_spread = fastpath.stages_spread(comm._ranks.group)   # noqa: SLF001
    for collective in ("reduce_scatter", "allgather", "broadcast", "reduce"):
        for dtype in DTYPES:
            itemsize = np.dtype(dtype).itemsize
            for count in counts_to_cover(itemsize, n, collective):
                if count * itemsize > SIZES.small_max and dtype not in (np.float32, np.float64, np.int8):
                    continue
                ops = OPS if collective in ("reduce_scatter", "reduce") else ["sum"]
                for op, root in zip(ops, [0, n - 1, 0, n - 1, 0]):
                    x = inputs(comm.rank, count, dtype, rng)
                    if count % n == 0 and count > n:
                        x = x.reshape(n, -1)
                    before = x.copy()
                    # (a large fold the ranks may single copy the loop leaves to the plans: auto's single copy)
                    left_to_plans = loop.step_for(collective, x.nbytes) == fastpath.PLANS
                    for how, fast, reference in calls_of(comm, collective, x, root, op):
                        plan_waits, staged = compiled.waits_made, loop._channel.staged_calls   # noqa: SLF001
                        got = fast()
                        assert (compiled.waits_made > plan_waits) == left_to_plans, \
                            f"{collective} {how}: expected {'the plans' if left_to_plans else 'the loop'} to run it"
                        if left_to_plans:
                            ran = comm._ranks.what_ran()   # noqa: SLF001
                            assert ran == (SINGLE_COPY_ALGORITHMS[collective][0], "single_copy"), (collective, how, ran)
                            assert loop._channel.staged_calls == staged, f"{collective} {how}: staged"   # noqa: SLF001
                            if collective == "broadcast":
                                # below the pull limit every reader pulls all of x and nobody writes into
                                # a peer; from it the root's x is spread, each rank writing a block into
                                # every other output (plan.spread_plan)
                                spread = x.nbytes >= comm._ranks._broadcast_pull_max   # noqa: SLF001
                                pushed = comm._ranks._single.last_plan.pushes   # noqa: SLF001
                                assert bool(pushed) == spread, f"broadcast {how} {x.nbytes} bytes: pushes {pushed}"
                        elif count * itemsize > SIZES.small_max:   # staged where it must be, and only there
                            spread_staged = (stages_spread and collective == "allgather"
                                             and x.nbytes <= loop.tunables.spread_staged_max)
                            want = loop.large_path == "staged" or spread_staged
                            assert (loop._channel.staged_calls > staged) == want, (   # noqa: SLF001
                                f"{collective} {how} {x.nbytes} bytes: staged {not want}, expected {want}")
                        want = reference()
                        assert compiled.waits_made > plan_waits, "the reference ran no plan"
                        if collective == "reduce" and comm.rank != root:
                            want = got = np.zeros(0)   # only the root's output is defined
                        if got.tobytes() != want.tobytes():
                            raise AssertionError(f"{collective} {how} {np.dtype(dtype).name} {count} {op} root {root}: "
                                                 f"the loop's result differs from the direct plan's")
                        digest.update(want.tobytes())
                    assert before.tobytes() == x.tobytes(), f"{collective}: x changed"
        # every call above but the references took the loop (or none did)
        chosen = comm.chosen_algorithm(collective, 64, dtype=np.float32)
        assert (chosen.path == "compiled_loop") == LOOP, chosen
    named_direct_takes_the_loop(comm, digest, rng)


def named_direct_takes_the_loop(comm, digest, rng):
    """A call naming `direct` on one array runs in the loop where the loop's
    step is direct's (every collective's merged step; the large step but
    allreduce's, whose pipeline is two_shot's traffic, and a fold's the loop
    leaves to the plans), with the plan's bits."""
    n, compiled = comm.size, comm._ranks.compiled   # noqa: SLF001
    small = inputs(comm.rank, 4 * n, np.float64, rng)
    large = inputs(comm.rank, SIZES.small_max // 8 * n + n, np.float64, rng)
    for x in (small, large):
        k = x.size // n
        calls = {
            "allreduce": (lambda: comm.allreduce(x, out=np.empty_like(x), algorithm="direct"),
                          lambda: planned(comm.allreduce, x, out=np.empty_like(x))),
            "reduce_scatter": (lambda: comm.reduce_scatter(x, op="max", out=np.empty(k, x.dtype), algorithm="direct"),
                               lambda: planned(comm.reduce_scatter, x, op="max", out=np.empty(k, x.dtype))),
            "allgather": (lambda: comm.allgather(x, algorithm="direct"), lambda: planned(comm.allgather, x)),
            "broadcast": (lambda: comm.broadcast(x, root=n - 1, out=np.empty_like(x), algorithm="direct"),
                          lambda: planned(comm.broadcast, x, root=n - 1, out=np.empty_like(x))),
            "reduce": (lambda: comm.reduce(x, root=0, out=np.empty_like(x), algorithm="direct"),
                       lambda: planned(comm.reduce, x, root=0, out=np.empty_like(x))),
        }
        for collective, (named, reference) in calls.items():
            # (a large fold the ranks may single copy the loop leaves to the plans)
            left_to_plans = comm._ranks.fast.step_for(collective, x.nbytes) == fastpath.PLANS   # noqa: SLF001
            looped = fastpath.runs_as(collective, "direct", x.nbytes, comm._ranks.fast_small_max) \
                and not left_to_plans   # noqa: SLF001
            plan_waits = compiled.waits_made
            got = named()
            assert (compiled.waits_made == plan_waits) == looped, f"{collective} {x.nbytes} bytes naming direct"
            chosen = comm.chosen_algorithm(collective, x.nbytes, dtype=x.dtype, algorithm="direct", in_place=False)
            single_copy = left_to_plans and "direct" in SINGLE_COPY_ALGORITHMS[collective]   # (not allreduce's)
            path = "compiled_loop" if looped else "single_copy" if single_copy else "compiled_plan"
            assert (chosen, chosen.path) == ("direct", path), (chosen, chosen.path, path)
            want = reference()
            if collective == "reduce" and comm.rank != 0:
                want = got = np.zeros(0)   # only the root's output is defined
            assert got.tobytes() == want.tobytes(), f"{collective} {x.nbytes} bytes naming direct: not the plan's bits"
            digest.update(want.tobytes())


def scenario_edge_arrays(comm, digest):
    """Legal calls whose arrays differ from rank to rank in ways the loop
    must take alike on every rank (else a rank declining to the plans while
    the others take the loop would make a valid call fail):
    - the first large call, a reduce whose other ranks' outputs are
      read-only: staged in the loop, or in one copy on the plans (the
      loop leaves it to them), whose pushed reduce writes no output but
      the root's;
    - outputs that partly overlap their input on one rank only (reduce,
      broadcast, reduce_scatter, allgather): the loop reads a private copy;
    - a memory-mapped array, a NumPy integer root;
    - a broadcast root's read-only output is refused, as the plans refuse it."""
    import mmap
    r, n = comm.rank, comm.size
    large = (SIZES.small_max // 4) * 3 + n * 16   # float32 elements: past the merged step, whole blocks
    x = np.arange(large, dtype=np.float32) + r
    sealed = mmap.mmap(-1, x.nbytes, prot=mmap.PROT_READ)
    out = np.zeros_like(x) if r == 0 else np.frombuffer(sealed, np.float32)
    comm.reduce(x, root=0, out=out)
    if r == 0:
        assert np.array_equal(out, np.arange(large, dtype=np.float32) * n + sum(range(n)))
    if comm._ranks.fast.step_for("reduce", x.nbytes) == fastpath.PLANS:   # noqa: SLF001
        assert comm._ranks.what_ran() == ("two_shot", "single_copy"), comm._ranks.what_ran()   # noqa: SLF001
    for count in (1000, 32776, large):
        x = np.arange(count, dtype=np.float32) * (r + 1)
        want_sum = np.arange(count, dtype=np.float32) * sum(range(1, n + 1))
        buf = np.zeros(count + 1, np.float32)
        buf[:count] = x
        got = comm.reduce(buf[:count], root=0, out=buf[1:] if r == 0 else np.zeros(count, np.float32))
        if r == 0:
            assert np.array_equal(got, want_sum), ("reduce, overlapping out", count)
        buf = np.zeros(count + 1, np.float32)
        buf[:count] = x
        got = comm.broadcast(buf[:count], root=0, out=buf[1:] if r == 0 else np.zeros(count, np.float32))
        assert np.array_equal(got, np.arange(count, dtype=np.float32)), ("broadcast, overlapping out", count)
        whole = np.arange(n * count, dtype=np.float32) * (r + 1)
        block = comm.reduce_scatter(whole.copy(), out=whole[((r + 1) % n) * count:][:count] if r == 0 else None)
        want = np.arange(n * count, dtype=np.float32)[r * count:(r + 1) * count] * sum(range(1, n + 1))
        assert np.array_equal(block, want), ("reduce_scatter, out another block of x", count)
        gathered = np.zeros(n * count + 1, np.float32)
        mine = gathered[1:count + 1] if r == 0 else x
        mine[...] = x
        got = comm.allgather(mine, out=gathered[:n * count] if r == 0 else np.zeros(n * count, np.float32))
        want = np.concatenate([np.arange(count, dtype=np.float32) * (q + 1) for q in range(n)])
        assert np.array_equal(got, want), ("allgather, x partly overlapping out on rank 0", count)
        digest.update(got.tobytes())
    y = np.memmap(f"/dev/shm/fastpath-edge-{os.getpid()}", np.float32, "w+", shape=(1000,))
    try:
        y[...] = r
        assert comm.broadcast(y, root=np.int64(n - 1)) is y and (y == n - 1).all()
        assert np.array_equal(comm.allreduce(y), np.full(1000, (n - 1) * n, np.float32))
    finally:
        del y
        os.unlink(f"/dev/shm/fastpath-edge-{os.getpid()}")
    sealed_out = np.frombuffer(mmap.mmap(-1, 4000, prot=mmap.PROT_READ), np.float32)
    try:
        comm.broadcast(np.ones(1000, np.float32), root=0, out=sealed_out if r == 0 else np.zeros(1000, np.float32))
    except (InvalidUsageError, CollectiveError) as error:
        assert r != 0 or "read-only" in str(error), error
    else:
        raise AssertionError("a broadcast into the root's read-only output completed")


def which_is_wrong(x, op, result, reference):
    """For a failure report: both against a NumPy fold of every rank's input."""
    if op not in ("sum", "max", "min", "prod"):
        return "results differ"
    fold = {"sum": np.add, "max": np.fmax, "min": np.fmin, "prod": np.multiply}[op]
    everyone = MPI.COMM_WORLD.allgather(x)
    expected = everyone[0].copy()
    for other in everyone[1:]:
        expected = fold(expected, other)
    wrong = lambda got: np.flatnonzero(got.reshape(-1) != expected.reshape(-1))
    return (f"the loop's result differs from NumPy at {wrong(result)[:8]} ({len(wrong(result))} elements), "
            f"the interpreter's at {wrong(reference)[:8]} ({len(wrong(reference))} elements)")


def scenario_declined(comm, digest):
    """What the loop does not take goes to the interpreter, unchanged."""
    fast = comm._ranks.fast_allreduce   # noqa: SLF001
    x = np.ones(1000, np.float32)
    declined = [np.ones(10, dtype) for dtype in declined_dtypes()] + [
        [x],                                    # a list, even of one array
        np.ones((10, 10), np.float32)[:, ::2],  # not contiguous: the interpreter refuses it
        np.ones(0, np.float32),                 # nothing to reduce
    ]
    for array in declined:
        if fast is not None:
            assert fast(array, "sum", None, TIMEOUT) is None, array
    # An output overlapping its input is taken (the loop reads a private copy of x), as the plans take it.
    y = np.arange(1000, dtype=np.float32)
    got = comm.allreduce(y[:600], out=y[400:])
    assert got.base is y and np.array_equal(y[400:], np.arange(600, dtype=np.float32) * comm.size), y[400:410]
    assert fast is None or fast(x, "no such op", None, TIMEOUT) is None
    # chosen_algorithm names the loop's step exactly for the dtypes it takes, but
    # a large allreduce the loop leaves to the plans' single copy (its step PLANS)
    loop_dtypes = DTYPES + [np.uint16]
    for dtype in loop_dtypes + declined_dtypes() + [np.dtype(">f4"), np.complex64]:
        taken = fast is not None and fast(np.ones(10, dtype), "sum", None, TIMEOUT) is not None
        for nbytes, steps in ((40, {fastpath.MERGED}), (SIZES.small_max + 8, {fastpath.STAGED})):
            named = comm.chosen_algorithm("allreduce", nbytes, dtype=dtype)
            looped = (named.path, named.step in steps, named) == ("compiled_loop", True,
                                                                  fastpath.step_algorithm("allreduce", named.step))
            left_to_plans = taken and comm._ranks.fast.step_for("allreduce", nbytes) == fastpath.PLANS   # noqa: SLF001
            assert looped == (taken and not left_to_plans), (dtype, nbytes, named, taken)
            if left_to_plans:
                assert (named, named.path) == ("two_shot", "single_copy"), (dtype, nbytes, named)
        assert taken == (LOOP and np.dtype(dtype) in loop_dtypes), dtype
    # no dtype: one the path takes
    assert (comm.chosen_algorithm("allreduce", 40).path == "compiled_loop") == LOOP
    for dtype in declined_dtypes():
        y = comm.allreduce(np.full(100, comm.rank + 0.5, dtype), algorithm="direct")
        assert float(y[0]) == sum(r + 0.5 for r in range(comm.size))
        digest.update(y.tobytes())


def without_rank_1(comm, call, named):
    """Rank 1 stops calling in; the others' `call` raises a timeout naming
    rank 1 and `named` (or the abort of a rank that timed out first) within
    the short timeout, not a hang."""
    comm.timeout = STALL_TIMEOUT
    if comm.rank == 1:
        stall_until_the_others_gave_up(1, longest=STALL_TIMEOUT + 2)
        return
    start = time.perf_counter()
    try:
        call()
    except CollectiveTimeoutError as error:
        assert "timed out waiting for rank 1" in str(error) and named in str(error), error
    except CollectiveError as error:   # another rank timed out first and aborted
        assert "aborted" in str(error) and "timed out" in str(error), error
    else:
        raise AssertionError("the call completed without rank 1")
    assert time.perf_counter() - start < STALL_TIMEOUT + 1.5
    gave_up_on(1)


def scenario_stalled_large(comm):
    """Rank 1 stops calling in during a pipelined allreduce: a timeout, not a hang."""
    without_rank_1(comm, lambda: comm.allreduce(np.ones(1 << 20, np.float32)), "algorithm two_shot")


def scenario_killed_large(comm):
    """Rank 1 dies between calls: the others learn it from its pid within a second."""
    comm.allreduce(np.ones(1 << 20, np.float32))
    comm.barrier()
    if comm.rank == 1:
        os._exit(0)
    start = time.perf_counter()
    try:
        comm.allreduce(np.ones(1 << 20, np.float32))
    except (RankFailedError, CollectiveError) as error:
        assert isinstance(error, RankFailedError) or "died" in str(error), error
        assert time.perf_counter() - start < 1.0, "a dead rank should be reported within a second"
    else:
        raise AssertionError("allreduce completed without rank 1")


def scenario_mismatch(comm):
    """Ranks disagree: different sizes on the two paths, a different op, and a
    fast call against an interpreted one. Each is named, none hangs."""
    cases = [
        lambda: comm.allreduce(np.ones(10 if comm.rank == 0 else 1 << 20, np.float32)),
        lambda: comm.allreduce(np.ones(1 << 20, np.float32), op="sum" if comm.rank == 0 else "max"),
        lambda: comm.allreduce(np.ones(100, np.float32), algorithm="auto" if comm.rank == 0 else "ring"),
    ]
    case = int(os.environ["FASTPATH_CASE"])
    expect_a_different_call(cases[case], f"mismatched allreduce {case}")



def scenario_spread_mismatch(comm):
    """Rank 0 reads allgathers in place where its peers would stage them
    ($COLLECTIVES_SPREAD_STAGED_MAX differs, main): named as a different
    call, not waited out until the timeout."""
    start = time.perf_counter()
    expect_a_different_call(lambda: comm.allgather(np.ones(64 << 10, np.float32)), "an allgather staged on some ranks")
    assert time.perf_counter() - start < TIMEOUT / 2, f"named after {time.perf_counter() - start:.1f} s"


def scenario_abort(comm):
    """Rank 0 leaves a `with` block by an exception: the others, in a fast
    allreduce, see the abort at once instead of waiting out the timeout."""
    if comm.rank == 0:
        try:
            with comm:
                raise RuntimeError("rank 0 gave up")
        except RuntimeError:
            return
    start = time.perf_counter()
    try:
        comm.allreduce(np.ones(1 << 20, np.float32))
    except CollectiveError as error:
        assert "aborted" in str(error) and "gave up" in str(error), error
        assert time.perf_counter() - start < TIMEOUT / 2
    else:
        raise AssertionError("allreduce completed after rank 0 aborted")


def scenario_dropped(comm):
    """A second communicator, used through every shortcut and dropped
    without close(), frees its shared memory at once: nothing holds it in
    a reference cycle (the garbage collector is off while it lives), as the
    channel's callbacks once did."""
    gc.disable()
    try:
        other = collectives.init(timeout=TIMEOUT)
        x = np.ones(8 * other.size, np.float32)
        other.allreduce(x)
        for collective in ("reduce_scatter", "allgather", "broadcast", "reduce"):
            for _, fast, reference in calls_of(other, collective, x, 0, "sum"):
                fast()
        other.barrier()
        group = weakref.ref(other._ranks.group)   # noqa: SLF001
        del other, fast, reference   # (the calls' closures hold it too)
        assert group() is None, "a dropped communicator's process group outlived it (a reference cycle)"
    finally:
        gc.enable()
    comm.barrier()


def scenario_sizes(comm):
    """The loop's sizes as the environment set them when the communicator
    was made (tests/test_fastpath.py sets small ones): the channel is laid
    out by them, `chosen_algorithm` names the step they give, and calls on
    both sides of the limit and over several chunks give the direct plan's
    bits."""
    assert comm._ranks.fast.sizes == SIZES != (64 << 10, 256 << 10), SIZES   # noqa: SLF001
    for nbytes, algorithm, merged in ((SIZES.small_max, "direct", True), (SIZES.small_max + 8, "two_shot", False)):
        chosen = comm.chosen_algorithm("allreduce", nbytes, dtype=np.float32)
        assert (chosen, chosen.step == fastpath.MERGED) == (algorithm, merged), (nbytes, chosen)
    rng = np.random.default_rng(7 + comm.rank)
    n = comm.size
    for count in (SIZES.small_max // 4, SIZES.small_max // 4 + n, 3 * n * SIZES.chunk // 4 + 5 * n):
        x = inputs(comm.rank, count, np.float32, rng)
        got, want = comm.allreduce(x, out=np.empty_like(x)), planned(comm.allreduce, x, out=np.empty_like(x))
        assert got.tobytes() == want.tobytes(), f"allreduce of {count}"
        for collective in ("reduce_scatter", "allgather", "broadcast", "reduce"):
            for how, fast, reference in calls_of(comm, collective, x, n - 1, "sum"):
                got, want = fast(), reference()
                if collective == "reduce" and comm.rank != n - 1:
                    continue   # only the root's output is defined
                assert got.tobytes() == want.tobytes(), f"{collective} {how} of {count}"


def scenario_collective_faults(comm):
    """The other four collectives in the loop fail as allreduce does: a
    stalled peer is a timeout on the merged step and the large path (cases
    0, 1), a dead one is named within a second (2), and ranks that make
    different calls (another collective of the same size, another root, a
    plan against the loop, a barrier against the smallest allreduce) are
    told so (3 to 6)."""
    case = int(os.environ["FASTPATH_CASE"])
    large = np.ones(3 << 18, np.float32)   # 3 MiB: the large path (and blocks for 3 ranks)
    if case == 0:
        without_rank_1(comm, lambda: comm.allgather(np.ones(30, np.float32)), "allgather")
    elif case == 1:
        without_rank_1(comm, lambda: comm.reduce_scatter(large), "reduce_scatter")
    elif case == 2:
        comm.broadcast(large, root=0)
        comm.barrier()
        if comm.rank == 1:
            os._exit(0)
        start = time.perf_counter()
        try:
            comm.broadcast(large, root=1)
        except (RankFailedError, CollectiveError) as error:
            assert isinstance(error, RankFailedError) or "died" in str(error), error
            assert time.perf_counter() - start < 1.0, "a dead rank should be reported within a second"
        else:
            raise AssertionError("broadcast completed without rank 1")
    else:
        x = np.ones(64 * comm.size, np.float32)
        mismatched = {
            3: lambda: comm.allgather(x) if comm.rank == 0 else comm.reduce_scatter(x),
            4: lambda: comm.broadcast(large, root=0 if comm.rank == 0 else 1),
            5: lambda: comm.allgather(x) if comm.rank == 0 else planned(comm.allgather, x),
            6: lambda: comm.barrier() if comm.rank == 0 else comm.allreduce(np.zeros(1, np.uint8)),
        }
        expect_a_different_call(mismatched[case], f"mismatched call {case}")


# The fenced scenario: rank 1 holds each chunk's writes into rank 0 this
# long ($COLLECTIVES_TEST_WRITE_STALL); rank 0 gives up after FENCED_TIMEOUT,
# by when rank 1 is inside its first chunk's writes.
FENCED_STALL = 3.0
FENCED_TIMEOUT = 1.0


def scenario_fenced(comm):
    """Rank 0 gives up while rank 1 is inside its writes into rank 0's output
    (a single copy): the failed call raises only once that write is done,
    so the output does not change after the call raised: a reduce to rank
    0, whose peers push their blocks into the root's output ("reduce": the
    plans' pushed reduce, which the loop leaves to them, held by the same
    stall), and a broadcast from rank 1, which writes its block into rank
    0's ("broadcast": the loop's). (allreduce's: test_exchange_single_copy.py's
    pushes_fenced.)"""
    case = os.environ["FASTPATH_CASE"]
    count = (4 << 20) // 4
    x = np.full(count, comm.rank + 1.0, np.float32) if case == "broadcast" else np.ones(count, np.float32)
    out = np.zeros_like(x)
    if comm.rank == 0:
        comm.timeout = FENCED_TIMEOUT
    MPI.COMM_WORLD.Barrier()
    try:
        if case == "reduce":
            comm.reduce(x, root=0, out=out)
        else:
            comm.broadcast(x, root=1, out=out)
    except CollectiveError as error:
        if comm.rank == 1:
            assert "aborted" in str(error) and "timed out" in str(error), error
        else:
            assert "timed out waiting for rank 1" in str(error) and "still writing" not in str(error), error
    else:
        # only where the ranks cannot reach each other's memory (no writes to hold): the test skips
        assert comm._ranks.fast.large_path == "staged"   # noqa: SLF001
        return
    if comm.rank == 0:
        # rank 1's held chunk (the first of block 1) landed before the call raised ...
        assert out[count // 2] == 2, out[count // 2]
        after_the_call = out.copy()
        time.sleep(FENCED_STALL + 0.5)
        # ... and nothing after it
        changed = np.flatnonzero(out != after_the_call)
        assert changed.size == 0, f"{changed.size} elements changed after the call raised, from {changed[0]}"


def scenario_interrupted(comm):
    """Rank 0 gets Ctrl-C (SIGINT) while a fast allreduce waits for rank 1,
    which never comes: KeyboardInterrupt at once, not at the timeout, and
    rank 2 learns from the abort."""
    if comm.rank == 1:
        stall_until_the_others_gave_up(1, longest=TIMEOUT + 2)
        return
    if comm.rank == 0:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    start = time.perf_counter()
    try:
        comm.allreduce(np.ones(100, np.float32))
    except KeyboardInterrupt:
        assert comm.rank == 0
    except CollectiveError as error:
        assert comm.rank == 2 and "aborted" in str(error) and "interrupted" in str(error), error
    else:
        raise AssertionError("allreduce completed without rank 1")
    assert time.perf_counter() - start < TIMEOUT / 2, "the interrupt waited for the timeout"
    gave_up_on(1)


def scenario_late(comm):
    """Each rank in turn arrives late, on both paths and around interpreted
    calls: the others' waits fall asleep on the futex and are woken with
    the right result, and every sleeper is counted out again."""
    from collectives.transport import _shmloop
    counters = comm._ranks.group._counters   # noqa: SLF001
    world = MPI.COMM_WORLD
    for late in range(comm.size):
        for count in (100, (SIZES.small_max >> 2) * 3):    # merged, pipelined
            if comm.rank == late:
                time.sleep(0.05)
            x = np.arange(count, dtype=np.float64) + comm.rank
            assert np.array_equal(comm.allreduce(x), np.arange(count) * comm.size + sum(range(comm.size)))
            if comm.rank == late:
                time.sleep(0.05)
            y = planned(comm.broadcast, np.full(10, comm.rank, np.int32), root=late)   # a plan's protocol
            assert (y == late).all()
            y = comm.broadcast(np.full(10, comm.rank, np.int32), root=late)   # the loop's merged step
            assert (y == late).all()
    world.Barrier()   # every rank is out of every wait
    asleep = [counters.load(r, _shmloop.SLEEPERS) for r in range(comm.size)]
    world.Barrier()   # and none enters another (close()'s barrier may sleep) before every rank has looked
    assert asleep == [0] * comm.size, asleep


# The slow reader scenario: every rank but 0 waits SLOW_READ seconds before
# each read out of a peer's input, so rank 0 reaches the end of every single
# copy long before its readers are done with its input.
SLOW_READ = 0.02


def scenario_slow_reader(comm):
    """Large calls on the single copy, each rank overwriting its input the
    moment its call returns: the results must still be the inputs' (a rank
    returns only once every peer has finished reading it)."""
    n, r = comm.size, comm.rank
    count = n * (SIZES.small_max // 8 + 8)   # float64: above the merged step, a multiple of n
    inputs = [np.arange(count, dtype=np.float64) + 1000.0 * p for p in range(n)]
    total = np.sum(inputs, axis=0)
    k = count // n
    calls = {
        "allreduce": (lambda x: comm.allreduce(x, out=np.empty_like(x)), total),
        "reduce_scatter": (lambda x: comm.reduce_scatter(x, out=np.empty(k)), total[r * k:(r + 1) * k]),
        "allgather": (lambda x: comm.allgather(x), np.concatenate(inputs)),
        "broadcast": (lambda x: comm.broadcast(x, root=0, out=np.empty_like(x)), inputs[0]),
        "reduce": (lambda x: comm.reduce(x, root=0, out=np.empty_like(x)), total if r == 0 else None),
    }
    for collective, (call, want) in calls.items():
        x = inputs[r].copy()
        got = call(x)
        x[:] = -1.0   # what a reader still reading this rank's input would see
        if want is not None and not np.array_equal(got, want):
            wrong = np.flatnonzero(got != want)
            raise AssertionError(f"{collective}: {wrong.size} elements wrong from {wrong[0]} ({got[wrong[0]]}): "
                                 f"a peer returned before this rank had read its input")


def scenario_measured(comm):
    """What the ranks chose for the loop's staging limit as the
    communicator started (FastCollectives.choose_staged_max), and the step
    a 1 MiB allreduce then takes: "MEASURED rank staged_max single-copy
    staged last-step" (the probe's seconds, None where none ran)."""
    tuning = comm.tuning
    probe = tuning["probe_us"] or {}
    x = np.ones(fastpath.PROBE_BYTES // 4, np.float32)
    comm._ranks.forget_what_ran()   # noqa: SLF001
    assert np.array_equal(comm.allreduce(x, out=np.empty_like(x)), np.full_like(x, comm.size))
    chosen = comm.chosen_algorithm("allreduce", x.nbytes, dtype=np.float32)
    if chosen.path == "compiled_loop":   # staged in the loop
        step = comm._ranks.fast.last_step   # noqa: SLF001 - what ran
        assert chosen.step == step and comm._ranks.what_ran() is None, "the answer is what ran"   # noqa: SLF001
    else:   # the single copy, which the loop leaves to the plans
        step = chosen.path
        assert comm._ranks.what_ran() == (chosen, chosen.path) == ("two_shot", "single_copy"), chosen   # noqa: SLF001
    # the limit is the folds', and allgather's and broadcast's where the machine's processes have a core
    # each: up to it a large message stages, past it the plans single copy it where the ranks may (an
    # oversubscribed allgather stages up to its own limit too)
    loop = comm._ranks.fast   # noqa: SLF001
    for collective in fastpath.KIND_CODES:
        copies = collective in ("allgather", "broadcast")
        limit = max(tuning["staged_max"] if loop.copies_stage or not copies else 0,
                    loop.staged_spread_max if collective == "allgather" else 0)
        if limit > loop.merged_max:
            assert loop.step_for(collective, limit) == fastpath.STAGED, (collective, limit)
        past = loop.step_for(collective, max(limit, loop.merged_max) + 1)
        assert past == (fastpath.PLANS if loop.large_path == "single-copy" else fastpath.STAGED), (collective, past)
    print(f"MEASURED {comm.rank} {tuning['staged_max']} {probe.get(fastpath.SINGLE_COPY)!r} "
          f"{probe.get(fastpath.STAGED)!r} {step}", flush=True)


def staged_max_differs():
    """Rank 1 pins $COLLECTIVES_STAGED_MAX, the others leave it unset: every
    rank's start raises InvalidUsageError naming it (rank 1 would not probe
    while the others do), none waits for the timeout."""
    if MPI.COMM_WORLD.rank == 1:
        os.environ["COLLECTIVES_STAGED_MAX"] = "65536"
    try:
        collectives.init(timeout=TIMEOUT)
    except InvalidUsageError as error:
        assert "COLLECTIVES_STAGED_MAX differs among the ranks" in str(error), error
        print(f"OK staged_max_differs {MPI.COMM_WORLD.rank} {'0' * 16}", flush=True)
        return
    raise AssertionError("a start whose ranks disagree on COLLECTIVES_STAGED_MAX went on")


def main():
    scenario = sys.argv[1]
    if scenario == "staged_max_differs":
        return staged_max_differs()
    # The loop's tunables (config.LoopTunables), read when the communicator is made.
    if scenario == "fenced" and MPI.COMM_WORLD.rank == 1:
        os.environ["COLLECTIVES_TEST_WRITE_STALL"] = str(FENCED_STALL)
    if scenario == "spread_mismatch" and MPI.COMM_WORLD.rank == 0:
        os.environ["COLLECTIVES_SPREAD_STAGED_MAX"] = "0"
    if scenario == "slow_reader":
        os.environ["COLLECTIVES_SPREAD_STAGED_MAX"] = "0"   # allgather reads in place too, however many cores
        if MPI.COMM_WORLD.rank != 0:
            os.environ["COLLECTIVES_TEST_READ_STALL"] = str(SLOW_READ)
    comm = collectives.init(timeout=TIMEOUT)
    assert LOOP == (comm._ranks.fast_allreduce is not None), "the loop runs exactly when not hidden"   # noqa: SLF001
    digest = hashlib.blake2b()
    ranks_leave = scenario in ("killed_large", "abort", "stalled_large", "mismatch", "spread_mismatch", "interrupted",
                               "fenced", "collective_faults", "edge_arrays")

    def run():
        if scenario == "bits":
            scenario_bits(comm, digest)
            scenario_declined(comm, digest)
        elif scenario == "collectives":
            scenario_collectives(comm, digest)
        elif scenario == "edge_arrays":
            scenario_edge_arrays(comm, digest)
        else:
            globals()[f"scenario_{scenario}"](comm)
    run_scenario(run, ranks_leave)
    print(f"OK {scenario} {comm.rank} {digest.hexdigest()[:16]}", flush=True)
    if LOOP:
        # (how messages past the loop's staging limits moved: FastCollectives.large_path)
        print(f"LARGE PATH {comm.rank} {comm._ranks.fast.large_path}", flush=True)   # noqa: SLF001
    if ranks_leave:
        os._exit(0)
    comm.close()


if __name__ == "__main__":
    main()
