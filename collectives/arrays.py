"""The caller's arrays, whatever library made them, as one description.

A collective needs the same few facts of every array: where its memory is
(address and device), how big it is, its element type, and whether it is
contiguous and writable. `describe` reads them from NumPy arrays (host
memory, also the arrays of emulated devices), CuPy arrays, PyTorch tensors,
and any object exposing `__cuda_array_interface__` or DLPack, without
copying anything. `empty_like` makes a new array of the same library for
results the caller did not provide (allgather's output).
"""

import operator
import weakref
from typing import NamedTuple, Tuple

import numpy as np

from .errors import InvalidUsageError
from .ops import SUPPORTED_DTYPES, bfloat16, is_bfloat16, supported_dtype_set

HOST = "host"


class ArrayInfo(NamedTuple):
    """What a collective needs to know of an array (not the array itself:
    descriptions are cached, and a cache must not keep arrays alive)."""
    address: int
    size: int             # elements
    shape: Tuple[int, ...]
    dtype: np.dtype       # a NumPy dtype (ml_dtypes.bfloat16 for bfloat16)
    device: str           # "host" or "cuda:N"
    contiguous: bool
    writable: bool
    library: str          # "numpy", "cupy", "torch", or how a foreign array came

    @property
    def nbytes(self):
        return self.size * self.dtype.itemsize


# id(array) -> (weak reference, ArrayInfo) of NumPy arrays already described
# and found supported. Reading a NumPy array's address builds its
# __array_interface__ dict (microseconds); most calls pass the same arrays
# as the last one, so `describe` looks them up instead, after checking what
# could have changed in place (shape, dtype, flags).
_NUMPY_INFOS = {}
_NUMPY_CACHE_LIMIT = 4096


def _numpy(a):
    return ArrayInfo(a.__array_interface__["data"][0], a.size, a.shape, a.dtype, HOST,
                     a.flags.c_contiguous, a.flags.writeable, "numpy")


def _remember(a, info):
    key = id(a)
    if len(_NUMPY_INFOS) >= _NUMPY_CACHE_LIMIT:
        _NUMPY_INFOS.clear()
    _NUMPY_INFOS[key] = (weakref.ref(a, lambda _, key=key: _NUMPY_INFOS.pop(key, None)), info)


def describe_cupy(a):
    """The ArrayInfo of a CuPy array (or of a stand-in with its attributes)."""
    return ArrayInfo(a.data.ptr, a.size, a.shape, a.dtype, f"cuda:{a.device.id}", a.flags.c_contiguous, True, "cupy")


_cupy = describe_cupy


_TORCH_DTYPES = {f"torch.{name}": np.dtype(name) for name in SUPPORTED_DTYPES if name != "bfloat16"}


def _torch(t):
    dtype = _TORCH_DTYPES.get(str(t.dtype))
    if dtype is None and str(t.dtype) == "torch.bfloat16":
        dtype = _TORCH_DTYPES["torch.bfloat16"] = bfloat16()
    if dtype is None:
        raise InvalidUsageError(f"a tensor of {t.dtype} is not supported; supported: {', '.join(SUPPORTED_DTYPES)}")
    device = f"cuda:{t.device.index}" if t.device.type == "cuda" else HOST if t.device.type == "cpu" else None
    if device is None:
        raise InvalidUsageError(f"a tensor on {t.device} is not supported (CUDA or CPU tensors only)")
    return ArrayInfo(t.data_ptr(), t.numel(), tuple(t.shape), dtype, device, t.is_contiguous(), True, "torch")


def _cuda_array_interface(obj):
    interface = obj.__cuda_array_interface__
    shape = tuple(interface["shape"])
    dtype = np.dtype(interface["typestr"])
    if dtype.kind == "V":
        raise InvalidUsageError(
            f"{type(obj).__name__} exports an untyped {dtype} through __cuda_array_interface__; "
            "pass a CuPy array or a PyTorch tensor for bfloat16")
    strides = interface.get("strides")
    contiguous = strides is None or tuple(strides) == _c_strides(shape, dtype.itemsize)
    address, readonly = interface["data"]
    return ArrayInfo(address, int(np.prod(shape, dtype=np.int64)), shape, dtype,
                     f"cuda:{_device_of_pointer(address)}", contiguous, not readonly, "cuda_array_interface")


def _c_strides(shape, itemsize):
    strides, step = [], itemsize
    for extent in reversed(shape):
        strides.append(step)
        step *= extent
    return tuple(reversed(strides))


def _device_of_pointer(address):
    try:
        import cupy
        return cupy.cuda.runtime.pointerGetAttributes(address).device
    except Exception as error:  # no CuPy, no driver, or not device memory
        raise InvalidUsageError(f"cannot tell which GPU holds address {address:#x}: {error}") from None


def _dlpack(obj):
    kind, _ = obj.__dlpack_device__()
    if kind == 1:  # kDLCPU
        return _numpy(np.from_dlpack(obj))._replace(library="dlpack")
    if kind == 2:  # kDLCUDA
        import cupy
        return _cupy(cupy.from_dlpack(obj))._replace(library="dlpack")
    raise InvalidUsageError(f"{type(obj).__name__} lives on DLPack device type {kind}; only CPU and CUDA are supported")


