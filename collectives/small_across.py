"""The small path across nodes, compiled: one C call per collective call.

hierarchy.py's small path (see "small messages" there) is three steps: one
call of the node's compiled loop, one message to or from each counterpart
on the other nodes, and the fold of the partials in node order (or copies
into place). Driven from Python they cost about 20 µs a call between two
processes, where MPICH's allreduce costs 3. Here the steps of a call shape
(collective, dtype, count, op, root) are laid out once, as a Program of
transport/_across.c, and every later call of that shape is one C call:

    node step     the loop's channel (fastpath.FastCollectives.channel)
                  called back with the call's x and deadline, into a partial
                  that is already a message's payload where it can be;
    messages      persistent MPI requests made once (mpi.RepeatedExchange):
                  8 bytes of signature, then the payload; receives first;
    fold          host_folds.h's fold of the partials in node order (avg
                  divided once, at the end), or the copies into `out`.

The bits are those of hierarchy.small's steps, which run where no Program
can (a torch.distributed link, or no compiled extension). The messages'
signature is the call's, described with ", small path" appended: a rank on
the general path (a node without the compiled loop) sends another, and
both ranks name the mismatch instead of exchanging the wrong bytes.

The Communicator calls `allreduce` and `collective` below first (its
compiled shortcuts, `_fast_allreduce` and `_fast_collective`): a call whose
shape has a Program runs it without any other check (the Program checks the
arrays' sizes and contiguity, and declines, running nothing, where they
differ); any other call takes the general path, which lays out the Program
at a shape's first small call.
"""

import ctypes
import os
import time
from typing import NamedTuple

import numpy as np

from .algorithms.schedule import ALLGATHER, ALLREDUCE, BROADCAST, REDUCE_SCATTER, REDUCE_TO_ROOT
from .errors import CollectiveError, CollectiveTimeoutError
from .hierarchy import _in_node_op
from .ops import ReduceOp
from .transport import fastpath
from .transport.layout import SMALL_MAX
from .transport.protocol import description_hash

try:
    from .transport import _across
except ImportError:   # built without a C compiler: hierarchy.small drives the steps
    _across = None

PROGRAMS_KEPT = 16      # call shapes whose Program (requests and buffers) is kept, the least recently used dropped
HEALTH_EVERY = 0.02     # seconds a Program polls before Python looks at the deadline, the abort channel and signals


class Laid(NamedTuple):
    """A call shape's Program and what its failures are told with."""
    program: object          # _across.Program
    exchange: object         # its mpi.RepeatedExchange (kept alive, freed with it)
    receive_peers: list      # the rank each receive comes from
    send_peers: list
    description: str         # the call's, as errors name it
    in_node_op: ReduceOp


