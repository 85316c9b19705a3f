"""One rank of tests/test_recovery.py's training runs under collectives.elastic.

    mpiexec -disable-auto-cleanup -n N sh -c 'trap "" USR1; python tests/elastic_worker.py KIND SEED; exit $?'

Full-batch gradient descent on a fixed least-squares problem, the batch
sharded over the communicator's ranks (resharded by its size after each
shrink), every step committed. The sum of the shards' gradients is the
whole batch's whatever the number of ranks, so the run must end on the
weights of one process doing the same steps (to rounding), however many
ranks it lost and when. Rank VICTIM dies by SIGKILL at the start of a step
drawn from SEED. KIND: "numpy" (ArrayState) or "torch" (TorchState with a
DistributedOptimizer summing the gradients), or "torch_group": the same
steps on torch.distributed's default group of our backend (made from a
FileStore at STORE, a third argument), which a failed all_reduce shrinks
(collectives.torch.shrink_default_group) before the step is taken again.
"""

import os
import signal
import sys

from rare_collections import collect_rarely

collect_rarely()   # before PyTorch and TensorFlow load: rare_collections.py says why

import numpy as np

import collectives
from cases import run_scenario
from collectives import elastic

STEPS, LEARNING_RATE, VICTIM = 40, 0.5, 1


def problem():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((96, 6))
    y = x @ rng.standard_normal(6) + 0.1 * rng.standard_normal(96)
    return x, y


def one_process(x, y):
    w = np.zeros(x.shape[1])
    for _ in range(STEPS):
        w -= LEARNING_RATE * x.T @ (x @ w - y) / len(x)
    return w


def shard(state, n):
    size, rank = state.comm.size, state.comm.rank
    return slice(rank * n // size, (rank + 1) * n // size)


def numpy_run(comm, x, y, kill_step, original):
    state = elastic.ArrayState(comm, w=np.zeros(x.shape[1]), step=0)

    def train(state):
        while state.step < STEPS:
            if original == VICTIM and state.step == kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            part = shard(state, len(x))
            g = x[part].T @ (x[part] @ state.w - y[part])
            g = state.comm.allreduce(g, op="sum") / len(x)
            state.w -= LEARNING_RATE * g
            state.step += 1
            state.commit()
        return state.w

    return state, train


def torch_run(comm, x, y, kill_step, original):
    import torch

    from collectives.torch import DistributedOptimizer
    torch.manual_seed(0)
    model = torch.nn.Linear(x.shape[1], 1, bias=False, dtype=torch.float64)
    with torch.no_grad():
        model.weight.zero_()
    optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LEARNING_RATE), comm, op="sum")
    state = elastic.TorchState(comm, model, optimizer, step=0)
    xs, ys = torch.from_numpy(x), torch.from_numpy(y)

    def train(state):
        while state.step < STEPS:
            if original == VICTIM and state.step == kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            part = shard(state, len(x))
            optimizer.zero_grad()
            loss = ((model(xs[part]).squeeze(1) - ys[part]) ** 2).sum() / (2 * len(x))
            loss.backward()
            optimizer.step()
            state.step += 1
            state.commit()
        return model.weight.detach().numpy().reshape(-1).copy()

    return state, train


def torch_group_run(x, y, kill_step, store_path):
    """The steps on torch.distributed's default group; a failed step shrinks
    it and is taken again (the weights are only changed after the all_reduce)."""
    import datetime

    import torch
    import torch.distributed as dist

    import collectives.torch
    env = os.environ   # (hydra's variables, or Open MPI's)
    rank = int(env.get("PMI_RANK", env.get("OMPI_COMM_WORLD_RANK", -1)))
    size = int(env.get("PMI_SIZE", env.get("OMPI_COMM_WORLD_SIZE", -1)))
    dist.init_process_group("collectives", store=dist.FileStore(store_path, size), rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=10))
    xs, ys = torch.from_numpy(x), torch.from_numpy(y)
    w, step, shrinks = torch.zeros(x.shape[1], dtype=torch.float64), 0, []
    while step < STEPS:
        if rank == VICTIM and step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        n, r = dist.get_world_size(), dist.get_rank()
        part = slice(r * len(x) // n, (r + 1) * len(x) // n)
        g = xs[part].T @ (xs[part] @ w - ys[part])
        try:
            dist.all_reduce(g)
        except collectives.CollectiveTimeoutError:   # RankFailedError too
            shrinks.append(collectives.torch.shrink_default_group())
            continue
        w -= LEARNING_RATE * g / len(x)
        step += 1
    assert shrinks == [tuple(q for q in range(size) if q != VICTIM)], shrinks
    assert dist.get_world_size() == size - 1 and dist.get_rank() == shrinks[0].index(rank)
    assert np.allclose(w.numpy(), one_process(x, y), rtol=1e-9, atol=1e-12), (w, one_process(x, y))
    print(f"KILLED at step {kill_step}, rank {rank} is rank {dist.get_rank()} of {dist.get_world_size()}", flush=True)
    dist.destroy_process_group()
    return rank


def main():
    kind, seed = sys.argv[1], int(sys.argv[2])
    if kind == "torch_group":   # no communicator of ours but the group's
        kill_step = int(np.random.default_rng(seed).integers(2, STEPS - 2))
        holder = {}
        run_scenario(lambda: holder.setdefault("rank", torch_group_run(*problem(), kill_step, sys.argv[3])),
                     ranks_leave=True)
        print(f"OK {kind} {holder['rank']}", flush=True)
        os._exit(0)
    comm = collectives.init(timeout=10.0)
    original = comm.rank
    kill_step = int(np.random.default_rng(seed).integers(2, STEPS - 2))
    x, y = problem()

    def scenario():
        state, train = (numpy_run if kind == "numpy" else torch_run)(comm, x, y, kill_step, original)
        sizes = []
        state.on_reset(lambda s: sizes.append(s.comm.size))
        w = elastic.run(train, state)
        assert sizes == [comm.size - 1], sizes
        assert state.step == STEPS and state.comm.epoch == 1
        assert np.allclose(w, one_process(x, y), rtol=1e-9, atol=1e-12), (w, one_process(x, y))
        print(f"KILLED at step {kill_step}, {state.commits} commits, rank {original}", flush=True)
        state.comm.close()

    run_scenario(scenario, ranks_leave=True)
    print(f"OK {kind} {original}", flush=True)
    # and leave as any program does: MPI_Finalize must not wait for the dead rank (bootstrap.NO_COLLECTIVE_FINALIZE)


if __name__ == "__main__":
    main()
