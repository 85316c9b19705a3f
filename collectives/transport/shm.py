"""Host ranks in separate processes on one machine, through shared memory.

Each rank owns one data segment (its WORK and SCRATCH buffers) that the
others map read-only in spirit: plans only ever write the executing rank's
own memory. One control segment, made by rank 0, holds a row per rank:

    COUNTER   phases this rank has completed, over the communicator's life
    PID       so that a dead peer is reported instead of waited for
    SEQ, SIG  which call the rank is in, to catch ranks calling different things
    GEN, CAP  generation and size of the rank's data segment (it grows)

and an abort flag with a reason: a rank that fails mid-collective sets it, and
every other rank's wait raises instead of waiting out its timeout.

Ordering: a rank stores its data, then its counter; a peer loads the counter,
then the data. Aligned 8-byte stores are atomic and not reordered with earlier
stores on x86-64 (total store order), which this module relies on; a weaker
memory model (aarch64) would need a fence between the two, not provided yet.
"""

import glob
import hashlib
import mmap
import os
import secrets
import time
import weakref

import numpy as np

from ..errors import CollectiveError, CollectiveTimeoutError, InvalidUsageError, RankFailedError
from ..executors import host
from ..plan import SCRATCH, WORK, INPUT, OUTPUT

COUNTER, PID, SEQ, SIG, GEN, CAP = range(6)
ROW = 8                      # int64 slots per rank row (two spare)
HEADER = 2                   # ABORT flag, aborting rank + 1
ABORT, ABORT_RANK = 0, 1
REASON_BYTES = 1024
SEGMENT_ALIGN = 4096
SHM_DIR = "/dev/shm"


def new_prefix():
    """A name no other communicator on this machine uses."""
    return f"coll-{os.getpid()}-{secrets.token_hex(6)}"


class Segment:
    """A named file in /dev/shm, mapped into this process.

    Plain files rather than multiprocessing.shared_memory: that module starts a
    resource-tracker process per rank which shares the rank's pipes with
    mpiexec and, in Python < 3.13, unlinks segments it merely attached to.
    """

    def __init__(self, name, size=0, create=False):
        self.path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.buf = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)

    def release(self, unlink):
        try:
            self.buf.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes with it
        if unlink:
            _remove(self.path)


