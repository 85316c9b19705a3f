"""The codec kernels: float32 <-> wire, written once, compiled three ways.

Wire format (other code depends on it bit for bit)
==================================================

    input        float32, cut into blocks of BLOCK = 32 consecutive elements
                 (the last block of a buffer may be partial)

    codec   payload / element      scales / block   decode
    -----   --------------------   --------------   -------------------------
    bf16    uint16 bfloat16 bits   none             float32(b)
    fp16    uint16 float16 bits    uint8 E8M0       float32(h) * 2^e
    int8    int8 in [-127, 127]    uint8 E8M0       float32(q) * 2^e

    E8M0 scale byte  = e + 127, the block's power of two 2^e (MX's format)
        k            = unbiased float32 exponent of the block's largest |x|
                       (-126 when that maximum is zero or subnormal)
        fp16         e = max(k - 14, -127): the maximum scales into [2^14, 2^15),
                     float16 never overflows, and small blocks keep 11 bits
        int8         e = max(k - 6, -127): the maximum scales into [64, 128)
        byte 255     the block holds an inf or NaN: every element decodes to
                     NaN (payload written as zeros)

    encode  bf16     b = bfloat16_rne(x)              (NaN stays NaN, inf inf)
            fp16     h = float16_rne(x * 2^-e)
            int8     q = clamp(rint_half_even(x * 2^-e), -127, 127)

Every step is float32 with IEEE round-to-nearest-even, no FMA contraction,
no flush of subnormals (2^-127 is the subnormal float32 0x00400000), so the
GPU kernel, Numba's CUDA simulator, the CPU loop and the NumPy reference
(tests/codec_reference.py) agree bit for bit, and the same bytes decode to
the same floats everywhere.

One source, three compilations
==============================

The per-block bodies below (`_encode_block`, `_decode_block`,
`_decode_add_block`, `_add_block` and their helpers) are plain Python on
scalars and 1-D arrays. `_bind` compiles each of them with a given decorator
into a private namespace in which every helper name refers to its compiled
twin:

    numba.njit(cache=True)          the CPU loops over blocks (host ranks and
                                    the emulated device run these)
    numba.cuda.jit(device=True)     CUDA kernels, one thread per block of 32,
                                    grid-stride loop, no shared memory, no
                                    atomics: threads are independent
    the same under NUMBA_ENABLE_CUDASIM=1   the CUDA simulator (tests)

float16 and bfloat16 are converted with integer bit manipulation, not Numba's
float16 type: it is not available alike in njit, CUDA and the simulator, and
on the GPU it compiles to calls that need LTO linking. The only difference
between the targets is `_mul_rn`: on the GPU it is `__fmul_rn`, because NVVM
fuses `a * b + c` into one FMA (one rounding instead of two) whenever it
may, and it may by default.

Importing this module imports no Numba: the kernels are built on first use.
"""

import contextlib
import functools
import os
import re
import shutil
import subprocess
import tempfile
import types
from pathlib import Path

import numpy as np

from ..errors import CollectiveError, InvalidUsageError

CODECS = ("bf16", "fp16", "int8")
BLOCK = 32

BF16, FP16, INT8 = range(3)            # codec ids, the kernels' first argument
_PAYLOAD_DTYPES = (np.uint16, np.uint16, np.int8)
_HEADROOM = (0, 14, 6)                 # e = k - headroom: max scales into [2^h, 2^(h+1))
SPECIAL_SCALE = 255                    # the block holds inf or NaN: decodes to NaN

THREADS_PER_CUDA_BLOCK = 256           # 256 threads x 32 elements = 8192 elements per CUDA block
MAX_GRID = 4096                        # the grid-stride loop covers the rest

_NAN32 = np.float32("nan")
_RNE_MAGIC = np.float32(1.5 * 2 ** 23)  # (y + M) - M rounds y to an integer, half to even, for |y| < 2^22


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


# -- the per-block bodies: plain Python, compiled by _bind ---------------------
#
# Integers are int64 throughout: float bits are widened at once, so every
# target does the same exact arithmetic (Numba would turn uint32 op int64
# into float64, NumPy scalars would wrap).


