"""Inputs and closed-form expectations shared by the host, MPI and GPU suites
(and what the multi-process workers share).

Rank r's element i is chosen so that every result is exact in every dtype
(float16 and int8 included, for up to 8 ranks), whatever the reduction order:
so one expectation serves every algorithm and backend, with no tolerance.
"""

import functools
import os
import sys
import time
import traceback

import numpy as np

from collectives import SUPPORTED_DTYPES, CollectiveError, InvalidUsageError, kernels
from collectives.ops import bfloat16, is_floating


def all_dtypes():
    """Every supported dtype. A function, not a constant: bfloat16's
    ml_dtypes is imported by the scenarios that use it, not by every rank
    process (0.6 s of CPU each; collectives.ops.bfloat16)."""
    return tuple(bfloat16() if name == "bfloat16" else np.dtype(name) for name in SUPPORTED_DTYPES)


def __getattr__(name):
    """cases.DTYPES, all_dtypes(), for the test modules that take it at import."""
    if name == "DTYPES":
        return all_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

OPS = ("sum", "prod", "max", "min", "avg")
RANK_COUNTS = tuple(range(1, 9))


# The largest count of the matrix: past 64 KiB of float32 (the one-kernel
# path's limit, chunked and pipelined plans), and odd.
LARGEST_COUNT = 65537


def counts_for(n):
    """The element counts worth testing with n ranks."""
    return sorted({0, 1, max(n - 1, 0), n + 1, 1000, LARGEST_COUNT})


# At the largest count, a dtype of each item size (both 16-bit float
# formats). What a count changes in a plan and a kernel (the blocks and
# chunks it is cut into, the 16-byte vector path and the tail, grids,
# workspaces, the compiled loop's pipeline) depends on the element's size,
# never on its type; what the type changes (the fold: integer wrap, 16-bit
# floats accumulated in float32, NaN and signed zeros) is elementwise, the
# same at every count, and runs for every dtype at the other counts (1000
# included: vector path and tail). The cells left out ran the very code of
# the kept ones, and were a third of the whole suite's time.
LARGEST_COUNT_DTYPES = ("int8", "float16", "bfloat16", "float32", "float64")


def dtypes_for(count, among=None):
    """The dtypes of `among` (all_dtypes()) the matrix runs at `count` elements (per block for reduce_scatter)."""
    return [d for d in (all_dtypes() if among is None else among) if count < LARGEST_COUNT or d.name in LARGEST_COUNT_DTYPES]


# Ranks spread over several devices (the emulated-3 backend) run the same
# dtypes at every count. What spreading adds (events and waits between the
# devices' streams, copies from a peer device) follows the plan's phases
# and the bytes it moves, not the element type; the kernels' arithmetic of
# every dtype runs on the very same plans with the ranks on one device.
SPREAD_DTYPES = LARGEST_COUNT_DTYPES


def _sign(dtype):
    return 1 if dtype.kind == "u" else -1


def reduction_input(op, dtype, n, r, count):
    if op in ("sum", "avg"):
        values = _sign(dtype) * (_residues(5, count) + (r + 1))
    elif op == "prod":   # exactly one rank contributes 2
        values = np.where(_residues(n, count) == (-r) % n, np.int8(2), np.int8(1))
    else:   # (i + r) % n
        values = _residues(n, count + n)[r % n:r % n + count] + (0 if dtype.kind == "u" else -3)
    return values.astype(dtype)


def made_once(make):
    """`make`, an array maker of hashable arguments, made once per process
    for each: later calls return a copy of the first array (the caller may
    write into it, as into a new one). The workers ask for the same random
    inputs for every algorithm, op or root, and drawing them anew cost
    several times the copy: a fifth of some scenarios' time."""
    first = functools.lru_cache(maxsize=None)(make)

    @functools.wraps(make)
    def copy_of_first(*arguments):
        return first(*arguments).copy()
    return copy_of_first


@functools.lru_cache(maxsize=32)
def _residues(modulus, count):
    """i % modulus for i < count, read-only: the matrix asks for the same few
    thousand times (every dtype, op, rank, algorithm and backend), and at
    65537 elements computing it anew was most of a test's time. (Rank r's
    inputs are slices of it at offset r, not a modulo of their own.)"""
    residues = (np.arange(count) % modulus).astype(np.int16)
    residues.flags.writeable = False
    return residues


def reduction_expected(op, dtype, n, count):
    if op in ("sum", "avg"):
        total = n * _residues(5, count).astype(np.int64) + n * (n + 1) // 2
        if op == "avg":
            # Floats divide exactly here ((n+1)/2 is a half-integer at worst);
            # integers truncate the magnitude, i.e. round toward zero.
            total = total / n if is_floating(dtype) else total // n
        return (_sign(dtype) * total).astype(dtype)
    if op == "prod":
        return np.full(count, 2, dtype)
    offset = 0 if dtype.kind == "u" else -3
    return np.full(count, (n - 1 if op == "max" else 0) + offset, dtype)


def gather_input(dtype, r, count):
    """(r * 7 + i) % 100: a slice of the cached residues, from r * 7 % 100."""
    start = r * 7 % 100
    return _residues(100, count + 100)[start:start + count].astype(dtype)


