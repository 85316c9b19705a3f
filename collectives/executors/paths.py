"""Which way a call on GPU ranks runs: the execution paths and the selector.

A call is a plan (plan.py: collective, algorithm, ranks, count, dtype, op,
root, compression) on some buffers. GPU ranks run it on one of six paths,
each a small class that says what it serves and how it runs it:

    path        ranks                         serves                                 buffers    per call
    ll          in processes                  direct's bits, uncompressed, a rank    any        1 launch
                                              publishes at most 64 KiB
    symmetric   in processes                  direct's bits, uncompressed            symmetric  3 launches
    staged      in processes                  direct's bits, uncompressed            any        5 launches
    step        in processes (the fallback)   everything                             any        a launch, an event
                                                                                                poll, peer waits
                                                                                                per phase
    peer_ll     on several GPUs of one        as ll                                  any        1 launch per GPU
                process, one each
    events      in one process (the fallback) everything                             any        a launch per phase
                                                                                                and device, events

"direct's bits": the plan folds each element in rank order with one
accumulator, as the `direct` plan does (same_bits_as_direct): the one-pass
paths run that fold whatever the plan's algorithm, so they take only the
plans that give its bits. "symmetric" buffers: the arrays the peers touch
lie in symmetric memory (Communicator.alloc), at the same place on every
rank; "any": plain arrays or symmetric ones.

The selector takes the first path of its list that serves the call, and
the fallback (which serves everything) when none does: ll, symmetric,
staged, then step, for ranks in processes; peer_ll, then events, for ranks
in one process. The one-pass paths are in the list only with
$COLLECTIVES_ONE_KERNEL_ALLREDUCE=1 (config.py), peer_ll only for ranks
each on a GPU of their own. As MSCCL++ does with its algorithm objects and
its selector; there the fallback is NCCL.

A choice is made once per plan, and remembered (`Route`): a repeated call
costs one dictionary lookup. Where a path's buffers decide (symmetric), the
choice is remembered per plan and the buffers' addresses, and forgotten
when symmetric memory is allocated (a plain array's memory may lie in it
then; every rank allocates at the same point, so every rank forgets alike).

The choice is the same on every rank for the same call: it depends on the
plan, which every rank builds alike, and on where the arrays lie, which is
the same on every rank for symmetric memory. Ranks whose calls differ may
take different paths and so never meet in one path's own check of the
call's signature: the call records (device_protocol.py) name that
mismatch.

Communicator.chosen_algorithm reports the path too (`select`, by the kind
of buffers rather than the buffers).
"""

from typing import NamedTuple

from ..algorithms.schedule import ALLGATHER, ALLREDUCE, BROADCAST, REDUCE_SCATTER, REDUCE_TO_ROOT

# The kinds of a call's buffers.
PLAIN, SYMMETRIC = "plain", "symmetric"
ANY = frozenset({PLAIN, SYMMETRIC})

# The collectives the one-pass paths run (each as the `direct` plan does).
ONE_PASS_COLLECTIVES = frozenset({ALLREDUCE, ALLGATHER, BROADCAST, REDUCE_SCATTER, REDUCE_TO_ROOT})


def same_bits_as_direct(plan):
    """Whether every algorithm's plan of this call gives the `direct` plan's
    bits, which are the one-pass paths' (each element folded in rank order
    in one accumulator): the direct plan itself; `two_shot` (each chunk
    folded once, by its owner, in rank order, then copied: what `auto` picks
    for large allreduces of 3 ranks and more); allgather and broadcast,
    which only copy; and a reduction of 2 ranks, whose one fold of two
    operands is commutative (sum and prod exactly; max and min by the one
    tie rule; avg divides once either way). `auto` gives 2 ranks' allgather
    and reduce_scatter the ring (a tie in the model), which would otherwise
    miss these paths. One exception, in NaN payloads only: where both
    operands are NaN, the emulated device's sum keeps the first operand's
    payload, so a plan folding rank 1 first (ring) and the kernel may give
    NaNs of different payloads; a GPU gives its one canonical NaN either
    way, and results are compared as NaN (design: NaN compared as NaN)."""
    return plan.algorithm in ("direct", "two_shot") or plan.collective in (ALLGATHER, BROADCAST) or plan.nranks == 2


def one_pass(plan):
    """Whether a one-pass path may run `plan`'s calls: one of its
    collectives, with direct's bits, uncompressed."""
    return plan.collective in ONE_PASS_COLLECTIVES and same_bits_as_direct(plan) and plan.compression is None


