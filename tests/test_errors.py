"""Bad input: InvalidUsageError that names the problem, and nothing modified."""

import subprocess
import sys

import numpy as np
import pytest

import collectives
from collectives import CollectiveError, InvalidUsageError


@pytest.fixture
def comm():
    with collectives.Communicator.local(3) as c:
        yield c


def arrays(n=3, count=6, dtype=np.float32):
    return [np.full(count, r + 1, dtype) for r in range(n)]


def rejected(call, match, *watched):
    """Assert `call` raises InvalidUsageError matching `match` and leaves `watched` as they were."""
    before = [np.copy(a) for a in watched]
    with pytest.raises(InvalidUsageError, match=match) as info:
        call()
    assert isinstance(info.value, ValueError) and isinstance(info.value, CollectiveError)
    for a, b in zip(watched, before):
        assert np.array_equal(a, b)


def test_wrong_number_of_arrays(comm):
    xs = arrays(2)
    rejected(lambda: comm.allreduce(xs), "^x: 2 arrays given for 3 local ranks", *xs)


def test_bare_array_when_several_local_ranks(comm):
    x = np.ones(4)
    rejected(lambda: comm.allreduce(x),
             "^x: one array given, but this communicator owns 3 local ranks; pass a list of 3 arrays", x)


def test_mixed_dtypes(comm):
    xs = arrays()
    xs[1] = xs[1].astype(np.float64)
    rejected(lambda: comm.allreduce(xs), r"x\[1\] has dtype float64 but x\[0\] has float32", *xs)


def test_mixed_shapes(comm):
    xs = arrays()
    xs[2] = np.ones(7, np.float32)
    rejected(lambda: comm.allreduce(xs), r"x\[2\] has shape \(7,\)", *xs)


def test_non_contiguous(comm):
    xs = arrays(count=12)
    views = [x[::2] for x in xs]
    rejected(lambda: comm.allreduce(views), "C-contiguous", *xs)


def test_bool(comm):
    xs = [np.ones(4, bool) for _ in range(3)]
    rejected(lambda: comm.allreduce(xs), "dtype bool.*uint8", *xs)


def test_unsupported_dtype(comm):
    xs = [np.ones(4, np.complex64) for _ in range(3)]
    rejected(lambda: comm.allreduce(xs), "complex64", *xs)


def test_bfloat16_is_taken_though_ml_dtypes_is_imported_only_by_the_caller():
    """`import collectives` leaves ml_dtypes (0.6 s of CPU) unimported; an
    array of bfloat16 made afterwards is still taken, and the hot paths' dtype
    sets learn bfloat16 from that first array."""
    script = """if True:
        import sys
        import numpy as np
        import collectives
        from collectives import validation
        assert "ml_dtypes" not in sys.modules
        import ml_dtypes
        bf16 = np.dtype(ml_dtypes.bfloat16)
        assert bf16 not in validation.MESSAGE_DTYPES
        with collectives.Communicator.local(2) as comm:
            ys = comm.allreduce([np.full(3, 1.5, bf16), np.full(3, 2.25, bf16)])
        assert [y.dtype for y in ys] == [bf16, bf16] and all(float(v) == 3.75 for y in ys for v in y), ys
        assert bf16 in validation.MESSAGE_DTYPES
        assert collectives.ops.is_floating(bf16) and not collectives.ops.is_bfloat16(np.dtype(np.int16))
    """
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_not_an_array(comm):
    rejected(lambda: comm.allreduce([[1.0, 2.0]] * 3), "must be a NumPy array")
    rejected(lambda: comm.allreduce("abc"), "got str")
    rejected(lambda: comm.allreduce(None), "got NoneType")


def test_unknown_op(comm):
    xs = arrays()
    rejected(lambda: comm.allreduce(xs, op="xor"), "^op: unknown reduction 'xor'; expected one of 'sum'", *xs)
    rejected(lambda: comm.reduce_scatter(xs, op=7), "^op: unknown reduction 7", *xs)


def test_unknown_algorithm(comm):
    xs = arrays()
    rejected(lambda: comm.allreduce(xs, algorithm="hypercube"),
             "^algorithm: unknown algorithm 'hypercube'; expected one of 'auto', 'ring'", *xs)
    rejected(lambda: comm.allreduce(xs, algorithm=None), "^algorithm: expected a name", *xs)


def test_reduce_scatter_size_not_divisible(comm):
    xs = arrays(count=7)
    rejected(lambda: comm.reduce_scatter(xs), "^x: has 7 elements, which do not split into 3 equal blocks", *xs)


def test_root_out_of_range(comm):
    xs = arrays()
    rejected(lambda: comm.broadcast(xs, root=3), "^root: 3 is out of range; this communicator's ranks are 0 to 2", *xs)
    rejected(lambda: comm.reduce(xs, root=-1), "^root: -1 is out of range", *xs)
    rejected(lambda: comm.reduce(xs, root=1.0), "^root: expected a rank number", *xs)
    rejected(lambda: comm.broadcast(xs, root=True), "^root: expected a rank number", *xs)


