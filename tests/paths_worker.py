"""One rank of tests/test_paths.py's multi-process tests, started N times
under mpiexec with $COLLECTIVES_ONE_KERNEL_ALLREDUCE=1:

    mpiexec -n N python tests/paths_worker.py SCENARIO [DEVICE]

"chosen_path": the path chosen_algorithm names for small, large,
symmetric, ring and compressed calls is the one each call takes, told by
its launches (executors/paths.py).

Each rank prints "OK <scenario> <rank>" when every check held.
"""

import sys

import numpy as np

import ll_worker
import symmetric_worker
from symmetric_worker import beyond_the_ll, plain

FLOAT32 = np.dtype(np.float32)


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
