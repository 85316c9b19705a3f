"""This rank's side of the device protocol between GPU ranks in separate
processes: what the paths with no host in the loop (ll_collectives.py: ll;
symmetric.py: symmetric, staged) share, and the call records that name a
rank whose call takes another path than its peers'.

The kernels (kernels/ll_allreduce.cu: ll_allreduce, ll_barrier) count the
calls themselves, in state words at the end of the rank's LL area, and
wait for their peers' flags there; so a call's launches have the same
arguments every time it is made, and a CUDA graph of calls replays
correctly, interleaved with direct calls in any way (Communicator.graph();
replay_graph below). What the host does per call (`begin`, `end`):

* orders the call after the previous one when the caller changed streams
  (an event), since the kernels' argument rests on stream order (a graph's
  replay likewise, once, before it; inside a graph the launches are in
  order), and refuses a capture on a second stream;
* reads every rank's fault word and the communicator's abort flag (host
  memory, the control segment's LL region) before and after the launches,
  and raises if a kernel gave up (faults.py): CollectiveTimeoutError naming
  the peer a kernel waited for, RankFailedError if that peer is dead,
  InvalidUsageError if a kernel read a peer's flag of another call; the
  communicator is then aborted for every rank, as the step protocol does.

At the first call each rank allocates its LL area (zeroed device memory,
LL_AREA_BYTES: the LL slot sets, the state words, ll_barrier's word),
publishes its handle in the LL region, waits for every peer's (the only
host wait, once) and opens them; the GPU maps the front of the control
segment so that kernels read the abort flag and fault words. A watchdog
thread then checks the peers' pids every 50 ms and aborts the communicator
when one dies: kernels waiting for it see the abort flag and stop, and
every rank raises RankFailedError, long before the timeout. It checks the
call records too (below).

The areas live until close(), which the communicator calls after a barrier;
barrier() first waits for this rank's kernels (DeviceProcessRank.barrier),
so no peer's kernel still reads an area when it is released.

Call records. Each path checks that the ranks make the same call only
among the ranks on it: the LL kernel by the signature in its flags, the
barrier of symmetric and staged calls by its word's signature, the step
protocol by the row's SIG. Ranks whose calls differ may choose different
paths (paths.py) and never meet in one check: each would wait for the
other until the timeout. So every call of a rank (every path, barriers,
a graph's replay as one) is numbered and recorded before it runs: in the
control segment, rank r's record of its call k is one word, k's low 32
bits and 32 bits of the call's signature (describe_call: collective,
count, dtype, op, root, algorithm; and compression), with the call's
description beside it for messages. Before a call runs, its rank records
it and compares it with each peer's record of the same number: another
call there is InvalidUsageError, at once, with nothing launched, and the
communicator is aborted with that class, so the peers' kernels and waits
stop and every rank raises it. The rank that comes second to a call finds
it; the watchdog compares the last call's records every 50 ms besides
(two ranks that record at the same instant may each read the other's
record before it lands), as do the host waits of the first call's set-up.
A record is one 64-bit word, so it is read whole; the description beside
it is for the message only. The records are a ring of CALL_RECORDS per
rank: a peer that many calls ahead has overwritten the record, and a
mismatch with it is left to the paths' own checks and the timeout.
"""

import ctypes
import hashlib
import threading
import time

import numpy as np

from .. import kernels
from ..errors import CollectiveError, InvalidUsageError, RankFailedError
from ..transport.layout import (
    ABORT, CALL_DESCRIPTION_BYTES, CALL_RECORD_BYTES, CALL_RECORDS, HANDLE_BYTES, LL_FAULT, LL_HANDLE_OFFSET,
    LL_READY, LL_REGION_WORDS, LL_STAGING, LL_STAGING_HANDLE_OFFSET, ll_mapped_bytes, ll_region_offset,
)
from ..transport.protocol import Counters, Waiter, describe_call
from . import faults

WATCHDOG_PERIOD_S = 0.05


