"""A torch.distributed backend whose collectives run on this library.

    import torch.distributed as dist
    import collectives.torch                      # registers the backend "collectives"
    dist.init_process_group("collectives")        # under torchrun: no mpiexec, no mpi4py
    # or "cpu:collectives,cuda:collectives"; DDP, FSDP2 and dist.* run on it unchanged

Tested on CPU tensors (tests/test_torch_backend.py: 4 processes under
torchrun, mpi4py hidden). The CUDA tensor path below is written against
the library's GPU API but has not yet run on a GPU.

What torch.distributed calls a backend is, for a Python library in torch
2.13, a subclass of `torch.distributed.ProcessGroup` (the C++ `Backend`
class cannot be subclassed from Python), made by the creator registered
with `Backend.register_backend(name, creator, devices=[...])`. The creator
gets the group's store, a PrefixStore private to the group, its rank, size
and timeout. `ProcessGroupCollectives` is an adapter and owns no data path: each
op checks its tensors, turns them into what a Communicator takes
(tensors.py), calls it, and returns a finished Work (work.py).

- Rendezvous: the group's store is the ranks' meeting place
  (rendezvous.py): host ranks exchange their process ids and shared-memory
  names through it, GPU ranks their CUDA IPC handles. The host
  communicator is made with the group (every rank is in the creator
  together); the GPU one at the group's first call on CUDA tensors, which
  every rank makes at the same point of its program, as NCCL makes its
  communicators lazily.
- Across nodes, CPU tensors run on our hierarchical communicator: shared
  memory inside each node, Gloo between nodes (link.py). CUDA tensors
  across nodes run whole in NCCL, through the library's NCCL backend
  (executors/nccl.py, CuPy's binding: the cuda12/cuda13 extra), as
  init(backend="nccl") does today: our GPU ranks do not cross nodes yet.
  (A torch NCCL group cannot sit beside ours in one process group: torch
  2.13 makes a Python process group the whole group, for every device, so
  a device map such as "cpu:gloo,cuda:collectives" or
  "cpu:collectives,cuda:nccl" gives our group every device's tensors.)
- Timeouts: the group's timeout is the communicators' (torch's default for
  a group is 30 minutes, not the library's 300 s: pass timeout= to
  init_process_group or new_group). A rank that stalls makes the others'
  calls fail with CollectiveTimeoutError at the timeout; a rank that dies,
  with RankFailedError at once (the peers see its process gone). Both are
  raised by work.wait() (by dist.* itself for a blocking call) and, in
  DDP's backward, as a RuntimeError that names them. After such an error
  the group's communicator is aborted: make a new group, or on the
  default group call shrink_default_group() on every survivor (below).
- Execution: every call runs to completion in the caller's thread before it
  returns (host ranks), or is queued on the caller's current CUDA stream (GPU
  ranks), under one lock, so calls from several threads (DDP's autograd
  threads) are issued in one order. No background thread: on host ranks
  communication is CPU work on the cores that run the model
  (docs/training.md measured what overlap buys there: a few percent), and
  a hand-off to a thread would cost more than that on small calls.
- Ops: allreduce (SUM, AVG, PRODUCT, MIN, MAX, and PREMUL_SUM as a scaled
  copy summed), broadcast, reduce, allgather and reduce_scatter in their
  list and single-tensor forms (both spellings: 2.13's all_gather_single /
  reduce_scatter_single and the older _allgather_base /
  _reduce_scatter_base), their coalesced forms, gather, scatter,
  all_to_all (dist.all_to_all's lists and all_to_all_single, uneven splits
  too: Communicator.all_to_all_v, see all_to_all_single), barrier.
  Lists of tensors are packed into one buffer for one call. Across nodes
  (the hierarchical communicator) gather, scatter and all_to_all run as
  its exchanges: each block crosses once. send, recv (from a rank or any), isend and irecv on CPU tensors,
  through the Communicator's isend and irecv (host ranks in processes on
  one machine; transport/p2p.py): their Work is pending until wait(),
  which moves every pending message of the rank; GPU tensors and groups
  across nodes raise InvalidUsageError for them (not carried yet). BAND,
  BOR and BXOR raise InvalidUsageError.
  all_gather_object and broadcast_object_list run on allgather and
  broadcast (of bytes: collectives that only move data take any dtype,
  bool and complex included); reductions take the library's dtypes
  (collectives.SUPPORTED_DTYPES: no bool, no complex).
- Life cycle: destroy_process_group closes our communicators (shutdown);
  torch's abort ends them at once and tells the peers (abort).
- Errors: a tensor on another device, mismatched tensors, an op or dtype we
  do not offer: InvalidUsageError (or NotImplementedError) before anything
  is written, on every rank (every rank makes the same call). Errors of the
  call itself (a peer's different shapes, timeouts, dead peers) are in the
  returned Work: wait() raises them.
"""

import contextlib
import datetime
import math
import threading
import time

import torch
import torch.distributed as dist

