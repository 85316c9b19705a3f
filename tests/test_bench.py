"""The benchmark harness: its arithmetic, table, JSON, and that it catches wrong results."""

import dataclasses
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench import backends, cli, harness
from bench.all_reduce_perf import ALLREDUCE
from cases import keeps_a_workspace_copy
from installed import require
from mpi_launch import mpi_launch, run_launch

ROOT = Path(__file__).resolve().parents[1]


def test_size_sweep_and_suffixes():
    args = harness.parse_args(ALLREDUCE, ["-b", "8", "-e", "1K", "-f", "4"])
    assert list(harness.sizes(args)) == [8, 32, 128, 512]
    assert cli.parse_size("64M") == 64 << 20 and cli.parse_size("1.5K") == 1536


def test_busbw_factor_is_nccl_tests():
    assert [ALLREDUCE.busbw_factor(n) for n in (1, 2, 4, 8)] == [0, 1, 1.5, 1.75]


@pytest.mark.parametrize("op", ["sum", "prod", "max", "min", "avg"])
@pytest.mark.parametrize("dtype", ["int8", "uint16", "float16", "float64"])
def test_closed_form_matches_a_direct_reduction(op, dtype):
    dtype, n, count = np.dtype(dtype), 5, 103
    stacked = np.stack([ALLREDUCE.fill(dtype, op, n, r, count).astype(np.float64) for r in range(n)])
    reference = {"sum": stacked.sum(0), "prod": stacked.prod(0), "max": stacked.max(0),
                 "min": stacked.min(0), "avg": stacked.mean(0)}[op]
    if op == "avg" and dtype.kind != "f":
        reference = np.trunc(reference)
    assert np.array_equal(ALLREDUCE.expected(dtype, op, n, 0, count), reference.astype(dtype))


def run_bench(spec, argv, capsys):
    code = harness.main(spec, argv)
    return code, capsys.readouterr().out


def test_table_and_json(tmp_path, capsys):
    path = tmp_path / "out.json"
    code, out = run_bench(ALLREDUCE, ["--ranks", "3", "-b", "8", "-e", "4K", "-f", "8", "-n", "2", "-w", "1",
                                      "-d", "half", "-o", "max", "-J", str(path)], capsys)
    assert code == 0, out
    rows = [line.split() for line in out.splitlines() if not line.startswith("#")]
    assert [int(r[0]) for r in rows] == [8, 64, 512, 4096]
    assert all(r[2:5] == ["float16", "max", "-1"] and r[8] == r[12] == "0" for r in rows)
    report = json.loads(path.read_text())
    assert report["collective"] == "allreduce"
    assert report["environment"]["ranks"] == 3 and report["environment"]["command"]
    row = report["rows"][-1]
    assert row["size"] == 4096 and row["count"] == 2048 and row["backend"] == "ours"
    for place in ("out_of_place", "in_place"):
        m = row[place]
        assert m["wrong"] == 0 and m["time_us"] > 0
        assert m["algbw"] == pytest.approx(4096 / (m["time_us"] * 1e-6) / 1e9)
        assert m["busbw"] == pytest.approx(m["algbw"] * 2 * 2 / 3)


def test_a_wrong_backend_is_caught(capsys):
    def off_by_one(comm, x, out, args):
        results = comm.allreduce(x, op=args.op, out=out)
        results[-1][-1] += 1  # one wrong element on the last rank

    broken = dataclasses.replace(ALLREDUCE, run_ours=off_by_one)
    code, out = run_bench(broken, ["--ranks", "2", "-b", "64", "-e", "64", "-n", "1", "-w", "0"], capsys)
    assert code == 1
    row = next(line.split() for line in out.splitlines() if not line.startswith("#"))
    assert row[8] == "1" and row[12] == "1"
    assert "# 2 WRONG elements" in out  # one out of place, one in place


UNCAUGHT_ON_RANK_1 = """
from bench.harness import mpi_world
world = mpi_world()
if world.rank == 1:
    raise RuntimeError("an error no code catches, on rank 1")
world.Barrier()   # where rank 0 would wait for rank 1 for ever
"""


