"""CPU model of the device flag protocol in docs/device-protocol.md.

A one-shot allreduce, one kernel per call, called `calls` times; call g
(1, 2, ...) is the generation and uses slot set s = g % 2. Every rank owns, in
memory all ranks map:

    slot[owner][s][block][i]   the owner's input chunk for `block`, element i
    ready[owner][s][block]     generation whose chunk is complete in that slot
    done[reader][s][block]     generation of set s the reader has finished reading

and each (rank, block) runs, per call (docs/device-protocol.md explains why):

    1. wait until every peer's done[q][s][b] >= g - 2  (slot s is free again)
    2. store the chunk into slot[r][s][b]               (plain stores)
    3. ready[r][s][b] = g                               (release)
    4. wait until every peer's ready[q][s][b] >= g      (acquire)
    5. read slot[q][s][b] of every rank q, sum in rank order 0..n-1
    6. done[r][s][b] = g                                (release)

After its last call a rank retires its slots (frees them, regrows them or
hands them to a different layout): it first waits until every peer's done
covers the last generation of both sets, then overwrites them with poison.

Each (rank, block), and each rank's retirement, is a generator that yields
before every shared-memory operation. WeakMemoryRun picks the next operation
at random (a seeded scheduler: random interleavings stand for random delays)
and models the memory ordering, not just the interleaving:

    * a plain or relaxed store goes into the thread's store buffer and
      becomes visible to the others at a random later point, in any order
      with its other pending stores (stores to one location stay in order);
    * a release store first makes every earlier store of its thread visible,
      then itself;
    * a load sees the visible value, or the thread's own latest pending store.

Simplification on the reader side: loads are never reordered, so every load
behaves like an acquire. The model therefore cannot catch a missing acquire on
the flag load; the doc's rule (ld.acquire, or a fence after the load) has to.

Invariants, checked on every operation (a violation stops the run):

    (a) READ_BEFORE_COMPLETE  every element a reader takes from slot s carries
        this generation's tag: never an unwritten, stale or half-written chunk;
    (b) OVERWRITE_WHILE_READ  nobody stores into a slot chunk while a reader
        that is between its step 4 and step 6 for another generation
        relies on it (and no reader ever sees a later generation or poison);
    (c) WRONG_RESULT  every rank's output is the rank-order sum of the inputs,
        bit for bit, so all ranks hold identical results;
    (d) DEADLOCK  every run finishes: if no thread can move and no store is
        pending, the run reports the blocked threads instead of hanging.

ThreadedRun drives the same generators from real threads (sequentially
consistent memory, random tiny sleeps, bounded spins, joins with timeouts).
MUTATIONS are broken variants the checks must catch.
"""

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import product

READ_BEFORE_COMPLETE = "read-before-complete"   # (a)
OVERWRITE_WHILE_READ = "overwrite-while-read"   # (b)
WRONG_RESULT = "wrong-result"                   # (c)
DEADLOCK = "deadlock"                           # (d)

GENERATION = "generation"                       # ready holds the call's generation g
BOOLEAN_RESET_BY_READERS = "boolean-reset-by-readers"   # ready is 0/1; each reader clears it after reading
BOOLEAN_RESET_BY_OWNER = "boolean-reset-by-owner"       # ready is 0/1; the owner clears it before rewriting

SLOT_SETS_ALLOCATED = 2   # memory always has two sets; a single-set protocol leaves set 1 unused
FREED = -1                # generation tag of the poison a retiring rank writes over its slots


@dataclass(frozen=True)
class Protocol:
    """One variant of the protocol; the defaults are the design."""
    slot_sets: int = 2                   # call g uses set g % slot_sets
    free_slot_lag: int = 2               # step 1 waits for done >= g - free_slot_lag
    wait_before_overwrite: bool = True   # step 1
    wait_before_retire: bool = True      # the same wait, for both sets, before the slots are retired
    ready_release: bool = True           # step 3 is a release store (else relaxed)
    ready_flags: str = GENERATION