def _remove(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def describe_call(plan):
    return (f"{plan.collective} of {plan.count} {plan.dtype} (op {plan.op}, root {plan.root}, "
            f"algorithm {plan.algorithm})")


def call_signature(seq, description):
    """64 bits that differ when two ranks make different calls."""
    text = f"{seq}: {description}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


class Waiter:
    """Polls with a deadline: spins briefly, then yields, then sleeps.

    Spinning alone would starve peers when ranks outnumber cores (tests run 4
    ranks on 2 cores); sleeping at once would add scheduler latency to every
    step. The schedule below keeps a satisfied wait at a few microseconds.
    """

    SPIN = 200
    YIELD_SECONDS = 2e-3
    MAX_SLEEP = 1e-3
    LIVENESS_EVERY = 0.05

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
                check()
                next_check = now + self.LIVENESS_EVERY
            if now >= self.deadline:
                raise CollectiveTimeoutError(f"timed out waiting for {describe()}")
            if now - start < self.YIELD_SECONDS:
                os.sched_yield()
            else:
                time.sleep(sleep)
                sleep = min(2 * sleep, self.MAX_SLEEP)


class ShmRank:
    """This process's rank of a communicator whose ranks share one machine."""

    addressable = False  # peers see only each other's workspaces: plans copy in and out
    host_only = True     # it indexes NumPy arrays
    locations = None

    def __init__(self, rank, size, prefix):
        self.rank, self.size, self.prefix = rank, size, prefix
        control_bytes = 8 * (HEADER + ROW * size) + REASON_BYTES
        name = f"{prefix}-control"
        self._control_segment = Segment(name, control_bytes, create=(rank == 0))
        buf = self._control_segment.buf
        self._header = np.ndarray((HEADER,), np.int64, buf)
        self._rows = np.ndarray((size, ROW), np.int64, buf, offset=8 * HEADER)
        self._reason = np.ndarray((REASON_BYTES,), np.uint8, buf, offset=8 * (HEADER + ROW * size))
        self._mine = self._rows[rank]
        self._mine[PID] = os.getpid()
        self._seq = 0
        self._own_segment = None
        self._peer_segments = {}   # rank -> (generation, segment)
        # Released by close(), or at exit/collection if the caller forgot:
        # segments left behind would outlive the job in /dev/shm.
        self._segments = {"control": self._control_segment, "prefix": prefix, "own": None, "peers": {}}
        self._finalizer = weakref.finalize(self, _release_all, self._segments)

    # -- waiting ------------------------------------------------------------

    def _check_health(self, peer=None):
        """Raise if the communicator was aborted or `peer` died."""
        if self._header[ABORT]:
            who = int(self._header[ABORT_RANK]) - 1
            reason = bytes(self._reason).rstrip(b"\0").decode(errors="replace")
            raise CollectiveError(f"rank {who} aborted the communicator: {reason}")
        if peer is not None:
            pid = int(self._rows[peer, PID])
            if pid and not _alive(pid):
                raise RankFailedError(f"rank {peer} (pid {pid}) died before completing the collective")

    def _wait_for(self, peer, phases_done, waiter, description):
        """Wait until `peer` has completed `phases_done` phases in all."""
        counters = self._rows[:, COUNTER]
        waiter.until(
            lambda: counters[peer] >= phases_done,
            lambda: f"rank {peer} in call #{self._seq}, {description} (it has completed "
                    f"{int(counters[peer])} phases, this rank needs {phases_done}; "
                    "is every rank making the same calls?)",
            lambda: self._check_health(peer),
        )

    def _check_same_call(self, peer, signature, description):
        """Once `peer` is past phase 0 of this call, its SIG names this call."""
        if self._rows[peer, SIG] != signature:
            raise InvalidUsageError(
                f"rank {peer} is in its call #{int(self._rows[peer, SEQ])}, a different call from "
                f"rank {self.rank}'s call #{self._seq}, {description}; every rank must make the same "
                "calls in the same order")

    def _enter(self, description):
        """Start a call: its sequence number, signature and counter base."""
        self._check_health()
        self._seq += 1
        return call_signature(self._seq, description), int(self._mine[COUNTER])

    def abort(self, reason):
        """Tell every rank this communicator cannot go on."""
        if not self._header[ABORT]:
            data = reason.encode()[:REASON_BYTES - 1]
            self._reason[:] = 0
            self._reason[:len(data)] = np.frombuffer(data, np.uint8)
            self._header[ABORT_RANK] = self.rank + 1
            self._header[ABORT] = 1

    # -- buffers ------------------------------------------------------------

    def _ensure_capacity(self, nbytes):
        """Grow this rank's data segment. Called in phase 0, when no peer can
        still be reading the old one (phase 0 waits for all to leave the last call)."""
        if self._own_segment is not None and self._mine[CAP] >= nbytes:
            return
        generation = int(self._mine[GEN]) + 1
        capacity = max(nbytes, 2 * int(self._mine[CAP]), SEGMENT_ALIGN)
        segment = Segment(f"{self.prefix}-r{self.rank}-g{generation}", capacity, create=True)
        if self._own_segment is not None:
            self._own_segment.release(unlink=True)
        self._own_segment = self._segments["own"] = segment
        self._mine[CAP] = capacity
        self._mine[GEN] = generation

    def _segment_of(self, rank):
        if rank == self.rank:
            return self._own_segment
        generation = int(self._rows[rank, GEN])
        known = self._peer_segments.get(rank)
        if known is None or known[0] != generation:
            if known is not None:
                known[1].release(unlink=False)
            segment = Segment(f"{self.prefix}-r{rank}-g{generation}")
            self._peer_segments[rank] = self._segments["peers"][rank] = known = (generation, segment)
        return known[1]

    # -- collectives ----------------------------------------------------------

    def run(self, plan, inputs, outputs, input_infos, output_infos, deadline):
        """Execute this rank's part of `plan`; the lists hold this rank's arrays."""
        description = describe_call(plan)
        signature, base = self._enter(description)
        views = {}

        def buffer(rank, buffer_id):
            if buffer_id == INPUT:
                return inputs[0].reshape(-1)
            if buffer_id == OUTPUT:
                return outputs[0].reshape(-1)
            key = (rank, buffer_id)
            if key not in views:
                offset = 0 if buffer_id == WORK else plan.scratch_offset
                count = plan.count if buffer_id == WORK else plan.scratch_elements
                views[key] = np.ndarray((count,), plan.dtype, self._segment_of(rank).buf, offset=offset)
            return views[key]

        waiter = Waiter(deadline)
        try:
            for p, phase in enumerate(plan.phases):
                for peer, done in phase.waits[self.rank]:
                    self._wait_for(peer, base + done, waiter, description)
                    if done >= 1:
                        self._check_same_call(peer, signature, description)
                if p == 0:
                    self._ensure_capacity(plan.workspace_bytes)
                    self._mine[SEQ] = self._seq
                    self._mine[SIG] = signature
                host.execute(phase.rows_by_rank[self.rank], buffer, plan.op, plan.nranks)
                self._mine[COUNTER] = base + p + 1
        except BaseException as error:
            self.abort(f"{type(error).__name__}: {error}")
            raise
        finally:
            views.clear()  # drop views before any segment may be released

    def barrier(self, deadline):
        """Return once every rank has entered the barrier.

        Two phases, like a plan: phase 0 waits for every peer to leave the
        previous call before this rank's signature overwrites its last one;
        phase 1 waits for every peer to enter.
        """
        signature, base = self._enter("barrier")
        waiter = Waiter(deadline)
        peers = [peer for peer in range(self.size) if peer != self.rank]
        try:
            for peer in peers:
                self._wait_for(peer, base, waiter, "barrier")
            self._mine[SEQ] = self._seq
            self._mine[SIG] = signature
            self._mine[COUNTER] = base + 1
            for peer in peers:
                self._wait_for(peer, base + 1, waiter, "barrier")
                self._check_same_call(peer, signature, "barrier")
            self._mine[COUNTER] = base + 2
        except BaseException as error:
            self.abort(f"{type(error).__name__}: {error}")
            raise

    def close(self):
        """Unmap and remove this rank's segments. Call it after a barrier:
        a peer may still be reading this rank's buffers until then."""
        self._header = self._rows = self._reason = self._mine = None
        self._own_segment = self._control_segment = None
        self._peer_segments.clear()
        self._finalizer()


def _release_all(segments):
    """Unmap everything; remove every file of the communicator, a dead
    peer's included (removing a name others still map is harmless)."""
    for _, segment in segments["peers"].values():
        segment.release(unlink=False)
    if segments["own"] is not None:
        segments["own"].release(unlink=True)
    segments["control"].release(unlink=True)
    for path in glob.glob(os.path.join(SHM_DIR, glob.escape(segments["prefix"]) + "-*")):
        _remove(path)


def _alive(pid):
    """Whether process `pid` still runs. A zombie (dead, not yet reaped by its
    launcher) counts as dead: kill(pid, 0) alone would call it alive."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except FileNotFoundError:
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
