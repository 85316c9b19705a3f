"""Reduce bandwidth sweep, nccl-tests compatible: python -m bench.reduce_perf -h

The input is allreduce's, so the root's (-r, default 0) result is
allreduce's closed form; as in nccl-tests, only the root's output is
checked, the others' being undefined. Ours and MPI take an output apart from
the input; Gloo reduces in place: out of place, every rank first copies its
input to its output.
"""

import sys

from bench import all_reduce_perf
from bench.backends import gloo_op, mpi_buffer, mpi_op
from bench.harness import Spec, as_users_call, main


def expected(dtype, op, nranks, rank, count, root=0):
    return all_reduce_perf.expected(dtype, op, nranks, rank, count) if rank == root else None


def run_ours(comm, x, out, args):
    in_place = all(o is i for o, i in zip(out, x))
    x, out = as_users_call(x, out)
    comm.reduce(x, root=args.root, op=args.op, out=None if in_place else out, algorithm=args.algorithm)


def run_mpi(comm, x, out, args):
    from mpi4py import MPI
    if comm.rank == args.root:
        comm.Reduce(MPI.IN_PLACE if x is None else mpi_buffer(x), mpi_buffer(out), op=mpi_op(args.op), root=args.root)
    else:
        comm.Reduce(mpi_buffer(out if x is None else x), None, op=mpi_op(args.op), root=args.root)


def run_gloo(dist, x, out, args):
    if x is not None:
        out.copy_(x)
    dist.reduce(out, dst=args.root, op=gloo_op(dist, args.op))


REDUCE = Spec(
    name="reduce",
    busbw_factor=lambda n: 1,
    counts=lambda nbytes, itemsize, n: (nbytes // itemsize, nbytes // itemsize),
    run_ours=run_ours,
    run_mpi=run_mpi,
    run_gloo=run_gloo,
    expected=expected,
    fill=all_reduce_perf.fill,
    rooted=True,
)

if __name__ == "__main__":
    sys.exit(main(REDUCE))
