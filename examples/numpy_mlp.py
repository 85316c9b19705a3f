"""Data-parallel training with NumPy and collectives: synchronous SGD on 4 processes.

    pip install -e '.[mpi]' scikit-learn
    mpiexec -n 4 python examples/numpy_mlp.py

A small MLP (64 inputs, 32 hidden units, 10 classes) learns scikit-learn's
handwritten digits (8x8 images). Every process holds a full copy of the
model; each step of synchronous SGD has three parts:

  1. compute: each rank computes the gradient of the loss on its own
     quarter of the global batch;
  2. communicate: one fused allreduce averages the gradients over the
     ranks, which gives every rank the gradient of the whole global batch;
  3. update: every rank applies the same update to its own copy, so the
     copies stay identical (the allreduce gives every rank the same bits).

Options: --epochs, --batch (global), --lr, --compression bf16|fp16|int8.
"""

import argparse

import numpy as np

import collectives
import collectives.compression
from digits_data import digits


def init_params(rng, sizes=(64, 32, 10)):
    params = []
    for fan_in, fan_out in zip(sizes, sizes[1:]):
        params.append((rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in)).astype(np.float32))
        params.append(np.zeros(fan_out, np.float32))
    return params


def forward(params, x):
    w1, b1, w2, b2 = params
    h = np.maximum(x @ w1 + b1, 0)
    return h, h @ w2 + b2


def gradients(params, x, y):
    """Gradients of the mean cross-entropy over the batch (x, y)."""
    w1, b1, w2, b2 = params
    h, logits = forward(params, x)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1          # d loss / d logits, times the batch size
    dz = p / len(y)
    dh = (dz @ w2.T) * (h > 0)
    return [x.T @ dh, dh.sum(axis=0), h.T @ dz, dz.sum(axis=0)]


def accuracy(params, x, y):
    return float((forward(params, x)[1].argmax(axis=1) == y).mean())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64, help="global batch size (a multiple of the process count)")
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--compression", choices=["bf16", "fp16", "int8"], default=None)
    args = parser.parse_args()

    comm = collectives.init(timeout=60)
    if args.compression:
        collectives.compression.warm_up()   # compile the codecs before the first compressed allreduce
    rank, size = comm.rank, comm.size
    assert args.batch % size == 0, "the global batch must split evenly over the ranks"
    local = args.batch // size
    x_train, y_train, x_test, y_test = digits()

    # Start: every rank takes rank 0's initial parameters.
    params = init_params(np.random.default_rng(rank))
    for p in params:
        comm.broadcast(p, root=0)

    for epoch in range(args.epochs):
        order = np.random.default_rng(epoch).permutation(len(y_train))   # the same on every rank
        for start in range(0, len(order) - args.batch + 1, args.batch):
            batch = order[start:start + args.batch]
            mine = batch[rank * local:(rank + 1) * local]                  # this rank's share

            grads = gradients(params, x_train[mine], y_train[mine])        # 1. compute
            comm.allreduce_many(grads, op="avg", compression=args.compression)   # 2. communicate
            for p, g in zip(params, grads):                                # 3. update
                p -= args.lr * g

        if rank == 0 and ((epoch + 1) % 5 == 0 or epoch + 1 == args.epochs):
            print(f"epoch {epoch + 1:3d}  test accuracy {accuracy(params, x_test, y_test):.4f}", flush=True)

    # The copies never diverged: every rank holds the same bits.
    flat = np.concatenate([p.reshape(-1) for p in params])
    gathered = comm.allgather(flat).reshape(size, -1)
    same = all(np.array_equal(gathered[0].view(np.uint32), g.view(np.uint32)) for g in gathered)
    if rank == 0:
        print(f"parameters bitwise identical on all {size} ranks: {same}", flush=True)
    comm.close()


if __name__ == "__main__":
    main()
