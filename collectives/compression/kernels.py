"""The compression codecs' names, wire sizes and launching.

The wire format, and the arithmetic every form shares, is kernels/codec.cuh
(float32 <-> bf16, fp16 and int8 payloads with a block-32 E8M0 scale),
written once in C++ and compiled two ways:

    kernels/codec.cu                      the GPU kernels: NVRTC on a GPU
                                          (devices/cuda.py), g++ for the
                                          emulated device (devices/emulated.py
                                          runs the same file, warp shuffles
                                          and all), nvcc for the static checks
    collectives/compression/_codec.cpp    the CPU loops over blocks, for host
                                          ranks: a Python extension setup.py
                                          builds (no CUDA needed)

This module checks arguments and calls them: `cpu_encode` and friends on
NumPy arrays; on devices, `device_launch` turns one of wire.codec_launches'
operations into a codec_kernel instance and its argument block,
`device_row` into a row of codec_batch, and `batch_rows` groups a
device's rows into launches (rows that touch no common memory run side by
side); `round_sum_arguments` is codec_round_sum's block (direct, ranks on
one device: the rounding fused with the sum). tests/test_codecs.py compares
every form with the NumPy reference (tests/codec_reference.py) bit for bit.
"""

import ctypes
import functools

import numpy as np

from ..errors import CollectiveError, InvalidUsageError

CODECS = ("bf16", "fp16", "int8")
BLOCK = 32

BF16, FP16, INT8 = range(3)            # codec ids, the kernels' first argument
_PAYLOAD_DTYPES = (np.uint16, np.uint16, np.int8)


# -- the codecs by name ---------------------------------------------------------


def codec_id(name):
    """The small integer the kernels take for codec `name`."""
    try:
        return CODECS.index(name)
    except (ValueError, TypeError):
        raise InvalidUsageError(f"unknown codec {name!r}; expected one of {', '.join(map(repr, CODECS))}") from None


def payload_dtype(name):
    """np.uint16 (bf16, fp16 bits) or np.int8 (int8)."""
    return _PAYLOAD_DTYPES[codec_id(name)]


def has_scales(name):
    """Whether the codec sends a scale byte per block (fp16, int8)."""
    return codec_id(name) != BF16