def same_stream(a, b):
    """Whether two streams are one (CuPy makes a new object per query of the current one)."""
    return a is b or getattr(a, "ptr", a) == getattr(b, "ptr", b)


def order_after(device, event, previous, stream):
    """Order what runs next on `stream` after the work queued on `previous`
    (the stream of the rank's last one-kernel call, or None): the kernels'
    state words and slot reuse rest on each rank's calls running in order."""
    if previous is not None and not same_stream(previous, stream):
        device.record(event, previous)
        device.wait(stream, event)


class DeviceProtocol:
    """This rank's LL area, its peers', the control words its kernels read,
    stream order, the watchdog; for the paths of a DeviceProcessRank with
    no host in the loop (see the module doc)."""

    def __init__(self, rank, size, prefix, device, group, records):
        self.rank, self.size, self.prefix = rank, size, prefix
        self.device, self.group, self.records = device, group, records
        region = group.ll_region()
        self._region = region
        self._words = region.view(np.int64)               # (size, LL_REGION_WORDS)
        self._faults = self._words[:, LL_FAULT]
        self._fault_cells = faults.cells(self._words, LL_FAULT)
        self._flags = Counters(self._words)
        self._own_area = None
        self._peer_areas = {}                               # rank -> opened memory
        self._peer_memory = []                              # peers' symmetric memory, opened here
        self._mapped = None                                 # the control segment's front, as kernels see it
        self._args = kernels.LLAllreduceArgs()             # the set-up fields: areas, abort and fault words, ranks
        self._call = ""                                     # the last call's description, for errors
        self._stream = None
        self._capture_stream = None                         # the stream of the capture under way (one_capture_stream)
        self._event = device.new_event()
        self._timeout_s = 0.0
        self._watchdog = None
        self._stop = threading.Event()

    @property
    def used(self):
        """Whether the LL area is set up: kernels may have run, or be queued."""
        return self._own_area is not None

    @property
    def own_area(self):
        """This rank's LL area (device memory), once set up (tests read its words)."""
        return self._own_area

    def generation(self):
        """The rank's one-kernel call count (mod 2**32), from the device's
        state words once its work is done (for tests and diagnostics)."""
        return faults.generation(self.device, self._own_area.address) if self._own_area is not None else 0

    # -- a call ---------------------------------------------------------------------

    def begin(self, collective, description, deadline):
        """What every call with no host in the loop does before its
        launches: check for a kernel that gave up, set up at the first call,
        order after the previous call (or keep a capture on one stream).
        Returns the stream to launch on."""
        self.check()   # a kernel of an earlier call gave up: this call must not launch
        device = self.device
        stream = device.current_stream()
        capturing = device.is_capturing(stream)
        if self._own_area is None:
            self.ensure_setup(deadline, capturing, collective)
        if not capturing:   # a graph is ordered when it is replayed (replay_graph)
            self.order_on(stream)
            self._call = description
        else:
            self.one_capture_stream(stream)
        return stream

    def end(self):
        """After a call's launches: the emulated device runs them now (a GPU
        keeps them queued), and a kernel that gave up is reported. (The LL
        path, whose calls are the smallest, does the same inline.)"""
        self.device.call_returned()
        self.check()

    def ensure_setup(self, deadline, capturing, collective):
        """Set up the LL area at the first call (of any of the paths: the
        area holds ll_barrier's word too)."""
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
        if not same_stream(held, stream):
            raise InvalidUsageError(
                "graph: this capture's calls between processes were made on two streams, which its replay "
                "may run at once; the one-kernel calls of a rank must run one after another: make them on "
                "one stream")

    def set_timeout(self, deadline):
        """The call's timeout, kept for its error message: in ns, as kernels take it."""
        self._timeout_s = max(deadline - time.perf_counter(), 0.0)
        return int(self._timeout_s * 1e9)

    def args_copy(self):
        """The kernels' arguments as set up (areas, abort and fault words, ranks)."""
        return type(self._args).from_buffer_copy(self._args)

    def hold_peer_memory(self, opened):
        """Unmap a peer's memory at close, with the LL areas (symmetric memory)."""
        self._peer_memory.append(opened)

    def exchange_staging(self, own, capacity, deadline):
        """Publish this rank's new staging buffer (symmetric.py) in the LL
        region and wait for every peer's, of at least `capacity` bytes
        (every rank grows at the same call, to the same size); open them.
        Every rank's address of its peers' buffers, this rank's own at its
        place. (A peer reads the handle before it may change again: the next
        growth comes after this call's barriers.)"""
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
                         lambda: self._check_waiting(peer, "growing its staging buffer"))
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
        """Order what runs next on `stream` after this rank's previous call."""
        if stream is not self._stream:
            order_after(self.device, self._event, self._stream, stream)
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

    # -- faults ------------------------------------------------------------------------

    def check(self):
        """Raise if the communicator was aborted or any rank's kernel gave up."""
        self.group.check_health()
        for cell in self._fault_cells:   # every call: a loop here, not a function (its frame is the cost)
            if cell.value:
                self._raise_fault()

    def _raise_fault(self):
        """The error of a kernel that gave up, on every rank: a mismatch, or
        a timeout naming the peer it waited for (RankFailedError if that
        peer is dead); the communicator is aborted with it."""
        found = faults.decoded(self._faults)
        error = faults.mismatch_error(found, self.rank, self._call)
        timed_out = faults.first(found, kernels.LL_FAULT_TIMED_OUT)
        if error is None and timed_out is not None:
            waiter, fault = timed_out
            peer = fault.peer
            during = f"its part of {fault.collective} #{fault.generation} on the device (one-kernel protocol)"
            try:
                self.group.check_health(peer, during)   # dead: RankFailedError; aborted meanwhile: that class
            except CollectiveError as failure:
                self.group.abort(f"{type(failure).__name__}: {failure}", failure)
                raise
            error = faults.timeout_error(waiter, fault, self._timeout_s, f"rank {peer}",
                                         f" on the device (one-kernel protocol): it has not (has rank {peer} "
                                         "stopped calling, or is it making other calls?)")
        elif error is None:
            self.group.check_health()   # a kernel stopped for the abort flag: its class
            error = faults.stopped_error(found)
        self.group.abort(f"{type(error).__name__}: {error}", error)
        raise error

    def _check_waiting(self, peer, during):
        """What a host wait of the protocol checks now and then: the peer
        alive, the communicator not aborted, the ranks' calls the same."""
        self.group.check_health(peer, during)
        self.records.check_last()

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
                         lambda: self._check_waiting(peer, "setting up the one-kernel collectives"))
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
        """Abort the communicator when a peer dies (a kernel waiting for it
        sees the abort flag and stops: it cannot look at pids itself), or
        when a peer's record of this rank's last call is another call."""
        peers = [peer for peer in range(self.size) if peer != self.rank]
        while not self._stop.wait(WATCHDOG_PERIOD_S):
            try:
                for peer in peers:
                    self.group.check_health(peer, "its calls of the one-kernel collectives")
                self.records.check_last()
            except (RankFailedError, InvalidUsageError) as error:
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


