"""The collectives the harness sweeps, one Spec each (bench/harness.py says
what a Spec holds): what a rank's input is, what a correct result is, and
how each backend makes the call. Each bench.<collective>_perf tool runs one
of them; bench.host_vs_mpich runs them all (SPECS).

Sizes and columns follow nccl-tests: each section says what its size and
count columns are, and what is checked.
"""

import numpy as np

from bench.backends import MWMS_OPS, gloo_op, mpi_buffer, mpi_bytes, mpi_op
from bench.harness import Spec, as_users_call, first_block, own_block, pattern_fill, rank_pattern
from collectives.ops import is_floating


def ours_call(method, *flags):
    """run_ours of a collective that takes `out` as it is laid out in place
    too (a view of the input, or the input a view of it: the library tells
    in place from that), with the keywords `flags` names from the command
    line: "op" (-o), "root" (-r)."""
    def run_ours(comm, x, out, args):
        x, out = as_users_call(x, out)
        getattr(comm, method)(x, out=out, algorithm=args.algorithm, **{flag: getattr(args, flag) for flag in flags})
    return run_ours


def same_counts(nbytes, itemsize, nranks):
    """Input and output of the size itself (allreduce, reduce, broadcast)."""
    return nbytes // itemsize, nbytes // itemsize


# -- allreduce (bench.all_reduce_perf) ------------------------------------------------
# Rank r's element i is (i mod 3) + r + 1 (for prod: 2 on one rank, 1 on the
# others), so every correct result is exact and has a closed form.
#
# With --compression (float32, sum or avg; e.g. --compression none,fp16,bf16,int8)
# each codec runs as a backend of its own. Compressed results are approximate, so
# every row then also gets `maxrel`, the largest |result - reference| over the
# largest |reference|, on seeded standard-normal inputs (the reference is the
# float64 sum or mean of every rank's input, which each process regenerates),
# and `wire B`, the bytes one call makes a rank read from its peers.


def allreduce_fill(dtype, op, nranks, rank, count, root=0):
    i = np.arange(count)
    if op == "prod":
        return np.where((i + rank) % nranks == 0, 2, 1).astype(dtype)
    return ((i % 3) + rank + 1).astype(dtype)


def allreduce_expected(dtype, op, nranks, rank, count, root=0):
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


def allreduce_reference(op, nranks, inputs):
    """The float64 result of allreduce (sum or avg) over every rank's input."""
    total = None
    for x in inputs:
        if total is None:
            total = x.astype(np.float64)
        else:
            total += x
    return total / nranks if op == "avg" else total


def allreduce_ours(comm, x, out, args):
    codec = getattr(args, "codec", None)  # the backend's --compression entry, None for none
    if codec is None:
        x, out = as_users_call(x, out)
        comm.allreduce(x, op=args.op, out=out, algorithm=args.algorithm)  # in place, out is x
    else:
        comm.allreduce(x, op=args.op, out=out, algorithm=args.algorithm, compression=codec)


def allreduce_mpi(comm, x, out, args):
    from mpi4py import MPI
    comm.Allreduce(MPI.IN_PLACE if x is None else mpi_buffer(x), mpi_buffer(out), op=mpi_op(args.op))


def allreduce_gloo(dist, x, out, args):
    if x is not None:  # torch reduces in place: out of place is a copy, then the in-place call
        out.copy_(x)
    dist.all_reduce(out, op=gloo_op(dist, args.op))


ALLREDUCE = Spec(
    name="allreduce",
    busbw_factor=lambda n: 2 * (n - 1) / n,
    counts=same_counts,
    run_ours=allreduce_ours,
    run_mpi=allreduce_mpi,
    run_gloo=allreduce_gloo,
    run_mwms=lambda replica, x, args: replica.all_reduce(MWMS_OPS[args.op], x),
    run_tf=lambda ctf, comm, x, args: ctf.allreduce(x, comm, op=args.op),
    expected=allreduce_expected,
    fill=allreduce_fill,
    reference=allreduce_reference,
)


