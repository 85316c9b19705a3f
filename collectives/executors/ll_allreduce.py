"""The one-kernel collectives of small messages between GPU ranks in
separate processes: kernels/ll_allreduce.cu, with no host in the loop.

A call that fits (a plan whose bits are the `direct` plan's, uncompressed,
whose input a rank publishes fits its LL slot set: LL_MAX_BYTES, see
ACCEPTED) is one launch on the caller's current stream and returns at once:
no event, no counter, no wait on a peer. The kernel reads the caller's
input and writes its output directly; peers see only each rank's LL area.
The host does not count calls: the kernel does, in state words at the end
of the rank's LL area (kernels/ll_allreduce.cu), so a call's launch has the
same arguments every time it is made, and a CUDA graph of calls replays
correctly, interleaved with direct calls in any way (Communicator.graph();
replay_graph below). What the host does per call:

* orders the call after the previous one when the caller changed streams
  (an event), since the kernel's argument rests on stream order (a graph's
  replay likewise, once, before it; inside a graph the launches are in order);
* reads every rank's fault word and the communicator's abort flag (host
  memory, the control segment's LL region) before and after the launch,
  and raises if a kernel gave up: CollectiveTimeoutError naming the peer a
  kernel waited for, RankFailedError if that peer is dead; the
  communicator is then aborted for every rank, as the step protocol does.

At the first call each rank allocates its LL area (zeroed device memory,
LL_AREA_BYTES), publishes its handle in the LL region, waits for every
peer's (the only host wait, once) and opens them; the GPU maps the front of
the control segment so that kernels read the abort flag and fault words. A
watchdog thread then checks the peers' pids every 50 ms and aborts the
communicator when one dies: kernels waiting for it see the abort flag and
stop, and every rank raises RankFailedError, long before the timeout.

The areas live until close(), which the communicator calls after a barrier;
barrier() first waits for this rank's kernels (DeviceProcessRank.barrier),
so no peer's kernel still reads an area when it is released.
"""

import ctypes
import threading
import time

from typing import NamedTuple

import numpy as np

from .. import kernels
from ..algorithms.schedule import (
    ALLGATHER, ALLREDUCE, BROADCAST, REDUCE_SCATTER, REDUCE_TO_ROOT, REDUCING_COLLECTIVES,
)
from ..errors import CollectiveError, CollectiveTimeoutError, InvalidUsageError, RankFailedError
from ..ops import ReduceOp
from ..transport.layout import (
    ABORT, HANDLE_BYTES, LL_FAULT, LL_HANDLE_OFFSET, LL_READY, LL_REGION_WORDS, LL_STAGING, LL_STAGING_HANDLE_OFFSET,
    ll_mapped_bytes, ll_region_offset,
)
from ..transport.protocol import Counters, Waiter, describe_call

WATCHDOG_PERIOD_S = 0.05

# The collectives that run here, as the `direct` plan runs them (the
# kernel's step 3 is that plan's one step). Each rank publishes its input:
# the message (allreduce, broadcast, reduce), its block (allgather) or all
# n blocks (reduce_scatter), which must fit in LL_MAX_BYTES as whole lines
# per block (kernels.ll_shape).
ACCEPTED = frozenset({ALLREDUCE, ALLGATHER, BROADCAST, REDUCE_SCATTER, REDUCE_TO_ROOT})


def same_bits_as_direct(plan):
    """Whether every algorithm's plan of this call gives the `direct` plan's
    bits, which are the kernel's (each element folded in rank order in one
    accumulator): the direct plan itself; `two_shot` (each chunk folded
    once, by its owner, in rank order, then copied: what `auto` picks for
    large allreduces of 3 ranks and more); allgather and broadcast, which
    only copy; and a reduction of 2 ranks, whose one fold of two operands
    is commutative (sum and prod exactly; max and min by the one tie rule;
    avg divides once either way). `auto` gives 2 ranks' allgather and
    reduce_scatter the ring (a tie in the model), which would otherwise
    miss this path. One exception, in NaN payloads only: where both
    operands are NaN, the emulated device's sum keeps the first operand's
    payload, so a plan folding rank 1 first (ring) and the kernel may give
    NaNs of different payloads; a GPU gives its one canonical NaN either
    way, and results are compared as NaN (design: NaN compared as NaN)."""
    return plan.algorithm in ("direct", "two_shot") or plan.collective in (ALLGATHER, BROADCAST) or plan.nranks == 2


