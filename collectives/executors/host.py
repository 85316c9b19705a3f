"""The host executor: op tables interpreted with NumPy.

This is the reference meaning of a plan. Every other executor must produce
the same bits for the same table (integers) or the same fold order (floats).
"""

import numpy as np

from ..ops import ReduceOp
from ..plan import COPY_OP, REDUCE_FINAL_OP, SRC0

# The binary ufunc each op folds with; avg folds like sum and divides once.
_FOLD = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MAX: np.maximum,
    ReduceOp.MIN: np.minimum,
}


def divide_by_ranks(values, nranks):
    """avg's last step, in place: floats divide (correctly rounded), integers
    truncate toward zero as C and CUDA do (NumPy's // floors)."""
    if values.dtype.kind == "f":
        np.true_divide(values, nranks, out=values)
    elif values.dtype.kind == "u":
        np.floor_divide(values, nranks, out=values)
    else:
        negative_inexact = (values < 0) & (values % nranks != 0)
        np.floor_divide(values, nranks, out=values)
        values += negative_inexact


def execute(rows, buffer, op, nranks):
    """Run op table `rows`; `buffer(rank, buffer_id)` gives a flat array."""
    fold = _FOLD[op]
    for rank, kind, count, dst_buf, dst_off, nsrc, *sources in rows.tolist():
        dst = buffer(rank, dst_buf)[dst_off:dst_off + count]
        srcs = [
            buffer(sources[3 * i], sources[3 * i + 1])[sources[3 * i + 2]:sources[3 * i + 2] + count]
            for i in range(nsrc)
        ]
        if kind == COPY_OP:
            np.copyto(dst, srcs[0])
            continue
        fold(srcs[0], srcs[1], out=dst)
        for src in srcs[2:]:
            fold(dst, src, out=dst)
        if kind == REDUCE_FINAL_OP and op is ReduceOp.AVG:
            divide_by_ranks(dst, nranks)


assert SRC0 == 6, "execute() unpacks the six leading columns by position"
