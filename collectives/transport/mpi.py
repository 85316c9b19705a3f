"""Messages between nodes: MPI point-to-point, polled against the deadline.

Ranks on different nodes cannot map each other's memory, so the
hierarchical communicator (hierarchy.py) moves bytes between nodes with
MPI, a proven engine, and never with a network layer of its own. Only
nonblocking calls (Isend, Irecv) are used, on a private duplicate of the
program's communicator, and every wait polls them against the call's
deadline: a node that stops answering is a CollectiveTimeoutError, not a
hang.

One `exchange` is a set of sends and receives that may all be in flight at
once. Before its data, a rank sends every peer of the exchange its call
signature (protocol.call_signature: the call's number and what it is), and
checks the one each peer sent: ranks making different calls are told so
instead of exchanging the wrong bytes. MPI keeps the messages between two
ranks in order, so the signature is always the first message of the pair.

`repeated_exchange` lays out the messages of a small call repeated call
after call with the same peers and sizes (across.py's Programs):
each message carries the call signature in its first 8 bytes, through
buffers and persistent requests made once, which the Program starts and
tests from C.

A rank that fails in a collective sends every other rank an abort message
(tag ABORT_TAG; each rank keeps one receive posted for it from anyone).
Every wait checks it, so the others raise within moments instead of waiting
out their timeout; a whole node that dies is noticed at the timeout, unless
its processes are on this rank's machine (pretend nodes: `watch`).
"""

import ctypes
import itertools
import os
import time

import numpy as np

from ..errors import CollectiveError, CollectiveTimeoutError, InvalidUsageError, RankFailedError, class_of_kind, kind_of
from .segments import exited

ABORT_TAG, DATA_TAG = 1, 2
REASON_BYTES = 1024
HEALTH_EVERY = 0.02     # seconds between looks at the abort channel while waiting
WATCH_EVERY = 0.05      # seconds between looks at the watched processes (MpiLink.watch)
SEND_ABORT_SECONDS = 0.05
# How long a rank that finds a watched process gone keeps driving MPI for
# an abort that process (or its node-mate, which saw it die) may have sent
# (behind the call's own messages in MPI's queues): the abort's class is
# then what it raises. As long as an aborting rank pushes its abort out.
ABORT_IN_FLIGHT_SECONDS = SEND_ABORT_SECONDS
# ... but no longer than it takes MPI to hand over what the dead process had
# sent this rank before it left (on this machine, a few progress calls): the
# wait ends once this rank's MPI has shown no message of the dead pending
# for this long (a rank killed by a signal sent no abort, and the whole
# 50 ms was in every SIGKILL's recovery across pretend nodes: p50 78 ms,
# against 15 on one node).
DRAINED_SECONDS = 0.002
# A send to another node's rank on this machine (a Program's, or
# exchange()'s) is synchronous (it completes once the peer matched it)
# every CONFIRM_EVERY sends to that peer, so no more of this rank's
# messages than that wait unmatched for one peer. A dead peer never takes
# its messages: MPICH's eager messages between processes of one machine
# sit in the sender's 64 shared-memory cells, and once they are full
# every later send, to any rank, waits for good (a broadcast's root that
# sent on to a dead node until it noticed: it could not take part in the
# shrink). 8 peers' worth still leave cells free. Only messages of up to
# EAGER_BYTES go so: MPICH sends a longer one once the peer matched it (a
# sleeping receiver: 64 sends of 8,100 bytes completed, none of 8,150).
# The cost is the wait for the receiver every 8th call: a 1 KiB broadcast
# across 2 pretend nodes of 2 ranks on 2 cores, in place, went from
# 0.74-0.78x MPICH's time to 0.89x; with a core per rank no change showed
# (2 ranks, 1-64 KiB).
CONFIRM_EVERY = 8
EAGER_BYTES = 8192   # MPICH's shared-memory cell (MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_CELL_SIZE)
# An abort message starts with the class of its failure, one digit
# (errors.kind_of), so the receivers raise the same class.
_KIND_DIGITS = "0123456789"


