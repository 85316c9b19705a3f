"""The nccl-tests tools on the shared harness: their sizes and counts, bus
bandwidth, results checked in and out of place, the flags, the progress line,
and the backends side by side across processes."""

import dataclasses
import io
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from bench import backends, harness, progress
from bench.all_gather_perf import ALLGATHER
from bench.all_reduce_perf import ALLREDUCE
from bench.alltoall_perf import ALL_TO_ALL
from bench.broadcast_perf import BROADCAST
from bench.gather_perf import GATHER
from bench.reduce_perf import REDUCE
from bench.reduce_scatter_perf import REDUCE_SCATTER
from bench.scatter_perf import SCATTER
from collectives.transport import fastpath
from installed import require
from mpi_launch import run_launch

ROOT = Path(__file__).resolve().parents[1]
TOOLS = {"all_reduce_perf": ALLREDUCE, "reduce_scatter_perf": REDUCE_SCATTER, "all_gather_perf": ALLGATHER,
         "broadcast_perf": BROADCAST, "reduce_perf": REDUCE, "alltoall_perf": ALL_TO_ALL, "gather_perf": GATHER,
         "scatter_perf": SCATTER}
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
    ("alltoall_perf", [0, 0.5, 0.75, 0.875]),
    ("gather_perf", [0, 0.5, 0.75, 0.875]),
    ("scatter_perf", [0, 0.5, 0.75, 0.875]),
])
def test_busbw_factors_are_nccl_tests(tool, factors):
    assert [TOOLS[tool].busbw_factor(n) for n in (1, 2, 4, 8)] == factors


# (size, count) rows of a float sweep -b 8 -e 4K -f 8 on 3 ranks, as nccl-tests
# prints them: allgather's and gather's size is the gathered bytes,
# reduce_scatter's and scatter's the input, all_to_all's a rank's whole
# buffer, their count one rank's block (what it sends or receives); a size
# under one element per rank is left out.
PER_RANK = [(60, 5), (504, 42), (4092, 341)]
WHOLE = [(8, 2), (64, 16), (512, 128), (4096, 1024)]


