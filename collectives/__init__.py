"""collectives: GPU and host collective operations with our own data plane.

    import collectives
    with collectives.Communicator.local(4) as comm:       # 4 ranks in this process
        comm.allreduce([np.ones(8, np.float32) for _ in range(4)])

    comm = collectives.init()                             # one rank per process (mpiexec)
    comm = collectives.init(device="cuda")                # the same, each rank on a GPU
    comm = collectives.init(device="cuda", backend="nccl")  # the same, collectives run by NCCL
"""

import time

from .communicator import Communicator, resolve_backend
from .config import check_switches, resolve_timeout
from .errors import (CollectiveError, CollectiveTimeoutError, InvalidUsageError, RankExcludedError, RankFailedError,
                     RevokedError)
from .ops import SUPPORTED_DTYPES, ReduceOp

__all__ = [
    "Communicator", "init", "ReduceOp", "SUPPORTED_DTYPES",
    "CollectiveError", "InvalidUsageError", "CollectiveTimeoutError", "RankFailedError", "RevokedError",
    "RankExcludedError",
]
__version__ = "0.1.0"


def init(timeout=None, *, comm=None, device="host", backend="ours"):
    """A communicator with one rank per process (SPMD): its collectives take
    and return one bare array per call.

    Rank and size come from MPI when the program runs under `mpiexec -n N`
    (or from `comm`, an mpi4py communicator), from torchrun's environment
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: the ranks meet through its
    c10d store, and mpi4py is not needed) when torchrun started it; without
    a launcher it is a communicator of one rank. Every rank must call init
    together.

    `timeout`: seconds any call (init's own exchanges included) may wait for
    its peers; None takes $COLLECTIVES_TIMEOUT, else 300.

    init learns which ranks share a node (host name and boot id; tests split
    a machine into pretend nodes with $COLLECTIVES_PRETEND_NODES, see
    bootstrap.py). When all ranks share one node, host ranks reach each
    other through shared memory alone. When they span several nodes, host
    ranks get a hierarchical communicator (hierarchy.py): our shared memory
    inside each node, MPI between nodes (under torchrun, a torch.distributed
    Gloo group: torch/link.py). GPU ranks across nodes need
    backend="nccl", which runs whole collectives in NCCL.

    `device` says where this process's rank works:
        "host"        NumPy arrays (the default)
        "cuda"        GPU arrays, on GPU (local rank modulo the GPUs this
                      process sees), which init makes the current device:
                      several processes may share one GPU
        "emulated"    our CUDA kernels run on the CPU, on NumPy arrays
        "cuda:N", "emulated:N", or an int: that device

    `backend` says who runs the collectives:
        "ours"        our plans and kernels (the default)
        "nccl"        NCCL, through CuPy's binding (executors/nccl.py); a
                      "cuda" device only, at most one rank per GPU

    Returns a Communicator (a HierarchicalCommunicator across nodes). Raises
    InvalidUsageError for a bad argument (before any exchange, on every
    rank); CollectiveError on every rank when a rank cannot open its device
    or NCCL is missing; CollectiveTimeoutError when a rank does not join
    within the timeout.
    """
    from . import bootstrap

    timeout = resolve_timeout(timeout)
    backend = resolve_backend(backend)
    check_switches()
    deadline = time.perf_counter() + timeout
    binding = check_device(device, backend)   # a bad spec, or a missing NCCL, raises on every rank before any exchange
    return _start(bootstrap.rendezvous(comm, deadline), device, backend, binding, timeout, deadline)


def check_device(device, backend):
    """Raise InvalidUsageError for a bad device spec, CollectiveError when
    backend="nccl" has no NCCL; returns NCCL's binding for backend="nccl"."""
    from .validation import naming

    if backend == "nccl":
        from .executors import nccl as nccl_backend
        with naming("device"):
            nccl_backend.cuda_spec(device)
        return nccl_backend.load_binding()
    if not _on_host(device):
        from .devices import parse_spec
        with naming("device"):
            parse_spec(device)
    return None


