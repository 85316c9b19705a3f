"""The execution paths of GPU calls and the selector that picks one
(executors/paths.py): the selector's rule and its memory; the path
chosen_algorithm names is the one a call takes, in one process and across
processes (tests/paths_worker.py, under mpiexec on emulated devices).
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
from collectives.executors.paths import ANY, PLAIN, SYMMETRIC, Path as ExecutionPath, Route, Selector
from collectives.plan import build_plan

WORKER = Path(__file__).with_name("paths_worker.py")


@pytest.fixture(scope="module")
def emulation_library_built():
    """Built once here, not by every rank within its start-up timeout."""
    from collectives.devices import emulated
    emulated.library()


@pytest.mark.mpi
def test_ranks_in_processes_run_the_path_chosen_algorithm_names(emulation_library_built):
    pytest.importorskip("mpi4py", reason="the multi-process tests need mpi4py: pip install '.[test]'")
    from test_mpi import run_worker
    oks, report = run_worker(WORKER, 3, "chosen_path", "emulated", limit=120,
                             environment={"COLLECTIVES_ONE_KERNEL_ALLREDUCE": "1"})
    assert len(oks) == 3, report


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
    assert (again, again.path) == ("direct", "ll")


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
