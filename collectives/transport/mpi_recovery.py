"""Going on after a failure across nodes: the survivors agree over MPI.

recovery.py's agreement needs a segment that every survivor maps; ranks on
different nodes share none. Their MPI communicator (the link's, mpi.py)
still carries messages between survivors after a rank died, and
MPI_Comm_create_group makes a communicator of a group with only the
group's members taking part, the dead ones not (MPICH 5.0.2: 3 survivors
of 4 after a SIGKILL, 2-14 ms, on one machine and between hosts of
namespaces). So the survivors agree on who is left by messages, then ask
MPI for a communicator of themselves, where the shrunk communicator starts
as any other does (hierarchy.py, HierarchicalCommunicator.shrink).

The agreement, one coordinator at a time:

    the coordinator is the lowest candidate that has not failed;
    every other candidate sends it JOIN;
    it waits until every candidate joined or failed (or the deadline),
    and sends every candidate it did not see fail the DECISION: the
    members, those that joined, in rank order (itself first);
    a candidate whose coordinator failed before the decision came, or
    whose decision names a member that failed since, drops the failed
    ones and goes on with the next coordinator.

Every message to coordinator c, and every decision from it, carries tag
TAG_BASE + c: the ranks that take c for their coordinator meet on that tag
whatever each went through before. A candidate that did not join in time
is told it was left out (RankExcludedError).

Which ranks failed is read from /proc (recovery.process_failed), so every
rank must be on this machine (pretend nodes). Across machines a rank
cannot tell a dead peer from a slow one, and MPICH crashes a sender whose
peer on another machine died (mpi.py, MpiLink.abort): not offered there.
"""

import threading
import time

import numpy as np

from ..errors import CollectiveError, CollectiveTimeoutError, RankExcludedError, RankFailedError
from .recovery import POLL_SECONDS, process_failed

TAG_BASE = 1 << 14   # + the coordinator's rank (mpi.py's ABORT_TAG and DATA_TAG are 1 and 2)
AGREE_TAG_BASE = TAG_BASE + (1 << 13)   # + the coordinator's rank: agree's flags and decisions
RELAY_TAG = TAG_BASE - 2                # agree's decisions, passed on by each rank that got one
# MPI_Comm_create_group's, one per decision (group_tag): a member that died
# inside the call leaves the others' threads blocked in it for good, still
# receiving on its tag, and the next decision's call on the same tag lost
# its messages to them (survivors on two nodes then timed out in every
# later shrink; Open MPI 5.0.11's next call waits behind the blocked one
# whatever its tag). Within the 32767 that every MPI allows (so agree's tags
# above leave room for coordinators below rank 4096).
GROUP_TAG_BASE = AGREE_TAG_BASE + (1 << 12)
GROUP_TAGS = (1 << 15) - GROUP_TAG_BASE
RENDEZVOUS_TAG = TAG_BASE - 3           # SurvivorsRendezvous's
JOIN = 1


