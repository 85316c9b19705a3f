"""Allreduce bandwidth sweep, nccl-tests compatible: python -m bench.all_reduce_perf -h

Rank r's element i is (i mod 3) + r + 1 (for prod: 2 on one rank, 1 on the
others), so every correct result is exact and has a closed form.

With --compression (float32, sum or avg; e.g. --compression none,fp16,bf16,int8)
each codec runs as a backend of its own. Compressed results are approximate, so
every row then also gets `maxrel`, the largest |result - reference| over the
largest |reference|, on seeded standard-normal inputs (the reference is the
float64 sum or mean of every rank's input, which each process regenerates),
and `wire B`, the bytes one call makes a rank read from its peers.
"""

import sys

import numpy as np

from bench.backends import MWMS_OPS, gloo_op, mpi_buffer, mpi_op
from bench.harness import Spec, as_users_call, main
from collectives.ops import is_floating


def fill(dtype, op, nranks, rank, count, root=0):
    i = np.arange(count)
    if op == "prod":
        return np.where((i + rank) % nranks == 0, 2, 1).astype(dtype)
    return ((i % 3) + rank + 1).astype(dtype)


def expected(dtype, op, nranks, rank, count, root=0):
    base = np.arange(count) % 3
    if op == "prod":
        return np.full(count, 2, dtype)
    if op == "max":
        return (base + nranks).astype(dtype)
    if op == "min":
        return (base + 1).astype(dtype)
    total = nranks * base + nranks * (nranks + 1) // 2
    if op == "avg":
        total = total / nranks if is_floating(dtype) else total // nranks
    return total.astype(dtype)


def reference(op, nranks, inputs):
    """The float64 result of allreduce (sum or avg) over every rank's input."""
    total = None
    for x in inputs:
        if total is None:
            total = x.astype(np.float64)
        else:
            total += x
    return total / nranks if op == "avg" else total


def run_ours(comm, x, out, args):
    codec = getattr(args, "codec", None)  # the backend's --compression entry, None for none
    if codec is None:
        x, out = as_users_call(x, out)
        comm.allreduce(x, op=args.op, out=out, algorithm=args.algorithm)  # in place, out is x
    else:
        comm.allreduce(x, op=args.op, out=out, algorithm=args.algorithm, compression=codec)


def run_mpi(comm, x, out, args):
    from mpi4py import MPI
    comm.Allreduce(MPI.IN_PLACE if x is None else mpi_buffer(x), mpi_buffer(out), op=mpi_op(args.op))


def run_gloo(dist, x, out, args):
    if x is not None:  # torch reduces in place: out of place is a copy, then the in-place call
        out.copy_(x)
    dist.all_reduce(out, op=gloo_op(dist, args.op))


def run_mwms(replica, x, args):
    return replica.all_reduce(MWMS_OPS[args.op], x)


def run_tf(ctf, comm, x, args):
    return ctf.allreduce(x, comm, op=args.op)


ALLREDUCE = Spec(
    name="allreduce",
    busbw_factor=lambda n: 2 * (n - 1) / n,
    counts=lambda nbytes, itemsize, n: (nbytes // itemsize, nbytes // itemsize),
    run_ours=run_ours,
    run_mpi=run_mpi,
    run_gloo=run_gloo,
    run_mwms=run_mwms,
    run_tf=run_tf,
    expected=expected,
    fill=fill,
    reference=reference,
)

if __name__ == "__main__":
    sys.exit(main(ALLREDUCE))