@pytest.mark.mpi
def test_an_uncaught_exception_on_one_rank_ends_every_rank_of_a_tool(tmp_path):
    """A bench tool's rank that raises where nothing catches it aborts the
    world (harness.abort_on_uncaught_exceptions): the launch ends, with the
    traceback, where the other rank would have waited in MPI for ever."""
    pytest.importorskip("mpi4py", reason="needs mpi4py: pip install '.[test]'")
    done = run_launch([*mpi_launch(2), "-c", UNCAUGHT_ON_RANK_1], 60, cwd=ROOT)
    assert done.returncode != 0 and "RuntimeError" in done.stderr, done.stdout + done.stderr


@pytest.mark.mpi
def test_host_and_mpi_side_by_side_across_processes(tmp_path):
    pytest.importorskip("mpi4py", reason="needs mpi4py: pip install '.[test]'")
    path = tmp_path / "side.json"
    done = run_launch(
        [sys.executable, "-m", "bench.all_reduce_perf", "--backend", "host,mpi", "--ranks", "2",
         "-b", "1K", "-e", "64K", "-f", "8", "-n", "3", "-w", "1", "-J", str(path)], 120, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(path.read_text())
    assert report["environment"]["processes"] == 2 and "MPICH" in report["environment"]["mpi_library"]
    assert [r["backend"] for r in report["rows"]] == ["host", "mpi"] * 3
    assert all(r["out_of_place"]["wrong"] == r["in_place"]["wrong"] == 0 for r in report["rows"])
    assert all(r["vs_first"] > 0 for r in report["rows"])


@pytest.mark.mpi
def test_host_vs_mpich_times_three_libraries_per_collective(tmp_path):
    """python -m bench.host_vs_mpich: one mpiexec launch per process count,
    ours, MPICH and Gloo alternating in the same processes on the harness's
    specs, each size checked, every round in the JSON beside the machine,
    the versions and the exact command; every collective in both placements."""
    pytest.importorskip("mpi4py", reason="needs mpi4py: pip install '.[test]'")
    require("torch", reason="needs PyTorch for Gloo: pip install torch")
    path = tmp_path / "host_vs_mpich.json"
    command = [sys.executable, "-m", "bench.host_vs_mpich", "--quick", "--ranks", "2", "--sizes", "1K,4K",
               "--collectives", "all_to_all,broadcast", "--rounds", "3", "--floor-from", "4K", "-J", str(path)]
    done = run_launch(command, 240, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    table = [line for line in done.stdout.splitlines() if line.strip() and not line.startswith("#")]
    assert [line.split()[:2] for line in table] == [["1", "KiB"], ["4", "KiB"]] * 2
    # size (2), 5 cells per placement; calls of 4 KiB also the copy floor: "| floor", time and ratio per placement
    assert [len(line.split()) for line in table] == [12, 18, 12, 18]
    assert done.stdout.count("every element of every result as expected (three libraries)") == 2
    report = json.loads(path.read_text())
    assert report["command"] == "python -m bench.host_vs_mpich " + " ".join(command[3:])
    machine = report["machine"]
    assert machine["cores"] >= 1 and machine["cpu"] and machine["memory_bytes"] > 0 and machine["git_commit"]
    assert "MPICH" in machine["mpi_library"] and machine["mpi4py"] and machine["collectives"] and machine["torch"]
    assert not any(name.startswith("COLLECTIVES_BENCH") for name in machine["settings"])  # the tool's, not ours
    assert report["method"]["sizes"] == [1024, 4096] and report["method"]["rounds"] == 3
    binding = "core" if (os.cpu_count() or 1) >= 2 else "none"   # --bind-to auto: a core each, else unpinned
    assert [(r["collective"], r["mpi"], r["processes"], r["bind_to"]) for r in report["runs"]] == [
        ("all_to_all", "mpich", 2, binding), ("broadcast", "mpich", 2, binding)]
    for run in report["runs"]:
        assert len(run["affinity"]) == 2 and run["other_processes_cores"] >= 0
        assert run["launch"].startswith(f"mpiexec -bind-to {binding} -n 2 ") and "--worker-output" not in run["launch"]
        assert [row["size"] for row in run["rows"]] == [1024, 4096]
        places = ["out_of_place", "in_place"]
        assert run["placements"] == places
        for row in run["rows"]:
            assert [p for p in ("out_of_place", "in_place") if p in row] == places
            assert row["iters"] >= 1 and row["algorithm"]
            floored = row["size"] >= 4096   # both collectives only move bytes
            for place in places:
                assert sorted(row[place]) == sorted(["gloo", "mpich", "ours"] + (["floor"] if floored else []))
                for m in row[place].values():
                    assert m["wrong"] == 0 and len(m["rounds_us"]) == 3 and min(m["rounds_us"]) > 0
                    assert m["time_us"] == pytest.approx(statistics.median(m["rounds_us"]))
    # bench.report reads it: both libraries' ratios, per collective, both placements.
    from bench import report_host
    from bench.report_runs import Run
    measured = report_host.against_libraries(Run("host_vs_mpich.json", report, {}))
    assert [(m.content["collective"], sorted(m.content["ratios"])) for m in measured] == [
        ("all_to_all", ["Gloo", "MPICH", "the copy floor"]), ("broadcast", ["Gloo", "MPICH", "the copy floor"])]
    assert all(cells[0] > 0 and cells[1] > 0 for cells in measured[1].content["ratios"]["MPICH"].values())


def test_each_mpi_launches_with_the_same_placement_in_its_own_syntax(monkeypatch):
    """bench/mpis.py: hydra's flags, as the tests and tools write them, pass
    to MPICH unchanged and reach Open MPI's mpirun translated: rank r on
    core r mod cores (oversubscribed where the ranks outnumber the cores,
    which Open MPI refuses otherwise), survivors kept when a rank dies,
    variables per block of an MPMD launch."""
    from bench import mpis
    monkeypatch.setattr(mpis.os, "geteuid", lambda: 1000)   # as root Open MPI also needs --allow-run-as-root
    hydra = ["-disable-auto-cleanup", "-bind-to", "core"]
    assert mpis.translate_hydra_flags(mpis.MPICH, 4, hydra) == hydra
    assert mpis.launcher_flags(mpis.OPEN_MPI, 2, "core", cores=2) == [
        "--map-by", "core", "--rank-by", "span", "--bind-to", "core"]
    assert mpis.translate_hydra_flags(mpis.OPEN_MPI, 4, hydra) == mpis.launcher_flags(mpis.OPEN_MPI, 4, "core") + [
        "--enable-recovery"]
    assert mpis.launcher_flags(mpis.OPEN_MPI, 4, "core", cores=2) == [
        "--map-by", "core:oversubscribe", "--rank-by", "span", "--bind-to", "core:overload-allowed"]
    assert mpis.launcher_flags(mpis.OPEN_MPI, 4, "none", cores=2) == ["--oversubscribe", "--bind-to", "none"]
    assert mpis.launcher_flags(mpis.OPEN_MPI, 3, None, cores=2) == ["--oversubscribe"]
    assert mpis.translate_hydra_flags(mpis.OPEN_MPI, 1, ["-env", "A", "1"], whole_launch=False) == ["-x", "A=1"]
    monkeypatch.setattr(mpis.os, "geteuid", lambda: 0)
    assert mpis.launcher_flags(mpis.OPEN_MPI, 2, "none", cores=2)[0] == "--allow-run-as-root"
    with pytest.raises(ValueError, match="hydra's"):
        mpis.launcher_flags(mpis.OPEN_MPI, 4, "user:0,0,1,1")
    # The tests' launcher is read at each call, not at import.
    monkeypatch.setenv(mpis.TEST_MPI_VARIABLE, "openmpi")
    assert mpis.chosen_for_tests() == mpis.OPEN_MPI
    monkeypatch.delenv(mpis.TEST_MPI_VARIABLE)
    assert mpis.chosen_for_tests() == mpis.MPICH


def test_the_gpu_path_on_emulated_devices(capsys):
    """--device emulated: our kernels, compiled for the CPU, in the same table."""
    code, out = run_bench(ALLREDUCE, ["--device", "emulated", "--ranks", "3", "-b", "8", "-e", "64K", "-f", "32",
                                      "-n", "2", "-w", "1", "-d", "bfloat16", "-o", "avg"], capsys)
    assert code == 0, out
    assert "on emulated" in out and "all results correct" in out
    rows = [line.split() for line in out.splitlines() if not line.startswith("#")]
    assert [r[2] for r in rows] == ["bfloat16"] * 3 and all(r[8] == r[12] == "0" for r in rows)


@pytest.mark.slow
def test_gpu_check_runs_end_to_end_on_emulated_devices(tmp_path):
    """python -m bench.gpu_check --device emulated: the gpu tests, the kernel
    bandwidth against a copy, the allreduce table and the JSON, as on a GPU."""
    path = tmp_path / "check.json"
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--device", "emulated", "--bytes", "64K",
                           "--maxbytes", "256K", "--repeats", "2", "-J", str(path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(path.read_text())
    assert report["gpu_tests"]["returncode"] == 0 and " passed" in report["gpu_tests"]["summary"]
    assert [r["sources"] for r in report["kernel_bandwidth"]] == [1, 2, 4]
    assert all(r["step_GBps"] > 0 and r["copy_GBps"] > 0 for r in report["kernel_bandwidth"])
    assert report["allreduce"] and all(r["out_of_place"]["wrong"] == 0 for r in report["allreduce"])
    floor = report["against_floor"]["rows"]   # bench.floor: checked sizes, every method but the GPU's launches
    assert [r["bytes"] for r in floor] == [4, 16, 64, 256, 1024, 4096, 16384, 65536]
    assert all(r["call_us"] > 0 and r["prepared_us"] > 0 and r["graph_us"] > 0 and r["copy_us"] > 0
               and r["launch_us"] is None and r["cupy_launch_us"] is None for r in floor)
    assert report["environment"]["device"].startswith("emulated")
    processes = report["processes"]
    assert all(run["returncode"] == 0 for run in processes.values()), processes
    assert processes["allreduce"]["result"]["environment"]["processes"] == 2
    # The one-kernel path on plain arrays and on symmetric memory (128 KiB: beyond the LL, barrier-step-barrier).
    for name in ("allreduce_one_kernel", "allreduce_one_kernel_symmetric"):
        assert processes[name]["command"].startswith("COLLECTIVES_ONE_KERNEL_ALLREDUCE=1 ")
        rows = processes[name]["result"]["rows"]
        assert rows[-1]["size"] == 128 << 10 and all(r["out_of_place"]["wrong"] == 0 for r in rows)
    assert "--symmetric" in processes["allreduce_one_kernel_symmetric"]["command"]
    assert processes["overhead"]["result"]["ratio_to_host"]["emulated"] > 0
    assert report["processes_sharing"] == {"mode": "time-sliced", "why_not_mps": "not a GPU"}
    assert report["ours_vs_nccl"] == {"skipped": "NCCL needs a GPU"}
    assert [p.name for p in tmp_path.iterdir()] == ["check.json"]   # the allreduce table went to a scratch folder


def test_the_floor_benchmark_checks_every_size_and_saves_its_rows(tmp_path):
    """bench.floor on the emulated device, in place: each size checked
    against NumPy before it is timed, the rows and the command in the JSON."""
    from bench import floor
    path = tmp_path / "floor.json"
    report = floor.main(["--device", "emulated", "--ranks", "3", "-b", "5", "-e", "4K", "-f", "8", "--in-place",
                         "--calls", "2", "--rounds", "1", "-J", str(path)])
    assert json.loads(path.read_text()) == report
    assert report["command"].startswith("python -m bench.floor --device emulated")
    assert [r["bytes"] for r in report["rows"]] == [4, 40, 320, 2560]   # whole float32 elements (-b 5: one)
    assert all(r["algorithm"] == "direct" and r["copy_over_call"] > 0 for r in report["rows"])


def test_the_floor_benchmark_stops_on_a_wrong_result(monkeypatch):
    """A wrong allreduce is a failure, not a row (gpu_check records the
    error, fails, and still runs its later sections)."""
    from bench import floor
    monkeypatch.setattr(floor, "expected", lambda inputs: np.full(len(inputs[0]), 99, np.float32))
    with pytest.raises(floor.WrongResult, match="wrong elements at 64 bytes"):
        floor.main(["--device", "emulated", "--ranks", "2", "-b", "64", "-e", "64", "--calls", "1", "--rounds", "1"])


@pytest.mark.mpi
def test_gpu_ranks_across_processes_in_the_benchmarks(tmp_path):
    """all_reduce_perf and spmd_overhead under mpiexec with --device emulated:
    one GPU rank per process, results checked, round trips counted."""
    pytest.importorskip("mpi4py", reason="needs mpi4py: pip install '.[test]'")
    from bench.mpis import find_mpiexec
    sweep = tmp_path / "sweep.json"
    done = run_launch(
        [find_mpiexec(), "-n", "2", sys.executable, "-m", "bench.all_reduce_perf", "--device", "emulated",
         "-b", "8", "-e", "64K", "-f", "32", "-n", "2", "-w", "1", "-d", "bfloat16", "-J", str(sweep)], 120, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(sweep.read_text())
    assert report["environment"]["processes"] == 2 and "2 processes on emulated" in done.stdout
    assert all(r["out_of_place"]["wrong"] == r["in_place"]["wrong"] == 0 for r in report["rows"])

    overhead = tmp_path / "overhead.json"
    done = run_launch(
        [sys.executable, "-m", "bench.spmd_overhead", "--ranks", "2", "--batches", "2", "--calls", "20",
         "-J", str(overhead)], 120, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(overhead.read_text())
    assert result["environment"]["processes"] == 2 and "-bind-to core" in done.stdout
    trips = result["round_trips_per_call"]
    # One launch and one event poll (at least) per phase of this rank's plan with rows; host ranks launch nothing.
    assert trips["emulated"]["launches"] == result["phases_with_rows"] <= trips["emulated"]["event polls"]
    assert trips["host"]["launches"] == 0 and trips["host"]["peer waits"] == trips["emulated"]["peer waits"] > 0
    assert set(result["median_us_per_call"]) == {"host", "emulated", "emulated+ll"}
    # The one-kernel allreduce: one launch, and the host waits on nothing.
    assert trips["emulated+ll"] == {"peer waits": 0, "launches": 1, "event polls": 0}
    assert result["one_kernel_issue_us_per_call"] > 0

    # Another collective (allgather in place: x is its block of out) takes the one-kernel path too.
    done = run_launch(
        [sys.executable, "-m", "bench.spmd_overhead", "--ranks", "2", "--batches", "2", "--calls", "20",
         "--collective", "allgather", "--algorithm", "direct", "--in-place", "-J", str(overhead)], 120, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(overhead.read_text())
    assert result["collective"] == "allgather" and result["algorithm"] == "direct" and "allgather of" in done.stdout
    trips = result["round_trips_per_call"]
    assert trips["emulated"]["launches"] == result["phases_with_rows"] and trips["emulated"]["peer waits"] > 0
    assert trips["emulated+ll"] == {"peer waits": 0, "launches": 1, "event polls": 0}


def test_call_overhead_and_the_plans_model(tmp_path, capsys):
    from bench import call_overhead, model
    call_overhead.main(["--calls", "50", "--in-place", "--collectives", "allreduce,broadcast",
                        "-J", str(tmp_path / "overhead.json")])
    results = json.loads((tmp_path / "overhead.json").read_text())["results"]
    assert results["allreduce"]["launch_step_per_call"] == 6  # ring on 4 ranks, one device
    assert results["allreduce"]["outside_adapter_us_per_call"] > 0
    # The devices are the process's: they get their own methods back.
    from collectives.devices import open_device
    assert not set(call_overhead.ADAPTER_CALLS) & set(vars(open_device("emulated:0")))
    model.main(["plans", "--ranks", "3", "--bytes", "3K", "-J", str(tmp_path / "plans.json")])
    rows = json.loads((tmp_path / "plans.json").read_text())["rows"]
    for r in rows:
        copies = keeps_a_workspace_copy(r["collective"], r["algorithm"], r["binding"], 3)
        assert (r["workspace_copy_bytes"] > 0) == copies, r


def test_several_algorithms_alternate_in_one_run(tmp_path, capsys):
    """--algorithm a,b,c: each a backend of its own on the same ranks, size by
    size, with what auto picked in its rows."""
    path = tmp_path / "algorithms.json"
    code, out = run_bench(ALLREDUCE, ["--ranks", "3", "--algorithm", "auto,ring,tree,two_shot", "-b", "1K",
                                      "-e", "4K", "-f", "4", "-n", "1", "-w", "0", "-J", str(path)], capsys)
    assert code == 0 and "all results correct" in out, out
    rows = json.loads(path.read_text())["rows"]
    assert [r["backend"] for r in rows] == ["ours:auto", "ours:ring", "ours:tree", "ours:two_shot"] * 2
    from collectives.algorithms import REGISTRY
    assert all(r["picked"] in REGISTRY for r in rows)
    assert [r["picked"] for r in rows[1:4]] == ["ring", "tree", "two_shot"]


def test_every_timed_batch_comes_right_after_warm_calls(monkeypatch, capsys):
    """A batch runs on the machine the batch before it left (cores another
    library let go idle): each is preceded by untimed calls of its own
    backend for about WARM_SECONDS, as many on every rank (from the last
    batch's time, or one call timed first); none where a call is that long."""
    events = []
    per_call = {"seconds": 1e-3}

    def timed_calls(backend, buffers, calls, world):
        events.append(("timed", calls))
        return per_call["seconds"]

    def run(self, buffers):
        events.append("run")

    monkeypatch.setattr(harness, "timed_calls", timed_calls)
    monkeypatch.setattr(backends.Ours, "run", run)
    argv = ["--ranks", "2", "-b", "1K", "-e", "1K", "-n", "20", "-w", "0", "--rounds", "2", "-c", "0"]
    code, out = run_bench(ALLREDUCE, argv, capsys)
    assert code == 0, out
    warm = ["run"] * (int(harness.WARM_SECONDS / 1e-3) + 1)
    one_placement = [("timed", 1), *warm, ("timed", 20), *warm, ("timed", 20)]
    assert events == one_placement * 2
    events.clear()
    per_call["seconds"] = harness.WARM_SECONDS
    assert run_bench(ALLREDUCE, argv, capsys)[0] == 0
    assert events == [("timed", 1), ("timed", 20), ("timed", 20)] * 2


def test_the_model_reproduces_the_textbook_table(capsys):
    from bench import model
    model.main(["--table", "--ranks", "8", "--bytes", "1M"])
    table = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
             for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line}
    # textbook: rounds formula, its value for K = 8; ours: steps, sent per node
    assert table["star"][:3] == ["2K", "16", "2"]
    assert table["tree"][:3] == ["2 log2 K", "6", "6"]
    assert table["butterfly"][:3] == ["log2 K", "3", "3"]
    assert table["ring"][:4] == ["2(K-1)", "14", "14", "1.75 N"]
    assert table["halving_doubling"][2:4] == ["6", "1.75 N"] and table["two_shot"][2] == "2"


def test_the_model_calibrates_and_judges_auto_from_committed_runs(capsys):
    """The constants auto uses are what --calibrate fits to the committed
    runs, auto's recorded picks are what it picks today, and the README's
    bound (within 7% of the fastest algorithm) holds in the committed runs."""
    from bench import model
    from collectives.algorithms import MODELS, choose
    results = ROOT / "bench" / "results"
    runs = sorted(str(p) for p in results.glob("auto_calibration_*.json"))
    fitted = model.calibrate(runs)
    for transport in ("host-in-process", "host-processes", "host-processes-oversubscribed"):
        assert fitted[transport].step_seconds == pytest.approx(MODELS[transport].step_seconds, rel=0.01)
        assert fitted[transport].bytes_per_second == pytest.approx(MODELS[transport].bytes_per_second, rel=0.01)
    checks = sorted(str(p) for p in results.glob("auto_check_*proc.json"))
    assert len(checks) == 2
    for environment, row in model.load(checks):
        if row["algorithm"] == "auto":
            transport = model.transport_of(environment)
            assert row["picked"] == choose("allreduce", environment["ranks"], row["size"], 0, transport), row
    capsys.readouterr()
    worst = model.auto_against_fastest(checks)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    sizes = {(json.loads(open(path).read())["environment"]["ranks"], row["size"])
             for path in checks for row in json.loads(open(path).read())["rows"]}
    assert len(lines) == 1 + len(sizes)  # the header, then a row per (processes, size)
    ratios = [float(line.split("|")[-2]) for line in lines[1:]]
    assert max(ratios) == pytest.approx(worst, abs=0.005) and worst <= 1.07


def test_the_model_prints_its_prediction_next_to_measured_times(capsys):
    from bench import model
    model.main(["--results", str(ROOT / "bench" / "results" / "auto_check_2proc.json"), "--ranks", "2",
                "--bytes", "1M"])
    out = capsys.readouterr().out
    table = [line.split() for line in out.splitlines() if line.startswith("  ")]
    from collectives.algorithms import REGISTRY
    assert sorted(row[0] for row in table) == sorted(REGISTRY)   # every algorithm, with a measured time
    assert all(float(row[4]) > 0 and float(row[5]) > 0 for row in table)
    assert "measured (us)" in out and "| auto picks |" in out


@pytest.mark.parametrize("nodes", [2, 3, 4, 8, 64])
@pytest.mark.parametrize("range_bytes", [1 << 10, 1 << 20, 1 << 27])
def test_the_hierarchy_model_steps_across_nodes_as_the_code_does(nodes, range_bytes):
    """The scheme's own costs give docs/across-nodes.md's rounds and bytes
    sent (direct R = 1, V = (K-1) s; two_shot R = 2, V = 2 (K-1)/K s), and
    the fold reads K partials and writes one, of a rank's whole range s
    (direct) or its 1/K (two_shot)."""
    from bench import model
    from collectives.hierarchy import uses_two_shot
    step = model.across_nodes(nodes, range_bytes)
    k, s = nodes, range_bytes
    if uses_two_shot(k, s):
        assert step == ("two_shot", 2, pytest.approx(2 * (k - 1) / k * s), pytest.approx((k + 1) / k * s))
    else:
        assert step == ("direct", 1, (k - 1) * s, (k + 1) * s)


def test_the_hierarchy_model_calibrates_to_the_phases_of_a_run(tmp_path, capsys):
    """Fitted to the steps' times the model itself predicts, on 3 nodes
    whose step across is direct at some sizes and two_shot at others,
    --calibrate gives back the constants, and its model the totals. (The
    fit has no term for a round's further messages: they cost 0 here.)"""
    from bench import model
    known = model.Links(4e-6, 20e9, 30e-6, 3e9, 0.0, 60e9, "known")
    rows, schemes = [], set()
    for size in (1 << 10, 1 << 14, 1 << 18, 1 << 22, 1 << 26):
        seconds, parts, scheme = model.predict(known, 3, 2, size)
        schemes.add(scheme)
        rows.append({"size": size, "backends": {"hierarchical": {"out_of_place": seconds * 1e6}},
                     "components": {"inside_nodes": parts["inside"] * 1e6, "exchanges": parts["across"] * 1e6,
                                    "folds_across": parts["fold"] * 1e6}})
    assert schemes == {"direct", "two_shot"}
    run = tmp_path / "hierarchy.json"
    run.write_text(json.dumps({"nodes": [[0, 1], [2, 3], [4, 5]], "environment": {"command": "a run"}, "rows": rows}))
    fitted = model.calibrate_hierarchy(str(run), known._replace(source="the fallback"))
    assert fitted[:6] == pytest.approx(known[:6], rel=1e-6)
    ratios = [line.split("|")[-2].strip() for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert ratios == ["model / measured"] + ["1.00"] * len(rows)


def test_ours_beside_nccl_runs_the_nccl_rows_through_the_api(monkeypatch, capsys):
    """`--backend ours,nccl` (what gpu_check's section 5 runs on a GPU), here
    with an emulated communicator standing in for NCCL's: the NCCL rows go
    through the same harness path and the same Communicator API, and must
    name no algorithm of ours while calling the API with one it takes."""
    from bench import backends as bench_backends
    made = []
    real_local = bench_backends.collectives.Communicator.local

    def local(nranks, *, devices=None, timeout=None, backend="ours"):
        made.append(backend)
        if backend == "nccl":  # NCCL's stand-in: our kernels on emulated devices
            return real_local(nranks, devices=["emulated"] * nranks, timeout=timeout)
        return real_local(nranks, devices=devices, timeout=timeout, backend=backend)

    real_parse = harness.parse_args

    def parse_args(spec, argv=None):  # --backend nccl wants --device cuda: add it after the check
        args = real_parse(spec, argv)
        args.backends = [*args.backends, "nccl"]
        return args

    monkeypatch.setattr(bench_backends.collectives.Communicator, "local", staticmethod(local))
    monkeypatch.setattr(harness, "parse_args", parse_args)
    code, out = run_bench(ALLREDUCE, ["--device", "emulated", "--backend", "ours", "--ranks", "2", "-b", "64",
                                      "-e", "256", "-f", "4", "-n", "1", "-w", "1"], capsys)
    assert code == 0, out
    assert made == ["ours", "nccl"]
    rows = [line.split() for line in out.splitlines() if not line.startswith("#")]
    assert [r[-2] for r in rows] == ["ours", "nccl"] * 2, out
    assert "all results correct" in out


def test_gpu_check_starts_and_stops_a_private_mps_daemon(tmp_path, monkeypatch):
    """gpu_check's process section under MPS: the control daemon is started
    with private pipe and log folders, the processes get them, and it is told
    to quit even when the section fails. A script stands in for
    nvidia-cuda-mps-control and logs how it was called."""
    from bench import gpu_check
    log = tmp_path / "calls.log"
    control = tmp_path / "nvidia-cuda-mps-control"
    control.write_text(f"#!/bin/sh\necho \"$* stdin=$(cat) pipe=$CUDA_MPS_PIPE_DIRECTORY\" >> {log}\n")
    control.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(RuntimeError, match="the benchmark failed"):
        with gpu_check.mps_daemon("cuda") as (mode, env, why_not):
            assert (mode, why_not) == (gpu_check.MPS, None)
            pipe = Path(env["CUDA_MPS_PIPE_DIRECTORY"])
            assert pipe.is_dir() and Path(env["CUDA_MPS_LOG_DIRECTORY"]).is_dir()
            raise RuntimeError("the benchmark failed")
    calls = log.read_text().splitlines()
    assert calls == [f"-d stdin= pipe={pipe}", f" stdin=quit pipe={pipe}"], calls
    assert not pipe.exists(), "the private folder outlives the daemon"
    with gpu_check.mps_daemon("emulated") as (mode, env, why_not):
        assert (mode, why_not) == (gpu_check.TIME_SLICED, "not a GPU")
