"""Point-to-point messages: send, recv, isend, irecv between ranks.

Between processes on one machine a message crosses a mailbox of the control
segment (layout.py), one per ordered pair of ranks (sender, receiver):

    the sender cuts the message into fragments of at most a slot's bytes
    (layout.fragment_bytes: up to MAILBOX_SLOTS of them where it fits; one
    fragment, empty, for an empty message); fragment k goes to slot
    k % MAILBOX_SLOTS, its header giving the message's bytes, its tag, the
    fragment's offset and its bytes; then the sender publishes SENT = k + 1,
    before it copies the next (the receiver copies one fragment out while
    the sender copies the next in).
    The receiver, seeing SENT > k, copies fragment k out and publishes
    TAKEN = k + 1; the sender reuses slot k % MAILBOX_SLOTS only once
    SENT - TAKEN < MAILBOX_SLOTS.

Each side writes only its own counter, on its own cache line (release
stores, acquire loads: Counters), so the mailbox needs no lock. A message
that fits the free slots is sent at once (a send returns with the data
copied out of the caller's array).

A message larger than the free slots streams through them: the sender
puts each fragment in as soon as the receiver has freed its slot, so the
two copy at once, through slots that stay in cache.

A message of 4 MiB or more ($COLLECTIVES_MESSAGE_SINGLE_COPY_MIN,
config.py: where a stream, which needs both processes running at once,
stopped gaining) is copied once instead: its one fragment is a descriptor
(FRAGMENT_OFFSET SINGLE_COPY, the sender's pid and the address of its
bytes), and the receiver reads the bytes straight out of the sender's
process into its array (process_vm_readv, as the compiled loop's large
collectives do), then publishes TAKEN; the send completes once TAKEN
passes the descriptor, and the sender's array is read in place until then
(an isend's, until its wait). A receiver that cannot read the sender's
memory (another user, a ptrace restriction, a seccomp filter, or no
compiled loop) raises the descriptor's REFUSED word before TAKEN: the
sender then sends that message, and every later one to that rank, as
fragments, which the receiver goes on reading into the same array.

Matching is MPI's. Messages of one pair arrive in the order they were
sent. A receive takes the first message from its peer (any peer, for
`peer=None`) with its tag; receives are matched in the order they were
posted. A message at the head of a pair that no posted receive wants is
left in its slots, unless a posted receive waits for that pair behind it:
then it is read ahead into this process's memory ("unexpected"), where a
later receive finds it. A message to oneself goes there directly.

Nothing moves without a call: the requests of this rank progress whenever
it waits for one of them (and at each post), every pending one, in the
order posted, so two ranks that each wait for their own send while the
other's receive is pending both get through. Where nothing else is
pending, an isend whose fragments fit the free slots is done at its post
(mailbox_put), and an irecv from a named peer waits for its message in
one compiled call (mailbox_take) when it is waited for.

The blocking send and recv skip the engine where it has nothing to do
(_mailbox.c's mailbox_put, mailbox_stream, mailbox_send_single_copy and
mailbox_take: the same slots and counters, one compiled call): a send to
a rank with no send to it pending, and a receive from a named peer by a
rank with nothing pending, of the head message when it has the receive's
tag and bytes. Otherwise the engine runs, and it reads the same
mailboxes, so both mix. The communicator tries the common two before any
Python of its own, through this rank's Postbox (_mailbox.c), which checks
the arguments itself and declines while the engine has anything pending
(the engine tells it: _tell_postbox); what it declines comes here.

A failure (a timeout, a peer that died, a receive whose array does not
have the message's bytes) aborts the communicator as a failed collective
does: the message half-sent in a mailbox leaves that pair unusable.
"""

import collections
import math
import os
import time
from typing import Callable, NamedTuple

import numpy as np

