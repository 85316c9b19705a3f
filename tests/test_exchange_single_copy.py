"""all_to_all, all_to_all_v, gather and scatter between host processes in
one copy: the compiled plan executor reads peers' inputs in place
(plan.single_copy_plan, _host_plan.c); allgather and broadcast, and the
folds reduce_scatter, reduce and allreduce, too where the plans run them
(without the compiled loop), allreduce and reduce pushing their reduced
chunks into the receivers' outputs (plan.pushed_plan) and a large
broadcast spreading (plan.spread_plan). The interpreter's bits on 2, 3 and
4 processes, in and out of place, uneven all_to_all_v blocks with empty
ones; a refused read or push falling back to the staged plan on every
rank (in place, after pushes were found to work, raising); a rank that
returns before its readers are done caught, and one whose failed call
returned while a peer still pushed into it; a killed and a stalled rank
raising the typed error on the others. The checks of each rank are in
tests/exchange_worker.py; the plans' form is checked here."""

import re
from pathlib import Path

import numpy as np
import pytest

from collectives import binding as bindings
from collectives import plan as plans
from collectives.executors import host_process
from test_mpi import run_worker

WORKER = Path(__file__).with_name("exchange_worker.py")
SMALL = {"COLLECTIVES_EXCHANGE_SINGLE_COPY_MIN": "4096"}   # small calls take the single copy too

needs_the_executor = pytest.mark.skipif(not host_process.available(), reason="the compiled executor is not built")


def run(n, scenario, environment=SMALL, flags=(), limit=240, extra=()):
    oks, report = run_worker(WORKER, n, scenario, *extra, launcher_flags=flags, environment=environment, limit=limit)
    return oks, report


@pytest.mark.parametrize("collective", ["gather", "scatter", "all_to_all", "allgather", "broadcast"])
@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_single_copy_plans_read_peers_inputs_in_phase_1_only_and_wait_for_the_verdict(collective, n):
    for root in range(n) if collective in ("gather", "scatter", "broadcast") else [0]:
        for in_place in (False, True):
            plan = plans.single_copy_plan(collective, n, 8 * n, np.dtype(np.float32), "sum", root, in_place)
            assert plan.single_copy and len(plan.phases) == 3 and not len(plan.phases[0].table)
            for p, phase in enumerate(plan.phases):
                for row in phase.table:
                    peer = row[plans.SRC0 + plans.SRC_RANK]
                    if peer != row[plans.RANK]:
                        assert p == 1 and row[plans.SRC0 + plans.SRC_BUF] == plans.INPUT
                        assert (peer, 1) in phase.waits[row[plans.RANK]]
            for rank in range(n):   # every peer past its reads before any rank writes its input or returns
                assert {peer for peer, done in plan.phases[2].waits[rank] if done >= 2} == set(range(n)) - {rank}


