"""Scatter bandwidth sweep, nccl-tests compatible: python -m bench.scatter_perf -h

As in nccl-tests' scatter_perf, the size is the root's input (recvcount *
nranks elements), the count column what each rank receives, and busbw is
algbw times (n-1)/n: the root's own block does not travel. Every rank's
input is its own rank_pattern, of which only the root's (-r, default 0)
may be read, so rank r's result is block r of the root's pattern. In
place, the result is the rank's own block of its input (MPI_IN_PLACE at
the root).
"""

import sys

from bench import reduce_scatter_perf
from bench.backends import mpi_bytes
from bench.harness import Spec, as_users_call, main, own_block, pattern_fill, rank_pattern


def expected(dtype, op, nranks, rank, count, root=0):
    return rank_pattern(dtype, root, count, start=rank * count)


def run_ours(comm, x, out, args):
    x, out = as_users_call(x, out)
    comm.scatter(x, root=args.root, out=out, algorithm=args.algorithm)  # in place, out is x's own block


def run_mpi(comm, x, out, args):
    from mpi4py import MPI
    if comm.rank == args.root:
        comm.Scatter(mpi_bytes(out if x is None else x), MPI.IN_PLACE if x is None else mpi_bytes(out),
                     root=args.root)
    else:   # moves bytes: any type
        comm.Scatter(None, mpi_bytes(own_block(out, comm.rank, comm.size) if x is None else out), root=args.root)


def run_gloo(dist, x, out, args):
    rank, n = dist.get_rank(), dist.get_world_size()
    if x is None:
        x, out = out, own_block(out, rank, n)
    dist.scatter(out, list(x.chunk(n)) if rank == args.root else None, src=args.root)


SCATTER = Spec(
    name="scatter",
    busbw_factor=lambda n: (n - 1) / n,
    counts=reduce_scatter_perf.counts,
    run_ours=run_ours,
    run_mpi=run_mpi,
    run_gloo=run_gloo,
    expected=expected,
    fill=pattern_fill,
    has_op=False,
    rooted=True,
    in_place_result=own_block,
)

if __name__ == "__main__":
    sys.exit(main(SCATTER))
