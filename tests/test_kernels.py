"""The CUDA C kernels, without a GPU.

* The numbers Python and C++ must agree on (columns, sizes, element order,
  compiler options) are read from both sides and compared.
* The step kernel, compiled for the CPU (the emulated device), runs random
  op-table rows, every element type and op, aligned and not, and must give
  what the NumPy interpreter gives, bit for bit; a kernel with one lane
  broken must fail the same comparison.
* nvcc builds every instance (plan_step's, and batched_copy, whose emulated
  runs are tests/test_batched_copy.py's) for sm_80 and sm_90 and
  kernels/check.py finds no spills, no local memory, 128-bit accesses and no
  flushed subnormals.
"""

import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from collectives import CollectiveError, kernels, plan
from collectives.devices import emulated
from collectives.executors import device as device_executor, host
from collectives.ops import BFLOAT16, ReduceOp
from collectives.plan import COPY_OP, REDUCE_FINAL_OP, REDUCE_OP

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ROOT / "kernels"
sys.path.insert(0, str(SOURCES))
import check  # noqa: E402  (kernels/check.py)


# -- one definition on both sides ----------------------------------------------------

def cpp_constant(name, text):
    return int(re.search(rf"constexpr int {name} = (\d+);", text)[1])


def test_kernel_constants_match_python():
    source = (SOURCES / "plan_step.cu").read_text()
    assert cpp_constant("kStepThreads", source) == kernels.STEP_THREADS
    assert cpp_constant("kMaxRanks", source) == kernels.MAX_RANKS
    assert cpp_constant("kBuffers", source) == kernels.BUFFERS == plan.BUFFER_COUNT
    columns = dict(re.findall(r"k(\w+) = (\d+)", re.search(r"enum Column \{([^}]*)\}", source)[1]))
    assert [int(columns[c]) for c in ("Rank", "Kind", "Count", "DstBuf", "DstOff", "NumSrc", "Src0")] == \
        [plan.RANK, plan.KIND, plan.COUNT, plan.DST_BUF, plan.DST_OFF, plan.NSRC, plan.SRC0]
    kinds = dict(re.findall(r"k(\w+) = (\d+)", re.search(r"enum RowKind \{([^}]*)\}", source)[1]))
    assert (int(kinds["Copy"]), int(kinds["Reduce"]), int(kinds["ReduceFinal"])) == (COPY_OP, REDUCE_OP,
                                                                                      REDUCE_FINAL_OP)


def test_codec_constants_match_python():
    from collectives.compression import kernels as codecs
    source = (SOURCES / "codec.cu").read_text()
    header = (SOURCES / "codec.cuh").read_text()
    assert cpp_constant("kCodecThreads", source) == kernels.CODEC_THREADS
    assert cpp_constant("kCodecLanes", source) == kernels.CODEC_LANES
    assert cpp_constant("kBlock", header) == codecs.BLOCK
    names = re.findall(r"k(\w+) = (\d+)", re.search(r"enum Codec \{([^}]*)\}", header)[1])
    assert [(name.lower(), int(value)) for name, value in names] == [(c, codecs.codec_id(c)) for c in codecs.CODECS]
    assert tuple(check.CODEC_NAMES) == codecs.CODECS
    ops = re.findall(r"k(\w+) = (\d+)", re.search(r"enum CodecOp \{([^}]*)\}", source)[1])
    *kernel_ops, copy = ops    # the last is codec_batch's copy row
    assert [int(v) for _, v in kernel_ops] == list(range(len(codecs.KERNELS)))
    assert [re.sub(r"(?<!^)([A-Z])", r"_\1", name).lower() for name, _ in kernel_ops] == list(codecs.KERNELS) \
        == list(check.CODEC_OPS)
    assert copy == ("CodecCopy", str(codecs.COPY))
    assert cpp_constant("kCodecBatchRows", source) == kernels.CODEC_BATCH_ROWS
    row = re.search(r"struct CodecRow \{(.*?)\};", source, re.S)[1]
    assert re.findall(r"(\w+);", re.sub(r"//[^\n]*", "", row)) == [name for name, _ in codecs.CodecRow._fields_]
    flags = dict(re.findall(r"k(\w+) = (\d+)", re.search(r"enum CodecFlag \{([^}]*)\}", source)[1]))
    assert (int(flags["EncodeOut"]), int(flags["WriteOut"])) == (codecs.ENCODE_OUT, codecs.WRITE_OUT)
    fields = re.search(r"struct CodecArgs \{(.*?)\};", source, re.S)[1]
    declared = re.findall(r"(\w+)[,;]", re.sub(r"//[^\n]*", "", fields))
    assert declared == [name for name, _ in codecs.CodecArgs._fields_]


