"""Gradient compression: codecs on the wire, float32 accumulation.

    kernels.py   the codecs (bf16, fp16, int8) by name: wire sizes, argument
                 checks, and the calls into their two forms, the CPU loops
                 (_codec.cpp, a Python extension) and the GPU kernels
                 (kernels/codec.cu), both written on kernels/codec.cuh, which
                 also documents the wire format
    _codec.cpp   the CPU loops over blocks, for host ranks
    wire.py      how a compressed allreduce runs any algorithm's plan
"""


def warm_up():
    """Load the codecs' CPU loops now, and fail now if they were not built
    (a CollectiveError that says how to get them).

    They are compiled when the package is built, so this is quick; it is
    kept so that a caller can check before its first compressed collective
    (collectives.torch does, as do the multi-process tests)."""
    import numpy as np

    from . import kernels

    x = np.zeros(kernels.BLOCK, np.float32)
    for codec in kernels.CODECS:
        payload = np.empty(kernels.BLOCK, kernels.payload_dtype(codec))
        scales = np.empty(kernels.wire_nbytes(codec, kernels.BLOCK)[1], np.uint8)
        kernels.cpu_encode(codec, x, payload, scales, round_x=True)
        kernels.cpu_decode(codec, payload, scales, x)
