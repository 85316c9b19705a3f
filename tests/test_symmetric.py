"""Collectives on symmetric memory (Communicator.alloc, executors/symmetric.py):
the rows each rank runs, alloc on every kind of communicator, and, with
ranks in separate processes under mpiexec on emulated devices (and on a
GPU, marked `gpu`), the interpreter's bits for every collective, ranks
asking for different sizes, a call at another offset, a stalled rank and
graph capture (the checks of each rank are in tests/symmetric_worker.py).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import collectives
from backends import gpu_unavailable_reason
from collectives import InvalidUsageError, kernels
from collectives.binding import COPY_OP, INPUT, OUTPUT, REDUCE_FINAL_OP
from collectives.executors.symmetric import SYMMETRIC_FAULT_CODE
from collectives.executors.symmetric_rows import share_rows
from collectives.plan import COUNT, DST_OFF, KIND, NSRC, RANK, SRC0

WORKER = Path(__file__).with_name("symmetric_worker.py")
SCENARIOS = ["bits", "staged", "sizes", "mismatch", "staged_mismatch", "mixed", "growth_fails", "stalled", "killed",
             "graph"]   # tests/symmetric_worker.py
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")


def written_by(collective, n, count, itemsize, root=0, in_place=False):
    """{(destination rank, element): (writing rank, kind, sources)} over every rank's rows."""
    writes = {}
    for rank in range(n):
        for row in share_rows(collective, n, rank, root, count, itemsize, REDUCE_FINAL_OP, in_place):
            sources = tuple((int(row[SRC0 + 3 * i]), int(row[SRC0 + 3 * i + 1]), int(row[SRC0 + 3 * i + 2]))
                            for i in range(int(row[NSRC])))
            for e in range(int(row[COUNT])):
                key = (int(row[RANK]), int(row[DST_OFF]) + e)
                assert key not in writes, f"{collective}: element {key} written twice"
                writes[key] = (rank, int(row[KIND]), tuple((q, b, off + e) for q, b, off in sources))
    return writes


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_every_plan_the_one_pass_paths_take_gives_the_direct_plans_bits(n):
    # same_bits_as_direct's claim, on the NumPy interpreter: every registered
    # algorithm it accepts gives direct's bits (floats whose sums round), for
    # each collective the one-kernel and symmetric paths run.
    from collectives.algorithms import REGISTRY
    from collectives.executors.paths import ONE_PASS_COLLECTIVES, same_bits_as_direct
    from collectives.plan import build_plan
    rng = np.random.default_rng(n)
    taken = set()
    with collectives.Communicator.local(n) as comm:
        for collective in sorted(ONE_PASS_COLLECTIVES):
            xs = [(rng.standard_normal(n * 257) * 1e3).astype(np.float32) for _ in range(n)]
            call = {"allreduce": lambda a, xs: comm.allreduce(xs, algorithm=a),
                    "reduce_scatter": lambda a, xs: comm.reduce_scatter(xs, algorithm=a),
                    "allgather": lambda a, xs: comm.allgather(xs, algorithm=a),
                    "broadcast": lambda a, xs: comm.broadcast(xs, root=n - 1, algorithm=a),
                    "reduce": lambda a, xs: comm.reduce(xs, root=n - 1, algorithm=a)}[collective]
            want = call("direct", [x.copy() for x in xs])
            for name, spec in REGISTRY.items():
                if collective not in spec.collectives:
                    continue
                plan = build_plan(collective, name, n, xs[0].size, np.dtype(np.float32), "sum", root=n - 1)
                if not same_bits_as_direct(plan):
                    continue
                taken.add(name)
                got = call(name, [x.copy() for x in xs])
                assert all(a.tobytes() == b.tobytes() for a, b in zip(got, want)), (collective, name)
    assert "two_shot" in taken and "direct" in taken


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("count", [0, 1, 5, 64, 1003])
def test_every_output_element_is_written_once_from_the_right_sources(n, count):
    # allreduce: every element of every output, the fold of that element of
    # every input in rank order; each rank writes its own chunk only.
    writes = written_by("allreduce", n, count, 4)
    assert set(writes) == {(d, e) for d in range(n) for e in range(count)}
    for (d, e), (writer, kind, sources) in writes.items():
        assert kind == REDUCE_FINAL_OP and sources == tuple((q, INPUT, e) for q in range(n))
        assert all(w == writer for (_, e2), (w, _, _) in writes.items() if e2 == e)
    # reduce: the root's output only; broadcast: copies of the root's input.
    root = n - 1
    assert set(written_by("reduce", n, count, 4, root)) == {(root, e) for e in range(count)}
    broadcast = written_by("broadcast", n, count, 4, root, in_place=True)
    assert set(broadcast) == {(d, e) for d in range(n) if d != root for e in range(count)}
    assert all(kind == COPY_OP and sources == ((root, INPUT, e),) for (_, e), (_, kind, sources) in broadcast.items())
    # reduce_scatter (count = n blocks): rank r folds block r into its own output.
    block = count
    scatter = written_by("reduce_scatter", n, n * block, 4)
    assert set(scatter) == {(r, e) for r in range(n) for e in range(block)}
    assert all(writer == r and sources == tuple((q, INPUT, r * block + e) for q in range(n))
               for (r, e), (writer, _, sources) in scatter.items())
    # allgather (count = n blocks of output): rank r copies its input to block r of every output.
    gather = written_by("allgather", n, n * block, 4)
    assert set(gather) == {(d, e) for d in range(n) for e in range(n * block)}
    assert all(sources == ((writer, INPUT, e - writer * block),) and e // block == writer
               for (_, e), (writer, _, sources) in gather.items())
    in_place = written_by("allgather", n, n * block, 4, in_place=True)
    assert set(in_place) == {(d, e) for d in range(n) for e in range(n * block) if e // max(block, 1) != d}


def test_each_rank_reads_and_writes_about_the_message_the_memory_floor_on_one_gpu():
    # Summed over the ranks of an allreduce: every input read once, every
    # output written once (chunks at 16-byte boundaries).
    n, count = 4, 1 << 20
    reads = writes = 0
    for rank in range(n):
        rows = share_rows("allreduce", n, rank, 0, count, 4, REDUCE_FINAL_OP, False)
        reads += int(rows[0, COUNT]) * int(rows[0, NSRC])   # the group's sources, read once (fan-out)
        writes += int(rows[:, COUNT].sum())
    assert reads == writes == n * count


def test_alloc_gives_plain_arrays_where_ranks_share_a_process():
    with collectives.Communicator.local(3) as comm:
        xs = comm.alloc((2, 5), "float32")
        assert isinstance(xs, list) and len(xs) == 3
        assert all(isinstance(x, np.ndarray) and x.shape == (2, 5) and x.dtype == np.float32 for x in xs)
        for r, x in enumerate(xs):
            x[...] = r
        assert np.array_equal(comm.allreduce(xs)[1], np.full((2, 5), 3, np.float32))
    with collectives.Communicator.local(1, devices="emulated") as comm:
        x = comm.alloc(7, "bfloat16")
        assert isinstance(x, np.ndarray) and x.shape == (7,) and x.dtype == collectives.ops.BFLOAT16


@pytest.mark.parametrize("shape, dtype, message", [
    ((-1,), "float32", "shape"), ("abc", "float32", "shape"), ((2.5,), "float32", "shape"),
    (4, "complex64", "dtype"), (4, "bool", "dtype"), (4, "nonsense", "dtype")])
def test_alloc_refuses_bad_arguments(shape, dtype, message):
    with collectives.Communicator.local(2) as comm:
        with pytest.raises(InvalidUsageError, match=message):
            comm.alloc(shape, dtype)


def test_alloc_on_a_closed_communicator_is_refused():
    comm = collectives.Communicator.local(2)
    comm.close()
    with pytest.raises(InvalidUsageError, match="closed"):
        comm.alloc(4)


def test_a_barrier_fault_names_the_collective_on_symmetric_memory():
    word = kernels.LL_FAULT_TIMED_OUT | 2 << 8 | (SYMMETRIC_FAULT_CODE + 1) << 24 | 9 << 32
    fault = kernels.ll_fault(word)
    assert (fault.reason, fault.peer, fault.generation) == (kernels.LL_FAULT_TIMED_OUT, 1, 9)
    assert fault.collective == "reduce_scatter on symmetric memory"
    assert kernels.ll_fault(kernels.LL_FAULT_STOPPED | 3 << 24).collective == "broadcast"


@pytest.fixture(scope="module")
def emulation_library_built():
    """Built once here, not by every rank within its start-up timeout."""
    from collectives.devices import emulated
    emulated.library()


def run_ranks(n, scenario, device="emulated", limit=240):
    pytest.importorskip("mpi4py", reason="the multi-process tests need mpi4py: pip install '.[test]'")
    from test_mpi import run_worker
    flags = ["-disable-auto-cleanup"] if scenario == "killed" else []   # Hydra would kill the survivors
    oks, report = run_worker(WORKER, n, scenario, device, launcher_flags=flags, limit=limit,
                             environment={"COLLECTIVES_ONE_KERNEL_ALLREDUCE": "1"})
    assert len(oks) == (n - 1 if scenario == "killed" else n), report


@pytest.mark.mpi
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("n", [2, 3])
def test_across_processes(n, scenario, emulation_library_built):
    run_ranks(n, scenario)


@pytest.mark.mpi
@pytest.mark.gpu
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_across_processes_on_a_gpu(scenario):
    if gpu_unavailable_reason():
        pytest.skip(gpu_unavailable_reason())
    run_ranks(2, scenario, device="cuda", limit=400)


@pytest.mark.mpi
@pytest.mark.parametrize("tool", ["all_reduce_perf", "reduce_scatter_perf", "all_gather_perf", "broadcast_perf",
                                  "reduce_perf", "alltoall_perf", "gather_perf", "scatter_perf"])
def test_the_benchmarks_run_on_symmetric_memory(tool, tmp_path, emulation_library_built):
    # --symmetric: every size's results checked bit for bit, in place and
    # out of place, on buffers from comm.alloc (the path itself is checked
    # by the worker's barrier counts, above).
    pytest.importorskip("mpi4py", reason="needs mpi4py: pip install '.[test]'")
    from bench.mpis import find_mpiexec
    sweep = tmp_path / "sweep.json"
    done = subprocess.run(
        [find_mpiexec(), "-n", "2", sys.executable, "-m", f"bench.{tool}", "--device", "emulated", "--symmetric",
         "-b", "4K", "-e", "1M", "-f", "16", "-n", "2", "-w", "1", "-J", str(sweep)],
        cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=240,
        env=dict(os.environ, COLLECTIVES_ONE_KERNEL_ALLREDUCE="1"))
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(sweep.read_text())["rows"]
    assert len(rows) == 3 and all(r["out_of_place"]["wrong"] == r["in_place"]["wrong"] == 0 for r in rows)
    assert "--symmetric" in json.loads(sweep.read_text())["environment"]["command"]


@pytest.mark.mpi
def test_spmd_overhead_counts_a_symmetric_call_as_three_launches_and_no_host_wait(tmp_path,
                                                                                  emulation_library_built):
    pytest.importorskip("mpi4py", reason="needs mpi4py: pip install '.[test]'")
    result_file = tmp_path / "overhead.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.spmd_overhead", "--ranks", "2", "--bytes", "256K", "--symmetric",
         "--batches", "2", "--calls", "5", "-J", str(result_file)],
        cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(result_file.read_text())
    assert result["symmetric"] and result["one_kernel_issue_us_per_call"] > 0
    # Barrier, step kernel, barrier; the step protocol's ranks beside it wait on the host.
    assert result["round_trips_per_call"]["emulated+ll"] == {"peer waits": 0, "launches": 3, "event polls": 0}
    assert result["round_trips_per_call"]["emulated"]["peer waits"] > 0


