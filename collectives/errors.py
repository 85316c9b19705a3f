"""The typed errors of `collectives`.

Every failure a caller can act on is a `CollectiveError`; the subclasses say
which kind. Bad arguments are also `ValueError`s and timeouts also
`TimeoutError`s, so generic handlers keep working.
"""


class CollectiveError(Exception):
    """Base class of every error raised by `collectives`."""


class InvalidUsageError(CollectiveError, ValueError):
    """An argument was wrong; the call modified nothing."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective could not complete within the communicator's timeout."""


class RankFailedError(CollectiveTimeoutError):
    """A peer rank died, so the collective can never complete.

    A subclass of `CollectiveTimeoutError` because, to the caller, it is the
    same event reported early: waiting longer would not help.
    """


class RevokedError(CollectiveError):
    """A rank revoked the communicator (`Communicator.revoke`, or `shrink`,
    which revokes first): calls in it stop at once, on every rank. Call
    `shrink()` to go on with the ranks that are left."""


class RankExcludedError(CollectiveError):
    """This rank was left out of the communicator `shrink()` made: the other
    survivors decided without it (it came after they had waited for it, or
    they took it for failed). It can no longer take part in the job's
    collectives."""


# How an abort carries the class of its cause to the other ranks, so that
# every rank raises the same class for the same event (a program that
# catches TimeoutError handles a stalled peer on every rank): a small code,
# stored in the control segment's header (transport/protocol.py) or sent as
# the first byte of an MPI abort message (transport/mpi.py). After 0, a
# plain CollectiveError, the most specific class comes first (RankFailedError
# is a CollectiveTimeoutError).
_CARRIED = (CollectiveError, RankFailedError, CollectiveTimeoutError, InvalidUsageError, RevokedError)


def kind_of(error):
    """The code of `error`'s class (an exception or a class) among those an abort carries."""
    cls = error if isinstance(error, type) else type(error)
    for code in range(1, len(_CARRIED)):
        if issubclass(cls, _CARRIED[code]):
            return code
    return 0


def class_of_kind(code):
    """The error class of an abort's code (CollectiveError for an unknown one)."""
    return _CARRIED[code] if 0 <= code < len(_CARRIED) else CollectiveError
