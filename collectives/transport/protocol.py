"""The step protocol between ranks in separate processes, written once.

Host ranks (transport/shm.py) and GPU ranks (executors/device_process.py)
both run a plan phase by phase through a `ProcessGroup`; they differ only in
what runs a phase (NumPy, or a kernel launch whose event the host polls) and
in the memory their workspaces live in (a `memory` kind, below).

One control segment, made by rank 0 (shared memory, segments.py), holds a
row per rank:

    COUNTER   phases this rank has completed, over the communicator's life
    PID       so that a dead peer is reported instead of waited for
    SEQ, SIG  which call the rank is in, to catch ranks calling different things
    GEN, CAP  generation and size of the rank's workspace (it grows)

then a HANDLE per rank (what a peer needs to open the workspace of the
current generation: a segment's name, or a CUDA IPC handle), an abort flag, the
aborting rank, the class of its failure (errors.kind_of) and a reason: a rank
that fails mid-collective sets them, and every other rank's wait raises the
same class (a timeout stays a CollectiveTimeoutError on every rank, a dead
peer a RankFailedError) instead of waiting out its timeout.

A phase starts once the peers it depends on have completed enough phases
(`plan.phases[p].waits`, derived from the op tables); this rank's COUNTER is
published only when the phase's writes are complete (for a GPU: its event
has completed). Every wait has the caller's deadline, checks the abort flag
and the peer's pid, and any failure aborts the communicator for all.

Ordering: a rank stores its data (and HANDLE, CAP before GEN), then
publishes its counter (or GEN) with a release store; a peer loads the
counter with an acquire load, then reads the data (`Counters`, through the
compiled loop _shmloop.c: C11 atomics, correct on any architecture). Only
when the package was installed without a C compiler do the counters fall
back to plain stores, which x86-64's total store order keeps in order;
other architectures then refuse to start.

Host ranks' allreduce mostly bypasses the phases: fastpath.py runs it in
the compiled loop over a channel at the end of the control segment, and
counts its calls in the same COUNTER and SEQ, so both kinds of call mix.

A memory kind has three calls: `create(name, nbytes)` a workspace peers can
open (its `.handle` is at most HANDLE_BYTES bytes), `open(handle)` a peer's,
and `release(memory, own)`. Names start with the communicator's prefix.

No file in /dev/shm: host workspaces, the control segment and the emulated
device's memory are anonymous shared memory (memfd) that the kernel frees
with the last process holding or mapping it, so even a job whose every rank
is killed with SIGKILL leaves nothing behind (segments.py). Peers find a
segment by a name that says which process holds it: the control segment's,
`<prefix>-control@<pid>`, by the pid in the prefix (new_prefix, called by
rank 0's process), so the prefix alone is still all that ranks exchange.
"""

import functools
import hashlib
import os
import platform
import secrets
import time
import weakref

import numpy as np

from ..config import resolve_fast_sizes
from ..errors import CollectiveError, CollectiveTimeoutError, InvalidUsageError, RankFailedError, class_of_kind, kind_of
from .layout import (  # noqa: F401 (ROW and HEADER: other modules read the layout here too)
    ABORT, ABORT_KIND, ABORT_RANK, CAP, COUNTER, GEN, HANDLE_BYTES, HEADER, PID, REASON_BYTES, ROW, SEQ, SIG,
    CALL_RECORD_BYTES, CALL_RECORDS, LL_REGION_BYTES, WORKSPACE_ALIGN, calls_offset, channel_offset, control_bytes,
    ll_region_offset,
)
from .segments import Segment, gone_or_going

try:
    from . import _shmloop   # the compiled loop (setup.py builds it when a C compiler is there)
except ImportError:
    _shmloop = None


def new_prefix():
    """A name no other communicator on this machine uses. Call it in the
    process that will be the communicator's rank 0: the name says that this
    process holds the control segment, which is how peers find it."""
    return f"coll-{os.getpid()}-{secrets.token_hex(6)}"


def control_name(prefix):
    """The control segment's name: held by the process that made `prefix`."""
    head, pid, token = (prefix.split("-", 2) + ["", ""])[:3]
    if head != "coll" or not pid.isdigit() or not token:
        raise InvalidUsageError(
            f"a communicator's prefix comes from new_prefix() (coll-<pid>-<token>), got {prefix!r}")
    return f"{prefix}-control@{pid}"


