"""Gradient compression: codecs on the wire, float32 accumulation.

    kernels.py   the codecs (bf16, fp16, int8): Numba kernels for GPUs and
                 the same bodies compiled for the CPU
    wire.py      how a compressed allreduce runs any algorithm's plan
"""


def warm_up():
    """Compile (or load from Numba's disk cache) the CPU codec loops now.

    The first compressed call otherwise does it, which takes seconds the
    first time on a machine: under a short timeout, call this on every rank
    before the first compressed collective."""
    import numpy as np

    from . import kernels

    x = np.zeros(kernels.BLOCK, np.float32)
    for codec in kernels.CODECS:
        payload = np.empty(kernels.BLOCK, kernels.payload_dtype(codec))
        scales = np.empty(kernels.wire_nbytes(codec, kernels.BLOCK)[1], np.uint8)
        kernels.cpu_encode(codec, x, payload, scales, round_x=True)
        kernels.cpu_decode(codec, payload, scales, x)
        kernels.cpu_decode_add(codec, x, payload, scales, x, 0, payload, scales)
        kernels.cpu_add(codec, x, x, x, 0, payload, scales)
