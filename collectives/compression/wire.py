"""Compression on the wire, for any allreduce algorithm.

A compressed allreduce runs the same schedule as a plain one; only what a
rank reads from a peer changes. Each rank keeps two forms of its workspace:

    float32      WORK and SCRATCH, where it accumulates
    wire         the same regions encoded by the codec (kernels.py), which
                 is the only form a peer ever reads

One invariant makes every algorithm's bitwise-identical results survive:

    whenever a peer will read what a row writes, the row writes the encoded
    form too, and replaces its own float32 copy by the decoding of it.

So a region's float32 copy equals the decoding of its wire copy whenever a
peer can see it, and the owner and its peers fold the same values in the
same order. And where any completed result travels to a peer, every row
that completes a result rounds it the same way (encoded_writes), so ranks
that compute a result and ranks that receive one hold the same bits. What comes in from a peer is decoded and added to the local
float32 data, and what goes out is encoded, in one fused operation
(decode_add with an encoded output), once per transfer. A region whose
value stays with its owner (an intermediate sum the owner reuses, the final
copy into OUTPUT) is never rounded.

Chunks start on codec blocks (BLOCK elements), so a region at element
offset o of a buffer is at payload element o and scale byte o // BLOCK of
the wire copy: the op tables' offsets address both forms.

`lower_rows` turns each table row into codec operations, the program that
the host executor (NumPy views) and the device executors (kernels) run:

    ("copy",       out F, a F)                     out = a
    ("decode",     out F, a W)                     out = decode(a)
    ("copy_wire",  out W, a W)                     encoded bytes, as they are
    ("encode",     out F, a F, out W)              out W = encode(a); out F = decode(out W)
    ("add",        out F, a F, b F, divisor, out W or None)
    ("decode_add", out F, a F, b W, divisor, out W or None)
                   out = a + decode(b), then / divisor, then encoded as above

Refs are (rank, buffer, element offset, count); F means float32 form, W the
wire form; buffer TEMP is the rank's float32 accumulator for rows with more
than two sources. An output F of None is not written (streamline.py drops
what no one reads).
"""

from typing import NamedTuple

import numpy as np

from ..algorithms.schedule import ALLREDUCE, SCRATCH, WORK
from ..binding import COPY_OP, REDUCE_FINAL_OP
from ..errors import InvalidUsageError
from ..ops import ReduceOp, as_reduce_op
from .kernels import BLOCK, CODECS, wire_nbytes
from .streamline import streamline

TEMP = 4          # a rank's float32 accumulator (after WORK, SCRATCH, INPUT, OUTPUT)
PAGE = 4096

FLOAT32 = "float32"


def check_compression(compression, dtype, op, collective=ALLREDUCE):
    """Raise InvalidUsageError unless `compression` applies to this call.
    None always applies."""
    if compression is None:
        return
    if not isinstance(compression, str) or compression not in CODECS:
        raise InvalidUsageError(f"unknown compression {compression!r}; expected None or one of "
                                f"{', '.join(map(repr, CODECS))}")
    if collective != ALLREDUCE:
        raise InvalidUsageError(f"compression applies to allreduce, not {collective}")
    if str(dtype) != FLOAT32:
        raise InvalidUsageError(f"compression={compression!r} takes float32 arrays (it accumulates in float32), "
                                f"got {dtype}")
    if as_reduce_op(op) not in (ReduceOp.SUM, ReduceOp.AVG):
        raise InvalidUsageError(f"compression={compression!r} works with op 'sum' or 'avg', got {as_reduce_op(op).value!r}")



def encoded_nbytes(codec, count):
    """Bytes of `count` elements (from a block boundary) on the wire."""
    payload, scales = wire_nbytes(codec, count)
    return payload + scales


class WireLayout(NamedTuple):
    """Where a compressed plan's extra memory sits in a rank's workspace (bytes)."""
    codec: str
    payload: dict          # buffer id -> offset of the wire payload of WORK / SCRATCH
    scales: dict           # buffer id -> offset of its scale bytes
    temp: int              # offset of the float32 accumulator (count elements)
    workspace_bytes: int
    scales_used: bool      # whether the codec has scale bytes (bf16 has none)

    @classmethod
    def after(cls, base_bytes, work_count, scratch_count, codec):
        """The layout placed after `base_bytes` of float32 WORK and SCRATCH."""
        offset = _page(base_bytes)
        payload, scales = {}, {}
        for buffer, count in ((WORK, work_count), (SCRATCH, scratch_count)):
            payload_bytes, scale_bytes = wire_nbytes(codec, count)
            payload[buffer] = offset
            scales[buffer] = _page(offset + payload_bytes)
            offset = _page(scales[buffer] + scale_bytes)
        return cls(codec, payload, scales, offset, offset + 4 * work_count, wire_nbytes(codec, BLOCK)[1] > 0)


