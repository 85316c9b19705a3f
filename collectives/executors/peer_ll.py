"""The peer_ll path (paths.py): small calls of the five collectives between
ranks on several GPUs of one process, one launch of kernels/ll_allreduce.cu
per GPU: the protocol of the ranks in separate processes
(ll_collectives.py, device_protocol.py), over peer access instead of CUDA
IPC.

Serves what the LL path serves (ll_collectives.fits: a one-pass plan,
small, uncompressed, the direct plan's bits), on any buffers. On the
events path (executors/device.py) the host orders every phase between
devices: a direct allreduce of k GPUs is k launches, k event records and
k(k-1) waits before them, and as many after (the join). Here a call is one
launch per device and nothing else:

    each rank's kernel    publishes its input, flagged, in its own LL area
                          (memory of its own GPU);
                          reads its peers' areas through peer access,
                          waiting for their flags itself;
                          writes its own output.

No kernel reads another rank's arrays, so no join either: once a device's
stream has run its kernel, that rank's arrays are the caller's again.
Consecutive calls are ordered by the kernels' state words and slot sets
(kernels/ll_allreduce.cu), on each rank's stream; a rank whose caller
switched streams gets an event from its previous stream, as across
processes.

Where it runs: ranks on two or more devices, one rank per device (two ranks
on one GPU would queue their kernels on its one stream, the second behind
the first, which waits for it), with COLLECTIVES_ONE_KERNEL_ALLREDUCE=1 as
for ranks in processes. Not inside a CUDA graph: a capture over several
devices is refused, as on the event path.

Set up at the first call: per rank an LL area (LL_AREA_BYTES, zeroed) on
its device, and the control words in page-locked host memory that every
device maps (registered once, portable): the abort word, then each rank's
fault word. A kernel that waits past the communicator's timeout (a device
whose stream is busy with other work for that long) writes its fault word
and stops; the call, the next one or synchronize() raises
CollectiveTimeoutError. A launch that fails after others were issued sets
the abort word, so the kernels already launched stop instead of waiting for
the one that never came. Either way the ranks' call counts no longer agree:
the path is then aborted, and every later call raises.
"""

import mmap

import numpy as np

from .. import kernels
from ..config import resolve_timeout
from ..errors import CollectiveError, InvalidUsageError
from ..transport.layout import LL_FAULT, LL_REGION_WORDS
from . import faults
from .device_protocol import order_after
from .ll_collectives import fits, prepare_call
from .paths import Path

ABORT_ROW = 0   # the control words' first row holds the abort word; rank r's row is r + 1


