"""Gather bandwidth sweep, nccl-tests compatible: python -m bench.gather_perf -h

As in nccl-tests' gather_perf, the size is the gathered bytes (sendcount *
nranks), the count column what each rank sends, and busbw is algbw times
(n-1)/n: the root's own block does not travel. Rank r sends
rank_pattern(r), so the root's (-r, default 0) result is allgather's; the
other ranks' outputs are undefined (MPI's receive buffer is significant at
the root only) and unchecked, as reduce's. In place, each rank's input is
its own block of its output (MPI_IN_PLACE at the root).
"""

import sys

from bench import all_gather_perf
from bench.backends import mpi_bytes
from bench.harness import Spec, as_users_call, main, own_block, pattern_fill


def expected(dtype, op, nranks, rank, count, root=0):
    return all_gather_perf.expected(dtype, op, nranks, rank, count) if rank == root else None


def run_ours(comm, x, out, args):
    x, out = as_users_call(x, out)
    comm.gather(x, root=args.root, out=out, algorithm=args.algorithm)  # in place, x is out's own block


def run_mpi(comm, x, out, args):
    from mpi4py import MPI
    if comm.rank == args.root:
        comm.Gather(MPI.IN_PLACE if x is None else mpi_bytes(x), mpi_bytes(out), root=args.root)
    else:   # moves bytes: any type
        comm.Gather(mpi_bytes(own_block(out, comm.rank, comm.size) if x is None else x), None, root=args.root)


def run_gloo(dist, x, out, args):
    rank, n = dist.get_rank(), dist.get_world_size()
    if x is None:
        x = own_block(out, rank, n)
    dist.gather(x, list(out.chunk(n)) if rank == args.root else None, dst=args.root)


GATHER = Spec(
    name="gather",
    busbw_factor=lambda n: (n - 1) / n,
    counts=all_gather_perf.counts,
    run_ours=run_ours,
    run_mpi=run_mpi,
    run_gloo=run_gloo,
    expected=expected,
    fill=pattern_fill,
    has_op=False,
    rooted=True,
    in_place_input=own_block,
)

if __name__ == "__main__":
    sys.exit(main(GATHER))
