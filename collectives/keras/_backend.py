"""What collectives.keras asks of Keras' backend, on each backend it runs on:
the gradients reduced before an update, and variables broadcast from a root.

- TensorFlow: collectives.tensorflow's ops (graph nodes inside tf.function,
  IndexedSlices kept sparse).
- PyTorch: Keras' torch trainer hands the optimizer CPU torch tensors; they
  go to the communicator as NumPy arrays sharing their memory
  (collectives.torch.tensors), reduced in place in one fused call
  (Communicator.allreduce_many). TensorFlow is not imported.

JAX is refused: its train step is a pure function under jit, where a call
into our communicator would need a host callback; not offered yet.
"""

import keras
import numpy as np

from .. import validation
from ..errors import InvalidUsageError
from ..transport.protocol import description_hash

BACKENDS = ("tensorflow", "torch")


def current(name):
    """Keras' backend, one of BACKENDS; `name` is the argument the error names."""
    backend = keras.backend.backend()
    if backend not in BACKENDS:
        raise InvalidUsageError(f"{name}: collectives.keras runs on Keras' TensorFlow or PyTorch backend, not "
                                f"{backend!r} (set KERAS_BACKEND=tensorflow or KERAS_BACKEND=torch)")
    return backend


def check_communicator(comm, name="comm"):
    return validation.one_rank_in_this_process(comm, name, "collectives.keras' optimizer and callbacks")


def reduce_gradients(gradients, comm, op, compression, sparse_as_dense, fusion_threshold):
    """The gradients (None left as None) reduced over `comm` with `op`, in their order."""
    if keras.backend.backend() == "tensorflow":
        from ..tensorflow.tape import reduce_gradients as reduce_tensorflow_gradients
        return reduce_tensorflow_gradients(gradients, comm, op, compression, sparse_as_dense, fusion_threshold)
    return _reduce_torch_gradients(gradients, comm, op, compression, fusion_threshold)


def _reduce_torch_gradients(gradients, comm, op, compression, fusion_threshold):
    import torch
    from ..torch.tensors import host_array

    out = list(gradients)
    present = []
    for i, gradient in enumerate(out):
        if gradient is None:
            continue
        if not isinstance(gradient, torch.Tensor) or gradient.layout != torch.strided:
            got = f"{type(gradient).__name__} ({gradient.layout})" if isinstance(gradient, torch.Tensor) else \
                type(gradient).__name__
            raise InvalidUsageError(f"gradients[{i}]: expected a dense torch.Tensor, got {got}")
        if gradient.device.type != "cpu":
            raise InvalidUsageError(f"gradients[{i}]: on {gradient.device}; on Keras' torch backend "
                                    "collectives.keras reduces CPU tensors")
        out[i] = gradient.detach().contiguous()   # the gradient itself when contiguous: reduced in place
        present.append(i)
    if present:
        comm.allreduce_many([host_array(out[i]) for i in present], op=op, fusion_threshold=fusion_threshold,
                            compression=compression)
    return out


def broadcast_variables(variables, comm, root):
    """Every rank's `variables` (Keras variables) given the root's values."""
    if keras.backend.backend() == "tensorflow":
        from ..tensorflow.ops import broadcast_variables as broadcast_tensorflow_variables
        return broadcast_tensorflow_variables(variables, comm, root)
    values = [np.asarray(keras.ops.convert_to_numpy(v)) for v in variables]
    layout = [(a.dtype.str, a.shape) for a in values]
    agree(comm, f"broadcast_variables {root} {layout}",
          f"variables: ranks broadcast different lists of variables (this rank, {comm.rank}: {layout})")
    flat = np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in values] or
                          [np.empty(0, np.uint8)])
    if flat.size:
        comm.broadcast(flat, root=root)
    offset = 0
    for variable, a in zip(variables, values):
        variable.assign(flat[offset:offset + a.nbytes].view(a.dtype).reshape(a.shape))
        offset += a.nbytes
    return None


def agree(comm, description, error):
    """Raise InvalidUsageError(error) on every rank unless all ranks pass the same description."""
    signature = np.array([description_hash(description) >> 1], np.int64)
    everyone = comm.allgather(signature)
    if (everyone != everyone[0]).any():
        raise InvalidUsageError(error)