def wire_nbytes(name, n):
    """(payload bytes, scale bytes) of n elements that start on a block boundary."""
    n = int(n)
    if n < 0:
        raise InvalidUsageError(f"element count must be >= 0, got {n}")
    scale_bytes = -(-n // BLOCK) if has_scales(name) else 0
    return n * np.dtype(payload_dtype(name)).itemsize, scale_bytes


# -- CPU: the host extension (_codec.cpp, kernels/codec.cuh's arithmetic) ------


@functools.cache
def _host_loops():
    """The compiled CPU loops (collectives/compression/_codec.cpp), built by
    setup.py with the package."""
    try:
        from . import _codec
    except ImportError as error:
        raise CollectiveError(
            "the compression codecs' CPU loops (collectives/compression/_codec.cpp) were not built, so compressed "
            "collectives on host arrays cannot run: install a C++ compiler (g++ or clang++, e.g. apt-get install "
            f"g++) and reinstall the package (pip install .), or run python setup.py build_ext --inplace ({error})"
        ) from None
    if _codec.BLOCK != BLOCK:
        raise CollectiveError(f"{_codec.__file__} was built for blocks of {_codec.BLOCK}, not {BLOCK}: rebuild it")
    return _codec


def _address(array):
    return array.ctypes.data


def _nblocks(n):
    return (n + BLOCK - 1) // BLOCK


def _check(name, what, array, dtype, size=None):
    if not isinstance(array, np.ndarray) or array.ndim != 1 or array.dtype != dtype \
            or not array.flags.c_contiguous:
        raise InvalidUsageError(f"{name}: {what} must be a contiguous 1-D {np.dtype(dtype)} NumPy array, got "
                                f"{getattr(array, 'dtype', type(array).__name__)} "
                                f"{getattr(array, 'shape', '')}")
    if size is not None and array.size < size:
        raise InvalidUsageError(f"{name}: {what} holds {array.size} elements, {size} needed")


def _check_wire(name, n, payload, scales, what="payload"):
    """Validate the wire arrays for n elements; returns (codec id, payload, scales)."""
    codec = codec_id(name)
    _check(name, what, payload, _PAYLOAD_DTYPES[codec], n)
    if scales is None and codec == BF16:
        scales = np.empty(0, np.uint8)
    _check(name, f"scales of {what}", scales, np.uint8, _nblocks(n) if codec != BF16 else 0)
    return codec, payload, scales


def _out_wire(name, n, out_payload, out_scales):
    """(codec, payload, scales, encode_out); empty arrays stand in when not encoding."""
    codec = codec_id(name)
    if out_payload is None:
        return codec, np.empty(0, _PAYLOAD_DTYPES[codec]), np.empty(0, np.uint8), False
    return (*_check_wire(name, n, out_payload, out_scales, "out_payload"), True)


def _write_out(write_out, encode_out):
    if not write_out and not encode_out:
        raise InvalidUsageError("write_out=False needs out_payload: else the call would write nothing")
    return bool(write_out)


def _divisor(divisor):
    divisor = np.float32(divisor)
    if not divisor >= 0:
        raise InvalidUsageError(f"divisor must be >= 0 (0: none), got {divisor}")
    return divisor


def cpu_encode(name, x, payload, scales, round_x=False):
    """Encode float32 x into payload (and scales); with round_x, also replace
    x by decode(encode(x)). x starts on a block boundary; payload and scales
    are views at the same element (and element // BLOCK)."""
    bound_encode(name, x, payload, scales, round_x)()


def cpu_decode(name, payload, scales, out):
    """out = decode(payload, scales) for out.size elements."""
    bound_decode(name, payload, scales, out)()


def cpu_decode_add(name, acc, payload, scales, out, divisor=0, out_payload=None, out_scales=None, write_out=True):
    """out = acc + decode(payload, scales), then out /= divisor if divisor > 0,
    then, if out_payload is given, encode out into out_payload/out_scales and
    set out to its decoding. out may be acc. With write_out False (only with
    out_payload), out is left alone: only the encoding is written (out
    still gives the element count)."""
    bound_decode_add(name, acc, payload, scales, out, divisor, out_payload, out_scales, write_out)()


def cpu_add(name, acc, b, out, divisor=0, out_payload=None, out_scales=None, write_out=True):
    """cpu_decode_add with a float32 b in place of a decoded payload; out may
    be acc or b."""
    bound_add(name, acc, b, out, divisor, out_payload, out_scales, write_out)()


# The same four, checked once and bound to their arrays' addresses: a call
# of no arguments that runs the loop, for a caller that runs it call after
# call on the same arrays (hierarchy.compressed_program), which must keep
# the arrays alive.

def bound_encode(name, x, payload, scales, round_x=False):
    _check(name, "x", x, np.float32)
    codec, payload, scales = _check_wire(name, x.size, payload, scales)
    return functools.partial(_host_loops().encode, codec, _address(x), _address(payload), _address(scales), x.size,
                             bool(round_x))


def bound_decode(name, payload, scales, out):
    _check(name, "out", out, np.float32)
    codec, payload, scales = _check_wire(name, out.size, payload, scales)
    return functools.partial(_host_loops().decode, codec, _address(payload), _address(scales), _address(out),
                             out.size)


def bound_decode_add(name, acc, payload, scales, out, divisor=0, out_payload=None, out_scales=None, write_out=True):
    _check(name, "out", out, np.float32)
    _check(name, "acc", acc, np.float32, out.size)
    codec, payload, scales = _check_wire(name, out.size, payload, scales)
    _, out_payload, out_scales, encode_out = _out_wire(name, out.size, out_payload, out_scales)
    return functools.partial(_host_loops().decode_add, codec, _address(acc), _address(payload), _address(scales),
                             _address(out), out.size, _divisor(divisor), _address(out_payload), _address(out_scales),
                             encode_out, _write_out(write_out, encode_out))


def bound_add(name, acc, b, out, divisor=0, out_payload=None, out_scales=None, write_out=True):
    _check(name, "out", out, np.float32)
    _check(name, "acc", acc, np.float32, out.size)
    _check(name, "b", b, np.float32, out.size)
    codec, out_payload, out_scales, encode_out = _out_wire(name, out.size, out_payload, out_scales)
    return functools.partial(_host_loops().add, codec, _address(acc), _address(b), _address(out), out.size,
                             _divisor(divisor), _address(out_payload), _address(out_scales), encode_out,
                             _write_out(write_out, encode_out))


# -- devices: one kernel of kernels/codec.cu per operation ------------------------

# enum CodecOp and CodecFlag of kernels/codec.cu
KERNELS = ("encode", "decode", "decode_add", "add")
ENCODE_OUT, WRITE_OUT = 1, 2


class CodecArgs(ctypes.Structure):
    """codec.cu's CodecArgs, the one by-value argument of every codec kernel:
    byte addresses (0: absent), the element count, the divisor, the flags."""
    _fields_ = [("acc", ctypes.c_uint64), ("b", ctypes.c_uint64), ("payload", ctypes.c_uint64),
                ("scales", ctypes.c_uint64), ("out", ctypes.c_uint64), ("out_payload", ctypes.c_uint64),
                ("out_scales", ctypes.c_uint64), ("n", ctypes.c_int64), ("divisor", ctypes.c_float),
                ("flags", ctypes.c_int32)]


def _at(region):
    """A region's address; 0 for an absent or empty one (nothing is read there)."""
    return 0 if region is None or region.count == 0 else int(region.address)


def device_launch(kernel, name, regions, divisor):
    """One of wire.codec_launches' operations on device memory as
    (kernels.CodecInstance, CodecArgs, element count), or None when there is
    nothing to do. `regions` (wire.Region, None for an absent encoded
    output or float result) come in the order of the CPU loop of the same
    name; "encode_round" is encode that also sets x = decode(encode(x))."""
    from .. import kernels as sources
    codec = codec_id(name)
    args = CodecArgs(divisor=float(_divisor(divisor)))
    if kernel in ("encode", "encode_round"):
        x, payload, scales = regions
        n, op = x.count, "encode"
        args.acc, args.out_payload, args.out_scales = _at(x), _at(payload), _at(scales)
        if kernel == "encode_round":
            args.out, args.flags = _at(x), WRITE_OUT
    elif kernel == "decode":
        payload, scales, out = regions
        n, op = out.count, "decode"
        args.payload, args.scales, args.out = _at(payload), _at(scales), _at(out)
    elif kernel in ("decode_add", "add"):
        if kernel == "decode_add":
            acc, payload, scales, out, out_payload, out_scales = regions
            args.payload, args.scales = _at(payload), _at(scales)
        else:
            acc, b, out, out_payload, out_scales = regions
            args.b = _at(b)
        n, op = acc.count, kernel
        encode_out = out_payload is not None
        _write_out(out is not None, encode_out)       # out None (only the wire wanted) needs the wire
        args.acc, args.out = _at(acc), _at(out)
        args.out_payload, args.out_scales = _at(out_payload), _at(out_scales)
        args.flags = (ENCODE_OUT if encode_out else 0) | (WRITE_OUT if out is not None else 0)
    else:
        raise InvalidUsageError(f"unknown codec kernel {kernel!r}; expected one of {KERNELS} or 'encode_round'")
    if n == 0:
        return None
    args.n = n
    return sources.CodecInstance(codec, KERNELS.index(op)), args, n


# -- devices: operations in batches, one codec_batch launch each ------------------

# codec.cu's CodecRow and CodecBatch: a row is CodecArgs and what to do with
# them (an index of KERNELS, or COPY: args.n bytes from args.acc to args.out).
COPY = 4


class CodecRow(ctypes.Structure):
    _fields_ = [("args", CodecArgs), ("op", ctypes.c_int32), ("unused", ctypes.c_int32)]


@functools.cache
def codec_batch_type():
    """codec.cu's CodecBatch, the by-value argument of codec_batch (made at
    first use: its row count is the kernel sources', which host ranks never
    load)."""
    from .. import kernels as sources

    class CodecBatch(ctypes.Structure):
        _fields_ = [("rows", CodecRow * sources.CODEC_BATCH_ROWS)]
    return CodecBatch


def device_row(kernel, name, regions, divisor):
    """One of wire.codec_launches' operations (a "copy" too) as a CodecRow
    of codec_batch, or None when there is nothing to do."""
    if kernel == "copy":
        dst, src = regions
        nbytes = dst.count * np.dtype(dst.dtype).itemsize
        if nbytes == 0:
            return None
        return CodecRow(CodecArgs(acc=_at(src), out=_at(dst), n=nbytes), COPY)
    launch = device_launch(kernel, name, regions, divisor)
    if launch is None:
        return None
    instance, args, _ = launch
    return CodecRow(args, instance.op)


def _row_accesses(row, name):
    """(reads, writes) of a row: byte ranges [start, stop) of device memory."""
    args, op = row.args, row.op
    if op == COPY:
        return [(args.acc, args.acc + args.n)], [(args.out, args.out + args.n)]
    n = args.n
    payload = n * np.dtype(payload_dtype(name)).itemsize
    scales = _nblocks(n) if has_scales(name) else 0
    reads, writes = [], []
    for address, nbytes, into in ((args.acc, 4 * n, reads), (args.b, 4 * n, reads),
                                  (args.payload, payload, reads), (args.scales, scales, reads),
                                  (args.out, 4 * n, writes), (args.out_payload, payload, writes),
                                  (args.out_scales, scales, writes)):
        if address and nbytes:
            into.append((address, address + nbytes))
    return reads, writes


def _overlap(ranges, others):
    return any(a < d and c < b for a, b in ranges for c, d in others)


def batch_rows(rows, name):
    """`rows` (CodecRows in the order they must appear to run) as batches,
    lists of at most CODEC_BATCH_ROWS rows that touch no common memory
    where one writes: each batch a codec_batch launch, the batches launched
    in order on one stream. A row goes into the batch after the last one
    holding a row it must follow (it reads what that row writes, or writes
    what that row reads or writes), so every such pair stays in order and
    the rest run side by side."""
    from .. import kernels as sources

    levels = []          # per level: [(row, reads, writes)]
    for row in rows:
        reads, writes = _row_accesses(row, name)
        level = 0
        for depth in range(len(levels) - 1, -1, -1):
            if any(_overlap(writes, r + w) or _overlap(w, reads) for _, r, w in levels[depth]):
                level = depth + 1
                break
        if level == len(levels):
            levels.append([])
        levels[level].append((row, reads, writes))
    size = sources.CODEC_BATCH_ROWS
    return [[row for row, _, _ in level[i:i + size]] for level in levels for i in range(0, len(level), size)]


def batch_grid(rows, resident_blocks):
    """(blocks per row, rows) of a codec_batch launch: the blocks the longest
    row has work for (codec_grid's rule; a copy's 16-byte pieces), no more
    than the device's resident blocks shared among the rows."""
    from .. import kernels as sources

    def blocks(row):
        if row.op == COPY:
            pieces = -(-row.args.n // 16)
            return -(-pieces // sources.CODEC_THREADS)
        return sources.codec_grid(row.args.n, resident_blocks)

    longest = max(blocks(row) for row in rows)
    return max(1, min(longest, int(resident_blocks) // len(rows))), len(rows)


def batch_arguments(rows):
    """A CodecBatch holding `rows` (the rest zero: rows no block runs)."""
    batch = codec_batch_type()()
    for i, row in enumerate(rows):
        batch.rows[i] = row
    return batch


# -- devices: ranks on one device, the rounding fused with the sum ------------------


class CodecSumArgs(ctypes.Structure):
    """codec.cu's CodecSumArgs, the by-value argument of codec_round_sum."""
    _fields_ = [("inputs", ctypes.c_uint64 * 64), ("outputs", ctypes.c_uint64 * 64), ("n", ctypes.c_int64),
                ("ninputs", ctypes.c_int32), ("noutputs", ctypes.c_int32), ("divisor", ctypes.c_float),
                ("unused", ctypes.c_int32)]


def round_sum_arguments(inputs, outputs, n, divisor):
    """CodecSumArgs for codec_round_sum: every output gets the sum, in the
    order of `inputs` (float32 addresses), of each input rounded through the
    codec, divided by `divisor` when it is > 0."""
    if not 1 <= len(inputs) <= 64 or not 1 <= len(outputs) <= 64:
        raise InvalidUsageError(f"codec_round_sum takes 1 to 64 inputs and outputs, got {len(inputs)} and "
                                f"{len(outputs)}")
    args = CodecSumArgs(n=int(n), ninputs=len(inputs), noutputs=len(outputs), divisor=float(_divisor(divisor)))
    for i, address in enumerate(inputs):
        args.inputs[i] = int(address)
    for i, address in enumerate(outputs):
        args.outputs[i] = int(address)
    return args
