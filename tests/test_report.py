"""docs/benchmarks.md and the README's results table are exactly what
`python -m bench.report` writes from bench/results/, so neither can drift
from the measurements; and the page shows, per question, the latest run of
each configuration and links the rest."""

import json
import os
import re
import subprocess
import sys

import pytest

from bench import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = report.ROOT / report.RESULTS

OLD, NEW = "a" * 40, "b" * 40
HISTORY = {OLD: 1000, NEW: 2000}  # NEW is the later commit


def test_committed_page_is_what_the_report_writes_today():
    committed = (report.ROOT / report.OUTPUT).read_text()
    assert committed == report.render(RESULTS), (
        "docs/benchmarks.md is out of date with bench/results/: run python -m bench.report and commit it")


def test_committed_readme_table_is_what_the_report_writes_today():
    runs = report.load_runs(RESULTS)
    committed = report.readme_block((report.ROOT / report.README).read_text())
    assert committed is not None, f"README.md has lost its {report.README_START} block"
    assert committed == report.readme_table(runs, report.repository_history()), (
        "README.md's results table is out of date with bench/results/: run python -m bench.report and commit it")


def test_the_page_links_every_run():
    """Nothing is lost: every file is shown or linked, relative to docs/."""
    page = (report.ROOT / report.OUTPUT).read_text()
    for path in sorted(RESULTS.rglob("*.json")):
        relative = path.relative_to(RESULTS).as_posix()
        if relative != report.NOTES:
            assert f"](../bench/results/{relative})" in page, relative


def test_every_run_names_the_commit_it_measured():
    """A run whose JSON records no commit gets one in bench/results/notes.json
    (the commit that added the file), or is deleted."""
    notes = json.loads((RESULTS / report.NOTES).read_text())
    unmarked = []
    for path in sorted(RESULTS.rglob("*.json")):
        if path.name == report.NOTES:
            continue
        relative = path.relative_to(RESULTS).as_posix()
        recorded = report.run_environment(json.loads(path.read_text())).get("git_commit")
        if (not recorded or recorded == "unknown") and not notes.get(relative, {}).get("commit"):
            unmarked.append(relative)
    assert not unmarked, f"add their commit to bench/results/notes.json: {unmarked}"


def test_no_run_names_a_path_outside_the_repository():
    """Recorded commands say `python -m ...` and name output files as the
    repository keeps them: no interpreter or folder of the machine that
    ran them (bench.environment.command_line)."""
    outside = re.compile(r"(?<![\w.])/(?:work|tmp|root|home|opt|usr|mnt|scratch)/")
    named = [path.relative_to(RESULTS).as_posix() for path in sorted(RESULTS.rglob("*.json"))
             if outside.search(path.read_text())]
    assert not named, f"these runs name a path outside the repository: {named}"


def test_the_repository_history_dates_the_commits_runs_record():
    """What orders runs: the commits of this checkout, the current one among them."""
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    assert head.stdout.strip() in report.repository_history()


# -- synthetic runs --------------------------------------------------------------------


def suite_run(commit, mpi_over_ours, collective="reduce_scatter", processes=2):
    """A harness run on host ranks, ours against mpi, MPICH `mpi_over_ours` times slower at every size."""
    environment = {"command": f"mpiexec -n {processes} /x/.venv/bin/python -m bench.reduce_scatter_perf "
                              f"--backend ours,mpi -J ../scratch/out.json",
                   "cpu": "Test CPU", "cores": 2, "device": "host (no GPU)", "processes": processes,
                   "ranks": processes, "mpi_library": "MPICH Version: 9.9.9", "git_commit": commit}
    rows = [{"backend": b, "size": size, "type": "float32", "redop": "sum",
             "out_of_place": {"time_us": 10.0 * (mpi_over_ours if b == "mpi" else 1)},
             "in_place": {"time_us": 5.0 * (mpi_over_ours if b == "mpi" else 1)}}
            for size in (4096, 1024) for b in ("ours", "mpi")]
    return {"collective": collective, "environment": environment, "rows": rows}


