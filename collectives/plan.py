"""Plans: a schedule made concrete for one element type and count.

A plan is a list of phases, each one flat integer op table that any executor
interprets (NumPy on the host today, our kernels on the GPU next):

    phase 0         copy each rank's INPUT into its WORK buffer
    phases 1..S     the schedule's steps
    phase S+1       copy each rank's result into its OUTPUT

Op table row (int64), one per transfer, executed by the rank in column RANK:

    RANK KIND COUNT DST_BUF DST_OFF NSRC (SRC_RANK SRC_BUF SRC_OFF) * max_sources

Offsets and counts are in elements. Unused source slots hold -1. KIND is COPY
(dst = src), REDUCE (dst = fold of srcs) or REDUCE_FINAL (a REDUCE that
completes the reduction of its elements, where avg divides by the rank count).
INPUT and OUTPUT are the caller's arrays and only their own rank touches them.

For ranks in different processes, `waits[phase][rank]` lists (peer, t): the
phase may start once `peer` has completed t phases of this collective.
They are derived from the tables, never written by hand: a read of a peer's
region waits for the peer's last write of it (read after write), and a write
of one's own region waits for every peer that read it earlier (write after
read). Phase 0 waits for every peer to have left the previous collective,
since the next collective reuses the same WORK buffers.
"""

import functools
from typing import NamedTuple, Tuple

import numpy as np

from .algorithms import schedule_for
from .algorithms.schedule import (
    ALLGATHER, REDUCE, REDUCE_SCATTER, SCRATCH, WORK, Region,
)

INPUT = 2
OUTPUT = 3

COPY_OP = 0
REDUCE_OP = 1
REDUCE_FINAL_OP = 2

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


class Plan(NamedTuple):
    collective: str
    algorithm: str
    nranks: int
    count: int          # elements in each rank's WORK buffer
    dtype: np.dtype
    op: str
    root: int
    chunk_bounds: Tuple[Tuple[int, int], ...]
    scratch_elements: int
    scratch_offset: int     # bytes from the start of a rank's workspace to SCRATCH
    workspace_bytes: int    # WORK, padding and SCRATCH
    phases: Tuple[Phase, ...]


