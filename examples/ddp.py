"""Data-parallel training with PyTorch's DistributedDataParallel, started by torchrun.

    pip install -e '.[torch]' scikit-learn
    torchrun --standalone --nproc-per-node 4 examples/ddp.py                          # Gloo
    torchrun --standalone --nproc-per-node 4 examples/ddp.py --compression int8       # Gloo + our hook
    torchrun --standalone --nproc-per-node 4 examples/ddp.py --backend collectives    # our process group
    torchrun --standalone --nproc-per-node 4 examples/ddp.py --backend nccl           # GPUs: one per process

The model and data of torch_mlp.py (a 64-32-10 MLP, --hidden wider, on scikit-learn's
digits, a global batch of 64 split evenly over the ranks), written the way
a PyTorch user writes it: `init_process_group`, `DistributedDataParallel`,
and nothing else of ours, except what the two flags bring in:

  --backend      who runs DDP's collectives: "gloo" (CPU tensors), "nccl"
                 (CUDA tensors, the GPU of LOCAL_RANK), or "collectives":
                 `import collectives.torch` registers our library as a
                 torch.distributed backend, and DDP runs on it unchanged
  --compression  "none", or "bf16", "fp16", "int8": DDP's gradient buckets
                 go through `collectives.torch.compression_hook`, our
                 compressed allreduce (16 or 8 bits on the wire, sums in
                 float32), on our communicator: the process group's own
                 with --backend collectives, else collectives.init() beside
                 Gloo or NCCL (the ranks meet through torchrun's store);
                 "torch-fp16", "torch-bf16": torch's own fp16_compress_hook
                 and bf16_compress_hook instead (16-bit sums), to compare

Rank 0 prints the test accuracy every 5 epochs and at the end, the time
per step, whether every rank holds the same parameters, and a digest of
them (two runs with the same digest trained the same bits).
"""

import argparse
import hashlib
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from digits_task import digits, let_go, mlp, start


def hook_state(backend, device):
    """What our compression hook runs on: the process group itself when it is
    ours (it offers .communicator(device)), else a communicator of our own
    beside Gloo or NCCL."""
    if backend == "collectives":
        return dist.group.WORLD
    import collectives
    return collectives.init(device="cuda" if device.type == "cuda" else "host")


def train(args):
    device = start(args.backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    assert args.batch % size == 0, "the global batch must split evenly over the ranks"
    local = args.batch // size
    x_train, y_train, x_test, y_test = (t.to(device) for t in digits())

    torch.manual_seed(args.seed)
    model = DDP(mlp((64, args.hidden, 10)).to(device))    # DDP broadcasts rank 0's parameters
    if args.compression.startswith("torch-"):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        torch_hook = getattr(default_hooks, f"{args.compression[6:]}_compress_hook")

        def torch_compression(state, bucket):   # DDP refuses the name bf16_compress_hook without NCCL
            return torch_hook(state, bucket)
        model.register_comm_hook(None, torch_compression)
    elif args.compression != "none":
        from collectives.torch import compression_hook
        model.register_comm_hook(hook_state(args.backend, device),
                                 compression_hook(args.compression, error_feedback=args.error_feedback))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)

    steps, elapsed = 0, 0.0
    for epoch in range(args.epochs):
        order = torch.from_numpy(np.random.default_rng(epoch).permutation(len(y_train))).to(device)
        for first in range(0, len(order) - args.batch + 1, args.batch):
            mine = order[first:first + args.batch][rank * local:(rank + 1) * local]   # this rank's share
            began = time.perf_counter()
            optimizer.zero_grad()
            F.cross_entropy(model(x_train[mine]), y_train[mine]).backward()   # DDP averages the gradients
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed += time.perf_counter() - began
            steps += 1
        if rank == 0 and ((epoch + 1) % 5 == 0 and epoch + 1 < args.epochs):
            print(f"epoch {epoch + 1:3d}  test accuracy {accuracy(model, x_test, y_test):.4f}", flush=True)

    final = accuracy(model, x_test, y_test)
    with torch.no_grad():
        test_loss = F.cross_entropy(model(x_test), y_test).item()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(gathered, flat)
    let_go([flat, *gathered])
    same = all(torch.equal(gathered[0].view(torch.int32), g.view(torch.int32)) for g in gathered)
    if rank == 0:
        print(f"backend {args.backend}, compression {args.compression}"
              f"{' with error feedback' if args.error_feedback else ''}, {size} processes, {args.epochs} epochs",
              flush=True)
        print(f"final test accuracy {final:.4f}, test loss {test_loss:.4f}", flush=True)
        print(f"{1e3 * elapsed / max(steps, 1):.2f} ms per step (rank 0, {steps} steps)", flush=True)
        print(f"parameters bitwise identical on all {size} ranks: {same}; their digest "
              f"{hashlib.sha256(flat.cpu().numpy().tobytes()).hexdigest()[:16]}", flush=True)
    dist.destroy_process_group()


def accuracy(model, x, y):
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["gloo", "collectives", "nccl"], default="gloo")
    parser.add_argument("--compression", default="none",
                        choices=["none", "bf16", "fp16", "int8", "torch-fp16", "torch-bf16"])
    parser.add_argument("--error-feedback", action="store_true", help="with --compression")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64, help="global batch size (a multiple of the process count)")
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--hidden", type=int, default=32,
                        help="the hidden layer's width: 32 gives 2.4 K parameters; 4096 gives 307 K (1.2 MB of "
                             "gradients a step), where the wire, not the latency, is the cost")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.error_feedback and args.compression in ("none", "torch-fp16", "torch-bf16"):
        parser.error("--error-feedback needs --compression bf16, fp16 or int8")
    torch.set_num_threads(1)    # one core per process: the ranks share the machine's cores
    train(args)


if __name__ == "__main__":
    main()
