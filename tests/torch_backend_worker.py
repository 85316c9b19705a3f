"""One rank of tests/test_torch_backend.py: torch.distributed's backend
"collectives" under torchrun, with no mpiexec and mpi4py hidden.

    python -m torch.distributed.run --nproc-per-node 4 --standalone torch_backend_worker.py SCENARIO

Scenarios, comma-separated, run in order (each rank checks its own results
and prints "OK <scenario> <rank>"):

    init       (first only) collectives.init() under torchrun: its store, no MPI
    ops        every op, form and dtype against a NumPy reference; object
               collectives, barrier, futures; gather, scatter, all_to_all
               (even and uneven) and all_gather_coalesced on the world and
               on groups of 3 and 2 ranks; point-to-point (not offered) and
               bad input raising, on every rank, with nothing written
    training   DDP on our group against DDP on a Gloo group of the same
               processes (same seed, same data), and FSDP2 (fully_shard)
               on our group against both
    compressed compression_hook on our group's communicator (on DDP on our
               group, and on DDP on Gloo) and DistributedOptimizer with a
               codec, against DDP on Gloo uncompressed
    failure    the group's timeout is ours; a stalled rank, ranks that
               disagree on a shape, and a killed rank make the others raise
               our typed errors through work.wait() and DDP's backward

With $COLLECTIVES_PRETEND_NODES set (tests), "ops", "training" and
"compressed" run on the hierarchical communicator: Gloo between the pretend nodes.

$TORCH_BACKEND_TEST_SABOTAGE=1 makes the reference wrong (allreduce's SUM
reference gains 1), so that the test that runs it shows the checks fail.
"""

import sys

sys.modules["mpi4py"] = None   # any `import mpi4py` now raises ImportError: the backend must not need it

import datetime
import functools
import os
import signal
import time
import warnings

from rare_collections import collect_rarely

collect_rarely()   # before PyTorch and TensorFlow load: rare_collections.py says why

import numpy as np
import torch
import torch.distributed as dist

import collectives.torch  # noqa: F401  (registers the backend)
from collectives import CollectiveTimeoutError, InvalidUsageError, RankFailedError
from collectives.hierarchy import HierarchicalCommunicator
from collectives.torch.tensors import host_array

R = dist.ReduceOp
# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (the
# *_single spellings): both are checked here, the old ones quietly
warnings.filterwarnings("ignore", category=FutureWarning, message=".*is deprecated.*")
warnings.filterwarnings("ignore", category=FutureWarning, message=".*all_gather_coalesced. will be deprecated.*")
SABOTAGE = os.environ.get("TORCH_BACKEND_TEST_SABOTAGE") == "1"


def say(*words):
    print(*words, flush=True)


def check(condition, what):
    if not condition:
        raise AssertionError(f"rank {dist.get_rank()}: {what}")


def same(got, want, what):
    """Bit-exact equality of a tensor with a NumPy reference (NaNs too)."""
    got_np = host_array(got.contiguous()).astype(np.float64) if got.dtype in (torch.bfloat16,) else \
        host_array(got.contiguous())
    want = np.asarray(want).astype(got_np.dtype).reshape(got_np.shape)
    if got.dtype in (torch.bfloat16, torch.float16):
        want = host_array(tensor(np.asarray(want, np.float64)).to(got.dtype)).astype(got_np.dtype)
    check(np.array_equal(got_np, want), f"{what}: got {got_np.ravel()[:6]}..., want {want.ravel()[:6]}...")


# -- data: every rank can compute every rank's input ------------------------------------------------

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INTS = (torch.int32, torch.int64, torch.int8, torch.uint8)


