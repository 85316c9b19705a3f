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
        int8         e = max(k - 6, -127): the maximum M scales into [64, 128);
                     but where rint(M * 2^-e) would be 128, e + 1 (unless
                     e = 121: 64 * 2^122 is inf in float32), and it scales
                     into [63.75, 64). So no |q| ever needs the clamp to 127.
        byte 255     the block holds an inf or NaN: every element decodes to
                     NaN (payload written as zeros)

    encode  bf16     b = bfloat16_rne(x)              (NaN stays NaN, inf inf)
            fp16     h = float16_rne(x * 2^-e)
            int8     q = clamp(rint_half_even(x * 2^-e), -127, 127)

    int8's error, one encode and decode: x * 2^-e is exact, rint is off by at
    most half a step, q * 2^e is exact, so |x - q 2^e| <= min(|x|, 2^(e-1)),
    and, M being the block's largest |x|,
        2^(e-1) <= M / 128     where M * 2^-e is in [64, 127.5)
        2^(e-1) <= M / 127.5   where it is in [63.75, 64) (e went up by one)
        2^(e-1) =  2^-128      where e = -127 (M < 2^-121)
    that is |err| <= max(M / 127.5, 2^-128), M / 127.5 = 2^-6.994 M: half a
    step, unbiased (before, the maximum clamped from 128 to 127 was off by up
    to a whole step, always toward zero). The exception is float32's top
    sliver, M >= (2 - 2^-7) 2^127 (3.39e38), clamped as before.

Every step is float32 with IEEE round-to-nearest-even, no FMA contraction,
no flush of subnormals (2^-127 is the subnormal float32 0x00400000), so the
GPU kernel, Numba's CUDA simulator, the CPU loop and the NumPy reference
(tests/codec_reference.py) agree bit for bit, and the same bytes decode to
the same floats everywhere.

One source, three compilations
==============================

The per-block bodies below (`_encode_block`, `_decode_block`,
`_decode_add_block`, `_add_block`, the passes over a block's elements they
call and the per-element helpers) are plain Python on scalars and 1-D
arrays. `_bind` compiles each of them with a given decorator into a private
namespace in which every helper name refers to its compiled twin:

    numba.njit                      the CPU loops over blocks (host ranks and
                                    the emulated device run these), one set
                                    per codec, cached on disk
    numba.cuda.jit(device=True)     CUDA kernels, one thread per block of 32,
                                    grid-stride loop, no shared memory, no
                                    atomics: threads are independent
    the same under NUMBA_ENABLE_CUDASIM=1   the CUDA simulator (tests)

float16 and bfloat16 are converted with integer and float32 arithmetic, not
Numba's float16 type: it is not available alike in njit, CUDA and the
simulator, and on the GPU it compiles to calls that need LTO linking. The
only difference between the targets is `_mul_rn`: on the GPU it is
`__fmul_rn`, because NVVM fuses `a * b + c` into one FMA (one rounding
instead of two) whenever it may, and it may by default.

Written for speed on both targets
=================================

The CPU loops run near memory speed (bench/codec_speed.py), which is what
lets a compressed allreduce on host ranks beat a float32 one; the bodies are
shaped for that, and the GPU gets the same code:

* A block is straight-line passes over its (at most) 32 elements: the
  largest |x|, then the scale, then the conversion. Each pass is a function
  of its own, which Numba compiles apart (LLVM vectorizes its loop) and
  LLVM then inlines; see "Each pass over a block's elements" below.
* No branches per element, only selects (`a if c else b` on values both
  computed): vector lanes on the CPU, and no divergence in a warp. What is
  rare is decided per block: a block with inf or NaN takes a slow path;
  float16 payloads decode in fewer steps unless the block holds a float16
  subnormal, inf or NaN (`_plain`).
* Comparisons are between float32 values and integer steps stay in
  [0, 2^32), so that LLVM computes in 32-bit lanes (Numba types every
  integer as 64-bit); no float32 subnormal is ever an operand on the common
  paths (a CPU takes a microcode assist, 100+ cycles, for each).
