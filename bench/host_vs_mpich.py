"""Allreduce float32 sum: our host ranks against MPICH, one rank per process.

    python -m bench.host_vs_mpich --ranks 2,4

For each process count in --ranks this launches MPICH's mpiexec (the one
beside this Python) with `-bind-to BIND -n N`, and every process runs both
libraries on its own buffers:

    ours    comm = collectives.init();  comm.allreduce(x, out=y)  and  comm.allreduce(x)
    MPICH   MPI.COMM_WORLD.Allreduce(x, y)  and  Allreduce(MPI.IN_PLACE, x)   (mpi4py)

Method, per size and placement (out of place, then in place):
  * check: one call of each library on fresh inputs (rank r's element i is
    (i mod 3) + r + 1); every element of every rank's result must equal the
    exact sum, else the size is reported WRONG and the run exits 1;
  * iterations: each library is warmed up by batches of 1, 2, 4, ... calls
    until a batch takes a quarter of --budget; its batches then make
    budget / (least time per call of those) calls, within [--min-iters,
    --max-iters], the same count on every rank (small sizes get thousands
    of calls, 64 MiB a few);
  * batches: --batches rounds of (ours, MPICH), alternating in the same
    processes, so the machine's noise hits both alike. A batch starts with
    the library's barrier and ends with it; the barrier is outside the
    per-call times but inside the batch's mean. Every call is timed on every
    rank; a call's time is its slowest rank's, a batch's median is the
    median of its calls' times, and the table shows the median of the batch
    medians. In place, the timed buffers hold zeros (repeated in-place sums
    of the check data would overflow to inf); out of place they hold the
    check data.

The table: size, then per placement ours µs, MPICH µs and MPICH/ours (above
1: ours is faster). The JSON (written where -J says; the committed runs are
under bench/results/) has the machine, the exact command, each launch's
mpiexec line and every rank's CPU affinity, and every batch of every size.

Noise: the other processes on the machine are the largest error. Each
run records how many cores other processes kept busy meanwhile
(other_processes_cores, from /proc) and says so when it is a quarter of a
core or more; alternating batches keeps that noise from favouring either
library, but not from moving both. Where the median and the mean time per
call rank the libraries differently at some size, the run says so too.

Pinning (--bind-to, passed to mpiexec as -bind-to). `core` puts rank r on
core r mod cores: 4 processes on 2 cores stack ranks 0,2 on core 0 and 1,3 on
core 1; `none` leaves placement to the kernel; `user:0,0,1,1` (hydra's
syntax) stacks ranks 0,1 and 2,3. The default, `auto`, is `core` while every
process has a core (processes <= os.cpu_count(), the library's own test for
oversubscription) and `none` beyond. On the 2-core machine, 4 processes,
back to back, before the compiled loop (bench/results/
host_vs_mpich_4proc_bind_{none,core}.json; µs, ours / MPICH, out of place):

    4 processes     4 B           16 KiB        1 MiB          64 MiB
    -bind-to none   209 / 14      864 / 101     3342 / 1885    106382 / 151256
    -bind-to core   3333 / 2343   2302 / 2179   6780 / 7509    136759 / 194477

Pinned, two ranks that share a core wait for each other's time slice (both
libraries poll, then yield): a small call costs milliseconds, for MPICH as
for ours, and MPICH loses more than ours, so pinning 4 processes flatters
ours. Unpinned, the kernel runs whichever rank is ready on whichever core is
free: small messages got 3x to 16x (ours) and 20x to 170x (MPICH) faster,
and no size more than 6% slower (ours at 256 KiB). user:0,0,1,1 measured
like core. When other processes hold a core (1 core or more busy), 4 ranks
on what is left take a time slice per small call (~2.8 ms) however they are
placed, and pinning made no consistent difference. With 2 processes, `core`
was never slower, and under such load unpinned ranks were (ours 171 µs a
small call against 31 µs pinned, before the compiled loop; MPICH unmoved).
Each run records every rank's CPU affinity.

Under mpiexec already (`mpiexec -n 4 python -m bench.host_vs_mpich`) it runs
once on those processes and rank 0 prints and writes the same report.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

import collectives
from bench import cli
from bench.all_reduce_perf import expected, fill
from bench.environment import LAUNCHER_COMMAND, environment
from bench.harness import bind_to, count_wrong, find_mpiexec, mpi_world

OURS, MPICH = "ours", "mpich"
BACKENDS = (OURS, MPICH)
PLACEMENTS = ("out_of_place", "in_place")
SIZES = "4,1K,16K,256K,1M,4M,16M,64M"
QUICK_SIZES = "4,64K"
MODULE = "bench.host_vs_mpich"
DTYPE = np.float32
OP = "sum"


def parse_args(argv=None):
    p = cli.Parser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0],
                   epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--ranks", default="2,4",
                   help="process counts, comma-separated: one mpiexec launch each (ignored under mpiexec)")
    p.add_argument("--sizes", default=None, type=cli.sizes,
                   help=f"message sizes in bytes per rank, comma-separated, suffixes K M G (default {SIZES}; "
                        f"--quick: {QUICK_SIZES})")
    p.add_argument("--bind-to", default="auto",
                   help="mpiexec's -bind-to: auto (the default: core while the processes have a core each, "
                        "none beyond), core (rank r on core r mod cores), none, hwthread, or hydra's "
                        "user:C0,C1,... (ignored under mpiexec)")
    p.add_argument("--batches", type=int, default=None,
                   help="timed batches per library, per size and placement, alternating (default 10; --quick 2)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds a batch aims at; the calls per batch follow from it (default 0.1; --quick 0.005)")
    p.add_argument("--min-iters", type=int, default=None, help="calls per batch at least (default 5; --quick 2)")
    p.add_argument("--max-iters", type=int, default=None, help="calls per batch at most (default 20000; --quick 200)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: sizes {QUICK_SIZES}, 2 tiny batches")
    p.add_argument("-J", "--output_file", default=None, help="write the JSON report here (default: no file)")
    p.add_argument("--timeout", type=float, default=None, help="our communicator's timeout in seconds")
    p.add_argument("--worker-output", default=None, help=argparse.SUPPRESS)  # a launch's rank 0 writes its run here
    args = p.parse_args(argv)
    quick = args.quick
    defaults = {"sizes": QUICK_SIZES if quick else SIZES, "batches": 2 if quick else 10,
                "budget": 0.005 if quick else 0.1, "min_iters": 2 if quick else 5,
                "max_iters": 200 if quick else 20000}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    try:
        args.size_list = [cli.parse_size(s) for s in args.sizes.split(",") if s.strip()]
        args.rank_list = [int(r) for r in args.ranks.split(",") if r.strip()]
    except ValueError as error:
        p.error(f"--sizes and --ranks are comma-separated numbers: {error}")
    itemsize = np.dtype(DTYPE).itemsize
    if not args.size_list or any(s < itemsize or s % itemsize for s in args.size_list):
        p.error(f"--sizes: each a positive multiple of {itemsize} B (float32)")
    if not args.rank_list or any(r < 2 for r in args.rank_list):
        p.error("--ranks: process counts of at least 2")
    if args.batches < 1 or args.budget <= 0 or not 1 <= args.min_iters <= args.max_iters:
        p.error("need --batches >= 1, --budget > 0 and 1 <= --min-iters <= --max-iters")
    return args


def size_label(nbytes):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


# -- one launch: every rank runs this --------------------------------------------------

class Libraries:
    """The two libraries on this process's rank: a call of each, on buffers it owns."""

    def __init__(self, world, timeout):
        from mpi4py import MPI
        self.MPI, self.world = MPI, world
        self.ours = collectives.init(timeout=timeout)   # MPI.COMM_WORLD's processes, as a user writes it
        self.rank, self.nranks = world.rank, world.size

    def buffers(self, count, placement, data):
        """(x, y): y is None in place. data: "check" (the closed-form inputs) or "zeros"."""
        x = fill(DTYPE, OP, self.nranks, self.rank, count) if data == "check" else np.zeros(count, DTYPE)
        y = np.zeros(count, DTYPE) if placement == "out_of_place" else None  # zeros: its pages touched now
        return x, y

    def call(self, backend, x, y):
        """A call of no arguments: the library's allreduce, sum, of x into y (in place: into x)."""
        if backend == OURS:
            comm = self.ours
            if y is None:
                return lambda: comm.allreduce(x)
            return lambda: comm.allreduce(x, out=y)
        world, MPI, SUM = self.world, self.MPI, self.MPI.SUM
        if y is None:
            return lambda: world.Allreduce(MPI.IN_PLACE, x, op=SUM)
        return lambda: world.Allreduce(x, y, op=SUM)

    def barrier(self, backend):
        return self.ours.barrier if backend == OURS else self.world.Barrier

    def max_over_ranks(self, value):
        return self.world.allreduce(value, op=self.MPI.MAX)

    def close(self):
        self.ours.close()


