"""kernels/ll_allreduce.cu on the emulated device, driven directly: real
processes (fork), each running the kernel for a sequence of calls on LL
areas in shared memory, against the NumPy interpreter's bits.

No communicator is involved: the test plays the host's part itself (fills
each call's arguments, launches on the device's fixed grid, reads the fault
words; the kernel counts the calls in its state words), so a broken copy of
the kernel source can run in its place. Every call has random
dtype, op, size (0 to the capacity, odd ones included), in place or not, and
random delays between calls on every rank, so ranks drift in and out of
step and both slot sets are reused many times.

The multi-process tests through the communicator (mpiexec, timeouts, a
killed rank) are in tests/test_ll_mpi.py.
"""

import ctypes
import mmap
import multiprocessing
import os
import queue
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

import collectives
from cases import all_dtypes
from collectives import kernels
from collectives.devices import emulated
from collectives.ops import ReduceOp
from collectives.transport.layout import LL_FAULT, LL_REGION_WORDS

SOURCES = Path(kernels.source_dir())
DTYPES = all_dtypes()
OPS = ("sum", "prod", "max", "min", "avg")
COLLECTIVES = kernels.LL_COLLECTIVES


def call_sequence(seed, calls, n, kinds=COLLECTIVES):
    """The calls every rank makes: (collective, dtype, op, count, in place,
    root), `count` elements per rank's block for reduce_scatter and
    allgather (whose input is n blocks, or one), else the message's."""
    rng = np.random.default_rng(seed)
    sequence = []
    for _ in range(calls):
        collective = kinds[rng.integers(len(kinds))]
        dtype = DTYPES[rng.integers(len(DTYPES))]
        lines = kernels.LL_MAX_BYTES // 8 // (n if collective == "reduce_scatter" else 1)   # per block
        capacity = lines * 8 // dtype.itemsize
        count = int(rng.choice([0, 1, 2, 3, 7, int(rng.integers(1, 300)), int(rng.integers(1, capacity + 1)),
                                capacity]))
        sequence.append((collective, dtype, OPS[rng.integers(len(OPS))], count, bool(rng.integers(2)),
                         int(rng.integers(n))))
    return sequence


def rank_input(seed, call, rank, dtype, count):
    """Rank `rank`'s input of a call: random bits for integers, random
    values for floats (no NaN, so the bits compare)."""
    rng = np.random.default_rng([seed, call, rank])
    if dtype.kind in "iu":
        return rng.integers(0, 256, count * dtype.itemsize, dtype=np.uint8).view(dtype)
    return (rng.standard_normal(count) * 4).astype(dtype)


def arrays_of(collective, rank, n, x, in_place):
    """The rank's input and output as the communicator passes them (in place:
    reduce_scatter's output is the rank's block of x, allgather's x its
    block of the output); a reduce's output starts as its input, which the
    other ranks must leave as it was."""
    if collective == "reduce_scatter":
        k = x.size // n
        return x, x[rank * k:(rank + 1) * k] if in_place else np.empty(k, x.dtype)
    if collective == "allgather":
        out = np.empty(n * x.size, x.dtype)
        if not in_place:
            return x, out
        out[rank * x.size:(rank + 1) * x.size] = x
        return out[rank * x.size:(rank + 1) * x.size], out
    if collective == "reduce":
        return x, x if in_place else x.copy()
    return x, x if in_place else np.empty(x.size, x.dtype)


def interpreted(reference, collective, inputs, op, root):
    """Every rank's result by the `direct` plan on host ranks (NumPy)."""
    inputs = [x.copy() for x in inputs]
    if collective == "allreduce":
        return reference.allreduce(inputs, op=op, algorithm="direct")
    if collective == "reduce_scatter":
        return reference.reduce_scatter(inputs, op=op, algorithm="direct")
    if collective == "allgather":
        return reference.allgather(inputs, algorithm="direct")
    if collective == "broadcast":
        return reference.broadcast(inputs, root=root, algorithm="direct")
    return reference.reduce(inputs, root=root, op=op, algorithm="direct")


