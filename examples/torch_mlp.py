"""Data-parallel training with PyTorch and collectives.torch: 4 processes, CPU tensors.

    pip install -e '.[mpi,torch]' scikit-learn
    mpiexec -n 4 python examples/torch_mlp.py
    mpiexec -n 4 python examples/torch_mlp.py --compression int8 --error-feedback
    mpiexec -n 4 python examples/torch_mlp.py --measure     # time per step, with and without overlap

The same model and data as numpy_mlp.py (a 64-32-10 MLP on scikit-learn's
digits), with the three steps of synchronous SGD done by
`collectives.torch.DistributedOptimizer`:

  1. compute: `loss.backward()` on this rank's share of the global batch;
  2. communicate: while backward runs, a hook hands each gradient to a
     fusion buffer as soon as it exists, and full buffers are averaged over
     the ranks in the background; `optimizer.step()` waits for the rest;
  3. update: the wrapped optimizer (SGD) updates every rank's copy alike.

`--measure` times training steps of a larger MLP (64-1024-1024-1024-10,
2.2 M parameters) three ways, alternating: the hooks with fusion buffers
(communication overlaps backward), one fused allreduce_many after backward,
and one allreduce per gradient after backward; and, as the floor, steps
that skip the communication. It prints the slowest rank's median step time
and the share of the step spent waiting for communication (after
backward: in the allreduces; with the hooks: in step()'s wait).
"""

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

import collectives
from collectives.torch import DistributedOptimizer, broadcast_parameters

from digits_task import digits, mlp


def train(comm, args):
    rank, size = comm.rank, comm.size
    assert args.batch % size == 0, "the global batch must split evenly over the ranks"
    local = args.batch // size
    x_train, y_train, x_test, y_test = digits()

    torch.manual_seed(rank)                       # different on purpose: the broadcast makes them equal
    model = mlp((64, 32, 10))
    broadcast_parameters(model, comm, root=0)     # start: every rank takes rank 0's parameters
    optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr), comm,
                                     compression=args.compression, error_feedback=args.error_feedback)

    for epoch in range(args.epochs):
        order = torch.from_numpy(np.random.default_rng(epoch).permutation(len(y_train)))   # the same on every rank
        for start in range(0, len(order) - args.batch + 1, args.batch):
            mine = order[start:start + args.batch][rank * local:(rank + 1) * local]          # this rank's share
            optimizer.zero_grad()
            F.cross_entropy(model(x_train[mine]), y_train[mine]).backward()   # 1. compute (2. starts in the hooks)
            optimizer.step()                                                  # 2. wait for the averages, 3. update
        if rank == 0 and ((epoch + 1) % 5 == 0 or epoch + 1 == args.epochs):
            with torch.no_grad():
                accuracy = (model(x_test).argmax(dim=1) == y_test).float().mean().item()
            print(f"epoch {epoch + 1:3d}  test accuracy {accuracy:.4f}", flush=True)

    # The copies never diverged: every rank holds the same bits.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    gathered = comm.allgather(flat).reshape(size, -1)
    same = all(np.array_equal(gathered[0].view(np.uint32), g.view(np.uint32)) for g in gathered)
    if rank == 0:
        print(f"parameters bitwise identical on all {size} ranks: {same}", flush=True)


# -- --measure: where a step's time goes ---------------------------------------------------------


def measure(comm, args):
    rank, size = comm.rank, comm.size
    x_train, y_train, _, _ = digits()
    sizes = (64, *[args.hidden] * args.layers, 10)
    modes = {
        "overlap: hooks + fusion buffers": "hooks",
        "after backward: one allreduce_many": "fused",
        "after backward: allreduce per gradient": "plain",
        "no communication (compute alone, ranks diverge)": "alone",
    }
    runs = {}
    for mode in modes.values():
        torch.manual_seed(0)
        model = mlp(sizes)
        sgd = torch.optim.SGD(model.parameters(), lr=0.01)
        optimizer = DistributedOptimizer(sgd, comm, fusion_threshold=args.fusion_threshold) if mode == "hooks" else sgd
        runs[mode] = (model, optimizer, [])
    nparams = sum(p.numel() for p in runs["plain"][0].parameters())
    rng = np.random.default_rng(rank)

    def step(mode, record):
        model, optimizer, times = runs[mode]
        mine = torch.from_numpy(rng.integers(0, len(y_train), args.local_batch))
        start = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(x_train[mine]), y_train[mine]).backward()
        backward_done = time.perf_counter()
        if mode == "hooks":
            optimizer.synchronize()               # wait for what backward started
        elif mode == "fused":
            comm.allreduce_many([p.grad.numpy() for p in model.parameters()], op="avg",
                                fusion_threshold=args.fusion_threshold)
        elif mode == "plain":
            for p in model.parameters():
                comm.allreduce(p.grad.numpy(), op="avg")
        communicated = time.perf_counter()
        optimizer.step()
        if record:
            times.append((time.perf_counter() - start, communicated - backward_done))

    # Modes alternate in short rounds, so the machine's noise hits all alike.
    for round_ in range(args.rounds + 1):
        for mode in modes.values():
            for _ in range(args.steps):
                step(mode, record=round_ > 0)     # round 0 warms up

    summary = []
    for mode in modes.values():
        times = np.array(runs[mode][2])
        summary += [np.median(times[:, 0]), times[:, 1].sum() / times[:, 0].sum()]
    everyone = comm.allgather(np.array(summary)).reshape(size, len(modes), 2)
    if rank == 0:
        print(f"{size} processes, MLP {'-'.join(map(str, sizes))} ({nparams / 1e6:.2f} M parameters, "
              f"{4 * nparams / 2**20:.1f} MiB of gradients), {args.local_batch} samples per rank, "
              f"fusion threshold {args.fusion_threshold / 2**20:g} MiB, "
              f"{args.rounds} rounds x {args.steps} steps per mode", flush=True)
        print("| mode | step time (ms, median, slowest rank) | waiting for communication (share of step) |")
        print("|---|---:|---:|")
        for name, (step_time, share) in zip(modes, zip(everyone[:, :, 0].max(axis=0), everyone[:, :, 1].mean(axis=0))):
            print(f"| {name} | {1e3 * step_time:.1f} | {100 * share:.0f}% |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64, help="global batch size (a multiple of the process count)")
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--compression", choices=["bf16", "fp16", "int8"], default=None)
    parser.add_argument("--error-feedback", action="store_true", help="with --compression")
    parser.add_argument("--measure", action="store_true", help="time steps with and without overlap instead")
    parser.add_argument("--hidden", type=int, default=1024, help="--measure: hidden layer width")
    parser.add_argument("--layers", type=int, default=3, help="--measure: hidden layers")
    parser.add_argument("--local-batch", type=int, default=32, help="--measure: samples per rank and step")
    parser.add_argument("--fusion-threshold", type=int, default=1 << 20, help="--measure: bytes per fusion buffer")
    parser.add_argument("--steps", type=int, default=5, help="--measure: steps per mode and round")
    parser.add_argument("--rounds", type=int, default=6, help="--measure: rounds, after one to warm up")
    args = parser.parse_args()

    torch.set_num_threads(1)    # one core per process: the ranks share the machine's cores
    comm = collectives.init(timeout=60)
    try:
        measure(comm, args) if args.measure else train(comm, args)
    finally:
        comm.close()


if __name__ == "__main__":
    main()