def check(libs, backend, placement, count):
    """Wrong elements over every rank after one call on fresh check inputs."""
    x, y = libs.buffers(count, placement, "check")
    libs.call(backend, x, y)()
    result = x if y is None else y
    wrong = count_wrong(result, expected(DTYPE, OP, libs.nranks, libs.rank, count))
    return libs.world.allreduce(wrong)


def iterations(libs, call, barrier, args):
    """Warm-up, and the calls a batch makes: batches of 1, 2, 4, ... calls
    until one takes budget / 4 (the slowest rank's), then budget over the
    time per call, the least any of these batches took: one stalled batch
    (another process had the core) would otherwise leave every batch of
    this size a few calls. Every rank reaches the same number (the times are
    agreed through MPI)."""
    k, per_call = 1, math.inf
    while True:
        barrier()
        start = time.perf_counter()
        for _ in range(k):
            call()
        barrier()
        took = libs.max_over_ranks(time.perf_counter() - start)
        per_call = min(per_call, took / k)
        if took >= args.budget / 4 or k >= args.max_iters:
            break
        k *= 2
    return max(args.min_iters, min(args.max_iters, math.ceil(args.budget / max(per_call, 1e-9))))


def timed_batch(libs, call, barrier, iters):
    """One batch of `iters` calls, every call timed on every rank: the median
    over calls of the slowest rank's time, the slowest rank's mean including
    the closing barrier, and each rank's own median (µs)."""
    stamps = np.empty(iters + 1)
    clock = time.perf_counter
    barrier()
    for i in range(iters):
        stamps[i] = clock()
        call()
    stamps[iters] = clock()
    barrier()
    mean = (clock() - stamps[0]) / iters
    every = libs.world.gather(np.diff(stamps), root=0)
    mean = libs.max_over_ranks(mean)
    if libs.rank != 0:
        return None
    every = np.stack(every)
    slowest = every.max(axis=0)
    return {"iters": iters, "median_us": float(np.median(slowest)) * 1e6, "mean_us": mean * 1e6,
            "p90_us": float(np.percentile(slowest, 90)) * 1e6,
            "rank_median_us": [float(m) * 1e6 for m in np.median(every, axis=1)]}