# -- reduce_scatter (bench.reduce_scatter_perf) ----------------------------------------
# As in nccl-tests, the size is each rank's input (recvcount * nranks
# elements) and the count column is what each rank receives. The input is
# allreduce's, so rank r's result is block r of allreduce's closed form.
# In place, the result is the rank's own block of its input.


def scattered_counts(nbytes, itemsize, nranks):
    """A block per rank of the size (reduce_scatter's and scatter's input)."""
    received = nbytes // itemsize // nranks
    return received * nranks, received


def reduce_scatter_expected(dtype, op, nranks, rank, count, root=0):
    reduced = allreduce_expected(dtype, op, nranks, rank, count * nranks)
    return reduced[rank * count:(rank + 1) * count]


def reduce_scatter_mpi(comm, x, out, args):
    from mpi4py import MPI
    # In place MPI leaves the block at the start of `out` (mpi_in_place_result).
    comm.Reduce_scatter_block(MPI.IN_PLACE if x is None else mpi_buffer(x), mpi_buffer(out), op=mpi_op(args.op))


def reduce_scatter_gloo(dist, x, out, args):
    # Gloo has reduce_scatter (torch 2.13; checked, in place too), so no
    # all_reduce-then-copy fallback is needed. reduce_scatter_single is its
    # newer name; reduce_scatter_tensor the one older versions have.
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if x is None:
        x, out = out, own_block(out, dist.get_rank(), dist.get_world_size())
    reduce_scatter(out, x, op=gloo_op(dist, args.op))


REDUCE_SCATTER = Spec(
    name="reduce_scatter",
    busbw_factor=lambda n: (n - 1) / n,
    counts=scattered_counts,
    run_ours=ours_call("reduce_scatter", "op"),
    run_mpi=reduce_scatter_mpi,
    run_gloo=reduce_scatter_gloo,
    run_tf=lambda ctf, comm, x, args: ctf.reduce_scatter(x, comm, op=args.op),
    expected=reduce_scatter_expected,
    fill=allreduce_fill,
    in_place_result=own_block,
    mpi_in_place_result=first_block,
)


# -- allgather (bench.all_gather_perf) ----------------------------------------------
# As in nccl-tests, the size is the gathered bytes (sendcount * nranks) and
# the count column what each rank sends. Rank r sends rank_pattern(r), so the
# result is every rank's pattern in rank order. In place, each rank's input
# is its own block of the output.


def gathered_counts(nbytes, itemsize, nranks):
    """A block per rank of the size, gathered (allgather's and gather's output)."""
    sent = nbytes // itemsize // nranks
    return sent, sent * nranks


