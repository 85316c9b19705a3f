"""A dry run of the CUDA adapter: every line of ours that a GPU call runs,
on a machine without a GPU.

`dry_devices(n)` gives CudaDevice objects (devices/cuda.py, the real class)
that call a stand-in for CuPy instead of CuPy, and `DryArray` stands in for
a CuPy array. With them a collective runs the whole GPU path of this
library: the API's checks reading the arrays (as CuPy arrays: `.data.ptr`,
`.device.id`, `__cuda_array_interface__`, shape, dtype, strides, flags),
the executor's program, the adapter's parameter packing, device switches,
events and launch calls. Only the stand-in's own calls do nothing.

The stand-ins have CuPy's cost profile where it matters to us: an array's
attributes are properties that compute (CuPy builds `.data`, `.device`,
`.shape`, `.flags` and the interface dict on each access, as these do), not
plain attributes that would flatter a path that reads them often. Memory is
fake addresses: nothing is allocated, copied or computed, so the results of
a dry collective are meaningless; it is a proxy for host time and for what
the adapter asks of the driver (`DryCuda.launches`, the launches issued).

What a dry run does not see: the time CuPy and the CUDA driver spend in
the calls it stands in for (cuLaunchKernel itself, about 2-5 µs per launch
on an H100, setDevice, event records), contention for the driver's locks,
and anything the GPU does. bench.call_overhead --adapter dry measures with
it (and --callgrind counts its instructions).
"""

import itertools
import types

import numpy as np

from .. import arrays, kernels
from .cuda import CudaDevice

_STREAM_OF_INTERFACE = 1  # CUDA's legacy default stream, as __cuda_array_interface__ names it
# Fake device addresses: far from any host mapping, 256-byte aligned as
# cudaMalloc's are, and never reused within a process.
_FIRST_ADDRESS = 0x7F00_0000_0000
_ALIGNMENT = 256


