"""Plans: a schedule made concrete for one element type and count.

A plan is a list of phases, each one flat integer op table that any executor
interprets (NumPy on the host, our step kernel on GPUs and emulated devices):

    phase 0         copy each rank's INPUT into its WORK buffer
    phases 1..S     the schedule's steps
    phase S+1       copy each rank's result into its OUTPUT

Op table row (int64), one per transfer, executed by the rank in column RANK:

    RANK KIND COUNT DST_BUF DST_OFF NSRC (SRC_RANK SRC_BUF SRC_OFF) * max_sources

Offsets and counts are in elements. Unused source slots hold -1. KIND is COPY
(dst = src), REDUCE (dst = fold of srcs) or REDUCE_FINAL (a REDUCE that
completes the reduction of its elements, where avg divides by the rank count).
The rows of one phase are independent: no row reads what another row of the
same phase writes, so they may run in any order or all at once.

INPUT and OUTPUT are the caller's arrays. How the plan uses them is its
`binding` (see binding.py): with WORKSPACE, as above, only their own rank
touches them; when ranks can address each other's arrays (ranks in one
process), the plan reads inputs and writes outputs in place of WORK, and the
copies in and out disappear.

For ranks in different processes, `waits[phase][rank]` lists (peer, t): the
phase may start once `peer` has completed t phases of this collective.
They are derived from the tables, never written by hand: a read of a peer's
region waits for the peer's last write of it (read after write), and a write
of one's own region waits for every peer that read it earlier (write after
read). Phase 0 waits for every peer to have left the previous collective,
since the next collective reuses the same WORK buffers.
"""

import functools
from typing import NamedTuple, Optional, Tuple

import numpy as np

from . import binding as bindings
from .algorithms import schedule_for
from .algorithms.schedule import (
    ALL_TO_ALL, ALL_TO_ALL_V, ALLGATHER, ALLREDUCE, BLOCKED_COLLECTIVES, BROADCAST, GATHER, REDUCE, REDUCE_SCATTER,
    ROOTED_COLLECTIVES, SCATTER, SCRATCH, WORK,
)
from .binding import COPY_OP, INPUT, OUTPUT, REDUCE_FINAL_OP, REDUCE_OP, WORKSPACE  # noqa: F401 (re-exported)
from .compression import wire
from .ops import as_dtype

BUFFER_COUNT = 4  # WORK, SCRATCH, INPUT, OUTPUT: the buffer ids a row may name

RANK, KIND, COUNT, DST_BUF, DST_OFF, NSRC = range(6)
SRC0 = 6  # source i is at columns SRC0 + 3*i (rank), +1 (buffer), +2 (offset)
SRC_RANK, SRC_BUF, SRC_OFF = 0, 1, 2

# Chunk boundaries fall on 16-byte multiples so kernels can use vector loads.
ALIGN_BYTES = 16
# SCRATCH starts on a page boundary of a rank's workspace.
SCRATCH_ALIGN_BYTES = 4096


class Phase(NamedTuple):
    table: np.ndarray                # all rows, shape (rows, SRC0 + 3*max_sources)
    rows_by_rank: Tuple[np.ndarray, ...]
    waits: Tuple[Tuple[Tuple[int, int], ...], ...]  # per rank: ((peer, phases done), ...)
    # Compressed plans only: per rank, its rows lowered to codec operations
    # (compression/wire.py), which executors run instead of the table.
    wire_ops_by_rank: Optional[Tuple[tuple, ...]] = None


class Traffic(NamedTuple):
    """Bytes of memory a plan reads plus writes, over all ranks."""
    total: int
    workspace_copies: int   # copy rows between a caller's array and a workspace


class Plan(NamedTuple):
    collective: str
    algorithm: str
    nranks: int
    count: int          # elements in each rank's WORK buffer
    dtype: np.dtype
    op: str
    root: int
    binding: str
    chunk_bounds: Tuple[Tuple[int, int], ...]
    scratch_elements: int
    scratch_offset: int     # bytes from the start of a rank's workspace to SCRATCH
    workspace_bytes: int    # WORK, padding and SCRATCH; 0 when the plan uses neither
    phases: Tuple[Phase, ...]
    traffic: Traffic
    # Per phase: (regions written, (reading rank, peer region) pairs), for
    # executors that derive their own ordering (executors/device.py).
    access: Tuple[Tuple[frozenset, frozenset], ...]
    # The codec on the wire ("bf16", "fp16", "int8") or None; with one, each
    # rank's workspace also holds the wire copies of WORK and SCRATCH, and a
    # float32 accumulator (compression/wire.py, WireLayout).
    compression: Optional[str] = None
    wire: Optional[object] = None           # compression.wire.WireLayout
    wire_bytes: int = 0     # bytes ranks read from peers' memory in one call, all ranks together
    # IN_PLACE_LOCKSTEP only: the phases whose moves overwrite what other
    # moves of their group read, which an executor must run as fan-out
    # groups in lockstep (binding.py).
    lockstep_phases: frozenset = frozenset()
    # all_to_all_v only: block_counts[q][r], the elements rank q sends rank
    # r (see BlockLayout); chunk_bounds is then empty, since a chunk's
    # bounds differ from rank to rank.
    block_counts: Optional[Tuple[Tuple[int, ...], ...]] = None
    # single_copy_plan's plans: ranks in separate processes read peers'
    # INPUT in place (the compiled executor, _host_plan.c).
    single_copy: bool = False
    # segmented_plan's plans: the elements of WORK one segment takes (every
    # run of the segment plan but a shorter last one); WORK holds no more. 0: one run.
    segment: int = 0
    # pushed_plan's plans: a rank's table also holds rows whose destination
    # is a peer's OUTPUT, which it writes into the peer's process.
    pushes: bool = False
    # spread_plan's: the rank (the root) whose pushes the executor skips
    # where, at the call, its output is its input (its x holds what they
    # would write: peers cannot tell from their own placement); -1: none.
    no_push_in_place: int = -1