def test_out_of_wrong_size_or_dtype(comm):
    xs = arrays()
    wrong_size = [np.zeros(5, np.float32) for _ in range(3)]
    wrong_dtype = [np.zeros(6, np.float64) for _ in range(3)]
    rejected(lambda: comm.allreduce(xs, out=wrong_size), r"out\[0\] has 5 elements, expected 6", *xs, *wrong_size)
    rejected(lambda: comm.allreduce(xs, out=wrong_dtype), "dtype float64, expected float32", *xs, *wrong_dtype)
    gathered = [np.zeros(6, np.float32) for _ in range(3)]
    rejected(lambda: comm.allgather(xs, out=gathered), "expected 18", *xs, *gathered)
    scattered = [np.zeros(6, np.float32) for _ in range(3)]
    rejected(lambda: comm.reduce_scatter(xs, out=scattered), "expected 2", *xs, *scattered)


def test_all_to_all_v_checks_its_counts_before_writing(comm):
    """Counts that are not size ints >= 0, that do not sum to x's size, or
    that do not match the peers' (recv_counts, out's size): nothing written."""
    sends = [[1, 2, 3], [0, 0, 6], [2, 2, 2]]           # rank r receives column r: 3, 4, 11 elements
    xs = arrays()
    outs = [np.zeros(k, np.float32) for k in (3, 4, 11)]
    rejected(lambda: comm.all_to_all_v(xs, sends[:2], out=outs), r"^send_counts: expected a list of 3 rows", *xs, *outs)
    rejected(lambda: comm.all_to_all_v(xs, [[1, 2, 3], [0, 6], [2, 2, 2]], out=outs),
             r"^send_counts\[1\]: expected 3 ints >= 0", *xs, *outs)
    rejected(lambda: comm.all_to_all_v(xs, [[1, 2, 3], [-1, 1, 6], [2, 2, 2]], out=outs),
             r"^send_counts\[1\]: expected 3 ints >= 0", *xs, *outs)
    rejected(lambda: comm.all_to_all_v(xs, [[1, 2, 3], [0, 1, 6], [2, 2, 2]], out=outs),
             r"^send_counts\[1\]: sums to 7, but x\[1\] has 6 elements", *xs, *outs)
    rejected(lambda: comm.all_to_all_v(xs, sends, out=outs, recv_counts=[[1, 0, 2], [2, 0, 2], [3, 6, 1]]),
             r"^recv_counts\[2\]: expects 1 elements from rank 2, which sends 2", *xs, *outs)
    short = [np.zeros(k, np.float32) for k in (3, 4, 10)]
    rejected(lambda: comm.all_to_all_v(xs, sends, out=short), r"^out\[2\]: has 10 elements, but the rank receives 11",
             *xs, *short)
    rejected(lambda: comm.all_to_all_v(xs, sends, algorithm="ring"), "does not implement all_to_all", *xs)
    frozen = [o.copy() for o in outs]
    frozen[1].setflags(write=False)
    rejected(lambda: comm.all_to_all_v(xs, sends, out=frozen), r"^out\[1\] is read-only", *xs, *frozen)
    got = comm.all_to_all_v(xs, sends, out=outs, recv_counts=[[1, 0, 2], [2, 0, 2], [3, 6, 2]])
    assert [o.tolist() for o in got] == [[1, 3, 3], [1, 1, 3, 3], [1, 1, 1] + [2] * 6 + [3, 3]]


def test_all_to_all_v_out_may_overlap_its_own_x(comm):
    """Through a workspace, as all_to_all's overlapping out: each rank's
    result lands over its own input, the blocks as sent."""
    sends = [[2, 1, 0], [1, 1, 1], [0, 3, 3]]
    buffers = [np.arange(8, dtype=np.int32) + 10 * r for r in range(3)]
    xs = [b[:sum(row)] for b, row in zip(buffers, sends)]
    outs = [b[1:1 + sum(row[r] for row in sends)] for r, b in enumerate(buffers)]
    comm.all_to_all_v(xs, sends, out=outs)
    assert [o.tolist() for o in outs] == [[0, 1, 10], [2, 11, 20, 21, 22], [12, 23, 24, 25]]
    assert comm.chosen_algorithm("all_to_all_v", 64) == comm.chosen_algorithm("all_to_all", 64, in_place=False)


def test_read_only_output(comm):
    xs = arrays()
    xs[1].setflags(write=False)
    rejected(lambda: comm.allreduce(xs), r"x\[1\] is read-only", *xs)


