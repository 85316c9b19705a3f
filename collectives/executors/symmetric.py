"""Collectives on symmetric memory between GPU ranks in separate processes:
each rank's kernel reads its peers' inputs and writes their outputs where
they lie, with no copy into or out of a workspace and no host in the loop
(NCCL's registered buffers, PyTorch's symmetric memory). Two paths
(paths.py) and the memory they run on.

Symmetric memory is what Communicator.alloc(shape, dtype) returns: every
rank allocates the same bytes of IPC-shareable device memory, the ranks
exchange the handles by an allgather, and each maps every peer's. So an
array at offset o of allocation k on one rank has a twin at offset o of
allocation k on every rank, and a rank knows its address on each peer.

The symmetric path serves the one-pass plans (paths.one_pass: the five
collectives, the `direct` plan's bits, uncompressed) on symmetric buffers:
the arrays its peers touch (every input but allgather's, every output but
reduce_scatter's) lie in symmetric memory. A call is three launches on the
caller's stream:

    ll_barrier  enter: every peer has reached the call (kernels/ll_allreduce.cu)
    plan_step   this rank's share (symmetric_rows.py), on the peers' memory
    ll_barrier  leave: every peer is done with this rank's arrays

Rank r's share of a call, one pass of plan_step over every rank's arrays,
is in executors/symmetric_rows.py: each rank reads about the message and
writes about the message, each input once and each output once for ranks
sharing one GPU (the memory floor), folding in rank order (the `direct`
plan's bits).

The staged path serves the same plans on any buffers (the LL path takes
the small ones first, the symmetric path those on symmetric memory),
through each rank's staging buffer, symmetric memory of the
communicator's own: a copy of the input into it, the same three launches
in place on the staging buffers, a copy of the result out: five launches,
no host wait, the copies NCCL's eager path makes. The staging buffers grow
at the same calls on every rank (every rank makes the same calls), a power
of two at least STAGING_MIN_BYTES, which is the only time these calls wait
on the host.

The barriers' signature (32 bits of a hash of the collective, counts, dtype,
op, root and where input and output lie in symmetric memory) makes a rank
whose call differs (another allocation or offset included) a mismatch that
every rank raises as InvalidUsageError; so does a rank that passes arrays
outside symmetric memory while its peers pass symmetric ones (its call goes
through staging, whose place differs). Timeouts, a dead peer, graphs and
stream order are the device protocol's (device_protocol.py), whose LL
area holds the barrier word.
"""

import hashlib
from typing import NamedTuple, Optional, Tuple

import numpy as np

from .. import kernels
from ..algorithms.schedule import ALLGATHER, BROADCAST, REDUCE_SCATTER, REDUCING_COLLECTIVES
from ..binding import COPY_OP, IN_PLACE_BINDINGS, INPUT, OUTPUT, REDUCE_FINAL_OP
from ..errors import InvalidUsageError
from ..ops import ReduceOp
from ..plan import SCRATCH, WORK
from ..transport.protocol import describe_call
from .device import fan_out, grid_for
from .paths import SYMMETRIC, Path, one_pass
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
    """A plan's call on plain arrays through staging (StagedPath)."""
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