def run_rank(library, rank, n, seed, calls, areas, control, timeout_s, delays, kinds=COLLECTIVES):
    """One rank's calls, as the executor makes them; returns the calls whose
    result differs from the NumPy interpreter's, and a fault if a kernel gave up."""
    base = ctypes.addressof(ctypes.c_char.from_buffer(areas))
    control_base = ctypes.addressof(ctypes.c_char.from_buffer(control))
    faults = np.frombuffer(control, np.int64, offset=8).reshape(n, LL_REGION_WORDS)[:, LL_FAULT]
    args = kernels.LLAllreduceArgs()
    args.areas[:n] = [base + q * kernels.LL_AREA_BYTES for q in range(n)]
    args.abort_word, args.faults = control_base, control_base + 8
    args.rank, args.nranks = rank, n
    args.timeout_ns = int(timeout_s * 1e9)
    rng = np.random.default_rng([seed, rank, 1])
    wrong = []
    with collectives.Communicator.local(n) as reference:
        for call, (collective, dtype, op, count, in_place, root) in enumerate(
                call_sequence(seed, calls, n, kinds)):
            elements = n * count if collective == "reduce_scatter" else count   # each rank's x
            work = n * count if collective in ("reduce_scatter", "allgather") else count   # the plan's count
            inputs = [rank_input(seed, call, q, dtype, elements) for q in range(n)]
            x, out = arrays_of(collective, rank, n, inputs[rank].copy(), in_place)
            shape = kernels.ll_shape(collective, n, work, dtype.itemsize)
            assert shape.fits, (collective, count, dtype)
            if delays and rng.random() < 0.3:
                time.sleep(rng.random() * 2e-4)
            if shape.lines:   # an empty call launches nothing (the executor's rule)
                args.input, args.output, args.count = x.ctypes.data, out.ctypes.data, shape.count
                args.collective, args.root = shape.collective, root
                args.signature = kernels.ll_signature(work, dtype, ReduceOp(op), collective, root)
                reducing = collective in ("allreduce", "reduce_scatter", "reduce")
                args.divisor = kernels.step_divisor(ReduceOp(op), n) if reducing else 0
                instance = kernels.ll_instance(dtype, ReduceOp(op) if reducing else ReduceOp.SUM)
                status = library.collectives_emulated_ll_allreduce(instance.element_index, instance.op_code,
                                                                   emulated.LL_BLOCKS, emulated.LL_THREADS,
                                                                   ctypes.byref(args))
                assert status == 0, status
                if faults.any():
                    return wrong, [kernels.ll_fault(int(w)) for w in faults]
            want = interpreted(reference, collective, inputs, op, root)[rank]
            if out.tobytes() != want.tobytes():
                wrong.append((call, collective, dtype.name, op, count, in_place, root))
    return wrong, None


# How long run_ranks waits for a rank's result. Each kernel's waits are
# bounded by timeout_s, so only a rank that stopped making progress outside
# them (or a machine starved for minutes) takes this long. At 60 s,
# test_a_flag_stored_before_its_data_is_caught failed twice on the 2-core
# machine, both times while other jobs loaded it; a failure now names the
# ranks that did not report.
RESULTS_TIMEOUT_S = 180


