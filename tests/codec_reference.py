"""The compression wire format in plain NumPy: the reference the codec
kernels (kernels/codec.cuh: the CPU loops and the GPU kernels) must equal bit for bit.

Written from the format's definition with NumPy's own conversions
(astype(float16), astype(bfloat16), rint, frexp, ldexp), not with the
kernels' bit tricks, so that a shared mistake is unlikely. Vectorized over
whole buffers: blocks are the rows of an (nblocks, 32) view.

    bf16   payload = bfloat16 bits (uint16); no scales
    fp16   payload = float16 bits of x * 2^-e; scale byte e + 127
    int8   payload = clamp(rint(x * 2^-e), -127, 127); scale byte e + 127
    with   k = exponent of the block's largest |x| = M (-126 if zero or subnormal),
           e = max(k - 14, -127) for fp16, max(k - 6, -127) for int8, plus
           one for int8 if rint(M * 2^-e) > 127 (so the clamp never acts),
           but not to 122 (64 * 2^122 overflows float32);
           a block with inf or NaN: scale byte 255, payload 0, decodes to NaN
"""

import functools

import ml_dtypes
import numpy as np

BLOCK = 32
HEADROOM = {"fp16": 14, "int8": 6}
PAYLOAD = {"bf16": np.uint16, "fp16": np.uint16, "int8": np.int8}
SPECIAL = 255


def _quiet(f):
    """inf and NaN are data here: NumPy's overflow and invalid warnings are noise."""
    @functools.wraps(f)
    def quiet(*args, **kwargs):
        with np.errstate(over="ignore", invalid="ignore"):
            return f(*args, **kwargs)
    return quiet


def _blocks(x):
    """x (float32) zero-padded to whole blocks, as (nblocks, BLOCK)."""
    nblocks = -(-x.size // BLOCK)
    padded = np.zeros(nblocks * BLOCK, np.float32)
    padded[:x.size] = x
    return padded.reshape(nblocks, BLOCK)


def block_exponents(codec, x):
    """(e per block as int64, special per block as bool)."""
    blocks = _blocks(np.asarray(x, np.float32))
    special = ~np.isfinite(blocks).all(axis=1)
    largest = np.abs(np.where(special[:, None], 0, blocks)).max(axis=1, initial=0).astype(np.float32)
    _, exponent = np.frexp(largest)          # largest = f * 2^exponent, 0.5 <= f < 1
    k = np.where(largest == 0, -126, np.maximum(exponent.astype(np.int64) - 1, -126))
    e = np.maximum(k - HEADROOM[codec], -127)
    if codec == "int8":
        # The largest would scale into [64, 128); where it rounds to 128, one
        # more power of two halves it into [63.75, 64), which rounds to 64 --
        # unless 64 2^(e+1) overflows float32 (e + 1 = 122): then it stays,
        # and is clamped to 127.
        e = e + ((np.rint(largest * power_of_two(-e)) > 127) & (e < 121))
    return e, special


def _per_element(values, n):
    return np.repeat(values, BLOCK)[:n]


def power_of_two(e):
    """2^e as float32, exactly (subnormal for e = -127)."""
    return np.ldexp(np.float32(1), np.asarray(e, np.int32)).astype(np.float32)


@_quiet
def encode(codec, x):
    """(payload, scales) of float32 x."""
    x = np.asarray(x, np.float32)
    if codec == "bf16":
        return x.astype(ml_dtypes.bfloat16).view(np.uint16), np.zeros(0, np.uint8)
    e, special = block_exponents(codec, x)
    scaled = x * _per_element(power_of_two(-e), x.size)          # float32 * float32
    special_elements = _per_element(special, x.size)
    scaled = np.where(special_elements, np.float32(0), scaled)
    if codec == "fp16":
        payload = scaled.astype(np.float16).view(np.uint16)
    elif codec == "int8":
        payload = np.clip(np.rint(scaled), -127, 127).astype(np.int8)
    else:
        raise ValueError(codec)
    scales = np.where(special, SPECIAL, e + 127).astype(np.uint8)
    return payload, scales


@_quiet
def decode(codec, payload, scales, n=None):
    """float32 values of n elements (default: all of payload)."""
    n = payload.size if n is None else n
    payload = np.asarray(payload)[:n]
    if codec == "bf16":
        return payload.view(ml_dtypes.bfloat16).astype(np.float32)
    scales = np.asarray(scales, np.int64)
    values = payload.view(np.float16).astype(np.float32) if codec == "fp16" else payload.astype(np.float32)
    scale = _per_element(power_of_two(np.where(scales == SPECIAL, 0, scales - 127)), n)
    out = values * scale
    return np.where(_per_element(scales == SPECIAL, n), np.float32(np.nan), out).astype(np.float32)


def round_trip(codec, x):
    payload, scales = encode(codec, x)
    return decode(codec, payload, scales, np.asarray(x).size)


def _finish(codec, out, divisor, encode_out):
    if divisor > 0:
        out = out / np.float32(divisor)
    if not encode_out:
        return out, None, None
    payload, scales = encode(codec, out)
    return decode(codec, payload, scales, out.size), payload, scales


@_quiet
def decode_add(codec, acc, payload, scales, divisor=0, encode_out=False):
    """(out, out_payload, out_scales): out = acc + decode(...), / divisor, encoded if asked."""
    acc = np.asarray(acc, np.float32)
    return _finish(codec, acc + decode(codec, payload, scales, acc.size), divisor, encode_out)


@_quiet
def add(codec, acc, b, divisor=0, encode_out=False):
    acc, b = np.asarray(acc, np.float32), np.asarray(b, np.float32)
    return _finish(codec, acc + b, divisor, encode_out)
