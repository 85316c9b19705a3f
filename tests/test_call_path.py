"""The per-call path of a repeated call (Communicator._collective, _Call).

A call with the arguments and the very arrays of an earlier call that
passed, unchanged, reuses that call's checks, plan and bound form
(executors/host.py BoundTables on virtual ranks). Here: the bound form gives
the interpreter's bits, anything that could change a check's verdict makes
the call take the full path again, and every error is still raised on a
repeat after a success.
"""

import gc
import weakref

import numpy as np
import pytest

import collectives
from collectives import InvalidUsageError
from collectives.algorithms import REGISTRY
from collectives.binding import WORKSPACE
from collectives.executors.host import BoundTables
from collectives.ops import BFLOAT16, is_floating

OPS = ("sum", "prod", "max", "min", "avg")
DTYPES = (np.dtype(np.float32), np.dtype(np.float16), BFLOAT16, np.dtype(np.float64), np.dtype(np.int32),
          np.dtype(np.uint8), np.dtype(np.int64))
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")


def random_values(rng, dtype, shape):
    """Values whose folds round differently in different orders, with the
    zeros, infinities and NaNs that max and min treat specially."""
    if is_floating(dtype):
        values = rng.standard_normal(shape) * 100
        special = rng.random(shape)
        values[special < 0.05] = 0.0
        values[(special >= 0.05) & (special < 0.1)] = -0.0
        values[(special >= 0.1) & (special < 0.12)] = np.inf
        values[(special >= 0.12) & (special < 0.14)] = -np.inf
        values[(special >= 0.14) & (special < 0.15)] = np.nan
        return values.astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, endpoint=True, dtype=dtype)


def call(comm, collective, xs, outs, op, algorithm, root):
    if collective == "allreduce":
        return comm.allreduce(xs, op=op, out=outs, algorithm=algorithm)
    if collective == "reduce_scatter":
        return comm.reduce_scatter(xs, op=op, out=outs, algorithm=algorithm)
    if collective == "allgather":
        return comm.allgather(xs, out=outs, algorithm=algorithm)
    if collective == "broadcast":
        return comm.broadcast(xs, root=root, algorithm=algorithm)
    return comm.reduce(xs, root=root, op=op, algorithm=algorithm)


def shapes(collective, n):
    """(input shape, output shape) per rank: odd sizes, 2-D where it fits."""
    if collective == "allreduce":
        return (3, 7), (3, 7)
    if collective == "reduce_scatter":
        return (n * 5,), (5,)
    if collective == "allgather":
        return (2, 3), (2 * n, 3)
    return (2, 9), (2, 9)


def bits(a):
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def bound_calls(comm):
    return [c for c in comm._calls.values() if isinstance(c.bound, BoundTables)]


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("algorithm", ["auto", *REGISTRY])
def test_bound_form_gives_the_interpreters_bits(n, collective, algorithm):
    """Every op, several dtypes, in and out of place: the calls after the
    first (bound form) leave the bits the first call (the plan interpreter)
    leaves, on every rank."""
    if algorithm != "auto" and collective not in REGISTRY[algorithm].collectives:
        pytest.skip(f"{algorithm} does not implement {collective}")
    rng = np.random.default_rng(7)
    in_shape, out_shape = shapes(collective, n)
    reducing = collective in ("allreduce", "reduce_scatter", "reduce")
    placements = (True, False) if collective in ("allreduce", "reduce_scatter", "allgather") else (True,)
    with collectives.Communicator.local(n) as comm:
        for dtype in DTYPES:
            for op in OPS if reducing else ("sum",):
                for in_place in placements:
                    case = f"{collective} {algorithm} {op} {dtype} n={n} in_place={in_place}"
                    originals = [random_values(rng, dtype, in_shape) for _ in range(n)]
                    with collectives.Communicator.local(n) as reference:
                        xs = [o.copy() for o in originals]
                        outs = None if in_place else [np.zeros(out_shape, dtype) for _ in range(n)]
                        want = [bits(r).copy() for r in call(reference, collective, xs, outs, op, algorithm, 1)]
                        assert not bound_calls(reference), case  # the first call is interpreted
                    xs = [o.copy() for o in originals]
                    outs = None if in_place else [np.zeros(out_shape, dtype) for _ in range(n)]
                    for repeat in range(3):
                        for x, o in zip(xs, originals):
                            x[...] = o   # the same arrays, their values as before
                        got = call(comm, collective, xs, outs, op, algorithm, 1)
                        for r in range(n):
                            assert np.array_equal(bits(got[r]), want[r]), f"{case} rank {r} call {repeat}"
                    assert isinstance(list(comm._calls.values())[-1].bound, BoundTables), case


