"""CrossDeviceOps: tf.distribute.MirroredStrategy's reductions run by collectives.

    import collectives.tensorflow as ctf
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ctf.CrossDeviceOps())
    # or, one process per rank under mpiexec, reducing over every process's replicas too:
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ctf.CrossDeviceOps(collectives.init()))

How a reduction runs. MirroredStrategy hands the ops one value per replica
(its devices in this process). Each replica is a rank of a communicator of
host ranks in this process (Communicator.local(n), made once per replica
count): the replicas' values are reduced to rank 0 by its `reduce`, then,
with `comm`, that result is allreduced over the processes (several values
of one batch_reduce in one fused allreduce_many), and the result is copied
to every destination device (the base class's broadcast, as
ReductionToOneDevice does). Eagerly that runs at once; in a graph (what
strategy.run inside tf.function, and Keras fit, trace) it is one
graph node per call (ops._run), so it runs each time the graph runs.

Reductions: SUM and MEAN (the mean over every replica of every process:
each process must have the same number of replicas, which the first call
of each description checks). Dtypes: those collectives reduces; a MEAN of
integers is the library's avg, truncated in the input's dtype, where
ReductionToOneDevice divides into float64 (MirroredStrategy sends int32 to
its own ReductionToOneDevice anyway).
IndexedSlices (embedding gradients) stay sparse, as ReductionToOneDevice
keeps them: the replicas' values and indices are concatenated (the sum of
IndexedSlices is their concatenation: duplicates add where applied), and
with `comm` allgathered over the processes (collectives.tensorflow.allgather);
MEAN divides the values by the number of replicas. `strategy.gather` is a
concatenation of the replicas' tensors, allgathered over the processes with
`comm`.

With `comm`, every process must run the same reductions in the same order
(one MirroredStrategy per process, the same program on each): the
communicator numbers its calls. Keras: Keras scales each replica's loss by
the strategy's replica count, which counts this process's replicas only;
summed over every process's replicas, the gradients would come out
`comm.size` times the mean. With sum_across="mean" a SUM is averaged over
the processes instead, and a fit on each process's share of every global
batch trains as one process on the global batches (tests/test_tensorflow.py
compares the weights; in one process, ours against ReductionToOneDevice).
"""

import threading

import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as _tf_cross_device_ops

from ..communicator import Communicator
from ..errors import InvalidUsageError
from ..fusion import DEFAULT_THRESHOLD, check_threshold
from ..ops import ReduceOp
from .ops import _agree_once, _fresh, _run, allgather, check_communicator, check_reducible

__all__ = ["CrossDeviceOps"]

_REDUCE_OPS = {tf.distribute.ReduceOp.SUM: ReduceOp.SUM, tf.distribute.ReduceOp.MEAN: ReduceOp.AVG}


def _reduce_op(reduce_op):
    try:
        return _REDUCE_OPS[tf.distribute.ReduceOp(reduce_op)]
    except (KeyError, ValueError):
        raise InvalidUsageError(f"reduce_op: expected tf.distribute.ReduceOp.SUM or MEAN, got {reduce_op!r}") from None


