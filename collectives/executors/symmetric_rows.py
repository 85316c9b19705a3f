"""What each rank does in a call on symmetric memory (executors/symmetric.py),
as step-kernel rows: the slide of the one pass, without a device.

Rank r's share, one plan_step table in the op-table format (plan.py), with
n ranks, a message of C elements cut into n chunks at 16-byte boundaries
(plan.chunk_bounds), chunk r = [lo, hi):

    allreduce       fold chunk r of every rank's input, in rank order, and
                    store it to chunk r of every rank's output (one row per
                    output; plan_step reads the sources once for all of them)
    reduce          the same, stored to the root's output only
    broadcast       copy chunk r of the root's input to every output
    reduce_scatter  fold block r of every input; store it to r's own output
    allgather       copy r's input to block r of every output

Every element is read and written by one thread of one rank, which reads all
its sources before it stores: so an output may be its input (in place) or
hold it (reduce_scatter's own block, allgather's). Each rank reads about
the message and writes about the message: for ranks sharing one GPU every
input is read once and every output written once, the memory floor. Every
rank folds in rank order with one accumulator (the REDUCE_FINAL rows of the
`direct` plan), so results are the NumPy interpreter's bits.

A call on plain arrays adds a copy of what the rank contributes into its
staging buffer and of what it receives out of it (staged_copies).
"""

import numpy as np

from ..algorithms.schedule import ALLGATHER, ALLREDUCE, BROADCAST, REDUCE_SCATTER, REDUCE_TO_ROOT
from ..binding import COPY_OP, INPUT, OUTPUT, REDUCE_FINAL_OP
from ..plan import COUNT, NSRC, SRC0, chunk_bounds
from .device import fan_out

# Whose arrays a rank's share touches (share_rows): peers read every input
# but allgather's (each rank copies its own), and write every output but
# reduce_scatter's (each rank folds its own block). Those arrays must lie in
# symmetric memory, at the same place on every rank; the others may lie
# anywhere on the rank's device, at any place.
PEERS_READ_INPUT = frozenset({ALLREDUCE, REDUCE_SCATTER, BROADCAST, REDUCE_TO_ROOT})
PEERS_WRITE_OUTPUT = frozenset({ALLREDUCE, ALLGATHER, BROADCAST, REDUCE_TO_ROOT})


def share_rows(collective, nranks, rank, root, count, itemsize, op_kind, in_place):
    """Rank `rank`'s rows (plan.py's op-table format) of a call on symmetric
    memory; `count` is plan.count (the message; reduce_scatter's input,
    allgather's output: n blocks). `in_place`: the output is the input (or,
    for allgather, holds it as block `rank`): a copy onto itself is left out."""
    rows = []

    def row(destination, kind, elements, dst_offset, sources):
        rows.append([destination, kind, elements, OUTPUT, dst_offset, len(sources)]
                    + [field for source in sources for field in source])

    everyone = range(nranks)
    if collective in (REDUCE_SCATTER, ALLGATHER):
        block = count // nranks
        if block == 0:
            return np.zeros((0, SRC0 + 3), np.int64)
        if collective == REDUCE_SCATTER:
            row(rank, op_kind, block, 0, [(q, INPUT, rank * block) for q in everyone])
        else:
            for d in everyone:
                if not (in_place and d == rank):
                    row(d, COPY_OP, block, rank * block, [(rank, INPUT, 0)])
    else:
        lo, hi = chunk_bounds(collective, nranks, nranks, count, itemsize)[rank]
        if hi > lo:
            if collective == BROADCAST:
                for d in everyone:
                    if not (in_place and d == root):
                        row(d, COPY_OP, hi - lo, lo, [(root, INPUT, lo)])
            else:
                sources = [(q, INPUT, lo) for q in everyone]
                for d in (everyone if collective == ALLREDUCE else (root,)):
                    row(d, op_kind, hi - lo, lo, sources)
    width = max((len(r) for r in rows), default=SRC0 + 3)
    table = np.full((len(rows), width), -1, np.int64)
    for i, r in enumerate(rows):
        table[i, :len(r)] = r
    return table


def staged_copies(collective, nranks, rank, root, count, itemsize, in_place=True):
    """(copy in, copy out) of rank `rank`'s staged call, each (staging
    offset, bytes) or None: what the rank contributes and what it receives
    (`count` is plan.count, as for share_rows; `in_place`: the caller's
    output is its input, which a broadcast's root then need not receive)."""
    block = count // nranks * itemsize
    whole = count * itemsize
    if collective == ALLGATHER:
        return (rank * block, block), (0, whole)
    if collective == REDUCE_SCATTER:
        return (0, whole), (rank * block, block)
    if collective == BROADCAST:   # in place, the root's x is its own result
        return ((0, whole), None if in_place else (0, whole)) if rank == root else (None, (0, whole))
    if collective == REDUCE_TO_ROOT:   # the other ranks' x stays as it is
        return (0, whole), ((0, whole) if rank == root else None)
    return (0, whole), (0, whole)


def call_traffic(collective, nranks, root, count, itemsize, staged, in_place=False):
    """(bytes read plus written by every rank's launches, the most launches a
    rank makes) of a call on symmetric memory, or `staged` through staging
    buffers (bench.model plans): a share reads each source once for all its
    destinations (fan-out); a copy reads and writes its bytes."""
    traffic, launches = 0, 0
    for rank in range(nranks):
        rows = share_rows(collective, nranks, rank, root, count, itemsize, REDUCE_FINAL_OP, in_place)
        if len(rows):
            rows, fanout = fan_out(rows)
            for group in rows[::fanout]:
                traffic += int(group[COUNT]) * itemsize * (int(group[NSRC]) + fanout)
        copies = [c for c in staged_copies(collective, nranks, rank, root, count, itemsize, in_place) if c] if staged else []
        traffic += sum(2 * nbytes for _, nbytes in copies)
        launches = max(launches, 3 + len(copies))
    return traffic, launches