class CallShape(NamedTuple):
    """What the paths' `serves` reads of a plan, for asking which path a
    call would take without planning it (Communicator.chosen_algorithm)."""
    collective: str
    algorithm: str
    nranks: int
    count: int          # elements of each rank's WORK buffer, as plan.count
    dtype: object       # a NumPy dtype
    root: int
    compression: object
    binding: object = None   # how the call would bind its arrays (binding.py), as a Plan's


class Path:
    """One way a call runs. A path says:

    name                 what Communicator.chosen_algorithm and the benchmarks report
    buffers              the kinds of buffers it takes (ANY, or {SYMMETRIC})
    serves(plan)         whether it runs `plan`'s calls: the collective, the
                         sizes, the algorithm (its bits), the compression
    arrays(plan, input, output)
                         for a path of symmetric buffers only: where the
                         call's arrays (ArrayInfos) lie, or None where they
                         are not its buffers
    prepare(plan[, arrays])
                         what every call of the plan (on those arrays) passes
                         to run, made once: the route's `call` (None: nothing)
    run(route, inputs, outputs, deadline)
                         issue the call (ArrayInfos of the ranks of this process)
    launches(plan)       the kernel launches a call makes (bench.model plans, tests)

    and, for ranks in one process, bind(route, inputs, outputs): the call
    bound to these arrays, for Communicator._repeat (None: run each time)."""

    name = ""
    buffers = ANY

    def serves(self, plan):
        raise NotImplementedError

    def prepare(self, plan, arrays=None):
        return None

    def run(self, route, inputs, outputs, deadline):
        raise NotImplementedError

    def launches(self, plan):
        raise NotImplementedError

    def __repr__(self):
        return f"<path {self.name}>"


class Route(NamedTuple):
    """A plan's chosen path, and what the path prepared for its calls."""
    plan: object
    path: Path
    call: object


class _Candidates(NamedTuple):
    """The paths that serve a plan, in the selector's order, where the
    buffers decide among them."""
    plan: object
    paths: tuple


_KEPT = 1024   # remembered choices; all forgotten at once past it (each entry keeps its plan alive)


class Selector:
    """The first of `paths` that serves a call, else `fallback` (see the
    module doc)."""

    def __init__(self, paths, fallback):
        self.paths = tuple(paths)
        self.fallback = fallback
        # id(plan) -> Route, or _Candidates where the buffers decide. A hot
        # path may read it first (DeviceRanks.run): a known plan costs one lookup.
        self.by_plan = {}
        self._by_buffers = {}   # (id(plan), input address, output address) -> Route

    def select(self, plan, kind=PLAIN):
        """The path a call of `plan` on buffers of `kind` takes (reports:
        Communicator.chosen_algorithm, launches)."""
        for path in self.paths:
            if kind in path.buffers and path.serves(plan):
                return path
        return self.fallback

    def route(self, plan, input_info, output_info):
        """The Route of a call of `plan` on these arrays (the ArrayInfos of
        this process's first rank: where a path's buffers decide, ranks in
        processes, there is one)."""
        entry = self.by_plan.get(id(plan))
        if entry is None or entry.plan is not plan:
            entry = self._plan_entry(plan)
        if entry.__class__ is Route:   # the plan alone decides
            return entry
        key = (id(plan), input_info.address, output_info.address)
        route = self._by_buffers.get(key)
        if route is None or route.plan is not plan:
            route = self._buffers_route(entry, input_info, output_info)
            if len(self._by_buffers) >= _KEPT:
                self._by_buffers.clear()
            self._by_buffers[key] = route
        return route

    def forget_buffers(self):
        """Forget the choices the buffers made: where memory lies changed
        (a symmetric allocation)."""
        self._by_buffers.clear()

    def forget(self):
        """Forget every choice (close)."""
        self.by_plan.clear()
        self._by_buffers.clear()

    def _plan_entry(self, plan):
        candidates = []
        for path in (*self.paths, self.fallback):
            if path is self.fallback or path.serves(plan):
                candidates.append(path)
                if path.buffers == ANY:   # it takes the call on any buffers: no later path is asked
                    break
        first = candidates[0]
        entry = Route(plan, first, first.prepare(plan)) if first.buffers == ANY else _Candidates(plan, tuple(candidates))
        if len(self.by_plan) >= _KEPT:
            self.by_plan.clear()
        self.by_plan[id(plan)] = entry
        return entry

    @staticmethod
    def _buffers_route(candidates, input_info, output_info):
        plan = candidates.plan
        for path in candidates.paths:
            if path.buffers == ANY:
                return Route(plan, path, path.prepare(plan))
            arrays = path.arrays(plan, input_info, output_info)
            if arrays is not None:
                return Route(plan, path, path.prepare(plan, arrays))
        raise AssertionError("the fallback takes any buffers")