def test_bound_form_through_a_workspace():
    """Outputs that overlap their inputs other than chunk for chunk get the
    workspace plan; its bound form uses the workspace views it keeps."""
    with collectives.Communicator.local(2) as comm:
        buffers = [np.empty(12, np.int32) for _ in range(2)]
        xs = [b[:8] for b in buffers]
        outs = [b[4:12] for b in buffers]  # shifted by 4 elements
        want = np.arange(8, dtype=np.int32) * 2 + 100
        for repeat in range(3):
            for r, b in enumerate(buffers):
                b[...] = np.arange(12, dtype=np.int32) + 100 * r
            comm.allreduce(xs, out=outs, algorithm="ring")
            assert all(np.array_equal(o, want) for o in outs), repeat
        (entry,) = comm._calls.values()
        assert entry.plan.binding == WORKSPACE and isinstance(entry.bound, BoundTables)


def test_auto_is_what_chosen_algorithm_says():
    with collectives.Communicator.local(4) as comm:
        xs = [np.full(256, r + 1, np.float32) for r in range(4)]
        for _ in range(3):
            comm.allreduce(xs)
        (entry,) = comm._calls.values()
        assert entry.plan.algorithm == comm.chosen_algorithm("allreduce", 1024)


# -- what makes a repeat take the full path again --------------------------------------


def test_an_array_replaced_by_another_of_the_same_shape():
    with collectives.Communicator.local(3) as comm:
        xs = [np.full(6, r + 1, np.float32) for r in range(3)]
        outs = [np.zeros(6, np.float32) for _ in range(3)]
        for _ in range(2):
            comm.allreduce(xs, out=outs)
        xs[1] = np.full(6, 10, np.float32)
        result = comm.allreduce(xs, out=outs)
        assert all(r is o for r, o in zip(result, outs))
        assert all((o == 14).all() for o in outs)
        outs[2] = np.zeros(6, np.float32)
        comm.allreduce(xs, out=outs)
        assert (outs[2] == 14).all()


def test_a_different_out():
    with collectives.Communicator.local(3) as comm:
        xs = [np.full(6, r + 1, np.float32) for r in range(3)]
        first = [np.zeros(6, np.float32) for _ in range(3)]
        for _ in range(2):
            comm.allreduce(xs, out=first)
        second = [np.zeros(6, np.float32) for _ in range(3)]
        result = comm.allreduce(xs, out=second)
        assert all(r is o for r, o in zip(result, second)) and all((o == 6).all() for o in second)
        first_before = [f.copy() for f in first]
        in_place = comm.allreduce(xs)
        assert all(r is x for r, x in zip(in_place, xs)) and all((x == 6).all() for x in xs)
        assert all(np.array_equal(f, b) for f, b in zip(first, first_before))


def test_a_view_of_another_base():
    with collectives.Communicator.local(2) as comm:
        bases = [np.arange(16, dtype=np.float64) + 100 * r for r in range(2)]
        xs = [b[3:11] for b in bases]
        for _ in range(2):
            comm.allreduce(xs, op="max")
        others = [np.arange(16, dtype=np.float64) * -1 for _ in range(2)]
        ys = [o[3:11] for o in others]
        comm.allreduce(ys, op="max")
        assert all(np.array_equal(y, -np.arange(3, 11, dtype=np.float64)) for y in ys)
        assert np.array_equal(bases[0][:3], np.arange(3)), "the old base is left alone"


def test_arrays_whose_ids_are_reused():
    """Arrays made anew each step often get the ids of the last ones."""
    with collectives.Communicator.local(3) as comm:
        for step in range(20):
            xs = [np.full(5, r + step, np.int64) for r in range(3)]
            comm.allreduce(xs)
            assert all((x == 3 * step + 3).all() for x in xs), step
            del xs
            # What this step made is young: a full collection walked the pytest
            # worker's whole heap, 0.5 s each in a run of the suite.
            gc.collect(1)