def timed_out_waiting(peers, what):
    """The CollectiveTimeoutError of a wait for `peers` on other nodes, which
    says whom it waited for (`awaited`): they may be dead or out of reach,
    and an abort is not sent there (MpiLink.abort)."""
    error = CollectiveTimeoutError(f"timed out waiting for rank(s) {', '.join(map(str, peers)) or '-'} on other "
                                   f"nodes in {what} (is every rank making the same calls?)")
    error.awaited = tuple(peers)
    return error


class MpiLink:
    """This rank's end of the messages between nodes: `comm` is a private
    duplicate (MpiRendezvous.link, bootstrap.py) of the communicator the ranks started from."""

    def __init__(self, comm):
        from mpi4py import MPI

        self._mpi = self.mpi = MPI
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._signature = np.zeros(1, np.int64)
        self._aborted = None              # (error class, message, whether a peer sent it): raised from now on
        self._abort_buffer = bytearray(REASON_BYTES)
        self._abort_status = MPI.Status()
        self._abort_request = comm.Irecv([self._abort_buffer, MPI.BYTE], MPI.ANY_SOURCE, ABORT_TAG)
        # (MPI may write into it until close() or the process's end: see _HELD_FOR_MPI)
        self._held = next(_LINK_NUMBERS)
        _HELD_FOR_MPI[self._held] = [(self._abort_request, self._abort_buffer)]
        self._orphans = []                # requests (and their buffers) of failed exchanges
        self._watched, self._next_look = {}, 0.0   # (watch)
        # per peer, the sends to it (Programs' and exchange()'s) since the last synchronous one (CONFIRM_EVERY)
        self.unconfirmed_sends = np.zeros(self.size, np.int64)

    # -- health ------------------------------------------------------------------

    def begin(self, signature):
        """Start a call whose signature is `signature`; raise if the communicator was aborted."""
        self.check_health()
        self._signature[0] = signature

    @property
    def abort_request_address(self):
        """Where mpi4py keeps the abort receive's handle: across.py's Programs
        test it (MPI_Test) before their calls; once it completed there, the
        handle is MPI_REQUEST_NULL and the status is filled."""
        return self._mpi._addressof(self._abort_request)   # noqa: SLF001

    @property
    def abort_status_address(self):
        return self._mpi._addressof(self._abort_status)   # noqa: SLF001

    def check_health(self):
        """Raise if this communicator was aborted, here or by another rank."""
        self._raise_if_aborted()
        if self._watched:
            try:
                self._look_at_the_watched()
            except RankFailedError:
                # A watched rank that aborted, then exited, since the look
                # above: its abort (sent before it left) is what happened.
                self._wait_for_an_abort_in_flight(self._dead_watched())
                self._raise_if_aborted()
                raise

    def _wait_for_an_abort_in_flight(self, dead):
        """Drive MPI until an abort came (_raise_if_aborted raises it), or
        none of `dead`'s messages has been pending for DRAINED_SECONDS, or
        ABORT_IN_FLIGHT_SECONDS passed."""
        start = time.perf_counter()
        drained_since = start
        while (now := time.perf_counter()) < start + ABORT_IN_FLIGHT_SECONDS:
            self._raise_if_aborted()
            if any(self.comm.Iprobe(q, self._mpi.ANY_TAG) for q in dead):
                drained_since = now
            elif now - drained_since >= DRAINED_SECONDS:
                return
            os.sched_yield()

    def _raise_if_aborted(self):
        if self._aborted is None and (self._abort_request == self._mpi.REQUEST_NULL   # (a Program's MPI_Test took it)
                                      or self._abort_request.Test(self._abort_status)):
            who = self._abort_status.Get_source()
            text = bytes(self._abort_buffer).rstrip(b"\0").decode(errors="replace")
            kind, reason = (int(text[0]), text[1:]) if text[:1] and text[0] in _KIND_DIGITS else (0, text)
            self._aborted = (class_of_kind(kind), f"rank {who} aborted the communicator: {reason}", True)
        if self._aborted is not None:
            kind, message, _ = self._aborted
            raise kind(message)

    def watch(self, pids):
        """Ranks of other nodes whose processes this rank can see, {rank:
        pid}: those on its own machine (pretend nodes). One that dies is
        then a RankFailedError at this rank's next look at its health
        (every HEALTH_EVERY while it waits, at most every WATCH_EVERY),
        where before only the timeout told: a rank alone on its node has
        no node-mate to see it die and abort. Sends to them count toward
        CONFIRM_EVERY (confirms)."""
        self._watched = dict(pids)

    def confirms(self, peer, nbytes):
        """Whether a send of `nbytes` to `peer` counts toward CONFIRM_EVERY:
        an eager one to a rank on this machine, which MPICH's shared-memory
        cells hold. Between machines no rank goes on after a death (shrink
        needs one machine), and a synchronous send there would cost a
        round trip of the network every 8th call."""
        return nbytes <= EAGER_BYTES and peer in self._watched

    def _look_at_the_watched(self):
        now = time.perf_counter()
        if now < self._next_look:
            return
        self._next_look = now + WATCH_EVERY
        dead = self._dead_watched()
        if dead:
            raise self._died(dead)

    def _dead_watched(self):
        """The watched ranks whose processes are gone, in rank order."""
        return [rank for rank, pid in sorted(self._watched.items()) if exited(pid)]

    def _died(self, dead, during=""):
        return RankFailedError(f"rank(s) {', '.join(map(str, dead))} of another node died (process "
                               f"{', '.join(str(self._watched[rank]) for rank in dead)} on this machine){during}")

    def abort(self, error, unreachable=()):
        """Tell every other rank that this communicator cannot go on, unless
        the abort came from another rank (which told everyone). Sent once, and
        pushed out for at most SEND_ABORT_SECONDS, never waited for: a dead
        peer never receives it. Nothing is sent to the ranks `unreachable`:
        MPICH crashes (a segfault in MPI_Isend) sending to a rank of another
        machine that died, or that a cut link hides."""
        if self._aborted is not None:
            return
        self._aborted = (class_of_kind(kind_of(error)),
                         f"this communicator was aborted: {type(error).__name__}: {error}", False)
        message = np.frombuffer(f"{kind_of(error)}{type(error).__name__} on rank {self.rank}: {error}"
                                .encode()[:REASON_BYTES], np.uint8).copy()
        sends = [self.comm.Isend([message, self._mpi.BYTE], peer, ABORT_TAG)
                 for peer in range(self.size) if peer != self.rank and peer not in unreachable]
        self.hold((sends, message))
        until = time.perf_counter() + SEND_ABORT_SECONDS
        try:
            while not self._mpi.Request.Testall(sends) and time.perf_counter() < until:
                os.sched_yield()
        except self._mpi.Exception:
            pass   # a peer that is gone: the others got theirs

    # -- moving bytes ----------------------------------------------------------------

    def exchange(self, sends, receives, deadline, what):
        """Send each (peer, array) of `sends` and fill each (peer, array) of
        `receives`, all at once; return when all are done. Arrays are
        contiguous; between two ranks, the sender's list and the receiver's
        list name their messages in the same order."""
        MPI = self._mpi
        comm = self.comm
        sources = list(dict.fromkeys(peer for peer, _ in receives))
        targets = list(dict.fromkeys(peer for peer, _ in sends))
        heard = np.zeros(len(sources), np.int64)
        requests = [comm.Irecv([heard[i:i + 1], MPI.INT64_T], peer, DATA_TAG) for i, peer in enumerate(sources)]
        requests += [comm.Irecv([a.view(np.uint8), MPI.BYTE], peer, DATA_TAG) for peer, a in receives if a.size]
        nreceives = len(requests)
        requests += [self._send([self._signature, MPI.INT64_T], 8, peer) for peer in targets]
        requests += [self._send([a.view(np.uint8), MPI.BYTE], a.nbytes, peer) for peer, a in sends if a.size]
        try:
            self._wait(requests, deadline, what, sources)
        except BaseException:
            self._orphan(requests, nreceives, (heard, sends, receives))
            raise
        wrong = [peer for peer, signature in zip(sources, heard) if signature != self._signature[0]]
        if wrong:
            raise self.different_call(wrong[0], what)

    def _send(self, buffer, nbytes, peer):
        """MPI_Isend of `buffer` (`nbytes`) to `peer`, synchronous where it
        is the CONFIRM_EVERY-th eager send to that peer (as a Program's)."""
        if self.confirms(peer, nbytes):
            self.unconfirmed_sends[peer] += 1
            if self.unconfirmed_sends[peer] >= CONFIRM_EVERY:
                self.unconfirmed_sends[peer] = 0
                return self.comm.Issend(buffer, peer, DATA_TAG)
        return self.comm.Isend(buffer, peer, DATA_TAG)

    def repeated_exchange(self, sends, receives, one_payload=False):
        """The RepeatedExchange of messages to each (peer, nbytes) of
        `sends` and from each of `receives`, for a Program to run; orphan()
        or its free() ends it. `one_payload`: every send carries the same
        bytes, from one buffer."""
        return RepeatedExchange(self.comm, sends, receives, one_payload)

    def orphan(self, exchange, *kept):
        """A RepeatedExchange whose requests MPI may still hold (a failed call's):
        its receives cancelled, all kept alive with its buffers and `kept` (_orphan)."""
        self._orphan(exchange.requests + exchange.synchronous_sends, len(exchange.sources), (exchange, kept))

    def mpi_error(self, code, what, peer):
        """The error to raise for MPI's error `code` in a message with `peer`."""
        return self._error_of_class(self._mpi.Get_error_class(code), f"{code}", what, peer)

    def different_call(self, peer, what):
        return InvalidUsageError(f"rank {peer} is in a different call from rank {self.rank}'s {what}; every rank "
                                 "must make the same calls in the same order")

    def _wait(self, requests, deadline, what, sources):
        """Poll `requests` until all are done: the deadline and the abort
        channel are checked between polls, and the core is yielded (ranks may
        outnumber cores), but never slept away: MPI moves a large message
        only while both ends call into it."""
        testall = self._mpi.Request.Testall
        statuses = [self._mpi.Status() for _ in requests]   # where MPI says which request failed, and how
        next_health = 0.0
        try:
            while not testall(requests, statuses):
                now = time.perf_counter()
                if now >= next_health:
                    self.check_health()
                    next_health = now + HEALTH_EVERY
                if now >= deadline:
                    raise timed_out_waiting(sources, what)
                os.sched_yield()
        except self._mpi.Exception as error:
            error_class = error.Get_error_class()
            if error_class == self._mpi.ERR_IN_STATUS:   # the failed request's own class
                error_class = self._failed_request_class(statuses, error_class)
            raise self._error_of_class(error_class, error, what, None) from error

    def _failed_request_class(self, statuses, default):
        """The error class of the request that failed, among a Testall's
        statuses: the first that is neither SUCCESS nor ERR_PENDING (the
        requests MPI had not completed when another failed: one of them
        comes before the truncated receive that says a peer made a
        different call, on three nodes and more)."""
        MPI = self._mpi
        classes = (MPI.Get_error_class(status.Get_error()) for status in statuses)
        return next((c for c in classes if c not in (MPI.SUCCESS, MPI.ERR_PENDING)), default)

    def _error_of_class(self, error_class, error, what, peer):
        """What an MPI error of `error_class` during `what` is to the caller."""
        MPI = self._mpi
        if error_class in (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING):
            return RankFailedError(f"MPI reports a failed rank during {what}: {error}")
        if error_class == MPI.ERR_TRUNCATE:
            return InvalidUsageError(
                f"{'a rank' if peer is None else f'rank {peer}'} on another node sent more bytes than {what} "
                "expects; every rank must make the same calls in the same order")
        dead = self._dead_watched()   # MPICH fails a message to a dead process with an error of no class of its own
        if dead:
            return self._died(dead, f" during {what} (MPI: {error})")
        return CollectiveError(f"MPI failed during {what}: {error}")

    def _orphan(self, requests, nreceives, buffers):
        """Requests of an exchange that failed, its first `nreceives` the
        receives: cancel the receives that have not completed, and keep
        every buffer alive, since MPI may still hold them. A send is never
        cancelled: cancelling a started large send crashed MPICH (3 of 6
        runs of two nodes' allreduces of different large sizes)."""
        for request in requests[:nreceives]:
            try:
                if not request.Test():
                    request.Cancel()
            except self._mpi.Exception:
                pass
        self.hold((requests, buffers))

    def hold(self, requests_and_buffers):
        """Requests MPI may still complete, and their buffers: kept alive (_HELD_FOR_MPI)."""
        self._orphans.append(requests_and_buffers)
        _HELD_FOR_MPI[self._held].append(requests_and_buffers)

    def close(self):
        """Release the duplicate communicator (when no exchange failed)."""
        if self.comm is None:
            return
        try:
            self._abort_request.Cancel()
            if self._aborted is None and not self._orphans:
                self._abort_request.Wait()
                self.comm.Free()
                del _HELD_FOR_MPI[self._held]   # nothing of this link's is left with MPI
        except self._mpi.Exception:
            pass
        self.comm = None