def _mul_rn(a, b):
    """a * b in float32, rounded once. Replaced by __fmul_rn on the GPU."""
    return a * b


def _bits(x):
    """The bits of float32 x, as a non-negative int."""
    return np.int64(np.float32(x).view(np.uint32))


def _from_bits(b):
    """The float32 whose bits are b (0 <= b < 2^32)."""
    return np.uint32(b).view(np.float32)


def _pow2(e):
    """2^e as float32 for -127 <= e <= 127 (2^-127 is subnormal)."""
    if e == -127:
        return _from_bits(0x00400000)
    return _from_bits((e + 127) << 23)


def _block_range(blk, n):
    lo = blk * BLOCK
    return lo, min(lo + BLOCK, n)


def _to_bf16(x):
    """bfloat16 bits of float32 x, round to nearest even."""
    b = _bits(x)
    if (b & 0x7FFFFFFF) > 0x7F800000:
        return (b >> 16) | 0x0040                      # NaN: keep it a (quiet) NaN
    # Adding 0x7FFF plus the lowest kept bit carries into the kept bits exactly
    # when the dropped half is above one half, or is one half and the kept part
    # odd. A carry out of the mantissa raises the exponent, up to inf.
    return (b + 0x7FFF + ((b >> 16) & 1)) >> 16


def _from_bf16(h):
    return _from_bits((np.int64(h) & 0xFFFF) << 16)


def _to_f16(x):
    """IEEE float16 bits of float32 x, round to nearest even, subnormals included."""
    b = _bits(x)
    sign = (b >> 16) & 0x8000
    a = b & 0x7FFFFFFF
    if a > 0x7F800000:
        return sign | 0x7E00                           # NaN
    if a >= 0x477FF000:                                # >= 65520, halfway from 65504 to 2^16: rounds to inf
        return sign | 0x7C00
    if a >= 0x38800000:                                # >= 2^-14: a normal float16
        # Rebias the exponent (127 -> 15) and drop 13 mantissa bits, rounding as in _to_bf16.
        return sign | ((a - 0x38000000 + 0x0FFF + ((a >> 13) & 1)) >> 13)
    if a <= 0x33000000:                                # <= 2^-25, half the smallest subnormal: ties to 0
        return sign
    # A float16 subnormal counts units of 2^-24: the 24-bit significand m is
    # x / 2^(exponent - 23), so x / 2^-24 = m >> shift with shift in [14, 24].
    shift = 126 - (a >> 23)
    m = (a & 0x7FFFFF) | 0x800000
    h = m >> shift
    rest = m & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    if rest > half or (rest == half and (h & 1) == 1):
        h += 1                                         # may become 0x400, the smallest normal: right
    return sign | h


def _from_f16(h):
    """The float32 value of float16 bits h (exact)."""
    h = np.int64(h) & 0xFFFF
    sign = (h & 0x8000) << 16
    exponent = (h >> 10) & 0x1F
    mantissa = h & 0x3FF
    if exponent == 0x1F:
        return _from_bits(sign | 0x7F800000 | (mantissa << 13))      # inf, NaN
    if exponent == 0:
        # subnormal or zero: mantissa * 2^-24, exact in float32
        v = _mul_rn(np.float32(mantissa), _from_bits(0x33800000))
        return _from_bits(_bits(v) | sign)
    return _from_bits(sign | ((exponent + 112) << 23) | (mantissa << 13))


def _scale_byte(codec, x, lo, hi):
    """E8M0 byte of the block x[lo:hi] (fp16, int8): e + 127, or 255 if inf/NaN."""
    largest = 0                                        # largest |x| as bits: they order like the values
    for i in range(lo, hi):
        a = _bits(x[i]) & 0x7FFFFFFF
        if a > largest:
            largest = a
    if largest >= 0x7F800000:
        return SPECIAL_SCALE
    k = max(largest >> 23, 1) - 127                    # zero and subnormal maxima count as 2^-126
    return max(k - _HEADROOM[codec], -127) + 127


