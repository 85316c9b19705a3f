"""Small calls one at a time: the spread of a call's time, ours against MPICH's.

    mpiexec -n 4 python -m bench.call_percentiles [--sizes 1K,16K] [--calls 100] [-J FILE]
    python -m bench.hosts mpiexec --dir D -- -hosts h0:2,h1:2 -n 4 python -m bench.call_percentiles

The harness (bench/harness.py) times batches between barriers and reports
a batch's mean: on a loaded machine one rank descheduled for a few ms
inside a batch moves its mean by that over the calls, and the mean cannot
tell a fixed cost in every call from a rare stall. Here each sample is
--per-sample calls of one library (after two untimed ones), its time the
slowest rank's mean, and the libraries take turns sample by sample in the
same processes (ours: collectives.init(); MPICH: mpi4py's calls on
COMM_WORLD), float32 sum, root 0, out of place. Printed per collective and
size: p10, p50 and p90 of the samples, MPICH/ours of the p50s, and the CPU
time per call of all ranks together (time.process_time: what a rank burns
spinning is a core its peers lack where ranks outnumber cores). No result
is checked here (the harness's tools do that).
"""

import sys
import time

import numpy as np

from bench import cli
from bench.environment import environment
from bench.harness import abort_on_uncaught_exceptions, seconds_per_call, slowest

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")
LIBRARIES = ("ours", "mpich")


def calls(comm, world, collective, x, y):
    """The collective's call of each library on x into y."""
    return {"ours": {"allreduce": lambda: comm.allreduce(x, out=y), "reduce": lambda: comm.reduce(x, out=y, root=0),
                     "broadcast": lambda: comm.broadcast(x, out=y, root=0),
                     "allgather": lambda: comm.allgather(x, out=y),
                     "reduce_scatter": lambda: comm.reduce_scatter(x, out=y)}[collective],
            "mpich": {"allreduce": lambda: world.Allreduce(x, y), "reduce": lambda: world.Reduce(x, y, root=0),
                      "broadcast": lambda: world.Bcast(y, root=0), "allgather": lambda: world.Allgather(x, y),
                      "reduce_scatter": lambda: world.Reduce_scatter_block(x, y)}[collective]}


def measure(comm, world, collective, nbytes, args):
    count, n = nbytes // 4, world.size
    x = np.ones(count, np.float32)
    y = np.empty({"allgather": count * n, "reduce_scatter": count // n}.get(collective, count), np.float32)
    run = calls(comm, world, collective, x, y)
    samples, cpu = {lib: [] for lib in LIBRARIES}, {lib: 0.0 for lib in LIBRARIES}
    for lib in LIBRARIES:
        for _ in range(10):
            run[lib]()
    for _ in range(args.calls):
        for lib in LIBRARIES:
            run[lib]()
            run[lib]()
            cpu_start = time.process_time()
            seconds = seconds_per_call(run[lib], args.per_sample)
            cpu[lib] += time.process_time() - cpu_start
            samples[lib].append(slowest(world, seconds))
    every_cpu = world.gather(cpu, root=0)
    if world.rank != 0:
        return None
    row = {"collective": collective, "size": nbytes}
    for lib in LIBRARIES:
        us = np.array(samples[lib]) * 1e6
        row[lib] = {"p10_us": float(np.percentile(us, 10)), "p50_us": float(np.percentile(us, 50)),
                    "p90_us": float(np.percentile(us, 90)), "samples_us": us.tolist(),
                    "cpu_us_per_call": sum(c[lib] for c in every_cpu) / (args.calls * args.per_sample) * 1e6}
    return row


def main(argv=None):
    p = cli.Parser(prog="python -m bench.call_percentiles", description=__doc__.splitlines()[0],
                   epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--collectives", default=",".join(COLLECTIVES), help="comma-separated")
    p.add_argument("--sizes", default="1K,16K", type=cli.sizes, help="bytes, comma-separated, suffixes K M")
    p.add_argument("--calls", type=int, default=100, help="samples per library, collective and size")
    p.add_argument("--per-sample", type=int, default=4, help="timed calls per sample")
    p.add_argument("-J", "--output_file", default=None, help="write the rows as JSON here (default: no file)")
    args = p.parse_args(argv)
    collective_list = cli.names(p, "--collectives", args.collectives, COLLECTIVES)
    from mpi4py import MPI

    import collectives
    world = MPI.COMM_WORLD
    abort_on_uncaught_exceptions(world)
    comm = collectives.init()
    rows = []
    for collective in collective_list:
        for nbytes in (cli.parse_size(s) for s in args.sizes.split(",")):
            row = measure(comm, world, collective, nbytes, args)
            if row is not None:
                rows.append(row)
                o, m = row["ours"], row["mpich"]
                print(f"{collective:15s} {nbytes:>8d} B  ours p10/p50/p90 {o['p10_us']:7.1f}/{o['p50_us']:7.1f}/"
                      f"{o['p90_us']:7.1f}  MPICH {m['p10_us']:7.1f}/{m['p50_us']:7.1f}/{m['p90_us']:7.1f} us  "
                      f"MPICH/ours {m['p50_us'] / o['p50_us']:6.3f}x  CPU/call {o['cpu_us_per_call']:.0f} / "
                      f"{m['cpu_us_per_call']:.0f} us", flush=True)
    if world.rank == 0 and args.output_file:
        cli.write_json(args.output_file, {"environment": environment("host", world.size, list(LIBRARIES)), "rows": rows},
                       say=None)
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
