"""The emulated device: our CUDA kernels run on the CPU, behind the same
interface as a GPU (see __init__.py).

Kernels: kernels/*.cu compiled by the host C++ compiler against
kernels/emulation/cuda_host.h. Its launcher (emulation/launch.cpp) runs every
(block, thread) of a thread-independent kernel (plan_step, batched_copy)
one after another, and the threads of each CUDA block of a kernel that
shuffles values between threads (the codecs, kernels/codec.cu) as fibers
that meet at every shuffle. The library is built on first use and cached on
disk, keyed by the sources, the compiler and the flags.

Memory: NumPy buffers; NumPy arrays are the device arrays.

Streams and events: work is queued, not run, when it is issued. When a
collective returns (or on synchronize) the queues drain in a random order
that respects only what CUDA promises: order within a stream, and a wait on
an event holds its stream until the work before the matching record is done.
So an executor that forgets a cross-device wait gets wrong answers here too,
not just on a GPU. COLLECTIVES_EMULATED_SEED fixes the order's seed. A
kernel that waits for another kernel's writes (the one-kernel collectives)
runs on a thread of its own meanwhile, as kernels of two GPUs run at once.
"""

import ctypes
import hashlib
import os
import queue
import random
import subprocess
import tempfile
import threading
from collections import deque
from pathlib import Path

import numpy as np

from .. import kernels
from ..compression import kernels as codecs
from ..errors import CollectiveError, InvalidUsageError
from ..transport.layout import LL_REGION_WORDS
from ..transport.segments import Segment
from . import Device

RESIDENT_BLOCKS = 2  # a small grid: every emulated thread strides over more elements
# ll_allreduce's grid: each thread's waits for its peers are a handshake
# between processes, so few threads, each striding over many lines. The
# same for every call, small or not: each thread keeps the rank's call
# count in a state word of its own (kernels/ll_allreduce.cu).
LL_BLOCKS, LL_THREADS = 2, 4


class EmulatedMemory:
    """Device memory of an emulated device: a 256-byte aligned NumPy buffer."""

    def __init__(self, nbytes):
        self._buffer = np.zeros(nbytes + 256, np.uint8)
        start = (-self._buffer.ctypes.data) % 256
        self.array = self._buffer[start:start + nbytes]
        self.address = self.array.ctypes.data
        self.nbytes = nbytes


class EmulatedSharedMemory:
    """Memory that emulated devices in other processes open: CUDA IPC done
    with a host rank's kind of segment (transport/segments.py: anonymous
    shared memory, no file in /dev/shm, gone with the last process that
    maps it), whose name is the handle."""

    def __init__(self, segment):
        self.segment = segment
        self.array = np.frombuffer(segment.buf, np.uint8)  # page-aligned, like cudaMalloc's
        self.address = self.array.ctypes.data
        self.nbytes = self.array.nbytes
        self.handle = segment.handle

    def release(self, own):
        self.array = None  # the last view, so the mapping can close
        self.segment.release()  # own or not: the memory goes with its last mapping


class EmulatedEvent:
    def __init__(self):
        self.records = 0     # records issued
        self.completed = 0   # records whose preceding work has run


class EmulatedStream:
    def __init__(self, device):
        self.device = device
        self.queue = deque()
        self.capturing = False   # while True, the queue is a graph being recorded: nothing runs

    def __repr__(self):
        return f"<EmulatedStream of {self.device.name}>"


# The kinds of queued operation: SPIN is a kernel that may wait for another to run.
LAUNCH, SPIN, RECORD, WAIT = "launch", "spin", "record", "wait"


