"""The GPU executor of ranks in this process, each on a device (several may
share one), on any device that implements the interface of
devices/__init__.py (CUDA GPUs, emulated ones).

Its calls take one of two paths (paths.py): peer_ll (peer_ll.py: small
calls as one kernel per GPU, for ranks each on a GPU of their own, with
$COLLECTIVES_ONE_KERNEL_ALLREDUCE=1), else events, here: plans run by the
step kernel. For each plan the events path prepares, once, a program:

* per phase and device, the rows of that device's ranks as a table in device
  memory, and one plan_step launch over them. Rows that fold the same
  sources the same way go as fan-out groups (`fan_out`): the kernel reads
  their sources once and writes every row's destination, so ranks sharing a
  GPU run direct allreduce in one pass at the memory floor;
* the cross-device ordering, as event records and waits derived from the
  plan's accesses (plan.derive_waits): a device starts a phase once the
  devices whose memory it reads (or whose earlier reads it overwrites) have
  done the phases it depends on. Ranks on one device need nothing: their
  rows share the device's stream, which keeps its order;
* a join at the end: every device waits for the devices that read its
  memory during the call, so when the call is done on a device's stream,
  its arrays are the caller's again. That also orders consecutive calls.

A call then resolves the buffer addresses (each rank's workspace and the
caller's arrays) and issues the program on each device's current stream. It
never waits for a device: the work can be captured in a CUDA graph when all
ranks share one GPU.

The program is issued from its launch record, made once with it: per step a
callable that takes the stream and does only that step's driver call (a
launch's kernel, grid and packed parameters are the adapter's, prepared by
its `step_launcher`), and per device one block of buffer addresses that its
launches read. A call whose buffers are those of the program's last call
rewrites nothing; one with other buffers (the same shapes, other arrays)
rewrites each device's block once, not each launch. A call that repeats an
earlier one on the same arrays (Communicator._repeat) runs the program bound
to them (`bind`, BoundProgram): its address table made once, nothing
looked up per call.

In place, ranks on one device get the lockstep binding (binding.py,
IN_PLACE_LOCKSTEP): a fan-out group may overwrite the inputs it reads,
since plan_step reads every source of an element before writing there, so
direct allreduce in place is one launch too.

A compressed plan runs its ranks' codec operations (compression/wire.py)
instead of the table: per device, between its events, as codec_batch
launches of the operations that share no memory (`_codec_steps`), prepared
once per set of buffers (the codec launch record). Compressed direct with
every rank on one device is one codec_round_sum instead
(`rounds_in_one_pass`): each input rounded in registers and summed in rank
order, the compressed plan's bits at the uncompressed floor.
"""

from typing import NamedTuple, Tuple

import numpy as np

from .. import config, kernels
from ..algorithms.schedule import REDUCING_COLLECTIVES
from ..binding import IN_PLACE, IN_PLACE_LOCKSTEP, INPUT, OUTPUT
from ..compression import kernels as codecs
from ..compression import wire
from ..errors import InvalidUsageError
from ..ops import ReduceOp
from ..plan import COUNT, DST_BUF, DST_OFF, NSRC, RANK, SCRATCH, WORK, derive_waits
from .paths import PLAIN, Path, Selector
from .peer_ll import PeerLLPath

LAUNCH, RECORD, WAIT = "launch", "record", "wait"
# Event keys are (device, phase): recorded after that device's launch of that
# phase, or at the start of the call for phase START.
START = -1


class Launch(NamedTuple):
    table: object          # device memory holding the rows
    width: int
    grid: Tuple[int, int]  # (blocks per group, groups of `fanout` rows)
    fanout: int            # rows per group: they share sources, each has its destination
    rows: np.ndarray       # the rows on the host, for reports


