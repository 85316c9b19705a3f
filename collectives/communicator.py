"""The public API: a Communicator validates, plans, and hands the plan to its ranks."""

import concurrent.futures
import functools
import math
import numbers
import threading
import time
import weakref

import numpy as np

from . import arrays, auto, fusion, router, validation
from . import graph as graph_capture
from . import prepared
from .algorithms.schedule import (
    ALL_TO_ALL, ALL_TO_ALL_V, ALLGATHER, ALLREDUCE, BROADCAST, GATHER, REDUCE_SCATTER, REDUCE_TO_ROOT,
    ROOTED_COLLECTIVES, SCATTER,
)
from .binding import IN_PLACE, OUT_OF_PLACE, WORKSPACE, WORKSPACE_APART, WORKSPACE_IN_PLACE
from .compression import wire
from .config import DEFAULT_FAST_SMALL_MAX, resolve_timeout
from .errors import CollectiveError, CollectiveTimeoutError, InvalidUsageError, RankFailedError, RevokedError
from .ops import ReduceOp, as_dtype
from .executors import host
from .executors.paths import CallShape
from .plan import INPUT, OUTPUT, SCRATCH, SINGLE_COPY_ALGORITHMS, WORK, build_plan, segmented_plan
from .transport import fastpath
from .transport.p2p import PointToPoint


class VirtualHostRanks:
    """Every rank lives in this process and owns a NumPy workspace; a phase
    runs rank after rank, which is a valid order since the transfers of one
    phase are independent."""

    addressable = True  # ranks read each other's arrays: plans skip the workspace copies
    host_only = True    # it indexes NumPy arrays
    locations = None
    compresses = True   # runs compressed plans
    transport = "host-in-process"   # which cost model `auto` asks (algorithms/__init__.py)
    path = "interpreter"   # what runs a call (Communicator.chosen_algorithm): the NumPy interpreter of op tables

    def __init__(self, nranks):
        self._workspaces = [np.empty(0, np.uint8) for _ in range(nranks)]

    def point_to_point(self, timeout_of):
        """One rank's sends and receives, to itself alone (Communicator
        refuses several local ranks); nothing to check or abort."""
        return PointToPoint(0, 1, None, timeout_of, lambda peer, during: None, lambda reason, cause: None)

    def run(self, plan, inputs, outputs, input_infos, output_infos, deadline):
        """Run `plan` on the ranks' arrays (one per rank, with their ArrayInfos)."""
        if plan.compression is not None:
            return self._run_compressed(plan, inputs, outputs)
        views = {}
        for rank in range(len(self._workspaces)):
            views[rank, INPUT] = inputs[rank].reshape(-1)
            views[rank, OUTPUT] = outputs[rank].reshape(-1)
            if plan.workspace_bytes:
                workspace = self._workspace(rank, plan.workspace_bytes)
                views[rank, WORK] = workspace[:plan.count * plan.dtype.itemsize].view(plan.dtype)
                views[rank, SCRATCH] = workspace[plan.scratch_offset:plan.workspace_bytes].view(plan.dtype)
        host.execute_phases([phase.table for phase in plan.phases], lambda rank, buffer_id: views[rank, buffer_id],
                            plan.op, plan.nranks)

    def bind(self, plan, inputs, outputs, input_infos=None, output_infos=None):
        """`plan` bound to these arrays (host.BoundTables): a callable that
        runs it, as `run` does, on arrays of a later call with the same
        shapes and memory relation, `bound.run([*inputs, *outputs])`. None
        for compressed plans, which `run` runs. (The ArrayInfos are for
        ranks whose bound form keeps addresses: DeviceRanks.bind.)"""
        if plan.compression is not None:
            return None
        nranks = len(self._workspaces)
        slots = {(rank, INPUT): rank for rank in range(nranks)}
        slots.update({(rank, OUTPUT): nranks + rank for rank in range(nranks)})

        def fixed(rank, buffer_id):
            workspace = self._workspace(rank, plan.workspace_bytes)
            if buffer_id == WORK:
                return workspace[:plan.count * plan.dtype.itemsize].view(plan.dtype)
            return workspace[plan.scratch_offset:plan.workspace_bytes].view(plan.dtype)

        return host.BoundTables([phase.table for phase in plan.phases], plan.op, plan.nranks, [*inputs, *outputs],
                                lambda rank, buffer_id: slots.get((rank, buffer_id)), fixed)

    def _run_compressed(self, plan, inputs, outputs):
        """The codec operations of each phase, rank after rank (compression/wire.py)."""
        floats, wires = {}, []
        for rank in range(len(self._workspaces)):
            rank_floats, rank_wires = wire.workspace_views(plan, self._workspace(rank, plan.workspace_bytes))
            floats.update({(rank, b): v for b, v in rank_floats.items()})
            floats[rank, INPUT] = inputs[rank].reshape(-1)
            floats[rank, OUTPUT] = outputs[rank].reshape(-1)
            wires.append(rank_wires)
        for phase in plan.phases:
            for rank, ops in enumerate(phase.wire_ops_by_rank):
                host.execute_wire(ops, plan.compression, lambda r, b: floats[r, b], lambda r, b: wires[r][b])

    def _workspace(self, rank, nbytes):
        workspace = self._workspaces[rank]
        if workspace.size < nbytes:
            workspace = self._workspaces[rank] = np.empty(max(nbytes, 2 * workspace.size), np.uint8)
        return workspace

    def barrier(self, deadline):
        pass

    def abort(self, reason):
        pass

    def close(self):
        self._workspaces = []