class BlockLayout:
    """Where all_to_all_v's blocks lie. all_to_all's schedules name chunk
    c of WORK as the block a rank sends rank c and chunk c of SCRATCH as
    the block it receives from rank c, and only copy WORK chunk r of rank
    q to SCRATCH chunk q of rank r; so the same schedules, proved by the
    trace, move blocks of any sizes once a chunk's bounds depend on its
    rank and side: on the sending side (INPUT, WORK) rank q's chunk c is
    block_counts[q][c] elements after its blocks 0..c-1; on the receiving
    side (SCRATCH, OUTPUT) rank r's chunk c is block_counts[c][r] elements
    after its blocks from ranks 0..c-1. A copy's source and destination
    are then the same length by construction."""

    def __init__(self, block_counts):
        self.counts = block_counts
        n = len(block_counts)
        self.sent = tuple(_starts(block_counts[q]) for q in range(n))
        self.received = tuple(_starts([block_counts[q][r] for q in range(n)]) for r in range(n))

    def start(self, loc):
        if loc.buffer in (INPUT, WORK):
            return self.sent[loc.rank][loc.chunk]
        return self.received[loc.rank][loc.chunk]

    def length(self, loc):
        if loc.buffer in (INPUT, WORK):
            return self.counts[loc.rank][loc.chunk]
        return self.counts[loc.chunk][loc.rank]

    @property
    def work_elements(self):
        """The most elements a rank sends: every rank's WORK holds that many."""
        return max(self.sent[q][-1] for q in range(len(self.counts)))

    @property
    def scratch_elements(self):
        """The most elements a rank receives: every rank's SCRATCH holds that many."""
        return max(self.received[r][-1] for r in range(len(self.counts)))


def _starts(counts):
    """Each block's first element, and the total last."""
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + count)
    return tuple(starts)