def host_vs_mpich_run(commit, collective=None):
    """bench.host_vs_mpich's shape: MPICH twice as slow; runs name their collective when given."""
    run = {"processes": 2, "bind_to": "core",
           "environment": {"git_commit": commit, "device": "host (no GPU)", "cores": 2, "cpu": "Test CPU",
                           "mpi_library": "MPICH Version: 9.9.9"},
           "rows": [{"size": 64, "out_of_place": {"ours": {"time_us": 1.0}, "mpich": {"time_us": 2.0}},
                     "in_place": {"ours": {"time_us": 1.0}, "mpich": {"time_us": 2.0}}}]}
    if collective:
        run["collective"] = collective
    return {"benchmark": "allreduce float32 sum, ours vs MPICH", "command": "python -m bench.host_vs_mpich --ranks 2",
            "machine": run["environment"], "runs": [run]}


def write(folder, files, notes=None):
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps(data))
    if notes is not None:
        (folder / report.NOTES).write_text(json.dumps(notes))


def section(page, title):
    """The text of `## title` up to the next `## `."""
    return page.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def keras_fit_run(commit, ours_ms, mwms_ms):
    """bench.keras_fit's shape: each kind's step median and test accuracy."""
    kind = {"step_ms_median": ours_ms, "test_accuracy": 0.9633, "ranks_bitwise_identical": True}
    return {"environment": {"command": "mpiexec -bind-to core -n 4 python -m bench.keras_fit -J x.json",
                            "cpu": "Test CPU", "cores": 2, "device": "host (no GPU)", "processes": 4,
                            "git_commit": commit, "tensorflow": "9.9.9"},
            "ranks": 4, "epochs": 20, "global_batch": 64,
            "max_weight_difference": {"ours_loop_vs_mwms_loop": 0.0, "ours_fit_vs_ours_loop": 1e-6},
            "ours_fit": dict(kind, step_ms_median=2 * ours_ms), "ours_loop": kind,
            "mwms_loop": dict(kind, step_ms_median=mwms_ms, test_accuracy=0.96)}


def test_tensorflows_strategy_beside_mpich_and_its_keras_step(tmp_path):
    """A harness run with an mwms backend is a column of the host table and
    a README row; bench.keras_fit's run is the training question's table."""
    run = suite_run(NEW, 2.0, collective="allreduce")
    run["environment"]["tensorflow"] = "9.9.9"
    run["rows"] += [dict(r, backend="mwms", out_of_place={"time_us": 400.0}, in_place={"time_us": 200.0})
                    for r in run["rows"] if r["backend"] == "ours"]
    write(tmp_path, {"suite.json": run, "keras.json": keras_fit_run(NEW, 4.0, 10.0)})
    page = report.render(tmp_path, HISTORY)
    host = section(page, "Host ranks against MPICH, Open MPI and Gloo")
    assert "| size | MPICH / ours, 2 processes | TensorFlow MWMS / ours, 2 processes |" in host
    assert "| 1 KiB | 2.00 · 2.00 | 40.00 · - |" in host, host   # (MWMS has no in-place call: bench/backends.py)
    training = section(page, "Training steps against a framework's own collectives")
    assert "| 4 processes, global batch 64, 20 epochs | MWMS, custom loop | 10 | 2.5 | 96.00% | True |" in training
    assert "| 4 processes, global batch 64, 20 epochs | ours, Keras fit | 8 | - | 96.33% | True |" in training
    assert "ours' loop and MWMS' 0, ours' fit and loop 1e-06." in training
    table = report.readme_table(report.load_runs(tmp_path), HISTORY)
    assert "| TensorFlow 9.9.9 MultiWorkerMirroredStrategy | allreduce; host ranks, 2 processes (`bench.reduce_scatter_perf`); " \
           "1 KiB to 4 KiB; theirs a tf.function of strategy.run per call, ours the NumPy API | 40.00x |" in table, table
    assert ("| TensorFlow 9.9.9 MultiWorkerMirroredStrategy | a Keras training step, custom loop (`bench.keras_fit`), "
            "4 processes; test accuracy 96.33% ours, 96.00% theirs | 2.50x |") in table, table