@pytest.fixture(params=["compiled", "attributes"])
def numpy_states(request, monkeypatch):
    """A repeated call reads NumPy arrays' state in C (collectives/_arraystate.c,
    which the install builds) or, without it, through their attributes: the
    tests taking this run with both."""
    from collectives import arrays
    if request.param == "compiled":
        from collectives import _arraystate   # an ImportError here: the install did not build it
        assert arrays.repeat_state(np.empty(1)) is _arraystate.numpy_states
    else:
        monkeypatch.setitem(arrays._REPEAT_STATES, arrays._numpy,   # noqa: SLF001
                            arrays._states_through(("shape", "dtype", "flags.num")))   # noqa: SLF001
    return request.param


def test_the_compiled_state_differs_exactly_when_a_fact_does():
    from collectives._arraystate import numpy_states
    a, b = np.zeros((2, 3), np.float32), np.zeros(4, np.int8)
    same = numpy_states((a, b))
    assert numpy_states((a, b)) == same and numpy_states((b, a)) != same
    for change in (lambda: setattr(a, "shape", (3, 2)), lambda: setattr(a, "dtype", np.int32),
                   lambda: a.setflags(write=False)):
        change()
        assert numpy_states((a, b)) != same
        a = np.zeros((2, 3), np.float32)
        same = numpy_states((a, b))
    assert numpy_states((a[:, :2], b)) != numpy_states((a, b))   # a view: another address, shape and flags
    with pytest.raises(TypeError, match="NumPy arrays"):
        numpy_states((a, [1, 2]))


def test_an_array_reshaped_or_retyped_in_place(numpy_states):
    with collectives.Communicator.local(2) as comm:
        xs = [np.full(8, r + 1, np.int32) for r in range(2)]
        for _ in range(2):
            comm.allreduce(xs)
        for x in xs:
            x.shape = (2, 4)
            x[...] = 2
        result = comm.allreduce(xs)
        assert result[0].shape == (2, 4) and (result[0] == 4).all()
        for x in xs:
            x.dtype = np.float32   # same bytes, another type: the float sum of those bits
            x[...] = 1.5
        comm.allreduce(xs)
        assert all(x.dtype == np.float32 and (x == 3.0).all() for x in xs)


def test_an_array_made_read_only_after_a_success(numpy_states):
    with collectives.Communicator.local(3) as comm:
        xs = [np.full(6, r + 1, np.float32) for r in range(3)]
        outs = [np.zeros(6, np.float32) for _ in range(3)]
        for _ in range(2):
            comm.allreduce(xs)
            comm.allreduce(xs, out=outs)
        xs[1].setflags(write=False)
        before = [x.copy() for x in xs]
        with pytest.raises(InvalidUsageError, match=r"x\[1\] is read-only"):
            comm.allreduce(xs)
        assert all(np.array_equal(x, b) for x, b in zip(xs, before))
        comm.allreduce(xs, out=outs)   # read-only inputs are fine out of place
        outs[2].setflags(write=False)
        with pytest.raises(InvalidUsageError, match=r"out\[2\] is read-only"):
            comm.allreduce(xs, out=outs)
        outs[2].setflags(write=True)
        comm.allreduce(xs, out=outs)
        assert all(np.array_equal(o, xs[0] + xs[1] + xs[2]) for o in outs)


