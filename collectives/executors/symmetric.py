"""Collectives on symmetric memory between GPU ranks in separate processes:
each rank's kernel reads its peers' inputs and writes their outputs where
they lie, with no copy into or out of a workspace and no host in the loop
(NCCL's registered buffers, PyTorch's symmetric memory).

Symmetric memory is what Communicator.alloc(shape, dtype) returns: every
rank allocates the same bytes of IPC-shareable device memory, the ranks
exchange the handles by an allgather, and each maps every peer's. So an
array at offset o of allocation k on one rank has a twin at offset o of
allocation k on every rank, and a rank knows its address on each peer.

A call runs here when the arrays its peers touch (every input but
allgather's, every output but reduce_scatter's) lie in symmetric memory and
its plan's bits are the `direct` plan's (same_bits_as_direct), with no
compression. It is three launches on the caller's stream:

    ll_barrier  enter: every peer has reached the call (kernels/ll_allreduce.cu)
    plan_step   this rank's share (symmetric_rows.py), on the peers' memory
    ll_barrier  leave: every peer is done with this rank's arrays

Rank r's share of a call, one pass of plan_step over every rank's arrays,
is in executors/symmetric_rows.py: each rank reads about the message and
writes about the message, each input once and each output once for ranks
sharing one GPU (the memory floor), folding in rank order (the `direct`
plan's bits).

Calls on plain arrays that the LL path does not take (larger than 64 KiB)
and whose plans have the `direct` plan's bits run here too, through each
rank's staging buffer, symmetric memory of the communicator's own: a copy of
the input into it, the same three launches in place on the staging buffers,
a copy of the result out (run_staged): five launches, no host wait, the
copies NCCL's eager path makes. The staging buffers grow at the same calls
on every rank (every rank makes the same calls), a power of two at least
STAGING_MIN_BYTES, which is the only time these calls wait on the host.

The barriers' signature (32 bits of a hash of the collective, counts, dtype,
op, root and where input and output lie in symmetric memory) makes a rank
whose call differs (another allocation or offset included) a mismatch that
every rank raises as InvalidUsageError; so does a rank that passes arrays
outside symmetric memory while its peers pass symmetric ones (its call goes
through staging, whose place differs). Timeouts, a dead peer, graphs and
stream order are the LL path's
(executors/ll_allreduce.py), whose area holds the barrier word.
"""

import hashlib
from typing import NamedTuple, Optional, Tuple

import numpy as np

from .. import kernels
from ..algorithms.schedule import ALLGATHER, BROADCAST, REDUCE_SCATTER, REDUCING_COLLECTIVES
from ..binding import COPY_OP, INPUT, OUTPUT, REDUCE_FINAL_OP
from ..errors import InvalidUsageError
from ..ops import ReduceOp
from ..plan import SCRATCH, WORK
from ..transport.protocol import describe_call
from .device import fan_out, grid_for
from .ll_allreduce import ACCEPTED, same_bits_as_direct
from .symmetric_rows import PEERS_READ_INPUT, PEERS_WRITE_OUTPUT, share_rows, staged_copies

# The barrier's fault word names the collective as LL_COLLECTIVES's index
# plus this (kernels.ll_fault decodes it), so that an error says which path.
SYMMETRIC_FAULT_CODE = 16
HANDLE_PAYLOAD = 8 + 64   # what a rank shares of an allocation: its byte count, its handle
STAGING_MIN_BYTES = 1 << 20   # a staging buffer's least size: growth, which waits on the host, stays rare

class Allocation(NamedTuple):
    index: int                     # the communicator's k-th symmetric allocation, the same on every rank
    own: object                    # this rank's memory (device.allocate_shared)
    nbytes: int
    addresses: Tuple[int, ...]     # every rank's memory, as mapped in this process


class Place(NamedTuple):
    allocation: Allocation
    offset: int                    # bytes from its start


