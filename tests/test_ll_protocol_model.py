"""The LL one-shot collectives' protocol (kernels/ll_allreduce.cu), checked
on its CPU model (ll_protocol_model.py): weak memory, random interleavings,
message sizes and collectives that change between calls. The design
survives; each broken variant is caught by a named invariant. With
allreduces alone the slot-reuse wait (step 1) is implied by stream order,
which is why the executor orders a call after the previous one when the
caller changes streams (calls_overlap); with broadcasts and reduces, whose
ranks do not all read every peer, step 1 is needed, and so is its taking a
peer's line of the next call."""

import pytest

from ll_protocol_model import (
    DEADLOCK, DESIGN, MUTATIONS, NO_REUSE_WAIT, OVERWRITE_WHILE_READ, READ_BEFORE_COMPLETE, SHAPES, explore,
)

RUNS = 5000

CAUGHT_BY = {
    "one_slot_set": OVERWRITE_WHILE_READ,
    "flag_apart_from_data": READ_BEFORE_COMPLETE,
    "calls_overlap": OVERWRITE_WHILE_READ,
    "step1_without_next_call": OVERWRITE_WHILE_READ,
    "no_reuse_wait": OVERWRITE_WHILE_READ,
}


def assert_clean(summary, runs):
    assert summary.first is None, summary.first
    assert summary.runs == runs and summary.shapes == set(SHAPES)
    assert summary.reads > runs   # the checks saw the traffic


def test_shapes_cover_ranks_threads_calls_and_sizes():
    assert {s.ranks for s in SHAPES} == {1, 2, 3, 4}
    assert {s.threads for s in SHAPES} == {1, 2, 3}
    assert {s.calls for s in SHAPES} == set(range(1, 7))
    assert {s.max_lines for s in SHAPES} == {1, 2, 4}   # calls with fewer lines than threads, and more


def test_every_mutation_is_listed_with_the_invariant_that_catches_it():
    assert CAUGHT_BY.keys() == MUTATIONS.keys()


def test_design_survives_randomized_runs():
    assert_clean(explore(DESIGN, RUNS, seed=1), RUNS)


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_mutation_is_caught(mutation):
    summary = explore(MUTATIONS[mutation], RUNS, seed=2, stop_at_first=True)
    assert summary.first is not None, f"{mutation} survived {summary.runs} runs"
    run_index, shape, seed, invariant, detail = summary.first
    assert invariant == CAUGHT_BY[mutation], summary.first
    assert invariant != DEADLOCK
    print(f"\n{mutation}: {invariant} in run {run_index + 1} ({shape}, seed {seed}): {detail}")


def test_the_slot_reuse_wait_is_implied_by_stream_order_for_allreduces_alone():
    assert_clean(explore(NO_REUSE_WAIT, RUNS // 2, seed=4), RUNS // 2)
