"""Argument checks, all done before a collective touches a byte.

Each check raises InvalidUsageError with a sentence that names the argument,
the rank and what was expected, so a rejected call modifies nothing and says
why.
"""

import operator

import numpy as np

from .errors import InvalidUsageError
from .ops import SUPPORTED_DTYPES


def rank_arrays(x, nlocal, name="x"):
    """`x` as a list with one array per local rank, and whether it came as a sequence.

    A communicator that owns one rank takes a bare array (or a sequence of
    one); one that owns several takes a sequence with one array per rank.
    """
    if _is_array_like(x):
        if nlocal != 1:
            raise InvalidUsageError(
                f"this communicator owns {nlocal} ranks, so {name} must be a sequence of {nlocal} arrays, "
                "one per local rank")
        return [_host_array(x, name)], False
    if isinstance(x, (list, tuple)):
        if len(x) != nlocal:
            raise InvalidUsageError(f"{name} holds {len(x)} arrays but this communicator owns {nlocal} ranks")
        arrays = [_host_array(a, f"{name}[{i}]") for i, a in enumerate(x)]
        return arrays, True
    raise InvalidUsageError(f"{name} must be a NumPy array or a sequence of them, got {type(x).__name__}")


def _is_array_like(x):
    return isinstance(x, np.ndarray) or hasattr(x, "__cuda_array_interface__") or hasattr(x, "__dlpack__")


def _host_array(a, name):
    if not isinstance(a, np.ndarray):
        if hasattr(a, "__cuda_array_interface__") or hasattr(a, "__dlpack__"):
            raise InvalidUsageError(
                f"{name} is a {type(a).__module__}.{type(a).__name__}; this communicator works on NumPy "
                "(host) arrays")
        raise InvalidUsageError(f"{name} must be a NumPy array, got {type(a).__name__}")
    if a.dtype.name not in SUPPORTED_DTYPES:
        hint = " (use uint8 for flags)" if a.dtype == np.bool_ else ""
        raise InvalidUsageError(
            f"{name} has dtype {a.dtype}{hint}; supported: {', '.join(SUPPORTED_DTYPES)}")
    if not a.flags.c_contiguous:
        raise InvalidUsageError(f"{name} must be C-contiguous (np.ascontiguousarray makes a copy that is)")
    return a


def same_dtype_and_shape(arrays, name="x"):
    first = arrays[0]
    for i, a in enumerate(arrays[1:], start=1):
        if a.dtype != first.dtype:
            raise InvalidUsageError(f"{name}[{i}] has dtype {a.dtype} but {name}[0] has {first.dtype}")
        if a.shape != first.shape:
            raise InvalidUsageError(f"{name}[{i}] has shape {a.shape} but {name}[0] has {first.shape}")


def writable(arrays, name):
    for i, a in enumerate(arrays):
        if not a.flags.writeable:
            raise InvalidUsageError(f"{name}[{i}] is read-only, but the collective writes it")


def output_arrays(out, nlocal, count, dtype):
    """Validate caller-given outputs: `count` elements of `dtype` each."""
    outs, _ = rank_arrays(out, nlocal, name="out")
    for i, o in enumerate(outs):
        if o.dtype != dtype:
            raise InvalidUsageError(f"out[{i}] has dtype {o.dtype}, expected {dtype} like the input")
        if o.size != count:
            raise InvalidUsageError(f"out[{i}] has {o.size} elements, expected {count}")
    return outs


def no_overlap_between_ranks(inputs, outputs):
    """No output may share memory with another local rank's input or output:
    two ranks writing one buffer (or one reading what another writes) race.
    A rank's own input and output may overlap: plans read all input (phase 0)
    before they write any output (the last phase)."""
    buffers = [(rank, "input", a) for rank, a in enumerate(inputs)]
    buffers += [(rank, "out", o) for rank, o in enumerate(outputs)]
    for j, (rank_a, kind_a, a) in enumerate(buffers):
        for rank_b, kind_b, b in buffers[j + 1:]:
            if rank_a == rank_b or kind_a == kind_b == "input":
                continue
            if a.size and b.size and np.may_share_memory(a, b):
                raise InvalidUsageError(
                    f"{kind_a} of local rank {rank_a} and {kind_b} of local rank {rank_b} share memory")


def root_rank(root, size):
    if isinstance(root, bool):
        raise InvalidUsageError(f"root must be a rank number, got {root!r}")
    try:
        value = operator.index(root)
    except TypeError:
        raise InvalidUsageError(f"root must be an integer rank, got {type(root).__name__}") from None
    if not 0 <= value < size:
        raise InvalidUsageError(f"root {value} is out of range for a communicator of size {size}")
    return value
