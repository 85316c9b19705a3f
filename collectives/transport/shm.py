"""Host ranks in separate processes on one machine, through shared memory.

Each rank owns one workspace (its WORK and SCRATCH buffers), shared memory
that the others map and read; plans only ever write the executing rank's
own memory. The step protocol (waits, abort, growth of workspaces) is
transport/protocol.py, shared with GPU ranks; this module only says how a
host rank runs a plan: in the compiled executor (executors/host_process.py)
where it takes the plan, else phase by phase with NumPy, over views of the
mapped workspaces.
"""

import os
import time
from typing import NamedTuple

import numpy as np

from ..compression import wire
from ..errors import CollectiveError
from ..config import (DEFAULT_EXCHANGE_SINGLE_COPY_MIN, EXCHANGE_SINGLE_COPY_MIN_ENV, MEASURED_EXCHANGE_SINGLE_COPY_MIN,
                      broadcast_pull_max, resolve_compiled_plans, resolve_exchange_single_copy_min,
                      resolve_fast_single_copy, resolve_loop_tunables, resolve_plan_segment_bytes)
from ..executors import host, host_process
from ..plan import (ALL_TO_ALL, ALLGATHER, ALLREDUCE, BLOCKED_COLLECTIVES, FOLDS_INTO_X_IN_PLACE, INPUT,
                    OUTPUT, PUSHED_FOLDS, PUSHED_IN_PLACE, PUSHED_ONLY_IN_PLACE, REDUCE_SCATTER, SEGMENTED_COLLECTIVES,
                    SINGLE_COPY_ALGORITHMS, SINGLE_COPY_COLLECTIVES, SINGLE_COPY_FOLDS, SINGLE_COPY_FOLDS_IN_PLACE,
                    SPREAD_COLLECTIVES, WORK, pushed_plan, single_copy_plan, spread_plan)
from ..binding import IN_PLACE, WORKSPACE_BINDINGS, WORKSPACE_IN_PLACE
from . import fastpath, probe
from .layout import ABORT
from .p2p import CompiledWaits, Mailboxes, PointToPoint
from .protocol import ProcessGroup, describe_call
from .recovery import Recoverable
from .segments import HostMemory


# The exchanges' probe: an all_to_all out of place of this many bytes a
# rank, where the machines measured differ (config.py).
EXCHANGE_PROBE_BYTES = 256 << 10
EXCHANGE_PROBE_CALLS = 8    # a batch's (each call 10 to 20 us)
EXCHANGE_PROBE_ROUNDS = 5   # (cheap at that size, and one noisy round is outvoted)


REACH_PROBE_BYTES = 64   # a rank's part of the start's probing allreduce (_learn_reach)


class Limits(NamedTuple):
    """The size limits a rank chose as its communicator started (ShmRank.measure)."""
    staged_max: int | None                 # the loop's (None: no loop)
    exchange_single_copy_min: int | None   # None: the exchanges never take the single copy
    in_place_all_to_all_min: int | None
    pushes_reached: int = 0                # the compiled executor's verdict (ShmRank._learn_reach)


