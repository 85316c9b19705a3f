"""Which way a call goes: the one decision, for every kind of rank.

`route` answers, for a call's shape, the registered algorithm that runs it
and the path that runs it; Communicator.chosen_algorithm returns its answer
(an auto.Choice), and tests/test_routes.py holds that answer against what
ran, call after call, on every path of host ranks. The rules, the first
that holds:

    ranks             the call                                         path            algorithm
    host ranks in     uncompressed, of a dtype the loop folds          compiled_loop   direct; two_shot for
    processes on      (fastpath.LOOP_DTYPES), `auto` or the algorithm  + its step      an allreduce above
    one machine       the loop's step is (fastpath.runs_as), but a                     the merged step
                      message the loop leaves to the plans
                      one of the five past the loop's merged step      single_copy     two_shot for an
                      and staging limits (a fold's staged_max, an                      allreduce or reduce
                      oversubscribed allgather's), where the ranks                     (or direct named);
                      may single copy (a reduce in place where they                    the others direct
                      may push)
                      `direct` all_to_all(_v), gather, scatter of      single_copy     direct
                      blocks from the single-copy limit (shm.py);
                      allgather, broadcast the loop did not take
                      a plan the compiled executor takes               compiled_plan   auto's, or the named
                      (executors/host_process.py)
                      anything else: compressed, float16, bfloat16     step            auto's, or the named
    host ranks in     every call                                       interpreter     auto's, or the named
    one process
    ranks across      allreduce(compression=)                          compressed      hierarchical
    nodes             all_to_all(_v), gather, scatter                  exchange        hierarchical
    (hierarchy.py)    small, with the node's loop (hierarchy.route)    program, or     hierarchical
                                                                       counterparts
                      larger, a shape a compiled Program takes         program         hierarchical
                      anything else                                    hierarchical    hierarchical
    GPU ranks         the selector's first path that serves the plan   ll, symmetric,  auto's, or the named
                      (executors/paths.py)                             staged, step,
                                                                       peer_ll, events
    backend="nccl"    every call                                       nccl            auto's, or the named

The loop's step (compiled_loop) is "merged" up to its merged-step limit,
else "staged" where _shmloop.c's step_for decides so. A plan of
host ranks in processes whose workspace would hold more than two of
$COLLECTIVES_PLAN_SEGMENT_BYTES runs its algorithm in segments
(plan.segmented_plan, ShmRank.plan_segment) on the same path. Across
nodes the algorithm is "hierarchical" (the node's steps and the messages
between nodes, hierarchy.py), not one of the registry's plans.

Who follows the decision when a call runs: the communicator's collectives
hand a call to the ranks' compiled loop first (its shortcuts check the
first rule's conditions on the arrays themselves, in C, and decline what
it does not take); a declined call is planned (Communicator._plan, the
algorithm remembered per call shape) and its ranks run the plan on the
path their `chosen_path` names (ShmRank.route, hierarchy.route, the GPU
ranks' selector), which a repeated call on the same arrays keeps
(Communicator._repeat's bound form). chosen_algorithm assumes C-contiguous
arrays: others are read through private copies on the plans' paths.
"""

from . import auto, validation
from .algorithms.schedule import ALL_COLLECTIVES, ALL_TO_ALL, ALL_TO_ALL_V, ALLREDUCE, EXCHANGES, ROOTED_COLLECTIVES
from .errors import InvalidUsageError
from .executors.paths import PLAIN, SYMMETRIC
from .transport import fastpath

COMPILED_LOOP = "compiled_loop"


def route(comm, collective, nbytes, root=0, dtype=None, in_place=None, compression=None, algorithm="auto",
          symmetric=False):
    """What a call of `comm` runs: an auto.Choice (the algorithm, its path,
    and the loop's step on the loop's path). The arguments are
    Communicator.chosen_algorithm's, checked as a call checks them: raises
    InvalidUsageError for an unknown collective or algorithm, a bad root,
    or `nbytes` not an int >= 0."""
    nbytes = validation.byte_count(nbytes)
    if collective == ALL_TO_ALL_V:   # all_to_all's schedules and paths; out of place or through a workspace
        collective, in_place = ALL_TO_ALL, False
    if collective not in ALL_COLLECTIVES:
        raise InvalidUsageError(
            f"collective: unknown collective {collective!r}; expected one of "
            f"{', '.join((*ALL_COLLECTIVES, ALL_TO_ALL_V))}")
    step = loop_step(comm, collective, nbytes, dtype, compression, algorithm)
    if step is not None:
        if collective in ROOTED_COLLECTIVES:
            validation.root_rank(root, comm.size)   # a bad root raises, as on the other paths
        return auto.Choice(fastpath.step_algorithm(collective, step), COMPILED_LOOP, step)
    shape = comm._call_shape(collective, nbytes, dtype, root, algorithm, compression, in_place)   # noqa: SLF001
    return auto.Choice(shape.algorithm, path_of(comm._ranks, shape, symmetric and compression is None))   # noqa: SLF001


def loop_step(comm, collective, nbytes, dtype, compression, algorithm):
    """The compiled loop's step for a call it takes (the first rule), or
    None: the loop runs NCCL's five collectives, uncompressed, of a dtype
    it folds (None: one it does), with `auto` or naming the algorithm its
    step is, but a large message that the ranks may single copy, which it
    leaves to the plans. (A hierarchical communicator's shortcuts run its
    Programs, not the loop: its ranks have no loop of their own.)"""
    ranks = comm._ranks   # noqa: SLF001
    if collective in EXCHANGES or compression is not None or nbytes == 0:
        return None
    if getattr(ranks, "fast_allreduce" if collective == ALLREDUCE else "fast_collective", None) is None:
        return None
    if dtype is not None and not fastpath.takes(dtype):
        return None
    merged_max = comm._fast_small_max   # noqa: SLF001
    if algorithm != "auto" and not fastpath.runs_as(collective, algorithm, nbytes, merged_max):
        return None
    loop = getattr(ranks, "fast", None)
    step = None if loop is None else loop.step_for(collective, nbytes)
    if step is None:   # no channel (closed): the step its limits give
        step = fastpath.MERGED if nbytes <= merged_max else fastpath.STAGED
    return None if step == fastpath.PLANS else step   # (a call the loop leaves to the plans' single copy)


def path_of(ranks, shape, symmetric=False):
    """The path a planned call takes: the ranks' own choice where they have
    several paths (`chosen_path`: ShmRank.route, hierarchy.route, the GPU
    ranks' selector), else the one path that runs all their calls."""
    chosen = getattr(ranks, "chosen_path", None)
    if chosen is None:
        return getattr(ranks, "path", type(ranks).__name__)
    return chosen(shape, SYMMETRIC if symmetric else PLAIN)
