"""Binding: which memory a plan's transfers read and write.

A schedule works on two buffers per rank, WORK and SCRATCH (schedule.py). The
plain way to run it (binding WORKSPACE) copies each rank's INPUT into its
WORK first and its result into its OUTPUT last. That is what ranks in
different processes must do, since a peer can only address a rank's
workspace. Ranks in one process can address each other's arrays, and then
those two copies are wasted traffic: the plan can read inputs and write
outputs directly.

`bind` rewrites the logical plan (chunk-level moves, one list per phase) for
such ranks. A read of WORK that still holds the rank's input reads INPUT
instead, so the copy in disappears; writes of the result buffer go straight
to OUTPUT, so the copy out disappears where the result is already there. Two
bindings, as the caller's arrays are related:

    OUT_OF_PLACE   INPUT and OUTPUT are separate memory
    IN_PLACE       they are the same memory, chunk for chunk (allreduce's x;
                   reduce_scatter's output is the rank's own block of x;
                   allgather's x is the rank's own block of the output)
    IN_PLACE_LOCKSTEP
                   IN_PLACE, for an executor that runs a phase's moves with
                   the same sources as one group in lockstep: at each
                   element it reads every source before it writes any of
                   the group's destinations (the device executor's fan-out
                   groups, for ranks that share one device; plan_step.cu).
                   A group may then overwrite what its own moves read, so
                   direct allreduce in place is one pass: each element of
                   every rank's x read once, the sum written back once.

A rewrite is kept only if a symbolic run proves it: every phase still has
no chunk written twice or written while another move of the phase reads it
(IN_PLACE_LOCKSTEP: another group; and then the phase's moves are groups of
one size, which is when the executor runs them as groups),
and every chunk of every caller's array ends holding the same expression
(the same values, folded in the same order, avg dividing at the same move)
as the plain plan leaves there. (A move reads all its sources before it
writes: every executor does, so a move may write one of its own sources.)
Otherwise the next, more cautious, rewrite is
tried, and the plain plan is the last resort. So binding can cost speed,
never bits.

Ranks in separate processes that read each other's INPUT in place (the
single copy, plan.single_copy_plan) but no peer's OUTPUT take a third:

    PEERS_READ_INPUT
                   OUT_OF_PLACE, except that a result chunk a peer reads
                   stays in the rank's workspace (a peer can read that)
                   and is copied out after: two_shot allreduce's reduced
                   chunks, which every peer copies out of the reducer

Ranks that cannot address each other's arrays (processes) keep the plain
plan's reads, peers reading only workspaces, in one of two bindings:

    WORKSPACE      any relation of INPUT and OUTPUT: a result chunk's last
                   write goes straight to OUTPUT where nobody reads the
                   chunk after it (the copy out it saves: a broadcast's
                   receivers, a direct allgather's or reduce_scatter's
                   blocks); INPUT is read only by the copy in, before any
                   step, so any overlap with OUTPUT is still safe
    WORKSPACE_APART
                   INPUT and OUTPUT are separate memory: also, a block
                   that only its own rank reads back out of its workspace
                   (a gather's or scatter's root's own, all_to_all's own)
                   is copied straight from INPUT to OUTPUT in phase 0,
                   beside the copies in, one copy where it made two
    WORKSPACE_IN_PLACE
                   INPUT and OUTPUT are the same memory, chunk for chunk:
                   also, a copy out of a chunk that still holds the rank's
                   own input (a broadcast's root, allgather's own block) is
                   left out, its value being there already, and so is such
                   a block's copy in (WORKSPACE_APART's straight copy is a
                   copy onto itself here)

Each proved by the same symbolic run. Compressed plans keep the plain plan
(their wire copies are lowered from its moves).
"""

from typing import NamedTuple, Tuple

from .algorithms.schedule import ALLGATHER, GATHER, REDUCE, REDUCE_SCATTER, SCATTER, SCRATCH, WORK

INPUT = 2
OUTPUT = 3
BUFFER_NAMES = {WORK: "WORK", SCRATCH: "SCRATCH", INPUT: "INPUT", OUTPUT: "OUTPUT"}

COPY_OP = 0
REDUCE_OP = 1
REDUCE_FINAL_OP = 2

WORKSPACE = "workspace"
WORKSPACE_APART = "workspace_apart"
WORKSPACE_IN_PLACE = "workspace_in_place"
OUT_OF_PLACE = "out_of_place"
IN_PLACE = "in_place"
IN_PLACE_LOCKSTEP = "in_place_lockstep"
PEERS_READ_INPUT = "peers_read_input"
BINDINGS = (WORKSPACE, WORKSPACE_APART, WORKSPACE_IN_PLACE, OUT_OF_PLACE, IN_PLACE, IN_PLACE_LOCKSTEP,
            PEERS_READ_INPUT)
