"""The execution paths of GPU calls and the selector that picks one
(executors/paths.py): the selector's rule and its memory.
"""

import numpy as np

from collectives.executors.paths import ANY, PLAIN, SYMMETRIC, Path as ExecutionPath, Route, Selector
from collectives.plan import build_plan


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