class DryCuda:
    """The stand-in for the `cupy` module: the calls CudaDevice makes, on
    `ndevices` pretend GPUs. Counts the kernel launches it is asked for."""

    def __init__(self, ndevices, multiprocessors=132):
        self.ndevices, self.multiprocessors = ndevices, multiprocessors
        self.launches = 0                 # every kernel launched
        self.ll_launches = 0              # of which ll_allreduce's (the one-kernel collectives)
        self.ll_functions = set()         # the made-up handles of ll_allreduce instances
        self.records = self.waits = 0   # event records and stream waits, as the driver is asked for them
        self.current = 0   # the calling thread's current device (one thread is all a dry run needs)
        self._next_address = _FIRST_ADDRESS
        self._streams = [DryStream(0x5000 + k, self) for k in range(ndevices)]
        dry = self

        class CUDARuntimeError(RuntimeError):
            pass

        def launch_kernel(function, gx, gy, gz, bx, by, bz, shared, stream, parameters, extra):
            dry.launches += 1
            if function in dry.ll_functions:
                dry.ll_launches += 1

        def set_device(index):
            dry.current = index

        runtime = types.SimpleNamespace(
            getDeviceCount=lambda: ndevices, getDevice=lambda: dry.current, setDevice=set_device,
            CUDARuntimeError=CUDARuntimeError, memcpyDeviceToDevice=3, cudaIpcMemLazyEnablePeerAccess=1,
            memcpyAsync=lambda *args: None, deviceCanAccessPeer=lambda a, b: True,
            deviceEnablePeerAccess=lambda other: None,
            ipcGetMemHandle=lambda address: address.to_bytes(64, "little"),
            ipcOpenMemHandle=lambda handle, flags: int.from_bytes(handle, "little"),
            ipcCloseMemHandle=lambda address: None,
            deviceGetAttribute=lambda attribute, index: 1, hostRegister=lambda address, nbytes, flags: None,
            hostUnregister=lambda address: None, memset=lambda address, value, nbytes: None)
        self.cuda = types.SimpleNamespace(
            runtime=runtime, driver=types.SimpleNamespace(launchKernel=launch_kernel),
            Device=lambda index=None: DryDevice(dry, dry.current if index is None else index),
            alloc=self.allocate, memory=types.SimpleNamespace(Memory=self.allocate),
            get_current_stream=lambda index=None: dry._streams[dry.current if index is None else index],
            Event=lambda block=False, disable_timing=True: DryEvent(dry),
            get_cuda_path=lambda: None)

    def allocate(self, nbytes):
        address = self._next_address
        self._next_address += -(-max(nbytes, 1) // _ALIGNMENT) * _ALIGNMENT
        return DryMemory(address, nbytes, self.current)

    def asarray(self, array):
        """A DryArray with `array`'s shape and dtype (its values are not kept)."""
        array = np.asarray(array)
        return DryArray(array.shape, array.dtype, self.allocate(array.nbytes), self)

    def full(self, shape, value, dtype):
        return self.empty(shape, dtype)  # values are not kept

    def empty(self, shape, dtype):
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        dtype = np.dtype(dtype)
        return DryArray(shape, dtype, self.allocate(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize), self)


class DryDevice:
    """cupy.cuda.Device: a context manager that makes it current."""

    def __init__(self, dry, index):
        self._dry, self.id = dry, index
        self.attributes = {"MultiProcessorCount": dry.multiprocessors}
        self.compute_capability = "90"

    def use(self):
        self._dry.current = self.id

    def synchronize(self):
        pass

    def __enter__(self):
        self._previous = self._dry.current
        self._dry.current = self.id
        return self

    def __exit__(self, *exc):
        self._dry.current = self._previous


class DryMemory:
    def __init__(self, address, nbytes, device):
        self.ptr, self.nbytes, self.device_id = address, nbytes, device


class DryStream:
    def __init__(self, handle, dry):
        self._handle, self._dry = handle, dry

    @property
    def ptr(self):  # CuPy's Stream.ptr is a property too
        return self._handle

    def synchronize(self):
        pass

    def is_capturing(self):
        return False

    def wait_event(self, event):
        self._dry.waits += 1


class DryEvent:
    def __init__(self, dry):
        self._dry = dry

    def record(self, stream=None):
        self._dry.records += 1

    @property
    def done(self):
        return True


class _Pointer:
    """cupy.cuda.MemoryPointer, as `.data` gives it."""
    __slots__ = ("_memory",)

    def __init__(self, memory):
        self._memory = memory

    @property
    def ptr(self):
        return self._memory.ptr


class _DeviceOf:
    """cupy.cuda.Device, as an array's `.device` makes one on each access."""
    __slots__ = ("_index",)

    def __init__(self, index):
        self._index = index

    @property
    def id(self):
        return self._index


class _Flags:
    __slots__ = ("c_contiguous", "f_contiguous", "owndata")

    def __init__(self, c_contiguous):
        self.c_contiguous, self.f_contiguous, self.owndata = c_contiguous, False, True


class DryArray:
    """A contiguous CuPy array as far as this library can tell, without the
    memory: described through arrays.describe's CuPy path."""

    def __init__(self, shape, dtype, memory, owner=None):
        self._shape, self._dtype, self._memory = tuple(shape), np.dtype(dtype), memory
        self._owner = owner   # the DryCuda that made it (arrays.empty_like asks it for new ones)
        self._size = int(np.prod(self._shape, dtype=np.int64))

    @property
    def data(self):
        return _Pointer(self._memory)

    @property
    def device(self):
        return _DeviceOf(self._memory.device_id)

    @property
    def shape(self):
        return tuple(self._shape)

    @property
    def dtype(self):
        return self._dtype

    @property
    def ndim(self):
        return len(self._shape)

    @property
    def size(self):  # a stored number in CuPy too
        return self._size

    @property
    def nbytes(self):
        return self.size * self._dtype.itemsize

    @property
    def strides(self):
        strides, step = [], self._dtype.itemsize
        for extent in reversed(self._shape):
            strides.append(step)
            step *= extent
        return tuple(reversed(strides))

    @property
    def flags(self):
        return _Flags(True)

    @property
    def __cuda_array_interface__(self):
        # CuPy's (version 3) names the current stream, whose work a reader must wait for.
        return {"shape": self.shape, "typestr": self._dtype.str, "descr": [("", self._dtype.str)],
                "data": (self._memory.ptr, False), "strides": None, "version": 3,
                "stream": _STREAM_OF_INTERFACE}

    def __len__(self):
        return self._shape[0]

    def __getitem__(self, key):
        """Views of a 1-d array along its one axis (harness and benchmark slices)."""
        if len(self._shape) != 1 or not isinstance(key, slice):
            raise TypeError("a DryArray takes 1-d slices only")
        start, stop, step = key.indices(self._shape[0])
        if step != 1:
            raise TypeError("a DryArray takes contiguous slices only")
        stop = max(start, stop)
        view = DryMemory(self._memory.ptr + start * self._dtype.itemsize, (stop - start) * self._dtype.itemsize,
                         self._memory.device_id)
        return DryArray((stop - start,), self._dtype, view, self._owner)

    def reshape(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        if -1 in shape:
            known = int(np.prod([s for s in shape if s != -1], dtype=np.int64))
            shape = tuple(self.size // max(known, 1) if s == -1 else s for s in shape)
        return DryArray(shape, self._dtype, self._memory, self._owner)


arrays.register(DryArray, arrays.describe_cupy,
                empty_like=lambda obj, info, shape: DryCuda.empty(obj._owner, shape, info.dtype))


def dry_devices(ndevices, multiprocessors=132):
    """(the DryCuda stand-in, one CudaDevice per pretend GPU) for ranks
    through executors.device.DeviceRanks."""
    dry = DryCuda(ndevices, multiprocessors)
    return dry, [DryCudaDevice(index, cupy=dry) for index in range(ndevices)]


class DryCudaDevice(CudaDevice):
    """CudaDevice with kernel loading (NVRTC, cuModuleLoad: once per
    kernel instance, never per call) replaced by made-up function handles."""

    _handles = itertools.count(0x1000)

    def _load(self, instance):
        handle = next(self._handles)
        if isinstance(instance, kernels.LLInstance):
            self._cupy.ll_functions.add(handle)
        return handle
