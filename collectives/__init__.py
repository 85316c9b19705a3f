"""collectives: GPU and host collective operations with our own data plane.

    import collectives
    with collectives.Communicator.local(4) as comm:       # 4 ranks in this process
        comm.allreduce([np.ones(8, np.float32) for _ in range(4)])

    comm = collectives.init()                             # one rank per process (mpiexec)
"""

from .communicator import Communicator
from .config import resolve_timeout
from .errors import CollectiveError, CollectiveTimeoutError, InvalidUsageError, RankFailedError
from .ops import SUPPORTED_DTYPES, ReduceOp

__all__ = [
    "Communicator", "init", "ReduceOp", "SUPPORTED_DTYPES",
    "CollectiveError", "InvalidUsageError", "CollectiveTimeoutError", "RankFailedError",
]
__version__ = "0.1.0"


def init(timeout=None, *, comm=None):
    """A communicator with one rank per process (SPMD).

    Rank and size come from MPI when the program runs under `mpiexec -n N`
    (or from `comm`, an mpi4py communicator); without a launcher it is a
    communicator of one rank. Every rank must call init together.
    """
    from . import bootstrap
    from .communicator import VirtualHostRanks

    timeout = resolve_timeout(timeout)
    world = bootstrap.mpi_world(comm)
    if world is None or world.Get_size() == 1:
        return Communicator(VirtualHostRanks(1), size=1, local_ranks=[0], timeout=timeout)
    ranks = bootstrap.shared_memory_rank(world, timeout)
    return Communicator(ranks, size=world.Get_size(), local_ranks=[world.Get_rank()], timeout=timeout)
