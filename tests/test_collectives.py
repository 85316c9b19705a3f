"""Every collective, dtype and op, against closed forms, on every backend.

Parametrized over backends (host ranks, emulated devices, a GPU), ranks,
counts, algorithms and in/out of place; each test loops over the 12 dtypes
and 5 ops and names the case in its message. The closed forms are exact, so
they are also what the NumPy interpreter computes: a backend that passes
agrees with it bit for bit.
"""

import numpy as np
import pytest

import collectives
from backends import GPU_DEVICE, Backend, backend_params, require_gpu, shares_memory
from cases import LARGEST_COUNT, OPS, RANK_COUNTS, counts_for, gather_input, reduction_expected, reduction_input
from collectives.algorithms import REGISTRY
from collectives.binding import OUT_OF_PLACE, WORKSPACE
from collectives.plan import build_plan

# Every registered algorithm, on the collectives it implements (the rest are
# deselected in conftest.py, as is the reduced matrix of device backends).
ALGORITHMS = ("auto", *REGISTRY)
matrix = pytest.mark.parametrize("n,count", [(n, c) for n in RANK_COUNTS for c in counts_for(n)])
algorithms = pytest.mark.parametrize("algorithm", ALGORITHMS)
placement = pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "out-of-place"])


@pytest.fixture(scope="module", params=backend_params())
def backend(request):
    if request.param == "gpu":
        require_gpu()
        if GPU_DEVICE == "emulated":
            pytest.skip("the emulated backends of this module run this matrix already")
    return Backend(request.param)


@pytest.fixture(scope="module")
def communicators(backend):
    made = {}
    yield lambda n: made.setdefault(n, backend.communicator(n))
    for comm in made.values():
        comm.close()


def assert_bits_equal(got, want, case):
    got = np.asarray(got)
    assert got.dtype == want.dtype, case
    assert got.shape == want.shape, case
    # (most of the matrix's million comparisons are of a few elements, where
    # comparing the bytes costs a tenth of array_equal's 2 us; it copies them,
    # which from a few KiB on costs more than array_equal's pass)
    same = got.tobytes() == want.tobytes() if got.nbytes <= 4096 else \
        np.array_equal(got.view(np.uint8), want.view(np.uint8))
    assert same, f"{case}: got {got[:8]}..., want {want[:8]}..."


@matrix
@algorithms
@placement
def test_allreduce(backend, communicators, n, count, algorithm, in_place):
    comm = communicators(n)
    for dtype in backend.dtypes(count):
        for op in OPS:
            case = f"allreduce {op} {dtype} n={n} count={count} {algorithm} on {backend}"
            originals = [reduction_input(op, dtype, n, r, count) for r in range(n)]
            xs = [backend.put(x) for x in originals]
            outs = None if in_place else [backend.empty(count, dtype) for _ in xs]
            results = comm.allreduce(xs, op=op, out=outs, algorithm=algorithm)
            want = reduction_expected(op, dtype, n, count)
            for r in range(n):
                assert results[r] is (xs[r] if in_place else outs[r]), case
                assert_bits_equal(backend.read(results[r]), want, f"{case} rank {r}")
                if not in_place:
                    assert_bits_equal(backend.read(xs[r]), originals[r], f"{case}: input of rank {r} changed")


@matrix
@algorithms
@placement
def test_reduce_scatter(backend, communicators, n, count, algorithm, in_place):
    comm = communicators(n)
    for dtype in backend.dtypes(count):
        for op in OPS:
            case = f"reduce_scatter {op} {dtype} n={n} count={count} {algorithm} on {backend}"
            originals = [reduction_input(op, dtype, n, r, n * count) for r in range(n)]
            xs = [backend.put(x) for x in originals]
            outs = None if in_place else [backend.empty(count, dtype) for _ in range(n)]
            results = comm.reduce_scatter(xs, op=op, out=outs, algorithm=algorithm)
            want = reduction_expected(op, dtype, n, n * count)
            for r in range(n):
                block = slice(r * count, (r + 1) * count)
                assert_bits_equal(backend.read(results[r]), want[block], f"{case} rank {r}")
                x = backend.read(xs[r])
                if in_place:
                    assert count == 0 or shares_memory(results[r], xs[r]), case
                    others = np.ones(n * count, bool)
                    others[block] = False
                    assert_bits_equal(x[others], originals[r][others], f"{case}: other blocks changed")
                else:
                    assert_bits_equal(x, originals[r], f"{case}: input of rank {r} changed")


