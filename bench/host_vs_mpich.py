"""Every collective on host ranks, one rank per process: ours against MPICH, Open MPI and Gloo.

    python -m bench.host_vs_mpich --ranks 2,4 [--mpi mpich,openmpi] [-J FILE]
    python -m bench.host_vs_mpich --hosts 2 --link 1gbit --ranks 4 [--compression bf16,int8] [-J FILE]

For each MPI in --mpi and each process count in --ranks this makes one
launch, with that MPI's launcher and `-bind-to BIND -n N` in its syntax
(bench/mpis.py): MPICH's mpiexec beside this Python, Open MPI's mpirun in
its own environment, .venv-openmpi, which the tool finds or makes (and says
which; one process can load one MPI library, so the two never share a
launch). Every process runs the collectives (allreduce, reduce_scatter,
allgather, broadcast, reduce, and the exchanges all_to_all, gather and
scatter; float32, sum, root 0) with the libraries of its launch on its own
buffers:

    ours      comm = collectives.init();  comm.allreduce(x, out=y), ...
    the MPI   MPI.COMM_WORLD.Allreduce(x, y), ...  (mpi4py over MPICH or Open MPI)
    Gloo      torch.distributed with the gloo backend on CPU tensors, its
              TCP store on 127.0.0.1 at a port rank 0 picks and MPI
              broadcasts (in the first MPI's launches only: --mpi's first)
    floor     the collectives that only move bytes (allgather, broadcast and
              the exchanges) from --floor-from (1 MiB): the memory-copy
              floor, every rank copying the bytes its result needs once from
              a private array, all at once (backends.CopyFloor); where
              ours and the MPI copy each byte once too, floor/ours is how
              near each comes to it (1: at the floor)

Ours runs in every launch: each MPI's ratio is against ours in the same
processes, alternating batch by batch.

It is a spec over the benchmark harness (bench/harness.py), the one the
per-collective tools (bench/<collective>_perf.py) run on, with their specs
(bench/specs.py):
the same inputs, checks, alternation and timing, the libraries as the
harness's backends ours, mpi (the launch's MPI), gloo and floor. What this
tool adds: every collective in one launch per MPI and process count, calls
per batch that follow the
size, the ratios, the noise on the machine, and one JSON for bench.report.

Method, per collective, size and placement:
  * calls per batch: --batch-bytes / size, within [--min-iters, --max-iters]
    (16 MiB a batch: 200 calls of 16 KiB, 16 of 1 MiB, 2 of 64 MiB), after
    -w untimed calls of each library;
  * rounds: --rounds rounds of (ours, the MPI, Gloo, the floor), alternating
    in the same processes, so the machine's noise hits them alike; each batch
    right after about 20 ms of untimed calls of its library
    (harness.warm_up): Gloo's blocking calls leave the cores idle, and the
    calls after an idle spell run slow for several ms, whoever makes them.
    A batch starts and ends with its library's barrier; its time per call
    is its slowest rank's mean. The table shows the median over rounds;
  * check: after the rounds, one call of each library on fresh inputs (the
    spec's closed form); every element of every rank's result must match it
    bit for bit, else the size is reported WRONG and the run exits 1.
  * placements: out of place and in place, every collective. MPI_Bcast and
    Gloo's broadcast and reduce have no separate output: out of place, they
    copy the input into the output first, as their users must.

The table: per collective and size, per placement, the time per call of
ours, the MPI and Gloo (µs) and theirs over ours (above 1: ours is
faster), then, where the floor ran, its time and floor/ours. The JSON (written only where -J says; the committed runs are under
bench/results/, digested by python -m bench.report) has the machine, the
library versions, the commit, the exact command, each launch's mpiexec line
and every rank's CPU affinity, and every round's time.

Noise: the other processes on the machine are the largest error. Each
collective's run records how many cores other processes kept busy meanwhile
(other_processes_cores, from /proc) and says so when it is a quarter of a
core or more; alternating keeps that noise from favouring one library, but
not from moving all three.

Pinning (--bind-to, passed to mpiexec as -bind-to). `core` puts rank r on
core r mod cores: 4 processes on 2 cores stack ranks 0,2 on core 0 and 1,3 on
core 1; `none` leaves placement to the kernel; `user:0,0,1,1` (hydra's
syntax) stacks ranks 0,1 and 2,3. MPICH's hydra needs no flag to run more
processes than cores; its waits yield every MPIR_CVAR_POLLS_BEFORE_YIELD
(1000) polls, ours spin less when the processes outnumber the cores, then
yield, then sleep on a futex (collectives/transport/shm_waits.h), Gloo's
block in the kernel. The default, `auto`, is `core` while every process has
a core (processes <= os.cpu_count(), the library's own test for
oversubscription) and `none` beyond. On the 2-core machine, 4 processes
of allreduce, back to back, before the compiled loop (bench/results/
host_vs_mpich_4proc_bind_{none,core}.json; µs, ours / MPICH, out of place):

    4 processes     4 B           16 KiB        1 MiB          64 MiB
    -bind-to none   209 / 14      864 / 101     3342 / 1885    106382 / 151256
    -bind-to core   3333 / 2343   2302 / 2179   6780 / 7509    136759 / 194477

Pinned, two ranks that share a core wait for each other's time slice: a
small call costs milliseconds, for MPICH as for ours. Unpinned, the kernel
runs whichever rank is ready on whichever core is free. Each run records
every rank's CPU affinity.

Across hosts (--hosts H, root): the tool makes H hosts on this machine
(bench/hosts.py: each its own network, UTS, IPC, PID and mount namespaces,
a private /dev/shm, one link to a bridge shaped by tc tbf to --link), runs
each launch with MPICH's mpiexec through them, as many ranks on each host,
unpinned unless --bind-to says otherwise (the hosts share this machine's
cores), and removes them afterwards, also when killed. Before each launch
one TCP stream from h0 to h1 measures the link; the table adds the link
floor per size: the bytes the busiest host must send (LINK_BYTES below)
over that rate, and link/ours, how near ours comes to it. --compression
adds ours compressed beside the allreduce (seeded normal inputs for every
library then, the codec's maxrel in the JSON; ours/compressed in the
table is the codec's speed-up).

Under mpiexec already (`mpiexec -n 4 python -m bench.host_vs_mpich`) it runs
once on those processes and rank 0 prints and writes the same report.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bench import cli, harness, hosts, mpis
from bench.backends import COPY_FLOOR, FLOOR_PIECES, GLOO, MPI_BACKEND, NO_COMPRESSION, OURS, make_backends
from bench.environment import BIND_TO, LAUNCHER_COMMAND, command_line, environment, library_settings
from bench.specs import SPECS

# The names the JSON (and bench.report) gives the libraries, and the tables.
NAMES = {"ours": "ours", mpis.MPICH: "MPICH", mpis.OPEN_MPI: "Open MPI", "gloo": "Gloo", "floor": "floor",
         "link": "link"}
NOT_LIBRARIES = ("ours", "floor", "link")   # a row's entries that are no library beside ours
FLOORED = tuple(FLOOR_PIECES)   # collectives whose every byte can be copied once: their floor is a copy
FLOOR_FROM = "1M"                      # measured from this size (below it a call's fixed cost dominates)
PLACEMENTS = ("out_of_place", "in_place")
SIZES = "1K,16K,256K,1M,4M,16M,64M"
QUICK_SIZES = "1K,64K"
MODULE = "bench.host_vs_mpich"
DTYPE, OP, ROOT = "float", "sum", 0
DEFAULTS = {"rounds": 5, "batch_bytes": "16M", "min_iters": 2, "max_iters": 200, "warmup": 2}
QUICK = {"rounds": 2, "batch_bytes": "64K", "min_iters": 1, "max_iters": 5, "warmup": 1}


def parse_args(argv=None):
    p = cli.Parser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0],
                   epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--mpi", default=mpis.MPICH,
                   help="the MPI libraries, comma-separated, each in launches of its own: mpich (mpiexec beside "
                        "this Python), openmpi (mpirun in .venv-openmpi, made if missing: bench/mpis.py)")
    p.add_argument("--ranks", default="2,4",
                   help="process counts, comma-separated: one launch each, per MPI (ignored under mpiexec)")
    p.add_argument("--collectives", default=",".join(SPECS),
                   help=f"comma-separated, from {', '.join(SPECS)}")
    p.add_argument("--sizes", default=None, type=cli.sizes,
                   help=f"message sizes in bytes, comma-separated, suffixes K M G, as the <collective>_perf tools "
                        f"count them (default {SIZES}; --quick: {QUICK_SIZES})")
    p.add_argument("--bind-to", default="auto",
                   help="mpiexec's -bind-to: auto (the default: core while the processes have a core each, "
                        "none beyond), core (rank r on core r mod cores), none, hwthread, or hydra's "
                        "user:C0,C1,... (ignored under mpiexec)")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"timed rounds of (ours, MPICH, Gloo) per size and placement; the time is their median "
                        f"(default {DEFAULTS['rounds']}; --quick {QUICK['rounds']})")
    p.add_argument("--batch-bytes", default=None, type=cli.size,
                   help=f"bytes a timed batch moves: its calls are this over the size (default "
                        f"{DEFAULTS['batch_bytes']}; --quick {QUICK['batch_bytes']})")
    p.add_argument("--min-iters", type=int, default=None,
                   help=f"calls per batch at least (default {DEFAULTS['min_iters']}; --quick {QUICK['min_iters']})")
    p.add_argument("--max-iters", type=int, default=None,
                   help=f"calls per batch at most (default {DEFAULTS['max_iters']}; --quick {QUICK['max_iters']})")
    p.add_argument("-w", "--warmup", type=int, default=None,
                   help=f"untimed calls of each library per size and placement first (default "
                        f"{DEFAULTS['warmup']}; --quick {QUICK['warmup']})")
    p.add_argument("--hosts", type=int, default=0,
                   help="run across this many hosts made on this machine (bench/hosts.py: network namespaces, "
                        "each host's link shaped to --link; needs root), the processes spread evenly; "
                        "the table adds the link floor (default 0: every process on this machine)")
    p.add_argument("--link", default="10gbit",
                   help="with --hosts: each host's link rate, tc's words (10gbit, 1gbit, 100mbit)")
    p.add_argument("--compression", default=NO_COMPRESSION,
                   help="comma-separated codecs (bf16, fp16, int8) our allreduce also runs with, beside the "
                        "uncompressed call; its results are checked against the codec's error bound")
    p.add_argument("--compute-between", type=float, default=0.0, metavar="MS",
                   help="MS milliseconds of compute before each timed call on every rank, the call alone timed, "
                        "no warm-up calls before a batch: a training step's collective, which comes after "
                        "compute (bench/harness.py; default 0: calls back to back after 20 ms of warm-up calls)")
    p.add_argument("--read-results", action="store_true",
                   help="after each call (warm-up calls too) every rank reads its outputs, untimed, the calls "
                        "timed one by one: a result a peer's core wrote is brought over by its reader "
                        "(bench/harness.py; default: calls back to back, outputs never read)")
    p.add_argument("--floor-from", default=FLOOR_FROM, type=cli.size,
                   help=f"time the memory-copy floor beside the calls of {', '.join(FLOORED)} of this size and larger")
    p.add_argument("--quick", action="store_true", help=f"smoke run: sizes {QUICK_SIZES}, 2 rounds of a few calls")
    p.add_argument("-J", "--output_file", default=None, help="write the JSON report here (default: no file)")
    p.add_argument("--timeout", type=float, default=None, help="our communicator's timeout in seconds")
    p.add_argument("--worker-output", default=None, help=argparse.SUPPRESS)  # a launch's rank 0 writes its run here
    p.add_argument("--no-gloo", action="store_true", help=argparse.SUPPRESS)  # launches after the first MPI's
    p.add_argument("--link-rate", type=float, default=None, help=argparse.SUPPRESS)  # bytes/s, measured before
    args = p.parse_args(argv)
    for name, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.sizes is None:
        args.sizes = QUICK_SIZES if args.quick else SIZES
    args.batch_bytes = cli.parse_size(args.batch_bytes)
    args.floor_from = cli.parse_size(args.floor_from)
    try:
        args.size_list = [cli.parse_size(s) for s in args.sizes.split(",") if s.strip()]
        args.rank_list = [int(r) for r in args.ranks.split(",") if r.strip()]
    except ValueError as error:
        p.error(f"--sizes and --ranks are comma-separated numbers: {error}")
    args.collective_list = cli.names(p, "--collectives", args.collectives, SPECS)
    args.mpi_list = cli.names(p, "--mpi", args.mpi, mpis.MPIS)
    if not args.size_list or any(s < 4 or s % 4 for s in args.size_list):
        p.error("--sizes: each a positive multiple of 4 B (float32)")
    if not args.rank_list or any(r < 2 for r in args.rank_list):
        p.error("--ranks: process counts of at least 2")
    if args.compute_between < 0:
        p.error("--compute-between must be >= 0")
    args.compression_list = [codec for codec in cli.names(p, "--compression", args.compression, harness.COMPRESSIONS)
                             if codec != NO_COMPRESSION]
    if args.hosts:
        if args.hosts < 2:
            p.error("--hosts: at least 2 (0: one machine)")
        if args.mpi_list != [mpis.MPICH]:
            p.error("--hosts: MPICH only (its mpiexec launches through the hosts' launcher; Open MPI's mpirun "
                    "does not here)")
        if any(r % args.hosts for r in args.rank_list):
            p.error(f"--ranks: with --hosts {args.hosts}, multiples of {args.hosts} (as many processes per host)")
        try:
            hosts.link_bits_per_second(args.link)   # its words are checked before anything is made
        except ValueError as error:
            p.error(str(error))
    if args.rounds < 1 or args.batch_bytes < 1 or args.warmup < 0 or not 1 <= args.min_iters <= args.max_iters:
        p.error("need --rounds >= 1, --batch-bytes >= 1, -w >= 0 and 1 <= --min-iters <= --max-iters")
    return args


# The link floor across H hosts of G ranks each: the bytes the busiest host
# must send over its link, at least, for a collective of `size` bytes (the
# size column), when nothing is reduced in the network. Summed over hosts,
# what they send is what they receive; every host must receive what it lacks:
#   allreduce       2 (H-1)/H size  (each host's share of the sum in, every sum out: Patarasuk and Yuan)
#   reduce_scatter    (H-1)/H size  (the partials of the other hosts' ranges)
#   allgather         (H-1)/H size  (the other hosts' rows)
#   broadcast             size      (the root's host sends every byte once)
#   reduce          size / (H-1)    (the root's host receives a partial of every byte)
#   all_to_all      G (H-1)/H size  (size is a rank's buffer: each of the host's ranks
#                                    sends the other hosts' blocks of it)
#   gather              size / H    (every other host sends its rows to the root's)
#   scatter           (H-1)/H size  (the root's host sends the other hosts' rows)
LINK_BYTES = {
    "allreduce": lambda size, h, g: 2 * size * (h - 1) / h,
    "reduce_scatter": lambda size, h, g: size * (h - 1) / h,
    "allgather": lambda size, h, g: size * (h - 1) / h,
    "broadcast": lambda size, h, g: size,
    "reduce": lambda size, h, g: size / (h - 1),
    "all_to_all": lambda size, h, g: g * size * (h - 1) / h,
    "gather": lambda size, h, g: size / h,
    "scatter": lambda size, h, g: size * (h - 1) / h,
}


def link_floor_us(collective, size, host_count, ranks_per_host, bytes_per_second):
    """The link floor's time in µs (see LINK_BYTES)."""
    return LINK_BYTES[collective](size, host_count, ranks_per_host) / bytes_per_second * 1e6