class SmallPrograms:
    """A HierarchyRanks' Programs, by call shape: `allreduce` and `collective`
    are the Communicator's shortcuts, `run` the general path's way in."""

    def __init__(self, h):
        self._h = h
        self._laid = {}       # (collective, dtype, count, op, root) -> Laid, the most recently used last

    @staticmethod
    def available(link):
        """Whether Programs can run over `link` (MPI, and the extension built)."""
        return _across is not None and hasattr(link, "repeated_exchange") and _bound(link)

    # -- the Communicator's shortcuts --------------------------------------------

    def allreduce(self, x, op, out, timeout):
        """Communicator._fast_allreduce: the result, or None to decline."""
        if x.__class__ is not np.ndarray:
            return None
        laid = self._laid.get((ALLREDUCE, x.dtype, x.size, op, 0))
        if laid is None:
            return None
        out = x if out is None else out
        if out.__class__ is not np.ndarray:
            return None
        return out if self._fast(laid, x, out, timeout) else None

    def collective(self, collective, x, op, out, root, timeout):
        """Communicator._fast_collective: True once done, None to decline."""
        if x.__class__ is not np.ndarray:
            return None
        laid = self._laid.get((collective, x.dtype, x.size, op, root))
        if laid is None:
            return None
        if out is None:   # reduce_scatter's own block of x; broadcast and reduce in place
            out = _own_block(x, self._h) if collective == REDUCE_SCATTER else x
        elif out.__class__ is not np.ndarray:
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

    def run(self, call, x, out, deadline):
        """Run `call` (hierarchy.Call; the small path takes it) through its
        shape's Program, laid out first if need be; x and out flat."""
        key = (call.collective, call.dtype, call.count, call.op, call.root)
        laid = self._laid.pop(key, None)
        if laid is None:
            if len(self._laid) >= PROGRAMS_KEPT:
                self._laid.pop(next(iter(self._laid))).exchange.free()
            laid = lay_out(self._h, call)
        self._laid[key] = laid
        if not self._run(laid, x, out, self._h.calls, deadline):
            raise CollectiveError(f"{call.description}: the small path's program declined arrays the checks passed")

    def _run(self, laid, x, out, seq, deadline):
        """One call of `laid`'s program: True once done, False where it declined (nothing ran)."""
        now = time.perf_counter()
        status = laid.program.run(x, out, seq, deadline, min(deadline, now + HEALTH_EVERY))
        while status != 0:
            if status is None:
                return False
            if status[0] != _across.PENDING:
                self._fail(laid, status, x)
            link = self._h.link
            link.check_health()
            now = time.perf_counter()
            if now >= deadline:
                self._drop(laid)
                raise CollectiveTimeoutError(
                    f"timed out waiting for rank(s) {', '.join(map(str, laid.receive_peers)) or '-'} on other "
                    f"nodes in {laid.description}: between counterparts (is every rank making the same calls?)")
            status = laid.program.resume(x, out, min(deadline, now + HEALTH_EVERY))
        return True

    def _fail(self, laid, status, x):
        """Raise what `status` (a failed run's) says."""
        h, what = self._h, f"{laid.description}: between counterparts"
        kind = status[0]
        if kind == _across.NODE_FAILED:
            result = status[1]
            if result is None:
                raise CollectiveError(f"the node's compiled loop declined {laid.description}")
            collective = laid.description.split(" ", 1)[0]
            h.shm.fast_allreduce.raise_failure(result, x, laid.in_node_op, collective, 0)
        self._drop(laid)
        if kind == _across.MPI_FAILED:
            _, request, code = status
            peers = laid.receive_peers + laid.send_peers
            raise h.link.mpi_error(code, what, peers[request])
        raise h.link._different_call(laid.receive_peers[status[1]], what)   # noqa: SLF001

    def _drop(self, laid):
        """A failed call's Program: MPI may still hold its requests, so they are orphaned, never reused."""
        for key, kept in list(self._laid.items()):
            if kept is laid:
                del self._laid[key]
        self._h.link.orphan(laid.exchange)

    def stop(self):
        """After an abort: no Program runs again; MPI may hold their requests, so they are orphaned."""
        for laid in self._laid.values():
            self._h.link.orphan(laid.exchange)
        self._laid.clear()

    def close(self):
        """Free every Program's requests (the link is about to be freed)."""
        for laid in self._laid.values():
            laid.exchange.free()
        self._laid.clear()


def _own_block(x, h):
    """reduce_scatter's output without `out`: x's block of this rank (a view
    where x is contiguous; else a copy, which the Program declines with x)."""
    block = x.size // h.topology.size
    return x.reshape(-1)[h.rank * block:(h.rank + 1) * block]


def lay_out(h, call):
    """The Program of `call`'s shape on rank h.rank (see the module's doc)."""
    nodes, k_me = h.topology.nodes, h.node_index
    counterparts = [node[h.local] for node in nodes]
    others = [peer for k, peer in enumerate(counterparts) if k != k_me]
    shape = _LAYOUTS[call.collective](h, call, counterparts, others)
    exchange = shape.exchange
    program = _across.Program(
        node_step=shape.node_step, node_args=shape.node_args, x_at=shape.x_at, out_at=shape.out_at,
        deadline_at=shape.deadline_at, before=shape.before, send_headers=exchange.send_header_addresses(),
        receive_headers=exchange.receive_header_addresses(), requests=exchange.request_addresses(), fold=shape.fold,
        after=shape.after, x_bytes=shape.x_bytes, out_bytes=shape.out_bytes,
        description_hash=description_hash(f"{call.description}, small path"), spin=h.poll_spin)
    return Laid(program, exchange, exchange.sources, exchange.targets, call.description, _in_node_op(call.op))


class Shape(NamedTuple):
    """What lay_out hands the Program, worked out per collective below."""
    exchange: object
    x_bytes: int
    out_bytes: int
    node_step: object = None
    node_args: tuple = ()
    x_at: int = -1
    out_at: int = -1
    deadline_at: int = -1
    before: list = []
    fold: object = None
    after: list = []


def _address(array):
    return array.ctypes.data


