"""Data-parallel training with collectives.torch.

In this process, on a one-rank communicator: the optimizer wrapper's
plumbing (every gradient goes through the fusion buffer and comes back, in
any layout), its rules and errors, and broadcast_parameters' packing.

Under mpiexec (marked `mpi`; tests/training_worker.py is one rank): 4
processes train an MLP for 50 steps and (a) hold bitwise-identical
parameters, (b) equal one process training on the same global batches
within float32 rounding; (c) with each codec, with and without error
feedback, a longer run on scikit-learn's digits ends within 1 point of the
uncompressed run's test accuracy; (d) a rank that dies mid-training makes
the others raise within the timeout: one launch, which the three tests read. And both examples run.
"""

import importlib.util
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from installed import require
import mpi_launch

torch = pytest.importorskip("torch", reason="the training tests need PyTorch: pip install '.[test]' (or '.[torch]')")

import collectives  # noqa: E402
from collectives import InvalidUsageError  # noqa: E402
from collectives.torch import DistributedOptimizer, broadcast_parameters, host_array  # noqa: E402

WORKER = Path(__file__).with_name("training_worker.py")
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NEEDS_SKLEARN = "the digits data set comes with scikit-learn: pip install scikit-learn"


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def batches(n=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(10, 8, generator=g), torch.randint(0, 4, (10,), generator=g)) for _ in range(n)]


def train(model, optimizer, data, passes=1):
    for x, y in data:
        optimizer.zero_grad()
        for _ in range(passes):
            torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# -- in this process, one rank ------------------------------------------------------------


@pytest.mark.parametrize("threshold", [64, 1 << 20])
def test_one_rank_trains_exactly_as_the_plain_optimizer(threshold):
    """avg over one rank is the identity: every gradient must go through the
    fusion buffer (one array per buffer, or all in one) and come back intact."""
    with collectives.Communicator.local(1) as comm:
        model = mlp()
        optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), comm,
                                         fusion_threshold=threshold)
        got = train(model, optimizer, batches())
    reference = mlp()
    want = train(reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), batches())
    assert torch.equal(got, want)


def test_gradients_in_any_layout_and_accumulated_passes():
    """A transposed (non-contiguous) parameter's gradient is reduced in a
    copy and copied back; backward_passes_per_step accumulates locally."""
    def make():
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(4, 8).t())   # strides (1, 8): its gradient has them too
        b = torch.nn.Parameter(torch.zeros(4))
        assert not w.is_contiguous()
        return w, b

    data = batches()

    def run(optimizer_for):
        w, b = make()
        optimizer = optimizer_for([w, b])
        for x, y in data:
            optimizer.zero_grad()
            for _ in range(2):
                torch.nn.functional.cross_entropy(x @ w + b, y).backward()
            optimizer.step()
        return w.detach().clone(), b.detach().clone()

    with collectives.Communicator.local(1) as comm:
        got = run(lambda ps: DistributedOptimizer(torch.optim.SGD(ps, lr=0.1), comm, fusion_threshold=64,
                                                  backward_passes_per_step=2))
    want = run(lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_it_is_an_optimizer_sharing_the_wrapped_ones_state():
    with collectives.Communicator.local(1) as comm:
        model = mlp()
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        optimizer = DistributedOptimizer(sgd, comm)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)   # refuses non-Optimizers
        train(model, optimizer, batches(2))
        scheduler.step()
        assert sgd.param_groups[0]["lr"] == 0.05 and optimizer.param_groups is sgd.param_groups
        assert optimizer.state is sgd.state and len(optimizer.state) == 4
        saved = optimizer.state_dict()
        optimizer.load_state_dict(saved)
        assert optimizer.state_dict()["param_groups"] == saved["param_groups"]
        sgd.custom = 7
        assert optimizer.custom == 7                # other attributes are the wrapped optimizer's
        assert "SGD" in repr(optimizer) and "size=1" in repr(optimizer)


