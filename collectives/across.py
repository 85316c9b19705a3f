"""Calls across nodes as compiled Programs: one C call per collective call.

Where every node has as many ranks (G) and the node's compiled loop takes
the dtype, hierarchy.py's calls across nodes are a few steps that C can
run back to back:

    small     (any collective; hierarchy.small's steps, at any size but
              the two below): one call of the node's compiled loop, one
              message to or from each counterpart on the other nodes, the
              partials folded in node order or the data copied into place;
    blocks    (an allreduce above the merged step's limit whose count G
              divides): the loop's reduce_scatter, which leaves local rank
              l the node's partial of block l; that block to and from each
              counterpart (local rank l of every node holds the same
              block); the block's partials folded in node order; the
              loop's all-gather of the blocks into out;
    slices    (a broadcast above that limit whose count G divides): the
              root's node broadcasts, its local rank l sends slice l of
              out to its counterparts, straight into their out, and every
              other node's loop all-gathers the slices in place;
    node rows (an allgather of rows from NODE_ROWS_FROM, where every
              node holds consecutive ranks): each rank's row goes from x straight
              into its counterparts' out; the loop all-gathers each node's
              rows into that node's range of out, its own node's from x,
              the others' in place;
    node blocks (a reduce_scatter above that limit, consecutive nodes):
              the loop reduce-scatters each node's range of x's blocks,
              which leaves local rank l the partial its counterpart on
              that node folds, straight into the message to it; the
              block's partials folded in node order into out.

Driven from Python the small path cost about 20 µs a call between two
one-process pretend nodes, where MPICH's allreduce costs 3, and the general
path's phases ran inside nodes without the loop. Here the steps of a call
shape (collective, dtype, count, op, root) are laid out once as a Program
of transport/_across.c, and every later call of that shape is one C call:

    node steps    the loop's channel (fastpath.FastCollectives.channel)
                  called back with the call's x, out and deadline (node
                  rows and blocks: a Python function that takes the ranges);
    messages      persistent MPI requests made once (mpi.RepeatedExchange):
                  8 bytes of signature, then the payload; receives first;
                  slices and node rows: the signature alone, and the
                  payload a message of its own started per call straight
                  from or into the call's arrays (Shape.direct);
    fold          host_folds.h's fold of the partials in node order (avg
                  divided once, at the end).

The bits are those of the fold order hierarchy.py documents: the loop
folds a node's inputs in local rank order, the Program the partials in
node order. hierarchy.small's Python steps run where no Program can (a
torch.distributed link, or no compiled extension). The messages'
signature is the call's, described with ", compiled" appended: a rank on
another path (a node without the compiled loop) sends another, and both
ranks name the mismatch instead of exchanging the wrong bytes.

The Communicator calls `allreduce` and `collective` below first (its
compiled shortcuts, `_fast_allreduce` and `_fast_collective`, which are
_across.c's Shortcuts): a call whose shape has a Program runs it without
any Python (the Program checks the arrays' sizes and contiguity, and
declines, running nothing, where they differ); what C leaves comes back to
`_slow` and `_finish`; any other call takes the general path, which lays
out the Program at a shape's first call.
"""

import ctypes
import os
import time
import weakref
from typing import NamedTuple

import numpy as np

from .algorithms.schedule import ALLGATHER, ALLREDUCE, BROADCAST, REDUCE_SCATTER, REDUCE_TO_ROOT
from .errors import CollectiveError, CollectiveTimeoutError
from .ops import ReduceOp, partial_op
from .transport import fastpath
from .transport.failures import ABORT_ARRIVED, MPI_FAILED, NODE_FAILED, PENDING
from .transport.mpi import CONFIRM_EVERY, DATA_TAG, timed_out_waiting
from .transport.protocol import description_hash

def loop_runs_nodes(h, call):
    """Whether every node has as many ranks and its compiled loop takes
    `call`'s dtype: what hierarchy.py's small path and the Programs need."""
    return (len({len(node) for node in h.topology.nodes}) == 1 and fastpath.available()
            and fastpath.takes(call.dtype) and (h.shm is None or h.shm.fast_allreduce is not None))


try:
    from .transport import _across
except ImportError:   # built without a C compiler: hierarchy.py runs every step itself
    _across = None

PROGRAMS_KEPT = 16              # call shapes whose Program is kept, the least recently used dropped first,
PROGRAM_BYTES_KEPT = 256 << 20  # and while their buffers hold more than this
PROGRAM_MAX_BYTES = 128 << 20   # a call whose Program's buffers would hold more takes the phases
# Rows from which an allgather of consecutive nodes goes by node rows (_allgather_by_node_rows), below
# the small path's limit too: between 2 hosts of 2 ranks (10gbit), 32 KiB rows took 77-99 µs where the
# whole node range to each counterpart (G times the bytes: by node ranges, as it was) took 257-281, and
# 64 KiB rows the same either way; 16 KiB rows and less keep the small layout (by node rows: 61-112 µs
# against 34-69, one more node step and two messages a peer).
NODE_ROWS_FROM = 32 << 10
HEALTH_EVERY = 0.02     # seconds a Program polls before Python looks at the deadline, the abort channel and signals
STARTED_ONLY = -1.0     # a Program's run() poll_until: return once its messages started (run_in_pieces)


