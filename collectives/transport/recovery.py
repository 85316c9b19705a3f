"""Going on after a failure: the survivors agree, through the control segment.

When a rank of a communicator on one machine dies (or stops), every other
rank's call raises and the communicator is aborted (protocol.py). The
survivors still share the control segment: each mapped it at start-up, and
the kernel keeps it while one mapping is left, even when its holder (rank 0)
is the rank that died. This module is what they do there, with no failed
rank's help and no service outside the job:

agree(flag)   a uniform AND. Each rank writes its flag, then publishes the
              call's number; once every rank has published or is gone (dead,
              or stopped: SIGSTOP), one of them decides, by a compare-and-swap
              of the call's decision word from empty to its answer. Whoever
              loses the race, or comes late, takes the word's value: every
              rank that returns gets the same answer. A rank that failed
              before giving its flag counts as False (a step that lost a rank
              should not commit), and so does one that went on to shrink
              without giving it.

shrink        the members of the new communicator. In round k each survivor
              marks itself joined, then waits until every candidate has
              joined or is gone (or the deadline passes), and proposes the
              ranks it saw joined; the first proposal stored in the round's
              DECIDED word (compare-and-swap again) is the round's members,
              for every rank. A rank left out raises RankExcludedError. The
              lowest member makes the new communicator's control segment
              and writes its prefix in the round; the others map it; a
              barrier on the new communicator ends the round. A member that
              dies during the round (the maker before publishing, anyone
              before the barrier) fails the round on every member alike
              (the barrier cannot complete without it), and round k + 1
              starts from the round's members. A member that fails the
              round before it could map the new communicator (the maker
              died before it mapped, and its segment went with it) cannot
              abort it: it tells the others by joining round k + 1, which
              they see in its row here while they wait in round k (for the
              maker or in the barrier), and leave for round k + 1 too.
              Every wait is bounded by the deadline and notices a member
              that died. A shrink that raised CollectiveTimeoutError (the
              members did not meet in time) can be called again: it goes
              on with the next round, from the members of the last one.

Layout (where each word is): layout.py, "recovery". A segment sees at most
one shrink: the new communicator has its own segment, where the next
failure is recovered. Liveness is read from /proc: a pid that is gone, a
zombie, or stopped (state T) has failed; other states are waited for.
"""

import time

import numpy as np

from ..errors import CollectiveError, CollectiveTimeoutError, RankExcludedError, RankFailedError
from .layout import (
    AGREE_DECISIONS, AGREE_FLAG, AGREE_SEQ, DECIDED, JOINED, NAME_READY, PID, RECOVERY_NAME_BYTES,
    RECOVERY_NAME_OFFSET, RECOVERY_ROUND_BYTES, RECOVERY_ROUNDS, RECOVERY_ROW_BYTES, proposal_words,
    recovery_offset, recovery_parts,
)
from .segments import gone_or_going

try:
    from . import _shmloop
except ImportError:
    _shmloop = None

POLL_SECONDS = 2e-4


