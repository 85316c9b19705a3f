"""Compressed gradient averaging as a DDP communication hook.

    import torch, torch.distributed as dist, collectives
    from collectives.torch import compression_hook

    dist.init_process_group("gloo")                  # under torchrun; any backend
    comm = collectives.init()                        # our communicator, beside it
    model = torch.nn.parallel.DistributedDataParallel(Net())
    model.register_comm_hook(comm, compression_hook("bf16"))   # or "fp16", "int8"

DDP hands the hook each gradient bucket (a flat float32 tensor) as soon as
backward has filled it; the hook averages it over the ranks with our
communicator's compressed allreduce (`Communicator.allreduce(...,
op="avg", compression=codec)`): every transfer carries 16 or 8 bits per
element (compression/wire.py) and every hop decodes into float32 and
adds in float32, so the only losses are the encodings themselves. Torch's
own `fp16_compress_hook` and `bf16_compress_hook` instead cast the bucket
to 16 bits, divide it by the world size there, and let the backend add
16-bit values: every partial sum is rounded to 16 bits again, and in fp16
a gradient below about 6e-8 times the world size flushes to zero (our fp16
codec scales every 32 elements by a power of two).

Where the communicator comes from, first match:
    compression_hook(..., communicator=comm)       that one
    the hook's state is a Communicator             that one
    the state has .communicator(device)            what it returns for the
                                                   bucket's device (our
                                                   torch.distributed
                                                   process group offers it)
    otherwise                                      collectives.init() on the
                                                   first bucket (every rank
                                                   at once), kept per device
When the state is a torch.distributed ProcessGroup, its size must be the
communicator's.

CPU buckets go through host ranks (collectives.init()); the allreduce runs
in the communicator's background thread, so backward goes on computing the
next bucket while this one travels, and the returned future completes when
the average is in the bucket. CUDA buckets go through GPU ranks
(collectives.init(device="cuda")), queued on the current stream; the
future completes at once (the work is stream-ordered).

Error feedback (`error_feedback=True`): each rank keeps, per bucket index,
what the codec lost when it encoded the rank's contribution, and adds it
to that bucket's next contribution, as `Communicator.fusion_buffer` does;
the algorithm is then `direct` (each contribution is encoded once and
nothing else is, so the residual is exactly what was lost). DDP rebuilds
its buckets after the first step; a bucket whose size changed starts again
from a zero residual.

Compression runs where the communicator compresses: host ranks and GPU
ranks of one node, and host ranks across nodes (HierarchicalCommunicator:
the node's reduction in float32 over shared memory, only what crosses
nodes encoded; with error feedback the residual is kept by the rank that
encodes its node's partial, hierarchy.py). A communicator on
backend="nccl" does not, and the hook refuses it.

Needs PyTorch; `import collectives` does not import this module.
"""

import threading

import numpy as np
import torch

from ..compression import warm_up, wire
from ..compression.kernels import CODECS
from ..errors import InvalidUsageError

__all__ = ["compression_hook", "CompressionState"]


def compression_hook(compression, error_feedback=False, communicator=None, *, algorithm="auto"):
    """A DDP communication hook that averages each gradient bucket with our
    compressed allreduce: `model.register_comm_hook(state, hook)`.

    compression     "bf16", "fp16" or "int8": what the bucket travels as
                    (float32 buckets only; accumulation is float32)
    error_feedback  keep what the codec lost on this rank, per bucket, and
                    add it to the bucket's next contribution
    communicator    the Communicator to use (one rank per process); None:
                    the state's, else collectives.init() (module doc)
    algorithm       the allreduce algorithm; "auto" lets the library pick
                    (with error feedback, "auto" means "direct")

    The returned hook is a `CompressionState` (it keeps the residuals and
    the communicators it made): `hook.residual(i)` is bucket i's residual on
    this rank, or None. Raises InvalidUsageError for an unknown codec here,
    and, from backward, for a bucket that is not float32.
    """
    return CompressionState(compression, error_feedback, communicator, algorithm)


