"""Keras callbacks: one start for every rank, and metrics averaged over the ranks."""

import numbers

import keras
import numpy as np

from .. import validation
from ._backend import agree, broadcast_variables, check_communicator

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback"]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """When training begins (the first `fit` only), every rank takes the
    root's model variables (trainable or not) and optimizer variables.

    comm   a communicator with one rank in this process
    root   the rank whose values every rank takes

    Builds the optimizer's variables first (slots, iteration count), so
    they are broadcast too and every rank's optimizer starts alike. Raises
    InvalidUsageError for a bad argument; the broadcast raises
    CollectiveTimeoutError or RankFailedError when a peer stalls or dies.
    """

    def __init__(self, comm, root=0):
        super().__init__()
        self._comm = check_communicator(comm)
        self._root = validation.root_rank(root, comm.size)
        self.broadcast_done = False

    def on_train_begin(self, logs=None):
        if self.broadcast_done:
            return
        model = self.model
        variables = list(model.variables)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None:
            if not optimizer.built:
                optimizer.build(model.trainable_variables)
            seen = {id(v) for v in variables}
            variables += [v for v in optimizer.variables if id(v) not in seen]
        broadcast_variables(variables, self._comm, self._root)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """At each epoch's end, replaces every number in `logs` (loss, metrics,
    validation metrics) by its mean over the ranks: one allreduce.

    comm   a communicator with one rank in this process

    Put it before the callbacks that read the metrics (checkpoints, early
    stopping, ReduceLROnPlateau), which Keras calls in list order with the
    same `logs`. Raises InvalidUsageError when ranks log different metric
    names; CollectiveTimeoutError or RankFailedError when a peer stalls or
    dies.
    """

    def __init__(self, comm):
        super().__init__()
        self._comm = check_communicator(comm)

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        names = sorted(name for name, value in logs.items() if _is_number(value))
        # The names travel (hashed) before the values, so ranks logging
        # different metrics raise instead of averaging one metric with another.
        agree(self._comm, repr(names), f"logs: ranks log different metrics at the end of epoch {epoch}; "
                                       f"this rank ({self._comm.rank}) logs {names}")
        values = np.array([float(logs[name]) for name in names], np.float64)
        if values.size:
            self._comm.allreduce(values, op="avg")
        for name, value in zip(names, values):
            logs[name] = float(value)


def _is_number(value):
    if isinstance(value, bool):
        return False
    if isinstance(value, numbers.Real):
        return True
    return getattr(value, "shape", None) == () and np.issubdtype(np.asarray(value).dtype, np.number)
