"""Reduction operators and the element types every backend supports."""

import enum

import ml_dtypes
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

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def is_floating(dtype):
    """Whether `dtype` is a float type (bfloat16 included, whose NumPy kind is 'V')."""
    return dtype.kind == "f" or dtype == BFLOAT16


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
