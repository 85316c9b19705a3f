"""Per-call cost of a small collective with one rank per process: GPU ranks
(emulated devices, or GPUs) against host ranks, side by side in one run.

    python -m bench.spmd_overhead [--ranks 2] [--device emulated] [--bytes 1K] [--collective allreduce]

Each process makes three communicators, `init(device="host")`,
`init(device=DEVICE)` (the step protocol) and the same with
COLLECTIVES_ONE_KERNEL_ALLREDUCE=1 ("DEVICE+ll": small collectives as one
kernel, executors/ll_collectives.py), and times batches of calls (allreduce,
or --collective; broadcast and reduce from root 0) on each in turn
(alternating, so that the machine's noise hits all alike); it
prints the median time per call of each, their ratio, and the host round
trips a call makes: peer waits (a poll of a peer's counter), kernel
launches, and event polls until each launch is done. For the one-kernel
path it also prints the host's time to issue a call ("issue us/call"): on
a GPU that is what the caller waits for, the kernel runs behind it; on the
emulated device the kernels run at synchronize() there. With --symmetric the
DEVICE+ll ranks' arrays come from comm.alloc, so a call beyond 64 KiB runs
on symmetric memory (three launches, no host wait). Without a launcher it relaunches itself
under mpiexec with --ranks processes, pinned one per core (-bind-to core).
"""

import os
import statistics
import sys

import numpy as np

import collectives
from bench import cli
from collectives.algorithms.schedule import COLLECTIVES
from collectives.config import ONE_KERNEL_ALLREDUCE_ENV
from bench.harness import adding_calls, environment, mpi_world, relaunch_once, seconds_per_call, slowest


def parse_args(argv=None):
    p = cli.Parser(prog="python -m bench.spmd_overhead", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="processes, when not already under mpiexec")
    p.add_argument("--device", default="emulated", choices=["emulated", "cuda"], help="the GPU ranks' device, timed against host ranks")
    p.add_argument("--bytes", default="1K", type=cli.size, help="message size (suffixes K, M)")
    p.add_argument("--algorithm", default="auto", help="auto or a registered algorithm")
    p.add_argument("--collective", default="allreduce", choices=COLLECTIVES,
                   help="the collective timed (--bytes: each rank's x)")
    p.add_argument("--in-place", action="store_true", help="in place (else out of place)")
    p.add_argument("--symmetric", action="store_true",
                   help="the DEVICE+ll ranks' arrays from comm.alloc (symmetric memory): calls beyond 64 KiB "
                        "run as barrier, step kernel, barrier (executors/symmetric.py)")
    p.add_argument("--batches", type=int, default=30, help="batches per communicator, alternating")
    p.add_argument("--calls", type=int, default=200, help="calls per batch")
    p.add_argument("-J", "--output_file", help="write the results as JSON here (default: no file)")
    args = p.parse_args(argv)
    cli.require_device_toolchain(p.prog, args.device)
    args.nbytes = cli.parse_size(args.bytes)
    args.launcher_flags = ["-bind-to", "core"]
    return args


def call(comm, collective, x, out, algorithm):
    """One call of the collective timed, as every rank makes it (each of
    COLLECTIVES is a method of that name, taking out= and algorithm=)."""
    return getattr(comm, collective)(x, out=out, algorithm=algorithm)


# The device's calls that each make a host round trip: a launch, or an
# event poll until a launch is done.
DEVICE_TRIPS = {"launch_step": "launches", "launch_ll_allreduce": "launches", "launch_ll_barrier": "launches",
                "launch_copies": "launches", "query": "event polls"}


def round_trips(comm, collective, x, out, algorithm):
    """Host round trips of one call, counted on an instrumented copy of the
    communicator's rank (outside the timed batches)."""
    ranks = comm._ranks  # noqa: SLF001 - the benchmark looks inside on purpose
    counts = {"peer waits": 0, "launches": 0, "event polls": 0}
    group = ranks.group
    device = getattr(ranks, "device", None)
    group._wait_for = adding_calls(group._wait_for, counts, "peer waits")  # noqa: SLF001
    if device is not None:
        for name, key in DEVICE_TRIPS.items():
            setattr(device, name, adding_calls(getattr(device, name), counts, key))
    compiled = getattr(ranks, "compiled", None)   # host ranks' compiled executor waits in C: its own count
    waited_in_c = compiled.waits_made if compiled is not None else 0
    try:
        call(comm, collective, x, out, algorithm)
        if compiled is not None:
            counts["peer waits"] += compiled.waits_made - waited_in_c
    finally:
        del group._wait_for  # noqa: SLF001 - the instance attributes go, the methods stay
        if device is not None:
            for name in DEVICE_TRIPS:
                delattr(device, name)
    return counts


