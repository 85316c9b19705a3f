"""The one-kernel collectives (kernels/ll_allreduce.cu, executors/ll_allreduce.py)
through the communicator, each collective that takes the path, ranks in separate processes under mpiexec on
emulated devices (and on a GPU, marked `gpu`: all ranks share GPU 0, which
needs MPS to run their kernels at once): the NumPy interpreter's bits for
every dtype and op, a stalled or killed rank reported on every other rank,
a rank making a different call told so, and calls captured in a CUDA graph
(comm.graph()) replayed between direct calls. The checks of each
rank are in tests/ll_worker.py; the kernel alone is tested in
tests/test_ll_kernel.py.
"""

from pathlib import Path

import pytest

from backends import gpu_unavailable_reason
from collectives.executors.paths import ONE_PASS_COLLECTIVES
from test_mpi import run_worker

pytest.importorskip("mpi4py", reason="the multi-process tests need mpi4py: pip install '.[test]'")
pytestmark = pytest.mark.mpi

WORKER = Path(__file__).with_name("ll_worker.py")


# The collectives the executor runs as one kernel, the allreduce first, the
# others by name (a set's order differs between processes, and pytest-xdist
# needs every worker to collect the same order).
ON_THE_PATH = sorted(ONE_PASS_COLLECTIVES, key=lambda name: (name != "allreduce", name))


def run_ranks(n, scenario, device="emulated", collective="allreduce", limit=120):
    """Every rank must print OK (but a killed one)."""
    flags = ["-disable-auto-cleanup"] if scenario == "killed" else []   # Hydra would kill the survivors
    oks, report = run_worker(WORKER, n, scenario, device, collective, launcher_flags=flags, limit=limit,
                             environment={"COLLECTIVES_ONE_KERNEL_ALLREDUCE": "1"})
    assert len(oks) == (n - 1 if scenario == "killed" else n), report


@pytest.fixture(scope="module", autouse=True)
def emulation_library_built():
    """Built once here, not by every rank within its start-up timeout."""
    from collectives.devices import emulated
    emulated.library()


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_dtype_op_and_size_gives_the_interpreters_bits(n):
    run_ranks(n, "bits", collective="every")   # every collective of the path, one after another, in one launch


@pytest.mark.gpu
@pytest.mark.parametrize("collective", ON_THE_PATH)
@pytest.mark.parametrize("scenario", ["bits", "stalled", "killed", "mismatch"])
def test_on_a_gpu(scenario, collective):
    if gpu_unavailable_reason():
        pytest.skip(gpu_unavailable_reason())
    run_ranks(2 if scenario == "bits" else 3, scenario, device="cuda", collective=collective, limit=300)


@pytest.mark.parametrize("n", [2, 3])
def test_a_graph_replayed_between_direct_calls_gives_the_interpreters_bits(n):
    # Several collectives in one graph, replayed 40 times with direct calls
    # in between: the kernels count their calls in device memory.
    run_ranks(n, "graph")


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3])
def test_a_rank_that_stops_replaying_is_a_timeout_naming_it_on_every_other_rank(n):
    run_ranks(n, "graph_stalled")


@pytest.mark.gpu
@pytest.mark.parametrize("scenario", ["graph", "graph_stalled"])
def test_graphs_on_a_gpu(scenario):
    if gpu_unavailable_reason():
        pytest.skip(gpu_unavailable_reason())
    run_ranks(2 if scenario == "graph" else 3, scenario, device="cuda", limit=300)


@pytest.mark.slow
@pytest.mark.parametrize("collective", ON_THE_PATH)
@pytest.mark.parametrize("n", [2, 3])
def test_a_stalled_rank_is_a_timeout_naming_it_on_every_other_rank(n, collective):
    run_ranks(n, "stalled", collective=collective)


@pytest.mark.parametrize("collective", ON_THE_PATH)
def test_a_killed_rank_is_reported_on_every_other_rank(collective):
    run_ranks(3, "killed", collective=collective)


@pytest.mark.parametrize("collective", ON_THE_PATH)
@pytest.mark.parametrize("n", [2, 3])
def test_a_rank_making_a_different_call_is_told_so_on_every_rank(n, collective):
    run_ranks(n, "mismatch", collective=collective)