def process_failed(pid):
    """Whether the process `pid` can no longer take part: gone, a zombie,
    exiting, or stopped (SIGSTOP, or a tracer's stop). Unknown (0): no."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
    except OSError:
        return True
    return gone_or_going(text) or text.rsplit(b")", 1)[1].split()[0] in (b"T", b"t")


class RecoveryArea:
    """One rank's view of the recovery area of a control segment (`group`:
    the rank's protocol.ProcessGroup, aborted or not)."""

    def __init__(self, group):
        if _shmloop is None:
            raise CollectiveError("agree and shrink need the compiled loop collectives.transport._shmloop "
                                  "(its compare-and-swap); reinstall with a C compiler")
        self.group, self.rank, self.size = group, group.rank, group.size
        buf = group.control_buffer
        base = recovery_offset(self.size, group.fast_sizes)
        agreements, rows, proposals, _ = recovery_parts(self.size)
        self._rounds = np.ndarray((RECOVERY_ROUNDS, RECOVERY_ROUND_BYTES // 8), np.int64, buf, offset=base)
        self._names = np.ndarray((RECOVERY_ROUNDS, RECOVERY_ROUND_BYTES), np.uint8, buf, offset=base)
        self._decisions = np.ndarray((AGREE_DECISIONS,), np.int64, buf, offset=base + agreements)
        self._rows = np.ndarray((self.size, RECOVERY_ROW_BYTES // 8), np.int64, buf, offset=base + rows)
        self._proposals = np.ndarray((RECOVERY_ROUNDS, self.size, proposal_words(self.size)), np.int64, buf,
                                     offset=base + proposals)
        self._agreements = int(self._rows[self.rank, AGREE_SEQ])
        # The shrink's next round and its candidates: a shrink that timed
        # out and is called again goes on from there.
        self._next_round, self._candidates = 0, tuple(range(self.size))

    # -- the words, with release stores and acquire loads -------------------------

    def _load(self, array, *index):
        return _shmloop.load_acquire(_address(array, index))

    def _store(self, array, index, value):
        _shmloop.store_release(_address(array, index), value)

    def _swap_if_empty(self, array, index, value):
        """Store `value` where the word is 0; the word's value after (ours, or the winner's)."""
        found = _shmloop.compare_exchange(_address(array, index), 0, value)
        return value if found == 0 else found

    def failed(self, rank):
        """Whether `rank` of this communicator can no longer take part."""
        return process_failed(self.group.pid_of(rank))

    # -- agree ------------------------------------------------------------------

    def agree(self, flag, deadline):
        """The AND of every rank's `flag`, the same on every rank that returns
        (a rank that failed before giving its flag counts as False)."""
        self._agreements += 1
        call = self._agreements
        word = call % AGREE_DECISIONS
        self._rows[self.rank, AGREE_FLAG] = 1 if flag else 0
        self._store(self._rows, (self.rank, AGREE_SEQ), call)
        missing = set(range(self.size)) - {self.rank}
        while True:
            decided = self._load(self._decisions, word)
            if decided >> 2 == call:
                return bool(decided & 2)
            if decided >> 2 > call:
                raise RankExcludedError(
                    f"rank {self.rank} came to agree call #{call} after the others had gone on without it")
            # A rank that went on to a shrink without giving its flag will
            # not give it: it counts as failed, as a dead one does.
            missing = {q for q in missing if self._load(self._rows, q, AGREE_SEQ) < call
                       and not self._load(self._rows, q, JOINED) and not self.failed(q)}
            if not missing or time.perf_counter() >= deadline:
                break
            time.sleep(POLL_SECONDS)
        value = all(self._load(self._rows, q, AGREE_SEQ) == call and self._rows[q, AGREE_FLAG]
                    for q in range(self.size))
        mine = call << 2 | (2 if value else 0) | 1
        while True:   # the word holds an older call's decision: replace it, unless another rank did
            found = self._load(self._decisions, word)
            if found >> 2 >= call:
                break
            if _shmloop.compare_exchange(_address(self._decisions, (word,)), found, mine) == found:
                found = mine
                break
        if found >> 2 != call:
            raise RankExcludedError(
                f"rank {self.rank} came to agree call #{call} after the others had gone on without it")
        return bool(found & 2)

    # -- shrink -----------------------------------------------------------------

    def shrink(self, deadline, make_rank):
        """The new communicator's rank object and members (old ranks, in
        order), round after round until one completes: `make_rank(rank,
        size, prefix, pids)` makes (the first member) or maps (the others)
        the new communicator's rank; its `.group` is a ProcessGroup.
        Raises CollectiveTimeoutError where the round's members did not meet
        by `deadline`: calling it again goes on with the next round."""
        while self._next_round < RECOVERY_ROUNDS:
            round_ = self._next_round
            self._next_round += 1
            members = self._decide(round_, self._candidates, deadline)
            # The next round (after a member died, or this call timed out) starts from the rest.
            self._candidates = members
            try:
                return self._build(round_, members, deadline, make_rank), members
            except _RoundFailed:
                continue
        raise RankFailedError(f"ranks kept failing (or timing out) while the survivors shrank the communicator: "
                              f"all {RECOVERY_ROUNDS} rounds its shared memory holds failed")

    def _decide(self, round_, candidates, deadline):
        """Round `round_`'s members: the first proposal stored."""
        self._store(self._rows, (self.rank, JOINED), round_ + 1)
        waiting = set(candidates) - {self.rank}
        while self._load(self._rounds, round_, DECIDED) == 0:
            waiting = {q for q in waiting if self._load(self._rows, q, JOINED) <= round_ and not self.failed(q)}
            if not waiting or time.perf_counter() >= deadline:
                joined = [q for q in candidates if self._load(self._rows, q, JOINED) > round_]
                bits = np.zeros(self._proposals.shape[2], np.uint64)
                for q in joined:
                    bits[q // 64] |= np.uint64(1) << np.uint64(q % 64)
                self._proposals[round_, self.rank] = bits.view(np.int64)
                self._swap_if_empty(self._rounds, (round_, DECIDED), self.rank + 1)
                break
            time.sleep(POLL_SECONDS)
        winner = self._load(self._rounds, round_, DECIDED) - 1
        bits = self._proposals[round_, winner].view(np.uint64)
        members = tuple(q for q in range(self.size) if int(bits[q // 64]) >> (q % 64) & 1)
        if self.rank not in members:
            raise RankExcludedError(
                f"rank {self.rank} was left out of the shrunk communicator: the other survivors decided on "
                f"ranks {', '.join(map(str, members))} before it joined (it came after they had waited for it, "
                "or they took it for failed)")
        return members

    def _build(self, round_, members, deadline, make_rank):
        """Make or map the new communicator of `members`, then meet there:
        a member that dies before the meeting fails it on every member."""
        leader, size, new_rank = members[0], len(members), members.index(self.rank)
        pids = [self.group.pid_of(q) for q in members]
        if self.rank == leader:
            from .protocol import new_prefix
            made = make_rank(0, size, new_prefix(), pids)
            name = made.prefix.encode()
            if len(name) > RECOVERY_NAME_BYTES:
                raise CollectiveError(f"the prefix {made.prefix!r} is longer than {RECOVERY_NAME_BYTES} bytes")
            self._names[round_, RECOVERY_NAME_OFFSET:RECOVERY_NAME_OFFSET + len(name)] = np.frombuffer(name, np.uint8)
            self._store(self._rounds, (round_, NAME_READY), 1)
        else:
            while not self._load(self._rounds, round_, NAME_READY):
                if self.failed(leader):
                    if self._load(self._rounds, round_, NAME_READY):
                        break
                    raise _RoundFailed(f"rank {leader} died while it made the shrunk communicator")
                self._check_left(round_, members)
                if time.perf_counter() >= deadline:
                    raise CollectiveTimeoutError(
                        f"timed out waiting for rank {leader} to make the shrunk communicator")
                time.sleep(POLL_SECONDS)
            name = bytes(self._names[round_, RECOVERY_NAME_OFFSET:]).rstrip(b"\0").decode()
            try:
                made = make_rank(new_rank, size, name, pids)
            except CollectiveTimeoutError as error:
                if not isinstance(error, RankFailedError):
                    raise
                raise _RoundFailed(str(error)) from error   # the maker died
            except CollectiveError as error:   # the maker released it: the round failed on its side
                raise _RoundFailed(str(error)) from error
        try:
            made.group.barrier(deadline, lambda: self._check_left(round_, members))
        except BaseException as error:
            made.close()
            if isinstance(error, CollectiveError) and (isinstance(error, RankFailedError)
                                                       or not isinstance(error, CollectiveTimeoutError)):
                raise _RoundFailed(str(error)) from error   # a member died, or a peer's abort says so
            raise
        return made


    def _check_left(self, round_, members):
        """Raise _RoundFailed where a member of round `round_` has joined a
        later round: it failed this one, and will not come to its barrier.
        (One that failed it after mapping the new communicator aborted it
        too; one that could not map it has only this way to say so.)"""
        for q in members:
            if q != self.rank and self._load(self._rows, q, JOINED) > round_ + 1:
                raise _RoundFailed(f"rank {q} left shrink round {round_} for a later one: the round failed there")


class _RoundFailed(CollectiveError):
    """A member of a shrink round died before the round's meeting: every
    member fails the round alike, and the next round starts."""


class Recoverable:
    """agree and shrink for the rank object of a communicator of processes
    on one machine: it has `.group` (its protocol.ProcessGroup) and
    `remake(rank, size, prefix)`, a rank object like itself for another
    communicator (the shrunk one). Host ranks (shm.py) and GPU ranks
    (executors/device_process.py) alike: the new rank builds its own
    workspaces, IPC buffers and flags."""

    _recovery_area = None   # RecoveryArea, made at the first agree or shrink

    def agree(self, flag, deadline):
        """The AND of every rank's flag, uniform among the ranks that return."""
        return self._recovery().agree(flag, deadline)

    def shrink(self, deadline):
        """The rank object of a new communicator of the ranks that are left,
        and their ranks here, in order. Every survivor calls it; the
        caller revoked this communicator first."""
        def make(rank, size, prefix, pids):
            made = self.remake(rank, size, prefix)
            made.group.expect_pids(pids)
            return made
        return self._recovery().shrink(deadline, make)

    def _recovery(self):
        if self._recovery_area is None:
            self._recovery_area = RecoveryArea(self.group)
        return self._recovery_area

    def _forget_recovery(self):
        """Drop the views of the control segment (before the segment goes)."""
        self._recovery_area = None


def _address(array, index):
    """The address of `array[index]` (an int64 word)."""
    return array.ctypes.data + int(np.ravel_multi_index(index, array.shape)) * 8
