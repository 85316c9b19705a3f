"""How processes find each other: MPI (mpiexec -n N, through mpi4py).

MPI is used only to agree on names at start-up; the collectives themselves go
through our own transports. Every MPI call here is nonblocking and polled
against the deadline, so a rank that never arrives is a timeout, not a hang.
"""

import os
import time

from .errors import CollectiveError, CollectiveTimeoutError
from .transport.shm import ShmRank, new_prefix

# Set by common launchers in every process they start.
LAUNCHER_VARIABLES = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")
_NAME_BYTES = 128


def mpi_world(comm=None):
    """The MPI communicator to bootstrap from, or None when running alone
    without mpi4py. Under a launcher, mpi4py is required."""
    try:
        from mpi4py import MPI
    except ImportError:
        launched = [v for v in LAUNCHER_VARIABLES if v in os.environ]
        if comm is not None or launched:
            raise CollectiveError(
                "this process was started by an MPI launcher (it sets "
                f"{', '.join(launched) or 'a communicator'}) but mpi4py is not installed: "
                "pip install 'collectives[mpi]'") from None
        return None
    return comm if comm is not None else MPI.COMM_WORLD


def _wait(request, deadline, what):
    while not request.Test():
        if time.perf_counter() >= deadline:
            raise CollectiveTimeoutError(f"timed out at start-up waiting for {what}")
        time.sleep(1e-4)


def shared_memory_rank(comm, timeout):
    """This process's ShmRank; every rank of `comm` must call this together."""
    from mpi4py import MPI

    deadline = time.perf_counter() + timeout
    rank, size = comm.Get_rank(), comm.Get_size()
    name = bytearray(_NAME_BYTES)
    shm = None
    if rank == 0:
        prefix = new_prefix()
        shm = ShmRank(0, size, prefix)  # makes the control segment before anyone looks
        name[:len(prefix)] = prefix.encode()
    _wait(comm.Ibcast([name, MPI.BYTE], root=0), deadline, "rank 0 to share the communicator's name")
    if rank != 0:
        shm = ShmRank(rank, size, bytes(name).rstrip(b"\0").decode())
    # Nobody returns (and could close) before every rank has mapped the control segment.
    _wait(comm.Ibarrier(), deadline, "every rank to attach")
    return shm