def run_ranks(library, n, seed, calls, timeout_s=5.0, delays=True, kinds=COLLECTIVES):
    """Every rank in a process of its own; what each found, by rank."""
    areas = mmap.mmap(-1, n * kernels.LL_AREA_BYTES)        # shared, zeroed
    control = mmap.mmap(-1, 8 + n * LL_REGION_WORDS * 8)    # the abort word, then the fault words
    context = multiprocessing.get_context("fork")
    results = context.Queue()

    def rank_main(rank):
        try:
            results.put((rank, run_rank(library, rank, n, seed, calls, areas, control, timeout_s, delays,
                                        kinds)))
        except BaseException as error:  # noqa: BLE001 - reported to the parent
            results.put((rank, ([repr(error)], None)))
        finally:
            results.close()
            results.join_thread()   # the queue's feeder thread has sent it
            os._exit(0)

    processes = [context.Process(target=rank_main, args=(rank,)) for rank in range(n)]
    for p in processes:
        p.start()
    found = {}
    deadline = time.monotonic() + RESULTS_TIMEOUT_S
    try:
        while len(found) < n:
            try:
                rank, outcome = results.get(timeout=1.0)
            except queue.Empty:
                # A rank exits 0 once it has reported: any other exit is a crash.
                crashed = [(r, p.exitcode) for r, p in enumerate(processes) if p.exitcode not in (None, 0)]
                missing = sorted(set(range(n)) - set(found))
                if crashed or time.monotonic() > deadline:
                    reason = f"crashed: {crashed}" if crashed else f"none within {RESULTS_TIMEOUT_S} s"
                    raise AssertionError(f"no result from ranks {missing} ({reason}); those that reported: {found}")
                continue
            found[rank] = outcome
    finally:
        for p in processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return found


@pytest.mark.processes
@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_kernel_gives_the_interpreters_bits_across_processes(n):
    # All five collectives mixed: a call's slot-reuse wait (step 1) looks at
    # lines of the previous call, whatever collective and shape it had.
    found = run_ranks(emulated.library(), n, seed=n, calls=60)
    assert found == {rank: ([], None) for rank in range(n)}


@pytest.mark.processes
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_each_collective_alone_gives_the_interpreters_bits(collective):
    found = run_ranks(emulated.library(), 3, seed=17, calls=30, kinds=(collective,))
    assert found == {rank: ([], None) for rank in range(3)}


@pytest.mark.processes
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_a_stalled_rank_makes_the_others_give_up_and_name_it(collective):
    # Rank n - 1 makes three calls, the others five: the others' kernels
    # time out waiting for it (a fault word naming it), they do not hang. A
    # rank that reads nobody's lines in its fourth call (a broadcast's root,
    # a reduce's other ranks) waits for it in its fifth call's step 1.
    library = emulated.library()
    n, timeout_s, seed = 3, 0.5, 11
    assert call_sequence(seed, 4, n, (collective,))[3][3] > 0   # the call the stalled rank misses has lines
    areas = mmap.mmap(-1, n * kernels.LL_AREA_BYTES)
    control = mmap.mmap(-1, 8 + n * LL_REGION_WORDS * 8)
    context = multiprocessing.get_context("fork")
    results = context.Queue()

    def rank_main(rank):
        calls = 3 if rank == n - 1 else 5
        start = time.perf_counter()
        outcome = run_rank(library, rank, n, seed, calls, areas, control, timeout_s, delays=False,
                           kinds=(collective,))
        results.put((rank, outcome, time.perf_counter() - start))
        results.close()
        results.join_thread()
        os._exit(0)

    processes = [context.Process(target=rank_main, args=(rank,)) for rank in range(n)]
    for p in processes:
        p.start()
    found = {rank: (outcome, elapsed) for rank, outcome, elapsed in (results.get(timeout=60) for _ in processes)}
    for p in processes:
        p.join(timeout=10)
    for rank in range(n - 1):
        (wrong, faults), elapsed = found[rank]
        assert wrong == [] and faults is not None, found
        assert elapsed < timeout_s + 1.5, found   # the whole run: three calls before the one that waits
        timed_out = [f for f in faults if f.reason == kernels.LL_FAULT_TIMED_OUT]
        assert timed_out and all(f.peer == n - 1 and f.collective == collective for f in timed_out), faults