def chunk_bounds(collective, nranks, nchunks, count, itemsize, align_elements=1):
    """[start, stop) of each chunk, in elements; chunks start on multiples
    of 16 bytes and of `align_elements` (a codec's block)."""
    if collective in BLOCKED_COLLECTIVES:
        block = count // nranks  # one chunk per rank's block, by definition
        return tuple((c * block, (c + 1) * block) for c in range(nchunks))
    align = max(1, ALIGN_BYTES // itemsize, align_elements)
    size = -(-count // nchunks)
    size = -(-size // align) * align
    return tuple((min(c * size, count), min((c + 1) * size, count)) for c in range(nchunks))


@functools.lru_cache(maxsize=256)
def build_plan(collective, algorithm, nranks, count, dtype, op, root=0, binding=WORKSPACE, compression=None,
               streamlined=True, block_counts=None):
    """The plan for one call shape; cached, so a repeated call plans nothing.

    `count` is the number of elements in each rank's WORK buffer: the message
    for allreduce, broadcast and reduce; size * per-rank count for
    reduce_scatter, allgather, gather, scatter and all_to_all. `binding` says how the caller's arrays may
    be used (binding.py). `compression` names a codec for what peers read
    (compression/wire.py): then chunks start on codec blocks, and peers read
    only workspaces, where the wire copies are; `streamlined` lets each
    rank skip float32 passes (compression/streamline.py), which is valid
    when its input and output are one array or disjoint ones.

    all_to_all_v takes `block_counts` (a tuple of nranks tuples of nranks
    ints: block_counts[q][r] elements go from rank q to rank r; see
    BlockLayout) and ignores `count`, uncompressed only.
    """
    dtype = as_dtype(dtype)
    if compression is not None:
        wire.check_compression(compression, dtype, op, collective)
        return _build_plan(collective, algorithm, nranks, count, dtype, op, root, WORKSPACE, compression, streamlined)
    # Without compression a plan depends on the element's size only: one
    # build serves every dtype and op of that size (its tables, waits and
    # traffic are read-only), which a first call of a new dtype or op finds.
    shape = _uncompressed_plan(collective, algorithm, nranks, count, dtype.itemsize, root, binding, block_counts)
    return shape._replace(dtype=dtype, op=op)


@functools.lru_cache(maxsize=256)
def _uncompressed_plan(collective, algorithm, nranks, count, itemsize, root, binding, block_counts=None):
    """The uncompressed plan for elements of `itemsize` bytes (its dtype and op stand-ins, replaced by the caller's)."""
    return _build_plan(collective, algorithm, nranks, count, np.dtype(f"V{itemsize}"), None, root, binding, None, False,
                       block_counts)


def clear_cache():
    """Forget every plan built (for tests that change how plans are made)."""
    build_plan.cache_clear()
    _uncompressed_plan.cache_clear()
    _bound_phases.cache_clear()
    segmented_plan.cache_clear()


def _build_plan(collective, algorithm, nranks, count, dtype, op, root, binding, compression, streamlined,
                block_counts=None):
    """build_plan's work, uncached."""
    blocks = None
    if collective == ALL_TO_ALL_V:
        if block_counts is None or compression is not None or len(block_counts) != nranks:
            raise ValueError("all_to_all_v plans take block_counts, one row of nranks counts per rank, uncompressed")
        if binding not in (WORKSPACE, bindings.OUT_OF_PLACE, bindings.PEERS_READ_INPUT):
            # the in-place bindings take an output chunk to be the input
            # chunk of the same number, which blocks of other sizes are not
            raise ValueError(f"all_to_all_v plans bind {WORKSPACE}, {bindings.OUT_OF_PLACE} or "
                             f"{bindings.PEERS_READ_INPUT}, not {binding}")
        blocks = BlockLayout(block_counts)
        count = blocks.work_elements
    schedule = schedule_for(algorithm, ALL_TO_ALL if blocks else collective, nranks,
                            root if collective in ROOTED_COLLECTIVES else None)
    bounds = () if blocks else chunk_bounds(collective, nranks, schedule.nchunks, count, dtype.itemsize,
                                            wire.BLOCK if compression is not None else 1)
    moves, phase_access, waits = _bound_phases(schedule, binding, compression is None)
    encoded = wire.encoded_writes(moves) if compression is not None else None

    def element_offset(loc):
        if blocks:
            return blocks.start(loc)
        start = bounds[loc.chunk][0]
        # The caller's allgather and gather input and reduce_scatter and
        # scatter output hold only the rank's own block: chunk `rank` of the
        # full buffer.
        if (loc.buffer == INPUT and collective in (ALLGATHER, GATHER)) \
                or (loc.buffer == OUTPUT and collective in (REDUCE_SCATTER, SCATTER)):
            start -= bounds[loc.rank][0]
        return start

    def length(loc):
        if blocks:
            return blocks.length(loc)
        return bounds[loc.chunk][1] - bounds[loc.chunk][0]

    phase_rows = [
        _merge_rows([
            (m.rank, m.kind, length(m.dst), m.dst.buffer, element_offset(m.dst),
             [(s.rank, s.buffer, element_offset(s)) for s in m.srcs], bool(encoded and (p, i) in encoded))
            for i, m in enumerate(phase) if length(m.dst)
        ])
        for p, phase in enumerate(moves)
    ]
    max_sources = max([len(row[5]) for rows in phase_rows for row in rows] + [1])
    phases = tuple(_make_phase(rows, nranks, max_sources, w) for rows, w in zip(phase_rows, waits))
    if compression is not None:
        phases = tuple(phase._replace(wire_ops_by_rank=ops)
                       for phase, ops in zip(phases, wire.lower_plan(phase_rows, nranks, op, streamlined)))

    used = {loc.buffer for phase in moves for m in phase for loc in (m.dst, *m.srcs)}
    work_bytes = count * dtype.itemsize if WORK in used else 0
    scratch_elements = (blocks.scratch_elements if blocks else count) if SCRATCH in used else 0
    scratch_offset = -(-work_bytes // SCRATCH_ALIGN_BYTES) * SCRATCH_ALIGN_BYTES
    workspace_bytes = scratch_offset + scratch_elements * dtype.itemsize if used & {WORK, SCRATCH} else 0
    layout = wire.WireLayout.after(workspace_bytes, count, scratch_elements, compression) if compression else None
    return Plan(
        collective=collective, algorithm=algorithm, nranks=nranks, count=count, dtype=dtype,
        op=op, root=root, binding=binding, chunk_bounds=bounds, scratch_elements=scratch_elements,
        scratch_offset=scratch_offset,
        workspace_bytes=layout.workspace_bytes if layout else workspace_bytes,
        phases=phases, traffic=_traffic(phases, dtype.itemsize),
        access=tuple((frozenset(w), frozenset(r)) for w, r in phase_access),
        compression=compression, wire=layout,
        wire_bytes=_wire_bytes(phases, dtype.itemsize, compression),
        lockstep_phases=bindings.lockstep_phases(moves, schedule) if binding == bindings.IN_PLACE_LOCKSTEP
        else frozenset(),
        block_counts=block_counts if blocks else None,
    )


@functools.lru_cache(maxsize=256)
def _bound_phases(schedule, binding, rewrite_workspace_plans):
    """A schedule's moves for `binding` (binding.bind, proved by its symbolic
    run), each phase's (regions written, peer regions read), and the waits
    derived from them: what a plan's sizes do not change, so made once for
    every count (all_to_all_v meets a new matrix of counts at most calls).
    Read-only. (The waits cover moves of no elements too, which make no rows.)"""
    moves = bindings.bind(bindings.logical_phases(schedule), schedule, binding,
                          rewrite_workspace_plans=rewrite_workspace_plans)
    moves = tuple(tuple(phase) for phase in moves)
    memory = bindings.storage(schedule, binding)
    phase_access = [
        ({memory(m.dst) for m in phase}, {(m.rank, memory(s)) for m in phase for s in m.srcs if s.rank != m.rank})
        for phase in moves
    ]
    return moves, phase_access, derive_waits(schedule.nranks, phase_access)


def _merge_rows(rows):
    """Join each row with the next when both continue each other in every
    buffer they name (copies of adjacent chunks become one row)."""
    merged = []
    for row in rows:
        if merged:
            rank, kind, count, dst_buf, dst_off, srcs, encode = merged[-1]
            if (row[0], row[1], row[3], len(row[5]), row[6]) == (rank, kind, dst_buf, len(srcs), encode) \
                    and row[4] == dst_off + count \
                    and all(s[:2] == t[:2] and s[2] == t[2] + count for s, t in zip(row[5], srcs)):
                merged[-1] = (rank, kind, count + row[2], dst_buf, dst_off, srcs, encode)
                continue
        merged.append(row)
    return merged


def _make_phase(rows, nranks, max_sources, waits):
    table = np.full((len(rows), SRC0 + 3 * max_sources), -1, dtype=np.int64)
    for i, (rank, kind, count, dst_buf, dst_off, srcs, _) in enumerate(rows):
        table[i, :SRC0] = (rank, kind, count, dst_buf, dst_off, len(srcs))
        for j, src in enumerate(srcs):
            table[i, SRC0 + 3 * j: SRC0 + 3 * j + 3] = src
    table.setflags(write=False)
    by_rank = tuple(table[table[:, RANK] == rank] for rank in range(nranks))
    return Phase(table, by_rank, waits)


def _traffic(phases, itemsize):
    user = (INPUT, OUTPUT)
    total = copies = 0
    for phase in phases:
        for row in phase.table:
            nbytes = int(row[COUNT]) * itemsize
            total += nbytes * (int(row[NSRC]) + 1)
            if row[KIND] == COPY_OP and (row[DST_BUF] in user) != (row[SRC0 + SRC_BUF] in user):
                copies += 2 * nbytes
    return Traffic(total, copies)


def _wire_bytes(phases, itemsize, compression):
    """Bytes read from peers' memory (what crosses the wire) by all ranks in one call."""
    if compression is not None:
        size = functools.partial(wire.encoded_nbytes, compression)
    else:
        def size(count): return count * itemsize
    total = 0
    for phase in phases:
        for row in phase.table:
            total += sum(size(int(row[COUNT])) for i in range(int(row[NSRC]))
                         if row[SRC0 + 3 * i + SRC_RANK] != row[RANK])
    return total


# The collectives single_copy_plan serves: those that only move blocks,
# and the folds whose plans read each peer's input once, in phase 1, into
# the reader's own memory; those of the folds with a single copy in
# place, and those of them whose in-place form writes x in phase 1
# (reduce_scatter's: the rank's own block, which no peer reads), which
# may not fall back to the staged plan, so runs only where the ranks know
# that no read is refused (ShmRank._learn_reach). Reduce has no in-place
# read form (single_copy_plan says why): in place it runs only pushed
# (pushed_plan, PUSHED_ONLY_IN_PLACE), where the ranks know pushes work.
SINGLE_COPY_COLLECTIVES = (GATHER, SCATTER, ALL_TO_ALL, ALL_TO_ALL_V, ALLGATHER, BROADCAST)
SINGLE_COPY_FOLDS = (REDUCE_SCATTER, REDUCE, ALLREDUCE)
SINGLE_COPY_FOLDS_IN_PLACE = (ALLREDUCE, REDUCE_SCATTER, REDUCE)
FOLDS_INTO_X_IN_PLACE = (REDUCE_SCATTER,)
PUSHED_ONLY_IN_PLACE = (REDUCE,)
# The algorithms single_copy_plan makes plans of, by collective: the first
# is the one `auto` names where the single copy takes a call.
SINGLE_COPY_ALGORITHMS = {**{c: ("direct",) for c in SINGLE_COPY_COLLECTIVES + (REDUCE_SCATTER, REDUCE)},
                          REDUCE: ("two_shot", "direct"), ALLREDUCE: ("two_shot",)}


@functools.lru_cache(maxsize=256)
def single_copy_plan(collective, nranks, count, dtype, op, root=0, in_place=False, block_counts=None,
                     algorithm="direct"):
    """The plan of `algorithm` (SINGLE_COPY_ALGORITHMS) for a collective
    that only moves blocks (SINGLE_COPY_COLLECTIVES: the exchanges,
    allgather, broadcast) or folds each peer's input once
    (SINGLE_COPY_FOLDS: reduce_scatter, reduce, allreduce) for ranks in
    separate processes that read each other's arrays in place: each rank
    reads its blocks straight out of its peers' INPUT into its OUTPUT, or
    folds them there with its own, one copy where the WORKSPACE plan makes
    two (two_shot: each rank folds its chunk into its SCRATCH, in its
    workspace, and the root, or for allreduce every rank, copies the chunks
    out of there). Its moves are the PEERS_READ_INPUT or IN_PLACE binding
    of the algorithm's schedule, proved by binding.py's symbolic run, in
    three phases or more:

        0  nothing to copy: the executor publishes the rank's input address
        1  the reads of peers' INPUT (and a rank's own blocks)
        2  local copies (in place: SCRATCH over the input), and copies out
           of peers' workspaces; empty phases after it

    and waits of their own, beside those derived from the moves: phase 1
    reads a peer's INPUT once the peer completed phase 0 (its address is
    this call's), and phase 2 starts once every peer completed phase 1, so
    that no reader is left in a rank's input when it overwrites it or
    returns (docs/host-ranks.md, "The exchanges: one copy"). Every rank
    runs three phases whichever binding its own arrays take (the ranks of
    one call may differ), and every binding's phase 1 reads the same
    INPUT regions, which no binding's phase 1 writes (checked here).
    In place a fold's phase 1 writes into x what the staged call that runs
    instead of a refused one would read again: allreduce's phase 1 writes
    only the workspace, so in place it runs its out-of-place plan (phase 2
    writes x once no peer reads it); reduce_scatter's IN_PLACE plan writes
    the rank's own block of x, which no peer reads, so it runs only where no
    read can be refused (FOLDS_INTO_X_IN_PLACE); reduce has none (its
    root's x is what every rank reads).
    ValueError where the binding does not give that form."""
    if algorithm not in SINGLE_COPY_ALGORITHMS.get(collective, ()):
        raise ValueError(f"single_copy_plan serves {SINGLE_COPY_ALGORITHMS}, not {collective!r} by {algorithm!r}")
    dtype = np.dtype(dtype)
    apart = bindings.PEERS_READ_INPUT
    in_place_binding = apart if collective == ALLREDUCE else bindings.IN_PLACE
    bindings_tried = (apart,) if collective in (ALL_TO_ALL_V, REDUCE, ALLREDUCE) else (apart, in_place_binding)
    plans = {b: build_plan(collective, algorithm, nranks, count, dtype, op, root, b, block_counts=block_counts)
             for b in bindings_tried}
    binding = in_place_binding if in_place else apart
    if binding not in plans:
        raise ValueError(f"single_copy_plan: {collective} has no in-place single copy")
    peer_reads = set()
    for b, plan in plans.items():
        if len(plan.phases) < 3 or len(plan.phases[0].table) or any(len(phase.table) for phase in plan.phases[3:]):
            raise ValueError(f"single_copy_plan: {collective}'s {b} plan is not of three phases, the first empty")
        for p, phase in enumerate(plan.phases):
            for row in phase.table:
                for s in range(int(row[NSRC])):
                    src_rank, src_buf, src_off = (int(v) for v in row[SRC0 + 3 * s: SRC0 + 3 * s + 3])
                    if src_rank == row[RANK] or (p == 2 and src_buf in (WORK, SCRATCH)):
                        continue   # (a peer's workspace is shared memory: the waits the moves derive order it)
                    if p != 1 or src_buf != INPUT or (row[KIND] != COPY_OP and collective not in SINGLE_COPY_FOLDS):
                        raise ValueError(f"single_copy_plan: {collective}'s {b} plan reads a peer's "
                                         f"{bindings.BUFFER_NAMES[src_buf]} in phase {p}")
                    peer_reads.add((src_rank, src_off, src_off + int(row[COUNT])))
    if in_place:   # a phase-1 write into a rank's input must miss what its peers read there
        block = count // nranks
        # (where a rank's INPUT lies in its OUTPUT, in blocks of its rank: in place, x is the rank's block of
        # a gather's or allgather's out, a scatter's or reduce_scatter's out the rank's block of x, and the
        # whole of the other two)
        shift = {ALL_TO_ALL: 0, GATHER: -1, ALLGATHER: -1, SCATTER: 1, REDUCE_SCATTER: 1, BROADCAST: 0,
                 ALLREDUCE: 0}[collective]
        for row in plans[binding].phases[1].table:
            if row[DST_BUF] not in (INPUT, OUTPUT):
                continue
            rank, start = int(row[RANK]), int(row[DST_OFF])
            if row[DST_BUF] == OUTPUT:
                start += shift * rank * block
            stop = start + int(row[COUNT])
            if any(q == rank and a < stop and start < b for q, a, b in peer_reads):
                raise ValueError(f"single_copy_plan: {collective} in place overwrites in phase 1 what a peer reads")
    plan = plans[binding]
    reads = [set() for _ in range(nranks)]
    for row in plan.phases[1].table:
        reads[int(row[RANK])].update(int(row[SRC0 + 3 * s]) for s in range(int(row[NSRC])))
    phases = list(plan.phases)
    waits1 = tuple(_at_least(phases[1].waits[r], {q: 1 for q in reads[r] if q != r}) for r in range(nranks))
    waits2 = tuple(_at_least(phases[2].waits[r], {q: 2 for q in range(nranks) if q != r}) for r in range(nranks))
    phases[1] = phases[1]._replace(waits=waits1)
    phases[2] = phases[2]._replace(waits=waits2)
    return plan._replace(phases=tuple(phases), single_copy=True)


# The folds whose single copy can push (pushed_plan), those of them whose
# every rank pushes into every peer (which run pushed in place once the
# ranks know pushes work), and the bytes of a reduced chunk each rank
# folds and pushes at a time: the compiled loop's chunk, a slice that stays
# in cache between its fold and its writes.
PUSHED_FOLDS = (ALLREDUCE, REDUCE)
PUSHED_IN_PLACE = (ALLREDUCE,)
PUSH_SLICE_BYTES = 256 << 10


@functools.lru_cache(maxsize=256)
def pushed_plan(collective, nranks, count, dtype, op, root=0, in_place=False, algorithm="two_shot"):
    """The single copy of a fold whose reduced chunks go to other ranks'
    outputs (PUSHED_FOLDS by two_shot: allreduce's to every rank, reduce's
    to the root), with the reducer writing them into those outputs instead
    of each receiver copying them out of the reducer's workspace
    (single_copy_plan's PEERS_READ_INPUT form):

        1  rank r folds chunk r of every input (a peer's read in place)
           into its own memory (its output, or a reduce's non-root its
           SCRATCH), a slice at a time, and writes each slice, still in
           cache, into chunk r of every receiver's output
        2  nothing: every rank waits until every peer has completed
           phase 1 (its reads of this rank's input and its writes into
           this rank's output are done) before it returns

    Derived from the algorithm's OUT_OF_PLACE (in place: IN_PLACE) binding,
    proved by binding.py's symbolic run, whose phase 2 copies chunk r out
    of rank r's memory into the receivers' outputs: each such copy moves to
    the end of its source rank's phase 1, which holds because (checked here)
    its source was written in phase 1 by its own rank and by nothing after,
    and its destination is touched in phase 1 by no rank but the pusher,
    which reads it (in place) before it writes it. Phase 1 waits for every
    peer's phase 0 (its addresses are this call's). Out of place, a refused
    read or write may yet fall back to the staged plan (only outputs were
    written); in place this form writes inputs in phase 1, so it runs only
    once the ranks know pushes work (PUSHED_IN_PLACE, shm.py).
    ValueError where the binding does not give that form."""
    if collective not in PUSHED_FOLDS or algorithm != "two_shot":
        raise ValueError(f"pushed_plan serves {PUSHED_FOLDS} by two_shot, not {collective!r} by {algorithm!r}")
    dtype = np.dtype(dtype)
    binding = bindings.IN_PLACE if in_place else bindings.OUT_OF_PLACE
    plan = build_plan(collective, algorithm, nranks, count, dtype, op, root, binding)
    phases = plan.phases
    if len(phases) < 3 or len(phases[0].table) or any(len(phase.table) for phase in phases[3:]):
        raise ValueError(f"pushed_plan: {collective}'s plan is not of three phases, the first empty")
    folds, copies = phases[1].table, phases[2].table
    own_memory = (OUTPUT, SCRATCH)
    for row in folds:
        if row[DST_BUF] not in own_memory or row[KIND] == COPY_OP or \
                any(row[SRC0 + 3 * s + 1] != INPUT for s in range(int(row[NSRC]))):
            raise ValueError(f"pushed_plan: {collective}'s phase 1 has a row other than a fold into its own memory")

    def span(rank, buffer, offset, elements):   # (in place, a rank's INPUT is its OUTPUT)
        buffer = OUTPUT if in_place and buffer == INPUT else int(buffer)
        return int(rank), buffer, int(offset), int(offset) + int(elements)

    def overlaps(a, b):
        return a[:2] == b[:2] and a[2] < b[3] and b[2] < a[3]

    folded = [span(row[RANK], row[DST_BUF], row[DST_OFF], row[COUNT]) for row in folds]
    written = [span(r[RANK], r[DST_BUF], r[DST_OFF], r[COUNT]) for r in copies]
    touched = [(int(r[RANK]), region) for r, region in zip(folds, folded)] + \
              [(int(r[RANK]), span(r[SRC0 + 3 * s], INPUT, r[SRC0 + 3 * s + 2], r[COUNT]))
               for r in folds for s in range(int(r[NSRC]))]   # (phase 1's writes and reads, by their rank)
    pushes = [[] for _ in range(nranks)]   # per pushing rank: (destination rank, source buffer, start, stop)
    for row in copies:
        owner, buffer, start = (int(v) for v in row[SRC0:SRC0 + 3])
        source = span(owner, buffer, start, row[COUNT])
        target = span(row[RANK], row[DST_BUF], row[DST_OFF], row[COUNT])
        if row[KIND] != COPY_OP or row[NSRC] != 1 or buffer not in own_memory or row[DST_BUF] != OUTPUT \
                or owner == row[RANK] or int(row[DST_OFF]) != start:
            raise ValueError(f"pushed_plan: {collective}'s phase 2 has a row other than a copy out of a peer's "
                             "memory into an output")
        if not any(f[:2] == source[:2] and f[2] <= source[2] and source[3] <= f[3] for f in folded) or \
                any(overlaps(source, w) for w in written):
            raise ValueError(f"pushed_plan: {collective} copies a chunk its owner did not fold in phase 1, or "
                             "that phase 2 writes")
        if any(rank != owner and overlaps(target, region) for rank, region in touched):
            raise ValueError(f"pushed_plan: {collective}'s phase 1 touches on another rank what a push writes")
        pushes[owner].append((target[0], buffer, target[2], target[3]))
    slice_elements = max(1, PUSH_SLICE_BYTES // dtype.itemsize)
    rows_by_rank = []
    for rank in range(nranks):
        rows = []
        for row in folds[folds[:, RANK] == rank]:
            for at in range(int(row[DST_OFF]), int(row[DST_OFF] + row[COUNT]), slice_elements):
                stop = min(at + slice_elements, int(row[DST_OFF] + row[COUNT]))
                shift = at - int(row[DST_OFF])
                piece = row.copy()
                piece[COUNT] = stop - at
                piece[DST_OFF] = at
                for s in range(int(row[NSRC])):
                    piece[SRC0 + 3 * s + 2] += shift
                rows.append(piece)
                rows += [_copy_row(folds.shape[1], target_rank, max(start, at), min(end, stop), (rank, buffer))
                         for target_rank, buffer, start, end in pushes[rank]
                         if max(start, at) < min(end, stop) and buffer == row[DST_BUF]]
        rows_by_rank.append(rows)
    phase1 = _phase_of_pushes(rows_by_rank, folds.shape[1], phases[1].waits)
    empty = phases[2].table[:0]
    phase2 = Phase(empty, tuple(empty for _ in range(nranks)),
                   tuple(_at_least(waits, {q: 2 for q in range(nranks) if q != r})
                         for r, waits in enumerate(phases[2].waits)))
    # (the phases after 2, empty, would only publish a counter no peer waits for: one more store, each call,
    # into the line every peer polls)
    tail = phases[3:] if any(any(waits) for phase in phases[3:] for waits in phase.waits) else ()
    return plan._replace(phases=(phases[0], phase1, phase2, *tail), single_copy=True, pushes=True)


def _copy_row(width, rank, start, stop, source):
    """A copy row of `width` columns into rank `rank`'s OUTPUT elements
    [start, stop) from (source rank, source buffer) at `start`: a push
    where the rank whose table holds it is not `rank`."""
    row = np.full(width, -1, np.int64)
    row[:SRC0 + 3] = (rank, COPY_OP, stop - start, OUTPUT, start, 1, *source, start)
    return row


def _phase_of_pushes(rows_by_rank, width, waits):
    """Phase 1 of a plan whose ranks push (pushed_plan, spread_plan): each
    rank's rows as given (the rank that runs a row is the one whose list
    holds it), `waits` raised to every peer's phase 0 (every rank reads a
    peer's input or writes its output, at the addresses the peer publishes
    then)."""
    tables = []
    for rows in rows_by_rank:
        table = np.array(rows, np.int64).reshape(-1, width)
        table.setflags(write=False)
        tables.append(table)
    nranks = len(tables)
    return Phase(np.concatenate(tables), tuple(tables),
                 tuple(_at_least(waits[r], {q: 1 for q in range(nranks) if q != r}) for r in range(nranks)))


# The collectives whose single copy can spread (spread_plan): each rank
# reads one chunk of what every rank receives and pushes it into the others.
SPREAD_COLLECTIVES = (BROADCAST,)


@functools.lru_cache(maxsize=256)
def spread_plan(collective, nranks, count, dtype, root=0, in_place=False):
    """broadcast's single copy spread over the ranks (what the compiled
    loop's spread_from_root was): where direct's single copy has every
    rank read the whole of the root's x (single_copy_plan), rank c reads
    chunk c of it once into its own output (the root: copies it; in
    place, has it) and pushes it into every other rank's output, a slice
    of PUSH_SLICE_BYTES at a time, each slice still in cache:

        1  rank c: OUTPUT_c[c] = the root's INPUT[c], and OUTPUT_q[c] =
           that, pushed into every other rank q (the root in place: from
           its x); a push into the root is skipped where its output is
           its x (no_push_in_place)
        2  nothing: every rank waits until every peer completed phase 1

    Ranks may differ in placement, and each builds its plan from its own,
    so a peer cannot tell whether the root's x is its output: the executor
    looks at the call's addresses (a plan that took the root for in place
    left half of an out-of-place root's output unwritten; one whose root
    copied all of its x itself took 1.3-1.4 times as long at 16 and 64
    MiB out of place).

    Derived from direct's single-copy plan (a row per receiving rank q:
    OUTPUT_q = the root's INPUT, all of it), each row cut at the chunks'
    bounds (chunk_bounds) and piece c run by rank c: its own as it was,
    every other as a push of rank c's copy, which holds the same values
    once its own piece ran (the root in place: its input), the root's too
    where this rank's own placement has none. Checked here: direct's rows
    are of that form, so every receiving output element is written once,
    from the root's input. Phase 1 writes only outputs no staged rerun
    reads (in place, the root's x is only read: no push goes into it), so
    a refused read or push falls back to the staged plan in place too."""
    if collective not in SPREAD_COLLECTIVES:
        raise ValueError(f"spread_plan serves {SPREAD_COLLECTIVES}, not {collective!r}")
    dtype = np.dtype(dtype)
    base = single_copy_plan(collective, nranks, count, dtype, "sum", root, in_place)
    rows = base.phases[1].table
    receivers = [int(row[RANK]) for row in rows]
    for row in rows:
        if (row[KIND], row[COUNT], row[DST_BUF], row[DST_OFF], row[NSRC]) != (COPY_OP, count, OUTPUT, 0, 1) \
                or tuple(int(v) for v in row[SRC0:SRC0 + 3]) != (root, INPUT, 0):
            raise ValueError(f"spread_plan: {collective}'s single-copy row is not a copy of the root's input")
    if sorted(receivers) != [q for q in range(nranks) if not (in_place and q == root)]:
        raise ValueError(f"spread_plan: {collective}'s single copy does not give every receiving rank one row")
    slice_elements = max(1, PUSH_SLICE_BYTES // dtype.itemsize)
    width = rows.shape[1] if len(rows) else SRC0 + 3
    rows_by_rank = []
    for c, (lo, hi) in enumerate(chunk_bounds(collective, nranks, nranks, count, dtype.itemsize)):
        mine = []
        for at in range(lo, hi, slice_elements):
            stop = min(at + slice_elements, hi)
            if c in receivers:
                mine.append(_copy_row(width, c, at, stop, (root, INPUT)))
            source = (c, OUTPUT) if c in receivers else (root, INPUT)   # (the root in place: its x)
            mine += [_copy_row(width, q, at, stop, source) for q in range(nranks) if q != c]
        rows_by_rank.append(mine)
    phases = base.phases
    phase1 = _phase_of_pushes(rows_by_rank, width, phases[1].waits)
    return base._replace(phases=(phases[0], phase1, *phases[2:]), pushes=True, no_push_in_place=root)


# The collectives a call of which is the same call on segments of its
# message, one after the other (segmented_plan): those whose result element i
# is made of element i of the inputs alone, and those of blocks, each
# segment a slice of every rank's block. The caller's array that holds
# every rank's block, where one does (else each segment is a slice of the
# arrays):
SEGMENTED_COLLECTIVES = (ALLREDUCE, BROADCAST, REDUCE, REDUCE_SCATTER, ALLGATHER)
_ARRAY_OF_BLOCKS = {REDUCE_SCATTER: INPUT, ALLGATHER: OUTPUT}


@functools.lru_cache(maxsize=64)
def segmented_plan(collective, algorithm, nranks, count, dtype, op, root, binding, segment):
    """The plan of `collective` (SEGMENTED_COLLECTIVES) on `count` elements
    of WORK as consecutive runs of its plan on `segment` of them, the last
    run on what is left: a chunk loop, written out as phases. Run whole, a
    large staged call copies each rank's input into its WORK, folds and
    copies out, each pass over the whole message from memory; in segments
    that fit the cache, the passes of a segment find it there (measured:
    docs/host-ranks.md, "The plans in segments").

    Segment s's phases are the segment plan's, after every phase of the
    segments before: its rows on its slice of INPUT and OUTPUT (of every
    rank's block, where the array holds them all: reduce_scatter's INPUT,
    allgather's OUTPUT; a row that crosses blocks cut at their bounds) and
    on the same WORK and SCRATCH (a row's SCRATCH offset counts from
    SCRATCH's start, the segment's for the last run too); its waits (peer,
    t) become (peer, t + the phases before). So its phase 0, which waits for
    every peer to have completed the phases before (the previous segment:
    every read of this rank's workspace done), is what the first phase of a
    new call waits for, and each segment's runs are those of a call proved
    by the symbolic trace. A segment's bits are its plan's: the same on
    every rank, and, where the algorithm folds each element in an order
    that does not depend on the chunk it lies in (direct), the same as one
    run's."""
    if collective not in SEGMENTED_COLLECTIVES:
        raise ValueError(f"segmented_plan serves {SEGMENTED_COLLECTIVES}, not {collective!r}")
    blocks = nranks if collective in _ARRAY_OF_BLOCKS else 1
    if not 0 < segment < count or segment % blocks or count % blocks:
        raise ValueError(f"segmented_plan: a segment of {segment} elements in {count}, over {blocks} blocks")
    dtype = as_dtype(dtype)
    block, per_block = count // blocks, segment // blocks
    whole, tail = divmod(block, per_block)
    runs = [(s * per_block, per_block) for s in range(whole)] + ([(whole * per_block, tail)] if tail else [])
    runs = [(build_plan(collective, algorithm, nranks, length * blocks, dtype, op, root, binding), start, length)
            for start, length in runs]
    width = max(phase.table.shape[1] for plan, _, _ in runs for phase in plan.phases)
    phases, access, done_before = [], [], 0
    for plan, start, length in runs:
        for phase in plan.phases:
            rows = [row for original in phase.table.tolist()
                    for row in _rows_of_segment(original, _ARRAY_OF_BLOCKS.get(collective), start, length, block)]
            table = np.full((len(rows), width), -1, np.int64)
            for i, row in enumerate(rows):
                table[i, :len(row)] = row
            table.setflags(write=False)
            waits = tuple(tuple((peer, done + done_before) for peer, done in rank_waits) for rank_waits in phase.waits)
            phases.append(Phase(table, tuple(table[table[:, RANK] == r] for r in range(nranks)), waits))
        access.extend(plan.access)   # (regions by chunk: the device executors', which run no segmented plan)
        done_before += len(plan.phases)
    return runs[0][0]._replace(
        count=count, phases=tuple(phases), access=tuple(access), segment=segment,
        traffic=Traffic(*(sum(getattr(plan.traffic, f) for plan, _, _ in runs) for f in Traffic._fields)),
        wire_bytes=sum(plan.wire_bytes for plan, _, _ in runs))


def _rows_of_segment(row, array_of_blocks, start, length, block):
    """A segment plan's row (a list) on the call's arrays: the segment's
    elements [start, start + length) of each block of `block` elements. In
    `array_of_blocks` (a buffer id, or None) the segment plan's block b is
    at b * length, the call's at b * block: a row that crosses a block's
    bound there is cut at it. In the other caller's array the segment lies
    at `start`; WORK and SCRATCH are the segment plan's own."""
    operands = [(DST_BUF, DST_OFF)] + [(SRC0 + 3 * i + SRC_BUF, SRC0 + 3 * i + SRC_OFF) for i in range(row[NSRC])]
    cuts = {0, row[COUNT]}
    for buffer, offset in operands:
        if row[buffer] == array_of_blocks:
            cuts.update(range(-row[offset] % length, row[COUNT], length))
    cuts = sorted(cuts)
    pieces = []
    for first, last in zip(cuts, cuts[1:]):
        piece = list(row)
        piece[COUNT] = last - first
        for buffer, offset in operands:
            at = row[offset] + first
            if row[buffer] == array_of_blocks:
                at = at // length * block + start + at % length
            elif row[buffer] in (INPUT, OUTPUT):
                at += start
            piece[offset] = at
        pieces.append(piece)
    return pieces


def _at_least(waits, need):
    """`waits` ((peer, phases done) pairs) raised to `need` (peer -> phases done)."""
    merged = dict(waits)
    for peer, done in need.items():
        merged[peer] = max(merged.get(peer, 0), done)
    return tuple(sorted(merged.items()))


def derive_waits(nranks, phase_access, after_previous_call=True):
    """Per phase and rank, the (peer, phases completed) to wait for; see module doc.

    `phase_access[p]` is (regions written, (reading rank, peer region) pairs).
    A read of a region the call has not written waits for (peer, 0): the peer
    has started this call, so what the region held before the call is there.
    With `after_previous_call`, phase 0 also waits for every peer to have
    left the previous call (the process transport needs it; the device
    executor orders calls another way).
    """
    last_write = {}      # region -> phase that last wrote it
    readers = {}         # region -> {peer: last phase in which peer read it}
    waits = []
    for p, (writes, reads) in enumerate(phase_access):
        need = [dict() for _ in range(nranks)]
        if p == 0 and after_previous_call:
            for rank in range(nranks):
                need[rank] = {peer: 0 for peer in range(nranks) if peer != rank}
        for reader, region in reads:   # read after write
            t = last_write[region] + 1 if region in last_write else 0
            need[reader][region.rank] = max(need[reader].get(region.rank, 0), t)
        for region in writes:          # write after read
            for peer, t in readers.get(region, {}).items():
                need[region.rank][peer] = max(need[region.rank].get(peer, 0), t + 1)
        for reader, region in reads:
            readers.setdefault(region, {})[reader] = p
        for region in writes:
            last_write[region] = p
            readers.pop(region, None)  # earlier reads are now ordered before this write
        waits.append(tuple(tuple(sorted(need[rank].items())) for rank in range(nranks)))
    return waits


assert REDUCE == "reduce" and BUFFER_COUNT == 4