class SymmetricMemory:
    """This rank's symmetric memory (the caller's allocations and the staging
    buffers) and what both paths on it do: prepare a call's share, and
    launch barrier, share, barrier. `protocol` is the rank's
    device_protocol.DeviceProtocol, whose LL area holds the barrier word."""

    def __init__(self, rank, size, prefix, device, protocol):
        self.rank, self.size, self.prefix = rank, size, prefix
        self.device, self.protocol = device, protocol
        self.allocations = []
        self.staging = None            # the current staging buffer (an Allocation), for calls on plain arrays
        self._old_staging = []         # the ones it replaced: released at close
        self._calls = {}               # (id(plan), places) -> _SymmetricCall
        self._args = None              # the barriers' kernels.LLAllreduceArgs, made at the first call
        self._kept = []                # every table uploaded: a graph may launch it until close

    # -- memory ---------------------------------------------------------------

    def allocate(self, shape, dtype, exchange):
        """Communicator.alloc on this rank: an array of `shape` and `dtype`
        in new symmetric memory. `exchange(payload)` is the communicator's
        allgather of a small uint8 array on this rank's device. Every rank
        must ask for the same bytes: else every rank raises InvalidUsageError.
        (A plain array's memory may lie in it now: the selector forgets the
        paths the buffers chose, DeviceProcessRank.allocate_symmetric.)"""
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
                self.protocol.hold_peer_memory(opened)   # unmapped at close, with the LL areas
                addresses.append(opened.address)
        except BaseException as error:
            # The peers have this allocation and this rank has not: their
            # symmetric memory would no longer match. Abort for every rank.
            self.protocol.group.abort(f"{type(error).__name__}: alloc on rank {self.rank}: {error}", error)
            device.release_shared(own, own=True)
            raise
        self.allocations.append(Allocation(index, own, nbytes, tuple(addresses)))
        return device.wrap_shared(own, tuple(shape), dtype)

    def place(self, info):
        """The Place of an array (ArrayInfo) wholly inside this rank's
        symmetric memory, else None."""
        for allocation in self.allocations:
            offset = info.address - allocation.own.address
            if 0 <= offset and offset + info.nbytes <= allocation.nbytes:
                return Place(allocation, offset)
        return None

    def grow_staging(self, nbytes, deadline):
        """This rank's staging buffer, at least `nbytes`, and every peer's,
        mapped here. Every rank makes the same calls, so every rank grows
        at the same call, to the same size (a power of two, at least
        STAGING_MIN_BYTES). Growing publishes the new buffer's handle and
        size in the control segment's LL region and waits for every peer's:
        the only host wait of these calls, once per growth. It first waits
        for this rank's stream, so that every peer is done with the old
        buffer (this rank's last leave barrier is behind it), and the old
        buffers are released at close only (a peer may still map them)."""
        staging = self.staging
        if staging is not None and staging.nbytes >= nbytes:
            return staging
        device, protocol = self.device, self.protocol
        capacity = max(STAGING_MIN_BYTES, 1 << max(nbytes - 1, 1).bit_length())
        generation = len(self._old_staging) + (staging is not None) + 1
        own = None
        try:
            device.synchronize()
            own = device.allocate_shared(capacity, f"{self.prefix}-r{self.rank}-staging{generation}")
            addresses = protocol.exchange_staging(own, capacity, deadline)
        except BaseException as error:   # the peers waiting for this rank's buffer learn of it at once
            protocol.group.abort(f"{type(error).__name__}: {error}", error)   # first: a peer that cannot open it asks why
            if own is not None:
                device.release_shared(own, own=True)
            raise
        if staging is not None:
            self._old_staging.append(staging)
        self.staging = Allocation(-generation, own, capacity, addresses)   # negative: not a caller's allocation
        return self.staging

    def upload(self, rows):
        """Rows in device memory, kept until close: a captured graph may
        launch them after the caches here have let them go."""
        table = self.device.upload(rows)
        self._kept.append(table)
        return table

    def refuse_capture(self, plan, what):
        """InvalidUsageError while capturing: `what` a call not made before does, on the host."""
        device = self.device
        if device.is_capturing(device.current_stream()):
            raise InvalidUsageError(
                f"graph: a {plan.collective} between processes not made before {what}, which cannot be "
                "captured: make each call once before capturing it")

    def release(self):
        """At close, after every rank's kernels are done (a barrier): our own
        memory goes once the caller's arrays in it are gone too."""
        staging = self._old_staging + ([self.staging] if self.staging is not None else [])
        for allocation in self.allocations + staging:
            self.device.release_shared(allocation.own, own=True)
        self.allocations, self._old_staging, self.staging = [], [], None
        self._calls.clear()
        self._kept.clear()

    # -- the calls of both paths: barrier, share, barrier ----------------------------

    def call(self, plan, arrays):
        """The _SymmetricCall of `plan` on arrays that lie as `arrays` says
        (_Arrays), made once."""
        key = (id(plan), *arrays.key)
        call = self._calls.get(key)
        if call is None or call.plan is not plan:
            call = self._prepare(plan, arrays, key)
        return call

    def launch(self, plan, call, stream, deadline, after=None, buffers=None):
        """Barrier, share, barrier. A barrier that gives up zeroes a table
        (ll_barrier), whose rows then move nothing: the enter barrier the
        share's, the leave barrier `after`'s (_Rows launched next, or None)."""
        device, protocol = self.device, self.protocol
        if self._args is None:
            self._args = protocol.args_copy()
        args = self._args
        args.signature = call.signature
        args.collective = SYMMETRIC_FAULT_CODE + kernels.LL_COLLECTIVES.index(plan.collective)
        args.timeout_ns = protocol.set_timeout(deadline)
        args.output, args.count = (call.table.address, call.table_words) if call.table is not None else (0, 0)
        device.launch_ll_barrier(stream, args)   # (the launch copies the arguments)
        if call.table is not None:
            device.launch_step(stream, call.instance, call.grid, call.table, call.width,
                               call.addresses if buffers is None else buffers, call.divisor, call.fanout)
        args.output, args.count = (after.table.address, after.words) if after is not None else (0, 0)
        device.launch_ll_barrier(stream, args)

    def _prepare(self, plan, arrays, key):
        itemsize = plan.dtype.itemsize
        reducing = plan.collective in REDUCING_COLLECTIVES
        op = ReduceOp(plan.op) if reducing else ReduceOp.SUM
        block_bytes = plan.count // self.size * itemsize
        # A copy of a rank's data onto itself is left out (in place).
        own_block = self.rank * block_bytes if plan.collective == ALLGATHER else 0
        in_place = plan.collective in (BROADCAST, ALLGATHER) and arrays.input_address == arrays.output_address + own_block
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
            self.refuse_capture(plan, "uploads its rows")
            rows, fanout = fan_out(rows)
            table, width = self.upload(rows), rows.shape[1]
            grid = grid_for(rows, self.device, itemsize, fanout)
        call = _SymmetricCall(plan, self.rank, kernels.step_instance(plan.dtype, op, reducing),
                              kernels.step_divisor(op, self.size) if reducing else 0, table, words, width, grid, fanout,
                              buffers, signature(plan, arrays), describe_call(plan) + " on symmetric memory")
        if len(self._calls) >= 256:
            self._calls.clear()
        self._calls[key] = call
        return call