def takes(plan):
    """Whether `plan`'s call runs as one kernel: a plan of ACCEPTED whose
    bits are the kernel's (same_bits_as_direct), uncompressed, small."""
    return (plan.collective in ACCEPTED and same_bits_as_direct(plan) and plan.compression is None
            and plan.nranks <= kernels.LL_MAX_RANKS
            and kernels.ll_shape(plan.collective, plan.nranks, plan.count, plan.dtype.itemsize).fits)


class LLCall(NamedTuple):
    """What every call of a plan passes the kernel (prepare_call)."""
    plan: object
    shape: kernels.LLShape
    instance: kernels.LLInstance
    divisor: int
    signature: int
    description: str


def prepare_call(plan):
    """The LLCall of a plan that `takes` accepts, once per plan."""
    reducing = plan.collective in REDUCING_COLLECTIVES
    op = ReduceOp(plan.op) if reducing else ReduceOp.SUM   # copies: any instance of the dtype does
    return LLCall(plan, kernels.ll_shape(plan.collective, plan.nranks, plan.count, plan.dtype.itemsize),
                  kernels.ll_instance(plan.dtype, op), kernels.step_divisor(op, plan.nranks) if reducing else 0,
                  kernels.ll_signature(plan.count, plan.dtype, ReduceOp(plan.op), plan.collective, plan.root),
                  describe_call(plan))


