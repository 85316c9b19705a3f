"""backend="nccl": the decisions made before NCCL is called, the binding,
the errors, and the timeout/abort logic, all without a GPU (fake NCCL
communicators stand in for the binding's); one test on a real GPU."""

import ctypes
import importlib.util
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

import collectives
from collectives import (
    SUPPORTED_DTYPES, CollectiveError, CollectiveTimeoutError, Communicator, InvalidUsageError, ReduceOp,
)
from collectives.arrays import ArrayInfo
from collectives.bootstrap import MpiRendezvous
from collectives.executors import nccl as nccl_backend
from collectives.executors.nccl import NcclCall, NcclRanks, nccl_call, nccl_op_name, nccl_type_name
from backends import GPU_DEVICE, gpu_unavailable_reason

N = 3

# The values of the binding's constants (cupy.cuda.nccl with NCCL 2.32 loaded: NCCL's enums).
NCCL_CONSTANTS = {
    "NCCL_INT8": 0, "NCCL_UINT8": 1, "NCCL_INT32": 2, "NCCL_UINT32": 3, "NCCL_INT64": 4, "NCCL_UINT64": 5,
    "NCCL_FLOAT16": 6, "NCCL_FLOAT32": 7, "NCCL_FLOAT64": 8, "NCCL_BFLOAT16": 9,
    "NCCL_SUM": 0, "NCCL_PROD": 1, "NCCL_MAX": 2, "NCCL_MIN": 3, "NCCL_AVG": 4,
}
FLOAT32 = NCCL_CONSTANTS["NCCL_FLOAT32"]
UINT8 = NCCL_CONSTANTS["NCCL_UINT8"]
SUM = NCCL_CONSTANTS["NCCL_SUM"]
MAX = NCCL_CONSTANTS["NCCL_MAX"]


# -- fakes of the binding, the communicators and the devices -------------------------------

class FakeNcclError(RuntimeError):
    pass


def fake_binding(log):
    binding = types.SimpleNamespace(available=True, NcclError=FakeNcclError, **NCCL_CONSTANTS)
    binding.groupStart = lambda: log.append("groupStart")
    binding.groupEnd = lambda: log.append("groupEnd")
    return binding


class FakeCommunicator:
    def __init__(self, rank, log):
        self.rank, self.log = rank, log
        self.async_error = None
        self.aborted = self.destroyed = False

    def __getattr__(self, method):  # allReduce, reduceScatter, ...: logged with their arguments
        if not method[0].islower() or method.startswith("_"):
            raise AttributeError(method)
        return lambda *args: self.log.append((self.rank, method, args))

    def check_async_error(self):
        if self.async_error is not None:
            raise self.async_error

    def abort(self):
        self.aborted = True

    def destroy(self):
        self.destroyed = True


class FakeEvent:
    def __init__(self):
        self.records = 0
        self.done = True


class FakeDevice:
    """A GPU as the executor sees it; its arrays are NumPy arrays, so the
    Communicator's validation runs on them as on CuPy arrays."""

    array_location = "host"

    def __init__(self, index):
        self.name = f"cuda:{index}"
        self.stream = types.SimpleNamespace(ptr=0x5000 + index)
        self.events = []

    def current_stream(self):
        return self.stream

    def is_capturing(self, stream):
        return False

    def new_event(self):
        self.events.append(FakeEvent())
        return self.events[-1]

    def record(self, event, stream):
        event.records += 1

    def query(self, event):
        return event.done

    def allocate(self, nbytes):
        return types.SimpleNamespace(address=0x9000 + 0x100 * int(self.name[-1]))


class Fakes:
    def __init__(self, n=N, timeout=5.0):
        self.log = []
        self.devices = [FakeDevice(r) for r in range(n)]
        self.communicators = [FakeCommunicator(r, self.log) for r in range(n)]
        self.ranks = NcclRanks(fake_binding(self.log), self.devices, self.communicators, range(n), timeout,
                               "gpu-peers")
        self.comm = Communicator(self.ranks, size=n, local_ranks=range(n), timeout=timeout)

    def calls(self):
        return [entry for entry in self.log if isinstance(entry, tuple)]


def info(address, size, dtype=np.float32):
    return ArrayInfo(address, size, (size,), np.dtype(dtype), "cuda:0", True, True, "cupy")


def address(a):
    return a.__array_interface__["data"][0]


# -- dtypes and ops ----------------------------------------------------------------------------

NCCL_TYPE_OF = {
    "int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32", "uint32": "NCCL_UINT32",
    "int64": "NCCL_INT64", "uint64": "NCCL_UINT64", "float16": "NCCL_FLOAT16", "bfloat16": "NCCL_BFLOAT16",
    "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
}