def test_every_error_is_still_raised_after_a_success():
    with collectives.Communicator.local(3) as comm:
        xs = [np.full(6, r + 1, np.float32) for r in range(3)]
        outs = [np.zeros(6, np.float32) for _ in range(3)]

        def succeed():
            for _ in range(2):
                comm.allreduce(xs)
                comm.allreduce(xs, out=outs)
                comm.broadcast(xs, root=1)
                comm.reduce(xs, root=1)
                comm.reduce_scatter([np.ones(6, np.float32) for _ in range(3)])

        def rejected(f, match):
            succeed()
            before = [a.copy() for a in (*xs, *outs)]
            with pytest.raises(InvalidUsageError, match=match):
                f()
            assert all(np.array_equal(a, b) for a, b in zip((*xs, *outs), before))

        rejected(lambda: comm.allreduce(xs[:2]), "x: 2 arrays given for 3 local ranks")
        rejected(lambda: comm.allreduce(xs[0]), "x: one array given, but this communicator owns 3 local ranks")
        rejected(lambda: comm.allreduce([xs[0], xs[1].view(np.int32), xs[2]]), r"x\[1\] has dtype int32")
        rejected(lambda: comm.allreduce([xs[0], xs[1][:5], xs[2]]), r"x\[1\] has shape \(5,\)")
        rejected(lambda: comm.allreduce(xs, op="xor"), "op: unknown reduction 'xor'")
        rejected(lambda: comm.allreduce(xs, op=["sum"]), "op: unknown reduction")
        rejected(lambda: comm.allreduce(xs, algorithm="hypercube"), "algorithm: unknown algorithm 'hypercube'")
        rejected(lambda: comm.allreduce(xs, algorithm=None), "algorithm: expected a name")
        rejected(lambda: comm.broadcast(xs, root=3), "root: 3 is out of range")
        rejected(lambda: comm.broadcast(xs, root=1.0), "root: expected a rank number")
        rejected(lambda: comm.broadcast(xs, root=True), "root: expected a rank number")
        rejected(lambda: comm.reduce(xs, root=np.float64(1)), "root: expected a rank number")
        rejected(lambda: comm.allreduce(xs, out=outs[:2]), "out: 2 arrays given for 3 local ranks")
        rejected(lambda: comm.allreduce(xs, out=[o[:5] for o in outs]), r"out\[0\] has 5 elements, expected 6")
        rejected(lambda: comm.allreduce(xs, out=[outs[0], outs[0], outs[2]]),
                 "out: the same array is given for local ranks 0 and 1")
        rejected(lambda: comm.allreduce([xs[0], xs[0], xs[2]]), "x: the same array is given for local ranks 0 and 1")
        rejected(lambda: comm.allreduce(xs, out=[xs[1], outs[1], outs[2]]), r"out\[0\] shares memory with x\[1\]")
        rejected(lambda: comm.allreduce(xs, compression="zip"), "zip")
        rejected(lambda: comm.reduce_scatter([np.ones(7, np.float32) for _ in range(3)]),
                 "x: has 7 elements, which do not split into 3 equal blocks")
        rejected(lambda: comm.allreduce([x[::2] for x in (np.ones(12, np.float32),) * 3]), "C-contiguous")
        rejected(lambda: comm.allreduce([[1.0], [2.0], [3.0]]), "must be a NumPy array")
        rejected(lambda: comm.allreduce("abc"), "got str")
        comm.close()
        with pytest.raises(InvalidUsageError, match="closed"):
            comm.allreduce(xs)


def test_a_busy_fusion_buffer_still_stops_a_repeat():
    with collectives.Communicator.local(2) as comm:
        xs = [np.ones(4, np.float32) for _ in range(2)]
        for _ in range(2):
            comm.allreduce(xs)
        comm._busy.add("a fusion buffer")   # as FusionBuffer does while its allreduces run
        with pytest.raises(InvalidUsageError, match="in flight"):
            comm.allreduce(xs)
        comm._busy.clear()
        comm.allreduce(xs)
        assert all((x == 8).all() for x in xs)


def test_outputs_made_by_the_call_are_new_or_views_each_time():
    with collectives.Communicator.local(2) as comm:
        xs = [np.full(4, r + 1, np.int16) for r in range(2)]
        gathered = [comm.allgather(xs) for _ in range(3)]
        assert gathered[1][0] is not gathered[2][0]
        assert all(np.array_equal(g[r], [1, 1, 1, 1, 2, 2, 2, 2]) for g in gathered for r in range(2))
        for _ in range(3):
            for x in xs:
                x[...] = 1
            blocks = comm.reduce_scatter(xs)
            assert all(b.base is x for b, x in zip(blocks, xs)) and all((b == 2).all() for b in blocks)


def test_no_array_is_kept_alive():
    with collectives.Communicator.local(2) as comm:
        xs = [np.ones(4, np.float32) for _ in range(2)]
        outs = [np.ones(4, np.float32) for _ in range(2)]
        for _ in range(3):
            comm.allreduce(xs, out=outs)
        watched = [weakref.ref(a) for a in (*xs, *outs)]
        del xs, outs
        gc.collect()
        assert all(w() is None for w in watched)