class LLAllreduce:
    """This rank's side of the one-kernel collectives of a DeviceProcessRank."""

    def __init__(self, rank, size, prefix, device, group):
        self.rank, self.size, self.prefix = rank, size, prefix
        self.device, self.group = device, group
        region = group.ll_region()
        self._region = region
        self._words = region.view(np.int64)               # (size, LL_REGION_WORDS)
        self._faults = self._words[:, LL_FAULT]
        # The same words as ctypes cells: reading them is the per-call check,
        # and a cell's .value is several times cheaper than a NumPy reduction.
        self._fault_cells = tuple(ctypes.c_int64.from_buffer(self._words[q], 8 * LL_FAULT) for q in range(size))
        self._flags = Counters(self._words)
        self._own_area = None
        self._peer_areas = {}                               # rank -> opened memory
        self._peer_memory = []                              # peers' symmetric memory, opened here
        self._mapped = None                                 # the control segment's front, as kernels see it
        self._args = kernels.LLAllreduceArgs()
        self._calls = {}                                    # id(plan) -> LLCall
        self._declined = {}                                 # id(plan) -> a plan that does not run here
        self._call = ""                                     # the last call's description, for errors
        self._stream = None
        self._capture_stream = None                         # the stream of the capture under way (one_capture_stream)
        self._event = device.new_event()
        self._timeout_s = 0.0
        self._watchdog = None
        self._stop = threading.Event()

    def accepts(self, plan):
        """Whether `plan`'s call runs here: a plan of ACCEPTED whose bits are
        the kernel's (same_bits_as_direct), uncompressed, small. A plan run
        here before is known (a dictionary lookup per call)."""
        call = self._calls.get(id(plan))
        if call is not None and call.plan is plan:
            return True
        if self._declined.get(id(plan)) is plan:
            return False
        taken = takes(plan)
        if not taken:
            if len(self._declined) >= 256:
                self._declined.clear()
            self._declined[id(plan)] = plan   # (the plan is kept alive, so its id is not reused meanwhile)
        return taken

    @property
    def used(self):
        """Whether the LL area is set up: kernels may have run, or be queued."""
        return self._own_area is not None

    def generation(self):
        """The rank's LL call count (mod 2**32), read from the device's state
        words once its work is done (for tests and diagnostics; the host
        keeps no count). Every word must agree: each thread of the grid
        advanced its own."""
        if self._own_area is None:
            return 0
        words = np.frombuffer(self.device.download(self._own_area.address + kernels.LL_STATE_OFFSET,
                                                   8 * self.device.ll_grid_threads), np.uint64)
        generations = {kernels.ll_state(int(word)).generation for word in words}
        if len(generations) != 1:
            raise CollectiveError(f"the one-kernel state words disagree: generations {sorted(generations)}")
        return generations.pop()

    # -- a call -------------------------------------------------------------------

    def run(self, plan, source, result, deadline):
        self.check()
        call = self._calls.get(id(plan))
        if call is None or call.plan is not plan:
            call = self._prepare(plan)
        lines = call.shape.lines
        if lines == 0:
            return   # nothing to exchange, and no launch: the state words would record 0 lines ("no call before")
        device = self.device
        stream = device.current_stream()
        capturing = device.is_capturing(stream)
        self.ensure_setup(deadline, capturing, plan.collective)
        if not capturing:   # a graph is ordered when it is replayed (replay_graph)
            self.order_on(stream)
            self._call = call.description
        else:
            self.one_capture_stream(stream)
        args = self._args
        args.input, args.output, args.count = source, result, call.shape.count
        args.collective, args.root, args.signature = call.shape.collective, plan.root, call.signature
        args.timeout_ns = self.set_timeout(deadline)
        args.divisor = call.divisor
        device.launch_ll_allreduce(stream, call.instance, args)
        device.call_returned()   # the emulated device runs it now; a GPU keeps it queued
        self.check()

    def ensure_setup(self, deadline, capturing, collective):
        """Set up the LL area at the first call (this one, or the first on
        symmetric memory: executors/symmetric.py, whose barrier word it holds)."""
        if self._own_area is not None:
            return
        if capturing:   # allocating and the peers' handshake cannot be captured
            raise InvalidUsageError(
                f"graph: the first one-kernel {collective} of a communicator sets up memory its peers "
                "open, which cannot be captured: make each call once before capturing it")
        try:
            self._setup(deadline)
        except BaseException as error:   # the peers waiting for this rank's area learn of it at once
            self.group.abort(f"{type(error).__name__}: {error}", error)
            raise

    def one_capture_stream(self, stream):
        """Refuse a captured call on another stream than the capture's
        earlier ones: two captured streams (forked from the capture by an
        event) become branches of the graph that may run at once, and the
        kernels' state words and slots rest on this rank's calls running one
        after another. (A capture that ended leaves no claim: its stream no
        longer captures.)"""
        held = self._capture_stream
        if held is None or not self.device.is_capturing(held):
            self._capture_stream = stream
            return
        if held is not stream and getattr(held, "ptr", held) != getattr(stream, "ptr", stream):
            raise InvalidUsageError(
                "graph: this capture's calls between processes were made on two streams, which its replay "
                "may run at once; the one-kernel calls of a rank must run one after another: make them on "
                "one stream")

    def set_timeout(self, deadline):
        """The call's timeout, kept for its error message: in ns, as kernels take it."""
        self._timeout_s = max(deadline - time.perf_counter(), 0.0)
        return int(self._timeout_s * 1e9)

    def describe_call(self, description):
        """What a fault on this rank's own call names (a direct call's)."""
        self._call = description

    def args_copy(self):
        """The kernels' arguments as set up (areas, abort and fault words, ranks)."""
        return type(self._args).from_buffer_copy(self._args)

    def hold_peer_memory(self, opened):
        """Unmap a peer's memory at close, with the LL areas (symmetric memory)."""
        self._peer_memory.append(opened)

    def exchange_staging(self, own, capacity, deadline):
        """Publish this rank's new staging buffer (executors/symmetric.py)
        in the LL region and wait for every peer's, of at least `capacity`
        bytes (every rank grows at the same call, to the same size); open
        them. Every rank's address of its peers' buffers, this rank's own
        at its place. (A peer reads the handle before it may change again:
        the next growth comes after this call's barriers.)"""
        handle = np.frombuffer(own.handle, np.uint8)
        mine = self._region[self.rank, LL_STAGING_HANDLE_OFFSET:LL_STAGING_HANDLE_OFFSET + HANDLE_BYTES]
        mine[:] = 0
        mine[:len(handle)] = handle
        self._flags.publish(self.rank, LL_STAGING, capacity)   # last: a peer that sees it sees the handle
        waiter = Waiter(deadline)
        group = self.group
        addresses = []
        for peer in range(self.size):
            if peer == self.rank:
                addresses.append(own.address)
                continue
            published = self._flags.loader(peer, LL_STAGING)
            waiter.until(lambda: published() >= capacity,
                         lambda: f"rank {peer} to grow its staging buffer to {capacity} bytes"
                                 f"{group.absent_note(group._seq)}",
                         lambda: group.check_health(peer, "growing its staging buffer"))
            seen = published()
            peer_handle = bytes(self._region[peer, LL_STAGING_HANDLE_OFFSET:LL_STAGING_HANDLE_OFFSET + HANDLE_BYTES])
            if published() != seen:   # it grew again meanwhile: the handle read may be torn
                raise CollectiveError(f"rank {peer} replaced its staging buffer while rank {self.rank} opened it "
                                      "(the ranks' calls are out of step)")
            try:
                opened = self.device.open_shared(peer_handle)
            except CollectiveError:
                # A peer that gave up on this growth (another rank failed it)
                # releases its buffer: say why, the abort, if that is what happened.
                group.check_health(peer, "growing its staging buffer")
                raise
            self.hold_peer_memory(opened)
            addresses.append(opened.address)
        return tuple(addresses)

    def order_on(self, stream):
        """Order what runs next on `stream` after this rank's previous call
        (the kernel's state words and slot reuse rest on stream order)."""
        if self._stream is not None and stream is not self._stream and \
                getattr(stream, "ptr", stream) != getattr(self._stream, "ptr", self._stream):
            self.device.record(self._event, self._stream)
            self.device.wait(stream, self._event)
        self._stream = stream

    def replay_graph(self, graph):
        """Replay a captured graph (Graph.replay) on the current stream: its
        one-kernel calls take their generations from the state words, so
        they interleave with direct calls; a kernel that gave up is
        reported as after a direct call (at once on the emulated device,
        whose replay runs the graph; on a GPU at the next call or
        synchronize())."""
        self.check()
        device = self.device
        if self._own_area is not None:
            self.order_on(device.current_stream())
            self._call = "a call of a replayed graph"
        device.replay(graph)
        self.check()

    def _prepare(self, plan):
        """What every call of `plan` passes the kernel, once per plan."""
        call = prepare_call(plan)
        if len(self._calls) >= 256:
            self._calls.clear()
        self._calls[id(plan)] = call
        return call

    def check(self):
        """Raise if the communicator was aborted or any rank's kernel gave up."""
        self.group.check_health()
        for cell in self._fault_cells:
            if cell.value:
                self._raise_fault()

    def _raise_fault(self):
        """The error of a kernel that gave up, on every rank: a timeout names
        the peer it waited for (RankFailedError if that peer is dead)."""
        faults = [(rank, kernels.ll_fault(int(word))) for rank, word in enumerate(self._faults) if word]
        mismatched = [(rank, fault) for rank, fault in faults if fault.reason == kernels.LL_FAULT_MISMATCH]
        if mismatched:
            rank, fault = mismatched[0]
            mine = f": {self._call}" if rank == self.rank else ""
            error = InvalidUsageError(
                f"rank {fault.peer} made a different call from rank {rank}'s one-kernel {fault.collective} "
                f"#{fault.generation}{mine} (another collective, count, dtype, op or root, or another place in "
                "symmetric memory); every rank must "
                "make the same calls in the same order")
            self.group.abort(f"{type(error).__name__}: {error}", error)
            raise error
        timed_out = [(rank, fault) for rank, fault in faults if fault.reason == kernels.LL_FAULT_TIMED_OUT]
        if timed_out:
            waiter, fault = timed_out[0]
            peer = fault.peer
            during = f"its part of {fault.collective} #{fault.generation} on the device (one-kernel protocol)"
            try:
                self.group.check_health(peer, during)   # dead: RankFailedError; aborted meanwhile: that class
            except CollectiveError as error:
                self.group.abort(f"{type(error).__name__}: {error}", error)
                raise
            error = CollectiveTimeoutError(
                f"rank {waiter} timed out after {self._timeout_s:.1f} s waiting for rank {peer} to write {during}: "
                f"it has not (has rank {peer} stopped calling, or is it making other calls?)")
        else:
            self.group.check_health()   # a kernel stopped for the abort flag: its class
            error = CollectiveError(f"the one-kernel collective stopped on ranks {[rank for rank, _ in faults]}")
        self.group.abort(f"{type(error).__name__}: {error}", error)
        raise error

    # -- set-up, the watchdog, close -------------------------------------------------

    def _setup(self, deadline):
        device, group = self.device, self.group
        if self._mapped is None:
            header = group.channel_addresses()[0]   # the segment's start: header, rows, ..., LL region
            self._mapped = (header, device.map_host(header, ll_mapped_bytes(self.size)))
        own = device.allocate_shared(kernels.LL_AREA_BYTES, f"{self.prefix}-r{self.rank}-ll")
        device.clear_shared(own)
        self._own_area = own
        handle = np.frombuffer(own.handle, np.uint8)
        mine = self._region[self.rank, LL_HANDLE_OFFSET:LL_HANDLE_OFFSET + HANDLE_BYTES]
        mine[:] = 0
        mine[:len(handle)] = handle
        self._flags.publish(self.rank, LL_READY, 1)   # last: a peer that sees it sees the handle
        waiter = Waiter(deadline)
        areas = [0] * kernels.LL_MAX_RANKS
        areas[self.rank] = own.address
        for peer in range(self.size):
            if peer == self.rank:
                continue
            ready = self._flags.loader(peer, LL_READY)
            waiter.until(lambda: ready() == 1,
                         lambda: f"rank {peer} to set up the one-kernel collectives{group.absent_note(group._seq)}",
                         lambda: group.check_health(peer, "setting up the one-kernel collectives"))
            handle = bytes(self._region[peer, LL_HANDLE_OFFSET:LL_HANDLE_OFFSET + HANDLE_BYTES])
            self._peer_areas[peer] = opened = device.open_shared(handle)
            areas[peer] = opened.address
        mapped = self._mapped[1]
        args = self._args
        args.areas[:] = areas
        args.abort_word = mapped + 8 * ABORT
        args.faults = mapped + ll_region_offset(self.size) + 8 * LL_FAULT
        args.rank, args.nranks = self.rank, self.size
        assert LL_REGION_WORDS == 32   # kLLRegionWords; the emulated library checks it too
        self._watchdog = threading.Thread(target=self._watch, name=f"collectives-ll-watchdog-r{self.rank}",
                                          daemon=True)
        self._watchdog.start()

    def _watch(self):
        """Abort the communicator when a peer dies: a kernel waiting for it
        sees the abort flag and stops (it cannot look at pids itself)."""
        peers = [peer for peer in range(self.size) if peer != self.rank]
        while not self._stop.wait(WATCHDOG_PERIOD_S):
            for peer in peers:
                try:
                    self.group.check_health(peer, "its calls of the one-kernel collectives")
                except RankFailedError as error:
                    self.group.abort(f"{type(error).__name__}: {error}", error)
                    return
                except CollectiveError:
                    return   # aborted already: the kernels stop for it
                except Exception:   # noqa: BLE001 - the group is closing under this thread
                    return

    def close(self):
        """Release the areas: after every rank's kernels are done (see the top)."""
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.join(timeout=1.0)
            self._watchdog = None
        device = self.device
        for opened in [*self._peer_areas.values(), *self._peer_memory]:
            device.release_shared(opened, own=False)
        self._peer_areas.clear()
        self._peer_memory.clear()
        if self._own_area is not None:
            device.release_shared(self._own_area, own=True)
            self._own_area = None
        if self._mapped is not None:
            device.unmap_host(self._mapped[0])
            self._mapped = None
        self._region = self._words = self._faults = self._flags = self._fault_cells = None
