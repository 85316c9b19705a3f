"""A Keras training step with collectives.tensorflow against MultiWorkerMirroredStrategy, in the same processes.

    python -m bench.keras_fit [--ranks 4] [--epochs 20] [-J FILE]

examples/keras_digits.py's task (its digits() and mlp(): a 64-32-10 MLP on
scikit-learn's digits, global batch 64, SGD lr 0.2) trained three ways in
every process, epoch by epoch in turn, so that the machine's load hits all
alike:

    ours fit    as the example: model.fit without a strategy,
                DistributedOptimizer averaging the gradients (one fused
                allreduce of ours per step), BroadcastGlobalVariablesCallback
                starting every rank from rank 0's weights,
                MetricAverageCallback averaging each epoch's loss
    ours loop   a custom training loop: a tf.function step of GradientTape,
                collectives.tensorflow.DistributedGradientTape (the gradients
                averaged in one fused allreduce) and the Keras optimizer's
                apply, every rank started from rank 0's weights
                (broadcast_variables)
    mwms loop   the same step under tf.distribute.MultiWorkerMirroredStrategy
                (started from our ranks: collectives.tensorflow.cluster_resolver):
                a tf.function of strategy.run, the model and optimizer made
                in its scope, the loss divided by the replica count (Keras'
                losses do it under a strategy) and the gradients summed by the
                Keras optimizer through the strategy
                (TensorFlow's collectives, a ring over gRPC); the strategy
                starts every replica from worker 0's weights

Keras 3's model.fit cannot run under MultiWorkerMirroredStrategy
(keras-team/keras#20585: its first batch is averaged by strategy.reduce,
and each step's outputs by reduce_per_replica, and both raise under this
strategy), so the strategy runs the custom loop, and `ours loop` is the
comparison like for like.

Each rank trains on its share of every global batch, the same shares for
all three. A step's time, on rank 0: for the loops, one call of the step
function (its result read back); for fit, the interval between consecutive
on_train_batch_end callbacks of one epoch (the first step of an epoch, which
also starts its iterator, not counted). The first epoch, which traces, is
left out of the medians. After the last epoch each rank checks that its
weights are bitwise those of every other rank, and rank 0 computes each
model's test accuracy with the same NumPy forward pass. Without a launcher
it relaunches itself under mpiexec with --ranks processes (-bind-to as
--bind-to).
"""

import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import collectives
from bench import cli
from bench.environment import environment
from bench.harness import bind_to, mpi_world, relaunch_once

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "keras_digits.py"
KINDS = ("ours_fit", "ours_loop", "mwms_loop")


def parse_args(argv=None):
    p = cli.Parser(prog="python -m bench.keras_fit", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4, help="processes, when not already under mpiexec")
    p.add_argument("--epochs", type=int, default=20, help="epochs of each, alternating epoch by epoch")
    p.add_argument("--batch", type=int, default=64, help="global batch size (a multiple of the process count)")
    p.add_argument("--lr", type=float, default=0.2, help="SGD's learning rate")
    p.add_argument("--bind-to", default="core", help="mpiexec's -bind-to when it relaunches itself (auto: core "
                                                     "while the processes have a core each, none beyond)")
    p.add_argument("-J", "--output_file", help="write the results as JSON here (default: no file)")
    args = p.parse_args(argv)
    if args.epochs < 2:
        p.error("--epochs must be at least 2: the first, which traces, is left out of the medians")
    return args