class CompressionState:
    """The hook `compression_hook` returns: call it as `hook(state, bucket)`."""

    def __init__(self, compression, error_feedback=False, communicator=None, algorithm="auto"):
        if not isinstance(compression, str) or compression not in CODECS:
            raise InvalidUsageError(f"compression_hook: unknown compression {compression!r}; expected one of "
                                    f"{', '.join(map(repr, CODECS))} (for no compression, register no hook)")
        if not isinstance(error_feedback, bool):
            raise InvalidUsageError(f"compression_hook: error_feedback must be True or False, got {error_feedback!r}")
        if communicator is not None:
            _check_communicator(communicator)
        wire.check_compression(compression, np.dtype(np.float32), "avg")
        warm_up()   # the codecs' CPU loops load now: a build without them fails here, not in backward
        self.compression = compression
        self.error_feedback = error_feedback
        self.algorithm = "direct" if error_feedback and algorithm == "auto" else algorithm
        self._communicator = communicator
        self._made = {}        # device type -> communicator from collectives.init()
        self._residuals = {}   # bucket index -> float32 residual (NumPy array or CuPy array)
        self._lock = threading.Lock()
        self.__name__ = self.__qualname__ = f"collectives_{compression}_compression_hook"

    def __repr__(self):
        return f"compression_hook({self.compression!r}, error_feedback={self.error_feedback})"

    def residual(self, index):
        """What bucket `index` lost to the codec at its last step on this rank
        (float32, NumPy for CPU buckets), or None."""
        with self._lock:
            return self._residuals.get(index)

    def communicator(self, state, device):
        """The communicator a bucket on `device` goes through (module doc)."""
        if self._communicator is not None:
            return self._communicator
        if _is_communicator(state):
            return state
        if callable(getattr(state, "communicator", None)):
            return state.communicator(device)
        kind = torch.device(device).type
        if kind not in self._made:
            import collectives
            if kind == "cpu":
                self._made[kind] = collectives.init()
            elif kind == "cuda":
                self._made[kind] = collectives.init(device="cuda")
            else:
                raise InvalidUsageError(f"compression_hook: a bucket on {device}: CPU or CUDA tensors only")
        return self._made[kind]

    def __call__(self, state, bucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        if buffer.dtype != torch.float32:
            raise InvalidUsageError(
                f"compression_hook({self.compression!r}): DDP's gradient bucket {bucket.index()} is {buffer.dtype}; "
                "our codecs compress float32 gradients (they accumulate in float32). Keep the parameters in "
                "float32 (torch.autocast computes in 16 bits and keeps float32 gradients), or register no hook")
        comm = self.communicator(state, buffer.device)
        _check_communicator(comm)
        size = getattr(state, "size", None)
        if isinstance(state, torch.distributed.ProcessGroup) and callable(size) and size() != comm.size:
            raise InvalidUsageError(f"compression_hook: DDP's process group has {size()} ranks and the "
                                    f"communicator {comm.size}: average over the same ranks")
        if not buffer.is_contiguous():
            raise InvalidUsageError("compression_hook: the bucket is not contiguous")
        index = bucket.index()
        future = torch.futures.Future()
        if buffer.device.type == "cpu":
            array = buffer.detach().numpy()
            # The communicator's other collectives wait for this one (they raise
            # while it is in flight): each bucket is an owner of its own.
            owner = object()
            done = comm._fusion_submit(owner, lambda _fuser: self._reduce(comm, index, array))
            comm._fusion_done(owner, [done])

            def finish(done):
                error = done.exception()
                if error is None:
                    future.set_result(buffer)
                else:
                    future.set_exception(error)
            done.add_done_callback(finish)
        elif buffer.device.type == "cuda":
            from .optimizer import _on_torch_stream
            import cupy
            with _on_torch_stream(torch.cuda.current_stream(buffer.device)):
                self._reduce(comm, index, cupy.asarray(buffer))
            future.set_result(buffer)
        else:
            raise InvalidUsageError(f"compression_hook: a bucket on {buffer.device}: CPU or CUDA tensors only")
        return future

    def _reduce(self, comm, index, array):
        """Average `array` over the ranks in place, compressed (with error feedback if asked)."""
        if self.error_feedback and comm.size > 1:   # on one rank nothing is encoded, nothing lost
            with self._lock:
                residual = self._residuals.get(index)
                if residual is None or residual.shape != array.shape or type(residual) is not type(array):
                    residual = self._residuals[index] = array.copy()
                    residual[...] = 0
            if getattr(comm._ranks, "feeds_back_partials", False):
                # Across nodes the codec encodes the node's partial, on the rank holding its range:
                # the residual is kept there (hierarchy.py), not on this rank's contribution.
                with comm._ranks.feeding_back(residual.reshape(-1)):
                    comm.allreduce(array, op="avg", compression=self.compression, algorithm=self.algorithm)
                return
            array += residual
            rounded = array.copy()
            wire.round_trip(self.compression, rounded)
            np.subtract(array, rounded, out=residual)
        comm.allreduce(array, op="avg", compression=self.compression, algorithm=self.algorithm)


def _is_communicator(obj):
    return hasattr(obj, "allreduce") and hasattr(obj, "local_ranks") and hasattr(obj, "_fusion_submit")


def _check_communicator(comm):
    if not _is_communicator(comm):
        raise InvalidUsageError(f"compression_hook: expected a collectives Communicator, got {type(comm).__name__}")
    if len(comm.local_ranks) != 1:
        raise InvalidUsageError("compression_hook: the communicator must have one rank in this process "
                                "(collectives.init() under torchrun or mpiexec)")
    if not getattr(comm._ranks, "compresses", False):
        raise InvalidUsageError(f"compression_hook: compression is not available on {type(comm._ranks).__name__} "
                                "ranks (backend='nccl' does not compress)")
