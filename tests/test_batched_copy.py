"""batched_copy (kernels/batched_copy.cu): one launch copies every row of a
(src, dst, nbytes) table, as tensor fusion packs arrays into a fusion buffer
and unpacks them.

* On an emulated device (the same CUDA C run on the CPU): tables over NumPy
  arrays, launched on the device's stream, against NumPy copies. Every byte
  of the destination arena is compared, so a write outside a row shows too.
  Alignments cover each word width the kernel picks (16, 8, 4, 2, 1 bytes),
  lengths 0, 1, 15, 16, 17, 4099, a thousand rows, rows of very different
  lengths, and grids narrower than the table.
* A kernel with a dropped word must fail the same comparison.
* NVRTC (what the CUDA adapter compiles with) builds it for sm_90 here, with
  no GPU, and its SASS has the 128-bit accesses. The nvcc build and its
  static checks are tests/test_kernels.py's.
* On a GPU (marked `gpu`): launch_copies through the CUDA adapter.
"""

import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from backends import GPU_DEVICE, require_gpu
from collectives import InvalidUsageError, kernels
from collectives.devices import emulated, open_device

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ROOT / "kernels"


@pytest.fixture(scope="module")
def device():
    return open_device("emulated:0")


def aligned_bytes(nbytes, rng):
    """A NumPy byte array of random contents whose first byte is 16-byte aligned."""
    raw = np.empty(nbytes + 16, np.uint8)
    start = (-raw.ctypes.data) % 16
    array = raw[start:start + nbytes]
    array[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
    return array


def layout(copies):
    """Offsets of non-overlapping copies in a source and a destination arena:
    `copies` is [(nbytes, src address mod 16, dst address mod 16)]; returns
    ([(src offset, dst offset, nbytes)], source arena size, destination arena size)."""
    placed, src_end, dst_end = [], 0, 0
    for nbytes, src_mod, dst_mod in copies:
        src_at = -(-src_end // 16) * 16 + src_mod
        dst_at = -(-dst_end // 16) * 16 + dst_mod
        placed.append((src_at, dst_at, nbytes))
        src_end, dst_end = src_at + nbytes + 3, dst_at + nbytes + 3  # gaps that must stay untouched
    return placed, src_end + 16, dst_end + 16


def run_copies(device, copies, seed=0, grid=None, max_row_bytes=kernels.COPY_ROW_BYTES):
    """(got, want): the destination arena after launch_copies, and after the
    same copies done by NumPy."""
    rng = np.random.default_rng(seed)
    placed, src_size, dst_size = layout(copies)
    src, dst = aligned_bytes(src_size, rng), aligned_bytes(dst_size, rng)
    want = dst.copy()
    for s, d, n in placed:
        want[d:d + n] = src[s:s + n]
    table = kernels.copy_table([src.ctypes.data + s for s, _, _ in placed],
                               [dst.ctypes.data + d for _, d, _ in placed],
                               [n for _, _, n in placed], max_row_bytes)
    uploaded = device.upload(table)
    device.launch_copies(device.current_stream(), uploaded, len(table), grid=grid)
    device.synchronize()
    return dst, want


def differences(got, want):
    wrong = np.flatnonzero(got != want)
    return f"{len(wrong)} bytes differ, first at {wrong[:8].tolist()}" if len(wrong) else None


LENGTHS = [0, 1, 15, 16, 17, 4099]
# (src address mod 16, dst address mod 16), by the word width the kernel picks:
# the widest W with src = dst (mod W).
ALIGNMENTS = {16: [(0, 0), (7, 7)], 8: [(0, 8), (3, 11)], 4: [(0, 4), (1, 5), (12, 0)], 2: [(0, 2), (5, 7)],
              1: [(0, 1), (1, 0), (6, 9), (15, 0)]}


@pytest.mark.parametrize("src_mod, dst_mod", [pair for pairs in ALIGNMENTS.values() for pair in pairs])
def test_every_length_and_alignment(device, src_mod, dst_mod):
    got, want = run_copies(device, [(n, src_mod, dst_mod) for n in LENGTHS], seed=src_mod * 16 + dst_mod)
    assert differences(got, want) is None


@pytest.mark.parametrize("nbytes", LENGTHS)
def test_one_row_of_each_length(device, nbytes):
    for src_mod, dst_mod in ((0, 0), (3, 3), (0, 4), (1, 0)):
        got, want = run_copies(device, [(nbytes, src_mod, dst_mod)], seed=nbytes)
        assert differences(got, want) is None, (nbytes, src_mod, dst_mod)


def test_a_thousand_rows_in_one_launch(device):
    rng = np.random.default_rng(1000)
    mod = lambda: int(rng.integers(0, 16)) if rng.random() < 0.3 else 0  # mostly aligned, as allocators give
    copies = [(int(rng.integers(0, 600)), mod(), mod()) for _ in range(1000)]
    got, want = run_copies(device, copies, seed=1)
    assert differences(got, want) is None


@pytest.mark.parametrize("max_row_bytes", [kernels.COPY_ROW_BYTES, 1 << 40], ids=["split", "whole"])
def test_rows_of_very_different_lengths(device, max_row_bytes):
    """A few bytes beside megabytes, in one launch; "whole" keeps the long
    copies as single rows, "split" is copy_table's default."""
    copies = [(1, 0, 0), (3 * 2 ** 20 + 5, 0, 0), (17, 1, 0), (200_000, 4, 4), (0, 0, 0),
              (kernels.COPY_ROW_BYTES, 0, 0), (kernels.COPY_ROW_BYTES + 1, 8, 0), (2 ** 20 + 3, 5, 9), (16, 0, 0)]
    got, want = run_copies(device, copies, seed=2, max_row_bytes=max_row_bytes)
    assert differences(got, want) is None


@pytest.mark.parametrize("grid", [(1, 1), (3, 2), (1, 7), (5, 40), (2, 200)])
def test_any_grid_copies_every_row(device, grid):
    """Fewer rows of blocks than rows (each block walks several rows) and
    several blocks per row; more rows of blocks than rows, too."""
    rng = np.random.default_rng(sum(grid))
    copies = [(int(rng.integers(0, 5000)), int(rng.integers(0, 2)) * 8, 0) for _ in range(100)]
    got, want = run_copies(device, copies, seed=3, grid=grid)
    assert differences(got, want) is None


def test_more_rows_than_a_grid_has_rows_of_blocks(device):
    """gridDim.y stops at 65535: copy_grid's grid, and the blocks walk the rest."""
    rows = kernels.MAX_GRID_Y + 1000
    assert kernels.copy_grid(1, rows, device.resident_blocks) == (1, kernels.MAX_GRID_Y)
    got, want = run_copies(device, [(1, i % 16, 0) for i in range(rows)], seed=4)
    assert differences(got, want) is None


def test_pack_and_unpack_on_one_stream(device):
    """Tensor fusion's use: pack arrays of several dtypes, some views at odd
    elements, into a fusion buffer, then unpack it into new arrays: two
    launches queued on one stream, run in order at synchronize."""
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal(n).astype(dtype)[offset:]
              for n, dtype, offset in [(1000, np.float32, 0), (1, np.float64, 0), (4099, np.float16, 1),
                                       (333, np.int8, 3), (70_000, np.float32, 1), (0, np.float32, 0)]]
    fused_offsets = np.cumsum([0] + [-(-a.nbytes // 16) * 16 for a in arrays])  # 16-byte aligned slots
    fusion = aligned_bytes(int(fused_offsets[-1]), rng)
    outputs = [np.zeros_like(a) for a in arrays]
    stream = device.current_stream()
    nbytes = [a.nbytes for a in arrays]
    pack = kernels.copy_table([a.ctypes.data for a in arrays], fusion.ctypes.data + fused_offsets[:-1], nbytes)
    unpack = kernels.copy_table(fusion.ctypes.data + fused_offsets[:-1], [o.ctypes.data for o in outputs], nbytes)
    device.launch_copies(stream, device.upload(pack), len(pack))
    device.launch_copies(stream, device.upload(unpack), len(unpack))
    assert all((o == 0).all() for o in outputs), "launches are queued, not run, until the stream drains"
    device.synchronize()
    for a, o, at in zip(arrays, outputs, fused_offsets):
        assert np.array_equal(o.view(np.uint8), a.view(np.uint8))
        assert np.array_equal(fusion[at:at + a.nbytes], a.view(np.uint8))


def test_a_bad_launch_is_refused_and_queues_nothing(device):
    table = device.upload(np.zeros((0, kernels.COPY_COLUMNS), np.int64))
    stream = device.current_stream()
    for rows, grid, message in [(1, None, "need a table of 24 bytes"), (-1, None, "rows must be"),
                                (2.0, None, "rows must be"), (True, None, "rows must be")]:
        with pytest.raises(InvalidUsageError, match=message):
            device.launch_copies(stream, table, rows, grid)
    one_row = device.upload(np.zeros((1, kernels.COPY_COLUMNS), np.int64))
    for grid in [(0, 1), (1, 0), (1, kernels.MAX_GRID_Y + 1), (1, 1, 1)]:
        with pytest.raises(InvalidUsageError, match="grid must be"):
            device.launch_copies(stream, one_row, 1, grid)
    assert not stream.queue
    device.launch_copies(stream, table, 0)  # no rows: nothing to launch
    assert not stream.queue


# -- the host side: tables and grids -------------------------------------------------------

def test_copy_table_splits_long_copies_and_keeps_their_alignment():
    table = kernels.copy_table([1000, 5000, 9001], [20_000, 30_008, 40_009], [100, 0, 70], max_row_bytes=32)
    assert table.dtype == np.int64 and table.shape == (4 + 3, kernels.COPY_COLUMNS)
    assert table[:, kernels.COPY_NBYTES].tolist() == [32, 32, 32, 4, 32, 32, 6]
    assert table[:4, kernels.COPY_SRC].tolist() == [1000, 1032, 1064, 1096]
    assert table[:4, kernels.COPY_DST].tolist() == [20_000, 20_032, 20_064, 20_096]
    assert table[4:, kernels.COPY_SRC].tolist() == [9001, 9033, 9065]  # the empty copy has no row
    assert ((table[:, kernels.COPY_SRC] - table[:, kernels.COPY_DST]) % 16).tolist() == [8] * 4 + [0] * 3
    assert kernels.copy_table([], [], []).shape == (0, kernels.COPY_COLUMNS)
    with pytest.raises(InvalidUsageError, match="multiple of 16"):
        kernels.copy_table([0], [0], [1], max_row_bytes=24)
    with pytest.raises(InvalidUsageError, match=">= 0"):
        kernels.copy_table([0], [0], [-1])
    with pytest.raises(InvalidUsageError, match="as many"):
        kernels.copy_table([0, 1], [0], [1])


def test_copy_grid_fills_the_device_and_no_more():
    threads = kernels.COPY_THREADS
    assert kernels.copy_grid(None, 1, 1056) == (1056, 1)
    assert kernels.copy_grid(16 * threads * 100, 1, 1056) == (100, 1)   # one word per thread, no more blocks
    assert kernels.copy_grid(16 * threads * 100 + 1, 1, 1056) == (101, 1)
    assert kernels.copy_grid(0, 10, 1056) == (1, 10)
    assert kernels.copy_grid(1 << 30, 300, 1056) == (3, 300)
    assert kernels.copy_grid(1 << 30, 5000, 1056) == (1, 5000)
    assert kernels.copy_grid(1, 10 ** 6, 1056) == (1, kernels.MAX_GRID_Y)
    with pytest.raises(InvalidUsageError):
        kernels.copy_grid(1, 0, 1056)


def test_kernel_constants_match_python():
    source = (SOURCES / "batched_copy.cu").read_text()
    constant = lambda name: int(re.search(rf"constexpr int {name} = (\d+);", source)[1])
    assert constant("kCopyThreads") == kernels.COPY_THREADS
    assert constant("kCopyColumns") == kernels.COPY_COLUMNS
    columns = dict(re.findall(r"kCopy(\w+) = (\d+)", re.search(r"enum CopyColumn \{([^}]*)\}", source)[1]))
    assert (int(columns["Src"]), int(columns["Dst"]), int(columns["Bytes"])) == \
        (kernels.COPY_SRC, kernels.COPY_DST, kernels.COPY_NBYTES)
    assert emulated.library().collectives_emulated_copy_columns() == kernels.COPY_COLUMNS


# -- the comparison can fail ---------------------------------------------------------------

def broken_copy(tmp_path, old, new):
    broken = tmp_path / "kernels"
    shutil.copytree(SOURCES, broken, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    source = (broken / "batched_copy.cu").read_text()
    assert old in source
    (broken / "batched_copy.cu").write_text(source.replace(old, new))
    return emulated.library(broken)


@pytest.mark.slow
@pytest.mark.parametrize("old, new", [
    ("if (w < words) to[w] = word[u];", "if (w + 1 < words) to[w] = word[u];"),   # drops a row's last word
    ("for (long long i = thread; i < head; i += threads)", "for (long long i = thread + 1; i < head; i += threads)"),
], ids=["last word", "first head byte"])  # each builds the emulation library anew: about 4 s
def test_a_broken_kernel_is_caught(tmp_path, old, new):
    lib = broken_copy(tmp_path, old, new)
    rng = np.random.default_rng(6)
    placed, src_size, dst_size = layout([(n, s, d) for n in (17, 4099) for s, d in ((0, 0), (3, 3), (0, 4))])
    src, dst = aligned_bytes(src_size, rng), aligned_bytes(dst_size, rng)
    want = dst.copy()
    for s, d, n in placed:
        want[d:d + n] = src[s:s + n]
    table = kernels.copy_table([src.ctypes.data + s for s, _, _ in placed],
                               [dst.ctypes.data + d for _, d, _ in placed], [n for _, _, n in placed])
    assert lib.collectives_emulated_batched_copy(1, 2, 64, table.ctypes.data, len(table)) == 0
    assert differences(dst, want) is not None, "a broken kernel passed the comparison"


# -- what the CUDA adapter compiles, without a GPU ---------------------------------------------

def test_nvrtc_builds_batched_copy_with_128_bit_accesses(tmp_path, monkeypatch):
    """kernels.nvrtc_cubin, the CUDA adapter's compiler, for sm_90 (NVRTC
    needs no GPU); the SASS of its cubin has the vector path's 128-bit
    global loads and stores and no local memory or generic accesses."""
    pytest.importorskip("cupy", reason="needs CuPy's NVRTC bindings (pip install '.[cuda13]')")
    from cupy.cuda import nvrtc
    try:
        nvrtc.getVersion()
    except Exception as error:  # CuPy without its NVRTC library
        pytest.skip(f"needs NVRTC: {error}")
    sys.path.insert(0, str(SOURCES))
    import check  # kernels/check.py
    monkeypatch.setenv("COLLECTIVES_CACHE_DIR", str(tmp_path))
    cubin, lowered = kernels.nvrtc_cubin(kernels.COPY_INSTANCE, "sm_90", kernels.cuda_include_dirs())
    assert "batched_copy" in lowered
    sass = check.run([check.find_tool("cuobjdump"), "-sass", str(cubin)])
    opcodes = [o for ops in check.sass_instructions(sass).values() for o in ops]
    assert any(o.startswith("LDG.E.128") for o in opcodes) and any(o.startswith("STG.E.128") for o in opcodes)
    assert not [o for o in opcodes if o.startswith(("LDL", "STL")) or re.match(r"^(LD|ST)\.", o)]
    assert kernels.nvrtc_cubin(kernels.COPY_INSTANCE, "sm_90", kernels.cuda_include_dirs()) == (cubin, lowered)


# -- on a GPU ------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_launch_copies_on_a_gpu():
    """Pack arrays of many sizes and alignments (views at odd elements
    included) into a fusion buffer with one launch on a non-default stream,
    unpack with another, and compare with the originals. Runs on an emulated
    device under COLLECTIVES_TEST_DEVICE=emulated, like tests/test_gpu.py."""
    require_gpu()
    rng = np.random.default_rng(7)
    sizes = [0, 1, 15, 16, 17, 4099, 65_536, 65_537, 3 * 2 ** 20 + 5] + [int(n) for n in rng.integers(1, 5000, 300)]
    host = [rng.integers(0, 256, n + 16, dtype=np.uint8) for n in sizes]
    starts = [int(rng.choice([0, 0, 1, 4, 8, 15])) for _ in sizes]
    slots = np.cumsum([0] + [-(-n // 16) * 16 for n in sizes])
    if GPU_DEVICE == "cuda":
        import cupy
        device = open_device("cuda:0")
        put, get, zeros = cupy.asarray, cupy.asnumpy, lambda n: cupy.zeros(n, cupy.uint8)
        address = lambda a: a.data.ptr
        stream = cupy.cuda.Stream(non_blocking=True)
    else:
        device = open_device("emulated:0")
        put, get, zeros = np.array, np.array, lambda n: np.zeros(n, np.uint8)
        address = lambda a: a.ctypes.data
        stream = device.current_stream()
    sources = [put(h)[s:s + n] for h, s, n in zip(host, starts, sizes)]
    fusion = device.allocate(int(slots[-1]))
    outputs = [zeros(n + 16)[s:s + n] for s, n in zip(starts[::-1], sizes)]  # other alignments than the sources
    pack = kernels.copy_table([address(a) for a in sources], fusion.address + slots[:-1], sizes)
    unpack = kernels.copy_table(fusion.address + slots[:-1], [address(o) for o in outputs], sizes)
    pack_table, unpack_table = device.upload(pack), device.upload(unpack)
    grid = kernels.copy_grid(int(pack[:, kernels.COPY_NBYTES].max()), len(pack), device.resident_blocks)
    device.launch_copies(stream, pack_table, len(pack), grid=grid)
    device.launch_copies(stream, unpack_table, len(unpack))
    device.synchronize()
    for i, (h, s, n, o) in enumerate(zip(host, starts, sizes, outputs)):
        assert np.array_equal(get(o), h[s:s + n]), f"array {i}: {n} bytes from offset {s}"