class _Engine:
    """Every emulated stream of the process, drained together.

    Most work runs on the draining thread, one operation at a time. A
    kernel that waits for another kernel to write its memory (SPIN: the
    one-kernel collectives, whose ranks on several devices of one process
    wait for each other's flags) runs on a thread of its own, as kernels of
    different streams run at once on GPUs: its stream holds until it ends,
    the other streams go on meanwhile, so the kernel it waits for can run."""

    def __init__(self):
        self.streams = []
        self.lock = threading.Lock()
        self.random = None   # the drain order's generator, made at the first drain (not at import)

    def drain(self):
        with self.lock:
            running = {}                 # stream -> its SPIN operation's thread
            ended = queue.SimpleQueue()  # (stream, the exception it raised or None), as threads end
            try:
                self._drain(running, ended)
            finally:
                # Nothing runs on once drain returns or raises (after a failure,
                # a kernel that waits for one that will not run now gives up at
                # its timeout); what ran leaves its queue.
                for stream, thread in running.items():
                    thread.join()
                    if stream.queue:
                        stream.queue.popleft()

    def _drain(self, running, ended):
        while True:
            busy = [s for s in self.streams if s.queue and not s.capturing and s not in running]
            ready = [s for s in busy if _ready(s.queue[0])]
            if not ready:
                if running:   # a spinning kernel may end, and record what a queue waits on
                    self._ended(running, *ended.get())
                    continue
                if not busy:
                    return
                for s in busy:
                    s.queue.clear()
                raise CollectiveError(
                    "emulated streams deadlocked: every queue waits on an event that is never recorded "
                    f"({', '.join(map(repr, busy))})")
            if not ended.empty():   # streams freed meanwhile: look again with them
                while not ended.empty():
                    self._ended(running, *ended.get())
                continue
            if len(busy) == 1 and not running:
                # One stream: its own order is the only order there is, and
                # a kernel on it has no kernel of this process to wait for.
                work = busy[0].queue
                while work and _ready(work[0]):
                    self._run(work.popleft())
                continue
            if self.random is None:
                seed = os.environ.get("COLLECTIVES_EMULATED_SEED")
                self.random = random.Random(int(seed) if seed else None)
            stream = self.random.choice(ready)
            if stream.queue[0][0] == SPIN:
                running[stream] = thread = threading.Thread(
                    target=self._spin, args=(stream, stream.queue[0], ended), name=f"collectives-emulated-{stream!r}",
                    daemon=True)
                thread.start()
                continue
            self._run(stream.queue.popleft())

    def _spin(self, stream, operation, ended):
        try:
            operation[1](*operation[2:])
        except BaseException as error:   # noqa: BLE001 - the draining thread raises it
            ended.put((stream, error))
        else:
            ended.put((stream, None))

    def _ended(self, running, stream, error):
        running.pop(stream).join()
        stream.queue.popleft()
        if error is not None:
            self._failed()
            raise error

    def _run(self, operation):
        try:
            operation[1](*operation[2:])
        except BaseException:
            self._failed()
            raise

    def _failed(self):
        for s in self.streams:  # what was queued behind a failure never runs
            s.queue.clear()


def _ready(operation):
    if operation[0] == WAIT:
        event, generation = operation[2], operation[3]
        return event.completed >= generation
    return True


def _complete(event, generation):
    event.completed = max(event.completed, generation)


def _nothing(*_):
    pass


def _run_copy(dst, src):
    np.copyto(_host_view(dst), _host_view(src))


def _host_view(region):
    """A NumPy array over an emulated device's memory (compression.wire.Region)."""
    if region is None:
        return None
    dtype = np.dtype(region.dtype)
    if region.count == 0:
        return np.empty(0, dtype)
    raw = (ctypes.c_uint8 * (region.count * dtype.itemsize)).from_address(region.address)
    return np.frombuffer(raw, dtype)


_ENGINE = _Engine()


