"""Settings that are the machine's, measured by the ranks as a communicator starts.

Some size limits of host ranks in processes decide between two ways of
moving the same bytes whose order differs from one machine to the next
by 2 to 3 times (config.py: the folds' staging limit, the exchanges'
single-copy limit). Unless a variable pins such a limit, the ranks time
both ways on a probe call and all take the faster:

    agree      every rank's pinned value (or none) in one allreduce:
               all pinned alike -> that value; none -> measure; mixed ->
               InvalidUsageError on every rank (one would probe while
               another ran its first call)
    time       `calls` calls one way, then `calls` the other (each batch
               after an untimed call), `rounds` times alternating; each
               way's median batch
    decide     the slowest rank's medians (an allreduce with op max, the
               same bits on every rank), the faster way

`allreduce(x, op, out)` is the caller's: the compiled loop's for the folds,
the communicator's for the exchanges. A failed call raises as any
collective's does.
"""

import time

import numpy as np

from ..errors import InvalidUsageError

CALLS = 4    # calls per timed batch
ROUNDS = 3   # batches each way, alternating (odd: the median is the middle one)


def agreed_pin(allreduce, variable, mine, rank_name):
    """`mine` (this rank's value of $`variable`, None where unset) where
    every rank gives the same, None where none gives one; InvalidUsageError
    on every rank where they differ."""
    mine = -1 if mine is None else int(mine)
    extremes = np.empty(2, np.int64)
    allreduce(np.array([mine, -mine], np.int64), "max", extremes)
    largest, smallest = int(extremes[0]), -int(extremes[1])
    if largest != smallest:
        def name(value):
            return "unset" if value < 0 else str(value)
        raise InvalidUsageError(
            f"${variable} differs among the ranks ({name(smallest)} on some, {name(largest)} on others, "
            f"{name(mine)} on rank {rank_name}): give every rank the same value, or none (then they measure it)")
    return None if largest < 0 else largest


def slowest_medians(allreduce, ways, calls=CALLS, rounds=ROUNDS):
    """Seconds per call of each of `ways` (functions that each make one
    call, the same on every rank), batches alternating: the median batch
    of each, the largest over the ranks (the same on every rank)."""
    def batch(way):
        way()   # (untimed: the first call after the other way's finds the caches theirs)
        start = time.perf_counter()
        for _ in range(calls):
            way()
        return (time.perf_counter() - start) / calls

    batches = [[batch(way) for way in ways] for _ in range(rounds)]
    medians = np.array([sorted(way)[rounds // 2] for way in zip(*batches)])   # (np.median's first call
    slowest = np.empty_like(medians)                                         # imports for milliseconds)
    allreduce(medians, "max", slowest)
    return [float(s) for s in slowest]