def test_the_latest_run_of_a_configuration_shows_and_the_older_is_linked(tmp_path):
    # The older run sorts last by name, so a pick by path would take it.
    write(tmp_path, {"a_new.json": suite_run(NEW, 3.0), "z_old.json": suite_run(OLD, 2.0)})
    page = report.render(tmp_path, HISTORY)
    host = section(page, "Host ranks against MPICH, Open MPI and Gloo")
    assert "| 1 KiB | 3.00 · 3.00 |" in host and "2.00 · 2.00" not in host
    assert "- 2 processes: [`a_new.json`](../bench/results/a_new.json), commit `bbbbbbbbbb`" in host
    assert ("- [`z_old.json`](../bench/results/z_old.json): an older run of what "
            "[`a_new.json`](../bench/results/a_new.json) measured") in host
    # The command as a reader types it, writing where the file is kept; the machine named once.
    assert "`mpiexec -n 2 python -m bench.reduce_scatter_perf --backend ours,mpi -J bench/results/a_new.json`" in host
    assert "Machine: Test CPU, 2 cores; no GPU; MPICH Version: 9.9.9." in host
    # The same files with the commits' order reversed: the other run is the latest.
    flipped = section(report.render(tmp_path, {OLD: 3000, NEW: 2000}), "Host ranks against MPICH, Open MPI and Gloo")
    assert "| 1 KiB | 2.00 · 2.00 |" in flipped and "3.00 · 3.00" not in flipped
    assert page == report.render(tmp_path, HISTORY)


def test_different_configurations_both_show(tmp_path):
    write(tmp_path, {"two.json": suite_run(OLD, 2.0, processes=2), "four.json": suite_run(NEW, 3.0, processes=4)})
    host = section(report.render(tmp_path, HISTORY), "Host ranks against MPICH, Open MPI and Gloo")
    assert "| size | MPICH / ours, 2 processes | MPICH / ours, 4 processes |" in host
    assert "| 1 KiB | 2.00 · 2.00 | 3.00 · 3.00 |" in host
    assert "Other runs of this question" not in host


def test_a_stale_run_is_linked_not_shown(tmp_path):
    write(tmp_path, {"new.json": suite_run(NEW, 3.0), "old.json": suite_run(OLD, 2.0)},
          notes={"new.json": {"stale": "measured code that is gone"}})
    host = section(report.render(tmp_path, HISTORY), "Host ranks against MPICH, Open MPI and Gloo")
    assert "| 1 KiB | 2.00 · 2.00 |" in host and "3.00" not in host
    assert "- [`new.json`](../bench/results/new.json): no longer describes the code: measured code that is gone" in host


def test_a_configuration_with_only_stale_runs_shows_none(tmp_path):
    write(tmp_path, {"old.json": suite_run(OLD, 2.0)}, notes={"old.json": {"stale": "gone"}})
    host = section(report.render(tmp_path, HISTORY), "Host ranks against MPICH, Open MPI and Gloo")
    assert "No current run measures host ranks against another library." in host
    assert "- [`old.json`](../bench/results/old.json): no longer describes the code: gone" in host


def test_questions_with_no_data_say_so(tmp_path):
    write(tmp_path, {"a.json": suite_run(NEW, 2.0, collective="allgather")})
    page = report.render(tmp_path, HISTORY)
    host = section(page, "Host ranks against MPICH, Open MPI and Gloo")
    assert "No current run measures reduce_scatter on host ranks against another library." in host
    assert "No current run against Gloo." in host
    assert "`bench.host_vs_mpich` has not measured allgather yet." in host
    gpu = section(page, "GPU ranks against the memory floor and NCCL")
    assert "Not measured yet: no run under `bench/results/` has an `nccl` backend." in gpu
    assert "No current run of `python -m bench.gpu_check` on a GPU." in gpu
    table = report.readme_table(report.load_runs(tmp_path), HISTORY)
    assert "| NCCL | any collective on GPU ranks | not measured yet | - |" in table