@pytest.mark.parametrize("name", sorted(NCCL_TYPE_OF))
def test_every_dtype_nccl_has_maps_to_its_type(name):
    dtype = collectives.ops.BFLOAT16 if name == "bfloat16" else np.dtype(name)
    assert nccl_type_name(dtype) == NCCL_TYPE_OF[name]


@pytest.mark.parametrize("name", ["int16", "uint16"])
def test_dtypes_nccl_lacks_are_refused_naming_them(name):
    with pytest.raises(InvalidUsageError, match=f"NCCL has no {name} type.*backend='ours' supports it"):
        nccl_type_name(np.dtype(name))


def test_the_mapping_covers_every_supported_dtype():
    assert set(NCCL_TYPE_OF) | {"int16", "uint16"} == set(SUPPORTED_DTYPES)


@pytest.mark.parametrize("op,name", [(ReduceOp.SUM, "NCCL_SUM"), (ReduceOp.PROD, "NCCL_PROD"),
                                     (ReduceOp.MAX, "NCCL_MAX"), (ReduceOp.MIN, "NCCL_MIN"),
                                     (ReduceOp.AVG, "NCCL_AVG"), ("avg", "NCCL_AVG")])
def test_ops_map_to_nccl_ops(op, name):
    assert nccl_op_name(op) == name


# -- the call each collective makes ----------------------------------------------------------

def test_allreduce_calls_allreduce_with_the_message():
    call = nccl_call("allreduce", 10, N, 0, 1, FLOAT32, SUM, info(0x1000, 10), info(0x2000, 10))
    assert call == NcclCall("allReduce", (0x1000, 0x2000, 10, FLOAT32, SUM))


def test_reduce_scatter_of_n_times_k_calls_reduce_scatter_with_recvcount_k():
    source = info(0x1000, N * 4)
    in_place = nccl_call("reduce_scatter", N * 4, N, 0, 2, FLOAT32, MAX, source, info(0x1000 + 2 * 16, 4))
    assert in_place == NcclCall("reduceScatter", (0x1000, 0x1020, 4, FLOAT32, MAX))
    apart = nccl_call("reduce_scatter", N * 4, N, 0, 2, FLOAT32, MAX, source, info(0x8000, 4))
    assert apart.args[2] == 4


def test_allgather_of_k_calls_allgather_with_sendcount_k():
    result = info(0x1000, N * 4)
    in_place = nccl_call("allgather", N * 4, N, 0, 1, FLOAT32, SUM, info(0x1000 + 16, 4), result)
    assert in_place == NcclCall("allGather", (0x1010, 0x1000, 4, FLOAT32))
    assert nccl_call("allgather", N * 4, N, 0, 1, FLOAT32, SUM, info(0x8000, 4), result).args[2] == 4


def test_rooted_collectives_pass_the_root():
    x = info(0x1000, 6)
    assert nccl_call("broadcast", 6, N, 2, 0, FLOAT32, SUM, x, x) == \
        NcclCall("broadcast", (0x1000, 0x1000, 6, FLOAT32, 2))
    assert nccl_call("reduce", 6, N, 1, 0, FLOAT32, MAX, x, x) == \
        NcclCall("reduce", (0x1000, 0x1000, 6, FLOAT32, MAX, 1))


@pytest.mark.parametrize("collective,source,result", [
    ("allreduce", info(0x1000, 8), info(0x1004, 8)),
    ("reduce_scatter", info(0x1000, 12), info(0x1000, 4)),        # rank 1's block is at 0x1010
    ("allgather", info(0x1000, 4), info(0x1000, 12)),             # rank 1's block is at 0x1010
])
def test_an_overlap_nccl_cannot_take_is_refused(collective, source, result):
    with pytest.raises(InvalidUsageError, match="overlaps its input.*in place.*backend='ours'"):
        nccl_call(collective, 12 if collective != "allreduce" else 8, N, 0, 1, FLOAT32, SUM, source, result)


