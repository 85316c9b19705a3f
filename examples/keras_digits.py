"""Data-parallel training with Keras 3 and collectives.keras: processes under mpiexec, CPU tensors.

    pip install -e '.[mpi,tensorflow]' scikit-learn
    mpiexec -n 4 python examples/keras_digits.py
    mpiexec -n 4 python examples/keras_digits.py --compression int8
    KERAS_BACKEND=torch mpiexec -n 4 python examples/keras_digits.py   # Keras on PyTorch's CPU tensors

The model and data of torch_mlp.py (a 64-32-10 MLP on scikit-learn's
digits, global batch 64, SGD), trained with `model.fit`:

  - every rank builds the model with its own seed, and
    `BroadcastGlobalVariablesCallback` makes them all start from rank 0's
    weights (and optimizer state) when training begins;
  - each rank fits on its share of every global batch (the same
    permutation per epoch on every rank, as torch_mlp.py);
  - `DistributedOptimizer` averages the gradients over the ranks (one fused
    allreduce per step) before SGD applies them, so every rank's copy
    takes the same update;
  - `MetricAverageCallback` makes the epoch's loss the mean over the ranks.

It ends by checking that every rank's weights are bitwise identical.
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")   # or torch: collectives.keras runs on either
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")      # TensorFlow's start-up banners

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import collectives  # noqa: E402
from collectives.keras import BroadcastGlobalVariablesCallback, DistributedOptimizer, MetricAverageCallback  # noqa: E402
from digits_data import digits  # noqa: E402


def mlp(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])


def train(comm, args):
    rank, size = comm.rank, comm.size
    assert args.batch % size == 0, "the global batch must split evenly over the ranks"
    local = args.batch // size
    x_train, y_train, x_test, y_test = digits()

    model = mlp(seed=rank)                      # different on purpose: the broadcast makes them equal
    model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(args.lr), comm, compression=args.compression),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    # One list for every fit: the broadcast happens at the first one only.
    callbacks = [BroadcastGlobalVariablesCallback(comm, root=0), MetricAverageCallback(comm)]

    batches = len(y_train) // args.batch
    for epoch in range(args.epochs):
        order = np.random.default_rng(epoch).permutation(len(y_train))[:batches * args.batch]
        mine = order.reshape(batches, size, local)[:, rank].reshape(-1)   # this rank's share of every global batch
        history = model.fit(x_train[mine], y_train[mine], batch_size=local, epochs=epoch + 1, initial_epoch=epoch,
                            shuffle=False, verbose=0, callbacks=callbacks)
        if rank == 0 and ((epoch + 1) % 5 == 0 or epoch + 1 == args.epochs):
            accuracy = float(np.mean(np.argmax(model.predict(x_test, verbose=0), axis=1) == y_test))
            print(f"epoch {epoch + 1:3d}  loss {history.history['loss'][-1]:.4f}  test accuracy {accuracy:.4f}",
                  flush=True)

    # The copies never diverged: every rank holds the same bits.
    flat = np.concatenate([w.numpy().reshape(-1) for w in model.weights])
    gathered = comm.allgather(flat).reshape(size, -1)
    same = all(np.array_equal(gathered[0].view(np.uint32), g.view(np.uint32)) for g in gathered)
    if rank == 0:
        print(f"parameters bitwise identical on all {size} ranks: {same}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64, help="global batch size (a multiple of the process count)")
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--compression", choices=["bf16", "fp16", "int8"], default=None)
    args = parser.parse_args()

    tf.config.threading.set_inter_op_parallelism_threads(2)   # the ranks share the machine's cores
    tf.config.threading.set_intra_op_parallelism_threads(1)
    comm = collectives.init(timeout=60)
    try:
        train(comm, args)
    finally:
        comm.close()


if __name__ == "__main__":
    main()