WORKSPACE_BINDINGS = (WORKSPACE, WORKSPACE_APART, WORKSPACE_IN_PLACE)
IN_PLACE_BINDINGS = frozenset({WORKSPACE_IN_PLACE, IN_PLACE, IN_PLACE_LOCKSTEP})


class Loc(NamedTuple):
    """A chunk of one of a rank's buffers. INPUT and OUTPUT chunks use the
    chunk numbers of WORK, also where the caller's array holds only one."""
    rank: int
    buffer: int
    chunk: int

    def __str__(self):
        return f"rank{self.rank}.{BUFFER_NAMES[self.buffer]}[{self.chunk}]"


class Move(NamedTuple):
    """A transfer at chunk level, executed by the owner of `dst`."""
    kind: int
    dst: Loc
    srcs: Tuple[Loc, ...]

    @property
    def rank(self):
        return self.dst.rank


def logical_phases(schedule):
    """The plain plan: copy in, the schedule's steps, copy out."""
    trace = schedule.trace()
    copy_in = [Move(COPY_OP, Loc(r, WORK, c), (Loc(r, INPUT, c),))
               for r in range(schedule.nranks) for c in schedule.input_chunks(r)]
    steps = []
    for s, step in enumerate(schedule.steps):
        moves = []
        for i, t in enumerate(step):
            kind = COPY_OP if t.kind != REDUCE else (REDUCE_FINAL_OP if (s, i) in trace.completing else REDUCE_OP)
            moves.append(Move(kind, Loc(*t.dst), tuple(Loc(*src) for src in t.srcs)))
        steps.append(moves)
    copy_out = [Move(COPY_OP, Loc(r, OUTPUT, c), (Loc(r, schedule.result_buffer, c),))
                for r in range(schedule.nranks) for c in schedule.output_chunks(r)]
    return [copy_in, *steps, copy_out]


# Where a rewrite may put a write of the result buffer's chunk c of rank r,
# when c is one of the rank's output chunks, tried in this order:
RESULT_IN_OUTPUT = "every write of the result buffer goes to OUTPUT"
LAST_WRITE_IN_OUTPUT = "only the last write of the result buffer goes to OUTPUT"
RESULT_IN_WORKSPACE = "the result stays in the workspace and is copied out"
POLICIES = (RESULT_IN_OUTPUT, LAST_WRITE_IN_OUTPUT, RESULT_IN_WORKSPACE)
# PEERS_READ_INPUT's one policy:
RESULT_IN_OUTPUT_UNLESS_PEERS_READ = "a write of the result buffer goes to OUTPUT unless a peer reads the chunk"


def bind(phases, schedule, binding, rewrite_workspace_plans=True):
    """`phases` rewritten for `binding` (see the module doc);
    `rewrite_workspace_plans` False keeps the plain plan for the workspace
    bindings (compressed plans)."""
    if binding not in BINDINGS:
        raise ValueError(f"unknown binding {binding!r}")
    if binding in WORKSPACE_BINDINGS and not rewrite_workspace_plans:
        return phases
    layout = _Layout(schedule, in_place=binding in IN_PLACE_BINDINGS, lockstep=binding == IN_PLACE_LOCKSTEP)
    expected = layout.run(phases)
    assert expected is not None, "a valid schedule's plain plan has no conflicts"
    if binding in WORKSPACE_BINDINGS:
        direct = _last_results_in_output(phases)
        candidates = [direct, phases]
        workspace = next(c for c in candidates if c is phases or layout.run(c) == expected)
        chosen = workspace
        if binding == WORKSPACE_IN_PLACE:
            candidates = [_without_copies_of_untouched_input(direct), _without_copies_of_untouched_input(phases),
                          *candidates]
            chosen = next(c for c in candidates if c is phases or layout.run(c) == expected)
        if binding != WORKSPACE:   # (the symbolic run knows how INPUT and OUTPUT relate: apart, or the same)
            straight = _straight_from_input(chosen)
            chosen = next((c for c in (_straight_copies_first(straight), straight) if layout.run(c) == expected),
                          chosen)
            onto_itself = [[m for m in phase if not (m.kind == COPY_OP
                                                     and layout.storage(m.dst) == layout.storage(m.srcs[0]))]
                           for phase in chosen]   # (in place, a block copied onto itself)
            chosen = onto_itself if layout.run(onto_itself) == expected else chosen
        # No copy out left: one phase less. But only where WORKSPACE has none
        # left either: each process binds by its own arrays, so the ranks of
        # one call may bind differently (MPI_IN_PLACE at a gather's root
        # alone), and their counters count phases: every rank of a call must
        # run as many. (WORKSPACE_IN_PLACE only leaves copies out, and the
        # straight copies above only move copies into phase 0 or leave them
        # out: a last phase WORKSPACE's plan has empty is empty here too, and
        # where it is not, a phase is left, empty or not.)
        return chosen[:-1] if len(chosen) > 2 and not workspace[-1] else chosen
    for policy in (RESULT_IN_OUTPUT_UNLESS_PEERS_READ,) if binding == PEERS_READ_INPUT else POLICIES:
        rewritten = _rewrite(phases, schedule, policy, layout)
        candidate = next((c for c in (_without_round_trips(rewritten, layout), rewritten)
                          if layout.run(c) == expected), None)
        if candidate is not None:
            # The copies left at the end (allgather's own block, say) often
            # conflict with nothing in the last step: then they join it, and
            # the plan has one launch less.
            merged = [*candidate[:-2], candidate[-2] + candidate[-1], []]
            if len(candidate) > 2 and candidate[-1] and layout.run(merged) == expected:
                return merged
            return candidate
    return phases