@pytest.mark.parametrize("collective", ["reduce_scatter", "reduce"])
@pytest.mark.parametrize("n", [2, 3, 5])
def test_single_copy_folds_read_each_peers_input_once_and_in_place_only_reduce_scatter(collective, n):
    """A fold's single copy: phase 1 folds peers' INPUT (every element of a
    peer read once, by the rank that keeps its fold) into the reader's own
    OUTPUT. In place, reduce_scatter's writes the rank's own block of x,
    which no peer reads; reduce has none (the root's x is what every rank
    reads)."""
    for root in range(n) if collective == "reduce" else [0]:
        plan = plans.single_copy_plan(collective, n, 8 * n, np.dtype(np.float32), "avg", root, False)
        assert plan.single_copy and len(plan.phases) == 3 and not len(plan.phases[0].table)
        assert not len(plan.phases[2].table)
        read = {}
        for row in plan.phases[1].table:
            assert row[plans.KIND] == plans.REDUCE_FINAL_OP and row[plans.DST_BUF] == plans.OUTPUT
            for s in range(row[plans.NSRC]):
                peer, buffer, offset = row[plans.SRC0 + 3 * s: plans.SRC0 + 3 * s + 3]
                assert buffer == plans.INPUT
                if peer != row[plans.RANK]:
                    assert (peer, 1) in plan.phases[1].waits[row[plans.RANK]]
                for element in range(offset, offset + row[plans.COUNT]):
                    read[peer, element] = read.get((peer, element), 0) + 1
        total = 8 * n
        assert read == {(q, e): 1 for q in range(n) for e in range(total)}
        for rank in range(n):
            assert {peer for peer, done in plan.phases[2].waits[rank] if done >= 2} == set(range(n)) - {rank}
        if collective == "reduce":
            with pytest.raises(ValueError, match="in-place single copy"):
                plans.single_copy_plan(collective, n, 8 * n, np.dtype(np.float32), "avg", root, True)
            continue
        in_place = plans.single_copy_plan(collective, n, 8 * n, np.dtype(np.float32), "avg", root, True)
        assert in_place.binding == "in_place" and collective in plans.FOLDS_INTO_X_IN_PLACE
        for row in in_place.phases[1].table:   # (in place a rank's OUTPUT is block `rank` of its x)
            rank = int(row[plans.RANK])
            assert (row[plans.DST_BUF], row[plans.DST_OFF], row[plans.COUNT]) == (plans.OUTPUT, 0, 8)
            assert [tuple(row[plans.SRC0 + 3 * s: plans.SRC0 + 3 * s + 3]) for s in range(n)] == \
                [(q, plans.INPUT, 8 * rank) for q in range(n)]


@pytest.mark.parametrize("n", [2, 3, 5])
def test_a_two_shot_reduce_folds_a_chunk_on_every_rank_and_the_root_copies_them_from_the_workspaces(n):
    """Phase 1: rank r folds chunk r of every rank's INPUT, read in place,
    into its own memory (the root: its OUTPUT; the others: SCRATCH, in
    their workspaces); phase 2, after every peer's reads: the root copies
    each other rank's chunk out of its SCRATCH. No other rank writes
    anything it does not own."""
    for root in range(n):
        plan = plans.single_copy_plan("reduce", n, 8 * n, np.dtype(np.float32), "sum", root, False, None, "two_shot")
        assert plan.algorithm == "two_shot" and plan.single_copy and plan.workspace_bytes > 0
        folds = sorted((int(row[plans.RANK]), int(row[plans.DST_BUF])) for row in plan.phases[1].table)
        assert folds == [(r, plans.OUTPUT if r == root else plans.SCRATCH) for r in range(n)]
        copies = sorted((int(row[plans.RANK]), int(row[plans.SRC0]), int(row[plans.SRC0 + 1]))
                        for row in plan.phases[2].table)
        assert copies == [(root, q, plans.SCRATCH) for q in range(n) if q != root]
        assert {peer for peer, done in plan.phases[2].waits[root] if done >= 2} == set(range(n)) - {root}
        assert not any(len(phase.table) for phase in plan.phases[3:])