class _Arrays(NamedTuple):
    """Where a call's arrays lie: in symmetric memory where peers reach them."""
    source: Optional[Place]        # the input, where peers read it (None: allgather's, read by its rank only)
    result: Optional[Place]        # the output, where peers write it (None: reduce_scatter's)
    input_address: int
    output_address: int

    @property
    def key(self):
        """What a prepared call depends on (Places hold their allocation's tuple)."""
        where = [(place.allocation.index, place.offset) if place else None for place in (self.source, self.result)]
        return (*where, self.input_address if self.source is None else 0,
                self.output_address if self.result is None else 0)


class _Rows(NamedTuple):
    """Step-kernel rows in device memory."""
    table: object
    width: int
    grid: tuple
    words: int                     # int64 words of the table (what a barrier zeroes)


class _StagedCall(NamedTuple):
    """A plan's call on plain arrays through staging (run_staged)."""
    call: object                   # the _SymmetricCall in place on the staging buffers
    staging: Allocation            # the staging buffer it was made for
    copy_instance: kernels.StepInstance
    copy_in: Optional[_Rows]       # a COPY row: WORK (the caller's input) to INPUT (the staging buffer), or None
    copy_out: Optional[_Rows]      # OUTPUT (the staging buffer) to SCRATCH (the caller's output), or None
    tables: dict                   # (input, output address) -> BufferTable, a few

    def buffers(self, input_address, output_address):
        """The BufferTable of all three step launches (passed by value): the
        share's, every rank's INPUT and OUTPUT on the staging buffers, with
        this rank's WORK the caller's input and SCRATCH its output, which
        the copies' rows name. One table for the three: a launch that
        passes the table of the one before costs the host no copy of it."""
        key = (input_address, output_address)
        table = self.tables.get(key)
        if table is None:
            if len(self.tables) >= 8:
                self.tables.clear()
            table = np.array(self.call.addresses)
            rank = self.call.rank
            table[kernels.BUFFERS * rank + WORK] = input_address
            table[kernels.BUFFERS * rank + SCRATCH] = output_address
            table.setflags(write=False)
            self.tables[key] = table
        return table


class _SymmetricCall(NamedTuple):
    plan: object
    rank: int
    instance: kernels.StepInstance
    divisor: int
    table: object                  # rank r's rows, in device memory; None: no rows (an empty share)
    table_words: int               # the table's int64 words (rows x width)
    width: int
    grid: tuple
    fanout: int
    addresses: np.ndarray          # the BufferTable: every rank's INPUT and OUTPUT
    signature: int
    description: str


def signature(plan, arrays):
    """32 bits of the call and where its arrays lie in symmetric memory
    (the same on every rank, or the call differs): the barrier word's high half."""
    where = arrays.key[:2]
    text = f"{describe_call(plan)} {plan.count} {plan.root} {where}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=4).digest(), "little")


