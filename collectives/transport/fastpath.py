"""The five collectives of host ranks in separate processes, in the compiled loop.

The compiled plan executor (executors/host_process.py) runs any plan, but a
plan of ranks in processes copies each rank's input into its workspace and
takes a few microseconds of Python per call. For calls with `auto`, host
ranks take this path instead: the compiled loop (_shmloop.c) over a channel
of shared memory at the end of the control segment (layout.py), per rank

    small slots   2 x (128 unused bytes + small_max bytes): a message of up
                  to small_max bytes is one merged step: copy in, publish,
                  wait once, take this rank's share of every rank's slot
                  (the row's SMALL_SIG slot of the parity names the call, so
                  mismatched calls are caught);
    staging       2 x nranks chunks of `chunk` bytes: a larger allreduce is a
                  pipelined reduce-scatter and all-gather, chunk by chunk,
                  with per-chunk counters (rows' STAGED and REDUCED slots);
                  the other four move a larger message segment by segment,
                  each segment a merged step.

Every collective is its `direct` algorithm: rank r reads, of every rank it
needs, the part of its input it needs (reduce_scatter: block r; broadcast:
the root's; reduce: the root reads all), and folds in rank order or copies.
So the bits equal the `direct` plan's on every rank, in place and out of
place (tests/test_fastpath.py compares them).

Where it can, a large message skips staging (the single copy), and that
is the plans' (the loop declines it: its step_for answers PLANS): they
read peers' inputs straight into their outputs (process_vm_readv) and
push into peers' outputs (process_vm_writev) (ShmRank's single-copy
plans; a node's step across nodes too, HierarchyRanks.plans_step). The
single copy needs every rank to be allowed to read and write every other's
memory (the same user; Yama's ptrace_scope 0, or 1 with ranks that are
each other's ancestors; no seccomp rule against it): the ranks find out as
the communicator starts (ShmRank._learn_reach), and where any may not, the
plans hand the refusal to the loop (`refuse_single_copy`), which stages
every large message from then on (`FastCollectives.large_path` says
which). Since the plans' pushes write into a rank's output, a call of the
loop that fails aborts the communicator and then waits until no peer is
writing (`_shmloop.c`'s fence) before it raises.

Calls advance COUNTER by 2 and SEQ by 1 like any other call
(protocol.py), so loop and plan calls mix freely. The loop takes
float32/float64 and 8- to 64-bit integers, C-contiguous NumPy arrays, any
op (an output that partly overlaps its input is taken too: the loop reads
a private copy of x), with `auto` or naming the algorithm its step is (runs_as);
everything else (float16, bfloat16, lists, another algorithm) declines
to the checks and the plans, which the
compiled plan executor or the interpreter runs. Without the compiled loop
there is no fast path.
"""

import os
import weakref

import numpy as np

from ..ops import ReduceOp, as_dtype
from ..config import (DEFAULT_STAGED_MAX, STAGED_MAX_ENV, resolve_fast_path, resolve_fast_single_copy,
                      resolve_loop_tunables)
from . import probe
from .failures import abort_fence_and_raise, raise_wait_failure
from .layout import HEADER, ROW, small_area

try:
    from . import _shmloop
except ImportError:   # installed without a C compiler: the interpreter runs every call
    _shmloop = None

# Large messages take the single copy where every rank can reach every
# other's memory, but up to the channel's staged_max per rank (_shmloop.c's
# stages_anyway; allgather and broadcast only where the machine's
# processes have a core each: copies_stage), oversubscribed allgathers up to
# their own limit (stages_spread), and everything with
# COLLECTIVES_FAST_SINGLE_COPY=0
# (config.resolve_fast_single_copy, read when a communicator is made):
# those take the staged pipeline. Which is faster depends on how fast the
# machine's process_vm_readv is against memcpy, by 2 to 3 times either way
# (config.py, DEFAULT_STAGED_MAX), so the ranks measure it on a fold when
# the communicator starts (choose_staged_max), unless $COLLECTIVES_STAGED_MAX
# pins it: calls of PROBE_BYTES a rank both ways, alternating, the slowest
# rank's median of each way deciding alike on every rank (probe.py): the
# communicator's allreduce (past staged_max the plans' single copy, up to it
# the loop's staging), or a node's reduce_scatter across nodes, the node step
# a large allreduce takes there (across._blocks).
PROBE_BYTES = 1 << 20
#
# How long a failed call waits for peers still writing into its output
# (the fence), and where ranks that outnumber the cores stage their
# allgathers: config.LoopTunables, resolved when a communicator is made.
#
# Where every rank has a core of its own, messages above this many bytes
# per rank take the large path even below the slots' size (config.FastSizes:
# 64 KiB): measured with 2 processes at f2eebaa (docs/host-ranks.md), the
# large path was faster from 16 to 32 KiB on (a 64 KiB broadcast 5.3 µs
# against 8.2 merged, an allreduce 5.8 against 8.2), while with 4 processes
# on the 2 cores the merged step stayed faster at 32 and 64 KiB.
MERGED_MAX_DEDICATED = 16 << 10
# Polls before a wait yields its core. Ranks that have a core each spin
# longer (a peer is running and about to publish); ranks that outnumber
# the cores yield almost at once (the peer may need this core).
SPIN_DEDICATED = 20000
SPIN_OVERSUBSCRIBED = 64
# Then it yields for this long before it sleeps on a futex (_shmloop.c
# says why both). Measured with 4 processes on 2 cores: 100 µs to 1 ms
# put every size at 1.3x to 2.8x MPICH's speed, no yield (straight to
# sleep) at 0.3x to 1.3x, 50 ms of yields at 0.2x at 4 MiB.
YIELD_SECONDS = 300e-6

