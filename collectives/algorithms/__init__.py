"""The algorithm registry: names -> schedule generators, and the `auto` choice.

An algorithm is a function (collective, nranks, root) -> Schedule. Registering
one is all it takes to make it usable everywhere: plans, every executor, the
benchmarks and the tests that prove schedules correct.
"""

import functools
from typing import Callable, NamedTuple

from ..errors import InvalidUsageError
from .direct import direct
from .ring import ring
from .schedule import COLLECTIVES, Schedule  # noqa: F401  (re-exported)


class Algorithm(NamedTuple):
    name: str
    generate: Callable
    collectives: tuple
    summary: str


REGISTRY = {
    "ring": Algorithm("ring", ring, COLLECTIVES, "bandwidth-optimal, 2(n-1) steps for allreduce"),
    "direct": Algorithm("direct", direct, COLLECTIVES, "one step, every rank reads its peers"),
}


@functools.lru_cache(maxsize=None)
def schedule_for(algorithm, collective, nranks, root=None):
    """The (cached) schedule of a registered algorithm."""
    try:
        spec = REGISTRY[algorithm]
    except KeyError:
        valid = ", ".join(repr(name) for name in ["auto", *REGISTRY])
        raise InvalidUsageError(f"unknown algorithm {algorithm!r}; expected one of {valid}") from None
    if collective not in spec.collectives:
        raise InvalidUsageError(f"algorithm {algorithm!r} does not implement {collective}")
    return spec.generate(collective, nranks, root=root)


# The latency-bandwidth model `auto` uses: a step costs a synchronisation
# (STEP_SECONDS) plus the memory traffic of the busiest rank at
# BYTES_PER_SECOND. Shared memory makes traffic, not hops, the price of bytes.
# Calibrated with `mpiexec -n 2 python -m bench.all_reduce_perf --algorithm
# ring|direct` on the 2-core development machine: direct wins up to 64 KiB,
# ring from 256 KiB; this model puts the crossover at 2 ranks near 200 KB.
STEP_SECONDS = 10e-6
BYTES_PER_SECOND = 10e9


def modelled_seconds(schedule, nbytes):
    chunk_bytes = nbytes / schedule.nchunks
    busiest = max(schedule.chunks_moved(r) for r in range(schedule.nranks))
    return schedule.nsteps * STEP_SECONDS + busiest * chunk_bytes / BYTES_PER_SECOND


@functools.lru_cache(maxsize=1024)
def choose(collective, nranks, nbytes, root=None):
    """The registered algorithm the model predicts fastest (ties: first
    registered). Cached: a repeated call shape asks the model once."""
    candidates = [name for name, spec in REGISTRY.items() if collective in spec.collectives]
    return min(candidates, key=lambda name: modelled_seconds(schedule_for(name, collective, nranks, root), nbytes))