* Encoding returns the value its payload decodes to, so that round_x and the
  encoded outputs of decode_add and add do not decode again.
* The CPU loops are compiled per codec, and pass constants where it pays (a
  division by nothing, in place, whole blocks of 32).

tests/test_codecs.py compares every target with tests/codec_reference.py bit
for bit, and the conversions with NumPy's on every float16 and on a sweep of
float32 values (a run over all 2^32 float32 values found no difference).

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
_SCALE_ROUNDING = (0, 0, 1 << 16)      # int8: k of the block maximum rounded to 8 bits (_scale_byte)
SPECIAL_SCALE = 255                    # the block holds inf or NaN: decodes to NaN

THREADS_PER_CUDA_BLOCK = 256           # 256 threads x 32 elements = 8192 elements per CUDA block
MAX_GRID = 4096                        # the grid-stride loop covers the rest

_NAN32 = np.float32("nan")
_RNE_MAGIC = np.float32(1.5 * 2 ** 23)  # (y + M) - M rounds y to an integer, half to even, for |y| < 2^22
_TWO_112 = np.float32(2.0 ** 112)
_TWO = np.float32(2)
_TWO_M15 = np.float32(2.0 ** -15)
_TWO_16 = np.float32(2.0 ** 16)
_F16_MIN_NORMAL = np.float32(2.0 ** -14)
_NO_DIVISOR = np.float32(0)
_INT8_MIN, _INT8_MAX = np.float32(-127), np.float32(127)


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
# into float64, NumPy scalars would wrap). Where speed matters, the steps
# that need the high bits (shifts right, comparisons) see only values in
# [0, 2^32), so that LLVM can use 32-bit lanes (see "Written for speed").


def _mul_rn(a, b):
    """a * b in float32, rounded once. Replaced by __fmul_rn on the GPU."""
    return a * b


def _bits(x):
    """The bits of float32 x, as a non-negative int."""
    return np.int64(np.float32(x).view(np.uint32))


def _from_bits(b):
    """The float32 whose bits are b (0 <= b < 2^32)."""
    return np.uint32(b).view(np.float32)


def _magnitude_bits(x):
    """The bits of |x|: for finite x they order like |x|; inf and NaN sort
    above them all. A uint32, so that a running maximum of them is one too
    (32-bit lanes on the CPU; Numba would widen the sum of ops to 64)."""
    return np.uint32(np.float32(x).view(np.uint32) & np.uint32(0x7FFFFFFF))


def _pow2(e):
    """2^e as float32 for -127 <= e <= 127 (2^-127 is subnormal)."""
    return _from_bits(0x00400000) if e == -127 else _from_bits((e + 127) << 23)


def _block_range(blk, n):
    """The elements [lo, hi) of block `blk`, as unsigned integers: Numba then
    indexes arrays with them directly (no wrap-around of negative indices,
    which would turn the CPU's vector loads into gathers)."""
    lo = blk * BLOCK
    return np.uint64(lo), np.uint64(min(lo + BLOCK, n))


def _to_bf16(x):
    """bfloat16 bits of float32 x, round to nearest even."""
    b = _bits(x)
    # Adding 0x7FFF plus the lowest kept bit carries into the kept bits exactly
    # when the dropped half is above one half, or is one half and the kept part
    # odd. A carry out of the mantissa raises the exponent, up to inf.
    rounded = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    quiet_nan = (b >> 16) | 0x0040                     # NaN: keep it a (quiet) NaN
    return quiet_nan if x != x else rounded


def _from_bf16(h):
    return _from_bits((np.int64(h) & 0xFFFF) << 16)