@pytest.mark.parametrize("n", [2, 3, 5])
def test_a_two_shot_allreduce_folds_a_chunk_into_each_workspace_and_every_rank_copies_them_all_out(n):
    """Phase 1: rank r folds chunk r of every rank's INPUT, read in place,
    into its SCRATCH (not its OUTPUT, which no peer can read); phase 2,
    after every peer's reads: each rank copies chunk q out of rank q's
    SCRATCH into its OUTPUT. Phase 1 writes no caller's array, so in place
    runs the same plan (x is written only once no peer reads it)."""
    count = 8 * n + 3   # chunks of unequal sizes
    plan = plans.single_copy_plan("allreduce", n, count, np.dtype(np.float32), "avg", 0, False, None, "two_shot")
    assert plan.algorithm == "two_shot" and plan.single_copy and plan.workspace_bytes > 0
    assert plans.single_copy_plan("allreduce", n, count, np.dtype(np.float32), "avg", 0, True, None,
                                  "two_shot").phases == plan.phases
    read, folded = {}, {}
    for row in plan.phases[1].table:
        rank = int(row[plans.RANK])
        assert row[plans.KIND] == plans.REDUCE_FINAL_OP and row[plans.DST_BUF] == plans.SCRATCH
        assert [int(row[plans.SRC0 + 3 * s]) for s in range(row[plans.NSRC])] == list(range(n))   # rank order
        for s in range(row[plans.NSRC]):
            peer, buffer, offset = (int(v) for v in row[plans.SRC0 + 3 * s: plans.SRC0 + 3 * s + 3])
            assert buffer == plans.INPUT and offset == row[plans.DST_OFF]
            for element in range(offset, offset + int(row[plans.COUNT])):
                read[peer, element] = read.get((peer, element), 0) + 1
                folded[element] = rank
    assert read == {(q, e): 1 for q in range(n) for e in range(count)}
    copied = {}
    for row in plan.phases[2].table:
        rank, source, buffer = int(row[plans.RANK]), int(row[plans.SRC0]), int(row[plans.SRC0 + 1])
        assert row[plans.KIND] == plans.COPY_OP and row[plans.DST_BUF] == plans.OUTPUT and buffer == plans.SCRATCH
        for element in range(int(row[plans.DST_OFF]), int(row[plans.DST_OFF] + row[plans.COUNT])):
            assert folded[element] == source
            copied[rank, element] = copied.get((rank, element), 0) + 1
    assert copied == {(r, e): 1 for r in range(n) for e in range(count)}
    for rank in range(n):
        assert {peer for peer, done in plan.phases[2].waits[rank] if done >= 2} == set(range(n)) - {rank}
    assert not any(len(phase.table) for phase in plan.phases[3:])


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("in_place", [False, True])
def test_a_pushed_allreduce_folds_each_chunk_once_and_its_folder_writes_it_into_every_peers_output(n, in_place):
    """plan.pushed_plan: phase 1, rank r folds chunk r of every rank's
    INPUT (rank order, every element read once) into its own OUTPUT, a
    slice of at most PUSH_SLICE_BYTES at a time, and after each slice's
    fold pushes that slice into every peer's OUTPUT (rows in its own table
    whose RANK is the peer); every element of every output is written
    once, by the rank that folded it. Phase 1 waits for every peer's phase
    0 (its addresses), phase 2 for every peer's phase 1 (its pushes into
    this rank are done) and has no rows."""
    itemsize = 4
    count = 3 * plans.PUSH_SLICE_BYTES // itemsize * n // 2 + 7   # several slices per chunk, and a tail
    plan = plans.pushed_plan("allreduce", n, count, np.dtype(np.float32), "avg", 0, in_place)
    assert plan.single_copy and plan.pushes and len(plan.phases) >= 3 and not len(plan.phases[0].table)
    assert not any(len(phase.table) for phase in plan.phases[2:])
    read, written = np.zeros((n, count), int), np.zeros((n, count), int)
    folded = np.full(count, -1)
    slice_elements = plans.PUSH_SLICE_BYTES // itemsize
    for rank, rows in enumerate(plan.phases[1].rows_by_rank):
        last_fold = None
        for row in rows:
            start, stop = int(row[plans.DST_OFF]), int(row[plans.DST_OFF] + row[plans.COUNT])
            assert row[plans.DST_BUF] == plans.OUTPUT
            if row[plans.RANK] == rank:   # a fold, into this rank's own output
                assert row[plans.KIND] == plans.REDUCE_FINAL_OP and stop - start <= slice_elements
                assert [int(row[plans.SRC0 + 3 * s]) for s in range(row[plans.NSRC])] == list(range(n))
                for s in range(row[plans.NSRC]):
                    peer, buffer, offset = (int(v) for v in row[plans.SRC0 + 3 * s: plans.SRC0 + 3 * s + 3])
                    assert buffer == plans.INPUT and offset == start
                    read[peer, start:stop] += 1
                folded[start:stop] = rank
                last_fold = (start, stop)
            else:   # a push of the slice just folded
                assert row[plans.KIND] == plans.COPY_OP and row[plans.NSRC] == 1
                assert tuple(int(v) for v in row[plans.SRC0:plans.SRC0 + 3]) == (rank, plans.OUTPUT, start)
                assert last_fold[0] <= start and stop <= last_fold[1]
            written[int(row[plans.RANK]), start:stop] += 1
            assert (folded[start:stop] == rank).all()
        assert {peer for peer, done in plan.phases[1].waits[rank] if done >= 1} == set(range(n)) - {rank}
        assert {peer for peer, done in plan.phases[2].waits[rank] if done >= 2} == set(range(n)) - {rank}
    assert (read == 1).all() and (written == 1).all()
    assert sorted(set(folded.tolist())) == list(range(n))
    with pytest.raises(ValueError, match="pushed_plan serves"):
        plans.pushed_plan("reduce_scatter", n, count, np.dtype(np.float32), "sum", 0, False)


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("in_place", [False, True])
def test_a_pushed_reduce_folds_each_chunk_once_and_its_folder_writes_it_into_the_roots_output(n, in_place):
    """plan.pushed_plan for two_shot's reduce: rank r folds chunk r of every
    rank's INPUT into its own memory (the root its OUTPUT, the others their
    SCRATCH) and pushes each slice into the root's OUTPUT; every element of
    the root's output is written once, by the rank that folded it, and no
    other rank's output is written. In place too (the root's OUTPUT is its
    x, chunk r of which rank r alone reads, before it writes it)."""
    count = 3 * plans.PUSH_SLICE_BYTES // 4 * n // 2 + 7
    for root in range(n):
        plan = plans.pushed_plan("reduce", n, count, np.dtype(np.float32), "sum", root, in_place)
        assert plan.binding == ("in_place" if in_place else "out_of_place"), plan.binding
        assert plan.single_copy and plan.pushes and not any(len(phase.table) for phase in plan.phases[2:])
        folded, written = np.full(count, -1), np.zeros(count, int)
        for rank, rows in enumerate(plan.phases[1].rows_by_rank):
            for row in rows:
                start, stop = int(row[plans.DST_OFF]), int(row[plans.DST_OFF] + row[plans.COUNT])
                if row[plans.RANK] == rank:
                    assert row[plans.DST_BUF] == (plans.OUTPUT if rank == root else plans.SCRATCH)
                    assert [int(row[plans.SRC0 + 3 * s]) for s in range(row[plans.NSRC])] == list(range(n))
                    assert (folded[start:stop] == -1).all()
                    folded[start:stop] = rank
                    if rank != root:
                        continue
                else:
                    assert row[plans.RANK] == root and row[plans.DST_BUF] == plans.OUTPUT
                    assert tuple(int(v) for v in row[plans.SRC0:plans.SRC0 + 3]) == (rank, plans.SCRATCH, start)
                    assert (folded[start:stop] == rank).all()
                written[start:stop] += 1
        assert (written == 1).all() and sorted(set(folded.tolist())) == list(range(n))


