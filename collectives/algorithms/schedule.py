"""What an algorithm produces: a schedule of transfers between rank buffers.

A schedule is pure data, independent of element type, size and device:

* Each rank owns two shared buffers, WORK and SCRATCH, of the same size and
  split into the same `nchunks` chunks. Before step 0 each rank's input has
  been copied into its WORK buffer (where the collective says); after the
  last step each rank's output is read from its `result_buffer`.
* A step is a set of transfers that may run in any order or all at once.
  Between steps every rank's reads and writes of the step before are done.
* A transfer is executed by the rank that owns its destination ("pull"):
  nobody ever writes another rank's memory, so the only cross-rank hazards
  are reads of a peer's region, which the plan turns into waits.
* COPY: dst = src. REDUCE: dst = srcs[0] op srcs[1] op ... folded left to
  right, which fixes the order in which every element is reduced.
* A transfer never moves data between chunk indices: chunk c of one rank only
  ever meets chunk c of another. This keeps an element's identity obvious.
  The one exception is all_to_all, whose whole point is to move block j of
  rank i to block i of rank j: its chunks are the ranks' equal blocks, it
  only copies, and the trace follows each copy's origin (see below).

`trace()` executes a schedule symbolically. It is how the plan learns where
each reduction completes (where avg divides) and how the tests prove that
every output element holds every rank's contribution exactly once, combined
in the same order on every rank, and, for the collectives that only move
blocks, that every output block is the very input block it should be.
"""

from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple

WORK = 0
SCRATCH = 1
BUFFER_NAMES = {WORK: "WORK", SCRATCH: "SCRATCH"}

COPY = "copy"
REDUCE = "reduce"

ALLREDUCE = "allreduce"
REDUCE_SCATTER = "reduce_scatter"
ALLGATHER = "allgather"
BROADCAST = "broadcast"
REDUCE_TO_ROOT = "reduce"
GATHER = "gather"
SCATTER = "scatter"
ALL_TO_ALL = "all_to_all"
# all_to_all with a block of its own size for every (sender, receiver):
# all_to_all's schedules, whose chunks are blocks, made concrete by plan.py
# with a count per block (no schedule has this name).
ALL_TO_ALL_V = "all_to_all_v"
# NCCL's five collectives: every executor, fast path and tool runs these.
COLLECTIVES = (ALLREDUCE, REDUCE_SCATTER, ALLGATHER, BROADCAST, REDUCE_TO_ROOT)
# The collectives that move blocks without reducing them (MPI's gather,
# scatter and alltoall): plans of the general path run them.
EXCHANGES = (GATHER, SCATTER, ALL_TO_ALL)
ALL_COLLECTIVES = COLLECTIVES + EXCHANGES
REDUCING_COLLECTIVES = (ALLREDUCE, REDUCE_SCATTER, REDUCE_TO_ROOT)
# The buffer is one equal block per rank (nchunks == nranks).
BLOCKED_COLLECTIVES = (REDUCE_SCATTER, ALLGATHER, GATHER, SCATTER, ALL_TO_ALL)
ROOTED_COLLECTIVES = (BROADCAST, REDUCE_TO_ROOT, GATHER, SCATTER)


class Region(NamedTuple):
    rank: int
    buffer: int
    chunk: int

    def __str__(self):
        return f"rank{self.rank}.{BUFFER_NAMES[self.buffer]}[{self.chunk}]"


class Transfer(NamedTuple):
    kind: str
    dst: Region
    srcs: Tuple[Region, ...]

    @property
    def rank(self):
        """The rank that executes this transfer: the owner of the destination."""
        return self.dst.rank


def copy(src, dst):
    return Transfer(COPY, dst, (src,))


def reduce(srcs, dst):
    return Transfer(REDUCE, dst, tuple(srcs))


class Costs(NamedTuple):
    """An algorithm's closed-form costs for one collective, n ranks and a
    buffer of `nbytes` (each rank's WORK: the message, or n blocks for
    reduce_scatter and allgather). Per rank means the busiest rank's."""
    steps: int
    sent: float      # bytes peers read from the busiest rank's buffers (Schedule.bytes_sent)
    moved: float     # bytes the busiest rank reads plus writes (Schedule.chunks_moved)


NO_COSTS = Costs(0, 0.0, 0.0)   # one rank: nothing to do


def largest_power_of_two_at_most(n):
    """p of the usual fix for rank counts that are not powers of two: ranks
    p..n-1 fold into a partner first and receive the result last."""
    return 1 << (n.bit_length() - 1)


class ScheduleError(ValueError):
    """A schedule breaks one of the rules in this module's docstring."""