def broken_copy(tmp_path, old, new):
    """The kernel sources with `old` replaced by `new` in ll_allreduce.cu."""
    broken = tmp_path / "kernels"
    shutil.copytree(SOURCES, broken, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    source = (broken / "ll_allreduce.cu").read_text()
    assert source.count(old) == 1, old
    (broken / "ll_allreduce.cu").write_text(source.replace(old, new))
    return broken


PUBLISH = "sys_store_line(ll_line(args.areas[args.rank], set, i), tag | (word & 0xffffffffull), tag | (word >> 32));"


@pytest.mark.slow
@pytest.mark.processes
def test_a_flag_stored_before_its_data_is_caught(tmp_path):
    # The LL rule broken: the flag goes out in a store of its own, before the
    # data (a yield between the two stands for the delay a GPU may put
    # there). A reader that sees the flag takes zeros for the data.
    flag_first = ("{ unsigned long long* line = ll_line(args.areas[args.rank], set, i);"
                  " sys_store_line(line, tag, tag); sched_yield();"
                  " sys_store_line(line, tag | (word & 0xffffffffull), tag | (word >> 32)); }")
    library = emulated.library(broken_copy(tmp_path, PUBLISH, flag_first))
    for collective in COLLECTIVES:   # every read of step 3: a fold, a block's fold, copies
        found = run_ranks(library, 3, seed=5, calls=40, delays=False, kinds=(collective,))
        assert any(wrong for wrong, _ in found.values()), (collective, found)


STATE_STORE = "*state = ll_state(generation, args.signature, lines);"


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.parametrize("collective", ["allreduce", "broadcast"])
def test_a_kernel_that_does_not_advance_its_state_is_caught(tmp_path, collective):
    # The device-side generation broken: the state word is read but never
    # written back, so every call is call 1 (set 1, flag F(1), no slot-reuse
    # wait). Readers take the previous call's lines for this one's (wrong
    # bits) or see another call's signature under the same generation (a
    # mismatch fault), which the host reports.
    library = emulated.library(broken_copy(tmp_path, STATE_STORE, "(void)lines;"))
    found = run_ranks(library, 3, seed=23, calls=40, timeout_s=2.0, kinds=(collective,))
    assert any(wrong or faults for wrong, faults in found.values()), found


def nvrtc_library():
    """NVRTC from NVIDIA's wheels (the `test` extra brings it), by ctypes:
    CuPy's bindings need a GPU-capable install this test does not."""
    try:
        import nvidia
    except ImportError:
        pytest.skip("no NVIDIA wheels: pip install '.[test]'")
    for root in map(Path, nvidia.__path__):
        for candidate in sorted(root.glob("cu*/lib/libnvrtc.so*")):
            return ctypes.CDLL(str(candidate))
    pytest.skip("no libnvrtc in the NVIDIA wheels")


@pytest.mark.parametrize("dtype, op", [("float16", "sum"), ("bfloat16", "max"), ("int8", "prod"), ("float64", "min")])
def test_nvrtc_compiles_the_instances_the_cuda_device_asks_for(dtype, op):
    # What CudaDevice._function does first (kernels.nvrtc_cubin), minus CuPy:
    # the source, its name expression, the options; no warning either.
    nvrtc = nvrtc_library()
    instance = kernels.ll_instance(np.dtype(dtype), ReduceOp(op))
    program = ctypes.c_void_p()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(program), kernels.kernel_source(instance.source).encode(),
                                    instance.source.encode(), 0, None, None) == 0
    try:
        assert nvrtc.nvrtcAddNameExpression(program, instance.name_expression.encode()) == 0
        options = [*kernels.NVRTC_OPTIONS, "--gpu-architecture=sm_90", f"-I{kernels.source_dir()}",
                   *(f"-I{d}" for d in kernels.cuda_include_dirs())]
        status = nvrtc.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(
            *[o.encode() for o in options]))
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(program, log)
        assert status == 0 and "warning" not in log.value.decode(), log.value.decode()
        lowered = ctypes.c_char_p()
        assert nvrtc.nvrtcGetLoweredName(program, instance.name_expression.encode(), ctypes.byref(lowered)) == 0
        assert b"ll_allreduce" in lowered.value
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))


