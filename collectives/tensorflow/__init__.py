"""TensorFlow's way in to the library: collectives on tf.Tensors, with gradients.

    ops.py    allreduce, allgather, reduce_scatter, broadcast,
              broadcast_variables, grouped_allreduce: eagerly and inside
              tf.function (nodes of our own op that run when the graph
              runs), each with its gradient; typed_error / typed_errors
              to get the library's typed error back from TensorFlow's
    native.py the graph op: a small C op, built at first use, whose
              kernel runs an op's Python body (numpy_function's job,
              without its machinery)
    tape.py   DistributedGradientTape: gradients averaged over the ranks in
              one fused call (IndexedSlices allgathered, or densified)
    distribute.py  CrossDeviceOps for tf.distribute.MirroredStrategy: its
              replicas reduced on host ranks of this process, and over the
              processes with a communicator
    cluster.py  cluster_resolver / tf_config: MultiWorkerMirroredStrategy
              started from our ranks (worker r = rank r, ports exchanged
              through the communicator)

Every op takes a communicator with one rank in this process, as
collectives.init() gives under mpiexec, as collectives.torch does. Keras 3
(TensorFlow backend) is collectives.keras. Host tensors only for now: a
tensor on a GPU is copied to the host by `.numpy()`.

Needs TensorFlow (`pip install '.[tensorflow]'`); `import collectives` does
not import this package.
"""

from .ops import (allgather, allreduce, broadcast, broadcast_variables, grouped_allreduce, reduce_scatter,
                  typed_error, typed_errors)
from .tape import DistributedGradientTape, reduce_gradients
from .distribute import CrossDeviceOps
from .cluster import cluster_resolver, tf_config

__all__ = ["allreduce", "allgather", "reduce_scatter", "broadcast", "broadcast_variables", "grouped_allreduce",
           "DistributedGradientTape", "reduce_gradients", "typed_error", "typed_errors", "CrossDeviceOps",
           "cluster_resolver", "tf_config"]