class Program(NamedTuple):
    plan: object
    instance: kernels.StepInstance
    divisor: int
    steps: tuple           # (LAUNCH, device, Launch or codec ops) | (RECORD | WAIT, device, event key)
    events: dict           # event key -> event (created on the recording device)
    launches: Tuple[int, ...]  # per device (uncompressed; launches() counts a compressed plan's batches)
    record: tuple          # the launch record: (device, issue(stream)) per step, in order (no compression)
    blocks: tuple          # per device, the buffer-address block its launches read (see the module doc)
    patched: list          # [the address table the blocks hold now]


class CodecRecord(NamedTuple):
    """A compressed program's launch record on one set of buffers."""
    program: Program
    key: tuple             # the buffers' addresses: inputs, outputs, workspaces
    record: tuple          # (device index, issue(stream)) per launch, record and wait
    inputs: list           # the descriptions of the call that last used it (for a repeat's identity check)
    outputs: list
    workspaces_replaced: int   # DeviceRanks._workspaces_replaced when it was made


class AddressBlock:
    """The buffer addresses launches read, for devices without a block of
    their own (the emulated device): the table itself, which the executor
    never changes once made (a new call's buffers make a new table)."""

    def __init__(self):
        self.addresses = None

    def update(self, addresses):
        self.addresses = addresses


def step_launcher(device, instance, launch, divisor, block):
    """issue(stream): one plan_step launch of `launch` on `device`, with the
    addresses `block` holds at the time: the device's own prepared launch
    where it has one (CudaDevice.step_launcher), else its launch_step."""
    prepared = getattr(device, "step_launcher", None)
    if prepared is not None:
        return prepared(instance, launch.grid, launch.table, launch.width, divisor, block, launch.fanout)

    # Its values as defaults, not closed over: a function, a tuple and a
    # bound method, where a closure is a function, a cell per value and a
    # tuple of them. A communicator keeps up to 1024 programs of a few dozen
    # steps each, all of it walked by every full garbage collection.
    def issue(stream, launch_step=device.launch_step, instance=instance, grid=launch.grid, table=launch.table,
              width=launch.width, block=block, divisor=divisor, fanout=launch.fanout):
        launch_step(stream, instance, grid, table, width, block.addresses, divisor, fanout)
    return issue


def codec_batch_launcher(device, codec, rows):
    """issue(stream): one codec_batch launch of `rows` on `device`, prepared
    by the device where it can (CudaDevice.codec_batch_launcher), else
    through its launch_codec_batch."""
    prepared = getattr(device, "codec_batch_launcher", None)
    if prepared is not None:
        return prepared(codec, rows)
    return lambda stream: device.launch_codec_batch(stream, codec, rows)