def measure_size(libs, nbytes, args):
    """One row: per placement, per library, its check, calls per batch, batches and median."""
    count = nbytes // np.dtype(DTYPE).itemsize
    row = {"size": nbytes, "count": count}
    for placement in PLACEMENTS:
        wrong = {b: check(libs, b, placement, count) for b in BACKENDS}
        data = "zeros" if placement == "in_place" else "check"
        calls, barriers, iters, batches = {}, {}, {}, {b: [] for b in BACKENDS}
        held = []
        for b in BACKENDS:
            x, y = libs.buffers(count, placement, data)
            held.append((x, y))
            calls[b], barriers[b] = libs.call(b, x, y), libs.barrier(b)
            iters[b] = iterations(libs, calls[b], barriers[b], args)
        for _ in range(args.batches):
            for b in BACKENDS:  # ours, MPICH, ours, MPICH, ...
                batches[b].append(timed_batch(libs, calls[b], barriers[b], iters[b]))
        del held
        if libs.rank == 0:
            row[placement] = {
                b: {"time_us": statistics.median(s["median_us"] for s in batches[b]),
                    "mean_us": statistics.median(s["mean_us"] for s in batches[b]),
                    "iters": iters[b], "wrong": wrong[b], "batches": batches[b]}
                for b in BACKENDS}
    return row


HEADER = ("#             -------------- out of place ---------------  ---------------- in place -----------------\n"
          "#     size    ours (µs)   MPICH (µs)  MPICH/ours           ours (µs)   MPICH (µs)  MPICH/ours")


def ratio(row, placement):
    r = row[placement]
    return r[MPICH]["time_us"] / r[OURS]["time_us"]


