"""The execution paths of GPU calls and the selector that picks one
(executors/paths.py): the selector's rule and memory; the path
chosen_algorithm names is the one a call takes, in one process and across
processes; the call records (executors/device_protocol.py). Across
processes under mpiexec on emulated devices (tests/paths_worker.py): a
rank whose call takes another path than its peers' (LL, symmetric memory,
staging, the step protocol, a barrier, a graph's replay) is a different
call that every rank names at once.
"""

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

import collectives
from collectives import InvalidUsageError
from collectives.auto import Choice
from collectives.config import ONE_KERNEL_ALLREDUCE_ENV
from collectives.executors.device_protocol import CallRecords
from collectives.executors.paths import ANY, PLAIN, SYMMETRIC, Path as ExecutionPath, Route, Selector
from collectives.plan import build_plan
from collectives.transport.layout import CALL_RECORD_BYTES, CALL_RECORDS

WORKER = Path(__file__).with_name("paths_worker.py")
CROSS_PATH = ["ll_vs_symmetric", "ll_vs_staged", "ll_vs_step", "staged_vs_step", "symmetric_vs_step", "ll_vs_barrier",
              "replay_vs_staged"]   # tests/paths_worker.py


@pytest.fixture(scope="module")
def emulation_library_built():
    """Built once here, not by every rank within its start-up timeout."""
    from collectives.devices import emulated
    emulated.library()


@pytest.mark.mpi
@pytest.mark.parametrize("scenario", CROSS_PATH)
def test_a_rank_whose_call_takes_another_path_is_named_at_once_on_every_rank(scenario, emulation_library_built):
    pytest.importorskip("mpi4py", reason="the multi-process tests need mpi4py: pip install '.[test]'")
    from test_mpi import run_worker
    oks, report = run_worker(WORKER, 3, scenario, "emulated", limit=120,
                             environment={"COLLECTIVES_ONE_KERNEL_ALLREDUCE": "1"})
    assert len(oks) == 3, report


@pytest.mark.mpi
@pytest.mark.parametrize("n, scenario", [(2, "algorithms_of_one_kernel"), (3, "chosen_path")])
def test_across_processes(n, scenario, emulation_library_built):
    pytest.importorskip("mpi4py", reason="the multi-process tests need mpi4py: pip install '.[test]'")
    from test_mpi import run_worker
    oks, report = run_worker(WORKER, n, scenario, "emulated", limit=120,
                             environment={"COLLECTIVES_ONE_KERNEL_ALLREDUCE": "1"})
    assert len(oks) == n, report


# -- the selector -------------------------------------------------------------------------

class Recorded(ExecutionPath):
    """A path that serves the plans `serves` says, on buffers `buffers`, and
    counts what the selector asks of it."""

    def __init__(self, name, serves=lambda plan: True, buffers=ANY, on=lambda info: True):
        self.name, self._serves, self.buffers, self._on = name, serves, buffers, on
        self.asked = {"serves": 0, "arrays": 0, "prepare": 0}

    def serves(self, plan):
        self.asked["serves"] += 1
        return self._serves(plan)

    def arrays(self, plan, input_info, output_info):
        self.asked["arrays"] += 1
        return ("placed", input_info.address) if self._on(input_info) else None

    def prepare(self, plan, arrays=None):
        self.asked["prepare"] += 1
        return (self.name, arrays)


class Info:
    def __init__(self, address):
        self.address = address


def plan_of(count, algorithm="direct", nranks=3):
    return build_plan("allreduce", algorithm, nranks, count, np.dtype(np.float32), "sum")


def test_the_selector_takes_the_first_path_that_serves_else_the_fallback():
    small = Recorded("small", serves=lambda plan: plan.count <= 10)
    direct = Recorded("direct", serves=lambda plan: plan.algorithm == "direct")
    fallback = Recorded("fallback")
    selector = Selector([small, direct], fallback)
    assert selector.select(plan_of(4)) is small
    assert selector.select(plan_of(40)) is direct
    assert selector.select(plan_of(40, "ring")) is fallback
    assert selector.route(plan_of(40, "ring"), Info(1), Info(2)).path is fallback


