"""The host executor: op tables interpreted with NumPy.

This is the reference meaning of a plan. Every other executor must produce
the same bits for the same table (integers) or the same fold order (floats).
"""

import numpy as np

from ..ops import BFLOAT16, ReduceOp, is_floating
from ..plan import COPY_OP, REDUCE_FINAL_OP, SRC0


def _ieee(fold, join_tie_bits):
    """`fold` (np.maximum or np.minimum) with the IEEE 754-2019 rule of ops.py:
    where both operands are zeros of different signs, the result's bits are
    `join_tie_bits` of theirs (AND: +0 wins, for max; OR: -0 wins, for min)."""

    def ieee_fold(a, b, out):
        if not is_floating(a.dtype):
            return fold(a, b, out=out)
        if out is None:
            out = np.empty_like(a)
        both_zero = (a == 0) & (b == 0)
        tied = np.flatnonzero(both_zero) if both_zero.any() else None
        if tied is not None:  # read before `out`, which may be `a` or `b`, is written
            bits = np.dtype(f"u{a.itemsize}")
            tie = join_tie_bits(a.view(bits)[tied], b.view(bits)[tied])
        fold(a, b, out=out)
        if tied is not None:
            out.view(bits)[tied] = tie
        return out

    return ieee_fold


# The binary fold each op uses; avg folds like sum and divides once.
_FOLD = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MAX: _ieee(np.maximum, np.bitwise_and),
    ReduceOp.MIN: _ieee(np.minimum, np.bitwise_or),
}


def divide_by_ranks(values, nranks):
    """avg's last step, in place: floats divide (correctly rounded), integers
    truncate toward zero as C and CUDA do (NumPy's // floors)."""
    if is_floating(values.dtype):
        np.true_divide(values, nranks, out=values)
    elif values.dtype.kind == "u":
        np.floor_divide(values, nranks, out=values)
    else:
        negative_inexact = (values < 0) & (values % nranks != 0)
        np.floor_divide(values, nranks, out=values)
        values += negative_inexact


def execute(rows, buffer, op, nranks):
    """Run op table `rows`; `buffer(rank, buffer_id)` gives a flat array."""
    with np.errstate(all="ignore"):  # inf - inf is NaN by IEEE 754, not a user error
        _execute(rows, buffer, op, nranks)


def _execute(rows, buffer, op, nranks):
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
        divides = kind == REDUCE_FINAL_OP and op is ReduceOp.AVG
        if dst.dtype in _ACCUMULATE_IN_FLOAT32:
            _reduce_in_float32(dst, srcs, fold, nranks if divides else None)
            continue
        # Every source is read before dst is written, as in the kernel; folding
        # into dst is that, unless dst is also a later source (a rank's own
        # array in an in-place direct reduction): then fold aside.
        late_alias = any(np.may_share_memory(dst, src) for src in srcs[2:])
        acc = fold(srcs[0], srcs[1], out=None if late_alias else dst)
        for src in srcs[2:]:
            fold(acc, src, out=acc)
        if late_alias:
            np.copyto(dst, acc)
        if divides:
            divide_by_ranks(dst, nranks)


# A float16 or bfloat16 transfer (one REDUCE or REDUCE_FINAL row, whatever its
# number of sources) accumulates in float32 and rounds to 16 bits once, as
# the issue asks: a row that folds n sources (direct, star, two_shot) rounds
# once, not n-1 times. NCCL's ring rounds at every hop (__hadd2); our ring,
# whose rows have two sources, does the same. bench/half_precision_error.py
# measures what this buys.
_ACCUMULATE_IN_FLOAT32 = (np.dtype(np.float16), BFLOAT16)


def _reduce_in_float32(dst, srcs, fold, divisor):
    """dst = round16(((f32(src0) op f32(src1)) op ...) [/ divisor]): every
    operation a correctly rounded float32 one (NumPy does not contract into
    FMA), the max/min rule of ops.py applied in float32, and one rounding to
    nearest even at the end. Every source is read before dst is written."""
    acc = srcs[0].astype(np.float32)
    for src in srcs[1:]:
        fold(acc, src.astype(np.float32), out=acc)
    if divisor is not None:
        divide_by_ranks(acc, divisor)
    dst[...] = acc.astype(dst.dtype)


assert SRC0 == 6, "execute() unpacks the six leading columns by position"


def execute_wire(ops, codec, floats, wires):
    """Run codec operations (compression/wire.py, lower_rows) on NumPy views:
    `floats(rank, buffer)` is a float32 array, `wires(rank, buffer)` the
    (payload, scales) of a buffer's wire copy."""
    from ..compression.wire import block_range, codec_launches

    def f(ref):
        rank, buffer, offset, count = ref
        return floats(rank, buffer)[offset:offset + count]

    def w(ref):
        rank, buffer, offset, count = ref
        payload, scales = wires(rank, buffer)
        first, stop = block_range(offset, count)
        return payload[offset:offset + count], scales[first:stop] if len(scales) else scales

    for kernel, args, divisor in codec_launches(ops, f, w):
        run_codec_launch(kernel, codec, args, divisor)


def run_codec_launch(kernel, codec, args, divisor):
    """One codec kernel (compression/kernels.py, its CPU loop) on NumPy arrays;
    `args` as wire.codec_launches gives them."""
    from ..compression import kernels as codecs

    if kernel == "copy":
        np.copyto(*args)
    elif kernel in ("encode", "encode_round"):
        codecs.cpu_encode(codec, *args, round_x=kernel == "encode_round")
    elif kernel == "decode":
        codecs.cpu_decode(codec, *args)
    elif kernel == "decode_add":   # out None: only the encoded result is wanted (acc gives the size)
        acc, payload, scales, out, *encoded = args
        codecs.cpu_decode_add(codec, acc, payload, scales, acc if out is None else out, divisor, *encoded,
                              write_out=out is not None)
    else:
        acc, b, out, *encoded = args
        codecs.cpu_add(codec, acc, b, acc if out is None else out, divisor, *encoded, write_out=out is not None)