class CallRecords:
    """This rank's record of each of its calls, and its peers' (see the
    module doc): `record` (or `record_plan`) before a call runs,
    `check_last` now and then."""

    def __init__(self, rank, size, group):
        self.rank, self.size, self.group = rank, size, group
        region = group.call_records()                       # (size, CALL_RECORDS * CALL_RECORD_BYTES) uint8
        self._texts = region.reshape(size, CALL_RECORDS, CALL_RECORD_BYTES)[:, :, 8:]
        words = region.view(np.uint64).reshape(size, CALL_RECORDS, CALL_RECORD_BYTES // 8)
        # Per record slot, this rank's word and (peer, word) of each peer, as
        # ctypes cells: a store and a load each per call.
        self._mine = tuple(ctypes.c_uint64.from_buffer(words[rank, slot]) for slot in range(CALL_RECORDS))
        self._theirs = tuple(tuple((q, ctypes.c_uint64.from_buffer(words[q, slot])) for q in range(size) if q != rank)
                             for slot in range(CALL_RECORDS))
        self._written = [None] * CALL_RECORDS               # the description each slot of ours holds
        self._number = 0                                    # this rank's calls so far
        self._last_word = 0                                 # the record of the last call (0: none yet)
        self._known = {}                                    # id(plan) -> (plan, signature, description)
        self.known = self._known.get                        # (id(plan)): what `learn` made for it, or None

    def learn(self, plan):
        """(plan, signature, description) of a call of `plan`, made once:
        record(signature, description) records the call. `known` finds it."""
        description = describe_call(plan) + (f", compressed {plan.compression}" if plan.compression else "")
        known = (plan, signature(description), description.encode())
        if len(self._known) >= 1024:
            self._known.clear()
        self._known[id(plan)] = known   # (the entry keeps its plan alive: its id is not reused meanwhile)
        return known

    def record_plan(self, plan):
        """Record the call of `plan` this rank is about to run, and compare."""
        known = self.known(id(plan))
        if known is None or known[0] is not plan:
            known = self.learn(plan)
        self.record(known[1], known[2])

    def record(self, call_signature, description):
        """Record this rank's next call, of `call_signature` (32 bits, not 0)
        and `description` (bytes, for messages), and compare it with each
        peer's record of the same number: InvalidUsageError, and the
        communicator aborted with it, where a peer made another call."""
        number = self._number = (self._number + 1) & 0xFFFFFFFF   # the word keeps 32 bits of it
        slot = number % CALL_RECORDS
        if self._written[slot] is not description:   # the description first: a peer that sees the word sees it
            self._describe(slot, description)
        word = self._last_word = number << 32 | call_signature
        self._mine[slot].value = word
        for peer, cell in self._theirs[slot]:   # (_compare, inline: this is every call's cost)
            theirs = cell.value
            if theirs != word and theirs >> 32 == number:
                self._mismatch(peer, number, theirs)

    def _describe(self, slot, description):
        text = self._texts[self.rank, slot]
        text[:] = 0
        text[:min(len(description), CALL_DESCRIPTION_BYTES)] = np.frombuffer(description[:CALL_DESCRIPTION_BYTES],
                                                                             np.uint8)
        self._written[slot] = description

    def check_last(self):
        """Compare this rank's last record with its peers' of the same number
        again (InvalidUsageError for another call): for two ranks that
        recorded at the same instant, each before the other's record landed."""
        if self._last_word:
            self._compare(self._last_word)

    def _compare(self, word):
        """A peer's record of this call's number, where it is there, must be `word`."""
        number = word >> 32
        for peer, cell in self._theirs[number % CALL_RECORDS]:
            theirs = cell.value
            if theirs != word and theirs >> 32 == number:   # the same number, another call
                self._mismatch(peer, number, theirs)

    def _mismatch(self, peer, number, theirs):
        """Raise the mismatch with `peer`'s record `theirs` of call `number`,
        having aborted the communicator with it (its kernels and waits stop,
        and every rank raises InvalidUsageError)."""
        slot = number % CALL_RECORDS
        text = bytes(self._texts[peer, slot]).rstrip(b"\0").decode(errors="replace")
        if dict(self._theirs[slot])[peer].value != theirs:   # rewritten meanwhile: the text may be the next call's
            text = "another call"
        mine = bytes(self._texts[self.rank, slot]).rstrip(b"\0").decode(errors="replace")
        error = InvalidUsageError(
            f"rank {peer} made a different call from rank {self.rank}'s call #{number}: rank {peer}'s is "
            f"{text}, rank {self.rank}'s {mine}; every rank must make the same calls in the same order")
        self.group.abort(f"{type(error).__name__}: {error}", error)
        raise error


def signature(description):
    """32 bits of a call's description, never 0 (a record of 0 is none)."""
    return int.from_bytes(hashlib.blake2b(description.encode(), digest_size=4).digest(), "little") % 0xFFFFFFFF + 1