def calls_per_batch(nbytes, args):
    return max(args.min_iters, min(args.max_iters, args.batch_bytes // nbytes))


def libraries(args):
    """The harness's backends a launch runs, ours first."""
    return [OURS, MPI_BACKEND] + ([] if args.no_gloo else [GLOO])


def json_name(backend, mpi):
    """A harness backend as the JSON names it: the mpi backend by its library,
    ours compressed by its codec (ours:int8)."""
    if backend.name == OURS and backend.compression is not None:
        return f"ours:{backend.compression}"
    return {OURS: "ours", MPI_BACKEND: mpi, GLOO: "gloo", COPY_FLOOR: "floor"}[backend.name]


def harness_args(spec, args):
    """The harness's own flags for this spec (its parser fills every default)."""
    argv = ["--backend", ",".join(libraries(args)), "-d", DTYPE, "-o", OP, "-r", str(ROOT), "-w", str(args.warmup),
            "--rounds", str(args.rounds), "-e", str(max(args.size_list)), "-q"]
    if args.compression_list and spec.name == "allreduce":
        argv += ["--compression", ",".join([NO_COMPRESSION, *args.compression_list])]
    return harness.parse_args(spec, argv + call_flags(args))


# -- one launch: every rank runs this --------------------------------------------------

def measure_collective(spec, args, world, mpi):
    """Every rank: one collective over the sizes. Returns its rows (rank 0's;
    else None) and what our communicator measured as it started (its `tuning`)."""
    hargs = harness_args(spec, args)
    floored = spec.name in FLOORED
    backends = make_backends(libraries(args) + ([COPY_FLOOR] if floored else []), spec, hargs, world)
    ours = backends[0]
    tuning = ours.comm.tuning   # (what its communicator measured as it started: Communicator.tuning)
    places = PLACEMENTS
    nranks, itemsize, rows = world.size, hargs.dtype.itemsize, []
    # compressed: every library's timed calls on seeded normal floats, ours compressed judged by maxrel
    seeded = harness.SeededInputs(spec, OP, nranks) if hargs.compressed else None
    try:
        for nbytes in args.size_list:
            if spec.param_count(nbytes, itemsize, nranks) == 0:
                continue   # less than one element per rank
            hargs.iters = calls_per_batch(nbytes, args)
            timed = [b for b in backends if b.name != COPY_FLOOR or nbytes >= args.floor_from]
            measured = harness.measure(timed, spec, hargs, nbytes, world, seeded=seeded,
                                       placements=[place == "in_place" for place in places])
            in_count, _ = spec.counts(nbytes, itemsize, nranks)
            # (what ran may differ by placement: an in-place all_to_all keeps staging longer)
            picked = {place: harness.picked_algorithm(ours, spec, hargs, in_count, in_place=place == "in_place")
                      for place in places}
            size = spec.bytes_moved(nbytes, itemsize, nranks)
            row = {"size": size,
                   "count": spec.param_count(nbytes, itemsize, nranks),
                   "iters": hargs.iters, **picked_fields(picked["out_of_place"]),
                   "picked": {place: picked_fields(picked[place]) for place in places}}
            for i, place in enumerate(places):
                row[place] = {json_name(b, mpi): {"time_us": m[i]["seconds"] * 1e6, "wrong": m[i]["wrong"],
                                                  "rounds_us": [s * 1e6 for s in m[i]["rounds"]],
                                                  **({"maxrel": m[i]["maxrel"]} if b.compression else {})}
                              for b, m in zip(timed, measured)}
                if args.link_rate:
                    row[place]["link"] = {"time_us": link_floor_us(spec.name, size, args.hosts, nranks // args.hosts,
                                                                       args.link_rate)}
            rows.append(row)
            if world.rank == 0:
                print(format_row(row), flush=True)
    finally:
        for backend in backends:
            backend.close()
    return rows, tuning


def picked_fields(picked):
    """A chosen_algorithm answer as the JSON records it: the algorithm, the path, the loop's step."""
    return {"algorithm": picked.algorithm, "path": picked.path, **({"step": picked.step} if picked.step else {})}


def run_launch(args, world):
    """Every rank: every collective. Rank 0 returns the runs, one per collective (else None)."""
    leader = world.rank == 0
    affinity = world.gather(sorted(os.sched_getaffinity(0)), root=0)
    pids = world.gather(os.getpid(), root=0)
    hostnames = world.gather(socket.gethostname(), root=0)
    binding = os.environ.get(BIND_TO, "as launched")
    # the library's settings it runs under ($COLLECTIVES_PRETEND_NODES, say), as the JSON's environment records them
    settings = "".join(f", {name}={value}" for name, value in library_settings().items())
    mpi = mpis.loaded_mpi()
    others = [mpi] + ([] if args.no_gloo else ["gloo"])
    runs = []
    for name in args.collective_list:
        spec = SPECS[name]
        if leader:
            print(f"# {name}, float32{f' {OP}' if spec.has_op else ''}, {world.size} processes, -bind-to {binding}"
                  f"{settings}: ours, {NAMES[mpi]} (mpi4py)" + ("" if args.no_gloo else ", Gloo (torch.distributed)")
                  + (f", the copy floor from {cli.size_label(args.floor_from)}" if name in FLOORED else "")
                  + (f", ours with {','.join(args.compression_list)}"
                     if args.compression_list and name == "allreduce" else "")
                  + (f"; {args.hosts} hosts, each link {args.link} ({args.link_rate * 8 / 1e9:.2f} Gbit/s measured), "
                     "the link floor" if args.link_rate else "")
                  + f", {args.rounds} rounds, alternating; median of rounds; CPU affinity per rank {affinity}",
                  flush=True)
            print(header(others, args.floor_from, bool(args.link_rate),
                         args.compression_list if name == "allreduce" else ()), flush=True)
        load_before = os.getloadavg()
        cpu_before = cpu_ticks(pids) if leader else None
        rows, tuning = measure_collective(spec, args, world, mpi)
        cpu_after = cpu_ticks(pids) if leader else None
        if not leader:
            continue
        env = environment("host", world.size, libraries(args))
        launch = env.pop("command").split(" --worker-output ")[0]  # the report's own temporary file
        across = ({"hosts": {"count": args.hosts, "link": args.link, "measured_bytes_per_second": args.link_rate,
                             "hostnames": sorted(set(hostnames))}}
                  if args.link_rate else {})
        runs.append({"collective": name, "mpi": mpi, "processes": world.size, "bind_to": binding, "affinity": affinity,
                     **across,
                     "placements": list(PLACEMENTS), "launch": launch, "environment": env,
                     "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
                     "other_processes_cores": other_processes_cores(cpu_before, cpu_after), "tuning": tuning,
                     "rows": rows})
    return runs if leader else None


def header(others, floor_from, link=False, codecs=()):
    """The table's two header lines for the libraries beside ours (format_row's cells)."""
    names = [NAMES[lib].replace(" ", "") for lib in others]
    columns = "".join(f"{n + ' µs':>12s}" for n in ["ours", *names]) + "".join(f"{n + '/ours':>14s}" for n in names)
    after = [f"from {cli.size_label(floor_from)}, {'/'.join(FLOORED)}: | floor µs, floor/ours"]
    if link:
        after.append("| link: the link floor µs, link/ours")
    if codecs:
        after.append(f"| {'/'.join(codecs)}: ours compressed µs, ours/compressed")
    return (f"#{'':9s}{' out of place ':-^{len(columns)}s}{' in place ':-^{len(columns)}s}\n#     size{columns}"
            f"{columns}   ({'; '.join(after)}; per placement)")


def libraries_of(row):
    """The libraries a row timed beside ours (not ours compressed, nor a floor), in the JSON's names."""
    return [lib for lib in row[PLACEMENTS[0]] if lib not in NOT_LIBRARIES and not lib.startswith("ours:")]


def codecs_of(row):
    """The codecs ours also ran with in this row (ours:int8 -> int8)."""
    return [lib.split(":", 1)[1] for lib in row[PLACEMENTS[0]] if lib.startswith("ours:")]


def ratio(row, placement, other):
    """`other`'s time over ours (above 1: ours is faster); for the floor, how near ours comes to it (1: at it)."""
    times = row.get(placement)
    if not times or other not in times:
        return None
    return times[other]["time_us"] / times["ours"]["time_us"]


def format_row(row):
    cells = f"{cli.size_label(row['size']):>10s}"
    others = libraries_of(row)
    for placement in PLACEMENTS:
        times = row[placement]
        cells += "".join(f"  {times[lib]['time_us']:10.1f}" for lib in ("ours", *others))
        cells += "".join(f"  {ratio(row, placement, lib):11.2f}x" for lib in others)
    for floor in ("floor", "link"):
        if floor in row[PLACEMENTS[0]]:
            cells += f"  | {floor}" + "".join(f"  {row[p][floor]['time_us']:8.1f}  {ratio(row, p, floor):5.2f}"
                                              for p in PLACEMENTS)
    for codec in codecs_of(row):   # ours uncompressed over ours compressed: the codec's speed-up
        cells += f"  | {codec}" + "".join(f"  {row[p]['ours:' + codec]['time_us']:8.1f}  "
                                          f"{1 / ratio(row, p, 'ours:' + codec):5.2f}x" for p in PLACEMENTS)
    wrong = any(m.get("wrong") for p in PLACEMENTS for m in row.get(p, {}).values())
    return cells + ("  WRONG" if wrong else "")


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


# -- the report --------------------------------------------------------------------------

def verdict(run):
    """Sizes where another library was at least as fast as ours, per library
    and placement; and the sizes with wrong results."""
    slower = {(lib, p): [cli.size_label(r["size"]) for r in run["rows"] if p in r and ratio(r, p, lib) <= 1]
              for lib in run_libraries(run) for p in run["placements"]}
    wrong = [cli.size_label(r["size"]) for r in run["rows"]
             if any(m.get("wrong") for p in run["placements"] for m in r[p].values())]
    return slower, wrong


def run_libraries(run):
    """The libraries a run timed beside ours (older runs: MPICH and Gloo, named in every row)."""
    return list(dict.fromkeys(lib for row in run["rows"] for lib in libraries_of(row)))


def summary_lines(run):
    slower, wrong = verdict(run)
    where = f"# {run['collective']}, {run['processes']} processes:"
    lines = []
    others = run.get("other_processes_cores")
    if others is not None and others >= 0.25:
        lines.append(f"{where} other processes kept {others:.1f} of the {run['environment'].get('cores')} cores "
                     "busy: the times are noisier than on an idle machine (other_processes_cores in the JSON)")
    others = run_libraries(run)
    for lib in others:
        lost = [f"{p.replace('_', ' ')} {', '.join(sizes)}" for (other, p), sizes in slower.items()
                if other == lib and sizes]
        name = NAMES[lib]
        lines.append(f"{where} " + (f"{name} as fast or faster at {'; '.join(lost)}" if lost
                                    else f"ours faster than {name} at every size"))
    for floor, what in (("floor", "the copy floor's"), ("link", "the link floor's")):
        floors = [ratio(r, p, floor) for r in run["rows"] for p in run["placements"] if ratio(r, p, floor)]
        if floors:
            lines.append(f"{where} ours at {min(floors):.2f} to {max(floors):.2f} of {what} speed ({floor}/ours)")
    for codec in dict.fromkeys(c for r in run["rows"] for c in codecs_of(r)):
        speedups = [1 / ratio(r, p, "ours:" + codec) for r in run["rows"] for p in run["placements"]
                    if ratio(r, p, "ours:" + codec)]
        errors = [r[p]["ours:" + codec].get("maxrel") for r in run["rows"] for p in run["placements"]
                  if "ours:" + codec in r[p]]
        worst = harness.worst_error(errors)
        lines.append(f"{where} ours with {codec}: {min(speedups):.2f} to {max(speedups):.2f}x the uncompressed "
                     f"call's speed, maxrel at most {worst if worst is None else format(worst, '.1e')}")
    count = {1: "two", 2: "three"}.get(len(others), str(len(others) + 1))
    lines.append(f"{where} " + (f"WRONG results at {', '.join(wrong)}" if wrong else
                                f"every element of every result as expected ({count} libraries)"))
    return lines


def time_us_method(args):
    """What a row's time_us is, in words, for the report's method."""
    if args.compute_between:
        return (f"median over rounds of the batch's time per call: its slowest rank's mean of its calls' own "
                f"times, each call after {args.compute_between:g} ms of compute (bench/harness.py timed_one_by_one)")
    if args.read_results:
        return ("median over rounds of the batch's time per call: its slowest rank's mean of its calls' own "
                "times, each call followed, untimed, by the rank's read of its outputs, the warm-up calls' "
                "too (bench/harness.py read_results)")
    return ("median over rounds of the batch's time per call: its slowest rank's time for the batch (barriers "
            "at both ends included) over its calls")


def write_report(args, runs, command):
    if not args.output_file:
        return
    machine = {k: v for k, v in runs[0]["environment"].items() if k not in ("ranks", "processes", "backends")}
    report = {
        "benchmark": f"{', '.join(args.collective_list)} on float32 (sum, root 0): ours "
                     f"(collectives.init host ranks) vs {' and '.join(NAMES[m] for m in args.mpi_list)} (mpi4py) "
                     f"and Gloo (torch.distributed), one rank per process; {', '.join(FLOORED)} also against "
                     "the copy floor",
        "command": command,
        "python_executable": os.path.basename(sys.executable),
        "machine": machine,
        "method": {"collectives": args.collective_list, "sizes": args.size_list, "rounds": args.rounds,
                   "batch_bytes": args.batch_bytes, "min_iters": args.min_iters, "max_iters": args.max_iters,
                   "warmup": args.warmup, "compute_between_ms": args.compute_between,
                   "read_results": args.read_results, "bind_to": args.bind_to, "mpi": args.mpi_list,
                   "compression": args.compression_list,
                   **({"hosts": f"{args.hosts} hosts made on this machine by bench/hosts.py (network, UTS, IPC, PID "
                                f"and mount namespaces, a private /dev/shm), each link shaped to {args.link} by tc "
                                "tbf; the processes spread evenly, MPICH's mpiexec launching through them",
                       "link_floor": "the bytes the busiest host must send (LINK_BYTES in bench/host_vs_mpich.py) "
                                     "over the link's rate, one TCP stream measured before each launch; "
                                     "link/ours is ours' fraction of that speed"} if args.hosts else {}),
                   "floor": f"{', '.join(FLOORED)} from {args.floor_from} B: every rank copies the bytes its result "
                            "needs once, from a private array, all ranks at once (bench/backends.py CopyFloor); "
                            "floor/ours is ours' fraction of that speed",
                   "time_us": time_us_method(args),
                   "placements": "out of place and in place",
                   "data": "the <collective>_perf specs' closed-form inputs, checked bit for bit after the rounds"},
        "runs": runs,
    }
    cli.write_json(Path(args.output_file), report)


def launch(install, args, nranks, argv_run, made_hosts=None):
    """Run one launch of `nranks` processes with `install`'s MPI (bench.mpis), on
    `made_hosts` (bench.hosts' state) if given; its runs, or None if it failed."""
    # hosts made on this machine share its cores, which each host's mpiexec proxy would bind
    # its ranks to from core 0 again: auto leaves them to the kernel there
    binding = "none" if made_hosts is not None and args.bind_to == "auto" else harness.bind_to(args.bind_to, nranks)
    launcher = mpis.launcher_command(install, nranks, binding)
    if made_hosts is not None:   # MPICH's mpiexec, through the hosts' launcher, as many ranks on each
        per_host = nranks // len(made_hosts["hosts"])
        placement = ",".join(f"{h['name']}:{per_host}" for h in made_hosts["hosts"])
        launcher = hosts.mpiexec_command(made_hosts["dir"], ["-hosts", placement, *launcher[1:]])
    fd, out = tempfile.mkstemp(prefix="host_vs_mpich_", suffix=".json")
    os.close(fd)
    command = [*launcher, install.python, "-m", MODULE, *argv_run, "--worker-output", out]
    # (the record names the launch as a user types it: across hosts, bench.hosts' mpiexec, whose
    # launcher lies in a temporary folder that is gone once the hosts are)
    shown = (["python", "-m", "bench.hosts", "mpiexec", "--", *launcher[launcher.index("-hosts"):]]
             if made_hosts is not None else [os.path.basename(launcher[0]), *launcher[1:]])
    env = dict(os.environ, **{BIND_TO: binding, LAUNCHER_COMMAND: " ".join(shown)})
    try:
        code = subprocess.call(command, env=env, cwd=mpis.REPOSITORY)   # (the other MPI's Python imports bench from here)
        if code != 0:
            print(f"# the {nranks}-process launch failed (exit {code}): {' '.join(command)}", file=sys.stderr)
            return None
        with open(out) as f:
            return json.load(f)
    finally:
        os.unlink(out)


def worker_argv(args):
    """The options every launch's ranks run with (explicit, so the JSON says what ran)."""
    argv = ["--collectives", ",".join(args.collective_list), "--sizes", ",".join(str(s) for s in args.size_list),
            "--rounds", str(args.rounds), "--batch-bytes", str(args.batch_bytes), "--min-iters", str(args.min_iters),
            "--max-iters", str(args.max_iters), "-w", str(args.warmup), "--floor-from", str(args.floor_from)]
    argv += call_flags(args)
    if args.compression_list:
        argv += ["--compression", ",".join(args.compression_list)]
    if args.hosts:
        argv += ["--hosts", str(args.hosts), "--link", args.link]
    return argv


def call_flags(args):
    """The flags of how each call runs that a launch's ranks and the harness
    under them take alike (the same names and values in both)."""
    argv = ["--timeout", repr(args.timeout)] if args.timeout is not None else []
    if args.compute_between:
        argv += ["--compute-between", repr(args.compute_between)]
    return argv + (["--read-results"] if args.read_results else [])


def run_launches(args, installs, made_hosts=None):
    """Every launch (MPI by process count); the runs, or None if one failed."""
    runs = []
    for first, install in enumerate(installs):
        for nranks in args.rank_list:
            argv = worker_argv(args) + ["--ranks", str(nranks)] + (["--no-gloo"] if first else [])
            if made_hosts is not None:   # measured before each launch: the floor of the calls that follow
                rate = hosts.measure_link(made_hosts["dir"])
                print(f"# the link h0 -> h1: {rate * 8 / 1e9:.2f} Gbit/s, one TCP stream for 1 s", flush=True)
                argv += ["--link-rate", repr(rate)]
            # Gloo beside the first MPI only: its ratio does not depend on which MPI started the processes
            launched = launch(install, args, nranks, argv, made_hosts)
            if launched is None:
                return None
            runs += launched
            print(flush=True)
    return runs


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    world = harness.mpi_world()
    if world is not None:  # a rank of a launch: ours (--worker-output) or the user's own mpiexec
        try:
            runs = run_launch(args, world)
        except BaseException:  # noqa: BLE001 - one rank's failure would leave the others waiting
            traceback.print_exc()
            sys.stderr.flush()
            world.Abort(1)
        if runs is None:
            return 0
        if args.worker_output:
            cli.write_json(args.worker_output, runs, say=None)   # (a temporary file the launching process reads)
            return 0
        command = command_line(MODULE, argv, [os.environ.get(LAUNCHER_COMMAND, f"mpiexec -n {world.size}")])
        for run in runs:
            run["launch"] = command
    else:
        command = command_line(MODULE, argv)
        print(f"# {command}", flush=True)
        installs = [mpis.find(mpi) for mpi in args.mpi_list]
        for install in installs:
            print(f"# {install.how}", flush=True)
        if args.hosts:
            # killed (timeout, CI), the hosts still go: SystemExit unwinds through their `with`
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
            with hosts.Hosts(args.hosts, args.link) as made:
                print(f"# {args.hosts} hosts made on this machine (bench/hosts.py), each link {args.link}", flush=True)
                runs = run_launches(args, installs, made)
        else:
            runs = run_launches(args, installs)
        if runs is None:
            return 2
    for run in runs:
        for line in summary_lines(run):
            print(line)
    write_report(args, runs, command)
    return 1 if any(verdict(run)[1] for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
