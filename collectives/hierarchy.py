"""Collectives across nodes: our shared memory inside a node, MPI between nodes.

init() returns a HierarchicalCommunicator when the ranks span several nodes
(bootstrap.topology; $COLLECTIVES_PRETEND_NODES splits one machine into
several). N ranks on K nodes, node k with G_k ranks (not necessarily as
many on every node). Inside a node, ranks read each other's workspaces
through the step protocol of transport/protocol.py; between nodes they
exchange messages through MPI (transport/mpi.py), never a network layer of
our own.

allreduce, as Horovod and NCCL do it across nodes:

    1. reduce-scatter inside each node: local rank l folds the node's inputs on
       its range [l*b, (l+1)*b), b = ceil(count / G_k): P_k, the node's partial.
    2. across nodes, over MPI: the ranges are cut into segments, each held by
       one rank on every node; for large ranges on 3 nodes or more, two_shot:
         a. every holder sends its P_k of a piece (1/K of a segment) to the
            piece's owner, its holder on node j for piece j;
         b. the owner folds the K partials in node order (below);
         c. the owner sends the result to the holders on the other nodes.
       Each rank sends 2 (K-1)/K of its range, as a ring would, in 2 rounds.
       Otherwise direct (uses_two_shot): every holder sends its segment to the
       holders on the other nodes, and each folds the K partials itself, in
       the same order; one round, and with 2 nodes no more bytes than two_shot.
    3. all-gather inside each node: every rank copies every range.

The fold order, the same for every reducing collective and on every rank:
each output element is

    F = ((P_0 op P_1) op P_2) ... op P_{K-1},   P_k = ((x_0 op x_1) op ...) op x_{G_k - 1}

nodes numbered by their lowest rank, a node's ranks in rank order (x_l:
its local rank l's input). Each is one op-table row run by the NumPy
interpreter (executors/host.py), so 16-bit floats accumulate in float32 and
round once per row, and avg divides by N once, in the row across nodes.
Every element is folded by one rank and copied to the others: all ranks
hold the same bits. (MPI's allreduce promises no order, nor the same bits
on every rank, so it is not used.)

The other collectives, in the same shape:

    reduce          allreduce's steps, where only the root's node receives the
                    results across nodes, and only the root gathers them.
    reduce_scatter  the block of rank r is handled, on a node other than r's, by
                    the local rank with r's local index modulo the node's size:
                    1. each handler folds its node's inputs on the blocks it handles;
                    2. sends each partial to the block's owner over MPI;
                    3. the owner folds the K partials in node order into its output.
    allgather       each rank sends its block to its handler on every other node,
                    then every rank copies each block from the node-mate holding it.
    broadcast       the root scatters K pieces to one leader per node (the root on
                    its own node, the first rank elsewhere), the leaders exchange
                    them (scatter + all-gather, as MPI does for large messages);
                    then the node's ranks copy from their leader.
    barrier         every rank of a node arrives; the node leaders hear from
                    each other (dissemination over MPI); the node's ranks leave.

The exchanges (all_to_all, all_to_all_v, gather, scatter) fold nothing: each
block moves once, straight from the rank that has it to the rank that needs
it (exchange(), exchange_plan()). A block between ranks of one node goes
through the node's shared memory (its sender copies it into its WORK in
phase 0, its receiver out of there in phase 1); a block between ranks of
different nodes is one MPI message from the sender's x into the receiver's
out, as MPI_Alltoall and NCCL's grouped send/recv move it, never through a
leader. Nodes that exchange nothing inside skip the phases (every node but
the root's for gather and scatter).

Small messages take a shorter way where every node has as many ranks: one
call of the node's compiled loop and one exchange between counterparts
(see "small messages" below), with the same bits. Where the loop takes the
dtype and MPI carries the messages, that way (at every size, but for an
allreduce) and a large allreduce in blocks run as compiled Programs, one C
call each (across.py), while a Program's buffers would hold at most 128
MiB; the barrier too, as a one-byte allreduce.

Steps inside a node are phases of one run of the step protocol: phase p
starts once every other rank of the node has completed p phases of the call
(so phase 0 waits for them to have left the last call, whose last phase may
have read this rank's workspace). Nodes of one rank skip them.

Every wait has the call's deadline. A rank that fails tells every other
rank, inside its node through the control segment and across nodes through
MPI, so no one waits out the timeout for a rank that is gone; a whole node
that stops is noticed at the timeout (on one machine, sooner:
MpiLink.watch). `algorithm=` is checked but not used: inside a node every
collective runs the phases above, folding as the direct algorithm does.
allreduce_many and fusion_buffer work, through allreduce.

allreduce(compression=codec) (compressed_allreduce) runs allreduce's steps
with ranges and pieces on codec blocks: the node's reduce-scatter and
all-gather stay float32 over shared memory; between nodes each holder sends
its node's partial encoded (the codec's bytes, as on one node), and every
rank that folds a piece folds the decodings of the same bytes in node
order, its own partial replaced by the decoding of what it sent: the same
bits everywhere. Error feedback (feeding_back) keeps, on the rank that
encodes a partial, what its encoding lost.
"""

import contextlib
import functools
import os
import time
import weakref
from typing import NamedTuple

import numpy as np

from . import bootstrap
from .algorithms.schedule import (
    ALL_TO_ALL, ALL_TO_ALL_V, ALLGATHER, ALLREDUCE, BROADCAST, GATHER, REDUCE_SCATTER, REDUCE_TO_ROOT,
    ROOTED_COLLECTIVES, SCATTER,
)
from .communicator import Communicator
from .config import resolve_compressed_piece_bytes, resolve_fast_sizes
from .errors import CollectiveError, CollectiveTimeoutError, InvalidUsageError, RankFailedError, RevokedError
from .executors import host
from .across import PROGRAM_MAX_BYTES, Programs, Shape, loop_runs_nodes, node_call
from .ops import ReduceOp, partial_op
from .compression import kernels as codec_kernels
from .compression.kernels import BLOCK
from .plan import COUNT, DST_OFF, INPUT, NSRC, OUTPUT, REDUCE_FINAL_OP, REDUCE_OP, SRC0, WORK
from .transport import fastpath
from .transport.layout import RECOVERY_ROUNDS
from .transport.mpi import MpiLink
from .transport.protocol import call_signature
from .validation import call_arguments, compressed_dtype, root_rank

# The paths a call takes (`route`, at the end, decides; chosen_algorithm answers them: router.py)
PROGRAM = "program"            # a compiled Program (across.py): the small path, or a larger call it takes
COUNTERPARTS = "counterparts"  # the small path's steps (`small`), where no Program can run
PHASES = "hierarchical"        # the phases: node, between nodes, node (allreduce, reduce, ... below)
COMPRESSED = "compressed"      # allreduce(compression=): the codec between nodes (compressed_allreduce)
EXCHANGE = "exchange"          # all_to_all, all_to_all_v, gather, scatter (`exchange`)

# Polls of a Program's MPI requests before its wait yields the core, where each rank has a core,
POLL_SPIN_DEDICATED = 2000
# and where this machine's ranks outnumber its cores: none. A poll is an MPI_Test (about 0.25 µs:
# it drives MPI's progress), and a counterpart that shares this core can answer only once it runs:
# the loop's 64 polls (cheap reads of a flag there) cost 16 µs a wait here. On 2 pretend nodes of 2
# (4 processes, 2 cores), 0 against 64: a 16 KiB allgather 17 µs against 33, a 64 KiB broadcast 25
# against 36, a 64 KiB allreduce 40 against 57 (docs/across-nodes.md).
POLL_SPIN_OVERSUBSCRIBED = 0

# Buffers an op-table row or a message names, besides INPUT, OUTPUT and a rank's WORK:
PART = 4        # this rank's partial or result (process memory, or a range of its WORK)
RECEIVED = 5    # partials received from other nodes, before they are folded


class Call(NamedTuple):
    """A checked call: what HierarchicalCommunicator._plan returns in place of a plan."""
    collective: str
    dtype: np.dtype
    count: int          # elements of each rank's input
    op: ReduceOp
    root: int
    description: str
    compression: str = None   # the codec of what crosses nodes (allreduce of float32), or None
    counts: tuple = None      # all_to_all_v: counts[q][r], the elements rank q sends rank r

    algorithm = "hierarchical"   # what Communicator.chosen_algorithm names (every call runs this module's steps)


