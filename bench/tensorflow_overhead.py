"""Per-call cost of collectives.tensorflow's allreduce against the library's own, one rank per process.

    python -m bench.tensorflow_overhead [--ranks 2] [--sizes 1K,1M,16M] [--batches 15] [--calls 50]

Each process makes one host communicator (collectives.init) and, for each
size (float32, op max: the values stay what they are however many calls
run in place), times batches of calls of each kind in turn, alternating
batch by batch so that the machine's noise hits all alike:

    ours    comm.allreduce(x) on a NumPy array, in place (the API's
            cheapest form; the TensorFlow op makes a new tensor)
    oop     comm.allreduce(x, out=y) into another array: the form of the
            TensorFlow op's call (from 1 MiB slower than in place here: the
            result is written into lines that are not in cache)
    eager   collectives.tensorflow.allreduce(t, comm) on a tf.Tensor
    graph   the same inside a tf.function (traced once, run each call)
    graph8  8 such allreduces in one tf.function, each on the last's
            result: the time per allreduce, with the function's call cost
            shared by 8 (each a node of our graph op, native.py)
    npf8    graph8 with tf.numpy_function nodes instead (the fallback
            where our op cannot be built, and what every node was before it)
    empty   a tf.function of one tf.identity: TensorFlow's own cost of
            calling a function, which no op inside it can remove
    floor   a tf.function of one bare tf.numpy_function calling
            comm.allreduce(a, out=np.empty_like(a)): the least any Python
            collective in a graph costs, without the adapter's checks,
            agreement, gradient and aligned buffers
    mwms    with --mwms: TensorFlow's own collectives for comparison, a
            tf.function of MultiWorkerMirroredStrategy.run whose replica
            all_reduces the tensor (op sum: it has no max), the strategy
            started from our ranks (collectives.tensorflow.cluster_resolver)

It prints the median over batches of the time per call of each, and each
TensorFlow kind's difference from ours (µs) and ratio to it, and `node`:
graph8 less its share of the function's call (empty / 8), what one
allreduce costs inside a tf.function (with --mwms
also MWMS's ratio to `graph`: both inside a tf.function) (the goal
docs/training.md states: at most 30 µs more than ours at 1 KiB and at most
1.3x from 1 MiB, inside tf.function on 2 processes). Without a launcher it relaunches itself
under mpiexec with --ranks processes, pinned one per core (-bind-to core).
"""

import os
import statistics
import sys

import numpy as np

import collectives
from bench import cli
from bench.environment import environment
from bench.harness import mpi_world, relaunch_once, seconds_per_call

KINDS = ("ours", "eager", "graph", "graph8", "empty", "floor", "npf8", "oop")
CHAIN = 8   # allreduces in one tf.function for graph8


def parse_args(argv=None):
    p = cli.Parser(prog="python -m bench.tensorflow_overhead", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="processes, when not already under mpiexec")
    p.add_argument("--sizes", default="1K,1M,16M", type=cli.sizes, help="bytes per call, comma-separated (K, M)")
    p.add_argument("--batches", type=int, default=15, help="batches per kind and size, alternating kinds")
    p.add_argument("--calls", type=int, default=50, help="calls per batch (fewer from 1 MiB: at least 3)")
    p.add_argument("--mwms", action="store_true",
                   help="time MultiWorkerMirroredStrategy's all_reduce too (TensorFlow's collectives over gRPC)")
    p.add_argument("-J", "--output_file", help="write the results as JSON here (default: no file)")
    args = p.parse_args(argv)
    args.nbytes = [cli.parse_size(s) for s in args.sizes.split(",") if s.strip()]
    return args


