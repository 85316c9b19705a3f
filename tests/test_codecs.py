"""The compression codecs (kernels/codec.cuh; collectives/compression), without a GPU.

* Both forms of the codecs, the CPU loops (the host extension _codec.cpp)
  and the GPU kernels (kernels/codec.cu, run by the emulated device with its
  warp shuffles), equal the NumPy reference (codec_reference.py) bit for
  bit, every codec and operation, on data chosen to hit every path: tiny,
  huge and mixed magnitudes, signed zeros, rounding ties of each codec,
  int8's scale stepping up, float32 subnormals, the largest float32, inf and
  NaN, partial blocks, in place and not, with and without the float result
  written; decoding arbitrary bytes too. The GPU kernels also with a grid
  smaller than the work and with regions that are not 16-byte aligned; an
  emulated shuffle that returns the lane's own value fails the comparison.
* The float16 and bfloat16 conversions equal NumPy's on every float16 and a
  sweep of float32 values.
* One encode/decode stays within the error bound derived from the format;
  int8 never needs its clamp.
* The wire is as small as promised.
* A compressed allreduce needs no Numba, runs where NumPy lacks
  np.row_stack (NumPy 2.5), and warns about nothing.
(The nvcc build of codec.cu and its static checks: tests/test_kernels.py.)
"""

import ctypes
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import codec_reference as ref
from collectives import kernels as sources
from collectives.compression import kernels
from collectives.compression.wire import Region
from collectives.devices import emulated
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


# -- both forms against the reference ----------------------------------------------


def _region(array):
    return None if array is None else Region(array.ctypes.data, array.size, array.dtype.name)


class EmulatedKernels:
    """kernels/codec.cu on the emulated device, called like the CPU loops
    (kernels.cpu_*) on NumPy arrays, which are the emulated device's memory:
    each call is one launch of the kernel instance a device would launch
    (kernels.device_launch), on `grid` blocks (None: the device's choice).
    With `misalign`, every array is copied to one that starts 4 bytes past a
    16-byte boundary for the launch (and back): the kernels' element-wise path."""

    def __init__(self, library, grid=None, misalign=False):
        self.library, self.grid, self.misalign = library, grid, misalign

    def _run(self, kernel, codec, arrays, divisor=0):
        if self.misalign:
            moved = {}          # by identity: an array passed twice (in place) stays one array
            for a in arrays:
                if a is not None and a.size and id(a) not in moved:
                    shifted = np.empty(a.nbytes + 20, np.uint8)
                    start = 16 - shifted.ctypes.data % 16 + 4
                    moved[id(a)] = (a, shifted[start:start + a.nbytes].view(a.dtype))
                    moved[id(a)][1][:] = a
            self._launch(kernel, codec, [moved[id(a)][1] if id(a) in moved else a for a in arrays], divisor)
            for original, copy in moved.values():
                original[:] = copy
        else:
            self._launch(kernel, codec, arrays, divisor)

    def _launch(self, kernel, codec, arrays, divisor):
        launch = kernels.device_launch(kernel, codec, [_region(a) for a in arrays], divisor)
        if launch is None:
            return
        instance, args, n = launch
        grid = self.grid or sources.codec_grid(n, emulated.RESIDENT_BLOCKS)
        status = self.library.collectives_emulated_codec(instance.codec, instance.op, grid, sources.CODEC_THREADS,
                                                         ctypes.byref(args))
        assert status == 0, f"emulated codec_kernel refused {instance}: {status}"

    def cpu_encode(self, codec, x, payload, scales, round_x=False):
        self._run("encode_round" if round_x else "encode", codec, (x, payload, scales))

    def cpu_decode(self, codec, payload, scales, out):
        self._run("decode", codec, (payload, scales, out))

    def cpu_decode_add(self, codec, acc, payload, scales, out, divisor=0, out_payload=None, out_scales=None,
                       write_out=True):
        self._run("decode_add", codec, (acc, payload, scales, out if write_out else None, out_payload, out_scales),
                  divisor)

    def cpu_add(self, codec, acc, b, out, divisor=0, out_payload=None, out_scales=None, write_out=True):
        self._run("add", codec, (acc, b, out if write_out else None, out_payload, out_scales), divisor)


class DeviceKernels(EmulatedKernels):
    """kernels/codec.cu through a device's launch_codec (the CUDA adapter on
    a GPU, or the emulated device's queue), called like the CPU loops: each
    array is copied to the device (an array passed twice stays one), the
    kernel runs on the device's stream, and every array comes back."""

    def __init__(self, device):
        self.device = device

    def _run(self, kernel, codec, arrays, divisor=0):
        if self.device.array_location == "host":
            on_device = {id(a): a for a in arrays if a is not None}
        else:
            import cupy
            on_device = {id(a): cupy.asarray(a) for a in arrays if a is not None}
        regions = [None if a is None else Region(_address_of(on_device[id(a)]), a.size, a.dtype.name) for a in arrays]
        self.device.launch_codec(self.device.current_stream(), kernel, codec, regions, divisor)
        self.device.synchronize()
        for a in arrays:
            if a is not None and on_device[id(a)] is not a:
                a[:] = on_device[id(a)].get()


def _address_of(array):
    return array.ctypes.data if isinstance(array, np.ndarray) else array.data.ptr