def _encode_value(codec, v, inverse):
    """Payload of float32 v (inverse = 2^-e; unused for bf16)."""
    if codec == BF16:
        return _to_bf16(v)
    y = _mul_rn(v, inverse)                            # exact unless it lands below 2^-126
    if codec == FP16:
        return _to_f16(y)
    q = np.int64((y + _RNE_MAGIC) - _RNE_MAGIC)        # |y| < 128: round half to even
    return min(max(q, -127), 127)                      # 127.5 <= |y| < 128 would give 128


def _decode_value(codec, p, scale_byte):
    """The float32 of payload p in a block with `scale_byte` (unused for bf16)."""
    if codec == BF16:
        return _from_bf16(p)
    if scale_byte == SPECIAL_SCALE:
        return _NAN32
    scale = _pow2(np.int64(scale_byte) - 127)
    if codec == FP16:
        return _mul_rn(_from_f16(p), scale)
    return _mul_rn(np.float32(np.int64(p)), scale)


def _encode_block(codec, x, payload, scales, blk, n, round_x):
    """Encode block `blk` of x[:n]; if round_x, x = decode(encode(x)) there."""
    lo, hi = _block_range(blk, n)
    s = 0
    if codec != BF16:
        s = _scale_byte(codec, x, lo, hi)
        scales[blk] = s
    if s == SPECIAL_SCALE:
        for i in range(lo, hi):
            payload[i] = 0
            if round_x:
                x[i] = _NAN32
        return
    inverse = _pow2(127 - s)                           # 2^-e, always a normal float32
    for i in range(lo, hi):
        p = _encode_value(codec, x[i], inverse)
        payload[i] = p
        if round_x:
            x[i] = _decode_value(codec, p, s)


def _decode_block(codec, payload, scales, out, blk, n):
    lo, hi = _block_range(blk, n)
    s = 0
    if codec != BF16:
        s = scales[blk]
    for i in range(lo, hi):
        out[i] = _decode_value(codec, payload[i], s)


def _finish(v, divisor):
    """v, divided by divisor if divisor > 0 (IEEE float32 division)."""
    if divisor > 0:
        return v / divisor
    return v


def _decode_add_block(codec, acc, payload, scales, out, divisor, out_payload, out_scales, encode_out, blk, n):
    """out = (acc + decode(payload)) [/ divisor], then [encoded into out_payload]."""
    lo, hi = _block_range(blk, n)
    s = 0
    if codec != BF16:
        s = scales[blk]
    for i in range(lo, hi):                            # acc[i] is read before out[i] is written: out may be acc
        out[i] = _finish(acc[i] + _decode_value(codec, payload[i], s), divisor)
    if encode_out:
        _encode_block(codec, out, out_payload, out_scales, blk, n, True)


def _add_block(acc, b, out, divisor, codec, out_payload, out_scales, encode_out, blk, n):
    """out = (acc + b) [/ divisor], then [encoded into out_payload]."""
    lo, hi = _block_range(blk, n)
    for i in range(lo, hi):
        out[i] = _finish(acc[i] + b[i], divisor)
    if encode_out:
        _encode_block(codec, out, out_payload, out_scales, blk, n, True)


def _nblocks(n):
    return (n + BLOCK - 1) // BLOCK


_BODIES = (_nblocks, _mul_rn, _bits, _from_bits, _pow2, _block_range, _to_bf16, _from_bf16, _to_f16, _from_f16,
           _scale_byte, _encode_value, _decode_value, _encode_block, _decode_block, _finish,
           _decode_add_block, _add_block)


# -- the CPU loops and the CUDA kernels: the same bodies, two drivers ----------


# The CPU loops call the bodies with a constant codec in each branch: once
# inlined, LLVM drops the other codecs' branches from the inner loops.

def _encode_loop(codec, x, payload, scales, round_x):
    n = x.size
    for blk in range(_nblocks(n)):
        if codec == BF16:
            _encode_block(BF16, x, payload, scales, blk, n, round_x)
        elif codec == FP16:
            _encode_block(FP16, x, payload, scales, blk, n, round_x)
        else:
            _encode_block(INT8, x, payload, scales, blk, n, round_x)