@dataclass(frozen=True)
class Schedule:
    collective: str
    nranks: int
    nchunks: int
    steps: Tuple[Tuple[Transfer, ...], ...]
    result_buffer: int = WORK
    root: Optional[int] = None

    def __post_init__(self):
        validate(self)

    @property
    def nsteps(self):
        return len(self.steps)

    def chunks_sent(self, rank):
        """How many chunks peers read from `rank`'s buffers over the schedule."""
        return sum(
            1
            for step in self.steps
            for t in step
            for src in t.srcs
            if src.rank == rank and t.rank != rank
        )

    def bytes_sent(self, rank, nbytes):
        """Bytes `rank` sends when the buffer holds `nbytes` (a multiple of nchunks)."""
        return self.chunks_sent(rank) * nbytes / self.nchunks

    def chunks_moved(self, rank, fused=True):
        """Chunks `rank` reads plus writes while executing its transfers.

        On shared-memory machines a step's cost is set by this traffic, not by
        what crosses a link, so it is what `auto` weighs. A fused reduce of k
        sources (the step kernel) reads k chunks and writes one; NumPy folds
        pairwise (`fused=False`), reading two and writing one k-1 times.
        """
        return sum(self.chunks_moved_by_step(rank, fused))

    def chunks_moved_by_step(self, rank, fused=True):
        """`chunks_moved`, step by step."""
        return [sum(_chunks_moved(t, fused) for t in step if t.rank == rank) for step in self.steps]

    def chunks_moved_by_rank_and_step(self, fused=True):
        """`chunks_moved_by_step` of every rank, in one pass over the transfers
        (`auto` weighs schedules of hundreds of ranks)."""
        table = [[0] * self.nsteps for _ in range(self.nranks)]
        for s, step in enumerate(self.steps):
            for t in step:
                table[t.rank][s] += _chunks_moved(t, fused)
        return table

    def chunks_moved_sharing_reads(self):
        """Chunks read plus written over all ranks when one engine runs a
        step's transfers that read the same sources as one fused fold (read
        once, each destination written): the GPU executor's fan-out."""
        total = 0
        for step in self.steps:
            groups = {}
            for t in step:
                groups[t.kind, t.srcs] = groups.get((t.kind, t.srcs), 0) + 1
            total += sum(len(srcs) + writes for (_, srcs), writes in groups.items())
        return total

    def peers_read(self, rank, step):
        """The peers whose buffers `rank` reads in step `step`."""
        return {src.rank for t in self.steps[step] if t.rank == rank for src in t.srcs if src.rank != rank}

    def peers_read_by_rank_and_step(self):
        """`peers_read` of every rank and step, in one pass over the transfers."""
        table = [[set() for _ in range(self.nsteps)] for _ in range(self.nranks)]
        for s, step in enumerate(self.steps):
            for t in step:
                table[t.rank][s].update(src.rank for src in t.srcs if src.rank != t.rank)
        return table

    def input_chunks(self, rank):
        """The WORK chunks that hold `rank`'s input before step 0."""
        if self.collective in (ALLGATHER, GATHER):
            return (rank,)
        if self.collective in (BROADCAST, SCATTER) and rank != self.root:
            return ()
        return tuple(range(self.nchunks))

    def output_chunks(self, rank):
        """The `result_buffer` chunks that form `rank`'s output, in order.
        A broadcast's root has an output too: its own input, copied where
        the caller gives an `out` (binding.py leaves the copy out in place)."""
        if self.collective in (REDUCE_SCATTER, SCATTER):
            return (rank,)
        if self.collective in (REDUCE_TO_ROOT, GATHER) and rank != self.root:
            return ()  # only the root receives the reduction, or the blocks
        return tuple(range(self.nchunks))

    def trace(self):
        """Execute symbolically; see `Trace`."""
        return _trace(self)


def _chunks_moved(transfer, fused):
    """Chunks a transfer reads plus writes (see Schedule.chunks_moved)."""
    if transfer.kind == REDUCE and not fused:
        return 3 * (len(transfer.srcs) - 1)
    return len(transfer.srcs) + 1


class Trace(NamedTuple):
    # Region -> expression: an int is that rank's original contribution to the
    # chunk, a tuple is the left fold of its members' values.
    final: dict
    # (step index, transfer index) of every REDUCE whose result holds all
    # ranks' contributions: where avg divides.
    completing: frozenset
    # Region -> (bit mask of the ranks its expression contains, how many
    # contributions it holds): `contributions` without walking the
    # expression, whose depth grows with the number of ranks.
    held: dict
    # Region -> the input region (WORK, before step 0) whose value it holds
    # unchanged, copied there; regions holding a fold are not in it.
    origin: dict


def contributions(expr):
    """The ranks whose data an expression contains, with repetitions."""
    if isinstance(expr, int):
        return [expr]
    return [rank for member in expr for rank in contributions(member)]


