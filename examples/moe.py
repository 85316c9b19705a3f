"""Expert parallelism: a mixture of experts whose tokens travel by all-to-all, started by torchrun.

    pip install -e '.[torch]' scikit-learn
    torchrun --standalone --nproc-per-node 4 examples/moe.py --backend collectives
    torchrun --standalone --nproc-per-node 4 examples/moe.py                          # Gloo, to compare

One expert per process (a 64-32-10 MLP on scikit-learn's digits) and a
router every process holds. Each step, every rank:

  1. routes its share of the global batch: the router's softmax picks one
     expert per image (top-1), whose probability scales that expert's output;
  2. sends each image to its expert's rank: `all_to_all_single` with split
     sizes (how many images go to each rank, told to the others by an
     all-to-all of the counts first);
  3. runs its expert on the images it received, and sends the outputs back
     the same way, reversed;
  4. backpropagates through both all-to-alls (AllToAll below: the gradient
     of an all-to-all is the reverse all-to-all), then averages the
     router's gradients over the ranks; an
     expert's gradients, summed over every rank's images, are divided by
     the rank count (the global loss is the mean of the ranks' losses).

Rank 0 also trains the whole model in one process on the global batch, from
the same initial parameters, and checks every step's loss (the mean of the
ranks' losses) against it: the two must agree to 1e-5. It prints the
largest difference, the test accuracy of both, and the time per step.
"""

import argparse
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from digits_task import digits, let_go, mlp, start


class Experts(torch.nn.Module):
    """The router and every expert, made alike on every rank (same seed):
    a rank trains the router and its own expert; rank 0's reference, all."""

    def __init__(self, count, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.router = torch.nn.Linear(64, count)
        self.experts = torch.nn.ModuleList(mlp((64, 32, 10)) for _ in range(count))

    def route(self, x):
        """(the expert of each image, the probability that scales its output)."""
        probabilities = F.softmax(self.router(x), dim=1)
        chosen = probabilities.argmax(dim=1)
        return chosen, probabilities.gather(1, chosen[:, None])

    def forward(self, x):
        """The whole model in one process: every image through its own expert."""
        chosen, weight = self.route(x)
        out = torch.zeros(len(x), 10)
        for e, expert in enumerate(self.experts):
            mine = chosen == e
            out[mine] = expert(x[mine])
        return out * weight


class AllToAll(torch.autograd.Function):
    """dist.all_to_all_single with split sizes, differentiable: the rows this
    rank sent come back as gradients by the same exchange reversed."""

    @staticmethod
    def forward(ctx, rows, received, sent):
        ctx.received, ctx.sent = received, sent
        out = rows.new_empty((sum(received), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), received, sent)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.sent), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.sent, ctx.received)
        return back, None, None


def expert_parallel(model, x, rank):
    """The same forward pass with this rank's expert alone: images travel to
    their expert's rank and back by all-to-all."""
    chosen, weight = model.route(x)
    order = torch.argsort(chosen, stable=True)              # images grouped by destination rank
    sent = torch.bincount(chosen, minlength=dist.get_world_size())
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent)                  # how many images each rank sends here
    sent, received = sent.tolist(), received.tolist()
    inbox = AllToAll.apply(x[order], received, sent)
    outbox = model.experts[rank](inbox)
    back = AllToAll.apply(outbox, sent, received)
    out = torch.empty_like(back).index_copy(0, order, back)   # back into the images' order
    return out * weight


def train(args):
    start(args.backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    assert args.batch % size == 0, "the global batch must split evenly over the ranks"
    local = args.batch // size
    x_train, y_train, x_test, y_test = digits()
    model = Experts(size, args.seed)
    mine = [*model.router.parameters(), *model.experts[rank].parameters()]
    optimizer = torch.optim.SGD(mine, lr=args.lr)
    reference = Experts(size, args.seed) if rank == 0 else None
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=args.lr) if rank == 0 else None

    worst, steps, elapsed = 0.0, 0, 0.0
    for epoch in range(args.epochs):
        order = torch.from_numpy(np.random.default_rng(epoch).permutation(len(y_train)))
        for first in range(0, len(order) - args.batch + 1, args.batch):
            batch = order[first:first + args.batch]
            share = batch[rank * local:(rank + 1) * local]
            began = time.perf_counter()
            optimizer.zero_grad()
            loss = F.cross_entropy(expert_parallel(model, x_train[share], rank), y_train[share])
            loss.backward()
            for p in model.router.parameters():
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            for p in mine:                                  # the global loss is the ranks' mean
                p.grad /= size
            optimizer.step()
            elapsed += time.perf_counter() - began
            steps += 1
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            if rank == 0:
                reference_optimizer.zero_grad()
                whole = F.cross_entropy(reference(x_train[batch]), y_train[batch])
                whole.backward()
                reference_optimizer.step()
                worst = max(worst, abs(mean_loss.item() / size - whole.item()))
    accuracy = _accuracy(model, x_test, y_test, rank)
    if rank == 0:
        evaluated = len(y_test) // size * size   # the images the ranks' shares cover
        with torch.no_grad():
            alone = (reference(x_test[:evaluated]).argmax(dim=1) == y_test[:evaluated]).float().mean().item()
        print(f"backend {args.backend}, {size} processes (one expert each), {args.epochs} epochs, {steps} steps",
              flush=True)
        print(f"largest difference of a step's loss from one process on the whole batch: {worst:.2e}", flush=True)
        print(f"final test accuracy {accuracy:.4f} (one process: {alone:.4f})", flush=True)
        print(f"{1e3 * elapsed / max(steps, 1):.2f} ms per step (rank 0)", flush=True)
    # Every rank waits for rank 0's reference before any tears the group down,
    # and for Gloo's worker threads to let go of the tensor of that last
    # collective: a rank that exited while one still held it aborted with
    # "terminate called without an active exception" (twice in fresh runs of
    # the suite, with dist.barrier() here, whose tensor let_go cannot see).
    done = torch.zeros(1)
    dist.all_reduce(done)
    let_go([done])
    dist.destroy_process_group()


def _accuracy(model, x, y, rank):
    """Test accuracy of the expert-parallel model: every rank routes its
    share of the test images (the test set split evenly; the rest left out)."""
    size = dist.get_world_size()
    share = len(y) // size
    mine = slice(rank * share, (rank + 1) * share)
    with torch.no_grad():
        right = (expert_parallel(model, x[mine], rank).argmax(dim=1) == y[mine]).sum()
    dist.all_reduce(right)
    return right.item() / (share * size)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["gloo", "collectives"], default="gloo")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64, help="global batch size (a multiple of the process count)")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)    # one core per process: the ranks share the machine's cores
    train(args)


if __name__ == "__main__":
    main()