def _decode_loop(codec, payload, scales, out):
    n = out.size
    for blk in range(_nblocks(n)):
        if codec == BF16:
            _decode_block(BF16, payload, scales, out, blk, n)
        elif codec == FP16:
            _decode_block(FP16, payload, scales, out, blk, n)
        else:
            _decode_block(INT8, payload, scales, out, blk, n)


def _decode_add_loop(codec, acc, payload, scales, out, divisor, out_payload, out_scales, encode_out):
    n = out.size
    for blk in range(_nblocks(n)):
        if codec == BF16:
            _decode_add_block(BF16, acc, payload, scales, out, divisor, out_payload, out_scales, encode_out, blk, n)
        elif codec == FP16:
            _decode_add_block(FP16, acc, payload, scales, out, divisor, out_payload, out_scales, encode_out, blk, n)
        else:
            _decode_add_block(INT8, acc, payload, scales, out, divisor, out_payload, out_scales, encode_out, blk, n)


def _add_loop(acc, b, out, divisor, codec, out_payload, out_scales, encode_out):
    n = out.size
    for blk in range(_nblocks(n)):
        if codec == BF16:
            _add_block(acc, b, out, divisor, BF16, out_payload, out_scales, encode_out, blk, n)
        elif codec == FP16:
            _add_block(acc, b, out, divisor, FP16, out_payload, out_scales, encode_out, blk, n)
        else:
            _add_block(acc, b, out, divisor, INT8, out_payload, out_scales, encode_out, blk, n)


# One thread per block of 32 elements, grid-stride, threads independent.
cuda = None      # numba.cuda in the kernels' namespace (_bind): importing this module imports no Numba


def _encode_kernel(codec, x, payload, scales, round_x):
    n = x.size
    for blk in range(cuda.grid(1), _nblocks(n), cuda.gridsize(1)):
        _encode_block(codec, x, payload, scales, blk, n, round_x)


def _decode_kernel(codec, payload, scales, out):
    n = out.size
    for blk in range(cuda.grid(1), _nblocks(n), cuda.gridsize(1)):
        _decode_block(codec, payload, scales, out, blk, n)


def _decode_add_kernel(codec, acc, payload, scales, out, divisor, out_payload, out_scales, encode_out):
    n = out.size
    for blk in range(cuda.grid(1), _nblocks(n), cuda.gridsize(1)):
        _decode_add_block(codec, acc, payload, scales, out, divisor, out_payload, out_scales, encode_out, blk, n)


def _add_kernel(acc, b, out, divisor, codec, out_payload, out_scales, encode_out):
    n = out.size
    for blk in range(cuda.grid(1), _nblocks(n), cuda.gridsize(1)):
        _add_block(acc, b, out, divisor, codec, out_payload, out_scales, encode_out, blk, n)


KERNELS = ("encode", "decode", "decode_add", "add")
_LOOPS = {"encode": _encode_loop, "decode": _decode_loop, "decode_add": _decode_add_loop, "add": _add_loop}
_CUDA = {"encode": _encode_kernel, "decode": _decode_kernel, "decode_add": _decode_add_kernel, "add": _add_kernel}


def _bind(functions, jit, **names):
    """Compile `functions` with `jit` into a private namespace: copies of the
    functions whose globals are this module's, except that each function's
    name means its compiled copy and `names` override the rest (the GPU's
    `_mul_rn`, `cuda`). Numba resolves a callee by name when it compiles the
    caller, so every body sees the compiled bodies of the same target.
    Returns {name: compiled}."""
    namespace = dict(globals())
    namespace.update(names)
    compiled = {}
    for f in functions:
        copy = types.FunctionType(f.__code__, namespace, f.__name__, f.__defaults__, f.__closure__)
        copy.__qualname__ = f.__qualname__
        if f.__name__ not in names:
            namespace[f.__name__] = compiled[f.__name__] = jit(copy)
    return compiled


