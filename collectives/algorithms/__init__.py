"""The algorithm registry: names -> schedule generators, and the `auto` choice.

An algorithm is a function (collective, nranks, root) -> Schedule. Registering
one is all it takes to make it usable everywhere: plans, every executor, the
benchmarks and the tests that prove schedules correct.
"""

import functools
from typing import Callable, NamedTuple

from ..errors import InvalidUsageError
from .butterfly import BUTTERFLY_COLLECTIVES, butterfly, butterfly_costs
from .direct import direct, direct_costs
from .halving_doubling import HALVING_DOUBLING_COLLECTIVES, halving_doubling, halving_doubling_costs
from .ring import ring, ring_costs
from .round_robin import ROUND_ROBIN_COLLECTIVES, round_robin, round_robin_costs
from .star import STAR_COLLECTIVES, star, star_costs
from .tree import TREE_COLLECTIVES, tree, tree_costs
from .two_shot import TWO_SHOT_COLLECTIVES, two_shot, two_shot_costs
from .schedule import ALL_COLLECTIVES, COLLECTIVES, Costs, Schedule  # noqa: F401  (re-exported)


class Algorithm(NamedTuple):
    name: str
    generate: Callable      # (collective, nranks, root=None) -> Schedule
    collectives: tuple
    summary: str
    costs: Callable         # (collective, nranks, nbytes) -> Costs, closed forms the tests check


REGISTRY = {
    "ring": Algorithm("ring", ring, COLLECTIVES, "bandwidth-optimal, 2(n-1) steps for allreduce", ring_costs),
    "direct": Algorithm("direct", direct, ALL_COLLECTIVES, "one step, every rank reads its peers", direct_costs),
    "star": Algorithm("star", star, STAR_COLLECTIVES, "master-worker: the master reduces, all copy back", star_costs),
    "tree": Algorithm("tree", tree, TREE_COLLECTIVES, "binomial tree, 2 ceil(log2 n) steps for allreduce", tree_costs),
    "butterfly": Algorithm("butterfly", butterfly, BUTTERFLY_COLLECTIVES,
                           "recursive doubling: log2 n steps for allreduce (2 more if n is not a power of 2)",
                           butterfly_costs),
    "halving_doubling": Algorithm("halving_doubling", halving_doubling, HALVING_DOUBLING_COLLECTIVES,
                                  "recursive halving then doubling: 2 log2 n steps and ring's bytes for "
                                  "powers of 2",
                                  halving_doubling_costs),
    "round_robin": Algorithm("round_robin", round_robin, ROUND_ROBIN_COLLECTIVES,
                             "pairwise exchange, round k with the rank k places away: 2(n-1) steps",
                             round_robin_costs),
    "two_shot": Algorithm("two_shot", two_shot, TWO_SHOT_COLLECTIVES,
                          "reduce your chunk from all, then gather: 2 steps", two_shot_costs),
}


@functools.lru_cache(maxsize=None)
def schedule_for(algorithm, collective, nranks, root=None):
    """The (cached) schedule of a registered algorithm."""
    try:
        spec = REGISTRY[algorithm]
    except KeyError:
        valid = ", ".join(repr(name) for name in ["auto", *REGISTRY])
        raise InvalidUsageError(f"unknown algorithm {algorithm!r}; expected one of {valid}") from None
    if collective not in spec.collectives:
        raise InvalidUsageError(f"algorithm {algorithm!r} does not implement {collective}")
    return spec.generate(collective, nranks, root=root)


# The latency-bandwidth model `auto` uses: a step costs a synchronisation
# (step_seconds) plus the memory traffic (bytes_moved) at bytes_per_second. On shared memory, traffic, not hops, is the price of
# bytes. One model per transport, since a step costs a Python loop between
# virtual ranks, a counter handshake between processes and a kernel launch
# on a GPU. `python -m bench.model --calibrate RESULTS.json` fits the two
# constants to a benchmark run of every algorithm; `measured_by` names it.


class CostModel(NamedTuple):
    step_seconds: float
    bytes_per_second: float
    fused_reduce: bool     # kernels fold k sources in one pass; NumPy folds pairwise
    one_engine: bool       # every rank's work runs on one engine (a thread, one GPU): all traffic adds up
    contended: bool        # ranks outnumber cores: a step's traffic counts once per peer it waits for
    per_transfer: bool     # the fixed cost is paid per transfer, not per step (virtual ranks run rows one by one)
    measured_by: str
    # One engine folds the transfers of a step that read the same sources
    # once, writing each destination (the GPU executor's fan-out groups).
    shared_reads: bool = False