def format_row(row):
    cells = f"{size_label(row['size']):>10s}"
    for placement in PLACEMENTS:
        r = row[placement]
        cells += f"  {r[OURS]['time_us']:11.1f}  {r[MPICH]['time_us']:11.1f}  {ratio(row, placement):9.2f}x"
        wrong = r[OURS]["wrong"] + r[MPICH]["wrong"]
        cells += f" {'WRONG' if wrong else '':>7s}"
    return cells


def cpu_ticks(pids):
    """(wall seconds, CPU ticks the machine spent busy, ticks these processes
    spent), from /proc; None where there is no /proc or a rank is elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)   # less idle and iowait
        ours = 0
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
            ours += int(stat[11]) + int(stat[12])   # utime, stime
    except (OSError, ValueError, IndexError):
        return None
    return time.perf_counter(), busy, ours


def other_processes_cores(before, after):
    """Cores that processes other than the ranks kept busy, on average,
    between two cpu_ticks (None if either is missing)."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    others = (after[1] - before[1]) - (after[2] - before[2])
    return max(0.0, others / hz / (after[0] - before[0]))


def run_launch(args, world):
    """Every rank: the whole sweep. Rank 0 returns the run (else None)."""
    libs = Libraries(world, args.timeout)
    leader = libs.rank == 0
    affinity = world.gather(sorted(os.sched_getaffinity(0)), root=0)
    if leader:
        binding = os.environ.get("COLLECTIVES_BIND_TO", "as launched")
        print(f"# allreduce float32 sum, {libs.nranks} processes, -bind-to {binding}: ours (collectives.init) and "
              f"MPICH (mpi4py), {args.batches} batches each, alternating, ~{args.budget * 1e3:g} ms a batch; "
              "median of batch medians", flush=True)
        print(f"# CPU affinity per rank: {affinity}", flush=True)
        print(HEADER, flush=True)
    load_before = os.getloadavg()
    pids = world.gather(os.getpid(), root=0)
    cpu_before = cpu_ticks(pids) if leader else None
    rows = []
    for nbytes in args.size_list:
        row = measure_size(libs, nbytes, args)
        if leader:
            rows.append(row)
            print(format_row(row), flush=True)
    cpu_after = cpu_ticks(pids) if leader else None   # before close: every rank is still there
    libs.close()
    if not leader:
        return None
    env = environment(argparse.Namespace(device="host"), libs.nranks, list(BACKENDS))
    launch = env.pop("command").split(" --worker-output ")[0]  # the report's own temporary file
    return {"processes": libs.nranks, "bind_to": os.environ.get("COLLECTIVES_BIND_TO", "as launched"),
            "affinity": affinity,
            "launch": launch, "environment": env,
            "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
            "other_processes_cores": other_processes_cores(cpu_before, cpu_after), "rows": rows}


# -- the report --------------------------------------------------------------------------

def busy_note(run):
    """A warning when other processes kept the machine's cores busy during
    the run (a quarter of a core or more, on average), or None."""
    others = run.get("other_processes_cores")
    if others is None or others < 0.25:
        return None
    return (f"other processes kept {others:.1f} of the {run['environment'].get('cores')} cores busy during the "
            "run: the times are noisier than on an idle machine (other_processes_cores in the JSON)")


def verdict(run):
    """Sizes where MPICH was at least as fast as ours, per placement."""
    slower = {p: [size_label(r["size"]) for r in run["rows"] if ratio(r, p) <= 1] for p in PLACEMENTS}
    wrong = [size_label(r["size"]) for r in run["rows"]
             if any(r[p][b]["wrong"] for p in PLACEMENTS for b in BACKENDS)]
    return slower, wrong


def summary_lines(run):
    slower, wrong = verdict(run)
    n = run["processes"]
    lines = []
    busy = busy_note(run)
    if busy:
        lines.append(f"# {n} processes: {busy}")
    if not any(slower.values()):
        lines.append(f"# {n} processes: ours faster than MPICH at every size, out of place and in place")
    else:
        lines.append(f"# {n} processes: ours NOT faster at every size; MPICH as fast or faster at: "
                     f"out of place {', '.join(slower['out_of_place']) or '-'}; "
                     f"in place {', '.join(slower['in_place']) or '-'}")
    split = [f"{size_label(r['size'])} {p.replace('_', ' ')}" for r in run["rows"] for p in PLACEMENTS
             if (ratio(r, p) > 1) != (r[p][MPICH]["mean_us"] > r[p][OURS]["mean_us"])]
    if split:  # e.g. ranks sharing a core: half the calls wait a time slice, the median lands on either side
        lines.append(f"# {n} processes: the mean time per call (mean_us in the JSON) ranks the libraries the other "
                     f"way at {', '.join(split)}")
    lines.append(f"# {n} processes: " + (f"WRONG results at {', '.join(wrong)}" if wrong else
                                         "every element of every result equals the expected sum (both libraries)"))
    return lines