def test_ranks_sharing_memory(comm):
    shared = np.ones(6, np.float32)
    rejected(lambda: comm.allreduce([shared, shared, np.ones(6, np.float32)]),
             "^x: the same array is given for local ranks 0 and 1", shared)
    xs = arrays()
    outs = [np.zeros(6, np.float32)] * 3
    rejected(lambda: comm.allreduce(xs, out=outs),
             "^out: the same array is given for local ranks 0 and 1", *xs, outs[0])


def test_broadcast_and_reduce_check_out_as_the_others_do(comm):
    xs = arrays()
    wrong_size = [np.zeros(5, np.float32) for _ in range(3)]
    rejected(lambda: comm.broadcast(xs, root=1, out=wrong_size), r"out\[0\] has 5 elements, expected 6",
             *xs, *wrong_size)
    wrong_dtype = [np.zeros(6, np.float64) for _ in range(3)]
    rejected(lambda: comm.reduce(xs, root=2, out=wrong_dtype), "dtype float64, expected float32", *xs, *wrong_dtype)
    outs = [np.zeros(6, np.float32) for _ in range(3)]
    outs[1].setflags(write=False)
    # A broadcast writes the root's out too; a reduce only the root's.
    rejected(lambda: comm.broadcast(xs, root=1, out=outs), r"out\[1\] is read-only", *xs, *outs)
    rejected(lambda: comm.reduce(xs, root=1, out=outs), r"out\[1\] is read-only", *xs, *outs)
    results = comm.reduce(xs, root=0, out=outs)   # the read-only out is not written
    assert all(r is o for r, o in zip(results, outs)) and (outs[0] == 6).all() and (outs[1] == 0).all()
    # out=x is the call in place.
    want = xs[2].copy()
    results = comm.broadcast(xs, root=2, out=xs)
    assert all(r is x and np.array_equal(x, want) for r, x in zip(results, xs))


def test_device_array_without_device_support(comm):
    class FakeDeviceArray:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False), "version": 3}

    rejected(lambda: comm.allreduce([FakeDeviceArray()] * 3), "works on NumPy")


def test_closed_communicator():
    comm = collectives.Communicator.local(2)
    comm.close()
    comm.close()  # idempotent
    xs = arrays(2)
    rejected(lambda: comm.allreduce(xs), "closed", *xs)
    rejected(lambda: comm.barrier(), "closed")


@pytest.mark.parametrize("nranks", [0, -1, 2.5, True, "2"])
def test_bad_rank_count(nranks):
    with pytest.raises(InvalidUsageError, match="^nranks: expected a positive integer"):
        collectives.Communicator.local(nranks)


def test_timeout_from_argument_and_environment(monkeypatch):
    monkeypatch.delenv("COLLECTIVES_TIMEOUT", raising=False)
    assert collectives.Communicator.local(1).timeout == 300
    assert collectives.Communicator.local(1, timeout=2.5).timeout == 2.5
    monkeypatch.setenv("COLLECTIVES_TIMEOUT", "7")
    assert collectives.Communicator.local(1).timeout == 7
    assert collectives.Communicator.local(1, timeout=1).timeout == 1
    for bad in ("soon", "0", "-3", "inf", "nan"):
        monkeypatch.setenv("COLLECTIVES_TIMEOUT", bad)
        with pytest.raises(InvalidUsageError, match="COLLECTIVES_TIMEOUT"):
            collectives.Communicator.local(1)


def test_a_timeout_set_later_is_checked_too():
    """comm.timeout = x takes what init takes (and 0: no wait at all), and
    names anything else: a negative one made every compiled wait's first
    look come at once, before any poll."""
    comm = collectives.Communicator.local(1, timeout=5)
    comm.timeout = 0.25
    assert comm.timeout == 0.25
    comm.timeout = 0
    for bad in (-1, float("nan"), float("inf"), "5", None, True):
        with pytest.raises(InvalidUsageError, match="^timeout: expected a finite number of seconds >= 0"):
            comm.timeout = bad
    assert comm.timeout == 0


@pytest.mark.parametrize("variable", ["COLLECTIVES_FAST_PATH", "COLLECTIVES_FAST_SINGLE_COPY",
                                      "COLLECTIVES_COMPILED_PLANS", "COLLECTIVES_ONE_KERNEL_ALLREDUCE"])
def test_a_bad_switch_in_the_environment_stops_init_before_any_exchange(monkeypatch, variable):
    """init resolves every on/off variable first (config.check_switches): a
    bad value raises there, on every rank, naming the variable."""
    monkeypatch.setenv(variable, "yes")
    with pytest.raises(InvalidUsageError, match=rf"^\${variable}: expected 0 or 1, got 'yes'"):
        collectives.init()
    monkeypatch.setenv(variable, "0")
    collectives.init().close()


def test_reduce_op_enum_is_accepted(comm):
    xs = arrays()
    comm.allreduce(xs, op=collectives.ReduceOp.MAX)
    assert all((x == 3).all() for x in xs)