from ..config import resolve_message_single_copy_min
from ..errors import CollectiveError, CollectiveTimeoutError, InvalidUsageError
from ..validation import MAX_TAG, MESSAGE_DTYPES
from .layout import (
    DESCRIPTOR_ADDRESS, DESCRIPTOR_PID, DESCRIPTOR_REFUSED, FRAGMENT_BYTES, FRAGMENT_OFFSET, MAILBOX_FRAGMENT_MIN,
    MAILBOX_HEADER, MAILBOX_SENT, MAILBOX_SLOT_BYTES, MAILBOX_SLOT_HEADER, MAILBOX_SLOTS, MAILBOX_TAKEN,
    MESSAGE_BYTES, MESSAGE_TAG, SINGLE_COPY, fragment_bytes, mailbox_bytes, mailboxes_offset,
)
from .fastpath import weakly
from .protocol import Counters, Waiter

_SLOT_STRIDE = MAILBOX_SLOT_HEADER + MAILBOX_SLOT_BYTES
SLOTS_BYTES = MAILBOX_SLOTS * MAILBOX_SLOT_BYTES   # a message up to this fits a mailbox's free slots at once
MESSAGE_ARRAYS = (np.ndarray,)   # what the one-frame send and receive take: exactly NumPy's arrays

try:
    from . import _mailbox   # the compiled send and receive (setup.py builds it when a C compiler is there)
    _mailbox.mailbox_layout(MAILBOX_HEADER, MAILBOX_SENT, MAILBOX_TAKEN, MAILBOX_SLOTS, MAILBOX_SLOT_HEADER,
                            MAILBOX_SLOT_BYTES, MESSAGE_BYTES, MESSAGE_TAG, FRAGMENT_OFFSET, DESCRIPTOR_PID,
                            DESCRIPTOR_ADDRESS, DESCRIPTOR_REFUSED, FRAGMENT_BYTES, MAILBOX_FRAGMENT_MIN)
    assert _mailbox.SINGLE_COPY == SINGLE_COPY, "_mailbox.c's descriptor offset"
except ImportError:
    _mailbox = None


class Request:
    """A send or receive in flight (isend, irecv). `wait()` returns once it
    is done: for a receive, the rank the message came from (its `source`);
    `test()` says whether it is done, moving what can move."""

    def __init__(self, engine, kind, peer, tag, data):
        self._engine = engine
        self.kind, self.peer, self.tag = kind, peer, tag
        self.data = data            # the caller's bytes (a flat uint8 view)
        self.done_bytes = 0
        self.done = False
        self.source = None          # a receive's sender, once matched
        self.descriptor_at = None   # a single-copy send's: the SENT index of its descriptor, once posted

    def __repr__(self):
        state = "done" if self.done else "pending"
        return f"<Request {self.kind} {'any rank' if self.peer is None else f'rank {self.peer}'} " \
               f"tag {self.tag} ({self.data.nbytes} bytes) {state}>"

    def wait(self, timeout=None):
        """Return once done (a receive: its source rank), within `timeout`
        seconds (None: the communicator's). Raises CollectiveTimeoutError,
        RankFailedError, or InvalidUsageError for a message whose bytes
        differ from the receive's array (the communicator is then aborted)."""
        self._engine.wait(self, timeout)
        return self.source

    def test(self):
        """Whether the request is done, after moving what can move now."""
        if not self.done and not self._engine.closed:
            self._engine.progress()
        return self.done


class _ReadAhead:
    """A message no posted receive wants yet, copied into this process."""

    def __init__(self, source, tag, nbytes):
        self.source, self.tag = source, tag
        self.data = np.empty(nbytes, np.uint8)
        self.done_bytes = 0


class CompiledWaits(NamedTuple):
    """What the compiled send and receive need of the ranks (shm.py):
    where the abort flag is, each rank's process id (and where the ranks'
    rows that hold them are), and how a wait spins."""
    abort_address: int
    pid_of: Callable[[int], int]
    spin: int
    yield_seconds: float
    rows_address: int