@pytest.mark.parametrize("tool, expected", [
    ("all_reduce_perf", WHOLE), ("reduce_scatter_perf", PER_RANK), ("all_gather_perf", PER_RANK),
    ("broadcast_perf", WHOLE), ("reduce_perf", WHOLE), ("alltoall_perf", PER_RANK), ("gather_perf", PER_RANK),
    ("scatter_perf", PER_RANK),
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


@pytest.mark.parametrize("tool", ["broadcast_perf", "reduce_perf", "gather_perf", "scatter_perf"])
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


def test_an_all_to_all_that_moves_nothing_is_caught(capsys, tmp_path):
    # In place each rank keeps its own block and nothing else: on 3 ranks of
    # 8 floats a block, the other two blocks of each rank are wrong.
    idle = dataclasses.replace(ALL_TO_ALL, run_ours=lambda comm, x, out, args: None)
    code, out, report = run_tool(idle, ["--ranks", "3", "-b", "96", "-e", "96", "-n", "1", "-w", "0"],
                                 capsys, tmp_path)
    assert code == 1 and report["rows"][0]["in_place"]["wrong"] == 3 * 2 * 8, out


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


# -- --compression -------------------------------------------------------------------

CODEC_SWEEP = ["--ranks", "2", "-b", "4K", "-e", "256K", "-f", "8", "-n", "1", "-w", "0"]
# The most of none's wire bytes each codec may read (fp16: 2 B and a scale byte per 32 elements)
# and the largest maxrel each may show on 2 ranks' standard-normal inputs.
WIRE_RATIO = {"fp16": 0.52, "bf16": 0.52, "int8": 0.28}
MAXREL = {"none": 2 ** -20, "fp16": 2 ** -9, "bf16": 2 ** -6, "int8": 2 ** -5}


def test_compression_parses_a_list():
    args = harness.parse_args(ALLREDUCE, ["--compression", "none, fp16,bf16,int8"])
    assert args.compressions == ["none", "fp16", "bf16", "int8"] and args.compressed
    args = harness.parse_args(ALLREDUCE, [])
    assert args.compressions == ["none"] and not args.compressed
    assert harness.parse_args(ALLREDUCE, ["--compression", "int8", "-o", "avg"]).compressions == ["int8"]
    # mpi beside ours runs uncompressed
    assert harness.parse_args(ALLREDUCE, ["--compression", "none,bf16", "--backend", "ours,mpi"]).compressed


@pytest.mark.parametrize("tool, argv, message", [
    ("all_reduce_perf", ["--compression", "zstd"], "--compression: unknown ['zstd']"),
    ("all_reduce_perf", ["--compression", ","], "--compression: unknown []"),
    ("reduce_scatter_perf", ["--compression", "fp16"], "compression applies to allreduce, not reduce_scatter"),
    ("all_gather_perf", ["--compression", "none,bf16"], "compression applies to allreduce"),
    ("broadcast_perf", ["--compression", "int8"], "compression applies to allreduce"),
    ("reduce_perf", ["--compression", "int8"], "compression applies to allreduce"),
    ("all_reduce_perf", ["--compression", "fp16", "-d", "half"], "compression takes float32 (-d float)"),
    ("all_reduce_perf", ["--compression", "bf16", "-d", "double"], "compression takes float32"),
    ("all_reduce_perf", ["--compression", "int8", "-o", "max"], "-o sum or avg, not max"),
    ("all_reduce_perf", ["--compression", "none,fp16", "--backend", "mpi"], "add --backend ours"),
])
def test_compression_refuses_what_it_cannot_run(tool, argv, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        harness.parse_args(TOOLS[tool], argv)
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


def test_other_tools_take_no_compression_but_none(capsys):
    assert harness.parse_args(REDUCE, ["--compression", "none"]).compressions == ["none"]
    with pytest.raises(SystemExit):
        harness.main(REDUCE, ["--ranks", "2", "--compression", "fp16"])
    assert "compression applies to allreduce" in capsys.readouterr().err


def by_codec(rows):
    return {codec: [r for r in rows if r["compression"] == codec] for codec in ("none", "fp16", "bf16", "int8")}


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_every_codec_side_by_side(op, capsys, tmp_path):
    """--compression none,fp16,bf16,int8: a backend per codec, size by size;
    maxrel against the float64 reference and the wire bytes in the table and
    the JSON; #wrong only for uncompressed rows."""
    code, out, report = run_tool(ALLREDUCE, [*CODEC_SWEEP, "-o", op, "--compression", "none,fp16,bf16,int8"],
                                 capsys, tmp_path)
    assert code == 0 and "all results correct" in out, out
    rows = report["rows"]
    assert [r["backend"] for r in rows] == ["ours:none", "ours:fp16", "ours:bf16", "ours:int8"] * 3
    assert [r["size"] for r in rows] == [4096] * 4 + [32768] * 4 + [262144] * 4
    for r in rows:
        for key in ("compression", "maxrel", "wire_bytes"):
            assert key in r, key
        assert r["maxrel"] == max(r["out_of_place"]["maxrel"], r["in_place"]["maxrel"])
        assert 0 <= r["maxrel"] < MAXREL[r["compression"]], r
        assert r["picked"] in ("ring", "direct", "star", "tree", "butterfly", "halving_doubling",
                               "round_robin", "two_shot")
    codecs = by_codec(rows)
    for plain in codecs["none"]:
        assert plain["out_of_place"]["wrong"] == plain["in_place"]["wrong"] == 0   # still checked bitwise
        assert plain["wire_bytes"] == plain["size"]        # 2 ranks: each reads the other's half, twice
        assert plain["maxrel"] > 0                        # random inputs: float32 rounds the sum
    for codec, ratio in WIRE_RATIO.items():
        for plain, compressed in zip(codecs["none"], codecs[codec]):
            assert compressed["out_of_place"]["wrong"] is None and compressed["in_place"]["wrong"] is None
            assert 0 < compressed["wire_bytes"] <= ratio * plain["wire_bytes"], (codec, compressed)
            assert compressed["maxrel"] > plain["maxrel"]
    # The table: the two columns after the in-place ones, and "-" for no bitwise check.
    lines = out.splitlines()
    assert any("maxrel" in line and "wire B" in line for line in lines if line.startswith("#"))
    for cells, r in zip(table(out), rows):
        assert cells[13] == f"{r['maxrel']:.1e}" and int(cells[14]) == r["wire_bytes"] and cells[15] == r["backend"]
        assert (cells[8], cells[12]) == (("0", "0") if r["compression"] == "none" else ("-", "-"))
    assert "# Out of bounds values : 0 OK" in out and out.count("# Max relative error  : ") == 3


def test_one_codec_and_several_algorithms_name_both(capsys, tmp_path):
    code, out, report = run_tool(ALLREDUCE, ["--ranks", "3", "-b", "12K", "-e", "12K", "-n", "1", "-w", "0",
                                             "--algorithm", "ring,direct", "--compression", "none,int8"],
                                 capsys, tmp_path)
    assert code == 0, out
    rows = report["rows"]
    assert [r["backend"] for r in rows] == ["ours:ring:none", "ours:ring:int8", "ours:direct:none",
                                            "ours:direct:int8"]
    assert [r["picked"] for r in rows] == ["ring", "ring", "direct", "direct"]
    # 3 ranks: direct reads every peer's whole buffer, the ring 2 (n-1)/n of one.
    assert rows[2]["wire_bytes"] == 2 * 12288 and rows[0]["wire_bytes"] == 2 * 12288 * 2 // 3
    assert rows[1]["wire_bytes"] <= 0.28 * rows[0]["wire_bytes"]
    code, out, report = run_tool(ALLREDUCE, ["--ranks", "2", "-b", "4K", "-e", "4K", "-n", "1", "-w", "0",
                                             "--compression", "bf16"], capsys, tmp_path)
    assert code == 0 and [r["backend"] for r in report["rows"]] == ["ours:bf16"], out


def test_a_compressed_result_that_is_off_shows_in_maxrel(capsys, tmp_path):
    def off(comm, x, out, args):
        results = comm.allreduce(x, op=args.op, out=out, compression=args.codec)
        results[-1][0] += 1000.0  # far off on one element of the last rank

    code, out, report = run_tool(dataclasses.replace(ALLREDUCE, run_ours=off),
                                 ["--ranks", "2", "-b", "1K", "-e", "1K", "-n", "1", "-w", "0",
                                  "--compression", "fp16"], capsys, tmp_path)
    assert code == 0 and report["rows"][0]["maxrel"] > 10, out

    def not_a_number(comm, x, out, args):
        results = comm.allreduce(x, op=args.op, out=out, compression=args.codec)
        results[0][-1] = float("nan")

    code, out, report = run_tool(dataclasses.replace(ALLREDUCE, run_ours=not_a_number),
                                 ["--ranks", "2", "-b", "1K", "-e", "1K", "-n", "1", "-w", "0",
                                  "--compression", "none,int8"], capsys, tmp_path)
    assert code == 1 and "not finite" in out


def test_the_seeded_reference_is_every_rank_regenerated():
    seeded = harness.SeededInputs(ALLREDUCE, "avg", 3)
    again = harness.SeededInputs(ALLREDUCE, "avg", 3)
    assert np.array_equal(seeded.input(1, 100), again.generate(1, 100))  # any process, same bytes
    assert not np.array_equal(seeded.input(0, 100), seeded.input(1, 100))
    every = np.stack([again.generate(r, 100).astype(np.float64) for r in range(3)])
    assert np.allclose(seeded.reference(100), every.mean(0), rtol=0, atol=1e-15)
    assert harness.max_relative_error(np.float32([1, -2]), np.array([1.0, -4.0])) == 0.5
    assert np.isnan(harness.max_relative_error(np.float32([np.nan, 1]), np.array([1.0, 1.0])))
    assert harness.max_relative_error(np.zeros(3, np.float32), np.zeros(3)) == 0.0


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
    assert reason("torch:collectives", ALL_TO_ALL) is None   # its process group runs it
    assert reason("torch:gloo", GATHER) is None and reason("mpi", SCATTER, "-d", "bfloat16") is None
    # MultiWorkerMirroredStrategy's replica context: all_reduce (SUM, MEAN) and all_gather, no 8-bit types
    assert reason("mwms", ALLREDUCE, "-o", "avg") is None and reason("mwms", ALLGATHER, "-d", "bfloat16") is None
    assert "no 'max'" in reason("mwms", ALLREDUCE, "-o", "max")
    assert "no int8" in reason("mwms", ALLGATHER, "-d", "int8")
    assert "integer average" in reason("mwms", ALLREDUCE, "-o", "avg", "-d", "int32")
    assert "no reduce_scatter" in reason("mwms", REDUCE_SCATTER) and "no broadcast" in reason("mwms", BROADCAST)
    assert reason("tf:mwms", ALLREDUCE, "-o", "max") == reason("mwms", ALLREDUCE, "-o", "max")   # the same backend
    # our TensorFlow ops: the four collectives.tensorflow has, our reductions' dtypes
    assert all(reason("tf:collectives", spec, "-o", "max") is None
               for spec in (ALLREDUCE, ALLGATHER, REDUCE_SCATTER, BROADCAST))
    assert "no reduce" in reason("tf:collectives", REDUCE) and "no all_to_all" in reason("tf:collectives", ALL_TO_ALL)


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
    done = run_launch([sys.executable, "-m", f"bench.{tool}", "--ranks", "2", *argv, "-J", str(path)], 120, cwd=ROOT)
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


@pytest.mark.slow
@pytest.mark.mpi
def test_gloo_beside_ours_and_mpi(tmp_path):
    pytest.importorskip("mpi4py", reason="needs mpi4py: pip install '.[test]'")
    require("torch", reason="the gloo backend needs PyTorch: pip install torch==2.13.0")
    out, report = run_processes("all_gather_perf", ["--backend", "ours,mpi,gloo", "-b", "1K", "-e", "64K",
                                                    "-f", "8", "-n", "2", "-w", "1", "-d", "int32"], tmp_path)
    assert [r["backend"] for r in report["rows"]] == ["ours", "mpi", "gloo"] * 3
    assert all(r["out_of_place"]["wrong"] == r["in_place"]["wrong"] == 0 for r in report["rows"])
    assert report["environment"]["torch"].startswith("2.")


@pytest.mark.slow
@pytest.mark.mpi
def test_a_backend_without_the_op_is_skipped(tmp_path):
    """MPI has no average: its rows are left out, with the reason; Gloo averages floats."""
    pytest.importorskip("mpi4py", reason="needs mpi4py: pip install '.[test]'")
    require("torch", reason="the gloo backend needs PyTorch: pip install torch==2.13.0")
    out, report = run_processes("reduce_scatter_perf", ["--backend", "ours,mpi,gloo", "-b", "4K", "-e", "4K",
                                                        "-n", "1", "-w", "0", "-o", "avg", "-d", "half"], tmp_path)
    assert "# mpi skipped: MPI has no 'avg' reduction" in out
    assert [r["backend"] for r in report["rows"]] == ["ours", "gloo"]
    assert all(r["out_of_place"]["wrong"] == r["in_place"]["wrong"] == 0 for r in report["rows"])


@pytest.mark.mpi
@pytest.mark.parametrize("tool", ["alltoall_perf", "gather_perf", "scatter_perf"])
def test_the_exchanges_beside_mpi(tool, tmp_path):
    """Ours in processes runs these as plans (no compiled loop), and MPI's
    calls take MPI_IN_PLACE at the root only (gather, scatter): every rank
    checked, a root other than 0, both placements."""
    pytest.importorskip("mpi4py", reason="needs mpi4py: pip install '.[test]'")
    out, report = run_processes(tool, ["--backend", "ours,mpi", "-b", "1K", "-e", "64K", "-f", "8", "-n", "2",
                                       "-w", "1", "-d", "int8", "-r", "1"], tmp_path)
    assert [r["backend"] for r in report["rows"]] == ["ours", "mpi"] * 3
    assert all(r["out_of_place"]["wrong"] == r["in_place"]["wrong"] == 0 for r in report["rows"])
    assert out.count("# Out of bounds values : 0 OK") == 2


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("tool", ["alltoall_perf", "gather_perf", "scatter_perf"])
def test_the_exchanges_in_gloo(tool, tmp_path):
    """Gloo's all_to_all_single (in place on a copy), gather and scatter into
    views of one buffer, checked as ours."""
    pytest.importorskip("mpi4py", reason="needs mpi4py: pip install '.[test]'")
    require("torch", reason="the gloo backend needs PyTorch: pip install torch==2.13.0")
    _, report = run_processes(tool, ["--backend", "gloo", "-b", "1K", "-e", "64K", "-f", "8", "-n", "2", "-w", "1",
                                     "-d", "bfloat16", "-r", "1"], tmp_path)
    assert [r["backend"] for r in report["rows"]] == ["gloo"] * 3
    assert all(r["out_of_place"]["wrong"] == r["in_place"]["wrong"] == 0 for r in report["rows"])


@pytest.mark.mpi
def test_codecs_across_processes_beside_uncompressed_mpi(tmp_path):
    """Under mpiexec: ours per codec through shared memory, and MPI's float32
    rows (run uncompressed, said so) with a maxrel and no wire bytes."""
    pytest.importorskip("mpi4py", reason="needs mpi4py: pip install '.[test]'")
    out, report = run_processes("all_reduce_perf", ["--backend", "ours,mpi", "--compression", "none,fp16,int8",
                                                    "-b", "4K", "-e", "64K", "-f", "16", "-n", "2", "-w", "1"],
                                tmp_path)
    assert "# mpi run uncompressed: --compression applies to ours" in out
    rows = report["rows"]
    assert [r["backend"] for r in rows] == ["ours:none", "ours:fp16", "ours:int8", "mpi"] * 2
    for plain, fp16, int8, mpi in zip(*[rows[i::4] for i in range(4)]):
        assert plain["in_place"]["wrong"] == mpi["out_of_place"]["wrong"] == 0 and fp16["in_place"]["wrong"] is None
        assert mpi["compression"] == "none" and mpi["wire_bytes"] is None and mpi["maxrel"] < MAXREL["none"]
        assert fp16["wire_bytes"] <= 0.52 * plain["wire_bytes"] and int8["wire_bytes"] <= 0.28 * plain["wire_bytes"]
        assert fp16["maxrel"] < MAXREL["fp16"] and int8["maxrel"] < MAXREL["int8"]
        # one array per process, as users call it: the compiled loop where it is built, its merged step up to
        # its limit (a core per rank: fastpath.MERGED_MAX_DEDICATED; else the slots' size, 64 KiB)
        merged_max = fastpath.MERGED_MAX_DEDICATED if (os.cpu_count() or 1) >= 2 else 64 << 10
        step = "direct" if plain["size"] <= merged_max else "two_shot"   # (the large step moves two_shot's bytes)
        assert plain["picked"] == (step if fastpath.available() else "direct"), plain
        assert plain["wire_bytes"] == plain["size"], plain   # 2 ranks: each reads its peer's message once


def test_nccl_is_a_backend_for_gpus_only():
    with pytest.raises(SystemExit):
        harness.parse_args(ALLREDUCE, ["--backend", "ours,nccl"])          # host: NCCL needs --device cuda
    with pytest.raises(SystemExit):
        harness.parse_args(ALLREDUCE, ["--backend", "mpi", "--device", "cuda"])  # MPI runs on host arrays
    args = harness.parse_args(ALLREDUCE, ["--backend", "ours,nccl", "--device", "cuda"])
    assert args.backends == ["ours", "nccl"]
    args = harness.parse_args(ALLREDUCE, ["--backend", "ours,mpi,gloo", "--device", "emulated"])
    assert args.backends == ["ours", "mpi", "gloo"]  # ours on emulated devices beside host MPI and Gloo


def test_in_place_batches_start_from_the_seeded_inputs(monkeypatch, capsys, tmp_path):
    """In place a sum doubles the data on 2 ranks: with --compression each
    timed batch starts again from the seeded inputs, so no batch meets inf."""
    largest = []
    real = harness.timed_batch

    def watching(backend, buffers, args, world):
        largest.append(max(float(np.max(np.abs(x))) for x in buffers.inputs))
        return real(backend, buffers, args, world)

    monkeypatch.setattr(harness, "timed_batch", watching)
    code, out, _ = run_tool(ALLREDUCE, ["--ranks", "2", "-b", "1K", "-e", "1K", "-n", "40", "-w", "40",
                                        "--rounds", "2", "--compression", "none,int8"], capsys, tmp_path)
    assert code == 0, out
    in_place = largest[len(largest) // 2:]   # out of place first, then in place
    assert len(in_place) == 4 and max(in_place) < 10  # standard normal inputs, not 2^80 times them


@pytest.mark.parametrize("gpus, expected", [(1, [0, 0, 0, 0]), (2, [0, 1, 0, 1]), (8, [0, 1, 2, 3])])
def test_fusion_perf_places_cuda_ranks_on_the_gpus_there_are(monkeypatch, gpus, expected):
    """--device cuda --ranks 4 on a one-GPU machine puts every rank on GPU 0
    (it asked for GPUs 0-3 and failed), as init(device="cuda") does."""
    import collectives
    from bench import fusion_perf
    from collectives.devices import cuda

    from bench import cli
    asked = []
    monkeypatch.setattr(cli, "require_device_toolchain", lambda prog, device: None)   # no CuPy here
    monkeypatch.setattr(cuda, "visible_gpus", lambda: gpus)
    monkeypatch.setattr(collectives.Communicator, "local", staticmethod(lambda n, devices=None: asked.append(devices)))
    fusion_perf.make_communicator(fusion_perf.parse_args(["--device", "cuda", "--ranks", "4"]), world=None)
    assert asked == [expected]


@pytest.mark.parametrize("device", ["host", "emulated"])
def test_fusion_perf_counts_every_steps_calls_and_launches_repeated_calls_too(device, tmp_path, capsys):
    """Each step after the warm-up repeats the same calls on the same arrays,
    which run their bound forms, not the ranks' run: the counts are of the
    communicator's calls (one per array, or one per fusion buffer) and of
    the kernels the emulated device runs (one per call at least)."""
    import json
    from bench import fusion_perf
    out = tmp_path / "fusion.json"
    assert fusion_perf.main(["--device", device, "--ranks", "2", "--steps", "2", "--models", "resnet50",
                             "--scale", "0.001", "-J", str(out)]) in (0, None)
    capsys.readouterr()
    model = json.loads(out.read_text())["models"]["resnet50"]
    fused, per_array = model["fused"], model["per-array"]
    assert per_array["collective_calls_per_step"] == model["tensors"] == 161
    assert 1 <= fused["collective_calls_per_step"] < model["tensors"]
    if device == "emulated":
        assert per_array["kernel_launches_per_step"] >= per_array["collective_calls_per_step"]
        assert fused["kernel_launches_per_step"] >= fused["collective_calls_per_step"]
    else:
        assert per_array["kernel_launches_per_step"] == fused["kernel_launches_per_step"] == 0


def test_codec_speed_on_a_device_times_each_kernel_against_a_copy_of_as_many_bytes(tmp_path, capsys):
    """The --device mode, on the emulated device (what CI can run): every row
    has the kernel's and the copy's rates, and the bytes the operation moves."""
    from bench import codec_speed
    out = tmp_path / "codecs.json"
    assert codec_speed.main(["--device", "emulated", "--mib", "1", "--repeat", "1", "--codecs", "fp16",
                             "--ops", "decode,decode_add+encode", "-J", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["environment"]["git_commit"] and "--device emulated" in report["environment"]["command"]
    rows = {r["op"]: r for r in report["rows"]}
    n = rows["decode"]["elements"]
    wire = n * 2 + n // 32   # fp16 payload and one scale byte per block
    assert rows["decode"]["bytes_moved"] == wire + 4 * n
    assert rows["decode_add+encode"]["bytes_moved"] == 4 * n + wire + 4 * n + wire
    for r in rows.values():
        assert r["codec_GBps"] > 0 and r["copy_GBps"] > 0
        assert r["codec_vs_copy"] == pytest.approx(r["codec_GBps"] / r["copy_GBps"])
    assert "decode_add+encode" in capsys.readouterr().out


def test_codec_speed_times_what_a_four_rank_compressed_call_launches(tmp_path):
    """The device-only rows: four ring hops as one codec_batch (the bytes of
    one hop over all the elements), and codec_round_sum of 4 inputs into 4
    outputs (each read or written once); and the CPU mode refuses them."""
    from bench import codec_speed
    out = tmp_path / "batches.json"
    assert codec_speed.main(["--device", "emulated", "--mib", "1", "--repeat", "1", "--codecs", "int8",
                             "--ops", "decode_add+encode,batch4:decode_add+encode,round_sum4", "-J", str(out)]) == 0
    rows = {r["op"]: r for r in json.loads(out.read_text())["rows"]}
    n = rows["round_sum4"]["elements"]
    assert rows["batch4:decode_add+encode"]["bytes_moved"] == rows["decode_add+encode"]["bytes_moved"]
    assert rows["round_sum4"]["bytes_moved"] == 8 * 4 * n
    assert all(r["codec_GBps"] > 0 and r["copy_GBps"] > 0 for r in rows.values())
    with pytest.raises(SystemExit):
        codec_speed.main(["--ops", "round_sum4"])


def test_compute_between_puts_compute_before_each_timed_call_and_no_warm_up(monkeypatch, capsys, tmp_path):
    """--compute-between MS: every timed call comes after MS of compute, and
    no warm-up batch runs before a round (what a training step's call meets)."""
    events = []
    monkeypatch.setattr(harness, "compute", lambda seconds: events.append(("compute", seconds)))
    monkeypatch.setattr(harness, "warm_up", lambda *arguments: events.append(("warm_up",)))
    run = harness.timed_one_by_one

    def counted(backend, buffers, calls, world, **around):
        events.append(("batch", calls))
        return run(backend, buffers, calls, world, **around)
    monkeypatch.setattr(harness, "timed_one_by_one", counted)
    code, out, report = run_tool(ALLREDUCE, ["--ranks", "2", "-b", "1K", "-e", "4K", "-f", "4", "-n", "3", "-w", "0",
                                             "--rounds", "2", "--compute-between", "1.5"], capsys, tmp_path)
    assert code == 0 and report["rows"], out
    assert ("warm_up",) not in events
    batches = [e for e in events if e[0] == "batch"]
    assert len(batches) == 2 * 2 * 2 and all(calls == 3 for _, calls in batches)   # sizes x placements x rounds
    assert events.count(("compute", 1.5e-3)) == 3 * len(batches) == len(events) - len(batches)


def test_read_results_reads_every_output_after_each_call_warm_up_calls_too(monkeypatch, capsys, tmp_path):
    """--read-results: after every timed call each rank reads its outputs,
    untimed (every output of the batch, as many reads as calls), and the
    warm-up before each batch reads after its calls too; refused with
    --compute-between and off the host."""
    events = []

    def warm_up(backend, buffers, world, last, after=None):
        events.append("warm_up")
        after()
    monkeypatch.setattr(harness, "warm_up", warm_up)
    monkeypatch.setattr(harness, "read_results", lambda buffers: events.append(("read", len(buffers.outputs))))
    code, out, report = run_tool(ALLREDUCE, ["--ranks", "2", "-b", "1K", "-e", "4K", "-f", "4", "-n", "3", "-w", "0",
                                             "--rounds", "2", "--read-results"], capsys, tmp_path)
    assert code == 0 and report["rows"], out
    batch = ["warm_up", ("read", 2)] + [("read", 2)] * 3   # a warm-up's read, then each of 3 calls', 2 local ranks
    assert events == batch * (2 * 2 * 2), events   # rounds x placements x sizes
    for refused in (["--compute-between", "1"], ["--device", "emulated"]):
        with pytest.raises(SystemExit):
            harness.parse_args(ALLREDUCE, ["--read-results", *refused])
    buffers = harness.Buffers([np.zeros(4)], [np.ones(4), np.ones(2)], None)
    harness.read_results(buffers)   # (host arrays: reads, writes nothing)
