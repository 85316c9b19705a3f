"""examples/ddp.py and examples/fsdp.py run under torchrun, with no mpiexec.

Gloo carries DDP's and FSDP's collectives; ddp.py's --compression puts our
compression hook (collectives.torch.compression_hook) on DDP's buckets, on
a communicator collectives.init() makes beside Gloo through torchrun's
store. Two epochs on 2 processes: each run ends with the test accuracy
and, for DDP, every rank holding the same parameters. `--backend
collectives` needs the torch.distributed backend and is run where it is
registered.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the examples need PyTorch: pip install '.[test]'")
pytest.importorskip("sklearn", reason="the examples train on scikit-learn's digits: pip install '.[examples]'")

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
@pytest.mark.parametrize("compression", ["none", "int8"])
def test_ddp_example_trains_under_torchrun(compression):
    flags = ["--epochs", "2", "--compression", compression] + (["--error-feedback"] if compression != "none" else [])
    stdout, report = torchrun(2, "ddp.py", *flags)
    assert re.search(r"final test accuracy 0\.[5-9]\d+", stdout), report
    assert "parameters bitwise identical on all 2 ranks: True" in stdout, report


@pytest.mark.slow
@pytest.mark.processes
def test_fsdp_example_trains_under_torchrun():
    stdout, report = torchrun(2, "fsdp.py", "--epochs", "2")
    assert re.search(r"final test accuracy 0\.[5-9]\d+", stdout), report
    assert "parameters' digest" in stdout, report
