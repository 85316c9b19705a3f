"""One rank of tests/test_routes.py: host ranks in separate processes ask
`chosen_algorithm` about a call, make it, and hold the answer against what
ran (the compiled loop's step, or the plan and path of ShmRank.what_ran).

    mpiexec -n N python tests/routes_worker.py [routes LAYOUT]

With LAYOUT (one node label per rank, $COLLECTIVES_PRETEND_NODES), the
ranks form pretend nodes and ask a HierarchicalCommunicator, whose paths
hierarchy.route decides (what ran: HierarchyRanks.last_path, or a
shortcut's Program). Each rank prints "OK routes <rank> <cases>" when
every answer was what ran, or raises naming the first call whose answer
was not.
"""

import os
import sys

import numpy as np
from mpi4py import MPI

import collectives
from collectives import hierarchy
from collectives.algorithms import REGISTRY
from collectives.transport import fastpath

TIMEOUT = 30.0
ALGORITHMS = ("auto", "direct", "two_shot", "ring", "tree")
DTYPES = (np.float32, np.int32, np.float16)


def what_ran(comm, call):
    """Make `call` and say what ran it: (algorithm, path, step)."""
    rank = comm._ranks   # noqa: SLF001
    if hasattr(rank, "topology"):   # across nodes
        rank.last_path, calls = None, rank.calls
        call()
        if rank.last_path is None:   # the shortcuts ran the shape's Program from C
            assert rank.calls == calls + 1, "no path ran the call"
            return "hierarchical", hierarchy.PROGRAM, None
        return "hierarchical", rank.last_path, None
    loop = rank.fast
    rank.forget_what_ran()
    before = None if loop is None else loop.steps_taken
    call()
    plan = rank.what_ran()   # (the plans ran it: an all_to_all_v's counts may also go through the loop first)
    if plan is not None:
        return (*plan, None)
    assert loop is not None and loop.steps_taken == before + 1, "neither the loop nor a plan ran the call"
    step = loop.last_step
    return fastpath.step_algorithm(call.collective, step), "compiled_loop", step


class Call:
    """One call of the walk: `collective` on this rank's fresh arrays."""

    def __init__(self, comm, collective, count, dtype, algorithm, in_place, compression, as_list=False):
        self.comm, self.collective, self.algorithm, self.compression = comm, collective, algorithm, compression
        self.in_place, self.as_list = in_place, as_list
        n = comm.size
        self.x = (np.arange(count) % 7 + comm.rank).astype(dtype)
        gathered = collective in ("allgather", "gather")
        split = collective in ("reduce_scatter", "scatter")
        self.out = None if in_place else np.empty(count * n if gathered else count // n if split else count, dtype)
        self.root = n - 1 if collective in ("broadcast", "reduce", "gather", "scatter") else 0

    def __call__(self):
        comm, collective, x, out = self.comm, self.collective, self.x, self.out
        keywords = {"algorithm": self.algorithm}
        if self.compression is not None:
            keywords["compression"] = self.compression
        if collective in ("broadcast", "reduce", "gather", "scatter"):
            keywords["root"] = self.root
        if collective == "all_to_all_v":
            return comm.all_to_all_v(x, [x.size // comm.size] * comm.size, out=out, **keywords)
        if self.as_list:   # the rank-agnostic form: a list of this process's one rank's arrays
            result = getattr(comm, collective)([x], out=None if out is None else [out], **keywords)
            assert isinstance(result, list) and len(result) == 1, f"{self}: returned {type(result).__name__}"
            return result
        return getattr(comm, collective)(x, out=out, **keywords)

    def chosen(self):
        return self.comm.chosen_algorithm(self.collective, self.x.nbytes, root=self.root, dtype=self.x.dtype,
                                          in_place=self.in_place, compression=self.compression,
                                          algorithm=self.algorithm)

    def __str__(self):
        placement = "in place" if self.in_place else "out of place"
        return (f"{self.collective} of {self.x.size} {self.x.dtype}{' in a list' if self.as_list else ''} "
                f"{placement}, algorithm {self.algorithm}, compression {self.compression}")


def calls(comm):
    """Every collective over sizes on both sides of the loop's merged-step
    limit and the exchanges' single-copy limit, loop dtypes and float16,
    named algorithms and auto, in and out of place, compressed allreduces."""
    n = comm.size
    merged_max = MPI.COMM_WORLD.bcast(comm._ranks.fast_small_max)   # noqa: SLF001 - rank 0's: the same calls
    counts = {n * 4, n * (merged_max // 4 // n), n * (merged_max // 4 // n + 1), n * (1 << 16)}
    if hasattr(comm._ranks, "topology"):   # noqa: SLF001 - across nodes: an allgather sends a node's blocks
        counts.add(n * max(1, merged_max // 4 // n // MPI.COMM_WORLD.bcast(len(comm._ranks.node_ranks))))
    counts = sorted(counts)
    for collective in ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "gather", "scatter",
                       "all_to_all", "all_to_all_v"):
        for algorithm in ALGORITHMS:
            if algorithm != "auto" and collective not in REGISTRY[algorithm].collectives \
                    and not (collective == "all_to_all_v" and "all_to_all" in REGISTRY[algorithm].collectives):
                continue
            for dtype in DTYPES:
                for count in counts:
                    for in_place in (False, True):
                        if in_place and collective in ("allgather", "gather", "scatter", "all_to_all_v"):
                            continue   # (no in-place form)
                        yield Call(comm, collective, count, dtype, algorithm, in_place, None)
    for compression in ("bf16", "int8"):
        for count in counts:
            yield Call(comm, "allreduce", count, np.float32, "auto", False, compression)
    # A list of one array takes the bare array's path (chosen_algorithm's answer).
    for collective in ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce"):
        for count in counts:
            for in_place in (False,) if collective == "allgather" else (False, True):
                yield Call(comm, collective, count, np.float32, "auto", in_place, None, as_list=True)


def main():
    if len(sys.argv) > 2:   # routes LAYOUT
        os.environ["COLLECTIVES_PRETEND_NODES"] = sys.argv[2]
    comm = collectives.init(timeout=TIMEOUT)
    assert (len(sys.argv) > 2) == isinstance(comm, hierarchy.HierarchicalCommunicator), type(comm)
    cases = 0
    for call in calls(comm):
        chosen = call.chosen()
        # (a repeat is recognised and bound, and may run elsewhere; from the
        # second repeat on, a bound plan runs from C: the runner's repeats)
        for time in ("first", "repeated", "repeated again"):
            ran = what_ran(comm, call)
            assert (chosen.algorithm, chosen.path, chosen.step) == ran, \
                f"{call}, {time} call: chosen_algorithm said {chosen!r}, but {ran} ran"
            cases += 1
    comm.barrier()
    print(f"OK routes {comm.rank} {cases}", flush=True)
    comm.close()


if __name__ == "__main__":
    main()
