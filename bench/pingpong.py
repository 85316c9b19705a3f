"""Point-to-point latency: send/recv ping-pong between 2 processes, ours beside MPI's.

    python -m bench.pingpong [--mpi mpich|openmpi] [--sizes 8,1K,64K,1M] [--batches 20] [--round-trips 500]
                             [-J pingpong.json]

Rank 0 sends a message to rank 1 and waits for it back; one way is half a
round trip. Batches of --round-trips (fewer for large messages: a batch
moves at most --batch-bytes each way, and makes at least 3) alternate between our
`comm.send`/`comm.recv` and MPI's `Send`/`Recv` (mpi4py, on the same
NumPy arrays), in the same 2 processes, after a barrier each; the median
batch is reported, with MPI's time over ours (above 1: we are faster).
Without a launcher it relaunches itself, 2 processes pinned one per core:
under MPICH's mpiexec (`--mpi mpich`, the default), or under Open MPI's
mpirun with the Python of its own environment (`--mpi openmpi`:
bench/mpis.py finds or makes it). The record names the MPI library the
ranks loaded.
"""

import statistics
import sys

import numpy as np

import collectives
from bench import cli, mpis
from bench.harness import mpi_world, relaunch_once, seconds_per_call


def parse_args(argv=None):
    p = cli.Parser(prog="python -m bench.pingpong", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="8,1K,64K,1M", type=cli.sizes, help="message sizes (suffixes K, M)")
    p.add_argument("--batches", type=int, default=20, help="batches per side, alternating")
    p.add_argument("--round-trips", type=int, default=500, help="round trips per batch")
    p.add_argument("--batch-bytes", default="256M", type=cli.parse_size,
                   help="fewer round trips for large messages: a batch moves at most this each way (at least 3 "
                        "round trips)")
    p.add_argument("--mpi", default=mpis.MPICH, choices=mpis.MPIS,
                   help="the MPI beside ours: mpich (mpiexec beside this Python) or openmpi (mpirun in "
                        ".venv-openmpi, made if missing: bench/mpis.py)")
    p.add_argument("-J", "--output_file", help="write the results as JSON here (default: no file)")
    args = p.parse_args(argv)
    args.ranks = 2   # (the relaunch starts this many)
    args.backends = [args.mpi]   # (which launcher the relaunch takes: harness.relaunch_under_mpiexec)
    return args


def one_way_seconds(send, recv, rank, round_trips):
    """Seconds one way, from `round_trips` round trips timed on rank 0."""
    def round_trip():
        if rank == 0:
            send()
            recv()
        else:
            recv()
            send()
    return seconds_per_call(round_trip, round_trips) / 2


def main(argv=None):
    args = parse_args(argv)
    world = mpi_world()
    if world is None or world.Get_size() == 1:
        return relaunch_once(args, sys.argv[1:] if argv is None else argv, ["-bind-to", "core"],
                             missing="bench.pingpong needs 2 processes")
    if world.Get_size() != 2:
        sys.exit("bench.pingpong runs on exactly 2 processes")
    from mpi4py import MPI
    # A failure on one rank aborts the communicator (the with block), so the other raises at once.
    with collectives.init(comm=world) as comm:
        rows = measure(args, world, comm, MPI)
        if comm.rank == 0 and args.output_file:
            from bench.environment import command_line, environment
            report = {"command": command_line("bench.pingpong", sys.argv[1:] if argv is None else argv),
                      "environment": environment("host", 2, ["ours", "mpi"]), "one_way": rows}
            cli.write_json(args.output_file, report, say=None)
    return 0


def measure(args, world, comm, MPI):
    """The rows: per size, the median one-way time of each side."""
    rank, peer = comm.rank, 1 - comm.rank
    rows = []
    for nbytes in [cli.parse_size(s) for s in args.sizes.split(",") if s.strip()]:
        message = np.arange(nbytes, dtype=np.uint8)
        back = np.empty(nbytes, np.uint8)
        sides = {
            "ours": (lambda: comm.send(message, peer), lambda: comm.recv(back, peer)),
            "mpi": (lambda: world.Send([message, MPI.BYTE], peer), lambda: world.Recv([back, MPI.BYTE], peer)),
        }
        times = {name: [] for name in sides}
        round_trips = max(3, min(args.round_trips, args.batch_bytes // max(nbytes, 1)))
        for name, (send, recv) in sides.items():   # a warm-up batch each (first calls map and compile)
            one_way_seconds(send, recv, rank, min(10, round_trips))
        for _ in range(args.batches):
            for name, (send, recv) in sides.items():
                world.Barrier()
                times[name].append(one_way_seconds(send, recv, rank, round_trips))
        assert np.array_equal(back, message), "the message came back changed"
        row = {"bytes": nbytes, "round_trips": round_trips,
               **{f"{name}_us": statistics.median(t) * 1e6 for name, t in times.items()}}
        row["mpi_over_ours"] = row["mpi_us"] / row["ours_us"]
        rows.append(row)
        if rank == 0:
            mpi = mpis.NAMES[mpis.loaded_mpi()]
            print(f"{nbytes:>10d} B   ours {row['ours_us']:8.2f} us   {mpi} {row['mpi_us']:8.2f} us   "
                  f"{mpi}/ours {row['mpi_over_ours']:5.2f}", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