def load_example():
    """examples/keras_digits.py as a module: its digits() and mlp()."""
    spec = importlib.util.spec_from_file_location("keras_digits", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def step_timer(keras, into):
    """A callback that appends each step's seconds (batch end to batch end
    within an epoch) to `into`, one list per epoch."""

    class StepTimer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            into.append([])
            self.last = None

        def on_train_batch_end(self, batch, logs=None):
            now = time.perf_counter()
            if self.last is not None:
                into[-1].append(now - self.last)
            self.last = now

    return StepTimer()


def accuracy(weights, x, y):
    """The MLP's test accuracy from its weights (kernel, bias per layer), by NumPy."""
    (w1, b1), (w2, b2) = weights[0:2], weights[2:4]
    logits = np.maximum(x @ w1 + b1, 0) @ w2 + b2
    return float(np.mean(np.argmax(logits, axis=1) == y))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    world = mpi_world()
    if world is None:
        return relaunch_once(args, argv, ["-bind-to", bind_to(args.bind_to, args.ranks)])
    example = load_example()   # (sets KERAS_BACKEND and TensorFlow's log level before importing them)
    import keras
    import tensorflow as tf

    import collectives.tensorflow as ctf
    from collectives.keras import BroadcastGlobalVariablesCallback, DistributedOptimizer, MetricAverageCallback

    tf.config.threading.set_inter_op_parallelism_threads(2)   # as the example: the ranks share the cores
    tf.config.threading.set_intra_op_parallelism_threads(1)
    comm = collectives.init(comm=world, timeout=120)
    # before any other TensorFlow op: the strategy starts TensorFlow's runtime as a worker of the cluster
    strategy = tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=ctf.cluster_resolver(comm))
    rank, size = comm.rank, comm.size
    if args.batch % size:
        sys.exit(f"--batch {args.batch} does not split evenly over {size} processes")
    local = args.batch // size
    x_train, y_train, x_test, y_test = example.digits()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    fitted = example.mlp(seed=rank)   # different on purpose: the broadcast makes them rank 0's
    fitted.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(args.lr), comm), loss=loss)
    looped, looped_optimizer = example.mlp(seed=rank), keras.optimizers.SGD(args.lr)
    looped_optimizer.build(looped.trainable_variables)
    ctf.broadcast_variables(looped.variables, comm, root=0)
    with strategy.scope():
        theirs = example.mlp(seed=rank)   # the strategy starts every replica from worker 0's values
        their_optimizer = keras.optimizers.SGD(args.lr)
        their_optimizer.build(theirs.trainable_variables)

    @tf.function
    def our_step(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, looped(x, training=True))
        variables = looped.trainable_variables
        looped_optimizer.apply(ctf.DistributedGradientTape(tape, comm).gradient(value, variables), variables)
        return value

    @tf.function
    def their_step(x, y):
        def replica_step(x, y):
            with tf.GradientTape() as tape:
                # (under the strategy Keras' loss divides its mean by the replica count itself: summed
                # over the replicas by the optimizer, the gradients are the global batch's mean)
                value = loss(y, theirs(x, training=True))
            variables = theirs.trainable_variables
            their_optimizer.apply(tape.gradient(value, variables), variables)
            return value
        return strategy.run(replica_step, args=(x, y))

    steps = {kind: [] for kind in KINDS}   # per kind, a list of step times per epoch
    fit_callbacks = [BroadcastGlobalVariablesCallback(comm, root=0), MetricAverageCallback(comm),
                     step_timer(keras, steps["ours_fit"])]

    def loop(step, x, y):
        times = steps["ours_loop" if step is our_step else "mwms_loop"]
        times.append([])
        for first in range(0, len(y), local):
            xs, ys = tf.constant(x[first:first + local]), tf.constant(y[first:first + local])
            start = time.perf_counter()
            result = step(xs, ys)
            tf.nest.map_structure(lambda t: t.numpy(), strategy.experimental_local_results(result)
                                  if step is their_step else result)
            times[-1].append(time.perf_counter() - start)

    batches = len(y_train) // args.batch
    for epoch in range(args.epochs):
        order = np.random.default_rng(epoch).permutation(len(y_train))[:batches * args.batch]
        mine = order.reshape(batches, size, local)[:, rank].reshape(-1)   # this rank's share of every global batch
        x_mine, y_mine = x_train[mine], y_train[mine]
        for kind in KINDS:
            comm.barrier()   # all start each epoch together on every rank
            if kind == "ours_fit":
                fitted.fit(x_mine, y_mine, batch_size=local, epochs=epoch + 1, initial_epoch=epoch, shuffle=False,
                           verbose=0, callbacks=fit_callbacks)
            else:
                loop(our_step if kind == "ours_loop" else their_step, x_mine, y_mine)

    result = {"ranks": size, "epochs": args.epochs, "global_batch": args.batch, "steps_per_epoch": batches,
              "load_average": os.getloadavg()[0]}
    flats = {}
    for kind, model in zip(KINDS, (fitted, looped, theirs)):
        weights = [np.asarray(w) for w in model.get_weights()]
        flats[kind] = np.concatenate([w.reshape(-1) for w in weights]).astype(np.float32)
        gathered = comm.allgather(flats[kind]).reshape(size, -1)
        timed = [s for epoch in steps[kind][1:] for s in epoch]
        result[kind] = {"step_ms_median": statistics.median(timed) * 1e3,
                        "step_ms_quartiles": [float(q) * 1e3 for q in np.percentile(timed, [25, 75])],
                        "steps_timed": len(timed),
                        "test_accuracy": accuracy(weights, x_test, y_test),
                        "ranks_bitwise_identical": bool(all(np.array_equal(gathered[0].view(np.uint32),
                                                                           g.view(np.uint32)) for g in gathered))}
    # how far apart the three trainings end (the same arithmetic but for the order of the reductions)
    result["max_weight_difference"] = {
        "ours_loop_vs_mwms_loop": float(np.max(np.abs(flats["ours_loop"] - flats["mwms_loop"]))),
        "ours_fit_vs_ours_loop": float(np.max(np.abs(flats["ours_fit"] - flats["ours_loop"])))}
    result["mwms_loop_over_ours_loop"] = result["mwms_loop"]["step_ms_median"] / result["ours_loop"]["step_ms_median"]
    if rank == 0:
        print(f"# {size} processes, {args.epochs} epochs of {batches} steps, global batch {args.batch}, "
              f"kinds alternating epoch by epoch; medians without the first epoch; load average "
              f"{result['load_average']:.1f}")
        print(f"{'':>10} {'step ms':>8} {'(q1-q3)':>13} {'test acc':>9} {'ranks equal':>12}")
        for kind in KINDS:
            r = result[kind]
            low, high = r["step_ms_quartiles"]
            print(f"{kind:>10} {r['step_ms_median']:>8.2f} {low:>6.2f}-{high:<6.2f} {r['test_accuracy']:>9.4f} "
                  f"{str(r['ranks_bitwise_identical']):>12}")
        apart = result["max_weight_difference"]
        print(f"# MultiWorkerMirroredStrategy's loop step over ours: {result['mwms_loop_over_ours_loop']:.2f}x; "
              f"largest weight difference after training: ours loop - mwms loop "
              f"{apart['ours_loop_vs_mwms_loop']:.2e}, ours fit - ours loop {apart['ours_fit_vs_ours_loop']:.2e}")
        if args.output_file:
            cli.write_json(args.output_file, {"environment": environment("host", size, ["ours", "mwms"]), **result})
    comm.close()
    return 0

if __name__ == "__main__":
    sys.exit(main())
