"""One rank of a test of the exchanges across pretend nodes (all_to_all,
all_to_all_v, gather, scatter); tests/test_exchanges_across_nodes.py starts
4 of these under mpiexec, split into nodes as hierarchy_worker.py's are.

    mpiexec -n 4 python tests/exchanges_across_worker.py SCENARIO LAYOUT

Each rank prints "OK <scenario> <rank>" when everything it checked held,
and fails with a traceback (non-zero exit) otherwise.
"""

import os
import sys
import time

import numpy as np
from mpi4py import MPI

import collectives
from collectives import CollectiveError, CollectiveTimeoutError, InvalidUsageError, RankFailedError
from collectives.bootstrap import PRETEND_NODES_ENV
from collectives.hierarchy import HierarchicalCommunicator
from collectives.ops import bfloat16, is_floating
from cases import gave_up_on, run_scenario, stall_until_the_others_gave_up
from hierarchy_worker import check, no_segment_crosses_a_node, random_values, record_segments

TIMEOUT = 3.0
STALL_TIMEOUT = 1.0
WORLD = MPI.COMM_WORLD


def dtypes():
    return (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), bfloat16(), np.dtype(np.int8),
            np.dtype(np.int64), np.dtype(np.uint16))


def block(dtype, sender, receiver, count):
    """The block rank `sender` sends rank `receiver`: floats of every
    magnitude with NaN, infinities and signed zeros (random_values), or
    integers over the dtype's whole range; compared bit for bit."""
    if is_floating(dtype):
        return random_values(dtype, 1000 * sender + receiver + 1, count)
    g = np.random.default_rng([sender, receiver + 1, count, dtype.itemsize])
    return g.integers(np.iinfo(dtype).min, np.iinfo(dtype).max, count, dtype=dtype, endpoint=True)


def traffic(comm):
    """Bytes this rank's link sends each peer, by call (the link's exchange wrapped)."""
    link, sent = comm._ranks.link, []   # noqa: SLF001
    exchange = link.exchange

    def counted(sends, receives, deadline, what):
        sent.append({peer: sum(a.nbytes for p, a in sends if p == peer) for peer, _ in sends})
        return exchange(sends, receives, deadline, what)

    link.exchange = counted
    return sent


def scenario_exchanges(comm):
    """Every exchange, every dtype, in and out of place where the API
    allows it, every root: the bits each rank must hold; what crosses nodes
    goes from the rank that has it straight to the rank that needs it, once."""
    r, n = comm.rank, comm.size
    assert isinstance(comm, HierarchicalCommunicator), comm
    nodes = comm.topology.nodes
    node_of = {q: k for k, node in enumerate(nodes) for q in node}
    sent = traffic(comm)
    for dtype in dtypes():
        for k in (0, 1, 7, 3000):
            case = f"{dtype} k={k} rank {r} nodes {nodes}"
            # all_to_all: block q of the result is block r of rank q's x
            x = np.concatenate([block(dtype, r, q, k) for q in range(n)])
            want = np.concatenate([block(dtype, q, r, k) for q in range(n)])
            kept = x.copy()
            del sent[:]
            check(comm.all_to_all(x, out=np.empty_like(x)), want, f"all_to_all {case}")
            check(x, kept, f"all_to_all's x out of place {case}")
            if k:   # one message to each rank of another node, of its block's bytes; none to a node-mate
                assert sent == [{q: k * dtype.itemsize for q in range(n) if node_of[q] != node_of[r]}], sent
            got = comm.all_to_all(x)   # in place
            assert got is x
            check(x, want, f"all_to_all in place {case}")
            # gather and scatter from every root
            mine = block(dtype, r, -1, k)
            for root in range(n):
                gathered = np.concatenate([block(dtype, q, -1, k) for q in range(n)])
                got = comm.gather(mine, root=root)
                if r == root:
                    check(got, gathered, f"gather to {root} {case}")
                else:
                    assert got is None, got
                untouched = np.full(n * k, 3, dtype)
                out = untouched.copy()
                if r == root:   # in place: x is the root's own block of out
                    out[r * k:(r + 1) * k] = mine
                    comm.gather(out[r * k:(r + 1) * k], root=root, out=out)
                    check(out, gathered, f"gather in place to {root} {case}")
                else:
                    comm.gather(mine, root=root, out=out)
                    check(out, untouched, f"gather's out off the root {root} {case}")
                whole = np.concatenate([block(dtype, root, q, k) for q in range(n)])
                x = whole.copy() if r == root else np.full(n * k, 5, dtype)
                kept = x.copy()
                got = comm.scatter(x, root=root)   # into this rank's own block of x
                check(got, whole[r * k:(r + 1) * k], f"scatter from {root} {case}")
                others = np.ones(n * k, bool)
                others[r * k:(r + 1) * k] = False
                check(x[others], kept[others], f"scatter in place leaves the other blocks {case}")
                out = np.empty(k, dtype)
                check(comm.scatter(whole if r == root else kept, root=root, out=out), whole[r * k:(r + 1) * k],
                      f"scatter out of place from {root} {case}")
    all_to_all_v(comm)
    chosen = [comm.chosen_algorithm(c, 4096, root=n - 1) for c in ("all_to_all", "all_to_all_v", "gather", "scatter")]
    chosen.append(comm.chosen_algorithm("all_to_all", 4096, algorithm="round_robin"))   # checked, not used
    assert all((c, c.path) == ("hierarchical", "exchange") for c in chosen), [(c, c.path) for c in chosen]


