"""Allgather bandwidth sweep, nccl-tests compatible: python -m bench.all_gather_perf -h

As in nccl-tests, the size is the gathered bytes (sendcount * nranks) and
the count column what each rank sends. Rank r sends rank_pattern(r), so the
result is every rank's pattern in rank order. In place, each rank's input
is its own block of the output.
"""

import sys

import numpy as np

from bench.backends import mpi_bytes
from bench.harness import Spec, as_users_call, main, own_block, pattern_fill, rank_pattern


def counts(nbytes, itemsize, nranks):
    sent = nbytes // itemsize // nranks
    return sent, sent * nranks


def expected(dtype, op, nranks, rank, count, root=0):
    return np.concatenate([rank_pattern(dtype, r, count // nranks) for r in range(nranks)])


def run_ours(comm, x, out, args):
    x, out = as_users_call(x, out)
    comm.allgather(x, out=out, algorithm=args.algorithm)  # in place, x is out's own block


def run_mpi(comm, x, out, args):
    from mpi4py import MPI
    comm.Allgather(MPI.IN_PLACE if x is None else mpi_bytes(x), mpi_bytes(out))  # moves bytes: any type


def run_gloo(dist, x, out, args):
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # newer name first
    if x is None:
        x = own_block(out, dist.get_rank(), dist.get_world_size())
    all_gather(out, x)


def run_mwms(replica, x, args):
    return replica.all_gather(x, axis=0)


def run_tf(ctf, comm, x, args):
    return ctf.allgather(x, comm)


ALLGATHER = Spec(
    name="allgather",
    busbw_factor=lambda n: (n - 1) / n,
    counts=counts,
    run_ours=run_ours,
    run_mpi=run_mpi,
    run_gloo=run_gloo,
    run_mwms=run_mwms,
    run_tf=run_tf,
    expected=expected,
    fill=pattern_fill,
    has_op=False,
    in_place_input=own_block,
)

if __name__ == "__main__":
    sys.exit(main(ALLGATHER))
