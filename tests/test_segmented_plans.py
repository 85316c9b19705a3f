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


def run(plan, inputs, outputs):
    """Every rank's part of `plan`, phase by phase, on workspaces of its own."""
    workspaces = [np.zeros(max(plan.workspace_bytes, 8), np.uint8) for _ in inputs]
    itemsize = plan.dtype.itemsize

    def buffer(rank, buffer_id):
        if buffer_id == WORK:
            return workspaces[rank][:plan.count * itemsize].view(plan.dtype)
        if buffer_id == SCRATCH:
            start = plan.scratch_offset
            return workspaces[rank][start:start + plan.scratch_elements * itemsize].view(plan.dtype)
        return inputs[rank] if buffer_id == INPUT else outputs[rank]
    host.execute_phases([phase.table for phase in plan.phases], buffer, plan.op, plan.nranks)


def arrays(collective, n, block, values, in_place):
    """Each rank's (input, output) for a call of `block` elements per rank's
    block (the whole message where the collective has no blocks), in place
    as the binding takes it: the same array, or one the rank's block of the other."""
    copies = [v.copy() for v in values]
    if collective == "reduce_scatter":
        outs = [x[r * block:(r + 1) * block] if in_place else np.zeros(block, np.float32)
                for r, x in enumerate(copies)]
        return copies, outs
    if collective == "allgather":
        if in_place:
            outs = [np.zeros(n * block, np.float32) for _ in range(n)]
            for r, out in enumerate(outs):
                out[r * block:(r + 1) * block] = values[r][:block]
            return [out[r * block:(r + 1) * block] for r, out in enumerate(outs)], outs
        return [v[:block].copy() for v in values], [np.zeros(n * block, np.float32) for _ in range(n)]
    return copies, (copies if in_place else [np.zeros(block, np.float32) for _ in range(n)])


def slice_of_segment(n, array, block, start, length, whole_blocks):
    """The segment's elements of a caller's array: of each block where it holds every rank's."""
    if whole_blocks:
        return np.concatenate([array[b * block + start:b * block + start + length] for b in range(n)])
    return array[start:start + length]


@pytest.mark.parametrize("collective", plans.SEGMENTED_COLLECTIVES)
@pytest.mark.parametrize("in_place", [False, True], ids=["out-of-place", "in-place"])
def test_a_segmented_plan_gives_the_bits_of_its_segments_plans_run_one_after_another(collective, in_place):
    """Against the segments' own plans on the segments' elements, each bound
    plainly (WORKSPACE: the same expressions as any binding, binding.py)."""
    binding = bindings.WORKSPACE_IN_PLACE if in_place else bindings.WORKSPACE_APART
    blocked = collective in ("reduce_scatter", "allgather")
    rng = np.random.default_rng(3)
    checked = 0
    for algorithm in ALGORITHMS:
        if collective not in REGISTRY[algorithm].collectives:
            continue
        for n in (2, 3):
            # (a segment of more than a page: the last run's own plan puts SCRATCH a page nearer than the segment's)
            for block, per_block in ((3 * 2048, 2048), (4 * 2048 + 37, 2048), (5 * 64 + 3, 64)):
                blocks = n if blocked else 1
                segmented = plans.segmented_plan(collective, algorithm, n, block * blocks, np.dtype(np.float32), "sum",
                                                 1, binding, per_block * blocks)
                values = [rng.standard_normal(block * blocks).astype(np.float32) for _ in range(n)]
                inputs, outputs = arrays(collective, n, block, values, in_place)
                run(segmented, inputs, outputs)
                for start in range(0, block, per_block):
                    length = min(per_block, block - start)
                    one = plans.build_plan(collective, algorithm, n, length * blocks, np.float32, "sum", 1,
                                           bindings.WORKSPACE)
                    seg_in = [slice_of_segment(n, v if collective != "allgather" else v[:block], block, start, length,
                                               collective == "reduce_scatter") for v in values]
                    seg_out = [np.zeros(length * (n if collective == "allgather" else 1), np.float32)
                               for _ in range(n)]
                    run(one, seg_in, seg_out)
                    for r in ([1] if collective == "reduce" else range(n)):
                        got = slice_of_segment(n, outputs[r], block, start, length, collective == "allgather")
                        assert np.array_equal(got.view(np.uint32), seg_out[r].view(np.uint32)), \
                            (algorithm, n, block, start, r)
                checked += 1
    assert checked >= 12


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


def test_only_the_collectives_of_elements_or_blocks_and_a_segment_shorter_than_the_message_are_segmented():
    for collective in ("all_to_all", "gather", "scatter"):
        with pytest.raises(ValueError, match="segmented_plan serves"):
            plans.segmented_plan(collective, "direct", 2, 4096, np.dtype(np.float32), "sum", 0,
                                 bindings.WORKSPACE, 1024)
    for collective, segment in (("allreduce", 0), ("allreduce", 4096), ("allreduce", 5000), ("reduce_scatter", 1023)):
        with pytest.raises(ValueError, match="a segment of"):
            plans.segmented_plan(collective, "direct", 2, 4096, np.dtype(np.float32), "sum", 0,
                                 bindings.WORKSPACE, segment)