class Laid(NamedTuple):
    """A call shape's Program and what its failures are told with."""
    program: object          # _across.Program
    exchange: object         # its mpi.RepeatedExchange (kept alive, freed with it)
    description: str         # the call's, as errors name it
    steps: tuple             # the collectives of its first and last node steps (for their errors)
    in_node_op: ReduceOp
    nbytes: int              # its buffers'
    own: tuple               # (start, stop): out's elements its last step reads as `own` (blocks), or None
    peers: tuple             # the peer of each of its requests, in the Program's order (for errors)


def takes_large(h, call):
    """Whether a call above the small path's limit runs as a Program (the
    same answer on every rank): where every node has G ranks and the loop
    takes the dtype, an allreduce whose count G divides (in blocks), any
    other collective (a broadcast in slices, an allgather or reduce_scatter
    of consecutive nodes node by node, else as the small path: each
    measured faster than the phases, see docs/across-nodes.md); while its
    buffers hold at most PROGRAM_MAX_BYTES."""
    size = len(h.node_ranks)
    return (call.count > 0 and (call.collective != ALLREDUCE or call.count % size == 0)
            and _buffer_bytes(h, call) <= PROGRAM_MAX_BYTES and loop_runs_nodes(h, call)
            and call.count * call.dtype.itemsize < 1 << 31)   # (a direct message's count is an int)


