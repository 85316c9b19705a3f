"""One rank of a multi-process test; tests/test_mpi.py starts N of these under mpiexec.

    mpiexec -n N python tests/mpi_worker.py SCENARIO [DEVICE]

DEVICE is what collectives.init(device=...) takes: host (the default),
emulated or cuda. Each rank prints "OK <scenario> <rank>" when everything it
checked held, and fails with a traceback (non-zero exit) otherwise.

The scenarios are one body for every device: they make their inputs and
expected values as NumPy arrays and hand the communicator `on_rank(a)`, a
copy where the rank's arrays live (CuPy on the rank's GPU for cuda, NumPy
for host and emulated ranks), and compare `to_host(result)`. So the cuda
runs differ from the emulated ones, which CI runs, in those two functions only.
"""

import os
import re
import sys
import time

import numpy as np
from mpi4py import MPI

import collectives
import collectives.compression
from cases import (OPS, all_dtypes, counts_for, dtypes_for, expect_a_different_call, gather_input, gave_up_on, made_once,
                   reduction_expected, reduction_input, run_scenario, stall_until_the_others_gave_up)
from collectives import CollectiveError, CollectiveTimeoutError, InvalidUsageError, RankFailedError
from collectives.algorithms import REGISTRY

ALGORITHMS = tuple(REGISTRY)

TIMEOUT = 3.0
# What the stalled scenarios' calls wait, once every rank has made one
# call of the same shape (the first may compile a kernel): the wait is
# the scenario's whole cost.
STALL_TIMEOUT = 1.0
# init waits for every rank to open its device: a CUDA context takes seconds
# when many processes make theirs at once (pytest -n on one GPU), which the
# collectives' own TIMEOUT does not allow for. The scenarios that time how
# ranks stall, die or disagree keep TIMEOUT for their calls; the others do
# not time anything, and a GPU rank's first call of a dtype and op may
# compile its kernel (NVRTC, seconds on a cold cache, under load longer)
# while its peers wait: they get UNTIMED_TIMEOUT, which still ends a hang.
STARTUP_TIMEOUT = 120.0
UNTIMED_TIMEOUT = 60.0
TIMED_SCENARIOS = ("stalled", "stalled_barrier", "killed", "mismatch", "fusion_killed", "point_to_point_failures",
                   "point_to_point_killed", "point_to_point_late_receiver", "all_to_all_v_mismatch")


def on_rank(a):
    """A copy of host array `a` where this rank's arrays live."""
    if DEVICE.startswith("cuda"):
        import cupy
        return cupy.asarray(a)  # on the current device, which init made this rank's GPU
    return np.array(a)


def to_host(a):
    """A rank's array (or result) as a NumPy array."""
    if DEVICE.startswith("cuda"):
        import cupy
        return cupy.asnumpy(a)
    return np.asarray(a)


def check(got, want, case):
    got = to_host(got)
    assert got.dtype == want.dtype and got.shape == want.shape, case
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), f"{case}: {got[:6]} != {want[:6]}"


