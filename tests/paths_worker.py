"""One rank of tests/test_paths.py's multi-process tests, started N times
under mpiexec with $COLLECTIVES_ONE_KERNEL_ALLREDUCE=1:

    mpiexec -n N python tests/paths_worker.py SCENARIO [DEVICE]

Each scenario makes rank FAILING's call one that takes another execution
path than its peers' call (executors/paths.py): the one-kernel LL kernel,
symmetric memory, staging buffers, the step protocol, a barrier, a graph's
replay. Ranks on different paths never meet in one protocol's signature
check, so the call records (executors/device_protocol.py) must name the
mismatch: every rank raises InvalidUsageError saying "different call",
well before the timeout, and no rank's arrays are written.

"ll_vs_symmetric": rank FAILING broadcasts an array of comm.alloc past the
LL's 64 KiB (symmetric memory) while its peers allreduce 256 float32 (LL).
"ll_vs_staged": rank FAILING allreduces a large plain array (staged).
"ll_vs_step": rank FAILING asks for ring, which 3 ranks run on the step protocol.
"staged_vs_step", "symmetric_vs_step": the same, large, on plain arrays
and on symmetric memory.
"ll_vs_barrier": rank FAILING calls barrier().
"replay_vs_staged": rank FAILING replays a graph of an LL call while its
peers make a large call on plain arrays.
"algorithms_of_one_kernel" (2 ranks): rank FAILING asks for ring, its peer
for direct: both run the LL kernel, with the same bits, but the calls differ.
"chosen_path": no mismatch: the path chosen_algorithm names for small,
large, symmetric, ring and compressed calls is the one each call takes,
told by its launches.

Each rank prints "OK <scenario> <rank>" when every check held.
"""

import sys
import time

import numpy as np
from mpi4py import MPI

from collectives import InvalidUsageError
import ll_worker
import symmetric_worker
from peer_failure_worker import FAILING, TIMEOUT
from symmetric_worker import beyond_the_ll, plain, to_host, write

FLOAT32 = np.dtype(np.float32)


class Call:
    """A call of rank `comm.rank`'s own: its arrays, filled with sentinels,
    and what it runs."""

    def __init__(self, comm, kind):
        n = comm.size
        large = beyond_the_ll("allreduce", n, FLOAT32, 100)
        self.kind = kind
        if kind == "barrier":
            self.arrays = []
            return
        if kind in ("small", "ring", "replay"):
            x, out = plain(256, FLOAT32), plain(256, FLOAT32)
        elif kind in ("staged", "staged_ring"):
            x, out = plain(large, FLOAT32), plain(large, FLOAT32)
        else:   # on symmetric memory: every rank allocates alike (alloc is collective)
            x, out = comm.alloc(large, FLOAT32), comm.alloc(large, FLOAT32)
        write(x, np.full(x.size, comm.rank + 1, FLOAT32))
        write(out, np.full(out.size, -7, FLOAT32))
        self.x, self.out, self.arrays = x, out, [x, out]
        self.graph = None

    def issue(self, comm):
        kind = self.kind
        if kind == "barrier":
            comm.barrier()
        elif kind == "symmetric_broadcast":
            comm.broadcast(self.x, root=0)
        elif kind in ("symmetric_ring", "staged_ring"):
            comm.allreduce(self.x, out=self.out, algorithm="ring")
        elif kind == "ring":
            comm.allreduce(self.x, out=self.out, algorithm="ring")
        elif kind == "replay":
            self.graph.replay()
        else:
            comm.allreduce(self.x, out=self.out)
        comm.synchronize()

    def snapshot(self):
        return [to_host(a).copy() for a in self.arrays]


def allocate_alike(comm):
    """Symmetric memory is allocated by every rank alike: the scenarios that
    use it on one rank allocate it on all, and use it only there."""
    large = beyond_the_ll("allreduce", comm.size, FLOAT32, 100)
    return comm.alloc(large, FLOAT32), comm.alloc(large, FLOAT32)


def mismatch(comm, mine, theirs, warm=()):
    """Rank FAILING makes a call of kind `mine`, its peers of kind `theirs`:
    every rank must raise InvalidUsageError naming a different call within
    half the timeout, with its arrays as they were."""
    for kind in warm:   # every rank alike: set-up, staging buffers, kernels
        Call(comm, kind).issue(comm)
    kind = mine if comm.rank == FAILING else theirs
    needs_memory = {"symmetric_broadcast", "symmetric_ring"} & {mine, theirs}
    if needs_memory and kind not in needs_memory:
        allocate_alike(comm)   # the peers' comm.alloc calls, made alike
    call = Call(comm, kind)
    if kind == "replay":
        with comm.graph() as call.graph:
            comm.allreduce(call.x, out=call.out)
    elif "replay" in (mine, theirs):
        with comm.graph():   # every rank captures alike (a capture runs nothing)
            pass
    before = call.snapshot()
    MPI.COMM_WORLD.Barrier()   # every rank's set-up done: the mismatch below is all that fails
    start = time.perf_counter()
    try:
        call.issue(comm)
    except InvalidUsageError as error:
        elapsed = time.perf_counter() - start
        assert "different call" in str(error), error
        assert elapsed < TIMEOUT / 2, f"the mismatch was found by the timeout, after {elapsed:.1f} s: {error}"
    except Exception as error:   # noqa: BLE001 - the class is what is checked
        raise AssertionError(f"rank {comm.rank} ({kind}) raised {type(error).__name__}: {error}") from error
    else:
        raise AssertionError(f"rank {comm.rank}'s {kind} call completed although rank {FAILING} made another")
    after = call.snapshot()
    for a, b in zip(before, after):
        assert np.array_equal(a, b), f"rank {comm.rank}'s failed {kind} call wrote its arrays: {b[:3]}, was {a[:3]}"


