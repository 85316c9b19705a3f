"""What `algorithm="auto"` runs: the algorithm a cost model predicts fastest.

Two models, by where the ranks are:

* most ranks: the schedule-level model of their transport
  (algorithms.choose: a step's fixed time and the bytes the busiest rank
  moves, calibrated per transport, collectives/algorithms/__init__.py);
* ranks that all share one device (DeviceRanks with `one_device`): that
  model cannot see what the binding to the caller's arrays and fan-out
  groups change there (executors/device.py), so each algorithm's bound plan
  is priced instead (`one_device_choice`): out of place, direct is one
  launch at the memory floor; in place it needs a copy phase, and star or
  two_shot move less. A compressed call there runs direct, whose one pass
  (codec_round_sum) moves the floor's bytes in one launch, which no plan
  beats.

Communicator._auto and Communicator.chosen_algorithm ask `choose`.
"""

import functools

import numpy as np

from .algorithms import MODELS, REGISTRY
from .algorithms import choose as choose_by_schedule
from .binding import IN_PLACE, IN_PLACE_LOCKSTEP, OUT_OF_PLACE
from .plan import build_plan


def choose(collective, nranks, nbytes, root, ranks, binding=None, compression=None):
    """The algorithm `auto` runs for a call of `nbytes` per rank's WORK
    buffer on `ranks` (their `transport` names the schedule-level model;
    `one_device`, where every rank shares one device, asks for bound plans'
    prices, by `binding` or for a `compression`)."""
    if getattr(ranks, "one_device", False) and (binding or compression):
        picked = one_device_pick(collective, nranks, nbytes, root, binding, compression, ranks.transport)
        if picked is not None:
            return picked
    return choose_by_schedule(collective, nranks, nbytes, root, ranks.transport)


def one_device_pick(collective, nranks, nbytes, root, binding, compression, transport):
    """What `auto` runs where every rank shares one device, or None (the
    schedule-level model decides): compressed, direct (see the module doc);
    else the bound plan priced lowest, for the bindings that bind to the
    caller's arrays."""
    if compression is not None:
        return "direct" if "direct" in REGISTRY and collective in REGISTRY["direct"].collectives else None
    if binding not in (IN_PLACE, IN_PLACE_LOCKSTEP, OUT_OF_PLACE):
        return None
    return one_device_choice(collective, nranks, nbytes, root, binding, transport)


@functools.lru_cache(maxsize=256)
def bound_plan_costs(collective, nranks, root, binding):
    """Per registered algorithm, with every rank on one device: (launches,
    bytes of traffic per byte of a rank's WORK buffer) of its bound plan,
    fan-out groups reading their sources once. Traffic scales with the
    message, so one plan of whole chunks prices every size."""
    # (imported here: ranks that never share a device, host ranks in a
    # process of their own among them, need not load the device executor)
    from .executors.device import fan_out, groups_traffic
    itemsize, count = 4, nranks * nranks * 64
    costs = {}
    for name, spec in REGISTRY.items():
        if collective not in spec.collectives:
            continue
        plan = build_plan(collective, name, nranks, count, np.dtype(np.float32), "sum", root, binding)
        launches = traffic = 0
        for phase in plan.phases:
            if len(phase.table):
                rows, fanout = fan_out(phase.table)
                launches += 1
                traffic += groups_traffic(rows, fanout, itemsize)
        costs[name] = (launches, traffic / (count * itemsize))
    return costs


def one_device_choice(collective, nranks, nbytes, root, binding, transport):
    """The algorithm `auto` runs for ranks that all share one device: the one
    whose bound plan the model of `transport` prices lowest, its launches at
    the model's step cost plus its traffic at the model's bandwidth; ties go
    to fewer launches, then to the first registered."""
    model = MODELS[transport]
    costs = bound_plan_costs(collective, nranks, root, binding)

    def price(name):
        launches, traffic_per_byte = costs[name]
        return launches * model.step_seconds + traffic_per_byte * nbytes / model.bytes_per_second, launches

    return min(costs, key=price)


class Choice(str):
    """What a call runs (Communicator.chosen_algorithm): the algorithm's
    name, which it is (it compares, hashes, prints and serializes as that
    str, so code that took the name goes on working), the execution path
    that runs it in `path` (executors/paths.py: "ll", "symmetric",
    "staged", "step", "peer_ll", "events"; for other ranks "interpreter",
    "step", "compiled_loop", "compiled_plan", "single_copy", "nccl"), and
    for the compiled loop its step in `step` ("merged", "single_copy" or
    "staged": transport/fastpath.py; None on the other paths)."""

    def __new__(cls, algorithm, path, step=None):
        choice = super().__new__(cls, algorithm)
        choice.path = path
        choice.step = step
        return choice

    @property
    def algorithm(self):
        """The algorithm's name, as a plain str."""
        return str.__str__(self)

    def __repr__(self):
        step = "" if self.step is None else f", step={self.step!r}"
        return f"Choice({self.algorithm!r}, path={self.path!r}{step})"

    def __reduce__(self):
        return Choice, (self.algorithm, self.path, self.step)