def storage(schedule, binding):
    """A function naming the memory each Loc lives in: in place, an
    OUTPUT chunk is the INPUT chunk it shares memory with. Hazards (waits,
    conflicts) are between memory, not between names."""
    if binding not in IN_PLACE_BINDINGS:
        return lambda loc: loc
    return _Layout(schedule, in_place=True).storage


def lockstep_phases(phases, schedule):
    """The indices of the phases of an IN_PLACE_LOCKSTEP plan that need
    lockstep groups: those the plain in-place rule refuses."""
    plain = _Layout(schedule, in_place=True)
    return frozenset(p for p, phase in enumerate(phases) if plain.run([phase]) is None)


def _last_results_in_output(phases):
    """The plain plan with each result chunk's last write sent to OUTPUT,
    and its copy out left out, where no move reads the chunk in a later
    phase (a move reads its sources before the phase writes: a read in the
    same phase is of the value before, which stays in the workspace)."""
    copy_in, *steps, copy_out = phases
    output_of = {m.srcs[0]: m.dst for m in copy_out}
    last_write, last_read = {}, {}
    for p, step in enumerate(steps):
        for m in step:
            last_write[m.dst] = p
            for src in m.srcs:
                last_read[src] = p
    direct = {loc for loc, p in last_write.items() if loc in output_of and last_read.get(loc, -1) <= p}
    rewritten = [[m._replace(dst=output_of[m.dst]) if m.dst in direct and last_write[m.dst] == p else m
                  for m in step] for p, step in enumerate(steps)]
    return [copy_in, *rewritten, [m for m in copy_out if m.srcs[0] not in direct]]


def _without_copies_of_untouched_input(phases):
    """The plain plan less each copy out whose source WORK chunk no step
    wrote since the copy in filled it from the same chunk of INPUT: in
    place, OUTPUT's chunk is that INPUT chunk, which holds the value."""
    copy_in, *steps, copy_out = phases
    written = {m.dst for step in steps for m in step}
    loaded_from = {m.dst: m.srcs[0] for m in copy_in}

    def untouched_input(m):
        src = m.srcs[0]
        return src not in written and loaded_from.get(src) == Loc(m.dst.rank, INPUT, m.dst.chunk)
    return [copy_in, *steps, [m for m in copy_out if not untouched_input(m)]]


def _straight_from_input(phases):
    """The plan with each copy of a rank's own WORK chunk that only the copy
    in wrote taken straight from that INPUT chunk, and each copy in that
    nothing reads then left out: a block no peer reads (a gather's root's
    own, all_to_all's own) costs one copy where it cost two."""
    copy_in, *later = phases
    written = {m.dst for phase in later for m in phase}
    loaded_from = {m.dst: m.srcs[0] for m in copy_in}

    def straight(m):
        src = m.srcs[0]
        if m.kind == COPY_OP and src.rank == m.rank and src in loaded_from and src not in written:
            return m._replace(srcs=(loaded_from[src],))
        return m
    later = [[straight(m) for m in phase] for phase in later]
    read = {src for phase in later for m in phase for src in m.srcs}
    return [[m for m in copy_in if m.dst in read], *later]


def _straight_copies_first(phases):
    """The plan with its copies from INPUT to OUTPUT moved into phase 0,
    beside the copies in: a rank's own block moves while its peers copy
    theirs in."""
    copy_in, *later = phases

    def straight(m):
        return m.kind == COPY_OP and m.dst.buffer == OUTPUT and all(src.buffer == INPUT for src in m.srcs)
    return [copy_in + [m for phase in later for m in phase if straight(m)],
            *[[m for m in phase if not straight(m)] for phase in later]]