def node_cost(row):
    """One allreduce's time inside a tf.function (µs): graph8's per-call
    time less its share of calling the function, which no op removes."""
    return row["graph8_us"] - row["empty_us"] / CHAIN


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    world = mpi_world()
    if world is None:
        return relaunch_once(args, argv, ["-bind-to", "core"])
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    import collectives.tensorflow as ctf
    from collectives.tensorflow import native

    tf.config.threading.set_inter_op_parallelism_threads(2)   # the ranks share the machine's cores
    tf.config.threading.set_intra_op_parallelism_threads(1)
    comm = collectives.init(comm=world)
    kinds = KINDS + (("mwms",) if args.mwms else ())
    strategy = None
    if args.mwms:   # before any other TensorFlow op: the strategy wants to start the runtime itself
        strategy = tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=ctf.cluster_resolver(comm))
    rows = []
    for nbytes in args.nbytes:
        x = np.random.default_rng(comm.rank).standard_normal(max(1, nbytes // 4)).astype(np.float32)
        t = tf.constant(x)
        graph = tf.function(lambda v: ctf.allreduce(v, comm, op="max"))

        @tf.function
        def graph8(v):
            for _ in range(CHAIN):
                v = ctf.allreduce(v, comm, op="max")
            return v

        npf8 = tf.function(graph8.python_function)
        native_op, native._loaded = native.op(), False   # npf8's trace: numpy_function nodes
        npf8.get_concrete_function(t)
        native._loaded = native_op or False
        empty = tf.function(tf.identity)
        floor = tf.function(lambda v: tf.numpy_function(lambda a: comm.allreduce(a, op="max", out=np.empty_like(a)),
                                                        [v], tf.float32, stateful=True))
        want = comm.allreduce(x.copy(), op="max")
        y = np.empty_like(x)
        calls = {"ours": lambda: comm.allreduce(x, op="max"), "eager": lambda: ctf.allreduce(t, comm, op="max"),
                 "graph": lambda: graph(t),
                 "graph8": lambda: graph8(t), "empty": lambda: empty(t), "floor": lambda: floor(t),
                 "npf8": lambda: npf8(t), "oop": lambda: comm.allreduce(x, op="max", out=y)}
        empty(t)
        if strategy is not None:
            @tf.function
            def mwms(v):
                return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce("sum", tf.identity(v)))

            calls["mwms"] = lambda: mwms(t)
            np.testing.assert_allclose(strategy.experimental_local_results(mwms(t))[0].numpy(),
                                       comm.allreduce(x.copy(), op="sum"), rtol=1e-5, atol=1e-5)   # sums near 0: another order
        for kind in ("eager", "graph", "graph8", "floor", "npf8"):   # warm-up (the trace), and a check that it reduces
            np.testing.assert_array_equal(calls[kind]().numpy(), want)
        per_batch = max(3, args.calls if nbytes < (1 << 20) else args.calls // 10)
        times = {kind: [] for kind in kinds}
        for _ in range(args.batches):
            for kind in kinds:
                # ranks start each batch together: a peer still in its last
                # batch would otherwise be charged to this one
                comm.barrier()
                times[kind].append(seconds_per_call(calls[kind], per_batch) / (CHAIN if kind in ("graph8", "npf8") else 1))
        median = {kind: statistics.median(values) * 1e6 for kind, values in times.items()}
        rows.append({"bytes": nbytes, "calls_per_batch": per_batch, "batches": args.batches,
                     **{f"{kind}_us": median[kind] for kind in kinds}})
    if comm.rank == 0:
        load = os.getloadavg()[0]
        print(f"# {comm.size} processes, float32 max, median of {args.batches} batches; load average {load:.1f}")
        print(f"# ours: comm.allreduce in place; graph8: per allreduce of {CHAIN} in one tf.function "
              f"({'our op' if native.op() else 'numpy_function: our op did not build'}); npf8: the same as "
              "numpy_function nodes; empty: a tf.function of tf.identity")
        print(f"{'bytes':>10} {'ours us':>9} {'eager us':>9} {'graph us':>9} {'graph8 us':>9} {'empty us':>9} "
              f"{'floor us':>9} {'npf8 us':>9} "
              f"{'eager-ours':>10} {'graph-ours':>10} {'g8-ours':>9} {'eager/ours':>10} {'graph/ours':>10} "
              f"{'g8/ours':>8} {'node us':>8} {'node-ours':>9} {'node/ours':>9} {'oop us':>8} {'node/oop':>8}" + (f" {'mwms us':>9} {'mwms/ours':>9} {'mwms/graph':>10}" if args.mwms else ""))
        for row in rows:
            ours, eager, graph, graph8, empty, floor, npf8, oop = (row[f"{kind}_us"] for kind in KINDS)
            print(f"{row['bytes']:>10} {ours:>9.1f} {eager:>9.1f} {graph:>9.1f} {graph8:>9.1f} {empty:>9.1f} "
                  f"{floor:>9.1f} {npf8:>9.1f} "
                  f"{eager - ours:>10.1f} {graph - ours:>10.1f} {graph8 - ours:>9.1f} {eager / ours:>10.2f} "
                  f"{graph / ours:>10.2f} {graph8 / ours:>8.2f} {node_cost(row):>8.1f} {node_cost(row) - ours:>9.1f} "
                  f"{node_cost(row) / ours:>9.2f} {oop:>8.1f} {node_cost(row) / oop:>8.2f}"
                  + (f" {row['mwms_us']:>9.1f} {row['mwms_us'] / ours:>9.2f} {row['mwms_us'] / graph:>10.2f}"
                     if args.mwms else ""))
        if args.output_file:
            measured = environment("host", comm.size, ["ours", *(["mwms"] if args.mwms else [])])
            measured["tensorflow"] = tf.__version__   # every row is TensorFlow's, with or without --mwms
            measured["graph_node"] = native.OP_NAME if native.op() else "PyFunc"
            cli.write_json(args.output_file, {"environment": measured, "ranks": comm.size, "load_average": load,
                                              "rows": rows}, say=None)
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