DESIGN = Protocol()

MUTATIONS = {
    # (1) No alternation, step 1 unchanged: call g rewrites the set that
    # peers may still be reading for call g - 1.
    "single_slot_set": Protocol(slot_sets=1),
    # (2) ready may become visible before the chunk stores it announces.
    "relaxed_ready_store": Protocol(ready_release=False),
    # (3) 0/1 flags instead of generations, cleared after use. Cleared by the
    # readers: with two or more readers the first clears the flag before the
    # others saw it (lost wake-up). Cleared by the owner when it reclaims the
    # set: a fast peer takes the 1 left from two calls ago for this call.
    "boolean_ready_reset_by_readers": Protocol(ready_flags=BOOLEAN_RESET_BY_READERS),
    "boolean_ready_reset_by_owner": Protocol(ready_flags=BOOLEAN_RESET_BY_OWNER),
    # (4) Never wait for the slot to be free: neither in the call nor before
    # retiring the slots. Only the retirement can be caught: inside a sequence
    # of calls the wait is implied (IN_CALL_FREE_SLOT_WAIT_SKIPPED below).
    "no_wait_for_free_slot": Protocol(wait_before_overwrite=False, wait_before_retire=False),
}

# Correct variants that are not the design; they document two findings.
# One set is correct if step 1 waits for the previous call (g - 1): an
# all-peer wait on every call's critical path, which two sets make free.
SINGLE_SET_WAITING_FOR_PREVIOUS_CALL = Protocol(slot_sets=1, free_slot_lag=1)
# Within a sequence of calls, step 1 is implied by step 4 of the previous
# call (a peer publishes ready for g - 1 only after it finished reading
# g - 2); only retirement needs the done flags.
IN_CALL_FREE_SLOT_WAIT_SKIPPED = Protocol(wait_before_overwrite=False)


@dataclass(frozen=True)
class Shape:
    ranks: int
    blocks: int
    calls: int
    chunk_len: int   # plain stores per chunk: a torn chunk is observable when > 1


# Every combination, ranks varying fastest so that any prefix mixes them.
SHAPES = [Shape(ranks, blocks, calls, chunk_len)
          for calls, chunk_len, blocks, ranks in product(range(1, 7), range(1, 4), (1, 2), range(1, 5))]


class ProtocolViolation(Exception):
    def __init__(self, invariant, detail):
        super().__init__(f"{invariant}: {detail}")
        self.invariant, self.detail = invariant, detail


class Layout:
    """Flat indices of every shared location: slots, then ready, done, exited."""

    def __init__(self, shape):
        n, self.blocks, self.chunk_len = shape.ranks, shape.blocks, shape.chunk_len
        self.chunks = n * SLOT_SETS_ALLOCATED * shape.blocks        # one per (owner, set, block)
        self.ready_base = self.chunks * shape.chunk_len
        self.done_base = self.ready_base + self.chunks
        self.exited_base = self.done_base + self.chunks
        self.size = self.exited_base + n * shape.blocks

    def chunk(self, owner, s, block):
        return (owner * SLOT_SETS_ALLOCATED + s) * self.blocks + block

    def slot(self, owner, s, block, i):
        return self.chunk(owner, s, block) * self.chunk_len + i

    def ready(self, owner, s, block):
        return self.ready_base + self.chunk(owner, s, block)

    def done(self, reader, s, block):
        return self.done_base + self.chunk(reader, s, block)

    def exited(self, rank, block):
        """Set when the block's kernel returns: the host sees it through stream order."""
        return self.exited_base + rank * self.blocks + block

    def name(self, loc):
        if loc >= self.exited_base:
            return "exited[{}][{}]".format(*divmod(loc - self.exited_base, self.blocks))
        for base, flag in ((self.done_base, "done"), (self.ready_base, "ready")):
            if loc >= base:
                owner_and_set, block = divmod(loc - base, self.blocks)
                return "{}[{}][{}][{}]".format(flag, *divmod(owner_and_set, SLOT_SETS_ALLOCATED), block)
        chunk, i = divmod(loc, self.chunk_len)
        owner_and_set, block = divmod(chunk, self.blocks)
        return "slot[{}][{}][{}][{}]".format(*divmod(owner_and_set, SLOT_SETS_ALLOCATED), block, i)