@pytest.mark.parametrize("collective", ["gather", "scatter", "all_to_all"])
@pytest.mark.parametrize("n", [2, 3, 5])
def test_staged_plans_move_a_block_only_its_rank_needs_once_or_not_at_all(collective, n):
    """Below the single-copy limit the exchanges go through workspaces: a
    block no peer reads (the root's own of gather and scatter, each rank's
    own of all_to_all) goes straight from INPUT to OUTPUT in phase 0,
    beside the peers' copies in, not in and out of the workspace; in place
    it does not move. Elements each rank's rows move: every other block
    twice between them (into a workspace, out of it), its own once."""
    block = 8
    for in_place in (False, True):
        binding = bindings.WORKSPACE_IN_PLACE if in_place else bindings.WORKSPACE_APART
        plan = plans.build_plan(collective, "direct", n, block * n, np.dtype(np.float32), "sum", 0, binding)
        moved = [sum(int(row[plans.COUNT]) for phase in plan.phases for row in phase.rows_by_rank[r])
                 for r in range(n)]
        own = 0 if in_place else block
        if collective == "all_to_all":
            assert moved == [2 * (n - 1) * block + own] * n, (in_place, moved)
        else:   # the root, rank 0, copies the others' blocks in (scatter) or out (gather); each other rank one
            assert moved == [(n - 1) * block + own] + [block] * (n - 1), (collective, in_place, moved)
        straight = [row for row in plan.phases[0].rows_by_rank[0]
                    if row[plans.DST_BUF] == plans.OUTPUT and row[plans.SRC0 + plans.SRC_BUF] == plans.INPUT]
        assert len(straight) == (0 if in_place else 1), straight
    # Where x and out may overlap in any other way, INPUT is read only in
    # phase 0, and nothing is written into OUTPUT there, as always.
    plan = plans.build_plan(collective, "direct", n, block * n, np.dtype(np.float32), "sum", 0, bindings.WORKSPACE)
    assert all(row[plans.SRC0 + plans.SRC_BUF] != plans.INPUT for phase in plan.phases[1:] for row in phase.table)
    assert all(row[plans.DST_BUF] != plans.OUTPUT for row in plan.phases[0].table)


