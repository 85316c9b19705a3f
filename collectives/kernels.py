"""The CUDA C kernels in kernels/: where they are, how their instances are
named, and how they are compiled.

Importing this module compiles nothing. The CUDA adapter compiles the
instance a call needs with NVRTC (`nvrtc_cubin`, cached on disk) and loads
it with `cupy.RawModule`; the emulated device compiles every instance once
with the host C++ compiler (devices/emulated.py). The numbers below mirror
kernels/*.cu, and tests/test_kernels.py and tests/test_batched_copy.py check
that they agree.

Why not `RawModule(code=...)`: CuPy adds -ftz=true to every NVRTC compile,
and flushing subnormal float32 values to zero changes bfloat16 and float32
results (an H100 showed it against NumPy); and CuPy's cache key covers the
source it is given, not the headers that source includes.
"""

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .errors import CollectiveError, InvalidUsageError
from .ops import ReduceOp, as_dtype

STEP_THREADS = 256   # kStepThreads: threads per block of plan_step
MAX_RANKS = 64       # kMaxRanks: ranks a buffer table addresses
BUFFERS = 4          # kBuffers: WORK, SCRATCH, INPUT, OUTPUT per rank

# batched_copy (kernels/batched_copy.cu): a table of (src, dst, nbytes) rows.
COPY_THREADS = 256   # kCopyThreads: threads per block of batched_copy
COPY_COLUMNS = 3     # kCopyColumns: int64 per row
COPY_SRC, COPY_DST, COPY_NBYTES = 0, 1, 2   # enum CopyColumn
# copy_table splits longer copies into rows of this many bytes, so that rows
# are comparable and the kernel's rows x blocks grid is balanced (see
# batched_copy.cu). One block alone copies 64 KiB in about four of its loop
# iterations (256 threads x 4 x 16 bytes each), microseconds, so a long row
# among many short ones no longer holds the launch up.
COPY_ROW_BYTES = 1 << 16
MAX_GRID_Y = 65535   # CUDA's limit on gridDim.y; batched_copy's blocks walk rows beyond it

# COLLECTIVES_FOR_EACH_ELEMENT, in order: NumPy dtype name -> C++ element type.
ELEMENTS = {
    "int8": "Int8", "int16": "Int16", "int32": "Int32", "int64": "Int64",
    "uint8": "Uint8", "uint16": "Uint16", "uint32": "Uint32", "uint64": "Uint64",
    "float16": "Float16", "bfloat16": "BFloat16", "float32": "Float32", "float64": "Float64",
}
ELEMENT_INDEX = {name: i for i, name in enumerate(ELEMENTS)}

# collectives::Op. avg folds as sum; its division happens in REDUCE_FINAL rows.
OP_CODES = {ReduceOp.SUM: 0, ReduceOp.PROD: 1, ReduceOp.MAX: 2, ReduceOp.MIN: 3, ReduceOp.AVG: 0}

# Copies do not look at values, so collectives that only copy use the
# unsigned type of the same width: fewer instances to compile.
_COPY_ELEMENT = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}


class StepInstance(NamedTuple):
    """One instance of plan_step: an element type and an op."""
    element: str       # NumPy dtype name
    op_code: int

    @property
    def name_expression(self):
        return f"collectives::plan_step<collectives::{ELEMENTS[self.element]}, {self.op_code}>"

    @property
    def element_index(self):
        return ELEMENT_INDEX[self.element]

    @property
    def source(self):
        return "plan_step.cu"


class CopyInstance(NamedTuple):
    """batched_copy, not a template, so its one instance: named the way
    nvrtc_cubin and the CUDA adapter name plan_step's instances."""
    name_expression: str = "collectives::batched_copy"
    source: str = "batched_copy.cu"


COPY_INSTANCE = CopyInstance()

