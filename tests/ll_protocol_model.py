"""CPU model of the LL one-shot collectives (kernels/ll_allreduce.cu,
docs/device-protocol.md), with weak memory and random interleavings.

The emulated device runs the kernel itself (tests/test_ll_kernel.py), but
its threads run one after another and x86 keeps stores in order, so some
races cannot happen there. This model lets them: every thread of every rank
is a generator that yields before each shared-memory operation, a seeded
scheduler picks the next one at random, and stores sit in a per-thread
store buffer until the memory system makes them visible, in any order (one
location's stores stay in order; a release store first makes the thread's
earlier stores visible). Loads are never reordered (a missing acquire is the
kernel's comments' business, not this model's).

A 64-bit word is one location holding (flag, data): a line is two of them,
each stored whole. Per call g (1, 2, ...) with `lines[g]` lines (the same on
every rank, varying between calls, fewer than the threads at times), thread
t of rank r runs the kernel's three steps on lines t, t + T, ... (g and
lines[g - 1] are the thread's own record of its calls, as the kernel's
per-thread state words are: every thread runs in every call, so the loop's
count is that word; its step 0 touches nothing another thread reads):

    1. g >= 2: wait until each peer's line (t mod lines[g - 1]) of set
       (g - 1) % 2 has flag g - 1, or g + 1
    2. store its lines of set g % 2: words (g, data)
    3. per line, for each rank q it reads, in rank order: wait until both
       words of q's line have flag g, add the data; record the output

Each call is, at random, an allreduce (every rank reads every rank, as
allgather and reduce_scatter do too), a broadcast (every rank reads the
root) or a reduce (the root reads every rank, the others nobody): ranks
that read nobody, or only the root, run ahead of the others, which is what
step 1's "or g + 1" and step 1 itself are for.

Between calls a rank's threads meet (stream order: call g + 1 starts after
every thread of call g returned, its stores visible). Invariants, checked
on every operation:

    (a) READ_BEFORE_COMPLETE  a word taken with flag g holds call g's data
        for that owner, line and word;
    (b) OVERWRITE_WHILE_READ  a waiter never finds a later call's flag in
        the line it waits for (its call's data is gone);
    (c) WRONG_RESULT          every output is the rank-order sum (the
                              root's data, for a broadcast);
    (d) DEADLOCK              reported, never hung.

MUTATIONS are broken variants; the tests expect each to be caught.
"""

import random
from collections import Counter
from dataclasses import dataclass, field
from itertools import product

READ_BEFORE_COMPLETE = "read-before-complete"
OVERWRITE_WHILE_READ = "overwrite-while-read"
WRONG_RESULT = "wrong-result"
DEADLOCK = "deadlock"

WORDS = 2   # 64-bit words per line
# What a thread yields before its next operation: None before one that
# changes memory (or ends a call), LOOK before a load, SPIN after a wait
# found nothing new. A thread that spun runs again only once something
# changed, so a run where every thread spins and no store is pending is a
# deadlock, found at once.
LOOK, SPIN = "look", "spin"


@dataclass(frozen=True)
class Protocol:
    slot_sets: int = 2              # call g uses set g % slot_sets
    reuse_wait: bool = True         # step 1
    flag_with_data: bool = True     # each word carries its flag (else: data words, then a separate flag word)
    stream_order: bool = True       # a rank's call g + 1 starts after its call g finished
    next_call_in_step1: bool = True  # step 1 also takes a peer's line of call g + 1
    kinds: tuple = ("allreduce", "broadcast", "reduce")   # what a call may be


DESIGN = Protocol()
MUTATIONS = {
    # One set: a fast rank rewrites the lines a slow peer still waits to read.
    "one_slot_set": Protocol(slot_sets=1),
    # The flag in a word of its own, stored (relaxed) after the data words:
    # the data may become visible after it.
    "flag_apart_from_data": Protocol(flag_with_data=False),
    # A rank's calls overlap (two streams, no event between them): step 1's
    # "a peer that wrote call g - 1 finished g - 2" no longer holds.
    "calls_overlap": Protocol(stream_order=False),
    # Step 1 waits for F(g - 1) only: a peer that read nobody in call g (a
    # broadcast's root, a reduce's other ranks) may have stored call g + 1
    # there already (the real kernel would wait until its timeout).
    "step1_without_next_call": Protocol(next_call_in_step1=False),
    # No step 1: such a peer runs two calls ahead and rewrites lines a
    # slower rank still has to read.
    "no_reuse_wait": Protocol(reuse_wait=False),
}
# Correct, not the design: with allreduces only (every rank reads every
# rank), step 1 is implied by stream order and the previous call's reads.
NO_REUSE_WAIT = Protocol(reuse_wait=False, kinds=("allreduce",))


