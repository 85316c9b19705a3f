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
