"""Reduction operators and the element types every backend supports."""

import enum
import sys

import numpy as np

from .errors import InvalidUsageError


class ReduceOp(str, enum.Enum):
    SUM = "sum"
    PROD = "prod"
    MAX = "max"
    MIN = "min"
    # Sum, then divided by the number of ranks once, where the reduction of an
    # element completes (integer division truncates toward zero, as in C).
    AVG = "avg"


# max and min of floats follow IEEE 754-2019 maximum/minimum on every
# backend: a NaN operand gives NaN, and -0 < +0, so max(-0, +0) is +0 and
# min(-0, +0) is -0. (NumPy alone breaks that tie one way for float16 and the
# other way for float32.)


# NumPy dtype names. bool is left out on purpose: NumPy's sum of booleans is a
# logical or, NCCL has no bool type, and a silent disagreement is worse than
# an error that asks for uint8. bfloat16 is ml_dtypes.bfloat16 on the host
# (torch.bfloat16 on the GPU); like float16 it computes in float32 and rounds
# to nearest even.
SUPPORTED_DTYPES = (
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64",
)

# bfloat16's dtype is ml_dtypes', imported on first use rather than with
# collectives: that import registers NumPy loops for a dozen types, 0.6 s of
# CPU, three quarters of `import collectives`, which every rank process of a
# job pays and few of them need. No array of bfloat16 exists before ml_dtypes
# is imported (by us, or by the library that made the array).
_bfloat16 = None
_sets_awaiting_bfloat16 = []


def bfloat16():
    """bfloat16's NumPy dtype (ml_dtypes.bfloat16), importing ml_dtypes the
    first time; from then on it is in every supported_dtype_set()."""
    global _bfloat16
    if _bfloat16 is None:
        import ml_dtypes
        _bfloat16 = np.dtype(ml_dtypes.bfloat16)
        for dtypes in _sets_awaiting_bfloat16:
            dtypes.add(_bfloat16)
        _sets_awaiting_bfloat16.clear()
    return _bfloat16


def is_bfloat16(dtype):
    """Whether `dtype` is bfloat16 (without importing ml_dtypes where nothing has)."""
    if _bfloat16 is None and "ml_dtypes" not in sys.modules:
        return False
    return dtype == bfloat16()


def as_dtype(dtype):
    """np.dtype(dtype), the name "bfloat16" included (NumPy knows that name
    only once ml_dtypes is imported)."""
    return bfloat16() if isinstance(dtype, str) and dtype == "bfloat16" else np.dtype(dtype)


def supported_dtype_set():
    """A new set of the supported dtypes as dtype objects, for the checks of
    the hot paths (a set lookup: dtype.name costs microseconds in NumPy 2).
    bfloat16 joins it once something asked for bfloat16() (is_bfloat16 on an
    array of it does): until then the set misses bfloat16, and the caller's
    slower path, which asks is_bfloat16, takes the call."""
    dtypes = {np.dtype(name) for name in SUPPORTED_DTYPES if name != "bfloat16"}
    if _bfloat16 is not None:
        dtypes.add(_bfloat16)
    else:
        _sets_awaiting_bfloat16.append(dtypes)
    return dtypes


def __getattr__(name):
    """ops.BFLOAT16, bfloat16(), for the callers that want the dtype at import."""
    if name == "BFLOAT16":
        return bfloat16()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_floating(dtype):
    """Whether `dtype` is a float type (bfloat16 included, whose NumPy kind is 'V')."""
    return dtype.kind == "f" or (dtype.kind == "V" and is_bfloat16(dtype))


def as_reduce_op(op):
    """`op` as a ReduceOp, from the enum or its string value."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        try:
            return ReduceOp(op.lower())
        except ValueError:
            pass
    valid = ", ".join(repr(o.value) for o in ReduceOp)
    raise InvalidUsageError(f"unknown reduction op {op!r}; expected one of {valid}")


def partial_op(op):
    """The op of a partial fold (inside a node, before the fold across nodes):
    avg sums; it divides once, where the last fold completes."""
    return ReduceOp.SUM if op is ReduceOp.AVG else op
