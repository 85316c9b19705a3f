"""One rank of a data-parallel training test; tests/test_training.py starts N of these under mpiexec.

    mpiexec -n N python tests/training_worker.py SCENARIO[,SCENARIO...] [OUTPUT_FOLDER]

Each rank trains a small MLP with collectives.torch.DistributedOptimizer on
host ranks, runs the scenarios in turn on one communicator, prints "OK
<scenario> <rank>" after each one whose every check held, and fails with a
traceback (non-zero exit) otherwise. Rank 0 writes what a scenario measured
to OUTPUT_FOLDER/<scenario>.json when a folder is named. (One launch for
several scenarios: each rank's start, PyTorch's import above all, costs
about 2.5 CPU-s.) `killed` ends the ranks, so it comes last.
"""

import json
import os
import sys
import time
from pathlib import Path

from rare_collections import collect_rarely

collect_rarely()   # before PyTorch and TensorFlow load: rare_collections.py says why

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI

import collectives
import collectives.compression
from collectives import CollectiveError, RankFailedError
from collectives.torch import DistributedOptimizer, broadcast_parameters

TIMEOUT = 10.0
EPS32 = float(np.finfo(np.float32).eps)


def mlp(seed, sizes=(64, 32, 10)):
    torch.manual_seed(seed)
    layers = []
    for fan_in, fan_out in zip(sizes, sizes[1:]):
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def synthetic(samples=4096, seed=0):
    """Ten classes a random linear teacher assigns to Gaussian points: no data set package needed."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, 64)).astype(np.float32)
    y = (x @ rng.standard_normal((64, 10)).astype(np.float32)).argmax(axis=1)
    return torch.from_numpy(x), torch.from_numpy(y)


def digits():
    """scikit-learn's handwritten digits as tensors: 1197 training and 600 test images, as the examples split them."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from digits_data import digits as split_digits
    return tuple(torch.from_numpy(array) for array in split_digits())


def global_batches(nsamples, batch, steps):
    """The same sequence of global batches (sample indices) on every rank: epochs of fixed permutations."""
    out, epoch = [], 0
    while len(out) < steps:
        order = torch.from_numpy(np.random.default_rng(epoch).permutation(nsamples))
        out += [order[s:s + batch] for s in range(0, nsamples - batch + 1, batch)]
        epoch += 1
    return out[:steps]


def flat_parameters(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


def all_ranks_identical(model):
    """Whether every rank's parameters have the same bits as rank 0's (compared through MPI, not us)."""
    everyone = MPI.COMM_WORLD.allgather(flat_parameters(model).tobytes())
    return all(b == everyone[0] for b in everyone)


def train(comm, model, x, y, batches, lr, **options):
    optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr), comm, **options)
    local = len(batches[0]) // comm.size
    for batch in batches:
        mine = batch[comm.rank * local:(comm.rank + 1) * local]
        optimizer.zero_grad()
        F.cross_entropy(model(x[mine]), y[mine]).backward()
        optimizer.step()
    optimizer.remove_hooks()
    return model


def scenario_sync(comm, output):
    """(a) after 50 steps every rank's parameters are bitwise identical; (b)
    they equal one process's training on the same global batches, within
    float32 rounding."""
    steps, batch, lr = 50, 64, 0.1
    x, y = synthetic()
    batches = global_batches(len(y), batch, steps)
    model = mlp(seed=comm.rank)                   # different on every rank until the broadcast
    broadcast_parameters(model, comm, root=0)
    # A small fusion threshold: several fused allreduces per step, started from the hooks during backward.
    train(comm, model, x, y, batches, lr, fusion_threshold=4096)
    assert all_ranks_identical(model), "ranks' parameters differ after training"

    # One process, the global batch at once: the mean over 64 samples, as
    # the average of the ranks' means over 16 each is.
    reference = mlp(seed=0)                       # rank 0's initial parameters
    sgd = torch.optim.SGD(reference.parameters(), lr=lr)
    for b in batches:
        sgd.zero_grad()
        F.cross_entropy(reference(x[b]), y[b]).backward()
        sgd.step()
    got, want = flat_parameters(model), flat_parameters(reference)
    # Tolerance: both runs compute the mean gradient of the same 64 samples,
    # summed in a different order (one mean of 64, against the average of
    # four means of 16), which changes each gradient entry by a few float32
    # rounding errors of the gradient's size. lr * |g| is far below the
    # parameters' size, so a step changes the parameters' difference by less
    # than one rounding error of the largest parameter, eps * max|theta|;
    # over `steps` steps these add up at most linearly:
    #     tolerance = steps * eps * max|theta|   (50 eps; measured 1.6 eps).
    # Over 12 data seeds the difference stayed under 2.5 eps for 200 steps,
    # except where a ReLU input within rounding of zero flipped sign (once,
    # near step 200): past such a kink the runs take different paths, which
    # is why the comparison is at 50 steps.
    tolerance = steps * EPS32 * float(np.abs(want).max())
    difference = float(np.abs(got - want).max())
    assert difference <= tolerance, f"largest difference {difference:.3g} > tolerance {tolerance:.3g}"
    assert not np.array_equal(flat_parameters(mlp(seed=0)), got), "training did not move the parameters"
    if output and comm.rank == 0:
        with open(output, "w") as f:
            json.dump({"steps": steps, "difference": difference, "tolerance": tolerance,
                       "difference_in_eps": difference / EPS32 / float(np.abs(want).max())}, f)


