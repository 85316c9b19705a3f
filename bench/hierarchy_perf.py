"""The hierarchical allreduce across pretend nodes, side by side with MPICH's.

    python -m bench.hierarchy_perf [--nodes 0,0,1,1] [-b 1M -e 64M -f 64] [-n 20] [-w 2] [--rounds 7]
                                   [-J bench/results/hierarchy_2x2_vs_mpich.json]

Without a launcher it relaunches itself as `mpiexec -bind-to core -n <ranks>`
with $COLLECTIVES_PRETEND_NODES set to --nodes (one node label per rank).
Three backends run on the same processes, on identical float32 inputs,
alternating batch by batch so that the machine's noise hits all alike:

    hierarchical   collectives.init() across the pretend nodes (hierarchy.py)
    mpich          MPI_Allreduce through mpi4py, on the same processes
    one-node       collectives.init() with every rank on one node: today's path

A batch is -n calls (fewer for large sizes: at most --batch-bytes per batch,
at least 2), right after about 20 ms of untimed calls of its backend (as
the harness's: bench/harness.py, warm_up); its time is the slowest rank's
mean; a row is the median over --rounds batches, out of place and in place. Every backend's result is then
checked exactly on fresh inputs.

Last, an untimed pass of the hierarchical allreduce at each size splits its
time into what the model (bench/model.py's hierarchy) weighs: inside nodes,
the MPI exchanges between nodes, and the folds across nodes; written to the
JSON as "components" for `python -m bench.model hierarchy --calibrate`. A
size that runs as a compiled Program (collectives/across.py) is one C call
with no split: its total alone ("compiled"); COLLECTIVES_FAST_PATH=0 keeps
every size on the phases.
"""

import os
import statistics
import sys
import time

import numpy as np

import collectives
from bench import cli
from collectives import hierarchy
from collectives.ops import ReduceOp
from bench.environment import environment
from bench.harness import (abort_on_uncaught_exceptions, adding_seconds, relaunch_once, seconds_per_call, slowest,
                           warm_calls)
from collectives.bootstrap import LAUNCHER_VARIABLES, PRETEND_NODES_ENV
from collectives.plan import KIND, REDUCE_FINAL_OP

BACKENDS = ("hierarchical", "mpich", "one-node")


def parse_args(argv):
    p = cli.Parser(prog="python -m bench.hierarchy_perf", description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="0,0,1,1", help="pretend node of each rank, comma-separated")
    p.add_argument("-b", "--minbytes", default="1M", type=cli.size, help="smallest message (suffixes K, M, G)")
    p.add_argument("-e", "--maxbytes", default="64M", type=cli.size, help="largest message")
    p.add_argument("-f", "--stepfactor", type=int, default=64, help="multiply the size by this each step")
    p.add_argument("-n", "--iters", type=int, default=20, help="calls per timed batch (at most)")
    p.add_argument("--batch-bytes", default="256M", type=cli.size, help="fewer calls per batch for large sizes: at most this")
    p.add_argument("-w", "--warmup_iters", type=int, default=2, help="untimed calls first")
    p.add_argument("--rounds", type=int, default=7, help="alternating batches per backend; the median is kept")
    p.add_argument("--timeout", type=float, default=120.0, help="communicator timeout in seconds")
    p.add_argument("-J", "--output_file", help="write the results as JSON here (default: no file)")
    return p.parse_args(argv)


def one_node_communicator(world, timeout):
    """Today's communicator on the same processes: init without pretend nodes."""
    saved = os.environ.pop(PRETEND_NODES_ENV, None)
    try:
        return collectives.init(timeout=timeout, comm=world)
    finally:
        if saved is not None:
            os.environ[PRETEND_NODES_ENV] = saved


def make_calls(world, hierarchical, one_node):
    from mpi4py import MPI

    def mpich(x, y):
        world.Allreduce(MPI.IN_PLACE if y is x else x, y)

    return {
        "hierarchical": lambda x, y: hierarchical.allreduce(x, out=None if y is x else y),
        "mpich": mpich,
        "one-node": lambda x, y: one_node.allreduce(x, out=None if y is x else y),
    }


def timed_batch(world, call, x, y, iters):
    """Seconds per call of `iters` calls after a barrier, the slowest rank's."""
    return slowest(world, seconds_per_call(call, iters, x, y, before=world.Barrier))