class HierarchicalCommunicator(Communicator):
    """A Communicator whose ranks, one per process, span several nodes.

    The same API and errors as Communicator. `topology` says which ranks
    share a node (bootstrap.Topology), `node` is this rank's node, an index
    into topology.nodes."""

    @classmethod
    def start(cls, rendezvous, found, deadline, timeout):
        """Every rank of the rendezvous (bootstrap.py) calls this together (init does)."""
        from .transport.shm import ShmRank

        shm = bootstrap.node_process_rank(rendezvous, deadline, ShmRank, found)
        if shm is not None:   # (its errors name the ranks as the user numbers them)
            shm.group.name_ranks(found.nodes[found.node_of(rendezvous.rank)])
        link = rendezvous.link(deadline)
        ranks = HierarchyRanks(found, rendezvous.rank, shm, link)
        ranks.processes = bootstrap.processes(rendezvous, deadline)
        ranks.world_size = getattr(rendezvous, "world_size", rendezvous.size)
        if isinstance(link, MpiLink):   # a rank of another node on this machine that dies: raise, not time out
            me = rendezvous.rank
            link.watch({q: ranks.processes[q][0] for q in range(rendezvous.size)
                        if found.machines[q] == found.machines[me] and found.node_of(q) != found.node_of(me)})
        communicator = cls(ranks, size=rendezvous.size, local_ranks=[rendezvous.rank], timeout=timeout)
        if shm is not None:   # (each node's ranks choose their loop's settings on their own)
            from . import _measure
            _measure(communicator, shm, timeout, across_nodes=True)
        return communicator

    def __init__(self, ranks, *, size, local_ranks, timeout):
        super().__init__(ranks, size=size, local_ranks=local_ranks, timeout=timeout)
        self.topology = ranks.topology
        self.node = ranks.node_index
        if ranks.programs is not None:   # a call whose shape has a Program: one compiled call (across.py)
            self._fast_allreduce, self._fast_collective = ranks.programs.allreduce, ranks.programs.collective

    def __repr__(self):
        nodes = len(self.topology.nodes)
        return super().__repr__().replace("<Communicator", f"<HierarchicalCommunicator nodes={nodes}")

    def _auto(self, collective, elements, itemsize, root, binding=None, compression=None):
        return "hierarchical"

    # -- going on after a failure (transport/mpi_recovery.py) ---------------------

    def revoke(self):
        """Communicator.revoke across nodes: every rank's calls raise
        RevokedError, on this node through its shared memory, on the others
        through MPI."""
        self._recovering("revoke").abort(RevokedError(f"rank {self.rank} revoked the communicator"))

    def shrink(self):
        """Communicator.shrink across nodes, where every rank is on one
        machine (pretend nodes); `agree` and `revoke` work there too.

        The survivors agree by MPI messages (transport/mpi_recovery.py: the
        lowest live rank coordinates, collects who joined and tells them).
        Where the members still span nodes, MPI makes a communicator of them
        alone (MPI_Comm_create_group) and the shrunk communicator starts on
        it as collectives.init starts one (a HierarchicalCommunicator);
        where they are on one node, or one rank is left, it starts on
        messages between them over this one's MPI communicator
        (mpi_recovery.SurvivorsRendezvous: no MPI collective). `old_ranks`
        and `epoch` as Communicator.shrink's.

        Raises InvalidUsageError where ranks are on several machines (no
        rank can tell a dead peer there from a slow one) or the link between
        nodes is not MPI's; RankExcludedError on a rank the coordinator
        left out; CollectiveTimeoutError where no decision came within the
        timeout, RankFailedError where a member died while the new
        communicator started: this communicator then stays (aborted), and
        shrink() again goes on without the dead, RECOVERY_ROUNDS calls in
        all as on one machine (then RankFailedError, and it is closed). A
        member that died inside MPI_Comm_create_group leaves a thread of
        this process blocked there for good, on that decision's tag, apart
        from the next decision's call (mpi_recovery.group_tag) under MPICH;
        under Open MPI the next call waits behind it, so going on works
        there where the members left are on one node.
        """
        from .transport.mpi_recovery import SurvivorsRendezvous, create_group

        h = self._recovering("shrink")
        self._stop_worker()
        h.abort(RevokedError(f"rank {self.rank} revoked the communicator to shrink it"))
        deadline = time.perf_counter() + self.timeout
        h.shrink_calls += 1
        if h.shrink_calls > RECOVERY_ROUNDS:   # as on one machine: a bounded number of tries, then an end
            self._close_failed(h)
            raise RankFailedError(f"ranks kept failing (or timing out) while the survivors shrank the communicator "
                                  f"across nodes: all {RECOVERY_ROUNDS} tries failed")
        try:
            members, decision = h.recovery().members(h.candidates, deadline)
            h.candidates = members
            world_rank = h.processes[self.rank][1]
            if len({h.topology.node_of(q) for q in members}) == 1:
                # One node (or one rank) left: it starts on messages between the members, with no MPI
                # collective, which a member that died during it would leave blocked for good.
                rendezvous = SurvivorsRendezvous(h.recovery(), members, decision, world_rank, h.world_size)
            else:
                pids = h.recovery().pids
                rendezvous = bootstrap.MpiRendezvous(create_group(h.link, members, decision, pids, deadline),
                                                     watched={new: pids[old] for new, old in enumerate(members)
                                                              if old != self.rank})
                rendezvous.world_rank, rendezvous.world_size = world_rank, h.world_size
            shrunk = self._start_on_every_member(h, rendezvous, members, decision, deadline)
        except CollectiveTimeoutError:
            raise   # (no decision in time, or a member died or was late: this communicator stays for shrink())
        except BaseException:
            self._close_failed(h)
            raise
        self._close_failed(h)
        shrunk.epoch, shrunk.old_ranks = self.epoch + 1, tuple(members)
        return shrunk

    def _start_on_every_member(self, h, rendezvous, members, decision, deadline):
        """The shrunk communicator, once every member's start returned: the
        members agree on it (this communicator's agreement, the decision's
        number) and each returns it or none does. A member that died as it
        started, after some members' start had returned and before the
        others' did, left the first in the new communicator and the rest in
        this one, each side shrinking its own: the survivors ended apart
        (chaos across pretend nodes, seed 171). Otherwise every member
        abandons what it started (no barrier: a member is dead) and raises,
        and shrink() again goes on here without the dead."""
        from . import _start
        from .transport.mpi_recovery import agree

        shrunk = failed = None
        try:
            shrunk = _start(rendezvous, "host", "ours", None, self.timeout, deadline)
        except CollectiveTimeoutError as error:   # (RankFailedError among them: a member died)
            failed = error
        try:
            if agree(h.recovery(), failed is None, members, deadline, call=decision):
                return shrunk
            failed = failed or RankFailedError(
                f"a member of ranks {', '.join(map(str, members))} failed as the shrunk communicator started")
        except BaseException as error:
            failed = error
        if shrunk is not None:
            shrunk.__exit__(type(failed), failed, None)   # abort and close it, without a barrier
        raise failed

    def _recovering(self, what):
        """The ranks, where the survivors can shrink; else InvalidUsageError."""
        self._check_open()
        h = self._ranks
        machines = set(h.topology.machines)
        if h.processes is None or not isinstance(h.link, MpiLink) or len(machines) > 1:
            raise InvalidUsageError(
                f"{what}: not available on this communicator across nodes: it needs every rank on one machine "
                f"(these are on {len(machines)}) and MPI between the nodes")
        return h

    def _close_failed(self, h):
        """Close this communicator after a shrink, with no barrier: its peers may be dead."""
        if not self._closed:
            self._closed = True
            if self._p2p is not None:
                self._p2p.close()
            h.close()

    def _call_shape(self, collective, nbytes, dtype, root, algorithm, compression, in_place):
        """The checked Call router.route asks `route` about (float32 where
        no dtype is given): every call runs this module's steps, so the
        algorithm is "hierarchical", a named one checked, not used."""
        root = root_rank(root, self.size) if collective in ROOTED_COLLECTIVES else 0
        dtype = np.dtype(np.float32 if dtype is None else dtype)
        return self._plan(collective, dtype, nbytes // dtype.itemsize, "sum", root, algorithm, None, compression)

    def _plan_v(self, dtype, matrix, algorithm, binding):
        """all_to_all_v's Call (its counts checked alike on every rank by Communicator.all_to_all_v)."""
        total = sum(map(sum, matrix))
        return Call(ALL_TO_ALL_V, dtype, total, ReduceOp.SUM, 0, f"all_to_all_v of {total} {dtype} in all",
                    counts=matrix)

    def _plan(self, collective, dtype, elements, op, root, algorithm, binding, compression=None):
        """The checked Call: everything Communicator checks before it plans."""
        op, root = call_arguments(collective, op, root, algorithm, compression, self.size)
        compressed_dtype(compression, dtype)
        # (the codec in the signature: a rank whose call differs only in it is named, not misread)
        codec = "" if compression is None else f", {compression} between nodes"
        description = f"{collective} of {elements} {dtype} (op {op.value}, root {root}{codec})"
        return Call(collective, dtype, elements, op, root, description, compression)


class HierarchyRanks:
    """This process's rank of a HierarchicalCommunicator: its rank of the
    node's step protocol (a ShmRank; None when alone on its node), its MPI
    link to the other nodes, and scratch buffers."""

    addressable = False   # no plan binds the caller's arrays
    host_only = True      # NumPy arrays
    locations = None
    compresses = True     # allreduce(compression=): what crosses nodes is encoded (compressed_allreduce)
    transport = "host-hierarchical"
    path = PHASES   # (the general path's name; `route` says which path a call takes: chosen_path)
    # (HierarchicalCommunicator.start's: every rank's (pid, rank in the job's world), and the world's
    # size, for shrink; the ranks a shrink still counts on, and its agreement, once one began)
    processes = world_size = None
    candidates = None
    agreement = None
    shrink_calls = 0   # shrink() calls (at most RECOVERY_ROUNDS)

    def __init__(self, topology, rank, shm, link):
        self.topology, self.rank, self.shm, self.link = topology, rank, shm, link
        self.node_index = topology.node_of(rank)
        self.node_ranks = topology.nodes[self.node_index]
        self.local = topology.local_of(rank)
        self._scratch = {}
        self._node = None       # the node's Communicator over shm (plans_step)
        self.residual = None    # error feedback for the next compressed call (feeding_back)
        self.calls = 0          # calls made: each one's number goes into its signature
        self.candidates = tuple(range(topology.size))   # who a shrink counts on (HierarchicalCommunicator.shrink)
        self.last_path = None   # the path `route` gave the last call the general path's way in ran
        # the small path's limit (config.FastSizes): the loop's slots, the same on every node whatever its
        # cores (inside a node, its loop may take a message above its own merged step's limit the large way)
        self.fast_small_max = (resolve_fast_sizes() if shm is None else shm.group.fast_sizes).small_max
        self.compressed_piece_bytes = resolve_compressed_piece_bytes()   # (compressed_pieces)
        # Polls of a Program's MPI requests before it yields its core: none
        # where this machine's ranks outnumber its cores (the peer may need this one): the ranks of
        # every node on this kernel, whatever their host names (Topology.sharing_cores).
        on_machine = topology.sharing_cores(rank)
        self.poll_spin = POLL_SPIN_OVERSUBSCRIBED if on_machine > (os.cpu_count() or 1) else POLL_SPIN_DEDICATED
        # Compiled Programs (across.py), where they can run: how the small path
        # and a large allreduce of equal nodes run, and the communicator's shortcuts.
        self.programs = Programs(self) if Programs.available(link) else None
        # A barrier as a small allreduce of one byte where a Program runs one
        # (no rank has every node's partial before every rank has arrived):
        # 23 µs against 158 through the phases, 2 nodes of 2 on the 2-core machine (MPICH: 15).
        compiled = Call("barrier", np.dtype(np.uint8), 1, ReduceOp.SUM, 0, "barrier")
        self._compiled_barrier = ((compiled, np.zeros(1, np.uint8))
                                  if self.programs is not None and takes_small(self, compiled) else None)

    def plans_step(self, collective, x, out, op, root, deadline):
        """A node step: the node's `collective` (one of the five; reduce
        and broadcast to or from local rank `root`; `op` a fold's) of x
        into `out` where its loop leaves the call to the plans (a single
        copy: its step_for answers fastpath.PLANS), as on one machine,
        through the node's own Communicator over `shm` (`_node_until`).
        In place: `out` x (allreduce, broadcast, reduce), x's own block
        (reduce_scatter), or x this rank's block of `out` (allgather). 0 once
        done (a Program's node step); else it raises what that call
        raises, the node aborted."""
        node = self._node_until(deadline)
        if collective == REDUCE_SCATTER:
            node.reduce_scatter(x, op, out=out)
        elif collective == ALLGATHER:
            node.allgather(x.reshape(-1), out=out.reshape(-1))
        elif collective == BROADCAST:
            node.broadcast(x, root=root, out=None if out is x else out)
        elif collective == ALLREDUCE:
            node.allreduce(x, op, out=None if out is x else out)
        else:
            node.reduce(x, root=root, op=op, out=None if out is x else out)
        return 0

    def _node_until(self, deadline):
        """The node's own Communicator over `shm` (made at the first node
        step the loop leaves to the plans), its timeout until `deadline`."""
        if self._node is None:
            self._node = Communicator(self.shm, size=self.shm.size, local_ranks=[self.shm.rank], timeout=0.0)
        self._node.timeout = max(deadline - time.perf_counter(), 0.0)
        return self._node

    def tuning(self):
        """Communicator.tuning: this node's loop's (none where alone on its node)."""
        return {} if self.shm is None else self.shm.tuning()

    def chosen_path(self, call, kind=None):
        """The path a call (a checked Call) takes: `route`'s (router.path_of)."""
        return route(self, call)

    def run(self, call, inputs, outputs, input_infos, output_infos, deadline):
        """Communicator._collective's last step: `call` is what _plan returned."""
        x = inputs[0].reshape(-1)
        out = x if outputs[0] is inputs[0] else outputs[0].reshape(-1)
        path = self.last_path = route(self, call)
        if path == COMPRESSED:
            residual = self.residual
            if residual is not None:   # (direct between nodes, told apart from a call without feedback)
                if residual.shape != (call.count,) or residual.dtype != np.float32:
                    raise InvalidUsageError(f"error feedback: a residual of {residual.size} {residual.dtype} "
                                            f"for an allreduce of {call.count} float32")
                call = call._replace(description=call.description + " with error feedback")
            self._guarded(compressed_allreduce, call, x, out, deadline)
            return
        self._guarded(RUN[path] if path in RUN else GENERAL[call.collective], call, x, out, deadline)

    # The fusion buffer and the torch hook keep error feedback here (feeding_back), not on the rank's own
    # contribution: what is encoded across nodes is the node's partial, by the rank that holds its range.
    feeds_back_partials = True

    @contextlib.contextmanager
    def feeding_back(self, residual):
        """Error feedback for the compressed allreduces inside: `residual`, a
        float32 array of the call's count (zeros at first, kept by the caller
        from call to call), is added to the node's partial on this rank's
        range before it is encoded, and receives there what the encoding
        lost (elsewhere it stays zero). Between nodes the partials then go
        direct (each encoded once and nothing else is), so the residual is
        all that was lost."""
        self.residual = residual
        try:
            yield
        finally:
            self.residual = None

    def barrier(self, deadline):
        if self._compiled_barrier is None:
            self._guarded(barrier, Call("barrier", np.dtype(np.uint8), 0, ReduceOp.SUM, 0, "barrier"), None, None,
                          deadline)
            return
        call, byte = self._compiled_barrier
        self.calls += 1
        try:
            self.programs.run(call, byte, byte, deadline)
        except BaseException as error:
            self.abort(error)
            raise

    def _guarded(self, algorithm, call, x, out, deadline):
        self.calls += 1
        try:   # (begin too: it raises where a watched rank died, and the node must hear of it)
            self.link.begin(call_signature(self.calls, call.description))
            algorithm(self, call, x, out, deadline)
        except BaseException as error:
            self.abort(error)
            raise

    def abort(self, error):
        """Stop every rank: the node's through the control segment, the other
        nodes' through MPI (unless the abort came from there)."""
        error = error if isinstance(error, BaseException) else CollectiveError(str(error))
        if self.programs is not None:
            self.programs.stop()   # every later call meets the abort on the general path
        if self.shm is not None:
            self.shm.abort(f"{type(error).__name__} on rank {self.rank}: {error}", error)
        self.link.abort(error, self.out_of_reach(error))

    def recovery(self):
        """The survivors' agreement over the link (transport/mpi_recovery.py), made at the first agree or shrink."""
        if self.agreement is None:
            from .transport.mpi_recovery import Agreement
            self.agreement = Agreement(self.link, [pid for pid, _ in self.processes])
        return self.agreement

    def agree(self, flag, deadline):
        """Communicator.agree across nodes: the AND of every rank's flag, uniform among those that return."""
        from .transport.mpi_recovery import agree
        return agree(self.recovery(), flag, self.candidates, deadline)

    def out_of_reach(self, error):
        """The ranks an abort for `error` must not be sent to: every rank of
        the other nodes this rank waited for when it timed out (a machine may
        have died, or its link been cut; its surviving ranks time out too)."""
        nodes = {self.topology.node_of(peer) for peer in getattr(error, "awaited", ())} - {self.node_index}
        return {rank for node in nodes for rank in self.topology.nodes[node]}

    def close(self):
        """After Communicator.close's barrier: no peer reads this rank's memory any more."""
        if self.programs is not None:
            self.programs.close()   # (their requests, before the link's communicator is freed)
        if self.shm is not None:
            self.shm.close()
        self.link.close()
        self._scratch.clear()

    # -- what the algorithms use --------------------------------------------------------

    def in_node(self, call, nphases, workspace_elements, phase, deadline):
        """Run `phase(p, work)` for p in range(nphases) as one call of the
        node's step protocol; work(local rank) is that rank's WORK buffer
        (workspace_elements of the call's dtype)."""
        group, views = self.shm.group, {}

        def work(rank):
            if rank not in views:
                try:
                    memory = group.workspace(rank).buf if workspace_elements else None
                except OSError as error:    # a peer that aborted has released its files
                    group.check_health()
                    raise CollectiveError(f"local rank {rank}'s workspace is gone: {error}") from error
                views[rank] = np.ndarray((workspace_elements,), call.dtype, memory)
            return views[rank]

        try:
            group.run(_node_phases(len(self.node_ranks), nphases, workspace_elements * call.dtype.itemsize),
                      call.description, lambda p, waiter: phase(p, work), deadline)
        finally:
            views.clear()   # before a workspace may be released

    def exchange(self, messages, buffers, deadline, what):
        """Send and receive an Exchange's messages, (peer, buffer, offset, count) each."""
        def view(buffer, offset, count):
            return buffers[buffer][offset:offset + count]

        self.link.exchange([(peer, view(*where)) for peer, *where in messages.sends],
                           [(peer, view(*where)) for peer, *where in messages.receives], deadline, what)

    def fold(self, table, buffers, op):
        """Run op-table rows; `buffers` maps a buffer id (or (rank, id)) to an array."""
        if len(table):
            host.execute(table, lambda rank, buffer: buffers.get((rank, buffer)) if buffer == WORK else buffers[buffer],
                         op, self.topology.size)

    def scratch(self, name, dtype, count):
        """A reusable buffer of this process (grows, never shrinks)."""
        nbytes = count * dtype.itemsize
        buffer = self._scratch.get(name)
        if buffer is None or buffer.size < nbytes:
            buffer = self._scratch[name] = np.empty(max(nbytes, 2 * (0 if buffer is None else buffer.size)), np.uint8)
        return buffer[:nbytes].view(dtype)


# -- the algorithms: one function per collective ------------------------------------------------

def allreduce(h, call, x, out, deadline, root_node=None):
    """Reduce-scatter in the node, direct or two_shot across nodes, all-gather
    in the node. reduce() is this with `root_node`: only that node gathers,
    into the root's output. Compressed (call.compression), the ranges and
    pieces start on codec blocks, and what crosses nodes is encoded
    (compressed_across_nodes)."""
    if call.count == 0:
        return
    if call.compression is None:
        plan = range_plan(h.topology, call.count, call.dtype.itemsize, h.rank, root_node)
        across = across_nodes
    else:
        plan = range_plan(h.topology, call.count, call.dtype.itemsize, h.rank, root_node, BLOCK,
                          h.residual is not None)
        start, stop = plan.ranges[h.local]
        residual = None if h.residual is None else h.residual[start:stop]
        across = functools.partial(compressed_across_nodes, residual=residual)
    result = out if call.collective == ALLREDUCE or h.rank == call.root else None
    if h.shm is None:        # alone on its node: its range is everything, its input the partial
        part = result if result is not None else h.scratch("part", call.dtype, call.count)
        if part is not x:
            np.copyto(part, x)
        across(h, call, plan, part, deadline)
        return
    start, stop = plan.ranges[h.local]

    def phase(p, work):
        mine = work(h.local)
        if p == 0:       # x where the node's ranks read it (this rank's own range it reads from x)
            mine[:start], mine[stop:] = x[:start], x[stop:]
        elif p == 1:     # 1. the node's partial on this rank's range; 2. across nodes
            h.fold(plan.node_fold, {INPUT: x, **{(r, WORK): work(r) for r in range(len(h.node_ranks))}},
                   partial_op(call.op))
            across(h, call, plan, mine[start:stop], deadline)
        elif result is not None:   # 3. every range into the result
            for rank, (a, z) in enumerate(plan.ranges):
                result[a:z] = work(rank)[a:z]

    gathers = root_node is None or root_node == h.node_index
    h.in_node(call, 3 if gathers else 2, call.count, phase, deadline)


def across_nodes(h, call, plan, part, deadline):
    """allreduce's step 2 on this rank's range `part`: partials to their owners,
    which fold them in node order, results back (two_shot only)."""
    buffers = {PART: part, RECEIVED: h.scratch("received", call.dtype, plan.received)}
    h.exchange(plan.reduce, buffers, deadline, f"{call.description}: partials to their owners")
    h.fold(plan.folds, buffers, call.op)
    if plan.gather.sends or plan.gather.receives:
        h.exchange(plan.gather, buffers, deadline, f"{call.description}: results from their owners")


def compressed_allreduce(h, call, x, out, deadline):
    """allreduce(compression=codec) across nodes: the node's reduce-scatter
    in float32 (its partial P_k on each rank's range), each range's partial
    encoded once by the rank that holds it and sent as the codec's bytes,
    the K partials decoded and folded in node order in float32, the node's
    all-gather of the float32 result. Every rank folding a piece folds the
    decodings of the same bytes (its own partial replaced by the decoding of
    what it sent), so all hold the same bits; with two_shot the owner's
    result is encoded for the others and replaced by its decoding too.

    Where the node's compiled loop runs (every node of G ranks) and G codec
    blocks divide the count, the node's steps are the loop's reduce_scatter
    and allgather (in_blocks); else the phases. Both fold the node's inputs
    in local rank order and cut the same ranges, so they send the same
    messages and give the same bits."""
    if call.count and h.shm is not None and call.count % (len(h.node_ranks) * BLOCK) == 0 \
            and loop_runs_nodes(h, call):
        if takes_compressed_program(h, call):
            pieces = compressed_pieces(h, call)
            if len(pieces) == 1:
                h.programs.run(call, x, out, deadline, compressed_program)
            else:
                _compressed_in_pieces(h, call, pieces, x, out, deadline)
        else:
            compressed_in_blocks(h, call, x, out, deadline)
    else:
        allreduce(h, call, x, out, deadline)


def takes_compressed_program(h, call):
    """Whether compressed_in_blocks runs as a compiled Program (the same
    answer on every rank; its caller checked the blocks): where Programs
    run, direct between nodes (two_shot's second exchange is not in a
    Program; with error feedback always direct), its buffers within
    PROGRAM_MAX_BYTES."""
    k = call.count // len(h.node_ranks)
    nodes = len(h.topology.nodes)
    direct = h.residual is not None or not uses_two_shot(nodes, k * call.dtype.itemsize)
    return h.programs is not None and direct and nodes * (2 * k * call.dtype.itemsize + 16) <= PROGRAM_MAX_BYTES


def compressed_pieces(h, call):
    """The pieces (start, count) a compressed Program runs in
    (Programs.run_in_pieces): about h.compressed_piece_bytes each, the last
    up to twice that; one where the call is below twice it. Every
    piece is a multiple of G codec blocks (G: the node's ranks), so each
    rank's range in each piece starts on a block of the whole call: the
    codec's blocks, and so the bits, are those of the call in one piece
    (and with error feedback each element meets its own residual)."""
    unit = len(h.node_ranks) * BLOCK
    piece = h.compressed_piece_bytes // call.dtype.itemsize // unit * unit
    if piece == 0 or call.count < 2 * piece:
        return [(0, call.count)]
    last = (call.count // piece - 1) * piece   # (the last piece takes the rest)
    return [(start, piece) for start in range(0, last, piece)] + [(last, call.count - last)]


def _compressed_in_pieces(h, call, pieces, x, out, deadline):
    """The compressed Program in `pieces` (Programs.run_in_pieces), the
    pieces named in the call's signature (a rank that pieces it otherwise
    is named, not misread). With error feedback, h.residual is each
    piece's part of the call's residual as the piece starts
    (compressed_program reads it there), and the whole again after."""
    call = call._replace(description=f"{call.description} in pieces of {pieces[0][1]}")
    whole = h.residual
    if whole is None:
        h.programs.run_in_pieces(call, pieces, x, out, deadline, compressed_program)
        return

    def point_residual_at_piece(start, count):
        h.residual = whole[start:start + count]

    try:
        h.programs.run_in_pieces(call, pieces, x, out, deadline, compressed_program, point_residual_at_piece)
    finally:
        h.residual = whole


def compressed_program(h, call, counterparts, others):
    """compressed_in_blocks as a Program's Shape (across.py), the same
    steps and bits: its first node step the loop's reduce_scatter into this
    rank's block and the block's encoding (rounded: the block becomes its
    decoding) straight into the message to every counterpart, payload then
    scales; its messages; its last step the K partials decoded and folded
    in node order (_fold_decoded, as compressed_across_nodes folds them)
    and the loop's all-gather of the blocks. Where MPI and the loop run in
    C, the Python left is the codec's calls, a few per call. With error
    feedback (a call described so, laid out apart), the encoding takes the
    residual that h.residual holds at each call, as compressed_across_nodes
    does."""
    codec, payload_dtype = call.compression, np.dtype(codec_kernels.payload_dtype(call.compression))
    k = call.count // len(h.node_ranks)
    feedback = h.residual is not None
    plan = range_plan(h.topology, call.count, call.dtype.itemsize, h.rank, None, BLOCK, feedback)
    assert not plan.gather.sends and not plan.gather.receives, "two_shot: takes_compressed_program declines it"
    assert plan.reduce.sends and {(offset, count) for _, _, offset, count in plan.reduce.sends} == {(0, k)}, \
        plan.reduce.sends

    def wire_bytes(count):
        return count * payload_dtype.itemsize + (-(-count // BLOCK) if codec_kernels.has_scales(codec) else 0)

    def wire(message, count):   # (payload, scales) of `count` elements at the start of `message`
        at = count * payload_dtype.itemsize
        return message[:at].view(payload_dtype), message[at:wire_bytes(count)]

    exchange = h.link.repeated_exchange([(peer, wire_bytes(k)) for peer, *_ in plan.reduce.sends],
                                        [(peer, wire_bytes(count)) for peer, _, _, count in plan.reduce.receives],
                                        one_payload=True)
    part = exchange.keep(np.empty(k, np.float32))
    temp = exchange.keep(np.empty(k if len(h.topology.nodes) > 2 else 0, np.float32))   # (3 partials and more)
    sent = wire(exchange.send_payloads[0], k)
    received = {offset: (message, count) for (_, _, offset, count), message
                in zip(plan.reduce.receives, exchange.receive_payloads)}
    steps = []   # (the fold's loops, bound to their arrays)
    divisor = h.topology.size if call.op is ReduceOp.AVG else 0
    for row in plan.folds:
        count, offset = int(row[COUNT]), int(row[DST_OFF])
        sources = []
        for _, buffer, at in (row[SRC0 + 3 * i:SRC0 + 3 * i + 3] for i in range(int(row[NSRC]))):
            if buffer == PART:
                sources.append(part[at:at + count])
            else:
                message, held = received[at]
                assert count <= held, (count, held)
                sources.append(wire(message, count))
        steps += _fold_decoded_steps(codec, part[offset:offset + count], sources, divisor, temp[:count])
    node_fold = node_call(h, REDUCE_SCATTER, call.count * call.dtype.itemsize, call.op)
    node_gather = node_call(h, ALLGATHER, part.nbytes)
    encode = codec_kernels.bound_encode(codec, part, *sent, round_x=True)
    start, stop = plan.ranges[h.local]
    ranks = weakref.proxy(h)   # (h holds this Program: no cycle through it)

    def reduce_scatter_and_encode(x, deadline):
        result = node_fold(x, part, deadline)
        if result != 0:
            return result
        if feedback:   # the residual is added first and receives what the encoding lost
            residual = ranks.residual[start:stop]
            np.add(part, residual, out=part)
            np.copyto(residual, part)
            encode()
            residual -= part
        else:
            encode()
        return 0

    def fold_and_gather(out, deadline):
        for step in steps:
            step()
        return node_gather(part, out, deadline)

    x_bytes = call.count * call.dtype.itemsize
    return Shape(exchange, x_bytes, x_bytes, first_step=(reduce_scatter_and_encode, (None, None), 0, -1, 1, -1),
                 last_step=(fold_and_gather, (None, None), -1, 0, 1, -1), steps=(REDUCE_SCATTER, ALLGATHER))


def compressed_in_blocks(h, call, x, out, deadline):
    """compressed_allreduce with the node's compiled loop: its reduce_scatter
    leaves local rank l the node's partial of block l (its range), which
    crosses nodes encoded; its allgather gives every rank every block."""
    k = call.count // len(h.node_ranks)
    plan = range_plan(h.topology, call.count, call.dtype.itemsize, h.rank, None, BLOCK, h.residual is not None)
    start, stop = plan.ranges[h.local]
    assert (start, stop) == (h.local * k, (h.local + 1) * k), (plan.ranges, k)
    part = h.scratch("block", call.dtype, k)
    _in_node(h, REDUCE_SCATTER, x, part, partial_op(call.op).value, 0, deadline)
    compressed_across_nodes(h, call, plan, part, deadline, None if h.residual is None else h.residual[start:stop])
    _in_node(h, ALLGATHER, part, out, "sum", 0, deadline)


def compressed_across_nodes(h, call, plan, part, deadline, residual=None):
    """across_nodes with encoded partials: `part` (this rank's range, which
    starts on a codec block, as every piece in it does) is encoded once,
    in place of its values the decoding (cpu_encode's round_x). The wire
    form is one node's: a piece of c elements at element o of the range is
    payload[o:o + c] and scales[o // BLOCK:] (ceil(c / BLOCK) bytes; none
    for bf16), sent as two messages. With `residual` (error feedback), it is
    added to the partial first and receives what the encoding lost."""
    codec, n = call.compression, part.size
    payload = h.scratch("payload", np.dtype(codec_kernels.payload_dtype(codec)), n)
    scales = h.scratch("scales", np.dtype(np.uint8), codec_kernels.wire_nbytes(codec, n)[1])
    if residual is not None:
        part += residual
        np.copyto(residual, part)
    codec_kernels.cpu_encode(codec, part, payload, scales, round_x=True)
    if residual is not None:
        residual -= part
    # What comes from other nodes: pieces one after another, each at its element offset in RECEIVED
    # (payload) and at the running count of its blocks (scales: a piece may end inside a block).
    received_payload = h.scratch("received_payload", payload.dtype, plan.received)
    scale_offsets, blocks = {}, 0
    for _, _, offset, count in plan.reduce.receives:
        scale_offsets[offset] = blocks
        blocks += -(-count // BLOCK)
    received_scales = h.scratch("received_scales", np.dtype(np.uint8),
                                blocks if codec_kernels.has_scales(codec) else 0)

    def wire(buffer, offset, count):
        nblocks = -(-count // BLOCK) if codec_kernels.has_scales(codec) else 0
        if buffer == PART:
            return payload[offset:offset + count], scales[offset // BLOCK:offset // BLOCK + nblocks]
        first = scale_offsets[offset]
        return received_payload[offset:offset + count], received_scales[first:first + nblocks]

    def messages(listed):   # each message of the plan as its payload, then its scales
        return [(peer, array) for peer, *where in listed for array in wire(*where)]

    what = f"{call.description}: encoded partials to their owners"
    h.link.exchange(messages(plan.reduce.sends), messages(plan.reduce.receives), deadline, what)
    divisor = h.topology.size if call.op is ReduceOp.AVG else 0
    for row in plan.folds:
        count, offset = int(row[COUNT]), int(row[DST_OFF])
        sources = [part[off:off + count] if buffer == PART else wire(buffer, off, count)
                   for _, buffer, off in (row[SRC0 + 3 * i:SRC0 + 3 * i + 3] for i in range(int(row[NSRC])))]
        _fold_decoded(codec, part[offset:offset + count], sources, divisor, h.scratch("temp", call.dtype, count))
    if plan.gather.sends or plan.gather.receives:   # two_shot: the owners' results, encoded, to the holders
        for offset, count in dict.fromkeys((offset, count) for _, _, offset, count in plan.gather.sends):
            codec_kernels.cpu_encode(codec, part[offset:offset + count], *wire(PART, offset, count), round_x=True)
        h.link.exchange(messages(plan.gather.sends), messages(plan.gather.receives), deadline,
                        f"{call.description}: encoded results from their owners")
        for _, _, offset, count in plan.gather.receives:
            codec_kernels.cpu_decode(codec, *wire(PART, offset, count), part[offset:offset + count])


def _fold_decoded(codec, dst, sources, divisor, temp):
    """dst = ((s_0 + s_1) + s_2) ... [/ divisor] in float32, each source a
    float32 array (this node's partial, already the decoding of what it
    sent; it may be dst itself) or (payload, scales), decoded on the way."""
    for step in _fold_decoded_steps(codec, dst, sources, divisor, temp):
        step()


def _fold_decoded_steps(codec, dst, sources, divisor, temp):
    """_fold_decoded's loops, bound to their arrays (codec_kernels.bound_*),
    in order. Addition commutes bit for bit, so either of the first two
    sources may be the one decoded into the other; more than two accumulate
    in `temp`, since this node's partial (dst) may come later."""
    def add(out, a, b, divisor):   # a: float32; b either form
        if isinstance(b, tuple):
            return codec_kernels.bound_decode_add(codec, a, *b, out, divisor)
        return codec_kernels.bound_add(codec, a, b, out, divisor)

    steps = []
    first, second, rest = sources[0], sources[1], sources[2:]
    acc = dst if not rest else temp
    if isinstance(first, tuple) and isinstance(second, tuple):
        steps.append(codec_kernels.bound_decode(codec, *first, acc))
        first = acc
    elif isinstance(first, tuple):
        first, second = second, first
    steps.append(add(acc, first, second, 0 if rest else divisor))
    for i, source in enumerate(rest):
        last = i == len(rest) - 1
        steps.append(add(dst if last else acc, acc, source, divisor if last else 0))
    return steps


def reduce(h, call, x, out, deadline):
    allreduce(h, call, x, out, deadline, root_node=h.topology.node_of(call.root))


def reduce_scatter(h, call, x, out, deadline):
    """Each handler folds its node's inputs on the blocks it handles and sends
    them to their owners, which fold the K partials in node order."""
    k = call.count // h.topology.size
    plan = block_plan(h.topology, k, h.rank)
    buffers = {INPUT: x, OUTPUT: out, RECEIVED: h.scratch("received", call.dtype, plan.received)}
    if h.shm is None:        # alone on its node: its input is the node's partial of every block
        buffers[PART] = x
        h.exchange(plan.to_owners, buffers, deadline, f"{call.description}: partials to their owners")
        h.fold(plan.owner_fold, buffers, call.op)
        return
    buffers[PART] = h.scratch("part", call.dtype, len(plan.handled) * k)

    def phase(p, work):
        if p == 0:       # x where the node's ranks read it (the blocks this rank handles, it reads from x)
            mine = work(h.local)
            for a, z in plan.not_handled:
                mine[a:z] = x[a:z]
        else:
            h.fold(plan.node_folds, {**buffers, **{(r, WORK): work(r) for r in range(len(h.node_ranks))}},
                   partial_op(call.op))
            h.exchange(plan.to_owners, buffers, deadline, f"{call.description}: partials to their owners")
            h.fold(plan.owner_fold, buffers, call.op)

    h.in_node(call, 2, call.count, phase, deadline)


def allgather(h, call, x, out, deadline):
    """Each block to its handler on every other node, then each block from
    the node-mate holding it."""
    k = call.count
    plan = block_plan(h.topology, k, h.rank)
    if h.shm is None:        # alone on its node: it handles every block, and receives them in place
        own = out[h.rank * k:(h.rank + 1) * k]
        if not _same_memory(own, x):
            own[...] = x
        h.exchange(plan.spread, {INPUT: x, PART: out}, deadline, f"{call.description}: blocks to their handlers")
        return

    def phase(p, work):
        if p == 0:       # own block, and the blocks this rank handles, into its WORK
            work(h.local)[h.rank * k:(h.rank + 1) * k] = x
            h.exchange(plan.spread, {INPUT: x, PART: work(h.local)}, deadline,
                       f"{call.description}: blocks to their handlers")
        else:            # every block from the node-mate that holds it
            for rank, holder in enumerate(plan.holders):
                if rank != h.rank or not _same_memory(out[rank * k:(rank + 1) * k], x):
                    out[rank * k:(rank + 1) * k] = work(holder)[rank * k:(rank + 1) * k]

    h.in_node(call, 2, h.topology.size * k, phase, deadline)


def broadcast(h, call, x, out, deadline):
    """Scatter + all-gather among one leader per node, then the node's ranks
    copy from their leader. Out of place, the root's x is first copied into
    its output, and every rank's output is the buffer sent and received."""
    if call.count == 0:
        return
    if out is not x:
        if h.rank == call.root:
            np.copyto(out, x)
        x = out
    plan = broadcast_plan(h.topology, call.count, call.root, h.rank)
    leader = h.rank == plan.leader

    def between_leaders():
        for step in (plan.scatter, plan.allgather):
            h.exchange(step, {PART: x}, deadline, f"{call.description}: pieces between nodes")

    if h.shm is None:
        between_leaders()
        return

    def phase(p, work):
        if p == 0 and leader:
            between_leaders()
            work(h.local)[...] = x
        elif p == 1 and not leader:
            x[...] = work(h.node_ranks.index(plan.leader))

    h.in_node(call, 2, call.count, phase, deadline)


def barrier(h, call, x, out, deadline):
    """Every rank of the node has arrived (phase 1 starts); the leaders hear
    from each other; the node's ranks leave once their leader has (phase 2)."""
    def between_leaders():
        if h.rank == h.node_ranks[0]:
            for messages in barrier_plan(h.topology, h.node_index):
                h.exchange(messages, {PART: np.empty(0, np.uint8)}, deadline, "barrier")

    if h.shm is None:
        between_leaders()
        return
    h.in_node(call, 3, 0, lambda p, work: between_leaders() if p == 1 else None, deadline)


def exchange(h, call, x, out, deadline):
    """all_to_all, all_to_all_v, gather and scatter: each block moves once,
    straight from the rank that has it to the rank that needs it. A block
    between ranks of one node goes through the node's shared memory: in
    phase 0 each rank copies the blocks for its node-mates into its WORK,
    in phase 1 each copies its blocks out of theirs. A block between ranks
    of different nodes crosses the link, from x into out, in phase 1 (so
    that the node-mates read this rank's WORK meanwhile). A node that
    exchanges nothing inside (every node but the root's for gather and
    scatter, nodes of one rank) skips the phases. Where out lies on memory
    of x that the call still reads (all_to_all in place), x is copied first."""
    plan = exchange_plan(h.topology, call.collective, call.count, call.root, call.counts, h.rank)
    if plan.reads_x and _writes_what_it_reads(plan, x, out):
        staged = h.scratch("sent", call.dtype, x.size)
        staged[...] = x
        x = staged
    buffers = {INPUT: x, OUTPUT: out}
    what = f"{call.description}: blocks between nodes"

    def across_and_own():
        h.exchange(plan.link, buffers, deadline, what)
        if plan.own:
            a, b, count = plan.own
            if not _same_memory(out[b:b + count], x[a:a + count]):
                out[b:b + count] = x[a:a + count]

    if h.shm is None or not plan.in_node:
        across_and_own()
        return

    def phase(p, work):
        if p == 0:
            mine = work(h.local)
            for a, w, count in plan.staged:
                mine[w:w + count] = x[a:a + count]
        else:
            across_and_own()
            for local, w, b, count in plan.reads:
                out[b:b + count] = work(local)[w:w + count]

    h.in_node(call, 2, plan.workspace, phase, deadline)


def _writes_what_it_reads(plan, x, out):
    """Whether a block the call writes into `out` lies on memory of `x` that
    it reads (a block copied onto itself aside)."""
    x_at, out_at, size = x.__array_interface__["data"][0], out.__array_interface__["data"][0], x.itemsize
    read = [(x_at + a * size, x_at + (a + count) * size) for a, count in plan.x_spans]
    low, high = min(a for a, _ in read), max(z for _, z in read)
    written = [(out_at + b * size, out_at + (b + count) * size) for b, count in plan.out_spans]
    if plan.own:
        a, b, count = plan.own
        if x_at + a * size != out_at + b * size:
            written.append((out_at + b * size, out_at + (b + count) * size))
    return any(a < high and low < z for a, z in written)


# -- small messages: the node's compiled loop, then one exchange between counterparts ----------
#
# A message of up to the loop's merged-step limit per rank (h.fast_small_max),
# where every node has G ranks
# and the node's compiled loop takes the dtype (fastpath.py), is one call of
# that loop inside the node and one exchange over MPI between counterparts,
# the ranks of one local index l on every node:
#
#   allreduce       the node's allreduce gives every rank P_k; each sends it
#                   to its counterparts and folds the K partials in node order.
#   reduce          the node's reduce to the root's local index gives that
#                   rank P_k, which it sends to the root; the root folds.
#   reduce_scatter  the node's allreduce gives every rank P_k; each sends its
#                   counterpart c block c of it; each folds its block's K partials.
#   allgather       the node's allgather gives every rank its node's blocks; each
#                   sends them to its counterparts and places what it receives.
#   broadcast       the root's node broadcasts; each of its ranks sends the data
#                   to its counterparts.
#
# The loop folds a node's inputs in local rank order and the rows below fold
# the partials in node order, as the phases above do: the same bits.

def takes_small(h, call):
    """Whether `call` runs the small path (the same answer on every rank)."""
    nbytes = call.count * call.dtype.itemsize
    if call.collective == ALLGATHER:
        nbytes *= len(h.node_ranks)   # what a rank sends each counterpart
    return 0 < nbytes <= h.fast_small_max and loop_runs_nodes(h, call)


def _in_node(h, collective, x, out, op, root, deadline):
    """One call of the node's compiled loop (nothing when alone on the node:
    out = x), or of the node's plans where the loop leaves it to them (a
    large message the ranks may single copy). The loop
    takes these buffers on every rank alike; its declining would be a bug,
    and is raised as one."""
    if h.shm is None:
        if out is not x:
            np.copyto(out, x)
        return
    if h.shm.fast.step_for(collective, x.nbytes) == fastpath.PLANS:
        h.plans_step(collective, x, out, op, root, deadline)   # (the single copy, which the loop leaves to the plans)
        return
    timeout = max(deadline - time.perf_counter(), 0.0)
    if collective == ALLREDUCE:
        done = h.shm.fast_allreduce(x, op, out, timeout) is not None
    else:
        done = h.shm.fast_collective(collective, x, op, out, root, timeout)
    if not done:
        raise CollectiveError(f"the node's compiled loop declined a {collective} of {x.size} {x.dtype}")


def _fold_partials(h, call, count, part, part_offset, received, out):
    """out = the K partials of `count` elements folded in node order (the
    across-node row of the phases' plans): this node's at
    `part`[part_offset:], the others' in `received`, one after another in
    node order."""
    others = iter(range(0, len(received), count))
    sources = [part[part_offset:part_offset + count] if k == h.node_index else received[next(others):][:count]
               for k in range(len(h.topology.nodes))]
    with np.errstate(all="ignore"):
        host.fold_row(out, sources, call.op, h.topology.size, final=True)


def small(h, call, x, out, deadline):
    """The small path (above) for any collective, where no compiled Program
    (across.py) can run it: the Program's bits."""
    nodes, me, k_me = h.topology.nodes, h.rank, h.node_index
    counterparts = [node[h.local] for node in nodes]
    others = [peer for k, peer in enumerate(counterparts) if k != k_me]
    count, what = call.count, f"{call.description}: between counterparts"
    in_node_op = partial_op(call.op).value
    if call.collective in (ALLREDUCE, REDUCE_SCATTER):
        part = h.scratch("part", call.dtype, count)
        _in_node(h, ALLREDUCE, x, part, in_node_op, 0, deadline)
        k = count // h.topology.size if call.collective == REDUCE_SCATTER else count
        received = h.scratch("received", call.dtype, len(others) * k)
        if call.collective == ALLREDUCE:
            sends = [(peer, part) for peer in others]
        else:
            sends = [(peer, part[peer * k:(peer + 1) * k]) for peer in others]
        h.link.exchange(sends, [(peer, received[i * k:(i + 1) * k]) for i, peer in enumerate(others)],
                        deadline, what)
        _fold_partials(h, call, k, part, 0 if call.collective == ALLREDUCE else me * k, received, out)
    elif call.collective == REDUCE_TO_ROOT:
        root_node, root_local = h.topology.node_of(call.root), h.topology.local_of(call.root)
        part = h.scratch("part", call.dtype, count)
        _in_node(h, REDUCE_TO_ROOT, x, part, in_node_op, root_local, deadline)
        if h.local != root_local:
            return
        if me != call.root:
            h.link.exchange([(call.root, part)], [], deadline, what)
            return
        received = h.scratch("received", call.dtype, len(others) * count)
        h.link.exchange([], [(peer, received[i * count:(i + 1) * count]) for i, peer in enumerate(others)],
                        deadline, what)
        _fold_partials(h, call, count, part, 0, received, out)
    elif call.collective == ALLGATHER:
        size = len(h.node_ranks)
        gathered = h.scratch("gathered", call.dtype, len(nodes) * size * count)   # node by node, local order
        mine = gathered[k_me * size * count:(k_me + 1) * size * count]
        _in_node(h, ALLGATHER, x, mine, "sum", 0, deadline)
        h.link.exchange([(peer, mine) for peer in others],
                        [(counterparts[k], gathered[k * size * count:(k + 1) * size * count])
                         for k in range(len(nodes)) if k != k_me], deadline, what)
        for k, node in enumerate(nodes):
            for local, rank in enumerate(node):
                block = out[rank * count:(rank + 1) * count]
                if k != k_me or rank != me or not _same_memory(block, x):
                    block[...] = gathered[(k * size + local) * count:(k * size + local + 1) * count]
    else:   # BROADCAST
        root_node, root_local = h.topology.node_of(call.root), h.topology.local_of(call.root)
        if k_me == root_node:
            _in_node(h, BROADCAST, x, out, "sum", root_local, deadline)
            h.link.exchange([(peer, out) for peer in others], [], deadline, what)
        else:   # (out of place, x is left as it was)
            h.link.exchange([], [(counterparts[root_node], out)], deadline, what)


# -- the one decision: which path a call across nodes takes --------------------------

def route(h, call):
    """The path `call` (a Call) takes, the same on every rank: the one
    place that decides it, for the general path's way in and for
    chosen_algorithm. (The Communicator's shortcuts run a shape's Program
    from C once it is laid out: the same path.)"""
    if call.compression is not None:
        return COMPRESSED
    if call.collective in EXCHANGE_COLLECTIVES:
        return EXCHANGE
    if call.count and takes_small(h, call):
        return PROGRAM if h.programs is not None else COUNTERPARTS
    if h.programs is not None and h.programs.takes_large(call):
        return PROGRAM
    return PHASES


def _program(h, call, x, out, deadline):
    h.programs.run(call, x, out, deadline)


GENERAL = {ALLREDUCE: allreduce, REDUCE_TO_ROOT: reduce, REDUCE_SCATTER: reduce_scatter, ALLGATHER: allgather,
           BROADCAST: broadcast}
RUN = {PROGRAM: _program, COUNTERPARTS: small, EXCHANGE: exchange}   # (PHASES: GENERAL's; COMPRESSED: run's own)
EXCHANGE_COLLECTIVES = frozenset({ALL_TO_ALL, ALL_TO_ALL_V, GATHER, SCATTER})


def _same_memory(a, b):
    return a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.nbytes == b.nbytes


# -- the plans: who folds what and sends it to whom, as data (cached per call shape) ------------

class Exchange(NamedTuple):
    """One round of one rank's messages: (peer, buffer, offset, count) each.
    Between two ranks, the sender's and the receiver's lists are in one order."""
    sends: tuple = ()
    receives: tuple = ()


class NodePhase(NamedTuple):
    waits: tuple        # per local rank: ((peer, phases it has completed), ...), as plan.Phase.waits


class NodePhases(NamedTuple):
    """Phases inside a node, in the form ProcessGroup.run takes."""
    phases: tuple
    workspace_bytes: int


@functools.lru_cache(maxsize=64)
def _node_phases(size, nphases, workspace_bytes):
    """Phase p waits until every other rank of the node has completed p phases of the call."""
    return NodePhases(tuple(NodePhase(tuple(tuple((peer, p) for peer in range(size) if peer != rank)
                                            for rank in range(size)))
                            for p in range(nphases)), workspace_bytes)


def _table(rows, sources):
    """Rows as an op table (plan.py's columns) with `sources` source slots."""
    table = np.full((len(rows), SRC0 + 3 * sources), -1, np.int64)
    for i, row in enumerate(rows):
        table[i, :len(row)] = row
    return table


def _fold_row(dst_rank, kind, count, dst, offset, sources):
    """One op-table row: dst (buffer, offset) = the fold of sources ((rank, buffer, offset), ...) in order."""
    return (dst_rank, kind, count, dst, offset, len(sources), *(v for source in sources for v in source))


def _cut(start, stop, parts, align=1):
    """[start, stop) cut into `parts` pieces, as even as can be, each but
    the last starting `align` elements after another piece's start."""
    size, extra = divmod(-(-(stop - start) // align), parts)
    edges, units = [start], 0
    for j in range(parts):
        units += size + (j < extra)
        edges.append(min(start + units * align, stop))
    return list(zip(edges, edges[1:]))


class RangePlan(NamedTuple):
    ranges: tuple         # per local rank of this node: its range [start, stop)
    node_fold: np.ndarray  # step 1: this rank's range, its node's inputs folded in local rank order
    received: int         # elements of RECEIVED
    reduce: Exchange      # step 2a: partials to their owners
    folds: np.ndarray     # step 2b: the pieces this rank owns, K sources in node order
    gather: Exchange      # step 2c: results from their owners


# Across nodes, two_shot's second round pays off once a rank's range is large:
# it sends 2 (K-1)/K of the range where direct sends K-1 ranges, so two_shot
# saves (K-1)(K-2)/K ranges for one more round, worth this many bytes.
ROUND_BYTES = 256 << 10


def uses_two_shot(nodes, range_bytes):
    """Whether step 2 is two_shot (else direct: every holder sends its whole
    range to every other node's holder, and each folds the K partials itself,
    in the same order, so the bits are the same). With 2 nodes both send one
    range; direct does it in one round."""
    return range_bytes * (nodes - 1) * (nodes - 2) > nodes * ROUND_BYTES


def encodings(topology, count, error_feedback=False):
    """How many times a compressed allreduce of `count` float32 across nodes
    encodes an element on its way to the result (the q of the error bound,
    docs/compression.md): once, its node's partial by the rank holding it;
    twice with two_shot between nodes, where the owner's result travels
    encoded too. With error feedback the partials always go direct."""
    blocks = max(-(-count // (len(node) * BLOCK)) * BLOCK for node in topology.nodes)
    return 1 if error_feedback or not uses_two_shot(len(topology.nodes), blocks * 4) else 2


@functools.lru_cache(maxsize=256)
def range_plan(topology, count, itemsize, me, root_node=None, align=1, direct_only=False):
    """allreduce (and reduce, which gathers on `root_node` only).

    Every node's ranges together cut [0, count) into segments, each held by
    one rank on every node. two_shot cuts a segment into K pieces, piece j
    owned (folded) by its holder on node j; direct leaves it whole, owned by
    its holder on every node that gathers (always, with `direct_only`).
    Ranges and pieces start at multiples of `align` elements (a codec block
    where what crosses nodes is encoded, so that its blocks are the ones a
    whole array's encoding has)."""
    nodes = topology.nodes
    k_me, local = topology.node_of(me), topology.local_of(me)
    blocks = [-(-count // (len(node) * align)) * align for node in nodes]
    ranges = tuple((min(l * blocks[k_me], count), min((l + 1) * blocks[k_me], count)) for l in range(len(nodes[k_me])))
    start, stop = ranges[local]
    inputs = [(r, INPUT if r == local else WORK, start) for r in range(len(ranges))]
    node_fold = [_fold_row(local, REDUCE_OP, stop - start, WORK, start, inputs)] if stop > start else []
    edges = sorted({0, count, *(min(l * b, count) for b, node in zip(blocks, nodes) for l in range(len(node)))})
    gatherers = tuple(range(len(nodes))) if root_node is None else (root_node,)
    two_shot = not direct_only and uses_two_shot(len(nodes), max(blocks) * itemsize)
    reduce_sends, reduce_receives, gather_sends, gather_receives, folds = [], [], [], [], []
    received = 0
    for a, z in zip(edges, edges[1:]):
        holders = [node[a // b] for b, node in zip(blocks, nodes)]
        if holders[k_me] != me:
            continue
        pieces = [(cut, (j,)) for j, cut in enumerate(_cut(a, z, len(nodes), align))] if two_shot else \
            [((a, z), gatherers)]
        for (p, q), owners in pieces:
            if q == p:
                continue
            piece = (p - start, q - p)        # where it is in this rank's range
            reduce_sends += [(holders[j], PART, *piece) for j in owners if j != k_me]
            if k_me not in owners:
                if k_me in gatherers:          # two_shot: the owner's result
                    gather_receives.append((holders[owners[0]], PART, *piece))
                continue
            sources = []
            for k, holder in enumerate(holders):
                if k == k_me:
                    sources.append((k, PART, p - start))
                else:
                    reduce_receives.append((holder, RECEIVED, received, q - p))
                    sources.append((k, RECEIVED, received))
                    received += q - p
            folds.append(_fold_row(k_me, REDUCE_FINAL_OP, q - p, PART, p - start, sources))
            gather_sends += [(holders[k], PART, *piece) for k in gatherers if k not in owners]
    return RangePlan(ranges, _table(node_fold, len(ranges)), received,
                     Exchange(tuple(reduce_sends), tuple(reduce_receives)), _table(folds, len(nodes)),
                     Exchange(tuple(gather_sends), tuple(gather_receives)))


def handler(topology, k, rank):
    """The rank of node k that handles `rank`'s block: `rank` itself on its own
    node, elsewhere the rank whose local index is its local index modulo the node's size."""
    node = topology.nodes[k]
    return rank if topology.node_of(rank) == k else node[topology.local_of(rank) % len(node)]


class BlockPlan(NamedTuple):
    handled: tuple        # the ranks whose blocks this rank handles, in rank order
    not_handled: tuple    # [start, stop) of the other blocks, merged
    holders: tuple        # per rank: the local rank of this node whose WORK holds its block (allgather)
    node_folds: np.ndarray  # reduce_scatter 1: the handled blocks, the node's inputs folded in local rank order
    received: int
    to_owners: Exchange   # reduce_scatter 2: partials to their owners
    owner_fold: np.ndarray  # reduce_scatter 3: this rank's block, K partials in node order, into OUTPUT
    spread: Exchange      # allgather: own block to its handlers, handled blocks from their owners


@functools.lru_cache(maxsize=256)
def block_plan(topology, k, me):
    """reduce_scatter and allgather, blocks of k elements."""
    nodes, n = topology.nodes, topology.size
    k_me, local = topology.node_of(me), topology.local_of(me)
    node = nodes[k_me]
    handled = tuple(r for r in range(n) if handler(topology, k_me, r) == me)
    not_handled = tuple((r * k, (r + 1) * k) for r in range(n) if r not in handled)
    holders = tuple(node.index(handler(topology, k_me, r)) for r in range(n))
    node_folds = [_fold_row(local, REDUCE_OP, k, PART, j * k,
                            [(l, INPUT if l == local else WORK, r * k) for l in range(len(node))])
                  for j, r in enumerate(handled)] if k else []
    to_owners = [(r, PART, j * k, k) for j, r in enumerate(handled) if r not in node]
    spread_receives = [(r, PART, r * k, k) for r in handled if r not in node]
    receives, spread_sends, sources = [], [], []
    for other in range(len(nodes)):
        if other == k_me:
            sources.append((other, PART, handled.index(me) * k))
            continue
        there = handler(topology, other, me)
        sources.append((other, RECEIVED, len(receives) * k))
        receives.append((there, RECEIVED, len(receives) * k, k))
        spread_sends.append((there, INPUT, 0, k))
    owner_fold = [_fold_row(k_me, REDUCE_FINAL_OP, k, OUTPUT, 0, sources)] if k else []
    return BlockPlan(handled, _merged(not_handled), holders, _table(node_folds, len(node)), len(receives) * k,
                     Exchange(tuple(to_owners), tuple(receives)), _table(owner_fold, len(nodes)),
                     Exchange(tuple(spread_sends), tuple(spread_receives)))


def _merged(spans):
    merged = []
    for a, z in spans:
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], z)
        elif z > a:
            merged.append((a, z))
    return tuple(merged)


class BroadcastPlan(NamedTuple):
    leader: int           # the rank of this rank's node that takes part between nodes
    scatter: Exchange     # the root's pieces to the leaders
    allgather: Exchange   # the leaders' pieces to each other


@functools.lru_cache(maxsize=256)
def broadcast_plan(topology, count, root, me):
    nodes = topology.nodes
    k_root = topology.node_of(root)
    leaders = [root if k == k_root else node[0] for k, node in enumerate(nodes)]
    pieces = [(a, z - a) for a, z in _cut(0, count, len(nodes))]
    scatter_sends, scatter_receives, sends, receives = [], [], [], []
    for j, (a, size) in enumerate(pieces):    # piece j to node j's leader
        if size and j != k_root:
            if me == root:
                scatter_sends.append((leaders[j], PART, a, size))
            if me == leaders[j]:
                scatter_receives.append((root, PART, a, size))
    for j, (a, size) in enumerate(pieces):    # then from there to every other leader but the root
        for k, leader in enumerate(leaders):
            if size and k not in (j, k_root):
                if me == leaders[j]:
                    sends.append((leader, PART, a, size))
                if me == leader:
                    receives.append((leaders[j], PART, a, size))
    return BroadcastPlan(leaders[topology.node_of(me)], Exchange(tuple(scatter_sends), tuple(scatter_receives)),
                         Exchange(tuple(sends), tuple(receives)))


@functools.lru_cache(maxsize=64)
def barrier_plan(topology, k_me):
    """Dissemination among node leaders: in round d, hear from the leader d
    nodes back and tell the one d nodes ahead (d = 1, 2, 4, ...)."""
    leaders, rounds, d = [node[0] for node in topology.nodes], [], 1
    while d < len(leaders):
        rounds.append(Exchange(((leaders[(k_me + d) % len(leaders)], PART, 0, 0),),
                               ((leaders[(k_me - d) % len(leaders)], PART, 0, 0),)))
        d *= 2
    return tuple(rounds)


class ExchangePlan(NamedTuple):
    """One rank's blocks in an exchange (exchange()), offsets and counts in elements."""
    link: Exchange      # blocks from INPUT to ranks of other nodes, into OUTPUT from them
    staged: tuple       # (x offset, WORK offset, count): the blocks for node-mates, into this rank's WORK
    reads: tuple        # (local rank, its WORK offset, out offset, count): the blocks from node-mates
    own: tuple          # (x offset, out offset, count) of this rank's block to itself, or ()
    workspace: int      # elements of WORK on every rank of the node
    in_node: bool       # whether the node's ranks exchange anything among themselves (the phases run)
    x_spans: tuple      # (offset, count) of x that the call reads, own block included (_writes_what_it_reads)
    out_spans: tuple    # (offset, count) of out that it writes, own block aside

    @property
    def reads_x(self):
        return bool(self.x_spans)


def exchange_counts(collective, count, root, size):
    """counts[q][r], the elements rank q sends rank r, in an exchange whose
    ranks' x hold `count` elements (all_to_all and scatter: `size` blocks)."""
    if collective == ALL_TO_ALL:
        return ((count // size,) * size,) * size
    if collective == GATHER:
        row = tuple(count if r == root else 0 for r in range(size))
        return (row,) * size
    zeros = (0,) * size    # SCATTER
    return tuple((count // size,) * size if q == root else zeros for q in range(size))


@functools.lru_cache(maxsize=256)
def exchange_plan(topology, collective, count, root, counts, me):
    """all_to_all, all_to_all_v (`counts`, the matrix of what each rank
    sends each), gather and scatter: blocks in rank order in x (the blocks
    rank q sends) and in out (the blocks rank r receives). A rank's WORK
    holds its blocks for its node-mates one after another in local order."""
    n = topology.size
    if counts is None:
        counts = exchange_counts(collective, count, root, n)
    node = topology.nodes[topology.node_of(me)]

    def sent_at(q, r):      # where block r starts in rank q's x
        return sum(counts[q][:r])

    def received_at(r, q):  # where the block from q starts in rank r's out
        return sum(counts[p][r] for p in range(q))

    def staged_at(q, r):    # where q's block for its node-mate r starts in q's WORK
        return sum(counts[q][p] for p in node[:node.index(r)] if p != q)

    sends = tuple((r, INPUT, sent_at(me, r), counts[me][r]) for r in range(n) if r not in node and counts[me][r])
    receives = tuple((q, OUTPUT, received_at(me, q), counts[q][me]) for q in range(n)
                     if q not in node and counts[q][me])
    staged = _merged_copies([(sent_at(me, r), staged_at(me, r), counts[me][r]) for r in node
                             if r != me and counts[me][r]])
    reads = tuple((node.index(q), staged_at(q, me), received_at(me, q), counts[q][me]) for q in node
                  if q != me and counts[q][me])
    own = (sent_at(me, me), received_at(me, me), counts[me][me]) if counts[me][me] else ()
    workspace = max(sum(counts[q][r] for r in node if r != q) for q in node)
    x_spans = tuple((a, c) for _, _, a, c in sends) + tuple((a, c) for a, _, c in staged) + \
        (((own[0], own[2]),) if own else ())
    out_spans = tuple((b, c) for _, _, b, c in receives) + tuple((b, c) for _, _, b, c in reads)
    return ExchangePlan(Exchange(sends, receives), staged, reads, own, workspace, workspace > 0, x_spans, out_spans)


def _merged_copies(copies):
    """(source offset, destination offset, count) copies, those that continue each other merged."""
    merged = []
    for a, w, count in copies:
        if merged and merged[-1][0] + merged[-1][2] == a and merged[-1][1] + merged[-1][2] == w:
            merged[-1] = (merged[-1][0], merged[-1][1], merged[-1][2] + count)
        else:
            merged.append((a, w, count))
    return tuple(merged)