def test_element_order_and_ops_match_python():
    header = (SOURCES / "elements.cuh").read_text()
    listed = re.findall(r"X\((\w+)\)", header[header.index("#define COLLECTIVES_FOR_EACH_ELEMENT"):])
    assert listed == list(kernels.ELEMENTS.values())
    ops = dict(re.findall(r"k(\w+) = (\d+)", re.search(r"enum Op \{([^}]*)\}", header)[1]))
    assert {ReduceOp[name.upper()]: int(code) for name, code in ops.items()} == \
        {op: code for op, code in kernels.OP_CODES.items() if op is not ReduceOp.AVG}


def test_nvcc_and_nvrtc_get_the_same_options():
    cmake = (ROOT / "CMakeLists.txt").read_text()
    flags = re.search(r"set\(COLLECTIVES_NVCC_FLAGS ([^)]*)\)", cmake)[1].split()
    assert [f.lstrip("-") for f in flags] == [f.lstrip("-") for f in kernels.NVRTC_OPTIONS]


# -- the step kernel on the CPU, against the NumPy interpreter --------------------------

DTYPES = [np.dtype(name) if name != "bfloat16" else BFLOAT16 for name in kernels.ELEMENTS]
OPS = list(ReduceOp)
MAX_COUNT = 4099


def random_values(rng, dtype, count):
    """Any bits for integers; for floats, normal values of many magnitudes
    with zeros of both signs, infinities, subnormals and NaNs mixed in."""
    if dtype.kind in "iu":
        return rng.integers(0, 256, count * dtype.itemsize, dtype=np.uint8).view(dtype)
    values = rng.standard_normal(count) * 10.0 ** rng.integers(-8, 8, count)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-45, 6e-8, -6e-5])
    pick = rng.random(count) < 0.1
    values[pick] = rng.choice(specials, pick.sum())
    with np.errstate(over="ignore"):  # large values become infinities in 16-bit types: wanted
        return values.astype(dtype)


class Memory:
    """One flat buffer per (rank, buffer) on the CPU, addressed as the kernel
    addresses them, and the same bytes as NumPy arrays for the interpreter."""

    def __init__(self, rng, dtype, nranks):
        self.dtype = dtype
        size = (MAX_COUNT + 64) * dtype.itemsize
        self.raw = {(r, b): emulated.EmulatedMemory(size) for r in range(nranks) for b in range(kernels.BUFFERS)}
        for memory in self.raw.values():
            memory.array[:] = random_values(rng, dtype, MAX_COUNT + 64).view(np.uint8)

    def addresses(self):
        table = kernels.buffer_table([])
        for (r, b), memory in self.raw.items():
            table[r * kernels.BUFFERS + b] = memory.address
        return table

    def arrays(self):
        return {key: memory.array.copy().view(self.dtype) for key, memory in self.raw.items()}


def random_rows(rng, nranks, dtype, count):
    """A phase of independent rows: each row writes a distinct (rank, buffer)
    and reads from (rank, buffer) pairs no row writes, except that a fold
    may read its own destination first or second, as plans' folds do."""
    rows = []
    lanes = 16 // dtype.itemsize
    targets = [(r, b) for r in range(nranks) for b in range(2)]
    rng.shuffle(targets)
    for dst_rank, dst_buf in targets[:3]:
        nsrc = int(rng.integers(1, 6))
        kind = COPY_OP if nsrc == 1 else int(rng.choice([REDUCE_OP, REDUCE_FINAL_OP]))
        misaligned = rng.random() < 0.5  # half the rows take the scalar path
        offset = lambda: int(rng.integers(0, 4)) * lanes + (int(rng.integers(1, lanes)) if misaligned and lanes > 1 else 0)
        row = [dst_rank, kind, count, dst_buf, offset(), nsrc]
        for _ in range(nsrc):
            row += [int(rng.integers(0, nranks)), int(rng.integers(2, 4)), offset()]  # sources: INPUT, OUTPUT
        if nsrc > 1 and rng.random() < 0.3:  # dst = dst op src, or src op dst
            at = plan.SRC0 + 3 * int(rng.integers(0, 2))
            row[at:at + 3] = [dst_rank, dst_buf, row[plan.DST_OFF]]
        rows.append(row)
    width = plan.SRC0 + 3 * max(r[plan.NSRC] for r in rows)
    return np.array([r + [-1] * (width - len(r)) for r in rows], np.int64)