def _trace(schedule):
    n = schedule.nranks
    values = {}
    held = {}
    origin = {}
    for rank in range(n):
        for chunk in schedule.input_chunks(rank):
            values[Region(rank, WORK, chunk)] = rank
            held[Region(rank, WORK, chunk)] = (1 << rank, 1)
            origin[Region(rank, WORK, chunk)] = Region(rank, WORK, chunk)
    completing = set()
    for s, step in enumerate(schedule.steps):
        # All reads of a step see the state before it (validate() guarantees
        # no region is read and written by different transfers of one step):
        # the step's writes land once all its transfers have read.
        writes = []
        for i, t in enumerate(step):
            try:
                inputs = [values[src] for src in t.srcs]
            except KeyError as missing:
                raise ScheduleError(f"step {s}: {t.kind} reads {missing.args[0]} before it holds data") from None
            if t.kind == COPY:
                writes.append((t.dst, inputs[0], held[t.srcs[0]], origin.get(t.srcs[0])))
                continue
            mask, count = 0, 0
            for src in t.srcs:
                src_mask, src_count = held[src]
                mask, count = mask | src_mask, count + src_count
            if count != mask.bit_count():
                raise ScheduleError(f"step {s}: {t.dst} would hold a contribution twice: "
                                    f"{sorted(contributions(tuple(inputs)))}")
            writes.append((t.dst, tuple(inputs), (mask, count), None))
            if count == n:
                completing.add((s, i))
        for dst, value, ranks_held, came_from in writes:
            values[dst] = value
            held[dst] = ranks_held
            if came_from is None:
                origin.pop(dst, None)
            else:
                origin[dst] = came_from
    return Trace(values, frozenset(completing), held, origin)


def validate(schedule):
    """Raise ScheduleError unless the schedule follows the module's rules."""
    n, nchunks = schedule.nranks, schedule.nchunks
    if schedule.collective not in ALL_COLLECTIVES:
        raise ScheduleError(f"unknown collective {schedule.collective!r}")
    if n < 1 or nchunks < 1:
        raise ScheduleError("a schedule needs at least one rank and one chunk")
    if schedule.collective in BLOCKED_COLLECTIVES and nchunks != n:
        raise ScheduleError(f"{schedule.collective} splits its buffer into one chunk per rank")
    moves_blocks = schedule.collective == ALL_TO_ALL   # (see the module doc)
    for s, step in enumerate(schedule.steps):
        written = set()
        read_by_other = set()
        for t in step:
            regions = (t.dst,) + t.srcs
            if any(not (0 <= r.rank < n and r.buffer in BUFFER_NAMES and 0 <= r.chunk < nchunks) for r in regions):
                raise ScheduleError(f"step {s}: {t} addresses a region out of range")
            if any(src.chunk != t.dst.chunk for src in t.srcs) and not (moves_blocks and t.kind == COPY):
                raise ScheduleError(f"step {s}: {t} moves data between chunk indices")
            if t.kind == COPY and len(t.srcs) != 1:
                raise ScheduleError(f"step {s}: a copy has exactly one source")
            if t.kind == REDUCE and len(t.srcs) < 2:
                raise ScheduleError(f"step {s}: a reduce has at least two sources")
            if t.kind not in (COPY, REDUCE):
                raise ScheduleError(f"step {s}: unknown transfer kind {t.kind!r}")
            # The fold writes dst after combining srcs[0] and srcs[1], so dst
            # may stand only in those places.
            if t.dst in t.srcs[2:]:
                raise ScheduleError(f"step {s}: {t.dst} is a later source of its own reduce")
            if t.dst in written:
                raise ScheduleError(f"step {s}: {t.dst} is written twice")
            written.add(t.dst)
            read_by_other.update(src for src in t.srcs if src != t.dst)
        clash = written & read_by_other
        if clash:
            raise ScheduleError(f"step {s}: {sorted(map(str, clash))} read and written in the same step")
    if schedule.collective in ROOTED_COLLECTIVES and not (
        schedule.root is not None and 0 <= schedule.root < n
    ):
        raise ScheduleError(f"{schedule.collective} needs a root in [0, {n})")
    trace = _trace(schedule)
    _check_outputs(schedule, trace)


def _check_outputs(schedule, trace):
    """Every output chunk holds what the collective promises."""
    n = schedule.nranks
    reducing = schedule.collective in REDUCING_COLLECTIVES
    everyone = list(range(n)), (1 << n) - 1
    for rank in range(n):
        for chunk in schedule.output_chunks(rank):
            region = Region(rank, schedule.result_buffer, chunk)
            if region not in trace.final:
                raise ScheduleError(f"output {region} never receives data")
            if reducing:
                want, want_mask = everyone
            else:
                source = _source_block(schedule, rank, chunk)
                if trace.origin.get(region) != source:
                    raise ScheduleError(f"output {region} holds {trace.origin.get(region, 'a fold')}, "
                                        f"expected a copy of {source}")
                want, want_mask = [source.rank], 1 << source.rank
            # no rank twice (the trace refused repeats), so the mask and count say it all
            if trace.held[region] != (want_mask, len(want)):
                got = sorted(contributions(trace.final[region]))
                raise ScheduleError(f"output {region} holds contributions {got}, expected {want}")


def _source_block(schedule, rank, chunk):
    """The input region that `rank`'s output chunk `chunk` is a copy of, in
    a collective that does not reduce."""
    if schedule.collective in (ALLGATHER, GATHER):
        return Region(chunk, WORK, chunk)        # block c is rank c's input
    if schedule.collective == ALL_TO_ALL:
        return Region(chunk, WORK, rank)         # block c of rank r: block r of rank c's input
    return Region(schedule.root, WORK, chunk)    # broadcast, scatter: the root's
