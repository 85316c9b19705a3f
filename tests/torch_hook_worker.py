"""One rank of the DDP compression-hook tests; tests/test_torch_hook.py starts N of these under torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/torch_hook_worker.py OUTPUT_DIR

DDP runs on a Gloo process group; our communicator (collectives.init(),
which meets its peers through torchrun's store) sits beside it. Each rank
runs every scenario in the same order and writes OUTPUT_DIR/rank<r>.json:
per scenario "ok" or the traceback of what failed, and what it measured.
Every rank knows every rank's gradients (they come from seeded generators),
so each computes the NumPy reference itself.
"""

import json
import os
import sys
import traceback
from pathlib import Path

from rare_collections import collect_rarely

collect_rarely()   # before PyTorch and TensorFlow load: rare_collections.py says why

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook, fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import codec_reference as ref

import collectives
from collectives import InvalidUsageError
from collectives.torch import compression_hook

CODECS = ("bf16", "fp16", "int8")


class Probe(torch.nn.Module):
    """Parameters whose gradient is whatever forward is given: d/dp sum(p * g) = g, exactly."""

    def __init__(self, sizes, dtype=torch.float32):
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in sizes])

    def forward(self, gradients):
        return sum((p * g).sum() for p, g in zip(self.ps, gradients))


def gradients(rank, step, sizes, mixed=True):
    """Rank `rank`'s gradients at `step`: magnitudes from 1e-6 to 1e3 mixed within each array."""
    out = []
    for i, size in enumerate(sizes):
        rng = np.random.default_rng([rank, step, i, 7])
        g = rng.standard_normal(size)
        if mixed:
            g *= 10.0 ** rng.integers(-6, 4, size)
        out.append(g.astype(np.float32))
    return out


def backward(model, grads):
    model.zero_grad(set_to_none=True)
    model([torch.from_numpy(g) for g in grads]).backward()
    return [p.grad.detach().numpy().copy() for p in model.module.ps]


def direct_average(codec, contributions):
    """The compressed direct allreduce in NumPy: each rank's contribution
    encoded once, decoded, summed in float32 in rank order, divided by n."""
    total = ref.round_trip(codec, contributions[0])
    for x in contributions[1:]:
        total = total + ref.round_trip(codec, x)
    return total / np.float32(len(contributions))


def same_bits(a, b):
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def ddp(sizes, hook_state, hook, dtype=torch.float32, bucket_cap_mb=0.004):
    model = DDP(Probe(sizes, dtype), bucket_cap_mb=bucket_cap_mb)
    if hook is not None:
        model.register_comm_hook(hook_state, hook)
    return model


# -- scenarios --------------------------------------------------------------------------------------


def exact(ctx, codec):
    """Several buckets (params of 32-element multiples, so no codec block
    straddles two), three steps (DDP rebuilds its buckets after the first):
    every gradient is the NumPy reference's bits."""
    sizes = [1024, 96, 2048, 32, 512]
    model = ddp(sizes, ctx.comm, compression_hook(codec, algorithm="direct"))
    for step in range(3):
        grads = backward(model, gradients(ctx.rank, step, sizes))
        everyone = [gradients(r, step, sizes) for r in range(ctx.size)]
        for i, got in enumerate(grads):
            want = direct_average(codec, [g[i] for g in everyone])
            assert same_bits(got, want), f"{codec} step {step} param {i}: max diff {np.abs(got - want).max()}"


