"""Settings that come from the environment, read when a communicator is made.

Nothing here is a mutable module global: each communicator resolves its own
settings once, so two communicators never share a hidden knob.
"""

import math
import os
from typing import NamedTuple

from .errors import InvalidUsageError

TIMEOUT_ENV = "COLLECTIVES_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0


def _given(value, argument, variable):
    """A setting and where it came from, as errors name it: `value` (the
    argument `argument`) where given, else $`variable` (None when unset)."""
    if value is not None:
        return value, argument
    return os.environ.get(variable), f"${variable}"


def resolve_timeout(timeout=None):
    """The timeout in seconds: the argument, else $COLLECTIVES_TIMEOUT, else 300."""
    timeout, source = _given(timeout, "timeout", TIMEOUT_ENV)
    if timeout is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(timeout)
    except (TypeError, ValueError):
        raise InvalidUsageError(f"{source}: expected a number of seconds, got {timeout!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise InvalidUsageError(f"{source}: expected a positive, finite number of seconds, got {timeout!r}")
    return value


ONE_KERNEL_ALLREDUCE_ENV = "COLLECTIVES_ONE_KERNEL_ALLREDUCE"


def resolve_one_kernel_allreduce(enabled=None):
    """Whether GPU ranks in separate processes, and ranks on several GPUs of
    one process, run small collectives (all five; the variable's name is
    from when it was the allreduce alone) as one kernel per rank
    (the ll, symmetric, staged and peer_ll paths, executors/paths.py): the argument, else
    $COLLECTIVES_ONE_KERNEL_ALLREDUCE ("1" or "0"), else off. Every rank must
    agree (mpiexec gives all ranks the same environment)."""
    return _switch(enabled, "one_kernel_allreduce", ONE_KERNEL_ALLREDUCE_ENV, default=False)


COMPILED_PLANS_ENV = "COLLECTIVES_COMPILED_PLANS"


def resolve_compiled_plans(enabled=None):
    """Whether host ranks in separate processes run their plans in the
    compiled executor (executors/host_process.py) where it takes them: the
    argument, else $COLLECTIVES_COMPILED_PLANS ("1" or "0"), else on. "0"
    runs every plan in the NumPy interpreter (to compare the two). Ranks may
    differ: both executors follow one protocol."""
    return _switch(enabled, "compiled_plans", COMPILED_PLANS_ENV, default=True)


FAST_PATH_ENV = "COLLECTIVES_FAST_PATH"


def resolve_fast_path(enabled=None):
    """Whether host ranks in separate processes run the calls the compiled
    loop takes there (transport/fastpath.py): the argument, else
    $COLLECTIVES_FAST_PATH ("1" or "0"), else on. "0" sends every call to
    the plans. Ranks may differ: a loop's call against a plan's is named
    as a mismatch, not run."""
    return _switch(enabled, "fast_path", FAST_PATH_ENV, default=True)


FAST_SINGLE_COPY_ENV = "COLLECTIVES_FAST_SINGLE_COPY"


def resolve_fast_single_copy(enabled=None):
    """Whether the compiled loop's large messages may read and write peers'
    arrays in place (the single copy) where the ranks can reach each
    other's memory: the argument, else $COLLECTIVES_FAST_SINGLE_COPY ("1"
    or "0"), else on. "0" keeps them on the staged pipeline. Every rank
    must agree: a large call of a rank set to "0" against one that may take
    the single copy is named as a mismatch."""
    return _switch(enabled, "fast_single_copy", FAST_SINGLE_COPY_ENV, default=True)


FAST_SMALL_MAX_ENV = "COLLECTIVES_FAST_SMALL_MAX"
FAST_CHUNK_ENV = "COLLECTIVES_FAST_CHUNK"
# bytes: the compiled loop's merged step takes messages up to small_max per
# rank, the pipeline above moves `chunk` bytes of every block per iteration
# (measured best from 32 KiB to 1 MiB: docs/host-ranks.md).
DEFAULT_FAST_SMALL_MAX = 64 << 10
DEFAULT_FAST_CHUNK = 256 << 10


class FastSizes(NamedTuple):
    """The compiled loop's sizes (transport/layout.py lays its channel out
    by them): every rank of a communicator must have the same."""
    small_max: int   # bytes per rank a merged step takes at most
    chunk: int       # bytes of a pipeline's or a staged segment's chunk


def resolve_fast_sizes(small_max=None, chunk=None):
    """The compiled loop's FastSizes: the arguments, else
    $COLLECTIVES_FAST_SMALL_MAX and $COLLECTIVES_FAST_CHUNK (bytes), else
    64 KiB and 256 KiB. A merged step's limit is a multiple of 8 bytes, a
    chunk of 64 (the loop's slots and chunks start on cache lines)."""
    return FastSizes(_bytes(small_max, "small_max", FAST_SMALL_MAX_ENV, DEFAULT_FAST_SMALL_MAX, 8),
                     _bytes(chunk, "chunk", FAST_CHUNK_ENV, DEFAULT_FAST_CHUNK, 64))


def _bytes(value, argument, variable, default, multiple):
    """A positive byte count, a multiple of `multiple`: `value`, else
    $`variable`, else `default`; InvalidUsageError naming where a bad one
    came from."""
    value, source = _given(value, argument, variable)
    if value is None:
        return default
    try:
        count = int(value)
    except (TypeError, ValueError):
        raise InvalidUsageError(f"{source}: expected a number of bytes, got {value!r}") from None
    if count <= 0 or count % multiple or count > 1 << 30:
        raise InvalidUsageError(f"{source}: expected a positive multiple of {multiple} bytes up to 1 GiB, "
                                f"got {value!r}")
    return count


# From how many bytes of a call's blocks (all of them: each rank's x for
# all_to_all and scatter, the gathered array for gather, the most a rank
# sends for all_to_all_v) host ranks in processes run all_to_all,
# all_to_all_v, gather and scatter as single-copy plans, reading peers'
# inputs in place (plan.single_copy_plan), where
# $COLLECTIVES_FAST_SINGLE_COPY allows it; the same on every rank.
# Below it the staged plans run: each block through the sender's workspace,
# two copies, but both ranks copying at once through cache-sized slices,
# where the single copy pays a process_vm_readv (page pinning) per block and
# three rounds. Which is faster is the machine's, so unless this variable
# pins it, the ranks measure it as the communicator starts
# (transport/shm.py, ShmRank.measure: 256 KiB all_to_alls out of place both
# ways, alternating, probe.py) and all take the faster: the single copy from
# MEASURED_EXCHANGE_SINGLE_COPY_MIN, or from the default. An in-place
# all_to_all keeps the default even then: it reads into scratch and copies
# over x after, two copies either way, and staged it was the faster on both
# machines below. Measured, this variable at 128 KiB (the single copy)
# against 1 GiB or 4 MiB (staged), 2 processes pinned (bench.host_vs_mpich,
# 3 rounds): on an AMD EPYC VM (2026-11-30, MPICH 5.0.2;
# bench.alltoall_perf -n 20 -w 5 --rounds 3 agreeing) staged faster at
# 128 KiB to 2 MiB in all three exchanges (all_to_all out of place 12.9
# against 21.4 us at 128 KiB, 68.6 against 105.4 at 1 MiB, in place 63.3
# against 159.0; gather 46.8 against 100.8 at 1 MiB), from 4 MiB the single
# copy ahead or even (all_to_all at 8 MiB 433 against 1189 us); with 4
# processes on the 2 cores the same up to 1 MiB, mixed at 2 and 4 MiB
# (docs/host-ranks.md, "The exchanges: one copy"). On an Intel Xeon VM
# (2026-12-01), the variable at 64 KiB against 4 MiB, two launches each:
# the single copy ahead from 128 KiB out of place (all_to_all 8.4-8.7
# against 13.0-13.2 us at 128 KiB, 11.6-12.2 against 17.7-18.0 at 256 KiB,
# 59-61 against 97-107 at 1 MiB; gather and scatter alike, and in place
# too: gather 1 MiB 20-22 against 51), at 64 KiB even or staged slightly
# ahead (gather 6.5-6.8 against 5.5), and in place all_to_all staged ahead (22.9 against 15.6 at 256 KiB, 74-78 against 60
# at 1 MiB; docs/noticed.md).
EXCHANGE_SINGLE_COPY_MIN_ENV = "COLLECTIVES_EXCHANGE_SINGLE_COPY_MIN"
DEFAULT_EXCHANGE_SINGLE_COPY_MIN = 4 << 20
MEASURED_EXCHANGE_SINGLE_COPY_MIN = 128 << 10


def resolve_exchange_single_copy_min(min_bytes=None):
    """The exchanges' single-copy threshold in bytes: the argument, else
    $COLLECTIVES_EXCHANGE_SINGLE_COPY_MIN, else None (measured as the
    communicator starts)."""
    return _number(min_bytes, "exchange_single_copy_min", EXCHANGE_SINGLE_COPY_MIN_ENV, None, int)


# From how many bytes send and recv between processes go in one copy (the
# receiver reads the sender's array with process_vm_readv, p2p.py); 0:
# never. Below it a message streams through the mailbox's slots, each
# fragment put in as soon as the receiver has freed a slot: two copies, but
# the sender's and the receiver's at once, through slots that stay in cache,
# where the single copy leaves the sender idle and pins every page it
# reads. Measured on the 2-core machine (2 processes pinned, alternating
# launches of bench.pingpong or the same loop, MPICH's Send/Recv in the
# same processes), one way: streamed 57-69 us at 1 MiB against 132-147 in
# one copy (MPICH 114-133); at 4 MiB 270-327 against 525-906, and once 873
# against 559 (MPICH 420-590); at 16 and 64 MiB 1.56-2.98 and 6.1-8.0 ms
# against 2.67-3.26 and 8.6-9.5 in three launches, 3.4-3.6 and 13.4-15.6
# against 2.67-2.69 and 8.6-8.8 in two others (MPICH about 2.0 and 8.4).
# The slow launches were those where the hypervisor had put the two cores
# in different core complexes (a cache line took 225-260 ns from one to
# the other, against 40-70: docs/noticed.md), and a stream hands every
# byte from one core's cache to the other's; the single copy reads the
# sender's pages from memory. As the exchanges' threshold above: the single
# copy from 4 MiB.
MESSAGE_SINGLE_COPY_MIN_ENV = "COLLECTIVES_MESSAGE_SINGLE_COPY_MIN"
DEFAULT_MESSAGE_SINGLE_COPY_MIN = 4 << 20


def resolve_message_single_copy_min(min_bytes=None):
    """send and recv's single-copy threshold in bytes (0: never): the
    argument, else $COLLECTIVES_MESSAGE_SINGLE_COPY_MIN, else 4 MiB."""
    return _number(min_bytes, "message_single_copy_min", MESSAGE_SINGLE_COPY_MIN_ENV,
                   DEFAULT_MESSAGE_SINGLE_COPY_MIN, int)


# The compiled loop's settings other than its layout (FastSizes), read once
# when a communicator is made: the fence's wait and the stalls are a rank's own; the
# staging limit must be the same on every rank (the loop names a rank whose differs).
FENCE_SECONDS_ENV = "COLLECTIVES_FENCE_SECONDS"
# How long a failed call waits for a peer still writing into its output (a
# chunk's writes take microseconds; only a stopped or long starved process
# takes longer), before it raises naming that peer.
DEFAULT_FENCE_SECONDS = 5.0
SPREAD_STAGED_MAX_ENV = "COLLECTIVES_SPREAD_STAGED_MAX"
# Where the loop's ranks outnumber the cores (fastpath.stages_spread),
# allgather of up to this many bytes per rank takes the staged pipeline even
# where the ranks may single copy: there every reader's process_vm_readv of
# the same pages, and the readers' wait for each other's end, cost more than
# staging. Measured with 4 processes on the 2 cores (docs/host-ranks.md,
# "Oversubscribed"): MPICH/ours at 128 KiB to 2 MiB, broadcast 0.77-1.06
# reading in place against 1.17-1.59 staged (out of place); at 8 MiB per
# rank and above, mixed or the single copy ahead. Broadcast no longer
# stages: since each rank moves one block of the root's x into every output
# (then _shmloop.c's spread_from_root, now plan.spread_plan), its single copy measured faster than
# staging at 256 KiB and 1 MiB too (4 processes, in place 1 MiB: 0.13 ms
# against 0.22). Not where only the machine is oversubscribed: on 2 pretend
# nodes of 2 (each node's loop 2 ranks, a core each, shared with the other
# node's), a 4 MiB allgather across the nodes (the node's loop gathering
# 1 MiB rows) took 866 to 903 us in place reading in place, 1158 to 1330
# staged (MPICH 882 to 929).
DEFAULT_SPREAD_STAGED_MAX = 2 << 20
# A broadcast of fewer bytes than this, where the node's ranks have a core
# each, takes no spread (plan.spread_plan): every reader pulls
# all of x, and no rank writes into a peer's output. A block the root's
# core wrote there is still in that core's cache when the reader's code
# reads it, and the next call's write must take the lines back. On an
# Intel Xeon VM (2026-12-02), 2 processes pinned, in place, each call's
# output read after it: 64 KiB 8.5 us spread against 4.2 pulled (MPICH
# 5.6), 256 KiB 24 against 11.5-12 (12.3-12.8), 512 KiB 27-29 against 23.7,
# 1 MiB 52-54 against 60-63; back to back, nobody reading, the spread is
# ahead at every size (256 KiB 7.2 against 11.0, 512 KiB 11.7 against
# 21.3). With 4 processes on the 2 cores the spread won at 256 KiB either
# way (in place 52 us against 94 back to back): there it stays.
BROADCAST_PULL_MAX = 512 << 10


def broadcast_pull_max(oversubscribed):
    """BROADCAST_PULL_MAX where the ranks have a core each, else 0 (a
    broadcast spreads at every size): the plans' rule (ShmRank._single_plan)."""
    return 0 if oversubscribed else BROADCAST_PULL_MAX


STAGED_MAX_ENV = "COLLECTIVES_STAGED_MAX"
# A large message of any of the five collectives of up to this many bytes
# per rank may take the loop's staged pipeline even where the ranks may
# single copy: the fold or copy from slices that stay in cache, both ranks
# copying at once, against what one process_vm_readv per block brings in
# (it pins the pages it reads). Which is faster is the machine's, and by
# 2 to 3 times either way, so unless this variable pins it, the ranks
# measure it when the communicator starts (fastpath.py,
# FastCollectives.choose_staged_max: the communicator's 1 MiB allreduces
# both ways, the loop's staging against the plans' single copy,
# alternating) and all take the faster: staging up to this default, or
# never (0). Measured with bench.host_vs_mpich --ranks 2 --bind-to core,
# 3 rounds, the variable at 0 against 4 MiB, alternating: on an AMD EPYC
# VM (2026-11-30; a 1 MiB process_vm_readv took 129 us where a memcpy
# took 52) our time with the single copy over staged, 256 KiB to 4 MiB,
# allreduce 1.95-3.38, reduce 1.72-3.48, reduce_scatter 1.02-2.31, at
# 16 MiB 0.95-1.21 (even); on an Intel Xeon VM (2026-12-01) the other way
# round, the single copy 2 to 3 times the faster from 256 KiB to 4 MiB
# (reduce_scatter 1 MiB 41-43 against 120-131 us, allreduce 71-76 against
# 133-150; docs/noticed.md). allgather and broadcast, which only copy,
# follow the folds' limit (2026-12-03, the AMD VM, 2 processes pinned,
# batches after a barrier: staging up to 4 MiB 1.1-3.6 times as fast as the
# plans' single copy from 32 KiB to 4 MiB, at 8 MiB and more the single
# copy as fast or faster; docs/host-ranks.md).
DEFAULT_STAGED_MAX = 4 << 20
# Host ranks in processes run an allreduce, broadcast, reduce,
# reduce_scatter or allgather of a dtype the compiled executor folds (not
# float16 or bfloat16: ShmRank.plan_segment) whose workspace would hold more than 2
# segments of this many bytes on the plans' staged path (where the compiled
# loop does not take it) as consecutive runs of the same plan on segments
# of it (plan.segmented_plan; of every rank's block alike for the last
# two), so that a segment's copy into the workspace, its fold and its copy
# out find it in cache; 0: one run. The same on every rank (a call's
# signature names it). Measured with 2 processes pinned
# (docs/host-ranks.md, "The plans in segments").
PLAN_SEGMENT_BYTES_ENV = "COLLECTIVES_PLAN_SEGMENT_BYTES"
DEFAULT_PLAN_SEGMENT_BYTES = 2 << 20


def resolve_plan_segment_bytes(nbytes=None):
    """The plans' segment in bytes (0: none): the argument, else
    $COLLECTIVES_PLAN_SEGMENT_BYTES, else 2 MiB; a multiple of 4096."""
    segment = _number(nbytes, "plan_segment_bytes", PLAN_SEGMENT_BYTES_ENV, DEFAULT_PLAN_SEGMENT_BYTES, int)
    if segment % 4096:
        source = _given(nbytes, "plan_segment_bytes", PLAN_SEGMENT_BYTES_ENV)[1]
        raise InvalidUsageError(f"{source}: expected 0 or a multiple of 4096 bytes, got {segment}")
    return segment


# A compressed allreduce across nodes of at least twice this many bytes a
# rank runs in pieces of about this many (hierarchy.compressed_allreduce,
# across.Programs.run_in_pieces): each piece's node reduction and encoding
# while the one before is on the link, and its decoding and node gather
# while the one after is. 0: one piece. Give every rank the same: a call in
# pieces says so in its signature, so ranks that piece it differently are
# named (InvalidUsageError), not misread. The result's bits do not depend
# on it (every piece starts on a codec block of every rank's range).
COMPRESSED_PIECE_BYTES_ENV = "COLLECTIVES_COMPRESSED_PIECE_BYTES"
DEFAULT_COMPRESSED_PIECE_BYTES = 4 << 20


def resolve_compressed_piece_bytes(nbytes=None):
    """The compressed allreduce's piece across nodes in bytes a rank (0:
    none): the argument, else $COLLECTIVES_COMPRESSED_PIECE_BYTES, else 4 MiB."""
    return _number(nbytes, "compressed_piece_bytes", COMPRESSED_PIECE_BYTES_ENV, DEFAULT_COMPRESSED_PIECE_BYTES, int)


# For tests only: seconds a writer is held inside each chunk's writes (so
# that the fence has something to wait for), and a reader before each read
# out of a peer's input (so that a peer which returned before every reader
# was done with its input would be caught): the compiled plan executor's
# single copies (executors/host_process.py).
TEST_WRITE_STALL_ENV = "COLLECTIVES_TEST_WRITE_STALL"
TEST_READ_STALL_ENV = "COLLECTIVES_TEST_READ_STALL"


class LoopTunables(NamedTuple):
    """The compiled loop's tunables (transport/fastpath.py), one rank's."""
    fence_seconds: float
    spread_staged_max: int   # bytes per rank; 0: allgather reads in place however many cores
    staged_max: int | None   # bytes per rank; 0: large messages take the single copy where they may;
                             # None: measured when the communicator starts
    test_write_stall: float
    test_read_stall: float


def resolve_loop_tunables(fence_seconds=None, spread_staged_max=None, test_write_stall=None, test_read_stall=None,
                          staged_max=None):
    """The compiled loop's LoopTunables: each argument, else its variable
    ($COLLECTIVES_FENCE_SECONDS, $COLLECTIVES_SPREAD_STAGED_MAX,
    $COLLECTIVES_STAGED_MAX, and the
    tests' $COLLECTIVES_TEST_WRITE_STALL, $COLLECTIVES_TEST_READ_STALL), else
    the default above (no stall; staged_max None: measured)."""
    return LoopTunables(_number(fence_seconds, "fence_seconds", FENCE_SECONDS_ENV, DEFAULT_FENCE_SECONDS, float),
                        _number(spread_staged_max, "spread_staged_max", SPREAD_STAGED_MAX_ENV,
                                DEFAULT_SPREAD_STAGED_MAX, int),
                        _number(staged_max, "staged_max", STAGED_MAX_ENV, None, int),
                        _number(test_write_stall, "test_write_stall", TEST_WRITE_STALL_ENV, 0.0, float),
                        _number(test_read_stall, "test_read_stall", TEST_READ_STALL_ENV, 0.0, float))


def _number(value, argument, variable, default, kind):
    """A finite number >= 0 of `kind` (int or float): `value`, else
    $`variable`, else `default`; InvalidUsageError naming where a bad one
    came from."""
    value, source = _given(value, argument, variable)
    if value is None:
        return default
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise InvalidUsageError(f"{source}: expected {'an integer' if kind is int else 'a number'}, "
                                f"got {value!r}") from None
    if not (number >= 0 and math.isfinite(number)):
        raise InvalidUsageError(f"{source}: expected a finite number >= 0, got {value!r}")
    return number


def check_switches():
    """Resolve every variable above once, so that a bad value raises
    InvalidUsageError on every rank before any exchange (init and start
    call it), not on the first rank to read it while the others wait."""
    for resolve in (resolve_one_kernel_allreduce, resolve_compiled_plans, resolve_fast_path,
                    resolve_fast_single_copy, resolve_fast_sizes, resolve_loop_tunables,
                    resolve_exchange_single_copy_min, resolve_message_single_copy_min, resolve_plan_segment_bytes,
                    resolve_compressed_piece_bytes):
        resolve()


def _switch(enabled, argument, variable, default):
    """An on/off setting: `enabled` (a bool, or "1"/"0"), else $`variable`
    ("1" or "0"), else `default`; InvalidUsageError naming where a bad
    value came from."""
    enabled, source = _given(enabled, argument, variable)
    if enabled is None:
        return default
    if isinstance(enabled, bool):
        return enabled
    if str(enabled) in ("0", "1"):
        return str(enabled) == "1"
    raise InvalidUsageError(f"{source}: expected 0 or 1, got {enabled!r}")