# The compression codecs (kernels/codec.cu): codec_kernel<codec, op>, one
# group of CODEC_LANES threads per block of 32 elements.
CODEC_THREADS = 256  # kCodecThreads: threads per block of codec_kernel
CODEC_LANES = 8      # kCodecLanes: threads per block of 32 elements


class CodecInstance(NamedTuple):
    """One instance of codec_kernel: a codec id (compression/kernels.py:
    codec_id) and an op (enum CodecOp; compression/kernels.py: KERNELS)."""
    codec: int
    op: int

    @property
    def name_expression(self):
        return f"collectives::codec_kernel<{self.codec}, {self.op}>"

    @property
    def source(self):
        return "codec.cu"


CODEC_BATCH_ROWS = 40  # kCodecBatchRows: the rows one codec_batch launch holds


class CodecBatchInstance(NamedTuple):
    """One instance of codec_batch: a codec id. Its rows say what each does."""
    codec: int

    @property
    def name_expression(self):
        return f"collectives::codec_batch<{self.codec}>"

    @property
    def source(self):
        return "codec.cu"


class CodecSumInstance(NamedTuple):
    """One instance of codec_round_sum: a codec id."""
    codec: int

    @property
    def name_expression(self):
        return f"collectives::codec_round_sum<{self.codec}>"

    @property
    def source(self):
        return "codec.cu"