def _to_f16(x):
    """(IEEE float16 bits of float32 x, round to nearest even, subnormals
    included; the float32 value of those bits, exact), for finite x below
    65520 in magnitude, where float16 does not overflow: every x a block's
    scale 2^-e has brought below 2^15."""
    magnitude = abs(x)
    # e: the exponent field of |x|, 2^-14 if below (float16's subnormals).
    e = _bits(max(magnitude, _F16_MIN_NORMAL)) & 0x7F800000
    # c = 1.5 2^(E + 13) is a float32 whose spacing, 2^(E - 10), is float16's
    # at exponent E (below 2^-14: 2^-24, its subnormals' spacing). So the
    # IEEE sum |x| + c rounds |x| to float16, half to even, and stays below
    # 2c: the sum's bits minus c's count float16 steps from 0 at exponent
    # E, a carry into the next exponent included, and the sum minus c,
    # exact, is the rounded |x|.
    c = e + 0x06C00000
    rounded = magnitude + _from_bits(c)
    h = ((e >> 13) - (113 << 10)) + (_bits(rounded) - c)     # (E + 14) << 10: float16's exponent field, minus one
    sign = _bits(x) & 0x80000000
    return (sign >> 16) | h, _from_bits(_bits(rounded - _from_bits(c)) | sign)


def _from_f16(h):
    """The float32 value of float16 bits h (exact)."""
    h = np.int64(h) & 0xFFFF
    # Rebiased (15 -> 127), the bits are a normal float16's value; with the
    # smallest exponent, 0, they read 2^-15 (1 + m/1024) instead of the
    # subnormal's m 2^-24, which two exact steps recover (no float32
    # subnormal on the way: they are slow on CPUs); with the largest, 31,
    # 2^16 (1 + m/1024) instead of inf or NaN, whose bits 112 more exponent
    # gives.
    v = _from_bits((((h & 0x7FFF) << 13) + 0x38000000) | ((h & 0x8000) << 16))
    magnitude = abs(v)
    subnormal = _mul_rn(magnitude - _TWO_M15, _TWO)
    subnormal = subnormal if v > 0 else -subnormal     # -(+0) is -0: the sign of -0 kept
    v = subnormal if magnitude < _F16_MIN_NORMAL else v
    return _from_bits(_bits(v) + 0x38000000) if magnitude >= _TWO_16 else v


def _from_plain_f16(h):
    """_from_f16 for zero and normal float16s only (no subnormal, inf, NaN),
    in fewer steps: moved into float32's place, such bits read as the value
    times 2^-112 (a normal float32, or zero), and one exact product puts the
    exponent back. (For a subnormal float16 this product would take a
    float32 subnormal, which CPUs handle slowly.)"""
    s = ((np.int64(h) & 0xFFFF) ^ 0x8000) - 0x8000    # sign-extended: shifted by 13, its sign lands on bit 31
    return _mul_rn(_from_bits((s << 13) & 0x8FFFE000), _TWO_112)


def _plain(codec, payload, lo, hi):
    """Whether the payloads [lo, hi) decode with the plain steps: always,
    except for fp16 payloads that hold a subnormal, inf or NaN float16 (the
    encoder writes a subnormal only for an element about 2^-28 of its block's
    largest or less; inf and NaN only come from elsewhere)."""
    if codec != FP16:
        return True
    unusual = False
    for i in range(lo, hi):
        u = np.int64(payload[i]) & 0x7FFF
        unusual |= (u >= 0x7C00) | ((u != 0) & (u < 0x400))
    return not unusual


def _scale_byte(codec, largest):
    """E8M0 byte (fp16, int8) of a block whose largest |x| has the bits
    `largest`: e + 127, or 255 if the block holds inf or NaN."""
    largest = np.int64(largest)
    if largest >= 0x7F800000:
        return SPECIAL_SCALE
    # k, the exponent of the largest |x| (zero and subnormal maxima count as
    # 2^-126); for int8, of it rounded to 8 significant bits: adding 2^16 to
    # the bits carries into the exponent exactly when the mantissa is at
    # least 1 + 127/128, when the maximum scaled into [64, 128) would be >= 127.5
    # and round to 128. Then e is one larger and it scales to [63.75, 64).
    # Not past k = 127, though: 64 2^122 = 2^128 would decode to inf, so in
    # float32's top sliver, |x| >= (2 - 2^-7) 2^127, the maximum is clamped
    # to 127 2^121 instead.
    k = min(max((largest + _SCALE_ROUNDING[codec]) >> 23, 1), 254) - 127
    return max(k - _HEADROOM[codec], -127) + 127