def measure(world, calls, nbytes, args):
    """{backend: {"out_of_place": µs, "in_place": µs, "wrong": elements}} for one size."""
    count = nbytes // 4
    n, r = world.Get_size(), world.Get_rank()
    iters = max(2, min(args.iters, cli.parse_size(args.batch_bytes) // max(nbytes, 1)))
    row = {name: {} for name in calls}
    for place in ("out_of_place", "in_place"):
        buffers = {name: (np.full(count, r + 1, np.float32), np.empty(count, np.float32)) for name in calls}
        if place == "in_place":
            buffers = {name: (x, x) for name, (x, _) in buffers.items()}
        for name, call in calls.items():
            for _ in range(args.warmup_iters):
                call(*buffers[name])
        times = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                x, y = buffers[name]
                # untimed calls first, as the harness's batches (harness.warm_up): a batch after the
                # machine idled would start cold (as many calls on every rank: from the slowest's time)
                last = times[name][-1] if times[name] else timed_batch(world, call, x, y, 1)
                for _ in range(warm_calls(last)):
                    call(x, y)
                x[...] = r + 1      # in place, every call multiplies by n: start each batch afresh (untimed)
                times[name].append(timed_batch(world, call, x, y, iters))
        for name, call in calls.items():
            x = np.full(count, r + 1, np.float32)
            y = x if place == "in_place" else np.empty(count, np.float32)
            call(x, y)
            wrong = int(np.count_nonzero(y != n * (n + 1) / 2))
            row[name][place] = statistics.median(times[name]) * 1e6
            row[name]["wrong"] = row[name].get("wrong", 0) + world.allreduce(wrong)
    return row, iters


def components(world, comm, nbytes, calls=5):
    """Median over `calls` of the split of one hierarchical allreduce on its
    slowest rank: total, MPI exchanges (waits for the other node included),
    folds across nodes (REDUCE_FINAL rows), and the rest, inside the node
    (µs). A call of a compiled Program (across.py) is one C call: its
    total alone, with "compiled" true."""
    ranks = comm._ranks   # noqa: SLF001 - the bench looks inside on purpose
    call = hierarchy.Call("allreduce", np.dtype(np.float32), nbytes // 4, ReduceOp.SUM, 0, "")
    compiled = ranks.programs is not None and (hierarchy.takes_small(ranks, call) or ranks.programs.takes_large(call))
    spent = {}
    exchange, fold = ranks.exchange, ranks.fold
    fold_across = adding_seconds(fold, spent, "folds_across")
    ranks.exchange = adding_seconds(exchange, spent, "exchanges")
    ranks.fold = lambda table, *a: (fold_across if len(table) and table[0, KIND] == REDUCE_FINAL_OP
                                    else fold)(table, *a)
    x, y = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
    samples = []
    try:
        for _ in range(calls):
            spent.clear()
            world.Barrier()
            start = time.perf_counter()
            comm.allreduce(x, out=y)
            total = time.perf_counter() - start
            mine = {"total": total, "exchanges": spent.get("exchanges", 0.0),
                    "folds_across": spent.get("folds_across", 0.0)}
            mine["inside_nodes"] = total - mine["exchanges"] - mine["folds_across"]
            slowest = max(world.allgather(mine), key=lambda split: split["total"])
            samples.append({k: v * 1e6 for k, v in slowest.items()})
    finally:
        ranks.exchange, ranks.fold = exchange, fold
    if compiled:
        return {"total": statistics.median(s["total"] for s in samples), "compiled": True}
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not any(v in os.environ for v in LAUNCHER_VARIABLES):
        return relaunch_once(args, argv, ["-bind-to", "core"], ranks=len(args.nodes.split(",")),
                             variables={PRETEND_NODES_ENV: args.nodes})
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    abort_on_uncaught_exceptions(world)
    if len(args.nodes.split(",")) != world.Get_size():
        raise SystemExit(f"--nodes names {len(args.nodes.split(','))} ranks, but {world.Get_size()} processes run")
    os.environ[PRETEND_NODES_ENV] = args.nodes
    hierarchical = collectives.init(timeout=args.timeout)
    one_node = one_node_communicator(world, args.timeout)
    assert type(hierarchical).__name__ == "HierarchicalCommunicator", "the pretend nodes gave one node"
    calls = make_calls(world, hierarchical, one_node)
    nodes = hierarchical.topology.nodes
    sizes = cli.size_sweep(args.minbytes, args.maxbytes, args.stepfactor)
    rank0 = world.Get_rank() == 0
    if rank0:
        print(f"# allreduce, float32 sum, {world.Get_size()} processes on pretend nodes "
              f"{' | '.join(' '.join(map(str, node)) for node in nodes)}; median of {args.rounds} alternating "
              "batches, slowest rank; times in µs")
        print(f"# {'size':>10s} {'calls':>5s}  " + "  ".join(f"{name + ' ' + place:>24s}" for name in BACKENDS
                                                          for place in ("oop", "ip")) + "  mpich/hier oop  ip")
    rows = []
    for nbytes in sizes:
        row, iters = measure(world, calls, nbytes, args)
        split = components(world, hierarchical, nbytes)
        rows.append({"size": nbytes, "calls_per_batch": iters, "backends": row, "components": split})
        if rank0:
            mpich, hier = row["mpich"], row["hierarchical"]
            print(f"  {nbytes:10d} {iters:5d}  " + "  ".join(f"{row[name][place]:24.1f}" for name in BACKENDS
                                                           for place in ("out_of_place", "in_place"))
                  + f"  {mpich['out_of_place'] / hier['out_of_place']:14.2f}"
                  + f" {mpich['in_place'] / hier['in_place']:4.2f}",
                  flush=True)
    wrong = sum(r["backends"][name]["wrong"] for r in rows for name in BACKENDS)
    if rank0:
        print(f"# wrong results: {wrong}")
        for r in rows:
            c = r["components"]
            if c.get("compiled"):
                print(f"# hierarchical at {r['size']} B: one compiled call (across.py), {c['total']:.0f} µs")
                continue
            print(f"# hierarchical at {r['size']} B, one call split: inside nodes {c['inside_nodes']:.0f} µs, "
                  f"MPI exchanges {c['exchanges']:.0f} µs, folds across nodes {c['folds_across']:.0f} µs "
                  f"(total {c['total']:.0f} µs)")
    if rank0 and args.output_file:
        report = {"collective": "allreduce", "dtype": "float32", "op": "sum", "nodes": [list(n) for n in nodes],
                  "environment": environment("host", world.Get_size(),
                                             ["hierarchical", "mpi", "ours"]),
                  "rows": rows}
        cli.write_json(args.output_file, report)
    hierarchical.close()
    one_node.close()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