def _page(nbytes):
    return -(-nbytes // PAGE) * PAGE


# -- which writes go on the wire ------------------------------------------------


def encoded_writes(phases):
    """{(phase, move index)} of the moves whose written value some peer reads
    before it is overwritten (moves of binding.logical_phases)."""
    encoded = set()
    last_writer = {}     # region -> (phase, move index) of its latest write
    for p, phase in enumerate(phases):
        for m in phase:
            for src in m.srcs:
                if src.rank != m.rank:
                    writer = last_writer.get(src)
                    if writer is None:
                        raise AssertionError(f"{src} is read by a peer before this call wrote it")
                    encoded.add(writer)
        for i, m in enumerate(phase):
            last_writer[m.dst] = (p, i)
    # Where one rank's completed result travels to another, every completed
    # result is rounded through the codec: else the rank that kept its own
    # (unrounded) result would disagree with the ranks that received one
    # (butterfly on 3 ranks: rank 0 forwards its result to rank 2, rank 1
    # keeps its own). Where none travels (direct), none needs rounding.
    final = {(p, i) for p, phase in enumerate(phases) for i, m in enumerate(phase) if m.kind == REDUCE_FINAL_OP}
    if encoded & final:
        encoded |= final
    return encoded


# -- rows as codec operations -------------------------------------------------


def lower_rows(rows, nranks, op):
    """Per rank, the codec operations of its rows (plan rows: rank, kind,
    count, dst buffer, dst offset, sources, encode)."""
    by_rank = [[] for _ in range(nranks)]
    for rank, kind, count, dst_buf, dst_off, srcs, encode in rows:
        divisor = nranks if kind == REDUCE_FINAL_OP and ReduceOp(op) is ReduceOp.AVG else 0
        by_rank[rank].extend(_lower(rank, kind, count, (rank, dst_buf, dst_off, count),
                                    [(s[0], s[1], s[2], count) for s in srcs], encode, divisor))
    return tuple(tuple(ops) for ops in by_rank)


def lower_plan(phase_rows, nranks, op, streamlined=True):
    """Per phase, per rank, the codec operations of a compressed plan;
    `streamlined` (streamline.py) skips the float32 passes nothing needs."""
    lowered = [lower_rows(rows, nranks, op) for rows in phase_rows]   # [phase][rank]
    if not streamlined:
        return lowered
    per_rank = [streamline([phase[rank] for phase in lowered]) for rank in range(nranks)]
    return [tuple(per_rank[rank][p] for rank in range(nranks)) for p in range(len(lowered))]


def _lower(rank, kind, count, dst, srcs, encode, divisor):
    out_wire = dst if encode else None
    if kind == COPY_OP:
        (src,) = srcs
        if src[0] == rank:
            return [("copy", dst, src)] + ([("encode", dst, dst, dst)] if encode else [])
        if not encode:
            return [("decode", dst, src)]
        # The peer's encoded chunk is read once, across the link: copied as it
        # is into this rank's wire copy (which a later peer reads), then
        # decoded from there, in this rank's own memory.
        return [("copy_wire", dst, src), ("decode", dst, dst)]

    def fold(out, a, b, a_is_wire=False, last=False):
        """out = a + b as one operation (a is float unless a_is_wire, then b is)."""
        divide, wire_out = (divisor, out_wire) if last else (0, None)
        if a_is_wire:
            a, b = b, a   # addition commutes bit for bit: which operand is decoded does not matter
        if b[0] == rank or b[1] == TEMP:
            return ("add", out, a, b, divide, wire_out)
        return ("decode_add", out, a, b, divide, wire_out)

    ops = []
    own = [s[0] == rank for s in srcs]
    # Two sources write straight into dst; more accumulate in TEMP, since
    # dst may be one of the later sources (the rank's own chunk).
    acc = dst if len(srcs) == 2 else (rank, TEMP, 0, count)
    first, second = srcs[0], srcs[1]
    if not own[0] and not own[1]:
        ops.append(("decode", acc, first))
        first, own0 = acc, True
    else:
        own0 = own[0]
    ops.append(fold(acc, first, second, a_is_wire=not own0, last=len(srcs) == 2))
    for i, src in enumerate(srcs[2:], start=2):
        last = i == len(srcs) - 1
        ops.append(fold(dst if last else acc, acc, src, last=last))
    return ops


# -- codec operations as kernel launches -----------------------------------------


def codec_launches(ops, f, w):
    """Each operation as (kernel, args, divisor), the arguments of one kernel
    of kernels.py (or "copy": dst, src of equal size) in the order its CPU
    loop takes them. `f(ref)` gives a float32 region, `w(ref)` a wire region
    as (payload, scales): NumPy views on the host, address descriptions on
    devices. Encoded outputs that are absent are (None, None)."""
    for kind, out, a, *rest in ops:
        if kind == "copy":
            yield "copy", (f(out), f(a)), 0
        elif kind == "decode":
            yield "decode", (*w(a), f(out)), 0
        elif kind == "copy_wire":
            for dst, src in zip(w(out), w(a)):
                if _length(dst):
                    yield "copy", (dst, src), 0
        elif kind == "encode":   # ("encode", out F or None, a F, out W)
            source, encoded = f(a), w(rest[0])
            if out == a:
                yield "encode_round", (source, *encoded), 0
            else:
                yield "encode", (source, *encoded), 0
                if out is not None:
                    yield "decode", (*encoded, f(out)), 0
        else:
            b, divisor, out_wire = rest
            encoded = w(out_wire) if out_wire is not None else (None, None)
            result = f(out) if out is not None else None    # None: only the encoded result is wanted
            if kind == "add":
                yield "add", (f(a), f(b), result, *encoded), divisor
            else:
                yield "decode_add", (f(a), *w(b), result, *encoded), divisor


def _length(region):
    return region.size if hasattr(region, "size") else region.count


class Region(NamedTuple):
    """Device memory for one kernel argument: `count` elements of `dtype` at `address`."""
    address: int
    count: int
    dtype: str

    @property
    def size(self):
        return self.count


def device_regions(plan, address_of):
    """(f, w) for codec_launches on devices: `address_of(rank, buffer)` is the
    address of a rank's float32 buffer (WORK, SCRATCH, INPUT, OUTPUT) or of
    its workspace (buffer None), from which TEMP and the wire copies are found."""
    layout = plan.wire
    payload_dtype = np.dtype(_payload_dtype(layout.codec))

    def f(ref):
        rank, buffer, offset, count = ref
        base = address_of(rank, None) + layout.temp if buffer == TEMP else address_of(rank, buffer)
        return Region(base + 4 * offset, count, "float32")

    def w(ref):
        rank, buffer, offset, count = ref
        base = address_of(rank, None)
        first, stop = block_range(offset, count)
        scales = Region(base + layout.scales[buffer] + first, stop - first if layout.scales_used else 0, "uint8")
        return Region(base + layout.payload[buffer] + payload_dtype.itemsize * offset, count, payload_dtype.name), scales

    return f, w


def _payload_dtype(codec):
    from .kernels import payload_dtype
    return payload_dtype(codec)


# -- a workspace's views, for executors that run on NumPy ------------------------


def workspace_views(plan, workspace):
    """(floats, wires) of one rank's workspace (bytes-like or uint8 array):
    floats[buffer] is a float32 array (WORK, SCRATCH, TEMP), wires[buffer]
    is (payload, scales) for WORK and SCRATCH."""
    import numpy as np

    layout = plan.wire
    raw = np.frombuffer(workspace, np.uint8) if not isinstance(workspace, np.ndarray) else workspace
    floats = {
        WORK: raw[:4 * plan.count].view(np.float32),
        SCRATCH: raw[plan.scratch_offset:plan.scratch_offset + 4 * plan.scratch_elements].view(np.float32),
        TEMP: raw[layout.temp:layout.temp + 4 * plan.count].view(np.float32),
    }
    from .kernels import payload_dtype
    dtype = np.dtype(payload_dtype(layout.codec))
    wires = {}
    for buffer, count in ((WORK, plan.count), (SCRATCH, plan.scratch_elements)):
        payload_bytes, scale_bytes = wire_nbytes(layout.codec, count)
        start = layout.payload[buffer]
        wires[buffer] = (raw[start:start + payload_bytes].view(dtype),
                         raw[layout.scales[buffer]:layout.scales[buffer] + scale_bytes])
    return floats, wires


def block_range(offset, count):
    """The scale bytes of `count` elements from element `offset` (a block start)."""
    first = offset // BLOCK
    return first, first + -(-count // BLOCK)


def quantizations(plan):
    """The most times any element of the result was encoded on its way
    there (the q of the error bounds in the README): the plan's codec
    operations run on counters instead of values."""
    from ..binding import OUTPUT

    counts = {}   # (rank, buffer) or (rank, ("wire", buffer)) -> per element counts; inputs start at 0

    def floats(rank, buffer):
        key = (rank, buffer)
        if key not in counts:
            counts[key] = np.zeros(plan.count if buffer != SCRATCH else plan.scratch_elements, np.int64)
        return counts[key]

    def wire_copy(rank, buffer):
        return floats(rank, ("wire", buffer))

    def view(get, ref):
        rank, buffer, offset, count = ref
        return get(rank, buffer)[offset:offset + count]

    for phase in plan.phases:
        for ops in phase.wire_ops_by_rank:
            for kind, out, a, *rest in ops:
                if kind == "copy":
                    view(floats, out)[:] = view(floats, a)
                elif kind == "decode":
                    view(floats, out)[:] = view(wire_copy, a)
                elif kind == "copy_wire":
                    view(wire_copy, out)[:] = view(wire_copy, a)
                elif kind == "encode":
                    (out_wire,) = rest
                    view(wire_copy, out_wire)[:] = view(floats, a) + 1
                    if out is not None:
                        view(floats, out)[:] = view(wire_copy, out_wire)
                else:
                    b, _, out_wire = rest
                    b_counts = view(floats, b) if kind == "add" else view(wire_copy, b)
                    result = np.maximum(view(floats, a), b_counts)
                    if out_wire is not None:
                        result += 1
                        view(wire_copy, out_wire)[:] = result
                    if out is not None:
                        view(floats, out)[:] = result
    return max((int(floats(rank, OUTPUT).max()) for rank in range(plan.nranks)), default=0) if plan.count else 0


def round_trip(codec, values):
    """Replace float32 `values` (a NumPy or CuPy array) by decode(encode(values))."""
    from . import kernels

    payload_bytes, scale_bytes = wire_nbytes(codec, values.size)
    if isinstance(values, np.ndarray):
        payload = np.empty(payload_bytes // np.dtype(kernels.payload_dtype(codec)).itemsize, kernels.payload_dtype(codec))
        scales = np.empty(scale_bytes, np.uint8)
        kernels.cpu_encode(codec, values, payload, scales, round_x=True)
        return
    import cupy

    from ..devices import open_device
    device = open_device(values.device.id)
    region = lambda array: Region(array.data.ptr, array.size, array.dtype.name)   # noqa: E731
    payload = cupy.empty(payload_bytes // cupy.dtype(kernels.payload_dtype(codec)).itemsize, kernels.payload_dtype(codec))
    scales = cupy.empty(scale_bytes, cupy.uint8)
    # On the array's device's current stream: ordered with the caller's work, as CuPy's own calls are.
    device.launch_codec(device.current_stream(), "encode_round", codec,
                        (region(values), region(payload), region(scales)), 0)


# One encoding's error, as a fraction of the element (bf16, fp16) or of the
# largest magnitude in its block (int8: half a step, at most max / 127.5).
UNIT = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11, "int8": 2 / 255}


def error_bound(inputs, codec, quantizations, op="sum"):
    """Elementwise bound on |result - exact| of a compressed allreduce of
    `inputs` (one float32 array per rank) whose elements went through at
    most `quantizations` encodings (docs/compression.md, "Error bounds"): each encoding of
    a partial sum errs by UNIT of its magnitude, at most P_i = sum over ranks
    of |x_i| (int8, and fp16's float16 subnormals: of the block's largest,
    at most the sum over ranks of each rank's block maximum), and the float32
    additions by 2^-24 of P_i each."""
    stacked = np.abs(np.stack([np.asarray(x, np.float64).reshape(-1) for x in inputs]))
    n, count = stacked.shape
    magnitude = stacked.sum(axis=0)
    padded = np.pad(stacked, ((0, 0), (0, -count % BLOCK)))
    block_max = np.repeat(padded.reshape(n, -1, BLOCK).max(axis=2).sum(axis=0), BLOCK)[:count]
    unit, growth = UNIT[codec], (1 + UNIT[codec]) ** quantizations
    bound = quantizations * unit * (block_max if codec == "int8" else magnitude) * growth
    bound += (n + 1) * 2.0 ** -24 * magnitude * growth
    if codec == "fp16":   # half a float16 subnormal's spacing: 2^-25 of a scale of at most 2^-14 block max
        bound += quantizations * 2.0 ** -39 * block_max * growth
    if as_reduce_op(op) is ReduceOp.AVG:
        bound = bound / n + 2.0 ** -24 * magnitude / n
    return bound