class CrossDeviceOps(tf.distribute.CrossDeviceOps):
    """tf.distribute.CrossDeviceOps whose reductions are the library's.

    comm              None (default): reduce over the strategy's replicas in
                      this process only. Else a communicator with one rank in
                      this process (collectives.init() under mpiexec): the
                      replicas' result is then reduced over the processes too
    fusion_threshold  bytes per fusion buffer of the fused allreduce over
                      the processes (batch_reduce)
    sum_across        with `comm`, what a SUM does over the processes: "sum"
                      (default: the sum over every replica of every
                      process) or "mean" (summed over this process's
                      replicas, averaged over the processes: what Keras fit
                      needs, since it scales each replica's loss by the
                      replica count of its own process; then its gradients
                      are the mean over the global batch). MEAN is the mean
                      over every replica either way.

    Pass it to tf.distribute.MirroredStrategy(devices, cross_device_ops=...).
    Call close() (or use it as a context manager) to free the host ranks it
    made; `comm` stays the caller's. Raises InvalidUsageError for a bad
    argument (a communicator with several ranks in this process, a reduce
    op other than SUM and MEAN, a dtype collectives does not reduce,
    processes with different replica counts or shapes).
    """

    def __init__(self, comm=None, fusion_threshold=DEFAULT_THRESHOLD, sum_across="sum"):
        super().__init__()
        if comm is not None:
            check_communicator(comm, "comm")
        check_threshold(fusion_threshold, "fusion_threshold")
        if sum_across not in ("sum", "mean"):
            raise InvalidUsageError(f"sum_across: expected 'sum' or 'mean', got {sum_across!r}")
        self._comm = comm
        # What a SUM does over the processes: a strategy (and Keras) sees
        # only this process's replicas, and scales losses by their count.
        self._across = {ReduceOp.SUM: ReduceOp.SUM if sum_across == "sum" else ReduceOp.AVG,
                        ReduceOp.AVG: ReduceOp.AVG}
        self._threshold = fusion_threshold
        self._replicas = {}   # replica count -> Communicator.local(count)
        self._lock = threading.Lock()

    def __deepcopy__(self, memo):
        # Strategies copy their options; communicators cannot be copied (they
        # are shared memory and processes): the copy shares them.
        return self

    def close(self):
        """Close the host ranks made for the replicas (not `comm`). Raises nothing."""
        with self._lock:
            replicas, self._replicas = self._replicas, {}
        for local in replicas.values():
            local.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _local(self, count):
        with self._lock:
            local = self._replicas.get(count)
            if local is None:
                local = self._replicas[count] = Communicator.local(count)
            return local

    # -- what MirroredStrategy calls ------------------------------------------------------

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        """`per_replica_value`'s values reduced with `reduce_op` (SUM or MEAN)
        over the replicas (and the processes, with `comm`), on every device of
        `destinations` (`options` unused). Returns what ReductionToOneDevice
        returns: a Mirrored value, or a tensor for one device. Raises
        InvalidUsageError for a bad argument."""
        return self.batch_reduce_implementation(reduce_op, [(per_replica_value, destinations)], options)[0]

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        """Each (value, destinations) pair of `value_destination_pairs`
        reduced as reduce_implementation does with `reduce_op` (`options`
        unused): the dense values of one replica count and dtype in one
        node, reduced over the processes in one fused allreduce. Returns the
        list of results, in order. Raises InvalidUsageError for a bad argument."""
        op = _reduce_op(reduce_op)
        pairs = list(value_destination_pairs)
        results = [None] * len(pairs)
        dense = []
        for i, (value, destinations) in enumerate(pairs):
            values = list(value.values)
            if any(isinstance(v, tf.IndexedSlices) for v in values):
                results[i] = self.broadcast(self._reduce_sparse(op, values, i), self._to(destinations, value))
            else:
                dense.append(i)
        if dense:
            reduced = self._reduce_dense(op, [list(pairs[i][0].values) for i in dense])
            for i, tensor in zip(dense, reduced):
                results[i] = self.broadcast(tensor, self._to(pairs[i][1], pairs[i][0]))
        return results

    def broadcast_implementation(self, tensor, destinations):
        """`tensor` copied to every device of `destinations` (as the base
        class does: a copy per device, no collective; with `comm` every
        process already holds its own value). Returns a Mirrored value.
        Raises nothing of its own."""
        return _tf_cross_device_ops.simple_broadcast(tensor, destinations, always_mirrored=True,
                                                     canonicalize_devices=self._canonicalize_devices)

    def _gather_implementation(self, per_replica_value, destinations, axis, options):
        """strategy.gather: the replicas' tensors concatenated along `axis`,
        then allgathered over the processes with `comm`, on every device of
        `destinations` (`options` unused). Raises InvalidUsageError for a
        bad argument."""
        values = list(per_replica_value.values)
        with tf.device(values[0].device):
            gathered = tf.concat(values, axis)
            if self._comm is not None:
                rank = gathered.shape.rank
                axis = axis % rank if rank else axis
                if axis:   # allgather concatenates along the first dimension
                    order = [axis, *[d for d in range(rank) if d != axis]]
                    back = [order.index(d) for d in range(rank)]
                    gathered = tf.transpose(allgather(tf.transpose(gathered, order), self._comm), back)
                else:
                    gathered = allgather(gathered, self._comm)
        return self.broadcast(gathered, self._to(destinations, per_replica_value))

    # -- how ------------------------------------------------------------------------------

    @staticmethod
    def _to(destinations, value):
        """Where a result goes: `destinations`, or the value's own devices
        when none is given (as ReductionToOneDevice reads it)."""
        return destinations if _tf_cross_device_ops.check_destinations(destinations) else value

    def _reduce_dense(self, op, groups):
        """One reduced tensor per group of per-replica tensors: a node per
        (replica count, dtype), its values reduced on local ranks, then (with
        `comm`) in one fused allreduce over the processes."""
        for g, values in enumerate(groups):
            for v in values:
                check_reducible(v.dtype, f"per_replica_value (value {g})", op)
            if len({v.dtype for v in values}) != 1 or len({tuple(v.shape) for v in values}) != 1:
                raise InvalidUsageError(f"per_replica_value (value {g}): every replica must hold the same dtype and "
                                        f"shape; got {[(v.dtype.name, tuple(v.shape)) for v in values]}")
        by_kind = {}
        for g, values in enumerate(groups):
            by_kind.setdefault((len(values), values[0].dtype), []).append(g)
        out = [None] * len(groups)
        for (count, dtype), members in by_kind.items():
            flat = [v for g in members for v in groups[g]]
            with tf.device(groups[members[0]][0].device):
                reduced = _run("CollectivesCrossDeviceReduce", self._body(op, count, len(members)), flat,
                               [dtype] * len(members))
            for g, tensor in zip(members, reduced):
                tensor.set_shape(groups[g][0].shape)
                out[g] = tensor
        return out

    def _body(self, op, count, k):
        """The NumPy side: k tensors of `count` replicas each, flat in `arrays`
        (tensor by tensor); returns the k reduced arrays."""
        local, comm, threshold, across = self._local(count), self._comm, self._threshold, self._across[op]

        def body(*arrays):
            results = []
            for j in range(k):
                mine = arrays[j * count:(j + 1) * count]
                if comm is not None:   # the processes agree on the replica count, dtype and shape
                    _agree_once(comm, "cross_device_reduce", op, count, tf.as_dtype(mine[0].dtype), mine[0].shape,
                                "per_replica_value")
                result = _fresh(mine[0].shape, mine[0].dtype)
                if result.size:
                    # Rank 0 receives the reduction; the other ranks' outputs
                    # are never written (and so cost no page).
                    outs = [result.reshape(-1)] + [np.empty(result.size, result.dtype) for _ in range(count - 1)]
                    local.reduce([a.reshape(-1) for a in mine], root=0, op=op.value, out=outs)
                results.append(result)
            filled = [r.reshape(-1) for r in results if r.size]
            if comm is not None and filled:
                # avg of the processes' avgs is the mean over every replica:
                # every process has `count` replicas (agreed above)
                comm.allreduce_many(filled, op=across.value, fusion_threshold=threshold)
            return results

        return body

    def _reduce_sparse(self, op, values, index):
        """IndexedSlices (and any dense values among them, as slices of every
        row) concatenated over the replicas, then allgathered over the processes."""
        slices = [v if isinstance(v, tf.IndexedSlices) else _as_slices(v) for v in values]
        check_reducible(slices[0].values.dtype, f"per_replica_value (value {index})", op)
        with tf.device(values[0].device):
            merged_values = tf.concat([s.values for s in slices], 0)
            indices = tf.concat([tf.cast(s.indices, tf.int64) for s in slices], 0)
            divisor = len(values) if op is ReduceOp.AVG else 1
            if self._comm is not None:
                merged_values = allgather(merged_values, self._comm)
                indices = allgather(indices, self._comm)
                if self._across[op] is ReduceOp.AVG:   # MEAN, or SUM with sum_across="mean"
                    divisor *= self._comm.size
            if divisor > 1:
                merged_values = merged_values / tf.cast(divisor, merged_values.dtype)
        return tf.IndexedSlices(merged_values, indices, slices[0].dense_shape)


def _as_slices(tensor):
    """A dense tensor as the IndexedSlices of all its rows."""
    tensor = tf.convert_to_tensor(tensor)
    return tf.IndexedSlices(tensor, tf.range(tf.shape(tensor, out_type=tf.int64)[0]), tf.shape(tensor, out_type=tf.int64))