def _without_round_trips(phases, layout):
    """`phases` less each chunk's round trip: a step's copy of a chunk into
    the workspace whose copy out goes back into the very memory it came
    from (in place: all_to_all's own block, which RESULT_IN_WORKSPACE
    sends through SCRATCH and back). Kept only where the symbolic run
    finds the same result (the chunk unchanged in between, the workspace
    copy read by nothing else)."""
    *steps, final = phases
    copied_in = {m.dst: m for step in steps for m in step if m.kind == COPY_OP}
    trips = [(copied_in[m.srcs[0]], m) for m in final if m.kind == COPY_OP and m.srcs[0] in copied_in
             and layout.storage(copied_in[m.srcs[0]].srcs[0]) == layout.storage(m.dst)]
    if not trips:
        return phases
    dropped = {id(m) for trip in trips for m in trip}
    return [[m for m in phase if id(m) not in dropped] for phase in phases]


def _rewrite(phases, schedule, policy, layout):
    copy_in, *steps, copy_out = phases
    outputs = {Loc(r, schedule.result_buffer, c) for r in range(schedule.nranks) for c in schedule.output_chunks(r)}
    last_write = {m.dst: p for p, step in enumerate(steps) for m in step}
    read_by_peers = {src for step in steps for m in step for src in m.srcs if src.rank != m.rank}
    home = {m.dst: m.srcs[0] for m in copy_in}  # logical chunk -> where its value is now

    def destination(loc, p):
        if loc in outputs and (policy == RESULT_IN_OUTPUT or (policy == LAST_WRITE_IN_OUTPUT and last_write[loc] == p)
                               or (policy == RESULT_IN_OUTPUT_UNLESS_PEERS_READ and loc not in read_by_peers)):
            return Loc(loc.rank, OUTPUT, loc.chunk)
        return loc

    rewritten = [[]]
    for p, step in enumerate(steps):
        moves = [Move(m.kind, destination(m.dst, p), tuple(home.get(s, s) for s in m.srcs)) for m in step]
        home.update((m.dst, bound.dst) for m, bound in zip(step, moves))
        rewritten.append(moves)
    final = []
    for m in copy_out:
        src = home.get(m.srcs[0], m.srcs[0])
        if layout.storage(src) != layout.storage(m.dst):
            final.append(Move(COPY_OP, m.dst, (src,)))
    rewritten.append(final)
    return rewritten


class _Layout:
    """The caller's arrays as chunks, for the symbolic run."""

    def __init__(self, schedule, in_place, lockstep=False):
        n, chunks = schedule.nranks, range(schedule.nchunks)
        self.inputs = {Loc(r, INPUT, c) for r in range(n)
                       for c in ((r,) if schedule.collective in (ALLGATHER, GATHER) else chunks)}
        self.outputs = {Loc(r, OUTPUT, c) for r in range(n)
                        for c in ((r,) if schedule.collective in (REDUCE_SCATTER, SCATTER) else chunks)}
        self.in_place, self.lockstep = in_place, lockstep

    def storage(self, loc):
        """The memory a chunk lives in: in place, an OUTPUT chunk that the
        input also has is that INPUT chunk."""
        if self.in_place and loc.buffer == OUTPUT and Loc(loc.rank, INPUT, loc.chunk) in self.inputs:
            return Loc(loc.rank, INPUT, loc.chunk)
        return loc

    def run(self, phases):
        """What every caller's chunk holds after `phases`, or None if a phase
        has a write-write or read-write conflict between its moves (with
        lockstep, a read-write conflict between groups, or one inside groups
        of unequal sizes). Every read of a phase sees the values from before
        it: also what a lockstep group reads where it writes."""
        state = {self.storage(loc): ("before the call", loc) for loc in self.inputs | self.outputs}
        for phase in phases:
            written, writer_group, reads, group_sizes = {}, {}, [], {}
            for m in phase:
                dst = self.storage(m.dst)
                srcs = [self.storage(s) for s in m.srcs]
                values = [state.get(s, ("never written", s)) for s in srcs]
                if dst in written:
                    return None
                written[dst] = values[0] if m.kind == COPY_OP else (m.kind, tuple(values))
                group = (m.kind, tuple(srcs))   # what the executor's fan-out groups by
                writer_group[dst] = group
                group_sizes[group] = group_sizes.get(group, 0) + 1
                reads.extend((s, group) for s in srcs if s != dst)
            overwritten = [(s, group) for s, group in reads if s in written]
            if overwritten and not (self.lockstep and all(writer_group[s] == group for s, group in overwritten)
                                    and len(set(group_sizes.values())) == 1):
                return None
            state.update(written)
        return {loc: state[loc] for loc in map(self.storage, self.inputs | self.outputs)}
