"""How processes find each other: a rendezvous they already have.

Under `mpiexec -n N` that is MPI (mpi4py); under `torchrun`, or inside a
torch.distributed backend, the c10d store (collectives/torch/rendezvous.py).
Either is used at start-up only, through one small interface, a
*rendezvous*:

    rank, size                          this process's place in the job
    allgather(data, nbytes, deadline, what) -> every rank's bytes, in rank order
    barrier(deadline, what)             every rank has arrived
    link(deadline)                      the messages between nodes (hierarchy.py)

so that the functions below (which ranks share a node, whether every rank
could open its device, the communicator's name) are written once. Only
handles travel through it (process ids, shared-memory names, CUDA IPC
handles, NCCL's id); data never does. Inside a node the collectives go
through our own transports, and between nodes through the rendezvous'
engine (MPI, or a torch.distributed group: hierarchy.py). Every exchange is
bounded by the deadline, so a rank that never arrives is a timeout, not a
hang. (That is why nodes are found from host names rather than with
MPI_Comm_split_type, a blocking collective with no nonblocking form.)
"""

import ctypes
import functools
import os
import signal
import socket
import sys
import time
from typing import NamedTuple, Tuple

from .errors import CollectiveError, CollectiveTimeoutError, InvalidUsageError, RankFailedError
from .transport import segments
from .transport.protocol import new_prefix

# Set by common launchers in every process they start.
LAUNCHER_VARIABLES = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")
# Set by torchrun (and by torch.distributed's env:// convention) in every
# process: enough to reach the c10d store that torchrun's agent serves.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Splits each machine into pretend nodes, for tests: one label per rank of the
# world, comma-separated ("0,0,1,1": ranks 0 and 1 on one node, 2 and 3 on
# another). Ranks with the same label on the same machine share a node; a
# label never joins ranks of different machines.
PRETEND_NODES_ENV = "COLLECTIVES_PRETEND_NODES"
_NAME_BYTES = 128
_ERROR_BYTES = 384
_NODE_BYTES = 256


def rendezvous(comm=None, deadline=None, environ=os.environ):
    """The rendezvous to bootstrap from: MPI's when `comm` (an mpi4py
    communicator) is given or an MPI launcher started this process; the c10d
    store's when torchrun did (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
    no mpi4py needed); else MPI's world when mpi4py is installed; None when
    running alone without it."""
    launched_by_mpi = [v for v in LAUNCHER_VARIABLES if v in environ]
    if comm is None and not launched_by_mpi and all(v in environ for v in TORCHRUN_VARIABLES):
        from .torch.rendezvous import torchrun_rendezvous
        return torchrun_rendezvous(deadline, environ)
    world = mpi_world(comm)
    return None if world is None else MpiRendezvous(world)


# MPICH's MPI_Finalize waits, in a barrier of its launcher's (PMI), for
# every process of the job to finalize too, so once a rank has died every
# survivor that leaves normally waits there forever (mpi4py finalizes at the
# interpreter's end). With this set, a process finalizes alone. MPICH reads
# it at MPI_Init, which importing mpi4py's MPI does: set here, before our
# first import of it, unless the user set it or MPI is already running.
NO_COLLECTIVE_FINALIZE = "MPIR_CVAR_NO_COLLECTIVE_FINALIZE"


# MPICH's MPI_Init installs a handler for SIGUSR1, which its launcher
# (hydra, under -disable-auto-cleanup) sends the ranks of a machine when one
# of them exits without finalizing. The next MPI call then asks mpiexec which
# processes died, and blocks reading the answer. Where mpiexec is out of
# reach (a cut link, its machine lost) the answer never comes: the rank hangs
# inside MPI, where no timeout of ours reaches it. We find dead ranks
# ourselves, and MPICH keeps nothing of the answer but for its fault-tolerant
# mode (off). So once MPI runs, the signal gets back the process's Python
# handler, or is ignored (its default action would end the process, which
# MPICH's handler had kept it from doing).
FAILURE_SIGNAL = signal.SIGUSR1
_BEFORE_MPI = {}   # FAILURE_SIGNAL's disposition before we replaced MPICH's handler


