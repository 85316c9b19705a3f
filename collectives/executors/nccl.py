"""NCCL as a backend: `backend="nccl"` hands each whole collective to NCCL.

    Communicator.local(n, devices=[0, 1, ...], backend="nccl")   ranks in this process, one per GPU
    collectives.init(device="cuda", backend="nccl")              one rank per process (mpiexec)

The Communicator still does everything around the call: it validates the
arrays, dtype, op, root and algorithm exactly as for our backend (and
builds its plan, which this executor reads only for the collective, dtype,
count, op and root), so a bad call is refused before NCCL sees it. This
executor then maps dtype and op to NCCL's, decides which NCCL call to make
with which arguments (`nccl_call`), and issues it on each rank's current
stream. Every decision is a small pure function, tested without a GPU; the
few lines that call NCCL are the ones only a GPU can run.

The binding is CuPy's, `cupy.cuda.nccl`, not NVIDIA's nccl4py: the GPU path
already requires CuPy, and our `cuda12`/`cuda13` extras already install
NCCL's library (nvidia-nccl-cu12/-cu13), so it adds no dependency. It has
what a collective backend needs: NcclCommunicator with allReduce,
reduceScatter, allGather, broadcast and reduce taking raw device pointers
and a stream pointer, initAll (one communicator per GPU of this process,
ncclCommInitAll) and the ncclCommInitRank constructor (one rank per
process), groupStart/groupEnd, get_unique_id (128 bytes), check_async_error
and abort (ncclCommGetAsyncError, ncclCommAbort), and the NCCL_* constants
of every type and op we map. nccl4py, a separate package still below 1.0,
would add a dependency for the same calls. What CuPy's binding lacks is
NcclConfig's `blocking` field (it exposes only split_share), so communicator
creation cannot be made nonblocking and bounded by our timeout (see below).
The binding links ncclCommSplit (NCCL 2.18), so any library it loads has
ncclAvg and ncclBfloat16 (NCCL 2.10).

Timeouts. NCCL has none of its own, and a call returns as soon as its work
is queued on the stream, so a call never blocks the host and the timeout is
enforced where the host waits: Communicator.synchronize(), barrier() and
close(). There the host polls events recorded after each rank's NCCL calls,
and NCCL's asynchronous errors (check_async_error), until the work is done
or the communicator's deadline passes; on a timeout or an error it aborts
the NCCL communicators (ncclCommAbort, which also unblocks their kernels)
and raises CollectiveTimeoutError or CollectiveError. An aborted
communicator refuses every later call; make a new one. Not covered:
* creating the NCCL communicators (ncclCommInitAll / ncclCommInitRank)
  blocks until every rank joins, with no timeout;
* NCCL connects peers lazily, at the first collective that needs them
  (NCCL_RUNTIME_CONNECT, the default since 2.22), which can block the host
  until the peers make that call too (NCCL_RUNTIME_CONNECT=0 moves this into
  communicator creation);
* work waited for some other way (the caller's stream.synchronize(), or a
  captured CUDA graph, whose calls this executor does not track).

Differences from backend="ours": NCCL has no int16 or uint16 (refused, with
that said); NCCL takes a rank's output either in place (in its arrangement:
the output is the input, the reduce_scatter output is the rank's block of
its input, the allgather input is the rank's block of its output) or apart
from the input, so a partial overlap that our backend stages through a
workspace is refused; at most one rank of a communicator per GPU; floats
are summed in NCCL's order and averaged NCCL's way, and max/min follow
NCCL's handling of NaN and signed zeros, so results can differ from ours in
the last bits. NCCL chooses its own algorithm: the `algorithm` argument is
checked as for our backend but does not reach NCCL (its NCCL_ALGO variable
does).

Gather, scatter and all_to_all, which NCCL has no call for, are its
point-to-point calls grouped, as NCCL's documentation builds them
(`nccl_exchange_calls`): per block a send and the matching receive, a
rank's own block sent to itself where it must move. NCCL cannot receive an
all_to_all into the buffer it sends from, so in place is refused there.
"""

import importlib
import time
import warnings
from typing import NamedTuple

import numpy as np