class ShmRank(Recoverable):
    """This process's rank of a communicator whose ranks share one machine
    (agree and shrink: recovery.Recoverable)."""

    addressable = False  # peers see only each other's workspaces: plans copy in and out
    host_only = True     # it indexes NumPy arrays
    locations = None
    compresses = True    # runs compressed plans

    def __init__(self, rank, size, prefix, ranks_on_machine=None, inherited=None):
        """`ranks_on_machine`: the processes of the job on this machine, where
        they are more than this communicator's (pretend nodes share one);
        `inherited`: the Limits of the communicator a shrunk one comes
        from, which it keeps (else `measure`, called once every rank is
        attached, chooses them)."""
        self.group = ProcessGroup(rank, size, prefix, HostMemory)
        self.rank, self.size, self.prefix = rank, size, prefix
        self._ranks_on_machine = ranks_on_machine
        self._inherited = inherited
        self._timeout = None   # the communicator's, which it sets at once (use_timeout)
        # Which cost model `auto` asks: ranks that outnumber the cores wait
        # for the scheduler at every step, a cost of its own.
        oversubscribed = max(size, ranks_on_machine or 0) > (os.cpu_count() or 1)
        self.transport = "host-processes-oversubscribed" if oversubscribed else "host-processes"
        self._broadcast_pull_max = broadcast_pull_max(oversubscribed)   # (a single-copy broadcast spreads from it)
        # Calls with `auto` in the compiled loop (fastpath.py); None without
        # it. The communicator calls its shortcuts first: allreduce's, and
        # the other four collectives'.
        self.fast = fastpath.make(self.group, oversubscribed)
        # polls before a wait yields its core (the compiled executor's and send/recv's)
        self._spin = fastpath.SPIN_OVERSUBSCRIBED if oversubscribed else fastpath.SPIN_DEDICATED
        # the loop's merged-step limit (the communicator names the step by it)
        self.fast_small_max = self.group.fast_sizes.small_max if self.fast is None else self.fast.merged_max
        self.fast_allreduce = None if self.fast is None else self.fast.allreduce
        self.fast_collective = None if self.fast is None else self.fast.collective
        # Every other plan it takes in the compiled executor; None: the interpreter runs them all.
        executor = host_process.CompiledPlans(self.group, self._spin, fastpath.YIELD_SECONDS, resolve_loop_tunables()) \
            if host_process.available() else None
        self.compiled = executor if resolve_compiled_plans() else None
        # A repeated call of a plan it bound, recognised and run in C
        # (host_process.py: the runner's Repeats), which the communicator
        # tries first; None: the Python path recognises every repeat.
        self.repeat = None if self.compiled is None else self.compiled.repeat
        self.forget_repeats = None if self.compiled is None else self.compiled.forget_repeats
        # The exchanges from this many bytes read peers' inputs in place, in
        # the compiled executor whatever runs the other plans (the
        # interpreter has no such reads); None: never. Once a call found a
        # read refused, on every rank alike, they stage (`_refused`). The
        # limit is $COLLECTIVES_EXCHANGE_SINGLE_COPY_MIN's, else measured
        # (`measure`), and then an in-place all_to_all keeps the default
        # (config.py says why): `_in_place_all_to_all_min`.
        self._pinned_single_copy_min = resolve_exchange_single_copy_min()
        # A staged plan whose workspace would hold more than two segments of
        # this many bytes runs them one after the other (plan_segment).
        self.plan_segment_bytes = resolve_plan_segment_bytes()
        self.single_copy_min = (DEFAULT_EXCHANGE_SINGLE_COPY_MIN if self._pinned_single_copy_min is None
                                else self._pinned_single_copy_min) \
            if executor is not None and size > 1 and resolve_fast_single_copy() else None
        self._in_place_all_to_all_min = self.single_copy_min
        if self.fast is not None and self.single_copy_min is None:   # no plan single copies: the loop stages all
            self.fast.refuse_single_copy()
        self.exchange_probe_seconds = None   # {"single_copy": s, "staged": s}, once measured
        self._single = executor
        self._refused = False
        if executor is not None:
            executor.on_refused = fastpath.weakly(self._refusal)
        self._interpreted = None   # the last plan the interpreter ran (what_ran)

    def point_to_point(self, timeout_of):
        """This rank's sends and receives (p2p.py), through the control
        segment's mailboxes; `timeout_of()` gives the communicator's timeout.
        The communicator closes it before this rank (its views go first)."""
        group = self.group
        header, rows, _ = group.channel_addresses()
        compiled = CompiledWaits(header + 8 * ABORT, group.pid_of, self._spin, fastpath.YIELD_SECONDS, rows)
        return PointToPoint(self.rank, self.size, Mailboxes(group.control_buffer, self.size, group.fast_sizes),
                            timeout_of, group.check_peers, group.abort, compiled)

    def measure(self, timeout, communicator=None):
        """Choose, on every rank alike, the limits that are the machine's,
        once every rank has attached (every rank calls it together): the
        loop's staged_max (fastpath.FastCollectives.choose_staged_max), and
        with the `communicator` whose rank this is (one machine's), the
        exchanges' single-copy limit. A shrunk communicator's rank keeps
        the Limits it inherited, with no call."""
        inherited = self._inherited
        if inherited is None:
            self._learn_reach(timeout)
        elif self._single is not None:
            self._single.pushes_reached = inherited.pushes_reached   # (the survivors reach each other as before)
        if self.fast is not None:
            if communicator is not None:
                def fold(x, op, out):
                    communicator.allreduce(x, op, out=out)
            else:
                fold = self._node_reduce_scatter(timeout)
            self.fast.choose_staged_max(timeout, None if inherited is None else inherited.staged_max,
                                        "allreduce" if communicator is not None else "reduce_scatter", fold)
        if inherited is not None:
            if self.single_copy_min is not None:   # (a shrunk communicator of one rank has no exchange to copy)
                self.single_copy_min = inherited.exchange_single_copy_min
                self._in_place_all_to_all_min = inherited.in_place_all_to_all_min
                self._forget_shapes()
        elif communicator is not None:
            self._choose_exchange_single_copy_min(communicator)

    def _learn_reach(self, timeout):
        """Learn, on every rank together as the communicator starts, whether
        every rank may read and write every peer's arrays (the single
        copy's reads and pushes): one allreduce of REACH_PROBE_BYTES a
        rank in the read form whose probe writes into every peer (the form
        of a fold that can push, before the ranks know: _host_plan.c's
        SINGLE_COPY_PROBES). Its verdict is the runner's pushes_reached (1,
        or -1 where a push was refused: the folds then read); a read
        refused is the ranks' refusal (_refusal: every large call stages).
        So no call's route waits on an earlier call to find out: a fold
        that writes x in its reads' phase runs in place only where no read
        or push can be refused (plan.FOLDS_INTO_X_IN_PLACE, PUSHED_IN_PLACE)."""
        if self._single is None or self.single_copy_min is None:
            return
        count = REACH_PROBE_BYTES // 4 * self.size
        x, out = np.zeros(count, np.float32), np.empty(count, np.float32)
        probing = single_copy_plan(ALLREDUCE, self.size, count, x.dtype, "sum", algorithm="two_shot")
        self._run_single_plan(probing, x.ctypes.data, out.ctypes.data, time.perf_counter() + timeout)

    def _node_reduce_scatter(self, timeout):
        """`reduce_scatter(x, op, out)` out of place as a node's `auto`
        runs it across nodes, for the staged_max probe of a rank with no
        Communicator of its own: the loop's staging, or the read plan's
        single copy where the loop leaves it to the plans (that plan
        built at the first such call, one size of x)."""
        plans = {}

        def reduce_scatter(x, op, out):
            if self.fast.collective("reduce_scatter", x, op, out, 0, timeout):
                return
            if x.size not in plans:
                plans[x.size] = single_copy_plan(REDUCE_SCATTER, self.size, x.size, x.dtype, op)
            deadline = time.perf_counter() + timeout
            # (a refused read: the loop stages from now on, and runs this call so)
            if not self._run_single_plan(plans[x.size], x.ctypes.data, out.ctypes.data, deadline) \
                    and not self.fast.collective("reduce_scatter", x, op, out, 0, timeout):
                raise AssertionError("the loop declined its own probe")
        return reduce_scatter

    def _choose_exchange_single_copy_min(self, communicator):
        """The exchanges' single-copy limit: pinned by the variable where
        every rank gives the same (InvalidUsageError where they differ),
        else the faster of the single copy from
        MEASURED_EXCHANGE_SINGLE_COPY_MIN and staging up to the default,
        timed on EXCHANGE_PROBE_BYTES all_to_alls out of place (probe.py);
        nothing to choose where some rank may not take the single copy."""
        def allreduce(x, op, out):
            communicator.allreduce(x, op, out=out)

        pinned = probe.agreed_pin(allreduce, EXCHANGE_SINGLE_COPY_MIN_ENV, self._pinned_single_copy_min,
                                  self.group.names[self.rank])
        everyone = np.empty(1, np.int64)
        allreduce(np.array([self.single_copy_min is not None], np.int64), "min", everyone)
        if pinned is not None or not everyone[0]:
            return
        x = np.ones(EXCHANGE_PROBE_BYTES // 4 // self.size * self.size, np.float32)   # (size blocks)

        def single_copy_from(limit):
            out = np.empty_like(x)   # (one pair of arrays a way: a repeated call keeps the path it was bound with)

            def call():
                self.single_copy_min = limit
                communicator.all_to_all(x, out=out, algorithm="direct")
            return call

        single_copy = single_copy_from(MEASURED_EXCHANGE_SINGLE_COPY_MIN)
        staged = single_copy_from(DEFAULT_EXCHANGE_SINGLE_COPY_MIN)
        single_copy()
        if self._refused:   # a read was refused, on every rank alike: every exchange stages
            self.single_copy_min = DEFAULT_EXCHANGE_SINGLE_COPY_MIN
            return
        staged()   # (both ways once untimed)
        seconds = probe.slowest_medians(allreduce, [single_copy, staged], EXCHANGE_PROBE_CALLS, EXCHANGE_PROBE_ROUNDS)
        self.exchange_probe_seconds = dict(zip((fastpath.SINGLE_COPY, fastpath.STAGED), seconds))
        self.single_copy_min = MEASURED_EXCHANGE_SINGLE_COPY_MIN if seconds[0] < seconds[1] \
            else DEFAULT_EXCHANGE_SINGLE_COPY_MIN
        self._in_place_all_to_all_min = DEFAULT_EXCHANGE_SINGLE_COPY_MIN
        self._forget_shapes()

    def limits(self):
        """The Limits this rank holds (what a shrunk communicator keeps)."""
        return Limits(None if self.fast is None else self.fast.staged_max, self.single_copy_min,
                      self._in_place_all_to_all_min, 0 if self._single is None else self._single.pushes_reached)

    def tuning(self):
        """Communicator.tuning: the limits, and the probes' microseconds."""
        def microseconds(probe_seconds):
            return None if probe_seconds is None else {way: s * 1e6 for way, s in probe_seconds.items()}

        tuning = {}
        if self.fast is not None and self.fast.staged_max is not None:
            tuning.update(staged_max=self.fast.staged_max, probe_us=microseconds(self.fast.probe_seconds))
        if self._single is not None and self.size > 1:
            tuning.update(exchange_single_copy_min=self.single_copy_min,
                          exchange_probe_us=microseconds(self.exchange_probe_seconds))
        return tuning

    def use_timeout(self, seconds):
        """The communicator's timeout (Communicator.timeout passes each new
        value on): what a bound call waits at most."""
        self._timeout = seconds

    @property
    def single_copy_min(self):
        """The exchanges' single-copy limit in bytes (see __init__), or None."""
        return self._single_copy_min

    @single_copy_min.setter
    def single_copy_min(self, limit):
        self._single_copy_min = limit
        self._forget_shapes()

    def _forget_shapes(self):
        """The path of an exchange's call may have changed (its single-copy
        limits, a refused read): the compiled executor forgets every call
        shape it was handed to run on new arrays (remember_shape), which it
        would otherwise run on the path it had."""
        compiled = getattr(self, "compiled", None)
        if compiled is not None:
            compiled.forget_shapes()

    def plan_segment(self, collective, count, dtype, binding):
        """The elements of WORK a segment of a staged plan of `count` of them
        takes (plan.segmented_plan: of every rank's block alike, for
        reduce_scatter and allgather), or 0: one run. The same on every rank
        of a call, whose ranks may bind differently but all to a workspace.
        Only for the dtypes the compiled executor folds: the interpreter,
        which folds 16-bit floats in float32, paid for the segments (a 16 MiB
        float16 allreduce over 2 processes: 52-53 ms whole, 69-70 in
        segments); a rank that interprets them anyway (without the executor)
        runs the same segments."""
        if collective not in SEGMENTED_COLLECTIVES or binding not in WORKSPACE_BINDINGS \
                or dtype not in fastpath.LOOP_DTYPES:
            return 0
        blocks = self.size if collective in BLOCKED_COLLECTIVES else 1
        segment = self.plan_segment_bytes // dtype.itemsize // blocks * blocks
        return segment if segment and count > 2 * segment else 0

    def single_copy_takes(self, collective, nbytes, binding=None):
        """Whether an exchange, or a fold out of place (plan.single_copy_plan),
        whose blocks are `nbytes` in all runs reading peers' inputs in place
        (so `auto` names its first SINGLE_COPY_ALGORITHMS for it); `binding`:
        the call's (binding.py), WORKSPACE_IN_PLACE in place."""
        in_place = binding == WORKSPACE_IN_PLACE
        if collective in SINGLE_COPY_FOLDS:
            in_place_refused = in_place and (
                collective not in SINGLE_COPY_FOLDS_IN_PLACE
                or (collective in FOLDS_INTO_X_IN_PLACE and not self._reads_known)
                or (collective in PUSHED_ONLY_IN_PLACE and self._single.pushes_reached != 1))
            limit = None if in_place_refused else self._declined_single_copy_min(collective)
        elif collective in fastpath.KIND_CODES:   # allgather, broadcast
            limit = self._declined_single_copy_min(collective)
        elif collective in SINGLE_COPY_COLLECTIVES:
            limit = self._in_place_all_to_all_min if collective == ALL_TO_ALL and in_place else self.single_copy_min
        else:
            limit = None
        return limit is not None and not self._refused and nbytes >= limit

    @property
    def _reads_known(self):
        """Whether the start found that every rank may read every peer
        (_learn_reach: any verdict but a refusal, which stages all)."""
        return self._single is not None and self._single.pushes_reached != 0 and not self._refused

    def _declined_single_copy_min(self, collective):
        """The least bytes a rank of a call of one of the loop's five
        collectives that reads peers' inputs in place: every one the loop
        declines (_shmloop.c's STEP_PLANS: past its merged step, its
        staged_max, which its probe chose by timing folds both ways (a
        copy's where copies_stage), and an oversubscribed allgather's
        staged_spread_max), so the same bound
        for a call naming the single copy's algorithm (the exchanges' probe
        times an all_to_all, which on a machine where reading another
        process costs four copies in memory chose 128 KiB, where folds were
        twice as fast staged up to 4 MiB). Without the loop, a fold from
        $COLLECTIVES_EXCHANGE_SINGLE_COPY_MIN where pinned, an allgather or
        broadcast from the exchanges' limit; None where the single copy
        never runs."""
        assert collective in fastpath.KIND_CODES, collective
        if self.single_copy_min is None:   # no compiled executor, or the single copy turned off
            return None
        staged_max = None if self.fast is None else self.fast.staged_max
        if staged_max is None:
            return self._pinned_single_copy_min if collective in SINGLE_COPY_FOLDS else self.single_copy_min
        stages_up_to = staged_max if collective in SINGLE_COPY_FOLDS or self.fast.copies_stage else 0
        if collective == ALLGATHER:
            stages_up_to = max(stages_up_to, self.fast.staged_spread_max)
        return max(stages_up_to, self.fast.merged_max) + 1

    def _single_copy_of(self, plan):
        """Whether `plan` (a Plan or a paths.CallShape) runs as a single-copy plan."""
        pushed_only = plan.collective in PUSHED_ONLY_IN_PLACE and plan.binding == WORKSPACE_IN_PLACE
        return plan.algorithm in SINGLE_COPY_ALGORITHMS.get(plan.collective, ()) \
            and not (pushed_only and plan.algorithm != "two_shot") \
            and getattr(plan, "compression", None) is None \
            and self.single_copy_takes(plan.collective, plan.count * plan.dtype.itemsize, plan.binding) \
            and self._single.takes(plan)

    def _single_plan(self, plan, in_place):
        """The single-copy plan of `plan`: pushed (plan.pushed_plan) where
        a fold's reduced chunks go to other ranks (two_shot): in place
        (PUSHED_IN_PLACE, PUSHED_ONLY_IN_PLACE) where the start found that
        every rank may push into every peer (the compiled executor's
        pushes_reached, the same on every rank), out of place unless it
        found a push refused (a refused read or write may still fall back
        to the staged plan); else read (plan.single_copy_plan). A broadcast
        from the loop's pull limit on (every size where ranks outnumber
        cores, as the loop's) spreads (plan.spread_plan)."""
        reached = self._single.pushes_reached
        pushes_in_place = plan.collective in PUSHED_IN_PLACE + PUSHED_ONLY_IN_PLACE
        if plan.collective in PUSHED_FOLDS and plan.algorithm == "two_shot" \
                and (reached == 1 and pushes_in_place if in_place else reached != -1):
            return pushed_plan(plan.collective, plan.nranks, plan.count, plan.dtype, plan.op, plan.root, in_place,
                               plan.algorithm)
        if plan.collective in SPREAD_COLLECTIVES and plan.count * plan.dtype.itemsize >= self._broadcast_pull_max:
            return spread_plan(plan.collective, plan.nranks, plan.count, plan.dtype, plan.root, in_place)
        return single_copy_plan(plan.collective, plan.nranks, plan.count, plan.dtype, plan.op, plan.root, in_place,
                                plan.block_counts, plan.algorithm)

    def _run_single_copy(self, plan, inputs, outputs, input_infos, output_infos, deadline):
        """Run `plan` (a `direct` exchange) as its single-copy plan: True,
        or False where a read was refused (on every rank alike: then run
        it staged). Arrays that are not contiguous, or that overlap without
        being the same memory, are read through a private copy."""
        x, out = inputs[0], outputs[0]
        xi, oi = input_infos[0], output_infos[0]
        in_place = self._read_in_place(plan, xi, oi)
        if in_place is not None:
            return self._run_single_plan(self._single_plan(plan, in_place), xi.address, oi.address, deadline)
        own_x = np.ascontiguousarray(x).reshape(-1).copy()
        own_out = np.empty(oi.size, oi.dtype)
        if not self._run_single_plan(self._single_plan(plan, False), own_x.ctypes.data, own_out.ctypes.data,
                                     deadline):
            return False
        out[...] = own_out.reshape(out.shape)
        return True

    @staticmethod
    def _read_in_place(plan, xi, oi):
        """Whether a single copy of `plan` on arrays of these infos runs in
        place (True) or apart (False), reading them where they lie; None
        where it reads private copies (arrays not contiguous, or that
        overlap without being the same memory)."""
        if plan.binding == WORKSPACE_IN_PLACE and xi.contiguous and oi.contiguous:
            return True
        overlap = xi.address < oi.address + oi.nbytes and oi.address < xi.address + xi.nbytes
        return False if xi.contiguous and oi.contiguous and not overlap else None

    def repeatable_single_plan(self, plan, xi, oi):
        """The single-copy plan a call of `plan` on arrays of these infos
        runs, where the runner may run it again from C, on these arrays or
        on new ones of their shape (its Repeats and Shapes): the arrays read
        where they lie, and not the read form of a plan that pushes once
        the ranks know pushes work (a refusal makes the runner forget them:
        _refusal). Else None."""
        in_place = self._read_in_place(plan, xi, oi)
        if self.compiled is None or in_place is None or not self._single_copy_of(plan):
            return None
        single = self._single_plan(plan, in_place)
        if single.collective in PUSHED_IN_PLACE and in_place and not single.pushes and self._single.pushes_reached == 0:
            return None
        return single

    def _run_single_plan(self, single, x_address, out_address, deadline):
        if self._single.run(single, x_address, out_address, deadline) is None:
            return True
        self._refusal(single)
        return False

    def _refusal(self, single):
        """A read or push of `single` (a single-copy plan) was refused, on
        every rank alike: every later call stages (the shapes and repeated
        calls the runner took from C forgotten), and this one is run again
        staged, but for an in-place form that writes x in phase 1 (a pushed
        allreduce's, a reduce_scatter's), which may have: it raises."""
        self._refused = True
        if self.fast is not None:   # (the loop stages too: the allreduces it leaves to the plans)
            self.fast.refuse_single_copy()
        self._forget_shapes()
        if self.forget_repeats is not None:
            self.forget_repeats(None)
        writes_x = single.pushes and single.collective in PUSHED_IN_PLACE + PUSHED_ONLY_IN_PLACE \
            or single.collective in FOLDS_INTO_X_IN_PLACE
        if single.binding == IN_PLACE and writes_x:   # (every rank alike: the verdict)
            raise CollectiveError(f"a read or push of a peer's array was refused in an in-place "
                                  f"{single.collective} after the start had found that they work; x is partly "
                                  "overwritten: this communicator now stages, but this call's result is lost")

    def bind(self, plan, inputs, outputs, input_infos, output_infos):
        """A repeated call of `plan` on these very arrays, bound
        (Communicator._repeat): `bound.run(arrays)` runs it in the compiled
        executor with nothing looked up again. None where the compiled
        executor does not take the call (or its outputs are new each call):
        `run` runs it then."""
        if output_infos is None or not (input_infos[0].contiguous and output_infos[0].contiguous):
            return None
        path = self.route(plan)
        if path == "single_copy":
            return _BoundExchange(self, plan, inputs, outputs, input_infos, output_infos)
        if path == "compiled_plan":
            return self.compiled.bind(plan, input_infos[0].address, output_infos[0].address, lambda: self._timeout)
        return None

    def remember_shape(self, plan, collective, op, root, algorithm, x, out, view, input_info, output_info,
                       make_output=None):
        """A call that ran on the plans' path: where the compiled executor
        ran it, it takes the same call on new arrays of this shape from now
        on, from C (host_process.CompiledPlans.remember_shape)."""
        if self.compiled is None:
            return
        path = self.route(plan)
        if path == "single_copy":
            plan = self.repeatable_single_plan(plan, input_info, output_info)
        if plan is not None and path in ("compiled_plan", "single_copy"):
            self.compiled.remember_shape(plan, collective, op, root, algorithm, x, out, view, input_info.address,
                                         output_info.address, make_output)

    def route(self, plan, contiguous=True):
        """How this rank runs a call of `plan` (a Plan or a paths.CallShape)
        that reached the plans (the loop declined it), the one place that
        decides it: "single_copy" (an exchange's plan reading peers' inputs
        in place, in the compiled executor; arrays that are not contiguous
        are read through a private copy), "compiled_plan"
        (executors/host_process.py; C-contiguous arrays only) or "step"
        (the interpreter, phase by phase: compressed plans, dtypes the
        executor does not fold, other arrays). A single copy whose read was
        refused runs on the next of the three."""
        if self._single is not None and self._single_copy_of(plan):
            return "single_copy"
        return "compiled_plan" if contiguous and self.compiled is not None and self.compiled.takes(plan) else "step"

    def chosen_path(self, plan, kind=None):
        """What runs a call of `plan` on C-contiguous arrays (`route`)."""
        return self.route(plan)

    def what_ran(self):
        """What ran this rank's calls that reached the plans since
        `forget_what_ran`, as Communicator.chosen_algorithm names it: (the
        algorithm, the path) of the last, or None."""
        if self._interpreted is not None:
            return self._interpreted.algorithm, "step"
        ran = None if self._single is None else self._single.last_plan   # (the compiled executor, which runs both)
        if ran is None:
            return None
        return ran.algorithm, "single_copy" if ran.single_copy else "compiled_plan"

    def forget_what_ran(self):
        if self._single is not None:
            self._single.last_plan = None
        self._interpreted = None

    def run(self, plan, inputs, outputs, input_infos, output_infos, deadline):
        """Execute this rank's part of `plan`; the lists hold this rank's arrays."""
        path = self.route(plan, input_infos[0].contiguous and output_infos[0].contiguous)
        if path == "single_copy":
            if self._run_single_copy(plan, inputs, outputs, input_infos, output_infos, deadline):
                return None
            path = self.route(plan, input_infos[0].contiguous and output_infos[0].contiguous)   # refused: staged
        if path == "compiled_plan":
            return self.compiled.run(plan, input_infos[0].address, output_infos[0].address, deadline)
        self._interpreted = plan
        views = {}
        group = self.group

        def buffer(rank, buffer_id):
            if buffer_id == INPUT:
                return inputs[0].reshape(-1)
            if buffer_id == OUTPUT:
                return outputs[0].reshape(-1)
            key = (rank, buffer_id)
            if key not in views:
                offset = 0 if buffer_id == WORK else plan.scratch_offset
                # (WORK holds the call's count of elements, or a segmented plan's one segment)
                count = (plan.segment or plan.count) if buffer_id == WORK else plan.scratch_elements
                views[key] = np.ndarray((count,), plan.dtype, group.workspace(rank).buf, offset=offset)
            return views[key]

        def execute_phase(p, waiter):
            host.execute(plan.phases[p].rows_by_rank[self.rank], buffer, plan.op, plan.nranks)

        if plan.compression is not None:
            execute_phase = self._compressed_phases(plan, inputs, outputs, views)

        try:
            group.run(plan, describe_call(plan), execute_phase, deadline)
        finally:
            views.clear()  # drop views before any workspace may be released

    def _compressed_phases(self, plan, inputs, outputs, views):
        """execute_phase for a compressed plan: its codec operations on views of
        this rank's and its peers' workspaces (compression/wire.py)."""
        group = self.group

        def rank_views(rank):
            if rank not in views:
                views[rank] = wire.workspace_views(plan, group.workspace(rank).buf)
            return views[rank]

        def floats(rank, buffer_id):
            if buffer_id == INPUT:
                return inputs[0].reshape(-1)
            if buffer_id == OUTPUT:
                return outputs[0].reshape(-1)
            return rank_views(rank)[0][buffer_id]

        def execute_phase(p, waiter):
            host.execute_wire(plan.phases[p].wire_ops_by_rank[self.rank], plan.compression,
                              floats, lambda rank, buffer_id: rank_views(rank)[1][buffer_id])

        return execute_phase

    def barrier(self, deadline):
        if self.fast is None or not self.fast.barrier(deadline):   # (the loop's: a merged step of no bytes)
            self.group.barrier(deadline)

    def remake(self, rank, size, prefix):
        """This rank's like, for another communicator (a shrunk one: recovery.Recoverable)."""
        made = ShmRank(rank, size, prefix, self._ranks_on_machine, self.limits())
        made.measure(self._timeout)   # (no call: it keeps this communicator's limits)
        return made

    def abort(self, reason, cause=CollectiveError):
        """Abort the communicator for every rank: theirs raise `cause`'s class (protocol.py)."""
        self.group.abort(reason, cause)

    def close(self):
        self._forget_recovery()   # its views of the control segment go before the segment
        if self.fast is not None:
            self.fast.close()
        self.group.close()


class _BoundExchange:
    """An exchange bound to one pair of arrays (ShmRank.bind): its
    single-copy plan, the staged plan where a read was refused."""

    __slots__ = ("_rank", "_plan", "_args")

    def __init__(self, rank, plan, inputs, outputs, input_infos, output_infos):
        self._rank, self._plan, self._args = rank, plan, (input_infos, output_infos)

    def run(self, arrays):
        rank, plan = self._rank, self._plan
        input_infos, output_infos = self._args
        inputs, outputs = list(arrays[:1]), list(arrays[-1:])
        rank.run(plan, inputs, outputs, input_infos, output_infos, time.perf_counter() + rank._timeout)

    def remember_as(self, collective, op, root, algorithm, x, out, view=None):
        """Have the compiled executor's runner recognise this call from now
        on and run its single-copy plan from C (host_process.BoundPlan's
        remember_as), where that plan cannot change from call to call
        (ShmRank.repeatable_single_plan)."""
        rank = self._rank
        (xi,), (oi,) = self._args
        single = rank.repeatable_single_plan(self._plan, xi, oi)
        if single is not None:
            rank.compiled.remember(single, collective, op, root, algorithm, x, out, xi.address, oi.address, view)