def _scale(codec, scales, blk):
    """2^e of block `blk` of a wire (NaN for byte 255: every element decodes to NaN)."""
    if codec == BF16:
        return _NAN32                                  # unused
    s = np.int64(scales[blk])
    return _NAN32 if s == SPECIAL_SCALE else _pow2(s - 127)


def _encode_value(codec, v, inverse):
    """(payload of float32 v; its decoding times 2^-e, exact) (inverse = 2^-e;
    unused for bf16, whose decoding is returned)."""
    if codec == BF16:
        p = _to_bf16(v)
        return p, _from_bf16(p)
    y = _mul_rn(v, inverse)                            # exact unless it lands below 2^-126
    if codec == FP16:
        return _to_f16(y)
    q = (y + _RNE_MAGIC) - _RNE_MAGIC                  # |y| < 127.5: round half to even
    q = min(max(q, _INT8_MIN), _INT8_MAX)              # a guard: the scale keeps |q| <= 127
    return np.int64(q), q


def _rescale(codec, value, scale):
    """The decoding of a payload, from the value _encode_value gave with it:
    _decode_value(codec, payload, scale) without going through the payload."""
    return value if codec == BF16 else _mul_rn(value, scale)


def _decode_value(codec, p, scale, plain):
    """The float32 of payload p in a block of scale 2^e (NaN: special; unused
    for bf16); `plain`: the block's _plain (the same result, in fewer steps)."""
    if codec == BF16:
        return _from_bf16(p)
    if codec == FP16:
        return _mul_rn(_from_plain_f16(p) if plain else _from_f16(p), scale)
    return _mul_rn(np.float32(np.int64(p)), scale)


def _finish(v, divisor):
    """v, divided by divisor if divisor > 0 (IEEE float32 division)."""
    return v / divisor if divisor > 0 else v


# A block's operation reads its float32 values v (x; acc + decode(b);
# acc + b) in up to two passes: the largest |v|, for the scale, then each
# value's encoding. The second pass computes v again, in the same float32
# steps, so it has the same bits: nothing is stored in between (no local
# arrays: on the GPU they would live in local memory), out may be acc, and
# with write_out False out is never written.
#
# Each pass over a block's elements is a function of its own (_largest,
# _encode_values, ...), for the CPU's sake: Numba compiles it apart, where
# LLVM vectorizes its loop (the bounds unknown), and LLVM then inlines it
# (forceinline). Inlined first, where its loop runs a known 32 steps, LLVM
# would unroll a small loop into scalar code before trying to vectorize it
# (Numba runs no SLP vectorizer). acc None means acc is out (in place): the
# CPU loops say so, so that the compiled pass reads and writes through one
# pointer; two would need an overlap check, which fails when they are equal
# and falls back to scalar code.


def _acc(acc, out, i):
    """acc[i], where acc None stands for out."""
    if acc is None:
        return out[i]
    return acc[i]


def _sum(codec, acc, out, payload, i, scale, plain, divisor):
    """(acc + decode(payload)) [/ divisor] at element i."""
    return _finish(_acc(acc, out, i) + _decode_value(codec, payload[i], scale, plain), divisor)


def _largest(x, lo, hi):
    """The largest _magnitude_bits of x[lo:hi]."""
    largest = np.uint32(0)
    for i in range(lo, hi):
        largest = max(largest, _magnitude_bits(x[i]))
    return largest


def _largest_sum(codec, acc, out, payload, scale, plain, divisor, lo, hi):
    """The largest _magnitude_bits of _sum over [lo, hi)."""
    largest = np.uint32(0)
    for i in range(lo, hi):
        largest = max(largest, _magnitude_bits(_sum(codec, acc, out, payload, i, scale, plain, divisor)))
    return largest


