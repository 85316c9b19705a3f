"""Where the test suites run their communicators: one test body, several backends.

    host         virtual ranks on NumPy arrays (the NumPy interpreter)
    emulated     every rank on one emulated device (our kernels on the CPU)
    emulated-3   ranks spread over three emulated devices (cross-device events)
    gpu          every rank on GPU 0, CuPy arrays; marked `gpu`

COLLECTIVES_TEST_DEVICE=emulated makes the `gpu` tests run on an emulated
device instead (bench/gpu_check.py --device emulated does so in CI).
"""

import functools
import os

import numpy as np
import pytest

import collectives
from cases import DTYPES, SPREAD_DTYPES, dtypes_for
from collectives import arrays

GPU_DEVICE = os.environ.get("COLLECTIVES_TEST_DEVICE", "cuda")


@functools.lru_cache(maxsize=None)
def gpu_unavailable_reason():
    """None when a CUDA GPU is usable, else why not."""
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
    except ImportError:
        return "needs a GPU: CuPy is not installed (pip install '.[cuda13]')"
    except Exception as error:
        return f"needs a GPU: CuPy sees none ({type(error).__name__})"
    return None if count else "needs a GPU: CuPy sees none"


def require_gpu():
    """Skip unless the `gpu` tests have a device: a real GPU, or the emulated
    one that COLLECTIVES_TEST_DEVICE asks for."""
    if GPU_DEVICE != "emulated" and gpu_unavailable_reason():
        pytest.skip(gpu_unavailable_reason())


class Backend:
    def __init__(self, name):
        self.name = name
        self.on_gpu = name == "gpu" and GPU_DEVICE == "cuda"

    def __repr__(self):
        return self.name

    def devices(self, n):
        if self.name == "host":
            return None
        if self.name == "emulated-3":
            return [f"emulated:{r % 3}" for r in range(n)]
        if self.name == "gpu":
            return ["cuda:0" if self.on_gpu else "emulated"] * n
        return ["emulated"] * n

    def communicator(self, n, **kwargs):
        return collectives.Communicator.local(n, devices=self.devices(n), **kwargs)

    def put(self, array):
        """A copy of a NumPy array where this backend's ranks take arrays."""
        if self.on_gpu:
            import cupy
            return cupy.asarray(array)
        return np.array(array)

    def get(self, array):
        """A NumPy copy of an array of this backend."""
        if self.on_gpu:
            import cupy
            if isinstance(array, cupy.ndarray):
                return cupy.asnumpy(array)
        return np.array(array)

    def dtypes(self, count):
        """The dtypes the collective matrix runs on this backend at `count`
        elements (tests/cases.py says why some cells are left out)."""
        return dtypes_for(count, [d for d in DTYPES if d.name in SPREAD_DTYPES] if self.name == "emulated-3"
                          else DTYPES)

    def read(self, array):
        """The values of an array of this backend as NumPy, to compare at
        once: the array itself where it is on the host (no copy: at the
        matrix's largest counts, copies were a tenth of its time)."""
        return self.get(array) if self.on_gpu else np.asarray(array)

    def empty(self, shape, dtype):
        if self.on_gpu:
            import cupy
            return cupy.empty(shape, dtype)
        return np.empty(shape, dtype)

    def synchronize(self, comm):
        comm.synchronize()


def shares_memory(a, b):
    x, y = arrays.describe(a, "a"), arrays.describe(b, "b")
    return x.device == y.device and x.address < y.address + y.nbytes and y.address < x.address + x.nbytes


BACKEND_NAMES = ("host", "emulated", "emulated-3", "gpu")


def backend_params():
    return [pytest.param(name, marks=pytest.mark.gpu) if name == "gpu" else name for name in BACKEND_NAMES]