def test_a_communicator_hands_nccl_the_plans_counts():
    """Through the whole Communicator path: the plan's count (n*k) becomes
    NCCL's per-rank counts, the caller's arrays its buffers, in one group."""
    fakes = Fakes()
    xs = [np.arange(N * 4, dtype=np.float32) for _ in range(N)]
    outs = fakes.comm.reduce_scatter(xs, op="avg")
    assert fakes.log[0] == "groupStart" and fakes.log[-1] == "groupEnd"
    assert fakes.calls() == [(r, "reduceScatter", (address(xs[r]), address(outs[r]), 4, FLOAT32,
                                                   NCCL_CONSTANTS["NCCL_AVG"], 0x5000 + r)) for r in range(N)]
    fakes.log.clear()
    parts = [np.ones(4, np.int64) for _ in range(N)]
    gathered = fakes.comm.allgather(parts)
    assert [c[2][2] for c in fakes.calls()] == [4] * N
    assert [c[2][:2] for c in fakes.calls()] == [(address(p), address(g)) for p, g in zip(parts, gathered)]
    assert all(event.records == 2 for device in fakes.devices for event in device.events)


def deliver(calls, itemsize):
    """What NCCL does with a group's point-to-point calls: the k-th send from
    rank a to rank b meets the k-th receive on b from a, of the same count,
    and its bytes land there (the fakes' buffers are NumPy arrays)."""
    sends, receives = {}, {}
    for rank, method, (address, count, _, peer, _stream) in calls:
        assert method in ("send", "recv"), method
        pairs = sends if method == "send" else receives
        pairs.setdefault((rank, peer) if method == "send" else (peer, rank), []).append((address, count))
    assert sends.keys() == receives.keys(), "a send without its receive, or a receive without its send"
    for pair, sent in sends.items():
        assert len(sent) == len(receives[pair]), pair
        for (source, count), (destination, expected) in zip(sent, receives[pair]):
            assert count == expected, pair
            ctypes.memmove(destination, source, count * itemsize)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_gather_scatter_and_all_to_all_are_grouped_sends_and_receives(n):
    """The calls each rank makes, delivered as NCCL would, leave the results
    our backend gives, in place (where NCCL can) and out of place."""
    fakes = Fakes(n)
    k = 3
    blocks = [np.arange(n * k, dtype=np.float64) + 100 * r for r in range(n)]
    with Communicator.local(n) as ours:
        for root in range(n):
            for in_place in (False, True):
                fakes.log.clear()
                outs = [np.full(n * k, -1.0) for _ in range(n)]
                if in_place:   # the root's x is its own block of its out
                    outs[root][root * k:(root + 1) * k] = blocks[root][:k]
                xs = [outs[r][r * k:(r + 1) * k] if in_place and r == root else blocks[r][:k].copy()
                      for r in range(n)]
                want = ours.gather([b[:k].copy() for b in blocks], root=root)[root]
                fakes.comm.gather(xs, root=root, out=outs)
                assert not fakes.log or fakes.log[0] == "groupStart" and fakes.log[-1] == "groupEnd"
                deliver(fakes.calls(), 8)
                assert np.array_equal(outs[root], want), (root, in_place)
                assert all((outs[r] == -1).all() for r in range(n) if r != root)

                fakes.log.clear()
                xs = [b.copy() for b in blocks]
                outs = None if in_place else [np.zeros(k) for _ in range(n)]
                got = fakes.comm.scatter(xs, root=root, out=outs)
                deliver(fakes.calls(), 8)
                assert all(np.array_equal(got[r], blocks[root][r * k:(r + 1) * k]) for r in range(n)), (root, in_place)
        fakes.log.clear()
        outs = [np.zeros(n * k) for _ in range(n)]
        fakes.comm.all_to_all([b.copy() for b in blocks], out=outs)
        deliver(fakes.calls(), 8)
        want = ours.all_to_all([b.copy() for b in blocks])
        assert all(np.array_equal(outs[r], want[r]) for r in range(n))
        if n > 1:   # NCCL receives into what it sends from: refused, before any call
            fakes.log.clear()
            with pytest.raises(InvalidUsageError, match="overlaps its input.*backend='ours'"):
                fakes.comm.all_to_all([b.copy() for b in blocks])
            assert fakes.log == []


def test_our_validation_refuses_before_nccl_is_called():
    fakes = Fakes()
    xs = [np.ones(4, np.float32) for _ in range(N)]
    with pytest.raises(InvalidUsageError, match="reduce_scatter needs a multiple of the communicator size"):
        fakes.comm.reduce_scatter(xs)
    with pytest.raises(InvalidUsageError, match="root: 5 is out of range"):
        fakes.comm.broadcast(xs, root=5)
    with pytest.raises(InvalidUsageError, match="op: unknown reduction"):
        fakes.comm.allreduce(xs, op="xor")
    with pytest.raises(InvalidUsageError, match="NCCL has no int16 type"):
        fakes.comm.allreduce([np.ones(4, np.int16) for _ in range(N)])
    assert fakes.log == []


# -- arguments, the binding, and what is missing here ---------------------------------------