def _largest_add(acc, b, out, divisor, lo, hi):
    """The largest _magnitude_bits of (acc + b) [/ divisor] over [lo, hi)."""
    largest = np.uint32(0)
    for i in range(lo, hi):
        largest = max(largest, _magnitude_bits(_finish(_acc(acc, out, i) + b[i], divisor)))
    return largest


def _encode_values(codec, x, payload, inverse, scale, round_x, lo, hi):
    for i in range(lo, hi):
        p, value = _encode_value(codec, x[i], inverse)
        payload[i] = p
        if round_x:
            x[i] = _rescale(codec, value, scale)


def _decode_values(codec, payload, out, scale, plain, lo, hi):
    for i in range(lo, hi):
        out[i] = _decode_value(codec, payload[i], scale, plain)


def _sum_values(codec, acc, payload, out, scale, plain, divisor, lo, hi):
    for i in range(lo, hi):                            # acc[i] is read before out[i] is written: out may be acc
        out[i] = _sum(codec, acc, out, payload, i, scale, plain, divisor)


def _sum_encode_values(codec, acc, payload, out, scale, plain, divisor, out_payload, inverse, out_scale, write_out,
                       lo, hi):
    for i in range(lo, hi):
        p, value = _encode_value(codec, _sum(codec, acc, out, payload, i, scale, plain, divisor), inverse)
        out_payload[i] = p
        if write_out:
            out[i] = _rescale(codec, value, out_scale)


def _add_values(acc, b, out, divisor, lo, hi):
    for i in range(lo, hi):
        out[i] = _finish(_acc(acc, out, i) + b[i], divisor)


def _add_encode_values(codec, acc, b, out, divisor, out_payload, inverse, out_scale, write_out, lo, hi):
    for i in range(lo, hi):
        p, value = _encode_value(codec, _finish(_acc(acc, out, i) + b[i], divisor), inverse)
        out_payload[i] = p
        if write_out:
            out[i] = _rescale(codec, value, out_scale)


def _special_block(x, payload, lo, hi, write_x):
    """A block holding inf or NaN: payload zeros; x, if written, NaN."""
    for i in range(lo, hi):
        payload[i] = 0
        if write_x:
            x[i] = _NAN32


def _encode_block(codec, x, payload, scales, blk, n, round_x):
    """Encode block `blk` of x[:n]; if round_x, x = decode(encode(x)) there."""
    lo, hi = _block_range(blk, n)
    s = 0
    if codec != BF16:
        s = _scale_byte(codec, _largest(x, lo, hi))
        scales[blk] = s
        if s == SPECIAL_SCALE:
            _special_block(x, payload, lo, hi, round_x)
            return
    # 2^-e and 2^e, normal float32 (unused for bf16)
    _encode_values(codec, x, payload, _pow2(127 - s), _pow2(s - 127), round_x, lo, hi)


def _decode_block(codec, payload, scales, out, blk, n):
    lo, hi = _block_range(blk, n)
    _decode_values(codec, payload, out, _scale(codec, scales, blk), _plain(codec, payload, lo, hi), lo, hi)


def _decode_add_block(codec, acc, payload, scales, out, divisor, out_payload, out_scales, encode_out, write_out,
                      blk, n):
    """out = (acc + decode(payload)) [/ divisor], then [encoded into out_payload
    and out = its decoding]; with write_out False, out is not written."""
    lo, hi = _block_range(blk, n)
    scale, plain = _scale(codec, scales, blk), _plain(codec, payload, lo, hi)
    if not encode_out:
        _sum_values(codec, acc, payload, out, scale, plain, divisor, lo, hi)
        return
    s = 0
    if codec != BF16:
        s = _scale_byte(codec, _largest_sum(codec, acc, out, payload, scale, plain, divisor, lo, hi))
        out_scales[blk] = s
        if s == SPECIAL_SCALE:
            _special_block(out, out_payload, lo, hi, write_out)
            return
    _sum_encode_values(codec, acc, payload, out, scale, plain, divisor, out_payload, _pow2(127 - s), _pow2(s - 127),
                       write_out, lo, hi)