class EmulatedDevice(Device):
    def __init__(self, index):
        self.index = index
        self.name = f"emulated:{index}"
        self.resident_blocks = RESIDENT_BLOCKS
        self.ll_grid_threads = LL_BLOCKS * LL_THREADS   # ll_allreduce's fixed grid: the state words it uses
        self.array_location = "host"  # NumPy arrays are this device's arrays
        self._library = library()
        self._default_stream = self.new_stream()
        self._current = self._default_stream
        self._last_addresses = (None, 0)  # (buffer table, its address), kept alive while queued

    def __repr__(self):
        return f"<EmulatedDevice {self.name}>"

    # -- memory -----------------------------------------------------------

    def allocate(self, nbytes):
        return EmulatedMemory(nbytes)

    def allocate_shared(self, nbytes, name):
        return EmulatedSharedMemory(Segment(name, nbytes, create=True))

    def open_shared(self, handle):
        return EmulatedSharedMemory(Segment(handle.rstrip(b"\0").decode()))

    def release_shared(self, memory, own):
        memory.release(own)

    def wrap_shared(self, memory, shape, dtype):
        """An array of `shape` and `dtype` at the start of shared memory
        (symmetric memory: Communicator.alloc). It keeps the mapping alive:
        release_shared leaves a mapping with views to its last view."""
        count = int(np.prod(shape, dtype=np.int64))
        return np.frombuffer(memory.segment.buf, dtype, count).reshape(shape)

    def empty(self, shape, dtype):
        """An array of this device's ranks (NumPy: the emulated device's memory is the host's)."""
        return np.empty(shape, dtype)

    def from_host(self, array):
        """A copy of a NumPy array as an array of this device's ranks."""
        return np.array(array)

    def to_host(self, array):
        """A NumPy copy of an array of this device's ranks, once the work on it is done."""
        return np.array(array)

    def upload(self, array):
        memory = EmulatedMemory(array.nbytes)
        memory.array[:] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        return memory

    # -- streams ------------------------------------------------------------

    def new_stream(self):
        stream = EmulatedStream(self)
        with _ENGINE.lock:
            _ENGINE.streams.append(stream)
        return stream

    def current_stream(self):
        return self._current

    def use(self):
        pass  # its arrays are NumPy arrays: there is nothing to make current

    def launch_step(self, stream, instance, grid, table, width, addresses, divisor, fanout=1):
        if addresses is not self._last_addresses[0]:
            if addresses.flags.writeable:  # the caller may reuse it before this runs
                addresses = np.array(addresses, np.uint64)
            self._last_addresses = (addresses, addresses.ctypes.data)
        stream.queue.append((LAUNCH, self._run_step, instance, grid, table, width, self._last_addresses, divisor,
                             fanout))

    def _run_step(self, instance, grid, table, width, addresses, divisor, fanout):
        status = self._library.collectives_emulated_plan_step(
            instance.element_index, instance.op_code, grid[0], grid[1], kernels.STEP_THREADS,
            table.address, width, addresses[1], divisor, fanout)
        if status != 0:
            raise CollectiveError(f"the emulated plan_step rejected {instance} (status {status})")

    def launch_copies(self, stream, table, rows, grid=None):
        # Checked now, run when the stream drains: a bad call queues nothing.
        grid = kernels.copy_launch_grid(table, rows, grid, self.resident_blocks)
        if grid is not None:  # the queued tuple keeps `table` alive until it has run
            stream.queue.append((LAUNCH, self._run_copies, grid, table, int(rows)))

    def _run_copies(self, grid, table, rows):
        status = self._library.collectives_emulated_batched_copy(grid[0], grid[1], kernels.COPY_THREADS,
                                                                 table.address, rows)
        if status != 0:
            raise CollectiveError(f"the emulated batched_copy rejected grid {grid} (status {status})")

    def launch_codec(self, stream, kernel, codec, args, divisor):
        # kernels/codec.cu compiled for the CPU, its warp shuffles run by
        # fibers (emulation/launch.cpp), when the stream drains; "copy" moves
        # the bytes of one region into another.
        if kernel == "copy":
            stream.queue.append((LAUNCH, _run_copy, *args))
            return
        launch = codecs.device_launch(kernel, codec, args, divisor)   # checked now: a bad call queues nothing
        if launch is not None:
            instance, parameters, n = launch
            grid = kernels.codec_grid(n, self.resident_blocks)
            stream.queue.append((LAUNCH, self._run_codec, instance, grid, parameters))

    def _run_codec(self, instance, grid, parameters):
        status = self._library.collectives_emulated_codec(instance.codec, instance.op, grid, kernels.CODEC_THREADS,
                                                          ctypes.byref(parameters))
        if status != 0:
            raise CollectiveError(f"the emulated codec_kernel rejected {instance} (status {status})")

    def launch_codec_batch(self, stream, codec, rows):
        # kernels/codec.cu's codec_batch compiled for the CPU, as launch_codec's kernels.
        if not rows or len(rows) > kernels.CODEC_BATCH_ROWS:
            raise InvalidUsageError(f"a codec batch holds 1 to {kernels.CODEC_BATCH_ROWS} rows, got {len(rows)}")
        grid = codecs.batch_grid(rows, self.resident_blocks)
        # A GPU runs a launch's blocks in no set order. Here the rows run last
        # first: a batch holding two rows that must keep their order (one
        # reads or overwrites what the other writes) then gives wrong bits
        # instead of passing because the emulator happened to run them in order.
        stream.queue.append((LAUNCH, self._run_codec_batch, codecs.codec_id(codec), grid,
                             codecs.batch_arguments(rows[::-1])))

    def _run_codec_batch(self, codec, grid, batch):
        status = self._library.collectives_emulated_codec_batch(codec, grid[0], grid[1], kernels.CODEC_THREADS,
                                                                ctypes.byref(batch))
        if status != 0:
            raise CollectiveError(f"the emulated codec_batch rejected codec {codec}, grid {grid} (status {status})")

    def launch_codec_round_sum(self, stream, codec, inputs, outputs, n, divisor):
        # kernels/codec.cu's codec_round_sum compiled for the CPU, its shuffles run by fibers.
        args = codecs.round_sum_arguments(inputs, outputs, n, divisor)   # checked now: a bad call queues nothing
        if n:
            grid = kernels.codec_grid(n, self.resident_blocks)
            stream.queue.append((LAUNCH, self._run_codec_round_sum, codecs.codec_id(codec), grid, args))

    def _run_codec_round_sum(self, codec, grid, args):
        status = self._library.collectives_emulated_codec_round_sum(codec, grid, kernels.CODEC_THREADS,
                                                                    ctypes.byref(args))
        if status != 0:
            raise CollectiveError(f"the emulated codec_round_sum rejected codec {codec}, grid {grid} (status {status})")

    def new_event(self):
        return EmulatedEvent()

    def record(self, event, stream):
        event.records += 1
        stream.queue.append((RECORD, _complete, event, event.records))

    def wait(self, stream, event):
        if event.records:  # as in CUDA, waiting for an event never recorded is no wait
            stream.queue.append((WAIT, _nothing, event, event.records))

    def query(self, event):
        # Like cudaEventQuery, but the work runs when asked about: drain, then look.
        _ENGINE.drain()
        return event.completed >= event.records

    def enable_peer_access(self, other):
        pass  # one address space

    def is_capturing(self, stream):
        return stream.capturing

    # -- the one-kernel collectives between processes (kernels/ll_allreduce.cu) ---

    def clear_shared(self, memory):
        """Zero shared memory before peers see it (a new segment already is)."""
        memory.array[:] = 0

    def map_host(self, address, nbytes):
        """The address at which kernels reach host memory: the same, here."""
        return address

    def unmap_host(self, address):
        pass

    def download(self, address, nbytes):
        """`nbytes` of device memory at `address`, once the work issued so far is done."""
        _ENGINE.drain()
        return ctypes.string_at(address, nbytes)

    def launch_ll_allreduce(self, stream, instance, args):
        """ll_allreduce<instance> on its fixed grid; `args` is copied now
        (kernels.LLAllreduceArgs), so the caller may change it at once."""
        stream.queue.append((SPIN, self._run_ll, instance, (LL_BLOCKS, LL_THREADS),
                             type(args).from_buffer_copy(args)))

    def _run_ll(self, instance, grid, args):
        status = self._library.collectives_emulated_ll_allreduce(instance.element_index, instance.op_code,
                                                                 grid[0], grid[1], ctypes.byref(args))
        if status != 0:
            raise CollectiveError(f"the emulated ll_allreduce rejected {instance} (status {status})")

    def launch_ll_barrier(self, stream, args):
        """ll_barrier (one thread); `args` is copied now."""
        stream.queue.append((SPIN, self._run_ll_barrier, None, (1, 1), type(args).from_buffer_copy(args)))

    def _run_ll_barrier(self, _, grid, args):
        self._library.collectives_emulated_ll_barrier(ctypes.byref(args))

    # -- graphs: what is queued while capturing is recorded, not run --------------

    def begin_capture(self):
        """Make a new stream current and record what is issued on it."""
        stream = self.new_stream()
        stream.capturing = True
        previous, self._current = self._current, stream
        return stream, previous

    def end_capture(self, capture):
        """Stop recording; the recorded operations, replayable in order."""
        stream, previous = capture
        self._current = previous
        recorded, stream.queue = tuple(stream.queue), deque()
        stream.capturing = False
        return recorded

    def replay(self, graph):
        """Issue a recorded graph on the current stream; it completes before
        this returns, as every call on this device does."""
        self._current.queue.extend(graph)
        _ENGINE.drain()

    def synchronize(self):
        _ENGINE.drain()

    def call_returned(self):
        # NumPy arrays are this device's arrays and the caller reads them
        # right away, so a collective completes before it returns.
        _ENGINE.drain()


