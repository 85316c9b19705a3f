"""Settings that come from the environment, read when a communicator is made.

Nothing here is a mutable module global: each communicator resolves its own
settings once, so two communicators never share a hidden knob.
"""

import math
import os

from .errors import InvalidUsageError

TIMEOUT_ENV = "COLLECTIVES_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0


def resolve_timeout(timeout=None):
    """The timeout in seconds: the argument, else $COLLECTIVES_TIMEOUT, else 300."""
    source = "timeout"
    if timeout is None:
        timeout = os.environ.get(TIMEOUT_ENV)
        source = f"${TIMEOUT_ENV}"
        if timeout is None:
            return DEFAULT_TIMEOUT_S
    try:
        value = float(timeout)
    except (TypeError, ValueError):
        raise InvalidUsageError(f"{source}: expected a number of seconds, got {timeout!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise InvalidUsageError(f"{source}: expected a positive, finite number of seconds, got {timeout!r}")
    return value
