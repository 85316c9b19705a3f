"""How processes find each other: MPI (mpiexec -n N, through mpi4py).

MPI is used only to agree on names at start-up; the collectives themselves go
through our own transports. Every MPI call here is nonblocking and polled
against the deadline, so a rank that never arrives is a timeout, not a hang.
"""

import os
import socket
import time

from .errors import CollectiveError, CollectiveTimeoutError
from .transport.protocol import new_prefix

# Set by common launchers in every process they start.
LAUNCHER_VARIABLES = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")
_NAME_BYTES = 128
_ERROR_BYTES = 384


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


def _allgather_text(comm, text, nbytes, deadline, what):
    """Every rank's `text` (at most `nbytes` of UTF-8), in rank order."""
    from mpi4py import MPI
    mine = bytearray(nbytes)
    data = text.encode()[:nbytes]
    mine[:len(data)] = data
    everyone = bytearray(nbytes * comm.Get_size())
    _wait(comm.Iallgather([mine, MPI.BYTE], [everyone, MPI.BYTE]), deadline, what)
    return [bytes(everyone[i:i + nbytes]).rstrip(b"\0").decode(errors="replace")
            for i in range(0, len(everyone), nbytes)]


def local_rank(comm, deadline):
    """This rank's index among the ranks on its machine. Every rank must be on
    one machine: peers map each other's memory."""
    hosts = _allgather_text(comm, socket.gethostname(), _NAME_BYTES, deadline, "every rank's host name")
    if len(set(hosts)) > 1:
        raise CollectiveError(
            f"the ranks run on {len(set(hosts))} machines ({', '.join(sorted(set(hosts)))}); ranks in "
            "separate processes map each other's memory, so they must share one machine")
    return comm.Get_rank()


def agree(comm, deadline, error):
    """Raise on every rank if any rank reports an `error` (an exception or None)."""
    text = "" if error is None else f"{type(error).__name__}: {error}"
    errors = _allgather_text(comm, text, _ERROR_BYTES, deadline, "every rank to open its device")
    failed = [(rank, e) for rank, e in enumerate(errors) if e]
    if failed:
        raise CollectiveError("; ".join(f"rank {rank} could not start: {e}" for rank, e in failed)) from error


def process_rank(comm, deadline, make_rank):
    """This process's rank object, `make_rank(rank, size, prefix)`; every rank
    of `comm` must call this together. Rank 0 makes its rank (and with it the
    control segment) before the others look for it."""
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    name = bytearray(_NAME_BYTES)
    made = None
    if rank == 0:
        prefix = new_prefix()
        made = make_rank(0, size, prefix)
        name[:len(prefix)] = prefix.encode()
    _wait(comm.Ibcast([name, MPI.BYTE], root=0), deadline, "rank 0 to share the communicator's name")
    if rank != 0:
        made = make_rank(rank, size, bytes(name).rstrip(b"\0").decode())
    # Nobody returns (and could close) before every rank has mapped the control segment.
    _wait(comm.Ibarrier(), deadline, "every rank to attach")
    return made
