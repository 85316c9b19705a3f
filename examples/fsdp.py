"""Sharded data-parallel training with PyTorch's FSDP2 (`fully_shard`), started by torchrun.

    pip install -e '.[torch]' scikit-learn
    torchrun --standalone --nproc-per-node 4 examples/fsdp.py                          # Gloo
    torchrun --standalone --nproc-per-node 4 examples/fsdp.py --backend collectives    # our process group
    torchrun --standalone --nproc-per-node 4 examples/fsdp.py --backend nccl           # GPUs: one per process

ddp.py's model, data and schedule, with each Linear layer and then the
whole model wrapped by `torch.distributed.fsdp.fully_shard`: every rank
keeps a quarter of each parameter (and of its gradient and optimizer
state), gathers a layer's parameters just before using it (allgather), and
leaves backward with its shard of the averaged gradient (reduce_scatter).
The same script runs on Gloo, on NCCL, or on our library as a
torch.distributed backend (`--backend collectives`: `import
collectives.torch` registers it). There is no compression flag: FSDP has
no DDP communication hook; its gradients travel as the parameters' dtype.

Rank 0 prints the test accuracy every 5 epochs and at the end, the time
per step, and a digest of the full parameters.
"""

import argparse
import hashlib
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from digits_task import digits, let_go, mlp, start


def train(args):
    device = start(args.backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    assert args.batch % size == 0, "the global batch must split evenly over the ranks"
    local = args.batch // size
    x_train, y_train, x_test, y_test = (t.to(device) for t in digits())

    torch.manual_seed(args.seed)                 # every rank builds the same model, then keeps its shards
    model = mlp((64, 32, 10)).to(device)
    mesh = init_device_mesh(device.type, (size,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)

    steps, elapsed = 0, 0.0
    for epoch in range(args.epochs):
        order = torch.from_numpy(np.random.default_rng(epoch).permutation(len(y_train))).to(device)
        for first in range(0, len(order) - args.batch + 1, args.batch):
            mine = order[first:first + args.batch][rank * local:(rank + 1) * local]   # this rank's share
            began = time.perf_counter()
            optimizer.zero_grad()
            F.cross_entropy(model(x_train[mine]), y_train[mine]).backward()   # leaves averaged gradient shards
            optimizer.step()                                                  # each rank updates its shards
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed += time.perf_counter() - began
            steps += 1
        if (epoch + 1) % 5 == 0 and epoch + 1 < args.epochs:
            result = accuracy(model, x_test, y_test)   # every rank: forward gathers the parameters
            if rank == 0:
                print(f"epoch {epoch + 1:3d}  test accuracy {result:.4f}", flush=True)

    final = accuracy(model, x_test, y_test)
    gathered = [p.full_tensor() for p in model.parameters()]
    let_go(gathered)
    full = torch.cat([g.detach().reshape(-1) for g in gathered])
    if rank == 0:
        print(f"backend {args.backend}, FSDP2, {size} processes, {args.epochs} epochs", flush=True)
        print(f"final test accuracy {final:.4f}", flush=True)
        print(f"{1e3 * elapsed / max(steps, 1):.2f} ms per step (rank 0, {steps} steps)", flush=True)
        print(f"parameters' digest {hashlib.sha256(full.cpu().numpy().tobytes()).hexdigest()[:16]}", flush=True)
    dist.destroy_process_group()


def accuracy(model, x, y):
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["gloo", "collectives", "nccl"], default="gloo")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64, help="global batch size (a multiple of the process count)")
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)    # one core per process: the ranks share the machine's cores
    train(args)


if __name__ == "__main__":
    main()