class Communicator:
    """A group of ranks that run collectives together.

    Make one with `Communicator.local(nranks)` (all ranks in this process) or
    `collectives.init()` (one rank per process under mpiexec). `size` is the
    number of ranks, `local_ranks` those this process owns, `rank` the first
    of them, `timeout` the seconds any call may wait for its peers.

    Arrays. Where this process owns one rank, a collective takes a bare
    array; where it owns several, a list (or tuple) with one array per local
    rank, in the order of `local_ranks`, each its own memory. The result
    comes back in the same form (a list for a list). Host communicators
    and emulated devices take NumPy arrays; GPU ranks take CuPy arrays,
    PyTorch tensors, or anything exposing __cuda_array_interface__ or
    DLPack. Arrays are C-contiguous, of the same dtype and shape on every
    rank, of a dtype in collectives.SUPPORTED_DTYPES: int8 to int64, uint8
    to uint64, float16, bfloat16, float32, float64 (not bool: pass uint8).

    Ops (op=): "sum", "prod", "max", "min", "avg", or a ReduceOp. avg is the
    sum divided once by `size` (integers truncate toward zero); float16 and
    bfloat16 compute in float32 and round to nearest even; integer sum and
    prod wrap around; max and min return NaN if any input is NaN, and take
    -0 < +0. Every rank gets the same bits.

    Errors (collectives.errors), the same class on every rank for one event:
    InvalidUsageError (a ValueError) for a bad argument, raised before
    anything is written, or for ranks making different calls;
    CollectiveTimeoutError (a TimeoutError) when a peer did not come within
    `timeout`; RankFailedError (a CollectiveTimeoutError) when a peer died;
    CollectiveError for other failures. Between processes a failed call
    aborts the communicator: every later call raises; `shrink()` makes one
    of the ranks left (host ranks on one machine; see also `agree`,
    `revoke` and collectives.elastic).
    On GPU ranks a collective returns once its work is queued on the
    current stream (see `synchronize`); on host ranks, once it is done.
    """

    def __init__(self, ranks, *, size, local_ranks, timeout):
        self._ranks = ranks
        self.size = size
        self.local_ranks = tuple(local_ranks)
        self.rank = self.local_ranks[0]
        self.timeout = timeout
        self._closed = False
        self._last_checked = None  # ((collective, root, input infos, output infos), binding) that passed
        self._plans = {}           # call shape -> plan
        self._checked_arguments = set()  # (collective, op, root, its type, algorithm, compression) that passed
        self._calls = {}           # arguments and arrays' ids -> _Call that passed (see _collective)
        self._fusion = None        # fusion.Fuser, made on first use
        self._p2p = None           # transport.p2p.PointToPoint, made at the first send or receive
        self._postbox = None       # its compiled shortcuts (p2p.py), which send and recv try first
        self._worker = None        # the background thread of fusion buffers on host ranks
        self._worker_thread = None
        self._busy = set()         # fusion buffers with allreduces started and not yet waited for
        # A compiled allreduce of the ranks' own (ShmRank's, when it has one):
        # fast(x, op, out, timeout) returns the result, or None to decline,
        # and then the general path below runs (and raises what is wrong).
        self._fast_allreduce = getattr(ranks, "fast_allreduce", None)
        # And the other four: fast(collective, x, op, out, root, timeout)
        # returns True once done, or None to decline (see _fast).
        self._fast_collective = getattr(ranks, "fast_collective", None)
        # The loop's merged-step limit (bytes per rank; config.FastSizes):
        # where a call naming `direct` is the loop's step, and which step it is.
        self._fast_small_max = getattr(ranks, "fast_small_max", DEFAULT_FAST_SMALL_MAX)
        # A repeated call of a plan the ranks bound, recognised and run in C
        # (ShmRank's, where the compiled executor runs plans): repeat(collective,
        # x, op, out, root, algorithm, timeout) returns the result, or None to
        # decline (see _collective); forget_repeats(x_id, out_id) when an array goes.
        self._repeat_in_c = getattr(ranks, "repeat", None)
        self._forget_repeats = getattr(ranks, "forget_repeats", None)
        # And where it ran the call: its shape, taken from then on by the same
        # call on new arrays, in C too (shm.py; see _remember_shape).
        self._shape_in_c = getattr(ranks, "remember_shape", None)
        # Made by shrink(): how many shrinks led here, and the rank each rank had before the last one.
        self.epoch = 0
        self.old_ranks = None

    @property
    def timeout(self):
        """Seconds any call may wait for its peers; setting it applies to the calls made after."""
        return self._timeout

    @timeout.setter
    def timeout(self, seconds):
        # (0 is taken: a caller's remaining time, hierarchy.py's node steps; every wait then times out at once)
        if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not 0 <= seconds < math.inf:
            raise InvalidUsageError(f"timeout: expected a finite number of seconds >= 0, got {seconds!r}")
        self._timeout = seconds
        # Ranks whose kernels wait for their peers by themselves take it as a
        # kernel argument (DeviceRanks: the one-kernel calls between GPUs).
        use = getattr(self._ranks, "use_timeout", None)
        if use is not None:
            use(seconds)

    @classmethod
    def local(cls, nranks, *, devices=None, timeout=None, backend="ours"):
        """A communicator of `nranks` ranks, all owned by this process
        ("virtual ranks"): its collectives take a list of `nranks` arrays,
        one per rank.

        nranks   a positive int.
        devices  None (default): host ranks, on NumPy arrays. Else where rank
                 r works, devices[r]: a CUDA device number or "cuda:N" (GPU
                 arrays), or "emulated" / "emulated:N" (our CUDA kernels run
                 on the CPU, on NumPy arrays). Devices may repeat; a single
                 spec puts every rank there.
        timeout  seconds a call may wait for its peers: None takes
                 $COLLECTIVES_TIMEOUT, else 300.
        backend  "ours" (default): our plans and kernels; "nccl": each
                 collective handed to NCCL (executors/nccl.py), every rank on
                 a GPU of its own.

        Raises InvalidUsageError for a bad argument, CollectiveError when a
        device cannot be opened. Use it as a context manager, or call close().
        """
        if isinstance(nranks, bool) or not isinstance(nranks, (int, np.integer)) or nranks < 1:
            raise InvalidUsageError(f"nranks: expected a positive integer, got {nranks!r}")
        nranks = int(nranks)
        timeout = resolve_timeout(timeout)
        backend = resolve_backend(backend)
        if devices is None:
            if backend == "nccl":
                raise InvalidUsageError(
                    "devices: backend='nccl' runs on CUDA GPUs: pass devices=[...], one GPU per rank")
            return cls(VirtualHostRanks(nranks), size=nranks, local_ranks=range(nranks), timeout=timeout)
        if isinstance(devices, (str, int)):
            devices = [devices] * nranks
        devices = list(devices)
        if len(devices) != nranks:
            raise InvalidUsageError(f"devices: names {len(devices)} devices for {nranks} ranks; give one per rank")
        if backend == "nccl":
            from .executors.nccl import NcclRanks, cuda_spec
            for rank, spec in enumerate(devices):
                with validation.naming(f"devices[{rank}]"):
                    cuda_spec(spec)
            ranks = NcclRanks.in_process(devices, timeout)
        else:
            from .devices import open_device, parse_spec
            from .executors.device import DeviceRanks
            for rank, spec in enumerate(devices):
                with validation.naming(f"devices[{rank}]"):
                    parse_spec(spec)
            ranks = DeviceRanks([open_device(spec) for spec in devices])
        return cls(ranks, size=nranks, local_ranks=range(nranks), timeout=timeout)

    def __repr__(self):
        state = "closed" if self._closed else "open"
        return f"<Communicator size={self.size} local_ranks={list(self.local_ranks)} {state}>"

    # -- collectives ----------------------------------------------------------

    def allreduce(self, x, op="sum", out=None, algorithm="auto", compression=None):
        """Every rank gets the reduction (`op`) of all ranks' `x`.

        x            the rank's array, or a list of one per local rank (see
                     Communicator): any supported dtype and shape.
        op           "sum" (default), "prod", "max", "min", "avg", or a ReduceOp.
        out          None: the result overwrites `x` (in place). Else arrays
                     of x's size and dtype, in the form of `x`, that receive
                     it; `out` may be `x` itself, and may overlap its own
                     rank's `x`, but not another local rank's arrays.
        algorithm    "auto" (default: chosen by a cost model, see
                     `chosen_algorithm`) or a name from
                     collectives.algorithms.REGISTRY ("ring", "direct", ...).
        compression  None (default), or "bf16", "fp16", "int8": float32 arrays
                     and op "sum" or "avg" only; data between ranks is
                     encoded, the accumulation is float32, and the result is
                     float32 and the same bits on every rank (error bounds:
                     docs/compression.md, compression/wire.py).

        Returns the result: `out`, or `x` when computed in place (a list for
        a list). Raises InvalidUsageError for a bad argument (nothing is
        written), CollectiveTimeoutError or RankFailedError when a peer
        stalls or dies, CollectiveError otherwise (see Communicator).
        """
        fast = self._fast_allreduce
        if fast is not None and compression is None and algorithm.__class__ is str and not self._closed \
                and not self._busy and (algorithm == "auto" or x.__class__ in fastpath.ARRAYS
                                        and fastpath.runs_as(ALLREDUCE, algorithm, x.nbytes, self._fast_small_max)):
            result = fast(x, op, out, self.timeout)
            if result is not None:
                return result
        return self._list_or_collective(ALLREDUCE, x, op, out, 0, algorithm, compression)

    def reduce_scatter(self, x, op="sum", out=None, algorithm="auto"):
        """Reduce all ranks' `x` and give rank r block r of the result.

        x            the rank's array (or a list, one per local rank) of
                     size*k elements; block r is elements r*k to (r+1)*k.
        op           "sum" (default), "prod", "max", "min", "avg", or a ReduceOp.
        out          None: the result lands in `x`'s own block, returned as a
                     view (along the first axis when it divides by `size`,
                     else flat); the other blocks of `x` are left as they
                     were. Else arrays of k elements and x's dtype.
        algorithm    "auto" (default) or a name that implements reduce_scatter.

        Returns rank r's k reduced elements: `out`, or the view of `x` (a
        list for a list). Raises InvalidUsageError for a bad argument (size
        not a multiple of `size`, too: nothing is written),
        CollectiveTimeoutError or RankFailedError when a peer stalls or dies
        (see Communicator).
        """
        fast = self._fast_collective
        if fast is not None:
            if algorithm.__class__ is str and algorithm == "auto" and not self._closed and not self._busy:
                if fast(REDUCE_SCATTER, x, op, out, 0, self.timeout):   # (see _fast)
                    return self._own_block(x, self.rank) if out is None else out
            else:
                result = self._fast(REDUCE_SCATTER, x, op, out, 0, algorithm)
                if result is not None:
                    return result
        return self._list_or_collective(REDUCE_SCATTER, x, op, out, 0, algorithm)

    def allgather(self, x, out=None, algorithm="auto"):
        """Every rank gets all ranks' `x` concatenated in rank order.

        x            the rank's array of k elements (or a list, one per local
                     rank); it is only read, so local ranks may share one.
        out          None: a new array of the library of `x`, stacked along
                     axis 0 (shape (size*x.shape[0], *x.shape[1:])). Else
                     arrays of size*k elements and x's dtype; `x` may be its
                     own rank's block of `out`.
        algorithm    "auto" (default) or a name that implements allgather.

        Returns the size*k elements (a list for a list). Raises
        InvalidUsageError for a bad argument (nothing is written),
        CollectiveTimeoutError or RankFailedError when a peer stalls or
        dies (see Communicator).
        """
        fast = self._fast_collective
        if fast is not None:
            if out is not None and algorithm.__class__ is str and algorithm == "auto" and not self._closed \
                    and not self._busy:
                if fast(ALLGATHER, x, "sum", out, 0, self.timeout):   # (see _fast)
                    return out
            else:
                result = self._fast(ALLGATHER, x, "sum", out, 0, algorithm)
                if result is not None:
                    return result
        return self._list_or_collective(ALLGATHER, x, "sum", out, 0, algorithm)

    def broadcast(self, x, root=0, out=None, algorithm="auto"):
        """Every rank gets a copy of the root's `x`.

        x            the rank's array (or a list, one per local rank), of the
                     same dtype and shape on every rank; only the root's is
                     read.
        root         the rank whose `x` is sent: an int, 0 <= root < size.
        out          None: the copy overwrites `x` (in place). Else arrays of
                     x's size and dtype, in the form of `x`, that receive it,
                     the root's included (NCCL's send and receive buffers);
                     `x` is then left as it was.
        algorithm    "auto" (default) or a name that implements broadcast.

        Returns the result: `out`, or `x` in place (a list for a list).
        Raises InvalidUsageError for a bad argument (nothing is written),
        CollectiveTimeoutError or RankFailedError when a peer stalls or dies
        (see Communicator).
        """
        fast = self._fast_collective
        if fast is not None:
            if root.__class__ is int and algorithm.__class__ is str and algorithm == "auto" and not self._closed \
                    and not self._busy:
                if fast(BROADCAST, x, "sum", out, root, self.timeout):   # (see _fast)
                    return x if out is None else out
            else:
                result = self._fast(BROADCAST, x, "sum", out, root, algorithm)
                if result is not None:
                    return result
        return self._list_or_collective(BROADCAST, x, "sum", out, root, algorithm)

    def reduce(self, x, root=0, op="sum", out=None, algorithm="auto"):
        """The root gets the reduction (`op`) of all ranks' `x`.

        x            the rank's array (or a list, one per local rank).
        root         the rank that receives the result: an int, 0 <= root < size.
        op           "sum" (default), "prod", "max", "min", "avg", or a ReduceOp.
        out          None: the result overwrites the root's `x` (in place).
                     Else arrays of x's size and dtype, in the form of `x`:
                     the root's receives the result, the other ranks' are
                     left as they were (NCCL's receive buffer, significant
                     at the root only), and every `x` as it was.
        algorithm    "auto" (default) or a name that implements reduce.

        Returns `out`, or `x` in place (a list for a list): on the other
        ranks as it was. Raises InvalidUsageError for a bad argument
        (nothing is written), CollectiveTimeoutError or RankFailedError when
        a peer stalls or dies (see Communicator).
        """
        fast = self._fast_collective
        if fast is not None:
            if root.__class__ is int and algorithm.__class__ is str and algorithm == "auto" and not self._closed \
                    and not self._busy:
                if fast(REDUCE_TO_ROOT, x, op, out, root, self.timeout):   # (see _fast)
                    return x if out is None else out
            else:
                result = self._fast(REDUCE_TO_ROOT, x, op, out, root, algorithm)
                if result is not None:
                    return result
        return self._list_or_collective(REDUCE_TO_ROOT, x, op, out, root, algorithm)

    def gather(self, x, root=0, out=None, algorithm="auto"):
        """The root gets all ranks' `x` concatenated in rank order.

        x            the rank's array of k elements (or a list, one per local
                     rank), the same shape and dtype on every rank; only read.
        root         the rank that receives: an int, 0 <= root < size.
        out          None: the root gets a new array stacked along axis 0
                     (shape (size*x.shape[0], *x.shape[1:])), the other ranks
                     None. Else arrays of size*k elements and x's dtype, in
                     the form of `x`: the root's receives the blocks, the
                     other ranks' are left as they were (MPI's receive
                     buffer, significant at the root only); the root's `x`
                     may be its own block of its `out`.
        algorithm    "auto" (default) or a name that implements gather
                     ("direct": the root reads every block; "tree": binomial).

        Returns `out` (a list for a list), or, without `out`, the new array
        at the root and None elsewhere. Raises InvalidUsageError for a bad
        argument (nothing is written), CollectiveTimeoutError or
        RankFailedError when a peer stalls or dies (see Communicator).
        """
        results = self._collective(GATHER, x, "sum", out, root, algorithm)
        if out is not None:
            return results
        if isinstance(results, list):
            return [result if rank == root else None for result, rank in zip(results, self.local_ranks)]
        return results if self.rank == root else None

    def scatter(self, x, root=0, out=None, algorithm="auto"):
        """Rank r gets block r of the root's `x`.

        x            the rank's array (or a list, one per local rank) of
                     size*k elements, the same shape and dtype on every rank;
                     only the root's is read. Block r is elements r*k to
                     (r+1)*k.
        root         the rank whose `x` is sent: an int, 0 <= root < size.
        out          None: block r lands in the rank's own block of `x`,
                     returned as a view (along the first axis when it divides
                     by `size`, else flat); the other blocks of `x` are left
                     as they were (on the root: all of them). Else arrays of
                     k elements and x's dtype, in the form of `x`.
        algorithm    "auto" (default) or a name that implements scatter
                     ("direct": every rank reads its block; "tree": binomial).

        Returns rank r's k elements: `out`, or the view of `x` (a list for a
        list). Raises InvalidUsageError for a bad argument (a size that is
        not a multiple of `size` too: nothing is written),
        CollectiveTimeoutError or RankFailedError when a peer stalls or dies
        (see Communicator).
        """
        return self._collective(SCATTER, x, "sum", out, root, algorithm)

    def all_to_all(self, x, out=None, algorithm="auto"):
        """Rank r gets block r of every rank's `x`, in rank order: block q of
        its result is block r of rank q's `x` (MPI_Alltoall, NCCL's grouped
        send/recv, torch's all_to_all_single with equal splits).

        x            the rank's array (or a list, one per local rank) of
                     size*k elements, the same shape and dtype on every rank.
                     Block q is elements q*k to (q+1)*k.
        out          None: the result overwrites `x` (in place). Else arrays
                     of x's size and dtype, in the form of `x`; `out` may be
                     `x` itself, and may overlap its own rank's `x`, but not
                     another local rank's arrays.
        algorithm    "auto" (default) or a name that implements all_to_all
                     ("direct": one step, every rank reads a block of each;
                     "round_robin": pairwise exchange, one peer a step).

        Returns the result: `out`, or `x` in place (a list for a list).
        Raises InvalidUsageError for a bad argument (a size that is not a
        multiple of `size` too: nothing is written), CollectiveTimeoutError
        or RankFailedError when a peer stalls or dies (see Communicator).
        """
        return self._collective(ALL_TO_ALL, x, "sum", out, 0, algorithm)

    def all_to_all_v(self, x, send_counts, out=None, recv_counts=None, algorithm="auto"):
        """all_to_all with blocks of any sizes (MPI_Alltoallv with the blocks
        in rank order, torch's all_to_all_single with split sizes): rank r
        sends block q of its `x`, send_counts[q] elements, to rank q; block
        q of its result is the block rank q sent it.

        x            the rank's array (or a list, one per local rank) of
                     sum(send_counts) elements, read flat; the ranks' sizes
                     may differ, their dtype may not. Block q starts
                     send_counts[0] + ... + send_counts[q-1] elements in.
        send_counts  `size` ints >= 0 (with a list `x`, a list of such, one
                     per local rank).
        out          None: a new flat array per rank, of the library of
                     `x`. Else arrays of x's dtype, as many elements as the
                     rank receives, in the form of `x`; `out` may overlap
                     its own rank's `x` (the call then goes through a
                     workspace), but not another local rank's arrays.
        recv_counts  None: the peers' send_counts say what each rank
                     receives. Else `size` ints per local rank, as
                     send_counts, that must be what each peer sends.
        algorithm    "auto" (default) or a name that implements all_to_all
                     ("direct", "round_robin"): the same schedules, whose
                     blocks here have a size of their own (plan.BlockLayout).

        Every rank needs every rank's counts to build the one plan they
        all run: ranks of one process have them from the arguments; a rank
        of several processes first allgathers its row (2 size + 2 int64:
        a mark of the exchange, what it sends, what it expects or -1, how
        many elements its `out` holds or -1), so that a mismatch raises the
        same InvalidUsageError on every rank, nothing written. A rank whose
        peer made another call of those bytes there (a row without the
        mark) raises InvalidUsageError and aborts the communicator, so that
        the peer's next call raises too. Then each block crosses once, as
        all_to_all's: a rank moves its blocks' bytes, not size x the largest.

        Returns the result: `out`, or the new arrays (a list for a list).
        Raises InvalidUsageError for a bad argument (nothing is written),
        CollectiveTimeoutError or RankFailedError when a peer stalls or dies
        (see Communicator).
        """
        self._check_open()
        self._check_idle()
        self._check_arguments(ALL_TO_ALL_V, "sum", 0, algorithm, None)
        ranks = self._ranks
        if getattr(ranks, "path", None) == "nccl":
            raise InvalidUsageError("all_to_all_v: not available yet with backend='nccl'; our backend runs it")
        nlocal, size = len(self.local_ranks), self.size
        inputs, input_infos, as_sequence = validation.rank_arrays(x, nlocal, ranks)
        dtype = input_infos[0].dtype
        for i, info in enumerate(input_infos):
            if info.dtype != dtype:
                raise InvalidUsageError(f"x[{i}] has dtype {info.dtype}, expected {dtype} like x[0]")
        sends = validation.block_counts(send_counts, nlocal, size, as_sequence, "send_counts")
        for i, (row, info) in enumerate(zip(sends, input_infos)):
            if sum(row) != info.size:
                raise InvalidUsageError(f"{validation.rank_name('send_counts', i, as_sequence)}: sums to {sum(row)}, "
                                        f"but x{f'[{i}]' if as_sequence else ''} has {info.size} elements")
        expects = None if recv_counts is None else \
            validation.block_counts(recv_counts, nlocal, size, as_sequence, "recv_counts")
        if out is not None:   # (checked before the counts are exchanged: a rank that raises later strands its peers)
            outputs, output_infos, _ = validation.rank_arrays(out, nlocal, ranks, name="out")
            for i, info in enumerate(output_infos):
                if info.dtype != dtype:
                    raise InvalidUsageError(f"out[{i}] has dtype {info.dtype}, expected {dtype} like the input")
            validation.writable(output_infos, "out")
            validation.ranks_own_their_memory(input_infos, output_infos, True, inputs_written=False,
                                              objects={"x": inputs, "out": outputs})
        if nlocal == size:
            matrix = tuple(sends)
            validation.received_counts(matrix, expects, None if out is None else [info.size for info in output_infos],
                                       as_sequence)
        elif nlocal == 1:
            matrix = self._counts_of_every_rank(sends[0], None if expects is None else expects[0],
                                                None if out is None else output_infos[0].size)
        else:
            raise InvalidUsageError(f"all_to_all_v: this communicator owns {nlocal} of {size} ranks; it takes "
                                    "every rank in one process, or one rank per process")
        receives = [sum(matrix[q][r] for q in range(size)) for r in self.local_ranks]
        if out is None:
            outputs = [arrays.empty_like(a, info, (n,)) for a, info, n in zip(inputs, input_infos, receives)]
            output_infos = [arrays.describe(o) for o in outputs]
        apart = validation.relation(input_infos, output_infos, lambda i, a, b: False) == validation.DISJOINT
        binding = OUT_OF_PLACE if apart and ranks.addressable else WORKSPACE
        plan = self._plan_v(dtype, matrix, algorithm, binding)
        ranks.run(plan, inputs, outputs, input_infos, output_infos, time.perf_counter() + self.timeout)
        return outputs if as_sequence else outputs[0]

    def _plan_v(self, dtype, matrix, algorithm, binding):
        """all_to_all_v's plan for the checked counts `matrix` (matrix[q][r]: what rank q sends rank r)."""
        if algorithm == "auto":   # priced as an all_to_all of the most a rank sends
            algorithm = self._auto(ALL_TO_ALL, max(map(sum, matrix)), dtype.itemsize, 0,
                                   binding if self._ranks.addressable else None)
        return build_plan(ALL_TO_ALL_V, algorithm, self.size, 0, dtype, ReduceOp.SUM, 0, binding, block_counts=matrix)

    def _counts_of_every_rank(self, sends, expects, out_elements):
        """all_to_all_v's counts between processes: this rank's row
        allgathered, then checked alike on every rank (validation.received_counts)."""
        size = self.size
        row = np.array([_COUNTS_MARK, *sends, *(expects if expects is not None else [-1] * size),
                        -1 if out_elements is None else out_elements], np.int64)
        devices = getattr(self._ranks, "rank_devices", None)
        if devices:   # GPU ranks take arrays of their device (an emulated device's are NumPy's)
            rows = devices[0].to_host(self.allgather(devices[0].from_host(row)))
        else:
            rows = self.allgather(row)
        rows = np.asarray(rows).reshape(size, 2 * size + 2)
        other = next((q for q in range(size) if rows[q, 0] != _COUNTS_MARK), None)
        if other is not None:   # the loop matched an allgather of the same bytes: name it, on both ranks
            reason = (f"all_to_all_v: rank {other} made a different call (an allgather of {row.nbytes} bytes?) "
                      f"where rank {self.rank} exchanged its all_to_all_v counts")
            self._ranks.abort(reason, InvalidUsageError)
            raise InvalidUsageError(reason)
        rows = rows[:, 1:]
        matrix = tuple(tuple(int(c) for c in rows[q, :size]) for q in range(size))
        given = [rows[r, size:2 * size] for r in range(size)]
        validation.received_counts(matrix,
                                   [None if given[r][0] < 0 else tuple(int(c) for c in given[r]) for r in range(size)],
                                   [None if rows[r, -1] < 0 else int(rows[r, -1]) for r in range(size)],
                                   as_sequence=False, every_rank=True)
        return matrix

    # -- point to point (transport/p2p.py) -------------------------------------

    def send(self, x, peer, tag=0):
        """Send `x` to rank `peer`; return once `x` may be reused.

        x     one C-contiguous array of a supported dtype (this process
              owns one rank: one rank per process, under mpiexec or torchrun).
        peer  the receiving rank; this rank itself too (the message waits
              for this rank's receive).
        tag   an int >= 0 that the receive names (default 0).

        Messages from one rank to another arrive in the order sent; a
        receive takes the first one with its tag (MPI's matching). A message
        that fits the mailbox's free slots (512 KiB in all) is copied there
        and the call returns; a larger one streams through them, and the
        call returns once the receiver has taken all but the slots' worth;
        from 4 MiB ($COLLECTIVES_MESSAGE_SINGLE_COPY_MIN) the receiver reads
        it straight out of `x` (one copy), and the call returns once it has
        (where the receiver may not read this process's memory, it streams).
        Raises InvalidUsageError for a bad argument (nothing is sent),
        CollectiveTimeoutError when the receiver does not take it within
        the timeout, RankFailedError when it died; a failure aborts the
        communicator, as a failed collective does.
        """
        postbox = self._postbox   # (the common case: one compiled call, checks and all)
        if postbox is not None and postbox.send(x, peer, tag):
            return
        engine = self._p2p
        if engine is not None and not self._closed and engine.sent_at_once(x, peer, tag):
            return
        engine = self._point_to_point("send")
        data = validation.message_bytes(x, self._ranks, "x", written=False)
        engine.send(data, validation.rank_number(peer, self.size, "peer"), validation.message_tag(tag))

    def recv(self, out, peer=None, tag=0):
        """Receive a message into `out`; return the rank it came from.

        out   one C-contiguous, writable array with exactly the message's bytes.
        peer  the sending rank, or None for any rank (MPI_ANY_SOURCE).
        tag   the message's tag (default 0).

        Raises InvalidUsageError for a bad argument, or a message whose
        bytes differ from `out`'s (the communicator is then aborted: the
        sender would wait for a receive that never comes);
        CollectiveTimeoutError or RankFailedError as `send`.
        """
        postbox = self._postbox   # (the common case: one compiled call, checks and all)
        if postbox is not None:
            source = postbox.recv(out, peer, tag, self._timeout)
            if source is not None:
                return source
        engine = self._p2p
        if engine is not None and not self._closed:
            source = engine.received_at_once(out, peer, tag)
            if source is not None:
                return source
        engine = self._point_to_point("recv")
        data = validation.message_bytes(out, self._ranks, "out", written=True)
        peer = None if peer is None else validation.rank_number(peer, self.size, "peer")
        return engine.recv(data, peer, validation.message_tag(tag))

    def isend(self, x, peer, tag=0):
        """`send` that returns at once: a transport.p2p.Request, whose
        `wait()` returns once `x` may be reused (`test()`: whether it may).
        Leave `x` as it is until then. Pending requests move whenever this
        rank waits for any of them."""
        engine = self._point_to_point("send")
        data = validation.message_bytes(x, self._ranks, "x", written=False)
        return engine.isend(data, validation.rank_number(peer, self.size, "peer"), validation.message_tag(tag))

    def irecv(self, out, peer=None, tag=0):
        """`recv` that returns at once: a Request whose `wait()` returns the
        sender's rank once `out` holds the message (also its `source`)."""
        engine = self._point_to_point("recv")
        data = validation.message_bytes(out, self._ranks, "out", written=True)
        peer = None if peer is None else validation.rank_number(peer, self.size, "peer")
        return engine.irecv(data, peer, validation.message_tag(tag))

    def _point_to_point(self, what):
        """The ranks' send/receive engine (made at the first call), or
        InvalidUsageError where these ranks have none."""
        self._check_open()
        engine = self._p2p
        if engine is None:
            if len(self.local_ranks) != 1:
                raise InvalidUsageError(
                    f"{what}: this communicator owns {len(self.local_ranks)} local ranks; send and recv take "
                    "one rank per process (collectives.init under mpiexec or torchrun)")
            make = getattr(self._ranks, "point_to_point", None)
            if make is None:
                raise InvalidUsageError(
                    f"{what}: not available yet on {type(self._ranks).__name__} ranks; host ranks in processes "
                    "on one machine have it")
            engine = self._p2p = make(lambda: self.timeout)
            self._postbox = engine.postbox
        return engine

    def prepare(self, collective, x, **arguments):
        """A collective on fixed arrays, checked and planned now, to run as
        often as wanted with no checks (MPI-4's persistent collectives):

            step = comm.prepare("allreduce", grads, op="avg")
            step()                  # the same as comm.allreduce(grads, op="avg")

        collective  "allreduce", "reduce_scatter", "allgather", "broadcast", "reduce",
                    "gather", "scatter" or "all_to_all".
        x           as for that collective.
        arguments   that collective's keyword arguments (op, out, root,
                    algorithm, compression: those it takes), with its defaults.

        Returns a PreparedCall (collectives/prepared.py): calling it runs
        the collective and returns what the collective returns, the same
        arrays each time (allgather without `out` makes its outputs once,
        here). It keeps the arrays alive. Between calls write new values
        into them; do not reshape, retype or resize them in place (nothing
        is re-checked). On ranks in this process a call issues the launches
        bound now; on ranks in separate processes and with NCCL it is the
        plain call.

        Raises what the collective raises for bad arguments
        (InvalidUsageError, nothing written), and InvalidUsageError for an
        unknown collective or an argument it does not take.
        """
        self._check_open()
        op, out, root, algorithm, compression = prepared.call_arguments(self, collective, arguments)
        checked = self._checked(collective, x, op, out, root, algorithm, compression)
        return prepared.PreparedCall(self, collective, x, arguments, checked)

    def alloc(self, shape, dtype="float32"):
        """Arrays for collectives that read and write the peers' arrays in
        place ("symmetric memory", NCCL's registered buffers): every rank
        calls alloc with the same shape and dtype, in the same order.

            x = comm.alloc(1 << 25, "float32")   # on every rank
            x[...] = ...
            comm.allreduce(x)                      # in place, no workspace copies

        On GPU ranks in separate processes with the one-kernel path on
        (COLLECTIVES_ONE_KERNEL_ALLREDUCE=1), a call whose input and output
        both lie in this memory, at the same place on every rank, runs as a
        barrier, one pass of the step kernel over the peers' arrays and a
        barrier, with no host in the loop (executors/symmetric.py); calls
        small enough for the one-kernel path take it as before. Elsewhere
        (ranks in one process already read each other's arrays; host ranks)
        it returns plain arrays of the ranks' kind. Contents are undefined
        until written, like numpy.empty. The memory is the communicator's:
        do not use it after close() for collectives.

        shape    an int or a sequence of ints
        dtype    a supported dtype (collectives.SUPPORTED_DTYPES)

        Returns one array per local rank: a list where this process has
        several ranks, else the array (NumPy, or CuPy on a GPU).

        Raises InvalidUsageError for a bad shape or dtype, where the
        communicator is closed, or where ranks ask for different sizes
        (every rank raises); CollectiveTimeoutError where a rank does not
        call alloc within the timeout.
        """
        self._check_open()
        self._check_idle()
        shape, dtype = validation.allocation(shape, dtype)
        allocate = getattr(self._ranks, "allocate_symmetric", None)
        if allocate is not None:   # one rank per process
            return allocate(shape, dtype, self.allgather)
        devices = getattr(self._ranks, "rank_devices", None)
        made = [device.empty(shape, dtype) for device in devices] if devices else \
            [np.empty(shape, dtype) for _ in self.local_ranks]
        return made if len(made) > 1 else made[0]

    def allreduce_many(self, arrays, op="sum", fusion_threshold=fusion.DEFAULT_THRESHOLD, compression=None,
                       algorithm="auto"):
        """Allreduce every array of `arrays` in place, fused into few calls.

        Arrays of one dtype are packed, in order, into fusion buffers of at
        most `fusion_threshold` bytes, each allreduced once, then unpacked
        (fusion.py); the arrays may differ in dtype and shape.

        arrays            a list of arrays; with several local ranks, one
                          such list per local rank, alike in length, dtypes
                          and shapes. No two arrays may share memory.
        op                "sum" (default), "prod", "max", "min", "avg", or a ReduceOp.
        fusion_threshold  bytes per fusion buffer (a positive int).
        compression       None, or "bf16", "fp16", "int8" (float32 arrays,
                          op "sum" or "avg"), as in `allreduce`.
        algorithm         "auto" (default) or a name, as in `allreduce`.

        Returns `arrays`. Raises InvalidUsageError for a bad argument
        (checked for every array before any is written), or while a fusion
        buffer of this communicator has allreduces in flight;
        CollectiveTimeoutError or RankFailedError when a peer stalls or
        dies (see Communicator).
        """
        self._check_open()
        self._check_idle()
        return fusion.allreduce_many(self, arrays, op, fusion_threshold, compression, algorithm)

    def fusion_buffer(self, threshold=fusion.DEFAULT_THRESHOLD, op="sum", compression=None, error_feedback=False,
                      algorithm="auto"):
        """A FusionBuffer (fusion.py) that allreduces arrays in place as they
        become ready, as gradients do during a backward pass.

        buffer.add(a) queues an array (a list, one per local rank, with
        several local ranks); once the arrays queued of its dtype fill
        `threshold` bytes, their allreduce starts while the caller goes on.
        buffer.flush() starts what is left; buffer.wait() returns once every
        result is in place and raises the first error of any started
        allreduce. Until wait() returns the arrays are the library's, and
        on host ranks no other collective of this communicator may start.

        threshold       bytes per fusion buffer (a positive int).
        op              "sum" (default), "prod", "max", "min", "avg", or a ReduceOp.
        compression     None, or "bf16", "fp16", "int8" (float32 arrays, op
                        "sum" or "avg"), as in `allreduce`.
        error_feedback  with a compression, each rank keeps what the codec
                        lost of its contribution and adds it to the next
                        (error-feedback SGD); `auto` then runs `direct`.
        algorithm       "auto" (default) or a name, as in `allreduce`.

        Raises InvalidUsageError for a bad argument, here or at add();
        wait() raises CollectiveTimeoutError or RankFailedError when a peer
        stalls or dies (see Communicator).
        """
        self._check_open()
        return fusion.FusionBuffer(self, threshold, op, compression, error_feedback, algorithm)

    def _fuser(self):
        if self._fusion is None:
            self._fusion = fusion.Fuser(self)
        return self._fusion

    def _fusion_submit(self, owner, job):
        """Start `job(fuser)` for a fusion buffer; returns a future. Host ranks
        run jobs in order in one background thread. GPU ranks issue the work
        on the caller's streams right away, which already runs asynchronously."""
        self._busy.add(owner)
        if not self._ranks.host_only:
            future = concurrent.futures.Future()
            try:
                job(self._fuser())
                self._fuser().finished()
                future.set_result(None)
            except Exception as error:  # noqa: BLE001 - surfaces at wait()
                future.set_exception(error)
            return future
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="collectives-fusion")
            self._worker_thread = self._worker.submit(threading.get_ident).result()
        return self._worker.submit(job, self._fuser())

    def _fusion_done(self, owner, futures):
        """`owner` has no work in flight once all `futures` are done."""
        pending = [f for f in futures if not f.done()]
        if not pending:
            self._busy.discard(owner)
            return
        remaining = [len(pending)]

        def one_done(_):
            remaining[0] -= 1
            if not remaining[0]:
                self._busy.discard(owner)

        for future in pending:
            future.add_done_callback(one_done)

    @property
    def tuning(self):
        """What this rank's communicator measured or was given as it
        started, as a dict: for host ranks in processes (across nodes, this
        rank's node), `staged_max` (a large message of any of the five
        collectives of up to this many bytes per rank stages; 0: never) and
        `probe_us` (the slowest rank's median microseconds of the probe's
        allreduce, `single_copy` and `staged`; None where nothing was
        timed: pinned by $COLLECTIVES_STAGED_MAX, kept from before a
        shrink, or every large message stages); on one machine also
        `exchange_single_copy_min` (the exchanges take the single copy from
        this many bytes of a call's blocks; None: never) and
        `exchange_probe_us` (the probe's all_to_all, likewise). {} elsewhere."""
        tuning = getattr(self._ranks, "tuning", None)
        return {} if tuning is None else tuning()

    def chosen_algorithm(self, collective, nbytes, root=0, dtype=None, in_place=None, compression=None,
                         algorithm="auto", symmetric=False):
        """What a call runs: the algorithm, a name of
        collectives.algorithms.REGISTRY that `algorithm="auto"` chooses by
        the cost model of this communicator's transport (or `algorithm`
        itself, when named), and the execution path that runs it.

        collective  "allreduce", "reduce_scatter", "allgather", "broadcast",
                    "reduce", "gather", "scatter", "all_to_all" or
                    "all_to_all_v" (all_to_all's answer, out of place).
        nbytes      bytes of each rank's `x` (all_to_all_v: the most a rank sends).
        root        the call's root (broadcast, reduce, gather, scatter; else ignored).
        dtype       the dtype of `x` (None: one the call's path takes, as
                    float32): host ranks in processes run a call on one
                    NumPy array of a dtype their compiled loop folds
                    (fastpath.LOOP_DTYPES; float16 and bfloat16 not) in
                    the loop, with `auto` or naming the algorithm its step
                    is (fastpath.runs_as): "direct", or "two_shot" for
                    a large allreduce.
        in_place    whether the call writes its result into `x` (None: as
                    the call with no `out` does: broadcast and reduce in
                    place, and all_to_all, the others not): ranks that share one GPU choose
                    differently in place (see docs/gpu.md); elsewhere it
                    changes nothing.
        compression the call's codec (allreduce), or None: ranks that share
                    one GPU run a compressed direct in one pass at the
                    memory floor, and choose it.
        algorithm   "auto" (default), or the algorithm the call names.
        symmetric   whether the arrays lie in symmetric memory (`alloc`):
                    GPU ranks in processes run such calls on another path.

        Returns a Choice (collectives/auto.py): a str, the algorithm's
        name (always one of collectives.algorithms.REGISTRY, but
        "hierarchical" across nodes), with the path in `.path` and, on the
        compiled loop's path, its step in `.step` ("merged" or "staged").
        The paths,
        and which call takes which, are collectives/router.py's table, the
        one decision: for GPU ranks "ll", "symmetric", "staged" or "step"
        in processes, "peer_ll" or "events" in one process (docs/design.md,
        "Execution paths"); "interpreter" for host ranks in one process;
        for host ranks in processes "compiled_loop", "single_copy" (a
        plan reading peers' inputs in place), "compiled_plan" (the
        compiled plan executor) or "step" (the interpreter: compressed,
        float16 and bfloat16 calls); across nodes "program",
        "counterparts", "hierarchical", "compressed" or "exchange"
        (hierarchy.py); "nccl" for backend="nccl". ShmRank.what_ran, the
        loop's `last_step` and HierarchyRanks.last_path say what ran
        (tests/test_routes.py holds each answer against it).

        Raises InvalidUsageError for an unknown collective or algorithm, a
        bad root, or `nbytes` not an int >= 0.
        """
        return router.route(self, collective, nbytes, root, dtype, in_place, compression, algorithm, symmetric)

    def _call_shape(self, collective, nbytes, dtype, root, algorithm, compression, in_place):
        """What router.route asks the ranks' paths about, for a call that
        reaches the plans: the plan of a compressed call (of float32), else
        a paths.CallShape with the algorithm `auto` picks or the one named,
        its arguments checked as a call's (InvalidUsageError)."""
        if compression is not None:
            return self._plan(collective, np.dtype(np.float32), max(1, nbytes // 4), "sum", root, algorithm,
                              (WORKSPACE, True), compression)
        root = validation.root_rank(root, self.size) if collective in ROOTED_COLLECTIVES else 0
        if in_place is None:   # as a call without `out`: broadcast, reduce and all_to_all in place
            in_place = collective in (BROADCAST, REDUCE_TO_ROOT, ALL_TO_ALL)
        if getattr(self._ranks, "addressable", False):
            binding = self._in_place_binding() if in_place else OUT_OF_PLACE
        else:   # (as _binding gives other ranks for arrays in place or apart)
            binding = WORKSPACE_IN_PLACE if in_place else WORKSPACE_APART
        if algorithm == "auto":
            algorithm = self._auto(collective, nbytes, 1, root, binding)   # (nbytes are elements of 1 byte)
        else:
            validation.call_arguments(collective, "sum", root, algorithm, None, self.size)
        dtype = np.dtype(np.uint8) if dtype is None else as_dtype(dtype)
        elements = max(nbytes // dtype.itemsize, 0)
        return CallShape(collective, algorithm, self.size, _work_elements(collective, elements, self.size),
                         dtype, root, None, binding)

    def _auto(self, collective, elements, itemsize, root, binding=None, compression=None):
        """What `auto` runs for a call of `elements` per rank: the model asks
        about each rank's WORK buffer (all blocks, for allgather). Ranks that
        all share one GPU price bound plans, for a binding or a codec (auto.py)."""
        count = _work_elements(collective, elements, self.size)
        single_copy = getattr(self._ranks, "single_copy_takes", None)
        if compression is None and single_copy is not None and single_copy(collective, count * itemsize, binding):
            return SINGLE_COPY_ALGORITHMS[collective][0]   # host ranks in processes: peers' inputs read in place
        return auto.choose(collective, self.size, count * itemsize, root, self._ranks, binding, compression)

    def barrier(self):
        """Return once every rank has called barrier.

        Raises CollectiveTimeoutError when a rank does not come within the
        timeout, RankFailedError when one died, InvalidUsageError where the
        communicator is closed or a fusion buffer has allreduces in flight.
        """
        self._check_open()
        self._check_idle()
        self._ranks.barrier(time.perf_counter() + self.timeout)

    # -- going on after a failure (transport/recovery.py) ------------------------

    def revoke(self):
        """Stop this communicator's calls on every rank at once: a rank
        waiting in a collective, a barrier or agree's peers, and every later
        call, raise RevokedError (unless a failure aborted it first: then
        that failure's class). The way to tell the others to shrink when
        only this rank knows something is wrong. Calling it again, or on an
        aborted communicator, does nothing.

        Raises InvalidUsageError where the communicator is closed, or where
        its ranks cannot recover (see shrink).
        """
        self._recovering("revoke").abort(f"rank {self.rank} revoked the communicator", RevokedError)

    def agree(self, flag):
        """The AND of every rank's `flag` (a bool), the same on every rank that
        returns, also while ranks fail: a rank that died or stopped before
        giving its flag counts as False. Works on an aborted or revoked
        communicator too, so a training step can decide whether to commit
        after a failure. Collective: every rank calls it, in the same order
        among its agree calls (agree calls are counted apart from
        collectives).

        Raises InvalidUsageError for a flag that is not a bool (or 0 or 1),
        where the communicator is closed or cannot recover (see shrink);
        RankExcludedError on a rank that came after the others had decided
        without it (they waited the timeout, or took it for failed).
        """
        if not (isinstance(flag, (bool, np.bool_)) or (isinstance(flag, (int, np.integer)) and flag in (0, 1))):
            raise InvalidUsageError(f"flag: expected a bool, got {flag!r}")
        if self.size == 1:   # alone: nobody to disagree with
            self._check_open()
            return bool(flag)
        return self._recovering("agree").agree(bool(flag), time.perf_counter() + self.timeout)

    def shrink(self):
        """A new communicator of the ranks that are left, after a collective
        raised RankFailedError or CollectiveTimeoutError (or after a rank
        called revoke). Every surviving rank calls it.

        It revokes this communicator first, so a rank still waiting in it
        raises at once. The survivors then agree on who is left, through
        this communicator's shared memory (no service outside the job): the
        ranks that joined the shrink before the others were done waiting
        for them; a rank that is dead or stopped (SIGSTOP) is not waited
        for; any other is waited for up to the timeout. Every member gets
        the same membership, renumbered densely in the old order: the new
        communicator's `old_ranks[r]` is the rank its rank r had here, and
        its `epoch` is this one's + 1. A rank that dies while they shrink
        is left out too (the round starts again without it).

        Once it returns, this communicator stays aborted and is closed: its
        shared memory goes (with the last survivor's mapping), its later
        calls raise InvalidUsageError. What a failed collective left in its output is
        unspecified: a rank may have written some of its result.

        For host ranks in processes on one machine (collectives.init under
        a launcher that lets survivors live: docs/api.md). Raises
        InvalidUsageError elsewhere, or where this communicator is closed;
        RankExcludedError on a rank the others left out (it is closed
        then); CollectiveTimeoutError when the new communicator's members
        do not meet within the timeout: this communicator then stays open
        (aborted), and calling shrink() again goes on with a new round
        (the other members that timed out do the same; one that went on
        without this rank makes it raise RankExcludedError). A shrink has
        4 rounds in all (RankFailedError, and the communicator closed,
        once every one failed).
        """
        ranks = self._recovering("shrink")
        self._stop_worker()
        ranks.abort(f"rank {self.rank} revoked the communicator to shrink it", RevokedError)
        retry = False
        try:
            made, members = ranks.shrink(time.perf_counter() + self.timeout)
        except CollectiveTimeoutError as error:
            # The members did not meet in time: this communicator stays
            # (aborted) for shrink() to go on with the next round. A
            # RankFailedError here says every round was used: nothing to go on with.
            retry = not isinstance(error, RankFailedError)
            raise
        finally:
            if not retry:
                self._closed = True
                if self._p2p is not None:
                    self._p2p.close()
                ranks.close()
        shrunk = Communicator(made, size=len(members), local_ranks=[members.index(self.rank)], timeout=self.timeout)
        shrunk.epoch, shrunk.old_ranks = self.epoch + 1, tuple(members)
        return shrunk

    def _recovering(self, what):
        """The ranks, where they can agree and shrink; else InvalidUsageError."""
        self._check_open()
        if not hasattr(self._ranks, "shrink"):
            raise InvalidUsageError(
                f"{what}: not available on {type(self._ranks).__name__} ranks; host ranks in processes on one "
                "machine have it (collectives.init, one rank per process)")
        return self._ranks

    def synchronize(self):
        """Wait until every collective this process issued so far has
        completed. Collectives on GPU ranks return once their work is queued
        on the caller's current streams; on host ranks they complete before
        returning, and this returns at once.

        Raises InvalidUsageError where the communicator is closed;
        CollectiveTimeoutError where NCCL's work does not complete within
        the timeout (backend="nccl").
        """
        self._check_open()
        wait = getattr(self._ranks, "synchronize", None)
        if wait is not None:  # ranks that bound the wait by the timeout themselves (NCCL)
            wait(time.perf_counter() + self.timeout)
            return
        for device in getattr(self._ranks, "devices", ()):
            device.synchronize()

    def graph(self):
        """Capture the calls made in a `with` block as a graph to replay:

            with comm.graph() as graph:
                comm.allreduce(xs)
            graph.replay()          # one graph launch, a few microseconds of host time

        Nothing runs while capturing; `graph.replay()` runs the captured
        calls on the current stream, on the same arrays (write new values
        into them; do not rebind). Make each call once before capturing it
        (kernels compile and workspaces are allocated on first use, which
        CUDA refuses during capture). See collectives/graph.py.

        Returns a context manager whose `with` value is the Graph.

        Raises InvalidUsageError unless every local rank is on one device
        (our kernels; backend="nccl" cannot be captured, and GPU ranks in
        separate processes only on the one-kernel path, whose calls are the
        only ones they may make while capturing), where the communicator is
        closed or a fusion buffer has allreduces in flight; CollectiveError
        when the capture itself fails.
        """
        from .executors.device import DeviceRanks
        self._check_open()
        self._check_idle()
        devices = getattr(self._ranks, "devices", ())
        if getattr(self._ranks, "capturable", False):   # GPU ranks in processes, one-kernel paths
            return graph_capture.Capture(self, self._ranks, self._ranks.replay_graph)
        if not isinstance(self._ranks, DeviceRanks) or len(devices) != 1:
            where = (f"these ranks are on {len(devices)} devices" if isinstance(self._ranks, DeviceRanks)
                     else f"these are {type(self._ranks).__name__} ranks")
            raise InvalidUsageError(
                "graph: capturing needs every local rank on one device, with our kernels "
                "(Communicator.local(n, devices=[0] * n)), or GPU ranks in separate processes with "
                f"COLLECTIVES_ONE_KERNEL_ALLREDUCE=1; {where}")
        return graph_capture.Capture(self, devices[0])

    @property
    def closed(self):
        """Whether close() was called."""
        return self._closed

    # -- life cycle -------------------------------------------------------------

    def close(self):
        """Release the communicator's resources. Collective: every rank calls
        it (leaving a `with` block does). Calling it again does nothing;
        any later collective raises InvalidUsageError.

        It waits (up to the timeout) for the other ranks to close, so that
        none still reads this rank's memory; a peer that died or never
        calls in does not make close() raise, and shared buffers are
        released all the same. A rank that leaves a `with` block through an
        exception aborts the communicator instead, so that its peers raise
        at once rather than wait out their timeout.
        """
        if self._closed:
            return
        self._stop_worker()   # queued fused allreduces run first: peers wait for them
        self._closed = True
        try:
            self._ranks.barrier(time.perf_counter() + self.timeout)
        except CollectiveError:
            pass
        finally:
            if self._p2p is not None:
                self._p2p.close()   # its views of the ranks' memory go first; its pending requests raise
            self._ranks.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is not None and not self._closed:
            # This rank is leaving early: tell the others instead of making
            # them wait in close() for the full timeout.
            self._ranks.abort(f"{exc_type.__name__} on rank {self.rank}: {exc}")
            self._closed = True
            self._stop_worker()
            self._ranks.close()
        else:
            self.close()

    def _stop_worker(self):
        """Let started fused allreduces finish (each is bounded by the timeout)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True, cancel_futures=False)
            self._worker = None

    def _check_open(self):
        if self._closed:
            raise InvalidUsageError("this communicator is closed")

    def _check_idle(self):
        """Collectives of the caller's thread may not overtake those of a
        fusion buffer's background thread."""
        if self._busy and threading.get_ident() != self._worker_thread and self._ranks.host_only:
            raise InvalidUsageError(
                "a fusion buffer of this communicator has allreduces in flight; call its wait() first "
                "(collectives run in one order on every rank)")

    # -- the compiled loop's shortcut, and the one path every collective takes ---

    def _fast(self, collective, x, op, out, root, algorithm):
        """A reduce_scatter, allgather, broadcast or reduce with `auto` (or
        naming `direct`, which the loop runs: fastpath.runs_as) run by
        the ranks' compiled loop (host ranks in processes: fastpath.py),
        which checks the arrays itself: the result, or None where the loop
        declines the call and the checks and plans of _collective run it
        (and raise what is wrong). The collectives themselves make the
        commonest such call (`auto`, an int root, an `out` for allgather)
        without this frame: about 0.2 us of a 1 KiB broadcast's 0.9 between
        2 processes."""
        if algorithm.__class__ is not str or algorithm != "auto" and algorithm != "direct" \
                or self._closed or self._busy:
            return None
        if root.__class__ is not int:   # a NumPy integer is a rank too (validation.root_rank)
            if not isinstance(root, np.integer):
                return None
            root = int(root)
        if collective == ALLGATHER and out is None:   # a new array, as _checked makes it
            if not isinstance(x, np.ndarray):
                return None
            out = np.empty((self.size * x.shape[0], *x.shape[1:]) if x.ndim else (self.size,), x.dtype)
        if not self._fast_collective(collective, x, op, out, root, self.timeout):
            return None
        if out is not None:
            return out
        return self._own_block(x, self.rank) if collective == REDUCE_SCATTER else x

    def _list_or_collective(self, collective, x, op, out, root, algorithm, compression=None):
        """The five collectives' last step: _collective, but for a list of
        one array (and `out`: None or a list of one) on a process's one
        rank, which the compiled loop runs as it runs the bare array's call
        where it takes that ([the result]). Rank-agnostic code passes a
        list of its local ranks' arrays, one in a process; without this the
        plans ran what allreduce(x) runs in the loop (2026-12-03: a fused
        step went so and was 1.2-1.4x as slow), while chosen_algorithm named
        the loop. What the loop declines goes on to _collective, which
        checks it and names x[0] in what it raises. (_collective itself
        always plans a list: the tests' reference.)"""
        if x.__class__ is list and len(x) == 1 and self._fast_collective is not None and compression is None:
            taken = self._loop_takes_a_list_of_one(collective, x[0], op, out, root, algorithm)
            if taken is not None:
                return taken
        return self._collective(collective, x, op, out, root, algorithm, compression)

    def _loop_takes_a_list_of_one(self, collective, x, op, out, root, algorithm):
        """_list_or_collective's call of the loop on the bare array `x`:
        [the result], or None where the loop declines it."""
        if out is not None and (out.__class__ is not list or len(out) != 1):
            return None
        out = None if out is None else out[0]
        if collective == ALLREDUCE:   # allreduce's own test of its fast path, on the bare array
            fast = self._fast_allreduce
            if fast is None or self._closed or self._busy or algorithm.__class__ is not str or not (
                    algorithm == "auto" or x.__class__ in fastpath.ARRAYS
                    and fastpath.runs_as(ALLREDUCE, algorithm, x.nbytes, self._fast_small_max)):
                return None
            result = fast(x, op, out, self.timeout)
        elif collective in (REDUCE_SCATTER, ALLGATHER, BROADCAST, REDUCE_TO_ROOT):
            result = self._fast(collective, x, op, out, root, algorithm)
        else:
            return None
        return None if result is None else [result]

    def _collective(self, collective, x, op="sum", out=None, root=0, algorithm="auto", compression=None):
        # (The collectives pass their arguments by position: the cheaper call.)
        if self._closed:
            self._check_open()
        if self._busy:
            self._check_idle()
        if self._repeat_in_c is not None and compression is None:   # a repeat the ranks run in C (_offer_repeat)
            result = self._repeat_in_c(collective, x, op, out, root, algorithm, self._timeout)
            if result is not None:
                return result
        # A call with the arguments and the very arrays of an earlier call
        # that passed every check, none of them changed since, would pass
        # again: it takes that call's verdict, plan and bound form (_Call).
        # The arrays are recognised by their ids: a remembered call is
        # forgotten as soon as one of its arrays is gone (see _remember), so
        # while it is remembered no other object can have one of those ids.
        as_sequence = isinstance(x, (list, tuple))
        xs = tuple(x) if as_sequence else (x,)
        key = None
        if root.__class__ is int:   # (1.0 and True equal 1 as keys, but only 1 is a rank)
            try:
                if as_sequence or isinstance(out, (list, tuple)):
                    outs = () if out is None else tuple(out) if isinstance(out, (list, tuple)) else (out,)
                    objects = xs + outs
                    key = (collective, op, root, algorithm, compression, as_sequence, out is None, len(xs),
                           *map(id, objects))
                elif out is None:   # (the same keys, spelt out: a rank's one array is the commonest call)
                    objects = xs
                    key = (collective, op, root, algorithm, compression, False, True, 1, id(x))
                else:
                    objects = (x, out)
                    key = (collective, op, root, algorithm, compression, False, False, 1, id(x), id(out))
                call = self._calls.get(key)
            except (TypeError, ValueError):  # not arrays, or unhashable: the checks below say what is wrong
                key = None
            else:
                if call is not None and call.states_of(objects) == call.states:
                    result = self._repeat(call, xs, objects, as_sequence)
                    if not call.offered:
                        call.offered = True
                        self._offer_repeat(call, collective, x, op, out, root, algorithm, compression, as_sequence)
                    return result

        checked = self._checked(collective, x, op, out, root, algorithm, compression)
        inputs, outputs, input_infos, output_infos, made, plan, as_sequence = checked
        self._ranks.run(plan, inputs, outputs, input_infos, output_infos, time.perf_counter() + self.timeout)
        if key is not None:
            states_of = arrays.repeat_state(objects[0])  # None: arrays of a kind whose calls are checked in full
            if states_of is not None:
                self._remember(key, objects, states_of, plan, input_infos, output_infos, made)
            if self._shape_in_c is not None and not as_sequence and compression is None:
                self._remember_shape(plan, collective, op, root, algorithm, x, out, made, outputs, input_infos,
                                     output_infos)
        return outputs if as_sequence else outputs[0]

    def _remember_shape(self, plan, collective, op, root, algorithm, x, out, made, outputs, input_infos,
                        output_infos):
        """Hand a call that passed every check to the ranks, to run the same
        call on new arrays that differ from these only in their addresses
        from C (the runner's Shapes, _host_plan.c): one NumPy array (and
        `out`, in place, returning its own block of x along the first axis,
        or a new NumPy array each call), as _offer_repeat hands a repeat."""
        if type(x) is not np.ndarray or (made is _GIVEN) != (type(out) is np.ndarray):
            return
        view = make_output = None
        if made is _OWN_BLOCKS:
            if x.ndim < 1 or x.shape[0] % self.size:   # (_own_block's second form is no view of x)
                return
            rows = x.shape[0] // self.size
            view = slice(self.rank * rows, (self.rank + 1) * rows)
        elif made is _FRESH:
            out = outputs[0]
            if type(out) is not np.ndarray:
                return
            make_output = functools.partial(np.empty, out.shape, out.dtype)   # (arrays.empty_like's for NumPy)
        self._shape_in_c(plan, collective, op, root, algorithm, x, None if made is _IN_PLACE or made is _OWN_BLOCKS
                         else out, view, input_infos[0], output_infos[0], make_output)

    def _checked(self, collective, x, op, out, root, algorithm, compression):
        """Every check of a call, then its plan: (inputs, outputs, their
        ArrayInfos, how the outputs came about, the plan, whether `x` was a
        sequence). Raises InvalidUsageError, having written nothing."""
        # The checks, in the order a caller's mistakes arise (validation.py):
        # the call's own arguments, each array, then arrays against each other.
        self._check_arguments(collective, op, root, algorithm, compression)
        ranks = self._ranks
        nlocal = len(self.local_ranks)
        inputs, input_infos, as_sequence = validation.rank_arrays(x, nlocal, ranks)
        first = input_infos[0]
        dtype, elements = first.dtype, first.size
        validation.compressed_dtype(compression, dtype)
        validation.same_dtype_and_shape(input_infos)

        if collective in (REDUCE_SCATTER, SCATTER, ALL_TO_ALL) and elements % self.size:
            raise InvalidUsageError(
                f"x: has {elements} elements, which do not split into {self.size} equal blocks; "
                f"{collective} needs a multiple of the communicator size {self.size}")
        if collective in (REDUCE_SCATTER, SCATTER):
            result_elements = elements // self.size
        elif collective in (ALLGATHER, GATHER):
            result_elements = elements * self.size
        else:
            result_elements = elements

        if out is not None:
            outputs, output_infos = validation.output_arrays(out, nlocal, result_elements, dtype, ranks)
            made = _GIVEN
        elif collective in (REDUCE_SCATTER, SCATTER):
            outputs = [self._own_block(a, rank) for a, rank in zip(inputs, self.local_ranks)]
            output_infos = [arrays.describe(o) for o in outputs]
            made = _OWN_BLOCKS
        elif collective in (ALLGATHER, GATHER):
            outputs = [arrays.empty_like(a, info, self._gathered_shape(info)) for a, info in zip(inputs, input_infos)]
            output_infos = [arrays.describe(o) for o in outputs]
            made = _FRESH
        else:
            outputs, output_infos, made = inputs, input_infos, _IN_PLACE

        binding = self._check_buffers(collective, root, made, inputs, outputs, input_infos, output_infos)
        if compression is not None:  # streamline.py's rewrites hold for an output that is the input or apart from it
            streamlined = validation.relation(input_infos, output_infos, _same_array) != validation.OVERLAPPING
            binding = (WORKSPACE, streamlined)
        plan = self._plan(collective, dtype, elements, op, root, algorithm, binding, compression)
        return inputs, outputs, input_infos, output_infos, made, plan, as_sequence

    def _offer_repeat(self, call, collective, x, op, out, root, algorithm, compression, as_sequence):
        """Hand a repeated call to the ranks to recognise and run in C from
        now on (_collective tries that first), where they can: a call on one
        NumPy array (and `out`, in place, or returning its own block of x
        along the first axis) bound to a compiled plan
        (host_process.BoundPlan.remember_as). _remember's callback forgets
        it with the call."""
        remember = getattr(call.bound, "remember_as", None)
        made = call.made
        if remember is None or self._repeat_in_c is None or as_sequence or compression is not None \
                or type(x) is not np.ndarray or (made is _GIVEN) != (type(out) is np.ndarray):
            return
        if made is _GIVEN:
            remember(collective, op, root, algorithm, x, out)
        elif made is _IN_PLACE:
            remember(collective, op, root, algorithm, x, None)
        elif made is _OWN_BLOCKS and x.ndim >= 1 and x.shape[0] % self.size == 0:   # (_own_block's first form)
            rows = x.shape[0] // self.size
            remember(collective, op, root, algorithm, x, None, slice(self.rank * rows, (self.rank + 1) * rows))

    def _remember(self, key, objects, states_of, plan, input_infos, output_infos, made):
        """Keep a call that passed for `_collective` to recognise its repeats,
        when its arrays are all of one type whose state is cheap to read back
        (`states_of`, arrays.repeat_state: NumPy and CuPy arrays).

        `key` holds the arrays' ids. The _Call keeps a weak reference to each
        array, whose callback forgets the call when the array goes: so no
        array is kept alive, and a key names these very arrays for as long
        as the call is remembered (an id is reused only once its object is
        gone, and CPython runs the callbacks before it frees the object). A
        weak reference also pins an array's memory: NumPy refuses to resize
        (move) an array that has one (short of resize(refcheck=False), which
        it documents as unsafe). A CuPy array's state includes its address
        (arrays.repeat_state). So an array of the same state is still the
        memory that passed the checks. (`input_infos` and `output_infos`
        also keep the arrays' dtype objects alive, which the compiled NumPy
        state compares by address.)"""
        kind = type(objects[0])
        if not all(type(a) is kind for a in objects):
            return
        calls = self._calls
        forget_in_c = self._forget_repeats
        if len(calls) >= _CALLS_KEPT:   # all alive (the gone are forgotten): start afresh
            calls = self._calls = {}
            if forget_in_c is not None:
                forget_in_c(None)
        # (the ids the ranks' repeats in C know the call by: its x, and its out, 0 in place)
        ids = (id(objects[0]), id(objects[1]) if made is _GIVEN and len(objects) == 2 else 0)

        def forget(_, calls=calls, key=key, forget_in_c=forget_in_c, ids=ids):   # not `self`: nor is the
            calls.pop(key, None)                                                 # communicator kept alive
            if forget_in_c is not None:
                forget_in_c(*ids)

        refs = tuple(weakref.ref(a, forget) for a in objects)
        calls[key] = _Call(refs, states_of, states_of(objects), plan, input_infos, output_infos, made)

    def _repeat(self, call, xs, objects, as_sequence):
        """Run a recognised call (see _collective): `xs` its inputs, `objects`
        its inputs and the outputs it was given."""
        made = call.made
        if made is _GIVEN:
            outputs = objects[len(xs):]
        elif made is _IN_PLACE:
            outputs = xs
        elif made is _OWN_BLOCKS:
            outputs = tuple(self._own_block(a, rank) for a, rank in zip(xs, self.local_ranks))
        else:
            outputs = tuple(arrays.empty_like(x, info, self._gathered_shape(info))
                            for x, info in zip(xs, call.input_infos))
        bound = call.bound
        if bound is None:  # bound at the first repeat: a call made once is not worth binding
            bind = getattr(self._ranks, "bind", None)
            bound = call.bound = (bind and bind(call.plan, xs, outputs, call.input_infos,
                                                None if made is _FRESH else call.output_infos)) or False
        if bound:
            bound.run(objects if made is _GIVEN else xs + outputs)   # (objects: the inputs, then the outputs)
        else:
            output_infos = [arrays.describe(o) for o in outputs] if made is _FRESH else call.output_infos
            self._ranks.run(call.plan, list(xs), list(outputs), call.input_infos, output_infos,
                            time.perf_counter() + self.timeout)
        return list(outputs) if as_sequence else outputs[0]

    def _plan(self, collective, dtype, elements, op, root, algorithm, binding, compression=None):
        """The plan for a call shape, checking its op, root, algorithm and
        compression (remembered: a repeated shape costs one dictionary lookup)."""
        # root's type too: 1.0 and True equal 1 as keys, but are no rank numbers.
        key = (collective, dtype, elements, op, root, root.__class__, algorithm, binding, compression)
        try:
            return self._plans[key]
        except KeyError:
            pass
        except TypeError:  # an unhashable argument: the checks below say what is wrong with it
            key = None
        op, root = validation.call_arguments(collective, op, root, algorithm, compression, self.size)
        validation.compressed_dtype(compression, dtype)
        count = _work_elements(collective, elements, self.size)
        itemsize = dtype.itemsize
        if compression is not None:
            itemsize = wire.encoded_nbytes(compression, max(elements, 1)) / max(elements, 1)  # what `auto` weighs
        if algorithm == "auto":
            algorithm = self._auto(collective, elements, itemsize, root, binding if compression is None else None,
                                   compression)
        if compression is not None:
            binding, streamlined = binding
            plan = build_plan(collective, algorithm, self.size, count, dtype, op, root, binding, compression, streamlined)
        else:
            segment = self._plan_segment(collective, count, dtype, binding)
            plan = segmented_plan(collective, algorithm, self.size, count, dtype, op, root, binding, segment) \
                if segment else build_plan(collective, algorithm, self.size, count, dtype, op, root, binding)
        if key is not None:
            if len(self._plans) >= 1024:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def _plan_segment(self, collective, count, dtype, binding):
        """The elements of a segment the ranks run a plan of `count` in
        (ShmRank.plan_segment: plan.segmented_plan), or 0: one run."""
        segment_of = getattr(self._ranks, "plan_segment", None)
        return segment_of(collective, count, dtype, binding) if segment_of is not None else 0

    def _check_arguments(self, collective, op, root, algorithm, compression):
        """The call's own arguments (validation.call_arguments), before any
        array is looked at. Arguments that passed are remembered: a call
        that repeats them costs one dictionary lookup."""
        key = (collective, op, root, root.__class__, algorithm, compression)
        try:
            if key in self._checked_arguments:
                return
        except TypeError:   # an unhashable argument: the check below says what is wrong with it
            key = None
        validation.call_arguments(collective, op, root, algorithm, compression, self.size)
        if compression is not None and not getattr(self._ranks, "compresses", False):
            raise InvalidUsageError(f"compression: not available on {type(self._ranks).__name__} ranks")
        if key is not None:
            if len(self._checked_arguments) >= 1024:
                self._checked_arguments.clear()
            self._checked_arguments.add(key)

    def _check_buffers(self, collective, root, made, inputs, outputs, input_infos, output_infos):
        """Outputs writable, no memory shared between ranks; returns the
        plan binding. The same descriptions as the last call (describing
        caches them) passed these checks already."""
        key = (collective, root, tuple(input_infos), tuple(output_infos))
        last = self._last_checked
        if last is not None and last[0] == key:  # equal descriptions pass equally (identical ones compare fast)
            return last[1]
        out_given = made is _GIVEN
        ranks = self.local_ranks
        validation.writable(output_infos, "out" if out_given else "x",
                            lambda i: _receives(collective, ranks[i], root, out_given))
        validation.ranks_own_their_memory(input_infos, output_infos, out_given,
                                          inputs_written=made in (_IN_PLACE, _OWN_BLOCKS),
                                          objects={"x": inputs, "out": outputs})
        binding = self._binding(collective, input_infos, output_infos)
        self._last_checked = (key, binding)
        return binding

    def _binding(self, collective, inputs, outputs):
        """How a plan may use the caller's arrays (binding.py). Ranks that
        address each other's arrays: IN_PLACE when every rank's output is
        its input chunk for chunk, OUT_OF_PLACE when they are separate, else
        through a workspace. Other ranks: through a workspace, in place
        (WORKSPACE_IN_PLACE), apart (WORKSPACE_APART) or overlapping
        otherwise (WORKSPACE)."""
        ranks = self.local_ranks
        if collective in (REDUCE_SCATTER, SCATTER):    # the output is the rank's block of the input
            def same(i, a, b): return b.address == a.address + ranks[i] * b.nbytes and a.device == b.device
        elif collective in (ALLGATHER, GATHER):        # the input is the rank's block of the output
            def same(i, a, b): return a.address == b.address + ranks[i] * a.nbytes and a.device == b.device
        else:
            def same(i, a, b): return a.address == b.address and a.device == b.device
        relation = validation.relation(inputs, outputs, same)
        if not self._ranks.addressable:
            return {validation.SAME: WORKSPACE_IN_PLACE, validation.DISJOINT: WORKSPACE_APART}.get(relation, WORKSPACE)
        return {validation.SAME: self._in_place_binding(), validation.DISJOINT: OUT_OF_PLACE}.get(relation, WORKSPACE)

    def _in_place_binding(self):
        """IN_PLACE, or the ranks' own form of it (DeviceRanks on one device:
        IN_PLACE_LOCKSTEP, binding.py)."""
        return getattr(self._ranks, "in_place_binding", IN_PLACE)

    def _own_block(self, a, rank):
        """Rank `rank`'s block of a reduce_scatter input, as a view."""
        if a.ndim >= 1 and a.shape[0] % self.size == 0:
            rows = a.shape[0] // self.size
            return a[rank * rows:(rank + 1) * rows]
        k = a.size // self.size
        return a.reshape(-1)[rank * k:(rank + 1) * k]

    def _gathered_shape(self, info):
        return (self.size * info.shape[0], *info.shape[1:]) if len(info.shape) >= 1 else (self.size,)


# How a call's outputs come about: the caller's `out`, its inputs (in place),
# views of each input's own block (reduce_scatter in place), or new arrays
# (allgather without `out`).
_GIVEN, _IN_PLACE, _OWN_BLOCKS, _FRESH = "given", "in place", "own blocks", "fresh"


# The first word of each rank's row in all_to_all_v's exchange of counts
# ("a2av-cnt"): a row without it is another call's data.
_COUNTS_MARK = int.from_bytes(b"a2av-cnt", "little")

# Calls a communicator recognises: enough for one allreduce per gradient of a model.
_CALLS_KEPT = 1024


class _Call:
    """A call that passed every check (Communicator._remember): its arrays'
    weak references, the function reading their state (arrays.repeat_state)
    and their states as they were; the plan; the arrays' descriptions; how
    outputs are made; and the plan bound to the arrays by ranks that can
    (VirtualHostRanks.bind): None until the first repeat, False where there
    is no bound form."""

    __slots__ = ("refs", "states_of", "states", "plan", "input_infos", "output_infos", "made", "bound", "offered")

    def __init__(self, refs, states_of, states, plan, input_infos, output_infos, made):
        self.refs, self.states_of, self.states, self.plan, self.made = refs, states_of, states, plan, made
        self.input_infos, self.output_infos = input_infos, output_infos
        self.bound = None
        self.offered = False   # handed to the ranks' repeats in C once (Communicator._offer_repeat)


# "ours": our plans on our executors; "nccl": whole collectives handed to NCCL.
BACKENDS = ("ours", "nccl")


def resolve_backend(backend):
    """`backend`, checked against the backends there are."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise InvalidUsageError(
            f"backend: unknown backend {backend!r}; expected one of {', '.join(map(repr, BACKENDS))}")
    return backend


def _same_array(rank, a, b):
    return a.address == b.address and a.device == b.device


def _receives(collective, rank, root, out_given):
    """Whether `rank`'s output is written by the collective."""
    if collective in (BROADCAST, SCATTER):
        return rank != root or out_given
    if collective in (REDUCE_TO_ROOT, GATHER):
        return rank == root
    return True


def _work_elements(collective, elements, size):
    """Elements in each rank's WORK buffer (plan.py) for a call of `elements` per rank's `x`."""
    return elements * size if collective in (ALLGATHER, GATHER) else elements