def fan_out_rows(rng, nranks, dtype, count):
    """A phase of fan-out groups: rows that compute the same fold of the same
    sources (INPUT, OUTPUT) into distinct destinations (WORK, SCRATCH), in
    groups of one size, some destinations misaligned, shuffled."""
    lanes = 16 // dtype.itemsize
    targets = [(r, b) for r in range(nranks) for b in range(2)]
    rng.shuffle(targets)
    fanout = int(rng.integers(2, len(targets) + 1))
    groups = int(rng.integers(1, len(targets) // fanout + 1))
    rows = []
    for g in range(groups):
        nsrc = int(rng.integers(1, 6))
        kind = COPY_OP if nsrc == 1 else int(rng.choice([REDUCE_OP, REDUCE_FINAL_OP]))
        sources = []
        for _ in range(nsrc):
            sources += [int(rng.integers(0, nranks)), int(rng.integers(2, 4)), int(rng.integers(0, 4)) * lanes]
        for dst_rank, dst_buf in targets[g * fanout:(g + 1) * fanout]:
            offset = int(rng.integers(0, 4)) * lanes + (int(rng.integers(1, lanes)) if rng.random() < 0.2 and lanes > 1 else 0)
            rows.append([dst_rank, kind, count, dst_buf, offset, nsrc] + sources)
    width = plan.SRC0 + 3 * max(r[plan.NSRC] for r in rows)
    rows = np.array([r + [-1] * (width - len(r)) for r in rows], np.int64)
    return rows[rng.permutation(len(rows))], fanout


def run_on_emulated_kernel(lib, memory, rows, dtype, op, nranks, grid_x, fanout=1):
    instance = kernels.step_instance(dtype, op, reduces=True)
    table = emulated.EmulatedMemory(rows.nbytes)
    table.array[:] = rows.view(np.uint8).reshape(-1)
    addresses = memory.addresses()  # alive until the call returns
    status = lib.collectives_emulated_plan_step(
        instance.element_index, instance.op_code, grid_x, len(rows) // fanout, 64, table.address, rows.shape[1],
        addresses.ctypes.data, kernels.step_divisor(op, nranks), fanout)
    assert status == 0


def same_bits_or_both_nan(got, want):
    bits = np.dtype(f"u{got.dtype.itemsize}")
    if got.dtype.kind in "iu":
        return np.array_equal(got.view(bits), want.view(bits))
    nan_got, nan_want = np.isnan(got.astype(np.float64)), np.isnan(want.astype(np.float64))
    return np.array_equal(nan_got, nan_want) and np.array_equal(got.view(bits)[~nan_got], want.view(bits)[~nan_want])


def fuzz(lib, seed, cases, fanning_out=False):
    """Mismatches between the emulated kernel and the interpreter over
    `cases` random phases of every element type and op; with `fanning_out`,
    phases of fan-out groups, which the kernel runs as the executor sorts
    them (executors/device.py, fan_out)."""
    rng = np.random.default_rng(seed)
    mismatches = []
    for case in range(cases):
        dtype, op = DTYPES[case % len(DTYPES)], OPS[case // len(DTYPES) % len(OPS)]
        nranks = int(rng.integers(1, 5))
        count = int(rng.choice([0, 1, 7, 15, 16, 17, 33, 100, 1000, MAX_COUNT]))
        memory = Memory(rng, dtype, nranks)
        if fanning_out:
            rows, fanout = fan_out_rows(rng, nranks, dtype, count)
            sorted_rows, found = device_executor.fan_out(rows)
            assert found == fanout, (found, fanout)
        else:
            rows = sorted_rows = random_rows(rng, nranks, dtype, count)
            fanout = 1
        want = memory.arrays()
        host.execute(rows, lambda r, b: want[r, b], op, nranks)
        run_on_emulated_kernel(lib, memory, sorted_rows, dtype, op, nranks, grid_x=int(rng.integers(1, 4)),
                               fanout=fanout)
        got = memory.arrays()
        for key in want:
            if not same_bits_or_both_nan(got[key], want[key]):
                mismatches.append(f"{dtype} {op.value} count={count} buffer {key}")
    return mismatches


def test_emulated_step_kernel_matches_the_numpy_interpreter():
    assert fuzz(emulated.library(), seed=1, cases=1200) == []


def test_fan_out_groups_write_every_destination_as_the_interpreter_does():
    assert fuzz(emulated.library(), seed=2, cases=600, fanning_out=True) == []


@pytest.mark.slow
def test_a_kernel_that_writes_only_the_first_row_of_a_group_is_caught(tmp_path):
    """The fan-out comparison can fail: the same sources, but only the
    group's first destination is written."""
    broken = tmp_path / "kernels"
    shutil.copytree(SOURCES, broken, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    source = (broken / "plan_step.cu").read_text()
    loop = "for (int d = 0; d < fanout; ++d) {"
    assert source.count(loop) == 1
    (broken / "plan_step.cu").write_text(source.replace(loop, "for (int d = 0; d < 1; ++d) {"))
    assert fuzz(emulated.library(broken), seed=2, cases=120, fanning_out=True), \
        "a kernel that skips fan-out destinations passed the comparison"


@pytest.mark.slow
def test_a_kernel_with_one_broken_lane_is_caught(tmp_path):
    """The comparison above can fail: the same sources, but combine_into
    skips the last lane of every 16-byte pack."""
    broken = tmp_path / "kernels"
    shutil.copytree(SOURCES, broken, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    source = (broken / "plan_step.cu").read_text()
    loop = "for (int i = 0; i < int(16 / sizeof(S)); ++i)\n            set_lane"
    assert loop in source
    (broken / "plan_step.cu").write_text(source.replace(loop, loop.replace("i < int(16 / sizeof(S))",
                                                                           "i < int(16 / sizeof(S)) - 1")))
    mismatches = fuzz(emulated.library(broken), seed=1, cases=240)
    assert mismatches, "a kernel that drops a lane passed the comparison"


def test_a_compile_error_shows_the_failing_source_line(tmp_path):
    broken = tmp_path / "kernels"
    shutil.copytree(SOURCES, broken, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    header = (broken / "elements.cuh").read_text()
    (broken / "elements.cuh").write_text(header.replace("enum Op {", "enum Op { not C++;", 1))
    with pytest.raises(CollectiveError, match=r"(?s)building the emulated kernels failed.*elements.cuh:\d+: "
                                              r"enum Op \{ not C\+\+;"):
        emulated.library(broken)
    log = "plan_step.cu(3): error: expected a declaration"  # NVRTC's form
    assert (SOURCES / "plan_step.cu").read_text().splitlines()[2].strip() in kernels.describe_compile_error(log)


# -- nvcc, ptxas and the SASS ------------------------------------------------------------

@pytest.mark.slow
def test_nvcc_build_passes_the_static_checks(tmp_path, capsys):
    """Every instance for sm_80 and sm_90 (and compute_90 PTX), with the
    pinned nvcc of the test extra."""
    assert check.main(["--build-dir", str(tmp_path / "build"), "--json", str(tmp_path / "report.json")]) == 0, \
        capsys.readouterr().out
    out = capsys.readouterr().out
    assert "plan_step<BFloat16, 0>" in out and "all clean" in out
    assert re.search(r"^batched_copy +\d+ +\d+$", out, re.M), out  # registers on sm_80 and sm_90
    for codec in check.CODEC_NAMES:          # the codecs: every instance, checked like the others
        for op in check.CODEC_OPS:
            assert re.search(rf"^codec_kernel<{codec}, {op}> +\d+ +\d+$", out, re.M), out
    print(out)


def test_nvrtc_builds_the_codec_kernels_with_their_wide_accesses(tmp_path, monkeypatch):
    """kernels.nvrtc_cubin, the CUDA adapter's compiler, builds every codec
    instance for sm_90 (NVRTC needs no GPU), with the wide accesses
    check.py wants of the nvcc build, and no local memory or generic access."""
    pytest.importorskip("cupy", reason="needs CuPy's NVRTC bindings (pip install '.[cuda13]')")
    from cupy.cuda import nvrtc
    try:
        nvrtc.getVersion()
    except Exception as error:  # CuPy without its NVRTC library
        pytest.skip(f"needs NVRTC: {error}")
    monkeypatch.setenv("COLLECTIVES_CACHE_DIR", str(tmp_path))
    from collectives.compression import kernels as codecs
    for codec in range(len(codecs.CODECS)):
        for op in range(len(codecs.KERNELS)):
            instance = kernels.CodecInstance(codec, op)
            cubin, lowered = kernels.nvrtc_cubin(instance, "sm_90", kernels.cuda_include_dirs())
            sass = check.run([check.find_tool("cuobjdump"), "-sass", str(cubin)])
            (kernel, opcodes), = [(k, o) for (k, _), o in check.sass_instructions(sass).items()]
            assert kernel == lowered and check.short(kernel) == f"codec_kernel<{codecs.CODECS[codec]}, " \
                                                                   f"{codecs.KERNELS[op]}>"
            for wanted in check.wanted_accesses(kernel):
                assert wanted in opcodes, (instance, wanted)
            assert not [o for o in opcodes if o.startswith(("LDL", "STL")) or re.match(r"^(LD|ST)\.", o)], instance


def test_static_checks_flag_what_they_promise_to():
    usage = check.resource_usage(
        "ptxas info    : Compiling entry function 'k' for 'sm_90'\n"
        "ptxas info    : Function properties for k\n"
        "    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 32 registers, used 0 barriers\n")
    assert usage == {("k", "sm_90"): {"stack": 8, "spill_stores": 4, "spill_loads": 4, "registers": 32}}
    sass = check.sass_instructions(
        "\tcode for sm_90\n\t\tFunction : _ZN11collectives9plan_stepINS_7Float32ELi0EEEvv\n"
        "        /*0010*/                   LDL R1, [R2] ;\n"
        "        /*0020*/                   LD.E.128 R4, desc[UR4][R2.64] ;\n"
        "\tcode for sm_80\n\t\tFunction : _ZN11collectives12batched_copyEPKxi\n"
        "        /*0010*/                   LDG.E.U8 R1, [R2] ;\n"
        "\tcode for sm_90\n\t\tFunction : _ZN11collectives12codec_kernelILi1ELi2EEEvNS_9CodecArgsE\n"
        "        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;\n"
        "        /*0020*/                   LDG.E.64 R8, desc[UR4][R6.64] ;\n"
        "        /*0030*/                   STG.E.128 desc[UR4][R2.64], R4 ;\n"
        "        /*0040*/                   STG.E desc[UR4][R6.64], R8 ;\n")
    flushing = check.ptx_flushing(".visible .entry k(\n\tadd.rn.ftz.f32 %f1, %f2, %f3;\n")
    fused = check.ptx_fused(".visible .entry k(\n\tfma.rn.f32 %f1, %f2, %f3, %f4;\n\tmul.rn.f32 %f1, %f2, %f3;\n")
    assert fused == {"k": ["fma.rn.f32 %f1, %f2, %f3, %f4;"]}
    found = "\n".join(check.problems(usage, sass, flushing, fused))
    for symptom in ("spill", "local memory", "generic", "no LDG.E.128", "no STG.E.128", "flushes subnormals",
                    "batched_copy on sm_80: no LDG.E.128", "no plan_step kernel in the build",
                    "no batched_copy kernel in the build", "no codec_kernel kernel in the build",
                    "codec_kernel<fp16, decode_add> on sm_90: no STG.E.64", "fused multiply-adds"):
        assert symptom in found, symptom
