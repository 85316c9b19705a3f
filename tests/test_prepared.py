"""Prepared calls (Communicator.prepare, collectives/prepared.py): checked
and planned once, then issued with no checks.

A prepared call must give, call after call, the bits the plain call gives
on the same values (the values change between calls, the arrays do not);
return the same arrays each time; raise at prepare what the plain call
raises, having written nothing; and refuse to run on a closed communicator.
"""

import numpy as np
import pytest

import collectives
from collectives import InvalidUsageError
from collectives.algorithms import REGISTRY

from test_call_path import random_values

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "gather", "scatter", "all_to_all")
# Virtual host ranks, ranks on one emulated device, and on two.
RANK_DEVICES = {"host": None, "emulated-1": ["emulated:0"] * 4, "emulated-2": ["emulated:0", "emulated:1"] * 2}


def shapes(collective, n):
    """(input shape, output shape) per rank."""
    if collective in ("reduce_scatter", "scatter"):
        return (n * 6, 3), (6, 3)
    if collective in ("allgather", "gather"):
        return (5, 3), (n * 5, 3)
    if collective == "all_to_all":
        return (n * 2, 3), (n * 2, 3)
    return (7, 3), (7, 3)


def arguments(collective, outs, op, root, algorithm):
    """The collective's keyword arguments (prepare takes the method's)."""
    taken = collectives.prepared.taken_arguments(collectives.Communicator, collective)
    given = {"op": op, "out": outs, "root": root, "algorithm": algorithm}
    return {name: value for name, value in given.items() if name in taken and value is not None}


PREPARED_CASES = [
    (collective, out_given, algorithm)
    for collective in COLLECTIVES
    for out_given in ((True, False) if collective not in ("broadcast", "reduce") else (False,))
    for algorithm in ("auto", "ring", "direct") if algorithm == "auto" or collective in REGISTRY[algorithm].collectives]


@pytest.mark.parametrize("ranks", RANK_DEVICES)
@pytest.mark.parametrize("collective, out_given, algorithm", PREPARED_CASES)
def test_a_prepared_call_gives_the_plain_calls_bits_call_after_call(ranks, collective, out_given, algorithm):
    n, dtype, op, root = 4, np.dtype(np.float32), "sum", 2
    rng = np.random.default_rng([COLLECTIVES.index(collective), out_given])
    in_shape, out_shape = shapes(collective, n)
    with collectives.Communicator.local(n, devices=RANK_DEVICES[ranks]) as comm, \
            collectives.Communicator.local(n) as reference:
        xs = [np.empty(in_shape, dtype) for _ in range(n)]
        outs = [np.empty(out_shape, dtype) for _ in range(n)] if out_given else None
        step = comm.prepare(collective, xs, **arguments(collective, outs, op, root, algorithm))
        assert step._bound, "ranks in this process issue the bound launches, not the plain call"
        results = []
        for _ in range(3):
            values = [random_values(rng, dtype, in_shape) for _ in range(n)]
            for x, v in zip(xs, values):
                x[...] = v
            got = step()
            want = getattr(reference, collective)(
                values, **arguments(collective, None if outs is None else [np.empty_like(o) for o in outs],
                                    op, root, algorithm))
            assert len(got) == n
            for r in range(n):
                if want[r] is None:   # a gather's ranks but the root, without out
                    assert got[r] is None
                    continue
                if collective == "gather" and r != root:   # its out, as the caller left it
                    continue
                assert got[r].shape == want[r].shape
                assert np.array_equal(got[r], want[r], equal_nan=True), f"rank {r}"
            results.append(got)
        # The same arrays every call: the caller's (out, or x in place), or
        # those prepare made (allgather without out) or viewed (reduce_scatter's blocks).
        for r in range(n):
            assert all(result[r] is results[0][r] for result in results)
            if outs is not None:
                assert results[0][r] is outs[r]
            elif collective in ("allreduce", "broadcast", "reduce", "all_to_all"):
                assert results[0][r] is xs[r]