def counts_matrix(n, seed):
    """counts[q][r]: what rank q sends rank r, uneven, with zeros (a whole row
    and a whole column of them for seed 0), the same on every rank."""
    g = np.random.default_rng(seed)
    counts = g.integers(0, 50, (n, n)) * g.integers(0, 2, (n, n))
    if seed == 0:
        counts[0, :] = 0
        counts[:, n - 1] = 0
    elif seed == 1:
        counts[1, 2 % n] = 70000   # a block past the small messages
    return counts.tolist()


def all_to_all_v(comm):
    """Uneven and zero counts, out given (of the right size) or not, recv_counts
    given or not, out overlapping the rank's own x."""
    r, n = comm.rank, comm.size
    for seed, dtype in enumerate((np.dtype(np.float32), bfloat16(), np.dtype(np.int16), np.dtype(np.float64))):
        counts = counts_matrix(n, seed)
        x = np.concatenate([block(dtype, r, q, counts[r][q]) for q in range(n)])
        want = np.concatenate([block(dtype, q, r, counts[q][r]) for q in range(n)])
        expects = [counts[q][r] for q in range(n)]
        case = f"all_to_all_v {dtype} counts {counts} rank {r}"
        kept = x.copy()
        check(comm.all_to_all_v(x, counts[r]), want, case)
        check(x, kept, f"{case}: x")
        out = np.empty(want.size, dtype)
        got = comm.all_to_all_v(x, counts[r], out=out, recv_counts=expects)
        assert got is out
        check(out, want, f"{case} into out")
        # out overlapping x: x at the start of one buffer, out at its end
        room = np.zeros(x.size + want.size, dtype)
        room[:x.size] = x
        shifted = room[room.size - want.size:]
        check(comm.all_to_all_v(room[:x.size], counts[r], out=shifted), want, f"{case} overlapping")


def scenario_refusals(comm):
    """Bad exchanges raise InvalidUsageError on every rank and write nothing;
    the communicator goes on."""
    r, n = comm.rank, comm.size
    x = np.arange(4 * n, dtype=np.float32)
    out = np.full(4 * n, -1, np.float32)
    counts = [4] * n
    for name, call in (
            ("all_to_all of a size the ranks do not divide", lambda: comm.all_to_all(x[:4 * n - 1])),
            ("all_to_all into an out of another size", lambda: comm.all_to_all(x, out=out[:-1])),
            ("all_to_all into an out of another dtype", lambda: comm.all_to_all(x, out=out.view(np.int32))),
            ("all_to_all naming no algorithm", lambda: comm.all_to_all(x, out=out, algorithm="nope")),
            ("gather to a rank that is not", lambda: comm.gather(x, root=n)),
            ("gather into an out too small", lambda: comm.gather(x, root=0, out=out)),
            ("scatter from a negative root", lambda: comm.scatter(x, root=-1, out=out[:4])),
            ("scatter into an out of the wrong size", lambda: comm.scatter(x, root=0, out=out[:3])),
            ("all_to_all_v with counts that miss x's size", lambda: comm.all_to_all_v(x, [5] * n, out=out)),
            ("all_to_all_v with too few counts", lambda: comm.all_to_all_v(x, [4 * n], out=out)),
            # (every rank raises: the ranks' counts are exchanged first, and disagree)
            ("all_to_all_v expecting what is not sent",
             lambda: comm.all_to_all_v(x, counts, out=out, recv_counts=[4] * (n - 1) + [3 + (r == 0)])),
            ("all_to_all_v into an out of another size", lambda: comm.all_to_all_v(x, counts, out=out[:-1]))):
        try:
            call()
        except InvalidUsageError:
            pass
        else:
            raise AssertionError(f"{name}: accepted")
        check(x, np.arange(4 * n, dtype=np.float32), f"{name}: x")
        check(out, np.full(4 * n, -1, np.float32), f"{name}: out")
    want = np.concatenate([np.arange(4 * r, 4 * r + 4, dtype=np.float32) + 4 * n * q for q in range(n)])
    check(comm.all_to_all(x + 4 * n * r), want, "still usable")