from .. import bootstrap, start
from ..errors import CollectiveError, InvalidUsageError
from ..transport.protocol import description_hash
from .rendezvous import StoreRendezvous
from .tensors import byte_array, host_array, on_torch_stream, rank_array, reducible, word_array
from .work import PendingWork, Work

BACKEND = "collectives"

_REDUCE_OPS = {dist.ReduceOp.RedOpType.SUM: "sum", dist.ReduceOp.RedOpType.AVG: "avg",
               dist.ReduceOp.RedOpType.PRODUCT: "prod", dist.ReduceOp.RedOpType.MIN: "min",
               dist.ReduceOp.RedOpType.MAX: "max"}
_OFFERED = "SUM, AVG, PRODUCT, MIN, MAX and PREMUL_SUM"


def create_process_group(store, rank, size, timeout):
    """The creator torch.distributed calls (Backend.register_backend)."""
    return ProcessGroupCollectives(store, rank, size, timeout, adopted=_take_adopted(rank, size))


def create_process_group_extended(options, backend_options=None):
    """The creator of register_backend's extended API, which also says
    where a group of some ranks sits in the world (global_ranks_in_group:
    empty for the default group), for $COLLECTIVES_PRETEND_NODES."""
    world_ranks = list(options.global_ranks_in_group) or None
    return ProcessGroupCollectives(options.store, options.group_rank, options.group_size, options.timeout,
                                   world_ranks=world_ranks,
                                   adopted=_take_adopted(options.group_rank, options.group_size))


# -- going on after a failure ---------------------------------------------------------------------

# The communicator shrink_default_group made, for the creator that its own
# init_process_group calls next, on this thread, to take instead of a new one.
_adopting = threading.local()


def _take_adopted(rank, size):
    comm = getattr(_adopting, "comm", None)
    _adopting.comm = None
    if comm is not None and (comm.rank, comm.size) != (rank, size):
        raise InvalidUsageError(f"the shrunk communicator is rank {comm.rank} of {comm.size}; torch.distributed "
                                f"asked for rank {rank} of {size}")
    return comm


def shrink_default_group():
    """After a call on torch.distributed's default group (ours) raised
    RankFailedError or CollectiveTimeoutError (or RevokedError): every
    surviving rank calls this, and the default group becomes one of the
    ranks that are left, the same processes, renumbered densely in the old
    order (Communicator.shrink: the survivors agree on who is left through
    the old group's shared memory; no store round, no new process).
    dist.get_rank() and get_world_size() then answer for the new group.

    Returns the old ranks of the new group's ranks (new rank r was
    `old_ranks[r]`). Groups made from the old one (new_group, a
    DeviceMesh) are gone with it, and so is what holds the old group:
    wrap the model in DistributedDataParallel again. Host ranks (CPU
    tensors) in processes on one machine, as Communicator.shrink; raises
    InvalidUsageError elsewhere (a default group that is not ours, or one
    that ran CUDA tensors), RankExcludedError on a rank the others left out.
    """
    if not dist.is_initialized():
        raise InvalidUsageError("shrink_default_group: torch.distributed has no default group")
    group = dist.distributed_c10d._get_default_group()
    if not isinstance(group, ProcessGroupCollectives):
        raise InvalidUsageError(f"shrink_default_group: the default group is {group.name()}'s, not collectives'")
    if "cuda" in group._communicators:
        raise InvalidUsageError("shrink_default_group: a group that ran CUDA tensors cannot shrink yet (host "
                                "ranks only)")
    store = dist.distributed_c10d._get_default_store()   # (torch keeps it; no public way to it)
    shrunk = group.communicator("cpu").shrink()
    dist.destroy_process_group()
    _adopting.comm = shrunk
    try:
        dist.init_process_group(BACKEND, store=dist.PrefixStore(f"collectives-shrunk-{shrunk.epoch}", store),
                                rank=shrunk.rank, world_size=shrunk.size, timeout=_timedelta(group._timeout))
    finally:
        _adopting.comm = None
    return shrunk.old_ranks


def _timedelta(seconds):
    return None if seconds is None else datetime.timedelta(seconds=seconds)