def describe_call(plan):
    return (f"{plan.collective} of {plan.count} {plan.dtype} (op {plan.op}, root {plan.root}, "
            f"algorithm {plan.algorithm}{', one copy' if getattr(plan, 'single_copy', False) else ''}"
            f"{', pushed' if getattr(plan, 'pushes', False) else ''}"
            f"{f', in segments of {plan.segment}' if getattr(plan, 'segment', 0) else ''})")


def call_signature(seq, description):
    """64 bits that differ when two ranks make different calls: the
    description's hash (computed once per description) mixed with the call's
    number, a few integer operations per call."""
    mixed = (description_hash(description) ^ (seq * 0x9E3779B97F4A7C15)) & _MASK64
    mixed = ((mixed ^ (mixed >> 31)) * 0xBF58476D1CE4E5B9) & _MASK64
    mixed ^= mixed >> 29
    return mixed - (1 << 64) if mixed >> 63 else mixed   # a signed int64, as the rows hold it


_MASK64 = (1 << 64) - 1


@functools.lru_cache(maxsize=1024)
def description_hash(description):
    """64 bits of the description (an unsigned int): call_signature's per-description half."""
    return int.from_bytes(hashlib.blake2b(description.encode(), digest_size=8).digest(), "little")


class Waiter:
    """Polls with a deadline: spins briefly, then yields, then sleeps.

    Spinning alone would starve peers when ranks outnumber cores (tests run 4
    ranks on 2 cores); sleeping at once would add scheduler latency to every
    step. The schedule below keeps a satisfied wait at a few microseconds.
    """

    SPIN = 200
    YIELD_SECONDS = 2e-3
    MAX_SLEEP = 1e-3
    LIVENESS_EVERY = 0.01   # as the compiled waits (shm_waits.h LIVENESS_SECONDS)

    def __init__(self, deadline):
        self.deadline = deadline

    def until(self, ready, describe, check):
        """Return once ready(); call check() now and then (it raises to stop)."""
        for _ in range(self.SPIN):
            if ready():
                return
        start = time.perf_counter()
        next_check = start
        sleep = 1e-5
        while not ready():
            now = time.perf_counter()
            if now >= next_check:
                try:
                    check()
                except CollectiveError:
                    # The peer may have published, then left or died, since
                    # ready() was asked: what this waits for happened.
                    if ready():
                        return
                    raise
                next_check = now + self.LIVENESS_EVERY
            if now >= self.deadline:
                raise CollectiveTimeoutError(f"timed out waiting for {describe()}")
            if now - start < self.YIELD_SECONDS:
                os.sched_yield()
            else:
                time.sleep(sleep)
                sleep = min(2 * sleep, self.MAX_SLEEP)


class Counters:
    """The rows' slots, stored with release and loaded with acquire order
    through the compiled loop (_shmloop.c), so a peer that sees a counter
    sees the data written before it on any architecture. Without the loop
    (no compiler at install) plain NumPy accesses, ordered only by x86-64's
    total store order: other machines refuse to run without it."""

    def __init__(self, rows):
        self._rows = rows
        self._base = rows.ctypes.data
        self._stride = rows.strides[0]
        if _shmloop is None and platform.machine() not in ("x86_64", "AMD64", "i386", "i686"):
            raise CollectiveError(
                f"ranks in separate processes on {platform.machine()} need the compiled loop "
                "collectives.transport._shmloop for release/acquire ordering; reinstall with a C compiler")

    def address(self, rank, slot):
        return self._base + rank * self._stride + 8 * slot

    def publish(self, rank, slot, value):
        if _shmloop is not None:   # also wakes the compiled loop's waits asleep on the row
            _shmloop.publish(self._base + rank * self._stride, slot, value)
        else:
            self._rows[rank, slot] = value

    def load(self, rank, slot):
        if _shmloop is not None:
            return _shmloop.load_acquire(self.address(rank, slot))
        return int(self._rows[rank, slot])

    def loader(self, rank, slot):
        """A function of no argument that loads the slot (for polling)."""
        if _shmloop is not None:
            load, address = _shmloop.load_acquire, self.address(rank, slot)
            return lambda: load(address)
        rows = self._rows
        return lambda: int(rows[rank, slot])


