"""collectives.torch.compression_hook: our compressed allreduce as a DDP communication hook.

In this process: the arguments it refuses. Under torchrun (marked
`processes`; tests/torch_hook_worker.py is one rank): one launch of 2
ranks and one of 4 run every scenario, DDP on a Gloo group with our communicator
(collectives.init() through torchrun's store) beside it, and each test
below reads its scenario's verdict from every rank:

- every gradient is the bits of a NumPy reference of the compressed
  direct allreduce (each contribution encoded once, float32 sum in rank
  order, divided by n), over several buckets and DDP's bucket rebuild;
- with algorithm auto, the bits of Communicator.allreduce on the same
  arrays, within docs/compression.md's error bound;
- closer to the exact average than torch's fp16_compress_hook and
  bf16_compress_hook, which sum in 16 bits;
- error feedback: the residual is what the codec lost, and the error of
  the summed results stays bounded where without it it grows;
- the communicator from the argument, the state, .communicator(device),
  or collectives.init();
- a bucket that is not float32, or a group of another size: a typed error.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the DDP hook needs PyTorch: pip install '.[test]'")

import collectives  # noqa: E402
from collectives import InvalidUsageError  # noqa: E402
from collectives.torch import compression_hook  # noqa: E402

HERE = Path(__file__).resolve().parent


def test_unknown_codecs_and_arguments_are_refused_at_once():
    for bad in ("fp8", "FP16", None, 16, "none"):
        with pytest.raises(InvalidUsageError, match="unknown compression"):
            compression_hook(bad)
    with pytest.raises(InvalidUsageError, match="error_feedback"):
        compression_hook("fp16", error_feedback="yes")
    with pytest.raises(InvalidUsageError, match="Communicator"):
        compression_hook("fp16", communicator=object())
    with collectives.Communicator.local(2) as comm, pytest.raises(InvalidUsageError, match="one rank"):
        compression_hook("fp16", communicator=comm)


def test_a_communicator_that_does_not_compress_is_refused(monkeypatch):
    """On NCCL our codecs do not run: the hook says so when it is made, not
    in the middle of backward."""
    comm = collectives.init()

    class Ranks:
        compresses = False
    monkeypatch.setattr(comm, "_ranks", Ranks())
    with pytest.raises(InvalidUsageError, match="not available on Ranks ranks"):
        compression_hook("bf16", communicator=comm)


def test_the_hook_is_named_and_error_feedback_means_direct():
    hook = compression_hook("int8", error_feedback=True)
    assert hook.__name__ == "collectives_int8_compression_hook" and hook.algorithm == "direct"
    assert compression_hook("bf16").algorithm == "auto"
    assert compression_hook("fp16", algorithm="ring").algorithm == "ring"
    assert hook.residual(0) is None


def test_one_rank_averages_over_itself():
    """collectives.init() without a launcher is one rank: the hook gives the
    bucket back unchanged (nothing is encoded on one rank)."""
    comm = collectives.init()
    hook = compression_hook("int8", error_feedback=True, communicator=comm)

    class Bucket:
        def __init__(self, t):
            self.t = t

        def buffer(self):
            return self.t

        def index(self):
            return 3

    values = torch.randn(100)
    result = hook(None, Bucket(values.clone())).wait()
    assert torch.equal(result, values) and hook.residual(3) is None


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def verdicts(request, tmp_path_factory):
    """Run every scenario once on 2 and on 4 torchrun processes; per
    scenario, every rank's verdict, and rank 0's measurements."""
    nranks = request.param
    out = tmp_path_factory.mktemp("torch_hook")
    env = dict(os.environ, COLLECTIVES_TIMEOUT="30", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={nranks}", str(HERE / "torch_hook_worker.py"), str(out)],
                          env=env, capture_output=True, text=True, timeout=240)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nranks)
             if (out / f"rank{r}.json").exists()]
    assert done.returncode == 0 and len(ranks) == nranks, done.stdout[-3000:] + done.stderr[-6000:]
    return {name: [r["results"][name] for r in ranks] for name in ranks[0]["results"]}, ranks[0]["measured"]


def check(verdicts, name):
    results, _ = verdicts
    failed = [v for v in results[name] if v != "ok"]
    assert not failed, failed[0]



@pytest.mark.processes
@pytest.mark.parametrize("codec", ["bf16", "fp16", "int8"])
def test_ddp_gradients_are_the_numpy_reference_bits(verdicts, codec):
    check(verdicts, f"exact_{codec}")


@pytest.mark.processes
@pytest.mark.parametrize("codec", ["bf16", "fp16", "int8"])
def test_auto_gives_the_communicators_bits_within_the_bound(verdicts, codec):
    check(verdicts, f"auto_{codec}")


@pytest.mark.processes
@pytest.mark.parametrize("codec", ["fp16", "bf16"])
def test_closer_to_the_average_than_torchs_16_bit_hooks(verdicts, codec):
    check(verdicts, f"versus_torch_{codec}")
    measured = verdicts[1][f"versus_torch_{codec}"]
    assert measured["torch"] > max(measured["ours_auto"], measured["ours_direct"])


@pytest.mark.processes
def test_error_feedback_keeps_what_the_codec_lost(verdicts):
    check(verdicts, "error_feedback")


@pytest.mark.processes
def test_where_the_communicator_comes_from(verdicts):
    check(verdicts, "state_forms")


@pytest.mark.processes
def test_buckets_and_groups_it_cannot_take_raise(verdicts):
    check(verdicts, "refusals")
