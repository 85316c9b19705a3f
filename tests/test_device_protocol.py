"""The device flag protocol (docs/device-protocol.md), checked on its CPU model
(protocol_model.py): the design survives 10^4 randomized runs with weak
memory, and every broken variant is caught by a named invariant."""

import pytest

from protocol_model import (
    DEADLOCK, DESIGN, IN_CALL_FREE_SLOT_WAIT_SKIPPED, MUTATIONS, OVERWRITE_WHILE_READ, READ_BEFORE_COMPLETE,
    SHAPES, SINGLE_SET_WAITING_FOR_PREVIOUS_CALL, Shape, WeakMemoryRun, explore,
)

RUNS = 10_000          # randomized runs of the design; each mutation gets the same budget
THREADED_RUNS = 300
MULTI_RANK_SHAPES = [shape for shape in SHAPES if shape.ranks > 1]

# The invariant each mutation breaks first (see MUTATIONS for the race behind each).
CAUGHT_BY = {
    "single_slot_set": OVERWRITE_WHILE_READ,
    "relaxed_ready_store": READ_BEFORE_COMPLETE,
    "boolean_ready_reset_by_readers": DEADLOCK,
    "boolean_ready_reset_by_owner": READ_BEFORE_COMPLETE,
    "no_wait_for_free_slot": OVERWRITE_WHILE_READ,
}


def assert_clean(summary, runs, shapes=SHAPES):
    assert summary.first is None, summary.first
    assert summary.runs == runs                     # the budget really ran ...
    assert summary.shapes == set(shapes)            # ... over every shape ...
    assert summary.reads_checked > summary.runs     # ... and the checks saw the traffic
    assert summary.writes_checked > summary.runs


def test_every_mutation_is_listed_with_the_invariant_that_catches_it():
    assert CAUGHT_BY.keys() == MUTATIONS.keys()


def test_shapes_cover_the_parameter_ranges():
    assert {s.ranks for s in SHAPES} == {1, 2, 3, 4}
    assert {s.blocks for s in SHAPES} == {1, 2}
    assert {s.calls for s in SHAPES} == set(range(1, 7))
    assert {s.chunk_len for s in SHAPES} == {1, 2, 3}


def test_design_survives_randomized_runs():
    summary = explore(DESIGN, RUNS, seed=1)
    assert_clean(summary, RUNS)
    assert summary.flags_ahead == 0   # no rank ever got more than one call ahead of a peer
    print(f"\ndesign: {summary.runs} runs over {len(summary.shapes)} shapes, "
          f"{summary.reads_checked} reads and {summary.writes_checked} slot stores checked, no violation")


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_mutation_is_caught(mutation):
    summary = explore(MUTATIONS[mutation], RUNS, seed=2, stop_at_first=True)
    assert summary.first is not None, f"{mutation} survived {summary.runs} runs"
    assert summary.first.invariant == CAUGHT_BY[mutation], summary.first
    print(f"\n{mutation}: {summary.first.invariant} in run {summary.first.run_index + 1} "
          f"({summary.first.shape}, seed {summary.first.seed}): {summary.first.detail}")


def test_a_finding_replays_from_its_shape_and_seed():
    first = explore(MUTATIONS["relaxed_ready_store"], RUNS, seed=2, stop_at_first=True).first
    replay = WeakMemoryRun(first.shape, MUTATIONS["relaxed_ready_store"], first.seed).execute()
    assert (replay.violation.invariant, replay.violation.detail) == (first.invariant, first.detail)


def test_single_set_is_correct_only_when_it_waits_for_the_previous_call():
    # Two sets are not needed for safety: they make the step-1 wait free.
    assert_clean(explore(SINGLE_SET_WAITING_FOR_PREVIOUS_CALL, RUNS // 5, seed=3), RUNS // 5)


def test_in_call_free_slot_wait_is_implied_by_the_previous_ready_exchange():
    # Step 1 never has to wait in a sequence of calls: a peer publishes ready
    # for g - 1 only after it finished reading g - 2. The done flags are
    # needed by retirement (test_mutation_is_caught[no_wait_for_free_slot]).
    assert_clean(explore(IN_CALL_FREE_SLOT_WAIT_SKIPPED, RUNS // 5, seed=4), RUNS // 5)


def test_one_rank_needs_no_peer():
    run = WeakMemoryRun(Shape(ranks=1, blocks=2, calls=6, chunk_len=3), DESIGN, seed=5).execute()
    assert run.violation is None and run.reads_checked == 6 * 2 * 3


def test_design_on_real_threads():
    summary = explore(DESIGN, THREADED_RUNS, seed=6, threaded=True, shapes=MULTI_RANK_SHAPES,
                      spin_timeout=10.0, join_timeout=30.0)
    assert_clean(summary, THREADED_RUNS, MULTI_RANK_SHAPES)


def test_real_threads_catch_a_mutation():
    # The threaded checks bite too. (relaxed_ready_store cannot be caught
    # there: its memory is sequentially consistent.)
    summary = explore(MUTATIONS["single_slot_set"], THREADED_RUNS, seed=7, threaded=True,
                      shapes=MULTI_RANK_SHAPES, stop_at_first=True, spin_timeout=10.0, join_timeout=30.0)
    assert summary.first is not None and summary.first.invariant == OVERWRITE_WHILE_READ, summary.first