def _on_host(device):
    return isinstance(device, str) and device.strip().lower() == "host"


def start(rendezvous, device="host", backend="ours", timeout=None, deadline=None):
    """init's work once the processes have a rendezvous (bootstrap.py): MPI's,
    the c10d store's (the torch.distributed backend calls this with the
    store it is given), or None for a process alone. Every rank calls it
    together. Returns the Communicator; raises as init does."""
    timeout = resolve_timeout(timeout)
    backend = resolve_backend(backend)
    check_switches()
    deadline = time.perf_counter() + timeout if deadline is None else deadline
    return _start(rendezvous, device, backend, check_device(device, backend), timeout, deadline)


def _measure(communicator, ranks, timeout, across_nodes=False):
    """ranks.measure (ShmRank's: the limits that are the machine's), the
    communicator closed where it raises. `across_nodes`: `ranks` is this
    node's part of a communicator across nodes (its loop's limit only)."""
    try:
        ranks.measure(timeout, None if across_nodes else communicator)
    except BaseException as error:
        communicator.__exit__(type(error), error, None)
        raise


def _start(rendezvous, device, backend, binding, timeout, deadline):
    from . import bootstrap
    from .communicator import VirtualHostRanks

    alone = rendezvous is None or rendezvous.size == 1
    if _on_host(device):
        if alone:
            return Communicator(VirtualHostRanks(1), size=1, local_ranks=[0], timeout=timeout)
        found = bootstrap.topology(rendezvous, deadline)
        if len(found.nodes) > 1:
            from .hierarchy import HierarchicalCommunicator
            return HierarchicalCommunicator.start(rendezvous, found, deadline, timeout)
        from .transport.shm import ShmRank
        ranks = bootstrap.process_rank(rendezvous, deadline, ShmRank)
        communicator = Communicator(ranks, size=rendezvous.size, local_ranks=[rendezvous.rank], timeout=timeout)
        _measure(communicator, ranks, timeout)
        return communicator

    from .devices import device_for_rank
    if backend == "nccl":
        from .executors import nccl as nccl_backend
    if alone:
        opened = device_for_rank(device, 0)
        opened.use()
        if backend == "nccl":
            ranks = nccl_backend.NcclRanks.in_process([opened.index], timeout)
        else:
            from .executors.device import DeviceRanks
            ranks = DeviceRanks([opened])
        return Communicator(ranks, size=1, local_ranks=[0], timeout=timeout)
    rank, size = rendezvous.rank, rendezvous.size
    local_rank, found = bootstrap.local_rank(rendezvous, deadline)
    if len(found.nodes) > 1 and backend != "nccl":
        raise CollectiveError(
            f"GPU ranks with backend='ours' must share one node, but these span {len(found.nodes)} nodes "
            f"(ranks {' | '.join(' '.join(map(str, node)) for node in found.nodes)}); across nodes use "
            "backend='nccl', or host arrays (device='host'), whose collectives cross nodes through MPI "
            "or torch.distributed")
    opened = error = unique_id = None
    try:
        opened = device_for_rank(device, local_rank)
        if backend == "nccl" and rank == 0:
            unique_id = nccl_backend.new_unique_id(binding)
    except CollectiveError as failure:
        error = failure
    bootstrap.agree(rendezvous, deadline, error)   # every rank raises if one could not open its device (or make NCCL's id)
    opened.use()
    if backend == "nccl":
        unique_id = nccl_backend.share_unique_id(rendezvous, deadline, unique_id)
        ranks = nccl_backend.NcclRanks.in_processes(binding, opened, rank, size, unique_id, timeout)
        return Communicator(ranks, size=size, local_ranks=[rank], timeout=timeout)
    from .executors.device_process import DeviceProcessRank
    ranks = bootstrap.process_rank(rendezvous, deadline, lambda rank, size, prefix:
                                   DeviceProcessRank(rank, size, prefix, opened))
    return Communicator(ranks, size=size, local_ranks=[rank], timeout=timeout)