def allgather_expected(dtype, op, nranks, rank, count, root=0):
    return np.concatenate([rank_pattern(dtype, r, count // nranks) for r in range(nranks)])


def allgather_mpi(comm, x, out, args):
    from mpi4py import MPI
    comm.Allgather(MPI.IN_PLACE if x is None else mpi_bytes(x), mpi_bytes(out))  # moves bytes: any type


def allgather_gloo(dist, x, out, args):
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # newer name first
    if x is None:
        x = own_block(out, dist.get_rank(), dist.get_world_size())
    all_gather(out, x)


ALLGATHER = Spec(
    name="allgather",
    busbw_factor=lambda n: (n - 1) / n,
    counts=gathered_counts,
    run_ours=ours_call("allgather"),
    run_mpi=allgather_mpi,
    run_gloo=allgather_gloo,
    run_mwms=lambda replica, x, args: replica.all_gather(x, axis=0),
    run_tf=lambda ctf, comm, x, args: ctf.allgather(x, comm),
    expected=allgather_expected,
    fill=pattern_fill,
    has_op=False,
    in_place_input=own_block,
)


# -- broadcast (bench.broadcast_perf) -----------------------------------------------
# Rank r's input is rank_pattern(r), so every rank must end with the root's
# (-r, default 0). Ours takes an output apart from the input, as
# ncclBroadcast does; MPI and Gloo broadcast in place: out of place, their
# root first copies its input to its output (as ncclBroadcast does inside).


def broadcast_ours(comm, x, out, args):
    in_place = all(o is i for o, i in zip(out, x))
    x, out = as_users_call(x, out)
    comm.broadcast(x, root=args.root, out=None if in_place else out, algorithm=args.algorithm)


def broadcast_mpi(comm, x, out, args):
    if x is not None and comm.rank == args.root:
        out[...] = x
    comm.Bcast(mpi_bytes(out), root=args.root)  # moves bytes: any type


def broadcast_gloo(dist, x, out, args):
    if x is not None and dist.get_rank() == args.root:
        out.copy_(x)
    dist.broadcast(out, src=args.root)


BROADCAST = Spec(
    name="broadcast",
    busbw_factor=lambda n: 1,
    counts=same_counts,
    run_ours=broadcast_ours,
    run_mpi=broadcast_mpi,
    run_gloo=broadcast_gloo,
    run_tf=lambda ctf, comm, x, args: ctf.broadcast(x, comm, root=args.root),
    expected=lambda dtype, op, nranks, rank, count, root=0: rank_pattern(dtype, root, count),
    fill=pattern_fill,
    has_op=False,
    rooted=True,
)


# -- reduce (bench.reduce_perf) -----------------------------------------------------
# The input is allreduce's, so the root's (-r, default 0) result is
# allreduce's closed form; as in nccl-tests, only the root's output is
# checked, the others' being undefined. Ours and MPI take an output apart from
# the input; Gloo reduces in place: out of place, every rank first copies its
# input to its output.


def reduce_expected(dtype, op, nranks, rank, count, root=0):
    return allreduce_expected(dtype, op, nranks, rank, count) if rank == root else None


def reduce_ours(comm, x, out, args):
    in_place = all(o is i for o, i in zip(out, x))
    x, out = as_users_call(x, out)
    comm.reduce(x, root=args.root, op=args.op, out=None if in_place else out, algorithm=args.algorithm)


def reduce_mpi(comm, x, out, args):
    from mpi4py import MPI
    if comm.rank == args.root:
        comm.Reduce(MPI.IN_PLACE if x is None else mpi_buffer(x), mpi_buffer(out), op=mpi_op(args.op), root=args.root)
    else:
        comm.Reduce(mpi_buffer(out if x is None else x), None, op=mpi_op(args.op), root=args.root)


def reduce_gloo(dist, x, out, args):
    if x is not None:
        out.copy_(x)
    dist.reduce(out, dst=args.root, op=gloo_op(dist, args.op))


REDUCE = Spec(
    name="reduce",
    busbw_factor=lambda n: 1,
    counts=same_counts,
    run_ours=reduce_ours,
    run_mpi=reduce_mpi,
    run_gloo=reduce_gloo,
    expected=reduce_expected,
    fill=allreduce_fill,
    rooted=True,
)


# -- all_to_all (bench.alltoall_perf) -----------------------------------------------
# As in nccl-tests' alltoall_perf, the size is a rank's whole buffer (its
# input and its output alike: a block per rank), the count column one block
# (what a rank sends each peer), and busbw is algbw times (n-1)/n, since a
# rank's own block stays home. Rank r's input is rank_pattern(r), so block q
# of rank r's result is block r of rank q's pattern. In place, the result
# overwrites the input (MPI_IN_PLACE); nccl-tests leaves in place unchecked,
# this checks it as out of place.


def all_to_all_counts(nbytes, itemsize, nranks):
    whole = nbytes // itemsize // nranks * nranks   # whole blocks, as nccl-tests rounds
    return whole, whole


def all_to_all_expected(dtype, op, nranks, rank, count, root=0):
    block = count // nranks
    return np.concatenate([rank_pattern(dtype, q, block, start=rank * block) for q in range(nranks)])


def all_to_all_mpi(comm, x, out, args):
    from mpi4py import MPI
    comm.Alltoall(MPI.IN_PLACE if x is None else mpi_bytes(x), mpi_bytes(out))  # moves bytes: any type


def all_to_all_gloo(dist, x, out, args):
    # Gloo has no in-place all_to_all (given one tensor twice it writes blocks
    # it has yet to send: the check finds them wrong), so in place its input
    # is a copy, made inside the timed call.
    dist.all_to_all_single(out, out.clone() if x is None else x)


ALL_TO_ALL = Spec(
    name="all_to_all",
    busbw_factor=lambda n: (n - 1) / n,
    counts=all_to_all_counts,
    count_column=lambda nbytes, itemsize, n: nbytes // itemsize // n,
    run_ours=ours_call("all_to_all"),
    run_mpi=all_to_all_mpi,
    run_gloo=all_to_all_gloo,
    expected=all_to_all_expected,
    fill=pattern_fill,
    has_op=False,
)


# -- gather (bench.gather_perf) -----------------------------------------------------
# As in nccl-tests' gather_perf, the size is the gathered bytes (sendcount *
# nranks), the count column what each rank sends, and busbw is algbw times
# (n-1)/n: the root's own block does not travel. Rank r sends
# rank_pattern(r), so the root's (-r, default 0) result is allgather's; the
# other ranks' outputs are undefined (MPI's receive buffer is significant at
# the root only) and unchecked, as reduce's. In place, each rank's input is
# its own block of its output (MPI_IN_PLACE at the root).


def gather_expected(dtype, op, nranks, rank, count, root=0):
    return allgather_expected(dtype, op, nranks, rank, count) if rank == root else None


def gather_mpi(comm, x, out, args):
    from mpi4py import MPI
    if comm.rank == args.root:
        comm.Gather(MPI.IN_PLACE if x is None else mpi_bytes(x), mpi_bytes(out), root=args.root)
    else:   # moves bytes: any type
        comm.Gather(mpi_bytes(own_block(out, comm.rank, comm.size) if x is None else x), None, root=args.root)


def gather_gloo(dist, x, out, args):
    rank, n = dist.get_rank(), dist.get_world_size()
    if x is None:
        x = own_block(out, rank, n)
    dist.gather(x, list(out.chunk(n)) if rank == args.root else None, dst=args.root)


GATHER = Spec(
    name="gather",
    busbw_factor=lambda n: (n - 1) / n,
    counts=gathered_counts,
    run_ours=ours_call("gather", "root"),
    run_mpi=gather_mpi,
    run_gloo=gather_gloo,
    expected=gather_expected,
    fill=pattern_fill,
    has_op=False,
    rooted=True,
    in_place_input=own_block,
)


# -- scatter (bench.scatter_perf) ---------------------------------------------------
# As in nccl-tests' scatter_perf, the size is the root's input (recvcount *
# nranks elements), the count column what each rank receives, and busbw is
# algbw times (n-1)/n: the root's own block does not travel. Every rank's
# input is its own rank_pattern, of which only the root's (-r, default 0)
# may be read, so rank r's result is block r of the root's pattern. In
# place, the result is the rank's own block of its input (MPI_IN_PLACE at
# the root).


def scatter_mpi(comm, x, out, args):
    from mpi4py import MPI
    if comm.rank == args.root:
        comm.Scatter(mpi_bytes(out if x is None else x), MPI.IN_PLACE if x is None else mpi_bytes(out),
                     root=args.root)
    else:   # moves bytes: any type
        comm.Scatter(None, mpi_bytes(own_block(out, comm.rank, comm.size) if x is None else out), root=args.root)


def scatter_gloo(dist, x, out, args):
    rank, n = dist.get_rank(), dist.get_world_size()
    if x is None:
        x, out = out, own_block(out, rank, n)
    dist.scatter(out, list(x.chunk(n)) if rank == args.root else None, src=args.root)


SCATTER = Spec(
    name="scatter",
    busbw_factor=lambda n: (n - 1) / n,
    counts=scattered_counts,
    run_ours=ours_call("scatter", "root"),
    run_mpi=scatter_mpi,
    run_gloo=scatter_gloo,
    expected=lambda dtype, op, nranks, rank, count, root=0: rank_pattern(dtype, root, count, start=rank * count),
    fill=pattern_fill,
    has_op=False,
    rooted=True,
    in_place_result=own_block,
)


# By name, in the order bench.host_vs_mpich runs and reports them.
SPECS = {spec.name: spec for spec in (ALLREDUCE, REDUCE_SCATTER, ALLGATHER, BROADCAST, REDUCE,
                                      ALL_TO_ALL, GATHER, SCATTER)}
