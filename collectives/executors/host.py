"""The host executor: op tables interpreted with NumPy.

This is the reference meaning of a plan. Every other executor must produce
the same bits for the same table (integers) or the same fold order (floats).
`BoundTables` is the interpreter with its per-row work done once for a
call's arrays: the NumPy calls `execute` makes, nothing else, for a call
that repeats (virtual ranks, Communicator._collective).
"""

import math

import numpy as np

from ..ops import ReduceOp, is_floating
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
    elif nranks > np.iinfo(values.dtype).max:
        # nranks is not a value of the dtype (int8 over 128 ranks or more):
        # divide in 64 bits, as the compiled loop does; every quotient fits back.
        wide = values.astype(np.int64)
        divide_by_ranks(wide, nranks)
        values[...] = wide
    elif values.dtype.kind == "u":
        np.floor_divide(values, nranks, out=values)
    else:
        negative_inexact = (values < 0) & (values % nranks != 0)
        np.floor_divide(values, nranks, out=values)
        values += negative_inexact


def execute(rows, buffer, op, nranks):
    """Run op table `rows`; `buffer(rank, buffer_id)` gives a flat array."""
    execute_phases((rows,), buffer, op, nranks)


def execute_phases(tables, buffer, op, nranks):
    """Run op tables one after another (a plan's phases), as `execute` runs
    each, with NumPy's error state set once for them all (entering it costs
    about as much as a small table's rows)."""
    with np.errstate(all="ignore"):  # inf - inf is NaN by IEEE 754, not a user error
        for rows in tables:
            _execute(rows, buffer, op, nranks)


def _execute(rows, buffer, op, nranks):
    for rank, kind, count, dst_buf, dst_off, nsrc, *sources in rows.tolist():
        dst = buffer(rank, dst_buf)[dst_off:dst_off + count]
        srcs = [
            buffer(sources[3 * i], sources[3 * i + 1])[sources[3 * i + 2]:sources[3 * i + 2] + count]
            for i in range(nsrc)
        ]
        if kind == COPY_OP:
            np.copyto(dst, srcs[0])
            continue
        fold_row(dst, srcs, op, nranks, final=kind == REDUCE_FINAL_OP)


def fold_row(dst, srcs, op, nranks, final):
    """One REDUCE row (REDUCE_FINAL where `final`): dst = the fold of `srcs`
    (two or more) in order, avg's division by `nranks` where final (call under
    np.errstate(all="ignore"), as execute does)."""
    fold = _FOLD[op]
    divides = final and op is ReduceOp.AVG
    if _accumulates_in_float32(dst.dtype):
        _reduce_in_float32(dst, srcs, fold, nranks if divides else None)
        return
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
def _accumulates_in_float32(dtype):
    """float16 and bfloat16, the 16-bit floats."""
    return dtype.itemsize == 2 and is_floating(dtype)


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


