"""GPU ranks in separate processes: one rank per process, each on a device
(a GPU, which several processes may share, or an emulated device).

The same step protocol as host ranks (transport/protocol.py), with two
differences:

* a rank's workspace is device memory its peers open through CUDA IPC (the
  emulated device does the same with a file in /dev/shm), once per
  generation: at the first call that needs it, and again when it grows;
* a phase is one launch of the step kernel on the caller's current stream,
  over this rank's rows of the plan's table. The host records an event after
  it, polls the event against the deadline (a GPU that never finishes is a
  timeout, not a hang), and only then publishes the phase's counter, so a
  peer that sees the counter may read what the phase wrote.

A user's array enters the workspace by one copy row and leaves it by one (the
plan's workspace bindings; a block only its own rank receives, an exchange's
own, goes from input to output by one row), as NCCL's eager path does: peers
read only workspaces, never a caller's arrays. Because the host waits between
phases, a call returns with its work complete, and cannot be captured in a
CUDA graph.

That is the step path (StepProtocolPath), which serves every call. With
$COLLECTIVES_ONE_KERNEL_ALLREDUCE=1 (config.py) the selector (paths.py)
asks three paths with no host in the loop first, in this order: ll
(ll_collectives.py: small calls of every collective as one kernel), symmetric
(symmetric.py: on the caller's arrays where they lie in symmetric memory,
Communicator.alloc: barrier, step kernel, barrier) and staged (the same
through staging buffers, on any arrays). They take the plans with the
`direct` plan's bits; the step protocol then runs only the other plans
(ring or tree of 3 ranks or more, compression). Their calls return as soon
as their kernels are queued, and can be captured in a graph
(Communicator.graph(): `capturable`, begin_capture, replay_graph). Every
call, whatever its path, is recorded first (device_protocol.CallRecords),
so that a rank whose call differs from its peers', and so may take another
path, is named at once.
"""

from typing import NamedTuple, Optional, Tuple

from .. import config, kernels
from ..algorithms.schedule import REDUCING_COLLECTIVES
from ..errors import CollectiveError, InvalidUsageError
from ..ops import ReduceOp
from ..binding import INPUT, OUTPUT
from ..compression import kernels as codecs
from ..compression import wire
from ..plan import NSRC, SCRATCH, SRC0, SRC_BUF, SRC_RANK, WORK
from ..transport.protocol import ProcessGroup, describe_call
from ..transport.recovery import Recoverable
from .device import grid_for
from .device_protocol import CallRecords, DeviceProtocol, signature
from .ll_collectives import LLPath
from .paths import PLAIN, Path, Route, Selector
from .symmetric import StagedPath, SymmetricMemory, SymmetricPath


class PhaseLaunch(NamedTuple):
    table: object                 # this rank's rows, in device memory
    width: int
    grid: Tuple[int, int]
    workspaces: Tuple[int, ...]   # ranks whose workspace the rows name


class Program(NamedTuple):
    plan: object
    instance: kernels.StepInstance
    divisor: int
    description: str
    launches: Tuple[Optional[PhaseLaunch], ...]  # per phase; None where this rank has no rows


class DeviceMemory:
    """The memory kind (protocol.py) of GPU ranks: IPC-shareable device memory."""

    def __init__(self, device):
        self.device = device

    def create(self, name, nbytes):
        return self.device.allocate_shared(nbytes, name)

    def open(self, handle):
        return self.device.open_shared(handle)

    def release(self, memory, own):
        self.device.release_shared(memory, own)