def codec_grid(n, resident_blocks):
    """Blocks of CODEC_THREADS for codec_kernel over n >= 1 elements: the
    blocks the device runs at once, fewer when the work has fewer groups of
    32 elements than that many blocks have lanes for (the grid-stride loop
    does the rest). Never 0: CUDA refuses an empty grid."""
    needed = -(-(-(-int(n) // 32) * CODEC_LANES) // CODEC_THREADS)
    return max(1, min(int(resident_blocks), needed))


def step_instance(dtype, op, reduces):
    """The plan_step instance for a call; `reduces` is False for collectives
    whose plans only copy (allgather, broadcast)."""
    if not reduces:
        return StepInstance(_COPY_ELEMENT[dtype.itemsize], OP_CODES[ReduceOp.SUM])
    return StepInstance(dtype.name, OP_CODES[op])


def step_divisor(op, nranks):
    """plan_step's `divisor` argument: avg divides in REDUCE_FINAL rows."""
    return nranks if op is ReduceOp.AVG else 0


def source_dir():
    """The kernel sources: collectives/kernel_sources when installed, the
    repository's kernels/ in a source checkout (and an editable install)."""
    package = Path(__file__).resolve().parent
    for candidate in (package / "kernel_sources", package.parent / "kernels"):
        if (candidate / "plan_step.cu").is_file():
            return candidate
    raise CollectiveError(f"the kernel sources (kernels/plan_step.cu) are missing beside {package}")


@functools.lru_cache(maxsize=None)
def kernel_source(name):
    """The text of kernels/<name>, as NVRTC compiles it."""
    return (source_dir() / name).read_text()


def step_source():
    return kernel_source("plan_step.cu")


def copy_table(sources, destinations, nbytes, max_row_bytes=COPY_ROW_BYTES):
    """The table batched_copy reads, int64 of shape (rows, COPY_COLUMNS):
    copy i moves nbytes[i] bytes from address sources[i] to destinations[i].
    A copy longer than `max_row_bytes` becomes several rows of that many
    bytes (the last one shorter); an empty copy becomes no row. Rows of one
    copy start at multiples of max_row_bytes, a multiple of 16, so each row
    keeps the copy's alignment and takes the same path through the kernel.
    No destination may overlap a source or another destination; sources
    may be shared (batched_copy.cu)."""
    src = np.asarray(sources, np.int64).reshape(-1)
    dst = np.asarray(destinations, np.int64).reshape(-1)
    n = np.asarray(nbytes, np.int64).reshape(-1)
    if not len(src) == len(dst) == len(n):
        raise InvalidUsageError(f"copy_table needs as many destinations and byte counts as sources, got "
                                f"{len(src)} sources, {len(dst)} destinations, {len(n)} byte counts")
    if (n < 0).any():
        raise InvalidUsageError(f"copy_table: byte counts must be >= 0, got {int(n.min())}")
    if max_row_bytes < 16 or max_row_bytes % 16:
        raise InvalidUsageError(f"copy_table: max_row_bytes must be a positive multiple of 16, got {max_row_bytes}")
    pieces = -(-n // max_row_bytes)                  # rows per copy: 0 for an empty one
    copy = np.repeat(np.arange(len(n)), pieces)      # the copy each row belongs to
    first = np.cumsum(pieces) - pieces               # each copy's first row
    offset = (np.arange(len(copy)) - first[copy]) * max_row_bytes
    table = np.empty((len(copy), COPY_COLUMNS), np.int64)
    table[:, COPY_SRC] = src[copy] + offset
    table[:, COPY_DST] = dst[copy] + offset
    table[:, COPY_NBYTES] = np.minimum(n[copy] - offset, max_row_bytes)
    return table


def copy_grid(nbytes_longest_row, rows, resident_blocks):
    """(blocks per row, rows of blocks) for batched_copy over `rows` >= 1
    rows: together about the blocks the device runs at once, and no more
    blocks per row than the longest row has 16-byte words for one per thread
    (None: not known, the device's share only). gridDim.y stops at
    MAX_GRID_Y; the kernel's blocks then walk several rows each."""
    if rows < 1:
        raise InvalidUsageError(f"copy_grid needs at least one row, got {rows}")
    per_row = max(1, resident_blocks // rows)
    if nbytes_longest_row is not None:
        words = -(-int(nbytes_longest_row) // 16)
        per_row = min(per_row, max(1, -(-words // COPY_THREADS)))
    return (per_row, min(rows, MAX_GRID_Y))


def copy_launch_grid(table, rows, grid, resident_blocks):
    """What a device's launch_copies checks before it queues anything: the
    grid to launch (`grid`, or copy_grid's for an unknown longest row), or
    None when there are no rows (CUDA refuses an empty grid; nothing to do)."""
    if not isinstance(rows, (int, np.integer)) or isinstance(rows, bool) or not 0 <= rows < 2 ** 31:
        raise InvalidUsageError(f"launch_copies: rows must be an int in [0, 2**31), got {rows!r}")
    needed = int(rows) * COPY_COLUMNS * 8
    if table.nbytes < needed:
        raise InvalidUsageError(f"launch_copies: {rows} rows need a table of {needed} bytes, "
                                f"this one has {table.nbytes}")
    if rows == 0:
        return None
    if grid is None:
        return copy_grid(None, int(rows), resident_blocks)
    grid = tuple(int(g) for g in grid)
    if len(grid) != 2 or not 1 <= grid[0] < 2 ** 31 or not 1 <= grid[1] <= MAX_GRID_Y:
        raise InvalidUsageError(f"launch_copies: grid must be (1 .. 2**31-1, 1 .. {MAX_GRID_Y}), got {grid}")
    return grid


# Every float operation exactly as written and IEEE: no FMA contraction, no
# flushing of subnormals, correctly rounded division.
NVRTC_OPTIONS = ("--std=c++17", "--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true")


def cxx_compiler(why):
    """The C++ compiler that builds what the library builds at first use:
    $CXX, else g++, else c++ (its path); CollectiveError(`why`) without one."""
    found = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if found is None:
        raise CollectiveError(why)
    return found


@contextlib.contextmanager
def build_lock(target):
    """An exclusive lock on `target`'s lock file for the block (the file
    stays: removing it would race): one build of what the cache keeps, for
    the processes that ask at once."""
    with open(f"{target}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def cache_dir():
    """Where compiled kernels are kept: $COLLECTIVES_CACHE_DIR, else
    $XDG_CACHE_HOME/collectives, else ~/.cache/collectives."""
    base = os.environ.get("COLLECTIVES_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "collectives")
    return Path(base)


def sources_digest(source=None):
    """A hash of every kernel source file: a change to any header rebuilds."""
    digest = hashlib.sha256()
    source = Path(source or source_dir())
    for path in sorted([*source.glob("*.cu"), *source.glob("*.cuh"), *(source / "emulation").glob("*.[ch]*")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def nvrtc_cubin(instance, arch, include_dirs, defines=()):
    """(path of a cubin holding `instance` (a StepInstance, COPY_INSTANCE or CodecInstance)
    for `arch` like "sm_90", its lowered name), compiled with NVRTC through
    CuPy's bindings and cached on disk by sources, options, NVRTC version
    and instance."""
    from cupy.cuda import nvrtc

    options = [*NVRTC_OPTIONS, *defines, f"--gpu-architecture={arch}", f"-I{source_dir()}",
               *(f"-I{d}" for d in include_dirs)]
    key = hashlib.sha256(json.dumps([sources_digest(), options, nvrtc.getVersion(), instance.name_expression])
                         .encode()).hexdigest()[:24]
    stem = Path(instance.source).stem
    cubin, name_file = cache_dir() / f"{stem}-{key}.cubin", cache_dir() / f"{stem}-{key}.name"
    if cubin.exists() and name_file.exists():
        return cubin, name_file.read_text()
    program = nvrtc.createProgram(kernel_source(instance.source), instance.source, [], [])
    try:
        nvrtc.addNameExpression(program, instance.name_expression)
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError:
            raise CollectiveError(f"compiling {instance.name_expression} for {arch} failed:\n"
                                  + describe_compile_error(nvrtc.getProgramLog(program))) from None
        lowered = nvrtc.getLoweredName(program, instance.name_expression)
        binary = _cubin(program)
    finally:
        nvrtc.destroyProgram(program)
    cubin.parent.mkdir(parents=True, exist_ok=True)
    for path, data in ((cubin, binary), (name_file, lowered.encode())):
        with tempfile.NamedTemporaryFile(dir=cubin.parent, delete=False) as f:
            f.write(data)
        os.replace(f.name, path)  # atomic: concurrent compilers all leave a whole file
    return cubin, lowered


def cuda_include_dirs():
    """Directories holding cuda_fp16.h and its <nv/target>: the CUDA 13
    wheels (nvidia-cuda-runtime, nvidia-cuda-cccl) or an installed toolkit."""
    found = []
    try:
        import nvidia
        for root in map(Path, nvidia.__path__):
            for flavour in sorted(root.glob("cu*")):
                include = flavour / "include"
                found.append(include)
    except ImportError:
        pass
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(variable):
            found.append(Path(os.environ[variable]) / "include")
    found.append(Path("/usr/local/cuda/include"))
    headers = list(dict.fromkeys(d for d in found if (d / "cuda_fp16.h").is_file()))
    if not headers:
        raise CollectiveError(
            "no CUDA headers (cuda_fp16.h) found: install the toolchain wheels with "
            "pip install -e '.[test]' in a checkout or pip install 'collectives[test]', "
            "or set CUDA_HOME to a CUDA toolkit")
    # CUDA 13 keeps CCCL (<nv/target>, which cuda_fp16.h includes) in include/cccl.
    return [d for include in headers for d in (include, include / "cccl") if d.is_dir()]


def _cubin(program):
    """The cubin of a compiled NVRTC program. CuPy 14.2's nvrtc.getCUBIN
    returned a byte short of nvrtcGetCUBINSize (and cuobjdump rejected the
    result), so this asks the library CuPy loaded, through ctypes."""
    import ctypes
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libnvrtc.so" in line and "builtins" not in line}
    if not paths:
        raise CollectiveError("NVRTC is not loaded (CuPy loads it on its first compile)")
    library = ctypes.CDLL(sorted(paths)[0])
    size = ctypes.c_size_t()
    if library.nvrtcGetCUBINSize(ctypes.c_void_p(program), ctypes.byref(size)) != 0:
        raise CollectiveError("nvrtcGetCUBINSize failed")
    buffer = ctypes.create_string_buffer(size.value)
    if library.nvrtcGetCUBIN(ctypes.c_void_p(program), buffer) != 0:
        raise CollectiveError("nvrtcGetCUBIN failed")
    return buffer.raw


# file(line) as NVRTC writes it, file:line: as g++ and nvcc do.
_LOCATION = re.compile(r"(?P<file>[\w./-]+\.(?:cuh?|h|cpp))(?:\((?P<line>\d+)\)|:(?P<gline>\d+):)")


def describe_compile_error(log, source=None):
    """A compiler log with each file and line it names followed by that line
    of the kernel sources in `source` (by default the library's own)."""
    source = Path(source or source_dir())
    out = []
    for line in str(log).splitlines():
        out.append(line)
        match = _LOCATION.search(line)
        if match:
            name = Path(match["file"]).name
            path = next((p for p in (source / name, source / "emulation" / name) if p.is_file()), None)
            number = int(match["line"] or match["gline"])
            if path is not None:
                lines = path.read_text().splitlines()
                if 0 < number <= len(lines):
                    out.append(f"    {name}:{number}: {lines[number - 1].strip()}")
    return "\n".join(out)


def buffer_table(addresses):
    """The BufferTable argument: MAX_RANKS * BUFFERS byte addresses."""
    table = np.zeros(MAX_RANKS * BUFFERS, np.uint64)
    table[:len(addresses)] = addresses
    return table


# -- ll_allreduce (kernels/ll_allreduce.cu): the one-kernel small collectives ------

LL_THREADS = 256           # kLLThreads: threads per block on a GPU
LL_GRID_BLOCKS = 32        # kLLGridBlocks: blocks of every launch on a GPU (the grid is fixed: the state words)
LL_STATE_SLOTS = LL_GRID_BLOCKS * LL_THREADS   # kLLStateSlots: a rank's state words, one per thread of the grid
LL_MAX_RANKS = 64          # kLLMaxRanks: ranks whose LL areas the arguments name
LL_MAX_BYTES = 64 << 10    # kLLMaxBytes: payload of one call
LL_LINE_BYTES = 16         # 8 payload bytes and two 32-bit flags
LL_SLOT_SETS = 2
LL_SCRUB_PERIOD = 1 << 14  # kLLScrubPeriod: calls between scrubs of a slot set's unpublished lines
LL_STATE_OFFSET = LL_SLOT_SETS * (LL_MAX_BYTES // 8) * LL_LINE_BYTES   # bytes: the slot sets, then the state
LL_BARRIER_OFFSET = LL_STATE_OFFSET + 8 * LL_STATE_SLOTS   # bytes: ll_barrier's word (symmetric calls)
LL_AREA_BYTES = LL_BARRIER_OFFSET + 16   # one rank's area (16: the barrier word, padded)
LL_FAULT_TIMED_OUT, LL_FAULT_STOPPED, LL_FAULT_MISMATCH = 1, 2, 3   # enum LLFault


class LLBarrierInstance(NamedTuple):
    """ll_barrier, not a template: its one instance (as COPY_INSTANCE)."""
    name_expression: str = "collectives::ll_barrier"
    source: str = "ll_allreduce.cu"


LL_BARRIER_INSTANCE = LLBarrierInstance()


class LLInstance(NamedTuple):
    """One instance of ll_allreduce: an element type and an op."""
    element: str       # NumPy dtype name
    op_code: int

    @property
    def name_expression(self):
        return f"collectives::ll_allreduce<collectives::{ELEMENTS[self.element]}, {self.op_code}>"

    @property
    def element_index(self):
        return ELEMENT_INDEX[self.element]

    @property
    def source(self):
        return "ll_allreduce.cu"


def ll_instance(dtype, op):
    return LLInstance(dtype.name, OP_CODES[op])


def ll_lines(nbytes):
    """LL lines of a message: 8 payload bytes each."""
    return -(-nbytes // 8)


class LLAllreduceArgs(ctypes.Structure):
    """The kernel's one argument, struct LLAllreduceArgs, field for field."""
    _fields_ = [
        ("input", ctypes.c_uint64), ("output", ctypes.c_uint64), ("count", ctypes.c_int64),
        ("timeout_ns", ctypes.c_uint64), ("abort_word", ctypes.c_uint64), ("faults", ctypes.c_uint64),
        ("rank", ctypes.c_int32), ("nranks", ctypes.c_int32), ("divisor", ctypes.c_int32),
        ("signature", ctypes.c_uint32), ("collective", ctypes.c_int32), ("root", ctypes.c_int32),
        ("areas", ctypes.c_uint64 * LL_MAX_RANKS),
    ]


# enum LLCollective: what an LL call computes, args.collective.
LL_COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")


class LLShape(NamedTuple):
    """How a call's input lies in a rank's LL slot set: `chunks` chunks of
    `count` elements (args.count), each on `lines` lines (the grid's lines)."""
    collective: int    # index in LL_COLLECTIVES
    count: int
    chunks: int
    lines: int

    @property
    def fits(self):
        return self.chunks * self.lines <= LL_MAX_BYTES // 8


def ll_shape(collective, nranks, count, itemsize):
    """The LLShape of a call whose plan has `count` elements in each rank's
    WORK buffer: the message, or nranks blocks for reduce_scatter (every rank
    publishes all of them; rank r reads block r) and allgather (every rank
    publishes its own block)."""
    code = LL_COLLECTIVES.index(collective)
    chunk = count // nranks if collective in ("reduce_scatter", "allgather") else count
    chunks = nranks if collective == "reduce_scatter" else 1
    return LLShape(code, chunk, chunks, ll_lines(chunk * itemsize))


def ll_signature(count, dtype, op, collective="allreduce", root=0):
    """16 bits that differ (but for one in 65535) between calls of another
    collective, count, dtype, op or root: the low half of each LL flag.
    Never 0: a call whose generation is a multiple of 65536 would otherwise
    have flag 0, which is also what a line nobody ever wrote holds (zeroed
    memory), so a reader would take the zeros for that call's data."""
    text = f"{collective} {count} {as_dtype(dtype).name} {int(OP_CODES[op])} {op} {root}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=2).digest(), "little") % 0xFFFF + 1


class LLState(NamedTuple):
    """A state word of a rank's LL area, decoded (ll_state in the kernel):
    what one thread of the grid knows of the rank's last call."""
    generation: int    # the call's, mod 2**32 (0: none yet)
    signature: int
    lines: int


def ll_state(word):
    word &= (1 << 64) - 1
    return LLState(word & 0xffffffff, (word >> 32) & 0xffff, word >> 48)


class LLFault(NamedTuple):
    """A nonzero fault word, decoded (LLWatch::record)."""
    reason: int        # LL_FAULT_*
    peer: int          # the rank named, or -1
    generation: int    # the call's, mod 2**32
    collective: str    # the call's, a name of LL_COLLECTIVES


def ll_fault(word):
    word &= (1 << 64) - 1
    code = (word >> 24) & 0xff
    # ll_barrier's faults (calls on symmetric memory) add SYMMETRIC_FAULT_CODE.
    symmetric, index = divmod(code, 16)
    if index < len(LL_COLLECTIVES) and symmetric in (0, 1):
        name = LL_COLLECTIVES[index] + (" on symmetric memory" if symmetric else "")
    else:
        name = f"collective {code}"
    return LLFault(word & 0xff, ((word >> 8) & 0xffff) - 1, word >> 32, name)
