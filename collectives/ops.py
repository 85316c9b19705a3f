"""Reduction operators and the element types every backend supports."""

import enum

from .errors import InvalidUsageError


class ReduceOp(str, enum.Enum):
    SUM = "sum"
    PROD = "prod"
    MAX = "max"
    MIN = "min"
    # Sum, then divided by the number of ranks once, where the reduction of an
    # element completes (integer division truncates toward zero, as in C).
    AVG = "avg"


# NumPy dtype names. bool is left out on purpose: NumPy's sum of booleans is a
# logical or, NCCL has no bool type, and a silent disagreement is worse than
# an error that asks for uint8.
SUPPORTED_DTYPES = (
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64",
)


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
