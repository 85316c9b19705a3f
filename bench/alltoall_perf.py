"""All_to_all bandwidth sweep, nccl-tests compatible: python -m bench.alltoall_perf -h

As in nccl-tests' alltoall_perf, the size is a rank's whole buffer (its
input and its output alike: a block per rank), the count column one block
(what a rank sends each peer), and busbw is algbw times (n-1)/n, since a
rank's own block stays home. Rank r's input is rank_pattern(r), so block q
of rank r's result is block r of rank q's pattern. In place, the result
overwrites the input (MPI_IN_PLACE); nccl-tests leaves in place unchecked,
this checks it as out of place.
"""

import sys

import numpy as np

from bench.backends import mpi_bytes
from bench.harness import Spec, as_users_call, main, pattern_fill, rank_pattern


def counts(nbytes, itemsize, nranks):
    whole = nbytes // itemsize // nranks * nranks   # whole blocks, as nccl-tests rounds
    return whole, whole


def expected(dtype, op, nranks, rank, count, root=0):
    block = count // nranks
    return np.concatenate([rank_pattern(dtype, q, block, start=rank * block) for q in range(nranks)])


def run_ours(comm, x, out, args):
    x, out = as_users_call(x, out)
    comm.all_to_all(x, out=out, algorithm=args.algorithm)  # in place, out is x


def run_mpi(comm, x, out, args):
    from mpi4py import MPI
    comm.Alltoall(MPI.IN_PLACE if x is None else mpi_bytes(x), mpi_bytes(out))  # moves bytes: any type


def run_gloo(dist, x, out, args):
    # Gloo has no in-place all_to_all (given one tensor twice it writes blocks
    # it has yet to send: the check finds them wrong), so in place its input
    # is a copy, made inside the timed call.
    dist.all_to_all_single(out, out.clone() if x is None else x)


ALL_TO_ALL = Spec(
    name="all_to_all",
    busbw_factor=lambda n: (n - 1) / n,
    counts=counts,
    count_column=lambda nbytes, itemsize, n: nbytes // itemsize // n,
    run_ours=run_ours,
    run_mpi=run_mpi,
    run_gloo=run_gloo,
    expected=expected,
    fill=pattern_fill,
    has_op=False,
)

if __name__ == "__main__":
    sys.exit(main(ALL_TO_ALL))