def test_a_choice_is_made_once_per_plan_and_the_buffers_decide_only_where_a_path_needs_them():
    on_symmetric = Recorded("symmetric", buffers=frozenset({SYMMETRIC}), on=lambda info: info.address >= 1000)
    anywhere = Recorded("anywhere")
    selector = Selector([on_symmetric], anywhere)
    plan = plan_of(64)
    route = selector.route(plan, Info(1), Info(2))
    assert route == Route(plan, anywhere, ("anywhere", None))
    assert selector.route(plan, Info(1), Info(2)) is route   # remembered: asked nothing again
    assert on_symmetric.asked == {"serves": 1, "arrays": 1, "prepare": 0}
    placed = selector.route(plan, Info(1000), Info(2000))
    assert placed.path is on_symmetric and placed.call == ("symmetric", ("placed", 1000))
    assert selector.select(plan, SYMMETRIC) is on_symmetric and selector.select(plan, PLAIN) is anywhere
    assert on_symmetric.asked["arrays"] == 2
    selector.forget_buffers()   # symmetric memory was allocated: the buffers are asked again
    assert selector.route(plan, Info(1), Info(2)) is not route and on_symmetric.asked["arrays"] == 3
    assert on_symmetric.asked["serves"] == 1 + 1   # once per plan for routes (and once for the select above)
    # A path that takes any buffers ends the list: later ones are not asked about this plan.
    never = Recorded("never")
    selector = Selector([anywhere, never], Recorded("fallback"))
    assert selector.route(plan, Info(1), Info(2)).path is anywhere and never.asked["serves"] == 0


# -- chosen_algorithm: the algorithm, and the path that runs it ---------------------------------

def test_a_choice_is_the_algorithms_name_with_the_path_beside_it():
    choice = Choice("direct", "ll")
    assert choice == "direct" and isinstance(choice, str) and f"{choice}" == "direct" and choice.path == "ll"
    assert {"direct": 1}[choice] == 1 and json.dumps({"picked": choice}) == '{"picked": "direct"}'
    assert repr(choice) == "Choice('direct', path='ll')" and choice.algorithm.__class__ is str
    again = pickle.loads(pickle.dumps(choice))
    assert (again, again.path, again.step) == ("direct", "ll", None)
    looped = Choice("two_shot", "compiled_loop", "single_copy")   # the compiled loop's step beside them
    assert repr(looped) == "Choice('two_shot', path='compiled_loop', step='single_copy')"
    again = pickle.loads(pickle.dumps(looped))
    assert (again, again.path, again.step) == ("two_shot", "compiled_loop", "single_copy")


def test_host_ranks_in_one_process_run_the_interpreter():
    with collectives.Communicator.local(4) as comm:
        chosen = comm.chosen_algorithm("allreduce", 1024)
        assert chosen.path == "interpreter" and chosen == comm.chosen_algorithm("allreduce", 1024).algorithm
        assert comm.chosen_algorithm("allreduce", 1024, algorithm="ring") == "ring"
        with pytest.raises(InvalidUsageError, match="algorithm"):
            comm.chosen_algorithm("allreduce", 1024, algorithm="no_such_algorithm")
        with pytest.raises(InvalidUsageError, match="'star' does not implement allgather"):
            comm.chosen_algorithm("allgather", 1024, algorithm="star")


class Launched:
    """Launches of every emulated device, by kind."""

    def __init__(self, monkeypatch):
        from collectives.devices.emulated import EmulatedDevice
        self.counts = {"launch_ll_allreduce": 0, "launch_step": 0}
        for kind in self.counts:
            original = getattr(EmulatedDevice, kind)

            def counted(device, *args, _original=original, _kind=kind):
                self.counts[_kind] += 1
                return _original(device, *args)
            monkeypatch.setattr(EmulatedDevice, kind, counted)

    def take(self):
        taken, self.counts = dict(self.counts), dict.fromkeys(self.counts, 0)
        return taken