@dataclass(frozen=True)
class Shape:
    ranks: int
    threads: int
    calls: int
    max_lines: int


SHAPES = [Shape(ranks, threads, calls, max_lines)
          for calls, max_lines, threads, ranks in product(range(1, 7), (1, 2, 4), (1, 2, 3), range(1, 5))]


class ProtocolViolation(Exception):
    def __init__(self, invariant, detail):
        super().__init__(f"{invariant}: {detail}")
        self.invariant, self.detail = invariant, detail


class Run:
    def __init__(self, shape, protocol, seed):
        self.shape, self.protocol, self.rng = shape, protocol, random.Random(seed)
        n, calls = shape.ranks, shape.calls
        self.lines = [0] + [self.rng.randint(1, shape.max_lines) for _ in range(calls)]   # per call, 1-based
        self.kind = [None] + [self.rng.choice(protocol.kinds) for _ in range(calls)]
        self.root = [None] + [self.rng.randrange(n) for _ in range(calls)]
        self.inputs = {(r, g, i, w): self.rng.uniform(-1, 1)
                       for r in range(n) for g in range(1, calls + 1) for i in range(self.lines[g]) for w in range(WORDS)}
        self.memory = {}        # location -> value; a missing line word reads (0, None)
        self.buffers = {}       # thread -> [(location, value)] pending, in program order
        self.outputs = {}
        self.finished = {r: 0 for r in range(n)}   # threads of rank r done with its current call
        self.call_of = {r: 1 for r in range(n)}    # the call rank r's threads may run (stream order)
        self.reads = 0
        self.version = 0        # counts changes others can see: a spinning thread waits for the next
        self.programs = {(r, t): self.thread(r, t) for r in range(n) for t in range(shape.threads)}

    # -- memory ---------------------------------------------------------------------

    def word(self, owner, s, i, w):
        return ("word", owner, s, i, w)

    def flag(self, owner, s, i):
        return ("flag", owner, s, i)

    def store(self, tid, loc, value):
        self.buffers.setdefault(tid, []).append((loc, value))

    def release(self, tid):
        for loc, value in self.buffers.pop(tid, []):
            self.memory[loc] = value
        self.version += 1

    def load(self, tid, loc):
        for pending, value in reversed(self.buffers.get(tid, [])):
            if pending == loc:
                return value
        return self.memory.get(loc, (0, None))

    def drain_one(self):
        tid = self.rng.choice([t for t, b in self.buffers.items() if b])
        buf = self.buffers[tid]
        loc = buf[self.rng.randrange(len(buf))][0]
        k = next(k for k, (pending, _) in enumerate(buf) if pending == loc)   # that location's oldest
        self.memory[loc] = buf.pop(k)[1]
        self.version += 1

    # -- the kernel -----------------------------------------------------------------------

    def wait_line(self, tid, owner, s, i, g):
        """Spin until owner's line i has flag g (both words); its words."""
        while True:
            if self.protocol.flag_with_data:
                data = []
                for w in range(WORDS):
                    yield LOOK
                    data.append(self.load(tid, self.word(owner, s, i, w)))
                flags = {flag for flag, _ in data}
            else:   # the flag first, then the data words it announces
                yield LOOK
                flags = {self.load(tid, self.flag(owner, s, i))[0]}
                data = None
            if any(flag > g for flag in flags):
                raise ProtocolViolation(OVERWRITE_WHILE_READ, f"{tid} waits for rank {owner} line {i} of set {s} "
                                        f"at call {g} and finds flags {sorted(flags)}")
            if flags == {g}:
                if data is None:
                    data = []
                    for w in range(WORDS):
                        yield LOOK
                        data.append((g, self.load(tid, self.word(owner, s, i, w))[1]))
                return data
            yield SPIN

    def thread(self, r, t):
        shape, protocol = self.shape, self.protocol
        tid = (r, t)
        for g in range(1, shape.calls + 1):
            if protocol.stream_order:
                while self.call_of[r] < g:
                    yield SPIN
            lines, s = self.lines[g], g % protocol.slot_sets
            mine = range(t, lines, shape.threads)
            if mine and g >= 2 and protocol.reuse_wait:
                probe, previous = t % self.lines[g - 1], (g - 1) % protocol.slot_sets
                for q in range(shape.ranks):
                    if q != r:
                        while True:
                            yield LOOK
                            flag, _ = self.load(tid, self.word(q, previous, probe, 0) if protocol.flag_with_data
                                                else self.flag(q, previous, probe))
                            if flag == g - 1 or flag == g + 1 and protocol.next_call_in_step1:
                                break
                            if flag > g - 1:
                                raise ProtocolViolation(OVERWRITE_WHILE_READ, f"{tid} step 1 of call {g} finds "
                                                        f"rank {q}'s line {probe} at {flag}")
                            yield SPIN
            for i in mine:
                for w in range(WORDS):
                    yield
                    value = (r, g, i, w, self.inputs[(r, g, i, w)])
                    self.store(tid, self.word(r, s, i, w), (g, value) if protocol.flag_with_data else (0, value))
                if not protocol.flag_with_data:
                    yield
                    self.store(tid, self.flag(r, s, i), (g, None))
            for i in mine:
                totals = [None] * WORDS
                for q in self.read_by(r, g):
                    data = yield from self.wait_line(tid, q, s, i, g)
                    for w, (_, value) in enumerate(data):
                        self.reads += 1
                        if value is None or value[:4] != (q, g, i, w):
                            raise ProtocolViolation(READ_BEFORE_COMPLETE, f"{tid} at call {g} takes rank {q}'s "
                                                    f"line {i} word {w} with flag {g}, holding {value}")
                        totals[w] = value[4] if totals[w] is None else totals[w] + value[4]
                if totals[0] is not None:
                    for w in range(WORDS):
                        self.outputs[(r, g, i, w)] = totals[w]
            # The kernel returns: its stores are visible before the next call on the stream.
            yield
            self.release(tid)
            self.finished[r] += 1
            if self.finished[r] == shape.threads:
                self.finished[r] = 0
                self.call_of[r] = g + 1
                self.version += 1

    def read_by(self, r, g):
        """The ranks whose lines rank r reads in call g, in rank order."""
        kind, root = self.kind[g], self.root[g]
        if kind == "broadcast":
            return [root]
        if kind == "reduce" and r != root:
            return []
        return range(self.shape.ranks)

    # -- the scheduler ------------------------------------------------------------------

    def execute(self, max_steps=200_000):
        try:
            live = dict(self.programs)
            spun_at = {}     # thread -> memory version its last failed wait saw: it waits for a change
            looked_at = {}   # thread -> memory version at the first load of its current wait
            last = {}        # thread -> what it yielded last
            for _ in range(max_steps):
                if not live:
                    break
                pending = any(self.buffers.values())
                runnable = [tid for tid in live if spun_at.get(tid) != self.version]
                if not runnable and not pending:
                    raise ProtocolViolation(DEADLOCK, f"threads {sorted(live)} wait on each other")
                if pending and (not runnable or self.rng.random() < 0.3):
                    self.drain_one()
                    continue
                tid = self.rng.choice(runnable)
                if last.get(tid) is LOOK:
                    looked_at.setdefault(tid, self.version)   # the load runs now
                try:
                    step = last[tid] = next(live[tid])
                except StopIteration:
                    del live[tid]
                    continue
                if step is SPIN:   # nothing it loaded changed since: sleep until something does
                    spun_at[tid] = looked_at.pop(tid, self.version)
                elif step is None:
                    looked_at.pop(tid, None)
            else:
                raise ProtocolViolation(DEADLOCK, f"no end after {max_steps} steps")
            self.check_results()
            self.violation = None
        except ProtocolViolation as violation:
            self.violation = violation
        return self

    def check_results(self):
        shape = self.shape
        for g in range(1, shape.calls + 1):
            for i, w in product(range(self.lines[g]), range(WORDS)):
                want = self.inputs[(0, g, i, w)]
                for q in range(1, shape.ranks):
                    want += self.inputs[(q, g, i, w)]
                if self.kind[g] == "broadcast":
                    want = self.inputs[(self.root[g], g, i, w)]
                for r in range(shape.ranks):
                    if self.kind[g] == "reduce" and r != self.root[g]:
                        continue   # only the root receives
                    if self.outputs.get((r, g, i, w)) != want:
                        raise ProtocolViolation(WRONG_RESULT, f"rank {r} call {g} line {i} word {w}")


@dataclass
class Summary:
    runs: int = 0
    violations: Counter = field(default_factory=Counter)
    first: tuple = None        # (run index, shape, seed, invariant, detail)
    reads: int = 0
    shapes: set = field(default_factory=set)


def explore(protocol, runs, seed=0, stop_at_first=False, shapes=SHAPES):
    summary = Summary()
    for k in range(runs):
        shape, run_seed = shapes[k % len(shapes)], seed * 1_000_003 + k
        run = Run(shape, protocol, run_seed).execute()
        summary.runs += 1
        summary.reads += run.reads
        summary.shapes.add(shape)
        if run.violation is not None:
            summary.violations[run.violation.invariant] += 1
            if summary.first is None:
                summary.first = (k, shape, run_seed, run.violation.invariant, run.violation.detail)
            if stop_at_first:
                break
    return summary

