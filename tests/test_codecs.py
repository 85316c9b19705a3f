"""The compression codecs (collectives/compression/kernels.py), without a GPU.

* The CPU loops (numba.njit) equal the NumPy reference (codec_reference.py)
  bit for bit, every codec and operation, on data chosen to hit every path:
  tiny, huge and mixed magnitudes, signed zeros, rounding ties of each
  codec, int8's scale stepping up, float32 subnormals, the largest float32,
  inf and NaN, partial blocks, in place and not, with and without the float
  result written; decoding arbitrary bytes too.
* The float16 and bfloat16 conversions equal NumPy's on every float16 and a
  sweep of float32 values.
* One encode/decode stays within the error bound derived from the format;
  int8 never needs its clamp.
* The wire is as small as promised.
* The CUDA kernels, the same bodies, run under Numba's CUDA simulator (in a
  subprocess, so the simulator does not leak into this one) and equal the
  reference bit for bit.
* The CUDA kernels compile for sm_80 and sm_90 without a GPU; ptxas finds no
  spills and no local memory, and the PTX has no FMA and no flushing.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import codec_reference as ref
from collectives.compression import kernels
from collectives.errors import InvalidUsageError

ROOT = Path(__file__).resolve().parents[1]
CODECS = kernels.CODECS
BLOCK = kernels.BLOCK


# -- data that reaches every path ----------------------------------------------------


def _ties(seed=0):
    """Halfway cases of each codec, one block each (all codecs run all of them)."""
    rng = np.random.default_rng(seed)
    # bf16: dropped 16 bits exactly 0x8000, kept part odd and even, both signs.
    upper = rng.integers(0x0080, 0x7F00, BLOCK).astype(np.uint32) | (rng.integers(0, 2, BLOCK).astype(np.uint32) << 15)
    bf16 = ((upper << 16) | 0x8000).view(np.float32)
    # fp16: a block whose maximum 1.5 * 2^14 gives e = 0, then scaled by an exact 2^-30
    # (so e = -30): normal ties 1 + (2j+1) 2^-11 between neighbours 2^-10 apart, and
    # subnormal ties (2j+1) 2^-25 between neighbours 2^-24 apart (2^-25 itself ties to 0).
    fp16 = [1.5 * 2 ** 14] + [(-1) ** j * (1 + (2 * j + 1) * 2 ** -11) for j in range(15)] \
        + [(-1) ** j * (2 * j + 1) * 2 ** -25 for j in range(16)]
    fp16 = np.array(fp16, np.float32) * np.float32(2 ** -30)
    # int8, one block: maximum 127.25 (scales to itself, e = 0, rounds to 127)
    # and ties j + 1/2 of both parities; another: maximum 127.5, which would
    # round to 128 at e = 0, so e = 1 and the odd integers beside it become
    # ties. Both scaled by 2^10 (so e = 10 and 11).
    int8 = [127.25, -127.25] + [(j + 0.5) * (-1) ** j for j in range(-60, 60, 4)] \
        + [127.5, -127.5] + [(2 * j + 1) * (-1) ** j for j in range(-60, 60, 4)]
    int8 = np.array(int8, np.float32) * np.float32(2 ** 10)
    return np.concatenate([bf16, fp16, int8])


def _int8_scale_edges():
    """Blocks whose largest |x| is just below, at and above the point where
    int8's scale steps up (the mantissa 1 + 127/128, where the maximum would
    round to 128), from the largest float32 down to the floor of the scale
    (e = -127) and float32 subnormals; plus random values beside it."""
    rng = np.random.default_rng(5)
    blocks = []
    for exponent in (127, 64, 6, 0, -1, -100, -120, -121, -122, -126):
        for mantissa in (0x7EFFFF, 0x7F0000, 0x7F0001, 0x7F8000, 0x7FFFFF, 0):
            top = np.uint32(((exponent + 127) << 23) | mantissa).view(np.float32)
            block = (rng.uniform(-1, 1, BLOCK) * top).astype(np.float32)
            block[rng.integers(BLOCK)] = top * rng.choice([-1, 1])
            blocks.append(block)
    subnormal = np.array([0x7F0000, 0x7EFFFF, 0x7FFFFF, 0x400000], np.uint32).view(np.float32)
    blocks.append(np.resize(np.concatenate([subnormal, -subnormal]), BLOCK))
    return np.concatenate(blocks).astype(np.float32)


def _datasets():
    rng = np.random.default_rng(2024)
    normal = rng.standard_normal(1000).astype(np.float32)
    mixed = (10.0 ** rng.uniform(-8, 5, 1000) * rng.choice([-1, 1], 1000)).astype(np.float32)
    subnormal = np.concatenate([
        rng.integers(1, 0x800000, 40).astype(np.uint32).view(np.float32),              # float32 subnormals
        np.array([1.4e-45, -1.4e-45, 1e-40, 1.1754942e-38, 1.1754944e-38], np.float32),  # and their edges
        rng.standard_normal(19).astype(np.float32) * np.float32(1e-38),
    ])
    largest = np.float32(np.finfo(np.float32).max)
    big = np.concatenate([[largest, -largest], rng.standard_normal(61).astype(np.float32) * np.float32(1e37)])
    special = rng.standard_normal(200).astype(np.float32)
    special[[3, 40, 41, 100, 199]] = [np.inf, np.nan, -np.inf, -np.nan, np.inf]    # blocks 0, 1, 3, 6 (partial)
    data = {
        "normal-1e-8": normal * np.float32(1e-8),
        "normal-1": normal,
        "normal-1e5": normal * np.float32(1e5),
        "mixed-1e-8..1e5": mixed,
        "zeros": np.zeros(70, np.float32),
        "negative-zeros": np.full(70, -0.0, np.float32),
        "signed-zeros-and-ones": np.tile(np.array([0.0, -0.0, 1.0, -1.0], np.float32), 20),
        "ties": _ties(),
        "int8-scale-edges": _int8_scale_edges(),
        "subnormal": subnormal.astype(np.float32),
        "largest": big.astype(np.float32),
        "inf-nan": special,
    }
    for n in (0, 1, 31, 32, 33, 1000):
        data[f"size-{n}"] = rng.standard_normal(n).astype(np.float32)
    return data


DATA = _datasets()


# -- comparisons ---------------------------------------------------------------------


def assert_same_floats(got, want, what):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, what
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan, err_msg=f"{what}: NaN-ness differs")
    bad = np.flatnonzero((got.view(np.uint32) != want.view(np.uint32)) & ~nan)
    assert bad.size == 0, (f"{what}: {bad.size} elements differ, first at {bad[0]}: "
                           f"{got[bad[0]]!r} ({got.view(np.uint32)[bad[0]]:#010x}) != "
                           f"{want[bad[0]]!r} ({want.view(np.uint32)[bad[0]]:#010x})")


def assert_same_wire(codec, got, want, what):
    """Payload and scales; a bfloat16 NaN may carry any payload (compared as NaN)."""
    (gp, gs), (wp, ws) = got, want
    assert gp.dtype == wp.dtype and gp.shape == wp.shape, what
    if codec == "bf16":
        nan = (wp.view(np.uint16) & 0x7FFF) > 0x7F80
        np.testing.assert_array_equal((gp.view(np.uint16) & 0x7FFF) > 0x7F80, nan, err_msg=f"{what}: NaN-ness")
        gp, wp = gp[~nan], wp[~nan]
    bad = np.flatnonzero(gp != wp)
    assert bad.size == 0, f"{what}: payload differs at {bad[:8]}: {gp[bad[:8]]} != {wp[bad[:8]]}"
    np.testing.assert_array_equal(gs, ws, err_msg=f"{what}: scales")


def empty_wire(codec, n):
    payload_bytes, scale_bytes = kernels.wire_nbytes(codec, n)
    return np.full(n, 0x55, kernels.payload_dtype(codec)), np.full(scale_bytes, 0x55, np.uint8)


def random_wire(codec, n, rng):
    """Arbitrary bytes: every payload and scale value decodes, NaN and inf codes too."""
    payload = rng.integers(0, 1 << 16, n).astype(np.uint16)
    if codec == "int8":
        payload = rng.integers(-128, 128, n).astype(np.int8)
    scales = rng.integers(0, 256, kernels.wire_nbytes(codec, n)[1]).astype(np.uint8)
    return payload, scales


# -- the CPU loops against the reference ----------------------------------------------


@pytest.mark.parametrize("name", DATA)
@pytest.mark.parametrize("codec", CODECS)
def test_cpu_equals_reference(codec, name):
    x = DATA[name]
    n = x.size
    rng = np.random.default_rng(n)
    want = ref.encode(codec, x)

    # encode, and encode with round_x
    got = empty_wire(codec, n)
    kernels.cpu_encode(codec, x.copy(), *got)
    assert_same_wire(codec, got, want, "encode")
    rounded = x.copy()
    kernels.cpu_encode(codec, rounded, *empty_wire(codec, n), round_x=True)
    assert_same_floats(rounded, ref.decode(codec, *want, n), "encode round_x")

    # decode what the reference encoded, and arbitrary bytes (every float16:
    # subnormals, inf and NaN take the long way, _plain)
    acc = (x[::-1] * np.float32(0.75)).astype(np.float32)
    for wire, what in ((want, "decode"), (random_wire(codec, n, rng), "decode of random bytes")):
        out = np.full(n, 7, np.float32)
        kernels.cpu_decode(codec, *wire, out)
        assert_same_floats(out, ref.decode(codec, *wire, n), what)
        want_out, *want_wire = ref.decode_add(codec, acc, *wire, 0, True)
        out, out_wire = np.full(n, 7, np.float32), empty_wire(codec, n)
        kernels.cpu_decode_add(codec, acc, *wire, out, 0, *out_wire)
        assert_same_floats(out, want_out, f"decode_add, encoded, of {what}")
        assert_same_wire(codec, out_wire, want_wire, f"decode_add, encoded, of {what}: wire")

    # decode_add and add: plain, divided, encoded, divided and encoded, in place
    for divisor in (0, 3):
        for encode_out in (False, True):
            case = f"divisor={divisor} encode_out={encode_out}"
            want_out, *want_wire = ref.decode_add(codec, acc, *want, divisor, encode_out)
            out, out_wire = np.full(n, 7, np.float32), empty_wire(codec, n)
            kernels.cpu_decode_add(codec, acc, *want, out, divisor, *(out_wire if encode_out else ()))
            assert_same_floats(out, want_out, f"decode_add {case}")
            if encode_out:
                assert_same_wire(codec, out_wire, want_wire, f"decode_add {case}: wire")
            in_place = acc.copy()
            kernels.cpu_decode_add(codec, in_place, *want, in_place, divisor, *(empty_wire(codec, n) if encode_out else ()))
            assert_same_floats(in_place, want_out, f"decode_add in place {case}")

            if encode_out:      # the float result not written: only the wire
                out, out_wire = np.full(n, 7, np.float32), empty_wire(codec, n)
                kernels.cpu_decode_add(codec, acc, *want, out, divisor, *out_wire, write_out=False)
                assert_same_wire(codec, out_wire, want_wire, f"decode_add {case} write_out=False: wire")
                assert np.all(out == 7), f"decode_add {case}: write_out=False wrote out"

            want_out, *want_wire = ref.add(codec, acc, x, divisor, encode_out)
            out, out_wire = np.full(n, 7, np.float32), empty_wire(codec, n)
            kernels.cpu_add(codec, acc, x, out, divisor, *(out_wire if encode_out else ()))
            assert_same_floats(out, want_out, f"add {case}")
            if encode_out:
                assert_same_wire(codec, out_wire, want_wire, f"add {case}: wire")
            for in_place in ("acc", "b"):       # out may be either operand
                a, b = acc.copy(), x.copy()
                kernels.cpu_add(codec, a, b, a if in_place == "acc" else b, divisor,
                                *(empty_wire(codec, n) if encode_out else ()))
                assert_same_floats(a if in_place == "acc" else b, want_out, f"add in place on {in_place} {case}")
            if encode_out:
                out, out_wire = np.full(n, 7, np.float32), empty_wire(codec, n)
                kernels.cpu_add(codec, acc, x, out, divisor, *out_wire, write_out=False)
                assert_same_wire(codec, out_wire, want_wire, f"add {case} write_out=False: wire")
                assert np.all(out == 7), f"add {case}: write_out=False wrote out"


@pytest.mark.parametrize("codec", CODECS)
def test_block_aligned_views_equal_the_whole(codec):
    """Executors pass views at block boundaries (scales at offset // 32): the
    pieces must give the bytes of the whole."""
    x = DATA["mixed-1e-8..1e5"]
    whole = empty_wire(codec, x.size)
    kernels.cpu_encode(codec, x, *whole)
    pieces = empty_wire(codec, x.size)
    for start, stop in ((0, 64), (64, 96), (96, 512), (512, 1000)):
        scales = pieces[1][start // BLOCK:-(-stop // BLOCK)] if codec != "bf16" else pieces[1]
        kernels.cpu_encode(codec, x[start:stop], pieces[0][start:stop], scales)
    assert_same_wire(codec, pieces, whole, "pieces")


# -- the conversions on their own, against NumPy's --------------------------------------


@pytest.fixture(scope="module")
def conversions():
    """The per-element float16/bfloat16 conversions of kernels/codec.cuh, as
    the host extension compiles them, in loops over arrays: (encode, decode)."""
    from collectives.compression import _codec

    def encode(x, f16, f16_value, bf16):
        _codec.convert(x.ctypes.data, f16.ctypes.data, f16_value.ctypes.data, bf16.ctypes.data, x.size, 0, 0, 0, 0)

    def decode(payload, general, plain):
        _codec.convert(0, 0, 0, 0, 0, payload.ctypes.data, general.ctypes.data, plain.ctypes.data, payload.size)

    return encode, decode


def _float32_sweep():
    """Random float32 bit patterns, and for every exponent the mantissas
    around float16's and bfloat16's rounding points (ties, both parities,
    carries into the exponent)."""
    rng = np.random.default_rng(17)
    patterns = [rng.integers(0, 1 << 32, 1 << 21, dtype=np.uint64)]
    exponent = np.arange(256, dtype=np.uint64) << 23
    upper = rng.integers(0, 1 << 10, (256, 8), dtype=np.uint64) << 13
    upper[:, :2] = [0, 0x3FF << 13]                       # the smallest and largest float16 mantissa
    for low in (0, 1, 0xFFF, 0x1000, 0x1001, 0x1FFF, 0x7FFF, 0x8000, 0x8001, 0xFFFF):
        mantissa = (upper | low) & 0x7FFFFF
        patterns.append((exponent[:, None] | mantissa).ravel())
    bits = np.concatenate(patterns).astype(np.uint32)
    return np.concatenate([bits, bits | np.uint32(0x80000000)]).view(np.float32)


def test_float16_and_bfloat16_conversions_equal_numpy(conversions):
    encode, decode = conversions
    payload = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    general, plain = np.empty(payload.size, np.float32), np.empty(payload.size, np.float32)
    decode(payload, general, plain)
    want = payload.view(np.float16).astype(np.float32)
    assert_same_floats(general, want, "float16 -> float32")
    u = payload & 0x7FFF
    is_plain = (u == 0) | ((u >= 0x400) & (u < 0x7C00))    # what _plain lets through
    assert_same_floats(plain[is_plain], want[is_plain], "plain float16 -> float32")

    x = _float32_sweep()
    f16, f16_value, bf16 = np.empty(x.size, np.uint16), np.empty(x.size, np.float32), np.empty(x.size, np.uint16)
    encode(x, f16, f16_value, bf16)
    with np.errstate(over="ignore", invalid="ignore"):
        want_bf16 = x.astype(ml_dtypes.bfloat16).view(np.uint16)
        want_f16 = x.astype(np.float16)
    assert_same_wire("bf16", (bf16, None), (want_bf16, None), "float32 -> bfloat16")
    domain = np.abs(x) < 65520                                  # _to_f16's: finite, no overflow
    bad = np.flatnonzero(f16[domain] != want_f16.view(np.uint16)[domain])
    assert bad.size == 0, f"float32 -> float16: {x[domain][bad[:4]]} gave {f16[domain][bad[:4]]}"
    assert_same_floats(f16_value[domain], want_f16[domain].astype(np.float32), "float32 -> float16 value")


# -- error bounds of one encode/decode --------------------------------------------------


def _round_trip(codec, x):
    payload, scales = empty_wire(codec, x.size)
    y = x.copy()
    kernels.cpu_encode(codec, y, payload, scales, round_x=True)
    e = np.repeat(scales.astype(np.int64) - 127, BLOCK)[:x.size] if codec != "bf16" else None
    return y, e


@pytest.mark.parametrize("scale", [1e-8, 1.0, 1e5, "mixed"])
@pytest.mark.parametrize("codec", CODECS)
def test_error_bound(codec, scale):
    rng = np.random.default_rng(7)
    if scale == "mixed":
        x = (10.0 ** rng.uniform(-8, 5, 4096) * rng.choice([-1, 1], 4096)).astype(np.float32)
    else:
        x = (rng.standard_normal(4096) * scale).astype(np.float32)
    y, e = _round_trip(codec, x)
    err = np.abs(y.astype(np.float64) - x.astype(np.float64))
    ax = np.abs(x.astype(np.float64))
    if codec == "bf16":
        # bfloat16 keeps p = 8 significant bits: round to nearest is off by at
        # most half a unit in the last place, 2^-8 relative (2^-134 absolute,
        # half bfloat16's subnormal spacing, for float32 subnormals).
        bound = np.maximum(2.0 ** -8 * ax, 2.0 ** -134)
    elif codec == "fp16":
        # y = x 2^-e is exact (a power of two; below 2^-126 it is far under
        # float16's resolution anyway), |y| < 2^15 so float16 cannot overflow;
        # rounding y to float16 costs 2^-11 |y| (p = 11) in the normal range and
        # 2^-25 (half the subnormal spacing 2^-24) below it. Scaling back by 2^e
        # is exact unless it lands in float32's subnormals (2^-150 at most). So
        #   |err| <= max(2^-11 |x|, 2^(e-25)) + 2^-150,  2^(e-25) <= 2^-39 blockmax.
        bound = np.maximum(2.0 ** -11 * ax, 2.0 ** (e - 25)) + 2.0 ** -150
    else:
        # y = x 2^-e is exact (a power of two; |y| < 127.5), rint is off by at
        # most half a step and q 2^e is exact: |err| <= 2^(e - 1), never more
        # (the scale is chosen so that nothing is clamped). Relative to the
        # block's largest |x| = M, e is one of
        #   M 2^-e in [64, 127.5):   2^(e-1) = 2^e / 2 <= M / 128
        #   M 2^-e in [63.75, 64):   2^(e-1) <= M / 127.5   (M would have rounded to 128 one step lower)
        # and e = -127 (M < 2^-121): 2^(e-1) = 2^-128. So
        #   |err| <= min(|x|, max(M / 127.5, 2^-128)),  M / 127.5 = 2^-6.994 M.
        bound = np.minimum(ax, 2.0 ** (e - 1))
        block_max = np.repeat(np.abs(np.pad(x, (0, -x.size % BLOCK))).reshape(-1, BLOCK).max(axis=1), BLOCK)[:x.size]
        assert np.all(bound <= np.maximum(block_max.astype(np.float64) / 127.5, 2.0 ** -128))
    over = np.flatnonzero(err > bound)
    assert over.size == 0, f"{over.size} elements over the bound, e.g. x={x[over[0]]!r} -> {y[over[0]]!r}"


@pytest.mark.parametrize("name", ["int8-scale-edges", "ties", "mixed-1e-8..1e5", "subnormal", "largest"])
def test_int8_scale_never_needs_the_clamp(name):
    """Each block's scale 2^e puts its largest |x| where it rounds to at most
    127: every |x 2^-e| < 127.5, and the block maximum rounds to 64..127,
    off by at most half a step (no bias toward zero at the top). Except in
    float32's top sliver, |x| >= (2 - 2^-7) 2^127, where 64 2^122 would be
    inf: e stays 121 and the clamp acts, as it always did."""
    x = DATA[name]
    finite_blocks = np.isfinite(np.pad(x, (0, -x.size % BLOCK))).reshape(-1, BLOCK).all(axis=1)
    y, e = _round_trip("int8", x)
    payload, scales = empty_wire("int8", x.size)
    kernels.cpu_encode("int8", x, payload, scales)
    scaled = np.abs(x.astype(np.float64)) * 2.0 ** -e
    finite = np.repeat(finite_blocks, BLOCK)[:x.size]
    # except in float32's top sliver, where 64 2^122 would decode to inf
    sliver = np.abs(x.astype(np.float64)) >= (2 - 2.0 ** -7) * 2.0 ** 127
    assert np.all(e[sliver] == 121) and np.all(np.isfinite(y[sliver]))
    assert np.all(scaled[finite & ~sliver] < 127.5)
    assert np.all(np.abs(payload[finite].astype(np.int64)) <= 127)
    for blk in np.flatnonzero(finite_blocks):
        block = slice(blk * BLOCK, (blk + 1) * BLOCK)
        top = np.argmax(np.abs(x[block]))
        if e[block][0] > -127:          # above the floor of the scale the maximum uses the top half
            assert 64 <= abs(int(payload[block][top])) <= 127, (blk, x[block][top], payload[block][top])
        step = 2.0 ** e[block][0]
        assert abs(float(y[block][top]) - float(x[block][top])) <= (step if sliver[block].any() else step / 2)


def test_write_out_false_needs_an_encoded_output():
    x = np.zeros(64, np.float32)
    payload, scales = empty_wire("fp16", 64)
    with pytest.raises(InvalidUsageError, match="write_out"):
        kernels.cpu_decode_add("fp16", x, payload, scales, x, 0, write_out=False)
    with pytest.raises(InvalidUsageError, match="write_out"):
        kernels.cpu_add("fp16", x, x, x, 0, write_out=False)


def test_fp16_scaling_keeps_tiny_and_huge_gradients():
    """Plain float16 flushes 1e-8 to zero and overflows 1e5; the block scale does neither."""
    rng = np.random.default_rng(3)
    for magnitude in (1e-8, 1e5):
        x = (rng.uniform(0.7, 1, 256) * rng.choice([-1, 1], 256) * magnitude).astype(np.float32)
        with np.errstate(over="ignore"):
            plain = x.astype(np.float16).astype(np.float32)      # |x| < 3e-8 rounds to 0, > 65520 to inf
        assert (plain == 0).all() if magnitude < 1 else np.isinf(plain).all()
        y, _ = _round_trip("fp16", x)
        assert np.isfinite(y).all() and (y != 0).all() and (np.sign(y) == np.sign(x)).all()
        assert np.all(np.abs(y - x) <= 2.0 ** -11 * np.abs(x))


def test_wire_bytes():
    for n in (1 << 10, 1000, 1 << 20, 3 * (1 << 20) + 5):
        ratio = {codec: sum(kernels.wire_nbytes(codec, n)) / (4 * n) for codec in CODECS}
        assert ratio["bf16"] == 0.5
        assert ratio["fp16"] <= 0.52
        assert ratio["int8"] <= 0.28
    assert kernels.wire_nbytes("fp16", 33) == (66, 2)
    assert kernels.wire_nbytes("int8", 0) == (0, 0)
    assert kernels.wire_nbytes("bf16", 33) == (66, 0)
    assert not kernels.has_scales("bf16") and kernels.has_scales("fp16") and kernels.has_scales("int8")


def test_launch_grid():
    """One thread per block of 32 elements, whole warps, at most 256 threads
    per CUDA block and MAX_GRID CUDA blocks (the kernels loop over the rest)."""
    assert kernels.grid(1) == (1, 32)
    assert kernels.grid(257) == (1, 32)                          # 9 blocks of elements: one warp
    assert kernels.grid(32 * 256) == (1, 256)
    assert kernels.grid(32 * 256 + 1) == (2, 256)
    assert kernels.grid(1 << 26) == (kernels.MAX_GRID, 256)      # 256 MiB of float32
    for n in (1, 31, 33, 1000, 32 * 256 * 7 + 5):
        blocks, threads = kernels.grid(n)
        assert threads % 32 == 0 and blocks * threads >= -(-n // 32)


# -- bad input -----------------------------------------------------------------------


def test_unknown_codec_and_bad_arrays():
    x = np.zeros(64, np.float32)
    for bad in ("fp8", "FP16", None, 1):
        for call in (lambda: kernels.codec_id(bad), lambda: kernels.payload_dtype(bad),
                     lambda: kernels.wire_nbytes(bad, 10), lambda: kernels.has_scales(bad),
                     lambda: kernels.cpu_encode(bad, x, np.zeros(64, np.uint16), np.zeros(2, np.uint8))):
            with pytest.raises(InvalidUsageError, match="unknown codec"):
                call()
    with pytest.raises(InvalidUsageError, match="int8"):                    # int8 payload must be int8
        kernels.cpu_encode("int8", x, np.zeros(64, np.uint16), np.zeros(2, np.uint8))
    with pytest.raises(InvalidUsageError, match="scales"):                  # one scale byte short
        kernels.cpu_encode("fp16", x, np.zeros(64, np.uint16), np.zeros(1, np.uint8))
    with pytest.raises(InvalidUsageError, match="payload"):
        kernels.cpu_decode("fp16", np.zeros(63, np.uint16), np.zeros(2, np.uint8), x)
    with pytest.raises(InvalidUsageError, match="float32"):
        kernels.cpu_encode("bf16", x.astype(np.float64), np.zeros(64, np.uint16), None)
    with pytest.raises(InvalidUsageError, match="divisor"):
        kernels.cpu_add("bf16", x, x, x, -1)


def test_import_needs_no_numba():
    code = "import sys, collectives.compression.kernels; assert 'numba' not in sys.modules, 'numba imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


# -- the CUDA kernels under the simulator ------------------------------------------------

SIMULATOR_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    from numba import config, cuda
    assert config.ENABLE_CUDASIM
    from collectives.compression import kernels

    inputs = dict(np.load(sys.argv[1]))
    results = {}
    stream = cuda.stream()
    for key in sorted({k.split("/")[0] for k in inputs}):
        get = lambda name: inputs[key + "/" + name]
        codec = str(get("codec")); op = str(get("op")); n = int(get("n"))
        c = kernels.codec_id(codec)
        dev = {name[len(key) + 1:]: cuda.to_device(v, stream=stream)
               for name, v in inputs.items() if name.startswith(key + "/") and v.ndim == 1}
        divisor = np.float32(get("divisor")); encode_out = bool(get("encode_out")); write_out = bool(get("write_out"))
        if op == "encode":
            args = (c, dev["x"], dev["payload"], dev["scales"], bool(get("round_x")))
        elif op == "decode":
            args = (c, dev["payload"], dev["scales"], dev["out"])
        elif op == "decode_add":
            args = (c, dev["acc"], dev["payload"], dev["scales"], dev["out"], divisor,
                    dev["out_payload"], dev["out_scales"], encode_out, write_out)
        else:
            args = (dev["acc"], dev["b"], dev["out"], divisor, c, dev["out_payload"], dev["out_scales"], encode_out,
                    write_out)
        if int(get("small_grid")):
            # fewer threads than blocks: the grid-stride loop does the rest
            getattr(kernels.cuda_kernels(), op)[1, 3, stream](*args)
        else:
            kernels.launch(op, stream, n, *args)
        stream.synchronize()
        for name, array in dev.items():
            results[key + "/" + name] = array.copy_to_host()
    np.savez(sys.argv[2], **results)
""")


