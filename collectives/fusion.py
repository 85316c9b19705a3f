"""Tensor fusion: many arrays, few collectives.

Data-parallel training allreduces hundreds of gradient arrays per step,
most of them small, where each call's fixed cost dominates. Fusion packs
arrays of one dtype into a fusion buffer, allreduces the buffer once and
unpacks it:

    arrays ──pack──> [ a | b | c | ... ]  ──allreduce──>  ──unpack──> arrays

* Grouping (`Packer`): arrays are taken in the caller's order; each dtype
  has one open buffer, which takes the next array of its dtype while the
  buffer stays within the threshold, and is closed (its allreduce can
  start) when the next one does not fit. An array larger than the pack
  limit is allreduced on its own, where it lies: on GPU ranks the limit is
  the threshold; on host ranks it is HOST_PACK_LIMIT, since there a call
  costs a few microseconds (repeated, in processes) to tens of them (ranks
  in one process), and copying an array in and out costs more than that
  from a few tens of KiB on (bench/fusion_perf.py measures it).
  `allreduce_many` and `FusionBuffer` group with the same Packer, so the
  same arrays give the same buffers and so the same bits.
* Layout: every array starts on a 16-byte boundary of its buffer; with
  compression, on a codec block (32 elements), so no block's scale is
  shared by two arrays, and the gaps are zeroed (a gap is part of a block).
* Pack and unpack: on devices, one batched-copy launch per device each
  (kernels/batched_copy.cu), whatever the number of arrays; on the host,
  a NumPy copy per array. A group of one array needs neither.
* avg divides inside the allreduce's last reduction (plan.py's
  REDUCE_FINAL), so fusion adds no pass of its own.
"""

import bisect
import concurrent.futures
import contextlib
import operator
from typing import NamedTuple, Tuple

import numpy as np

from . import arrays, validation
from .algorithms.schedule import ALLREDUCE
from .binding import WORKSPACE
from .compression import wire
from .errors import CollectiveTimeoutError, InvalidUsageError

ALIGN_BYTES = 16
DEFAULT_THRESHOLD = 64 << 20
HOST_PACK_LIMIT = 64 << 10


def pack_limit(comm):
    """The largest array a fusion buffer takes on `comm` (see the module doc)."""
    return HOST_PACK_LIMIT if comm._ranks.host_only else None


class Slot(NamedTuple):
    index: int     # position in the caller's list
    offset: int    # elements from the start of the buffer
    size: int      # elements


class Group(NamedTuple):
    """Arrays allreduced together: `count` elements of `dtype`."""
    dtype: np.dtype
    slots: Tuple[Slot, ...]
    count: int

    @property
    def packed(self):
        """Whether the group goes through a fusion buffer (more than one array)."""
        return len(self.slots) > 1