def mpi_world(comm=None):
    """The MPI communicator to bootstrap from, or None when running alone
    without mpi4py. Under a launcher, mpi4py is required."""
    if "mpi4py.MPI" not in sys.modules:
        os.environ.setdefault(NO_COLLECTIVE_FINALIZE, "1")
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
    _undo_mpich_failure_handler(MPI)
    return comm if comm is not None else MPI.COMM_WORLD


def failure_signal_before_mpi():
    """SIGUSR1's disposition as the process had it before MPI_Init, as
    signal.getsignal gives it (SIG_DFL, SIG_IGN as a launch's `trap "" USR1`
    leaves it, a Python handler)."""
    return _BEFORE_MPI.get(FAILURE_SIGNAL, signal.getsignal(FAILURE_SIGNAL))


def _undo_mpich_failure_handler(MPI):
    """Under MPICH, SIGUSR1 back to the process's Python handler, or ignored:
    see FAILURE_SIGNAL. Once per process, as MPI_Init runs once: a handler
    the program sets later stays. (signal.getsignal still gives what Python
    last saw: MPI_Init sets its handler in C.)"""
    if FAILURE_SIGNAL in _BEFORE_MPI or not MPI.Get_library_version().startswith("MPICH"):
        return
    before = _BEFORE_MPI[FAILURE_SIGNAL] = signal.getsignal(FAILURE_SIGNAL)
    try:
        signal.signal(FAILURE_SIGNAL, before if callable(before) else signal.SIG_IGN)
    except ValueError:   # (not the main thread: only there does Python set handlers, so ignored, even over one)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype, libc.signal.argtypes = ctypes.c_void_p, (ctypes.c_int, ctypes.c_void_p)
        libc.signal(FAILURE_SIGNAL, int(signal.SIG_IGN))


WATCH_SECONDS = 0.005   # between looks at the watched processes while a start-up exchange waits


def _wait(request, deadline, what, watched=None):
    """Poll `request` until done; CollectiveTimeoutError at the deadline,
    RankFailedError once a process of `watched` ({rank: pid}) has exited."""
    from .transport.segments import exited
    next_look = 0.0
    while not request.Test():
        now = time.perf_counter()
        if now >= deadline:
            raise CollectiveTimeoutError(f"timed out at start-up waiting for {what}")
        if watched and now >= next_look:
            next_look = now + WATCH_SECONDS
            dead = [rank for rank, pid in watched.items() if exited(pid)]
            if dead:
                raise RankFailedError(f"rank(s) {', '.join(map(str, dead))} died at start-up, while this rank "
                                      f"waited for {what}")
        time.sleep(1e-4)


class MpiRendezvous:
    """Start-up exchanges over an mpi4py communicator, every call nonblocking
    and polled against the deadline. `watched`: {rank: pid} of ranks on this
    machine whose death ends a wait at once (a shrink's members: one that
    dies while the shrunk communicator starts would otherwise cost the
    others the whole timeout)."""

    def __init__(self, comm, watched=None):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._watched = dict(watched or {})

    def allgather(self, data, nbytes, deadline, what):
        """Every rank's `data` (at most `nbytes` bytes), in rank order, each
        padded with zero bytes to `nbytes`."""
        from mpi4py import MPI
        mine = bytearray(nbytes)
        mine[:len(data[:nbytes])] = data[:nbytes]
        everyone = bytearray(nbytes * self.size)
        _wait(self.comm.Iallgather([mine, MPI.BYTE], [everyone, MPI.BYTE]), deadline, what, self._watched)
        return [bytes(everyone[i:i + nbytes]) for i in range(0, len(everyone), nbytes)]

    def barrier(self, deadline, what):
        _wait(self.comm.Ibarrier(), deadline, what, self._watched)

    def link(self, deadline):
        """hierarchy.py's messages between nodes: MPI point-to-point on a
        private duplicate of the communicator (MPI_Comm_idup, polled), so our
        messages never match the program's own."""
        from .transport.mpi import MpiLink
        copy, request = self.comm.Idup()
        _wait(request, deadline, "every rank to duplicate the MPI communicator", self._watched)
        return MpiLink(copy)


