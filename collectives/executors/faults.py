"""What the one-kernel kernels (kernels/ll_allreduce.cu: ll_allreduce and
ll_barrier) leave for the host, read back: their fault words, as the error
every rank raises, and their state words, as the number of calls they ran.

Shared by the paths of GPU ranks in separate processes (device_protocol.py:
ll, symmetric, staged) and of ranks on several GPUs of one process
(peer_ll.py), which differ only in where the words live (a control
segment's LL region in shared memory, or page-locked memory of the process)
and in what they can tell: only ranks in processes can make different calls
(one call of the process launches every rank of peer_ll), and only they
have peers that may die.

A fault word is written by a kernel that stopped waiting: {why
(kernels.LL_FAULT_*), the rank it waited for, the collective, the call's
number}; a kernel that sees another's fault word, or the abort word, stops
too and says so (LL_FAULT_STOPPED), so the cause is the fault of another
reason. The host reads the words as ctypes cells (`cells`): one read each
per call, in a loop of the caller's, several times cheaper than a NumPy
reduction.
"""

import ctypes

import numpy as np

from .. import kernels
from ..errors import CollectiveError, CollectiveTimeoutError, InvalidUsageError


def cells(rows, column):
    """The int64 word `column` of each row of `rows` (an int64 array, a
    row per rank), as ctypes cells over the same memory."""
    return tuple(ctypes.c_int64.from_buffer(row, 8 * column) for row in rows)


def decoded(words):
    """[(rank, kernels.LLFault)] of the nonzero fault words, a word per rank."""
    return [(rank, kernels.ll_fault(int(word))) for rank, word in enumerate(words) if word]


def first(faults, reason):
    """The first (rank, fault) of `faults` for `reason`, or None."""
    for rank, fault in faults:
        if fault.reason == reason:
            return rank, fault
    return None


def mismatch_error(faults, rank, description):
    """InvalidUsageError for a kernel that read a peer's flag of another
    call (another signature), or None: ranks in processes made different
    calls. `description` names this rank's own call where the fault is its."""
    found = first(faults, kernels.LL_FAULT_MISMATCH)
    if found is None:
        return None
    reader, fault = found
    mine = f": {description}" if reader == rank else ""
    return InvalidUsageError(
        f"rank {fault.peer} made a different call from rank {reader}'s one-kernel {fault.collective} "
        f"#{fault.generation}{mine} (another collective, count, dtype, op or root, or another place in "
        "symmetric memory); every rank must make the same calls in the same order")


def timeout_error(waiter, fault, seconds, peer_name, rest):
    """CollectiveTimeoutError for a kernel of rank `waiter` that waited
    `seconds` for `fault.peer` (named `peer_name`); `rest` ends the message."""
    return CollectiveTimeoutError(
        f"rank {waiter} timed out after {seconds:.1f} s waiting for {peer_name} to write its part of "
        f"{fault.collective} #{fault.generation}{rest}")


def stopped_error(faults):
    """CollectiveError for kernels that stopped for no fault of their own
    (the abort word, or another's fault word)."""
    return CollectiveError(f"the one-kernel collective stopped on ranks {[rank for rank, _ in faults]}: "
                           f"{[fault for _, fault in faults]}")


def generation(device, area_address, who="the"):
    """The call count (mod 2**32) of the rank whose LL area is at
    `area_address` on `device`, from its kernels' state words once the
    device is idle (for tests and diagnostics; the host keeps no count).
    Every word must agree: each thread of the grid advanced its own."""
    words = np.frombuffer(device.download(area_address + kernels.LL_STATE_OFFSET, 8 * device.ll_grid_threads),
                          np.uint64)
    generations = {kernels.ll_state(int(word)).generation for word in words}
    if len(generations) != 1:
        raise CollectiveError(f"{who} one-kernel state words disagree: generations {sorted(generations)}")
    return generations.pop()