def test_all_to_all_v_single_copy_plans_skip_empty_blocks():
    matrix = ((0, 3, 0), (2, 0, 5), (0, 0, 0))
    plan = plans.single_copy_plan("all_to_all_v", 3, 0, np.dtype(np.int8), "sum", 0, False, matrix)
    moved = sorted((int(r[plans.RANK]), int(r[plans.SRC0]), int(r[plans.COUNT])) for r in plan.phases[1].table)
    assert moved == [(0, 1, 2), (1, 0, 3), (2, 1, 5)]


@pytest.mark.mpi
@needs_the_executor
@pytest.mark.parametrize("n", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_exchanges_in_one_copy_give_the_interpreters_bits(n):
    oks, report = run(n, "bits")
    assert len(oks) == n, report


@pytest.mark.mpi
@needs_the_executor
def test_allgather_and_broadcast_on_the_plans_read_peers_inputs_in_one_copy_with_the_interpreters_bits():
    """Without the compiled loop (COLLECTIVES_FAST_PATH=0), which runs them
    otherwise, allgather and broadcast's `direct` plans read peers' inputs
    in one copy too."""
    oks, report = run(3, "moves_without_the_loop", environment={**SMALL, "COLLECTIVES_FAST_PATH": "0"})
    assert len(oks) == 3, report


@pytest.mark.mpi
@needs_the_executor
@pytest.mark.parametrize("n", [2, 3])
def test_the_folds_on_the_plans_fold_peers_inputs_in_one_copy_with_the_interpreters_bits(n):
    """Without the compiled loop (COLLECTIVES_FAST_PATH=0), which runs them
    otherwise, reduce_scatter, reduce and allreduce (in place too) fold
    peers' inputs read in place, slice by slice (_host_plan.c's fold_peers)."""
    oks, report = run(n, "folds", environment={**SMALL, "COLLECTIVES_FAST_PATH": "0"})
    assert len(oks) == n, report


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("in_place", [False, True])
def test_a_spread_broadcast_reads_each_chunk_of_the_roots_x_once_and_pushes_it_into_every_other_output(n, in_place):
    """plan.spread_plan: run each rank's phase-1 rows in order on element
    labels (what the root's x holds at each place): rank c reads chunk c of
    the root's x once (the root: copies it; in place, has it), a slice at a
    time, and each slice's pushes carry what it just read; a push into the
    root is skipped where it is in place (as the executor does:
    no_push_in_place); every receiving output ends with the root's x, each
    element written once; phase 1 waits for every peer's phase 0, phase 2
    for every peer's phase 1."""
    count = 3 * plans.PUSH_SLICE_BYTES // 4 * n // 2 + 5
    for root in range(n):
        plan = plans.spread_plan("broadcast", n, count, np.dtype(np.float32), root, in_place)
        assert plan.single_copy and plan.pushes and not any(len(phase.table) for phase in plan.phases[2:])
        x = np.arange(count)
        outputs = {q: np.full(count, -1) for q in range(n) if not (in_place and q == root)}
        writes = {q: np.zeros(count, int) for q in outputs}
        reads = np.zeros(count, int)
        for rank, rows in enumerate(plan.phases[1].rows_by_rank):
            for row in rows:
                start, stop = int(row[plans.DST_OFF]), int(row[plans.DST_OFF] + row[plans.COUNT])
                source, buffer, at = (int(v) for v in row[plans.SRC0:plans.SRC0 + 3])
                assert row[plans.KIND] == plans.COPY_OP and row[plans.DST_BUF] == plans.OUTPUT and at == start
                assert row[plans.RANK] == rank or source == rank   # a rank writes its own output or pushes its own
                assert stop - start <= plans.PUSH_SLICE_BYTES // 4
                if row[plans.RANK] == plan.no_push_in_place == root and in_place:
                    continue   # (the executor skips it: the root's x holds the result)
                if buffer == plans.INPUT:
                    assert source == root
                    reads[start:stop] += row[plans.RANK] == rank   # (an in-place root pushes its x: no read)
                    values = x[start:stop]
                else:
                    assert buffer == plans.OUTPUT
                    values = outputs[source][start:stop]
                    assert (values == x[start:stop]).all(), "a push of what its rank has not read yet"
                outputs[int(row[plans.RANK])][start:stop] = values
                writes[int(row[plans.RANK])][start:stop] += 1
        assert all((out == x).all() for out in outputs.values())
        assert all((w == 1).all() for w in writes.values())
        for c, (lo, hi) in enumerate(plans.chunk_bounds("broadcast", n, n, count, 4)):
            assert (reads[lo:hi] == (0 if in_place and c == root else 1)).all()
        for rank in range(n):
            assert {peer for peer, done in plan.phases[1].waits[rank] if done >= 1} == set(range(n)) - {rank}
            assert {peer for peer, done in plan.phases[2].waits[rank] if done >= 2} == set(range(n)) - {rank}
    with pytest.raises(ValueError, match="spread_plan serves"):
        plans.spread_plan("allgather", n, count, np.dtype(np.float32), 0, in_place)


@pytest.mark.mpi
@needs_the_executor
@pytest.mark.parametrize("first", ["out", "in"])
def test_a_pushed_allreduce_gives_the_interpreters_bits_and_a_refused_push_falls_back_on_every_rank(first):
    oks, report = run(3, "pushes", environment={**SMALL, "COLLECTIVES_FAST_PATH": "0"}, extra=[first])
    assert len(oks) == 3, report


@pytest.mark.mpi
@needs_the_executor
@pytest.mark.parametrize("n", [2, 3])
def test_a_spread_broadcast_gives_the_roots_bits_and_a_refused_push_falls_back_on_every_rank(n):
    oks, report = run(n, "spread", environment={**SMALL, "COLLECTIVES_FAST_PATH": "0"})
    assert len(oks) == n, report


@pytest.mark.mpi
@needs_the_executor
def test_where_a_rank_may_not_push_allreduce_in_place_keeps_reading():
    oks, report = run(2, "pushes_probe_refused", environment={**SMALL, "COLLECTIVES_FAST_PATH": "0"})
    assert len(oks) == 2, report


@pytest.mark.mpi
@needs_the_executor
@pytest.mark.parametrize("case", ["out", "in", pytest.param("held", marks=pytest.mark.slow)])
def test_a_failed_call_returns_only_once_no_peer_pushes_into_its_output(case):
    """The pushed allreduce that `auto` runs (the loop leaves it to the
    plans: COLLECTIVES_STAGED_MAX=0 makes every large one a single copy)."""
    oks, report = run(2, "pushes_fenced", environment={**SMALL, "COLLECTIVES_STAGED_MAX": "0"},
                      flags=["-disable-auto-cleanup"], extra=[case])
    assert len(oks) == 2, report


@pytest.mark.mpi
@needs_the_executor
def test_a_refused_read_falls_back_to_the_staged_plan_on_every_rank():
    oks, report = run(3, "refused")
    assert len(oks) == 3, report


@pytest.mark.mpi
@needs_the_executor
def test_a_rank_returns_only_once_its_readers_are_done():
    oks, report = run(3, "slow_readers")
    assert len(oks) == 3, report


@pytest.mark.mpi
@needs_the_executor
@pytest.mark.parametrize("event", ["killed", "stalled", "killed_pushing"])
def test_a_killed_or_stalled_rank_raises_the_typed_error_on_the_others(event):
    # Hydra would otherwise kill the survivors itself when one rank exits.
    environment = {**SMALL, "COLLECTIVES_FAST_PATH": "0"} if event == "killed_pushing" else SMALL
    oks, report = run(3, event, environment=environment, flags=["-disable-auto-cleanup"], limit=120)
    assert len(oks) == (3 if event == "stalled" else 2), report


@needs_the_executor
@pytest.mark.parametrize("setting", ["plain", "slow", "refused"])
def test_the_ranks_measure_the_exchanges_single_copy_limit_as_they_start(setting, monkeypatch):
    """Unpinned, the ranks time 256 KiB all_to_alls both ways and all take
    the faster limit (the same times on every rank: the slowest rank's),
    while an in-place all_to_all keeps staging below 4 MiB; with every
    read held 2 ms the single copy loses; with one rank's reads refused
    nothing is timed and every exchange stages. What runs is what
    chosen_algorithm answers (the worker checks)."""
    from collectives.config import DEFAULT_EXCHANGE_SINGLE_COPY_MIN, MEASURED_EXCHANGE_SINGLE_COPY_MIN
    monkeypatch.delenv("COLLECTIVES_EXCHANGE_SINGLE_COPY_MIN", raising=False)
    oks, report = run(2, "measured", environment={}, extra=(setting,))
    assert len(oks) == 2, report
    seconds = r"(None|[0-9.]+(?:e-?[0-9]+)?)"   # (mpiexec may splice lines: match the fields themselves)
    chosen = set(re.findall(rf"MEASURED \d+ (\d+) {seconds} {seconds} (single_copy|compiled_plan) "
                            r"(single_copy|compiled_plan)", report))
    assert len(chosen) == 1, report   # every rank alike
    ((limit, single_copy, staged, out_of_place, in_place),) = chosen
    assert in_place == "compiled_plan", report
    if setting == "refused":
        assert (int(limit), single_copy, out_of_place) == (DEFAULT_EXCHANGE_SINGLE_COPY_MIN, "None",
                                                           "compiled_plan"), report
        return
    faster = float(single_copy) < float(staged)
    assert int(limit) == (MEASURED_EXCHANGE_SINGLE_COPY_MIN if faster else DEFAULT_EXCHANGE_SINGLE_COPY_MIN), report
    assert out_of_place == ("single_copy" if faster else "compiled_plan"), report
    if setting == "slow":   # 2 ms a read, one read of the peer a call
        assert float(single_copy) > 2000 and not faster, report


@needs_the_executor
def test_ranks_that_disagree_on_the_pinned_single_copy_limit_are_told_as_they_start(monkeypatch):
    monkeypatch.delenv("COLLECTIVES_EXCHANGE_SINGLE_COPY_MIN", raising=False)
    oks, report = run(3, "limit_differs", environment={})
    assert len(oks) == 3, report