def test_calls_whose_arrays_are_gone_are_forgotten(monkeypatch):
    monkeypatch.setattr(collectives.communicator, "_CALLS_KEPT", 8)
    with collectives.Communicator.local(2) as comm:
        kept = [np.ones(3, np.float32) for _ in range(2)]
        for step in range(30):
            comm.allreduce(kept)
            xs = [np.full(3, step, np.float32) for _ in range(2)]
            comm.allreduce(xs)
            assert (xs[0] == 2 * step).all() and len(comm._calls) <= 8
        assert any(c.refs[0]() is kept[0] for c in comm._calls.values())
        assert (kept[0] == 2 ** 30).all()


def test_an_array_seen_cannot_be_moved():
    """What the cache relies on for addresses: NumPy refuses to resize
    (reallocate) an array that has weak references."""
    with collectives.Communicator.local(2) as comm:
        xs = [np.ones(4, np.float32) for _ in range(2)]
        for _ in range(2):
            comm.allreduce(xs)
        with pytest.raises(ValueError, match="resize"):
            xs[0].resize(1024)


def test_a_single_rank_takes_a_bare_array_or_a_sequence():
    with collectives.Communicator.local(1) as comm:
        x = np.arange(5, dtype=np.float32)
        for _ in range(3):
            assert comm.allreduce(x) is x
            result = comm.allreduce([x])
            assert isinstance(result, list) and result[0] is x
            out = np.zeros(5, np.float32)
            assert comm.allreduce(x, out=out) is out and np.array_equal(out, x)


# -- the compiled allreduce hook for ranks in separate processes ---------------------------


class HookedRanks(collectives.communicator.VirtualHostRanks):
    """Virtual ranks with a fast_allreduce that records its calls."""

    def __init__(self, nranks, answer):
        super().__init__(nranks)
        self.calls, self.answer = [], answer

    def fast_allreduce(self, x, op, out, timeout):
        self.calls.append((x, op, out, timeout))
        return self.answer


def test_fast_allreduce_is_asked_first_and_may_decline():
    xs = [np.full(4, r + 1, np.float32) for r in range(2)]
    ranks = HookedRanks(2, answer="done by the hook")
    comm = collectives.Communicator(ranks, size=2, local_ranks=range(2), timeout=5.0)
    assert comm.allreduce(xs, op="max") == "done by the hook"
    assert ranks.calls == [(xs, "max", None, 5.0)] and (xs[0] == 1).all()
    # Not asked with compression, another algorithm, or while a fusion buffer is busy.
    comm.allreduce(xs, compression="bf16")
    comm.allreduce(xs, algorithm="ring")
    comm._busy.add("busy")
    with pytest.raises(InvalidUsageError, match="in flight"):
        comm.allreduce(xs)
    comm._busy.clear()
    assert len(ranks.calls) == 1
    # None declines: the general path runs, and raises what is wrong.
    ranks.answer = None
    result = comm.allreduce(xs)
    assert result[0] is xs[0] and len(ranks.calls) == 2
    with pytest.raises(InvalidUsageError, match="op: unknown reduction"):
        comm.allreduce(xs, op="xor")
    comm.close()
    with pytest.raises(InvalidUsageError, match="closed"):
        comm.allreduce(xs)
    assert len(ranks.calls) == 3


def test_chosen_algorithm_names_the_loop_only_for_the_collectives_it_has():
    """Ranks with a compiled allreduce and no loop for the other four: only
    allreduce is named the loop's (path compiled_loop, its merged step), the
    others name their plan's algorithm and path."""
    ranks = HookedRanks(2, answer=None)
    comm = collectives.Communicator(ranks, size=2, local_ranks=range(2), timeout=5.0)
    chosen = comm.chosen_algorithm("allreduce", 40, dtype=np.float32)
    assert (chosen, chosen.path, chosen.step) == ("direct", "compiled_loop", "merged")
    for collective in ("reduce_scatter", "allgather", "broadcast", "reduce"):
        assert comm.chosen_algorithm(collective, 40, dtype=np.float32).path != "compiled_loop", collective
    ranks.fast_collective = lambda *arguments: None
    comm = collectives.Communicator(ranks, size=2, local_ranks=range(2), timeout=5.0)
    chosen = comm.chosen_algorithm("broadcast", 40, root=1, dtype=np.float32)
    assert (chosen, chosen.path, chosen.step) == ("direct", "compiled_loop", "merged")
    with pytest.raises(InvalidUsageError, match="root"):
        comm.chosen_algorithm("broadcast", 40, root=2, dtype=np.float32)
