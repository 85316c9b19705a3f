"""What only a GPU can show, plus the checks a GPU run must repeat.

Every test here carries the `gpu` marker and skips with a reason when no GPU
is usable. COLLECTIVES_TEST_DEVICE=emulated runs them on an emulated device
instead (python -m bench.gpu_check --device emulated, which CI runs), except
those that need CUDA itself (graphs, PyTorch CUDA tensors), which say so.
"""

import numpy as np
import pytest

import collectives
from backends import GPU_DEVICE, Backend, require_gpu
from collectives import InvalidUsageError
from collectives.ops import BFLOAT16

pytestmark = pytest.mark.gpu

FLOATS = (np.dtype("float16"), BFLOAT16, np.dtype("float32"), np.dtype("float64"))


@pytest.fixture(scope="module")
def gpu():
    require_gpu()
    return Backend("gpu")


def needs_cuda():
    if GPU_DEVICE != "cuda":
        pytest.skip("needs CUDA itself, not an emulated device")


def random_floats(rng, dtype, count):
    """Normal values with the special ones mixed in: zeros of both signs,
    infinities, subnormals (NaN is added by the tests that want it)."""
    values = rng.standard_normal(count) * 10.0 ** rng.integers(-3, 4, count)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, 1e-40, -1e-40, 1.0, -1.0])
    values[rng.integers(0, count, count // 16)] = rng.choice(specials, count // 16)
    return values.astype(dtype)


def same_bits_or_both_nan(got, want):
    """Bitwise equality, except that NaNs compare by NaN-ness: CUDA's
    conversions give one canonical NaN where NumPy keeps payloads."""
    got, want = np.asarray(got), np.asarray(want)
    nan_got, nan_want = np.isnan(got.astype(np.float64)), np.isnan(want.astype(np.float64))
    bits = np.dtype(f"u{got.dtype.itemsize}")
    return np.array_equal(nan_got, nan_want) and np.array_equal(got.view(bits)[~nan_got], want.view(bits)[~nan_want])


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_random_floats_match_the_numpy_interpreter_bit_for_bit(gpu, n):
    rng = np.random.default_rng(n)
    with gpu.communicator(n) as comm, collectives.Communicator.local(n) as host:
        for dtype in FLOATS:
            for op in ("sum", "prod", "max", "min", "avg"):
                for algorithm in ("ring", "direct"):
                    xs = [random_floats(rng, dtype, 4099) for _ in range(n)]
                    if op in ("max", "min"):
                        xs[0][::97] = np.nan
                    want = host.allreduce([x.copy() for x in xs], op=op, algorithm=algorithm)
                    got = comm.allreduce([gpu.put(x) for x in xs], op=op, algorithm=algorithm)
                    for r in range(n):
                        assert same_bits_or_both_nan(gpu.get(got[r]), want[r]), f"{dtype} {op} {algorithm} rank {r}"


@pytest.mark.parametrize("offset", [1, 3, 7])
@pytest.mark.parametrize("dtype", ["int8", "float16", "float32", "float64"])
def test_views_that_start_at_an_odd_element(gpu, offset, dtype):
    """Addresses that are not 16-byte aligned take the kernel's scalar path."""
    n, count = 3, 1001
    rng = np.random.default_rng(offset)
    with gpu.communicator(n) as comm, collectives.Communicator.local(n) as host:
        data = [rng.integers(-50, 50, count + 2 * offset).astype(dtype) for _ in range(n)]
        want = host.allreduce([d[offset:offset + count].copy() for d in data])
        buffers = [gpu.put(d) for d in data]
        views = [b[offset:offset + count] for b in buffers]
        outs = [gpu.put(np.zeros(count + offset, dtype))[offset:] for _ in range(n)]
        comm.allreduce(views, out=outs)
        comm.allreduce(views)
        for r in range(n):
            assert np.array_equal(gpu.get(outs[r]), want[r])
            assert np.array_equal(gpu.get(views[r]), want[r])
            assert np.array_equal(gpu.get(buffers[r])[:offset], data[r][:offset]), "wrote before the view"
            assert np.array_equal(gpu.get(buffers[r])[offset + count:], data[r][offset + count:]), "wrote after it"
        gathered = comm.allgather(views)
        for r in range(n):
            assert np.array_equal(gpu.get(gathered[r]), np.concatenate(want))


def test_mixing_host_and_device_arrays_is_refused_and_modifies_nothing(gpu):
    needs_cuda()
    with gpu.communicator(2) as comm:
        xs = [gpu.put(np.ones(8, np.float32)), np.ones(8, np.float32)]
        with pytest.raises(InvalidUsageError, match=r"x\[1\] is in host memory.*cuda:0"):
            comm.allreduce(xs)
        assert (gpu.get(xs[0]) == 1).all() and (xs[1] == 1).all()


def test_host_communicator_refuses_device_arrays_and_says_what_to_use(gpu):
    needs_cuda()
    with collectives.Communicator.local(2) as comm:
        xs = [gpu.put(np.ones(8, np.float32)) for _ in range(2)]
        with pytest.raises(InvalidUsageError, match=r"devices=\["):
            comm.allreduce(xs)


def test_work_goes_on_the_current_stream_and_returns_before_it_is_done(gpu):
    needs_cuda()
    import cupy
    n, count = 4, 1 << 22
    with gpu.communicator(n) as comm:
        xs = [cupy.full(count, r + 1, cupy.float32) for r in range(n)]
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            comm.allreduce(xs)
            for _ in range(20):
                comm.allreduce(xs, op="max")
        stream.synchronize()
        for x in xs:
            assert float(x[0]) == 10.0 and float(x[-1]) == 10.0


def test_cuda_graph_capture_and_replay(gpu):
    needs_cuda()
    import cupy
    n, count = 4, 100_003
    with gpu.communicator(n) as comm:
        xs = [cupy.full(count, r + 1, cupy.float32) for r in range(n)]
        outs = [cupy.zeros(count, cupy.float32) for _ in range(n)]
        comm.allreduce(xs, out=outs)  # plan and compile outside the capture
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            comm.allreduce(xs, out=outs)
            graph = stream.end_capture()
        for round_ in range(1, 4):
            for r, x in enumerate(xs):
                x.fill(round_ * (r + 1))
            cupy.cuda.Device().synchronize()
            graph.launch(stream)
            stream.synchronize()
            for out in outs:
                assert float(out[0]) == round_ * 10 and float(out[-1]) == round_ * 10


def test_comm_graph_captures_and_replays_on_the_gpu(gpu):
    needs_cuda()
    import cupy
    n, count = 4, 100_003
    with gpu.communicator(n) as comm:
        xs = [cupy.full(count, r + 1, cupy.float32) for r in range(n)]
        outs = [cupy.zeros(count, cupy.float32) for _ in range(n)]
        comm.allreduce(xs, out=outs)  # warm-up: plan, kernels and workspaces outside the capture
        comm.allreduce(xs)
        with comm.graph() as graph:
            comm.allreduce(xs, out=outs)
        for round_ in range(1, 4):
            for r, x in enumerate(xs):
                x.fill(round_ * (r + 1))
            graph.replay()
            cupy.cuda.get_current_stream().synchronize()
            for out in outs:
                assert float(out[0]) == round_ * 10 and float(out[-1]) == round_ * 10


def test_pytorch_cuda_tensors_bfloat16_included(gpu):
    needs_cuda()
    torch = pytest.importorskip("torch", reason="needs PyTorch with CUDA")
    if not torch.cuda.is_available():
        pytest.skip("this PyTorch build has no CUDA")
    n, count = 3, 5000
    rng = np.random.default_rng(0)
    with gpu.communicator(n) as comm, collectives.Communicator.local(n) as host:
        for name, numpy_dtype in (("float32", np.dtype("float32")), ("bfloat16", BFLOAT16), ("int64", np.dtype("int64"))):
            data = [random_floats(rng, np.float32, count) for _ in range(n)]
            if name == "int64":
                data = [np.rint(d).clip(-1e6, 1e6) for d in data]
            tensors = [torch.tensor(d, device="cuda").to(getattr(torch, name)) for d in data]
            want = host.allreduce([t.cpu().view(torch.int16).numpy().view(BFLOAT16) if name == "bfloat16"
                                   else t.cpu().numpy() for t in tensors], op="sum")
            got = comm.allreduce(tensors, op="sum")
            assert got[0] is tensors[0]
            for r in range(n):
                result = got[r].cpu()
                result = result.view(torch.int16).numpy().view(BFLOAT16) if name == "bfloat16" else result.numpy()
                assert same_bits_or_both_nan(result, want[r]), f"{name} rank {r}"


def test_any_cuda_array_interface_object(gpu):
    needs_cuda()
    import cupy

    class Wrapped:
        def __init__(self, array):
            self.array = array
            self.__cuda_array_interface__ = array.__cuda_array_interface__

    with gpu.communicator(2) as comm:
        raw = [cupy.full(10, r + 1, cupy.int32) for r in range(2)]
        comm.allreduce([Wrapped(a) for a in raw])
        assert all((a == 3).all() for a in raw)


def test_ranks_on_two_gpus(gpu):
    needs_cuda()
    import cupy
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    n = 4
    with collectives.Communicator.local(n, devices=[r % 2 for r in range(n)]) as comm:
        xs = []
        for r in range(n):
            with cupy.cuda.Device(r % 2):
                xs.append(cupy.full(1 << 20, r + 1, cupy.float32))
        comm.allreduce(xs)
        comm.synchronize()
        assert all(float(x[0]) == 10 for x in xs)


def test_ranks_on_several_gpus_make_small_calls_as_one_kernel_each(gpu, monkeypatch):
    """executors/peer_ll.py on GPUs: one rank per GPU, every collective's
    small calls with COLLECTIVES_ONE_KERNEL_ALLREDUCE=1, against the
    interpreter's direct plan, three calls each with a larger call (the
    event path) after each; then repeated and prepared calls on the same
    arrays."""
    needs_cuda()
    import cupy
    n = min(cupy.cuda.runtime.getDeviceCount(), 4)
    if n < 2:
        pytest.skip("needs two GPUs")
    monkeypatch.setenv("COLLECTIVES_ONE_KERNEL_ALLREDUCE", "1")
    from cases import expected, rank_input

    def on_gpus(arrays):
        placed = []
        for r, a in enumerate(arrays):
            with cupy.cuda.Device(r):
                placed.append(cupy.asarray(a))
        return placed

    with collectives.Communicator.local(n, devices=list(range(n))) as comm, \
            collectives.Communicator.local(n) as host:
        assert comm._ranks.peer_ll is not None   # noqa: SLF001
        for dtype, op in ((np.dtype(np.float32), "sum"), (np.dtype(np.float16), "avg"), (np.dtype(np.int32), "max")):
            for collective in ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce"):
                elements = 1001 * (n if collective == "reduce_scatter" else 1)
                for call in range(3):
                    inputs = [rank_input(call, q, dtype, elements) for q in range(n)]
                    xs = on_gpus(inputs)
                    root = call % n
                    if collective == "allreduce":
                        got = comm.allreduce(xs, op=op)
                    elif collective == "reduce_scatter":
                        got = comm.reduce_scatter(xs, op=op)
                    elif collective == "allgather":
                        got = comm.allgather(xs)
                    elif collective == "broadcast":
                        got = comm.broadcast(xs, root=root)
                    else:
                        got = comm.reduce(xs, root=root, op=op)
                    comm.synchronize()
                    want = expected(host, collective, inputs, op, root, "direct")
                    for r in range(n):
                        if collective != "reduce" or r == root:
                            assert same_bits_or_both_nan(cupy.asnumpy(got[r]), want[r]), (collective, dtype, r)
                    big = on_gpus([np.ones(1 << 20, np.float32)] * n)
                    comm.allreduce(big)   # past the LL: the event path, between one-kernel calls
                    comm.synchronize()
                    assert float(big[0][0]) == n
        # The same arrays again and again: the bound launches, plain and prepared.
        xs = on_gpus([np.zeros(777, np.float32)] * n)
        outs = on_gpus([np.zeros(777, np.float32)] * n)
        step = comm.prepare("allreduce", xs, out=outs)
        for call in range(6):
            inputs = [rank_input(100 + call, q, np.dtype(np.float32), 777) for q in range(n)]
            for r, x in enumerate(xs):
                with cupy.cuda.Device(r):
                    x.set(inputs[r])
            step() if call % 2 else comm.allreduce(xs, out=outs)
            comm.synchronize()
            want = expected(host, "allreduce", inputs, "sum", 0, "direct")
            assert all(same_bits_or_both_nan(cupy.asnumpy(outs[r]), want[r]) for r in range(n)), call