class BoundTables:
    """Op tables bound once to one call's buffers: what `execute` does for
    each row, with the row's decoding, its slicing of fixed buffers and its
    choice of NumPy calls done here, once. Calling the result with the
    caller's arrays of a later call makes exactly the NumPy calls `execute`
    would make for the same rows (so the same bits; tests/test_call_path.py
    compares them), rows in table order.

    `arrays` are the call's arrays (one "slot" each); `slot_of(rank,
    buffer_id)` names the slot of a caller's buffer, or None for a buffer
    the executor owns, which `fixed(rank, buffer_id)` gives as a flat array
    (a workspace view; kept, the arrays of slots are not). A later call must
    pass arrays of the same shapes whose memory is related as these arrays'
    is: whether a row's destination shares memory with a later source is
    decided here, from these arrays (Communicator._collective reuses a bound
    form only for the very same arrays, and outputs it makes from them or
    anew).
    """

    def __init__(self, tables, op, nranks, arrays, slot_of, fixed):
        fold = _FOLD[op]
        # Whole arrays of any shape serve as operands where the row's NumPy
        # calls are elementwise; max and min of floats index ties by flat
        # position (_ieee), so they get flat views.
        elementwise = fold in (np.add, np.multiply)
        shapes = [a.shape for a in arrays]
        self._nslots = len(arrays)
        self._fixed = []        # views of fixed buffers, at indices nslots..
        self._flat = []         # slots whose flat view is made per call (not 1-D)
        self._slices = []       # (index of a flat array, start, stop), sliced per call
        regions = {}            # region -> index in the per-call list of operands
        flat_index = {}

        def flat(slot):
            if len(shapes[slot]) == 1:
                return slot
            if slot not in flat_index:
                self._flat.append(slot)
                flat_index[slot] = ("flat", slot)
            return flat_index[slot]

        def operand(rank, buffer_id, offset, count, whole):
            slot = slot_of(rank, buffer_id)
            if slot is None:
                key = ("fixed", rank, buffer_id, offset, count)
                if key not in regions:
                    self._fixed.append(fixed(rank, buffer_id)[offset:offset + count])
                    regions[key] = ("fixed", len(self._fixed) - 1)
                return regions[key]
            if whole:
                return slot
            if offset == 0 and count == math.prod(shapes[slot]):
                return flat(slot)
            key = ("slice", slot, offset, count)
            if key not in regions:
                self._slices.append((flat(slot), offset, offset + count))
                regions[key] = ("slice", len(self._slices) - 1)
            return regions[key]

        decoded = []
        for table in tables:
            for rank, kind, count, dst_buf, dst_off, nsrc, *sources in table.tolist():
                refs = [(rank, dst_buf, dst_off)] + [tuple(sources[3 * i:3 * i + 3]) for i in range(nsrc)]
                slots = [slot_of(r, b) for r, b, _ in refs]
                # Whole arrays when every operand is a caller's array, entire
                # and of one shape; else flat views (slices) of each.
                whole = (kind == COPY_OP or elementwise) and None not in slots \
                    and all(off == 0 and math.prod(shapes[s]) == count for (_, _, off), s in zip(refs, slots)) \
                    and len({shapes[s] for s in slots}) == 1
                decoded.append((kind, [operand(r, b, off, count, whole) for r, b, off in refs]))

        # Per-call operand list: slots, fixed views, flat views, slices.
        order = {}
        for i in range(len(self._fixed)):
            order["fixed", i] = self._nslots + i
        for i, slot in enumerate(self._flat):
            order["flat", slot] = self._nslots + len(self._fixed) + i
        for i in range(len(self._slices)):
            order["slice", i] = self._nslots + len(self._fixed) + len(self._flat) + i

        def index(ref):
            return ref if isinstance(ref, int) else order[ref]

        self._slices = [(index(base), start, stop) for base, start, stop in self._slices]
        views = self._operands(arrays)   # this call's operands: which rows alias is decided on them
        steps, copies = [], []
        reduces = False
        for kind, refs in decoded:
            dst, *srcs = map(index, refs)
            if kind == COPY_OP:
                copies.append((dst, srcs[0]))
                continue
            if copies:
                steps.append(_copy_step(copies))
                copies = []
            reduces = True
            divisor = nranks if kind == REDUCE_FINAL_OP and op is ReduceOp.AVG else None
            if _accumulates_in_float32(views[dst].dtype):
                steps.append(_float32_step(fold, dst, srcs, divisor))
            else:
                late_alias = any(np.may_share_memory(views[dst], views[s]) for s in srcs[2:])
                steps.append(_reduce_step(fold, dst, srcs, late_alias, divisor))
        if copies:
            steps.append(_copy_step(copies))
        steps = tuple(steps)
        operands = self._operands if self._fixed or self._flat or self._slices else None

        def run(arrays):
            views = arrays if operands is None else operands(arrays)
            for step in steps:
                step(views)

        # Only float folds can raise floating-point errors, which execute
        # ignores; errstate as a decorator is its cheapest form per call.
        self.run = np.errstate(all="ignore")(run) if reduces and any(is_floating(a.dtype) for a in arrays) else run

    def _operands(self, arrays):
        views = [*arrays, *self._fixed]
        for slot in self._flat:
            views.append(views[slot].reshape(-1))
        for base, start, stop in self._slices:
            views.append(views[base][start:stop])
        return views

    def __call__(self, arrays):
        """Run the tables on `arrays` (one per slot, as at binding); also `run(arrays)`."""
        self.run(arrays)


def _copy_step(pairs):
    """Consecutive COPY rows: np.copyto(dst, src) each, in order."""
    pairs = tuple(pairs)
    copyto = np.copyto

    def copy(views):
        for dst, src in pairs:
            copyto(views[dst], views[src])

    return copy


def _reduce_step(fold, dst, srcs, late_alias, divisor):
    """A REDUCE(_FINAL) row as _execute runs it, its aliasing decided."""
    first, second, *rest = srcs
    rest = tuple(rest)
    if late_alias:
        def reduce(views):
            acc = fold(views[first], views[second], out=None)
            for src in rest:
                fold(acc, views[src], out=acc)
            np.copyto(views[dst], acc)
            if divisor is not None:
                divide_by_ranks(views[dst], divisor)
    elif divisor is None:
        def reduce(views):
            out = views[dst]
            fold(views[first], views[second], out=out)
            for src in rest:
                fold(out, views[src], out=out)
    else:
        def reduce(views):
            out = views[dst]
            fold(views[first], views[second], out=out)
            for src in rest:
                fold(out, views[src], out=out)
            divide_by_ranks(out, divisor)
    return reduce


def _float32_step(fold, dst, srcs, divisor):
    """A float16/bfloat16 REDUCE(_FINAL) row: _reduce_in_float32."""
    srcs = tuple(srcs)

    def reduce(views):
        _reduce_in_float32(views[dst], [views[s] for s in srcs], fold, divisor)

    return reduce