def test_rules_are_enforced_with_a_message():
    with collectives.Communicator.local(1) as comm:
        model = mlp()
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(InvalidUsageError, match="torch.optim.Optimizer"):
            DistributedOptimizer(object(), comm)
        with pytest.raises(InvalidUsageError, match="needs a compression"):
            DistributedOptimizer(sgd, comm, error_feedback=True)
        with pytest.raises(InvalidUsageError, match="backward_passes_per_step"):
            DistributedOptimizer(sgd, comm, backward_passes_per_step=0)
        with pytest.raises(InvalidUsageError, match="float32"):
            DistributedOptimizer(torch.optim.SGD(mlp().double().parameters(), lr=0.1), comm, compression="bf16")
        optimizer = DistributedOptimizer(sgd, comm)
        with pytest.raises(InvalidUsageError, match="already"):
            DistributedOptimizer(optimizer, comm)
        (x, y), = batches(1)
        loss = lambda: torch.nn.functional.cross_entropy(model(x), y)  # noqa: E731
        loss().backward()
        with pytest.raises(InvalidUsageError, match="computed 2 times"):
            loss().backward()
        optimizer.zero_grad()                       # waits for what was in flight, starts afresh
        loss().backward()
        optimizer.synchronize()
        with pytest.raises(InvalidUsageError, match="after synchronize"):
            loss().backward()
        optimizer.zero_grad()
        optimizer.remove_hooks()                    # now another wrapper may take the parameters
        again = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm)
        loss().backward()
        again.step()
    with collectives.Communicator.local(2) as two:
        with pytest.raises(InvalidUsageError, match="one rank in this process"):
            DistributedOptimizer(torch.optim.SGD(mlp().parameters(), lr=0.1), two)


def test_broadcast_parameters_packs_every_dtype_and_size_and_unpacks_them_intact():
    """One rank: the broadcast is the identity, so what comes back checks the
    byte packing (odd sizes, 16-byte boundaries, bf16, bool, int64, 0-d)."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.BatchNorm1d(5))   # int64 num_batches_tracked
    tensors = [torch.randn(7, dtype=torch.bfloat16), torch.tensor([True, False, True]), torch.tensor(3.5),
               torch.arange(5, dtype=torch.int16)[::2], torch.randn(2, 3, dtype=torch.float64)]
    before = [t.clone() for t in [*model.state_dict().values(), *tensors]]
    with collectives.Communicator.local(1) as comm:
        broadcast_parameters(model, comm)
        broadcast_parameters(tensors, comm)
        broadcast_parameters({"a": tensors[0]}, comm, root=0)
        with pytest.raises(InvalidUsageError, match="tensors"):
            broadcast_parameters([np.ones(3)], comm)
    after = [*model.state_dict().values(), *tensors]
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(before, after))


def test_host_array_shares_the_tensors_memory():
    t = torch.zeros(4, dtype=torch.bfloat16)
    a = host_array(t)
    a[1] = 2.5
    assert str(a.dtype) == "bfloat16" and t[1].item() == 2.5


# -- across processes ---------------------------------------------------------------------


def mpiexec():
    pytest.importorskip("mpi4py", reason="the multi-process tests need mpi4py: pip install '.[test]'")
    return mpi_launch.mpiexec()


def run(n, command, *launcher_flags, limit=120):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(WORKER.parent), os.environ.get("PYTHONPATH", "")]))
    env.pop("COLLECTIVES_TIMEOUT", None)
    done = mpi_launch.run_launch([*mpi_launch.mpi_launch(n, *launcher_flags), *command], limit, env)
    report = f"exit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    assert done.returncode == 0, report
    return done.stdout, report


def test_the_examples_read_the_digits_as_scikit_learn_loads_them():
    """digits_data.py reads scikit-learn's table itself (importing scikit-learn
    costs every process about 1.7 CPU-s); it must give load_digits' arrays."""
    datasets = pytest.importorskip("sklearn.datasets", reason=NEEDS_SKLEARN)
    spec = importlib.util.spec_from_file_location("digits_data", EXAMPLES / "digits_data.py")
    digits_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(digits_data)
    pixels, labels = digits_data.load_digits()
    expected = datasets.load_digits()
    np.testing.assert_array_equal(pixels, expected.data)
    np.testing.assert_array_equal(labels, expected.target)
    assert pixels.shape == (1797, 64) and labels.dtype == np.int64 and set(labels) == set(range(10))
    x_train, y_train, x_test, y_test = digits_data.digits()
    assert (x_train.shape, x_test.shape, y_train.shape, y_test.shape) == ((1197, 64), (600, 64), (1197,), (600,))
    assert x_train.dtype == np.float32 and 0 <= x_train.min() and x_train.max() == 1