@matrix
@algorithms
@placement
def test_allgather(backend, communicators, n, count, algorithm, in_place):
    """In place here is MPI's: each rank's x is its own block of the output."""
    comm = communicators(n)
    for dtype in backend.dtypes(count):
        case = f"allgather {dtype} n={n} count={count} {algorithm} on {backend}"
        want = np.concatenate([gather_input(dtype, q, count) for q in range(n)])
        if in_place:
            outs = [backend.put(np.where(np.arange(n * count) // max(count, 1) == r, want, 0).astype(dtype))
                    for r in range(n)]
            xs = [out[r * count:(r + 1) * count] for r, out in enumerate(outs)]
        else:
            xs = [backend.put(gather_input(dtype, r, count)) for r in range(n)]
            outs = [backend.empty(n * count, dtype) for _ in range(n)]
        results = comm.allgather(xs, out=outs, algorithm=algorithm)
        for r in range(n):
            assert results[r] is outs[r], case
            assert_bits_equal(backend.read(results[r]), want, f"{case} rank {r}")


@matrix
@algorithms
@placement
def test_broadcast(backend, communicators, n, count, algorithm, in_place):
    """Out of place, every rank's out receives the root's x (the root's
    too), and every x is left as it was."""
    comm = communicators(n)
    for dtype in backend.dtypes(count):
        originals = [gather_input(dtype, r, count) for r in range(n)]
        untouched = [gather_input(dtype, n + r, count) for r in range(n)]
        for root in sorted({0, n // 2, n - 1}):
            case = f"broadcast {dtype} n={n} count={count} root={root} {algorithm} on {backend}"
            xs = [backend.put(x) for x in originals]
            outs = None if in_place else [backend.put(u) for u in untouched]
            results = comm.broadcast(xs, root=root, out=outs, algorithm=algorithm)
            for r in range(n):
                assert results[r] is (xs[r] if in_place else outs[r]), case
                assert_bits_equal(backend.read(results[r]), originals[root], f"{case} rank {r}")
                if not in_place:
                    assert_bits_equal(backend.read(xs[r]), originals[r], f"{case}: input of rank {r} changed")


@matrix
@algorithms
@placement
def test_reduce(backend, communicators, n, count, algorithm, in_place):
    """Out of place, the root's out receives the reduction, the other
    ranks' out are left as they were, and so is every x."""
    comm = communicators(n)
    for dtype in backend.dtypes(count):
        untouched = [gather_input(dtype, n + r, count) for r in range(n)]
        for op in OPS:
            originals = [reduction_input(op, dtype, n, r, count) for r in range(n)]
            reduced = reduction_expected(op, dtype, n, count)
            for root in sorted({0, n - 1}):
                case = f"reduce {op} {dtype} n={n} count={count} root={root} {algorithm} on {backend}"
                xs = [backend.put(x) for x in originals]
                outs = None if in_place else [backend.put(u) for u in untouched]
                results = comm.reduce(xs, root=root, op=op, out=outs, algorithm=algorithm)
                for r in range(n):
                    assert results[r] is (xs[r] if in_place else outs[r]), case
                    want = reduced if r == root else originals[r] if in_place else untouched[r]
                    assert_bits_equal(backend.read(results[r]), want, f"{case} rank {r}")
                    if not in_place:
                        assert_bits_equal(backend.read(xs[r]), originals[r], f"{case}: input of rank {r} changed")


# gather, scatter and all_to_all only copy: what a dtype changes for them is
# its item size (the plan's offsets, the kernels' vector path and tail), so
# one dtype of each size runs them.
COPIED_DTYPES = ("int8", "float16", "float32", "float64")


def copied_dtypes(backend, count):
    return [d for d in backend.dtypes(count) if d.name in COPIED_DTYPES]


@matrix
@algorithms
@placement
def test_gather(backend, communicators, n, count, algorithm, in_place):
    """In place is MPI's: the root's x is its own block of its out. Out of
    place, only the root's out changes; without out, the root gets a new
    array and the others None."""
    comm = communicators(n)
    for dtype in copied_dtypes(backend, count):
        want = np.concatenate([gather_input(dtype, q, count) for q in range(n)])
        untouched = [gather_input(dtype, n + r, n * count) for r in range(n)]
        for root in sorted({0, n - 1}):
            case = f"gather {dtype} n={n} count={count} root={root} {algorithm} on {backend}"
            if in_place:
                outs = [backend.put(u) for u in untouched]
                outs[root] = backend.put(np.where(np.arange(n * count) // max(count, 1) == root, want, 0).astype(dtype))
                xs = [outs[root][root * count:(root + 1) * count] if r == root else backend.put(gather_input(dtype, r, count))
                      for r in range(n)]
            else:
                xs = [backend.put(gather_input(dtype, r, count)) for r in range(n)]
                outs = [backend.put(u) for u in untouched]
            results = comm.gather(xs, root=root, out=outs, algorithm=algorithm)
            for r in range(n):
                assert results[r] is outs[r], case
                assert_bits_equal(backend.read(results[r]), want if r == root else untouched[r], f"{case} rank {r}")
                if r != root:
                    assert_bits_equal(backend.read(xs[r]), gather_input(dtype, r, count), f"{case}: x of rank {r}")
    if count == 1 and not in_place:   # without out
        xs = [backend.put(gather_input(np.dtype(np.int32), r, 2).reshape(1, 2)) for r in range(n)]
        results = comm.gather(xs, root=n - 1, algorithm=algorithm)
        assert all(results[r] is None for r in range(n - 1))
        assert_bits_equal(backend.read(results[n - 1]),
                          np.stack([gather_input(np.dtype(np.int32), q, 2) for q in range(n)]), "gather, new array")


@matrix
@algorithms
@placement
def test_scatter(backend, communicators, n, count, algorithm, in_place):
    """In place, rank r's block of its x receives block r of the root's x,
    as reduce_scatter's; only the root's x is read."""
    comm = communicators(n)
    for dtype in copied_dtypes(backend, count):
        originals = [gather_input(dtype, r, n * count) for r in range(n)]
        for root in sorted({0, n - 1}):
            case = f"scatter {dtype} n={n} count={count} root={root} {algorithm} on {backend}"
            xs = [backend.put(x) for x in originals]
            outs = None if in_place else [backend.empty(count, dtype) for _ in range(n)]
            results = comm.scatter(xs, root=root, out=outs, algorithm=algorithm)
            for r in range(n):
                block = slice(r * count, (r + 1) * count)
                assert_bits_equal(backend.read(results[r]), originals[root][block], f"{case} rank {r}")
                x = backend.read(xs[r])
                if in_place:
                    assert count == 0 or shares_memory(results[r], xs[r]), case
                    others = np.ones(n * count, bool)
                    others[block] = False
                    assert_bits_equal(x[others], originals[r][others], f"{case}: other blocks changed")
                else:
                    assert results[r] is outs[r], case
                    assert_bits_equal(x, originals[r], f"{case}: x of rank {r} changed")


@matrix
@algorithms
@placement
def test_all_to_all(backend, communicators, n, count, algorithm, in_place):
    """Block q of rank r's result is block r of rank q's x."""
    comm = communicators(n)
    for dtype in copied_dtypes(backend, count):
        case = f"all_to_all {dtype} n={n} count={count} {algorithm} on {backend}"
        originals = [gather_input(dtype, r, n * count) for r in range(n)]
        xs = [backend.put(x) for x in originals]
        outs = None if in_place else [backend.empty(n * count, dtype) for _ in range(n)]
        results = comm.all_to_all(xs, out=outs, algorithm=algorithm)
        for r in range(n):
            want = np.concatenate([originals[q][r * count:(r + 1) * count] for q in range(n)])
            assert results[r] is (xs[r] if in_place else outs[r]), case
            assert_bits_equal(backend.read(results[r]), want, f"{case} rank {r}")
            if not in_place:
                assert_bits_equal(backend.read(xs[r]), originals[r], f"{case}: x of rank {r} changed")


def uneven_blocks(n, count):
    """blocks[q][r]: the elements rank q sends rank r in the all_to_all_v
    cases, 0 to 1.5 x count, some blocks empty, no two rows alike."""
    return tuple(tuple((q * 3 + r * 5 + 1) % 4 * count // 2 for r in range(n)) for q in range(n))


# all_to_all_v runs all_to_all's plans with other offsets: the matrix's
# counts but the largest, which all_to_all runs on the same executors.
@pytest.mark.parametrize("n,count", [(n, c) for n in RANK_COUNTS for c in counts_for(n) if c != LARGEST_COUNT])
@pytest.mark.parametrize("algorithm", ("auto", "direct", "round_robin"))   # those of all_to_all
def test_all_to_all_v(backend, communicators, n, count, algorithm):
    """Block q of rank r's result is the block rank q sends rank r, of
    its own size; x is left as it was. Without out (count 1), new arrays."""
    comm = communicators(n)
    blocks = uneven_blocks(n, count)
    out_given = count != 1
    for dtype in copied_dtypes(backend, count):
        case = f"all_to_all_v {dtype} n={n} count={count} {algorithm} on {backend}"
        originals = [gather_input(dtype, q, sum(blocks[q])) for q in range(n)]
        pieces = [np.split(x, np.cumsum(row)[:-1]) for x, row in zip(originals, blocks)]   # pieces[q][r]: q to r
        xs = [backend.put(x) for x in originals]
        outs = [backend.empty(sum(blocks[q][r] for q in range(n)), dtype) for r in range(n)] if out_given else None
        results = comm.all_to_all_v(xs, list(blocks), out=outs, algorithm=algorithm)
        for r in range(n):
            want = np.concatenate([pieces[q][r] for q in range(n)])
            if out_given:
                assert results[r] is outs[r], case
            assert_bits_equal(backend.read(results[r]), want, f"{case} rank {r}")
            assert_bits_equal(backend.read(xs[r]), originals[r], f"{case}: x of rank {r} changed")


@pytest.mark.parametrize("algorithm", ["direct", "round_robin"])
@pytest.mark.parametrize("binding", [WORKSPACE, OUT_OF_PLACE])
def test_all_to_all_v_plans_read_each_block_once(algorithm, binding):
    """What peers read is the blocks between ranks, each once (a rank's
    own block stays home), not every block padded to the largest."""
    blocks = uneven_blocks(5, 7)
    plan = build_plan("all_to_all_v", algorithm, 5, 0, np.dtype(np.float64), "sum", 0, binding, block_counts=blocks)
    between = sum(c for q, row in enumerate(blocks) for r, c in enumerate(row) if q != r)
    assert plan.wire_bytes == 8 * between < 8 * 5 * 4 * max(map(max, blocks))


@pytest.mark.parametrize("n", [2, 3, 5, 8])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_float_results_are_bitwise_identical_on_every_rank(n, dtype):
    """Random floats are not exact: equal bits show one reduction order."""
    rng = np.random.default_rng(n)
    eps, tiny = np.finfo(dtype).eps, np.finfo(dtype).smallest_subnormal
    with collectives.Communicator.local(n) as comm:
        for algorithm in ("ring", "direct"):
            for op in ("sum", "prod", "avg"):
                xs = [rng.standard_normal(4099).astype(dtype) for _ in range(n)]
                exact, bound = _reference_and_error_bound(xs, op, eps)
                bound += n * tiny  # results that underflow to subnormals lose relative accuracy
                out_of_place = comm.allreduce(xs, op=op, out=[np.empty_like(x) for x in xs], algorithm=algorithm)
                in_place = comm.allreduce(xs, op=op, algorithm=algorithm)
                for r in range(n):
                    assert_bits_equal(out_of_place[r], out_of_place[0], f"{algorithm} {op} rank {r}")
                    assert_bits_equal(in_place[r], out_of_place[0], f"{algorithm} {op} rank {r} in place")
                error = np.abs(out_of_place[0].astype(np.float64) - exact)
                assert (error <= bound).all(), f"{algorithm} {op}: error {error.max()} over its bound"


def _reference_and_error_bound(xs, op, eps):
    """The exact result and the classic bound for n-1 rounded operations
    (plus one for avg's division): |error| <= n * eps * sum|x| for sums,
    n * eps * |result| for products."""
    stacked = np.stack(xs).astype(np.float64)
    n = len(xs)
    if op == "prod":
        exact = stacked.prod(0)
        return exact, n * eps * np.abs(exact)
    total_magnitude = np.abs(stacked).sum(0)
    if op == "sum":
        return stacked.sum(0), n * eps * total_magnitude
    return stacked.mean(0), (n + 1) * eps * total_magnitude / n


def test_single_rank_communicator_takes_and_returns_a_bare_array():
    with collectives.init() as comm:
        assert (comm.size, comm.rank, comm.local_ranks) == (1, 0, (0,))
        x = np.arange(5, dtype=np.int32)
        assert comm.allreduce(x) is x
        assert np.array_equal(comm.allgather(x), x)
        assert comm.allreduce([x])[0] is x  # a sequence of one comes back as a list


@pytest.mark.parametrize("dtype, n", [(np.int8, 128), (np.int8, 200), (np.uint8, 256)])
def test_integer_avg_over_more_ranks_than_the_dtype_holds(dtype, n):
    """The rank count is no value of the dtype there: the quotient is taken
    in 64 bits and truncates toward zero, as in C and in the compiled loop."""
    info = np.iinfo(dtype)
    with collectives.Communicator.local(n) as comm:
        # rank 0 holds the extremes, the others +-1 and 0: sums stay in range
        xs = [np.array([info.min, info.max, info.min // 2 - 1 if info.min else 7, 0, 1], dtype) if r == 0
              else np.array([0, 0, 0, 1, -1 if info.min else 0], dtype) for r in range(n)]
        totals = np.sum([x.astype(np.int64) for x in xs], axis=0)
        expected = np.array([abs(int(t)) // n * (1 if t >= 0 else -1) for t in totals], dtype)
        comm.allreduce(xs, op="avg", algorithm="direct")
        for x in xs:
            assert np.array_equal(x, expected), (x, expected)


def test_results_keep_shapes():
    with collectives.Communicator.local(2) as comm:
        xs = [np.ones((4, 3), np.float32) * (r + 1) for r in range(2)]
        assert comm.allreduce(xs)[0].shape == (4, 3)
        assert comm.allgather(xs)[0].shape == (8, 3)
        blocks = comm.reduce_scatter([np.ones((4, 3), np.float32) for _ in range(2)])
        assert [b.shape for b in blocks] == [(2, 3), (2, 3)]
        flat = comm.reduce_scatter([np.ones((3, 2), np.float32) for _ in range(2)])  # 3 rows do not split
        assert [b.shape for b in flat] == [(3,), (3,)]
