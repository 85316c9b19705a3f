"""A CUDA GPU through CuPy: the only code in the library that needs one.

Kept to the calls of the device interface (__init__.py); everything it does
for a collective, the emulated device does too, so it is the one part that
CPU-only CI cannot run. Kernels come from kernels/plan_step.cu,
kernels/batched_copy.cu and kernels/codec.cu, one instance per module, compiled on first use by
NVRTC with our options (kernels.nvrtc_cubin, cached on disk) and loaded with
`cupy.RawModule`. Launches go through the driver's cuLaunchKernel with a
prepared parameter block, because the buffer table is a 2 KiB struct passed
by value (batched_copy's two arguments and the codecs' CodecArgs struct go
the same way, for one code path). CuPy's `driver.launchKernel` is the
thinnest launch CuPy has (a Cython call of cuLaunchKernel, no argument
packing of its own), so a launch costs one driver call and what the driver
itself takes; the executor's launches are prepared once (step_launcher),
and a call issues them as they are.
"""

import ctypes
import threading
from pathlib import Path

import numpy as np

from .. import kernels
from ..compression import kernels as codecs
from ..errors import CollectiveError
from . import Device, PreparedLaunches

# plan_step(const long long* table, int width, BufferTable buffers, int divisor,
# int fanout), one parameter per pointer of cuLaunchKernel's array, each in
# its own 8-byte words: the table pointer, width (its low 4 bytes), the
# buffer table, divisor (low 4), fanout (low 4).
_WIDTH_WORD, _BUFFERS_WORD = 1, 2
_DIVISOR_WORD = _BUFFERS_WORD + kernels.MAX_RANKS * kernels.BUFFERS
_FANOUT_WORD = _DIVISOR_WORD + 1
_PARAMETER_OFFSETS = (0, 8 * _WIDTH_WORD, 8 * _BUFFERS_WORD, 8 * _DIVISOR_WORD, 8 * _FANOUT_WORD)
# batched_copy(const long long* table, int rows): the table pointer, then
# rows in the low 4 bytes of the next word.
_COPY_PARAMETER_OFFSETS = (0, 8)
BLOCKS_PER_MULTIPROCESSOR = 2048 // kernels.STEP_THREADS
# ll_allreduce: kernels.LL_GRID_BLOCKS x LL_THREADS threads on every call (a
# fixed grid: each thread keeps the rank's call count in a state word of its
# own), one line per thread at the capacity, small enough for every rank's
# grid to be resident at once.
# cudaHostRegister's flags and cudaDevAttrCanUseHostPointerForRegisteredMem.
_HOST_REGISTER_PORTABLE, _HOST_REGISTER_MAPPED = 1, 2
_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91


class CudaMemory:
    """Device memory and its address; the memory lives as long as this does.
    `handle`: the CUDA IPC handle of memory made to be shared."""

    def __init__(self, owner, address, nbytes, handle=None):
        self.owner, self.address, self.nbytes, self.handle = owner, address, nbytes, handle


def visible_gpus():
    """How many GPUs this process sees (CUDA_VISIBLE_DEVICES applies)."""
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # no driver, no GPU: CuPy raises its own runtime errors
        raise CollectiveError(f"device='cuda' needs a GPU, and none is usable: {error}") from error
    if count == 0:
        raise CollectiveError("device='cuda' needs a GPU, and this process sees none")
    return count