# -- the library ---------------------------------------------------------------

_LOADED = {}


def library(source=None):
    """The emulation library built from the kernel sources in `source` (by
    default the library's own): built on first use, then cached on disk."""
    source = Path(source or kernels.source_dir())
    if source not in _LOADED:
        _LOADED[source] = _load(_build(source))
    return _LOADED[source]


def compiler():
    return kernels.cxx_compiler("the emulated device needs a C++ compiler (g++ or $CXX) to build its kernels")


# The two translation units of the library: the thread-independent kernels
# (plan_step, batched_copy, the codecs) and the one-kernel collectives.
UNITS = ("launch.cpp", "ll_launch.cpp")


def compile_flags(source):
    return ["-std=c++17", "-O2", "-ffp-contract=off", "-fno-strict-aliasing", "-fPIC",
            "-include", str(source / "emulation" / "cuda_host.h"), *[f"-I{d}" for d in kernels.cuda_include_dirs()]]


def _build(source):
    """The library's path in the cache, built if it is not there. Built
    once however many processes ask at once (a lock per library), and from
    objects cached per translation unit, keyed by the unit's preprocessed
    text: a copy of the sources changed in one kernel, as the tests that
    break a kernel on purpose make, recompiles only the unit that includes
    it."""
    compiler_version = subprocess.run([compiler(), "--version"], capture_output=True).stdout
    digest = hashlib.sha256(kernels.sources_digest(source).encode())
    digest.update(" ".join(compile_flags(Path("SOURCE"))).encode() + compiler_version)
    target = kernels.cache_dir() / f"emulated-{digest.hexdigest()[:20]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with kernels.build_lock(target), tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        if target.exists():   # built by another process while this one waited for the lock
            return target
        objects = [_unit_object(source, unit, compiler_version, Path(scratch)) for unit in UNITS]
        built = Path(scratch) / target.name
        _compile([compiler(), "-shared", *map(str, objects), "-o", str(built)], source)
        os.replace(built, target)  # atomic: a process that does not take the lock sees a whole file or none
    return target