def test_nccl_needs_cuda_devices():
    with pytest.raises(InvalidUsageError, match="backend='nccl' runs on CUDA GPUs: pass devices"):
        Communicator.local(2, backend="nccl")
    with pytest.raises(InvalidUsageError, match="'emulated' is not one"):
        Communicator.local(2, devices="emulated", backend="nccl")
    with pytest.raises(InvalidUsageError, match="'emulated:1' is not one"):
        Communicator.local(2, devices=[0, "emulated:1"], backend="nccl")
    with pytest.raises(InvalidUsageError, match="ranks 0 and 1 on cuda:0.*one rank of a communicator per GPU"):
        Communicator.local(2, devices=[0, "cuda:0"], backend="nccl")
    with pytest.raises(InvalidUsageError, match="'host' is not one"):
        collectives.init(backend="nccl")
    with pytest.raises(InvalidUsageError, match="'emulated' is not one"):
        collectives.init(device="emulated", backend="nccl")


@pytest.mark.parametrize("backend", ["NCCL", "mpi", None, 1])
def test_unknown_backends_are_refused_naming_the_valid_ones(backend):
    with pytest.raises(InvalidUsageError, match="unknown backend.*expected one of 'ours', 'nccl'"):
        Communicator.local(2, backend=backend)
    with pytest.raises(InvalidUsageError, match="unknown backend"):
        collectives.init(backend=backend)


def test_the_module_imports_without_a_gpu_and_loads_cupys_binding(monkeypatch):
    """The executor imports no CuPy until a backend='nccl' communicator is
    made, and then uses cupy.cuda.nccl."""
    imported = subprocess.run([sys.executable, "-c", "import sys, collectives.executors.nccl; print(sorted("
                               "m for m in sys.modules if m.split('.')[0] in ('cupy', 'cupy_backends')))"],
                              capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1])
    assert imported.stdout.strip() == "[]"
    binding = types.SimpleNamespace(available=True)
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", binding)
    assert nccl_backend.load_binding() is binding


def test_without_cupy_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(CollectiveError, match=r"needs CuPy.*pip install '\.\[cuda13\]'"):
        nccl_backend.load_binding()


def test_the_names_used_are_in_the_installed_binding():
    """Without NCCL's library the binding cannot be imported; its extension
    module still holds the names of what this executor calls."""
    pytest.importorskip("cupy")
    spec = importlib.util.find_spec("cupy_backends.cuda.libs.nccl")
    if spec is None or spec.origin is None:
        pytest.skip("this CuPy has no NCCL binding")
    binary = Path(spec.origin).read_bytes()
    names = [*NCCL_CONSTANTS, "NcclCommunicator", "initAll", "allReduce", "reduceScatter", "allGather",
             "broadcast", "reduce", "groupStart", "groupEnd", "get_unique_id", "check_async_error", "abort",
             "destroy", "NcclError"]
    assert [name for name in names if name.encode() not in binary] == []


# What the errors say is missing: CuPy, NCCL's library, or a GPU (the device's own errors).
WHAT_IS_MISSING = ("pip install '.[cuda13]'", "pip install nvidia-nccl-cu13", "needs a GPU", "cuda:0 is not usable")


@pytest.mark.skipif(gpu_unavailable_reason() is None, reason="a GPU is usable here")
def test_without_nccl_or_a_gpu_the_error_says_what_is_missing():
    """Whichever is missing first (here NCCL's library, and a GPU)."""
    for make in (lambda: Communicator.local(2, devices=[0, 1], backend="nccl"),
                 lambda: collectives.init(device="cuda", backend="nccl")):
        with pytest.raises(CollectiveError) as error:
            make()
        assert any(what in str(error.value) for what in WHAT_IS_MISSING), error.value


def test_the_unique_id_travels_through_mpi():
    MPI = pytest.importorskip("mpi4py.MPI")
    unique_id = bytes(range(128))
    assert nccl_backend.share_unique_id(MpiRendezvous(MPI.COMM_SELF), time.perf_counter() + 5, unique_id) == unique_id


# -- where the host waits: timeouts, errors, abort ----------------------------------------------

def test_synchronize_waits_for_the_events_of_nccl_calls():
    fakes = Fakes()
    fakes.comm.allreduce([np.ones(4, np.float32) for _ in range(N)])
    fakes.comm.synchronize()
    assert not any(c.aborted for c in fakes.communicators)


def test_calls_on_ever_new_streams_keep_a_bounded_record():
    fakes = Fakes()
    xs = [np.ones(4, np.float32) for _ in range(N)]
    for call in range(100):
        for device in fakes.devices:
            device.stream = types.SimpleNamespace(ptr=0x10000 + call)
        fakes.comm.allreduce(xs)
    assert len(fakes.ranks._events) <= nccl_backend._TRACKED_STREAMS + N