def issue_time(comm, collective, x, out, algorithm, calls):
    """Host seconds per call to issue `calls` one-kernel calls, the
    kernels left queued (the emulated device runs them at synchronize, as a
    GPU runs them behind the host)."""
    device = comm._ranks.device  # noqa: SLF001
    deferred = getattr(device, "call_returned", None)
    device.call_returned = lambda: None
    try:
        seconds = seconds_per_call(call, calls, comm, collective, x, out, algorithm)
    finally:
        del device.call_returned
    comm.synchronize()
    assert deferred is not None
    return seconds


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    # The same plan on both kinds of ranks: host ranks' compiled allreduce
    # (transport/fastpath.py) would run no plan at all.
    os.environ["COLLECTIVES_FAST_PATH"] = "0"
    world = mpi_world()
    if world is None:
        return relaunch_once(args, argv, args.launcher_flags)
    leader = world.rank == 0
    host = collectives.init(comm=world)
    gpu = collectives.init(comm=world, device=args.device)
    os.environ[ONE_KERNEL_ALLREDUCE_ENV] = "1"   # read when the communicator is made
    one_kernel = collectives.init(comm=world, device=args.device)
    del os.environ[ONE_KERNEL_ALLREDUCE_ENV]
    count = max(1, args.nbytes // 4)
    n = world.size
    if args.collective == "reduce_scatter":
        count = -(-count // n) * n   # n equal blocks
    # Elements of `out` (unused in place).
    out_count = {"reduce_scatter": count // n, "allgather": n * count}.get(args.collective, count)
    arrays = {}
    for name, comm in (("host", host), (args.device, gpu), (f"{args.device}+ll", one_kernel)):
        xp = np
        if name.startswith("cuda"):
            import cupy as xp
        empty = (lambda k: comm.alloc(k, "float32")) if args.symmetric and name.endswith("+ll") else \
            (lambda k, xp=xp: xp.empty(k, xp.float32))
        x = empty(count)
        x[...] = 1
        out = None if args.in_place else empty(out_count)
        if args.in_place and args.collective == "allgather":   # x is this rank's block of out
            out = empty(n * count)
            x = out[world.rank * count:(world.rank + 1) * count]
            x[:] = 1
        arrays[name] = (comm, x, out)
    samples = {name: [] for name in arrays}
    for name, (comm, x, out) in arrays.items():   # warm up: plans, kernels, workspaces
        for _ in range(args.calls):
            call(comm, args.collective, x, out, args.algorithm)
    for _ in range(args.batches):
        for name, (comm, x, out) in arrays.items():
            samples[name].append(seconds_per_call(call, args.calls, comm, args.collective, x, out, args.algorithm,
                                                  before=comm.barrier, after=comm.synchronize))
    # Per batch the slowest rank's time (a collective is as slow as its last rank), then the median.
    medians = {name: statistics.median([slowest(world, t) for t in times])
               for name, times in samples.items()}
    trips = {name: round_trips(comm, args.collective, x, out, args.algorithm)
             for name, (comm, x, out) in arrays.items()}
    ll_name = f"{args.device}+ll"
    ll_comm, ll_x, ll_out = arrays[ll_name]
    issue = [slowest(world, issue_time(ll_comm, args.collective, ll_x, ll_out, args.algorithm, args.calls))
             for _ in range(args.batches)]
    issue_us = statistics.median(issue) * 1e6
    plan = next(iter(host._plans.values()))  # noqa: SLF001
    if leader:
        place = "in place" if args.in_place else "out of place"
        print(f"# {args.collective} of {args.nbytes} B float32 ({place}), {world.size} processes, algorithm "
              f"{plan.algorithm}, {args.batches} alternating batches of {args.calls} calls")
        print(f"# {'ranks':>10s}  {'median us/call':>14s}  {'vs host':>7s}  host round trips per call (rank 0)")
        for name in samples:
            print(f"  {name:>10s}  {medians[name] * 1e6:14.1f}  {medians[name] / medians['host']:6.2f}x  "
                  + ", ".join(f"{k} {v}" for k, v in trips[name].items()))
        print(f"# {ll_name}: issue us/call (host time, kernels left queued) {issue_us:.1f}")
    if args.output_file and leader:
        report = {"benchmark": "spmd_overhead", "collective": args.collective, "bytes": args.nbytes,
                  "in_place": args.in_place, "symmetric": args.symmetric,
                  "algorithm": plan.algorithm, "phases": len(plan.phases),
                  # the phases rank 0 runs rows in (an empty one launches nothing: a
                  # process's plan keeps its last phase, empty or not, binding.bind)
                  "phases_with_rows": sum(1 for phase in plan.phases if len(phase.rows_by_rank[0])),
                  "environment": environment(args.device, world.size, ["host", args.device]),
                  "median_us_per_call": {k: v * 1e6 for k, v in medians.items()},
                  "ratio_to_host": {k: v / medians["host"] for k, v in medians.items()},
                  "round_trips_per_call": trips,
                  "one_kernel_issue_us_per_call": issue_us,
                  "samples_us": {k: [t * 1e6 for t in v] for k, v in samples.items()}}
        cli.write_json(args.output_file, report)
    one_kernel.close()
    gpu.close()
    host.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