def write_report(args, runs, command):
    if not args.output_file:
        return
    machine = {k: v for k, v in runs[0]["environment"].items() if k not in ("ranks", "processes", "backends")}
    report = {
        "benchmark": "allreduce float32 sum, ours (collectives.init host ranks) vs MPICH (mpi4py), "
                     "one rank per process",
        "command": command,
        "python_executable": os.path.basename(sys.executable),
        "machine": machine,
        "method": {"sizes": args.size_list, "batches": args.batches, "budget_seconds": args.budget,
                   "min_iters": args.min_iters, "max_iters": args.max_iters, "bind_to": args.bind_to,
                   "time_us": "median over batches of the batch median; a batch median is the median over its "
                              "calls of the slowest rank's time for that call",
                   "mean_us": "median over batches of the slowest rank's batch time (closing barrier included) "
                              "over its calls",
                   "in_place_data": "zeros (the check runs on (i mod 3) + rank + 1 first)",
                   "out_of_place_data": "(i mod 3) + rank + 1"},
        "runs": runs,
    }
    path = Path(args.output_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"# wrote {path}", flush=True)


def launch(args, nranks, argv_run):
    """Run one mpiexec launch of `nranks` processes; its run, or None if it failed."""
    mpiexec = find_mpiexec()
    binding = bind_to(args.bind_to, nranks)
    flags = ["-bind-to", binding]
    fd, out = tempfile.mkstemp(prefix="host_vs_mpich_", suffix=".json")
    os.close(fd)
    command = [mpiexec, *flags, "-n", str(nranks), sys.executable, "-m", MODULE, *argv_run, "--worker-output", out]
    env = dict(os.environ, COLLECTIVES_BIND_TO=binding,
               **{LAUNCHER_COMMAND: " ".join(["mpiexec", *flags, "-n", str(nranks)])})
    try:
        code = subprocess.call(command, env=env)
        if code != 0:
            print(f"# the {nranks}-process launch failed (exit {code}): {' '.join(command)}", file=sys.stderr)
            return None
        with open(out) as f:
            return json.load(f)
    finally:
        os.unlink(out)


def worker_argv(args):
    """The options every launch's ranks run with (explicit, so the JSON says what ran)."""
    argv = ["--sizes", ",".join(str(s) for s in args.size_list), "--batches", str(args.batches),
            "--budget", repr(args.budget), "--min-iters", str(args.min_iters), "--max-iters", str(args.max_iters)]
    if args.timeout is not None:
        argv += ["--timeout", repr(args.timeout)]
    return argv


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    world = mpi_world()
    if world is not None:  # a rank of a launch: ours (--worker-output) or the user's own mpiexec
        try:
            run = run_launch(args, world)
        except BaseException:  # noqa: BLE001 - one rank's failure would leave the others waiting
            traceback.print_exc()
            sys.stderr.flush()
            world.Abort(1)
        if run is None:
            return 0
        if args.worker_output:
            Path(args.worker_output).write_text(json.dumps(run))
            return 0
        run["launch"] = " ".join([os.environ.get(LAUNCHER_COMMAND, f"mpiexec -n {run['processes']}"),
                                  "python", "-m", MODULE, *argv])
        for line in summary_lines(run):
            print(line)
        write_report(args, [run], run["launch"])
        return 1 if verdict(run)[1] else 0
    command = " ".join(["python", "-m", MODULE, *argv])
    print(f"# {command}", flush=True)
    runs = []
    for nranks in args.rank_list:
        run = launch(args, nranks, worker_argv(args))
        if run is None:
            return 2
        runs.append(run)
        print(flush=True)
    for run in runs:
        for line in summary_lines(run):
            print(line)
    write_report(args, runs, command)
    return 1 if any(verdict(run)[1] for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