def test_host_vs_mpich_runs_slot_in_by_their_collective(tmp_path):
    """Runs of bench.host_vs_mpich that name their collective go to its table;
    those that do not are allreduce, as its "benchmark" line says."""
    write(tmp_path, {"hvm.json": host_vs_mpich_run(NEW), "hvm_rs.json": host_vs_mpich_run(NEW, "reduce_scatter")})
    page = report.render(tmp_path, HISTORY)
    host = section(page, "Host ranks against MPICH, Open MPI and Gloo")
    for collective in ("allreduce", "reduce_scatter"):
        table = host.split(f"### {collective}\n", 1)[1].split("###", 1)[0]
        assert "| 64 B | 2.00 · 2.00 |" in table, collective
        assert "has not measured" not in table
    table = report.readme_table(report.load_runs(tmp_path), HISTORY)
    # The comparison users rerun gets a README row per collective.
    assert ("| MPICH 9.9.9 | allreduce; host ranks, 2 processes; 64 B to 64 B | 2.00x | 2-core CPU, no GPU |\n"
            "| MPICH 9.9.9 | reduce_scatter; host ranks, 2 processes; 64 B to 64 B | 2.00x | 2-core CPU, no GPU |"
            ) in table


def test_host_vs_mpich_across_pretend_nodes_is_a_configuration_of_its_own(tmp_path):
    """A run of bench.host_vs_mpich under $COLLECTIVES_PRETEND_NODES (the
    environment's settings say so) shows beside the one-node run of as many
    processes, named by its nodes, and has README rows of its own; the
    command shown carries the setting."""
    one_node = host_vs_mpich_run(OLD)
    across = host_vs_mpich_run(NEW)
    for data in (one_node, across):
        data["runs"][0]["processes"] = 4
    across["runs"][0]["environment"]["settings"] = {"COLLECTIVES_PRETEND_NODES": "0,0,1,1"}
    across["runs"][0]["rows"][0]["in_place"]["mpich"]["time_us"] = 0.5
    write(tmp_path, {"hvm.json": one_node, "hvm_nodes.json": across})
    host = section(report.render(tmp_path, HISTORY), "Host ranks against MPICH, Open MPI and Gloo")
    allreduce = host.split("### allreduce\n", 1)[1].split("###", 1)[0]
    assert ("| size | MPICH / ours, 4 processes, -bind-to core | MPICH / ours, 4 processes, -bind-to core, "
            "2 pretend nodes of 2 processes |") in allreduce
    assert "| 64 B | 2.00 · 2.00 | 2.00 · 0.50 |" in allreduce
    assert "an older run" not in allreduce
    # (the runs are listed once, under the part's tables, not under each collective's)
    assert "COLLECTIVES_PRETEND_NODES=0,0,1,1 python -m bench.host_vs_mpich --ranks 2" in host
    table = report.readme_table(report.load_runs(tmp_path), HISTORY)
    assert "| MPICH 9.9.9 | allreduce; host ranks, 4 processes; 64 B to 64 B | 2.00x |" in table
    assert "| MPICH 9.9.9 | allreduce; 2 pretend nodes of 2 processes; 64 B to 64 B | 0.50x to 2.00x |" in table