@pytest.mark.parametrize("one_kernel", ["0", "1"])
def test_ranks_in_one_process_run_the_path_chosen_algorithm_names(monkeypatch, one_kernel):
    """Ranks on three devices: peer_ll for small calls whose plan has
    direct's bits (two_shot too), events for the rest (a 3-rank ring, large
    calls, compressed ones), or for all without the setting; one device:
    events. The launches show which path ran."""
    monkeypatch.setenv(ONE_KERNEL_ALLREDUCE_ENV, one_kernel)
    launched = Launched(monkeypatch)
    on = one_kernel == "1"
    cases = [(256, "auto", None, "peer_ll" if on else "events"), (256, "two_shot", None, "peer_ll" if on else "events"),
             (256, "ring", None, "events"), (1 << 15, "auto", None, "events"), (256, "auto", "fp16", "events")]
    with collectives.Communicator.local(3, devices=["emulated:0", "emulated:1", "emulated:2"]) as comm:
        for count, algorithm, compression, path in cases:
            xs = [np.ones(count, np.float32) for _ in range(3)]
            chosen = comm.chosen_algorithm("allreduce", 4 * count, algorithm=algorithm, compression=compression)
            assert chosen.path == path, (count, algorithm, compression, repr(chosen))
            launched.take()
            comm.allreduce(xs, algorithm=algorithm, compression=compression)
            assert xs[0][0] == 3
            counts = launched.take()
            one_kernel_ran = counts == {"launch_ll_allreduce": 3, "launch_step": 0}
            assert one_kernel_ran == (path == "peer_ll"), (count, algorithm, compression, counts)
    with collectives.Communicator.local(3, devices="emulated") as comm:
        assert comm.chosen_algorithm("allreduce", 1024).path == "events"


# -- the call records -----------------------------------------------------------------------

class Group:
    """What CallRecords asks of a ProcessGroup: the records' memory (one
    array shared by the ranks of the test, as the control segment is) and
    the abort."""

    def __init__(self, region):
        self.region, self.aborted = region, []

    def call_records(self):
        return self.region

    def abort(self, reason, cause):
        self.aborted.append((reason, cause))


def ranks_records(n):
    region = np.zeros((n, CALL_RECORDS * CALL_RECORD_BYTES), np.uint8)
    groups = [Group(region) for _ in range(n)]
    return [CallRecords(r, n, groups[r]) for r in range(n)], groups


def test_the_rank_second_to_a_different_call_names_both_and_aborts():
    (a, b, c), groups = ranks_records(3)
    for records in (a, b, c):
        records.record_plan(plan_of(64))   # the same call: nothing to say
    a.record_plan(plan_of(64))
    c.record_plan(plan_of(64))
    with pytest.raises(InvalidUsageError, match="different call") as raised:
        b.record_plan(plan_of(64, "ring"))
    message = str(raised.value)
    assert "rank 0" in message and "call #2" in message and "algorithm direct" in message and "algorithm ring" in message
    assert groups[1].aborted and groups[1].aborted[0][1] is raised.value   # the peers' waits and kernels stop
    assert not groups[0].aborted and not groups[2].aborted


def test_two_ranks_that_record_at_once_are_told_by_the_next_check():
    (a, b), groups = ranks_records(2)
    words = groups[0].region.view(np.uint64).reshape(2, CALL_RECORDS, CALL_RECORD_BYTES // 8)
    a.record(7, b"a call")
    landed, words[0, 1, 0] = words[0, 1, 0], 0   # b reads rank 0's record of call 1 before it lands
    b.record(8, b"another call")
    words[0, 1, 0] = landed
    with pytest.raises(InvalidUsageError, match="rank 1 made a different call from rank 0's call #1"):
        a.check_last()   # the watchdog's check
    assert groups[0].aborted


def test_a_peer_a_whole_ring_ahead_is_no_mismatch():
    (a, b), _ = ranks_records(2)
    for _ in range(CALL_RECORDS + 1):
        b.record(5, b"b's calls")   # b's call 1 is overwritten by its call CALL_RECORDS + 1
    a.record(6, b"a's call")        # a's call 1 finds no record of b's call 1: nothing to compare
    a.check_last()
    for _ in range(CALL_RECORDS):
        a.record(5, b"a's calls")   # the same calls as b's from here: nothing to say