class PointToPoint:
    """This rank's sends and receives; `mailboxes` None where it has no
    peers in other processes (it can then message itself alone). With
    `compiled` (CompiledWaits) and the compiled loop built, a blocking send
    or receive takes the compiled mailbox calls where they apply (see
    send and recv)."""

    def __init__(self, rank, size, mailboxes, timeout_of, check_health, abort, compiled=None,
                 single_copy_min=None):
        self.rank, self.size = rank, size
        # Messages of at least this many bytes go in one copy (module doc;
        # infinity: none), never one that fits the slots at once.
        threshold = resolve_message_single_copy_min(single_copy_min)
        self.single_copy_min = max(SLOTS_BYTES + 1, threshold) if threshold else math.inf
        self._mailboxes = mailboxes
        self._compiled = compiled if _mailbox is not None and mailboxes is not None else None
        self._timeout_of = timeout_of           # () -> the communicator's timeout
        self._check_health = check_health       # (peer or None, during) -> raises if aborted or peer died
        self._abort = abort                     # (reason, cause)
        self._sends = collections.defaultdict(collections.deque)   # peer -> its sends, in order
        self._receives = []                     # posted, not done, in the order posted
        self._reading = {}                      # peer -> the receive (or read-ahead) its head message fills
        self._unexpected = collections.defaultdict(collections.deque)   # source -> complete _ReadAheads
        self._refused = set()                   # peers that cannot read this process's memory (module doc)
        self.closed = False
        # Each peer's mailbox from this rank and to it (the compiled calls take their addresses).
        self._outboxes = self._inboxes = None
        self._pids = [0] * size   # each peer's process, once it attached (it stays for the communicator's life)
        if mailboxes is not None:
            self._outboxes = [mailboxes.address(rank * size + peer) for peer in range(size)]
            self._inboxes = [mailboxes.address(peer * size + rank) for peer in range(size)]
        # The communicator's first try at a blocking send or receive, with no
        # Python frame (_mailbox.c, Postbox); None without the compiled calls.
        self.postbox = None
        if self._compiled is not None:
            self.postbox = _mailbox.Postbox(
                mailboxes.address(0), mailboxes.address(1) - mailboxes.address(0), rank, size,
                self._compiled.rows_address, self._compiled.abort_address, self._compiled.spin,
                self._compiled.yield_seconds, MESSAGE_ARRAYS, weakly(self._compiled_failure))

    # -- the common case in one frame (Communicator.send and recv ask these after the postbox) --

    def sent_at_once(self, x, peer, tag):
        """A blocking send of `x`, one C-contiguous NumPy array of a
        supported dtype and at most the slots' bytes, to another rank (an
        int, as the tag) with no send to it pending: one compiled call that
        puts every fragment in the free slots. True once sent; False where
        any of that does not hold or the fragments do not fit now (nothing
        sent: `send` checks the arguments and sends it)."""
        if x.__class__ is not np.ndarray or peer.__class__ is not int or tag.__class__ is not int \
                or self._outboxes is None or self._compiled is None or not 0 <= peer < self.size \
                or peer == self.rank or not 0 <= tag <= MAX_TAG or self._sends.get(peer) \
                or x.dtype not in MESSAGE_DTYPES or not x.flags.c_contiguous or x.nbytes > SLOTS_BYTES:
            return False
        return _mailbox.mailbox_put(self._outboxes[peer], x, tag)

    def received_at_once(self, out, peer, tag):
        """A blocking receive into `out`, one C-contiguous writable NumPy
        array of a supported dtype, from a named rank (an int, as the tag),
        with nothing pending on this rank: one compiled call that waits for
        the message and copies it out. The source once done; None where any
        of that does not hold, or the head message is not of this tag and
        size (nothing taken: `recv` checks and receives it)."""
        if out.__class__ is not np.ndarray or peer.__class__ is not int or tag.__class__ is not int \
                or self._inboxes is None or self._compiled is None or not 0 <= peer < self.size \
                or peer == self.rank or not 0 <= tag <= MAX_TAG or out.dtype not in MESSAGE_DTYPES \
                or self._receives or self._reading or self._unexpected.get(peer) or any(self._sends.values()):
            return None
        flags = out.flags
        if not (flags.c_contiguous and flags.writeable):
            return None
        return peer if self._taken(out, peer, tag, self._timeout_of()) else None

    def _taken(self, data, peer, tag, limit):
        """Take the head message of `peer`'s mailbox, of `tag` and of
        `data`'s bytes, into `data`, in one compiled call that waits for it
        up to `limit` seconds: True once done, False where it declined
        (another message at the head: nothing taken); a failure aborts the
        communicator and raises."""
        compiled = self._compiled
        status = _mailbox.mailbox_take(self._inboxes[peer], data, tag, time.perf_counter() + limit,
                                       compiled.abort_address, self._pids[peer] or self._pid_of(peer), compiled.spin,
                                       compiled.yield_seconds)
        if status == _mailbox.NOT_FAST:
            return False
        if status != 0:
            self._compiled_failure(status, peer, tag, data.nbytes, "recv")
        return True

    # -- posting ------------------------------------------------------------------

    def isend(self, data, peer, tag):
        request = Request(self, "send", peer, tag, data)
        if peer == self.rank:   # to oneself: straight to where a receive looks first
            copied = _ReadAhead(peer, tag, data.nbytes)
            copied.data[:] = data
            self._unexpected[peer].append(copied)
            request.done_bytes, request.done = data.nbytes, True
            self._tell_postbox()
            return request
        if self._compiled is not None and not self._pending() and _mailbox.mailbox_put(self._outboxes[peer], data, tag):
            request.done_bytes, request.done = data.nbytes, True   # (in the free slots: nothing else to move)
            return request
        self._sends[peer].append(request)
        self.progress()
        return request

    def _pending(self):
        """Whether this rank has anything pending: a request, or a message read ahead."""
        return bool(self._receives or self._reading or any(self._sends.values()) or any(self._unexpected.values()))

    def irecv(self, data, peer, tag):
        request = Request(self, "recv", peer, tag, data)
        alone = self._compiled is not None and peer is not None and not self._pending()
        self._receives.append(request)
        if alone:   # nothing else to move: its wait takes the message in one compiled call (_received_in_c)
            self._tell_postbox()
        else:
            self.progress()
        return request

    def _pid_of(self, peer):
        pid = self._pids[peer] = self._compiled.pid_of(peer)   # (0 until it attached: asked again next time)
        return pid

    # -- blocking calls: the compiled mailbox where it applies ----------------------

    def send(self, data, peer, tag):
        """A blocking send. Where nothing to `peer` is pending, one compiled
        call puts every fragment in the free slots if they fit (it never
        waits); else, where this rank has nothing pending at all, one
        compiled call that waits (_sent_waiting). Else isend and wait."""
        compiled = self._compiled
        if compiled is not None and peer != self.rank and not self._sends.get(peer):
            box = self._mailboxes.address(self.rank * self.size + peer)
            if _mailbox.mailbox_put(box, data, tag):
                return
            # (a waiting compiled call moves no other request, and a peer may
            # need one of this rank's to move before it takes this message)
            if not (self._receives or self._reading or any(self._sends.values())) \
                    and self._sent_waiting(box, data, peer, tag, compiled):
                return
        self.wait(self.isend(data, peer, tag), None)

    def _sent_waiting(self, box, data, peer, tag, compiled):
        """Send `data` in one compiled call that waits for the receiver: in
        one copy from `single_copy_min` (until the receiver has read it),
        else fragment by fragment as the receiver frees slots (until all
        but the slots' worth are taken). True once sent; False where the
        single copy found no free slot (nothing sent)."""
        waits = (time.perf_counter() + self._timeout_of(), compiled.abort_address, compiled.pid_of(peer),
                 compiled.spin, compiled.yield_seconds)
        if data.nbytes >= self.single_copy_min and peer not in self._refused:
            status = _mailbox.mailbox_send_single_copy(box, data, tag, *waits)
            if status == _mailbox.NOT_FAST:
                return False
            if status != _mailbox.REFUSED:
                if status != 0:
                    self._compiled_failure(status, peer, tag, data.nbytes, "send")
                return True
            self._refused.add(peer)   # the receiver now expects the message as fragments
        status = _mailbox.mailbox_stream(box, data, tag, *waits)
        if status != 0:
            self._compiled_failure(status, peer, tag, data.nbytes, "send")
        return True

    def recv(self, data, peer, tag):
        """A blocking receive; returns the source. Where this rank has
        nothing pending (a receive waiting in C would not move it) and
        names its peer, one compiled call waits for the message and copies
        it out, if the head of the mailbox is a message of `tag` and of
        `data`'s bytes; else (or for a message read ahead) irecv and wait."""
        if self._compiled is not None and peer is not None and peer != self.rank and not self._receives \
                and not self._reading and not self._unexpected.get(peer) and not any(self._sends.values()) \
                and self._taken(data, peer, tag, self._timeout_of()):
            return peer
        request = self.irecv(data, peer, tag)
        self.wait(request, None)
        return request.source

    def _compiled_failure(self, status, peer, tag, nbytes, kind):
        """Raise what the engine's wait raises for the compiled send's or
        receive's (`kind`) `status`, the communicator aborted first."""
        try:
            if status == _mailbox.TIMED_OUT:
                raise CollectiveTimeoutError(f"timed out waiting for rank {peer} to complete a {kind} of {nbytes} "
                                             f"bytes (tag {tag})")
            if status == _mailbox.MISMATCH:
                raise CollectiveError(f"a {kind} of {nbytes} bytes with rank {peer} (tag {tag}): a fragment in the "
                                      "mailbox lies outside its message (the control segment was overwritten)")
            self._check_health(peer, f"a {kind} with this rank")   # ABORTED, PEER_DEAD: the class of what happened
            raise CollectiveError(f"a {kind} of {nbytes} bytes with rank {peer} (tag {tag}) stopped: the "
                                  "communicator was aborted")
        except BaseException as error:
            self._fail(error)
            raise

    # -- moving -------------------------------------------------------------------

    def progress(self):
        """Move every pending request as far as it can go now."""
        try:
            for peer, sends in list(self._sends.items()):
                while sends and self._push(peer, sends[0]):
                    sends.popleft().done = True
            self._match_read_ahead()
            for peer in self._peers_to_read():
                self._pull(peer)
        except BaseException as error:
            self._fail(error)
            raise
        finally:
            self._tell_postbox()

    def _received_in_c(self, request, limit):
        """Wait for `request` in one compiled call where it is a receive from
        a named peer and the only thing pending here, nothing of its message
        taken yet (irecv then wait, as torch's backend does): the compiled
        take (mailbox_take) waits for the head message of that peer. True
        once done; False where it declined (another tag or size at the head:
        the engine matches it), nothing taken."""
        peer = request.peer
        if request.kind != "recv" or peer is None or self._compiled is None or self._receives != [request] \
                or self._reading or any(self._sends.values()) or any(self._unexpected.values()):
            return False
        if not self._taken(request.data, peer, request.tag, limit):
            return False
        self._receives.remove(request)
        request.done_bytes, request.done, request.source = request.data.nbytes, True, peer
        self._tell_postbox()
        return True

    def _tell_postbox(self):
        """Whether anything is pending here, for the postbox's shortcuts,
        which decline then (they would move no request and match nothing read
        ahead). Every change of the pending state ends in progress() or here."""
        if self.postbox is not None:
            self.postbox.busy = self._pending()

    def wait(self, request, timeout):
        if request.done:
            return
        if self.closed:
            raise InvalidUsageError(f"{request!r}: its communicator was closed before the request completed")
        limit = self._timeout_of() if timeout is None else timeout
        if self._received_in_c(request, limit):
            return
        waiter = Waiter(time.perf_counter() + limit)
        who = "any rank" if request.peer is None else f"rank {request.peer}"

        def describe():
            what = f"{request.kind} of {request.data.nbytes} bytes (tag {request.tag})"
            return f"{who} to complete a {what}: {request.done_bytes} bytes moved"

        try:
            waiter.until(lambda: self.progress() or request.done, describe,
                         lambda: self._check_health(request.peer, f"a {request.kind} with this rank"))
        except BaseException as error:
            self._fail(error)
            raise

    def _fail(self, error):
        """A failed p2p call aborts the communicator (see the module doc; the first abort wins)."""
        self._abort(f"{type(error).__name__}: {error}", error)

    def close(self):
        """Drop the mailboxes' views (before their segment goes); pending
        requests then raise when waited for."""
        if self.postbox is not None:
            self.postbox.closed = 1
        self._mailboxes = None
        self.closed = True

    # -- the sender's side of a mailbox ---------------------------------------------

    def _push(self, peer, request):
        """Put as many of `request`'s fragments in the mailbox to `peer` as
        fit; True once its last one is there."""
        box = self._mailboxes
        pair = self.rank * self.size + peer
        total = request.data.nbytes
        if total >= self.single_copy_min and peer not in self._refused:
            return self._push_descriptor(box, pair, peer, request)
        while True:
            sent = box.load(pair, MAILBOX_SENT)
            if sent - box.load(pair, MAILBOX_TAKEN) >= MAILBOX_SLOTS:
                return False
            start = request.done_bytes
            length = min(fragment_bytes(total), total - start)
            header, payload = box.slot(pair, sent % MAILBOX_SLOTS)
            header[MESSAGE_BYTES], header[MESSAGE_TAG], header[FRAGMENT_OFFSET] = total, request.tag, start
            header[FRAGMENT_BYTES] = length
            payload[:length] = request.data[start:start + length]
            box.publish(pair, MAILBOX_SENT, sent + 1)   # last: a receiver that sees it sees the fragment
            request.done_bytes = start + length
            if request.done_bytes == total:
                return True

    def _push_descriptor(self, box, pair, peer, request):
        """A single-copy send (module doc): its descriptor posted once a slot
        is free; True once the receiver has read the bytes. If it refused,
        the message goes as fragments from here on."""
        if request.descriptor_at is None:
            sent = box.load(pair, MAILBOX_SENT)
            if sent - box.load(pair, MAILBOX_TAKEN) >= MAILBOX_SLOTS:
                return False
            header, _ = box.slot(pair, sent % MAILBOX_SLOTS)
            header[MESSAGE_BYTES], header[MESSAGE_TAG], header[FRAGMENT_OFFSET] = \
                request.data.nbytes, request.tag, SINGLE_COPY
            header[DESCRIPTOR_PID], header[DESCRIPTOR_ADDRESS] = os.getpid(), request.data.ctypes.data
            header[DESCRIPTOR_REFUSED] = 0
            box.publish(pair, MAILBOX_SENT, sent + 1)   # last: a receiver that sees it sees the descriptor
            request.descriptor_at = sent
        if box.load(pair, MAILBOX_TAKEN) <= request.descriptor_at:
            return False
        header, _ = box.slot(pair, request.descriptor_at % MAILBOX_SLOTS)   # (read after TAKEN's acquire)
        if header[DESCRIPTOR_REFUSED]:
            self._refused.add(peer)
            return self._push(peer, request)
        request.done_bytes = request.data.nbytes
        return True

    # -- the receiver's side -------------------------------------------------------

    def _match_read_ahead(self):
        """Give posted receives the messages already read ahead, in order."""
        for request in list(self._receives):
            if request.source is not None:
                continue
            sources = range(self.size) if request.peer is None else (request.peer,)
            for source in sources:
                found = next((m for m in self._unexpected.get(source, ()) if m.tag == request.tag), None)
                if found is not None:
                    self._unexpected[source].remove(found)
                    self._claim(request, source, found.data.nbytes)
                    request.data[:] = found.data
                    self._complete(request, found.data.nbytes)
                    break

    def _peers_to_read(self):
        """The peers whose mailbox to this rank a posted receive may want."""
        if self._mailboxes is None:
            return ()
        wanted = set(self._reading)
        for request in self._receives:
            if request.source is None:
                if request.peer is None:
                    return [p for p in range(self.size) if p != self.rank]
                wanted.add(request.peer)
        wanted.discard(self.rank)
        return sorted(wanted)

    def _pull(self, peer):
        """Copy out the fragments waiting in `peer`'s mailbox to this rank,
        into the receive its message matches (or a read-ahead)."""
        box = self._mailboxes
        pair = peer * self.size + self.rank
        while True:
            taken = box.load(pair, MAILBOX_TAKEN)
            if box.load(pair, MAILBOX_SENT) <= taken:
                return
            header, payload = box.slot(pair, taken % MAILBOX_SLOTS)
            total, tag, start = int(header[MESSAGE_BYTES]), int(header[MESSAGE_TAG]), int(header[FRAGMENT_OFFSET])
            target = self._reading.get(peer)
            if target is None:
                target = self._target(peer, tag, total)
                if target is None:
                    return   # nobody wants it yet: it waits in the slots
                self._reading[peer] = target
            if start == SINGLE_COPY:
                if not self._read_descriptor(peer, header, target.data):
                    header[DESCRIPTOR_REFUSED] = 1   # the fragments follow, into the same target
                    box.publish(pair, MAILBOX_TAKEN, taken + 1)
                    continue
                target.done_bytes = total
            else:
                length = int(header[FRAGMENT_BYTES])
                target.data[start:start + length] = payload[:length]
                target.done_bytes = start + length
            box.publish(pair, MAILBOX_TAKEN, taken + 1)
            if target.done_bytes == total:
                del self._reading[peer]
                if isinstance(target, _ReadAhead):
                    self._unexpected[peer].append(target)
                else:
                    self._complete(target, total)

    def _read_descriptor(self, peer, header, into):
        """A single-copy message's bytes read out of its sender into `into`:
        True; False where this process cannot read them (the sender is then
        told so, and sends fragments). Raises where the sender died."""
        if self._compiled is None:   # (no compiled loop, nothing to read with)
            return False
        status = _mailbox.read_process(int(header[DESCRIPTOR_PID]), int(header[DESCRIPTOR_ADDRESS]), into,
                                       self._compiled.abort_address)
        if status in (_mailbox.PEER_DEAD, _mailbox.ABORTED):   # (aborted: see take_message in _mailbox.c)
            self._check_health(peer, "a recv with this rank")
            raise CollectiveError(f"rank {peer}'s message could not be read: its process is gone, or the "
                                  "communicator was aborted")
        return status == 0

    def _target(self, peer, tag, nbytes):
        """Where the message at the head of `peer`'s mailbox goes: the first
        posted receive that takes it, else a read-ahead if a receive waits
        for that mailbox behind it, else None."""
        waiting = False
        for request in self._receives:
            if request.source is not None or request.peer not in (peer, None):
                continue
            if request.tag == tag:
                self._claim(request, peer, nbytes)
                return request
            waiting = True
        return _ReadAhead(peer, tag, nbytes) if waiting else None

    def _claim(self, request, source, nbytes):
        if nbytes != request.data.nbytes:
            raise InvalidUsageError(
                f"out: the message from rank {source} (tag {request.tag}) has {nbytes} bytes, but the "
                f"receive's array has {request.data.nbytes}; a receive takes a message of its own size")
        request.source = source

    def _complete(self, request, nbytes):
        request.done_bytes, request.done = nbytes, True
        self._receives.remove(request)


