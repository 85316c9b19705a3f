"""The bench command lines answer questions: --help describes every flag and
shows its default, and a bad flag or a missing toolchain ends in one line
of stderr, never a traceback."""

import argparse
import os
import runpy
import subprocess
import sys
import textwrap

import pytest

from bench import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every module under bench/ that is a command line (python -m bench.NAME),
# and every subcommand of one (python -m bench.NAME SUBCOMMAND).
TOOLS = ["all_reduce_perf", "reduce_scatter_perf", "all_gather_perf", "broadcast_perf", "reduce_perf",
         "alltoall_perf", "gather_perf", "scatter_perf",
         "call_overhead", "codec_speed", "compression_error", "fusion_perf", "gpu_check",
         "floor", "half_precision_error", "hierarchy_perf", "host_vs_mpich",
         "model", "model hierarchy", "model compression", "model plans",
         "plot", "report", "spmd_overhead", "chaos", "pingpong", "tensorflow_overhead",
         "call_percentiles", "keras_fit", "mpis", "ddp_step"]


def test_every_command_line_is_listed():
    """A new tool under bench/ that builds a cli.Parser is tested here too."""
    bench = os.path.join(ROOT, "bench")
    with_parser = {name[:-3] for name in os.listdir(bench)
                   if name.endswith(".py") and "cli.Parser(" in open(os.path.join(bench, name)).read()}
    harness_tools = {name[:-3] for name in os.listdir(bench)  # bench/harness.py's parser, through its main
                     if name.endswith("_perf.py")
                     and "from bench.specs import" in open(os.path.join(bench, name)).read()}
    assert (with_parser - {"harness"}) | harness_tools == {tool.split()[0] for tool in TOOLS}
    from bench.model import SUBCOMMANDS
    assert {tool for tool in TOOLS if tool.startswith("model ")} == {f"model {name}" for name in SUBCOMMANDS}
    # and each spec of bench/specs.py is the one spec of one tool
    from bench.specs import SPECS
    swept = sorted((tool_spec(name) for name in harness_tools), key=lambda spec: spec.name)
    assert [spec.name for spec in swept] == sorted(SPECS)
    assert all(spec is SPECS[spec.name] for spec in swept)


def tool_spec(tool):
    """The Spec that `python -m bench.TOOL` sweeps (a harness tool)."""
    import importlib
    from bench.harness import Spec
    specs = [value for value in vars(importlib.import_module(f"bench.{tool}")).values() if isinstance(value, Spec)]
    assert len(specs) == 1, (tool, specs)
    return specs[0]


def run_tool(monkeypatch, tool, argv):
    """Runs `python -m bench.TOOL ARGV` in this process (TOOL may name a
    subcommand too: "model plans"); returns its exit code."""
    module, *subcommand = tool.split()
    monkeypatch.setattr(sys, "argv", [f"bench/{module}.py", *subcommand, *argv])
    monkeypatch.delitem(sys.modules, f"bench.{module}", raising=False)  # run as __main__, as python -m does
    with pytest.raises(SystemExit) as stopped:
        runpy.run_module(f"bench.{module}", run_name="__main__")
    return stopped.value.code


@pytest.mark.parametrize("tool", TOOLS)
def test_help_describes_every_flag_and_shows_defaults(tool, monkeypatch, capsys):
    shown = []
    print_help = cli.Parser.print_help
    monkeypatch.setattr(cli.Parser, "print_help", lambda self, file=None: (shown.append(self), print_help(self, file)))
    assert run_tool(monkeypatch, tool, ["--help"]) in (0, None)
    text = capsys.readouterr().out
    parser, = shown
    assert parser.prog == f"python -m bench.{tool}"
    assert parser.description and " ".join(parser.description.split())[:40] in " ".join(text.split())
    undescribed = [a.option_strings or a.dest for a in parser._actions if not a.help]
    assert not undescribed, f"flags with no description: {undescribed}"
    # Every flag with a value to default to says what it is, as a reader
    # would type it, not with binary floating point's noise (7.109999999999999).
    for action in parser._actions:
        if action.option_strings and action.default not in (None, False, "==SUPPRESS=="):
            assert "default" in parser._get_formatter()._get_help_string(action), action.option_strings
        if isinstance(action.default, float):
            assert float(f"{action.default:.12g}") == action.default, (action.option_strings, action.default)