def auto(ctx, codec):
    """algorithm auto, one bucket: the bits of Communicator.allreduce(op="avg",
    compression=codec) on the same arrays, and within the documented error
    bound (docs/compression.md) with q = n, the most any algorithm encodes."""
    sizes = [4096]
    model = ddp(sizes, ctx.comm, compression_hook(codec), bucket_cap_mb=25)
    for step in range(2):
        mine = gradients(ctx.rank, step, sizes)
        (got,) = backward(model, mine)
        direct_api = ctx.comm.allreduce(mine[0].copy(), op="avg", compression=codec)
        assert same_bits(got, direct_api), codec
        everyone = np.stack([gradients(r, step, sizes)[0] for r in range(ctx.size)]).astype(np.float64)
        n, q = ctx.size, ctx.size
        u = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11, "int8": 1 / 127.5}[codec]
        if codec == "bf16":
            p = np.abs(everyone).sum(axis=0)
        else:   # each rank's largest |x| in the element's block, summed (covers fp16's small term too)
            blocks = np.abs(everyone).reshape(n, -1, 32).max(axis=2, keepdims=True)
            p = np.broadcast_to(blocks, (n, everyone.shape[1] // 32, 32)).reshape(n, -1).sum(axis=0)
        mean = everyone.mean(axis=0)
        bound = (q * u * p + (n + 1) * 2.0 ** -24 * p) * (1 + u) ** q / n + 2.0 ** -24 * np.abs(mean)
        assert (np.abs(got - mean) <= bound).all(), codec


def versus_torch(ctx, codec):
    """Values exact in 16 bits whose average is not: one large per element
    on rank 0, small ones on the others, and tiny ones everywhere (below
    fp16's smallest once torch's hook divides them by n). Torch's hook
    divides and sums in 16 bits, where the small terms vanish beside the
    large and the tiny flush to zero. Ours, direct: every input is exact on
    the wire and the sum is float32's, never encoded again. Ours, auto: direct
    for processes on one node; were it an algorithm that sends the sum on
    (star), one more encoding of the result, where torch rounds every
    partial sum."""
    n = 2048
    j = np.arange(n // 2)
    if codec == "fp16":
        large, small, tiny = 1 + (j % 1024) / 1024, (1 + (j * 7 % 1024) / 1024) * 2.0 ** -13, \
            (1 + (j * 3 % 1024) / 1024) * 2.0 ** -23
    else:
        large, small, tiny = 1 + (j % 128) / 128, (1 + (j * 7 % 128) / 128) * 2.0 ** -10, \
            (1 + (j * 3 % 128) / 128) * 2.0 ** -30

    def grad(rank):
        return np.concatenate([large if rank == 0 else small, tiny * 2.0 ** rank]).astype(np.float32)

    exact_mean = np.mean([grad(r).astype(np.float64) for r in range(ctx.size)], axis=0)

    def error(model):
        (got,) = backward(model, [grad(ctx.rank)])
        return float((np.abs(got - exact_mean) / exact_mean).max())

    if codec == "fp16":
        theirs_hook = fp16_compress_hook
    else:
        def theirs_hook(state, bucket):   # DDP refuses the name bf16_compress_hook without NCCL
            return bf16_compress_hook(state, bucket)
    theirs = error(ddp([n], None, theirs_hook, bucket_cap_mb=25))
    direct = error(ddp([n], ctx.comm, compression_hook(codec, algorithm="direct"), bucket_cap_mb=25))
    auto = error(ddp([n], ctx.comm, compression_hook(codec), bucket_cap_mb=25))
    ctx.measured[f"versus_torch_{codec}"] = {"torch": theirs, "ours_direct": direct, "ours_auto": auto,
                                             "auto_is": ctx.comm.chosen_algorithm("allreduce", 4 * n,
                                                                                  compression=codec).algorithm}
    assert direct <= 2.0 ** -23, direct                 # float32's rounding of the sum, nothing else
    unit = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}[codec]
    assert auto <= unit + 2.0 ** -22, auto              # one encoding of the result
    assert theirs >= 4 * auto and theirs >= 1000 * direct, (theirs, auto, direct)


def error_feedback(ctx):
    """int8 with error feedback, the same gradient every step: the residual
    is exactly what the codec lost of (gradient + last residual); every
    result is the reference's bits; the sum of K results stays within the
    ranks' residuals of K x the mean, where without feedback the error grows."""
    codec, sizes, steps = "int8", [4096], 12
    hook = compression_hook(codec, error_feedback=True)
    assert hook.algorithm == "direct"
    plain_hook = compression_hook(codec, algorithm="direct")
    model = ddp(sizes, ctx.comm, hook, bucket_cap_mb=25)
    plain = ddp(sizes, ctx.comm, plain_hook, bucket_cap_mb=25)
    everyone = [gradients(r, 0, sizes)[0] for r in range(ctx.size)]
    mean = np.mean(np.stack(everyone).astype(np.float64), axis=0)
    residuals = [np.zeros_like(g) for g in everyone]
    total, plain_total = np.zeros(sizes[0]), np.zeros(sizes[0])
    for step in range(steps):
        (got,) = backward(model, [everyone[ctx.rank]])
        (plain_got,) = backward(plain, [everyone[ctx.rank]])
        contributions = [g + r for g, r in zip(everyone, residuals)]
        want = direct_average(codec, contributions)
        residuals = [c - ref.round_trip(codec, c) for c in contributions]
        assert same_bits(got, want), f"step {step}"
        assert same_bits(hook.residual(0), residuals[ctx.rank]), f"residual, step {step}"
        total += got
        plain_total += plain_got
    assert plain_hook.residual(0) is None
    error = np.abs(total - steps * mean).max()
    plain_error = np.abs(plain_total - steps * mean).max()
    kept = sum(np.abs(r).astype(np.float64) for r in residuals) / ctx.size
    # float32's rounding of K sums of n terms, on top of what the residuals hold back
    slack = steps * (ctx.size + 2) * 2.0 ** -24 * np.abs(np.stack(everyone)).sum(axis=0).max()
    assert (np.abs(total - steps * mean) <= kept + slack).all()
    ctx.measured["error_feedback"] = {"steps": steps, "with": float(error), "without": float(plain_error)}
    assert plain_error > 4 * error, (plain_error, error)


class Group:
    """Stands for our torch.distributed process group: what the hook asks of it."""

    def __init__(self, comm):
        self.comm, self.asked = comm, []

    def communicator(self, device):
        self.asked.append(str(device))
        return self.comm


def state_forms(ctx):
    """Where the communicator comes from: the argument, the state (a
    Communicator, or an object with .communicator(device)), else
    collectives.init(); a Gloo group as state with communicator=."""
    sizes = [256, 64]
    group = Group(ctx.comm)
    forms = [(ctx.comm, compression_hook("bf16", algorithm="direct")),
             (group, compression_hook("bf16", algorithm="direct")),
             (None, compression_hook("bf16", algorithm="direct")),
             (dist.group.WORLD, compression_hook("bf16", communicator=ctx.comm, algorithm="direct"))]
    for state, hook in forms:
        model = ddp(sizes, state, hook)
        got = backward(model, gradients(ctx.rank, 0, sizes))
        everyone = [gradients(r, 0, sizes) for r in range(ctx.size)]
        for i, g in enumerate(got):
            assert same_bits(g, direct_average("bf16", [e[i] for e in everyone])), (type(state).__name__, i)
    assert group.asked and set(group.asked) == {"cpu"}, group.asked
    assert list(forms[2][1]._made) == ["cpu"] and forms[2][1]._made["cpu"] is not ctx.comm   # made by init()


class Bucket:
    def __init__(self, tensor, index=0):
        self.tensor, self.i = tensor, index

    def buffer(self):
        return self.tensor

    def index(self):
        return self.i


def refusals(ctx):
    """A bucket we cannot compress, or a process group of another size: a
    typed error naming it, on every rank, and through DDP's backward."""
    hook = compression_hook("fp16", communicator=ctx.comm)
    for dtype in (torch.float64, torch.float16, torch.bfloat16):
        tensor = torch.ones(64, dtype=dtype)
        try:
            hook(None, Bucket(tensor))
        except InvalidUsageError as error:
            assert str(dtype) in str(error) and "float32" in str(error), error
        else:
            raise AssertionError(f"{dtype} bucket accepted")
        assert (tensor == 1).all()
    pair = dist.new_group([0, 1])
    if ctx.rank in (0, 1) and ctx.size > 2:
        try:
            hook(pair, Bucket(torch.ones(64)))
        except InvalidUsageError as error:
            assert "2 ranks" in str(error), error
        else:
            raise AssertionError("a group of 2 ranks accepted with a communicator of more")
    model = ddp([64], ctx.comm, compression_hook("int8"), dtype=torch.float64)
    try:
        model([torch.ones(64, dtype=torch.float64)]).backward()
    except Exception as error:   # noqa: BLE001 - DDP may wrap it
        assert "torch.float64" in str(error) and "float32" in str(error), error
    else:
        raise AssertionError("DDP's backward accepted a float64 bucket")


def main():
    out = Path(sys.argv[1])
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    comm = collectives.init()
    assert (comm.rank, comm.size) == (rank, size)

    class Context:
        pass
    ctx = Context()
    ctx.rank, ctx.size, ctx.comm, ctx.measured = rank, size, comm, {}
    scenarios = [(f"exact_{c}", lambda c=c: exact(ctx, c)) for c in CODECS]
    scenarios += [(f"auto_{c}", lambda c=c: auto(ctx, c)) for c in CODECS]
    scenarios += [(f"versus_torch_{c}", lambda c=c: versus_torch(ctx, c)) for c in ("fp16", "bf16")]
    scenarios += [("error_feedback", lambda: error_feedback(ctx)), ("state_forms", lambda: state_forms(ctx)),
                  ("refusals", lambda: refusals(ctx))]
    results = {}
    for name, run in scenarios:
        try:
            run()
            results[name] = "ok"
        except Exception:   # noqa: BLE001 - reported per scenario
            results[name] = traceback.format_exc()
    (out / f"rank{rank}.json").write_text(json.dumps({"results": results, "measured": ctx.measured}))
    comm.close()
    dist.barrier()
    dist.destroy_process_group()
    # Out without the interpreter's finalization: a Gloo worker thread that
    # lets go of a tensor of the last collectives then needs the GIL, and
    # aborts the process (torch 2.13; docs/noticed.md). The examples wait for
    # their last tensors instead (examples/digits_task.py, let_go); here the
    # scenarios' tensors are many and the verdicts are already written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
