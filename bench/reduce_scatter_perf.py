"""Reduce_scatter bandwidth sweep, nccl-tests compatible: python -m bench.reduce_scatter_perf -h

As in nccl-tests, the size is each rank's input (recvcount * nranks
elements) and the count column is what each rank receives. The input is
allreduce's, so rank r's result is block r of allreduce's closed form.
In place, the result is the rank's own block of its input.
"""

import sys

from bench import all_reduce_perf
from bench.backends import gloo_op, mpi_buffer, mpi_op
from bench.harness import Spec, as_users_call, first_block, main, own_block


def counts(nbytes, itemsize, nranks):
    received = nbytes // itemsize // nranks
    return received * nranks, received


def expected(dtype, op, nranks, rank, count, root=0):
    reduced = all_reduce_perf.expected(dtype, op, nranks, rank, count * nranks)
    return reduced[rank * count:(rank + 1) * count]


def run_ours(comm, x, out, args):
    x, out = as_users_call(x, out)
    comm.reduce_scatter(x, op=args.op, out=out, algorithm=args.algorithm)  # in place, out is x's own block


def run_mpi(comm, x, out, args):
    from mpi4py import MPI
    # In place MPI leaves the block at the start of `out` (mpi_in_place_result).
    comm.Reduce_scatter_block(MPI.IN_PLACE if x is None else mpi_buffer(x), mpi_buffer(out), op=mpi_op(args.op))


def run_gloo(dist, x, out, args):
    # Gloo has reduce_scatter (torch 2.13; checked, in place too), so no
    # all_reduce-then-copy fallback is needed. reduce_scatter_single is its
    # newer name; reduce_scatter_tensor the one older versions have.
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if x is None:
        x, out = out, own_block(out, dist.get_rank(), dist.get_world_size())
    reduce_scatter(out, x, op=gloo_op(dist, args.op))


def run_tf(ctf, comm, x, args):
    return ctf.reduce_scatter(x, comm, op=args.op)


REDUCE_SCATTER = Spec(
    name="reduce_scatter",
    busbw_factor=lambda n: (n - 1) / n,
    counts=counts,
    run_ours=run_ours,
    run_mpi=run_mpi,
    run_gloo=run_gloo,
    run_tf=run_tf,
    expected=expected,
    fill=all_reduce_perf.fill,
    in_place_result=own_block,
    mpi_in_place_result=first_block,
)

if __name__ == "__main__":
    sys.exit(main(REDUCE_SCATTER))