def wait_at_least(run, tid, loc, threshold):
    """Spin on acquire loads until memory[loc] >= threshold.

    Yields (loc, threshold): the scheduler parks the thread until a load could
    succeed. The value may drop again before the thread runs (only the boolean
    mutations ever lower a flag), so the load is checked, not assumed.
    """
    if threshold <= 0:
        return   # flags start at 0: nothing to wait for before a set's first use
    while True:
        yield loc, threshold
        seen = run.load(tid, loc)
        if seen >= threshold:
            if seen > threshold and run.protocol.ready_flags == GENERATION:
                run.flags_ahead += 1
            return


def block_program(run, tid, rank, block):
    """Block `block` of rank `rank`: every call of the collective, in order."""
    shape, protocol, lay = run.shape, run.protocol, run.layout
    peers = [q for q in range(shape.ranks) if q != rank]
    generation_flags = protocol.ready_flags == GENERATION
    for g in range(1, shape.calls + 1):
        s = g % protocol.slot_sets

        # 1. Slot s is free: every peer finished reading the call that last used it.
        if protocol.wait_before_overwrite:
            for q in peers:
                yield from wait_at_least(run, tid, lay.done(q, s, block), g - protocol.free_slot_lag)
        if protocol.ready_flags == BOOLEAN_RESET_BY_OWNER:
            yield
            run.store(tid, lay.ready(rank, s, block), 0)

        # 2. The chunk, one plain store per element.
        for i in range(shape.chunk_len):
            yield
            run.store_slot(tid, rank, s, block, i, g)

        # 3. Publish it: the release makes the stores of step 2 visible first.
        ready_value = g if generation_flags else 1
        yield
        if protocol.ready_release:
            run.release_store(tid, lay.ready(rank, s, block), ready_value)
        else:
            run.store(tid, lay.ready(rank, s, block), ready_value)

        # 4. From here to step 6 this rank relies on slot s of every rank
        # holding generation g.
        run.start_reading(rank, s, block, g)
        for q in peers:
            yield from wait_at_least(run, tid, lay.ready(q, s, block), ready_value)

        # 5. Reduce in rank order, so that every rank computes the same bits.
        for i in range(shape.chunk_len):
            total = None
            for q in range(shape.ranks):
                yield
                x = run.load_slot(tid, q, s, block, i, rank, g)
                total = x if total is None else total + x
            run.outputs[rank][g, block, i] = total
        if protocol.ready_flags == BOOLEAN_RESET_BY_READERS:
            for q in peers:
                yield
                run.store(tid, lay.ready(q, s, block), 0)

        # 6. This rank no longer needs slot s of any rank for generation g.
        yield
        run.finish_reading(rank, s, block)
        run.release_store(tid, lay.done(rank, s, block), g)

    yield
    run.release_store(tid, lay.exited(rank, block), 1)


def retire_program(run, tid, rank):
    """After the rank's last kernel: free (or reuse, or regrow) its slots.

    The host knows its own kernel finished (stream order), but nothing
    follows the last call to say the peers finished reading: this is the
    step-1 wait once more, for the last generation of each set.
    """
    shape, protocol, lay = run.shape, run.protocol, run.layout
    for block in range(shape.blocks):
        yield from wait_at_least(run, tid, lay.exited(rank, block), 1)
    if protocol.wait_before_retire:
        for s in range(protocol.slot_sets):
            last = max((g for g in range(1, shape.calls + 1) if g % protocol.slot_sets == s), default=0)
            for q in range(shape.ranks):
                if q != rank:
                    for block in range(shape.blocks):
                        yield from wait_at_least(run, tid, lay.done(q, s, block), last)
    for s in range(protocol.slot_sets):
        for block in range(shape.blocks):
            for i in range(shape.chunk_len):
                yield
                run.store_slot(tid, rank, s, block, i, FREED)