def scenario_collectives(comm):
    r, n = comm.rank, comm.size
    # Host ranks run the NumPy interpreter, which the other suites cover for
    # every dtype; ranks on devices run every dtype through the step kernel.
    dtypes = all_dtypes() if DEVICE != "host" else \
        [d for d in all_dtypes() if d.name in ("int8", "uint16", "int64", "float16", "float32", "float64")]
    # Host ranks run every algorithm through the whole matrix; devices run ring
    # and direct through it, and every algorithm in the random-float check below.
    for algorithm in (ALGORITHMS if DEVICE == "host" else ("ring", "direct")):
        implemented = REGISTRY[algorithm].collectives
        for count in counts_for(n):
            for dtype in dtypes_for(count, dtypes):
                for op in OPS:
                    case = f"{algorithm} {op} {dtype} count={count} rank {r}"
                    x = reduction_input(op, dtype, n, r, count)
                    if "allreduce" in implemented:
                        check(comm.allreduce(on_rank(x), op=op, algorithm=algorithm),
                              reduction_expected(op, dtype, n, count), f"allreduce {case}")
                    if "reduce_scatter" in implemented:
                        out = on_rank(np.empty(count, dtype))
                        comm.reduce_scatter(on_rank(reduction_input(op, dtype, n, r, n * count)), op=op, out=out,
                                            algorithm=algorithm)
                        check(out, reduction_expected(op, dtype, n, n * count)[r * count:(r + 1) * count],
                              f"reduce_scatter {case}")
                    if "reduce" in implemented:   # in place and out of place, op by op
                        out_of_place = OPS.index(op) % 2 == 1
                        untouched = gather_input(dtype, n + r, count)
                        out = on_rank(untouched) if out_of_place else None
                        got = comm.reduce(on_rank(x), root=n - 1, op=op, out=out, algorithm=algorithm)
                        check(got, reduction_expected(op, dtype, n, count) if r == n - 1 else
                              untouched if out_of_place else x, f"reduce {case} {'out of' if out_of_place else 'in'} place")
                # allgather and broadcast in place and out of place, dtype by dtype
                in_place = dtypes.index(dtype) % 2 == 0
                if "allgather" in implemented:
                    want = np.concatenate([gather_input(dtype, q, count) for q in range(n)])
                    if in_place:   # x is the rank's own block of the output, as MPI_IN_PLACE
                        out = np.where(np.arange(n * count) // max(count, 1) == r, want, 0).astype(dtype)
                        gathered = on_rank(out)
                        comm.allgather(gathered[r * count:(r + 1) * count], out=gathered, algorithm=algorithm)
                    else:
                        gathered = comm.allgather(on_rank(gather_input(dtype, r, count)), algorithm=algorithm)
                    check(gathered, want, f"allgather {algorithm} {dtype} count={count} in place={in_place}")
                if "broadcast" in implemented:
                    x = on_rank(gather_input(dtype, r, count))
                    got = comm.broadcast(x, root=n // 2, out=None if in_place else on_rank(np.zeros(count, dtype)),
                                         algorithm=algorithm)
                    check(got, gather_input(dtype, n // 2, count), f"broadcast {algorithm} {dtype} count={count} "
                          f"in place={in_place}")
                    check(x, gather_input(dtype, n // 2 if in_place else r, count), "broadcast's x")
    # Random floats: every rank holds the bits the NumPy interpreter gives for
    # the same inputs (each rank can make everyone's), so all ranks agree.
    with collectives.Communicator.local(n) as reference:
        for algorithm in ALGORITHMS:  # every one implements allreduce
            implemented = REGISTRY[algorithm].collectives
            for size in (5, 70001, 1 << 20):  # 1 << 20 makes every rank grow its workspace
                inputs = [random_floats(q, size) for q in range(n)]
                mine = to_host(comm.allreduce(on_rank(inputs[r]), algorithm=algorithm))
                check(mine, reference.allreduce(inputs, algorithm=algorithm)[r], f"random allreduce {algorithm}")
                if "reduce_scatter" not in implemented:
                    continue
                out = on_rank(np.empty(size, np.float32))
                inputs = [random_floats(q, n * size) for q in range(n)]
                comm.reduce_scatter(on_rank(inputs[r]), op="max", out=out, algorithm=algorithm)
                check(out, reference.reduce_scatter(inputs, op="max", algorithm=algorithm)[r],
                      f"random reduce_scatter {algorithm}")
            everyone = MPI.COMM_WORLD.allgather(mine.tobytes())
            assert all(b == everyone[0] for b in everyone), f"ranks disagree, {algorithm}"
    comm.barrier()


def scenario_exchanges(comm):
    """gather, scatter and all_to_all with every algorithm that implements
    them, in place and out of place, a dtype of each item size (they only
    copy: the type changes nothing else), against closed forms."""
    r, n = comm.rank, comm.size
    for count in counts_for(n):
        for dtype in dtypes_for(count, [np.dtype(d) for d in ("int8", "float16", "float32", "float64")]):
            in_place = dtype.itemsize in (1, 4)
            mine, everyone = gather_input(dtype, r, count), np.concatenate([gather_input(dtype, q, count) for q in range(n)])
            blocks = [gather_input(dtype, n + q, n * count) for q in range(n)]   # rank q's x of n blocks
            for algorithm in (a for a in ALGORITHMS if "gather" in REGISTRY[a].collectives):
                case = f"gather {algorithm} {dtype} count={count} in place={in_place} rank {r}"
                root = (count + n - 1) % n
                if in_place and r == root:
                    out = on_rank(np.where(np.arange(n * count) // max(count, 1) == r, everyone, 0).astype(dtype))
                    got = comm.gather(out[r * count:(r + 1) * count], root=root, out=out, algorithm=algorithm)
                else:
                    untouched = on_rank(blocks[r])
                    got = comm.gather(on_rank(mine), root=root, out=untouched, algorithm=algorithm)
                check(got, everyone if r == root else blocks[r], case)
            for algorithm in (a for a in ALGORITHMS if "scatter" in REGISTRY[a].collectives):
                case = f"scatter {algorithm} {dtype} count={count} in place={in_place} rank {r}"
                root = count % n
                x = on_rank(blocks[r])
                got = comm.scatter(x, root=root, out=None if in_place else on_rank(np.zeros(count, dtype)),
                                   algorithm=algorithm)
                check(got, blocks[root][r * count:(r + 1) * count], case)
                kept = blocks[root] if in_place and r == root else np.where(
                    np.arange(n * count) // max(count, 1) == r, blocks[root], blocks[r]) if in_place else blocks[r]
                check(x, kept.astype(dtype), f"{case}: x")
            for algorithm in (a for a in ALGORITHMS if "all_to_all" in REGISTRY[a].collectives):
                case = f"all_to_all {algorithm} {dtype} count={count} in place={in_place} rank {r}"
                x = on_rank(blocks[r])
                got = comm.all_to_all(x, out=None if in_place else on_rank(np.zeros(n * count, dtype)),
                                      algorithm=algorithm)
                check(got, np.concatenate([blocks[q][r * count:(r + 1) * count] for q in range(n)]), case)
                check(x, blocks[r] if not in_place else to_host(got), f"{case}: x")
    all_to_all_v_across_processes(comm)
    # MPI_IN_PLACE on some ranks only: every process binds its plan by its
    # own arrays, and ranks must still run as many phases (binding.bind).
    want = np.concatenate([np.full(1000, q, np.float32) for q in range(n)])
    for algorithm in (a for a in ("auto", *ALGORITHMS) if a == "auto" or "allgather" in REGISTRY[a].collectives):
        if r == 0:
            out = on_rank(np.where(np.arange(n * 1000) < 1000, 0, -1).astype(np.float32))
            comm.allgather(out[:1000], out=out, algorithm=algorithm)
        else:
            out = comm.allgather(on_rank(np.full(1000, r, np.float32)), out=on_rank(np.zeros(n * 1000, np.float32)),
                                 algorithm=algorithm)
        check(out, want, f"allgather {algorithm}, in place on rank 0 alone, rank {r}")
    got = comm.gather(on_rank(np.arange(3) + 10 * r), root=0)   # without out: the root's new array, else None
    assert (got is None) == (r != 0), got
    if r == 0:
        check(got, np.concatenate([np.arange(3) + 10 * q for q in range(n)]), "gather without out")
    comm.barrier()


def all_to_all_v_across_processes(comm):
    """all_to_all_v: blocks of their own sizes (some empty), every
    algorithm of all_to_all, counts learnt from the peers or given, a new
    out or the caller's, an out over its own x on rank 0 (through the
    workspace); counts that disagree raise InvalidUsageError on every rank
    alike, and the next call runs."""
    r, n = comm.rank, comm.size
    for count in (1, 65537):   # blocks of 0 to 3 elements, and of tens of KiB
        blocks = [[(q * 3 + p * 5 + 1) % 4 * count // 2 for p in range(n)] for q in range(n)]   # q to p
        receives = [blocks[q][r] for q in range(n)]
        for dtype in (np.dtype(np.int8), np.dtype(np.float64)):
            originals = [gather_input(dtype, q, sum(blocks[q])) for q in range(n)]
            want = np.concatenate([np.split(originals[q], np.cumsum(blocks[q])[:-1])[r] for q in range(n)])
            for algorithm in (a for a in ("auto", *ALGORITHMS) if a == "auto" or "all_to_all" in REGISTRY[a].collectives):
                case = f"all_to_all_v {algorithm} {dtype} count={count} rank {r}"
                x = on_rank(originals[r])
                got = comm.all_to_all_v(x, blocks[r], algorithm=algorithm,
                                        recv_counts=receives if algorithm == "direct" else None)
                check(got, want, case)
                check(x, originals[r], f"{case}: x")
                if r == 0:   # out over x: one buffer, x at its start, out from its second element
                    both = on_rank(np.zeros(max(sum(blocks[0]), sum(receives)) + 1, dtype))
                    both[:sum(blocks[0])] = on_rank(originals[0])
                    x, out = both[:sum(blocks[0])], both[1:1 + sum(receives)]
                else:
                    x, out = on_rank(originals[r]), on_rank(np.zeros(sum(receives), dtype))
                check(comm.all_to_all_v(x, blocks[r], out=out, algorithm=algorithm), want, f"{case}, out given")
    sends = [1] * n
    expects = [2 if r == n - 1 and q == 0 else 1 for q in range(n)]   # the last rank expects too much from rank 0
    try:
        comm.all_to_all_v(on_rank(np.ones(n, np.float32)), sends, recv_counts=expects)
    except InvalidUsageError as error:
        assert f"rank {n - 1}'s recv_counts: expects 2 elements from rank 0, which sends 1" in str(error), error
    else:
        raise AssertionError("mismatched recv_counts passed")
    check(comm.all_to_all_v(on_rank(np.full(n, r, np.float32)), sends), np.arange(n, dtype=np.float32),
          "all_to_all_v after a mismatch")


def scenario_all_to_all_v_mismatch(comm):
    """A rank's all_to_all_v meets another rank's allgather of the bytes of
    its exchange of counts: the first raises naming it, and the other's next
    call raises through the abort."""
    n = comm.size
    if comm.rank == 0:
        expect_a_different_call(lambda: comm.all_to_all_v(on_rank(np.ones(n, np.float32)), [1] * n),
                                "all_to_all_v against an allgather")
    else:
        expect_a_different_call(lambda: (comm.allgather(on_rank(np.zeros(2 * n + 2, np.int64))), comm.barrier()),
                                "an allgather against all_to_all_v")


def scenario_point_to_point(comm):
    """send/recv/isend/irecv between processes: every size around the
    mailbox's slots, tags received out of order, any source, both ways at
    once with large messages, to oneself, and a receive of the wrong size
    (named on both sides). GPU ranks refuse them, naming why."""
    r, n = comm.rank, comm.size
    if DEVICE != "host":
        try:
            comm.send(on_rank(np.zeros(1, np.float32)), (r + 1) % n)
        except collectives.InvalidUsageError as error:
            assert "not available yet" in str(error), error
            return
        raise AssertionError("send on device ranks was accepted")
    right, left = (r + 1) % n, (r - 1) % n
    slot = collectives.transport.layout.MAILBOX_SLOT_BYTES
    slots = collectives.transport.layout.MAILBOX_SLOTS
    for nbytes in (0, 1, 1000, slot - 1, slot, slot + 1, slots * slot, slots * slot + 3, 3 << 20):
        def pattern(q): return ((np.arange(nbytes) * (q + 1) + nbytes) % 251).astype(np.uint8)
        out = np.empty(nbytes, np.uint8)
        sent = comm.isend(pattern(r), right, tag=nbytes % 5)
        assert comm.recv(out, left, tag=nbytes % 5) == left
        sent.wait()
        check(out, pattern(left), f"{nbytes} bytes from rank {left}")
    # Tags taken out of order: the later ones are read ahead, then found.
    if r == 0:
        for tag in (1, 2, 3):
            comm.send(np.full(10, tag, np.int64), 1, tag=tag)
    elif r == 1:
        for tag in (3, 1, 2):
            out = np.empty(10, np.int64)
            comm.recv(out, 0, tag=tag)
            check(out, np.full(10, tag, np.int64), f"tag {tag}")
    # Receives match in the order posted: a blocking receive behind a
    # pending one of the same peer and tag takes the second message (the
    # compiled shortcut declines while anything is pending), and a message
    # read ahead is found by the receive after it.
    if r == 0:
        for value in (1, 2, 3):
            comm.send(np.full(3, value, np.int32), 1, tag=4)
        comm.send(np.full(3, 9, np.int32), 1, tag=5)
    elif r == 1:
        first, second, third = (np.zeros(3, np.int32) for _ in range(3))
        pending = comm.irecv(first, 0, tag=4)
        comm.recv(second, 0, tag=4)
        pending.wait()
        late = np.zeros(3, np.int32)
        comm.recv(late, 0, tag=5)   # reads the third tag-4 message ahead, into this process
        comm.recv(third, 0, tag=4)
        for got, value in ((first, 1), (second, 2), (third, 3), (late, 9)):
            check(got, np.full(3, value, np.int32), f"the tag-4 message {value}, in the order posted")
    # A receive alone, waited for (the compiled take), whose head message has
    # another tag: the engine reads that one ahead and matches the wanted one.
    if r == 0:
        comm.send(np.full(2, 6, np.int64), 1, tag=6)
        comm.send(np.full(2, 7, np.int64), 1, tag=7)
    elif r == 1:
        sixth, seventh = np.zeros(2, np.int64), np.zeros(2, np.int64)
        assert comm.irecv(seventh, 0, tag=7).wait() == 0
        comm.recv(sixth, 0, tag=6)
        check(seventh, np.full(2, 7, np.int64), "tag 7 behind tag 6")
        check(sixth, np.full(2, 6, np.int64), "tag 6, read ahead")
    # Any source: every other rank's message, whoever comes first.
    if r == 0:
        seen = set()
        for _ in range(n - 1):
            out = np.empty(4, np.float64)
            source = comm.recv(out, None, tag=9)
            check(out, np.full(4, source, np.float64), f"from rank {source}")
            seen.add(source)
        assert seen == set(range(1, n)), seen
    else:
        comm.send(np.full(4, r, np.float64), 0, tag=9)
    # Both ways at once, far past the slots: the waits move each other's
    # requests. Streamed through the slots, then in one copy (p2p.py: from
    # $COLLECTIVES_MESSAGE_SINGLE_COPY_MIN).
    p2p = comm._p2p   # noqa: SLF001
    for way, single_copy_min in enumerate((float("inf"), collectives.transport.p2p.SLOTS_BYTES + 1)):
        p2p.single_copy_min = single_copy_min
        big = np.full(5 << 20, r + way, np.uint8)
        out = np.empty_like(big)
        for request in (comm.isend(big, right), comm.irecv(out, left)):
            request.wait()
        check(out, np.full(5 << 20, left + way, np.uint8), f"5 MiB both ways, single copy from {single_copy_min}")
        # Blocking, one way then back: the compiled calls that wait (streamed, or in one copy).
        if r < 2:
            message = ((np.arange(3 << 20) * (r + 3)) % 253).astype(np.uint8)
            out = np.empty_like(message)
            if r == 0:
                comm.send(message, 1)
                comm.recv(out, 1)
            else:
                comm.recv(out, 0)
                comm.send(message, 0)
            check(out, ((np.arange(3 << 20) * (4 - r)) % 253).astype(np.uint8),
                  f"3 MiB blocking, single copy from {single_copy_min}")
            # Head to head, each rank's receive posted first: a blocking send
            # that waited in C alone would never move it (MPI's progress rule).
            pending = comm.irecv(out, 1 - r)
            comm.send(np.full(3 << 20, r + 5, np.uint8), 1 - r)
            pending.wait()
            check(out, np.full(3 << 20, 6 - r, np.uint8), f"3 MiB head to head, single copy from {single_copy_min}")
        comm.barrier()
    # Those from single_copy_min were read straight out of their sender, in
    # one copy: no receiver refused. Then receivers that refuse (as where a
    # process may not read its peers' memory): the message goes as
    # fragments after all, refused by the compiled receive (rank 1) and by
    # the engine's (rank 0), and the sender sends fragments from then on.
    assert not p2p._refused, f"rank {r}: a large message did not go in one copy"   # noqa: SLF001
    if r < 2:
        from collectives.transport import _mailbox
        _mailbox.mailbox_test_refuse(True)
        comm.barrier()
        big = ((np.arange(3 << 20) * (r + 1)) % 251).astype(np.uint8)
        out = np.empty_like(big)
        if r == 0:
            comm.send(big, 1)
            request = comm.irecv(out, 1)
            while not request.test():   # (test moves it through the engine: its receive, not a compiled take)
                pass
        else:
            comm.recv(out, 0)
            comm.send(big, 0)
        check(out, ((np.arange(3 << 20) * (2 - r)) % 251).astype(np.uint8), f"refused, as fragments, rank {r}")
        assert comm._p2p._refused == {1 - r}, comm._p2p._refused   # noqa: SLF001
        _mailbox.mailbox_test_refuse(False)
    else:
        comm.barrier()
    # Bad arguments where the compiled calls are live (send_at_once, received_at_once):
    # refused by the checks, naming them, and nothing sent.
    read_only = np.zeros(2)
    read_only.setflags(write=False)
    bad = [lambda: comm.send(np.zeros(2), n), lambda: comm.send(np.zeros(2), True),
           lambda: comm.send(np.zeros(2), right, tag=-1), lambda: comm.send(np.zeros(2), right, tag=1 << 62),
           lambda: comm.send(np.zeros(2), right, tag=True), lambda: comm.send(np.zeros((4, 4))[:, 1], right),
           lambda: comm.send(np.zeros(2, object), right), lambda: comm.recv(read_only, left),
           lambda: comm.recv(np.zeros(2), n), lambda: comm.recv(np.zeros(2), left, tag=-1),
           lambda: comm.recv(np.zeros(2, object), left)]
    for i, call in enumerate(bad):
        try:
            call()
        except InvalidUsageError as error:
            assert re.match(r"(peer|tag|x|out)\b", str(error)), error
        else:
            raise AssertionError(f"bad call {i} was accepted")
    comm.send(np.full(2, 7.0 + r), right)
    out = np.zeros(2)
    comm.recv(out, left)
    check(out, np.full(2, 7.0 + left), "the first message after the refused calls")
    # To oneself, then a bfloat16 array as bytes.
    mine = np.arange(6, dtype=collectives.ops.BFLOAT16)
    comm.send(mine, r, tag=4)
    out = np.zeros(6, collectives.ops.BFLOAT16)
    assert comm.recv(out, r, tag=4) == r
    check(out, mine, "to oneself")
    comm.barrier()
    # A receive of the wrong size: named where it is received, and the
    # sender's wait ends in the abort instead of its timeout.
    if r < 2:
        try:
            if r == 0:
                comm.send(np.zeros(slots * slot * 2, np.uint8), 1)
            else:
                comm.recv(np.zeros(3, np.uint8), 0)
        except InvalidUsageError as error:
            assert "bytes" in str(error), error
        else:
            raise AssertionError("a receive of the wrong size completed")


def scenario_prepared(comm):
    """Prepared calls (comm.prepare) between processes make the plain call
    each time: the same bits as it, the same arrays returned, call after call."""
    r, n = comm.rank, comm.size
    x = on_rank(np.zeros(1000, np.float32))
    gathered_from = on_rank(np.zeros(3, np.int64))
    step = comm.prepare("allreduce", x, op="avg")
    gather = comm.prepare("allgather", gathered_from)
    reduce = comm.prepare("reduce", x, root=n - 1, op="max")
    blocks = on_rank(np.zeros(n * 4, np.int32))
    scatter = comm.prepare("reduce_scatter", blocks)   # in place: the result is a view of this rank's block
    first_gathered = first_block = None
    for k in range(3):
        inputs = [random_floats(q + 10 * k, 1000) for q in range(n)]
        x[...] = on_rank(inputs[r])
        assert step() is x
        check(x, to_host(comm.allreduce(on_rank(inputs[r]), op="avg")), f"prepared avg, call {k}")
        gathered_from[...] = on_rank(np.arange(3) + 10 * r + k)
        gathered = gather()
        first_gathered = gathered if first_gathered is None else first_gathered
        assert gathered is first_gathered
        check(gathered, np.concatenate([np.arange(3) + 10 * q + k for q in range(n)]), f"prepared allgather {k}")
        x[...] = on_rank(inputs[r])
        reduce()
        check(x, np.max(inputs, axis=0) if r == n - 1 else inputs[r], f"prepared reduce {k}")
        blocks[...] = on_rank(np.arange(n * 4, dtype=np.int32) * (r + 1) + k)
        block = scatter()
        first_block = block if first_block is None else first_block
        assert block is first_block
        check(block, (np.arange(n * 4, dtype=np.int32) * (n * (n + 1) // 2) + n * k)[r * 4:(r + 1) * 4],
              f"prepared reduce_scatter {k}")
    comm.barrier()


@made_once
def random_floats(rank, size):
    return np.random.default_rng([rank, size]).standard_normal(size).astype(np.float32)


def scenario_growth(comm):
    """Workspaces grow across calls; peers reopen the new generation, and
    results stay right before and after."""
    group = comm._ranks.group  # noqa: SLF001 - the test looks at the transport on purpose
    n, generations = comm.size, []
    for count in (16, 1 << 12, 1 << 18, 1 << 12, 1 << 20):
        x = on_rank(np.full(count, comm.rank + 1, np.float64))
        check(comm.allreduce(x, algorithm="ring"), np.full(count, n * (n + 1) / 2), f"count {count}")
        generations.append([group.generation(q) for q in range(n)])
    assert generations[0][comm.rank] >= 1 and generations[-1][comm.rank] > generations[1][comm.rank], generations
    # This rank's own generation: a peer's may already count its growth for
    # the next call (it can be a call ahead when this rank reads it).
    assert generations[3][comm.rank] == generations[2][comm.rank], "a smaller call must not grow the workspace"


def scenario_stalled(comm):
    """Rank 1 stops calling in: the others time out, then the group is unusable."""
    x = on_rank(np.ones(100, np.float32))
    comm.allreduce(x)
    comm.timeout = STALL_TIMEOUT
    if comm.rank == 1:
        stall_until_the_others_gave_up(1, longest=STALL_TIMEOUT + 2)
        try:
            comm.allreduce(x)
        except CollectiveError as error:
            assert "aborted" in str(error), error
            return
        raise AssertionError("a call into an aborted communicator succeeded")
    start = time.perf_counter()
    try:
        comm.allreduce(x)
    except CollectiveTimeoutError as error:
        elapsed = time.perf_counter() - start
        assert not isinstance(error, RankFailedError), error
        assert elapsed < STALL_TIMEOUT + 1.5, f"took {elapsed:.1f}s with a {STALL_TIMEOUT}s timeout"
    except CollectiveError as error:  # a peer timed out first and aborted the group
        assert "aborted" in str(error) and "timed out" in str(error), error
    else:
        raise AssertionError("allreduce completed without rank 1")
    gave_up_on(1)


def scenario_stalled_barrier(comm):
    comm.barrier()
    comm.timeout = STALL_TIMEOUT
    if comm.rank == 1:
        stall_until_the_others_gave_up(1, longest=STALL_TIMEOUT + 2)
        return
    start = time.perf_counter()
    try:
        comm.barrier()
    except CollectiveError as error:
        assert "timed out" in str(error), error
        assert time.perf_counter() - start < STALL_TIMEOUT + 1.5
    else:
        raise AssertionError("barrier completed without rank 1")
    gave_up_on(1)


def scenario_killed(comm):
    """Rank 1 dies: the others learn it from its pid, long before the timeout."""
    comm.barrier()
    if comm.rank == 1:
        os._exit(0)
    start = time.perf_counter()
    try:
        comm.allreduce(on_rank(np.ones(1000, np.float64)))
    except (RankFailedError, CollectiveError) as error:
        assert isinstance(error, RankFailedError) or "died" in str(error), error
        assert time.perf_counter() - start < 1.0, "a dead rank should be reported within a second"
    else:
        raise AssertionError("allreduce completed without rank 1")
    # Closing after a failure is quick and removes the dead rank's files too.
    prefix = comm._ranks.prefix  # noqa: SLF001
    start = time.perf_counter()
    comm.close()
    assert time.perf_counter() - start < TIMEOUT / 2
    leftovers = [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]
    assert not leftovers, leftovers


def scenario_point_to_point_failures(comm):
    """A receive whose sender stalls ends in CollectiveTimeoutError at the timeout."""
    r = comm.rank
    comm.timeout = STALL_TIMEOUT
    if r == 1:
        time.sleep(STALL_TIMEOUT + 0.5)   # rank 0's receive from this rank waits out its timeout
        return
    start = time.perf_counter()
    try:
        comm.recv(np.empty(8, np.uint8), 1)
    except CollectiveTimeoutError as error:
        assert not isinstance(error, RankFailedError) and "rank 1" in str(error), error
        assert STALL_TIMEOUT <= time.perf_counter() - start < STALL_TIMEOUT + 1.0
    else:
        raise AssertionError("a receive from a stalled rank completed")


def scenario_point_to_point_late_receiver(comm):
    """A send larger than the slots whose receiver comes after the send's
    timeout: the send raises CollectiveTimeoutError, and the late receive
    raises too, the communicator aborted, rather than read the array the
    sender's caller has had back (and changed) since."""
    r = comm.rank
    comm.timeout = STALL_TIMEOUT
    message = np.ones(1 << 20, np.uint8)
    if r == 0:
        try:
            comm.send(message, 1)
        except CollectiveTimeoutError as error:
            assert "rank 1" in str(error), error
        else:
            raise AssertionError("a send to a stalled receiver completed")
        message[:] = 2
        time.sleep(STALL_TIMEOUT)   # alive while rank 1 receives: its read would succeed
        return
    time.sleep(STALL_TIMEOUT + 0.5)
    out = np.zeros_like(message)
    try:
        comm.recv(out, 0)
    except CollectiveError as error:
        assert "aborted" in str(error), error
    else:
        raise AssertionError(f"a receive completed after its send had failed: {out[:4]}")


def scenario_point_to_point_killed(comm):
    """The sender dies mid-message (more than the slots hold: its
    descriptor posted, its bytes not read yet): a receive from any rank
    learns it from the pid, long before the timeout."""
    r = comm.rank
    comm.barrier()
    if r == 1:
        os.environ["COLLECTIVES_MESSAGE_SINGLE_COPY_MIN"] = str(1 << 20)   # in one copy (read at the first send)
        comm.isend(np.zeros(4 << 20, np.uint8), 0)   # the descriptor is posted, then this rank dies
        os._exit(0)
    time.sleep(0.3)   # (rank 1 gone before the receive reads its memory)
    start = time.perf_counter()
    try:
        comm.recv(np.empty(4 << 20, np.uint8), None)
    except RankFailedError as error:
        assert "rank 1" in str(error) and "died" in str(error), error
        assert time.perf_counter() - start < 1.5, "a dead rank should be reported within a second"
    else:
        raise AssertionError("a receive from a dead rank completed")


def scenario_mismatch(comm):
    """Ranks disagree on the count: one raises InvalidUsageError, none hangs."""
    count = 10 if comm.rank == 0 else 11
    expect_a_different_call(lambda: comm.allreduce(on_rank(np.ones(count, np.float32))), "mismatched allreduce")


def scenario_shared_segments_are_removed(comm):
    prefix = comm._ranks.prefix  # noqa: SLF001 - the test looks at the transport on purpose
    comm.allreduce(on_rank(np.ones(1 << 16, np.float32)))
    comm.close()
    MPI.COMM_WORLD.Barrier()
    leftovers = [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]
    assert not leftovers, leftovers


def scenario_fusion(comm):
    """Compressed allreduce, allreduce_many and fusion_buffer across processes
    give the bits the same calls give to ranks in one process."""
    r, n = comm.rank, comm.size
    rng = np.random.default_rng(0)
    sizes = [int(s) for s in rng.integers(0, 3000, size=40)]
    dtypes = [np.float32, np.float16, np.int32, np.float64]

    def grads(q, codec=None):
        g = np.random.default_rng([q, 1])
        return [(g.standard_normal(size) * 10.0 ** g.uniform(-3, 3)).astype(np.float32 if codec else dtypes[i % 4])
                for i, size in enumerate(sizes)]

    with collectives.Communicator.local(n) as reference:
        for codec in (None, "bf16", "fp16", "int8"):
            for algorithm in ("ring", "direct", "butterfly"):
                inputs = [grads(q, codec)[5] for q in range(n)]
                mine = comm.allreduce(on_rank(inputs[r]), algorithm=algorithm, compression=codec)
                check(mine, reference.allreduce(inputs, algorithm=algorithm, compression=codec)[r],
                      f"allreduce compression={codec} {algorithm}")
            everyone = [grads(q, codec) for q in range(n)]
            # `auto` weighs each transport's costs, so name the algorithm that both must run.
            want = reference.allreduce_many([[a.copy() for a in g] for g in everyone], fusion_threshold=8192,
                                            compression=codec, algorithm="ring")
            mine = comm.allreduce_many([on_rank(a) for a in everyone[r]], fusion_threshold=8192, compression=codec,
                                       algorithm="ring")
            for i, (got, expected) in enumerate(zip(mine, want[r])):
                check(got, expected, f"allreduce_many compression={codec} array {i}")
            buffer = comm.fusion_buffer(threshold=8192, compression=codec, algorithm="ring")
            queued = [on_rank(a) for a in everyone[r]]
            for a in queued:
                buffer.add(a)
            buffer.wait()
            for i, (got, expected) in enumerate(zip(queued, want[r])):
                check(got, expected, f"fusion_buffer compression={codec} array {i}")
    loop = getattr(comm._ranks, "fast", None)   # noqa: SLF001
    if loop is not None:
        # Host ranks in processes: a fused call's allreduces are the loop's,
        # as the caller's own allreduce(x) is (four 4000-byte arrays under an
        # 8192-byte threshold: two buffers of two, two calls).
        taken = loop.steps_taken
        fused = comm.allreduce_many([np.full(1000, r + 1.0, np.float32) for _ in range(4)], fusion_threshold=8192)
        assert loop.steps_taken == taken + 2, f"the loop took {loop.steps_taken - taken} of the 2 fused calls"
        for got in fused:
            check(got, np.full(1000, n * (n + 1) / 2, np.float32), "allreduce_many through the loop")


def scenario_fusion_killed(comm):
    """A rank dies while fused allreduces are in flight: the others' wait()
    raises, quickly, instead of hanging."""
    comm.barrier()
    buffer = comm.fusion_buffer(threshold=1 << 12)
    if comm.rank == 1:
        os._exit(0)
    start = time.perf_counter()
    for _ in range(8):
        buffer.add(on_rank(np.ones(1 << 10, np.float32)))   # each fills a buffer: 8 allreduces start in the background
    try:
        buffer.wait()
    except CollectiveError as error:
        assert isinstance(error, RankFailedError) or "died" in str(error) or "aborted" in str(error), error
        assert time.perf_counter() - start < TIMEOUT, "a dead rank should be reported before the timeout"
    else:
        raise AssertionError("fused allreduces completed without rank 1")
    comm.close()


def scenario_no_gpu():
    """init(device="cuda") on a machine without a GPU: every rank raises at
    once, naming the ranks that could not open one, instead of waiting."""
    start = time.perf_counter()
    try:
        collectives.init(timeout=TIMEOUT, device="cuda")
    except CollectiveError as error:
        message = str(error)
        assert all(f"rank {q} could not start" in message for q in range(MPI.COMM_WORLD.size)), message
        assert time.perf_counter() - start < TIMEOUT, "a rank waited out its timeout"
        return MPI.COMM_WORLD.rank
    raise AssertionError("init(device='cuda') succeeded without a GPU")


DEVICE = "host"


def main():
    """One scenario, or several that leave every rank alive (comma-separated):
    one launch for them, each on a communicator of its own, closed after it
    (a rank's start costs about 0.36 CPU-s, as much as a short scenario)."""
    global DEVICE
    scenarios = sys.argv[1].split(",")
    DEVICE = sys.argv[2] if len(sys.argv) > 2 else "host"
    if scenarios == ["no_gpu"]:
        print(f"OK no_gpu {scenario_no_gpu()}", flush=True)
        return
    assert len(scenarios) == 1 or not set(scenarios) & {*TIMED_SCENARIOS, *RANKS_DIE, "no_gpu"}, \
        f"only scenarios that leave every rank alive share a launch: {scenarios}"
    if any(scenario.startswith("fusion") for scenario in scenarios):
        # Load the codecs' CPU loops before the clock of TIMEOUT starts.
        collectives.compression.warm_up()
        MPI.COMM_WORLD.Barrier()
    for scenario in scenarios:
        comm = collectives.init(timeout=STARTUP_TIMEOUT, device=DEVICE)
        comm.timeout = TIMEOUT if scenario in TIMED_SCENARIOS else UNTIMED_TIMEOUT  # what each collective waits at most
        assert comm.size == MPI.COMM_WORLD.size and comm.rank == MPI.COMM_WORLD.rank
        run_scenario(lambda: globals()[f"scenario_{scenario}"](comm), ranks_leave=scenario in RANKS_DIE)
        print(f"OK {scenario} {comm.rank}", flush=True)
        if scenario in RANKS_DIE:
            os._exit(0)  # MPI_Finalize would wait for the dead rank
        if len(scenarios) > 1:
            comm.close()


RANKS_DIE = ("killed", "fusion_killed", "point_to_point_killed")


if __name__ == "__main__":
    main()