# -- CPU: numba.njit loops -------------------------------------------------------


@functools.cache
def _cpu_loops():
    try:
        import numba
    except ImportError:
        raise CollectiveError("the compression codecs need Numba on the host: pip install 'numba>=0.60'") from None
    # cache=True: the compiled loops land next to this file (or in Numba's
    # user cache), so a new rank process loads them instead of compiling
    # for seconds. Numba's cache key is this file's stamp, which covers
    # every body. No parallel=: the host ranks are the parallelism.
    compiled = _bind(_BODIES + tuple(_LOOPS.values()), numba.njit(cache=True))
    return {name: compiled[loop.__name__] for name, loop in _LOOPS.items()}


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


def _divisor(divisor):
    divisor = np.float32(divisor)
    if not divisor >= 0:
        raise InvalidUsageError(f"divisor must be >= 0 (0: none), got {divisor}")
    return divisor


def cpu_encode(name, x, payload, scales, round_x=False):
    """Encode float32 x into payload (and scales); with round_x, also replace
    x by decode(encode(x)). x starts on a block boundary; payload and scales
    are views at the same element (and element // BLOCK)."""
    _check(name, "x", x, np.float32)
    codec, payload, scales = _check_wire(name, x.size, payload, scales)
    _cpu_loops()["encode"](codec, x, payload, scales, bool(round_x))


def cpu_decode(name, payload, scales, out):
    """out = decode(payload, scales) for out.size elements."""
    _check(name, "out", out, np.float32)
    codec, payload, scales = _check_wire(name, out.size, payload, scales)
    _cpu_loops()["decode"](codec, payload, scales, out)


def cpu_decode_add(name, acc, payload, scales, out, divisor=0, out_payload=None, out_scales=None):
    """out = acc + decode(payload, scales), then out /= divisor if divisor > 0,
    then, if out_payload is given, encode out into out_payload/out_scales and
    set out to its decoding. out may be acc."""
    _check(name, "out", out, np.float32)
    _check(name, "acc", acc, np.float32, out.size)
    codec, payload, scales = _check_wire(name, out.size, payload, scales)
    _, out_payload, out_scales, encode_out = _out_wire(name, out.size, out_payload, out_scales)
    _cpu_loops()["decode_add"](codec, acc, payload, scales, out, _divisor(divisor), out_payload, out_scales,
                               encode_out)


def cpu_add(name, acc, b, out, divisor=0, out_payload=None, out_scales=None):
    """cpu_decode_add with a float32 b in place of a decoded payload."""
    _check(name, "out", out, np.float32)
    _check(name, "acc", acc, np.float32, out.size)
    _check(name, "b", b, np.float32, out.size)
    codec, out_payload, out_scales, encode_out = _out_wire(name, out.size, out_payload, out_scales)
    _cpu_loops()["add"](acc, b, out, _divisor(divisor), codec, out_payload, out_scales, encode_out)


# -- CUDA: numba.cuda kernels ------------------------------------------------------


def _cuda_compiled(jit_kernel, jit_device):
    """{kernel name: kernel} compiled with the given numba.cuda decorators."""
    from numba import config, cuda
    # Under the simulator there is no libdevice; its float32 product is the
    # same correctly rounded a * b.
    mul_rn = {} if config.ENABLE_CUDASIM else {"_mul_rn": cuda.libdevice.fmul_rn}
    compiled = _bind(_BODIES, jit_device, cuda=cuda, **mul_rn)
    namespace_kernels = _bind(tuple(_CUDA.values()), jit_kernel, cuda=cuda, **compiled)
    return {name: namespace_kernels[f.__name__] for name, f in _CUDA.items()}