from ..algorithms.schedule import (
    ALL_TO_ALL, ALLGATHER, ALLREDUCE, BROADCAST, EXCHANGES, GATHER, REDUCE_SCATTER, REDUCE_TO_ROOT, SCATTER,
)
from ..devices import open_device, parse_spec
from ..errors import CollectiveError, CollectiveTimeoutError, InvalidUsageError
from ..ops import ReduceOp, as_dtype, bfloat16

# Our dtypes -> the binding's constants for NCCL's types. NCCL has no 16-bit integers.
NCCL_TYPES = {
    np.dtype("int8"): "NCCL_INT8", np.dtype("uint8"): "NCCL_UINT8",
    np.dtype("int32"): "NCCL_INT32", np.dtype("uint32"): "NCCL_UINT32",
    np.dtype("int64"): "NCCL_INT64", np.dtype("uint64"): "NCCL_UINT64",
    np.dtype("float16"): "NCCL_FLOAT16", bfloat16(): "NCCL_BFLOAT16",
    np.dtype("float32"): "NCCL_FLOAT32", np.dtype("float64"): "NCCL_FLOAT64",
}
NCCL_OPS = {
    ReduceOp.SUM: "NCCL_SUM", ReduceOp.PROD: "NCCL_PROD", ReduceOp.MAX: "NCCL_MAX", ReduceOp.MIN: "NCCL_MIN",
    ReduceOp.AVG: "NCCL_AVG",
}
UNIQUE_ID_BYTES = 128       # NCCL_UNIQUE_ID_BYTES
POLL_SECONDS = 1e-4         # between checks of NCCL's progress while the host waits
_TRACKED_STREAMS = 64       # (rank, stream) pairs whose last NCCL call is tracked before done ones are dropped


class NcclCall(NamedTuple):
    method: str     # an NcclCommunicator method
    args: tuple     # its arguments but the last, the stream


# -- decisions, pure ----------------------------------------------------------------

def nccl_type_name(dtype):
    """The binding's constant for `dtype`, or InvalidUsageError for a dtype NCCL lacks."""
    try:
        return NCCL_TYPES[as_dtype(dtype)]
    except KeyError:
        raise InvalidUsageError(
            f"NCCL has no {as_dtype(dtype)} type, so backend='nccl' cannot reduce or move it; "
            "backend='ours' supports it") from None


def nccl_op_name(op):
    """The binding's constant for a ReduceOp (avg is ncclAvg, NCCL 2.10 and later)."""
    return NCCL_OPS[ReduceOp(op)]


