"""`Communicator.chosen_algorithm` tells what runs: host ranks in processes
walk every collective over the loop's steps and the plans' paths (tests/
routes_worker.py) and hold each answer, a registered algorithm with its
path and the loop's step, against what ran the call, its first time and
two repeats (the second a bound plan's run from C), under each setting that moves calls between paths; and ranks
on pretend nodes, whose HierarchicalCommunicator answers the path
hierarchy.route takes (a compiled Program, the phases, the codec between
nodes, the exchanges)."""

import re
from pathlib import Path

import pytest

from mpi_launch import mpi_launch, run_launch, run_nodes_worker

pytest.importorskip("mpi4py", reason="the multi-process tests need mpi4py: pip install '.[test]'")
pytestmark = pytest.mark.mpi

WORKER = Path(__file__).with_name("routes_worker.py")

# ranks, and the settings of the launch: every path the answer can name
# (the loop's and the exchanges' single-copy limits, 4 MiB by default,
# lowered where the walk's largest calls, 512 KiB of float32 on 2 ranks,
# must cross them)
CROSSED_LIMITS = {"COLLECTIVES_STAGED_MAX": str(256 << 10), "COLLECTIVES_EXCHANGE_SINGLE_COPY_MIN": str(256 << 10)}
LAUNCHES = {
    "2 ranks": (2, CROSSED_LIMITS),                                       # dedicated cores: the single copy
    "3 ranks, oversubscribed": (3, {}),                                   # staged small allgathers
    "staged large messages": (3, {"COLLECTIVES_FAST_SINGLE_COPY": "0"}),  # no single copy, loop or exchanges
    "no compiled plans": (2, {"COLLECTIVES_COMPILED_PLANS": "0"}),        # the interpreter runs the plans
    "no compiled loop": (2, {"COLLECTIVES_FAST_PATH": "0"}),              # the plans run every call
}


@pytest.mark.parametrize("launch", LAUNCHES)
def test_chosen_algorithm_names_what_ran_every_call(launch):
    ranks, settings = LAUNCHES[launch]
    flags = [flag for name, value in settings.items() for flag in ("-env", name, value)]
    done = run_launch([*mpi_launch(ranks, *flags), str(WORKER)], 300)
    report = f"exit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    oks = re.findall(r"OK routes \d+ (\d+)", done.stdout)
    assert done.returncode == 0 and len(oks) == ranks, report
    assert len(set(oks)) == 1 and int(oks[0]) > 1000, report   # every rank walked the same calls, and many


@pytest.mark.parametrize("layout", ["a,a,b,b", "a,a,b", "a,b"])
def test_across_nodes_chosen_algorithm_names_the_path_that_ran(layout):
    oks, report = run_nodes_worker(WORKER, "routes", layout)
    assert len(oks) == len(layout.split(",")), report
    walked = re.findall(r"OK routes \d+ (\d+)", report)
    assert len(set(walked)) == 1 and int(walked[0]) > 1000, report