def _add_block(acc, b, out, divisor, codec, out_payload, out_scales, encode_out, write_out, blk, n):
    """out = (acc + b) [/ divisor], then [encoded into out_payload and out =
    its decoding]; with write_out False, out is not written."""
    lo, hi = _block_range(blk, n)
    if not encode_out:
        _add_values(acc, b, out, divisor, lo, hi)
        return
    s = 0
    if codec != BF16:
        s = _scale_byte(codec, _largest_add(acc, b, out, divisor, lo, hi))
        out_scales[blk] = s
        if s == SPECIAL_SCALE:
            _special_block(out, out_payload, lo, hi, write_out)
            return
    _add_encode_values(codec, acc, b, out, divisor, out_payload, _pow2(127 - s), _pow2(s - 127), write_out, lo, hi)


def _nblocks(n):
    return (n + BLOCK - 1) // BLOCK


_BODIES = (_nblocks, _mul_rn, _bits, _from_bits, _magnitude_bits, _pow2, _block_range, _to_bf16, _from_bf16,
           _to_f16, _from_f16, _from_plain_f16, _plain, _scale_byte, _scale, _encode_value, _rescale, _decode_value,
           _finish, _acc, _sum, _largest, _largest_sum, _largest_add, _encode_values, _decode_values, _sum_values,
           _sum_encode_values, _add_values, _add_encode_values, _special_block,
           _encode_block, _decode_block, _decode_add_block, _add_block)


# -- the CPU loops and the CUDA kernels: the same bodies, two drivers ----------


# The CPU loops are compiled once per codec: CODEC is a constant in each
# compilation (_cpu_loops binds it), so LLVM keeps only that codec's code.
# They pass constants where it pays: acc None where out is acc (see above),
# divisor 0 where there is none (LLVM then drops the division), and
# n = (blk + 1) * BLOCK for every whole block, so that the block's bound
# min(blk * BLOCK + BLOCK, n) folds to a constant 32 steps; the partial last
# block, if any, gets the real n.
CODEC = None