def test_the_cuda_adapter_launches_the_kernel_with_its_arguments_and_grid():
    # devices/cuda.py's launch_ll_allreduce on the dry stand-in for CuPy
    # (devices/dry_cuda.py): the struct reaches cuLaunchKernel whole, as
    # its one parameter, on the fixed grid: one line per thread at the capacity.
    from collectives.devices.dry_cuda import dry_devices
    dry, (device,) = dry_devices(1)
    launched = []

    def launch_kernel(function, gx, gy, gz, bx, by, bz, shared, stream, parameters, extra):
        pointer = ctypes.c_uint64.from_address(parameters).value   # kernelParams[0]: the struct
        launched.append(((gx, gy, gz), (bx, by, bz), kernels.LLAllreduceArgs.from_buffer_copy(
            (ctypes.c_char * ctypes.sizeof(kernels.LLAllreduceArgs)).from_address(pointer))))

    dry.cuda.driver.launchKernel = launch_kernel
    args = kernels.LLAllreduceArgs(input=0x1000, output=0x2000, count=5, signature=0xabcd, rank=1, nranks=2)
    args.areas[:2] = [0x10000, 0x20000]
    instance = kernels.ll_instance(np.dtype(np.float32), ReduceOp.SUM)
    for count in (3, 300, kernels.LL_MAX_BYTES // 4):
        args.count = count
        device.launch_ll_allreduce(device.current_stream(), instance, args)
        assert bytes(launched[-1][2]) == bytes(args)
    # One grid for every size: each thread keeps the rank's call count in a
    # state word of its own, one per thread of this grid.
    grids = {(grid, block) for grid, block, _ in launched}
    assert grids == {((kernels.LL_GRID_BLOCKS, 1, 1), (kernels.LL_THREADS, 1, 1))}
    assert kernels.LL_GRID_BLOCKS * kernels.LL_THREADS == kernels.LL_STATE_SLOTS == kernels.LL_MAX_BYTES // 8


def test_a_signature_is_never_zero(monkeypatch):
    """A flag is (generation mod 2^16) << 16 | signature: with a zero
    signature, every 65536th call's flag would be 0, the value of a line
    nobody wrote. A hash of 0 is mapped elsewhere; others stay distinct."""
    class ZeroHash:
        def __init__(self, text, digest_size):
            self.digest_size = digest_size

        def digest(self):
            return bytes(self.digest_size)

    with monkeypatch.context() as patched:
        patched.setattr(kernels.hashlib, "blake2b", ZeroHash)
        assert kernels.ll_signature(8, np.float32, ReduceOp.SUM) != 0
    signatures = {kernels.ll_signature(count, np.float32, ReduceOp.SUM) for count in range(1, 2000)}
    assert 0 not in signatures and max(signatures) <= 0xFFFF and len(signatures) > 1900


class TwoRanksInThreads:
    """Two ranks' LL areas in one process, each rank's kernel launched from
    a thread of its own (ctypes lets go of the GIL, so they run at once),
    and the host's state words set by hand to jump ahead in generations."""

    SMALL = ("allreduce", np.dtype(np.float32), 1)   # the calls jumped over: 1-element allreduces

    def __init__(self, library):
        self.library, self.n = library, 2
        self.areas = np.zeros(self.n * kernels.LL_AREA_BYTES // 8, np.uint64)
        self.control = np.zeros(1 + self.n * LL_REGION_WORDS, np.int64)

    def signature(self, collective, dtype, count):
        return kernels.ll_signature(count, dtype, ReduceOp.SUM, collective, 0)

    def jump(self, generation):
        """Every rank as after calls generation - 1 and generation, both
        1-element allreduces: the state words, and line 0 of each set."""
        words_per_area, lines_per_set = kernels.LL_AREA_BYTES // 8, kernels.LL_MAX_BYTES // 8
        signature = self.signature(*self.SMALL)
        for q in range(self.n):
            base = q * words_per_area
            for g in (generation - 1, generation):
                tag = (((g & 0xFFFF) << 16) | signature) << 32
                line = base + (g % kernels.LL_SLOT_SETS) * lines_per_set * 2
                self.areas[line:line + 2] = (tag | 0x3F800000, tag)
            state = base + kernels.LL_STATE_OFFSET // 8
            self.areas[state:state + emulated.LL_BLOCKS * emulated.LL_THREADS] = \
                generation | signature << 32 | 1 << 48

    def launch(self, rank, x, out, timeout_s):
        args = kernels.LLAllreduceArgs()
        args.areas[:self.n] = [self.areas.ctypes.data + q * kernels.LL_AREA_BYTES for q in range(self.n)]
        args.abort_word, args.faults = self.control.ctypes.data, self.control.ctypes.data + 8
        args.rank, args.nranks, args.timeout_ns = rank, self.n, int(timeout_s * 1e9)
        args.input, args.output, args.count = x.ctypes.data, out.ctypes.data, x.size
        args.collective, args.root, args.divisor = kernels.LL_COLLECTIVES.index("allreduce"), 0, 0
        args.signature = self.signature("allreduce", x.dtype, x.size)
        instance = kernels.ll_instance(x.dtype, ReduceOp.SUM)
        assert self.library.collectives_emulated_ll_allreduce(
            instance.element_index, instance.op_code, emulated.LL_BLOCKS, emulated.LL_THREADS, ctypes.byref(args)) == 0

    def allreduce(self, inputs, absent_rank=None, timeout_s=5.0):
        """The ranks' allreduce of `inputs` (but rank `absent_rank`'s, which
        never comes); their outputs, and the fault words."""
        import threading
        outs = [np.zeros_like(x) for x in inputs]
        threads = [threading.Thread(target=self.launch, args=(q, inputs[q], outs[q], timeout_s))
                   for q in range(self.n) if q != absent_rank]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        return outs, [kernels.ll_fault(int(w)) for w in self.control[1:].reshape(self.n, -1)[:, LL_FAULT] if w]


def test_no_line_gets_old_enough_to_pass_for_the_current_call():
    """A flag keeps 16 bits of the generation. A 20-element allreduce as
    call 65536 leaves lines 1..9 of slot set 0 that no 1-element call
    touches; as call 131072 the same allreduce has the same flag there, and
    a rank ahead of its late peer would take those lines for the peer's
    data (and lines never written, zero, would look like a different call
    as call 65536). The scrub (every LL_SCRUB_PERIOD calls, the unpublished
    lines of each set get an old flag) must make it wait instead (here:
    until it gives up, as its peer never comes).
    Generations are jumped over by hand, never across a scrub: real calls
    make the scrubs the jumps land between."""
    ranks = TwoRanksInThreads(emulated.library())
    small = [np.ones(1, np.float32), np.ones(1, np.float32)]

    def small_calls_across_a_scrub(scrubbed):   # set 0 is scrubbed at `scrubbed`, set 1 at the next call
        ranks.jump(scrubbed - 2)
        for _ in range(4):
            outs, faults = ranks.allreduce(small)
            assert not faults and all((o == 2).all() for o in outs), (scrubbed, faults)

    ranks.jump(9)   # the 20-element call early on too: without a scrub, its lines would still be there
    outs, faults = ranks.allreduce([np.full(20, 5, np.float32), np.full(20, 5, np.float32)])
    assert not faults and all((o == 10).all() for o in outs), faults
    small_calls_across_a_scrub(3 * kernels.LL_SCRUB_PERIOD)   # 49152
    ranks.jump(65535)
    outs, faults = ranks.allreduce([np.full(20, 1, np.float32), np.full(20, 2, np.float32)])
    assert not faults and all((o == 3).all() for o in outs), faults
    small_calls_across_a_scrub(5 * kernels.LL_SCRUB_PERIOD)   # 81920
    ranks.jump(131070)
    assert not ranks.allreduce(small)[1]
    # Rank 1 never makes the call: rank 0 must time out waiting for it, and
    # take no line of rank 1's for this call's (10 + 2: call 65536's).
    outs, faults = ranks.allreduce([np.full(20, 10, np.float32), np.full(20, 20, np.float32)], absent_rank=1,
                                   timeout_s=0.3)
    assert [(f.reason, f.peer) for f in faults] == [(kernels.LL_FAULT_TIMED_OUT, 1)], faults
    assert not (outs[0] == 12).any(), f"rank 0 took 65536-calls-old lines for its absent peer's: {outs[0]}"