def test_host_vs_mpich_gloo_beside_mpich_and_in_place_only_collectives(tmp_path):
    """bench.host_vs_mpich's runs of today: Gloo's ratio in a column beside
    MPICH's, per process count; broadcast measured in place only (runs made
    before it took out=) shows an empty out-of-place cell."""
    runs = []
    for processes in (2, 4):
        for collective, places in (("allgather", ["out_of_place", "in_place"]), ("broadcast", ["in_place"])):
            runs.append({"collective": collective, "processes": processes, "bind_to": "core", "placements": places,
                         "environment": {"git_commit": NEW, "device": "host (no GPU)", "cores": 2,
                                         "cpu": "Test CPU", "mpi_library": "MPICH Version: 9.9.9",
                                         "torch": "2.13.0+cpu"},
                         "rows": [{"size": 1024, **{place: {"ours": {"time_us": 2.0},
                                                            "mpich": {"time_us": 3.0 * processes},
                                                            "gloo": {"time_us": 50.0}} for place in places}}]})
    write(tmp_path, {"host_vs_mpich.json": {"command": "python -m bench.host_vs_mpich --ranks 2,4",
                                            "machine": runs[0]["environment"], "runs": runs}})
    host = section(report.render(tmp_path, HISTORY), "Host ranks against MPICH, Open MPI and Gloo")
    allgather = host.split("### allgather\n", 1)[1].split("###", 1)[0]
    assert ("| size | MPICH / ours, 2 processes, -bind-to core | Gloo / ours, 2 processes, -bind-to core "
            "| MPICH / ours, 4 processes, -bind-to core | Gloo / ours, 4 processes, -bind-to core |") in allgather
    assert "| 1 KiB | 3.00 · 3.00 | 25.00 · 25.00 | 6.00 · 6.00 | 25.00 · 25.00 |" in allgather
    assert "No current run against MPICH" not in allgather and "No current run against Gloo" not in allgather
    broadcast = host.split("### broadcast\n", 1)[1].split("###", 1)[0]
    assert "| 1 KiB | - · 3.00 | - · 25.00 | - · 6.00 | - · 25.00 |" in broadcast
    assert "Machine: Test CPU, 2 cores; no GPU; MPICH Version: 9.9.9; torch 2.13.0+cpu." in host
    table = report.readme_table(report.load_runs(tmp_path), HISTORY)
    assert ("| MPICH 9.9.9 | allgather; host ranks, 2 and 4 processes; 1 KiB to 1 KiB | 3.00x to 6.00x "
            "| 2-core CPU, no GPU |\n"
            "| MPICH 9.9.9 | broadcast; host ranks, 2 and 4 processes; 1 KiB to 1 KiB | 3.00x to 6.00x "
            "| 2-core CPU, no GPU |\n"
            "| Gloo (torch 2.13.0) | allgather; host ranks, 2 and 4 processes; 1 KiB to 1 KiB | 25.00x ") in table


def test_host_vs_mpich_open_mpi_beside_mpich_and_the_copy_floor(tmp_path):
    """bench.host_vs_mpich --mpi mpich,openmpi: each MPI's runs (launches of
    their own) are configurations of their own, their columns side by side
    named by the library each run loaded; the copy floor's time over ours
    is a column and a README row of its own, after the libraries'."""
    runs = []
    for mpi, library, slower in (("mpich", "MPICH Version: 9.9.9", 3.0), ("openmpi", "Open MPI v8.8.8, package: x", 1.5)):
        environment = {"git_commit": NEW, "device": "host (no GPU)", "cores": 2, "cpu": "Test CPU",
                       "mpi_library": library}
        cells = {"ours": {"time_us": 2.0}, mpi: {"time_us": 2.0 * slower}, "floor": {"time_us": 1.9}}
        runs.append({"collective": "allgather", "mpi": mpi, "processes": 2, "bind_to": "core",
                     "placements": ["out_of_place", "in_place"], "environment": environment,
                     "rows": [{"size": 1 << 20, "out_of_place": cells, "in_place": cells}]})
    write(tmp_path, {"host_vs_mpi.json": {"command": "python -m bench.host_vs_mpich --ranks 2 --mpi mpich,openmpi",
                                          "machine": runs[0]["environment"], "runs": runs}})
    host = section(report.render(tmp_path, HISTORY), "Host ranks against MPICH, Open MPI and Gloo")
    allgather = host.split("### allgather\n", 1)[1].split("###", 1)[0]
    assert ("| size | MPICH / ours, 2 processes, -bind-to core | the copy floor / ours, 2 processes, -bind-to core "
            "| Open MPI / ours, 2 processes, -bind-to core | the copy floor / ours, 2 processes, -bind-to core |"
            ) in allgather
    assert "| 1 MiB | 3.00 · 3.00 | 0.95 · 0.95 | 1.50 · 1.50 | 0.95 · 0.95 |" in allgather
    assert "No current run against MPICH" not in allgather and "No current run against Open MPI" not in allgather
    # The file is listed once, under both machines its launches ran on.
    assert host.count("- 2 processes, -bind-to core: [`host_vs_mpi.json`]") == 1
    assert ("Machines: (1) Test CPU, 2 cores; no GPU; MPICH Version: 9.9.9; "
            "(2) Test CPU, 2 cores; no GPU; Open MPI v8.8.8, package: x.") in host
    table = report.readme_table(report.load_runs(tmp_path), HISTORY)
    assert "| MPICH 9.9.9 | allgather; host ranks, 2 processes; 1 MiB to 1 MiB | 3.00x |" in table
    assert "| Open MPI 8.8.8 | allgather; host ranks, 2 processes; 1 MiB to 1 MiB | 1.50x |" in table
    assert "| a memory copy (the same processes) | allgather; host ranks, 2 processes; 1 MiB to 1 MiB | 0.95x of its speed |" in table
    assert table.index("| MPICH 9.9.9 |") < table.index("| Open MPI 8.8.8 |") < table.index("| a memory copy")


