"""plan.segmented_plan: a plan of allreduce, broadcast or reduce run as
consecutive runs of one plan on segments of the message. Here, in one
process through the interpreter (executors/host.py), its bits against the
segments' own plans run one after the other, and its waits against theirs;
tests/test_host_plans.py runs it across processes, both executors, and
names a rank that cuts a call otherwise."""

import numpy as np
import pytest

from collectives import binding as bindings
from collectives import plan as plans
from collectives.algorithms import REGISTRY
from collectives.executors import host
from collectives.plan import INPUT, OUTPUT, SCRATCH, WORK

ALGORITHMS = sorted(REGISTRY)


def run(plan, inputs, outputs, in_place):
    """Every rank's part of `plan`, phase by phase, on workspaces of its own."""
    workspaces = [np.zeros(max(plan.workspace_bytes, 8), np.uint8) for _ in inputs]
    itemsize = plan.dtype.itemsize

    def buffer(rank, buffer_id):
        if buffer_id == WORK:
            return workspaces[rank][:plan.count * itemsize].view(plan.dtype)
        if buffer_id == SCRATCH:
            start = plan.scratch_offset
            return workspaces[rank][start:start + plan.scratch_elements * itemsize].view(plan.dtype)
        return inputs[rank] if buffer_id == INPUT or in_place else outputs[rank]
    host.execute_phases([phase.table for phase in plan.phases], buffer, plan.op, plan.nranks)


@pytest.mark.parametrize("collective", plans.SEGMENTED_COLLECTIVES)
@pytest.mark.parametrize("in_place", [False, True], ids=["out-of-place", "in-place"])
def test_a_segmented_plan_gives_the_bits_of_its_segments_plans_run_one_after_another(collective, in_place):
    binding = bindings.WORKSPACE_IN_PLACE if in_place else bindings.WORKSPACE_APART
    rng = np.random.default_rng(3)
    checked = 0
    for algorithm in ALGORITHMS:
        if collective not in REGISTRY[algorithm].collectives:
            continue
        for n in (2, 3):
            # (a segment of more than a page: the tail's own plan puts SCRATCH a page nearer than the segment's)
            for count, segment in ((3 * 2048, 2048), (4 * 2048 + 37, 2048)):
                segmented = plans.segmented_plan(collective, algorithm, n, count, np.dtype(np.float32), "sum", 1,
                                                 binding, segment)
                inputs = [rng.standard_normal(count).astype(np.float32) for _ in range(n)]
                got = [x.copy() for x in inputs], [np.zeros(count, np.float32) for _ in range(n)]
                run(segmented, *got, in_place)
                want = [x.copy() for x in inputs], [np.zeros(count, np.float32) for _ in range(n)]
                for start in range(0, count, segment):
                    piece = slice(start, min(start + segment, count))
                    one = plans.build_plan(collective, algorithm, n, piece.stop - piece.start, np.float32, "sum", 1,
                                           binding)
                    run(one, [x[piece] for x in want[0]], [o[piece] for o in want[1]], in_place)
                result = 0 if in_place else 1
                ranks = [1] if collective == "reduce" else range(n)
                for r in ranks:
                    assert np.array_equal(got[result][r].view(np.uint32), want[result][r].view(np.uint32)), \
                        (algorithm, n, count, r)
                checked += 1
    assert checked >= 8


def test_each_segment_waits_as_a_new_call_would_after_the_segments_before():
    count, segment = 5 * 512 + 100, 512
    whole = plans.build_plan("allreduce", "ring", 3, segment, np.float32, "sum", 0, bindings.WORKSPACE_APART)
    tail = plans.build_plan("allreduce", "ring", 3, 100, np.float32, "sum", 0, bindings.WORKSPACE_APART)
    segmented = plans.segmented_plan("allreduce", "ring", 3, count, np.dtype(np.float32), "sum", 0,
                                     bindings.WORKSPACE_APART, segment)
    per = len(whole.phases)
    assert len(segmented.phases) == 5 * per + len(tail.phases)
    assert segmented.segment == segment and segmented.count == count
    assert segmented.workspace_bytes == whole.workspace_bytes   # the workspace of one segment, not of the message
    for s in range(5):
        for p, phase in enumerate(whole.phases):
            shifted = segmented.phases[s * per + p]
            assert shifted.waits == tuple(tuple((peer, done + s * per) for peer, done in w) for w in phase.waits)
            rows, original = shifted.table, phase.table
            for column, buffer_column in ((plans.DST_OFF, plans.DST_BUF), (plans.SRC0 + 2, plans.SRC0 + 1)):
                moved = np.isin(original[:, buffer_column], (INPUT, OUTPUT))
                assert (rows[moved, column] == original[moved, column] + s * segment).all()
                assert (rows[~moved, column] == original[~moved, column]).all()
    # phase 0 of every segment waits for every peer to have completed all the segments before
    for s in range(6):
        assert all(dict(w) == {q: s * per for q in range(3) if q != r}
                   for r, w in enumerate(segmented.phases[s * per].waits))


def test_only_the_elementwise_collectives_and_a_segment_shorter_than_the_message_are_segmented():
    for collective in ("reduce_scatter", "allgather", "all_to_all", "gather", "scatter"):
        with pytest.raises(ValueError, match="segmented_plan serves"):
            plans.segmented_plan(collective, "direct", 2, 4096, np.dtype(np.float32), "sum", 0,
                                 bindings.WORKSPACE, 1024)
    for segment in (0, 4096, 5000):
        with pytest.raises(ValueError, match="a segment of"):
            plans.segmented_plan("allreduce", "direct", 2, 4096, np.dtype(np.float32), "sum", 0,
                                 bindings.WORKSPACE, segment)