def _buffer_bytes(h, call):
    """No fewer bytes than a Program of `call` keeps, on any rank (messages,
    scratch; the same answer on all)."""
    nodes, x_bytes = len(h.topology.nodes), call.count * call.dtype.itemsize
    layout = _layout(h, call)
    if layout in (_allgather_by_node_rows, _broadcast_in_slices):   # (signatures only)
        return 16 * nodes
    by_node_blocks = layout is _reduce_scatter_by_node_blocks   # (one block per node, twice)
    return {ALLREDUCE: nodes * x_bytes // len(h.node_ranks) + 16 * nodes,   # (each message's header too)
            REDUCE_SCATTER: (2 * nodes * x_bytes // h.topology.size if by_node_blocks else 3 * x_bytes) + 16 * nodes,
            REDUCE_TO_ROOT: nodes * x_bytes + 16 * nodes,
            ALLGATHER: h.topology.size * x_bytes + 16 * nodes,
            BROADCAST: x_bytes + 16}[call.collective]


class Programs:
    """A HierarchyRanks' Programs, by call shape: `allreduce` and `collective`
    are the Communicator's shortcuts, `run` the general path's way in."""

    def __init__(self, h):
        self._h = h
        self._laid = {}       # (collective, dtype, count, op, root) -> Laid, the most recently used last
        self._bytes = 0
        self._stopped = False
        # The shortcuts run a known shape's Program from C (_across.c:
        # Shortcuts), and hand the rest to _slow and _finish below.
        # (Held weakly, as fastpath.weakly says why: h and this object hold the shortcuts.)
        shortcuts = _across.Shortcuts(laid=self._laid, counter=weakref.proxy(h), array_type=np.ndarray,
                                      slow=fastpath.weakly(self._slow), finish=fastpath.weakly(self._finish),
                                      own_index=Laid._fields.index("own"), health_every=HEALTH_EVERY)
        self.allreduce, self.collective = shortcuts.allreduce, shortcuts.collective

    def takes_large(self, call):
        return takes_large(self._h, call)

    @staticmethod
    def available(link):
        """Whether Programs can run over `link` (MPI, and the extension built)."""
        return _across is not None and hasattr(link, "repeated_exchange") and _bound(link)

    # -- the Communicator's shortcuts, where C leaves the call ----------------------

    def _slow(self, collective, x, op, out, root, timeout):
        """What the shortcuts in C leave (a Program that needs its `own`
        view, reduce_scatter in place): the same call through Python."""
        if collective == ALLREDUCE:
            return self._allreduce(x, op, out, timeout)
        return self._collective(collective, x, op, out, root, timeout)

    def _finish(self, laid, status, x, out, deadline, error):
        """After a shortcut's run that did not end at once: resume it, or
        raise what it says (`error`: what the run raised), the
        communicator aborted first."""
        try:
            if error is not None:
                raise error
            self._go_on(laid, status, x, out, deadline)
        except BaseException as failure:
            self._h.abort(failure)
            raise
        return True

    def _allreduce(self, x, op, out, timeout):
        """Communicator._fast_allreduce: the result, or None to decline."""
        if x.__class__ is not np.ndarray:
            return None
        try:
            laid = self._laid.get((ALLREDUCE, x.dtype, x.size, op, 0))
        except TypeError:   # an unhashable op: the checks name it
            return None
        if laid is None:
            return None
        out = x if out is None else out
        if out.__class__ is not np.ndarray or out.dtype != x.dtype:
            return None
        return out if self._fast(laid, x, out, timeout) else None

    def _collective(self, collective, x, op, out, root, timeout):
        """Communicator._fast_collective: True once done, None to decline."""
        if x.__class__ is not np.ndarray:
            return None
        try:
            laid = self._laid.get((collective, x.dtype, x.size, op, root))
        except TypeError:   # an unhashable op: the checks name it
            return None
        if laid is None:
            return None
        if out is None:   # reduce_scatter's own block of x; broadcast and reduce in place
            out = _own_block(x, self._h) if collective == REDUCE_SCATTER else x
        elif out.__class__ is not np.ndarray or out.dtype != x.dtype:
            return None
        return True if self._fast(laid, x, out, timeout) else None

    def _fast(self, laid, x, out, timeout):
        """A shortcut's call: True once done, False where the Program declined."""
        h = self._h
        h.calls += 1   # the call's number, as HierarchyRanks counts every call
        try:
            ran = self._run(laid, x, out, h.calls, time.perf_counter() + timeout)
        except BaseException as error:
            h.abort(error)
            raise
        if not ran:
            h.calls -= 1   # nothing ran: the general path counts the call
        return ran

    # -- the general path's way in -------------------------------------------------

    def run(self, call, x, out, deadline, layout=None):
        """Run `call` (hierarchy.Call, which the small path or takes_large
        takes) through its shape's Program, laid out first if need be; x and
        out flat. `layout`: the function that lays it out, where the caller
        has its own (a compressed allreduce: hierarchy.compressed_program)."""
        if self._stopped:
            self._h.link.check_health()   # raises: the communicator was aborted
        laid = self._laid_for(call, layout)
        if not self._run(laid, x, out, self._h.calls, deadline):
            raise CollectiveError(f"{call.description}: the compiled program declined arrays the checks passed")

    def run_in_pieces(self, call, pieces, x, out, deadline, layout, before_piece=None):
        """Run `call` as consecutive pieces of x and out, `pieces` their
        (start, count) in elements, each piece a Program of its own laid
        out by `layout`, two in flight: piece i's first step runs and its
        messages start before piece i-1 is waited for and its last step
        runs, so the node's and the codec's work on one piece overlaps the
        link carrying the other. Each run only starts its piece
        (STARTED_ONLY): were piece i to finish inside its run on one rank
        and not on its node-mate, their node steps would come in different
        orders; so every rank's node steps go first(0), first(1), last(0),
        first(2), last(1), ... MPI moves a started message only while the
        rank calls into it (the polls of the piece it waits for), so a
        piece's steps should take no longer than the kernel's socket
        buffers take to drain. `before_piece(start, count)` runs before
        each piece starts (error feedback points h.residual at the
        piece's). Every rank runs the same pieces in the same order and MPI
        matches a pair's messages in the order they were started, so the
        two Programs in flight (one per parity, on the same tag) never take
        each other's messages; a failure leaves both to abort (stop()
        orphans them)."""
        if self._stopped:
            self._h.link.check_health()   # raises: the communicator was aborted
        in_flight = None   # (laid, status, x, out) of the piece before, started, its last step not run
        for index, (start, count) in enumerate(pieces):
            laid = self._laid_for(call._replace(count=count), layout, index % 2, in_flight and in_flight[0])
            if before_piece is not None:
                before_piece(start, count)
            xs, outs = x[start:start + count], out[start:start + count]
            own = () if laid.own is None else (_own(outs, laid),)
            status = laid.program.run(xs, outs, self._h.calls, deadline, STARTED_ONLY, *own)
            if status is None:
                raise CollectiveError(f"{call.description}: the compiled program declined a piece the checks passed")
            if status[0] != PENDING:   # a failure: raised before the piece in flight's last step, which the
                self._go_on(laid, status, xs, outs, deadline)   # node-mates will not run (the abort orphans it)
            if in_flight is not None:
                self._go_on(*in_flight, deadline)
            in_flight = (laid, status, xs, outs)
        if in_flight is not None:
            self._go_on(*in_flight, deadline)

    def _laid_for(self, call, layout, parity=None, in_flight=None):
        """`call`'s Program (laid out first if need be: `layout`, or the
        collective's own), now the most recently used; `parity` tells apart
        the two Programs of a shape that run_in_pieces keeps in flight, and
        the one `in_flight` is never dropped to make room."""
        key = (call.collective, call.dtype, call.count, call.op, call.root)
        if call.compression is not None:   # (a longer key: never one the shortcuts look up; the
            key += (call.compression, call.description)   # description tells error feedback apart)
        if parity is not None:
            key += ("piece", parity)
        laid = self._laid.pop(key, None)
        if laid is None:
            laid = lay_out(self._h, call, layout)
            self._bytes += laid.nbytes
            while self._laid and (len(self._laid) >= PROGRAMS_KEPT or self._bytes > PROGRAM_BYTES_KEPT):
                if self._laid[next(iter(self._laid))] is in_flight:
                    break
                dropped = self._laid.pop(next(iter(self._laid)))
                dropped.exchange.free()
                self._bytes -= dropped.nbytes
        self._laid[key] = laid
        return laid

    def _run(self, laid, x, out, seq, deadline):
        """One call of `laid`'s program: True once done, False where it declined (nothing ran)."""
        now = time.perf_counter()
        own = () if laid.own is None else (_own(out, laid),)
        status = laid.program.run(x, out, seq, deadline, min(deadline, now + HEALTH_EVERY), *own)
        if status is None:
            return False
        if status != 0:
            self._go_on(laid, status, x, out, deadline)
        return True

    def _go_on(self, laid, status, x, out, deadline):
        """After a run that did not finish: resume it while it is pending
        and in time (the abort channel and signals looked at in between),
        raise what a failure says."""
        while status != 0:
            if status[0] == ABORT_ARRIVED:
                self._h.link.check_health()   # raises the aborting rank's error
                raise CollectiveError(f"{laid.description}: MPI failed on the abort channel")
            if status[0] != PENDING:
                self._fail(laid, status, x)
            self._h.link.check_health()
            now = time.perf_counter()
            if now >= deadline:
                self._drop(laid)
                raise timed_out_waiting(laid.exchange.sources or laid.exchange.targets,
                                        f"{laid.description}: between counterparts")
            status = laid.program.resume(x, out, min(deadline, now + HEALTH_EVERY))

    def _fail(self, laid, status, x):
        """Raise what `status` (a failed run's) says."""
        h, what = self._h, f"{laid.description}: between counterparts"
        kind = status[0]
        if kind == NODE_FAILED:
            _, result, which = status
            if result is None:
                raise CollectiveError(f"the node's compiled loop declined a step of {laid.description}")
            h.shm.fast.raise_failure(result, x, laid.in_node_op, laid.steps[which], 0)
        self._drop(laid)
        exchange = laid.exchange
        if kind == MPI_FAILED:
            _, request, code = status
            raise h.link.mpi_error(code, what, laid.peers[request])
        raise h.link.different_call(exchange.sources[status[1]], what)   # MISMATCH

    def _drop(self, laid):
        """A failed call's Program: MPI may still hold its requests, so they are orphaned, never reused."""
        for key, kept in list(self._laid.items()):
            if kept is laid:
                del self._laid[key]
                self._bytes -= laid.nbytes
        _orphan(self._h.link, laid)

    def stop(self):
        """After an abort: no Program runs again; MPI may hold their requests, so they are orphaned."""
        for laid in self._laid.values():
            _orphan(self._h.link, laid)
        self._laid.clear()
        self._bytes = 0
        self._stopped = True

    def close(self):
        """Free every Program's requests (the link is about to be freed)."""
        for laid in self._laid.values():
            laid.exchange.free()
        self._laid.clear()
        self._bytes = 0


def _orphan(link, laid):
    """A Program MPI may still hold requests of: its direct receives
    cancelled, it (which holds the last call's arrays) and its exchange kept alive."""
    laid.program.cancel()
    link.orphan(laid.exchange, laid.program)


def _own(out, laid):
    """out's elements laid.own, as the blocks layout's last step reads them
    (a view where out is contiguous; else a copy, which the Program declines with out)."""
    start, stop = laid.own
    return out.reshape(-1)[start:stop]


def _own_block(x, h):
    """reduce_scatter's output without `out`: x's block of this rank (a view
    where x is contiguous; else a copy, which the Program declines with x)."""
    block = x.size // h.topology.size
    return x.reshape(-1)[h.rank * block:(h.rank + 1) * block]


# -- laying a call out -----------------------------------------------------------------------

class Shape(NamedTuple):
    """What lay_out hands the Program, worked out per collective below. A
    node step is (callable, args, x_at, out_at, deadline_at): the call's x,
    out and deadline go at those indexes of args (-1: nowhere)."""
    exchange: object
    x_bytes: int
    out_bytes: int
    first_step: tuple = None
    before: list = []
    fold: tuple = None
    last_step: tuple = None
    after: list = []
    steps: tuple = ("", "")   # the collectives of the first and last node steps
    own: tuple = None         # (start, stop): out's elements passed to a node step as `own`
    direct: tuple = None      # (receives, sends, x_home, sends_from_x): messages with no buffer (_across.c: Direct)


def lay_out(h, call, layout=None):
    """The Program of `call`'s shape on rank h.rank (see the module's doc),
    laid out by `layout` if given, else by the collective's own."""
    nodes, k_me = h.topology.nodes, h.node_index
    counterparts = [node[h.local] for node in nodes]
    others = [peer for k, peer in enumerate(counterparts) if k != k_me]
    shape = (layout or _layout(h, call))(h, call, counterparts, others)
    exchange = shape.exchange
    receives, sends, x_home, sends_from_x = shape.direct or ([], [], None, False)
    direct = None if shape.direct is None else (
        receives, sends, h.link.comm.handle, h.link.mpi.BYTE.handle, DATA_TAG, x_home, sends_from_x)
    program = _across.Program(
        first_step=shape.first_step, before=shape.before, send_headers=exchange.send_header_addresses(),
        receive_headers=exchange.receive_header_addresses(), requests=exchange.request_addresses(), fold=shape.fold,
        last_step=shape.last_step, after=shape.after, x_bytes=shape.x_bytes, out_bytes=shape.out_bytes,
        description_hash=description_hash(f"{call.description}, compiled"), spin=h.poll_spin,
        abort_request=h.link.abort_request_address, abort_status=h.link.abort_status_address, direct=direct,
        confirm=(exchange.synchronous_send_addresses(), exchange.confirmed_peers(h.link.confirms),
                 h.link.unconfirmed_sends.ctypes.data, CONFIRM_EVERY))
    peers = tuple(exchange.sources + exchange.targets + [peer for peer, _, _ in receives + sends])
    return Laid(program, exchange, call.description, shape.steps, partial_op(call.op), exchange.nbytes, shape.own,
                peers)


def _layout(h, call):
    """The function that lays `call` out (the same on every rank)."""
    nbytes = call.count * call.dtype.itemsize
    large = nbytes > h.fast_small_max
    consecutive = h.shm is not None and h.topology.consecutive
    if large and call.collective == ALLREDUCE:
        return _blocks
    if large and call.collective == BROADCAST and h.shm is not None and call.count % len(h.node_ranks) == 0:
        return _broadcast_in_slices
    if consecutive and call.collective == ALLGATHER and nbytes >= NODE_ROWS_FROM:
        return _allgather_by_node_rows
    if large and consecutive and call.collective == REDUCE_SCATTER:
        return _reduce_scatter_by_node_blocks
    return _SMALL[call.collective]


def _address(array):
    return array.ctypes.data


def _loop(h, collective, nbytes, source, into, op=ReduceOp.SUM, root=0, own_source=False):
    """The node step that runs `collective` of `nbytes` a rank from
    `source` into `into` (None: the call's x, or its out; `own_source`: the
    call's `own`), with the in-node op of `op` (avg sums) and local rank
    `root` (reduce, broadcast): the node's loop, or where it leaves such a
    call to the plans (a single copy), the node's plans
    (HierarchyRanks.plans_step: the same on every rank, and on every later
    call, which may only find the single copy refused and then stage in
    the loop that way)."""
    op = partial_op(op)
    x_at, own_at = (-1, 1) if own_source else (1 if source is None else -1, -1)
    out_at = 2 if into is None else -1
    if h.shm.fast.step_for(collective, nbytes) == fastpath.PLANS:
        ranks = weakref.proxy(h)   # (h holds the Programs that hold this)
        return (lambda *arguments: ranks.plans_step(*arguments), (collective, source, into, op.value, root, None),
                x_at, out_at, 5, own_at)
    if collective == ALLREDUCE:   # (the channel's allreduce takes neither a root nor a kind)
        assert source is None and into is not None and not own_source, "a node allreduce from x into a buffer"
        return h.shm.fast.channel.allreduce, (None, into, fastpath.OP_CODES[op], None), 0, -1, 3, -1
    args = (fastpath.KINDS[collective], source, into, fastpath.OP_CODES[op], root, None)
    return h.shm.fast.channel.collective, args, x_at, out_at, 5, own_at


def node_call(h, collective, nbytes, op=ReduceOp.SUM, root=0):
    """The node's `collective` of `nbytes` a rank with the in-node op of
    `op`, for a step's own function to call: `(x, out, deadline)` -> 0 or
    the loop's failure status, the loop's call, or where the loop leaves
    such a call to the plans (a single copy), the node's plans' (which
    raise a failure), decided once for every call of the shape as
    _loop's."""
    op = partial_op(op)
    if h.shm.fast.step_for(collective, nbytes) == fastpath.PLANS:
        ranks, value = weakref.proxy(h), op.value   # (h holds the Programs that hold this)
        return lambda x, out, deadline: ranks.plans_step(collective, x, out, value, root, deadline)
    channel, code = h.shm.fast.channel, fastpath.OP_CODES[op]
    if collective == ALLREDUCE:
        return lambda x, out, deadline: channel.allreduce(x, out, code, deadline)
    kind = fastpath.KINDS[collective]
    return lambda x, out, deadline: channel.collective(kind, x, out, code, root, deadline)


def _fold(sources, into, call, nbytes, size):
    """The fold of `sources` ((base, offset) each, in node order) into `into`."""
    return (sources, into, nbytes, call.dtype.itemsize, _across.element_type(np.empty(1, call.dtype)),
            fastpath.OP_CODES[call.op], size if call.op is ReduceOp.AVG else 0)


def _reducing(h, call, counterparts, others):
    """Small allreduce, reduce_scatter and reduce: the node's partial P (the
    loop's allreduce, or reduce to the root's local index) goes to the
    counterparts that fold it (reduce_scatter: block r of P to rank r's
    counterpart), which fold the partials in node order into out."""
    X, OUT, ADDRESS = _across.X, _across.OUT, _across.ADDRESS
    me, k_me, size, itemsize = h.rank, h.node_index, h.topology.size, call.dtype.itemsize
    x_bytes = call.count * itemsize
    block = x_bytes // size if call.collective == REDUCE_SCATTER else x_bytes
    if call.collective != REDUCE_TO_ROOT:
        senders, receivers = others, others
    elif h.local != h.topology.local_of(call.root):
        senders, receivers = [], []          # the node step only
    elif me != call.root:
        senders, receivers = [call.root], []
    else:
        senders, receivers = [], others
    exchange = h.link.repeated_exchange([(peer, block) for peer in senders], [(peer, block) for peer in receivers],
                                        one_payload=call.collective != REDUCE_SCATTER)
    # P: the first message itself where it is the whole partial, else memory of its own
    if senders and call.collective != REDUCE_SCATTER:
        part = exchange.send_payloads[0].view(call.dtype)
    else:
        part = exchange.keep(np.empty(call.count, call.dtype))
    first, before = None, []
    if h.shm is None:
        before.append(((X, 0), (ADDRESS, _address(part)), x_bytes))
    elif call.collective == REDUCE_TO_ROOT:
        first = _loop(h, REDUCE_TO_ROOT, x_bytes, None, part, call.op, h.topology.local_of(call.root))
    else:
        first = _loop(h, ALLREDUCE, x_bytes, None, part, call.op)
    for peer, payload in zip(senders, exchange.send_payloads):
        piece = _address(part) + (peer * block if call.collective == REDUCE_SCATTER else 0)
        if _address(payload) != piece:
            before.append(((ADDRESS, piece), (ADDRESS, _address(payload)), block))
    fold = None
    if receivers:
        received = iter(exchange.receive_payloads)
        mine = _address(part) + (me * block if call.collective == REDUCE_SCATTER else 0)
        sources = [(ADDRESS, mine if k == k_me else _address(next(received))) for k in range(len(h.topology.nodes))]
        fold = _fold(sources, (OUT, 0), call, block, size)
    step = "reduce" if call.collective == REDUCE_TO_ROOT else "allreduce"
    return Shape(exchange, x_bytes, block, first_step=first, before=before, fold=fold, steps=(step, ""))


def _reduce_scatter_by_node_blocks(h, call, counterparts, others):
    """A large reduce_scatter where every node holds consecutive ranks: node
    j's ranks own one range of x's blocks, so the loop's reduce_scatter of
    that range leaves local rank l the node's partial of block (j, l), the
    block of its counterpart on node j; run for every node's range, straight
    into the message to that counterpart (its own node's, into its own
    partial). Then each rank folds its block's partials in node order into
    out. The node reduces x once, where the small layout's allreduce left
    every rank the node's partial of all of x."""
    ADDRESS = _across.ADDRESS
    nodes, k_me, size = h.topology.nodes, h.node_index, h.topology.size
    count = call.count // size   # a block's elements
    block = count * call.dtype.itemsize
    exchange = h.link.repeated_exchange([(peer, block) for peer in others], [(peer, block) for peer in others])
    own_partial = exchange.keep(np.empty(count, call.dtype))
    partials = iter(payload.view(call.dtype) for payload in exchange.send_payloads)
    into = [own_partial if k == k_me else next(partials) for k in range(len(nodes))]
    ranges = [(node[0] * count, (node[0] + len(node)) * count) for node in nodes]
    reduce_scatter = node_call(h, REDUCE_SCATTER, len(h.node_ranks) * count * call.dtype.itemsize, call.op)

    def every_nodes_blocks(x, deadline):
        flat = x.reshape(-1)
        for partial, (start, stop) in zip(into, ranges):
            result = reduce_scatter(flat[start:stop], partial, deadline)
            if result != 0:
                return result
        return 0

    received = iter(exchange.receive_payloads)
    sources = [(ADDRESS, _address(own_partial) if k == k_me else _address(next(received)))
               for k in range(len(nodes))]
    return Shape(exchange, call.count * call.dtype.itemsize, block,
                 first_step=(every_nodes_blocks, (None, None), 0, -1, 1, -1),
                 fold=_fold(sources, (_across.OUT, 0), call, block, size), steps=("reduce_scatter", ""))


def _blocks(h, call, counterparts, others):
    """A large allreduce (takes_large): reduce_scatter in the node, the
    block's partials between counterparts, their fold in node order,
    all-gather in the node."""
    OUT, ADDRESS = _across.OUT, _across.ADDRESS
    size, k_me = len(h.node_ranks), h.node_index
    x_bytes = call.count * call.dtype.itemsize
    block = x_bytes // size
    exchange = h.link.repeated_exchange([(peer, block) for peer in others], [(peer, block) for peer in others],
                                        one_payload=True)
    part = exchange.send_payloads[0].view(call.dtype)
    if h.shm is None:   # one rank a node: its x is its node's partial, and the result is out
        before = [((_across.X, 0), (ADDRESS, _address(part)), x_bytes)]
        first = last = own = None
        result = (OUT, 0)
    else:   # the fold into out's block of this rank, which the all-gather then reads in place
        before = []
        first = _loop(h, REDUCE_SCATTER, x_bytes, None, part, call.op)
        last = _loop(h, ALLGATHER, block, None, None, own_source=True)
        count = call.count // size
        own = (h.local * count, (h.local + 1) * count)
        result = (OUT, h.local * block)
    before += [((ADDRESS, _address(part)), (ADDRESS, _address(payload)), block)
               for payload in exchange.send_payloads[1:] if _address(payload) != _address(part)]
    received = iter(exchange.receive_payloads)
    sources = [(ADDRESS, _address(part) if k == k_me else _address(next(received)))
               for k in range(len(h.topology.nodes))]
    return Shape(exchange, x_bytes, x_bytes, first_step=first, before=before,
                 fold=_fold(sources, result, call, block, h.topology.size), last_step=last,
                 steps=("reduce_scatter", "allgather"), own=own)


def _allgather(h, call, counterparts, others):
    """The node's blocks gathered by the loop into the message to every
    counterpart; then every node's blocks copied into out, rank by rank."""
    X, OUT, ADDRESS = _across.X, _across.OUT, _across.ADDRESS
    nodes, k_me, row = h.topology.nodes, h.node_index, call.count * call.dtype.itemsize
    node_bytes = len(h.node_ranks) * row
    exchange = h.link.repeated_exchange([(peer, node_bytes) for peer in others],
                                        [(counterparts[k], node_bytes) for k in range(len(nodes)) if k != k_me],
                                        one_payload=True)
    mine = exchange.send_payloads[0]
    if h.shm is None:
        first, before = None, [((X, 0), (ADDRESS, _address(mine)), row)]
    else:
        first, before = _loop(h, ALLGATHER, row, None, mine.view(call.dtype)), []
    before += [((ADDRESS, _address(mine)), (ADDRESS, _address(payload)), node_bytes)
               for payload in exchange.send_payloads[1:] if _address(payload) != _address(mine)]
    received = iter(exchange.receive_payloads)
    blocks = [_address(mine) if k == k_me else _address(next(received)) for k in range(len(nodes))]
    after = [((ADDRESS, blocks[k] + local * row), (OUT, rank * row), row)
             for k, node in enumerate(nodes) for local, rank in enumerate(node)]
    return Shape(exchange, row, h.topology.size * row, first_step=first, before=before, after=after,
                 steps=("allgather", ""))


def _allgather_by_node_rows(h, call, counterparts, others):
    """An allgather of rows from NODE_ROWS_FROM, where every node holds
    consecutive ranks, with no message buffers:

    1. each rank's row goes straight from x into its counterparts' out, and
       theirs into its out (started before the node step: a counterpart's
       MPI moves them while this rank is in its loop);
    2. the loop all-gathers the node's rows from x into the node's range of out;
    3. once the rows came, the loop all-gathers each other node's rows in
       place: local rank l holds that node's row l.

    A rank sends its row once per other node, and no byte goes through a
    buffer of ours (the small layout sends the node's G rows to every
    counterpart, then copies every row into place). Where x overlaps out
    other than as its own row, the node step may write over it: the rows
    then go after it, from out (_across.c: x_clear_of_out). The rows'
    signatures go before them, in 8-byte messages of their own."""
    OUT = _across.OUT
    k_me, count = h.node_index, call.count
    row = count * call.dtype.itemsize
    exchange, own_node, ranges = _signatures_and_own_node(h, call, others)
    gather = node_call(h, ALLGATHER, row)

    def other_nodes(out, deadline):
        flat = out.reshape(-1)
        for k, (start, stop) in enumerate(ranges):
            peer = counterparts[k]
            result = 0 if k == k_me else gather(flat[peer * count:(peer + 1) * count], flat[start:stop], deadline)
            if result != 0:
                return result
        return 0

    direct = ([(peer, (OUT, peer * row), row) for peer in others],
              [(peer, (OUT, h.rank * row), row) for peer in others], (OUT, h.rank * row), True)
    return Shape(exchange, row, h.topology.size * row, first_step=own_node,
                 last_step=(other_nodes, (None, None), -1, 0, 1, -1), steps=("allgather", "allgather"),
                 direct=direct)


def _signatures_and_own_node(h, call, others):
    """What the allgathers of consecutive nodes with no message buffers
    start from: their exchange (the call's signature alone, to and from
    each counterpart), the node step that all-gathers the node's rows from
    x into the node's range of out, and every node's range of out (elements)."""
    exchange = h.link.repeated_exchange([(peer, 0) for peer in others], [(peer, 0) for peer in others],
                                        one_payload=True)
    gather = node_call(h, ALLGATHER, call.count * call.dtype.itemsize)
    ranges = [(node[0] * call.count, (node[0] + len(node)) * call.count) for node in h.topology.nodes]
    start, stop = ranges[h.node_index]

    def own_node(x, out, deadline):
        return gather(x, out.reshape(-1)[start:stop], deadline)

    return exchange, (own_node, (None, None, None), 0, 1, 2, -1), ranges


def _broadcast(h, call, counterparts, others):
    """The root sends its data once to each other node, to the rank of the
    root's local index there (its counterpart), which broadcasts it in its
    node (the loop, from the received message into out); the root's node
    broadcasts once the root's messages are sent. One message per other node: a message from each rank
    of the root's node to each counterpart made G times the traffic and
    the work between nodes. Alone on its node (no loop), a rank sends from
    x or copies what it receives into out."""
    X, OUT, ADDRESS = _across.X, _across.OUT, _across.ADDRESS
    nbytes = call.count * call.dtype.itemsize
    root_node, root_local = h.topology.node_of(call.root), h.topology.local_of(call.root)
    in_root_node = h.node_index == root_node
    if h.shm is not None and h.local != root_local:   # the node's broadcast alone (out of place, x as it was)
        exchange = h.link.repeated_exchange([], [])
        step = _loop(h, BROADCAST, nbytes, None, None, root=root_local)
        if in_root_node:
            return Shape(exchange, nbytes, nbytes, first_step=step, steps=("broadcast", ""))
        return Shape(exchange, nbytes, nbytes, last_step=step, steps=("", "broadcast"))
    if not in_root_node:
        exchange = h.link.repeated_exchange([], [(counterparts[root_node], nbytes)])
        received = exchange.receive_payloads[0]
        if h.shm is None:
            return Shape(exchange, nbytes, nbytes, after=[((ADDRESS, _address(received)), (OUT, 0), nbytes)])
        step = _loop(h, BROADCAST, nbytes, received.view(call.dtype), None, root=root_local)
        return Shape(exchange, nbytes, nbytes, last_step=step, steps=("", "broadcast"))
    # The root: its message leaves first, then its node broadcasts (from x into out).
    exchange = h.link.repeated_exchange([(peer, nbytes) for peer in others], [], one_payload=True)
    before = [((X, 0), (ADDRESS, _address(payload)), nbytes) for payload in exchange.send_payloads[:1]]
    if h.shm is None:
        return Shape(exchange, nbytes, nbytes, before=before, after=[((X, 0), (OUT, 0), nbytes)])
    return Shape(exchange, nbytes, nbytes, before=before,
                 last_step=_loop(h, BROADCAST, nbytes, None, None, root=root_local), steps=("", "broadcast"))


def _broadcast_in_slices(h, call, counterparts, others):
    """A large broadcast whose count the node size G divides, with no
    message buffers: the root's node broadcasts (the loop), and its local
    rank l sends slice l (a G-th of the data) of out to its counterparts; on
    every other node, local rank l receives slice l straight into out, and
    the loop all-gathers the slices in place. So a node receives the data
    once, where each of its ranks receiving all of it made G times the
    traffic between nodes (and, on pretend nodes, G times the copies
    through MPI)."""
    OUT = _across.OUT
    local, nodes = h.local, h.topology.nodes
    count = call.count // len(h.node_ranks)
    piece = count * call.dtype.itemsize
    nbytes = call.count * call.dtype.itemsize
    root_node = h.topology.node_of(call.root)
    if h.node_index == root_node:
        exchange = h.link.repeated_exchange([(peer, 0) for peer in others], [], one_payload=True)
        first = _loop(h, BROADCAST, nbytes, None, None, root=h.topology.local_of(call.root))
        return Shape(exchange, nbytes, nbytes, first_step=first, steps=("broadcast", ""),
                     direct=([], [(peer, (OUT, local * piece), piece) for peer in others], None, False))
    source = nodes[root_node][local]
    exchange = h.link.repeated_exchange([], [(source, 0)])
    gather = node_call(h, ALLGATHER, piece)

    def gather_slices(out, deadline):
        flat = out.reshape(-1)
        return gather(flat[local * count:(local + 1) * count], flat, deadline)

    return Shape(exchange, nbytes, nbytes, last_step=(gather_slices, (None, None), -1, 0, 1, -1),
                 steps=("", "allgather"), direct=([(source, (OUT, local * piece), piece)], [], None, False))


_SMALL = {ALLREDUCE: _reducing, REDUCE_SCATTER: _reducing, REDUCE_TO_ROOT: _reducing, ALLGATHER: _allgather,
          BROADCAST: _broadcast, "barrier": _reducing}   # (HierarchyRanks.barrier: an allreduce of one byte)


def _bound(link):
    """Bind _across to the MPI library mpi4py loaded (once per process):
    False where its functions cannot be found (a static build, say)."""
    global _BOUND
    if _BOUND is None:
        MPI = link.mpi
        try:
            library = ctypes.CDLL(MPI.__file__, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            _across.bind_mpi(*(ctypes.cast(function, ctypes.c_void_p).value for function in (
                library.MPI_Start, library.MPI_Test, library.MPI_Isend, library.MPI_Irecv, library.MPI_Cancel)),
                MPI._sizeof(MPI.Status), MPI._sizeof(MPI.Comm))   # noqa: SLF001
            _BOUND = True
        except (OSError, AttributeError, ValueError):
            _BOUND = False
    return _BOUND


_BOUND = None