def _allgather_text(rendezvous, text, nbytes, deadline, what):
    """Every rank's `text` (at most `nbytes` of UTF-8), in rank order."""
    return [data.rstrip(b"\0").decode(errors="replace")
            for data in rendezvous.allgather(text.encode()[:nbytes], nbytes, deadline, what)]


class Topology(NamedTuple):
    """Which ranks share a node. Nodes are numbered by their lowest rank
    (node 0 holds rank 0), and each node lists its ranks in rank order."""
    nodes: Tuple[Tuple[int, ...], ...]
    machines: Tuple[str, ...]      # per rank: its machine (host name and boot id)

    @property
    def size(self):
        return len(self.machines)

    def node_of(self, rank):
        return _placement(self)[rank][0]

    def local_of(self, rank):
        """`rank`'s index among the ranks of its node."""
        return _placement(self)[rank][1]

    @property
    def consecutive(self):
        """Whether every node holds consecutive ranks (its rows are one range of an all-gather's out)."""
        return all(list(node) == list(range(node[0], node[0] + len(node))) for node in self.nodes)

    def sharing_cores(self, rank):
        """How many ranks run on `rank`'s kernel, and so share its cores:
        those with its boot id, whatever their host names. Containers or
        namespaces with host names of their own are nodes of their own (their
        own /dev/shm) but not cores of their own: counted by host name, 2
        such hosts of 2 ranks on a 2-core machine each looked like 2 ranks
        with a core each, and every wait spun hundreds of µs on the core
        that the rank it waited for needed. Two machines never
        share a boot id; without one, the host name alone counts."""
        def kernel(machine):
            name, _, boot = machine.rpartition("/")
            return boot or machine
        mine = kernel(self.machines[rank])
        return sum(kernel(machine) == mine for machine in self.machines)

    def machine_rank(self, rank):
        """`rank`'s index among the ranks on its machine (pretend nodes ignored):
        which GPU of the machine a rank takes."""
        return [r for r, m in enumerate(self.machines) if m == self.machines[rank]].index(rank)


@functools.lru_cache(maxsize=16)
def _placement(found):
    """Per rank: (its node, its index in the node)."""
    where = [None] * found.size
    for k, ranks in enumerate(found.nodes):
        for local, rank in enumerate(ranks):
            where[rank] = (k, local)
    return where


def machine_name():
    """This machine: its host name and boot id, as NCCL tells hosts apart
    (two machines given one host name still differ; containers on one
    machine have their own names, and their own /dev/shm)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def pretend_label(rank, size, environ=os.environ):
    """This rank's label from $COLLECTIVES_PRETEND_NODES ("" when unset)."""
    spec = environ.get(PRETEND_NODES_ENV, "").strip()
    if not spec:
        return ""
    labels = [label.strip() for label in spec.split(",")]
    if len(labels) != size or not all(labels):
        raise InvalidUsageError(
            f"${PRETEND_NODES_ENV}={spec!r} must give one node label per rank, comma-separated, for "
            f"{size} ranks (for example {','.join(str(r * 2 // size) for r in range(size))})")
    return labels[rank]


def topology(rendezvous, deadline, environ=os.environ):
    """Which ranks of the rendezvous share a node: ranks on one machine, split
    further by $COLLECTIVES_PRETEND_NODES. Every rank must call this
    together; a bad setting on any rank raises on every rank."""
    rank, size = rendezvous.rank, rendezvous.size
    # The labels are the job's, one per rank of the world: a rendezvous of
    # some of its ranks (a torch.distributed group of some ranks) says where
    # its ranks sit in the world.
    world_rank, world_size = getattr(rendezvous, "world_rank", rank), getattr(rendezvous, "world_size", size)
    try:
        mine = f"ok\n{machine_name()}\n{pretend_label(world_rank, world_size, environ)}"
    except InvalidUsageError as error:
        mine = f"error\n{error}"
    answers = [text.split("\n") for text in
               _allgather_text(rendezvous, mine, _NODE_BYTES, deadline, "every rank's machine and node")]
    failed = [(r, a[1]) for r, a in enumerate(answers) if a[0] != "ok"]
    if failed:
        raise InvalidUsageError("; ".join(f"rank {r}: {message}" for r, message in failed))
    nodes = {}
    for r, (_, machine, label) in enumerate(answers):
        nodes.setdefault((machine, label), []).append(r)
    return Topology(tuple(tuple(ranks) for ranks in sorted(nodes.values())),
                    tuple(machine for _, machine, _ in answers))