class CudaDevice(Device, PreparedLaunches):
    def __init__(self, index, defines=None, *, cupy=None):
        """GPU `index`. `defines` adds preprocessor definitions to every
        kernel it compiles (bench/gpu_check.py measures variants this way).
        `cupy`: the module it calls, CuPy unless a stand-in is given
        (devices/dry_cuda.py, which runs this adapter without a GPU)."""
        try:
            if cupy is None:
                import cupy
                import cupy.cuda.driver  # noqa: F401 - a submodule CuPy does not import itself
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as error:  # no driver, no GPU: CuPy raises its own runtime errors
            raise CollectiveError(f"cuda:{index} is not usable: {error}") from error
        if index >= count:
            raise CollectiveError(f"cuda:{index} does not exist: this machine has {count} GPU(s)")
        self._cupy, self._driver = cupy, cupy.cuda.driver
        self.index = index
        self.name = self.array_location = f"cuda:{index}"
        self._device = cupy.cuda.Device(index)
        self.resident_blocks = self._device.attributes["MultiProcessorCount"] * BLOCKS_PER_MULTIPROCESSOR
        self.ll_grid_threads = kernels.LL_STATE_SLOTS   # ll_allreduce's fixed grid: the state words it uses
        self._functions = {}   # StepInstance or kernels.COPY_INSTANCE -> CUfunction
        self._kernels = []
        self._defines = tuple(f"-D{name}={value}" for name, value in sorted((defines or {}).items()))
        # One parameter block per device: cuLaunchKernel copies it at launch;
        # the lock keeps threads from filling it at the same time.
        self._launch_lock = threading.Lock()
        self._parameters = np.zeros(_FANOUT_WORD + 1, np.uint64)
        self._parameter_addresses = np.array([self._parameters.ctypes.data + o for o in _PARAMETER_OFFSETS], np.uint64)
        self._parameter_pointer = self._parameter_addresses.ctypes.data
        self._addresses_in_block = None
        self._copy_parameters = np.zeros(len(_COPY_PARAMETER_OFFSETS), np.uint64)
        self._copy_parameter_addresses = np.array([self._copy_parameters.ctypes.data + o
                                                   for o in _COPY_PARAMETER_OFFSETS], np.uint64)
        self._copy_parameter_pointer = self._copy_parameter_addresses.ctypes.data
        self._codec_parameters = codecs.CodecArgs()   # codec_kernel's one argument, a struct
        self._codec_parameter_addresses = (ctypes.c_void_p * 1)(ctypes.addressof(self._codec_parameters))
        self._codec_parameter_pointer = ctypes.addressof(self._codec_parameter_addresses)
        self._ll_parameters = self._ll_parameter_addresses = None   # launch_ll_allreduce's, made on first use

    def __repr__(self):
        return f"<CudaDevice {self.name}>"

    def allocate(self, nbytes):
        with self._device:
            memory = self._cupy.cuda.alloc(max(nbytes, 1))
        return CudaMemory(memory, memory.ptr, nbytes)

    def allocate_shared(self, nbytes, name):
        # A cudaMalloc of its own, not a chunk of CuPy's pool: an IPC handle
        # names a whole allocation, and a peer opening it gets its start.
        with self._device:
            memory = self._cupy.cuda.memory.Memory(max(nbytes, 1))
            handle = self._cupy.cuda.runtime.ipcGetMemHandle(memory.ptr)
        return CudaMemory(memory, memory.ptr, nbytes, bytes(handle))

    def open_shared(self, handle):
        runtime = self._cupy.cuda.runtime
        with self._device:
            address = runtime.ipcOpenMemHandle(bytes(handle), runtime.cudaIpcMemLazyEnablePeerAccess)
        return CudaMemory(None, address, 0)

    def release_shared(self, memory, own):
        if own:
            memory.owner = None  # cudaFree once nothing else holds it
        else:
            with self._device:
                self._cupy.cuda.runtime.ipcCloseMemHandle(memory.address)

    def wrap_shared(self, memory, shape, dtype):
        """A CuPy array of `shape` and `dtype` at the start of our own shared
        memory (symmetric memory: Communicator.alloc); it holds the
        allocation, which is freed once it and release_shared let go."""
        cupy = self._cupy
        with self._device:
            return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory.owner, 0))

    def empty(self, shape, dtype):
        """A CuPy array on this GPU."""
        with self._device:
            return self._cupy.empty(shape, dtype)

    def from_host(self, array):
        """A CuPy copy of a NumPy array on this GPU."""
        with self._device:
            return self._cupy.asarray(array)

    def to_host(self, array):
        """A NumPy copy of a CuPy array (after the current stream's work)."""
        with self._device:
            return self._cupy.asnumpy(array)

    def upload(self, array):
        with self._device:
            copy = self._cupy.asarray(np.ascontiguousarray(array))
            self._cupy.cuda.get_current_stream().synchronize()
        return CudaMemory(copy, copy.data.ptr, copy.nbytes)

    def current_stream(self):
        return self._cupy.cuda.get_current_stream(self.index)

    def use(self):
        self._device.use()

    def _function(self, instance):
        function = self._functions.get(instance)
        if function is None:
            function = self._functions[instance] = self._load(instance)
        return function

    def _load(self, instance):
        """The CUfunction of a kernel instance, compiled (or read from the
        disk cache) and loaded: once per instance and device."""
        # CUDA's headers for NVRTC: the toolkit CuPy uses, else the CUDA wheels.
        toolkit = self._cupy.cuda.get_cuda_path()
        headers = Path(toolkit) / "include" if toolkit else None
        include_dirs = [headers] if headers and (headers / "cuda_fp16.h").is_file() else kernels.cuda_include_dirs()
        major, minor = self._device.compute_capability[:-1], self._device.compute_capability[-1]
        cubin, lowered = kernels.nvrtc_cubin(instance, f"sm_{major}{minor}", include_dirs, self._defines)
        with self._device:
            module = self._cupy.RawModule(path=str(cubin))
            kernel = module.get_function(lowered)
            kernel.compile()
        self._kernels.append(kernel)  # owns the module the function lives in
        return kernel.kernel.ptr

    def launch_step(self, stream, instance, grid, table, width, addresses, divisor, fanout=1):
        function = self._functions.get(instance) or self._function(instance)
        with self._launch_lock:
            parameters = self._parameters
            parameters[0] = table.address
            parameters[_WIDTH_WORD] = width
            if addresses is not self._addresses_in_block:  # the executor passes one table per call
                parameters[_BUFFERS_WORD:_DIVISOR_WORD] = addresses
                self._addresses_in_block = addresses
            parameters[_DIVISOR_WORD] = divisor
            parameters[_FANOUT_WORD] = fanout
            self._launch(function, grid, kernels.STEP_THREADS, stream, self._parameter_pointer)

    def buffer_block(self):
        """A BufferTable parameter for launches made by step_launcher: they
        read it at launch (the driver copies it then), so `update` between
        calls reaches every launch made with it."""
        return BufferBlock()

    def step_launcher(self, instance, grid, table, width, divisor, block, fanout=1):
        """issue(stream): launch plan_step<instance> over `grid` for the rows
        `table` holds, with the addresses in `block` (buffer_block's) at the
        time; the executor's launch record (executors/device.py). The kernel
        handle, grid and parameter pointers are prepared here, once: a launch
        is one driver call, and a device switch only when the caller's
        current device is another."""
        function = self._function(instance)
        # This launch's own parameter values (table pointer, width, divisor,
        # fanout, each in an 8-byte word as the compiler lays them out); the
        # buffer table is the block's, shared by every launch made with it.
        values = np.array([table.address, width, divisor, fanout], np.uint64)
        pointers = np.array([values.ctypes.data, values.ctypes.data + 8, block.pointer, values.ctypes.data + 16,
                             values.ctypes.data + 24], np.uint64)
        parameters = pointers.ctypes.data
        gx, gy, threads, index = grid[0], grid[1], kernels.STEP_THREADS, self.index
        launch_kernel, runtime = self._driver.launchKernel, self._cupy.cuda.runtime

        def issue(stream, _alive=(values, pointers, block, table)):  # the memory `parameters` points into
            current = runtime.getDevice()
            if current == index:
                launch_kernel(function, gx, gy, 1, threads, 1, 1, 0, stream.ptr, parameters, 0)
                return
            runtime.setDevice(index)  # launch in this device's context, then give the caller theirs back
            try:
                launch_kernel(function, gx, gy, 1, threads, 1, 1, 0, stream.ptr, parameters, 0)
            finally:
                runtime.setDevice(current)
        return issue

    def launch_copies(self, stream, table, rows, grid=None):
        grid = kernels.copy_launch_grid(table, rows, grid, self.resident_blocks)
        if grid is None:
            return  # no rows: CUDA refuses an empty grid, and there is nothing to copy
        instance = kernels.COPY_INSTANCE
        function = self._functions.get(instance) or self._function(instance)
        with self._launch_lock:
            self._copy_parameters[0] = table.address
            self._copy_parameters[1] = rows
            self._launch(function, grid, kernels.COPY_THREADS, stream, self._copy_parameter_pointer)

    def launch_codec(self, stream, kernel, codec, args, divisor):
        """A codec kernel of kernels/codec.cu on `stream`; `args` are
        compression.wire.Regions in the order of its CPU loop ("copy": dst, src)."""
        if kernel == "copy":
            dst, src = args
            nbytes = dst.count * np.dtype(dst.dtype).itemsize
            if nbytes:
                runtime = self._cupy.cuda.runtime
                with self._device:
                    runtime.memcpyAsync(dst.address, src.address, nbytes, runtime.memcpyDeviceToDevice, stream.ptr)
            return
        launch = codecs.device_launch(kernel, codec, args, divisor)
        if launch is None:
            return  # no elements: CUDA refuses an empty grid, and there is nothing to do
        instance, parameters, n = launch
        function = self._functions.get(instance) or self._function(instance)
        grid = (kernels.codec_grid(n, self.resident_blocks), 1)
        with self._launch_lock:
            # CodecArgs goes by value: the driver copies it from _codec_parameters at launch.
            ctypes.memmove(ctypes.addressof(self._codec_parameters), ctypes.addressof(parameters),
                           ctypes.sizeof(parameters))
            self._launch(function, grid, kernels.CODEC_THREADS, stream, self._codec_parameter_pointer)

    def launch_codec_batch(self, stream, codec, rows):
        """One codec_batch of kernels/codec.cu on `stream`: `rows`
        (compression.kernels.CodecRow, at most CODEC_BATCH_ROWS, none
        writing what another touches) run side by side."""
        self.codec_batch_launcher(codec, rows)(stream)

    def codec_batch_launcher(self, codec, rows):
        """issue(stream): the codec_batch launch of `rows`, prepared once: its
        instance, grid and CodecBatch (a struct of its own, which the driver
        copies at each launch). For the executor's codec launch records."""
        function = self._function(kernels.CodecBatchInstance(codecs.codec_id(codec)))
        grid = codecs.batch_grid(rows, self.resident_blocks)
        parameters = codecs.batch_arguments(rows)
        pointers = (ctypes.c_void_p * 1)(ctypes.addressof(parameters))
        pointer = ctypes.addressof(pointers)

        def issue(stream, _alive=(parameters, pointers)):
            self._launch(function, grid, kernels.CODEC_THREADS, stream, pointer)
        return issue

    def launch_codec_round_sum(self, stream, codec, inputs, outputs, n, divisor):
        """codec_round_sum of kernels/codec.cu on `stream`: every output (a
        float32 address) gets the sum, in the order of `inputs`, of each
        input rounded through the codec, divided by `divisor` when > 0."""
        self.codec_round_sum_launcher(codec, inputs, outputs, n, divisor)(stream)

    def codec_round_sum_launcher(self, codec, inputs, outputs, n, divisor):
        """issue(stream): launch_codec_round_sum's launch, prepared once."""
        parameters = codecs.round_sum_arguments(inputs, outputs, n, divisor)
        if n == 0:
            return lambda stream: None   # CUDA refuses an empty grid
        function = self._function(kernels.CodecSumInstance(codecs.codec_id(codec)))
        grid = (kernels.codec_grid(n, self.resident_blocks), 1)
        pointers = (ctypes.c_void_p * 1)(ctypes.addressof(parameters))
        pointer = ctypes.addressof(pointers)

        def issue(stream, _alive=(parameters, pointers)):
            self._launch(function, grid, kernels.CODEC_THREADS, stream, pointer)
        return issue

    def _launch(self, function, grid, threads, stream, parameter_pointer):
        """cuLaunchKernel; the caller holds the launch lock (the driver has
        copied the parameters once this returns)."""
        runtime = self._cupy.cuda.runtime
        current = runtime.getDevice()
        if current != self.index:  # launch in this device's context, then give the caller theirs back
            runtime.setDevice(self.index)
        try:
            self._driver.launchKernel(function, grid[0], grid[1], 1, threads, 1, 1, 0, stream.ptr,
                                      parameter_pointer, 0)
        finally:
            if current != self.index:
                runtime.setDevice(current)

    def new_event(self):
        with self._device:
            return self._cupy.cuda.Event(block=False, disable_timing=True)

    def record(self, event, stream):
        event.record(stream)

    def wait(self, stream, event):
        stream.wait_event(event)

    def query(self, event):
        return event.done

    def enable_peer_access(self, other):
        if not isinstance(other, CudaDevice) or other.index == self.index:
            return
        runtime = self._cupy.cuda.runtime
        if not runtime.deviceCanAccessPeer(self.index, other.index):
            raise CollectiveError(f"{self.name} cannot access {other.name}'s memory (no peer access between them)")
        with self._device:
            try:
                runtime.deviceEnablePeerAccess(other.index)
            except runtime.CUDARuntimeError as error:
                if "PeerAccessAlreadyEnabled" not in str(error):
                    raise

    def is_capturing(self, stream):
        return stream.is_capturing()

    # -- the one-kernel collectives between processes (kernels/ll_allreduce.cu) ---
    # (not run by CI: the emulated device's twins of these methods are)

    def clear_shared(self, memory):
        """Zero shared memory before peers see it: cudaMalloc does not."""
        with self._device:
            self._cupy.cuda.runtime.memset(memory.address, 0, max(memory.nbytes, 1))
            self._device.synchronize()

    def map_host(self, address, nbytes):
        """Page-lock host memory (the control segment's front) and map it
        for this GPU's kernels; with unified addressing they use the host's
        address, which is returned."""
        runtime = self._cupy.cuda.runtime
        with self._device:
            if not runtime.deviceGetAttribute(_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, self.index):
                raise CollectiveError(f"{self.name} cannot address registered host memory at its host address")
            runtime.hostRegister(address, nbytes, _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED)
        return address

    def unmap_host(self, address):
        with self._device:
            self._cupy.cuda.runtime.hostUnregister(address)

    def download(self, address, nbytes):
        """`nbytes` of device memory at `address`, once the device is idle."""
        out = np.empty(nbytes, np.uint8)
        runtime = self._cupy.cuda.runtime
        with self._device:
            self._device.synchronize()
            runtime.memcpy(out.ctypes.data, address, nbytes, runtime.memcpyDeviceToHost)
        return out.tobytes()

    def launch_ll_allreduce(self, stream, instance, args):
        """ll_allreduce<instance> on its fixed grid; `args`
        (kernels.LLAllreduceArgs) is copied into the launch's parameters
        (while capturing, into the graph's node)."""
        self._launch_with_args(instance, (kernels.LL_GRID_BLOCKS, 1), kernels.LL_THREADS, stream, args)

    def ll_launcher(self, instance, args):
        """issue(stream): ll_allreduce<instance> with `args` as they are at
        each launch (the driver copies them then), which the caller keeps
        (executors/peer_ll.py's bound calls): the kernel handle and parameter
        pointer are prepared once, as step_launcher's."""
        function = self._function(instance)
        pointers = np.array([ctypes.addressof(args)], np.uint64)
        parameters = pointers.ctypes.data
        gx, threads, index = kernels.LL_GRID_BLOCKS, kernels.LL_THREADS, self.index
        launch_kernel, runtime = self._driver.launchKernel, self._cupy.cuda.runtime

        def issue(stream, _alive=(args, pointers)):  # the memory `parameters` points into
            current = runtime.getDevice()
            if current == index:
                launch_kernel(function, gx, 1, 1, threads, 1, 1, 0, stream.ptr, parameters, 0)
                return
            runtime.setDevice(index)  # launch in this device's context, then give the caller theirs back
            try:
                launch_kernel(function, gx, 1, 1, threads, 1, 1, 0, stream.ptr, parameters, 0)
            finally:
                runtime.setDevice(current)
        return issue

    def launch_ll_barrier(self, stream, args):
        """ll_barrier, one thread; `args` is copied into the launch's parameters."""
        self._launch_with_args(kernels.LL_BARRIER_INSTANCE, (1, 1), 32, stream, args)

    def _launch_with_args(self, instance, grid, threads, stream, args):
        """Launch a kernel whose one parameter is an LLAllreduceArgs."""
        function = self._functions.get(instance) or self._function(instance)
        with self._launch_lock:
            if self._ll_parameters is None:
                self._ll_parameters = kernels.LLAllreduceArgs()
                self._ll_parameter_addresses = np.array([ctypes.addressof(self._ll_parameters)], np.uint64)
            ctypes.memmove(ctypes.addressof(self._ll_parameters), ctypes.addressof(args), ctypes.sizeof(args))
            self._launch(function, grid, threads, stream, self._ll_parameter_addresses.ctypes.data)

    # -- graphs ------------------------------------------------------------------

    def begin_capture(self):
        """Make a new stream current on this device and capture what is
        issued on it (CUDA cannot capture the legacy default stream)."""
        with self._device:
            stream = self._cupy.cuda.Stream(non_blocking=True)
        stream.__enter__()
        try:
            stream.begin_capture()
        except BaseException:
            stream.__exit__(None, None, None)
            raise
        return stream

    def end_capture(self, stream):
        """Stop capturing and give the caller's stream back: a CuPy Graph."""
        try:
            return stream.end_capture()
        finally:
            stream.__exit__(None, None, None)

    def replay(self, graph):
        graph.launch(self.current_stream())

    def synchronize(self):
        self._device.synchronize()

    def call_returned(self):
        pass  # the work stays queued on the caller's stream


class BufferBlock:
    """The BufferTable a CudaDevice's prepared launches pass by value: host
    memory whose address is in their parameter pointers. `addresses` is the
    table last copied in (the executor's, which it never changes once made)."""

    def __init__(self):
        self._table = kernels.buffer_table([])
        self.pointer = self._table.ctypes.data
        self.addresses = None

    def update(self, addresses):
        self._table[:] = addresses
        self.addresses = addresses