class Run:
    """Shared memory, the invariant checks and the results of one run."""

    def __init__(self, shape, protocol, seed):
        self.shape, self.protocol, self.seed = shape, protocol, seed
        self.rng = random.Random(seed)
        self.layout = lay = Layout(shape)
        self.memory = [None] * lay.ready_base + [0] * (lay.size - lay.ready_base)
        # Per slot chunk: {reader rank: generation it relies on}, from its step 4 to its step 6.
        self.readers = [{} for _ in range(lay.chunks)]
        uniform = self.rng.uniform   # floats, so that a different summation order would show
        self.inputs = [[[[uniform(-1, 1) for _ in range(shape.chunk_len)] for _ in range(shape.blocks)]
                        for _ in range(shape.calls)] for _ in range(shape.ranks)]
        self.outputs = [{} for _ in range(shape.ranks)]
        self.reads_checked = self.writes_checked = 0
        # Waits that found a generation flag past the one they waited for. The
        # doc claims none do (ranks are at most one call apart), so `>=` and
        # `==` are the same test.
        self.flags_ahead = 0
        self.violation = None
        # Thread ids: rank * blocks + block for the blocks, then one retirer per rank.
        self.programs = [block_program(self, r * shape.blocks + b, r, b)
                         for r in range(shape.ranks) for b in range(shape.blocks)]
        self.programs += [retire_program(self, len(self.programs) + r, r) for r in range(shape.ranks)]

    def describe(self, tid):
        blocks = self.shape.blocks
        if tid < self.shape.ranks * blocks:
            return f"rank {tid // blocks} block {tid % blocks}"
        return f"rank {tid - self.shape.ranks * blocks} retirement"

    # Invariant bookkeeping ------------------------------------------------

    def start_reading(self, reader, s, block, g):
        for owner in range(self.shape.ranks):
            self.readers[self.layout.chunk(owner, s, block)][reader] = g

    def finish_reading(self, reader, s, block):
        for owner in range(self.shape.ranks):
            del self.readers[self.layout.chunk(owner, s, block)][reader]

    def store_slot(self, tid, owner, s, block, i, g):
        """Invariant (b), writer side: a store into a chunk someone relies on
        for a different generation."""
        self.writes_checked += 1
        for reader, relied_on in self.readers[self.layout.chunk(owner, s, block)].items():
            if relied_on != g:
                what = "poison (retiring)" if g == FREED else f"generation {g}"
                raise ProtocolViolation(
                    OVERWRITE_WHILE_READ,
                    f"{self.describe(tid)} stores {what} into its set {s} chunk {block}[{i}] "
                    f"while rank {reader} still reads generation {relied_on} from it")
        value = float("nan") if g == FREED else self.inputs[owner][g - 1][block][i]
        self.store(tid, self.layout.slot(owner, s, block, i), (owner, g, block, i, value))

    def load_slot(self, tid, owner, s, block, i, reader, g):
        """Invariant (a), and (b) as the reader sees it: the element is this
        generation's, written by its owner for this place."""
        self.reads_checked += 1
        x = self.load(tid, self.layout.slot(owner, s, block, i))
        if x is not None and x[:4] == (owner, g, block, i):
            return x[4]
        where = f"rank {reader} (generation {g}) reads rank {owner} set {s} chunk {block}[{i}]"
        if x is None:
            raise ProtocolViolation(READ_BEFORE_COMPLETE, f"{where}: never written yet")
        if x[1] == FREED:
            raise ProtocolViolation(OVERWRITE_WHILE_READ, f"{where}: already poisoned by its retirement")
        if x[1] > g:
            raise ProtocolViolation(OVERWRITE_WHILE_READ, f"{where}: already overwritten by generation {x[1]}")
        raise ProtocolViolation(READ_BEFORE_COMPLETE, f"{where}: still holds {x[:4]}")

    def check_results(self):
        """Invariant (c): the rank-order sum, identical on every rank."""
        shape = self.shape
        for g, block, i in product(range(1, shape.calls + 1), range(shape.blocks), range(shape.chunk_len)):
            expected = self.inputs[0][g - 1][block][i]
            for q in range(1, shape.ranks):
                expected += self.inputs[q][g - 1][block][i]
            for rank in range(shape.ranks):
                got = self.outputs[rank].get((g, block, i))
                if got != expected:
                    raise ProtocolViolation(
                        WRONG_RESULT, f"rank {rank} call {g} chunk {block}[{i}]: {got!r}, expected {expected!r}")


