"""The five nccl-tests tools on the shared harness: their sizes and counts, bus
bandwidth, results checked in and out of place, the flags, the progress line,
and the backends side by side across processes."""

import dataclasses
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import backends, harness, progress
from bench.all_gather_perf import ALLGATHER
from bench.all_reduce_perf import ALLREDUCE
from bench.broadcast_perf import BROADCAST
from bench.reduce_perf import REDUCE
from bench.reduce_scatter_perf import REDUCE_SCATTER

ROOT = Path(__file__).resolve().parents[1]
TOOLS = {"all_reduce_perf": ALLREDUCE, "reduce_scatter_perf": REDUCE_SCATTER, "all_gather_perf": ALLGATHER,
         "broadcast_perf": BROADCAST, "reduce_perf": REDUCE}
SMALL_SWEEP = ["-b", "8", "-e", "4K", "-f", "8", "-n", "1", "-w", "0"]


def run_tool(spec, argv, capsys, tmp_path):
    """harness.main in this process; (exit code, stdout, the JSON report)."""
    path = tmp_path / "report.json"
    code = harness.main(spec, [*argv, "-J", str(path)])
    out = capsys.readouterr().out
    return code, out, json.loads(path.read_text()) if path.exists() else None


def table(out):
    return [line.split() for line in out.splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("dtype", ["float", "int32", "bfloat16"])
def test_every_tool_checks_exactly_in_and_out_of_place(tool, dtype, capsys, tmp_path):
    spec = TOOLS[tool]
    code, out, report = run_tool(spec, ["--ranks", "3", *SMALL_SWEEP, "-d", dtype, "-r", "1"], capsys, tmp_path)
    assert code == 0 and "all results correct" in out, out
    rows = report["rows"]
    assert rows and all(r["out_of_place"]["wrong"] == r["in_place"]["wrong"] == 0 for r in rows)
    assert "# Out of bounds values : 0 OK" in out and "# Avg bus bandwidth    : " in out
    for r in rows:
        assert r["redop"] == ("sum" if spec.has_op else "none")
        assert r["root"] == (1 if spec.rooted else -1)
        for place in ("out_of_place", "in_place"):
            m = r[place]
            assert m["algbw"] == pytest.approx(r["size"] / (m["time_us"] * 1e-6) / 1e9)
            assert m["busbw"] == pytest.approx(m["algbw"] * spec.busbw_factor(3))


@pytest.mark.parametrize("tool, factors", [
    ("all_reduce_perf", [0, 1, 1.5, 1.75]),
    ("reduce_scatter_perf", [0, 0.5, 0.75, 0.875]),
    ("all_gather_perf", [0, 0.5, 0.75, 0.875]),
    ("broadcast_perf", [1, 1, 1, 1]),
    ("reduce_perf", [1, 1, 1, 1]),
])
def test_busbw_factors_are_nccl_tests(tool, factors):
    assert [TOOLS[tool].busbw_factor(n) for n in (1, 2, 4, 8)] == factors


# (size, count) rows of a float sweep -b 8 -e 4K -f 8 on 3 ranks, as nccl-tests
# prints them: allgather's size is the gathered bytes and reduce_scatter's the
# input, their count what one rank sends or receives; a size under one
# element per rank is left out.
PER_RANK = [(60, 5), (504, 42), (4092, 341)]
WHOLE = [(8, 2), (64, 16), (512, 128), (4096, 1024)]


@pytest.mark.parametrize("tool, expected", [
    ("all_reduce_perf", WHOLE), ("reduce_scatter_perf", PER_RANK), ("all_gather_perf", PER_RANK),
    ("broadcast_perf", WHOLE), ("reduce_perf", WHOLE),
])
def test_size_and_count_columns(tool, expected, capsys, tmp_path):
    code, out, report = run_tool(TOOLS[tool], ["--ranks", "3", *SMALL_SWEEP], capsys, tmp_path)
    assert code == 0, out
    assert [(int(r[0]), int(r[1])) for r in table(out)] == expected
    assert [(r["size"], r["count"]) for r in report["rows"]] == expected
    if expected is PER_RANK:
        assert "# sizes under 12 B skipped" in out


@pytest.mark.parametrize("tool", ["reduce_scatter_perf", "reduce_perf"])
@pytest.mark.parametrize("op", ["sum", "prod", "max", "min", "avg"])
def test_every_op_where_the_collective_reduces(tool, op, capsys, tmp_path):
    code, out, report = run_tool(TOOLS[tool], ["--ranks", "3", "-b", "1K", "-e", "1K", "-n", "1", "-w", "0",
                                               "-d", "int8", "-o", op], capsys, tmp_path)
    assert code == 0 and "all results correct" in out, out
    assert report["rows"][0]["redop"] == op


@pytest.mark.parametrize("tool", ["broadcast_perf", "reduce_perf"])
def test_the_root_flag(tool, capsys, tmp_path):
    spec = TOOLS[tool]
    code, out, report = run_tool(spec, ["--ranks", "3", "-b", "1K", "-e", "1K", "-n", "1", "-w", "0", "-r", "2"],
                                 capsys, tmp_path)
    assert code == 0 and all(r[4] == "2" for r in table(out)) and report["rows"][0]["root"] == 2, out

    def ignores_the_root(comm, x, out, args):  # what a tool that always used rank 0 would do
        spec.run_ours(comm, x, out, argparse_with(args, root=0))

    code, out, _ = run_tool(dataclasses.replace(spec, run_ours=ignores_the_root),
                            ["--ranks", "3", "-b", "1K", "-e", "1K", "-n", "1", "-w", "0", "-r", "2"],
                            capsys, tmp_path)
    assert code == 1 and "WRONG elements" in out

    assert harness.main(spec, ["--ranks", "3", "-b", "1K", "-e", "1K", "-r", "3"]) == 2
    assert "-r 3 is not a rank of 3" in capsys.readouterr().err


def argparse_with(args, **changes):
    return type(args)(**{**vars(args), **changes})


def test_a_wrong_allgather_is_caught(capsys, tmp_path):
    def off_by_one(comm, x, out, args):
        results = comm.allgather(x, out=out)
        results[-1][-1] += 1  # one wrong element on the last rank

    broken = dataclasses.replace(ALLGATHER, run_ours=off_by_one)
    code, out, _ = run_tool(broken, ["--ranks", "3", "-b", "96", "-e", "96", "-n", "1", "-w", "0"], capsys, tmp_path)
    assert code == 1
    row = table(out)[0]
    assert row[8] == "1" and row[12] == "1"
    assert "# 2 WRONG elements" in out and "# Out of bounds values : 2 FAILED" in out


def test_ours_and_its_older_name_host(capsys, tmp_path):
    for name in ("ours", "host"):
        code, out, report = run_tool(ALLGATHER, ["--ranks", "2", "--backend", name, "-b", "1K", "-e", "1K",
                                                 "-n", "1", "-w", "0"], capsys, tmp_path)
        assert code == 0 and [r["backend"] for r in report["rows"]] == [name], out


def test_the_environment_in_the_json(capsys, tmp_path):
    code, out, report = run_tool(REDUCE, ["--ranks", "2", "-b", "1K", "-e", "1K", "-n", "1", "-w", "0"],
                                 capsys, tmp_path)
    env = report["environment"]
    assert code == 0 and env["memory_bytes"] > 0 and env["cores"] >= 1 and env["cpu"] and env["command"]
    assert env["collectives"] and (env["git_commit"] == "unknown" or len(env["git_commit"]) == 40)
    assert "torch" not in env  # only where gloo ran


def test_cuda_graphs_are_ignored_off_the_gpu_path(capsys, tmp_path):
    code, out, _ = run_tool(ALLREDUCE, ["--ranks", "2", "-G", "4", "-b", "1K", "-e", "4K", "-f", "4", "-n", "1",
                                        "-w", "0"], capsys, tmp_path)
    assert code == 0 and out.count("# -G ignored: CUDA graphs apply to --device cuda") == 1


def test_compression_other_than_none_is_an_error(capsys):
    assert harness.parse_args(ALLREDUCE, ["--compression", "none"]).compression == "none"
    with pytest.raises(SystemExit) as stopped:
        harness.parse_args(ALLREDUCE, ["--compression", "zstd"])
    assert stopped.value.code == 2
    assert "compression is not implemented yet" in capsys.readouterr().err


def test_gloo_without_torch_names_the_install(monkeypatch, capsys):
    real = harness.importlib.util.find_spec
    monkeypatch.setattr(harness.importlib.util, "find_spec", lambda name: None if name == "torch" else real(name))
    with pytest.raises(SystemExit):
        harness.parse_args(ALLGATHER, ["--backend", "ours,gloo"])
    assert "pip install torch==2.13.0" in capsys.readouterr().err


def test_what_mpi_and_gloo_cannot_run_is_said():
    def reason(backend, spec, *argv):
        return backends.unsupported(backend, spec, harness.parse_args(spec, list(argv)))

    assert "no 'avg'" in reason("mpi", ALLREDUCE, "-o", "avg")
    assert reason("mpi", ALLGATHER, "-o", "avg") is None  # allgather does not reduce
    assert "bfloat16" in reason("mpi", REDUCE, "-d", "bfloat16")
    assert reason("mpi", BROADCAST, "-d", "bfloat16") is None  # moved as bytes
    assert "int16" in reason("gloo", ALLGATHER, "-d", "int16")
    assert "floating-point" in reason("gloo", REDUCE_SCATTER, "-o", "avg", "-d", "int32")
    assert reason("gloo", REDUCE_SCATTER, "-o", "avg", "-d", "bfloat16") is None


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("quiet", [False, True])
def test_progress_on_a_terminal_and_quiet(quiet, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(progress, "PROGRESS_AFTER_SECONDS", 0.0)
    monkeypatch.setattr(progress, "PROGRESS_EVERY_SECONDS", 0.0)
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    code, out, _ = run_tool(ALLGATHER, ["--ranks", "2", "-b", "1K", "-e", "16K", "-f", "4", "-n", "1", "-w", "0",
                                        *(["-q"] if quiet else [])], capsys, tmp_path)
    assert code == 0
    shown = terminal.getvalue()
    if quiet:
        assert shown == ""
    else:
        assert "\r# allgather: size 3/3 (16K of 16K), ours, " in shown  # rewritten in place
        assert re.search(r"\r +\r# allgather: 3 sizes in [0-9.]+ s\n$", shown)  # cleared, then one last line
    assert "\r" not in out  # the table on stdout stays clean


def test_no_progress_when_stderr_is_not_a_terminal(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(progress, "PROGRESS_AFTER_SECONDS", 0.0)
    run_tool(ALLGATHER, ["--ranks", "2", "-b", "1K", "-e", "4K", "-n", "1", "-w", "0"], capsys, tmp_path)
    assert capsys.readouterr().err == ""


def test_the_progress_line():
    assert progress.progress_line("allgather", 2, 10, 4096, 1 << 20, "mpi", 75) == \
        "# allgather: size 3/10 (4K of 1M), mpi, ~1 min 15 s left"
    assert progress.progress_line("reduce", 0, 4, 8, 64, "ours", None) == \
        "# reduce: size 1/4 (8 of 64), ours, estimating time left"
    sweep = progress.Progress("x", [1 << 20, 2 << 20, 4 << 20], enabled=True, stream=io.StringIO())
    sweep.start -= 3.0  # three seconds on the first size, a seventh of the work (with latency)
    sweep.size(1)
    left = sweep.seconds_left(sweep.size_start)
    weights = [s + progress.LATENCY_BYTES for s in sweep.sweep]
    assert left == pytest.approx(3.0 * sum(weights[1:]) / weights[0], rel=0.01)


# -- across processes ----------------------------------------------------------------

def run_processes(tool, argv, tmp_path):
    path = tmp_path / f"{tool}.json"
    done = subprocess.run([sys.executable, "-m", f"bench.{tool}", "--ranks", "2", *argv, "-J", str(path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, json.loads(path.read_text())


@pytest.mark.mpi
def test_ours_and_mpi_side_by_side(tmp_path):
    pytest.importorskip("mpi4py", reason="needs mpi4py: pip install '.[test]'")
    out, report = run_processes("all_gather_perf", ["--backend", "ours,mpi", "-b", "1K", "-e", "64K", "-f", "8",
                                                    "-n", "2", "-w", "1", "-d", "bfloat16"], tmp_path)
    assert "-bind-to core" in out and report["environment"]["processes"] == 2
    assert [r["backend"] for r in report["rows"]] == ["ours", "mpi"] * 3
    assert all(r["out_of_place"]["wrong"] == r["in_place"]["wrong"] == 0 for r in report["rows"])
    assert out.count("# Out of bounds values : 0 OK") == 2


@pytest.mark.mpi
def test_gloo_beside_ours_and_mpi(tmp_path):
    pytest.importorskip("mpi4py", reason="needs mpi4py: pip install '.[test]'")
    pytest.importorskip("torch", reason="the gloo backend needs PyTorch: pip install torch==2.13.0")
    out, report = run_processes("all_gather_perf", ["--backend", "ours,mpi,gloo", "-b", "1K", "-e", "64K",
                                                    "-f", "8", "-n", "2", "-w", "1", "-d", "int32"], tmp_path)
    assert [r["backend"] for r in report["rows"]] == ["ours", "mpi", "gloo"] * 3
    assert all(r["out_of_place"]["wrong"] == r["in_place"]["wrong"] == 0 for r in report["rows"])
    assert report["environment"]["torch"].startswith("2.")


@pytest.mark.mpi
def test_a_backend_without_the_op_is_skipped(tmp_path):
    """MPI has no average: its rows are left out, with the reason; Gloo averages floats."""
    pytest.importorskip("mpi4py", reason="needs mpi4py: pip install '.[test]'")
    pytest.importorskip("torch", reason="the gloo backend needs PyTorch: pip install torch==2.13.0")
    out, report = run_processes("reduce_scatter_perf", ["--backend", "ours,mpi,gloo", "-b", "4K", "-e", "4K",
                                                        "-n", "1", "-w", "0", "-o", "avg", "-d", "half"], tmp_path)
    assert "# mpi skipped: MPI has no 'avg' reduction" in out
    assert [r["backend"] for r in report["rows"]] == ["ours", "gloo"]
    assert all(r["out_of_place"]["wrong"] == r["in_place"]["wrong"] == 0 for r in report["rows"])


def test_nccl_is_a_backend_for_gpus_only():
    with pytest.raises(SystemExit):
        harness.parse_args(ALLREDUCE, ["--backend", "ours,nccl"])          # host: NCCL needs --device cuda
    with pytest.raises(SystemExit):
        harness.parse_args(ALLREDUCE, ["--backend", "mpi", "--device", "cuda"])  # MPI runs on host arrays
    args = harness.parse_args(ALLREDUCE, ["--backend", "ours,nccl", "--device", "cuda"])
    assert args.backends == ["ours", "nccl"]
    args = harness.parse_args(ALLREDUCE, ["--backend", "ours,mpi,gloo", "--device", "emulated"])
    assert args.backends == ["ours", "mpi", "gloo"]  # ours on emulated devices beside host MPI and Gloo
