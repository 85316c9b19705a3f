"""The public API: a Communicator validates, plans, and hands the plan to its ranks."""

import concurrent.futures
import threading
import time
import weakref

import numpy as np

from . import arrays, fusion, validation
from .algorithms import choose
from .algorithms.schedule import (
    ALLGATHER, ALLREDUCE, BROADCAST, COLLECTIVES as COLLECTIVE_NAMES, REDUCE_SCATTER, REDUCE_TO_ROOT,
    REDUCING_COLLECTIVES,
)
from .binding import IN_PLACE, OUT_OF_PLACE, WORKSPACE
from .compression import wire
from .config import resolve_timeout
from .errors import CollectiveError, InvalidUsageError
from .executors import host
from .ops import ReduceOp, as_reduce_op
from .plan import INPUT, OUTPUT, SCRATCH, WORK, build_plan
from .transport import fastpath


class VirtualHostRanks:
    """Every rank lives in this process and owns a NumPy workspace; a phase
    runs rank after rank, which is a valid order since the transfers of one
    phase are independent."""

    addressable = True  # ranks read each other's arrays: plans skip the workspace copies
    host_only = True    # it indexes NumPy arrays
    locations = None
    compresses = True   # runs compressed plans
    transport = "host-in-process"   # which cost model `auto` asks (algorithms/__init__.py)

    def __init__(self, nranks):
        self._workspaces = [np.empty(0, np.uint8) for _ in range(nranks)]

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
        for phase in plan.phases:
            host.execute(phase.table, lambda rank, buffer_id: views[rank, buffer_id], plan.op, plan.nranks)

    def bind(self, plan, inputs, outputs):
        """`plan` bound to these arrays (host.BoundTables): a callable that
        runs it, as `run` does, on arrays of a later call with the same
        shapes and memory relation, `bound([*inputs, *outputs])`. None for
        compressed plans, which `run` runs."""
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
    `collectives.init()` (one rank per process under mpiexec). Every method
    takes one array when this process owns one rank, or a sequence with one
    array per local rank, and returns the result in the same form.
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
        self._calls = {}           # arguments and arrays' ids -> _Call that passed (see _collective)
        self._fusion = None        # fusion.Fuser, made on first use
        self._worker = None        # the background thread of fusion buffers on host ranks
        self._worker_thread = None
        self._busy = set()         # fusion buffers with allreduces started and not yet waited for
        # A compiled allreduce of the ranks' own (ShmRank's, when it has one):
        # fast(x, op, out, timeout) returns the result, or None to decline,
        # and then the general path below runs (and raises what is wrong).
        self._fast_allreduce = getattr(ranks, "fast_allreduce", None)

    @classmethod
    def local(cls, nranks, *, devices=None, timeout=None, backend="ours"):
        """`nranks` ranks owned by this process ("virtual ranks").

        Without `devices` they work on NumPy arrays. `devices` puts rank r on
        devices[r]: a CUDA device number (or "cuda:N") for GPU arrays, or
        "emulated"/"emulated:N" for our kernels run on the CPU, whose arrays
        are NumPy arrays. Devices may repeat. A single spec puts every rank there.

        `backend="nccl"` hands each collective to NCCL instead of our plans
        (executors/nccl.py): every rank on a GPU of its own.
        """
        if isinstance(nranks, bool) or not isinstance(nranks, (int, np.integer)) or nranks < 1:
            raise InvalidUsageError(f"nranks must be a positive integer, got {nranks!r}")
        nranks = int(nranks)
        timeout = resolve_timeout(timeout)
        backend = resolve_backend(backend)
        if devices is None:
            if backend == "nccl":
                raise InvalidUsageError("backend='nccl' runs on CUDA GPUs: pass devices=[...], one GPU per rank")
            return cls(VirtualHostRanks(nranks), size=nranks, local_ranks=range(nranks), timeout=timeout)
        if isinstance(devices, (str, int)):
            devices = [devices] * nranks
        devices = list(devices)
        if len(devices) != nranks:
            raise InvalidUsageError(f"devices names {len(devices)} devices for {nranks} ranks; give one per rank")
        if backend == "nccl":
            from .executors.nccl import NcclRanks
            ranks = NcclRanks.in_process(devices, timeout)
        else:
            from .devices import open_device
            from .executors.device import DeviceRanks
            ranks = DeviceRanks([open_device(spec) for spec in devices])
        return cls(ranks, size=nranks, local_ranks=range(nranks), timeout=timeout)

    def __repr__(self):
        state = "closed" if self._closed else "open"
        return f"<Communicator size={self.size} local_ranks={list(self.local_ranks)} {state}>"

    # -- collectives ----------------------------------------------------------

    def allreduce(self, x, op="sum", out=None, algorithm="auto", compression=None):
        """Every rank gets the reduction of all ranks' `x` (in place unless `out`).

        `compression` ("bf16", "fp16" or "int8"; float32 arrays, op sum or
        avg) sends encoded data between ranks and accumulates in float32;
        the result is float32 and the same bits on every rank
        (compression/wire.py; its error bounds are in the README)."""
        fast = self._fast_allreduce
        if fast is not None and compression is None and isinstance(algorithm, str) and algorithm == "auto" \
                and not self._closed and not self._busy:
            result = fast(x, op, out, self.timeout)
            if result is not None:
                return result
        return self._collective(ALLREDUCE, x, op=op, out=out, algorithm=algorithm, compression=compression)

    def reduce_scatter(self, x, op="sum", out=None, algorithm="auto"):
        """`x` has size*k elements; rank r gets block r (k elements) of the reduction.

        In place, the result lands in `x`'s own block, which is returned as a
        view (along the first axis when it divides evenly, else flat); the
        other blocks of `x` are left as they were.
        """
        return self._collective(REDUCE_SCATTER, x, op=op, out=out, algorithm=algorithm)

    def allgather(self, x, out=None, algorithm="auto"):
        """Every rank gets all ranks' `x` (k elements each) concatenated in rank
        order: size*k elements, in `out` or a new array stacked along axis 0."""
        return self._collective(ALLGATHER, x, out=out, algorithm=algorithm)

    def broadcast(self, x, root=0, algorithm="auto"):
        """Every rank's `x` becomes a copy of the root's `x`."""
        return self._collective(BROADCAST, x, root=root, algorithm=algorithm)

    def reduce(self, x, root=0, op="sum", algorithm="auto"):
        """The root's `x` becomes the reduction of all ranks' `x`; the others' is unchanged."""
        return self._collective(REDUCE_TO_ROOT, x, op=op, root=root, algorithm=algorithm)

    def allreduce_many(self, arrays, op="sum", fusion_threshold=fusion.DEFAULT_THRESHOLD, compression=None,
                       algorithm="auto"):
        """Allreduce every array of `arrays` in place, fused: arrays of one
        dtype are packed into buffers of at most `fusion_threshold` bytes,
        each allreduced once (see fusion.py). With several local ranks,
        `arrays` holds one list per local rank. Returns `arrays`."""
        self._check_open()
        self._check_idle()
        return fusion.allreduce_many(self, arrays, op, fusion_threshold, compression, algorithm)

    def fusion_buffer(self, threshold=fusion.DEFAULT_THRESHOLD, op="sum", compression=None, error_feedback=False,
                      algorithm="auto"):
        """A fusion.FusionBuffer: `add` arrays as they become ready, each
        fusion buffer's allreduce starts once it is full, `wait` for all."""
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

    def chosen_algorithm(self, collective, nbytes, root=0, dtype=None):
        """The algorithm `algorithm="auto"` runs for `collective` on arrays of
        `nbytes` bytes per rank (its cost model is this communicator's transport's).

        `dtype`: the call's `x` is one NumPy array of this dtype. Host ranks
        in processes run such an allreduce in the compiled loop when it takes
        the dtype, and the answer is its step, `merged` or `pipelined`.
        Without `dtype` (a list of arrays, which the loop declines), the plan."""
        if collective not in COLLECTIVE_NAMES:
            raise InvalidUsageError(f"unknown collective {collective!r}; expected one of {', '.join(COLLECTIVE_NAMES)}")
        if collective == ALLREDUCE and dtype is not None and self._fast_allreduce is not None and fastpath.takes(dtype):
            return fastpath.path_for(nbytes)
        itemsize = 1  # nbytes is already bytes
        rooted = collective in (BROADCAST, REDUCE_TO_ROOT)
        return self._auto(collective, nbytes, itemsize, validation.root_rank(root, self.size) if rooted else 0)

    def _auto(self, collective, elements, itemsize, root):
        """What `auto` runs for a call of `elements` per rank: the model asks
        about each rank's WORK buffer (all blocks, for allgather)."""
        count = elements * self.size if collective == ALLGATHER else elements
        return choose(collective, self.size, count * itemsize, root, self._ranks.transport)

    def barrier(self):
        """Return once every rank has called barrier (or raise after the timeout)."""
        self._check_open()
        self._check_idle()
        self._ranks.barrier(time.perf_counter() + self.timeout)

    def synchronize(self):
        """Wait until every collective issued so far has completed. Collectives
        on GPU ranks return once their work is queued on the caller's current
        streams; on host ranks they complete before returning."""
        self._check_open()
        wait = getattr(self._ranks, "synchronize", None)
        if wait is not None:  # ranks that bound the wait by the timeout themselves (NCCL)
            wait(time.perf_counter() + self.timeout)
            return
        for device in getattr(self._ranks, "devices", ()):
            device.synchronize()

    # -- life cycle -------------------------------------------------------------

    def close(self):
        """Release the communicator's resources. Collective: every rank calls it.

        A peer that died or never calls in does not make close() raise; its
        shared buffers are released all the same.
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

    # -- the one path every collective takes -------------------------------------

    def _collective(self, collective, x, *, op="sum", out=None, root=0, algorithm="auto", compression=None):
        if self._closed:
            self._check_open()
        if self._busy:
            self._check_idle()
        # A call with the arguments and the very arrays of an earlier call
        # that passed every check, none of them changed since, would pass
        # again: it takes that call's verdict, plan and bound form (_Call).
        # The arrays are recognised by their weak references (see _remember).
        as_sequence = isinstance(x, (list, tuple))
        xs = tuple(x) if as_sequence else (x,)
        key = None
        # (1.0 and True equal 1 as keys, but only 1 is a rank.)
        state_of = arrays.repeat_state(xs[0]) if root.__class__ is int and xs else None
        if state_of is not None:
            try:
                outs = () if out is None else tuple(out) if isinstance(out, (list, tuple)) else (out,)
                objects = xs + outs
                refs = tuple(map(weakref.ref, objects))
                key = (collective, op, root, algorithm, compression, as_sequence, out is None, len(xs),
                       *map(id, refs))
                call = self._calls.get(key)
            except (TypeError, ValueError):  # not arrays, or unhashable arguments: the checks below say what is wrong
                key = call = None
            else:
                if call is not None and tuple(map(call.state_of, objects)) == call.states:
                    return self._repeat(call, xs, objects, as_sequence)

        ranks = self._ranks
        nlocal = len(self.local_ranks)
        inputs, input_infos, as_sequence = validation.rank_arrays(x, nlocal, ranks)
        validation.same_dtype_and_shape(input_infos)
        first = input_infos[0]
        dtype, elements = first.dtype, first.size

        if collective == REDUCE_SCATTER:
            if elements % self.size:
                raise InvalidUsageError(
                    f"reduce_scatter needs an input whose size divides by the communicator size "
                    f"{self.size}; it has {elements} elements")
            result_elements = elements // self.size
        elif collective == ALLGATHER:
            result_elements = elements * self.size
        else:
            result_elements = elements

        if out is not None:
            outputs, output_infos = validation.output_arrays(out, nlocal, result_elements, dtype, ranks)
            made = _GIVEN
        elif collective == REDUCE_SCATTER:
            outputs = [self._own_block(a, rank) for a, rank in zip(inputs, self.local_ranks)]
            output_infos = [arrays.describe(o) for o in outputs]
            made = _OWN_BLOCKS
        elif collective == ALLGATHER:
            outputs = [arrays.empty_like(a, info, self._gathered_shape(info)) for a, info in zip(inputs, input_infos)]
            output_infos = [arrays.describe(o) for o in outputs]
            made = _FRESH
        else:
            outputs, output_infos, made = inputs, input_infos, _IN_PLACE

        binding = self._check_buffers(collective, root, out is not None, input_infos, output_infos)
        if compression is not None:  # streamline.py's rewrites hold for an output that is the input or apart from it
            streamlined = validation.relation(input_infos, output_infos, _same_array) != validation.OVERLAPPING
            binding = (WORKSPACE, streamlined)
        plan = self._plan(collective, dtype, elements, op, root, algorithm, binding, compression)
        ranks.run(plan, inputs, outputs, input_infos, output_infos, time.perf_counter() + self.timeout)
        if key is not None:
            self._remember(key, refs, objects, state_of, plan, input_infos, output_infos, made)
        return outputs if as_sequence else outputs[0]

    def _remember(self, key, refs, objects, state_of, plan, input_infos, output_infos, made):
        """Keep a call that passed for `_collective` to recognise its repeats,
        when its arrays are all of one type whose state is cheap to read back
        (`state_of`, arrays.repeat_state: NumPy and CuPy arrays).

        `key` holds the ids of the arrays' weak references `refs`, which the
        _Call keeps: so no array is kept alive, and no other object can take
        a reference's id. weakref.ref(a) returns a's existing reference, so
        a later call's key equals this one only with these very arrays, still
        alive. A weak reference also pins an array's memory: NumPy refuses to
        resize (move) an array that has one (short of resize(refcheck=False),
        which it documents as unsafe). A CuPy array's state includes its
        address (arrays.repeat_state). So an array of the same state is
        still the memory that passed the checks."""
        kind = type(objects[0])
        if not all(type(a) is kind for a in objects):
            return
        if len(self._calls) >= _CALLS_KEPT:  # forget calls whose arrays are gone, or else all
            live = {k: c for k, c in self._calls.items() if all(r() is not None for r in c.refs)}
            self._calls = live if len(live) < _CALLS_KEPT // 2 else {}
        self._calls[key] = _Call(refs, state_of, tuple(map(state_of, objects)), plan, input_infos, output_infos,
                                 made)

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
            bound = call.bound = (bind and bind(call.plan, xs, outputs)) or False
        if bound:
            bound.run(xs + outputs)
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
        op = _reduce_op(op) if collective in REDUCING_COLLECTIVES else ReduceOp.SUM
        root = validation.root_rank(root, self.size) if collective in (BROADCAST, REDUCE_TO_ROOT) else 0
        if not isinstance(algorithm, str):
            raise InvalidUsageError(f"algorithm must be a name, got {type(algorithm).__name__}")
        count = elements * self.size if collective == ALLGATHER else elements  # each rank's WORK buffer
        itemsize = dtype.itemsize
        if compression is not None:
            wire.check_compression(compression, dtype, op, collective)
            if not getattr(self._ranks, "compresses", False):
                raise InvalidUsageError(f"compression is not available on {type(self._ranks).__name__} ranks")
            itemsize = wire.encoded_nbytes(compression, max(elements, 1)) / max(elements, 1)  # what `auto` weighs
        if algorithm == "auto":
            algorithm = self._auto(collective, elements, itemsize, root)
        if compression is not None:
            binding, streamlined = binding
            plan = build_plan(collective, algorithm, self.size, count, dtype, op, root, binding, compression, streamlined)
        else:
            plan = build_plan(collective, algorithm, self.size, count, dtype, op, root, binding)
        if key is not None:
            if len(self._plans) >= 1024:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def _check_buffers(self, collective, root, out_given, input_infos, output_infos):
        """Outputs writable, no memory shared between ranks; returns the
        plan binding. The same descriptions as the last call (describing
        caches them) passed these checks already."""
        key = (collective, root, tuple(input_infos), tuple(output_infos))
        last = self._last_checked
        if last is not None and last[0] == key:  # equal descriptions pass equally (identical ones compare fast)
            return last[1]
        written = [o for o, rank in zip(output_infos, self.local_ranks) if _receives(collective, rank, root)]
        validation.writable(written, "out" if out_given else "x")
        validation.no_overlap_between_ranks(input_infos, output_infos)
        binding = self._binding(collective, input_infos, output_infos) if self._ranks.addressable else WORKSPACE
        self._last_checked = (key, binding)
        return binding

    def _binding(self, collective, inputs, outputs):
        """How a plan may use the arrays of ranks that address each other's
        (binding.py): IN_PLACE when every rank's output is its input chunk for
        chunk, OUT_OF_PLACE when they are separate, else through a workspace."""
        ranks = self.local_ranks
        if collective == REDUCE_SCATTER:    # the output is the rank's block of the input
            def same(i, a, b): return b.address == a.address + ranks[i] * b.nbytes and a.device == b.device
        elif collective == ALLGATHER:       # the input is the rank's block of the output
            def same(i, a, b): return a.address == b.address + ranks[i] * a.nbytes and a.device == b.device
        else:
            def same(i, a, b): return a.address == b.address and a.device == b.device
        relation = validation.relation(inputs, outputs, same)
        return {validation.SAME: IN_PLACE, validation.DISJOINT: OUT_OF_PLACE}.get(relation, WORKSPACE)

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


# Calls a communicator recognises: enough for one allreduce per gradient of a model.
_CALLS_KEPT = 1024


class _Call:
    """A call that passed every check (Communicator._remember): its arrays'
    weak references, the function reading their state (arrays.repeat_state)
    and their states as they were; the plan; the arrays' descriptions; how
    outputs are made; and the plan bound to the arrays by ranks that can
    (VirtualHostRanks.bind): None until the first repeat, False where there
    is no bound form."""

    __slots__ = ("refs", "state_of", "states", "plan", "input_infos", "output_infos", "made", "bound")

    def __init__(self, refs, state_of, states, plan, input_infos, output_infos, made):
        self.refs, self.state_of, self.states, self.plan, self.made = refs, state_of, states, plan, made
        self.input_infos, self.output_infos = input_infos, output_infos
        self.bound = None


# "ours": our plans on our executors; "nccl": whole collectives handed to NCCL.
BACKENDS = ("ours", "nccl")


def resolve_backend(backend):
    """`backend`, checked against the backends there are."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise InvalidUsageError(f"unknown backend {backend!r}; expected one of {', '.join(map(repr, BACKENDS))}")
    return backend


_OPS = {**{o.value: o for o in ReduceOp}, **{o: o for o in ReduceOp}}


def _reduce_op(op):
    try:
        return _OPS[op]
    except (KeyError, TypeError):
        return as_reduce_op(op)  # other spellings, or the error that names the valid ones


def _same_array(rank, a, b):
    return a.address == b.address and a.device == b.device


def _receives(collective, rank, root):
    """Whether `rank`'s output is written by the collective."""
    if collective == BROADCAST:
        return rank != root
    if collective == REDUCE_TO_ROOT:
        return rank == root
    return True
