"""Tensors as the communicator takes them: the one place torch's types meet ours.

CPU tensors go to host ranks as NumPy arrays sharing their memory
(bfloat16 as ml_dtypes.bfloat16); CUDA tensors go to GPU ranks as they are
(__cuda_array_interface__), with PyTorch's current stream made CuPy's, so
our kernels queue behind the kernels that made the tensors.
"""

import functools

import torch


def host_array(tensor):
    """A NumPy array sharing `tensor`'s memory (a contiguous CPU tensor),
    what host ranks take. bfloat16 becomes ml_dtypes.bfloat16."""
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def rank_array(tensor):
    """What a communicator takes for `tensor` (contiguous): a NumPy view of
    a CPU tensor, the CUDA tensor itself."""
    return host_array(tensor) if tensor.device.type == "cpu" else tensor.detach()


def byte_array(tensor):
    """`tensor`'s bytes (contiguous), for collectives that move data without
    reducing it, which therefore take any dtype (bool, complex, float8...)."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=flat.device)
    return rank_array(flat)


# Integer types of 1, 2, 4 and 8 bytes: a tensor of any dtype of such a size
# viewed as one of them is counted in its own elements.
_WORDS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def word_array(tensor):
    """`tensor` (contiguous) as the communicator's array of the integer type
    of its element's size, for collectives that move blocks counted in
    elements (all_to_all_v): (the array, its elements per tensor element),
    1 but for elements of other sizes (complex128: 2 int64s each)."""
    flat = tensor.detach().reshape(-1)
    size = flat.element_size()
    word = 8 if size % 8 == 0 else 4 if size % 4 == 0 else 2 if size % 2 == 0 else 1
    if flat.dtype != _WORDS[word]:
        flat = flat.view(_WORDS[word]) if flat.numel() else torch.empty(0, dtype=_WORDS[word], device=flat.device)
    return rank_array(flat), size // word


class on_torch_stream:
    """Make PyTorch's stream CuPy's current one (and its device current), so
    that the library's kernels queue behind the kernels that produced the
    tensors, and the ones that read the results queue behind them."""

    def __init__(self, stream):
        import cupy
        self._device = cupy.cuda.Device(stream.device.index)
        self._stream = cupy.cuda.ExternalStream(stream.cuda_stream, stream.device.index)

    def __enter__(self):
        self._device.__enter__()
        self._stream.__enter__()

    def __exit__(self, *exc):
        self._stream.__exit__(*exc)
        self._device.__exit__(*exc)


def numpy_dtype(dtype):
    """The NumPy dtype of a torch dtype, for messages and checks (None where NumPy has none)."""
    try:
        return host_array(torch.empty(0, dtype=dtype)).dtype
    except (TypeError, RuntimeError):
        return None



@functools.lru_cache(maxsize=None)   # per call otherwise: a NumPy dtype made from an empty tensor costs ~10 us
def reducible(dtype, op):
    """None when collectives can reduce tensors of torch `dtype` with `op`
    (our op's name), else why not, for an InvalidUsageError. Collectives
    that only move bytes (broadcast, allgather) take any dtype."""
    from ..ops import SUPPORTED_DTYPES
    numpy = numpy_dtype(dtype)
    if numpy is None or numpy.name not in SUPPORTED_DTYPES:
        return (f"tensors of {dtype} cannot be reduced by collectives (op {op}); it reduces "
                f"{', '.join(SUPPORTED_DTYPES)} (for bool, reduce a uint8 copy)")
    return None