def _one_pass_on_symmetric_memory(plan):
    """What both paths serve: a one-pass plan (paths.one_pass) of at most
    MAX_RANKS ranks (the step kernel's buffer table)."""
    return one_pass(plan) and plan.nranks <= kernels.MAX_RANKS


class SymmetricPath(Path):
    """Calls whose arrays lie in symmetric memory: barrier, this rank's
    share on the peers' arrays, barrier (see the module doc)."""

    name = "symmetric"
    buffers = frozenset({SYMMETRIC})

    def __init__(self, memory):
        self.memory = memory   # SymmetricMemory

    def serves(self, plan):
        return _one_pass_on_symmetric_memory(plan)

    def arrays(self, plan, input_info, output_info):
        """The call's _Arrays where the arrays peers read (every input but
        allgather's) or write (every output but reduce_scatter's) lie in
        symmetric memory, else None."""
        memory = self.memory
        if not memory.allocations:
            return None
        source = memory.place(input_info) if plan.collective in PEERS_READ_INPUT else None
        result = memory.place(output_info) if plan.collective in PEERS_WRITE_OUTPUT else None
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
            return b == a + self.memory.rank * output_info.nbytes
        if plan.collective == ALLGATHER:
            return a == b + self.memory.rank * input_info.nbytes
        return False

    def prepare(self, plan, arrays=None):
        return self.memory.call(plan, arrays)

    def launches(self, plan):
        return 3 if plan.count else 0

    def run(self, route, input_info, output_info, deadline):
        plan, call = route.plan, route.call
        protocol = self.memory.protocol
        if plan.count == 0:
            protocol.check()
            return
        stream = protocol.begin(plan.collective, call.description, deadline)
        self.memory.launch(plan, call, stream, deadline)
        protocol.end()