def scenario_ll_vs_symmetric(comm):
    mismatch(comm, "symmetric_broadcast", "small", warm=["small"])


def scenario_ll_vs_staged(comm):
    mismatch(comm, "staged", "small", warm=["small", "staged"])


def scenario_ll_vs_step(comm):
    mismatch(comm, "ring", "small", warm=["small", "ring"])


def scenario_staged_vs_step(comm):
    mismatch(comm, "staged_ring", "staged", warm=["small", "staged", "staged_ring"])


def scenario_symmetric_vs_step(comm):
    mismatch(comm, "symmetric_ring", "staged", warm=["small", "staged"])


def scenario_ll_vs_barrier(comm):
    mismatch(comm, "barrier", "small", warm=["small"])


def scenario_replay_vs_staged(comm):
    mismatch(comm, "replay", "staged", warm=["small", "staged"])


def scenario_algorithms_of_one_kernel(comm):
    """2 ranks: ring and direct both run as the LL kernel, with the same
    bits, which its flags cannot tell apart; the records can, as the step
    protocol does."""
    mismatch(comm, "ring", "small", warm=["small", "ring"])


class Launches:
    """The launches this rank's device is asked for, by kind."""
    KINDS = ("launch_ll_allreduce", "launch_ll_barrier", "launch_step")

    def __init__(self, device):
        self.counts = dict.fromkeys(self.KINDS, 0)
        for kind in self.KINDS:
            original = getattr(device, kind)

            def counted(*args, _original=original, _kind=kind):
                self.counts[_kind] += 1
                return _original(*args)
            setattr(device, kind, counted)

    def take(self):
        taken, self.counts = self.counts, dict.fromkeys(self.KINDS, 0)
        return taken


def scenario_chosen_path(comm):
    """The path chosen_algorithm names is the one a call takes (told by its
    launches), and the launches the ranks report are the call's."""
    n = comm.size
    ranks = comm._ranks   # noqa: SLF001 - the test looks inside on purpose
    launches = Launches(ranks.device)
    planned = []
    run = ranks.run
    ranks.run = lambda plan, *rest: (planned.append(plan), run(plan, *rest))[1]
    small, large = 256, beyond_the_ll("allreduce", n, FLOAT32, 100)
    symmetric_x = comm.alloc(large, FLOAT32)
    cases = [  # (x, algorithm, compression, symmetric, the path, the launches it makes; None: the step kernel's)
        (plain(small, FLOAT32), "auto", None, False, "ll", {"launch_ll_allreduce": 1}),
        (plain(small, FLOAT32), "two_shot", None, False, "ll", {"launch_ll_allreduce": 1}),
        (plain(large, FLOAT32), "auto", None, False, "staged", {"launch_ll_barrier": 2, "launch_step": 3}),
        (symmetric_x, "auto", None, True, "symmetric", {"launch_ll_barrier": 2, "launch_step": 1}),
        (plain(small, FLOAT32), "ring", None, False, "step", None),
        (plain(large, FLOAT32), "auto", "fp16", False, "step", {}),   # codec kernels only
    ]
    for x, algorithm, compression, symmetric, path, made in cases:
        kind = "symmetric" if symmetric else "plain"
        chosen = comm.chosen_algorithm("allreduce", x.nbytes, algorithm=algorithm, compression=compression,
                                       symmetric=symmetric)
        case = f"{x.size} float32, {algorithm}, {compression}, {kind}: {chosen!r}"
        assert chosen.path == path and (algorithm == "auto" or chosen == algorithm), case
        launches.take()
        comm.allreduce(x, algorithm=algorithm, compression=compression)
        comm.synchronize()
        counts, plan = launches.take(), planned[-1]
        assert plan.algorithm == chosen and ranks.chosen_path(plan, kind) == path, case
        if made is None:
            made = {"launch_step": ranks.launches(plan, kind)}
        assert counts == {**dict.fromkeys(Launches.KINDS, 0), **made}, (case, counts)
        if compression is None:
            assert ranks.launches(plan, kind) == sum(made.values()), case
    comm.barrier()


def main():
    scenario = sys.argv[1]
    ll_worker.DEVICE = symmetric_worker.DEVICE = sys.argv[2] if len(sys.argv) > 2 else "emulated"
    ll_worker.run_one_kernel_rank(scenario, globals())


if __name__ == "__main__":
    main()