def _describer(obj):
    kind = type(obj)
    module = kind.__module__.split(".")[0]
    if isinstance(obj, np.ndarray):
        return _numpy
    if module == "cupy" and hasattr(obj, "data") and hasattr(obj, "device"):
        return _cupy
    if module == "torch" and hasattr(obj, "data_ptr"):
        return _torch
    if hasattr(obj, "__cuda_array_interface__"):
        return _cuda_array_interface
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        return _dlpack
    return None


_DESCRIBERS = {}  # type -> describer (or None): the per-call path asks a dict, not isinstance chains


def _describer_of(obj):
    kind = type(obj)
    try:
        return _DESCRIBERS[kind]
    except KeyError:
        describer = _DESCRIBERS[kind] = _describer(obj)
        return describer


def register(kind, describer, empty_like=None):
    """Describe arrays of type `kind` with `describer`, and make new ones
    like them with `empty_like(obj, info, shape)` (devices/dry_cuda.py's
    stand-in for CuPy arrays registers so)."""
    _DESCRIBERS[kind] = describer
    if empty_like is not None:
        _MAKERS[kind] = empty_like


_MAKERS = {}  # type -> empty_like of a registered kind


# What a repeated call (Communicator._collective) reads back of an array it
# has seen, by the array's identity, to know that every check it passed
# still holds: the facts the checks depend on, read through the cheapest
# attributes. A NumPy array's memory cannot move while a weak reference to it
# lives (NumPy refuses to resize it), so shape, dtype and flags say the rest.
# A CuPy array's memory is its `data`, which Python code cannot reassign
# short of re-running __init__ or __setstate__; its address is read back all
# the same, through `.data.ptr` (0.2 µs; __cuda_array_interface__ costs 1 µs
# and `.device` makes an object). Same address, same device.
#
# A state is read for all of a call's arrays at once: states(arrays), arrays
# a tuple of one kind, gives a value compared with ==. NumPy's is read from
# the array struct in C where the extension was built (collectives/_arraystate.c:
# the address too, and the dtype by identity), else through the attributes.
def _states_through(attributes):
    getter = operator.attrgetter(*attributes)
    return lambda arrays: tuple(map(getter, arrays))


try:
    from ._arraystate import numpy_states as _numpy_states
except ImportError:   # not built (no compiler, or no NumPy at build time)
    _numpy_states = _states_through(("shape", "dtype", "flags.num"))

_REPEAT_STATES = {_numpy: _numpy_states, describe_cupy: _states_through(("data.ptr", "shape", "dtype"))}


def repeat_state(obj):
    """The function giving what a repeated call compares of a tuple of
    arrays of `obj`'s type (see above), or None where there is none (then
    every call is checked in full)."""
    return _REPEAT_STATES.get(_describer_of(obj))


def is_array(obj):
    return _describer_of(obj) is not None


# Dtype objects rather than names: dtype.name costs microseconds in NumPy 2.
_SUPPORTED = supported_dtype_set()


def describe(obj, name="the array"):
    """The ArrayInfo of `obj`, or InvalidUsageError naming `name`."""
    entry = _NUMPY_INFOS.get(id(obj))
    if entry is not None and entry[0]() is obj:
        info = entry[1]
        flags = obj.flags
        if obj.shape == info.shape and obj.dtype is info.dtype and flags.writeable == info.writable \
                and flags.c_contiguous:
            return info
    describer = _describer_of(obj)
    if describer is None:
        raise InvalidUsageError(f"{name} must be an array (NumPy, CuPy, PyTorch, ...), got {type(obj).__name__}")
    info = describer(obj)
    if info.dtype not in _SUPPORTED and not is_bfloat16(info.dtype):
        hint = " (use uint8 for flags)" if info.dtype == np.bool_ else ""
        raise InvalidUsageError(f"{name} has dtype {info.dtype}{hint}; supported: {', '.join(SUPPORTED_DTYPES)}")
    if not info.contiguous:
        raise InvalidUsageError(f"{name} must be C-contiguous (np.ascontiguousarray makes a copy that is)")
    if describer is _numpy:
        _remember(obj, info)
    return info


def empty_like(obj, info, shape):
    """A new array of `shape`, of the same library, dtype and device as `obj`
    (a NumPy array for other libraries' host arrays, a CuPy array for their
    device arrays)."""
    if info.library == "numpy" or info.device == HOST and info.library != "torch":
        return np.empty(shape, info.dtype)
    maker = _MAKERS.get(type(obj))
    if maker is not None:
        return maker(obj, info, shape)
    if info.library == "torch":
        import torch
        return torch.empty(shape, dtype=obj.dtype, device=obj.device)
    import cupy
    with cupy.cuda.Device(int(info.device.split(":")[1])):
        return cupy.empty(shape, info.dtype)