# Every link's receives MPI may still complete (the abort channel's, those
# of failed exchanges) and its sends, with their buffers, by link: kept
# until the link's close() finds nothing of it left with MPI, else past the
# interpreter's end. mpi4py calls MPI_Finalize after the interpreter has
# freed its objects, modules' globals included, so a communicator left
# unclosed (an aborted one, say) had its buffers freed first, and a message
# arriving then (a peer's abort) was written into freed memory: valgrind
# showed it, and about one exit in six after an aborted call crashed
# ("malloc(): unsorted double linked list corrupted"). The dict holds one
# reference more than its name gives, so the interpreter never frees it.
_HELD_FOR_MPI = {}
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_HELD_FOR_MPI))
_LINK_NUMBERS = itertools.count()


class RepeatedExchange:
    """Buffers and persistent requests for one repeated exchange: a message
    to or from a peer is 8 bytes of call signature, then the payload;
    receives first, in each peer's order (MPI matches a pair's messages in
    the order they were posted). A message longer than its receive buffer
    fails its request (MPI's truncation); one whose header is not the
    call's signature is another call's. A shorter message of the same call
    cannot come: the small path's signatures are no other path's
    (across.py), and a Program zeroes each receive header first."""

    def __init__(self, comm, sends, receives, one_payload=False):
        from mpi4py import MPI

        self.sources = [peer for peer, _ in receives]
        self.targets = [peer for peer, _ in sends]
        # (one buffer for all: MPI lets concurrent sends read the same memory)
        self._sent = [np.zeros(8 + nbytes, np.uint8) for _, nbytes in (sends[:1] if one_payload else sends)]
        self._sent *= len(sends) if one_payload else 1
        self._received = [np.zeros(8 + nbytes, np.uint8) for _, nbytes in receives]
        self.send_payloads = [b[8:] for b in self._sent]
        self.receive_payloads = [b[8:] for b in self._received]
        self.requests = [comm.Recv_init([b, MPI.BYTE], peer, DATA_TAG) for (peer, _), b in zip(receives, self._received)]
        self.requests += [comm.Send_init([b, MPI.BYTE], peer, DATA_TAG) for (peer, _), b in zip(sends, self._sent)]
        # the same sends, synchronous: what a Program starts instead every CONFIRM_EVERY sends to a peer
        self.synchronous_sends = [comm.Ssend_init([b, MPI.BYTE], peer, DATA_TAG)
                                  for (peer, _), b in zip(sends, self._sent)]
        self._addressof = MPI._addressof   # noqa: SLF001 - where mpi4py keeps a request's handle
        self._kept = []

    @property
    def nbytes(self):
        """Its buffers' bytes (the arrays kept included)."""
        return sum(b.nbytes for b in {id(b): b for b in self._sent + self._received + self._kept}.values())

    def keep(self, array):
        """Keep `array` (memory a Program points into) alive as long as this exchange; returns it."""
        self._kept.append(array)
        return array

    def send_header_addresses(self):
        return list(dict.fromkeys(b.ctypes.data for b in self._sent))   # (each shared buffer once)

    def receive_header_addresses(self):
        return [b.ctypes.data for b in self._received]

    def request_addresses(self):
        """Where each request's handle lives (mpi4py's Request object): what MPI_Start and MPI_Test take."""
        return [self._addressof(request) for request in self.requests]

    def synchronous_send_addresses(self):
        """The synchronous sends' handles, in the order of the sends' requests."""
        return [self._addressof(request) for request in self.synchronous_sends]

    def confirmed_peers(self, confirms):
        """Each send's peer where `confirms(peer, nbytes)` (MpiLink.confirms:
        a Program then sends it synchronously at times), else -1."""
        return [peer if confirms(peer, message.nbytes) else -1 for peer, message in zip(self.targets, self._sent)]

    def free(self):
        for request in self.requests + self.synchronous_sends:
            try:
                request.Free()
            except Exception:   # noqa: BLE001 - a request MPI already released
                pass