@pytest.mark.parametrize("ranks", RANK_DEVICES)
@pytest.mark.parametrize("codec", ["bf16", "fp16", "int8"])
def test_a_prepared_compressed_allreduce_gives_the_plain_calls_bits(ranks, codec):
    n, count = 4, 300
    rng = np.random.default_rng(7)
    with collectives.Communicator.local(n, devices=RANK_DEVICES[ranks]) as comm:
        xs = [np.empty(count, np.float32) for _ in range(n)]
        outs = [np.empty(count, np.float32) for _ in range(n)]
        step = comm.prepare("allreduce", xs, out=outs, compression=codec)
        for _ in range(2):
            values = [rng.standard_normal(count).astype(np.float32) for _ in range(n)]
            for x, v in zip(xs, values):
                x[...] = v
            step()
            want = comm.allreduce([v.copy() for v in values], compression=codec)
            for r in range(n):
                assert np.array_equal(outs[r], want[r]), f"rank {r}"


def test_a_bare_array_gives_a_bare_result():
    with collectives.Communicator.local(1) as comm:
        x = np.arange(6, dtype=np.int32)
        step = comm.prepare("allreduce", x, op="max")
        assert step() is x
        assert step.algorithm == comm.chosen_algorithm("allreduce", x.nbytes, in_place=True)


@pytest.mark.parametrize("collective, arguments, message", [
    ("allreduce", {"root": 0}, "root: allreduce takes no 'root' argument"),
    ("broadcast", {"op": "sum"}, "op: broadcast takes no 'op' argument"),
    ("allgather", {"compression": "fp16"}, "compression: allgather takes no 'compression' argument"),
    ("allreduce", {"op": "add"}, "op: unknown reduction 'add'"),
    ("allreduce", {"algorithm": "nope"}, "algorithm"),
    ("reduce", {"root": 9}, "root"),
    ("alltoallv", {}, "collective: unknown collective 'alltoallv'"),
])
def test_prepare_rejects_what_the_plain_call_rejects_and_writes_nothing(collective, arguments, message):
    with collectives.Communicator.local(2) as comm:
        xs = [np.full(4, r + 1, np.float32) for r in range(2)]
        with pytest.raises(InvalidUsageError, match=message):
            comm.prepare(collective, xs, **arguments)
        assert all((x == r + 1).all() for r, x in enumerate(xs))


def test_prepare_checks_the_arrays_as_the_plain_call_does():
    with collectives.Communicator.local(2) as comm:
        xs = [np.ones(4, np.float32), np.ones(5, np.float32)]
        with pytest.raises(InvalidUsageError) as plain:
            comm.allreduce(xs)
        with pytest.raises(InvalidUsageError) as prepared:
            comm.prepare("allreduce", xs)
        assert str(prepared.value) == str(plain.value)
        readonly = [np.ones(4, np.float32) for _ in range(2)]
        readonly[1].flags.writeable = False
        with pytest.raises(InvalidUsageError, match="writ"):
            comm.prepare("allreduce", readonly)


def test_a_prepared_call_refuses_to_run_on_a_closed_communicator():
    comm = collectives.Communicator.local(2, devices=["emulated:0"] * 2)
    xs = [np.ones(4, np.float32) for _ in range(2)]
    step = comm.prepare("allreduce", xs)
    step()
    comm.close()
    with pytest.raises(InvalidUsageError, match="closed"):
        step()
    with pytest.raises(InvalidUsageError, match="closed"):
        comm.prepare("allreduce", xs)


def test_a_prepared_call_can_be_captured_in_a_graph():
    with collectives.Communicator.local(4, devices=["emulated:0"] * 4) as comm:
        xs = [np.empty(10, np.float32) for _ in range(4)]
        step = comm.prepare("allreduce", xs, op="avg")
        for r, x in enumerate(xs):
            x[...] = r
        step()
        with comm.graph() as graph:
            step()
        for r, x in enumerate(xs):
            x[...] = 4 * r
        graph.replay()
        assert all((x == 6.0).all() for x in xs)