def nccl_call(collective, count, nranks, root, rank, datatype, op, source, result):
    """The NCCL call rank `rank` makes for a collective whose WORK buffer is
    `count` elements (plan.count: n*k for reduce_scatter and allgather),
    from the ArrayInfo `source` into the ArrayInfo `result`."""
    _check_placement(collective, rank, source, result)
    send, recv = source.address, result.address
    if collective == ALLREDUCE:
        return NcclCall("allReduce", (send, recv, count, datatype, op))
    if collective == REDUCE_SCATTER:
        return NcclCall("reduceScatter", (send, recv, count // nranks, datatype, op))
    if collective == ALLGATHER:
        return NcclCall("allGather", (send, recv, count // nranks, datatype))
    if collective == BROADCAST:
        return NcclCall("broadcast", (send, recv, count, datatype, root))
    assert collective == REDUCE_TO_ROOT, collective
    return NcclCall("reduce", (send, recv, count, datatype, op, root))


def nccl_calls(collective, count, nranks, root, rank, datatype, op, source, result):
    """Every NCCL call rank `rank` makes for the collective, in order (see
    nccl_call and nccl_exchange_calls)."""
    if collective in EXCHANGES:
        return nccl_exchange_calls(collective, count, nranks, root, rank, datatype, source, result)
    return (nccl_call(collective, count, nranks, root, rank, datatype, op, source, result),)


def nccl_exchange_calls(collective, count, nranks, root, rank, datatype, source, result):
    """The sends and receives rank `rank` makes, grouped, for a gather,
    scatter or all_to_all of blocks of count/nranks elements (plan.count is
    the whole buffer, n*k): rank q's block travels between offset q*k of the
    side holding n blocks and the single block of the other."""
    _check_placement(collective, rank, source, result, root)
    block = count // nranks
    if block == 0:
        return ()
    nbytes = block * source.dtype.itemsize

    def send(address, peer): return NcclCall("send", (address, block, datatype, peer))
    def recv(address, peer): return NcclCall("recv", (address, block, datatype, peer))

    if collective == ALL_TO_ALL:
        return tuple(call for q in range(nranks)
                     for call in (send(source.address + q * nbytes, q), recv(result.address + q * nbytes, q)))
    if collective == GATHER:
        if rank != root:
            return (send(source.address, root),)
        own = result.address + root * nbytes
        mine = () if source.address == own else (send(source.address, root), recv(own, root))
        return mine + tuple(recv(result.address + q * nbytes, q) for q in range(nranks) if q != root)
    assert collective == SCATTER, collective
    if rank != root:
        return (recv(result.address, root),)
    own = source.address + root * nbytes
    mine = () if result.address == own else (send(own, root), recv(result.address, root))
    return tuple(send(source.address + q * nbytes, q) for q in range(nranks) if q != root) + mine


def _check_placement(collective, rank, source, result, root=0):
    """NCCL runs in place only in its own arrangement; any other overlap of a
    rank's input and output is undefined there, so it is refused here."""
    if collective in (GATHER, SCATTER) and rank != root:   # one side alone is used there
        return
    if collective in (REDUCE_SCATTER, SCATTER):   # the output is the rank's block of the input
        in_place = result.address == source.address + rank * result.nbytes
    elif collective in (ALLGATHER, GATHER):       # the input is the rank's block of the output
        in_place = source.address == result.address + rank * source.nbytes
    elif collective == ALL_TO_ALL:                # NCCL's sends and receives of one group run at once
        in_place = False
    else:
        in_place = result.address == source.address
    apart = source.address + source.nbytes <= result.address or result.address + result.nbytes <= source.address
    if not (in_place or apart or source.nbytes == 0 or result.nbytes == 0):
        raise InvalidUsageError(
            f"local rank {rank}'s out overlaps its input, which NCCL cannot do: with backend='nccl' the output "
            "must be in place (as the collective defines it) or apart from the input; backend='ours' handles "
            "any overlap")


def cuda_spec(spec):
    """(kind, index) of a device spec that backend='nccl' can run on: a CUDA GPU."""
    on_host = isinstance(spec, str) and spec.strip().lower() == "host"
    kind_index = ("host", 0) if on_host else parse_spec(spec)
    if kind_index[0] != "cuda":
        raise InvalidUsageError(
            f"backend='nccl' runs on CUDA GPUs, and device {spec!r} is not one; "
            "backend='ours' runs on host and emulated devices")
    return kind_index


def cuda_device_indices(specs):
    """The GPU of each rank in one process: CUDA devices, none named twice
    (NCCL puts at most one rank of a communicator on a GPU)."""
    indices = [cuda_spec(spec)[1] for spec in specs]
    for rank, index in enumerate(indices):
        if index in indices[:rank]:
            raise InvalidUsageError(
                f"devices puts local ranks {indices.index(index)} and {rank} on cuda:{index}, but NCCL takes "
                "at most one rank of a communicator per GPU; backend='ours' lets ranks share one")
    return indices


# -- the binding ----------------------------------------------------------------------

def load_binding():
    """CuPy's NCCL binding, `cupy.cuda.nccl`, or a CollectiveError that says what to install."""
    try:
        import cupy  # noqa: F401  (the binding is part of CuPy)
    except ImportError:
        raise CollectiveError("backend='nccl' needs CuPy, which is not installed: pip install '.[cuda13]' "
                              "(or '.[cuda12]' for CUDA 12)") from None
    with warnings.catch_warnings():
        # CuPy warns when it cannot load NCCL's library; the error below says so, with the fix.
        warnings.filterwarnings("ignore", category=UserWarning, module=r"cupy\._environment")
        nccl = importlib.import_module("cupy.cuda.nccl")
    if not nccl.available:
        try:
            importlib.import_module("cupy_backends.cuda.libs.nccl")   # only for the reason it fails
            reason = "unknown"
        except ImportError as error:
            reason = str(error)
        raise CollectiveError(
            f"backend='nccl' needs NCCL's library, which CuPy could not load ({reason}): pip install "
            "nvidia-nccl-cu13 (with CuPy for CUDA 12: nvidia-nccl-cu12); the '.[cuda13]' and '.[cuda12]' "
            "extras include it")
    return nccl


def new_unique_id(nccl):
    """A fresh NCCL unique id (rank 0 makes it, for every rank of a communicator)."""
    try:
        return nccl.get_unique_id()
    except nccl.NcclError as error:
        raise CollectiveError(f"NCCL could not make a unique id: {error}") from error


def share_unique_id(rendezvous, deadline, unique_id):
    """Rank 0's NCCL unique id, on every rank of the rendezvous (bootstrap.py)."""
    mine = bytes(unique_id) if rendezvous.rank == 0 else b""
    return rendezvous.allgather(mine, UNIQUE_ID_BYTES, deadline, "rank 0 to share NCCL's unique id")[0]


# -- the executor ----------------------------------------------------------------------

class NcclRanks:
    """The ranks of this process, one per GPU, whose collectives NCCL runs
    (the object Communicator calls `run` on)."""

    addressable = False   # NCCL moves the data: the plan, and so its binding, goes unused
    host_only = False
    path = "nccl"         # what runs every call (Communicator.chosen_algorithm)

    def __init__(self, nccl, devices, communicators, nccl_ranks, timeout, transport):
        """`communicators[i]` is the NcclCommunicator of local rank i, on
        `devices[i]`, whose rank in NCCL's communicator is `nccl_ranks[i]`."""
        self._nccl = nccl
        self.rank_devices = list(devices)
        self.locations = [device.array_location for device in devices]
        self.devices = list(dict.fromkeys(devices))
        self.transport = transport    # which cost model `auto` asks, for the plan NCCL does not run
        self._communicators = list(communicators)
        self._nccl_ranks = list(nccl_ranks)
        self._timeout = timeout
        self._constants = {name: getattr(nccl, name) for name in (*NCCL_TYPES.values(), *NCCL_OPS.values())}
        self._events = {}             # (local rank, stream pointer) -> event recorded after its latest NCCL call
        self._barrier_buffers = None  # one byte per local rank, for barrier's allreduce
        self._aborted = None          # why the NCCL communicators were aborted

    @classmethod
    def in_process(cls, specs, timeout):
        """Ranks in this process on the GPUs `specs` (one per rank)."""
        indices = cuda_device_indices(specs)
        nccl = load_binding()
        devices = [open_device(index) for index in indices]   # no GPU: the error that says so
        try:
            communicators = nccl.NcclCommunicator.initAll(indices)
        except nccl.NcclError as error:
            raise CollectiveError(f"NCCL could not create communicators on GPUs {indices}: {error}") from error
        transport = "gpu-in-process" if len(devices) == 1 else "gpu-peers"
        return cls(nccl, devices, communicators, range(len(devices)), timeout, transport)

    @classmethod
    def in_processes(cls, nccl, device, rank, size, unique_id, timeout):
        """This process's rank `rank` of `size`, on `device`, which the caller
        has made current (ncclCommInitRank joins on the current device)."""
        try:
            communicator = nccl.NcclCommunicator(size, unique_id, rank)
        except nccl.NcclError as error:
            raise CollectiveError(
                f"NCCL could not create rank {rank}'s communicator on {device.name}: {error} "
                "(NCCL takes at most one rank per GPU: start at most as many processes as GPUs)") from error
        return cls(nccl, [device], [communicator], [rank], timeout, "gpu-processes")

    # -- the per-call path -----------------------------------------------------

    def run(self, plan, inputs, outputs, input_infos, output_infos, deadline):
        """Issue `plan`'s collective through NCCL on each rank's current
        stream; it returns without waiting (the timeout applies where the host
        waits, see the module doc)."""
        datatype = self._constants[nccl_type_name(plan.dtype)]
        op = self._constants[nccl_op_name(plan.op)]
        calls = [nccl_calls(plan.collective, plan.count, plan.nranks, plan.root, rank, datatype, op, source, result)
                 for rank, source, result in zip(self._nccl_ranks, input_infos, output_infos)]
        self._issue(plan.collective, calls)

    def _issue(self, what, calls):
        self._check_not_aborted()
        nccl = self._nccl
        streams = [device.current_stream() for device in self.rank_devices]
        # One thread issuing for several ranks, or several calls of a rank
        # (sends and receives), must group them: alone, a call may wait for
        # peers whose calls come after it.
        grouped = sum(map(len, calls)) > 1
        try:
            if grouped:
                nccl.groupStart()
            try:
                for communicator, stream, rank_calls in zip(self._communicators, streams, calls):
                    for call in rank_calls:
                        getattr(communicator, call.method)(*call.args, stream.ptr)
            finally:
                if grouped:
                    nccl.groupEnd()
        except nccl.NcclError as error:
            raise CollectiveError(f"NCCL refused {what}: {error}") from error
        for rank, (device, stream) in enumerate(zip(self.rank_devices, streams)):
            if device.is_capturing(stream):
                continue  # the graph's launch runs it, and the caller waits for that
            key = (rank, stream.ptr)
            event = self._events.get(key)
            if event is None:
                if len(self._events) >= _TRACKED_STREAMS:   # streams come and go: forget those that are done
                    self._events = {(r, s): e for (r, s), e in self._events.items()
                                    if not self.rank_devices[r].query(e)}
                event = self._events[key] = device.new_event()
            device.record(event, stream)

    # -- where the host waits --------------------------------------------------

    def synchronize(self, deadline):
        """Wait, until `deadline`, for this process's NCCL work (a GPU's own
        synchronize would wait forever for a hung NCCL kernel)."""
        self._wait(deadline, "synchronize()")

    def barrier(self, deadline):
        """A one-byte allreduce of every local rank, and a bounded wait for it:
        NCCL's only sign that the peers arrived is a collective that completes.
        The wait covers this process's earlier NCCL work too."""
        if self._barrier_buffers is None:
            self._barrier_buffers = [device.allocate(1) for device in self.rank_devices]
        uint8, maximum = self._constants["NCCL_UINT8"], self._constants["NCCL_MAX"]
        self._issue("a barrier", [(NcclCall("allReduce", (b.address, b.address, 1, uint8, maximum)),)
                                  for b in self._barrier_buffers])
        self._wait(deadline, "barrier()")

    def _wait(self, deadline, what):
        """Poll until every NCCL call issued so far is done, watching NCCL's
        asynchronous errors; abort the communicators on an error or at the deadline."""
        self._check_not_aborted()
        nccl = self._nccl
        while True:
            try:
                for communicator in self._communicators:
                    communicator.check_async_error()
            except nccl.NcclError as error:
                reason = f"NCCL reported an error during {what}: {error}"
                self.abort(reason)
                raise CollectiveError(f"{reason}; the NCCL communicators were aborted") from error
            if all(self.rank_devices[rank].query(event) for (rank, _), event in self._events.items()):
                return
            if time.perf_counter() >= deadline:
                reason = (f"{what} timed out after {self._timeout:g} s waiting for NCCL's work to complete "
                          "(a rank that never made the matching call, or a hung GPU)")
                self.abort(reason)
                raise CollectiveTimeoutError(f"{reason}; the NCCL communicators were aborted")
            time.sleep(POLL_SECONDS)

    def _check_not_aborted(self):
        if self._aborted is not None:
            raise CollectiveError(
                f"this communicator's NCCL communicators were aborted ({self._aborted}); make a new communicator")

    # -- life cycle ------------------------------------------------------------

    def abort(self, reason):
        """Abort the NCCL communicators: their pending work stops, and their
        peers in other processes see the failure as a timeout or NCCL error."""
        if self._aborted is None:
            self._aborted = reason
            for communicator in self._communicators:
                communicator.abort()

    def close(self):
        """Destroy the NCCL communicators. Communicator.close's barrier has
        waited for their work, or aborted them, which frees them already."""
        if self._aborted is None:
            for communicator in self._communicators:
                communicator.destroy()
        self._communicators = []
        self._events.clear()
        self._barrier_buffers = None