class StagedPath(Path):
    """Calls on any arrays through the staging buffers: a copy in, barrier,
    share, barrier on the staging buffers, a copy out (see the module doc)."""

    name = "staged"

    def __init__(self, memory):
        self.memory = memory   # SymmetricMemory
        self._staged = {}      # id(plan) -> _StagedCall

    def serves(self, plan):
        return _one_pass_on_symmetric_memory(plan)

    def launches(self, plan):
        if plan.count == 0:
            return 0
        copy_in, copy_out = self._copies(plan)
        return 3 + (copy_in is not None) + (copy_out is not None)

    def run(self, route, input_info, output_info, deadline):
        """Five launches, no host wait: a copy of the input into this rank's
        staging buffer, the call in place on the staging buffers (barrier,
        share, barrier) and a copy of the result out. The copy in may
        overwrite the staging buffer at once: every peer finished with it
        in this rank's previous call, whose leave barrier came before on the
        stream. The output may overlap the input in any way: the input is
        copied whole before anything is written. The copies are step kernel
        COPY rows made once per plan, the caller's addresses passed by value
        (a new array costs no upload). A leave barrier that gives up zeroes
        the copy out's table, as an enter barrier does the share's: a failed
        call writes no output."""
        plan = route.plan
        memory = self.memory
        protocol = memory.protocol
        if plan.count == 0:
            protocol.check()
            return
        staged = self._call(plan, deadline)
        buffers = staged.buffers(input_info.address, output_info.address)
        stream = protocol.begin(plan.collective, staged.call.description, deadline)
        device = memory.device
        if staged.copy_in is not None:
            device.launch_step(stream, staged.copy_instance, staged.copy_in.grid, staged.copy_in.table,
                               staged.copy_in.width, buffers, 0)
        memory.launch(plan, staged.call, stream, deadline, staged.copy_out, buffers)
        if staged.copy_out is not None:
            device.launch_step(stream, staged.copy_instance, staged.copy_out.grid, staged.copy_out.table,
                               staged.copy_out.width, buffers, 0)
        protocol.end()

    def _copies(self, plan):
        memory = self.memory
        return staged_copies(plan.collective, memory.size, memory.rank, plan.root, plan.count, plan.dtype.itemsize,
                             plan.binding in IN_PLACE_BINDINGS)

    def _call(self, plan, deadline):
        memory = self.memory
        staged = self._staged.get(id(plan))
        if staged is not None and staged.call.plan is plan and staged.staging is memory.staging:
            return staged
        memory.refuse_capture(plan, "uploads its copies and may grow the staging buffers its peers open")
        staging = memory.grow_staging(plan.count * plan.dtype.itemsize, deadline)
        rank = memory.rank
        block = plan.count // memory.size * plan.dtype.itemsize
        own = staging.own.address
        # The call in place on the staging buffers (the symmetric path's
        # in-place cases): reduce_scatter's output its own block, allgather's input its own block.
        if plan.collective == ALLGATHER:
            arrays = _Arrays(None, Place(staging, 0), own + rank * block, own)
        elif plan.collective == REDUCE_SCATTER:
            arrays = _Arrays(Place(staging, 0), None, own, own + rank * block)
        else:
            arrays = _Arrays(Place(staging, 0), Place(staging, 0), own, own)
        copy_in, copy_out = self._copies(plan)
        itemsize = plan.dtype.itemsize

        def copy(destination, source, nbytes):
            """One COPY row of this rank. The share's table puts this rank's
            INPUT and OUTPUT where its part of the call lies in the staging
            buffer (at copy_in's and copy_out's offsets, _copies); WORK and
            SCRATCH are the caller's input and output (buffers)."""
            rows = np.array([[rank, COPY_OP, nbytes // itemsize, destination, 0, 1, rank, source, 0]], np.int64)
            return _Rows(memory.upload(rows), rows.shape[1], grid_for(rows, memory.device, itemsize), rows.size)

        call = memory.call(plan, arrays)
        assert copy_in is None or call.addresses[kernels.BUFFERS * rank + INPUT] == own + copy_in[0]
        assert copy_out is None or call.addresses[kernels.BUFFERS * rank + OUTPUT] == own + copy_out[0]
        staged = _StagedCall(
            call, staging, kernels.step_instance(plan.dtype, ReduceOp.SUM, False),
            copy_in and copy(INPUT, WORK, copy_in[1]), copy_out and copy(SCRATCH, OUTPUT, copy_out[1]), {})
        if len(self._staged) >= 256:
            self._staged.clear()
        self._staged[id(plan)] = staged
        return staged

    def forget(self):
        """Close: the staged calls' tables go with the memory."""
        self._staged.clear()