def test_work_that_never_completes_times_out_and_aborts():
    fakes = Fakes(timeout=0.05)
    fakes.comm.allreduce([np.ones(4, np.float32) for _ in range(N)])
    fakes.devices[1].events[0].done = False
    started = time.perf_counter()
    with pytest.raises(CollectiveTimeoutError, match=r"synchronize\(\) timed out after 0.05 s.*aborted"):
        fakes.comm.synchronize()
    assert 0.05 <= time.perf_counter() - started < 2
    assert all(c.aborted for c in fakes.communicators)
    with pytest.raises(CollectiveError, match="were aborted.*make a new communicator"):
        fakes.comm.allreduce([np.ones(4, np.float32) for _ in range(N)])
    fakes.comm.close()   # aborted communicators are not destroyed (ncclCommAbort freed them)
    assert not any(c.destroyed for c in fakes.communicators)


def test_an_asynchronous_nccl_error_aborts_and_raises():
    fakes = Fakes()
    fakes.comm.allreduce([np.ones(4, np.float32) for _ in range(N)])
    fakes.communicators[2].async_error = FakeNcclError("NCCL_ERROR_REMOTE_ERROR: remote process exited")
    with pytest.raises(CollectiveError, match=r"NCCL reported an error during synchronize\(\).*remote process"):
        fakes.comm.synchronize()
    assert all(c.aborted for c in fakes.communicators)


def test_a_synchronous_nccl_error_is_a_collective_error():
    fakes = Fakes()

    def refuse(*args):
        raise FakeNcclError("NCCL_ERROR_INVALID_ARGUMENT: invalid argument")
    fakes.communicators[0].allReduce = refuse
    with pytest.raises(CollectiveError, match="NCCL refused allreduce: NCCL_ERROR_INVALID_ARGUMENT"):
        fakes.comm.allreduce([np.ones(4, np.float32) for _ in range(N)])
    assert fakes.log[-1] == "groupEnd"   # the group is closed all the same


def test_barrier_is_a_one_byte_allreduce_waited_for_within_the_timeout():
    fakes = Fakes(timeout=0.05)
    fakes.comm.barrier()
    assert [(rank, method, args[2:5]) for rank, method, args in fakes.calls()] == \
        [(r, "allReduce", (1, UINT8, MAX)) for r in range(N)]
    for device in fakes.devices:
        device.events[0].done = False
    with pytest.raises(CollectiveTimeoutError, match=r"barrier\(\) timed out"):
        fakes.comm.barrier()
    assert all(c.aborted for c in fakes.communicators)


def test_close_destroys_the_communicators_after_their_work():
    fakes = Fakes()
    fakes.comm.close()
    assert all(c.destroyed and not c.aborted for c in fakes.communicators)


def test_leaving_with_an_exception_aborts():
    fakes = Fakes()
    with pytest.raises(KeyError):
        with fakes.comm:
            raise KeyError("user code failed")
    assert all(c.aborted and not c.destroyed for c in fakes.communicators)


# -- on a GPU ----------------------------------------------------------------------------------------

def nccl_unavailable_reason():
    if GPU_DEVICE == "emulated":
        return "NCCL needs a real GPU (COLLECTIVES_TEST_DEVICE=emulated)"
    if gpu_unavailable_reason():
        return gpu_unavailable_reason()
    try:
        nccl_backend.load_binding()
    except CollectiveError as error:
        return str(error)
    return None


@pytest.mark.gpu
def test_nccl_allreduce_matches_ours_bit_for_bit():
    reason = nccl_unavailable_reason()
    if reason:
        pytest.skip(reason)
    import cupy
    n = min(cupy.cuda.runtime.getDeviceCount(), 4)   # one rank per GPU
    rng = np.random.default_rng(0)
    data = [rng.integers(-1000, 1000, 1 << 16).astype(np.float32) for _ in range(n)]  # sums are exact
    results = {}
    for backend in ("ours", "nccl"):
        with Communicator.local(n, devices=list(range(n)), backend=backend) as comm:
            xs = []
            for r in range(n):
                with cupy.cuda.Device(r):
                    xs.append(cupy.asarray(data[r]))
            comm.allreduce(xs)
            comm.synchronize()
            results[backend] = [cupy.asnumpy(x) for x in xs]
    assert all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(results["ours"], results["nccl"]))
    assert np.array_equal(results["nccl"][0], np.sum(data, axis=0))