def test_pingpong_beside_mpich_and_open_mpi_are_two_configurations_named_by_the_library_loaded(tmp_path):
    """bench.pingpong --mpi openmpi: a run beside Open MPI shows beside the
    MPICH run (neither replaces the other), each table and README row named
    by the MPI its ranks loaded; a run that names none is MPICH's."""
    def pingpong(library, mpi_us):
        environment = {"git_commit": NEW, "device": "host (no GPU)", "cores": 2, "cpu": "Test CPU", "processes": 2}
        if library:
            environment["mpi_library"] = library
        return {"command": "python -m bench.pingpong", "environment": environment,
                "one_way": [{"bytes": 8, "round_trips": 200, "ours_us": 1.0, "mpi_us": mpi_us,
                             "mpi_over_ours": mpi_us}]}
    write(tmp_path, {"pingpong_mpich.json": pingpong(None, 2.0),
                     "pingpong_openmpi.json": pingpong("Open MPI v8.8.8, package: x", 1.5)})
    page = report.render(tmp_path, HISTORY)
    point = section(page, "Host ranks against MPICH, Open MPI and Gloo").split(
        "### Point to point: send and recv against MPICH and Open MPI\n", 1)[1]
    assert "2 processes, beside MPICH:" in point and "2 processes, beside Open MPI:" in point
    assert "| 8 B | 1 | 2 | 2.00 |" in point and "| 8 B | 1 | 1.5 | 1.50 |" in point
    table = report.readme_table(report.load_runs(tmp_path), HISTORY)
    assert "| MPICH | send/recv one way; host ranks, 2 processes (`bench.pingpong`); 8 B to 8 B | 2.00x |" in table
    assert "| Open MPI 8.8.8 | send/recv one way; host ranks, 2 processes (`bench.pingpong`); 8 B to 8 B | 1.50x |" \
        in table


def test_the_gpu_floor_is_one_copy_of_what_the_call_moves(tmp_path):
    """gpu_check's allreduce against a copy of 2 x ranks x size bytes at the
    copy bandwidth it measured: 4 ranks of 32 MiB at 1000 GB/s is 268.4 µs."""
    environment = {"device": "Test GPU", "git_commit": NEW}
    floor_us = 2 * 4 * (32 << 20) / 1e3 / 1000
    rows = [{"backend": "ours", "size": size, "out_of_place": {"time_us": 2 * floor_us * size / (32 << 20)},
             "in_place": {"time_us": 4 * floor_us * size / (32 << 20)}} for size in (1 << 20, 32 << 20)]
    write(tmp_path, {"gpu_check.json": {
        "command": "python -m bench.gpu_check --ranks 4", "environment": environment,
        "kernel_bandwidth": [{"min_blocks": 4, "unroll": 1, "sources": 1, "bytes_per_source": 1 << 28,
                              "step_GBps": 900.0, "copy_GBps": 1000.0, "step_vs_copy": 0.9}],
        "allreduce_command": "python -m bench.all_reduce_perf --device cuda --ranks 4", "allreduce": rows}})
    page = report.render(tmp_path, HISTORY)
    gpu = section(page, "GPU ranks against the memory floor and NCCL")
    assert "| 32 MiB | 0.50 · 0.25 |" in gpu and "| 1 MiB |" not in gpu  # below 16 MiB a call is launch-bound
    assert "the copy at 1000 GB/s" in gpu
    assert "| 4 | 1 | 1 | 256 MiB | 900 | 1000 | 0.90 |" in gpu
    table = report.readme_table(report.load_runs(tmp_path), HISTORY)
    assert "| a device copy | the step kernel, 256 MiB per source | 0.90x of its bandwidth | Test GPU |" in table
    assert "| a device copy | allreduce, 4 ranks on one GPU, 32 MiB to 32 MiB per rank | 0.25x to 0.50x" in table


