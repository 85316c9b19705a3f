"""PyTorch's ways in to the library.

    optimizer.py      DistributedOptimizer and broadcast_parameters: Horovod's
                      style, on a communicator from collectives.init()
    process_group.py  the torch.distributed backend "collectives", which
                      importing this package registers:
                          import collectives.torch
                          torch.distributed.init_process_group("collectives")
                      (under torchrun: no mpiexec, no mpi4py); DDP, FSDP2
                      and torch.distributed's calls run on it unchanged;
                      shrink_default_group() goes on with the ranks left
                      after one failed
    hooks.py          compression_hook: our compressed allreduce (float32
                      sums) as a DDP communication hook
    rendezvous.py,    start-up through a c10d store, and the messages
    link.py           between nodes on a Gloo group

Needs PyTorch (`pip install '.[torch]'`); `import collectives` does not
import this package.
"""

import torch.distributed as _dist

from .hooks import compression_hook
from .optimizer import DistributedOptimizer, broadcast_parameters, host_array
from .process_group import (BACKEND, ProcessGroupCollectives, create_process_group, create_process_group_extended,
                            shrink_default_group)

__all__ = ["DistributedOptimizer", "broadcast_parameters", "host_array", "ProcessGroupCollectives", "BACKEND",
           "compression_hook", "shrink_default_group"]


def _register():
    """Register the backend once (a second import, or a reload, keeps the first)."""
    if BACKEND.upper() not in _dist.Backend._plugins:
        try:
            _dist.Backend.register_backend(BACKEND, create_process_group_extended, extended_api=True,
                                           devices=["cpu", "cuda"])
        except TypeError:   # a torch before `devices` (tested: 2.13 only)
            _dist.Backend.register_backend(BACKEND, create_process_group)


if _dist.is_available():
    _register()