class Mailboxes:
    """The control segment's mailboxes (layout.py), as counters and slot views."""

    def __init__(self, buffer, size, sizes):
        offset = mailboxes_offset(size, sizes)
        stride = mailbox_bytes()
        self._headers = np.ndarray((size * size, MAILBOX_HEADER // 8), np.int64, buffer, offset=offset,
                                   strides=(stride, 8))
        self._bytes = np.ndarray((size * size, stride), np.uint8, buffer, offset=offset)
        self._counters = Counters(self._headers)
        self._base = self._bytes.ctypes.data
        self._slots = {}

    def address(self, pair):
        """Where a pair's mailbox starts (the compiled calls take it)."""
        return self._base + pair * self._bytes.strides[0]

    def load(self, pair, word):
        return self._counters.load(pair, word)

    def publish(self, pair, word, value):
        self._counters.publish(pair, word, value)

    def slot(self, pair, index):
        """(header words, payload bytes) of a slot of a pair's mailbox."""
        key = (pair, index)
        views = self._slots.get(key)
        if views is None:
            start = MAILBOX_HEADER + index * _SLOT_STRIDE
            row = self._bytes[pair]
            views = self._slots[key] = (row[start:start + MAILBOX_SLOT_HEADER].view(np.int64),
                                        row[start + MAILBOX_SLOT_HEADER:start + _SLOT_STRIDE])
        return views