def data(rank, n, dtype, step=0, low=-8, high=9):
    """Rank `rank`'s input: small integers (so any fold order sums them
    exactly, in every dtype), as `dtype`."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    if dtype == torch.uint8 or (dtype == torch.int8 and low < -4):
        low, high = (0, 30) if dtype == torch.uint8 else (-30, 31)
    return torch.randint(low, high, (n,), generator=g).to(dtype)


def tensor(array):
    """A tensor copying `array` (torch.from_numpy would share it, and the collectives write in place)."""
    return torch.from_numpy(np.array(array))


def everyone(n, dtype, step=0, **kw):
    return np.stack([data(r, n, dtype, step, **kw).double().numpy() for r in range(dist.get_world_size())])


def reference(op, xs, size):
    if op == R.SUM:
        return xs.sum(0) + (1 if SABOTAGE else 0)
    if op == R.AVG:
        return np.trunc(xs.sum(0) / size)   # exact for the floats below; C's truncation for integers
    if op == R.PRODUCT:
        return xs.prod(0)
    if op == R.MIN:
        return xs.min(0)
    if op == R.MAX:
        return xs.max(0)
    raise AssertionError(op)


def raises(what, call, *untouched, kinds=(InvalidUsageError,)):
    """`call()` raises one of `kinds` (its message returned), having written none of `untouched`."""
    before = [u.clone() for u in untouched]
    try:
        call()
    except kinds as error:
        message = str(error)
    else:
        check(False, f"{what} did not raise")
    for u, b in zip(untouched, before):
        check(torch.equal(u, b) or (u.isnan() == b.isnan()).all(), f"{what} wrote a tensor before raising")
    return message


# -- the ops scenario --------------------------------------------------------------------------------

def ops():
    rank, size = dist.get_rank(), dist.get_world_size()
    pg = dist.group.WORLD
    check(pg.name() == "collectives" if hasattr(pg, "name") else True, "the backend's name")
    check(type(pg).__name__ == "ProcessGroupCollectives", f"the default group is ours, not {type(pg)}")
    pretend = os.environ.get("COLLECTIVES_PRETEND_NODES")
    check(isinstance(pg.communicator(), HierarchicalCommunicator) == bool(pretend),
          f"pretend nodes {pretend!r} give the hierarchical communicator")
    n = 37   # not a multiple of anything

    # allreduce: every op, dtype; blocking and async (the future holds the tensor)
    for dtype in FLOATS + INTS:
        for op in (R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX):
            if op == R.AVG and dtype in INTS:
                continue   # checked below with values that divide (C's truncation is ours, not torch's rule)
            kw = dict(low=1, high=3) if op == R.PRODUCT else {}
            xs = everyone(n, dtype, **kw)
            if op == R.AVG:
                xs = xs * size   # sums that divide by size: exact in every float dtype
            t = tensor(xs[rank]).to(dtype)
            if op == R.AVG and dtype == torch.uint8:
                continue
            work = dist.all_reduce(t, op=op, async_op=True)
            got = work.get_future().wait()
            check(work.wait() is True and got[0] is t, f"allreduce's work and future ({dtype}, {op})")
            same(t, reference(op, xs, size), f"allreduce {op} {dtype}")
    xs = everyone(n, torch.int64) * size
    t = tensor(xs[rank]).to(torch.int32)
    dist.all_reduce(t, op=R.AVG)
    same(t, xs.sum(0) // size, "allreduce AVG int32")

    # a sparse COO tensor (embedding gradients): summed, as Gloo sums them; ranks with different entries,
    # duplicates, one rank with none; the result replaces the tensor's contents on every rank
    def sparse_of(r):
        entries = 0 if r == size - 1 else 4 + r
        g = torch.Generator().manual_seed(r)
        return torch.sparse_coo_tensor(torch.randint(0, 5, (2, entries), generator=g),
                                       torch.randn(entries, 3, generator=g), (5, 5, 3), check_invariants=True)
    t = sparse_of(rank)
    dist.all_reduce(t)
    check(t.layout == torch.sparse_coo and t.is_coalesced(), "a sparse allreduce leaves a coalesced sparse tensor")
    want = sum(sparse_of(r).to_dense().double() for r in range(size))
    check(torch.allclose(t.to_dense().double(), want, atol=1e-5), "sparse allreduce: the sum of every rank's entries")
    dense = t.to_dense()
    gathered = [torch.empty_like(dense) for _ in range(size)]
    dist.all_gather(gathered, dense)
    check(all(torch.equal(x, gathered[0]) for x in gathered), "sparse allreduce: the same bits on every rank")
    raises("a sparse allreduce with MAX", lambda: dist.all_reduce(sparse_of(rank), op=R.MAX), kinds=(NotImplementedError,))
    other = torch.sparse_coo_tensor(torch.zeros((2, 1), dtype=torch.int64), torch.ones(1, 3 + (rank == 0)),
                                    (5, 5, 3 + (rank == 0)))
    message = raises("sparse tensors of different shapes", lambda: dist.all_reduce(other))
    check("sparse tensors differ in shape" in message, message)

    # PREMUL_SUM (FSDP2 with a divide factor): sum of factor * x
    if hasattr(dist, "_make_nccl_premul_sum"):
        xs = everyone(n, torch.float32)
        t = tensor(xs[rank]).float()
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
        same(t, (0.5 * xs).sum(0), "allreduce PREMUL_SUM")

    # random floats: every rank ends with the same bits, close to float64's sum
    g = torch.Generator().manual_seed(rank)
    t = torch.randn(1000, generator=g)
    exact = sum(torch.randn(1000, generator=torch.Generator().manual_seed(r)).double() for r in range(size))
    dist.all_reduce(t)
    check(torch.allclose(t.double(), exact, rtol=0, atol=4 * size * 2 ** -24 * 8), "random float32 sums")
    copies = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(copies, t)
    check(all(torch.equal(c, t) for c in copies), "every rank holds the same bits of a float sum")

    # a non-contiguous tensor (a transposed view): written through
    base = tensor(everyone(12, torch.float32)[rank]).float().reshape(3, 4)
    view = base.t()
    dist.all_reduce(view)
    same(base.reshape(-1), everyone(12, torch.float32).sum(0) + (1 if SABOTAGE else 0),
         "allreduce of a transposed view")

    # broadcast: every root, dtypes that are only moved (bool, complex)
    for root in range(size):
        for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64):
            t = (data(rank, n, torch.float32) > 0).to(dtype) if dtype == torch.bool else \
                data(rank, n, torch.float32).to(dtype)
            want = (data(root, n, torch.float32) > 0).to(dtype) if dtype == torch.bool else \
                data(root, n, torch.float32).to(dtype)
            dist.broadcast(t, src=root)
            check(torch.equal(t, want), f"broadcast from {root} ({dtype})")

    # reduce: the root gets the sum, the others keep their input
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for op in (R.SUM, R.MAX):
            root = size - 1
            xs = everyone(n, dtype)
            t = tensor(xs[rank]).to(dtype)
            dist.reduce(t, dst=root, op=op)
            same(t, reference(op, xs, size) if rank == root else xs[rank], f"reduce {op} {dtype}")

    # allgather: the list form, and the single-tensor forms (flat, and stacked)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.bool):
        mine = data(rank, n, torch.float32).to(dtype)
        outs = [torch.empty(n, dtype=dtype) for _ in range(size)]
        dist.all_gather(outs, mine)
        for r in range(size):
            check(torch.equal(outs[r], data(r, n, torch.float32).to(dtype)), f"all_gather block {r} {dtype}")
        flat = torch.empty(size * n, dtype=dtype)
        dist.all_gather_into_tensor(flat, mine)
        check(torch.equal(flat, torch.cat(outs)), f"all_gather_into_tensor flat {dtype}")
        stacked = torch.empty(size, n, dtype=dtype)
        dist.all_gather_into_tensor(stacked, mine)
        check(torch.equal(stacked, torch.stack(outs)), f"all_gather_into_tensor stacked {dtype}")
        if hasattr(dist, "all_gather_single"):
            flat = torch.empty(size * n, dtype=dtype)
            dist.all_gather_single(flat, mine)
            check(torch.equal(flat, torch.cat(outs)), f"all_gather_single {dtype}")

    # large calls, past every size at which a path across nodes changes: 1 MiB rows, a 4 MiB broadcast
    count = (1 << 18) + 1
    flat = torch.empty(size * count)
    dist.all_gather_into_tensor(flat, data(rank, count, torch.float32))
    check(torch.equal(flat, torch.cat([data(r, count, torch.float32) for r in range(size)])), "a large all_gather")
    sent = data(0, 1 << 20, torch.float32)
    got = sent.clone() if rank == 0 else torch.zeros(1 << 20)
    dist.broadcast(got, src=0)
    check(torch.equal(got, sent), "a large broadcast")

    # reduce_scatter: the list form, the single-tensor form; SUM and AVG
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32):
        for op in (R.SUM, R.AVG) if dtype in FLOATS else (R.SUM, R.MAX):
            xs = everyone(size * n, dtype) * (size if op == R.AVG else 1)
            want = reference(op, xs, size)[rank * n:(rank + 1) * n]
            full = tensor(xs[rank]).to(dtype)
            out = torch.empty(n, dtype=dtype)
            dist.reduce_scatter(out, list(full.chunk(size)), op=op)
            same(out, want, f"reduce_scatter {op} {dtype}")
            out = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(out, full, op=op)
            same(out, want, f"reduce_scatter_tensor {op} {dtype}")
            if hasattr(dist, "reduce_scatter_single"):
                out = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_single(out, full, op=op)
                same(out, want, f"reduce_scatter_single {op} {dtype}")
            check(torch.equal(full, tensor(xs[rank]).to(dtype)), "reduce_scatter_tensor left its input")

    # coalesced forms: torch's coalescing manager (what FSDP and full_tensor() use), and allreduce_coalesced
    xs = [everyone(k, torch.float32, step=k) for k in (3, 50, 7)]
    ts = [tensor(x[rank]).float() for x in xs]
    with dist._coalescing_manager(async_ops=True) as manager:
        for t in ts:
            dist.all_reduce(t)
    manager.wait()
    for t, x in zip(ts, xs):
        same(t, reference(R.SUM, x, size), "coalesced all_reduce")
    ins = [data(rank, k, torch.float32) for k in (5, 9)]
    outs = [torch.empty(size * k) for k in (5, 9)]
    with dist._coalescing_manager(async_ops=True) as manager:
        for o, i in zip(outs, ins):
            dist.all_gather_into_tensor(o, i)
    manager.wait()
    for o, k in zip(outs, (5, 9)):
        check(torch.equal(o, torch.cat([data(r, k, torch.float32) for r in range(size)])), "coalesced all_gather")
    xs = [everyone(size * k, torch.float32, step=k) for k in (2, 6)]
    outs = [torch.empty(k) for k in (2, 6)]
    with dist._coalescing_manager(async_ops=True) as manager:
        for o, x in zip(outs, xs):
            dist.reduce_scatter_tensor(o, tensor(x[rank]).float(), op=R.AVG)
    manager.wait()
    for o, x, k in zip(outs, xs, (2, 6)):
        same(o, reference(R.SUM, x, size)[rank * k:(rank + 1) * k] / size - (1 / size if SABOTAGE else 0),
             "coalesced reduce_scatter AVG")
    xs = [everyone(k, torch.float64, step=k) for k in (4, 11)]
    ts = [tensor(x[rank]).clone() for x in xs]
    work = pg.allreduce_coalesced(ts, dist.AllreduceCoalescedOptions())
    work.wait()
    for t, x in zip(ts, xs):
        same(t, reference(R.SUM, x, size), "allreduce_coalesced")

    # objects and barrier
    objects = [None] * size
    dist.all_gather_object(objects, {"rank": rank, "text": "x" * rank})
    check(objects == [{"rank": r, "text": "x" * r} for r in range(size)], f"all_gather_object: {objects}")
    sent = [f"from {size - 1}", {"n": 3}, None] if rank == size - 1 else [None, None, None]
    dist.broadcast_object_list(sent, src=size - 1)
    check(sent == [f"from {size - 1}", {"n": 3}, None], f"broadcast_object_list: {sent}")
    dist.barrier()
    work = dist.barrier(async_op=True)
    work.wait()

    # gather, scatter, all_to_all and all_gather_coalesced on the world; below on groups of 3 and 2 ranks
    exchanges(pg)

    point_to_point(pg)

    # bad input: a typed error before anything is written, on every rank
    t = torch.full((6,), 3.0)
    raises("BAND", lambda: dist.all_reduce(t, op=R.BAND), t)
    flags = torch.tensor([True, False])
    message = raises("a bool allreduce", lambda: dist.all_reduce(flags), flags)
    check("bool" in message, f"the dtype is named: {message}")
    outs = [torch.full((6,), -1.0) for _ in range(size + 1)]
    raises("all_gather with too many outputs", lambda: dist.all_gather(outs, t), t, *outs)
    outs = [torch.full((5,), -1.0) for _ in range(size)]
    raises("all_gather with outputs of the wrong shape", lambda: dist.all_gather(outs, t), t, *outs)
    flat = torch.full((size * 6 + 1,), -1.0)
    raises("all_gather_into_tensor of the wrong size", lambda: dist.all_gather_into_tensor(flat, t), flat)
    out = torch.full((6,), -1.0)
    raises("reduce_scatter_tensor of the wrong size", lambda: dist.reduce_scatter_tensor(out, torch.ones(size * 6 - 1)),
           out)
    good, bad = torch.full((size * 2,), -1.0), torch.full((size * 3 + 1,), -1.0)
    raises("a coalesced all_gather with a bad second item",
           lambda: pg.all_gather_single_coalesced([good, bad], [torch.ones(2), torch.ones(3)]),
           good, bad)
    meta = torch.empty(6, device="meta")
    raises("a tensor on the meta device", lambda: dist.all_reduce(meta))
    # the device map form makes our group too (torch makes one Python group for every device)
    mapped = dist.new_group(backend="cpu:collectives,cuda:collectives")
    check(type(mapped).__name__ == "ProcessGroupCollectives", f"the device map form gave {type(mapped)}")
    t = torch.full((3,), float(rank))
    dist.all_reduce(t, group=mapped)
    check(torch.equal(t, torch.full((3,), float(sum(range(size))))), "an allreduce on the device map's group")
    dist.destroy_process_group(mapped)

    # a group of some ranks (every rank calls new_group; members only call on it), ranks renumbered
    members = list(range(1, size))
    sub = dist.new_group(ranks=members, backend="collectives")
    if rank in members:
        t = torch.full((5,), float(rank))
        dist.all_reduce(t, group=sub)
        check(torch.equal(t, torch.full((5,), float(sum(members)))), f"a subgroup's allreduce: {t}")
        outs = [torch.empty(2) for _ in members]
        dist.all_gather(outs, torch.full((2,), float(rank)), group=sub)
        check([o[0].item() for o in outs] == [float(m) for m in members], f"a subgroup's all_gather: {outs}")
        exchanges(sub)
        point_to_point(sub)
        dist.destroy_process_group(sub)
    pair = dist.new_group(ranks=[0, 1], backend="collectives")
    if rank < 2:
        exchanges(pair)
        dist.destroy_process_group(pair)

    # after all that, the group still works
    t = torch.full((6,), float(rank))
    dist.all_reduce(t)
    check(torch.equal(t, torch.full((6,), float(sum(range(size))))), "the group works after the refusals")
    check("mpi4py" not in sys.modules or sys.modules["mpi4py"] is None, "mpi4py was imported")
    check(not any(v in os.environ for v in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")), "an MPI launcher")


def small(q, n, step, dtype):
    """Rank q's `n` small integers of a step, as `dtype`: exact in bfloat16 too."""
    return data(q, n, torch.float32, step=step).to(dtype)