class ProcessGroupCollectives(dist.ProcessGroup):
    """torch.distributed's view of our communicators: one for CPU tensors
    (host ranks), one for CUDA tensors (GPU ranks, made at the first CUDA call)."""

    def __init__(self, store, rank, size, timeout, world_ranks=None, adopted=None):
        super().__init__(rank, size)
        self._store = store
        # this rank's place in the job (a group of some ranks: its global ranks, in group order)
        self._world = (world_ranks[rank], dist.get_world_size()) if world_ranks and dist.is_initialized() else \
            (rank, size)
        self._timeout = timeout.total_seconds() if timeout is not None else None
        self._lock = threading.RLock()
        self._group_name = self._group_desc = ""
        # (adopted: the communicator shrink_default_group made, for the group it makes)
        self._communicators = {"cpu": adopted if adopted is not None else
                               start(self._rendezvous("cpu/"), "host", timeout=self._timeout)}

    def getBackendName(self):
        return BACKEND

    # torch.distributed names every group (_set_group_name, after the creator
    # returns); C++'s ProcessGroup keeps the name in its backends, which a
    # Python group has none of, so the name lives here. init_device_mesh,
    # DeviceMesh.from_group and FSDP2 read it.

    def _set_group_name(self, name):
        self._group_name = name

    @property
    def group_name(self):
        return self._group_name

    def _set_group_desc(self, desc):
        self._group_desc = desc

    @property
    def group_desc(self):
        return self._group_desc

    def name(self):
        return BACKEND

    def _get_backend_name(self):
        return BACKEND

    def __repr__(self):
        return f"<ProcessGroupCollectives rank={self.rank()} size={self.size()}>"

    def communicator(self, device="cpu"):
        """The Communicator that runs this group's calls on `device`'s
        tensors: "cpu", or a CUDA device (made at the first call, by every
        rank together). A communication hook may call it directly."""
        device = torch.device(device)
        if device.type == "cpu":
            comm = self._communicators.get("cpu")
            if comm is None:
                raise InvalidUsageError("this process group was shut down or aborted (destroy_process_group): "
                                        "make a new one")
            return comm
        if device.type != "cuda":
            raise InvalidUsageError(
                f"tensors on {device} are not supported: collectives' process group takes CPU tensors (host ranks) "
                "and CUDA tensors (GPU ranks)")
        with self._lock:
            if "cpu" not in self._communicators:
                self.communicator("cpu")   # raises: shut down
            if "cuda" not in self._communicators:
                self._communicators["cuda"] = self._gpu_communicator(device)
            return self._communicators["cuda"]

    def _gpu_communicator(self, device):
        """Our GPU ranks where every rank shares a node (CUDA IPC between
        them), else NCCL, which runs whole collectives across nodes."""
        rendezvous = self._rendezvous("cuda/")
        deadline = time.perf_counter() + (self._timeout or 300.0)
        nodes = len(bootstrap.topology(rendezvous, deadline).nodes)
        index = device.index if device.index is not None else torch.cuda.current_device()
        return start(rendezvous, f"cuda:{index}", backend="ours" if nodes == 1 else "nccl", timeout=self._timeout,
                     deadline=deadline)

    def _rendezvous(self, prefix):
        return StoreRendezvous(dist.PrefixStore(prefix, self._store), self.rank(), self.size(), *self._world)

    # -- the collectives -------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        tensor = _one(tensors, "allreduce")
        if tensor.layout == torch.sparse_coo:
            return self._sparse_allreduce(tensor, _opts(opts, dist.AllreduceOptions).reduceOp)
        op, factor = _reduce_op(_opts(opts, dist.AllreduceOptions).reduceOp, tensor, "allreduce")
        cpu = self._communicators.get("cpu")
        if factor is None and cpu is not None and tensor.device.type == "cpu" and tensor.is_contiguous():
            # DDP's and most callers' case, on the shortest path: the
            # general one below costs ~10 us more a call in Python
            with self._lock:
                try:
                    cpu.allreduce(host_array(tensor), op=op)
                except CollectiveError as error:
                    return Work(error=error)
            return Work(tensors)

        def run(comm):
            with _contiguous(tensor) as t:
                if factor is None:
                    comm.allreduce(rank_array(t), op=op)
                else:
                    comm.allreduce(rank_array(t * factor), op=op, out=rank_array(t))
        return self._run([tensor], "allreduce", run)

    def _sparse_allreduce(self, tensor, reduce_op):
        """A sparse COO tensor summed over the ranks, as Gloo sums them: each
        rank's coalesced indices and values go to every rank (one allgather
        of their counts, one of each part padded to the largest count), and
        every rank adds the same rows in rank order and coalesces them, so
        all get the same bits. The sum replaces `tensor`'s contents (its
        number of entries may grow). ReduceOp.SUM, CPU tensors."""
        if reduce_op != dist.ReduceOp.SUM:
            raise _not_offered(f"allreduce of a sparse tensor with {reduce_op}", "sparse tensors are summed "
                               "(ReduceOp.SUM), as Gloo sums them")
        if tensor.device.type != "cpu":
            raise _not_offered(f"allreduce of a sparse tensor on {tensor.device}", "sparse tensors on the CPU")

        def run(comm):
            mine = tensor.detach().coalesce()
            rows = [mine.indices().t().contiguous(), mine.values().contiguous()]   # one row per entry, each part
            # each rank's count of entries, with its tensor's kind: ranks whose tensors differ raise alike
            kind = description_hash(repr((tuple(mine.shape), mine.sparse_dim(), str(mine.dtype)))) >> 1
            told = comm.allgather(host_array(torch.tensor([rows[0].shape[0], kind], dtype=torch.int64)))
            counts, kinds = told[0::2].tolist(), set(told[1::2].tolist())
            if len(kinds) != 1:
                raise InvalidUsageError(f"allreduce: the ranks' sparse tensors differ in shape, sparse dimensions or "
                                        f"dtype (this rank, {self.rank()}: {tuple(mine.shape)}, "
                                        f"{mine.sparse_dim()} sparse, {mine.dtype})")
            most = max(counts)
            everyone = []
            for part in rows:
                padded = part.new_zeros((most, *part.shape[1:]))
                padded[:part.shape[0]] = part
                gathered = torch.from_numpy(comm.allgather(byte_array(padded))).view(part.dtype)
                gathered = gathered.reshape(len(counts), most, *part.shape[1:])
                everyone.append(torch.cat([gathered[r, :count] for r, count in enumerate(counts)]))
            indices, values = everyone
            tensor.copy_(torch.sparse_coo_tensor(indices.t(), values, mine.shape, check_invariants=True).coalesce())
        return self._run([tensor], "allreduce", run)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = _opts(opts, dist.AllreduceCoalescedOptions)
        for t in tensors:
            op, factor = _reduce_op(opts.reduceOp, t, "allreduce_coalesced")
        if not tensors or factor is not None:
            single = dist.AllreduceOptions()
            single.reduceOp = opts.reduceOp
            return self._each(tensors, lambda t: self.allreduce([t], single))

        def run(comm):
            with contextlib.ExitStack() as stack:
                flat = [stack.enter_context(_contiguous(t)) for t in tensors]
                comm.allreduce_many([rank_array(t) for t in flat], op=op)
        return self._run(tensors, "allreduce_coalesced", run)

    def broadcast(self, tensors, opts=None):
        tensor = _one(tensors, "broadcast")
        root = _root(_opts(opts, dist.BroadcastOptions).rootRank, self.size(), "broadcast")

        def run(comm):
            with _contiguous(tensor) as t:
                comm.broadcast(byte_array(t), root=root)
        return self._run([tensor], "broadcast", run)

    def reduce(self, tensors, opts=None):
        tensor = _one(tensors, "reduce")
        opts = _opts(opts, dist.ReduceOptions)
        root = _root(opts.rootRank, self.size(), "reduce")
        op, factor = _reduce_op(opts.reduceOp, tensor, "reduce")

        def run(comm):
            with _contiguous(tensor) as t:
                if factor is None:
                    comm.reduce(rank_array(t), root=root, op=op)
                    return
                scaled = t * factor
                comm.reduce(rank_array(scaled), root=root, op=op)
                if self.rank() == root:
                    t.copy_(scaled)
        return self._run([tensor], "reduce", run)

    def allgather(self, output_tensors, input_tensors, opts=None):
        tensor = _one(input_tensors, "allgather")
        outputs = _one(output_tensors, "allgather", "output_tensors")
        self._check_blocks(outputs, tensor, "allgather", "output_tensors")

        def run(comm):
            gathered = torch.empty((self.size(), *tensor.shape), dtype=tensor.dtype, device=tensor.device)
            comm.allgather(byte_array(tensor.contiguous()), out=byte_array(gathered))
            for out, block in zip(outputs, gathered):
                out.copy_(block)
        return self._run([tensor, *outputs], "allgather", run, outputs)

    def all_gather_single(self, output, input, opts=None):
        _check_sizes("all_gather_single", output, "output", input, "input", self.size())

        def run(comm):
            with _contiguous(output) as out:
                comm.allgather(byte_array(input.contiguous()), out=byte_array(out))
        return self._run([output, input], "all_gather_single", run, [output])

    _allgather_base = all_gather_single   # the spelling before torch 2.13

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """dist.all_gather_coalesced: output_lists[r][i] receives rank r's
        input_list[i] (one list per rank, as Gloo's), the items of any
        shapes. One allgather of the items' bytes packed end to end."""
        if len(output_lists) != self.size():
            raise InvalidUsageError(f"allgather_coalesced: output_lists must hold {self.size()} lists, one per rank, "
                                    f"got {len(output_lists)}")
        for outputs in output_lists:
            self._check_items(outputs, input_list, "allgather_coalesced", "output_lists")
        outputs = [t for ts in output_lists for t in ts]

        def run(comm):
            packed = _packed(input_list)
            gathered = torch.empty((self.size(), packed.numel()), dtype=torch.uint8, device=packed.device)
            comm.allgather(rank_array(packed), out=rank_array(gathered))
            for ts, row in zip(output_lists, gathered):
                _unpack(row, ts)
        return self._run([*input_list, *outputs], "allgather_coalesced", run, outputs)

    # The other coalesced forms run one call per item, after checking every
    # item (so that a bad one raises before any is written).

    def all_gather_single_coalesced(self, output_list, input_list, opts=None):
        pairs = _pairs(output_list, input_list, "all_gather_single_coalesced")
        for output, tensor in pairs:
            _check_sizes("all_gather_single_coalesced", output, "output", tensor, "input", self.size())
        return self._each(pairs, lambda pair: self.all_gather_single(*pair))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        output = _one(output_tensors, "reduce_scatter")
        inputs = _one(input_tensors, "reduce_scatter", "input_tensors")
        self._check_blocks(inputs, output, "reduce_scatter", "input_tensors")
        op, factor = _reduce_op(_opts(opts, dist.ReduceScatterOptions).reduceOp, output, "reduce_scatter")

        def run(comm):
            stacked = torch.stack(inputs)   # a copy, contiguous: rank r's block is inputs[r]
            if factor is not None:
                stacked.mul_(factor)
            with _contiguous(output) as out:
                comm.reduce_scatter(rank_array(stacked.reshape(-1)), op=op, out=rank_array(out.reshape(-1)))
        return self._run([output, *inputs], "reduce_scatter", run, [output])

    def reduce_scatter_single(self, output, input, opts=None):
        _check_sizes("reduce_scatter_single", input, "input", output, "output", self.size())
        op, factor = _reduce_op(_opts(opts, dist.ReduceScatterOptions).reduceOp, output, "reduce_scatter_single")

        def run(comm):
            x = input.reshape(-1) * factor if factor is not None else input.contiguous().reshape(-1)
            with _contiguous(output) as out:
                comm.reduce_scatter(rank_array(x), op=op, out=rank_array(out.reshape(-1)))
        return self._run([output, input], "reduce_scatter_single", run, [output])

    _reduce_scatter_base = reduce_scatter_single   # the spelling before torch 2.13

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        pairs = _pairs(outputs, inputs, "reduce_scatter_single_coalesced")
        for output, tensor in pairs:
            _check_sizes("reduce_scatter_single_coalesced", tensor, "input", output, "output", self.size())
            _reduce_op(_opts(opts, dist.ReduceScatterOptions).reduceOp, output, "reduce_scatter_single_coalesced")
        return self._each(pairs, lambda pair: self.reduce_scatter_single(*pair, opts))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # gather, scatter and all_to_all: equal blocks are the Communicator's
    # calls of the same names; uneven all_to_all is its all_to_all_v (see
    # all_to_all_single).

    def gather(self, output_tensors, input_tensors, opts=None):
        """dist.gather: the root's gather_list[r] receives rank r's tensor
        (torch passes a list only on the root; the others' are not read)."""
        tensor = _one(input_tensors, "gather", "input_tensors")
        root = _root(_opts(opts, dist.GatherOptions).rootRank, self.size(), "gather")
        outputs = _one(output_tensors, "gather", "output_tensors") if self.rank() == root else []
        if self.rank() == root:
            self._check_blocks(outputs, tensor, "gather", "output_tensors")

        def run(comm):
            x = tensor.contiguous()
            if self.rank() != root:
                comm.gather(byte_array(x), root=root)
                return
            gathered = torch.empty((self.size(), *x.shape), dtype=x.dtype, device=x.device)
            comm.gather(byte_array(x), root=root, out=byte_array(gathered))
            for out, block in zip(outputs, gathered):   # the root's
                out.copy_(block)
        return self._run([tensor, *outputs], "gather", run, outputs)

    def scatter(self, output_tensors, input_tensors, opts=None):
        """dist.scatter: rank r's tensor receives the root's scatter_list[r]
        (torch passes a list only on the root; the others' are not read)."""
        output = _one(output_tensors, "scatter", "output_tensors")
        root = _root(_opts(opts, dist.ScatterOptions).rootRank, self.size(), "scatter")
        inputs = _one(input_tensors, "scatter", "input_tensors") if self.rank() == root else []
        if self.rank() == root:
            self._check_blocks(inputs, output, "scatter", "input_tensors")

        def run(comm):
            # the Communicator takes size blocks on every rank and reads the root's only
            stacked = torch.stack(inputs) if inputs else \
                torch.empty((self.size(), *output.shape), dtype=output.dtype, device=output.device)
            with _contiguous(output) as out:
                comm.scatter(byte_array(stacked), root=root, out=byte_array(out))
        return self._run([output, *inputs], "scatter", run, [output])

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """dist.all_to_all_single: block q of `input` goes to rank q, and
        block q of `output` comes from rank q, blocks along dim 0.

        Without split sizes the blocks are equal: one Communicator.all_to_all
        (then no rank may pass split sizes, as with Gloo: a rank cannot see
        its peers'). With split sizes, even or not, one
        Communicator.all_to_all_v: the ranks allgather each rank's counts
        (2 x size + 2 integers a rank), which checks that every rank
        receives what its peers send (else every rank raises
        InvalidUsageError, nothing written), then each block crosses once,
        straight from `input` into `output`. With backend="nccl", where
        all_to_all_v does not run yet, the blocks are padded to the call's
        largest and exchanged by an all_to_all (`_padded`)."""
        _one_dtype("all_to_all_single", [output, input])
        if not output_split_sizes and not input_split_sizes:
            return self._even_all_to_all(output, input)
        sends = _splits(input, input_split_sizes, self.size(), "input_split_sizes")
        receives = _splits(output, output_split_sizes, self.size(), "output_split_sizes")

        def run(comm):
            with _contiguous(output) as out:
                if _runs_all_to_all_v(comm):
                    _all_to_all_v(comm, input.contiguous(), sends, out, receives, "all_to_all_single")
                    return
                packed = self._padded(comm, torch.split(input.detach().reshape(-1), sends), receives,
                                      "all_to_all_single")
                for block, got, n in zip(packed, torch.split(out.reshape(-1), receives), receives):
                    got.copy_(block[:n])
        return self._run([output, input], "all_to_all_single", run, [output])

    alltoall_base = all_to_all_single   # the spelling before torch 2.13

    def alltoall(self, output_tensors, input_tensors, opts=None):
        """dist.all_to_all: output_tensors[q] receives rank q's
        input_tensors[r] (r this rank), the tensors of any sizes: as
        all_to_all_single with split sizes (a rank cannot tell whether its
        peers' tensors are the size of its own), the lists packed into one
        tensor each way."""
        for name, tensors in (("output_tensors", output_tensors), ("input_tensors", input_tensors)):
            if len(tensors) != self.size():
                raise InvalidUsageError(f"all_to_all: {name} must hold {self.size()} tensors, one per rank; "
                                        f"got {len(tensors)}")
        _one_dtype("all_to_all", [*output_tensors, *input_tensors])
        receives = [t.numel() for t in output_tensors]

        def run(comm):
            blocks = [t.detach().reshape(-1) for t in input_tensors]
            if _runs_all_to_all_v(comm):
                like = output_tensors[0]
                received = torch.empty(sum(receives), dtype=like.dtype, device=like.device)
                _all_to_all_v(comm, torch.cat(blocks), [b.numel() for b in blocks], received, receives, "all_to_all")
                packed = torch.split(received, receives)
            else:
                packed = self._padded(comm, blocks, receives, "all_to_all")
            for block, out, n in zip(packed, output_tensors, receives):
                out.copy_(block[:n].view(out.shape))
        return self._run([*output_tensors, *input_tensors], "all_to_all", run, output_tensors)

    def _even_all_to_all(self, output, input):
        if output.numel() != input.numel() or input.numel() % self.size():
            raise InvalidUsageError(
                f"all_to_all_single: without split sizes, output ({output.numel()} elements) and input "
                f"({input.numel()}) must be the same size, a multiple of the group's {self.size()}")

        def run(comm):
            with _contiguous(output) as out:
                self._exchange(comm, input.contiguous(), out)
        return self._run([output, input], "all_to_all_single", run, [output])

    def _padded(self, comm, blocks, receives, what):
        """An uneven all_to_all's exchange on NCCL (see all_to_all_single): `blocks`
        (flat tensors, one per rank) sent, `receives[q]` elements expected
        from rank q. Returns the received blocks, padded: row q holds rank
        q's block first."""
        size, like = self.size(), blocks[0]
        mine = torch.tensor([b.numel() for b in blocks] + list(receives), dtype=torch.int64, device=like.device)
        counts = torch.empty((size, 2, size), dtype=torch.int64, device=like.device)
        comm.allgather(rank_array(mine), out=rank_array(counts.reshape(-1)))
        counts = counts.cpu()
        sent, expected = counts[:, 0], counts[:, 1].t()   # sent[q, r]: q to r; expected[q, r]: r from q
        wrong = (sent != expected).nonzero()
        if len(wrong):
            q, r = wrong[0].tolist()
            raise InvalidUsageError(
                f"{what}: rank {q} sends {sent[q, r]} elements to rank {r}, which expects {expected[q, r]}: every "
                "rank's split sizes must match its peers' (nothing was written)")
        largest = int(counts.max())
        packed = torch.empty((size, largest), dtype=like.dtype, device=like.device)   # the padding is never read
        for row, block in zip(packed, blocks):
            row[:block.numel()].copy_(block)
        received = torch.empty_like(packed)
        self._exchange(comm, packed, received)
        return received

    def _exchange(self, comm, x, out):
        """comm.all_to_all of `x` into `out` (contiguous, of size equal blocks)."""
        comm.all_to_all(byte_array(x), out=byte_array(out))

    def barrier(self, opts=None):
        def run(comm):
            gpu = self._communicators.get("cuda")
            if gpu is not None:   # as NCCL's barrier: after the GPU work issued so far
                gpu.synchronize()
            comm.barrier()
        return self._run([], "barrier", run)

    # -- what we do not offer: said, never a wrong result -----------------------------------------

    # -- point to point: the Communicator's isend and irecv (host ranks in processes) ---------------

    def send(self, tensors, dst, tag=0):
        """dist.send / isend: the Work is pending until the tensor's bytes
        are out of it (its wait() moves them, and every other pending
        message of this rank: an isend never blocks the caller)."""
        tensor = _one(tensors, "send")
        data = tensor.detach().contiguous()    # a copy where not contiguous, kept until the send is done
        return self._post("send", tensor, lambda comm: comm.isend(byte_array(data), dst, tag=tag), [tensor], data)

    def recv(self, tensors, src, tag=0):
        """dist.recv / irecv from rank `src` (its Work's wait() returns once
        the tensor holds the message)."""
        return self._receive(tensors, src, tag, "recv")

    def recv_anysource(self, tensors, tag=0):
        """dist.recv with no src: the message of any rank; the Work's
        _source_rank() names it once done."""
        return self._receive(tensors, None, tag, "recv_anysource")

    def _receive(self, tensors, src, tag, what):
        tensor = _one(tensors, what)
        into = tensor.detach() if tensor.is_contiguous() else torch.empty_like(tensor, memory_format=torch.contiguous_format)

        def finish():   # a non-contiguous tensor receives through a contiguous copy
            if into is not tensor:
                tensor.copy_(into)
        return self._post(what, tensor, lambda comm: comm.irecv(byte_array(into), src, tag=tag), [tensor], into,
                          finish)

    def _post(self, what, tensor, post, result, keep, finish=None):
        """A p2p call posted under the group's lock, as a PendingWork (or a
        failed Work: a bad argument, a point-to-point the ranks do not carry)."""
        comm = self.communicator(_device_of([tensor], what))
        with self._lock:
            try:
                request = post(comm)
            except CollectiveError as error:
                return Work(error=error)
        return PendingWork(request, self._lock, result, keep, finish)

    def monitored_barrier(self, *args, **kwargs):
        raise _not_offered("monitored_barrier")

    # -- life cycle -------------------------------------------------------------------------------

    def set_timeout(self, timeout):
        """The group's timeout, and so our communicators' (for the calls made after)."""
        self._timeout = timeout.total_seconds()
        for comm in self._communicators.values():
            comm.timeout = self._timeout

    def shutdown(self):
        """destroy_process_group's call: close our communicators (collective:
        every rank destroys the group; a dead peer does not make it hang)."""
        with self._lock:
            communicators, self._communicators = self._communicators, {}
        for comm in communicators.values():
            comm.close()

    def abort(self):
        """torch.distributed's abort (_abort_process_group): end our
        communicators at once, telling the peers (they raise instead of
        waiting out their timeout). Not under the call lock: a call of
        another thread may be stuck."""
        communicators, self._communicators = self._communicators, {}
        reason = CollectiveError(f"rank {self.rank()} aborted the torch.distributed process group")
        for comm in communicators.values():
            comm.__exit__(type(reason), reason, None)

    # -- the one path of every call ---------------------------------------------------------------

    def _run(self, tensors, what, run, result=None):
        """`run(communicator)` for `tensors` (all on one device; none: the
        host communicator's), as a finished Work holding `result` (default:
        `tensors`), or the call's error."""
        device = _device_of(tensors, what)
        comm = self.communicator(device)
        stream = on_torch_stream(torch.cuda.current_stream(device)) if device.type == "cuda" else \
            contextlib.nullcontext()
        with self._lock, stream:
            try:
                run(comm)
            except CollectiveError as error:
                return Work(error=error)
        return Work(tensors if result is None else result)

    def _each(self, items, call):
        """Coalesced forms: one call per item, in order; one Work, failed at the first failure."""
        results = []
        for item in items:
            work = call(item)
            if not work.is_success():
                return work
            results += work.result()
        return Work(results)

    def _check_items(self, tensors, like, what, name):
        if len(tensors) != len(like) or any(t.shape != u.shape or t.dtype != u.dtype for t, u in zip(tensors, like)):
            raise InvalidUsageError(
                f"{what}: each list of {name} must match the inputs, {[(tuple(u.shape), u.dtype) for u in like][:4]}; "
                f"got {[(tuple(t.shape), t.dtype) for t in tensors][:4]}")

    def _check_blocks(self, blocks, like, what, name):
        if len(blocks) != self.size() or any(b.shape != like.shape or b.dtype != like.dtype for b in blocks):
            raise InvalidUsageError(
                f"{what}: {name} must hold {self.size()} tensors of shape {tuple(like.shape)} and dtype {like.dtype}, "
                f"one per rank; got {len(blocks)}: {[(tuple(b.shape), b.dtype) for b in blocks][:4]}")


