"""PyTorch's ways in to the library.

    optimizer.py   DistributedOptimizer and broadcast_parameters: Horovod's
                   style, on a communicator from collectives.init()

Needs PyTorch (`pip install '.[torch]'`); `import collectives` does not
import this package.
"""

from .optimizer import DistributedOptimizer, broadcast_parameters, host_array

__all__ = ["DistributedOptimizer", "broadcast_parameters", "host_array"]