NOT_CALIBRATED = "not calibrated: no GPU has run these ranks yet; the constants of ranks on one GPU"
_ALGORITHMS = "ring,direct,star,tree,butterfly,halving_doubling,round_robin,two_shot"
_SWEEP = "python -m bench.all_reduce_perf -b 1K -e 16M -f 4 --algorithm "
MODELS = {
    # Fitted by python -m bench.model --calibrate on the runs named (bench/results/auto_calibration_*.json,
    # the 2-core development machine; bench/results/cuda_allreduce_4ranks_1gpu_*.json, an H100).
    "host-in-process": CostModel(1.55e-06, 4.37e10, False, True, False, True,
                                 _SWEEP + _ALGORITHMS + " -n 20 -w 3 --ranks 4"),
    "host-processes": CostModel(4.71e-06, 2.09e10, False, False, False, False,
                                "mpiexec -bind-to core -n 2 " + _SWEEP + "auto," + _ALGORITHMS + " -n 40 -w 5"),
    "host-processes-oversubscribed": CostModel(
        3.65e-05, 2.04e10, False, False, True, False, "mpiexec -bind-to core -n 4 " + _SWEEP + "auto," + _ALGORITHMS + " -n 40 -w 5"),
    # Refit with the fan-out features (shared_reads): 3.38 TB/s, the H100's HBM3 (the fit before them gave 4.7).
    "gpu-in-process": CostModel(7.11e-06, 3.38e12, True, True, False, False,
                                "python -m bench.all_reduce_perf --device cuda --ranks 4 --algorithm ring|direct "
                                "-b 8 -e 256M -f 4 -n 20 -w 5 (ranks on one H100)", shared_reads=True),
    # Modelled, not measured: one GPU's constants.
    "gpu-peers": CostModel(7.11e-06, 3.38e12, True, False, False, False, NOT_CALIBRATED),     # one process, several GPUs
    "gpu-processes": CostModel(7.11e-06, 3.38e12, True, False, False, False, NOT_CALIBRATED),
}
DEFAULT_TRANSPORT = "host-processes"


def modelled_seconds(schedule, nbytes, model):
    """The model's time for `schedule` on a buffer of `nbytes`."""
    return synchronisations(schedule, model) * model.step_seconds + bytes_moved(schedule, nbytes, model) / model.bytes_per_second


def synchronisations(schedule, model):
    """How many times the fixed cost is paid: once a step, or once a transfer."""
    return sum(map(len, schedule.steps)) if model.per_transfer else schedule.nsteps


def bytes_moved(schedule, nbytes, model):
    """The traffic that sets the time, in bytes (weighted, see below).

    Steps are synchronous, so each costs its busiest rank's traffic: the sum
    over steps of the largest rank's. When one engine does every rank's work
    (virtual ranks, ranks on one GPU), all ranks' traffic adds up instead.
    When ranks outnumber the cores, a step's traffic counts once per peer it
    waits for: those peers must all be scheduled, and ranks spinning in the
    wait take the cores they need (see the README for what that bought).
    """
    per_rank_steps = schedule.chunks_moved_by_rank_and_step(model.fused_reduce)
    if model.contended:
        peers = schedule.peers_read_by_rank_and_step()
        per_rank_steps = [[max(1, len(peers[r][s])) * chunks for s, chunks in enumerate(steps)]
                          for r, steps in enumerate(per_rank_steps)]
    if model.one_engine and model.shared_reads:
        chunks = schedule.chunks_moved_sharing_reads()
    elif model.one_engine:
        chunks = sum(map(sum, per_rank_steps))
    else:
        chunks = sum(max(step) for step in zip(*per_rank_steps)) if per_rank_steps and schedule.nsteps else 0
    return chunks * nbytes / schedule.nchunks


def busiest_rank_bytes(schedule, nbytes, model):
    """The most traffic one rank has: what breaks a tie between equal models
    (the algorithm that spreads the work wins)."""
    return max(map(sum, schedule.chunks_moved_by_rank_and_step(model.fused_reduce))) * nbytes / schedule.nchunks


@functools.lru_cache(maxsize=1024)
def choose(collective, nranks, nbytes, root=None, transport=DEFAULT_TRANSPORT):
    """The registered algorithm the model of `transport` predicts fastest
    (ties: the one whose busiest rank moves least, then the first
    registered). Cached: a repeated call shape asks the model once."""
    model = MODELS[transport]
    candidates = [name for name, spec in REGISTRY.items() if collective in spec.collectives]

    def cost(name):
        schedule = schedule_for(name, collective, nranks, root)
        return modelled_seconds(schedule, nbytes, model), busiest_rank_bytes(schedule, nbytes, model)

    return min(candidates, key=cost)