def _opts(opts, kind):
    return kind() if opts is None else opts


def _one(tensors, what, name="tensors"):
    """The one item of `tensors`: one device per process, as torch 2.x has it."""
    if len(tensors) != 1:
        raise InvalidUsageError(f"{what}: {name} must hold one item (one device per process), got {len(tensors)}")
    return tensors[0]


def _pairs(outputs, inputs, what):
    if len(outputs) != len(inputs):
        raise InvalidUsageError(f"{what}: {len(outputs)} outputs for {len(inputs)} inputs; they must pair up")
    return list(zip(outputs, inputs))


def _root(root, size, what):
    if not 0 <= root < size:
        raise InvalidUsageError(f"{what}: root {root} is not a rank of this group of {size}")
    return root


def _check_sizes(what, whole, whole_name, block, block_name, size):
    if whole.numel() != size * block.numel() or whole.dtype != block.dtype:
        raise InvalidUsageError(
            f"{what}: {whole_name} has {whole.numel()} elements of {whole.dtype}, {block_name} {block.numel()} of "
            f"{block.dtype}: the {whole_name} needs {size} x the {block_name}'s elements, of its dtype")


def _one_dtype(what, tensors):
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise InvalidUsageError(f"{what}: tensors of several dtypes ({', '.join(sorted(map(str, dtypes)))}); "
                                "a call's tensors must share one")