# The scenarios on 4 processes run in one launch (tests/training_worker.py
# says why), killed last; each test reads its own part of it. (compression
# trains on the digits, which need scikit-learn: its test skips without.)
def scenarios_on_four():
    if importlib.util.find_spec("sklearn") is None:
        return ("sync", "killed")
    return ("sync", "compression", "killed")


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """(stdout and stderr, the OK lines' {scenario: ranks}, the folder of
    what rank 0 measured) of the one launch of the scenarios."""
    mpiexec()
    folder = tmp_path_factory.mktemp("training")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(WORKER.parent), os.environ.get("PYTHONPATH", "")]))
    env.pop("COLLECTIVES_TIMEOUT", None)
    # Hydra would otherwise kill the survivors itself when the killed scenario's rank exits.
    done = mpi_launch.run_launch([*mpi_launch.mpi_launch(4, "-disable-auto-cleanup"), str(WORKER),
                                  ",".join(scenarios_on_four()), str(folder)], 240, env)
    report = f"exit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    oks = {}
    for scenario, rank in re.findall(r"OK (\w+) (\d+)", done.stdout):   # ranks' lines can arrive glued together
        oks.setdefault(scenario, set()).add(int(rank))
    return report, oks, folder


@pytest.mark.slow
@pytest.mark.mpi
def test_four_ranks_stay_bitwise_identical_and_match_one_process(four_ranks):
    report, oks, folder = four_ranks
    assert oks.get("sync") == {0, 1, 2, 3}, report
    measured = json.loads((folder / "sync.json").read_text())
    assert measured["difference"] <= measured["tolerance"], measured


@pytest.mark.slow
@pytest.mark.mpi
def test_compressed_training_ends_within_one_point_of_uncompressed(four_ranks):
    require("sklearn", reason=NEEDS_SKLEARN)
    report, oks, folder = four_ranks
    assert oks.get("compression") == {0, 1, 2, 3}, report
    results = json.loads((folder / "compression.json").read_text())
    baseline = results[0]
    assert baseline["compression"] is None and baseline["accuracy"] > 0.9, baseline
    print("\n| compression | error feedback | steps | test accuracy | against none (points) | test loss "
          "| parameters' distance from none's (relative L2) |\n|---|---|---:|---:|---:|---:|---:|")
    for r in results:
        points = 100 * (r["accuracy"] - baseline["accuracy"])
        print(f"| {r['compression'] or 'none'} | {'yes' if r['error_feedback'] else 'no'} | {r['steps']} | "
              f"{100 * r['accuracy']:.2f}% | {points:+.2f} | {r['test_loss']:.4f} | "
              f"{r['parameter_difference']:.2g} |")
    for r in results[1:]:
        assert abs(r["accuracy"] - baseline["accuracy"]) <= 0.01, (r, baseline)
        assert r["parameter_difference"] > 0, f"{r['compression']} changed nothing: was it applied?"


@pytest.mark.slow
@pytest.mark.mpi
def test_a_rank_that_dies_mid_training_makes_the_others_raise(four_ranks):
    report, oks, _ = four_ranks
    assert oks.get("killed") == {0, 2, 3}, report
    # The launch's status: every survivor exited 0, and hydra reports the rank that left by os._exit(0) as 0 too.
    assert "exit 0" in report.splitlines()[0], report


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("example, n, flags", [
    ("numpy_mlp.py", 4, ["--epochs", "2"]),
    ("torch_mlp.py", 4, ["--epochs", "2"]),
    ("torch_mlp.py", 2, ["--measure", "--hidden", "64", "--layers", "2", "--rounds", "1", "--steps", "2"]),
])
def test_the_examples_run(example, n, flags):
    require("sklearn", reason=NEEDS_SKLEARN)
    stdout, report = run(n, [str(EXAMPLES / example), *flags])
    if "--measure" in flags:
        assert stdout.count("| overlap") == 1 and stdout.count("| after backward") == 2, report
        assert stdout.count("| no communication") == 1, report
    else:
        assert re.search(r"epoch +2 +test accuracy 0\.\d+", stdout), report
        assert f"parameters bitwise identical on all {n} ranks: True" in stdout, report