def _encode_loop(x, payload, scales, round_x):
    n = x.size
    for blk in range(n // BLOCK):
        _encode_block(CODEC, x, payload, scales, blk, (blk + 1) * BLOCK, round_x)
    if n % BLOCK:
        _encode_block(CODEC, x, payload, scales, n // BLOCK, n, round_x)


def _decode_loop(payload, scales, out):
    n = out.size
    for blk in range(n // BLOCK):
        _decode_block(CODEC, payload, scales, out, blk, (blk + 1) * BLOCK)
    if n % BLOCK:
        _decode_block(CODEC, payload, scales, out, n // BLOCK, n)


def _decode_add_blocks(acc, payload, scales, out, divisor, out_payload, out_scales, encode_out, write_out):
    n = out.size
    for blk in range(n // BLOCK):
        _decode_add_block(CODEC, acc, payload, scales, out, divisor, out_payload, out_scales, encode_out, write_out,
                          blk, (blk + 1) * BLOCK)
    if n % BLOCK:
        _decode_add_block(CODEC, acc, payload, scales, out, divisor, out_payload, out_scales, encode_out, write_out,
                          n // BLOCK, n)


def _decode_add_loop(acc, payload, scales, out, divisor, out_payload, out_scales, encode_out, write_out):
    if divisor > 0:
        _decode_add_blocks(acc, payload, scales, out, divisor, out_payload, out_scales, encode_out, write_out)
    elif acc.ctypes.data == out.ctypes.data:
        _decode_add_blocks(None, payload, scales, out, _NO_DIVISOR, out_payload, out_scales, encode_out, write_out)
    else:
        _decode_add_blocks(acc, payload, scales, out, _NO_DIVISOR, out_payload, out_scales, encode_out, write_out)


def _add_blocks(acc, b, out, divisor, out_payload, out_scales, encode_out, write_out):
    n = out.size
    for blk in range(n // BLOCK):
        _add_block(acc, b, out, divisor, CODEC, out_payload, out_scales, encode_out, write_out, blk, (blk + 1) * BLOCK)
    if n % BLOCK:
        _add_block(acc, b, out, divisor, CODEC, out_payload, out_scales, encode_out, write_out, n // BLOCK, n)


def _add_loop(acc, b, out, divisor, out_payload, out_scales, encode_out, write_out):
    if b.ctypes.data == out.ctypes.data:
        acc, b = b, acc                                # acc + b == b + acc, bit for bit
    if divisor > 0:
        _add_blocks(acc, b, out, divisor, out_payload, out_scales, encode_out, write_out)
    elif acc.ctypes.data == out.ctypes.data:
        _add_blocks(None, b, out, _NO_DIVISOR, out_payload, out_scales, encode_out, write_out)
    else:
        _add_blocks(acc, b, out, _NO_DIVISOR, out_payload, out_scales, encode_out, write_out)


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


def _decode_add_kernel(codec, acc, payload, scales, out, divisor, out_payload, out_scales, encode_out, write_out):
    n = out.size
    for blk in range(cuda.grid(1), _nblocks(n), cuda.gridsize(1)):
        _decode_add_block(codec, acc, payload, scales, out, divisor, out_payload, out_scales, encode_out, write_out,
                          blk, n)


def _add_kernel(acc, b, out, divisor, codec, out_payload, out_scales, encode_out, write_out):
    n = out.size
    for blk in range(cuda.grid(1), _nblocks(n), cuda.gridsize(1)):
        _add_block(acc, b, out, divisor, codec, out_payload, out_scales, encode_out, write_out, blk, n)


_DRIVERS = (_decode_add_blocks, _add_blocks)
KERNELS = ("encode", "decode", "decode_add", "add")
_LOOPS = {"encode": _encode_loop, "decode": _decode_loop, "decode_add": _decode_add_loop, "add": _add_loop}
_CUDA = {"encode": _encode_kernel, "decode": _decode_kernel, "decode_add": _decode_add_kernel, "add": _add_kernel}


def _bind(functions, jit, tag="", **names):
    """Compile `functions` with `jit` into a private namespace: copies of the
    functions whose globals are this module's, except that each function's
    name means its compiled copy and `names` override the rest (the GPU's
    `_mul_rn`, `cuda`; the CPU's CODEC). Numba resolves a callee by name when
    it compiles the caller, so every body sees the compiled bodies of the
    same target. `tag` goes into the copies' qualified names, which key
    Numba's disk cache: copies compiled with different `names` must differ
    in it. Returns {name: compiled}."""
    namespace = dict(globals())
    namespace.update(names)
    compiled = {}
    for f in functions:
        copy = types.FunctionType(f.__code__, namespace, f.__name__, f.__defaults__, f.__closure__)
        copy.__qualname__ = f.__qualname__ + tag
        if f.__name__ not in names:
            namespace[f.__name__] = compiled[f.__name__] = jit(copy)
    return compiled


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
    _check(name, "x", x, np.float32)
    codec, payload, scales = _check_wire(name, x.size, payload, scales)
    _host_loops().encode(codec, _address(x), _address(payload), _address(scales), x.size, bool(round_x))


def cpu_decode(name, payload, scales, out):
    """out = decode(payload, scales) for out.size elements."""
    _check(name, "out", out, np.float32)
    codec, payload, scales = _check_wire(name, out.size, payload, scales)
    _host_loops().decode(codec, _address(payload), _address(scales), _address(out), out.size)


def cpu_decode_add(name, acc, payload, scales, out, divisor=0, out_payload=None, out_scales=None, write_out=True):
    """out = acc + decode(payload, scales), then out /= divisor if divisor > 0,
    then, if out_payload is given, encode out into out_payload/out_scales and
    set out to its decoding. out may be acc. With write_out False (only with
    out_payload), out is left alone: only the encoding is written (out
    still gives the element count)."""
    _check(name, "out", out, np.float32)
    _check(name, "acc", acc, np.float32, out.size)
    codec, payload, scales = _check_wire(name, out.size, payload, scales)
    _, out_payload, out_scales, encode_out = _out_wire(name, out.size, out_payload, out_scales)
    _host_loops().decode_add(codec, _address(acc), _address(payload), _address(scales), _address(out), out.size,
                             _divisor(divisor), _address(out_payload), _address(out_scales), encode_out,
                             _write_out(write_out, encode_out))


def cpu_add(name, acc, b, out, divisor=0, out_payload=None, out_scales=None, write_out=True):
    """cpu_decode_add with a float32 b in place of a decoded payload; out may
    be acc or b."""
    _check(name, "out", out, np.float32)
    _check(name, "acc", acc, np.float32, out.size)
    _check(name, "b", b, np.float32, out.size)
    codec, out_payload, out_scales, encode_out = _out_wire(name, out.size, out_payload, out_scales)
    _host_loops().add(codec, _address(acc), _address(b), _address(out), out.size, _divisor(divisor),
                      _address(out_payload), _address(out_scales), encode_out, _write_out(write_out, encode_out))


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
        decode_add(codec, acc, payload, scales, out, divisor, out_payload, out_scales, encode_out, write_out)
        add(acc, b, out, divisor, codec, out_payload, out_scales, encode_out, write_out)

    codec is codec_id(name), divisor a np.float32 (0: none); out_payload and
    out_scales may be empty arrays when encode_out is False, scales empty
    for bf16; write_out False leaves out unwritten (with encode_out)."""
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


def launch_on_stream(kernel_name, name, arrays, divisor, stream_pointer, write_out=True):
    """One codec kernel on the CUDA stream at `stream_pointer` (CuPy's), with
    `arrays` (device arrays, None for an absent encoded output) in the order
    of the CPU loop of the same name, as compression/wire.py's
    codec_launches lists them: the device twin of the cpu_* functions
    (write_out as theirs: decode_add and add only)."""
    from numba import cuda
    codec = codec_id(name)
    stream = cuda.external_stream(stream_pointer)
    empty_payload = cuda.device_array(0, _PAYLOAD_DTYPES[codec])
    empty_scales = cuda.device_array(0, np.uint8)
    # The arrays' work is ordered by `stream` itself: importing them without
    # the __cuda_array_interface__ sync keeps the host from waiting per launch.
    arrays = [None if a is None else cuda.as_cuda_array(a, sync=False) for a in arrays]

    def wire(payload, scales):
        return (payload if payload is not None else empty_payload,
                scales if scales is not None and scales.size else empty_scales)

    divisor = np.float32(divisor)
    if kernel_name in ("encode", "encode_round"):   # encode_round: x becomes decode(encode(x))
        x, payload, scales = arrays
        launch("encode", stream, x.size, codec, x, *wire(payload, scales), kernel_name == "encode_round")
    elif kernel_name == "decode":
        payload, scales, out = arrays
        launch("decode", stream, out.size, codec, *wire(payload, scales), out)
    elif kernel_name == "decode_add":
        acc, payload, scales, out, out_payload, out_scales = arrays
        if out is None:   # only the encoded result is wanted; acc stands in for the size
            out, write_out = acc, False
        launch("decode_add", stream, out.size, codec, acc, *wire(payload, scales), out, divisor,
               *wire(out_payload, out_scales), out_payload is not None,
               _write_out(write_out, out_payload is not None))
    elif kernel_name == "add":
        acc, b, out, out_payload, out_scales = arrays
        if out is None:
            out, write_out = acc, False
        launch("add", stream, out.size, acc, b, out, divisor, codec, *wire(out_payload, out_scales),
               out_payload is not None, _write_out(write_out, out_payload is not None))
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
        "decode_add": (nt.int64, f32, p, u8, f32, nt.float32, p, u8, nt.boolean, nt.boolean),
        "add": (f32, f32, f32, nt.float32, nt.int64, p, u8, nt.boolean, nt.boolean),
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