@pytest.mark.gpu
@pytest.mark.parametrize("codec", CODECS)
def test_device_kernels_equal_the_reference(codec):
    """On a GPU (or the emulated device under COLLECTIVES_TEST_DEVICE=emulated):
    every operation, through the device interface, on the data sets above
    (and a large one, for a grid of many blocks), bit for bit."""
    from backends import GPU_DEVICE, require_gpu
    from collectives.devices import open_device
    require_gpu()
    device = DeviceKernels(open_device("emulated:0" if GPU_DEVICE == "emulated" else 0))
    rng = np.random.default_rng(8)
    large = (rng.standard_normal(3 * 2 ** 20 + 5) * 10.0 ** rng.uniform(-5, 5, 3 * 2 ** 20 + 5)).astype(np.float32)
    for name, x in [*DATA.items(), ("large", large if GPU_DEVICE == "cuda" else large[:20000])]:
        check_against_reference(device, codec, x)


@pytest.fixture(scope="module", params=["cpu", "emulated-cuda"])
def form(request):
    """The codecs' CPU loops, or the GPU kernels on the emulated device."""
    if request.param == "cpu":
        return kernels
    return EmulatedKernels(emulated.library())


@pytest.mark.parametrize("name", DATA)
@pytest.mark.parametrize("codec", CODECS)
def test_equals_reference(form, codec, name):
    check_against_reference(form, codec, DATA[name])


def check_against_reference(kernels, codec, x):
    """Every operation of `kernels` (the CPU loops, or EmulatedKernels) on x
    against the reference, bit for bit."""
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
    """Groups of 8 threads per block of 32 elements, at most the blocks the
    device runs at once (the kernels' grid-stride loop does the rest), never
    an empty grid."""
    assert sources.codec_grid(1, 1056) == 1
    assert sources.codec_grid(32 * 32, 1056) == 1                   # 32 blocks of elements: 256 threads
    assert sources.codec_grid(32 * 32 + 1, 1056) == 2
    assert sources.codec_grid(1 << 24, 1056) == 1056                 # 64 MiB of float32: the whole device
    assert sources.codec_grid(1 << 24, 2) == 2


def test_the_emulated_kernels_stride_and_take_unaligned_regions():
    """One CUDA block for 5003 elements (the grid-stride loop runs several
    times), and arrays 4 bytes off 16-byte alignment (the element-wise
    path) give the reference's bits too."""
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(5003) * 10.0 ** rng.uniform(-5, 5, 5003)).astype(np.float32)
    x[4000] = np.nan
    check_against_reference(EmulatedKernels(emulated.library(), grid=1), "int8", x)
    for codec in CODECS:
        check_against_reference(EmulatedKernels(emulated.library(), misalign=True), codec, x[:777])


@pytest.mark.slow
def test_a_broken_emulated_shuffle_is_caught(tmp_path):
    """The comparison with the reference sees the shuffles: an emulated
    shuffle that hands each lane its own value back (so a block's scale comes
    from a quarter of it) must fail it."""
    broken = tmp_path / "kernels"
    shutil.copytree(sources.source_dir(), broken, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    launch = (broken / "emulation" / "launch.cpp").read_text()
    exchange = "return partner.deposit[slot];"
    assert exchange in launch
    (broken / "emulation" / "launch.cpp").write_text(launch.replace(exchange, "return self.deposit[slot];"))
    with pytest.raises(AssertionError, match="differ"):
        check_against_reference(EmulatedKernels(emulated.library(broken)), "fp16", DATA["mixed-1e-8..1e5"])


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


def test_without_the_host_extension_a_compressed_call_says_how_to_build_it():
    """setup.py builds _codec.cpp optionally (no compiler: the package still
    installs); a compressed call on host ranks then raises a CollectiveError
    that says what to do, and nothing else breaks."""
    code = textwrap.dedent("""
        import sys
        import numpy as np
        sys.modules["collectives.compression._codec"] = None     # as if it had not been built
        import collectives
        comm = collectives.Communicator.local(2)
        x = [np.ones(64, np.float32), np.ones(64, np.float32)]
        assert np.array_equal(comm.allreduce(x)[0], np.full(64, 2, np.float32))
        try:
            comm.allreduce(x, compression="fp16")
        except collectives.CollectiveError as error:
            print(error)
        else:
            raise SystemExit("no error")
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "C++ compiler" in done.stdout and "build_ext" in done.stdout, done.stdout


NO_NUMBA_NO_ROW_STACK = textwrap.dedent("""
    import sys, warnings
    import numpy as np

    class NoNumba:                                  # importing numba fails, as where it is not installed
        def find_spec(self, name, path=None, target=None):
            if name == "numba" or name.startswith("numba."):
                raise ImportError("numba is blocked in this test")
    sys.meta_path.insert(0, NoNumba())
    if hasattr(np, "row_stack"):                    # as NumPy 2.5, which removed it
        del np.row_stack
    warnings.simplefilter("error")                  # any warning fails the run

    import collectives
    for devices in (None, "emulated"):
        comm = collectives.Communicator.local(4, devices=devices)
        for codec in ("bf16", "fp16", "int8"):
            inputs = [np.full(1000, r + 1, np.float32) for r in range(4)]
            outputs = comm.allreduce(inputs, compression=codec)
            for out in outputs:
                assert np.array_equal(np.asarray(out), np.full(1000, 10, np.float32)), (devices, codec)
    assert "numba" not in sys.modules
    print("ok")
""")


def test_compressed_allreduce_without_numba_or_row_stack_and_without_warnings():
    """Host ranks and emulated devices: no Numba imported, NumPy 2.5's
    missing np.row_stack is no matter, and no warning (every warning an
    error) on the way."""
    done = subprocess.run([sys.executable, "-W", "error", "-c", NO_NUMBA_NO_ROW_STACK], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
    assert not done.stderr, done.stderr