def test_bench_floor_rows_and_an_nccl_backend_fill_their_tables(tmp_path):
    """What no committed run has yet: bench.floor's own copy / call, and ours against NCCL."""
    gpu = {"device": "Test GPU", "git_commit": NEW, "ranks": 2, "nccl": "2.99.1"}
    floor_rows = [{"bytes": size, "algorithm": "ring", "copy_over_call": 0.8} for size in (4, 64 << 20)]
    nccl_rows = [{"backend": b, "size": 1 << 20, "out_of_place": {"time_us": 30.0 if b == "nccl" else 10.0},
                  "in_place": {"time_us": 20.0 if b == "nccl" else 10.0}} for b in ("ours", "nccl")]
    write(tmp_path, {"floor.json": {"command": "python -m bench.floor --device cuda --ranks 2",
                                    "environment": {**gpu, "in_place": True}, "rows": floor_rows},
                     "nccl.json": {"collective": "allreduce", "rows": nccl_rows, "environment": {
                         **gpu, "command": "python -m bench.all_reduce_perf --device cuda --backend ours,nccl"}}})
    page = section(report.render(tmp_path, HISTORY), "GPU ranks against the memory floor and NCCL")
    # The nccl run is also a sweep of ours on a GPU, with no copy measured beside it: a column, no ratio.
    assert "| 64 MiB | - | - · 0.80 |" in page and "| 4 B |" not in page
    assert "- bench.floor, 2 ranks on one GPU: the copy timed beside the call, size by size (bench.floor)." in page
    assert "2 ranks, the default algorithm: no device copy was measured on the same GPU at the same commit" in page
    assert "| size | NCCL / ours, allreduce, 2 ranks |" in page and "| 1 MiB | 3.00 · 2.00 |" in page
    assert "Not measured yet" not in page
    table = report.readme_table(report.load_runs(tmp_path), HISTORY)
    assert "| NCCL 2.99.1 | allreduce, 2 ranks | 2.00x to 3.00x | Test GPU |" in table


def test_runs_no_question_reads_are_linked_at_the_end(tmp_path):
    write(tmp_path, {"sub/plan.json": {"command": "python -m bench.model plans", "rows": [{"x": 1}]}},
          notes={"sub/plan.json": {"commit": OLD, "note": "counted, not measured"}})
    others = section(report.render(tmp_path, HISTORY), "Runs no question reads")
    assert "- [`sub/plan.json`](../bench/results/sub/plan.json): `python -m bench.model plans`. counted, not measured" \
        in others


def test_notes_for_missing_files_are_an_error(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"rows": []}))
    (tmp_path / report.NOTES).write_text(json.dumps({"gone.json": {"commit": "abc"}}))
    with pytest.raises(ValueError, match="gone.json"):
        report.render(tmp_path)


def test_the_results_table_replaces_only_its_block():
    text = f"# R\n\nbefore\n\n{report.README_START}\n| old |\n{report.README_END}\n\nafter\n"
    rewritten = report.with_results_table(text, "| new |\n")
    assert rewritten == f"# R\n\nbefore\n\n{report.README_START}\n| new |\n{report.README_END}\n\nafter\n"
    assert report.readme_block(rewritten) == "| new |\n"
    with pytest.raises(ValueError, match="no .* block"):
        report.with_results_table("# R\n", "| new |\n")