def scenario_mismatched(comm):
    """The ranks make different exchanges (node 0 an all_to_all, the other
    nodes an all_to_all_v of the same bytes; then node 0 a gather to rank 0,
    the others an all_to_all): every rank raises an InvalidUsageError
    (its own, or the abort of the rank that saw it), none waits out the timeout."""
    n = comm.size
    calls = (lambda c: (c.all_to_all(np.ones(4 * n, np.float32)) if c.node == 0
                        else c.all_to_all_v(np.ones(4 * n, np.float32), [4] * n)),
             lambda c: (c.gather(np.ones(4, np.float32), root=0) if c.node == 0
                        else c.all_to_all(np.ones(4 * n, np.float32))))
    for case, call in enumerate(calls):
        if case:
            WORLD.Barrier()
            comm = collectives.init(timeout=TIMEOUT)
        start = time.perf_counter()
        try:
            call(comm)
        except InvalidUsageError as error:
            print(f"RAISED {case} {comm.rank} {type(error).__name__}: {error}", flush=True)
            assert time.perf_counter() - start < TIMEOUT, f"case {case} took {time.perf_counter() - start:.1f}s"
        else:
            try:   # a rank that only sent may finish its call: its next one meets the abort
                comm.barrier()
            except InvalidUsageError as error:
                print(f"RAISED {case} {comm.rank} next call {type(error).__name__}: {error}", flush=True)
            else:
                raise AssertionError(f"case {case}: a mismatched call and the barrier after it completed")


def scenario_killed(comm):
    """The last rank dies before an all_to_all: every other rank raises
    RankFailedError (its node-mate sees it die and tells the other nodes),
    within a second or two, never hangs."""
    last, n = comm.size - 1, comm.size
    x = np.ones(64 * n, np.float32)
    comm.all_to_all(x)
    # (MPI's barrier, not ours: a rank still in our barrier when the last leaves it and dies raises RankFailedError,
    # rightly, where this scenario wants the death between calls)
    WORLD.Barrier()
    if comm.rank == last:
        os._exit(0)
    start = time.perf_counter()
    try:
        comm.all_to_all(x)
    except RankFailedError as error:
        elapsed = time.perf_counter() - start
        assert elapsed < 1.5, f"took {elapsed:.1f}s to report {error}"
    else:
        raise AssertionError("all_to_all completed without the last rank")
    comm.close()


def scenario_stalled(comm):
    """The last rank stops calling in: everyone else raises
    CollectiveTimeoutError (or the abort of one that timed out) within the
    timeout, in an all_to_all_v (its counts' exchange) and then in a
    scatter from it on a new communicator."""
    last = comm.size - 1
    calls = (lambda c: c.all_to_all_v(np.ones(3 * c.size, np.float32), [3] * c.size),
             lambda c: c.scatter(np.ones(3 * c.size, np.float32), root=last, out=np.empty(3, np.float32)))
    for case, call in enumerate(calls):
        if case:
            WORLD.Barrier()
            comm = collectives.init(timeout=TIMEOUT)
        call(comm)
        comm.timeout = STALL_TIMEOUT
        if comm.rank == last:
            stall_until_the_others_gave_up(last, longest=STALL_TIMEOUT + 2, stall=case)
            continue
        start = time.perf_counter()
        try:
            call(comm)
        except CollectiveError as error:
            elapsed = time.perf_counter() - start
            assert isinstance(error, CollectiveTimeoutError) or "aborted" in str(error), error
            assert elapsed < STALL_TIMEOUT + 1.5, f"took {elapsed:.1f}s with a {STALL_TIMEOUT}s timeout"
            gave_up_on(last, stall=case)
        else:
            raise AssertionError(f"case {case} completed without the last rank")


FAILING = ("mismatched", "killed", "stalled")


def main():
    scenario, layout = sys.argv[1], sys.argv[2]
    os.environ[PRETEND_NODES_ENV] = layout
    record_segments()
    comm = collectives.init(timeout=TIMEOUT if scenario in FAILING else 30.0)
    assert comm.size == WORLD.size and comm.rank == WORLD.rank
    # (a failure of a scenario where ranks die or stall exits at once: MPI_Finalize would wait for them)
    run_scenario(lambda: globals()[f"scenario_{scenario}"](comm), ranks_leave=scenario in FAILING)
    if scenario == "exchanges":
        no_segment_crosses_a_node(comm)
    if scenario not in FAILING:
        comm.close()
    print(f"OK {scenario} {comm.rank}", flush=True)
    if scenario in FAILING:
        os._exit(0)   # (MPI_Finalize would wait for a dead or aborted rank)


if __name__ == "__main__":
    main()