def _splits(tensor, sizes, size, name):
    """The elements of each rank's block of `tensor`, blocks along dim 0 of
    `sizes` rows each (equal blocks where `sizes` is empty)."""
    rows, *rest = tensor.shape or (1,)
    if not sizes:
        if rows % size:
            raise InvalidUsageError(f"all_to_all_single: {name} is empty, so the tensor's dim 0 ({rows}) must split "
                                    f"into {size} equal blocks, one per rank")
        sizes = [rows // size] * size
    if len(sizes) != size or any(s < 0 for s in sizes) or sum(sizes) != rows:
        raise InvalidUsageError(f"all_to_all_single: {name} must hold {size} sizes, one per rank, >= 0, summing to "
                                f"the tensor's dim 0 ({rows}); got {list(sizes)}")
    return [s * math.prod(rest) for s in sizes]


def _all_to_all_v(comm, x, sends, out, receives, what):
    """comm.all_to_all_v of `x` (contiguous) into `out` (contiguous), the
    counts in elements of their dtype; a mismatch of the ranks' split sizes
    is said in them, on every rank."""
    array, words = word_array(x)
    try:
        comm.all_to_all_v(array, [n * words for n in sends], out=word_array(out)[0],
                          recv_counts=[n * words for n in receives])
    except InvalidUsageError as error:
        unit = "" if words == 1 else f" (in units of {words} per element)"
        raise InvalidUsageError(f"{what}: the split sizes of the ranks do not match{unit}: {error}") from None


def _runs_all_to_all_v(comm):
    """Whether `comm` runs all_to_all_v: ours do (one node or several); NCCL's does not yet."""
    return comm.chosen_algorithm("allreduce", 1).path != "nccl"


def _device_of(tensors, what):
    """The one device of the call's tensors (the CPU for a call with none)."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise InvalidUsageError(f"{what}: tensors on several devices ({', '.join(sorted(map(str, devices)))}); "
                                "a call's tensors must share one")
    return devices.pop() if devices else torch.device("cpu")


def _reduce_op(op, tensor, what):
    """(our op's name, the PREMUL_SUM factor or None) for a ReduceOp, after
    checking that `tensor`'s dtype can be reduced with it."""
    kind = op.op if isinstance(op, dist.ReduceOp) else op
    name = _REDUCE_OPS.get(kind)
    if name is not None:
        why = reducible(tensor.dtype, name)
        if why:
            raise InvalidUsageError(f"{what}: {why}")
        return name, None
    if kind == dist.ReduceOp.RedOpType.PREMUL_SUM:
        factor = op.factor
        name, factor = "sum", factor.item() if isinstance(factor, torch.Tensor) else float(factor)
    elif kind in _REDUCE_OPS:
        name, factor = _REDUCE_OPS[kind], None
    else:
        raise InvalidUsageError(f"{what}: ReduceOp.{getattr(kind, 'name', kind)} is not offered by collectives "
                                f"(it reduces with {_OFFERED})")
    why = reducible(tensor.dtype, name)
    if why:
        raise InvalidUsageError(f"{what}: {why}")
    return name, factor


def _not_offered(what, why=None):
    return NotImplementedError(
        f"{what} is not offered by collectives' process group{': ' + why if why else ''}. It offers allreduce "
        "(sparse tensors too: SUM, on the CPU), "
        "broadcast, reduce, allgather, reduce_scatter (list, single-tensor and coalesced forms), gather, scatter, "
        "all_to_all (list and single-tensor forms, uneven splits too), send, recv and barrier")


def _packed(tensors):
    """The bytes of `tensors`, end to end, in one new tensor."""
    if not tensors:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat([_bytes(t.contiguous()) for t in tensors])


def _unpack(packed, tensors):
    """Copy `packed` (bytes, as _packed made them) into `tensors`."""
    start = 0
    for t in tensors:
        with _contiguous(t) as flat:
            view = _bytes(flat)
            view.copy_(packed[start:start + view.numel()])
            start += view.numel()


def _bytes(tensor):
    """A contiguous tensor's bytes, a uint8 view."""
    return tensor.detach().reshape(-1).view(torch.uint8)


@contextlib.contextmanager
def _contiguous(tensor):
    """`tensor`, or a contiguous copy of it that is copied back when the
    call succeeds (the collectives take contiguous memory)."""
    if tensor.is_contiguous():
        yield tensor
        return
    copy = tensor.contiguous()
    yield copy
    tensor.copy_(copy)