# (compression, error feedback) of the accuracy comparison, the uncompressed run first.
CODECS = [(None, False), ("bf16", False), ("bf16", True), ("fp16", False), ("fp16", True),
          ("int8", False), ("int8", True)]


def scenario_compression(comm, output):
    """(c) the final test accuracy of a longer run on the digits, with each
    codec with and without error feedback, against the uncompressed run.
    Rank 0 writes the table; the test compares."""
    collectives.compression.warm_up()   # compiling the codecs may take longer than TIMEOUT
    comm.barrier()
    epochs, batch, lr = 10, 64, 0.2
    x_train, y_train, x_test, y_test = digits()
    batches = global_batches(len(y_train), batch, epochs * (len(y_train) // batch))
    results, uncompressed = [], None
    for codec, feedback in CODECS:
        start = time.perf_counter()
        model = mlp(seed=comm.rank)
        broadcast_parameters(model, comm, root=0)
        train(comm, model, x_train, y_train, batches, lr, compression=codec, error_feedback=feedback)
        assert all_ranks_identical(model), f"ranks' parameters differ after training with {codec}"
        with torch.no_grad():
            logits = model(x_test)
        parameters = flat_parameters(model)
        if uncompressed is None:
            uncompressed = parameters
        results.append({"compression": codec, "error_feedback": feedback, "steps": len(batches),
                        "accuracy": (logits.argmax(dim=1) == y_test).float().mean().item(),
                        "test_loss": F.cross_entropy(logits, y_test).item(),
                        "parameter_difference": float(np.linalg.norm(parameters - uncompressed) / np.linalg.norm(uncompressed)),
                        "seconds": time.perf_counter() - start})
    if output and comm.rank == 0:
        with open(output, "w") as f:
            json.dump(results, f)


def scenario_killed(comm, output):
    """(d) rank 1 dies in the middle of backward at step 20, with fused
    allreduces in flight: the others' step() raises within the timeout."""
    x, y = synthetic()
    batches = global_batches(len(y), 64, 50)
    model = mlp(seed=0)
    optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, fusion_threshold=1024)
    local = 64 // comm.size
    for step, batch in enumerate(batches):
        mine = batch[comm.rank * local:(comm.rank + 1) * local]
        if step == 20 and comm.rank == 1:
            # The first layer's weight is the last gradient backward makes:
            # the later layers' allreduces have started by then.
            model[0].weight.register_post_accumulate_grad_hook(lambda p: os._exit(0))
        start = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(x[mine]), y[mine]).backward()
        try:
            optimizer.step()
        except CollectiveError as error:
            elapsed = time.perf_counter() - start
            assert step == 20, f"step {step} raised: {error}"
            assert isinstance(error, RankFailedError) or "died" in str(error) or "aborted" in str(error), error
            assert elapsed < TIMEOUT, f"took {elapsed:.1f}s to notice, with a {TIMEOUT}s timeout"
            print(f"rank {comm.rank} raised {type(error).__name__} {elapsed:.3f}s into step {step}", flush=True)
            break
    else:
        raise AssertionError("training went on without rank 1")
    start = time.perf_counter()
    comm.close()
    assert time.perf_counter() - start < TIMEOUT / 2, "close() after a dead rank should be quick"


def main():
    scenarios = sys.argv[1].split(",")
    folder = sys.argv[2] if len(sys.argv) > 2 else None
    assert "killed" not in scenarios[:-1], "the killed scenario ends the ranks: it comes last"
    torch.set_num_threads(1)    # several ranks share the machine's cores
    comm = collectives.init(timeout=TIMEOUT)
    assert comm.size == MPI.COMM_WORLD.size and comm.rank == MPI.COMM_WORLD.rank
    for scenario in scenarios:
        globals()[f"scenario_{scenario}"](comm, folder and os.path.join(folder, f"{scenario}.json"))
        print(f"OK {scenario} {comm.rank}", flush=True)
    if scenarios[-1] == "killed":
        os._exit(0)  # MPI_Finalize would wait for the dead rank
    comm.close()


if __name__ == "__main__":
    main()