class ProcessGroup:
    """This process's rank of a communicator whose ranks are processes on one
    machine: the control segment, the waits, and the workspaces peers read."""

    def __init__(self, rank, size, prefix, memory):
        self.rank, self.size, self.prefix = rank, size, prefix
        self._memory = memory
        # the compiled loop's channel sizes, which the segment's size depends on
        self.fast_sizes = resolve_fast_sizes()
        self._control_segment = Segment(control_name(prefix), control_bytes(size, self.fast_sizes),
                                        create=(rank == 0))
        buf = self._control_segment.buf
        self._header = np.ndarray((HEADER,), np.int64, buf)
        self._rows = np.ndarray((size, ROW), np.int64, buf, offset=8 * HEADER)
        self._handles = np.ndarray((size, HANDLE_BYTES), np.uint8, buf, offset=8 * (HEADER + ROW * size))
        self._reason = np.ndarray((REASON_BYTES,), np.uint8, buf,
                                  offset=8 * (HEADER + ROW * size) + HANDLE_BYTES * size)
        self._mine = self._rows[rank]
        self._mine[PID] = os.getpid()
        # How errors name each rank: the communicator's numbers, which a
        # hierarchy's node group (local ranks 0..size-1) is told (name_ranks).
        self.names = tuple(range(size))
        self._counters = Counters(self._rows)
        self._seq = 0
        # Released by close(), or at exit/collection if the caller forgot
        # (a process that dies releases everything with it).
        self._state = {"control": self._control_segment, "prefix": prefix, "memory": memory,
                       "own": None, "peers": {}}   # peers: rank -> (generation, memory)
        self._finalizer = weakref.finalize(self, _release_all, self._state)

    def name_ranks(self, names):
        """Name this group's ranks in errors by `names` (the communicator's
        number of each local rank) rather than by their local numbers."""
        if len(names) != self.size:
            raise ValueError(f"{len(names)} names for a group of {self.size} ranks")
        self.names = tuple(names)

    # -- waiting ------------------------------------------------------------

    def check_health(self, peer=None, during="the collective"):
        """Raise if the communicator was aborted (the class of the aborting
        rank's failure, see abort) or `peer` died (RankFailedError, naming
        the call it did not complete: `during`)."""
        self._raise_if_aborted()
        if peer is not None:
            pid = int(self._rows[peer, PID])
            if pid and not _alive(pid):
                # A peer that aborted, then left, between the look above and
                # this one: its abort is what happened (it wrote the flag first).
                self._raise_if_aborted()
                raise RankFailedError(f"rank {self.names[peer]} (pid {pid}) died before completing {during}")

    def _raise_if_aborted(self):
        if self._header[ABORT]:
            who = int(self._header[ABORT_RANK]) - 1
            reason = bytes(self._reason).rstrip(b"\0").decode(errors="replace")
            by = f"rank {self.names[who]}" if who >= 0 else "a rank"   # the compiled loop's fence may set the flag alone
            raise class_of_kind(int(self._header[ABORT_KIND]))(f"{by} aborted the communicator: {reason}")

    def _wait_for(self, peer, phases_done, waiter, description, check=None):
        """Wait until `peer` has completed `phases_done` phases in all;
        `check()`, if given, is asked with the peer's health (it raises to stop)."""
        completed = self._counters.loader(peer, COUNTER)

        def healthy():
            self.check_health(peer, f"call #{self._seq}, {description}")
            if check is not None:
                check()
        waiter.until(
            lambda: completed() >= phases_done,
            lambda: f"rank {self.names[peer]} in call #{self._seq}, {description} (it has completed "
                    f"{completed()} phases, this rank needs {phases_done}){self.absent_note(self._seq)}",
            healthy,
        )

    def absent_note(self, seq):
        """What a timeout adds: the peers that never entered call #`seq`, which
        every wait of the call ends up waiting for (a peer's row names its
        call once the peer is past the call's first waits)."""
        absent = [self.names[peer] for peer in range(self.size) if peer != self.rank and int(self._rows[peer, SEQ]) < seq]
        if not absent:
            return "; is every rank making the same calls?"
        who = f"rank {absent[0]} has" if len(absent) == 1 else f"ranks {', '.join(map(str, absent))} have"
        return f"; {who} not entered call #{seq} (stopped calling, or making other calls?)"

    def _check_same_call(self, peer, signature, description):
        """Once `peer` is past phase 0 of this call, its SIG names this call."""
        if self._rows[peer, SIG] != signature:
            raise InvalidUsageError(
                f"rank {self.names[peer]} is in its call #{int(self._rows[peer, SEQ])}, a different call from "
                f"rank {self.names[self.rank]}'s call #{self._seq}, {description}; every rank must make the same "
                "calls in the same order")

    def enter_call(self, description):
        """Start a call: its signature and counter base (its sequence number: `seq`)."""
        self.check_health()
        self._seq = int(self._mine[SEQ]) + 1   # the row's: the fast path (fastpath.py) counts calls there too
        return call_signature(self._seq, description), int(self._mine[COUNTER])

    def abort(self, reason, cause=CollectiveError):
        """Tell every rank this communicator cannot go on: their waits raise
        the class of `cause` (an exception or a class, see errors.kind_of),
        with `reason`. The first abort wins."""
        if self._header is not None and not self._header[ABORT]:
            data = reason.encode()[:REASON_BYTES - 1]
            self._reason[:] = 0
            self._reason[:len(data)] = np.frombuffer(data, np.uint8)
            self._header[ABORT_RANK] = self.rank + 1
            self._header[ABORT_KIND] = kind_of(cause)
            self._header[ABORT] = 1   # last, as before: a rank that sees the flag reads the rest
            if _shmloop is not None:   # the compiled waits asleep on a live peer see it now, not at their nap's end
                _shmloop.wake_sleepers(self._rows.ctypes.data, self.size)

    def pid_of(self, rank):
        """The process of `rank` (0 until it attached)."""
        return int(self._rows[rank, PID])

    def expect_pids(self, pids):
        """The processes that will attach as ranks 0, 1, ... (the maker of a
        shrunk communicator knows them): a rank that dies before it attaches
        is then reported as failed, not waited for."""
        for rank, pid in enumerate(pids):
            if rank != self.rank and not self._rows[rank, PID]:
                self._rows[rank, PID] = pid

    def note_call(self, seq):
        """A call made without enter_call (the compiled executor numbers its
        calls itself): its number, for this group's messages."""
        self._seq = seq

    @property
    def seq(self):
        """The number of this rank's current (or last) call."""
        return self._seq

    def peer_seq(self, peer):
        """The number of the call `peer` is in (for error messages)."""
        return int(self._rows[peer, SEQ])

    @property
    def control_buffer(self):
        """The control segment's memory (layout.py says what lies where)."""
        return self._control_segment.buf

    def check_peers(self, peer=None, during="the call"):
        """check_health for `peer`, or for every peer where it is None."""
        for p in (range(self.size) if peer is None else (peer,)):
            if p != self.rank:
                self.check_health(p, during)
        self.check_health(None, during)

    def channel_addresses(self):
        """Where the header, the rows and the fast path's channel are mapped."""
        header = self._header.ctypes.data
        return header, self._rows.ctypes.data, header + channel_offset(self.size)

    def ll_region(self):
        """The control segment's LL region (layout.py): LL_REGION_BYTES per
        rank, for the one-kernel collectives (executors/device_protocol.py)."""
        return np.ndarray((self.size, LL_REGION_BYTES), np.uint8, self._control_segment.buf,
                          offset=ll_region_offset(self.size))

    def call_records(self):
        """The control segment's call records (layout.py): per rank
        CALL_RECORDS records of CALL_RECORD_BYTES, for GPU ranks
        (executors/device_protocol.py: CallRecords)."""
        return np.ndarray((self.size, CALL_RECORDS * CALL_RECORD_BYTES), np.uint8, self._control_segment.buf,
                          offset=calls_offset(self.size))

    # -- the workspaces peers read ----------------------------------------------

    def ensure_capacity(self, nbytes):
        """Grow this rank's workspace. Called in phase 0, when no peer can
        still be reading the old one (phase 0 waits for all to leave the last call)."""
        if nbytes == 0 or (self._state["own"] is not None and self._mine[CAP] >= nbytes):
            return
        generation = int(self._mine[GEN]) + 1
        capacity = max(nbytes, 2 * int(self._mine[CAP]), WORKSPACE_ALIGN)
        grown = self._memory.create(f"{self.prefix}-r{self.rank}-g{generation}", capacity)
        if self._state["own"] is not None:
            self._memory.release(self._state["own"], own=True)
        self._state["own"] = grown
        handle = np.frombuffer(grown.handle, np.uint8)
        self._handles[self.rank] = 0
        self._handles[self.rank, :len(handle)] = handle
        self._mine[CAP] = capacity
        self._counters.publish(self.rank, GEN, generation)   # last: a peer that sees it sees the handle

    def generation(self, rank):
        """Which workspace `rank` has: it changes when the workspace grows."""
        return self._counters.load(rank, GEN)

    def workspace(self, rank):
        """The memory of `rank`'s workspace (opened once per generation)."""
        if rank == self.rank:
            return self._state["own"]
        generation = self._counters.load(rank, GEN)
        known = self._state["peers"].get(rank)
        if known is None or known[0] != generation:
            if known is not None:
                self._memory.release(known[1], own=False)
                del self._state["peers"][rank]
            try:
                opened = self._memory.open(bytes(self._handles[rank]))
            except RankFailedError:
                raise
            except CollectiveError:
                # A live rank releases the workspace peers may open only on
                # its way out of an aborted communicator: say that instead.
                self.check_health(rank)
                raise
            self._state["peers"][rank] = known = (generation, opened)
        return known[1]

    # -- running a plan -----------------------------------------------------------

    def run(self, plan, description, execute_phase, deadline):
        """Run this rank's phases of `plan`: execute_phase(p, waiter) returns
        once phase p's writes are complete."""
        signature, base = self.enter_call(description)
        waiter = Waiter(deadline)
        try:
            for p, phase in enumerate(plan.phases):
                for peer, done in phase.waits[self.rank]:
                    self._wait_for(peer, base + done, waiter, description)
                    if done >= 1:
                        self._check_same_call(peer, signature, description)
                if p == 0:
                    self.ensure_capacity(plan.workspace_bytes)
                    self._mine[SEQ] = self._seq
                    self._mine[SIG] = signature
                execute_phase(p, waiter)
                self._counters.publish(self.rank, COUNTER, base + p + 1)
        except BaseException as error:
            self.abort(f"{type(error).__name__}: {error}", error)
            raise

    def barrier(self, deadline, check=None):
        """Return once every rank has entered the barrier.

        Two phases, like a plan: phase 0 waits for every peer to leave the
        previous call before this rank's signature overwrites its last one;
        phase 1 waits for every peer to enter. `check()`, if given, is asked
        now and then while it waits, as the peers' health is: what it raises
        aborts the barrier (a shrink's round asks whether a member left it
        without being able to say so here: recovery.py).
        """
        signature, base = self.enter_call("barrier")
        waiter = Waiter(deadline)
        peers = [peer for peer in range(self.size) if peer != self.rank]
        try:
            for peer in peers:
                self._wait_for(peer, base, waiter, "barrier", check)
            self._mine[SEQ] = self._seq
            self._mine[SIG] = signature
            self._counters.publish(self.rank, COUNTER, base + 1)
            for peer in peers:
                self._wait_for(peer, base + 1, waiter, "barrier", check)
                self._check_same_call(peer, signature, "barrier")
            self._counters.publish(self.rank, COUNTER, base + 2)
        except BaseException as error:
            self.abort(f"{type(error).__name__}: {error}", error)
            raise

    def close(self):
        """Release every workspace and the control segment. Call it after a
        barrier: a peer may still be reading this rank's workspace until then."""
        self._header = self._rows = self._handles = self._reason = self._mine = None
        self._control_segment = None
        self._finalizer()


def _release_all(state):
    """Release everything. There is nothing to remove: segments have no
    names in /dev/shm (segments.py), and a dead peer's go with their last
    mapping."""
    memory = state["memory"]
    for _, opened in state["peers"].values():
        memory.release(opened, own=False)
    state["peers"].clear()
    if state["own"] is not None:
        memory.release(state["own"], own=True)
        state["own"] = None
    state["control"].release()


def _alive(pid):
    """Whether process `pid` still runs. A zombie (dead, not yet reaped by its
    launcher) counts as dead: kill(pid, 0) alone would call it alive; so
    does a process in the kernel's exit path (PF_EXITING: its memory may be
    gone already, which is how the compiled loop's reads learn of a death
    first)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return not gone_or_going(stat.read())
    except (FileNotFoundError, ProcessLookupError):
        # ProcessLookupError (ESRCH): the read of a process being torn down,
        # whose pid kill() below would still find (a zombie)
        return False
    except OSError:
        pass  # no /proc: ask the kernel directly
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