class Agreement:
    """The survivors' agreement on `link` (an MpiLink, aborted or not):
    `pids[q]` is rank q's process id, all on this machine."""

    def __init__(self, link, pids):
        self.link, self.pids = link, tuple(pids)
        self.rank, self.size = link.rank, link.size
        self.agreements = 0   # agree calls made: each message of one carries its number
        self.decisions = 0    # shrink decisions this rank made as coordinator: each has a number of its own

    def failed(self, rank):
        return rank != self.rank and process_failed(self.pids[rank])

    def members(self, candidates, deadline):
        """The members every survivor that returns agrees on (this rank
        among them), in rank order, and the decision's number (the same on
        every member, another for every decision: what the new
        communicator's start-up messages carry). Raises RankExcludedError
        where the coordinator left this rank out, CollectiveTimeoutError
        where no decision came by `deadline`."""
        candidates = [q for q in candidates if not self.failed(q)]
        while True:
            coordinator = candidates[0]
            if coordinator == self.rank:
                members, number = self._coordinate(candidates, deadline)
            else:
                members, number = self._follow(coordinator, deadline)
            if members is None:                       # the coordinator failed first
                candidates = [q for q in candidates if q != coordinator and not self.failed(q)]
                continue
            if self.rank not in members:
                raise RankExcludedError(
                    f"rank {self.rank} was left out of the shrunk communicator: rank {coordinator} decided on "
                    f"ranks {', '.join(map(str, members))} before it joined")
            if any(self.failed(q) for q in members):  # a member failed since: the next coordinator decides
                candidates = [q for q in members if not self.failed(q)]
                continue
            return members, number

    def _coordinate(self, candidates, deadline):
        comm, mpi = self.link.comm, self.link.mpi
        tag = TAG_BASE + self.rank
        waiting = {q: (np.zeros(1, np.int64), None) for q in candidates if q != self.rank}
        waiting = {q: (b, comm.Irecv([b, mpi.INT64_T], q, tag)) for q, (b, _) in waiting.items()}
        joined = {self.rank}
        while waiting and time.perf_counter() < deadline:
            for q, (buffer, request) in list(waiting.items()):
                if request.Test():
                    joined.add(q)
                    del waiting[q]
                elif self.failed(q):
                    self._abandon(request, buffer)
                    del waiting[q]
            if waiting:
                time.sleep(POLL_SECONDS)
        for q, (buffer, request) in waiting.items():   # late: left out, and told so
            self._abandon(request, buffer)
        members = sorted(joined)
        self.decisions += 1
        number = (self.rank + 1) << 32 | self.decisions
        decision = np.append(_bits(members, self.size), np.int64(number))
        told = [q for q in candidates if q != self.rank and not self.failed(q)]
        sends = [comm.Isend([decision, mpi.INT64_T], q, tag) for q in told]
        self._finish_sends(sends, decision, told, deadline)
        return members, number

    def _follow(self, coordinator, deadline):
        """The coordinator's decision and its number, or (None, None) once it failed without one."""
        comm, mpi = self.link.comm, self.link.mpi
        tag = TAG_BASE + coordinator
        join = np.full(1, JOIN, np.int64)
        decision = np.zeros(_words(self.size) + 1, np.int64)
        sent = comm.Isend([join, mpi.INT64_T], coordinator, tag)
        received = comm.Irecv([decision, mpi.INT64_T], coordinator, tag)
        while not received.Test():
            if self.failed(coordinator):
                if received.Test():
                    break
                self._abandon(received, decision)
                self.link.hold(([sent], join))
                return None, None
            if time.perf_counter() >= deadline:
                self._abandon(received, decision)
                self.link.hold(([sent], join))
                raise CollectiveTimeoutError(f"timed out waiting for rank {coordinator} to decide who is left "
                                             "after the failure (it coordinates the shrink)")
            time.sleep(POLL_SECONDS)
        if not sent.Test():   # it decided, so it took the JOIN; MPI may still hold it for a moment
            self.link.hold(([sent], join))
        return _members(decision[:-1], self.size), int(decision[-1])

    def _finish_sends(self, sends, buffer, peers, deadline):
        """Wait (bounded) for the decisions to leave; a peer that failed never takes its own."""
        pending = list(zip(sends, peers))
        until = min(deadline, time.perf_counter() + 1.0)
        while pending and time.perf_counter() < until:
            pending = [(s, q) for s, q in pending if not s.Test() and not self.failed(q)]
            if pending:
                time.sleep(POLL_SECONDS)
        if pending:   # (sends are never cancelled: cancelling a started send crashed MPICH, mpi.py)
            self.link.hold(([s for s, _ in pending], buffer))

    def _abandon(self, receive, buffer):
        """A receive no message will complete: cancelled, and kept from MPI's reach until the link's end
        unless MPI is done with it at once (every agree call abandons one: they would pile up)."""
        try:
            receive.Cancel()
            if receive.Test():
                return
        except self.link.mpi.Exception:
            pass
        self.link.hold(([receive], buffer))


class _Agree:
    """One agree call's messages: (call number, value), int64 each."""

    def __init__(self, agreement, call):
        self.a, self.call = agreement, call
        self.comm, self.mpi = agreement.link.comm, agreement.link.mpi

    def message(self, value):
        return np.array([self.call, value], np.int64)

    def receive(self, source, tag):
        buffer = np.zeros(2, np.int64)
        return buffer, self.comm.Irecv([buffer, self.mpi.INT64_T], source, tag)

    def taken(self, buffer, request, source, tag):
        """True once `request` took this call's message into `buffer`; else
        the request to look at next time (one that took an earlier call's
        message, stale: its sender went on without an answer, is posted
        again)."""
        while request.Test():
            if buffer[0] == self.call:
                return True
            request = self.comm.Irecv([buffer, self.mpi.INT64_T], source, tag)
        return request

    def send_all(self, value, peers, deadline):
        message = self.message(value)
        self.a._finish_sends([self.comm.Isend([message, self.mpi.INT64_T], q, RELAY_TAG) for q in peers],
                             message, peers, deadline)