def rows(p, q):
    """The rows rank p sends rank q in the uneven all_to_all checks: 0, 1 or 2 (some blocks empty)."""
    return (p + 2 * q) % 3


def blocks_of(p, size, dtype):
    """Rank p's uneven all_to_all blocks, one per rank q: rows(p, q) rows of 2."""
    counts = [rows(p, q) for q in range(size)]
    return list(torch.split(small(p, 2 * sum(counts), 4, dtype).reshape(-1, 2), counts))


def exchanges(group):
    """gather, scatter, all_to_all (list and single-tensor forms, even and
    uneven splits) and all_gather_coalesced on `group`, against every rank's
    data (each rank can compute any rank's); their bad input. Group ranks
    throughout (group_dst, group_src)."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    for dtype in (torch.bfloat16, torch.int64):
        some = functools.partial(small, dtype=dtype)
        for root in (0, size - 1):
            blocks = [torch.full((2, 3), -1).to(dtype) for _ in range(size)] if me == root else None
            work = dist.gather(some(me, 6, root).reshape(2, 3), blocks, group=group, group_dst=root, async_op=True)
            check(work.wait() is True, "gather's work")
            for q, block in enumerate(blocks or ()):
                check(torch.equal(block.reshape(-1), some(q, 6, root)), f"gather to {root}: rank {q}'s block {dtype}")
            out = torch.full((5,), -1).to(dtype)
            dist.scatter(out, [some(q, 5, 10 + root) for q in range(size)] if me == root else None, group=group,
                         group_src=root)
            check(torch.equal(out, some(me, 5, 10 + root)), f"scatter from {root} {dtype}")

        # equal splits: block q of rank p's input goes to rank q
        x = some(me, 4 * size, 20)
        out = torch.full_like(x, -1)
        dist.all_to_all_single(out, x, group=group)
        want = torch.cat([some(q, 4 * size, 20)[4 * me:4 * me + 4] for q in range(size)])
        check(torch.equal(out, want) and torch.equal(x, some(me, 4 * size, 20)), f"all_to_all_single even {dtype}")

        # uneven splits (blocks of 0, 1 and 2 rows), asynchronous: the future holds the output
        x = torch.cat(blocks_of(me, size, dtype))
        out = torch.full((sum(rows(q, me) for q in range(size)), 2), -1).to(dtype)
        work = dist.all_to_all_single(out, x, [rows(q, me) for q in range(size)], [rows(me, q) for q in range(size)],
                                      group=group, async_op=True)
        check(work.get_future().wait()[0] is out, "all_to_all_single's future holds its output")
        want = torch.cat([blocks_of(q, size, dtype)[me] for q in range(size)])
        check(torch.equal(out, want), f"all_to_all_single uneven {dtype}: {out.tolist()} != {want.tolist()}")

        # the list form, of the same uneven blocks, into non-contiguous outputs (transposed views)
        outs = [torch.full((2, rows(q, me)), -1).to(dtype).t() for q in range(size)]
        dist.all_to_all(outs, blocks_of(me, size, dtype), group=group)
        for q, got in enumerate(outs):
            check(torch.equal(got, blocks_of(q, size, dtype)[me]), f"all_to_all from rank {q} {dtype}")

    # all_gather_coalesced: one list per rank of items of any shapes, empty ones too (torch's suite's case)
    items = [torch.full((2, 2), float(me)), torch.ones(0), torch.full((3,), me + 1.0)]
    outs = [[torch.full_like(item, -1) for item in items] for _ in range(size)]
    dist.all_gather_coalesced(outs, items, group=group)
    for q, got in enumerate(outs):
        check(torch.equal(got[0], torch.full((2, 2), float(q))) and torch.equal(got[2], torch.full((3,), q + 1.0)),
              f"all_gather_coalesced from rank {q}: {got}")

    # bad input, on every rank: nothing written
    outs = [[torch.full_like(item, -1) for item in items] for _ in range(size - 1)]
    raises("all_gather_coalesced with a list too few", lambda: dist.all_gather_coalesced(outs, items, group=group),
           *[t for ts in outs for t in ts])
    t = torch.full((4,), -1.0)
    outs = [t.clone() for _ in range(size + 1)]
    raises("all_to_all with a tensor too many", lambda: dist.all_to_all(outs, outs, group=group), *outs)
    raises("all_to_all of two dtypes",
           lambda: group.alltoall([t] * size, [t.double()] * size, dist.AllToAllOptions()), t)
    raises("all_to_all_single with splits that do not sum to dim 0",
           lambda: dist.all_to_all_single(t, torch.ones(4), [4] + [0] * (size - 1), [3] + [0] * (size - 1),
                                          group=group), t)
    uneven = torch.full((4 * size + 1,), -1.0)
    raises("all_to_all_single unsplittable", lambda: dist.all_to_all_single(uneven, uneven.clone(), group=group),
           uneven)
    message = raises("all_to_all_single with splits its peers do not match",
                     lambda: dist.all_to_all_single(t, torch.ones(4), [4] + [0] * (size - 1),
                                                    [4 if me == 0 else 0] + [0] * (size - 2) + [4 if me else 0],
                                                    group=group, async_op=True).wait(), t)
    check("sends" in message and "expects" in message, f"the mismatch is said: {message}")
    # a root's own list: checked before any message, so the root alone calls here (its peers would wait)
    if me == 0:
        opts = dist.GatherOptions()
        opts.rootRank = 0
        outs = [torch.full((4,), -1.0) for _ in range(size - 1)]
        raises("gather with a gather_list too short", lambda: group.gather([outs], [t], opts), *outs)
        opts = dist.ScatterOptions()
        opts.rootRank = 0
        message = raises("scatter of a wrong shape", lambda: group.scatter([t], [[torch.ones(5)] * size], opts), t)
        check("input_tensors" in message, f"scatter's error names the argument: {message}")


def point_to_point(group):
    """send, recv (from a rank and from any), isend, irecv and
    batch_isend_irecv on `group` (group ranks): a ring of messages past the
    mailbox's slots both ways at once, tags taken out of order, a
    non-contiguous receive, any source naming its sender."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    right, left = (me + 1) % size, (me - 1) % size
    if os.environ.get("COLLECTIVES_PRETEND_NODES"):   # not across nodes yet: said, nothing sent
        t = torch.full((4,), float(me))
        message = raises("send across nodes", lambda: dist.send(t, group=group, group_dst=right), t)
        check("not available yet on HierarchyRanks" in message, f"send across nodes says why: {message}")
        return
    big = small(me, 300_000, 30, torch.float32)             # 1.2 MB: more than a mailbox holds
    out = torch.full_like(big, -1)
    works = [dist.isend(big, group=group, group_dst=right), dist.irecv(out, group=group, group_src=left)]
    for work in works:
        work.wait()
    check(torch.equal(out, small(left, 300_000, 30, torch.float32)), "isend/irecv around the ring")
    ops = [dist.P2POp(dist.isend, big, group=group, group_peer=right),
           dist.P2POp(dist.irecv, out, group=group, group_peer=left)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    check(torch.equal(out, small(left, 300_000, 30, torch.float32)), "batch_isend_irecv around the ring")
    if me == 0:     # tags 1 then 2; rank 1 takes 2 first, the second into a transposed view
        for tag in (1, 2):
            dist.send(torch.full((2, 3), float(tag), dtype=torch.bfloat16), group=group, group_dst=1, tag=tag)
    elif me == 1:
        second = torch.full((3, 2), -1, dtype=torch.bfloat16).t()
        first = torch.full((2, 3), -1, dtype=torch.bfloat16)
        dist.recv(second, group=group, group_src=0, tag=2)
        dist.recv(first, group=group, group_src=0, tag=1)
        check(torch.equal(first, torch.full((2, 3), 1.0, dtype=torch.bfloat16))
              and torch.equal(second, torch.full((2, 3), 2.0, dtype=torch.bfloat16)), "send/recv by tag")
    if me == 0:     # from any rank: each sender is named
        senders = set()
        for _ in range(size - 1):
            got = torch.empty(3, dtype=torch.int64)
            sender = dist.get_group_rank(group, dist.recv(got, group=group, tag=7)) if group is not None \
                else dist.recv(got, tag=7)
            check(torch.equal(got, torch.full((3,), sender)), f"recv from any rank: {got} from {sender}")
            senders.add(sender)
        check(senders == set(range(1, size)), f"recv from any rank heard {senders}")
    else:
        dist.send(torch.full((3,), me), group=group, group_dst=0, tag=7)


# -- the training scenario ---------------------------------------------------------------------------

STEPS = 8


def model(buffers=True):
    """BatchNorm's buffers make DDP broadcast them from rank 0 at every
    forward; without buffers, DDP's only calls are its backward's allreduces."""
    torch.manual_seed(0)
    norm = torch.nn.BatchNorm1d(64) if buffers else torch.nn.Identity()
    return torch.nn.Sequential(torch.nn.Linear(32, 64), norm, torch.nn.Tanh(),
                               torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 10))


def batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)


def train(net, steps=STEPS, lr=0.1):
    """SGD with momentum on this rank's batches; returns the losses."""
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = batch(step, dist.get_rank())
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def flat_params(net):
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


# Parameters of DDP on our group and on Gloo's, after STEPS steps, agree to
# this (absolute, on parameters of size ~0.1-1). Both average the same four
# float32 gradients; only the order of the three additions differs, so each
# step's averaged gradient differs by at most ~3 ulp of the sum of |g| (about
# 1e-7 here), and momentum SGD over 8 steps with lr 0.1 carries that into the
# parameters as at most a few 1e-7. 1e-5 leaves a margin of more than 10x;
# a wrong reduction (SUM instead of AVG, a dropped rank, a stale bucket)
# moves the parameters by 1e-2 or more.
DDP_TOLERANCE = 1e-5


def training():
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.device_mesh import DeviceMesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, size = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    ours = DDP(model(), bucket_cap_mb=0.01)   # several buckets: several allreduces per step
    theirs = DDP(model(), bucket_cap_mb=0.01, process_group=gloo)
    ours_losses, theirs_losses = train(ours), train(theirs)
    a, b = flat_params(ours.module), flat_params(theirs.module)
    difference = (a - b).abs().max().item()
    check(difference <= DDP_TOLERANCE, f"DDP on collectives and on Gloo differ by {difference}")
    moved = (a - flat_params(model())).abs().max().item()
    check(moved > 100 * DDP_TOLERANCE, f"training moved the parameters by only {moved}")
    everyone_a = [torch.empty_like(a) for _ in range(size)]
    dist.all_gather(everyone_a, a, group=gloo)
    check(all(torch.equal(x, a) for x in everyone_a), "DDP on collectives: every rank holds the same parameters")
    ours_stats, theirs_stats = ours.module[1].running_mean, theirs.module[1].running_mean
    check((ours_stats - theirs_stats).abs().max().item() <= DDP_TOLERANCE, "DDP's broadcast buffers differ")
    say(f"DDP rank {rank}: max |ours - gloo| = {difference:.3g} after {STEPS} steps (moved {moved:.3g}); "
        f"last loss ours {ours_losses[-1]:.6f} gloo {theirs_losses[-1]:.6f}")

    # FSDP2 on our group: all_gather_single and reduce_scatter_single (AVG) per layer, full_tensor()'s
    # all_gather_single_coalesced; the same model and data as DDP, so the same parameters
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")

    def sharded_model():
        sharded = model()
        for layer in sharded:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(sharded, mesh=mesh)

    sharded = sharded_model()
    fsdp_losses = train(sharded)
    full = torch.cat([p.full_tensor().reshape(-1) for p in sharded.parameters()])
    difference = (full - a).abs().max().item()
    check(difference <= DDP_TOLERANCE, f"FSDP2 on collectives and DDP on collectives differ by {difference}")
    say(f"FSDP2 rank {rank}: max |fsdp2 - ddp| = {difference:.3g}; last loss {fsdp_losses[-1]:.6f}")
    # a divide factor makes FSDP2 reduce with PREMUL_SUM(1 / factor): gradients halved, learning rate doubled,
    # the same parameters (SGD with momentum is linear in the gradient's scale)
    halved = sharded_model()
    for module in halved.modules():   # each fully_shard'ed module reduces its own gradients
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(2.0 * size)
    train(halved, lr=0.2)
    full = torch.cat([p.full_tensor().reshape(-1) for p in halved.parameters()])
    difference = (full - a).abs().max().item()
    check(difference <= DDP_TOLERANCE, f"FSDP2 with PREMUL_SUM and DDP differ by {difference}")
    say(f"FSDP2 PREMUL_SUM rank {rank}: max |fsdp2 - ddp| = {difference:.3g}")


