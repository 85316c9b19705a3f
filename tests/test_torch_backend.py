"""The torch.distributed backend "collectives" (collectives/torch/process_group.py),
started by torchrun on 4 CPU processes with no mpiexec and mpi4py hidden.

Each test is one torchrun job of tests/torch_backend_worker.py, whose
ranks check their own results (against NumPy, against Gloo) and print
"OK <scenario> <rank>"; the worker's docstring says what each scenario
covers. One job per group of scenarios keeps the launches few: torch's
import and torchrun's start cost seconds per job.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from installed import needs

pytestmark = needs("torch", reason="the torch backend needs PyTorch: pip install '.[torch]'")

WORKER = Path(__file__).with_name("torch_backend_worker.py")
RANKS = 4
# Launchers' variables that would make the library look for MPI: the jobs must start without them.
MPI_VARIABLES = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "HYDRA_CONTROL_FD")


def torchrun(scenarios, limit=150, **environ):
    """Run the worker's `scenarios` (comma-separated) under torchrun; the
    OK lines per scenario, the exit code, and a report for failures."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(WORKER.parent.parent), str(WORKER.parent), os.environ.get("PYTHONPATH", "")]), **environ)
    for name in (*MPI_VARIABLES, "COLLECTIVES_TIMEOUT", "TORCH_BACKEND_TEST_SABOTAGE", "COLLECTIVES_PRETEND_NODES"):
        if name not in environ:
            env.pop(name, None)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS),
                           "--standalone", str(WORKER), scenarios],
                          capture_output=True, text=True, timeout=limit, env=env, cwd=WORKER.parent)
    report = f"exit {done.returncode}\n--- stdout\n{done.stdout[-6000:]}\n--- stderr\n{done.stderr[-6000:]}"
    oks = {s: sorted(int(r) for r in re.findall(rf"OK {s} (\d+)", done.stdout)) for s in scenarios.split(",")}
    return oks, done.returncode, report


@pytest.mark.processes
def test_every_op_and_training_against_numpy_and_gloo():
    """init: collectives.init() under torchrun; ops: every op, form and dtype against NumPy, object collectives,
    barrier, futures, refusals; training: DDP against Gloo's DDP, FSDP2."""
    oks, code, report = torchrun("init,ops,training")
    assert code == 0 and oks == {"init": [0, 1, 2, 3], "ops": [0, 1, 2, 3], "training": [0, 1, 2, 3]}, report
    assert sorted(re.findall(r"OK destroyed (\d)", report)) == ["0", "1", "2", "3"], report
    assert "max |ours - gloo|" in report and "max |fsdp2 - ddp|" in report, report


@pytest.fixture(scope="module")
def on_pretend_nodes():
    """One torchrun job on two pretend nodes of two ranks for both tests
    there (each job's start costs about 15 CPU-s): every op, training and
    compression, then the failures, which end it. (On one node the failures
    run apart: the first job ends by destroying the process group, which
    its test checks and a dead rank would prevent.)"""
    return torchrun("init,ops,training,compressed,failure", COLLECTIVES_PRETEND_NODES="0,0,1,1")


@pytest.mark.processes
def test_pretend_nodes_run_on_the_hierarchy_with_gloo_between_nodes(on_pretend_nodes):
    """The same checks on two pretend nodes of two ranks: shared memory
    inside each, Gloo between them (the worker checks the communicator is
    the hierarchical one); and compression_hook and DistributedOptimizer
    compressed across them, on our group and beside Gloo."""
    oks, code, report = on_pretend_nodes
    everyone = [0, 1, 2, 3]
    assert {s: oks[s] for s in ("init", "ops", "training", "compressed")} == {
        "init": everyone, "ops": everyone, "training": everyone, "compressed": everyone}, report


@pytest.mark.processes
@pytest.mark.parametrize("nodes", [None, "0,0,1,1"], ids=["one-node", "pretend-nodes"])
def test_stalled_mismatched_and_killed_ranks_raise_typed_errors(nodes, request):
    """The last rank stalls, then ranks disagree on a shape, then the last
    rank is killed: the others raise CollectiveTimeoutError,
    InvalidUsageError and RankFailedError (through work.wait() and DDP's
    backward) within the group's timeout. The killed rank fails the job;
    the others must each say OK. On pretend nodes the failures cross the
    Gloo link too (a dead peer's closed connection is RankFailedError)."""
    oks, code, report = request.getfixturevalue("on_pretend_nodes") if nodes else torchrun("failure")
    assert oks["failure"] == [0, 1, 2], report
    assert code != 0, report   # torchrun reports the killed rank
    assert report.count("CollectiveTimeoutError after") == RANKS, report
    assert len(re.findall(r"killed rank, DDP rank \d: RuntimeError", report)) == RANKS - 1, report


@pytest.mark.processes
def test_a_wrong_reference_is_caught():
    """The checks can fail: with the reference of a SUM made wrong, every
    rank's ops scenario fails and says which check."""
    oks, code, report = torchrun("ops", TORCH_BACKEND_TEST_SABOTAGE="1")
    assert code != 0 and oks == {"ops": []}, report
    assert "AssertionError" in report and "allreduce" in report, report


@pytest.mark.processes
def test_the_benchmarks_time_torch_collectives_beside_gloo(tmp_path):
    """--backend ours,torch:collectives,torch:gloo relaunches the tool under
    torchrun (no mpiexec): every backend's rows, every result correct."""
    out = tmp_path / "rows.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(WORKER.parent.parent), os.environ.get("PYTHONPATH", "")]))
    for name in (*MPI_VARIABLES, "COLLECTIVES_BENCH_RELAUNCHED"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-m", "bench.reduce_scatter_perf", "--backend",
                           "ours,torch:collectives,torch:gloo", "--ranks", "2", "-b", "1K", "-e", "4K", "-f", "4",
                           "-n", "2", "-w", "1", "-q", "-J", str(out)],
                          capture_output=True, text=True, timeout=150, env=env, cwd=WORKER.parent.parent)
    report = f"exit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr[-4000:]}"
    assert done.returncode == 0 and "torch.distributed.run" in done.stdout, report
    import json
    rows = json.loads(out.read_text())
    assert [r["backend"] for r in rows["rows"]] == ["ours", "torch:collectives", "torch:gloo"] * 2, report
    assert all(r[p]["wrong"] == 0 for r in rows["rows"] for p in ("out_of_place", "in_place")), report
    assert rows["environment"]["torch"].startswith("2.") and "torchrun" in rows["environment"]["command"], report


@pytest.mark.slow
@pytest.mark.processes
def test_pytorchs_own_suite_runs_on_our_backend_with_its_name_gates_lifted():
    """tests/torch_suite.py, PyTorch's own distributed tests on our group:
    one of the tests torch skips for us by name alone, once --ungated lifts
    that gate (the sparse allreduce, which only Gloo offers among torch's
    CPU backends): without the lift it would skip. (get_future, gated the
    same way, passes too; tests/torch_backend_worker.py reads futures, and
    each of torch's tests starts 3 processes of its own.)"""
    pytest.importorskip("expecttest", reason="PyTorch's test modules need expecttest: pip install '.[test]'")
    suite = WORKER.with_name("torch_suite.py")
    env = {name: value for name, value in os.environ.items() if name not in (*MPI_VARIABLES, "COLLECTIVES_TIMEOUT")}
    done = subprocess.run([sys.executable, str(suite), "--ungated", "-k",
                           "test_sparse_all_reduce_sum and not cuda and not gpu"],
                          capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0 and re.search(r"\b1 passed\b", done.stdout), done.stdout[-4000:] + done.stderr[-4000:]