OP_CODES = {**{o: i for i, o in enumerate(ReduceOp)}, **{o.value: i for i, o in enumerate(ReduceOp)}}
assert [o.value for o in ReduceOp] == ["sum", "prod", "max", "min", "avg"], "the loop's OP_ codes"

# The loop's steps (_shmloop.c's STEP_ codes; `Channel.last_step` names the
# last one taken): the merged step, and a large message's through staging.
MERGED, STAGED = "merged", "staged"
STEPS = (MERGED, STAGED)
# What Channel.step_for answers for a call the loop leaves to the plans: a
# large message the ranks may single copy (_shmloop.c's STEP_PLANS), of any
# of the five collectives; and the name of that way in the probes' timings.
PLANS, SINGLE_COPY = "plans", "single_copy"


# The arrays the loop takes: NumPy's, and its memory-mapped ones (a rank
# whose array is of another type declines, and ranks must agree).
ARRAYS = (np.ndarray, np.memmap)

# The collectives the loop runs besides allreduce (_shmloop.c's K_ codes).
KINDS = {"reduce_scatter": 1, "allgather": 2, "broadcast": 3, "reduce": 4}
COLLECTIVES = ("allreduce", *KINDS)
KIND_CODES = {"allreduce": 0, **KINDS}   # (allreduce's K_ code too: Channel.step_for takes all five)


def step_algorithm(collective, step):
    """The registered algorithm that the loop's `step` of `collective` is:
    the one whose plan moves as many bytes between ranks and gives the same
    bits. Each rank reads what `direct` reads of every peer and folds in
    rank order, but for a large allreduce, whose ranks each fold one block
    of every peer's and copy the folded blocks out: `two_shot` (whose bits
    are direct's too: executors/paths.same_bits_as_direct)."""
    return "two_shot" if collective == "allreduce" and step != MERGED else "direct"


def runs_as(collective, algorithm, nbytes, merged_max):
    """Whether a call naming `algorithm` may take the loop: where the loop's
    step for a message of `nbytes` per rank is that algorithm."""
    return algorithm == step_algorithm(collective, MERGED if nbytes <= merged_max else STAGED)


def available():
    return _shmloop is not None


# what the loop folds (_shmloop.c's element_type); other dtypes decline
LOOP_DTYPES = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.int8, np.uint8, np.int16, np.uint16,
                                              np.int32, np.uint32, np.int64, np.uint64))


def takes(dtype):
    """Whether the loop runs allreduces of `dtype` (native byte order only)."""
    return as_dtype(dtype) in LOOP_DTYPES


def weakly(method):
    """`method` (a bound method) called through a weak reference to its
    object. A C object that the method's object holds (a channel, across.py's
    Shortcuts) keeps its callbacks so, or the two would make a cycle: a
    communicator dropped without close() would keep its shared memory until
    the garbage collector ran, where it is freed at once."""
    reference = weakref.WeakMethod(method)

    def call(*arguments):
        return reference()(*arguments)
    return call


