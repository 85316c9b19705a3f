"""Broadcast bandwidth sweep, nccl-tests compatible: python -m bench.broadcast_perf -h

Rank r's input is rank_pattern(r), so every rank must end with the root's
(-r, default 0). Ours takes an output apart from the input, as
ncclBroadcast does; MPI and Gloo broadcast in place: out of place, their
root first copies its input to its output (as ncclBroadcast does inside).
"""

import sys

from bench.backends import mpi_bytes
from bench.harness import Spec, as_users_call, main, pattern_fill, rank_pattern


def expected(dtype, op, nranks, rank, count, root=0):
    return rank_pattern(dtype, root, count)


def run_ours(comm, x, out, args):
    in_place = all(o is i for o, i in zip(out, x))
    x, out = as_users_call(x, out)
    comm.broadcast(x, root=args.root, out=None if in_place else out, algorithm=args.algorithm)


def run_mpi(comm, x, out, args):
    if x is not None and comm.rank == args.root:
        out[...] = x
    comm.Bcast(mpi_bytes(out), root=args.root)  # moves bytes: any type


def run_gloo(dist, x, out, args):
    if x is not None and dist.get_rank() == args.root:
        out.copy_(x)
    dist.broadcast(out, src=args.root)


def run_tf(ctf, comm, x, args):
    return ctf.broadcast(x, comm, root=args.root)


BROADCAST = Spec(
    name="broadcast",
    busbw_factor=lambda n: 1,
    counts=lambda nbytes, itemsize, n: (nbytes // itemsize, nbytes // itemsize),
    run_ours=run_ours,
    run_mpi=run_mpi,
    run_gloo=run_gloo,
    run_tf=run_tf,
    expected=expected,
    fill=pattern_fill,
    has_op=False,
    rooted=True,
)

if __name__ == "__main__":
    sys.exit(main(BROADCAST))