class DeviceProcessRank(Recoverable):
    """This process's rank, on `device`, of a communicator of processes
    (agree and shrink: transport/recovery.Recoverable)."""

    addressable = False  # peers open only each other's workspaces
    host_only = False
    compresses = True    # runs compressed plans, with the codec kernels
    transport = "gpu-processes"   # which cost model `auto` asks

    def __init__(self, rank, size, prefix, device):
        self.rank, self.size, self.prefix = rank, size, prefix
        self.device = device
        self.devices = self.rank_devices = [device]
        self.locations = [device.array_location]
        self.group = ProcessGroup(rank, size, prefix, DeviceMemory(device))
        self.step = StepProtocolPath(rank, size, device, self.group)
        self.protocol = self.memory = self.records = None
        paths = ()
        if config.resolve_one_kernel_allreduce():
            self.records = CallRecords(rank, size, self.group)
            self.protocol = self.step.protocol = DeviceProtocol(rank, size, prefix, device, self.group, self.records)
            self.memory = SymmetricMemory(rank, size, prefix, device, self.protocol)
            paths = (LLPath(self.protocol), SymmetricPath(self.memory), StagedPath(self.memory))
        self.selector = Selector(paths, self.step)
        self._routes = self.selector.by_plan.get
        self._captured = None   # while Communicator.graph() captures: the plans of the calls captured

    # -- a call -------------------------------------------------------------------------

    def run(self, plan, inputs, outputs, input_infos, output_infos, deadline):
        """Run `plan` on this rank's arrays (their ArrayInfos) on the path the
        selector chooses; recorded first, where the one-kernel paths are on.
        The selector's memory and the records' are read here first: a known
        plan whose path the buffers do not decide costs two lookups, and no
        call but the path's."""
        source, result = input_infos[0], output_infos[0]
        route = self._routes(id(plan))
        if route is None or route.__class__ is not Route or route.plan is not plan:
            route = self.selector.route(plan, source, result)
        captured = self._captured
        if captured is not None:   # a capture: recorded when the graph is replayed
            route.path.run(route, source, result, deadline)
            captured.append(plan)
            return
        records = self.records
        if records is not None:
            known = records.known(id(plan))
            if known is None or known[0] is not plan:
                known = records.learn(plan)
            records.record(known[1], known[2])
        route.path.run(route, source, result, deadline)

    def chosen_path(self, plan, kind=PLAIN):
        """The path a call of `plan` takes on buffers of `kind` (paths.PLAIN,
        or paths.SYMMETRIC: its arrays in symmetric memory)."""
        return self.selector.select(plan, kind).name

    def launches(self, plan, kind=PLAIN):
        """Kernel launches this rank makes for a call of `plan` on buffers of `kind`."""
        return self.selector.select(plan, kind).launches(plan)

    # -- graphs and symmetric memory ------------------------------------------------------

    @property
    def capturable(self):
        """Whether Communicator.graph() may capture calls: those of the
        paths with no host in the loop (the step path refuses while capturing)."""
        return self.protocol is not None

    def begin_capture(self):
        """Communicator.graph(): the device's capture, and the calls made
        meanwhile noted (a replay is recorded as one call of them all)."""
        capture = self.device.begin_capture()
        self._captured = []
        return capture

    def end_capture(self, capture):
        """The captured graph (a _Replay), and the capture's end."""
        plans, self._captured = self._captured, None
        graph = self.device.end_capture(capture)
        descriptions = [describe_call(plan) for plan in plans or ()]
        text = f"a replay of a graph of {len(descriptions)} calls: " + "; ".join(descriptions)
        return _Replay(graph, signature(text), text.encode())

    def replay_graph(self, graph):
        """Graph.replay for these ranks: recorded as one call, ordered after
        the previous call, a kernel that gave up reported."""
        self.records.record(graph.signature, graph.description)
        self.protocol.replay_graph(graph.graph)

    def allocate_symmetric(self, shape, dtype, exchange):
        """Communicator.alloc: an array in symmetric memory (symmetric.py)
        where the one-kernel paths are on; else a plain array of the device,
        on which calls take the step protocol."""
        if self.memory is None:
            return self.device.empty(shape, dtype)
        array = self.memory.allocate(shape, dtype, exchange)
        self.selector.forget_buffers()   # a plain array's address may lie in it now: every rank forgets alike
        return array

    # -- life cycle ------------------------------------------------------------------------

    def barrier(self, deadline):
        if self.records is not None:
            self.records.record(BARRIER_SIGNATURE, b"barrier")
        if self.protocol is not None and self.protocol.used:
            # Done reading the peers' LL areas (close() follows a barrier),
            # and a kernel that gave up is reported here, not waited for.
            self.device.synchronize()
            self.protocol.check()
        self.group.barrier(deadline)

    def synchronize(self, deadline):
        """Communicator.synchronize: this rank's work done, and a kernel that
        gave up reported. Every kernel's wait is bounded by the timeout."""
        self.device.synchronize()
        if self.protocol is not None and self.protocol.used:
            self.protocol.check()

    def abort(self, reason, cause=CollectiveError):
        """Abort the communicator for every rank: theirs raise `cause`'s class (protocol.py)."""
        self.group.abort(reason, cause)

    def remake(self, rank, size, prefix):
        """This rank's like, for another communicator (a shrunk one): on the
        same device, with workspaces, IPC buffers and flags of its own."""
        return DeviceProcessRank(rank, size, prefix, self.device)

    def close(self):
        self._forget_recovery()
        try:
            self.device.synchronize()
        finally:
            if self.protocol is not None:
                self.memory.release()
                self.protocol.close()
            self.selector.forget()
            self.step.forget()
            self.group.close()


BARRIER_SIGNATURE = signature("barrier")


class _Replay(NamedTuple):
    """A graph captured by DeviceProcessRank: the device's, and its record."""
    graph: object
    signature: int
    description: bytes