class FastCollectives:
    """The compiled loop of one rank: `allreduce(x, op, out, timeout)` and
    `collective(collective, x, op, out, root, timeout)` are the channel's
    shortcuts (_shmloop.c), which the communicator calls first: the result
    (allreduce's output; True for the other four) once done, None where
    the loop declines the call; a failure raises (`_failed`)."""

    def __init__(self, group, header_address, rows_address, channel_address, oversubscribed):
        assert (ROW, HEADER) == (_shmloop.ROW_SLOTS, _shmloop.HEADER_SLOTS), "protocol.py and _shmloop.c disagree"
        assert KINDS == {name: getattr(_shmloop, name.upper()) for name in KINDS}, "_shmloop.c's K_ codes"
        self._group = group
        self.sizes = sizes = group.fast_sizes   # (config.FastSizes: the channel's layout)
        # Messages up to merged_max bytes take the merged step (the node's
        # ranks decide alike: they share its cores).
        self.merged_max = sizes.small_max if oversubscribed else min(sizes.small_max, MERGED_MAX_DEDICATED)
        self.tunables = tunables = resolve_loop_tunables()
        # The median seconds of the probe's allreduce each way, on the
        # slowest rank ({"single_copy": s, "staged": s}), once measured.
        self.probe_seconds = None
        # (the channel decides each call's step from these: step_for)
        staged_spread_max = tunables.spread_staged_max if stages_spread(group) else 0
        # Allgather and broadcast follow the folds' staging limit where the
        # machine's processes have a core each (measured 1.1-3.6 times as
        # fast staged from 32 KiB to 4 MiB, 2 processes on the AMD VM), not
        # where they outnumber its cores (2 pretend nodes of 2 on its 2
        # cores: a node's 1 MiB allgather step staged made a 1 MiB
        # allgather across them 1.3 times as slow, a 1 MiB allreduce 1.2).
        self.copies_stage = not oversubscribed
        self._channel = _shmloop.Channel(
            header=header_address, rows=rows_address, rank=group.rank, nranks=group.size,
            spin=SPIN_OVERSUBSCRIBED if oversubscribed else SPIN_DEDICATED, yield_seconds=YIELD_SECONDS,
            small=channel_address, small_max=sizes.small_max,
            staging=channel_address + small_area(group.size, sizes),
            chunk=sizes.chunk, single_copy=resolve_fast_single_copy(), staged_spread_max=staged_spread_max,
            merged_max=self.merged_max,
            staged_max=DEFAULT_STAGED_MAX if tunables.staged_max is None else tunables.staged_max,
            copies_stage=self.copies_stage)
        # An allgather of up to this many bytes a rank stages even where the
        # ranks may single copy (0: never), as the channel decides.
        self.staged_spread_max = staged_spread_max
        self._channel.bind_shortcuts(ARRAYS, OP_CODES, KINDS, weakly(self._failed))
        self.allreduce = self._channel.shortcut_allreduce
        self.collective = self._channel.shortcut

    @property
    def staged_max(self):
        """A large fold (allgather and broadcast too where copies_stage) of
        up to this many bytes per rank stages even where
        the ranks may single copy (0: never); None once closed."""
        return None if self._channel is None else self._channel.staged_max

    def choose_staged_max(self, timeout, inherited, collective, fold):
        """Set staged_max on every rank alike: `inherited` (the value of the
        communicator this one was shrunk from, the same on every survivor),
        else $COLLECTIVES_STAGED_MAX where every rank gives the same, else
        the faster of staging up to DEFAULT_STAGED_MAX and never, timed on
        calls of PROBE_BYTES (probe.py): `fold(x, op, out)` runs
        `collective` as `auto` does, the loop's staging or the plans'
        single copy (the communicator's allreduce on one machine; across
        nodes, a node's reduce_scatter, the node step of a large
        allreduce). Every rank of the loop calls it together, before any
        other call; InvalidUsageError on every rank where the variable
        differs among them; a call that fails raises as a collective's does
        (`timeout` seconds each)."""
        channel = self._channel
        if inherited is not None:
            channel.staged_max = inherited
            return

        def small_allreduce(x, op, out):
            done = self.allreduce(x, op, out, timeout)
            assert done is not None, "the loop declined its own probe"

        group = self._group
        pinned = probe.agreed_pin(small_allreduce, STAGED_MAX_ENV, self.tunables.staged_max, group.names[group.rank])
        if pinned is not None or PROBE_BYTES <= self.merged_max:
            channel.staged_max = DEFAULT_STAGED_MAX if pinned is None else pinned
            return
        x = np.ones(PROBE_BYTES // 4 // group.size * group.size, np.float32)   # (blocks for a reduce_scatter)
        out = np.empty_like(x) if collective == "allreduce" else np.empty(x.size // group.size, x.dtype)

        def staged_up_to(staged_max):
            def call():
                channel.staged_max = staged_max
                fold(x, "sum", out)
            return call

        single_copy, staged = staged_up_to(0), staged_up_to(DEFAULT_STAGED_MAX)
        single_copy()   # (a read the plans find refused here: ShmRank._refusal, on every rank alike)
        if channel.large_path == "staged":   # every large message stages: nothing to choose
            channel.staged_max = DEFAULT_STAGED_MAX
            return
        staged()   # (both ways once untimed: pages and staging touched)
        seconds = probe.slowest_medians(small_allreduce, [single_copy, staged])
        self.probe_seconds = dict(zip((SINGLE_COPY, STAGED), seconds))
        channel.staged_max = DEFAULT_STAGED_MAX if seconds[1] < seconds[0] else 0

    def barrier(self, deadline):
        """Return once every rank has entered the barrier (a merged step of
        no bytes in the loop); a failure raises as a collective's does.
        False where the channel is closed."""
        channel = self._channel
        if channel is None:
            return False
        try:
            status = channel.barrier(deadline)
        except BaseException as error:   # a signal handler's (Ctrl-C) while it waited
            self._failed(None, None, "sum", "barrier", 0, error)
        if status is None:   # closed meanwhile
            return False
        if status != 0:
            self._failed(status, None, "sum", "barrier", 0, None)
        return True

    @property
    def channel(self):
        """The loop's _shmloop.Channel, whose calls across.py's Programs
        make themselves (None once closed); their failures go to raise_failure."""
        return self._channel

    def raise_failure(self, status, x, op, collective, root):
        """Raise what a failed call of the channel (its `status`) means, as
        a call through this object would, the communicator aborted first."""
        self._failed(status, x, op, collective, root, None)

    def _failed(self, status, x, op, collective, root, error):
        """Raise for a failed call of the loop: `status` as the channel
        gives it, or `error`, a signal handler's (Ctrl-C) while the call
        waited; once the communicator is aborted and the fence passed."""
        if error is not None:
            self._abort_and_raise(f"rank {self._group.names[self._group.rank]} was interrupted during a {collective}: "
                                  f"{type(error).__name__}", error)
        try:
            self._raise_for(status, x, op, collective, root)
        except BaseException as error:
            self._abort_and_raise(f"{type(error).__name__}: {error}", error)

    def _raise_for(self, status, x, op, collective, root):
        """Raise what the interpreter's waits raise for the same failure."""
        kind, peer, have, need, seq = status
        group = self._group
        group._seq = seq   # noqa: SLF001 - the row's SEQ, which this call advanced
        description = "barrier" if x is None else (
            f"{collective} of {x.size} {x.dtype} (op {list(ReduceOp)[OP_CODES[op]].value}, "
            f"root {root}, algorithm {self.algorithm_of(collective, x.nbytes)})")
        raise_wait_failure(group, kind, peer, have, need, seq, description)

    def _abort_and_raise(self, reason, error):
        """Abort the communicator for every rank, fence this rank's buffers
        against peers still writing into them, then raise `error`
        (failures.abort_fence_and_raise)."""
        fence = None if self._channel is None else self._channel.fence_writes
        abort_fence_and_raise(self._group, reason, error, fence, self.tunables.fence_seconds)

    def refuse_single_copy(self):
        """Every rank alike, between the same two calls: large messages
        stage from now on (the plans met a refused single copy)."""
        if self._channel is not None:
            self._channel.refuse_single_copy()

    def step_for(self, collective, nbytes):
        """The step a call of `collective` with `nbytes` per rank takes in
        the loop, as the loop itself decides it (_shmloop.c's step_for):
        merged up to merged_max; staged for a fold up to staged_max, for
        an oversubscribed allgather up to staged_spread_max, and for every
        large message where the ranks may not single copy (`large_path`);
        else PLANS: the loop declines it, the plans single copy it. None
        once closed."""
        channel = self._channel
        return None if channel is None else channel.step_for(KIND_CODES[collective], nbytes)

    def algorithm_of(self, collective, nbytes):
        """The registered algorithm a call the loop takes runs (step_algorithm)."""
        return step_algorithm(collective, MERGED if nbytes <= self.merged_max else STAGED)

    @property
    def steps_taken(self):
        """Calls the loop took so far (None once closed): with `last_step`, what ran."""
        return None if self._channel is None else self._channel.steps_taken

    @property
    def last_step(self):
        """The step of the last call the loop took (STEPS), or None."""
        return None if self._channel is None else self._channel.last_step

    @property
    def large_path(self):
        """How messages past the loop's staging limits move: "single-copy"
        (the plans'), or "staged" where some rank may not read and write
        another's memory (the plans found out as the communicator started:
        refuse_single_copy), or with COLLECTIVES_FAST_SINGLE_COPY=0; None
        once closed."""
        return None if self._channel is None else self._channel.large_path

    def close(self):
        """The channel's memory is about to be unmapped: never touch it
        again (the shortcuts decline from now on)."""
        if self._channel is not None:
            self._channel.close()
        self._channel = None


def stages_spread(group):
    """Whether `group`'s allgathers up to LoopTunables.spread_staged_max per rank
    take the staged pipeline: where its own ranks outnumber the cores."""
    return group.size > (os.cpu_count() or 1)


def make(group, oversubscribed):
    """The compiled loop of `group`'s rank, or None without it
    (or when COLLECTIVES_FAST_PATH=0 asks for the plans: config.resolve_fast_path)."""
    if _shmloop is None or not resolve_fast_path():
        return None
    return FastCollectives(group, *group.channel_addresses(), oversubscribed)