class PeerLLPath(Path):
    """The one-kernel calls of DeviceRanks whose ranks each have a GPU."""

    name = "peer_ll"

    def __init__(self, devices):
        if len(set(map(id, devices))) != len(devices) or not 2 <= len(devices) <= kernels.LL_MAX_RANKS:
            raise InvalidUsageError(f"the one-kernel path between devices takes 2 to {kernels.LL_MAX_RANKS} ranks, "
                                    "one per device")
        self.devices = tuple(devices)
        self._areas = None        # per rank: its LL area on its device
        self._control = None      # (mmap, the words as int64 (nranks + 1, LL_REGION_WORDS), mapped address)
        self._cells = ()          # the abort word and the fault words as ctypes cells (cheap to read)
        self._args = ()           # per rank: its kernel's arguments, the set-up fields filled
        self._streams = [None] * len(devices)   # per rank: the stream of its last call
        self._events = [device.new_event() for device in devices]
        self.timeout_ns = int(resolve_timeout(None) * 1e9)   # until the communicator sets its own
        self._issued_timeout_ns = 0
        self._last_call = ""      # the description of the last call, for errors
        self._last = None         # (LLCall, addresses, BoundPeerCall) of the last unbound call
        self._aborted = None      # why the path stopped: every later call raises it

    # -- which calls ----------------------------------------------------------------

    def serves(self, plan):
        return fits(plan)

    def prepare(self, plan, arrays=None):
        return prepare_call(plan)

    def launches(self, plan):
        return (1 if plan.count else 0,) * len(self.devices)

    @property
    def used(self):
        """Whether the areas are set up: kernels may have run, or be queued."""
        return self._areas is not None

    def generation(self, rank):
        """Rank `rank`'s call count (mod 2**32), read from its kernels' state
        words once its device is idle (for tests; the host keeps no count)."""
        if self._areas is None:
            return 0
        return faults.generation(self.devices[rank], self._areas[rank].address, f"rank {rank}'s")

    # -- a call ---------------------------------------------------------------------

    def use_timeout(self, seconds):
        """How long a kernel may wait for a peer: the communicator's timeout
        (Communicator.timeout), taken by every call issued from now on."""
        self.timeout_ns = int(seconds * 1e9)

    def run(self, route, inputs, outputs, deadline=None):
        """Issue the route's call for the ranks' arrays (ArrayInfos). A call
        on the addresses of the last one reuses its launches."""
        call = route.call
        addresses = (*(i.address for i in inputs), *(o.address for o in outputs))
        last = self._last
        if last is None or last[0] is not call or last[1] != addresses:
            last = self._last = (call, addresses, self.bind(route, inputs, outputs))
        last[2].run()

    def bind(self, route, inputs, outputs):
        """The route's call on these arrays (ArrayInfos), each rank's
        arguments made once: its run() only orders streams and launches."""
        self.ensure_setup()
        plan, call = route.plan, route.call
        args = []
        for rank, template in enumerate(self._args):
            a = type(template).from_buffer_copy(template)
            a.input, a.output, a.count = inputs[rank].address, outputs[rank].address, call.shape.count
            a.collective, a.root, a.signature = call.shape.collective, plan.root, call.signature
            a.divisor = call.divisor
            args.append(a)
        return BoundPeerCall(self, call, tuple(args),
                             tuple(launcher(device, call.instance, a) for device, a in zip(self.devices, args)))

    def issue(self, call, launches, timeout_ns):
        """One launch per device (`launches`: per rank, issue(stream)), on
        its current stream; then the faults seen."""
        self.check()
        self._issued_timeout_ns = timeout_ns   # for the message of a fault: the timeout the kernels had
        if call.shape.lines == 0:
            return   # nothing to exchange, and no launch: a state word would record 0 lines ("no call before")
        devices = self.devices
        streams = [device.current_stream() for device in devices]
        if any(d.is_capturing(s) for d, s in zip(devices, streams)):
            raise InvalidUsageError(
                "capturing a collective in a CUDA graph works when all ranks share one GPU; "
                f"these ranks use {len(devices)} devices")
        self._last_call = call.description
        launched = 0
        try:
            for rank, launch in enumerate(launches):
                if streams[rank] is not self._streams[rank]:
                    self._order_on(rank, streams[rank])
                launch(streams[rank])
                launched += 1
            for device in devices:
                device.call_returned()   # the emulated device runs them now; a GPU keeps them queued
        except BaseException as error:
            if launched:   # kernels wait for the rank that was not launched: stop them now
                self.abort(f"a launch of {call.description} failed: {type(error).__name__}: {error}")
            raise
        self.check()

    def _order_on(self, rank, stream):
        """Order `stream` after the rank's previous call, made on another
        stream (the kernel's state words rest on each rank's stream order)."""
        order_after(self.devices[rank], self._events[rank], self._streams[rank], stream)
        self._streams[rank] = stream

    # -- faults ---------------------------------------------------------------------

    def check(self):
        """Raise if the path was aborted or a kernel gave up."""
        if self._aborted is not None:
            raise CollectiveError(f"the one-kernel collectives between devices were aborted: {self._aborted}")
        for cell in self._cells:   # every call: a loop here, not a function (its frame is the cost)
            if cell.value:
                self._raise_fault()

    def _raise_fault(self):
        words = self._control[1]
        if words[ABORT_ROW, 0]:
            raise CollectiveError("the one-kernel collectives between devices were aborted")
        found = faults.decoded(words[ABORT_ROW + 1:, LL_FAULT])
        timed_out = faults.first(found, kernels.LL_FAULT_TIMED_OUT)
        if timed_out is not None:
            waiter, fault = timed_out
            error = faults.timeout_error(
                waiter, fault, self._issued_timeout_ns / 1e9, f"rank {fault.peer} (on {self.devices[fault.peer].name})",
                f" (one-kernel protocol, the last call {self._last_call}): was that device busy with other work "
                "queued before it for that long?")
        else:   # a mismatch cannot happen here (one call launches every rank), nor a stop without an abort
            error = faults.stopped_error(found)
        self.abort(f"{type(error).__name__}: {error}")
        raise error

    def abort(self, reason):
        """Stop every kernel of the path now, and every later call."""
        if self._aborted is None:
            self._aborted = reason
        if self._control is not None:
            self._control[1][ABORT_ROW, 0] = 1

    # -- set-up and close -----------------------------------------------------------

    def ensure_setup(self):
        if self._areas is not None:
            return
        n = len(self.devices)
        nbytes = 8 * (n + 1) * LL_REGION_WORDS
        buffer = mmap.mmap(-1, nbytes)   # page-aligned, zeroed: what cudaHostRegister maps whole
        words = np.frombuffer(buffer, np.int64).reshape(n + 1, LL_REGION_WORDS)
        # Registered once, portable: every device's kernels use the host address (unified addressing).
        mapped = self.devices[0].map_host(words.ctypes.data, nbytes)
        self._control = (buffer, words, mapped)
        areas = []
        try:
            for device in self.devices:
                area = device.allocate(kernels.LL_AREA_BYTES)
                device.clear_shared(area)   # a kernel takes a zero state word for "no call yet"
                areas.append(area)
        except BaseException:
            self.devices[0].unmap_host(mapped)
            self._control = None
            raise
        self._areas = areas
        row = 8 * LL_REGION_WORDS
        self._cells = (*faults.cells(words[ABORT_ROW:ABORT_ROW + 1], 0), *faults.cells(words[ABORT_ROW + 1:], LL_FAULT))
        templates = []
        for rank in range(n):
            args = kernels.LLAllreduceArgs()
            args.areas[:] = [a.address for a in areas] + [0] * (kernels.LL_MAX_RANKS - n)
            args.abort_word = mapped + 8 * ABORT_ROW * LL_REGION_WORDS
            args.faults = mapped + row * (ABORT_ROW + 1) + 8 * LL_FAULT
            args.rank, args.nranks = rank, n
            templates.append(args)
        self._args = tuple(templates)

    def close(self):
        """Release the areas and the control words: after the devices are idle."""
        if self._areas is None:
            return
        for device in self.devices:
            device.synchronize()
        self._areas = None
        self._cells = ()
        self.devices[0].unmap_host(self._control[2])
        self._control = None   # the mapping goes with its last view


class BoundPeerCall:
    """A call of PeerLLPath bound to its arrays (DeviceRanks.bind, and run
    for a call on the last call's arrays): each rank's arguments and launch
    made once. The launches read the arguments when issued, so the timeout,
    the one argument that may change (PeerLLPath.use_timeout), is written
    into them when it did."""

    def __init__(self, peers, call, args, launches):
        self._peers, self._call, self._args, self._launches = peers, call, args, launches
        self._timeout_ns = None

    def run(self, arrays=None):
        timeout_ns = self._peers.timeout_ns
        if timeout_ns != self._timeout_ns:
            for a in self._args:
                a.timeout_ns = timeout_ns
            self._timeout_ns = timeout_ns
        self._peers.issue(self._call, self._launches, timeout_ns)


def launcher(device, instance, args):
    """issue(stream): the kernel with `args` as they are at each launch, on
    `device`: its own prepared launch where it has one
    (CudaDevice.ll_launcher), else its launch_ll_allreduce."""
    prepared = getattr(device, "ll_launcher", None)
    if prepared is not None:
        return prepared(instance, args)
    return lambda stream: device.launch_ll_allreduce(stream, instance, args)