class WeakMemoryRun(Run):
    """One randomized interleaving, with store buffers (see the module doc)."""

    def __init__(self, shape, protocol, seed):
        super().__init__(shape, protocol, seed)
        self.buffers = [[] for _ in self.programs]   # pending (loc, value), in program order
        self.draining = []                           # threads whose buffer is not empty
        self.runnable = list(range(len(self.programs)))
        self.waiters = {}                            # loc -> [(tid, threshold)]
        self.steps = 0

    def store(self, tid, loc, value):
        """Plain or relaxed store: visible to the others some time later."""
        buf = self.buffers[tid]
        if not buf:
            self.draining.append(tid)
        buf.append((loc, value))

    def release_store(self, tid, loc, value):
        buf = self.buffers[tid]
        if buf:
            for pending_loc, pending_value in buf:
                self.make_visible(pending_loc, pending_value)
            buf.clear()
            self.draining.remove(tid)
        self.make_visible(loc, value)

    def load(self, tid, loc):
        for pending_loc, pending_value in reversed(self.buffers[tid]):
            if pending_loc == loc:
                return pending_value
        return self.memory[loc]

    def make_visible(self, loc, value):
        self.memory[loc] = value
        waiting = self.waiters.get(loc)
        if waiting:
            still = [(tid, threshold) for tid, threshold in waiting if value < threshold]
            self.runnable.extend(tid for tid, threshold in waiting if value >= threshold)
            self.waiters[loc] = still

    def drain_one(self, tid):
        """The memory system makes one pending store of `tid` visible."""
        buf = self.buffers[tid]
        loc = buf[int(self.rng.random() * len(buf))][0]
        k = next(k for k, (pending_loc, _) in enumerate(buf) if pending_loc == loc)  # oldest to that location
        self.make_visible(*buf.pop(k))
        if not buf:
            self.draining.remove(tid)

    def execute(self):
        programs, runnable, draining = self.programs, self.runnable, self.draining
        rand = self.rng.random
        unfinished = len(programs)
        try:
            while True:
                moves = len(runnable) + len(draining)
                if moves == 0:
                    break
                k = int(rand() * moves)
                self.steps += 1
                if k >= len(runnable):
                    self.drain_one(draining[k - len(runnable)])
                    continue
                tid = runnable[k]
                try:
                    wait = next(programs[tid])
                except StopIteration:
                    runnable[k] = runnable[-1]
                    runnable.pop()
                    unfinished -= 1
                    continue
                if wait is not None and self.memory[wait[0]] < wait[1]:
                    runnable[k] = runnable[-1]
                    runnable.pop()
                    self.waiters.setdefault(wait[0], []).append((tid, wait[1]))
            if unfinished:
                blocked = [f"{self.describe(tid)} waits for {self.layout.name(loc)} >= {threshold}"
                           for loc, waiting in self.waiters.items() for tid, threshold in waiting]
                raise ProtocolViolation(DEADLOCK, "; ".join(blocked))
            self.check_results()
        except ProtocolViolation as violation:
            self.violation = violation
        return self