class SymmetricCalls:
    """This rank's symmetric memory and the calls on it, for a DeviceProcessRank
    whose one-kernel path (`ll`, an LLAllreduce) is on."""

    def __init__(self, rank, size, prefix, device, ll):
        self.rank, self.size, self.prefix = rank, size, prefix
        self.device, self.ll = device, ll
        self.allocations = []
        self._calls = {}               # (id(plan), places) -> _SymmetricCall
        self._args = None              # the barriers' kernels.LLAllreduceArgs, made at the first call
        self._staging = None           # the current staging buffer (an Allocation), for calls on plain arrays
        self._old_staging = []         # the ones it replaced: released at close
        self._staged = {}              # id(plan) -> _StagedCall
        self._kept = []                # every table uploaded: a graph may launch it until close
        self._routes = {}              # (id(plan), input address, output address) -> (plan, _SymmetricCall, staged)

    # -- memory ---------------------------------------------------------------

    def allocate(self, shape, dtype, exchange):
        """Communicator.alloc on this rank: an array of `shape` and `dtype`
        in new symmetric memory. `exchange(payload)` is the communicator's
        allgather of a small uint8 array on this rank's device. Every rank
        must ask for the same bytes: else every rank raises InvalidUsageError."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        device = self.device
        if device.is_capturing(device.current_stream()):   # the handles' allgather would be captured, not run
            raise InvalidUsageError("alloc: cannot allocate while a graph is being captured; allocate before")
        index = len(self.allocations)
        own = device.allocate_shared(max(nbytes, 1), f"{self.prefix}-r{self.rank}-sym{index}")
        payload = np.zeros(HANDLE_PAYLOAD, np.uint8)
        payload[:8] = np.frombuffer(np.int64(nbytes).tobytes(), np.uint8)
        payload[8:8 + len(own.handle)] = np.frombuffer(own.handle, np.uint8)
        try:
            shared = device.to_host(exchange(device.from_host(payload))).reshape(self.size, HANDLE_PAYLOAD)
            sizes = [int(np.frombuffer(shared[q, :8].tobytes(), np.int64)[0]) for q in range(self.size)]
            if len(set(sizes)) != 1:
                raise InvalidUsageError(
                    f"alloc: every rank must allocate the same bytes (symmetric memory), but ranks asked for "
                    f"{sizes}: rank {self.rank} asked for shape {tuple(shape)} of {dtype}")
        except BaseException:
            device.release_shared(own, own=True)
            raise
        addresses = []
        try:
            for q in range(self.size):
                if q == self.rank:
                    addresses.append(own.address)
                    continue
                opened = device.open_shared(bytes(shared[q, 8:]))
                self.ll.hold_peer_memory(opened)   # unmapped at close, with the LL areas
                addresses.append(opened.address)
        except BaseException as error:
            # The peers have this allocation and this rank has not: their
            # symmetric memory would no longer match. Abort for every rank.
            self.ll.group.abort(f"{type(error).__name__}: alloc on rank {self.rank}: {error}", error)
            device.release_shared(own, own=True)
            raise
        self.allocations.append(Allocation(index, own, nbytes, tuple(addresses)))
        self._routes.clear()   # a plain array's address may lie in it now (runs)
        return device.wrap_shared(own, tuple(shape), dtype)

    def place(self, info):
        """The Place of an array (ArrayInfo) wholly inside this rank's
        symmetric memory, else None."""
        for allocation in self.allocations:
            offset = info.address - allocation.own.address
            if 0 <= offset and offset + info.nbytes <= allocation.nbytes:
                return Place(allocation, offset)
        return None

    def release(self):
        """At close, after every rank's kernels are done (a barrier): our own
        memory goes once the caller's arrays in it are gone too."""
        staging = self._old_staging + ([self._staging] if self._staging is not None else [])
        for allocation in self.allocations + staging:
            self.device.release_shared(allocation.own, own=True)
        self.allocations, self._old_staging, self._staging = [], [], None
        self._calls.clear()
        self._staged.clear()
        self._routes.clear()
        self._kept.clear()

    # -- a call ---------------------------------------------------------------

    def accepts(self, plan, input_info, output_info):
        """The call's _Arrays when it runs here, else None: the arrays that
        peers read (every input but allgather's) or write (every output but
        reduce_scatter's) lie in symmetric memory."""
        if not self.allocations or plan.compression is not None or plan.collective not in ACCEPTED \
                or not same_bits_as_direct(plan) or plan.nranks > kernels.MAX_RANKS:
            return None
        source = self.place(input_info) if plan.collective in PEERS_READ_INPUT else None
        result = self.place(output_info) if plan.collective in PEERS_WRITE_OUTPUT else None
        if (source is None) == (plan.collective in PEERS_READ_INPUT) or \
                (result is None) == (plan.collective in PEERS_WRITE_OUTPUT):
            return None
        if not self._apart_or_aligned(plan, input_info, output_info):
            return None
        return _Arrays(source, result, input_info.address, output_info.address)

    def _apart_or_aligned(self, plan, input_info, output_info):
        """Whether the output is the input, lies apart from it, or is the
        relation the collective defines (reduce_scatter's output: block r of
        its input; allgather's input: block r of its output). An output that
        overlaps its input otherwise would race in the one pass; such a call
        goes through staging, which copies the input whole first. (For
        allreduce, reduce and broadcast both arrays lie at the same places on
        every rank, so every rank decides alike; an allgather's input or a
        reduce_scatter's output overlapping that way on some ranks only
        sends them through staging while their peers are not: every rank
        raises InvalidUsageError, a different call.)"""
        a, b = input_info.address, output_info.address
        if a == b or a + input_info.nbytes <= b or b + output_info.nbytes <= a:
            return True
        if plan.collective == REDUCE_SCATTER:
            return b == a + self.rank * output_info.nbytes
        if plan.collective == ALLGATHER:
            return a == b + self.rank * input_info.nbytes
        return False

    def runs(self, plan, input_info, output_info, deadline):
        """Run the call here if it runs here (on the caller's arrays in
        symmetric memory, or through staging), and say whether it did. The
        route of a (plan, input, output) is remembered until the next
        allocation, which every rank makes at the same point: a plain
        array's memory may then lie in symmetric memory, and every rank must
        route a call alike."""
        key = (id(plan), input_info.address, output_info.address)
        route = self._routes.get(key)
        if route is None or route[0] is not plan:
            arrays = self.accepts(plan, input_info, output_info) if self.allocations else None
            call = self._call(plan, arrays) if arrays is not None else None
            route = (plan, call, call is None and self.stages(plan))
            if len(self._routes) >= 256:
                self._routes.clear()
            self._routes[key] = route
        if route[1] is not None:
            self._run_call(plan, route[1], deadline)
            return True
        if route[2]:
            self.run_staged(plan, input_info, output_info, deadline)
            return True
        return False

    def _run_call(self, plan, call, deadline):
        """A call on symmetric memory: barrier, this rank's share, barrier."""
        if plan.count == 0:
            return
        stream = self._begin(plan, call.description, deadline)
        self._launch(plan, call, stream, deadline)
        self._end()

    def _call(self, plan, arrays):
        key = (id(plan), *arrays.key)
        call = self._calls.get(key)
        if call is None or call.plan is not plan:
            call = self._prepare(plan, arrays, key)
        return call

    def _begin(self, plan, description, deadline):
        """Checks and ordering before a call's launches; its stream."""
        device, ll = self.device, self.ll
        ll.check()   # a kernel of an earlier call gave up: this call must not launch
        stream = device.current_stream()
        capturing = device.is_capturing(stream)
        ll.ensure_setup(deadline, capturing, plan.collective)
        if not capturing:
            ll.order_on(stream)
            ll.describe_call(description)
        else:
            ll.one_capture_stream(stream)
        return stream

    def _launch(self, plan, call, stream, deadline, after=None, buffers=None):
        """Barrier, share, barrier. A barrier that gives up zeroes a table
        (ll_barrier), whose rows then move nothing: the enter barrier the
        share's, the leave barrier `after`'s (_Rows launched next, or None)."""
        device, ll = self.device, self.ll
        args = self._barrier_args()
        args.signature = call.signature
        args.collective = SYMMETRIC_FAULT_CODE + kernels.LL_COLLECTIVES.index(plan.collective)
        args.timeout_ns = ll.set_timeout(deadline)
        args.output, args.count = (call.table.address, call.table_words) if call.table is not None else (0, 0)
        device.launch_ll_barrier(stream, args)   # (the launch copies the arguments)
        if call.table is not None:
            device.launch_step(stream, call.instance, call.grid, call.table, call.width,
                               call.addresses if buffers is None else buffers, call.divisor, call.fanout)
        args.output, args.count = (after.table.address, after.words) if after is not None else (0, 0)
        device.launch_ll_barrier(stream, args)

    def _end(self):
        self.device.call_returned()   # the emulated device runs the launches now; a GPU keeps them queued
        self.ll.check()

    # -- calls on plain arrays, through staging -------------------------------------

    def stages(self, plan):
        """Whether a call on plain arrays runs here, through this rank's
        staging buffer (run_staged): a plan with the `direct` plan's bits,
        uncompressed; the LL path takes the small ones first."""
        return plan.compression is None and plan.collective in ACCEPTED and same_bits_as_direct(plan) \
            and plan.nranks <= kernels.MAX_RANKS

    def run_staged(self, plan, input_info, output_info, deadline):
        """A call on plain arrays as five launches, no host wait: a copy of
        the input into this rank's staging buffer (symmetric memory of the
        communicator's own), the call in place on the staging buffers
        (barrier, share, barrier) and a copy of the result out. The copy in
        may overwrite the staging buffer at once: every peer finished with
        it in this rank's previous call, whose leave barrier came before on
        the stream. The output may overlap the input in any way: the input
        is copied whole before anything is written. The copies are step
        kernel COPY rows made once per plan, the caller's addresses passed
        by value (a new array costs no upload). A leave barrier that gives
        up zeroes the copy out's table, as an enter barrier does the share's:
        a failed call writes no output."""
        if plan.count == 0:
            return
        staged = self._staged_call(plan, deadline)
        buffers = staged.buffers(input_info.address, output_info.address)
        stream = self._begin(plan, staged.call.description, deadline)
        device = self.device
        if staged.copy_in is not None:
            device.launch_step(stream, staged.copy_instance, staged.copy_in.grid, staged.copy_in.table,
                               staged.copy_in.width, buffers, 0)
        self._launch(plan, staged.call, stream, deadline, staged.copy_out, buffers)
        if staged.copy_out is not None:
            device.launch_step(stream, staged.copy_instance, staged.copy_out.grid, staged.copy_out.table,
                               staged.copy_out.width, buffers, 0)
        self._end()

    def staged_launches(self, plan):
        """Launches of a staged call of `plan` on this rank (bench.plan_report, spmd_overhead)."""
        if plan.count == 0:
            return 0
        copy_in, copy_out = self._staged_copies(plan)
        return 3 + (copy_in is not None) + (copy_out is not None)

    def _staged_copies(self, plan):
        return staged_copies(plan.collective, self.size, self.rank, plan.root, plan.count, plan.dtype.itemsize)

    def _staged_call(self, plan, deadline):
        staged = self._staged.get(id(plan))
        if staged is not None and staged.call.plan is plan and staged.staging is self._staging:
            return staged
        self._refuse_capture(plan, "uploads its copies and may grow the staging buffers its peers open")
        staging = self._ensure_staging(plan.count * plan.dtype.itemsize, plan.collective, deadline)
        block = plan.count // self.size * plan.dtype.itemsize
        own = staging.own.address
        # The call in place on the staging buffers (symmetric.py's in-place
        # cases): reduce_scatter's output its own block, allgather's input its own block.
        if plan.collective == ALLGATHER:
            arrays = _Arrays(None, Place(staging, 0), own + self.rank * block, own)
        elif plan.collective == REDUCE_SCATTER:
            arrays = _Arrays(Place(staging, 0), None, own, own + self.rank * block)
        else:
            arrays = _Arrays(Place(staging, 0), Place(staging, 0), own, own)
        copy_in, copy_out = self._staged_copies(plan)
        itemsize = plan.dtype.itemsize

        def copy(destination, source, nbytes):
            """One COPY row of this rank. The share's table puts this rank's
            INPUT and OUTPUT where its part of the call lies in the staging
            buffer (at copy_in's and copy_out's offsets, _staged_copies);
            WORK and SCRATCH are the caller's input and output (buffers)."""
            rows = np.array([[self.rank, COPY_OP, nbytes // itemsize, destination, 0, 1, self.rank, source, 0]],
                            np.int64)
            return _Rows(self._upload(rows), rows.shape[1], grid_for(rows, self.device, itemsize), rows.size)

        call = self._call(plan, arrays)
        assert copy_in is None or call.addresses[kernels.BUFFERS * self.rank + INPUT] == own + copy_in[0]
        assert copy_out is None or call.addresses[kernels.BUFFERS * self.rank + OUTPUT] == own + copy_out[0]
        staged = _StagedCall(
            call, staging, kernels.step_instance(plan.dtype, ReduceOp.SUM, False),
            copy_in and copy(INPUT, WORK, copy_in[1]), copy_out and copy(SCRATCH, OUTPUT, copy_out[1]), {})
        if len(self._staged) >= 256:
            self._staged.clear()
        self._staged[id(plan)] = staged
        return staged

    def _upload(self, rows):
        """Rows in device memory, kept until close: a captured graph may
        launch them after the caches here have let them go."""
        table = self.device.upload(rows)
        self._kept.append(table)
        return table

    def _refuse_capture(self, plan, what):
        """InvalidUsageError while capturing: `what` a call not made before does, on the host."""
        device = self.device
        if device.is_capturing(device.current_stream()):
            raise InvalidUsageError(
                f"graph: a {plan.collective} between processes not made before {what}, which cannot be "
                "captured: make each call once before capturing it")

    def _ensure_staging(self, nbytes, collective, deadline):
        """This rank's staging buffer, at least `nbytes`, and every peer's,
        mapped here. Every rank makes the same calls, so every rank grows
        at the same call, to the same size (a power of two, at least
        STAGING_MIN_BYTES). Growing publishes the new buffer's handle and
        size in the control segment's LL region and waits for every peer's:
        the only host wait of these calls, once per growth. It first waits
        for this rank's stream, so that every peer is done with the old
        buffer (this rank's last leave barrier is behind it), and the old
        buffers are released at close only (a peer may still map them)."""
        staging = self._staging
        if staging is not None and staging.nbytes >= nbytes:
            return staging
        device, ll = self.device, self.ll
        capacity = max(STAGING_MIN_BYTES, 1 << max(nbytes - 1, 1).bit_length())
        generation = len(self._old_staging) + (staging is not None) + 1
        own = None
        try:
            device.synchronize()
            own = device.allocate_shared(capacity, f"{self.prefix}-r{self.rank}-staging{generation}")
            addresses = ll.exchange_staging(own, capacity, deadline)
        except BaseException as error:   # the peers waiting for this rank's buffer learn of it at once
            ll.group.abort(f"{type(error).__name__}: {error}", error)   # first: a peer that cannot open it asks why
            if own is not None:
                device.release_shared(own, own=True)
            raise
        if staging is not None:
            self._old_staging.append(staging)
        self._staging = Allocation(-generation, own, capacity, addresses)   # negative: not a caller's allocation
        return self._staging

    def _barrier_args(self):
        if self._args is None:
            self._args = self.ll.args_copy()
        return self._args

    def _prepare(self, plan, arrays, key):
        itemsize = plan.dtype.itemsize
        reducing = plan.collective in REDUCING_COLLECTIVES
        op = ReduceOp(plan.op) if reducing else ReduceOp.SUM
        block_bytes = plan.count // self.size * itemsize
        # A copy of a rank's data onto itself is left out (in place).
        in_place = plan.collective == BROADCAST or (
            plan.collective == ALLGATHER and arrays.input_address == arrays.output_address + self.rank * block_bytes)
        rows = share_rows(plan.collective, self.size, self.rank, plan.root, plan.count, itemsize,
                          REDUCE_FINAL_OP, in_place)
        addresses = [0] * (kernels.BUFFERS * self.size)
        for q in range(self.size):   # where the rows read and write each rank's arrays, mapped here
            if arrays.source is not None:
                addresses[kernels.BUFFERS * q + INPUT] = arrays.source.allocation.addresses[q] + arrays.source.offset
            if arrays.result is not None:
                addresses[kernels.BUFFERS * q + OUTPUT] = arrays.result.allocation.addresses[q] + arrays.result.offset
        if arrays.source is None:   # allgather: only this rank reads its input
            addresses[kernels.BUFFERS * self.rank + INPUT] = arrays.input_address
        if arrays.result is None:   # reduce_scatter: only this rank writes its output
            addresses[kernels.BUFFERS * self.rank + OUTPUT] = arrays.output_address
        buffers = kernels.buffer_table(addresses)
        buffers.setflags(write=False)
        table = width = grid = None
        fanout = 1
        words = rows.size
        if len(rows):
            self._refuse_capture(plan, "uploads its rows")
            rows, fanout = fan_out(rows)
            table, width = self._upload(rows), rows.shape[1]
            grid = grid_for(rows, self.device, itemsize, fanout)
        call = _SymmetricCall(plan, self.rank, kernels.step_instance(plan.dtype, op, reducing),
                              kernels.step_divisor(op, self.size) if reducing else 0, table, words, width, grid, fanout,
                              buffers, signature(plan, arrays), describe_call(plan) + " on symmetric memory")
        if len(self._calls) >= 256:
            self._calls.clear()
        self._calls[key] = call
        return call