def grid_for(rows, device, itemsize, fanout=1):
    """(blocks per group, groups): enough blocks to fill the device, no more
    than the longest row has 16-byte packs for."""
    groups = len(rows) // fanout
    longest = int(rows[:, COUNT].max())
    packs = -(-longest * itemsize // 16)
    per_group = max(1, min(-(-packs // kernels.STEP_THREADS), device.resident_blocks // groups))
    return (per_group, groups)


# The columns that say where a row writes; the rest say what it computes.
_DESTINATION_COLUMNS = (RANK, DST_BUF, DST_OFF)


def fan_out(rows):
    """(rows, fanout): the rows reordered so that those computing the same
    value (every column equal but the destination's) are consecutive groups
    of `fanout`, when all groups are that size; else the rows as they are
    and 1. Rows of one phase never read what another writes, so a group's
    rows may share one read of their sources (plan_step.cu)."""
    if len(rows) < 2:
        return rows, 1
    computes = np.delete(rows, _DESTINATION_COLUMNS, axis=1)
    _, group, sizes = np.unique(computes, axis=0, return_inverse=True, return_counts=True)
    if sizes.min() != sizes.max() or sizes[0] == 1:
        return rows, 1
    return rows[np.argsort(group.reshape(-1), kind="stable")], int(sizes[0])


def groups_traffic(rows, fanout, itemsize):
    """Bytes a launch over `rows` in groups of `fanout` reads plus writes:
    each group's sources once, each row's destination once."""
    counts, sources = rows[::fanout, COUNT], rows[::fanout, NSRC]
    return int((counts * (sources + fanout)).sum()) * itemsize


class DeviceRanks:
    """Ranks of one process, each on a device (the object `run` is called on)."""

    addressable = True  # ranks read each other's arrays: plans skip the workspace copies
    host_only = False
    compresses = True   # runs compressed plans, with the codec kernels

    def __init__(self, devices):
        if len(devices) > kernels.MAX_RANKS:
            raise InvalidUsageError(f"at most {kernels.MAX_RANKS} ranks per process on devices, got {len(devices)}")
        self.rank_devices = list(devices)
        self.devices = list(dict.fromkeys(devices))     # distinct, in order of first use
        self.device_of_rank = [self.devices.index(d) for d in devices]
        # Which cost model `auto` asks: ranks on one GPU share its bandwidth.
        self.transport = "gpu-in-process" if len(self.devices) == 1 else "gpu-peers"
        # In place on one device, a phase's fan-out groups run in lockstep
        # (plan_step.cu reads a group's sources at each element before it
        # writes any destination there), so a group may overwrite what it
        # reads: direct allreduce in place is then one launch (binding.py).
        self.in_place_binding = IN_PLACE_LOCKSTEP if len(self.devices) == 1 else IN_PLACE
        self.ranks_of_device = [[r for r, k in enumerate(self.device_of_rank) if k == i]
                                for i in range(len(self.devices))]
        # Where each rank's arrays must live (an emulated device's are in host memory).
        self.locations = [device.array_location for device in devices]
        for a in self.devices:
            for b in self.devices:
                if a is not b:
                    a.enable_peer_access(b)
        self._workspaces = [None] * len(devices)
        self._retired = []      # outgrown workspaces: in-flight work may still use them
        self._programs = {}     # id(plan) -> Program
        self._layouts = {}      # id(plan.phases) -> (phases, _layout's): what the programs of one shape share
        self._codec_records = {}   # id(program) -> CodecRecord
        self._last_addresses = None
        # Counts the times a rank's workspace was replaced by a bigger one: an
        # address table made before holds an outgrown workspace (BoundProgram).
        self._workspaces_replaced = 0
        # Ranks each on a GPU of their own: small calls as one kernel per
        # device, with no host event between them (executors/peer_ll.py).
        self.peer_ll = PeerLLPath(self.devices) \
            if len(self.devices) > 1 and len(self.devices) == len(devices) and config.resolve_one_kernel_allreduce() \
            else None
        self.selector = Selector((self.peer_ll,) if self.peer_ll is not None else (), EventsPath(self))
        self._routes = self.selector.by_plan.get

    @property
    def one_device(self):
        """Whether every rank shares one device, where `auto` prices bound
        plans (auto.py) and a compressed direct runs in one pass."""
        return len(self.devices) == 1

    # -- the per-call path -----------------------------------------------------

    def run(self, plan, inputs, outputs, input_infos, output_infos, deadline=None):
        """Issue `plan` on each device's current stream for the ranks' arrays
        (only their ArrayInfos matter here), on the path the selector
        chooses. In one process the plan alone decides, so the selector's
        memory holds the plan's Route: read here first, a known plan costs
        one lookup and no call."""
        route = self._routes(id(plan))
        if route is None or route.plan is not plan:
            route = self.selector.route(plan, None, None)
        route.path.run(route, input_infos, output_infos, deadline)

    def run_program(self, route, input_infos, output_infos, deadline=None):
        """The events path's call (EventsPath.run): the route's program on
        each device's current stream."""
        peers = self.peer_ll
        if peers is not None and peers.used:
            peers.check()   # a kernel that gave up is reported, by this call as by any
        program = route.call
        plan = program.plan
        devices = self.devices
        streams = [device.current_stream() for device in devices]
        if len(devices) > 1 and any(d.is_capturing(s) for d, s in zip(devices, streams)):
            raise InvalidUsageError(
                "capturing a collective in a CUDA graph works when all ranks share one GPU; "
                f"these ranks use {len(devices)} devices")
        if plan.compression is not None:
            self._run_codec_program(program, streams, input_infos, output_infos)
            return
        addresses = self._addresses(plan, input_infos, output_infos)
        if program.patched[0] is not addresses:
            for block in program.blocks:
                block.update(addresses)
            program.patched[0] = addresses
        for k, issue in program.record:
            issue(streams[k])
        for device in devices:
            device.call_returned()

    def bind(self, plan, inputs, outputs, input_infos, output_infos):
        """`plan` bound to these arrays (their ArrayInfos): a BoundProgram,
        whose `run(arrays)` does what `run` does for a later call on the very
        same arrays, unchanged (Communicator._repeat vouches for that), with
        nothing looked up or rebuilt. None for compressed plans, which `run`
        runs, and where `output_infos` is None: outputs that each call makes
        anew (allgather without `out`) have addresses of their own."""
        if plan.compression is not None or output_infos is None:
            return None
        route = self.selector.route(plan, None, None)
        return route.path.bind(route, input_infos, output_infos)

    def _run_codec_program(self, program, streams, inputs, outputs):
        """A compressed plan: each rank's codec operations (compression/wire.py)
        as codec kernel launches, ordered between devices like step launches.
        The launches are prepared once per program and set of buffers (the
        codec launch record); a repeated call only issues them."""
        cached = self._codec_records.get(id(program))
        # A repeated call passes the very lists of descriptions it passed
        # before (Communicator._repeat), which nobody changes; and while no
        # workspace was replaced, the ones the record was made for are there
        # and large enough: nothing to check further.
        if cached is None or cached.program is not program or cached.inputs is not inputs \
                or cached.outputs is not outputs or cached.workspaces_replaced != self._workspaces_replaced:
            plan = program.plan
            workspaces = [0] * len(self.rank_devices) if self.rounds_in_one_pass(plan) else \
                [self._workspace(rank, plan.workspace_bytes).address for rank in range(len(self.rank_devices))]
            key = (tuple(i.address for i in inputs), tuple(o.address for o in outputs), tuple(workspaces))
            if cached is None or cached.program is not program or cached.key != key:
                record = self._codec_record(program, workspaces, inputs, outputs)
            else:
                record = cached.record
            cached = CodecRecord(program, key, record, inputs, outputs, self._workspaces_replaced)
            self._codec_records[id(program)] = cached
        for k, issue in cached.record:
            issue(streams[k])
        for device in self.devices:
            device.call_returned()

    def rounds_in_one_pass(self, plan):
        """Whether the compressed `plan` runs as one codec_round_sum launch
        (kernels/codec.cu): a direct allreduce of ranks that share one
        device, which read each other's inputs and need no wire form. Its
        bits are those of the plan's codec operations: every rank sums the
        rounded inputs in rank order (compression/wire.py lowers direct so)."""
        return plan.compression is not None and plan.algorithm == "direct" and len(self.devices) == 1

    def _codec_record(self, program, workspaces, inputs, outputs):
        """(device index, issue(stream)) for every codec launch, record and
        wait of a compressed program on these buffers."""
        plan, devices = program.plan, self.devices
        if self.rounds_in_one_pass(plan):
            device = devices[0]
            divisor = plan.nranks if ReduceOp(plan.op) is ReduceOp.AVG else 0
            args = (plan.compression, [i.address for i in inputs], [o.address for o in outputs], plan.count, divisor)
            prepared = getattr(device, "codec_round_sum_launcher", None)
            issue = prepared(*args) if prepared is not None else \
                (lambda stream: device.launch_codec_round_sum(stream, *args))
            return ((0, issue),)
        buffers = {INPUT: [i.address for i in inputs], OUTPUT: [o.address for o in outputs]}

        def address_of(rank, buffer):
            if buffer is None or buffer == WORK:
                return workspaces[rank]
            if buffer == SCRATCH:
                return workspaces[rank] + plan.scratch_offset
            return buffers[buffer][rank]

        record = []
        for kind, k, what in self._codec_steps(program, address_of):
            device = devices[k]
            if kind is LAUNCH:
                record.append((k, codec_batch_launcher(device, plan.compression, what)))
            else:
                event = program.events[what]
                record.append((k, (lambda stream, d=device, e=event: d.record(e, stream)) if kind is RECORD else
                               (lambda stream, d=device, e=event: d.wait(stream, e))))
        return tuple(record)

    def _codec_steps(self, program, address_of):
        """The steps of a compressed program on the buffers `address_of`
        gives (rank, buffer -> address; buffer None: the workspace), with
        the operations as batches: (LAUNCH, device, CodecRows of one
        codec_batch) and the records and waits as they are.

        A device's operations between two of its records or waits go as
        batches (compression/kernels.py: batch_rows): operations that touch
        no common memory run side by side, whatever phase or rank they
        belong to, and the rest keep their order. Only the device's own
        stream orders them there, so batches may span phases; the events,
        which order it with other devices, stay where the program put them."""
        plan = program.plan
        f, w = wire.device_regions(plan, address_of)
        steps, pending = [], [[] for _ in self.devices]    # per device: rows not yet in a batch

        def flush(k):
            steps.extend((LAUNCH, k, rows) for rows in codecs.batch_rows(pending[k], plan.compression))
            pending[k] = []

        for kind, k, what in program.steps:
            if kind is LAUNCH:   # what: this device's ranks' operations in the phase
                for kernel, args, divisor in wire.codec_launches(what, f, w):
                    row = codecs.device_row(kernel, plan.compression, args, divisor)
                    if row is not None:
                        pending[k].append(row)
            else:
                flush(k)
                steps.append((kind, k, what))
        for k in range(len(self.devices)):
            flush(k)
        return steps

    def _addresses(self, plan, inputs, outputs):
        """The BufferTable of this call: per rank WORK, SCRATCH, INPUT, OUTPUT.
        The same buffers as the last call give the same table object, which
        the CUDA adapter then need not copy again."""
        need = plan.workspace_bytes
        last = self._last_addresses
        # A repeated call passes the very lists of descriptions it passed
        # before (Communicator._repeat), which nobody changes: no key to build.
        if last is not None and last[2] is inputs and last[3] is outputs and last[4] == (need, plan.scratch_offset):
            return last[1]
        key = (tuple(inputs), tuple(outputs), need, plan.scratch_offset)
        if last is not None and last[0] == key:
            self._last_addresses = (key, last[1], inputs, outputs, (need, plan.scratch_offset))
            return last[1]
        addresses = []
        for rank, (i, o) in enumerate(zip(inputs, outputs)):
            work = self._workspace(rank, need).address if need else 0
            addresses += (work, work + plan.scratch_offset if need else 0, i.address, o.address)
        assert (WORK, SCRATCH, INPUT, OUTPUT) == (0, 1, 2, 3), "the order of a rank's addresses above"
        table = kernels.buffer_table(addresses)
        table.setflags(write=False)  # adapters may keep it: a new call makes a new table
        self._last_addresses = (key, table, inputs, outputs, (need, plan.scratch_offset))
        return table

    def _workspace(self, rank, nbytes):
        workspace = self._workspaces[rank]
        if workspace is None or workspace.nbytes < nbytes:
            if workspace is not None:
                self._retired.append(workspace)
                # Address tables made before hold the outgrown workspace: none is reused.
                self._workspaces_replaced += 1
                self._last_addresses = None
            grown = max(nbytes, 2 * workspace.nbytes) if workspace is not None else nbytes
            workspace = self._workspaces[rank] = self.rank_devices[rank].allocate(grown)
        return workspace

    # -- preparing a plan, once ----------------------------------------------------

    def _prepare(self, plan):
        instance = kernels.step_instance(plan.dtype, ReduceOp(plan.op), plan.collective in REDUCING_COLLECTIVES)
        divisor = kernels.step_divisor(ReduceOp(plan.op), plan.nranks)
        ndevices = len(self.devices)
        launches, steps, recorded, events = self._layout(plan)
        blocks = tuple(getattr(d, "buffer_block", AddressBlock)() for d in self.devices)
        record = () if plan.compression is not None else \
            tuple(self._issuer(step, instance, divisor, events, blocks) for step in steps)
        program = Program(plan, instance, divisor, tuple(steps), events,
                          tuple(sum(1 for (_, k) in launches if k == i) for i in range(ndevices)),
                          record, blocks, [None])
        if len(self._programs) >= 1024:   # as device_process's: all_to_all_v makes a plan per matrix of counts
            self._programs.clear()
        self._programs[id(plan)] = program
        return program

    def _layout(self, plan):
        """(launches, steps, recorded, events) of `plan`: its launches'
        tables on the devices, their order and the events between devices.
        None of it depends on the dtype or op: an uncompressed plan's phases
        are those of every plan of its shape (plan.build_plan builds them
        once per element size), so the first plan of a shape lays it out
        and the others of that shape (another dtype of the same size,
        another op) take it as it is, tables, order and events alike: two
        programs sharing events are ordered on each device's stream as two
        calls of one program are. Only the launch record, which holds the
        kernel instance and the divisor, is each program's own (_prepare).
        Compressed plans are laid out each on its own."""
        if plan.compression is None:
            shared = self._layouts.get(id(plan.phases))
            if shared is not None and shared[0] is plan.phases:
                return shared[1]
        launches = {}  # (phase, device) -> Launch, or a compressed plan's codec operations
        for p, phase in enumerate(plan.phases):
            for k, ranks in enumerate(self.ranks_of_device):
                if plan.compression is not None:
                    ops = tuple(op for rank in ranks for op in phase.wire_ops_by_rank[rank])
                    if ops:
                        launches[p, k] = ops
                    continue
                rows, fanout = fan_out(phase.table[np.isin(phase.table[:, RANK], ranks)])
                if p in plan.lockstep_phases and fanout == 1 and len(rows) > 1:
                    raise AssertionError(f"phase {p} of {plan.algorithm} in place overwrites what other rows "
                                         "read, and its rows are not fan-out groups of one size (binding.py)")
                if len(rows):
                    grid = grid_for(rows, self.devices[k], plan.dtype.itemsize, fanout)
                    launches[p, k] = Launch(self.devices[k].upload(rows), rows.shape[1], grid, fanout, rows)
        steps, recorded = self._order(plan, launches)
        events = {key: self.devices[key[0]].new_event() for key in recorded}
        layout = (launches, steps, recorded, events)
        if plan.compression is None:
            if len(self._layouts) >= 1024:
                self._layouts.clear()
            self._layouts[id(plan.phases)] = (plan.phases, layout)   # the phases held: their id stays theirs
        return layout

    def _issuer(self, step, instance, divisor, events, blocks):
        """(device index, issue(stream)) of one step of a program."""
        kind, k, what = step
        device = self.devices[k]
        if kind is LAUNCH:
            return k, step_launcher(device, instance, what, divisor, blocks[k])
        event = events[what]
        if kind is RECORD:   # defaults rather than cells, as step_launcher's
            return k, lambda stream, record=device.record, event=event: record(event, stream)
        return k, lambda stream, wait=device.wait, event=event: wait(stream, event)

    def _order(self, plan, launches):
        """The program's steps: launches with the records and waits between
        devices that the plan's accesses call for; see the module doc."""
        nphases, ndevices = len(plan.phases), len(self.devices)
        device_of = self.device_of_rank
        waits = derive_waits(plan.nranks, plan.access, after_previous_call=False)

        def after(j, t):
            """The event that says device j has done its first t phases."""
            done = [p for p in range(t) if (p, j) in launches]
            return (j, done[-1] if done else START)

        needed = {}       # (phase, device) -> events to wait for before its launch
        pending = [dict() for _ in range(ndevices)]
        for p in range(nphases):
            for rank, rank_waits in enumerate(waits[p]):
                k = device_of[rank]
                for peer, t in rank_waits:
                    j = device_of[peer]
                    if j != k:
                        pending[k][j] = max(pending[k].get(j, 0), t)
            for k in range(ndevices):
                if (p, k) in launches and pending[k]:
                    needed[p, k] = [after(j, t) for j, t in sorted(pending[k].items())]
                    pending[k] = {}
        last = {k: max(p for (p, j) in launches if j == k) for k in range(ndevices)
                if any(j == k for (_, j) in launches)}
        readers = [set() for _ in range(ndevices)]
        for _, reads in plan.access:
            for reader, region in reads:
                j, k = device_of[reader], device_of[region.rank]
                if j != k:
                    readers[k].add(j)
        joins = {k: [(j, last[j]) for j in sorted(readers[k]) if j in last] for k in range(ndevices)}

        recorded = {key for keys in needed.values() for key in keys} | {key for keys in joins.values() for key in keys}
        steps = [(RECORD, j, (j, START)) for j in range(ndevices) if (j, START) in recorded]
        waited = [dict() for _ in range(ndevices)]  # per device: peer -> latest phase already waited for

        def wait(k, key):
            """A wait, unless one for the same or a later phase of that peer came
            before it on this stream (the peer's phases finish in order)."""
            peer, phase = key
            if phase > waited[k].get(peer, START - 1):
                steps.append((WAIT, k, key))
                waited[k][peer] = phase

        for p in range(nphases):
            for k in range(ndevices):
                if (p, k) not in launches:
                    continue
                for key in needed.get((p, k), ()):
                    wait(k, key)
                steps.append((LAUNCH, k, launches[p, k]))
                if (k, p) in recorded:
                    steps.append((RECORD, k, (k, p)))
        for k in range(ndevices):
            for key in joins[k]:
                wait(k, key)
        return steps, recorded

    # -- reports ---------------------------------------------------------------

    def chosen_path(self, plan, kind=PLAIN):
        """The path a call of `plan` takes (paths.py); buffers change nothing here."""
        return self.selector.select(plan, kind).name

    def launches(self, plan):
        """Kernel launches per device for a call of `plan`."""
        return self.selector.select(plan).launches(plan)

    def program_launches(self, plan):
        """Kernel launches per device of the events path's program of `plan`.
        A compressed plan's depend on which operations share memory, so they
        are counted on made-up buffers: every rank's workspace, input and
        output apart, as a call's are."""
        program = self._program(plan)
        if plan.compression is None:
            return program.launches
        if self.rounds_in_one_pass(plan):
            return (1,) if plan.count else (0,)

        def address_of(rank, buffer):
            return (1 + 4 * rank + (buffer if buffer in (INPUT, OUTPUT) else 0)) << 40 \
                + (plan.scratch_offset if buffer == SCRATCH else 0)

        steps = self._codec_steps(program, address_of)
        return tuple(sum(1 for kind, j, _ in steps if kind is LAUNCH and j == k) for k in range(len(self.devices)))

    def traffic(self, plan):
        """Bytes of device memory an uncompressed `plan`'s launches read plus
        write, all devices: plan.traffic, less what fan-out groups share."""
        return sum(groups_traffic(step[2].rows, step[2].fanout, plan.dtype.itemsize)
                   for step in self._program(plan).steps if step[0] is LAUNCH)

    def _program(self, plan):
        entry = self._programs.get(id(plan))
        return entry if entry is not None and entry.plan is plan else self._prepare(plan)

    # -- life cycle ------------------------------------------------------------

    def barrier(self, deadline):
        pass  # ranks in one process: every call is already collective

    def use_timeout(self, seconds):
        """The communicator's timeout (Communicator.timeout): how long a
        one-kernel call's kernels wait for a peer."""
        if self.peer_ll is not None:
            self.peer_ll.use_timeout(seconds)

    def synchronize(self, deadline):
        """Communicator.synchronize: every device's work done, and a one-kernel
        call that gave up reported (its kernels' waits are bounded by the timeout)."""
        for device in self.devices:
            device.synchronize()
        if self.peer_ll is not None and self.peer_ll.used:
            self.peer_ll.check()

    def abort(self, reason):
        if self.peer_ll is not None:
            self.peer_ll.abort(reason)

    def close(self):
        for device in self.devices:
            device.synchronize()
        if self.peer_ll is not None:
            self.peer_ll.close()
        self.selector.forget()
        self._workspaces = [None] * len(self.rank_devices)
        self._workspaces_replaced += 1   # no bound program keeps a freed workspace's address
        self._retired.clear()
        self._programs.clear()
        self._layouts.clear()
        self._codec_records.clear()


class EventsPath(Path):
    """The events path: every call of ranks in one process, each phase one
    plan_step launch per device (codec launches where compressed), ordered
    between devices by events (see the module doc). DeviceRanks holds its
    programs, workspaces and address tables."""

    name = "events"

    def __init__(self, ranks):
        self.ranks = ranks
        # A call is DeviceRanks.run_program(route, inputs, outputs, deadline)
        # itself: no frame of this class's on the per-call path.
        self.run = ranks.run_program

    def serves(self, plan):
        return True

    def prepare(self, plan, arrays=None):
        return self.ranks._program(plan)

    def launches(self, plan):
        return self.ranks.program_launches(plan)

    def bind(self, route, inputs, outputs):
        return BoundProgram(self.ranks, route.call, inputs, outputs)


class BoundProgram:
    """A program bound to one call's arrays (DeviceRanks.bind): its launch
    record, and the address table of those arrays, made once. What a call
    must still do each time: read each device's current stream (the caller
    may have made another current, a graph capture does), point the
    program's address blocks at this table when another call of the same
    plan moved them, and issue the launches.

    The table also holds the ranks' workspaces; when one has grown since it
    was made (DeviceRanks._workspaces_replaced), it is made anew."""

    def __init__(self, ranks, program, input_infos, output_infos):
        self._ranks, self._program = ranks, program
        self._input_infos, self._output_infos = input_infos, output_infos
        self._devices = tuple(ranks.devices)
        self._record = program.record   # (device index, issue(stream)) per step
        # On one device every step goes to its stream: the issues alone.
        self._one_device = len(self._devices) == 1
        self._issues = tuple(issue for _, issue in program.record)
        self._make_table()

    def _make_table(self):
        ranks = self._ranks
        self._workspaces_replaced = ranks._workspaces_replaced
        self._table = ranks._addresses(self._program.plan, self._input_infos, self._output_infos)

    def run(self, arrays=None):
        """Issue the program on each device's current stream; `arrays` (the
        call's, as VirtualHostRanks' bound form takes them) are those bound."""
        devices = self._devices
        if self._one_device:
            stream = devices[0].current_stream()
        else:
            streams = [device.current_stream() for device in devices]
            if any(d.is_capturing(s) for d, s in zip(devices, streams)):
                raise InvalidUsageError(
                    "capturing a collective in a CUDA graph works when all ranks share one GPU; "
                    f"these ranks use {len(devices)} devices")
        if self._workspaces_replaced != self._ranks._workspaces_replaced:
            self._make_table()
        program, table = self._program, self._table
        if program.patched[0] is not table:
            for block in program.blocks:
                block.update(table)
            program.patched[0] = table
        if self._one_device:
            for issue in self._issues:
                issue(stream)
            devices[0].call_returned()
            return
        for k, issue in self._record:
            issue(streams[k])
        for device in devices:
            device.call_returned()
