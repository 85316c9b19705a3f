"""Keras 3 (TensorFlow or PyTorch backend) on collectives, in the spirit of Horovod's Keras API.

    import keras, collectives
    from collectives.keras import (DistributedOptimizer, BroadcastGlobalVariablesCallback,
                                   MetricAverageCallback)

    comm = collectives.init()                                  # under mpiexec -n N
    model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(0.1), comm), loss=...)
    model.fit(x_of_this_rank, y_of_this_rank, batch_size=global_batch // comm.size,
              callbacks=[BroadcastGlobalVariablesCallback(comm, root=0), MetricAverageCallback(comm)])

- DistributedOptimizer averages the gradients over the ranks (one grouped
  allreduce; IndexedSlices allgathered or densified) before the wrapped
  optimizer applies them, so clipping (clipnorm, global_clipnorm),
  weight decay and loss-scale unscaling see the averaged gradients, as
  they would in one process training on the global batch.
- BroadcastGlobalVariablesCallback makes every rank start from the root's
  weights and optimizer state, once, when training begins (it builds the
  optimizer's variables first so that they are broadcast too).
- MetricAverageCallback replaces each epoch's metrics in `logs` by their
  mean over the ranks; put it before the callbacks that read them
  (checkpoints, early stopping, learning-rate schedules on a metric).

Needs Keras 3 on TensorFlow (`pip install '.[tensorflow]'`) or on PyTorch
(`KERAS_BACKEND=torch`: CPU tensors; TensorFlow is then not imported);
JAX is refused. `import collectives` does not import this package.
"""

from .callbacks import BroadcastGlobalVariablesCallback, MetricAverageCallback
from .optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer", "BroadcastGlobalVariablesCallback", "MetricAverageCallback"]
