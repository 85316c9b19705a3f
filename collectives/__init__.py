"""collectives: GPU and host collective operations with our own data plane.

    import collectives
    with collectives.Communicator.local(4) as comm:       # 4 ranks in this process
        comm.allreduce([np.ones(8, np.float32) for _ in range(4)])

    comm = collectives.init()                             # one rank per process (mpiexec)
    comm = collectives.init(device="cuda")                # the same, each rank on a GPU
"""

import time

from .communicator import Communicator
from .config import resolve_timeout
from .errors import CollectiveError, CollectiveTimeoutError, InvalidUsageError, RankFailedError
from .ops import SUPPORTED_DTYPES, ReduceOp

__all__ = [
    "Communicator", "init", "ReduceOp", "SUPPORTED_DTYPES",
    "CollectiveError", "InvalidUsageError", "CollectiveTimeoutError", "RankFailedError",
]
__version__ = "0.1.0"


def init(timeout=None, *, comm=None, device="host"):
    """A communicator with one rank per process (SPMD).

    Rank and size come from MPI when the program runs under `mpiexec -n N`
    (or from `comm`, an mpi4py communicator); without a launcher it is a
    communicator of one rank. Every rank must call init together, and every
    rank must be on one machine.

    `device` says where this process's rank works:
        "host"        NumPy arrays (the default)
        "cuda"        GPU arrays, on GPU (local rank modulo the GPUs this
                      process sees), which init makes the current device:
                      several processes may share one GPU
        "emulated"    our CUDA kernels run on the CPU, on NumPy arrays
        "cuda:N", "emulated:N", or an int: that device
    """
    from . import bootstrap
    from .communicator import VirtualHostRanks

    timeout = resolve_timeout(timeout)
    deadline = time.perf_counter() + timeout
    on_host = isinstance(device, str) and device.strip().lower() == "host"
    if not on_host:
        from .devices import parse_spec
        parse_spec(device)  # a bad spec is an InvalidUsageError on every rank, before any exchange
    world = bootstrap.mpi_world(comm)
    alone = world is None or world.Get_size() == 1
    if on_host:
        if alone:
            return Communicator(VirtualHostRanks(1), size=1, local_ranks=[0], timeout=timeout)
        from .transport.shm import ShmRank
        ranks = bootstrap.process_rank(world, deadline, ShmRank)
        return Communicator(ranks, size=world.Get_size(), local_ranks=[world.Get_rank()], timeout=timeout)

    from .devices import device_for_rank
    if alone:
        from .executors.device import DeviceRanks
        opened = device_for_rank(device, 0)
        opened.use()
        return Communicator(DeviceRanks([opened]), size=1, local_ranks=[0], timeout=timeout)
    local_rank = bootstrap.local_rank(world, deadline)
    opened = error = None
    try:
        opened = device_for_rank(device, local_rank)
    except CollectiveError as failure:
        error = failure
    bootstrap.agree(world, deadline, error)   # every rank raises if one could not open its device
    opened.use()
    from .executors.device_process import DeviceProcessRank
    ranks = bootstrap.process_rank(world, deadline, lambda rank, size, prefix:
                                   DeviceProcessRank(rank, size, prefix, opened))
    return Communicator(ranks, size=world.Get_size(), local_ranks=[world.Get_rank()], timeout=timeout)