def test_help_shows_the_defaults_in_its_text(monkeypatch, capsys):
    run_tool(monkeypatch, "all_reduce_perf", ["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "largest message (default: 32M)" in text
    assert "(default: host)" in text and "(default: auto)" in text


# What a tool requires, so that the bad flag is what it complains of.
REQUIRED = {"plot": ["results.json", "-o", "plot.png"]}


@pytest.mark.parametrize("tool", TOOLS)
def test_a_bad_flag_gives_one_line(tool, monkeypatch, capsys):
    assert run_tool(monkeypatch, tool, [*REQUIRED.get(tool, []), "--no-such-flag"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"python -m bench.{tool}: error: "), err
    assert "--no-such-flag" in err


@pytest.mark.parametrize("tool, argv", [("all_reduce_perf", ["-b", "lots"]), ("model plans", ["--bytes", "lots"]),
                                        ("model hierarchy", ["--bytes", "1M,lots"]),
                                        ("host_vs_mpich", ["--sizes", "4,lots"])])
def test_a_bad_size_gives_one_line(tool, argv, monkeypatch, capsys):
    assert run_tool(monkeypatch, tool, argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'lots' is not a size" in err, err


@pytest.mark.parametrize("tool, argv, said", [
    ("host_vs_mpich", ["--mpi", "mpich,lam"], "--mpi: unknown ['lam']; choose from mpich, openmpi"),
    ("all_reduce_perf", ["--backend", "ours,mpich,openmpi"], "one process loads one MPI library"),
    ("compression_error", ["--algorithms", "ring,rign"], "--algorithms: unknown ['rign']; choose from "),
    ("codec_speed", ["--ops", "encode,zip"], "--ops: unknown ['zip']"),
    ("call_percentiles", ["--collectives", "allreduce,alltoall"], "--collectives: unknown ['alltoall']"),
    ("call_overhead", ["--collectives", ","], "--collectives: unknown []"),
    ("all_reduce_perf", ["--algorithm", "auto,hypercube"], "--algorithm: unknown ['hypercube']")])
def test_an_unknown_name_in_a_list_or_two_mpi_libraries_give_one_line(tool, argv, said, monkeypatch, capsys):
    assert run_tool(monkeypatch, tool, argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err, err


@pytest.mark.parametrize("argv, said", [
    (["--hosts", "1"], "--hosts: at least 2"),
    (["--hosts", "2", "--mpi", "openmpi"], "--hosts: MPICH only"),
    (["--hosts", "2", "--ranks", "2,3"], "--ranks: with --hosts 2, multiples of 2"),
    (["--hosts", "2", "--link", "fast"], "--link: a rate such as 10gbit"),
    (["--compression", "int8,zip"], "--compression: unknown ['zip']")])
def test_host_vs_mpich_across_hosts_and_compressed_refuses_what_it_cannot_run(argv, said, monkeypatch, capsys):
    assert run_tool(monkeypatch, "host_vs_mpich", argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err, err


@pytest.mark.parametrize("argv, said", [
    (["--runs", "gloo,mpi"], "--runs: 'mpi' is not BACKEND or BACKEND+CODEC"),
    (["--runs", "collectives+zip"], "--runs: 'collectives+zip' is not BACKEND"),
    (["--nproc-per-node", "3"], "the global batch, 64, must split evenly"),
    (["--hosts", "1"], "--hosts: at least 2")])
def test_ddp_step_refuses_runs_it_cannot_make_in_one_line(argv, said, monkeypatch, capsys):
    assert run_tool(monkeypatch, "ddp_step", argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err, err


def test_host_vs_mpich_rejects_an_unknown_collective_in_one_line(monkeypatch, capsys):
    assert run_tool(monkeypatch, "host_vs_mpich", ["--collectives", "allreduce,alltoall"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--collectives: unknown ['alltoall']" in err, err


def test_host_vs_mpich_is_the_harness_specs_and_their_placements():
    """The tool times the per-collective tools' own specs on the harness, all
    eight, in both placements."""
    from bench import host_vs_mpich as tool
    from bench.all_gather_perf import ALLGATHER
    from bench.all_reduce_perf import ALLREDUCE
    from bench.alltoall_perf import ALL_TO_ALL
    from bench.broadcast_perf import BROADCAST
    from bench.gather_perf import GATHER
    from bench.reduce_perf import REDUCE
    from bench.reduce_scatter_perf import REDUCE_SCATTER
    from bench.scatter_perf import SCATTER
    assert list(tool.SPECS.values()) == [ALLREDUCE, REDUCE_SCATTER, ALLGATHER, BROADCAST, REDUCE, ALL_TO_ALL, GATHER,
                                         SCATTER]
    assert tool.PLACEMENTS == ("out_of_place", "in_place")
    args = tool.parse_args(["--batch-bytes", "1M", "--min-iters", "2", "--max-iters", "100"])
    assert [tool.calls_per_batch(n, args) for n in (1 << 10, 16 << 10, 1 << 20, 64 << 20)] == [100, 64, 2, 2]
    # The ranks of a launch run with the settings the command parsed.
    again = tool.parse_args(tool.worker_argv(args))
    for name in ("collective_list", "size_list", "rounds", "batch_bytes", "min_iters", "max_iters", "warmup"):
        assert getattr(again, name) == getattr(args, name), name
    assert tool.parse_args([]).size_list == [1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


# Runs a tool in a fresh interpreter in which the CUDA headers cannot be
# found: the library's own lookup (collectives.kernels.cuda_include_dirs)
# runs, over every place it looks, and finds no cuda_fp16.h.
WITHOUT_CUDA_HEADERS = textwrap.dedent("""
    import pathlib, runpy, sys
    is_file = pathlib.Path.is_file
    pathlib.Path.is_file = lambda path: path.name != "cuda_fp16.h" and is_file(path)
    module = sys.argv[1]
    sys.argv = [module.replace(".", "/") + ".py", *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__")
""")


@pytest.mark.parametrize("argv", [["bench.all_reduce_perf", "--device", "emulated", "-e", "1K"],
                                  ["bench.fusion_perf", "--device", "emulated", "--steps", "1"]])
def test_missing_cuda_headers_give_one_line_with_both_install_hints(argv):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", WITHOUT_CUDA_HEADERS, *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"python -m {argv[0]}: error: --device emulated: no CUDA headers")
    assert "pip install -e '.[test]'" in done.stderr and "pip install 'collectives[test]'" in done.stderr


def test_the_library_names_both_installs_when_headers_are_missing(monkeypatch):
    """The message comes from the library, so every caller (not only the
    benchmarks) tells a checkout and an installed package what to install."""
    import pathlib
    from collectives import kernels
    from collectives.errors import CollectiveError
    is_file = pathlib.Path.is_file
    monkeypatch.setattr(pathlib.Path, "is_file", lambda path: path.name != "cuda_fp16.h" and is_file(path))
    with pytest.raises(CollectiveError, match=r"pip install -e '\.\[test\]'.*pip install 'collectives\[test\]'"):
        kernels.cuda_include_dirs()


# The tools that write a file whatever they are told: bench.report's job is
# to write docs/benchmarks.md and README.md's results table (test_report.py
# checks both), and bench.plot requires -o. bench.model and its hierarchy
# model print and write nothing; bench.mpis prints where each MPI is, and makes Open MPI's
# environment (.venv-openmpi, git-ignored) only when --make says so.
WRITERS_BY_DESIGN = {"report", "plot"}
PRINT_ONLY = {"model", "model hierarchy", "mpis"}


@pytest.mark.parametrize("tool", sorted(set(TOOLS) - WRITERS_BY_DESIGN))
def test_no_tool_writes_a_file_unless_told(tool, monkeypatch):
    """Every flag naming a file to write defaults to none: a run leaves the
    checkout as it found it unless -J (or the tool's own flag) says where."""
    parsed = []

    def parse_and_stop(self, args=None, namespace=None):
        parsed.append(argparse.ArgumentParser.parse_args(self, args, namespace))
        raise SystemExit(0)

    monkeypatch.setattr(cli.Parser, "parse_args", parse_and_stop)
    run_tool(monkeypatch, tool, [])
    (namespace,) = parsed
    writes = {name: value for name, value in vars(namespace).items()
              if ("output" in name or "json" in name) and name != "worker_output"}
    assert (tool in PRINT_ONLY) != bool(writes), writes
    assert all(value is None for value in writes.values()), writes


def test_gpu_check_writes_its_report_only_where_told(tmp_path, monkeypatch):
    """Like every tool, gpu_check writes a file only where -J says,
    made absolute: its steps run in the checkout's root."""
    from bench import gpu_check
    monkeypatch.chdir(tmp_path)
    assert gpu_check.parse_args(["--device", "emulated"]).output_file is None
    assert gpu_check.parse_args(["--device", "emulated", "-J", "r.json"]).output_file == str(tmp_path / "r.json")


def test_every_tool_writes_its_json_one_way(tmp_path, capsys):
    """cli.write_json, what each tool's -J goes through: the folder made if
    need be, indent 1 and a final newline, the file named after (not where
    the tool's stdout is its result)."""
    import json
    path = tmp_path / "new folder" / "run.json"
    cli.write_json(str(path), {"rows": [1, 2]})
    assert path.read_text() == json.dumps({"rows": [1, 2]}, indent=1) + "\n"
    assert capsys.readouterr().out == f"# wrote {path}\n"
    cli.write_json(path, {"rows": []}, say=None)
    assert json.loads(path.read_text()) == {"rows": []} and capsys.readouterr().out == ""


def test_a_sweep_goes_from_b_to_at_most_e_by_f():
    assert cli.size_sweep("1K", "64K", 4) == [1024, 4096, 16384, 65536]
    assert cli.size_sweep(8, "100", 3) == [8, 24, 72]
    assert cli.size_sweep("2M", "1M", 2) == []