def agree(agreement, flag, candidates, deadline, call=None):
    """The AND of every candidate's `flag`, the same on every rank that
    returns while ranks fail: agreement.members's coordinator collects the
    flags (a candidate that fails first counts as False, one that comes
    after the deadline too) and sends the AND; a rank passes the decision to
    every other candidate before it returns (RELAY_TAG), so that once one
    rank returned a value, a rank whose coordinator then died finds it
    waiting rather than deciding anew. Its messages carry the call's
    number: the agreement's count of agree calls, or `call` where the
    candidates share another (a shrink decision's, which is larger than
    any count, for the members' confirmation of their start)."""
    a = agreement
    if call is None:
        a.agreements += 1
        call = a.agreements
    call = _Agree(a, call)
    relayed, relay = call.receive(a.link.mpi.ANY_SOURCE, RELAY_TAG)
    everyone, candidates = candidates, [q for q in candidates if not a.failed(q)]
    try:
        while True:
            coordinator = candidates[0]
            tag = AGREE_TAG_BASE + coordinator
            if coordinator == a.rank:
                value = _collect(call, flag and len(candidates) == len(everyone), candidates, tag, deadline)
                call.send_all(value, [q for q in candidates if q != a.rank and not a.failed(q)], deadline)
                return bool(value)
            mine = call.message(int(flag))
            sent = a.link.comm.Isend([mine, a.link.mpi.INT64_T], coordinator, tag)
            decided, decision = call.receive(coordinator, tag)
            while True:
                if (decision := call.taken(decided, decision, coordinator, tag)) is True:
                    value = int(decided[1])
                    break
                if (relay := call.taken(relayed, relay, a.link.mpi.ANY_SOURCE, RELAY_TAG)) is True:
                    a._abandon(decision, decided)
                    _let_go(a, sent, mine)
                    return bool(relayed[1])   # (its sender passed it on to every candidate already)
                if a.failed(coordinator):
                    a._abandon(decision, decided)
                    _let_go(a, sent, mine)
                    value = None
                    break
                if time.perf_counter() >= deadline:
                    a._abandon(decision, decided)
                    _let_go(a, sent, mine)
                    raise CollectiveTimeoutError(f"timed out waiting for rank {coordinator} to decide agree "
                                                 f"call #{call.call} (it coordinates it)")
                time.sleep(POLL_SECONDS)
            if value is None:   # (the next coordinator counts the failed one as False)
                candidates = [q for q in candidates if q != coordinator and not a.failed(q)]
                continue
            _let_go(a, sent, mine)
            call.send_all(value, [q for q in candidates if q not in (a.rank, coordinator) and not a.failed(q)],
                          deadline)
            return bool(value)
    finally:
        if relay is not True:
            a._abandon(relay, relayed)


def _let_go(agreement, sent, buffer):
    """A small send is done at once (MPI sends it eagerly); one that is not is kept from MPI's reach."""
    if not sent.Test():
        agreement.link.hold(([sent], buffer))


def _collect(call, flag, candidates, tag, deadline):
    """The coordinator's AND: its own flag and every candidate's that came in time."""
    a, value = call.a, bool(flag)
    waiting = {}
    for q in candidates:
        if q != a.rank:
            buffer, request = call.receive(q, tag)
            waiting[q] = (buffer, request)
    while waiting and time.perf_counter() < deadline:
        for q, (buffer, request) in list(waiting.items()):
            request = call.taken(buffer, request, q, tag)
            if request is True:
                value = value and bool(buffer[1])
                del waiting[q]
            elif a.failed(q):
                a._abandon(request, buffer)
                value = False
                del waiting[q]
            else:
                waiting[q] = (buffer, request)
        if waiting:
            time.sleep(POLL_SECONDS)
    for q, (buffer, request) in waiting.items():   # late: counted False
        a._abandon(request, buffer)
        value = False
    return int(value)