# -- the compressed scenario -------------------------------------------------------------------------

# How far compressed training may land from uncompressed DDP on Gloo after
# STEPS steps, as a fraction of how far training moved the parameters: each
# step's averaged gradient errs by about 2^-8 (bf16) or 1/128 (int8) of its
# block's magnitude, and momentum SGD carries that into the parameters. A
# wrong average (a sum, a dropped rank) moves them by the whole step or more.
COMPRESSED_TOLERANCE = 0.02


def compressed():
    """compression_hook on our group's communicator (across nodes, with
    $COLLECTIVES_PRETEND_NODES, the hierarchical one): on DDP on our group
    (bf16), and beside Gloo on DDP on a Gloo group (int8, error feedback);
    DistributedOptimizer with int8 and error feedback. Each near DDP on
    Gloo uncompressed, every rank the same parameters."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from collectives.torch import DistributedOptimizer, compression_hook

    rank, size = dist.get_rank(), dist.get_world_size()
    comm = dist.group.WORLD.communicator()
    check(isinstance(comm, HierarchicalCommunicator) == bool(os.environ.get("COLLECTIVES_PRETEND_NODES")),
          "pretend nodes give the hierarchy")
    gloo = dist.new_group(backend="gloo")
    plain = DDP(model(buffers=False), bucket_cap_mb=0.01, process_group=gloo)
    train(plain)
    reference = flat_params(plain.module)
    moved = (reference - flat_params(model(buffers=False))).abs().max().item()

    def same_everywhere_and_near(net, what):
        got = flat_params(net)
        everyone = [torch.empty_like(got) for _ in range(size)]
        dist.all_gather(everyone, got, group=gloo)
        check(all(torch.equal(x, got) for x in everyone), f"{what}: every rank holds the same parameters")
        difference = (got - reference).abs().max().item()
        check(difference <= COMPRESSED_TOLERANCE * moved, f"{what}: {difference} from uncompressed (moved {moved})")
        say(f"{what} rank {rank}: max |compressed - gloo| = {difference:.3g} (moved {moved:.3g})")

    for codec, group, feedback in (("bf16", None, False), ("int8", gloo, True)):
        net = DDP(model(buffers=False), bucket_cap_mb=0.01, process_group=group)
        hook = compression_hook(codec, error_feedback=feedback)
        net.register_comm_hook(dist.group.WORLD, hook)
        train(net)
        same_everywhere_and_near(net.module, f"{codec} hook on DDP on {'Gloo' if group else 'collectives'}")
        if feedback:
            residual = hook.residual(0)
            check(residual is not None and np.any(residual != 0), "error feedback kept a residual")

    net = model(buffers=False)
    optimizer = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), comm,
                                     compression="int8", error_feedback=True)
    for step in range(STEPS):
        x, y = batch(step, rank)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
    same_everywhere_and_near(net, "int8 DistributedOptimizer")


# -- the failure scenario ----------------------------------------------------------------------------

def failure():
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, size = dist.get_rank(), dist.get_world_size()
    last = size - 1
    check(dist.group.WORLD.communicator().timeout == 20.0, "the process group's timeout is the communicator's")

    # a stalled rank: the others' work.wait() raises CollectiveTimeoutError at the group's timeout
    stalled = dist.new_group(backend="collectives", timeout=datetime.timedelta(seconds=2))
    check(stalled.communicator().timeout == 2.0, "new_group's timeout is the communicator's")
    t = torch.ones(100)
    if rank == last:
        time.sleep(4)
    began = time.perf_counter()
    work = dist.all_reduce(t, group=stalled, async_op=True)
    try:
        work.wait()
    except CollectiveTimeoutError as error:
        took = time.perf_counter() - began
        check(rank == last or 1.5 < took < 3.5, f"the stall was seen after {took:.1f} s, the timeout is 2 s")
        say(f"stall rank {rank}: {type(error).__name__} after {took:.1f} s: {str(error)[:100]}")
    else:
        check(False, "a stalled rank did not make work.wait() raise")
    dist.barrier()   # the default group is unharmed

    # ranks that disagree on the shape: every rank raises, none hangs
    mismatched = dist.new_group(backend="collectives", timeout=datetime.timedelta(seconds=5))
    t = torch.ones(5 if rank == 0 else 6)
    try:
        dist.all_reduce(t, group=mismatched)
    except (InvalidUsageError, CollectiveTimeoutError) as error:
        say(f"mismatch rank {rank}: {type(error).__name__}: {str(error)[:100]}")
    else:
        check(False, "ranks that disagree on a shape did not raise")
    dist.barrier()

    # a killed rank: the others raise RankFailedError through DDP's backward and work.wait(), well
    # before the group's 10 s timeout
    doomed = dist.new_group(backend="collectives", timeout=datetime.timedelta(seconds=10))
    net = DDP(model(buffers=False), process_group=doomed)   # its first call after the kill: backward's
    # torchrun's agent answers the death with SIGTERM to the others: they
    # ignore it, to show what our library does (they exit on their own)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    dist.barrier(group=doomed)
    if rank == last:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    began = time.perf_counter()
    work = dist.all_reduce(torch.ones(10), group=doomed, async_op=True)
    try:
        work.wait()
    except RankFailedError as error:
        took = time.perf_counter() - began
        check(took < 8, f"work.wait() raised after {took:.1f} s")
        say(f"killed rank, work.wait() rank {rank}: RankFailedError after {took:.1f} s: {str(error)[:100]}")
    else:
        check(False, "an allreduce went on without a rank")
    x, y = batch(0, rank)
    began = time.perf_counter()
    try:
        torch.nn.functional.cross_entropy(net(x), y).backward()
    except RuntimeError as error:
        took = time.perf_counter() - began
        check("RankFailedError" in str(error), f"DDP's error names ours: {error}")
        check(took < 8, f"DDP's backward raised after {took:.1f} s")
        say(f"killed rank, DDP rank {rank}: RuntimeError after {took:.1f} s: {str(error).splitlines()[0][:120]}")
    else:
        check(False, "DDP's backward went on without a rank")


# -- collectives.init() under torchrun --------------------------------------------------------------

def init():
    """collectives.init() under torchrun: the ranks meet through torchrun's
    store (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), not MPI."""
    import collectives
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with collectives.init(timeout=60) as comm:
        check((comm.rank, comm.size) == (rank, size), f"init's rank and size {comm.rank}, {comm.size}")
        pretend = os.environ.get("COLLECTIVES_PRETEND_NODES")
        check(isinstance(comm, HierarchicalCommunicator) == bool(pretend), "pretend nodes give the hierarchy")
        x = np.arange(10, dtype=np.float32) * (rank + 1)
        comm.allreduce(x)
        same(torch.from_numpy(x), np.arange(10) * sum(range(1, size + 1)), "init's allreduce")


SCENARIOS = {"init": init, "ops": ops, "training": training, "compressed": compressed, "failure": failure}


def main():
    scenarios = sys.argv[1].split(",")
    if scenarios[0] == "init":   # before torch.distributed: init() must not need a process group
        init()
        say(f"OK init {os.environ['RANK']}")
        scenarios = scenarios[1:]
    timeout = datetime.timedelta(seconds=20 if "failure" in scenarios else 60)
    dist.init_process_group("collectives", timeout=timeout)
    for scenario in scenarios:
        SCENARIOS[scenario]()
        say(f"OK {scenario} {dist.get_rank()}")
    if "failure" in scenarios:   # a rank is dead: closing would wait for it
        os._exit(0)
    group = dist.group.WORLD
    dist.destroy_process_group()   # closes our communicators: a later call says so
    try:
        group.allreduce([torch.ones(3)])
    except InvalidUsageError as error:
        check("shut down" in str(error), f"a call after destroy_process_group: {error}")
    else:
        check(False, "a call after destroy_process_group did not raise")
    say(f"OK destroyed {os.environ['RANK']}")


if __name__ == "__main__":
    main()
