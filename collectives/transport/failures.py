"""The C side's statuses (statuses.h: one table for _shmloop.c,
_mailbox.c, executors/_host_plan.c and _across.c) and the one translation of a failed
wait into our errors.

The numbers are repeated here because the package runs without its C
modules too; tests/test_layout.py checks that every built module exports
the same ones."""

import os
import warnings

from ..errors import CollectiveError, CollectiveTimeoutError, InvalidUsageError

(OK, TIMED_OUT, ABORTED, PEER_DEAD, MISMATCH, READ_FAILED, INTERRUPTED, WRITE_FAILED,
 DECLINED, NEED_OPEN, NEED_GROW, BAD_PLAN, PENDING, NODE_FAILED, MPI_FAILED, ABORT_ARRIVED, REFUSED) = range(17)

# Every status by name, as the C modules export them.
NAMES = {name: value for name, value in globals().items() if name.isupper() and isinstance(value, int)}


def raise_wait_failure(group, status, peer, have, need, seq, description, progress="its counter is at"):
    """Raise what the interpreter's waits raise when call #`seq` of
    `group`'s rank (`description`) failed with `status`, waiting for rank
    `peer` (`have` of its progress where this rank needs `need`, or the
    errno of a failed copy): the aborting rank's error or RankFailedError
    for ABORTED and PEER_DEAD, CollectiveTimeoutError, CollectiveError for
    a failed copy, InvalidUsageError for a peer in a different call.
    `progress` says what `have` counts."""
    if status in (ABORTED, PEER_DEAD):   # check_health raises the aborting rank's class, or RankFailedError
        group.check_health(peer if status == PEER_DEAD else None, f"call #{seq}, {description}")
        raise CollectiveError(f"the communicator was aborted during call #{seq}, {description}")
    if status == TIMED_OUT:
        raise CollectiveTimeoutError(
            f"timed out waiting for rank {group.names[peer]} in call #{seq}, {description} ({progress} {have}, "
            f"this rank needs {need}){group.absent_note(seq)}")
    if status in (READ_FAILED, WRITE_FAILED):   # `have` is the errno
        reason = os.strerror(have) if have else "nothing copied"
        raise CollectiveError(f"{'reading' if status == READ_FAILED else 'writing into'} rank {group.names[peer]}'s "
                              f"buffer failed in call #{seq}, {description}: {reason}")
    if status == MISMATCH:
        raise InvalidUsageError(
            f"rank {group.names[peer]} is in its call #{group.peer_seq(peer)}, a different call from "
            f"rank {group.names[group.rank]}'s call #{seq}, {description}; every rank must make the same calls in "
            "the same order")
    raise CollectiveError(f"call #{seq}, {description}, failed with status {status} "
                          f"({next((n for n, v in NAMES.items() if v == status), 'unknown')})")


def abort_fence_and_raise(group, reason, error, fence, fence_seconds):
    """Abort `group`'s communicator for every rank, wait until no peer
    writes into this rank's buffers any more (`fence(fence_seconds)`, the
    C side's fence_peer_writes: the peer still writing, or -1; it runs
    even if a second Ctrl-C cuts the abort short), then raise `error`, or
    one that names the peer the fence gave up on."""
    writer = -1
    try:
        group.abort(reason, error)   # peers raise error's class too
    finally:
        if fence is not None:
            writer = fence(fence_seconds)
    if writer < 0:
        raise error
    note = (f"rank {group.names[writer]} was still writing into peers' outputs {fence_seconds:g} s after this "
            "call failed (a stopped process?): this rank's output may still change until that process runs on "
            "or ends")
    if not isinstance(error, CollectiveError):   # Ctrl-C stays a KeyboardInterrupt
        warnings.warn(note, RuntimeWarning, stacklevel=4)
        raise error
    raise type(error)(f"{error}; {note}") from error