def processes(rendezvous, deadline):
    """Every rank's (process id, rank in the job's world), in rank order:
    how the survivors of a failure across nodes tell the dead (by pid, on
    one machine) and which pretend node each was on (by world rank)."""
    world_rank = getattr(rendezvous, "world_rank", rendezvous.rank)
    texts = _allgather_text(rendezvous, f"{os.getpid()} {world_rank}", 64, deadline, "every rank's process id")
    return tuple(tuple(int(word) for word in text.split()) for text in texts)


def local_rank(rendezvous, deadline):
    """This rank's index among the ranks on its machine (which GPU it takes),
    and the Topology."""
    found = topology(rendezvous, deadline)
    return found.machine_rank(rendezvous.rank), found


def agree(rendezvous, deadline, error):
    """Raise on every rank if any rank reports an `error` (an exception or None)."""
    text = "" if error is None else f"{type(error).__name__}: {error}"
    errors = _allgather_text(rendezvous, text, _ERROR_BYTES, deadline, "every rank to open its device")
    failed = [(rank, e) for rank, e in enumerate(errors) if e]
    if failed:
        raise CollectiveError("; ".join(f"rank {rank} could not start: {e}" for rank, e in failed)) from error


def process_rank(rendezvous, deadline, make_rank):
    """This process's rank object, `make_rank(rank, size, prefix)`; every rank
    must call this together. Rank 0 makes its rank (and with it the control
    segment) before the others look for it. The prefix is all that travels:
    it names rank 0's process, which holds the control segment, and the
    others map it from there (transport/segments.py), so new_prefix() is
    called in the process that becomes rank 0, here and in node_process_rank."""
    rank, size = rendezvous.rank, rendezvous.size
    made, prefix = None, ""
    if rank == 0:
        prefix = new_prefix()
        made = make_rank(0, size, prefix)
    names = _allgather_text(rendezvous, prefix, _NAME_BYTES, deadline, "rank 0 to share the communicator's name")
    if rank != 0:
        made = _attach(make_rank, (rank, size, names[0]), 0)
    # Nobody returns (and could close) before every rank has mapped the control segment.
    rendezvous.barrier(deadline, "every rank to attach")
    return made


def node_process_rank(rendezvous, deadline, make_rank, found):
    """process_rank for every node at once: this process's rank object among
    the ranks of its node, `make_rank(local rank, node size, prefix,
    ranks_on_machine)`, or None when it is alone on its node (pretend nodes,
    and hosts that are containers or namespaces of one kernel, share a
    machine: its ranks all compete for its cores, Topology.sharing_cores). Each node's first rank makes the
    control segment; the others attach to their own node's, and never to
    another node's (they could not map it). Every rank calls this."""
    rank = rendezvous.rank
    node = found.nodes[found.node_of(rank)]
    local, leader = node.index(rank), node[0]
    on_machine = found.sharing_cores(rank)
    made, prefix = None, ""
    if len(node) > 1 and rank == leader:
        prefix = new_prefix()
        made = make_rank(0, len(node), prefix, on_machine)
    names = _allgather_text(rendezvous, prefix, _NAME_BYTES, deadline, "each node's first rank to share its name")
    if len(node) > 1 and rank != leader:
        made = _attach(make_rank, (local, len(node), names[leader], on_machine), leader)
    rendezvous.barrier(deadline, "every rank to attach")
    return made


def _attach(make_rank, arguments, leader):
    """make_rank(*arguments) for a rank that maps the control segment of
    rank `leader`. A leader that released it before this rank mapped it
    gave up this start, the name already sent: a rank it waited for died or
    was late, and it raised for that (RankFailedError or the timeout). This
    rank raises CollectiveTimeoutError too, so that a shrink goes on with a
    new round on both, not closed on one (hierarchy.py's shrink)."""
    try:
        return make_rank(*arguments)
    except segments.Released as error:
        raise CollectiveTimeoutError(f"rank {leader}, which makes this communicator's shared memory, gave up "
                                     f"starting it before this rank attached ({error})") from error