def chunk_bounds(collective, nranks, nchunks, count, itemsize):
    """[start, stop) of each chunk, in elements."""
    if collective in (REDUCE_SCATTER, ALLGATHER):
        block = count // nranks  # one chunk per rank's block, by definition
        return tuple((c * block, (c + 1) * block) for c in range(nchunks))
    align = max(1, ALIGN_BYTES // itemsize)
    size = -(-count // nchunks)
    size = -(-size // align) * align
    return tuple((min(c * size, count), min((c + 1) * size, count)) for c in range(nchunks))


def _merge_ranges(pairs):
    """Join (offset, count) pairs that continue each other; drops empty ones."""
    merged = []
    for offset, count in pairs:
        if count == 0:
            continue
        if merged and merged[-1][0] + merged[-1][1] == offset:
            merged[-1] = (merged[-1][0], merged[-1][1] + count)
        else:
            merged.append((offset, count))
    return merged


@functools.lru_cache(maxsize=256)
def build_plan(collective, algorithm, nranks, count, dtype, op, root=0):
    """The plan for one call shape; cached, so a repeated call plans nothing.

    `count` is the number of elements in each rank's WORK buffer: the message
    for allreduce, broadcast and reduce; size * per-rank count for
    reduce_scatter and allgather.
    """
    dtype = np.dtype(dtype)
    schedule = schedule_for(algorithm, collective, nranks, root if collective in ("broadcast", "reduce") else None)
    bounds = chunk_bounds(collective, nranks, schedule.nchunks, count, dtype.itemsize)
    trace = schedule.trace()
    uses_scratch = schedule.result_buffer == SCRATCH or any(
        region.buffer == SCRATCH for step in schedule.steps for t in step for region in (t.dst, *t.srcs)
    )

    def offset(chunk):
        return bounds[chunk][0]

    def length(chunk):
        return bounds[chunk][1] - bounds[chunk][0]

    # Each row as (rank, kind, count, dst_buf, dst_off, [(src_rank, src_buf, src_off)]),
    # and each phase's region accesses, for the waits.
    phase_rows = []
    phase_access = []  # per phase: (regions written, (reading rank, peer region) pairs)

    # The caller's array maps onto WORK one to one, except allgather's input
    # and reduce_scatter's output, which are the rank's own block.
    copy_in, writes = [], set()
    for rank in range(nranks):
        chunks = schedule.input_chunks(rank)
        writes.update(Region(rank, WORK, chunk) for chunk in chunks)
        block_start = offset(rank) if collective == ALLGATHER else 0
        for start, n in _merge_ranges((offset(c), length(c)) for c in chunks):
            copy_in.append((rank, COPY_OP, n, WORK, start, [(rank, INPUT, start - block_start)]))
    phase_rows.append(copy_in)
    phase_access.append((writes, set()))

    for s, step in enumerate(schedule.steps):
        rows, writes, reads = [], set(), set()
        for i, t in enumerate(step):
            writes.add(t.dst)
            reads.update((t.rank, src) for src in t.srcs if src.rank != t.rank)
            n = length(t.dst.chunk)
            if n == 0:
                continue
            kind = COPY_OP if t.kind != REDUCE else (REDUCE_FINAL_OP if (s, i) in trace.completing else REDUCE_OP)
            rows.append((t.rank, kind, n, t.dst.buffer, offset(t.dst.chunk),
                         [(src.rank, src.buffer, offset(src.chunk)) for src in t.srcs]))
        phase_rows.append(rows)
        phase_access.append((writes, reads))

    copy_out = []
    for rank in range(nranks):
        chunks = schedule.output_chunks(rank)
        block_start = offset(rank) if collective == REDUCE_SCATTER else 0
        for start, n in _merge_ranges((offset(c), length(c)) for c in chunks):
            copy_out.append((rank, COPY_OP, n, OUTPUT, start - block_start, [(rank, schedule.result_buffer, start)]))
    phase_rows.append(copy_out)
    phase_access.append((set(), set()))

    max_sources = max([len(row[5]) for rows in phase_rows for row in rows] + [1])
    waits = _derive_waits(nranks, phase_access)
    phases = tuple(
        _make_phase(rows, nranks, max_sources, phase_waits) for rows, phase_waits in zip(phase_rows, waits)
    )
    scratch_elements = count if uses_scratch else 0
    scratch_offset = -(-count * dtype.itemsize // SCRATCH_ALIGN_BYTES) * SCRATCH_ALIGN_BYTES
    return Plan(
        collective=collective, algorithm=algorithm, nranks=nranks, count=count, dtype=dtype,
        op=op, root=root, chunk_bounds=bounds, scratch_elements=scratch_elements,
        scratch_offset=scratch_offset, workspace_bytes=scratch_offset + scratch_elements * dtype.itemsize,
        phases=phases,
    )


def _make_phase(rows, nranks, max_sources, waits):
    table = np.full((len(rows), SRC0 + 3 * max_sources), -1, dtype=np.int64)
    for i, (rank, kind, count, dst_buf, dst_off, srcs) in enumerate(rows):
        table[i, :SRC0] = (rank, kind, count, dst_buf, dst_off, len(srcs))
        for j, src in enumerate(srcs):
            table[i, SRC0 + 3 * j: SRC0 + 3 * j + 3] = src
    table.setflags(write=False)
    by_rank = tuple(table[table[:, RANK] == rank] for rank in range(nranks))
    return Phase(table, by_rank, waits)


def _derive_waits(nranks, phase_access):
    """Per phase and rank, the (peer, phases completed) to wait for; see module doc."""
    last_write = {}      # region -> phase that last wrote it
    readers = {}         # region -> {peer: last phase in which peer read it}
    waits = []
    for p, (writes, reads) in enumerate(phase_access):
        need = [dict() for _ in range(nranks)]
        if p == 0:
            for rank in range(nranks):
                need[rank] = {peer: 0 for peer in range(nranks) if peer != rank}
        for reader, region in reads:   # read after write
            t = last_write[region]
            need[reader][region.rank] = max(need[reader].get(region.rank, 0), t + 1)
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