def _simulator_cases():
    """{key: inputs} for a few hundred elements per case, every kernel and codec."""
    rng = np.random.default_rng(11)
    x = np.concatenate([DATA["ties"][:96], DATA["mixed-1e-8..1e5"][:64], DATA["inf-nan"][:64],
                        DATA["subnormal"][:33]]).astype(np.float32)          # 257: a partial last block
    n = x.size
    acc = (rng.standard_normal(n) * 100).astype(np.float32)
    cases = {}
    for codec in CODECS:
        payload, scales = ref.encode(codec, x)
        payload_dtype = kernels.payload_dtype(codec)
        blank = dict(out_payload=np.zeros(n, payload_dtype), out_scales=np.zeros(scales.size, np.uint8))
        common = dict(codec=codec, n=n, divisor=0, encode_out=False, write_out=True, round_x=False, small_grid=0)
        cases[f"{codec}-encode"] = dict(common, op="encode", x=x, payload=np.zeros(n, payload_dtype),
                                        scales=np.zeros(scales.size, np.uint8))
        cases[f"{codec}-encode-round"] = dict(cases[f"{codec}-encode"], round_x=True, small_grid=1)
        wild_payload, wild_scales = random_wire(codec, n, rng)
        cases[f"{codec}-decode"] = dict(common, op="decode", payload=wild_payload, scales=wild_scales,
                                        out=np.zeros(n, np.float32))
        cases[f"{codec}-decode_add"] = dict(common, op="decode_add", acc=acc, payload=payload, scales=scales,
                                            out=np.zeros(n, np.float32), **blank)
        cases[f"{codec}-decode_add-encode"] = dict(cases[f"{codec}-decode_add"], divisor=3, encode_out=True)
        cases[f"{codec}-decode_add-encode-nowrite"] = dict(cases[f"{codec}-decode_add"], encode_out=True,
                                                           write_out=False, out=np.full(n, 7, np.float32))
        cases[f"{codec}-add-encode"] = dict(common, op="add", acc=acc, b=x, out=np.zeros(n, np.float32),
                                            divisor=2, encode_out=True, small_grid=1, **blank)
        cases[f"{codec}-add-encode-nowrite"] = dict(cases[f"{codec}-add-encode"], write_out=False,
                                                    out=np.full(n, 7, np.float32))
    return cases