@functools.cache
def cuda_kernels():
    """The four CUDA kernels (namespace: encode, decode, decode_add, add),
    built on first use; each compiles for the current device on its first
    launch. Arguments (arrays 1-D, contiguous, on the device):

        encode(codec, x, payload, scales, round_x)
        decode(codec, payload, scales, out)
        decode_add(codec, acc, payload, scales, out, divisor, out_payload, out_scales, encode_out)
        add(acc, b, out, divisor, codec, out_payload, out_scales, encode_out)

    codec is codec_id(name), divisor a np.float32 (0: none); out_payload and
    out_scales may be empty arrays when encode_out is False, scales empty
    for bf16."""
    from numba import cuda
    return types.SimpleNamespace(**_cuda_compiled(cuda.jit, cuda.jit(device=True)))


def grid(n):
    """(CUDA blocks, threads per CUDA block) for n elements: one thread per
    block of BLOCK elements, whole warps, at most THREADS_PER_CUDA_BLOCK per
    CUDA block and MAX_GRID CUDA blocks (the kernels' grid-stride loop does
    the rest). Small n get a small CUDA block: the simulator runs every
    thread, busy or not."""
    threads = max(_nblocks(int(n)), 1)
    per_block = min(-(-threads // 32) * 32, THREADS_PER_CUDA_BLOCK)
    return min(-(-threads // per_block), MAX_GRID), per_block


def launch(kernel_name, stream, n, *args):
    """Launch kernel `kernel_name` for n elements on numba stream `stream`
    (0 or None: the default stream), with the kernel's arguments."""
    if kernel_name not in KERNELS:
        raise InvalidUsageError(f"unknown codec kernel {kernel_name!r}; expected one of {KERNELS}")
    if n == 0:
        return
    blocks, threads = grid(n)
    kernel = getattr(cuda_kernels(), kernel_name)
    kernel[blocks, threads, stream or 0](*args)


def cuda_encode(name, x, payload, scales, round_x=False, stream=None):
    """Encode a device float32 array x (CuPy, Numba, anything with
    __cuda_array_interface__) into payload/scales on `stream`."""
    codec = codec_id(name)
    if scales is None:
        from numba import cuda
        scales = cuda.device_array(0, np.uint8)
    launch("encode", stream, x.size, codec, x, payload, scales, bool(round_x))


def launch_on_stream(kernel_name, name, arrays, divisor, stream_pointer):
    """One codec kernel on the CUDA stream at `stream_pointer` (CuPy's), with
    `arrays` (device arrays, None for an absent encoded output) in the order
    of the CPU loop of the same name, as compression/wire.py's
    codec_launches lists them: the device twin of the cpu_* functions."""
    from numba import cuda
    codec = codec_id(name)
    stream = cuda.external_stream(stream_pointer)
    empty_payload = cuda.device_array(0, _PAYLOAD_DTYPES[codec])
    empty_scales = cuda.device_array(0, np.uint8)

    def wire(payload, scales):
        return (payload if payload is not None else empty_payload,
                scales if scales is not None and scales.size else empty_scales)

    divisor = np.float32(divisor)
    if kernel_name == "encode":
        x, payload, scales = arrays
        launch("encode", stream, x.size, codec, x, *wire(payload, scales), True)
    elif kernel_name == "decode":
        payload, scales, out = arrays
        launch("decode", stream, out.size, codec, *wire(payload, scales), out)
    elif kernel_name == "decode_add":
        acc, payload, scales, out, out_payload, out_scales = arrays
        launch("decode_add", stream, out.size, codec, acc, *wire(payload, scales), out, divisor,
               *wire(out_payload, out_scales), out_payload is not None)
    elif kernel_name == "add":
        acc, b, out, out_payload, out_scales = arrays
        launch("add", stream, out.size, acc, b, out, divisor, codec, *wire(out_payload, out_scales),
               out_payload is not None)
    else:
        raise InvalidUsageError(f"unknown codec kernel {kernel_name!r}; expected one of {KERNELS}")


# -- static check: compile for an architecture, ask ptxas ---------------------


def _signatures(kernel_name, payload):
    """The Numba signature of a kernel for payload type `payload` (uint16 or int8)."""
    from numba import types as nt
    f32, u8, p = nt.float32[::1], nt.uint8[::1], payload[::1]
    return {
        "encode": (nt.int64, f32, p, u8, nt.boolean),
        "decode": (nt.int64, p, u8, f32),
        "decode_add": (nt.int64, f32, p, u8, f32, nt.float32, p, u8, nt.boolean),
        "add": (f32, f32, f32, nt.float32, nt.int64, p, u8, nt.boolean),
    }[kernel_name]


@contextlib.contextmanager
def _target_device(arch):
    """Let numba-cuda compile device functions with no GPU. compile_ptx takes
    cc= and needs no driver, but the device functions a kernel calls (ours,
    and the overloads behind np.float32(x).view) compile for
    numba.cuda.dispatcher.get_current_device().compute_capability, which
    asks the driver. For the duration, that answers `arch`. numba-cuda is
    pinned in the test extra; this touches nothing else."""
    import numba.cuda.dispatcher as dispatcher
    from numba.cuda.core.compiler_lock import global_compiler_lock   # numba-cuda's and numba's

    class Device:
        compute_capability = tuple(arch)

    with global_compiler_lock:
        real = dispatcher.get_current_device
        dispatcher.get_current_device = lambda: Device
        try:
            yield
        finally:
            dispatcher.get_current_device = real


def find_ptxas():
    """ptxas from NVIDIA's wheels (site-packages/nvidia/cu*/bin), else the PATH; None if absent."""
    try:
        import nvidia
        for root in map(Path, nvidia.__path__):
            for candidate in sorted(root.glob("cu*/bin/ptxas")):
                if os.access(candidate, os.X_OK):
                    return str(candidate)
    except ImportError:
        pass
    return shutil.which("ptxas")


_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")


def compile_for(arch=(9, 0)):
    """Compile every kernel (for both payload types) to PTX for `arch` with
    no GPU, and assemble it with ptxas -v. Returns {"encode[uint16]": {ptx,
    registers, stack (local memory bytes), spill_stores, spill_loads,
    fma (fused float32 multiply-adds in the PTX), ftz (flushing float ops),
    ptxas (its report)}, ...}. Needs numba-cuda with its CUDA 13 wheels and
    ptxas (the test extra)."""
    from numba import config, cuda
    if config.ENABLE_CUDASIM:
        raise CollectiveError("compile_for needs the real numba.cuda, not the simulator (NUMBA_ENABLE_CUDASIM)")
    ptxas = find_ptxas()
    if ptxas is None:
        raise CollectiveError("ptxas not found: pip install 'collectives[test]' brings NVIDIA's wheel of it")
    arch = tuple(arch)
    sm = f"sm_{arch[0]}{arch[1]}"
    from numba import types as nt
    report = {}
    with _target_device(arch):
        # Fresh device functions: numba-cuda caches them per argument types, not per architecture.
        kernels = _cuda_compiled(lambda f: f, cuda.jit(device=True))
        for name in KERNELS:
            for payload in (nt.uint16, nt.int8):
                ptx, _ = cuda.compile_ptx(kernels[name], _signatures(name, payload), cc=arch)
                report[f"{name}[{payload}]"] = _assemble(ptxas, sm, ptx)
    return report


def _assemble(ptxas, sm, ptx):
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        done = subprocess.run([ptxas, f"-arch={sm}", "-v", str(source), "-o", str(Path(tmp) / "kernel.cubin")],
                              capture_output=True, text=True)
    text = done.stdout + done.stderr
    if done.returncode != 0:
        raise CollectiveError(f"ptxas -arch={sm} failed:\n{text}")
    frames = [tuple(map(int, m.groups())) for m in _FRAME.finditer(text)]
    registers = [int(m[1]) for m in _REGISTERS.finditer(text)]
    code = [line.strip() for line in ptx.splitlines()]
    return {
        "ptx": ptx,
        "registers": max(registers, default=0),
        "stack": sum(f[0] for f in frames),
        "spill_stores": sum(f[1] for f in frames),
        "spill_loads": sum(f[2] for f in frames),
        "fma": sum(line.startswith("fma.") and ".f32" in line for line in code),
        "ftz": sum(".ftz" in line for line in code),
        "ptxas": text,
    }