def keeps_a_workspace_copy(collective, algorithm, binding, n):
    """Whether a plan bound to the caller's arrays (ranks in one process)
    still copies between a caller's array and a workspace: in place, where a
    step has every rank read its peers' inputs while it writes its own result
    (direct allreduce, butterfly allreduce for 2 and 3 ranks), so the result
    waits in a workspace; halving_doubling reduce_scatter for n not a
    power of two, whose extra ranks fetch their block from their partner's
    workspace; and two_shot reduce, whose ranks but the root fold their
    chunk into their workspace (a reduce gives them no output to hold it),
    where the root copies it from. Listed, so that a change either way is
    seen. (`staged`: GPU
    ranks in processes through their staging buffers, a copy in and out;
    `symmetric`: on the caller's arrays, no copy; a broadcast in place
    through staging too: its root copies in, the other ranks out.)"""
    if binding.startswith(("staged", "symmetric")):
        return binding.startswith("staged")
    if n == 1 or binding == "workspace":
        return binding == "workspace"
    if (collective, algorithm) == ("reduce_scatter", "halving_doubling"):
        return n & (n - 1) != 0
    if (collective, algorithm) == ("reduce", "two_shot"):
        return True
    return binding == "in_place" and ((collective, algorithm) == ("allreduce", "direct")
                                      or (collective, algorithm) == ("allreduce", "butterfly") and n in (2, 3))


def expect_a_different_call(call, what):
    """Run `call`, which ranks make differently: it must raise naming the
    mismatch, on this rank or through the abort of a rank that named it."""
    try:
        call()
    except InvalidUsageError as error:
        assert "different call" in str(error), error
        return
    except CollectiveError as error:
        assert "aborted" in str(error) and "different call" in str(error), error
        return
    raise AssertionError(f"{what} completed")


# A stalled rank's wait: it must not call again before every other rank has
# given up on it (and aborted the communicator), and a fixed sleep long
# enough for a loaded machine was most of these scenarios' time. Each other
# rank, once its call has raised, says so to the stalled rank over MPI
# (imported in the functions: the pytest process imports this module too,
# and must not start MPI).
_GAVE_UP_TAG = 7001


def stall_until_the_others_gave_up(stalled, longest, stall=0):
    """On rank `stalled`: wait until every other rank has called
    gave_up_on(stalled) for the same `stall` (a scenario's stalls counted
    from 0), or `longest` seconds (a rank whose check failed says nothing:
    the stalled rank then goes on as after a fixed sleep)."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    flags = np.zeros(world.size, np.int32)
    pending = [world.Irecv([flags[q:q + 1], MPI.INT], source=q, tag=_GAVE_UP_TAG + stall)
               for q in range(world.size) if q != stalled]
    deadline = time.monotonic() + longest
    while not MPI.Request.Testall(pending) and time.monotonic() < deadline:
        time.sleep(0.01)
    for request in pending:
        if request:   # not completed: withdrawn, so MPI_Finalize finds no receive pending
            request.Cancel()
            request.Wait()


def gave_up_on(stalled, stall=0):
    """On every other rank, once its call has raised: tell rank `stalled`
    (an eager send of one int, which returns at once)."""
    from mpi4py import MPI
    MPI.COMM_WORLD.Send([np.ones(1, np.int32), MPI.INT], dest=stalled, tag=_GAVE_UP_TAG + stall)


def run_scenario(run, ranks_leave):
    """A multi-process worker's scenario: `run()`. Where ranks leave early
    (`ranks_leave`), MPI_Finalize would wait for them, so a failure prints
    its traceback and exits 1 at once: a failure, not a hang."""
    try:
        run()
    except BaseException:
        if not ranks_leave:
            raise
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


# -- the one-kernel collectives (executors/ll_collectives.py, peer_ll.py) ----------

def rank_input(seed, rank, dtype, count):
    """Random bits for integers, random values for floats (no NaN: bits compare)."""
    rng = np.random.default_rng([seed, rank, count])
    if dtype.kind in "iu":
        return rng.integers(0, 256, count * dtype.itemsize, dtype=np.uint8).view(dtype)
    return (rng.standard_normal(count) * 4).astype(dtype)


def expected(reference, collective, inputs, op, root, algorithm):
    """Every rank's result of the call on `reference` (host ranks in this
    process: the NumPy interpreter), on copies of `inputs`."""
    inputs = [x.copy() for x in inputs]
    if collective == "allreduce":
        return reference.allreduce(inputs, op=op, algorithm=algorithm)
    if collective == "reduce_scatter":
        return reference.reduce_scatter(inputs, op=op, algorithm=algorithm)
    if collective == "allgather":
        return reference.allgather(inputs, algorithm=algorithm)
    if collective == "broadcast":
        return reference.broadcast(inputs, root=root, algorithm=algorithm)
    return reference.reduce(inputs, root=root, op=op, algorithm=algorithm)


def capacity(collective, n, dtype):
    """The largest count that fits (reduce_scatter: per block)."""
    lines = kernels.LL_MAX_BYTES // 8 // (n if collective == "reduce_scatter" else 1)
    return lines * 8 // dtype.itemsize
