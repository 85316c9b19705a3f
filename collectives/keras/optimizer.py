"""DistributedOptimizer for Keras 3 (TensorFlow or PyTorch backend): gradients averaged over the ranks before the update."""

import keras

from .. import validation
from ..errors import InvalidUsageError
from ..fusion import DEFAULT_THRESHOLD
from . import _backend

__all__ = ["DistributedOptimizer"]


def DistributedOptimizer(optimizer, comm, compression=None, *, op="avg", sparse_as_dense=False,
                         fusion_threshold=DEFAULT_THRESHOLD):
    """A copy of the Keras `optimizer` whose updates use gradients averaged over `comm`'s ranks.

    optimizer         a keras.optimizers.Optimizer (SGD, Adam, ...), not yet
                      used: the result is a new optimizer made from its
                      config (its class, learning rate or schedule,
                      clipping, weight decay), of a subclass of its class
                      with the same name
    comm              a communicator with one rank in this process
                      (collectives.init() under mpiexec)
    compression       None, or "bf16", "fp16", "int8" (float32 gradients)
    op                "avg" (default) or "sum"
    sparse_as_dense   reduce IndexedSlices gradients (embeddings) as dense
                      tensors (default: allgather their values and indices;
                      TensorFlow's only: the torch backend's are dense)
    fusion_threshold  bytes per fusion buffer of the grouped allreduce

    Its `apply` (which `apply_gradients` and model.fit's train step call)
    reduces the gradients, then runs the wrapped class's `apply`: clipping,
    weight decay and the update see averaged gradients. Every rank must
    compute gradients for the same variables. On Keras' TensorFlow backend
    the reduction is collectives.tensorflow's (a graph node inside
    tf.function); on its torch backend, the CPU gradient tensors are
    reduced in place, in one fused call. Returns the new optimizer.
    Raises InvalidUsageError for a bad argument (not a Keras optimizer, a
    backend other than TensorFlow and PyTorch; at the update, a gradient
    on a GPU on the torch backend).
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise InvalidUsageError(f"optimizer: expected a keras.optimizers.Optimizer, got {type(optimizer).__name__}")
    if getattr(optimizer, "_collectives_comm", None) is not None:
        raise InvalidUsageError("optimizer: already a collectives DistributedOptimizer")
    _backend.current("optimizer")
    _backend.check_communicator(comm)
    op = validation.gradient_op(op)
    validation.compression_codec(compression, op)
    from ..fusion import check_threshold
    check_threshold(fusion_threshold, "fusion_threshold")
    options = dict(op=op, compression=compression, sparse_as_dense=bool(sparse_as_dense),
                   fusion_threshold=fusion_threshold)
    base = type(optimizer)

    def apply(self, grads, trainable_variables=None):
        # Reduced before the base class's apply, which filters missing
        # gradients, unscales a loss scale, clips and decays: all of them on
        # the averaged gradients, as in one process on the global batch.
        return base.apply(self, _backend.reduce_gradients(list(grads), comm, **options), trainable_variables)

    # The same class name as the wrapped optimizer's, so that a saved model
    # names a class Keras knows (it loads with the plain optimizer).
    cls = type(base.__name__, (base,), {
        "apply": apply,
        "_collectives_comm": comm,
        "__module__": base.__module__,
        "__doc__": f"{base.__name__} averaging its gradients over a collectives communicator "
                   "(collectives.keras.DistributedOptimizer).",
    })
    return cls.from_config(optimizer.get_config())