# ll_barrier broken on purpose (kernels/ll_allreduce.cu), run by the workers:
# each must make them fail, naming what went wrong.
NO_WAIT = ("passed = p == args.rank || watch.reached(p, phase, args.signature);", "passed = true;")
NO_DISARM = ("for (long long i = 0; i < args.count; ++i) table[i] = 0;", "(void)table;")


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("broken, scenario, found", [
    (NO_WAIT, "staged", "!="),                      # a rank reads its peers' buffers before they are written
    (NO_DISARM, "mismatch", "wrote into"),          # a failed call writes every rank's memory
    (NO_DISARM, "staged_mismatch", "wrote an output"),
], ids=["barrier that does not wait", "no disarm, symmetric", "no disarm, staged"])
def test_a_broken_barrier_is_caught(tmp_path, broken, scenario, found, emulation_library_built):
    pytest.importorskip("mpi4py", reason="the multi-process tests need mpi4py: pip install '.[test]'")
    from collectives.devices import emulated
    from test_ll_kernel import broken_copy
    from test_mpi import mpi_launch, run_launch
    from symmetric_worker import BROKEN_KERNELS
    sources = broken_copy(tmp_path, *broken)
    emulated.library(sources)   # built here, not by every rank within its start-up timeout
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(WORKER.parent), os.environ.get("PYTHONPATH", "")]),
               COLLECTIVES_ONE_KERNEL_ALLREDUCE="1", **{BROKEN_KERNELS: str(sources)})
    env.pop("COLLECTIVES_TIMEOUT", None)
    done = run_launch([*mpi_launch(3), str(WORKER), scenario], 240, env)
    assert done.returncode != 0 and found in done.stdout + done.stderr, done.stdout[-3000:] + done.stderr[-3000:]