class StepProtocolPath(Path):
    """The step path: every call, phase by phase, a step-kernel launch per
    phase whose event the host polls, the peers' counters waited for
    between phases (transport/protocol.py; see the module doc)."""

    name = "step"

    def __init__(self, rank, size, device, group):
        self.rank, self.size, self.device, self.group = rank, size, device, group
        self.protocol = None   # the device protocol, where the one-kernel paths are on
        self._event = device.new_event()
        self._programs = {}    # id(plan) -> Program
        self._tables = {}      # (phase launch, workspace generations, input, output) -> buffer table

    def serves(self, plan):
        return True

    def prepare(self, plan, arrays=None):
        return self._program(plan)

    def launches(self, plan):
        return sum(launch is not None for launch in self._program(plan).launches)

    def run(self, route, input_info, output_info, deadline):
        plan, program = route.plan, route.call
        protocol = self.protocol
        if protocol is not None and protocol.used:
            protocol.check()   # a kernel of an earlier call gave up: this call must not wait for it
        device, event, group = self.device, self._event, self.group
        stream = device.current_stream()
        if device.is_capturing(stream):
            raise InvalidUsageError(
                "a collective between processes waits on the host between its phases, so it cannot be "
                "captured in a CUDA graph; capture works for ranks in one process on one GPU")
        instance, divisor = program.instance, program.divisor
        source, result = input_info.address, output_info.address

        def execute_phase(p, waiter):
            launch = program.launches[p]
            if launch is None:
                return
            addresses = self._buffer_table(plan, launch, source, result)
            device.launch_step(stream, instance, launch.grid, launch.table, launch.width, addresses, divisor)
            device.record(event, stream)
            waiter.until(lambda: device.query(event),
                         lambda: f"{device.name} to finish phase {p} of {program.description}",
                         group.check_health)

        if plan.compression is not None:
            execute_phase = self._codec_phases(plan, program, stream, source, result)

        group.run(plan, program.description, execute_phase, deadline)

    def _codec_phases(self, plan, program, stream, source, result):
        """execute_phase for a compressed plan: this rank's codec operations
        (compression/wire.py) as codec_batch launches on peers' mapped
        workspaces (compression/kernels.py: batch_rows), then the same event
        poll as a step launch."""
        device, event, group = self.device, self._event, self.group
        users = {INPUT: source, OUTPUT: result}

        def address_of(rank, buffer):
            if buffer in users:
                return users[buffer]
            base = group.workspace(rank).address
            return base + plan.scratch_offset if buffer == SCRATCH else base

        f, w = wire.device_regions(plan, address_of)

        def execute_phase(p, waiter):
            ops = plan.phases[p].wire_ops_by_rank[self.rank]
            if not ops:
                return
            rows = (codecs.device_row(kernel, plan.compression, args, divisor)
                    for kernel, args, divisor in wire.codec_launches(ops, f, w))
            for batch in codecs.batch_rows([row for row in rows if row is not None], plan.compression):
                device.launch_codec_batch(stream, plan.compression, batch)
            device.record(event, stream)
            waiter.until(lambda: device.query(event),
                         lambda: f"{device.name} to finish phase {p} of {program.description}",
                         group.check_health)

        return execute_phase

    def _buffer_table(self, plan, launch, source, result):
        """Per rank WORK, SCRATCH, INPUT, OUTPUT: workspaces for the ranks
        this phase names (a peer's is its current generation, which the waits
        before the phase made current), the caller's arrays for this rank."""
        group = self.group
        key = (launch, tuple(group.generation(r) for r in launch.workspaces), source, result)
        table = self._tables.get(key)
        if table is None:
            addresses = [0] * (kernels.BUFFERS * self.size)
            for rank in launch.workspaces:
                work = group.workspace(rank).address
                addresses[kernels.BUFFERS * rank:kernels.BUFFERS * rank + 2] = (work, work + plan.scratch_offset)
            addresses[kernels.BUFFERS * self.rank + 2:kernels.BUFFERS * self.rank + 4] = (source, result)
            table = kernels.buffer_table(addresses)
            table.setflags(write=False)
            if len(self._tables) >= 256:
                self._tables.clear()
            self._tables[key] = table
        return table

    def _prepare(self, plan):
        """Upload this rank's rows of every phase, once per plan."""
        launches = []
        for phase in plan.phases:
            rows = phase.rows_by_rank[self.rank]
            if not len(rows):
                launches.append(None)
                continue
            named = {self.rank} if plan.workspace_bytes else set()
            for row in rows:
                for i in range(int(row[NSRC])):
                    if row[SRC0 + 3 * i + SRC_BUF] in (WORK, SCRATCH):
                        named.add(int(row[SRC0 + 3 * i + SRC_RANK]))
            launches.append(PhaseLaunch(self.device.upload(rows), rows.shape[1],
                                        grid_for(rows, self.device, plan.dtype.itemsize), tuple(sorted(named))))
        program = Program(
            plan, kernels.step_instance(plan.dtype, ReduceOp(plan.op), plan.collective in REDUCING_COLLECTIVES),
            kernels.step_divisor(ReduceOp(plan.op), plan.nranks), describe_call(plan), tuple(launches))
        if len(self._programs) >= 1024:
            self._programs.clear()
        self._programs[id(plan)] = program
        return program

    def _program(self, plan):
        entry = self._programs.get(id(plan))
        return entry if entry is not None and entry.plan is plan else self._prepare(plan)

    def forget(self):
        """Close: the programs' tables go with the device memory."""
        self._tables.clear()
        self._programs.clear()
