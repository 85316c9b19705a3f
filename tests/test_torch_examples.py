"""examples/ddp.py, fsdp.py and moe.py run under torchrun, with no mpiexec.

Gloo or our torch.distributed backend (`--backend collectives`) carries
DDP's and FSDP's collectives; ddp.py's --compression puts our compression
hook (collectives.torch.compression_hook) on DDP's buckets, on the
communicator of our group, or on one collectives.init() makes beside Gloo
through torchrun's store. Two epochs on 2 processes: each run ends with
the test accuracy and, for DDP, every rank holding the same parameters.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from installed import needs

pytestmark = [needs("torch", reason="the examples need PyTorch: pip install '.[test]'"),
              needs("sklearn", reason="the examples train on scikit-learn's digits: pip install '.[examples]'")]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def torchrun(n, script, *flags, limit=180):
    env = dict(os.environ, OMP_NUM_THREADS="1", COLLECTIVES_TIMEOUT="60",
               PYTHONPATH=os.pathsep.join([str(EXAMPLES.parent), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                           str(EXAMPLES / script), *flags], env=env, capture_output=True, text=True, timeout=limit)
    report = done.stdout[-3000:] + done.stderr[-6000:]
    assert done.returncode == 0, report
    return done.stdout, report


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.parametrize("backend, compression", [("gloo", "none"), ("gloo", "int8"), ("collectives", "bf16")])
def test_ddp_example_trains_under_torchrun(backend, compression):
    flags = ["--epochs", "2", "--backend", backend, "--compression", compression] + \
        (["--error-feedback"] if compression == "int8" else [])
    stdout, report = torchrun(2, "ddp.py", *flags)
    assert re.search(r"final test accuracy 0\.[5-9]\d+", stdout), report
    assert "parameters bitwise identical on all 2 ranks: True" in stdout, report


@pytest.mark.slow
@pytest.mark.processes
def test_fsdp_example_trains_under_torchrun():
    stdout, report = torchrun(2, "fsdp.py", "--epochs", "2")
    assert re.search(r"final test accuracy 0\.[5-9]\d+", stdout), report
    assert "parameters' digest" in stdout, report


@pytest.mark.processes
def test_on_our_group_fsdp_ends_on_ddps_parameters():
    """On our backend DDP and FSDP2 fold the same values in the same order:
    the same parameters, bit for bit (their digest)."""
    digests = []
    for script in ("ddp.py", "fsdp.py"):
        stdout, report = torchrun(2, script, "--epochs", "2", "--backend", "collectives")
        assert re.search(r"final test accuracy 0\.[5-9]\d+", stdout), report
        digests.append(re.search(r"digest ([0-9a-f]{16})", stdout).group(1))
    assert digests[0] == digests[1], digests


@pytest.mark.processes
@pytest.mark.parametrize("backend", ["collectives", pytest.param("gloo", marks=pytest.mark.slow)])
def test_the_mixture_of_experts_example_matches_one_process_on_the_whole_batch(backend):
    """Tokens to their experts and back by all_to_all_single with uneven
    splits, forward and backward, on 4 processes: every step's loss is the
    one-process model's on the whole batch, to 1e-5."""
    stdout, report = torchrun(4, "moe.py", "--epochs", "2", "--backend", backend)
    difference = float(re.search(r"from one process on the whole batch: (\S+)", stdout).group(1))
    assert difference <= 1e-5, report
    accuracy = re.search(r"final test accuracy (\S+) \(one process: (\S+)\)", stdout)
    assert accuracy.group(1) == accuracy.group(2), report


FAKE_DDP = """
import argparse, os
p = argparse.ArgumentParser()
for flag in ("--backend", "--compression", "--epochs", "--hidden"):
    p.add_argument(flag)
args = p.parse_args()
if os.environ.get("RANK") == "0":
    ms = 2.0 if args.backend == "gloo" else 1.0
    print(f"final test accuracy 0.9{args.hidden}, test loss 0.1", flush=True)
    print(f"{ms:.2f} ms per step (rank 0, 18 steps)", flush=True)
    print("parameters bitwise identical on all 2 ranks: True; their digest 0a1b", flush=True)
"""


@pytest.mark.slow
@pytest.mark.processes
def test_ddp_step_times_each_run_in_turn_and_reads_rank_0s_figures(tmp_path, monkeypatch, capsys):
    """python -m bench.ddp_step: one torchrun job per run and round, the runs in
    turn, rank 0's figures read off its output into the JSON (a stand-in for
    examples/ddp.py that prints what the example prints: the real example's
    training is tested above)."""
    from bench import ddp_step
    fake = tmp_path / "ddp.py"
    fake.write_text(FAKE_DDP)
    monkeypatch.setattr(ddp_step, "EXAMPLE", fake)
    path = tmp_path / "ddp.json"
    assert ddp_step.main(["--nproc-per-node", "1", "--epochs", "1", "--rounds", "1", "--hidden", "64",
                          "--runs", "gloo,collectives+int8", "-J", str(path)]) == 0
    said = capsys.readouterr().out
    assert said.count("# round ") == 2 and said.index("round 1: gloo") < said.index("round 1: collectives+int8"), said
    report = json.loads(path.read_text())
    assert report["processes"] == 1 and report["hidden"] == 64 and report["hosts"] is None
    assert [(r["run"], r["step_ms"], r["over_first"], r["test_accuracy"], r["steps"]) for r in report["runs"]] == [
        ("gloo", [2.0], 1.0, [0.964], 18), ("collectives+int8", [1.0], 0.5, [0.964], 18)]