class SurvivorsRendezvous:
    """bootstrap.py's rendezvous among `members` (ranks of the link's
    communicator), by messages on the link's communicator: where the
    shrunk communicator needs no MPI communicator of its own (its ranks on
    one node), it starts with no MPI collective, which a member that dies
    would leave blocked. Every message carries `attempt` (the decision's
    number, Agreement.members) and its exchange's number: one left over
    from an attempt a member died in is passed over."""

    def __init__(self, agreement, members, attempt, world_rank, world_size):
        self.a, self.members, self.attempt = agreement, tuple(members), attempt
        self.rank, self.size = self.members.index(agreement.rank), len(self.members)
        self.world_rank, self.world_size = world_rank, world_size
        self._exchanges = 0

    def allgather(self, data, nbytes, deadline, what):
        comm, mpi = self.a.link.comm, self.a.link.mpi
        self._exchanges += 1
        stamp = np.array([self.attempt, self._exchanges], np.int64).view(np.uint8)
        mine = np.zeros(16 + nbytes, np.uint8)
        mine[:16] = stamp
        mine[16:16 + len(data[:nbytes])] = np.frombuffer(data[:nbytes], np.uint8)
        everyone = {self.rank: mine}
        sends = [comm.Isend([mine, mpi.BYTE], q, RENDEZVOUS_TAG) for q in self.members if q != self.a.rank]
        pending = {}
        for r, q in enumerate(self.members):
            if q != self.a.rank:
                buffer = np.zeros(16 + nbytes, np.uint8)
                pending[r] = (q, buffer, comm.Irecv([buffer, mpi.BYTE], q, RENDEZVOUS_TAG))
        try:
            while pending:
                for r, (q, buffer, request) in list(pending.items()):
                    while request is not None and request.Test():
                        if bytes(buffer[:16]) == bytes(stamp):
                            everyone[r] = buffer
                            del pending[r]
                            request = None
                        else:   # an earlier attempt's
                            request = comm.Irecv([buffer, mpi.BYTE], q, RENDEZVOUS_TAG)
                    if request is not None:
                        if self.a.failed(q):
                            raise RankFailedError(f"rank {q} died while the shrunk communicator started ({what})")
                        pending[r] = (q, buffer, request)
                if pending:
                    if time.perf_counter() >= deadline:
                        raise CollectiveTimeoutError(f"timed out while the shrunk communicator started, waiting for "
                                                     f"{what}")
                    time.sleep(POLL_SECONDS)
        finally:
            for q, buffer, request in pending.values():
                self.a._abandon(request, buffer)
            self.a._finish_sends(sends, mine, [q for q in self.members if q != self.a.rank], deadline)
        return [bytes(everyone[r][16:]) for r in range(self.size)]

    def barrier(self, deadline, what):
        self.allgather(b"", 1, deadline, what)

    def link(self, deadline):
        raise CollectiveError("the survivors of a failure across nodes start a communicator on one node only "
                              "without MPI's communicator of their own")


def group_tag(decision):
    """The tag of MPI_Comm_create_group for decision number `decision`
    (Agreement.members'): another for each decision of a recovery."""
    coordinator, number = decision >> 32, decision & 0xFFFFFFFF
    return GROUP_TAG_BASE + (coordinator * 64 + number) % GROUP_TAGS


# How long a member that saw another fail still waits for its own part of
# MPI_Comm_create_group. A member that died after its part had returned (in
# the shrunk communicator's start) leaves the others' parts about to return,
# and a part that returns goes on to that start, which fails there on every
# member alike and is agreed on (hierarchy.py, _start_on_every_member); a
# member that gave up here instead would leave the others waiting for it in
# that agreement until the deadline. One that died before its part never
# lets the others' return: they wait this long for nothing.
FAILED_MEMBER_GRACE = 0.25


def create_group(link, members, decision, pids, deadline):
    """MPI's communicator of `members` (ranks of the link's communicator),
    made by the members alone (MPI_Comm_create_group), for decision number
    `decision`. It has no nonblocking form: it runs on a thread of its
    own, and a member that dies during it leaves that thread blocked in
    MPI (on its decision's tag: group_tag); this rank raises
    RankFailedError at the deadline, or FAILED_MEMBER_GRACE after it saw a
    member fail where its own part has not returned by then."""
    group = link.comm.Get_group().Incl(list(members))
    made, errors = [], []

    def create():
        try:
            made.append(link.comm.Create_group(group, group_tag(decision)))
        except BaseException as error:   # noqa: BLE001 - reported on the caller's thread
            errors.append(error)

    thread = threading.Thread(target=create, name="collectives-create-group", daemon=True)
    thread.start()
    failed_at = None
    while thread.is_alive():
        failed = [q for q in members if q != link.rank and process_failed(pids[q])]
        now = time.perf_counter()
        if failed and failed_at is None:
            failed_at = now
        if now >= deadline or failed and now - failed_at >= FAILED_MEMBER_GRACE:
            what = (f"rank(s) {', '.join(map(str, failed))} failed" if failed
                    else "the members did not all come within the timeout")
            raise RankFailedError(f"making MPI's communicator of the shrunk communicator's ranks failed: {what}")
        thread.join(POLL_SECONDS)
    group.Free()
    if errors:
        raise RankFailedError(f"making MPI's communicator of the shrunk communicator's ranks failed: {errors[0]}")
    return made[0]


def _words(size):
    return (size + 63) // 64


def _bits(members, size):
    words = np.zeros(_words(size), np.uint64)
    for q in members:
        words[q // 64] |= np.uint64(1) << np.uint64(q % 64)
    return words.view(np.int64)


def _members(decision, size):
    words = decision.view(np.uint64)
    return [q for q in range(size) if int(words[q // 64]) >> (q % 64) & 1]