class ThreadedRun(Run):
    """The same programs on real threads: one per (rank, block) and per
    retirement. Memory is sequentially consistent: each step (one shared
    operation) runs under a lock; between steps a thread sleeps a random tiny
    time, and a wait spins with backoff until a bound, like the device's."""

    def store(self, tid, loc, value):
        self.memory[loc] = value

    release_store = store

    def load(self, tid, loc):
        return self.memory[loc]

    def execute(self, spin_timeout=5.0, join_timeout=10.0):
        step_lock = threading.Lock()
        stop = threading.Event()
        crashes = []

        def report(violation):
            with step_lock:
                if self.violation is None:
                    self.violation = violation
            stop.set()

        def drive(tid):
            program, delays = self.programs[tid], random.Random(self.seed * 7919 + tid)
            try:
                while not stop.is_set():
                    with step_lock:
                        wait = next(program)
                    if wait is None:
                        time.sleep(delays.choice((0, 0, 0, 1e-6, 2e-5)))
                        continue
                    loc, threshold = wait
                    deadline, backoff = time.monotonic() + spin_timeout, 0.0
                    while self.memory[loc] < threshold and not stop.is_set():
                        if time.monotonic() > deadline:
                            raise ProtocolViolation(
                                DEADLOCK, f"{self.describe(tid)} waited {spin_timeout} s for "
                                f"{self.layout.name(loc)} >= {threshold}")
                        time.sleep(backoff)
                        backoff = min(2 * backoff or 1e-6, 1e-3)
            except StopIteration:
                pass
            except ProtocolViolation as violation:
                report(violation)
            except BaseException as error:   # a bug in the model: re-raised below, not a verdict
                crashes.append(error)
                stop.set()

        threads = [threading.Thread(target=drive, args=(tid,), daemon=True) for tid in range(len(self.programs))]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + join_timeout
        for tid, thread in enumerate(threads):
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                report(ProtocolViolation(DEADLOCK, f"{self.describe(tid)} still running after {join_timeout} s"))
        if crashes:
            raise crashes[0]
        if self.violation is None:
            try:
                self.check_results()
            except ProtocolViolation as violation:
                self.violation = violation
        return self


@dataclass
class Finding:
    run_index: int   # 0-based: how many runs came before it
    shape: Shape
    seed: int
    invariant: str
    detail: str


@dataclass
class Summary:
    runs: int = 0
    violations: Counter = field(default_factory=Counter)   # invariant -> runs that broke it
    first: Finding = None
    shapes: set = field(default_factory=set)
    reads_checked: int = 0
    writes_checked: int = 0
    flags_ahead: int = 0


def explore(protocol, runs, seed=0, stop_at_first=False, threaded=False, shapes=SHAPES, **execute_options):
    """Run `runs` randomized runs, cycling through `shapes`; run k uses seed
    seed * 1_000_003 + k, so a finding is replayed by its shape and seed."""
    summary = Summary()
    for k in range(runs):
        shape, run_seed = shapes[k % len(shapes)], seed * 1_000_003 + k
        run = (ThreadedRun if threaded else WeakMemoryRun)(shape, protocol, run_seed).execute(**execute_options)
        summary.runs += 1
        summary.shapes.add(shape)
        summary.reads_checked += run.reads_checked
        summary.writes_checked += run.writes_checked
        summary.flags_ahead += run.flags_ahead
        if run.violation is not None:
            summary.violations[run.violation.invariant] += 1
            if summary.first is None:
                summary.first = Finding(k, shape, run_seed, run.violation.invariant, run.violation.detail)
            if stop_at_first:
                break
    return summary