def _unit_object(source, unit, compiler_version, scratch):
    """The cached object file of one translation unit of `source`."""
    flags = compile_flags(source)
    preprocessed = _compile([compiler(), *flags, "-E", "-P", str(source / "emulation" / unit)], source)
    digest = hashlib.sha256(preprocessed.encode())
    digest.update(" ".join(compile_flags(Path("SOURCE"))).encode() + compiler_version)
    cached = kernels.cache_dir() / f"emulated-{Path(unit).stem}-{digest.hexdigest()[:20]}.o"
    if not cached.exists():
        built = scratch / cached.name
        _compile([compiler(), *flags, "-c", str(source / "emulation" / unit), "-o", str(built)], source)
        os.replace(built, cached)
    return cached


def _compile(command, source):
    """Runs the compiler; its standard output, or a CollectiveError that shows the failing source lines."""
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise CollectiveError("building the emulated kernels failed:\n"
                              + kernels.describe_compile_error(result.stderr, source))
    return result.stdout


def _load(path):
    lib = ctypes.CDLL(str(path))
    lib.collectives_emulated_plan_step.restype = ctypes.c_int
    lib.collectives_emulated_plan_step.argtypes = [
        ctypes.c_int, ctypes.c_int, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
        ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
    ]
    lib.collectives_emulated_codec.restype = ctypes.c_int
    lib.collectives_emulated_codec.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_uint, ctypes.c_uint,
                                               ctypes.c_void_p]
    lib.collectives_emulated_codec_batch.restype = ctypes.c_int
    lib.collectives_emulated_codec_batch.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                                                     ctypes.c_void_p]
    lib.collectives_emulated_codec_round_sum.restype = ctypes.c_int
    lib.collectives_emulated_codec_round_sum.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p]
    lib.collectives_emulated_batched_copy.restype = ctypes.c_int
    lib.collectives_emulated_batched_copy.argtypes = [
        ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_int,
    ]
    if (lib.collectives_emulated_max_ranks(), lib.collectives_emulated_buffers(),
            lib.collectives_emulated_copy_columns(), lib.collectives_emulated_codec_args_size(),
            lib.collectives_emulated_codec_batch_size(), lib.collectives_emulated_codec_sum_args_size()) != \
            (kernels.MAX_RANKS, kernels.BUFFERS, kernels.COPY_COLUMNS, ctypes.sizeof(codecs.CodecArgs),
             ctypes.sizeof(codecs.codec_batch_type()), ctypes.sizeof(codecs.CodecSumArgs)):
        raise CollectiveError(f"{path} was built from other kernel sources; delete it and try again")
    lib.collectives_emulated_ll_layout.restype = ctypes.c_longlong
    lib.collectives_emulated_ll_layout.argtypes = [ctypes.c_int]
    lib.collectives_emulated_ll_allreduce.restype = ctypes.c_int
    lib.collectives_emulated_ll_barrier.restype = ctypes.c_int
    lib.collectives_emulated_ll_barrier.argtypes = [ctypes.POINTER(kernels.LLAllreduceArgs)]
    lib.collectives_emulated_ll_allreduce.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_uint, ctypes.c_uint,
                                                      ctypes.POINTER(kernels.LLAllreduceArgs)]
    if tuple(lib.collectives_emulated_ll_layout(i) for i in range(7)) != (
            kernels.LL_MAX_BYTES, kernels.LL_MAX_RANKS, LL_REGION_WORDS, ctypes.sizeof(kernels.LLAllreduceArgs),
            kernels.LL_STATE_SLOTS, kernels.LL_THREADS, kernels.LL_BARRIER_OFFSET // 8):
        raise CollectiveError(f"{path} was built from other kernel sources (ll_allreduce); delete it and try again")
    return lib