def _expected(case):
    codec, op, n = case["codec"], case["op"], case["n"]
    if op == "encode":
        payload, scales = ref.encode(codec, case["x"])
        out = dict(payload=payload, scales=scales)
        if case["round_x"]:
            out["x"] = ref.decode(codec, payload, scales, n)
        return out
    if op == "decode":
        return dict(out=ref.decode(codec, case["payload"], case["scales"], n))
    if op == "decode_add":
        out, payload, scales = ref.decode_add(codec, case["acc"], case["payload"], case["scales"],
                                              case["divisor"], case["encode_out"])
    else:
        out, payload, scales = ref.add(codec, case["acc"], case["b"], case["divisor"], case["encode_out"])
    if not case["write_out"]:
        out = case["out"]                                           # left as it was
    return dict(out=out, **(dict(out_payload=payload, out_scales=scales) if case["encode_out"] else {}))


def test_cuda_kernels_under_simulator(tmp_path):
    cases = _simulator_cases()
    np.savez(tmp_path / "in.npz", **{f"{key}/{name}": np.asarray(value)
                                    for key, case in cases.items() for name, value in case.items()})
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    done = subprocess.run([sys.executable, "-c", SIMULATOR_SCRIPT, str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    got = np.load(tmp_path / "out.npz")
    for key, case in cases.items():
        codec = case["codec"]
        for name, want in _expected(case).items():
            if name in ("payload", "out_payload"):
                scales = "scales" if name == "payload" else "out_scales"
                want_scales = _expected(case).get(scales, np.zeros(0, np.uint8))
                assert_same_wire(codec, (got[f"{key}/{name}"], got[f"{key}/{scales}"]),
                                 (want, want_scales if codec != "bf16" else got[f"{key}/{scales}"]), key)
            elif name in ("out", "x"):
                assert_same_floats(got[f"{key}/{name}"], want, f"{key}: {name}")


# -- the CUDA kernels compiled for real GPUs -----------------------------------------------


def _compile_report(arch):
    import importlib.util
    if importlib.util.find_spec("numba_cuda") is None:
        pytest.skip("numba-cuda is not installed: pip install '.[test]' brings numba-cuda[cu13]")
    try:
        from numba import cuda  # noqa: F401
    except Exception as error:      # numba-cuda without its CUDA 13 wheels
        pytest.skip(f"numba.cuda does not import ({error}): pip install '.[test]' brings numba-cuda[cu13]")
    if kernels.find_ptxas() is None:
        pytest.skip("ptxas not found: pip install '.[test]' brings nvidia-cuda-nvcc")
    return kernels.compile_for(arch)


@pytest.mark.parametrize("arch", [(9, 0), (8, 0)], ids=["sm_90", "sm_80"])
def test_cuda_kernels_compile_without_spills(arch):
    report = _compile_report(arch)
    assert set(report) == {f"{k}[{p}]" for k in kernels.KERNELS for p in ("uint16", "int8")}
    problems = []
    for name, r in sorted(report.items()):
        if r["spill_stores"] or r["spill_loads"] or r["stack"]:
            problems.append(f"{name}: {r['stack']} bytes stack (local memory), {r['spill_stores']}/{r['spill_loads']} "
                            f"bytes spilled")
        if r["fma"] or r["ftz"]:
            problems.append(f"{name}: {r['fma']} fused multiply-adds, {r['ftz']} flushing instructions in the PTX")
        if ".local" in r["ptx"]:
            problems.append(f"{name}: local memory in the PTX")
        if not 0 < r["registers"] <= 64:
            problems.append(f"{name}: {r['registers']} registers")
    assert not problems, "\n".join(problems)
    print(json.dumps({name: r["registers"] for name, r in sorted(report.items())}))
