"""DistributedGradientTape: a tf.GradientTape whose gradients are averaged over the ranks.

    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = DistributedGradientTape(tape, comm)       # comm = collectives.init()
    grads = tape.gradient(loss, model.trainable_variables)   # averaged: one fused call
    optimizer.apply_gradients(zip(grads, model.trainable_variables))

`reduce_gradients` is the part the Keras optimizer shares: dense gradients
go through one grouped_allreduce (fusion buffers, see collectives/fusion.py);
IndexedSlices gradients (what tf.gather and embeddings give) are allgathered,
values and indices, which keeps them sparse (duplicate indices add up where
they are applied, so the concatenation is the sum), or, with
`sparse_as_dense=True`, densified and reduced with the dense ones.
"""

import tensorflow as tf

from .. import validation
from ..errors import InvalidUsageError
from ..fusion import DEFAULT_THRESHOLD
from ..ops import ReduceOp
from .ops import allgather, check_communicator, grouped_allreduce

__all__ = ["DistributedGradientTape", "reduce_gradients"]


def reduce_gradients(gradients, comm, op="avg", compression=None, sparse_as_dense=False,
                     fusion_threshold=DEFAULT_THRESHOLD):
    """`gradients` (a list of tf.Tensors, tf.IndexedSlices or None) reduced
    over `comm`'s ranks with `op` ("avg" or "sum"): dense ones in one grouped
    allreduce (`compression`, `fusion_threshold`: as grouped_allreduce's),
    IndexedSlices allgathered (or densified when `sparse_as_dense`), None
    left as None. Every rank must pass the same structure. Returns the list
    in the same order. Raises InvalidUsageError for a bad argument,
    CollectiveTimeoutError or RankFailedError when a peer stalls or dies."""
    op = validation.gradient_op(op)
    out = list(gradients)
    dense, sparse = [], []
    for i, g in enumerate(out):
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices):
            if sparse_as_dense:
                out[i] = tf.convert_to_tensor(g)
                dense.append(i)
            else:
                sparse.append(i)
        else:
            dense.append(i)
    if dense:
        reduced = grouped_allreduce([out[i] for i in dense], comm, op, compression, fusion_threshold)
        for i, value in zip(dense, reduced):
            out[i] = value
    for i in sparse:
        g = out[i]
        values = allgather(g.values, comm)
        if op is ReduceOp.AVG:
            values = values / tf.cast(comm.size, values.dtype)
        out[i] = tf.IndexedSlices(values, allgather(g.indices, comm), g.dense_shape)
    return out


class DistributedGradientTape:
    """Wraps `tape` so that `gradient()` returns gradients reduced over `comm`'s ranks.

    tape              a tf.GradientTape (recorded already, or to be used in
                      `with`: this object enters and exits it)
    comm              a communicator with one rank in this process
                      (collectives.init() under mpiexec)
    op                "avg" (default: the mean gradient, what one process
                      training on every rank's batch together gets) or "sum"
    compression       None, or "bf16", "fp16", "int8" (float32 gradients)
    sparse_as_dense   reduce IndexedSlices gradients as dense tensors
                      (default: allgather their values and indices)
    fusion_threshold  bytes per fusion buffer of the grouped allreduce

    Everything else (watch, stop_recording, jacobian, ...) is the wrapped
    tape's. Works eagerly and inside tf.function. Raises InvalidUsageError
    for a bad argument (not a tape, op neither avg nor sum, an unknown codec).
    """

    def __init__(self, tape, comm, op="avg", compression=None, sparse_as_dense=False,
                 fusion_threshold=DEFAULT_THRESHOLD):
        if isinstance(tape, DistributedGradientTape):
            raise InvalidUsageError("tape: already a DistributedGradientTape")
        if not isinstance(tape, tf.GradientTape):
            raise InvalidUsageError(f"tape: expected a tf.GradientTape, got {type(tape).__name__}")
        check_communicator(comm)
        op = validation.gradient_op(op)
        validation.compression_codec(compression, op)
        from ..fusion import check_threshold
        check_threshold(fusion_threshold, "fusion_threshold")
        self._tape = tape
        self._comm = comm
        self._options = dict(op=op, compression=compression, sparse_as_dense=bool(sparse_as_dense),
                             fusion_threshold=fusion_threshold)

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        """The wrapped tape's gradient of `target` with respect to `sources`
        (`output_gradients`, `unconnected_gradients`: as tf.GradientTape's),
        reduced over the ranks: one grouped allreduce for the dense ones.
        Returns the same structure as `sources`. Raises InvalidUsageError when ranks'
        gradients differ in shape or presence, CollectiveTimeoutError or
        RankFailedError when a peer stalls or dies."""
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients,
                                    unconnected_gradients=unconnected_gradients)
        flat = tf.nest.flatten(grads)
        return tf.nest.pack_sequence_as(grads, reduce_gradients(flat, self._comm, **self._options))

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def __getattr__(self, name):
        tape = self.__dict__.get("_tape")
        if tape is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(tape, name)