class Packer:
    """Groups arrays into fusion buffers, one array at a time (see module doc)."""

    def __init__(self, threshold, compression=None, pack_limit=None):
        self.threshold = threshold
        self.pack_limit = threshold if pack_limit is None else min(pack_limit, threshold)
        self.align = max(ALIGN_BYTES, 4 * wire.BLOCK) if compression is not None else ALIGN_BYTES
        self._open = {}   # dtype -> [slots, next free byte]

    def add(self, index, dtype, size):
        """Take array `index`; returns the groups this closes (in order)."""
        if size == 0:
            return []     # nothing to reduce
        nbytes = size * dtype.itemsize
        closed = []
        if nbytes > self.pack_limit:
            return [Group(dtype, (Slot(index, 0, size),), size)]
        entry = self._open.get(dtype)
        if entry is not None:
            start = -(-entry[1] // self.align) * self.align
            if start + nbytes > self.threshold:
                closed.append(self._close(dtype))
                entry = None
        if entry is None:
            entry = self._open[dtype] = [[], 0]
            start = 0
        entry[0].append(Slot(index, start // dtype.itemsize, size))
        entry[1] = start + nbytes
        if entry[1] >= self.threshold:   # full: nothing more can join it
            closed.append(self._close(dtype))
        return closed

    def close_all(self):
        return [self._close(dtype) for dtype in list(self._open)]

    def _close(self, dtype):
        slots, end = self._open.pop(dtype)
        return Group(dtype, tuple(slots), end // dtype.itemsize)


def gaps(group):
    """(offset, size) of the elements of a packed buffer no array covers."""
    found, end = [], 0
    for slot in group.slots:
        if slot.offset > end:
            found.append((end, slot.offset - end))
        end = slot.offset + slot.size
    return found


# -- checking a list of arrays --------------------------------------------------


def check_threshold(threshold, name):
    if isinstance(threshold, bool) or not isinstance(threshold, (int, np.integer)) or threshold < 1:
        raise InvalidUsageError(f"{name}: expected a positive number of bytes, got {threshold!r}")


def check_arrays(comm, arrays_, op, compression, threshold, algorithm="auto"):
    """Per local rank the arrays and their ArrayInfos, after every check
    (so a rejected call modifies nothing), in validation.py's order: the
    call's own arguments, each array, then arrays against each other."""
    check_threshold(threshold, "fusion_threshold")
    comm._check_arguments(ALLREDUCE, op, 0, algorithm, compression)
    nlocal = len(comm.local_ranks)
    if not isinstance(arrays_, (list, tuple)):
        raise InvalidUsageError(f"arrays: expected a list of arrays, got {type(arrays_).__name__}")
    flat = nlocal == 1 and not (arrays_ and isinstance(arrays_[0], (list, tuple)))   # not one list per rank
    if flat:
        per_rank = [list(arrays_)]
    else:
        if len(arrays_) != nlocal or not all(isinstance(a, (list, tuple)) for a in arrays_):
            raise InvalidUsageError(
                f"arrays: this communicator owns {nlocal} local ranks; pass one list of arrays per local rank")
        per_rank = [list(a) for a in arrays_]
    if len({len(a) for a in per_rank}) > 1:
        raise InvalidUsageError(f"arrays: every local rank must pass the same number of arrays, got "
                                f"{', '.join(str(len(a)) for a in per_rank)}")
    infos, names = [], []
    for position in range(len(per_rank[0])):
        # Named as the caller indexes it: arrays[position], or arrays[rank][position].
        name = f"arrays[{position}]" if flat else f"arrays[{{rank}}][{position}]"
        given = per_rank[0][position] if flat else [rank_arrays[position] for rank_arrays in per_rank]
        objects, position_infos, _ = validation.rank_arrays(given, nlocal, comm._ranks, name=name)
        validation.compressed_dtype(compression, position_infos[0].dtype)
        infos.append(position_infos)
        names.append(name)
    for name, position_infos in zip(names, infos):
        validation.same_dtype_and_shape(position_infos, name)
        validation.writable(position_infos, name)
    infos = [list(rank_infos) for rank_infos in zip(*infos)] if infos else [[] for _ in range(nlocal)]
    _no_overlap([info for rank_infos in infos for info in rank_infos], len(infos[0]))
    return per_rank, infos


def _no_overlap(infos, per_rank):
    """Results land in place: two arrays (of any local ranks) that share
    memory would be written twice. `infos` lists rank 0's, then rank 1's..."""
    def name(n):
        return f"arrays[{n}]" if len(infos) == per_rank else f"arrays[{n // per_rank}][{n % per_rank}]"

    spans = sorted((i.address, i.address + i.nbytes, i.device, n) for n, i in enumerate(infos) if i.nbytes)
    for (_, end, device, a), (start, _, other, b) in zip(spans, spans[1:]):
        if start < end and device == other:
            raise InvalidUsageError(f"arrays: {name(a)} and {name(b)} share memory; each array is reduced in place")


# -- running a group --------------------------------------------------------------


class Fuser:
    """Runs groups on one communicator: packs, allreduces, unpacks. Keeps
    the fusion buffers (per local rank and dtype) from call to call, and
    the batched-copy tables of the last allreduce_many, which a training
    loop repeats with the same arrays."""

    def __init__(self, comm):
        self.comm = comm
        self._buffers = {}    # (local rank, dtype) -> array
        self._views = {}      # (local rank, dtype, count) -> (buffer, its first count elements)
        self._zeros = None    # per device: a zeroed device buffer for the gaps
        self._tables = {}     # (call id, group index, pack) -> (buffer addresses, uploaded tables)
        self.last_call = None

    def run(self, group, per_rank, infos, op, compression, before_allreduce=None, algorithm="auto", table_key=None):
        comm = self.comm
        if not group.packed:
            (slot,) = group.slots
            targets = [rank_arrays[slot.index] for rank_arrays in per_rank]
            feedback = before_allreduce and before_allreduce(group, [t.reshape(-1) for t in targets])
            with feedback or contextlib.nullcontext():
                # (a process's one rank: the compiled loop takes it, Communicator._list_or_collective)
                comm.allreduce(targets, op=op, algorithm=algorithm, compression=compression)
            return
        first = group.slots[0].index
        buffers = [self._buffer(rank, group, per_rank[rank][first], infos[rank][first]) for rank in range(len(per_rank))]
        self._copy(group, per_rank, infos, buffers, True, compression is not None, table_key and (*table_key, True))
        # (error feedback: None, or a context the allreduce runs in, where the ranks keep the residual themselves)
        feedback = before_allreduce and before_allreduce(group, buffers)
        with feedback or contextlib.nullcontext():
            comm.allreduce(buffers, op=op, algorithm=algorithm, compression=compression)
        self._copy(group, per_rank, infos, buffers, False, False, table_key and (*table_key, False))

    def finished(self):
        """A fused call is done issuing: devices whose arrays the caller reads
        at once (emulated ones) complete it now, as any collective does."""
        for device in dict.fromkeys(getattr(self.comm._ranks, "devices", ())):
            device.call_returned()

    def _buffer(self, rank, group, like, info):
        """Local rank `rank`'s fusion buffer for `group`, on the device of `like`."""
        key = (rank, group.dtype)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.size < group.count:
            # Grows to the largest group seen; all groups share it, one at a time.
            buffer = arrays.empty_like(like, info, (max(group.count, 2 * (buffer.size if buffer is not None else 0)),))
            buffer[...] = 0   # alignment gaps are reduced too: zeros, not whatever was there
            self._buffers[key] = buffer
        # The same view as last time when it fits: its description is cached (arrays.describe).
        view_key = (rank, group.dtype, group.count)
        cached = self._views.get(view_key)
        if cached is None or cached[0] is not buffer:
            if len(self._views) >= 256:
                self._views.clear()
            cached = self._views[view_key] = (buffer, buffer[:group.count])
        return cached[1]

    def _copy(self, group, per_rank, infos, buffers, pack, zero_gaps, table_key):
        devices = getattr(self.comm._ranks, "rank_devices", None)
        if devices is not None and all(hasattr(d, "launch_copies") for d in devices):
            self._device_copy(devices, group, infos, buffers, pack, zero_gaps, table_key)
            return
        for rank, rank_arrays in enumerate(per_rank):
            buffer = buffers[rank]
            for slot in group.slots:
                array = rank_arrays[slot.index].reshape(-1)
                if pack:
                    buffer[slot.offset:slot.offset + slot.size] = array
                else:
                    array[...] = buffer[slot.offset:slot.offset + slot.size]
            if zero_gaps:
                for offset, size in gaps(group):
                    buffer[offset:offset + size] = 0

    def _device_copy(self, devices, group, infos, buffers, pack, zero_gaps, table_key):
        """One batched-copy launch per device, for all its ranks' arrays. The
        tables of a repeated allreduce_many (`table_key`) are uploaded once."""
        addresses = tuple(arrays.describe(b).address for b in buffers)
        cached = self._tables.get(table_key) if table_key is not None else None
        if cached is None or cached[0] != addresses:
            cached = (addresses, self._upload_copies(devices, group, infos, addresses, pack, zero_gaps))
            if table_key is not None:
                self._tables[table_key] = cached
        for device, table, rows, grid in cached[1]:
            device.launch_copies(device.current_stream(), table, rows, grid)

    def _upload_copies(self, devices, group, infos, addresses, pack, zero_gaps):
        """[(device, uploaded table, rows, grid)]: every copy of a pack or an unpack."""
        from . import kernels   # (the kernel sources' module: device ranks only, so not loaded at import)
        itemsize = group.dtype.itemsize
        rows_of = {}
        for rank, device in enumerate(devices):
            base = addresses[rank]
            rows = rows_of.setdefault(id(device), (device, []))[1]
            for slot in group.slots:
                user = infos[rank][slot.index].address
                fused = base + slot.offset * itemsize
                rows.append((user, fused, slot.size * itemsize) if pack else (fused, user, slot.size * itemsize))
            if zero_gaps:
                zeros = self._zero_source(device)
                rows.extend((zeros, base + offset * itemsize, size * itemsize) for offset, size in gaps(group))
        uploads = []
        for device, rows in rows_of.values():
            src, dst, nbytes = zip(*rows)
            table = kernels.copy_table(src, dst, nbytes)   # long copies split, so blocks share them out
            grid = kernels.copy_grid(int(table[:, kernels.COPY_NBYTES].max()), len(table), device.resident_blocks)
            uploads.append((device, device.upload(table), len(table), grid))
        return uploads

    def _zero_source(self, device):
        """A zeroed device buffer at least as long as any gap (a codec block)."""
        if self._zeros is None:
            self._zeros = {}
        memory = self._zeros.get(id(device))
        if memory is None:
            memory = self._zeros[id(device)] = device.upload(np.zeros(wire.BLOCK, np.float32))
        return memory.address


class FusedCall(NamedTuple):
    """A checked allreduce_many call, kept to recognise the next one."""
    key: tuple              # op, threshold, compression, algorithm
    flat: list              # every array, rank 0's first
    flat_infos: list
    per_rank: list
    infos: list
    groups: list
    numpy_state: object     # _numpy_state(flat), or None


def allreduce_many(comm, arrays_, op, fusion_threshold, compression, algorithm="auto"):
    """Communicator.allreduce_many: check everything, group, run the groups.
    A call with the arrays of the last one, unchanged (the same descriptions),
    skips the checks and the grouping, and reuses the copy tables."""
    fuser = comm._fuser()
    call = _recall(fuser.last_call, comm, arrays_, (op, fusion_threshold, compression, algorithm))
    if call is None:
        per_rank, infos = check_arrays(comm, arrays_, op, compression, fusion_threshold, algorithm)
        packer = Packer(fusion_threshold, compression, pack_limit(comm))
        groups = []
        for index, info in enumerate(infos[0] if infos else ()):
            groups += packer.add(index, info.dtype, info.size)
        groups += packer.close_all()
        flat = [a for rank in per_rank for a in rank]
        call = FusedCall((op, fusion_threshold, compression, algorithm), flat,
                         [i for rank in infos for i in rank], per_rank, infos, groups, _numpy_state(flat))
        for group in groups:   # every group's checks before the first writes anything
            comm._plan(ALLREDUCE, group.dtype, group.count, op, 0, algorithm,
                       WORKSPACE if compression is None else (WORKSPACE, True), compression)
        fuser.last_call = call
        fuser._tables.clear()
    for number, group in enumerate(call.groups):
        fuser.run(group, call.per_rank, call.infos, op, compression, algorithm=algorithm, table_key=(number,))
    fuser.finished()
    return arrays_


def _recall(call, comm, arrays_, key):
    """`call` if `arrays_` are its arrays, described as before, else None."""
    if call is None or call.key != key or not isinstance(arrays_, (list, tuple)):
        return None
    nested = len(comm.local_ranks) > 1 or (arrays_ and isinstance(arrays_[0], (list, tuple)))
    flat = [a for rank in arrays_ for a in rank] if nested else arrays_
    if len(flat) != len(call.flat):
        return None
    if not all(map(operator.is_, flat, call.flat)):
        return None
    if call.numpy_state is not None:
        # NumPy arrays we hold a reference to cannot move (resize refuses),
        # so what could have changed is this, read in C over the whole list.
        return call if _numpy_state(flat) == call.numpy_state else None
    describe = arrays.describe
    for a, info in zip(flat, call.flat_infos):
        now = describe(a)
        if now is not info and now != info:
            return None
    return call


_NUMPY_STATE = operator.attrgetter("shape", "strides", "dtype", "flags.writeable")


def _numpy_state(flat):
    """What describe() reads from NumPy arrays that can change in place, or
    None when not every array is a NumPy array."""
    if set(map(type, flat)) - {np.ndarray}:
        return None
    return list(map(_NUMPY_STATE, flat))


class FusionBuffer:
    """Gradients that become ready one by one (Communicator.fusion_buffer).

    `add` queues an array; once the arrays queued of its dtype fill a
    fusion buffer, its allreduce starts: on host ranks in the communicator's
    background thread, on GPU ranks on the caller's streams, while the
    caller goes on. `flush` starts what is left, `wait` returns when every
    result is in place, raising the first error of any started allreduce.
    Until `wait` returns, the arrays are the library's: do not touch them.
    The same arrays give the same bits as `allreduce_many`.

    With `error_feedback`, each rank keeps, per fusion buffer, what the
    codec lost when it encoded the rank's own contribution, and adds it to
    that buffer's next contribution (error-feedback SGD): the loss is not
    dropped, only delayed by a step. What is kept is exactly what was lost
    when the codec touches each contribution once and nothing else: the
    `direct` algorithm (every rank reads every peer's encoded contribution
    and sums in float32, an allgather of compressed gradients), which `auto`
    then means. Then the sum of the results over any number of steps
    differs from the sum of the gradients by at most the ranks' residuals:
    the error stays bounded. Algorithms that re-encode partial sums (ring,
    trees) lose more than the residual accounts for.
    """

    def __init__(self, comm, threshold, op, compression, error_feedback, algorithm="auto"):
        check_threshold(threshold, "threshold")
        validation.algorithm_name(algorithm, ALLREDUCE)
        validation.compression_codec(compression, validation.reduce_op(op))
        if error_feedback and compression is None:
            raise InvalidUsageError("error_feedback: True needs a compression codec; without one nothing is lost")
        if compression is not None and not getattr(comm._ranks, "compresses", False):
            raise InvalidUsageError(f"compression: not available on {type(comm._ranks).__name__} ranks")
        self.comm, self.threshold, self.op = comm, int(threshold), op
        # On one rank nothing is encoded, so nothing is lost and nothing is kept.
        self.compression, self.error_feedback = compression, bool(error_feedback) and comm.size > 1
        self.algorithm = "direct" if error_feedback and algorithm == "auto" else algorithm
        self._residuals = {}   # (group number in the step, dtype, slot sizes) -> per local rank float32 residual
        self._reset()

    def _reset(self):
        self._packer = Packer(self.threshold, self.compression, pack_limit(self.comm))
        self._arrays, self._infos = [], []   # per added array: per local rank
        self._started = []                   # futures, or None for work already issued on streams
        self._groups = 0
        self._spans = []                     # (start, stop, device) of the queued arrays, sorted

    def add(self, array):
        """Queue `array` (one per local rank, as a list, when there are several)."""
        comm = self.comm
        comm._check_open()
        objects, infos, _ = validation.rank_arrays(array, len(comm.local_ranks), comm._ranks, name="array")
        validation.compressed_dtype(self.compression, infos[0].dtype)
        validation.same_dtype_and_shape(infos, "array")
        validation.writable(infos, "array")
        self._claim(infos)
        index = len(self._arrays)
        self._arrays.append(objects)
        self._infos.append(infos)
        for group in self._packer.add(index, infos[0].dtype, infos[0].size):
            self._start(group)

    def _claim(self, infos):
        """Refuse an array that shares memory with one queued since the last
        wait (or with another rank's): it would be reduced twice."""
        spans = self._spans
        new = sorted((i.address, i.address + i.nbytes, i.device) for i in infos if i.nbytes)
        for start, stop, device in new:
            at = bisect.bisect_left(spans, (start,))
            neighbours = spans[max(at - 1, 0):at + 1]
            if any(s < stop and start < e and d == device for s, e, d in neighbours) or \
                    sum(1 for s, e, d in new if s < stop and start < e and d == device) > 1:
                raise InvalidUsageError("array: shares memory with an array already queued in this fusion "
                                        "buffer (or with another local rank's); each array is reduced in place")
        for span in new:
            bisect.insort(spans, span)

    def flush(self):
        """Start the allreduce of every array queued so far."""
        for group in self._packer.close_all():
            self._start(group)

    def wait(self):
        """Flush, then return once every result is in place; raises the first
        error of the started allreduces (a timeout or dead peer among them)."""
        try:
            self.flush()
            first_error = None
            for future in self._started:
                # Each fused allreduce ends within the timeout of its start
                # (it raises itself otherwise); the margin is for the thread.
                done, _ = concurrent.futures.wait([future], timeout=self.comm.timeout + 5.0)
                if not done:
                    error = CollectiveTimeoutError(
                        f"a fused allreduce did not finish within the timeout ({self.comm.timeout:g} s)")
                else:
                    error = future.exception()
                first_error = first_error or error
            if first_error is not None:
                raise first_error
        finally:
            self.comm._fusion_done(self, self._started)
            self._reset()

    def _start(self, group):
        per_rank = [[None] * len(self._arrays) for _ in range(len(self.comm.local_ranks))]
        infos = [[None] * len(self._arrays) for _ in range(len(self.comm.local_ranks))]
        for slot in group.slots:
            for rank in range(len(per_rank)):
                per_rank[rank][slot.index] = self._arrays[slot.index][rank]
                infos[rank][slot.index] = self._infos[slot.index][rank]
        number = self._groups
        self._groups += 1
        feedback = (lambda g, buffers: self._feed_back(number, g, buffers)) if self.error_feedback else None
        self._started.append(self.comm._fusion_submit(
            self, lambda fuser: fuser.run(group, per_rank, infos, self.op, self.compression, feedback, self.algorithm)))

    def _feed_back(self, number, group, buffers):
        """Add last step's residual to each rank's contribution; keep what
        encoding this one loses (what the codec's round trip changes).
        Across nodes (ranks that feed back partials, hierarchy.py) what is
        encoded is the node's partial on the range a rank holds: the ranks
        keep the residual there, and this returns the context to run the
        allreduce in."""
        key = (number, group.dtype, tuple(slot.size for slot in group.slots))
        if getattr(self.comm._ranks, "feeds_back_partials", False):
            (buffer,) = buffers   # (one rank per process)
            residual = self._residuals.get(key)
            if residual is None:
                residual = self._residuals[key] = [np.zeros(buffer.size, np.float32)]
            return self.comm._ranks.feeding_back(residual[0])
        if not self.comm._ranks.host_only:
            # The pack is queued on the device streams: let it land before the host
            # arithmetic below (CuPy's would be stream-ordered; an emulated device's NumPy is not).
            self.comm.synchronize()
        residuals = self._residuals.get(key)
        if residuals is None:
            residuals = self._residuals[key] = [np.zeros_like(buffer.reshape(-1)) for buffer in buffers]
        for buffer, residual in zip(buffers, residuals):
            values = buffer.reshape(-1)   # NumPy or CuPy: the arithmetic below works on both
            values += residual
            rounded = values.copy()
            wire.round_trip(self.compression, rounded)
            np.subtract(values, rounded, out=residual)