def _reducing(h, call, counterparts, others):
    """allreduce, reduce_scatter and reduce: the node's partial P (the loop's
    allreduce, or reduce to the root's local index), sent to the
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
    exchange = h.link.repeated_exchange([(peer, block) for peer in senders], [(peer, block) for peer in receivers])
    # P: the first message itself where it is the whole partial, else memory of its own
    if senders and call.collective != REDUCE_SCATTER:
        part = exchange.send_payloads[0].view(call.dtype)
    else:
        part = exchange.keep(np.empty(call.count, call.dtype))
    before = []
    if h.shm is None:
        before.append(((X, 0), (ADDRESS, _address(part)), x_bytes))
        step = {}
    else:
        channel = h.shm.fast_allreduce.channel
        code = fastpath.OP_CODES[_in_node_op(call.op)]
        if call.collective == REDUCE_TO_ROOT:
            step = dict(node_step=channel.collective, x_at=1, deadline_at=5, node_args=(
                fastpath.KINDS["reduce"], None, part, code, h.topology.local_of(call.root), None))
        else:
            step = dict(node_step=channel.allreduce, x_at=0, deadline_at=3,
                        node_args=(None, part, code, None, SMALL_MAX + 1))
    for peer, payload in zip(senders, exchange.send_payloads):
        piece = _address(part) + (peer * block if call.collective == REDUCE_SCATTER else 0)
        if _address(payload) != piece:
            before.append(((ADDRESS, piece), (ADDRESS, _address(payload)), block))
    fold = None
    if receivers:
        received = iter(exchange.receive_payloads)
        mine = _address(part) + (me * block if call.collective == REDUCE_SCATTER else 0)
        sources = [(ADDRESS, mine if k == k_me else _address(next(received))) for k in range(len(h.topology.nodes))]
        fold = (sources, (OUT, 0), block, itemsize, _across.element_type(part), fastpath.OP_CODES[call.op],
                size if call.op is ReduceOp.AVG else 0)
    return Shape(exchange, x_bytes, block, before=before, fold=fold, **step)


def _allgather(h, call, counterparts, others):
    """The node's blocks gathered by the loop into the message to every
    counterpart; then every node's blocks copied into out, rank by rank."""
    X, OUT, ADDRESS = _across.X, _across.OUT, _across.ADDRESS
    nodes, k_me, row = h.topology.nodes, h.node_index, call.count * call.dtype.itemsize
    node_bytes = len(h.node_ranks) * row
    exchange = h.link.repeated_exchange([(peer, node_bytes) for peer in others],
                                        [(counterparts[k], node_bytes) for k in range(len(nodes)) if k != k_me])
    mine = exchange.send_payloads[0]
    if h.shm is None:
        before, step = [((X, 0), (ADDRESS, _address(mine)), row)], {}
    else:
        before = []
        step = dict(node_step=h.shm.fast_allreduce.channel.collective, x_at=1, deadline_at=5, node_args=(
            fastpath.KINDS["allgather"], None, mine.view(call.dtype), 0, 0, None))
    before += [((ADDRESS, _address(mine)), (ADDRESS, _address(payload)), node_bytes)
               for payload in exchange.send_payloads[1:]]
    received = iter(exchange.receive_payloads)
    blocks = [_address(mine) if k == k_me else _address(next(received)) for k in range(len(nodes))]
    after = [((ADDRESS, blocks[k] + local * row), (OUT, rank * row), row)
             for k, node in enumerate(nodes) for local, rank in enumerate(node)]
    return Shape(exchange, row, h.topology.size * row, before=before, after=after, **step)


def _broadcast(h, call, counterparts, others):
    """The root's node broadcasts (the loop), each of its ranks sends out to
    its counterparts; a rank elsewhere copies what it receives into out."""
    X, OUT, ADDRESS = _across.X, _across.OUT, _across.ADDRESS
    nbytes = call.count * call.dtype.itemsize
    root_node = h.topology.node_of(call.root)
    if h.node_index != root_node:   # (out of place, x is left as it was)
        exchange = h.link.repeated_exchange([], [(counterparts[root_node], nbytes)])
        return Shape(exchange, nbytes, nbytes, after=[((ADDRESS, _address(exchange.receive_payloads[0])), (OUT, 0),
                                                       nbytes)])
    exchange = h.link.repeated_exchange([(peer, nbytes) for peer in others], [])
    if h.shm is None:
        before, step = [((X, 0), (OUT, 0), nbytes)], {}
    else:
        before = []
        step = dict(node_step=h.shm.fast_allreduce.channel.collective, x_at=1, out_at=2, deadline_at=5, node_args=(
            fastpath.KINDS["broadcast"], None, None, 0, h.topology.local_of(call.root), None))
    before += [((OUT, 0), (ADDRESS, _address(payload)), nbytes) for payload in exchange.send_payloads]
    return Shape(exchange, nbytes, nbytes, before=before, **step)


_LAYOUTS = {ALLREDUCE: _reducing, REDUCE_SCATTER: _reducing, REDUCE_TO_ROOT: _reducing, ALLGATHER: _allgather,
            BROADCAST: _broadcast}


def _bound(link):
    """Bind _across to the MPI library mpi4py loaded (once per process):
    False where its functions cannot be found (a static build, say)."""
    global _BOUND
    if _BOUND is None:
        MPI = link.mpi
        try:
            library = ctypes.CDLL(MPI.__file__, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            _across.bind_mpi(ctypes.cast(library.MPI_Start, ctypes.c_void_p).value,
                             ctypes.cast(library.MPI_Test, ctypes.c_void_p).value, MPI._sizeof(MPI.Status))   # noqa: SLF001
            _BOUND = True
        except (OSError, AttributeError, ValueError):
            _BOUND = False
    return _BOUND


_BOUND = None