def test_the_command_writes_the_page_and_the_readme_table(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    write(results, {"a.json": suite_run(NEW, 2.0)})
    readme = tmp_path / "README.md"
    readme.write_text(f"# R\n\n{report.README_START}\nstale\n{report.README_END}\n\nmore\n")
    output = tmp_path / "page.md"
    command = [sys.executable, "-m", "bench.report", "--results", str(results), "-o", str(output)]
    done = subprocess.run([*command, "--readme", str(readme)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert output.read_text() == report.render(results)
    runs = report.load_runs(results)
    table = report.readme_table(runs, report.repository_history())
    assert readme.read_text() == f"# R\n\n{report.README_START}\n{table}{report.README_END}\n\nmore\n"
    # -o - prints the page; with --results of its own and no --readme, no README is touched.
    printed = subprocess.run([*command[:-1], "-"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout == report.render(results)


def test_host_vs_mpich_across_hosts_is_a_configuration_of_its_own_with_its_floors_named():
    """A run across hosts (--hosts) is told apart from one machine's, and its link
    floor and compressed calls are named as what they are."""
    from bench import report_host
    from bench.report_runs import Run
    data = host_vs_mpich_run(NEW, "allreduce")
    one_machine = report_host.against_libraries(Run("one.json", data, {}))[0]
    across = json.loads(json.dumps(data))
    run = across["runs"][0]
    run["processes"] = 4
    run["hosts"] = {"count": 2, "link": "1gbit", "measured_bytes_per_second": 1.2e8, "hostnames": ["h0", "h1"]}
    for place in ("out_of_place", "in_place"):
        run["rows"][0][place].update({"link": {"time_us": 0.5}, "ours:int8": {"time_us": 0.25, "maxrel": 0.004}})
    measured = report_host.against_libraries(Run("across.json", across, {}))[0]
    assert measured.content["where"] == "2 hosts of 2 processes, 1gbit links"
    assert measured.configuration != one_machine.configuration
    assert measured.content["ratios"]["the link floor"] == {64: [0.5, 0.5]}
    assert measured.content["ratios"]["ours with int8"] == {64: [0.25, 0.25]}
    assert measured.content["ratios"]["MPICH"] == {64: [2.0, 2.0]}


def ddp_step_run(commit, gloo_ms, ours_ms, hosts=None):
    """bench.ddp_step's shape: one row per run, Gloo first."""
    runs = [{"run": name, "step_ms_median": ms, "step_ms": [ms], "over_first": ms / gloo_ms,
             "test_accuracy": [0.9567], "ranks_bitwise_identical": True, "steps": 90}
            for name, ms in (("gloo", gloo_ms), ("collectives", ours_ms), ("collectives+int8", ours_ms / 2))]
    return {"environment": {"command": "python -m bench.ddp_step --hidden 4096", "cpu": "Test CPU", "cores": 2,
                            "device": "host (no GPU)", "git_commit": commit, "torch": "9.9.9+cpu"},
            "processes": 4, "hidden": 4096, "epochs": 5, "rounds": 3, "hosts": hosts, "runs": runs}


def test_ddp_step_runs_are_the_training_questions_second_table_and_a_readme_row(tmp_path):
    across = {"count": 2, "link": "1gbit", "measured_bytes_per_second": 1.2e8}
    write(tmp_path, {"ddp.json": ddp_step_run(NEW, 20.0, 10.0), "ddp_hosts.json": ddp_step_run(NEW, 30.0, 60.0, across)})
    page = report.render(tmp_path, HISTORY)
    training = section(page, "Training steps against a framework's own collectives")
    assert "| 4 processes on one machine, hidden 4096 | collectives | 10 | 2 | 95.67% | True |" in training, training
    assert "| 2 hosts of 2 processes, 1gbit links, hidden 4096 | collectives+int8 | 30 | 1 | 95.67% | True |" \
        in training, training
    table = report.readme_table(report.load_runs(tmp_path), HISTORY)
    assert ("| Gloo (torch 9.9.9) | a DDP training step (`bench.ddp_step`), 2 hosts of 2 processes, 1gbit links, "
            "hidden 4096: collectives, collectives+int8 | 0.50x to 1.00x |") in table, table
