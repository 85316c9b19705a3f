"""Host ranks in separate processes run their plans compiled (_host_plan.c).

A rank of `transport.shm.ShmRank` hands every plan it can to the compiled
executor: its rows and waits, flattened once per plan, go to C, which runs
the rank's phases through the step protocol with no Python between them
(the waits, the call's signature, the counters: transport/protocol.py).
Python steps in only where the protocol needs it, and then resumes the
run:

    NEED_GROW   this rank's workspace is too small for the plan: grown
                after phase 0's waits (no peer reads it then), as the
                interpreter grows it;
    NEED_OPEN   a peer's workspace is of a generation not yet opened here:
                opened before any row of the phase that reads it runs (and
                this rank's own, grown since the last call: noted before the
                call starts).

A single-copy plan (plan.single_copy_plan: the exchanges' rows that read
peers' inputs straight out of their processes) runs here alone, the
interpreter having no such reads; where a rank may not read a peer's
memory, every rank's run returns REFUSED with nothing of its input
overwritten, and the caller runs the call again on the staged plan
(transport/shm.py).

The NumPy interpreter (executors/host.py) stays the reference meaning of a
plan and runs what the compiled executor does not take: compressed plans,
float16 and bfloat16 (which accumulate in float32: the interpreter's rule),
and everything when the package was built without a C compiler. Both
executors follow one protocol, so ranks may mix them within a call.
"""

import time

import numpy as np

from ..errors import CollectiveError
from ..transport.fastpath import weakly
from ..ops import ReduceOp
from ..plan import PUSHED_IN_PLACE
from ..transport.failures import BAD_PLAN, NEED_GROW, NEED_OPEN, REFUSED, abort_fence_and_raise, raise_wait_failure
from ..transport.layout import CAP, GEN
from ..transport.protocol import describe_call, description_hash

try:
    from . import _host_plan
except ImportError:   # built without a C compiler: the interpreter runs every plan
    _host_plan = None
try:
    from .._arraystate import numpy_states
except ImportError:   # not built: repeated calls are recognised in Python alone
    numpy_states = None


_OPS = {op: code for code, op in enumerate(ReduceOp)}
# Plans prepared and kept (CompiledPlans._prepare): more than a program makes
# of fixed shapes, bounded for the plans of all_to_all_v's changing counts.
_PREPARED_KEPT = 1024
assert [op.value for op in ReduceOp] == ["sum", "prod", "max", "min", "avg"], "host_folds.h's OP_ codes"


def _single_copy_form(plan):
    """The runner's single-copy form of `plan` (_host_plan.c's SINGLE_COPY_*):
    none, reads, reads and a probe of pushes (the read form of a fold that
    pushes in place once the ranks know pushes work), pushes from every
    rank into every peer (that fold's pushed form), other pushes."""
    if not plan.single_copy:
        return 0
    if plan.collective not in PUSHED_IN_PLACE:
        return 4 if plan.pushes else 1
    return 3 if plan.pushes else 2


def available():
    return _host_plan is not None


class CompiledPlans:
    """This rank's compiled executor: runs a plan's phases in C."""

    def __init__(self, group, spin, yield_seconds, tunables):
        """`tunables`: config.LoopTunables, whose fence and test stalls
        the single copy takes here as in the loop."""
        assert (_host_plan.GEN, _host_plan.CAP) == (GEN, CAP), "layout.py and _host_plan.c disagree"
        header, rows, _ = group.channel_addresses()
        self._group = group
        self._fence_seconds = tunables.fence_seconds   # a failed call's wait for peers still pushing into its output
        # The tests' stalls of every read and push ($COLLECTIVES_TEST_READ_STALL,
        # ..._WRITE_STALL): the loop's, and since the plans run allreduce's
        # single copy, this process's runner's too (only where set: the tests
        # also set them straight).
        if tunables.test_read_stall:
            _host_plan.test_stall_reads(tunables.test_read_stall)
        if tunables.test_write_stall:
            _host_plan.test_stall_writes(tunables.test_write_stall)
        # Per rank: the address of its workspace as mapped here, and the
        # generation that is; the runner reads them (it holds them), this
        # writes them (_refresh), between calls.
        self._bases = np.zeros(group.size, np.int64)
        self._generations = np.full(group.size, -1, np.int64)
        self._runner = _host_plan.Runner(header=header, rows=rows, rank=group.rank, nranks=group.size, spin=spin,
                                         yield_seconds=yield_seconds, bases=self._bases,
                                         generations=self._generations)
        self._types = {np.dtype(name): code for code, name in enumerate(_host_plan.TYPES.split())}
        self._prepared = {}   # id(plan) -> (plan, the runner's Plan, ...): the plan held, so its id stays its own
        # A repeated call of a bound plan straight from C (the runner's
        # Repeats: Communicator._collective tries `repeat` first), where the
        # arrays' states are read in C too (collectives/_arraystate.c).
        self.repeat = self.forget_repeats = None
        # Called with the plan when a single-copy plan the runner
        # repeated from C was refused (ShmRank._refusal): it raises, or the
        # call runs again from Python.
        self.on_refused = None
        if numpy_states is not None:
            self._runner.bind_repeats(numpy_states, np.ndarray, weakly(self._stopped_repeat))
            self.repeat, self.forget_repeats = self._runner.repeat, self._runner.forget

    def forget_shapes(self):
        """Forget every shape remember_shape handed the runner (the path a
        call of some shape takes changed)."""
        self._runner.forget_shapes()

    @property
    def repeats_run(self):
        """Calls the runner recognised and ran from C (its Repeats and Shapes) so far."""
        return self._runner.repeats_run

    def remember(self, plan, collective, op, root, algorithm, x, out, x_address, out_address, view=None):
        """Have the runner recognise this call from now on (its Repeats):
        `collective` with these arguments ran `plan` on the very arrays x
        and out (None: in place, or, with `view`, the result is x[view]) at
        these addresses."""
        self._runner.remember(collective, op, root, algorithm, x, out, self._entry(plan), x_address, out_address,
                              view)

    def remember_shape(self, plan, collective, op, root, algorithm, x, out, view, x_address, out_address,
                       make_output=None):
        """Have the runner take this call's shape on new arrays from now on
        (its Shapes, _host_plan.c): `collective` with these arguments ran
        `plan` on x and out (None: in place, or, with `view`, the result is
        x[view]; with `make_output`, out is what the call made, and
        make_output() makes the next) at these addresses."""
        if self.repeat is not None:
            self._runner.remember_shape(collective, op, root, algorithm, x, out, self._entry(plan), x_address,
                                        out_address, view, x.nbytes, 0 if out is None else out.nbytes, make_output)

    @property
    def last_plan(self):
        """The plan of the last call run (ShmRank.what_ran), or None: the
        runner's, since its repeats run without Python."""
        return self._runner.last

    @last_plan.setter
    def last_plan(self, plan):
        self._runner.last = plan

    @property
    def waits_made(self):
        """Peer waits the compiled executor made so far (each a poll of a peer's counter, in C)."""
        return self._runner.waits_made

    @property
    def pushes_reached(self):
        """1 where a call found that every rank may write into every peer's
        output (a pushed plan's run, or the probe of the read form that can
        push: _host_plan.c's "Single copy"), -1 where it found not, else 0;
        the same on every rank between calls."""
        return self._runner.pushes_reached

    @pushes_reached.setter
    def pushes_reached(self, verdict):
        self._runner.pushes_reached = verdict

    def takes(self, plan):
        """Whether the compiled executor runs `plan` (else the interpreter does)."""
        return plan.compression is None and plan.dtype in self._types

    def run(self, plan, x_address, out_address, deadline):
        """Run this rank's part of `plan` on its arrays, C-contiguous NumPy
        arrays at `x_address` and `out_address` (the bytes the interpreter's
        flat views of them are). Returns None, or REFUSED where a
        single-copy plan's read was refused on some rank (every rank's run
        returns it, in the same call: run the call again staged)."""
        self.last_plan = plan
        entry = self._entry(plan)
        try:
            result = self._runner.run(entry[1], x_address, out_address, 0, deadline)
        except BaseException as error:
            self._abort_for(error)
        return None if result == 0 else self._run_on(entry, x_address, out_address, deadline, result)

    def _entry(self, plan):
        """What `_prepare` made of `plan`: (plan, the runner's Plan, the call's description)."""
        entry = self._prepared.get(id(plan))
        return entry if entry is not None and entry[0] is plan else self._prepare(plan)

    def _run_on(self, entry, x_address, out_address, deadline, result):
        """The rest of a call whose run stopped with `result` (the runner's
        tuple): grow this rank's workspace or open a peer's and run on from
        the phase it names, until it ends (None), is REFUSED (a single-copy
        plan), or fails (raised, the communicator aborted)."""
        plan, prepared, description = entry
        group = self._group
        try:
            while result != 0:
                status, peer, have, need, seq, start = result
                group.note_call(seq)
                if status == REFUSED and plan.single_copy:
                    return REFUSED
                if status == NEED_GROW:
                    group.ensure_capacity(plan.workspace_bytes)
                    self._refresh(group.rank)
                elif status == NEED_OPEN:
                    self._refresh(peer)
                else:
                    self._raise_for(status, peer, have, need, description)
                result = self._runner.run(prepared, x_address, out_address, start, deadline)
            return None
        except BaseException as error:
            self._abort_for(error)

    def _stopped_repeat(self, entry, x_address, out_address, deadline, result, error):
        """A repeat the runner ran from C (its Repeats) stopped: with `result`
        (the runner's tuple) it goes on as a bound plan's run does, or with
        `error` (a signal handler's) the communicator is aborted and it
        raises. False where a single-copy plan was refused (on_refused did
        not raise): the runner declines the call, which the communicator
        then runs from Python, staged."""
        if error is not None:
            self._abort_for(error)
        if self._run_on(entry, x_address, out_address, deadline, result) == REFUSED:
            self.on_refused(entry[0])
            return False
        return True

    def _abort_for(self, error):
        """A call that raised `error` aborts the communicator for every rank,
        fences this rank's buffers against peers still pushing into them,
        and raises `error` (failures.abort_fence_and_raise)."""
        group = self._group
        group.note_call(self._runner.call()[0])
        abort_fence_and_raise(group, f"{type(error).__name__}: {error}", error, self._runner.fence_writes,
                              self._fence_seconds)

    def bind(self, plan, x_address, out_address, timeout):
        """`run` for one plan and pair of arrays, ready to repeat:
        `bound.run(arrays)` (the arrays only keep them alive; their
        addresses are these), waiting at most timeout() seconds."""
        return BoundPlan(self, plan, x_address, out_address, timeout)

    def _prepare(self, plan):
        """What the runner needs of `plan` for this rank, made once per plan:
        the rank's rows and waits, flat; the call's description; the numbers."""
        rank = self._group.rank
        tables = [phase.rows_by_rank[rank] for phase in plan.phases]
        width = max((t.shape[1] for t in tables), default=6)
        rows = np.ascontiguousarray(np.concatenate([t for t in tables if len(t)] or [np.zeros((0, width))])
                                    .astype(np.int64, copy=False)).reshape(-1, width)
        row_starts = np.cumsum([0] + [len(t) for t in tables], dtype=np.int64)
        waits = [phase.waits[rank] for phase in plan.phases]
        pairs = np.array([pair for phase_waits in waits for pair in phase_waits], np.int64).reshape(-1, 2)
        wait_starts = np.cumsum([0] + [len(w) for w in waits], dtype=np.int64)
        description = describe_call(plan)
        prepared = _host_plan.Plan(rows, row_starts, pairs, wait_starts, plan.scratch_offset, plan.workspace_bytes,
                                   self._types[plan.dtype], _OPS[ReduceOp(plan.op)], plan.nranks,
                                   description_hash(description), _single_copy_form(plan), plan.no_push_in_place)
        entry = (plan, prepared, description)
        if len(self._prepared) >= _PREPARED_KEPT:   # all_to_all_v makes a plan per matrix of counts
            self._prepared.clear()
        self._prepared[id(plan)] = entry
        return entry

    def _refresh(self, rank):
        """Map `rank`'s workspace of its current generation (this rank's own:
        the one it has) and note its address."""
        group = self._group
        generation = group.generation(rank)
        if generation == self._generations[rank] and self._bases[rank]:
            return
        memory = group.workspace(rank)
        if memory is None:   # this rank's, before its first workspace: none opened, at the generation it is
            self._bases[rank], self._generations[rank] = 0, generation
            return
        self._bases[rank] = np.frombuffer(memory.buf, np.uint8).ctypes.data
        self._generations[rank] = generation

    def _raise_for(self, status, peer, have, need, description):
        """Raise what the interpreter's waits raise for the same failure."""
        group, seq = self._group, self._group.seq
        if status == BAD_PLAN:
            raise CollectiveError(f"the compiled executor cannot run call #{seq}, {description}: its plan names "
                                  "memory of another rank than its workspace")
        raise_wait_failure(group, status, peer, have, need, seq, description, progress="it has completed")


class BoundPlan:
    """A plan bound to one pair of arrays (CompiledPlans.bind): `run`,
    with the plan prepared and looked up once."""

    __slots__ = ("_compiled", "_entry", "_x", "_out", "_timeout")

    def __init__(self, compiled, plan, x_address, out_address, timeout):
        self._compiled, self._entry = compiled, compiled._entry(plan)
        self._x, self._out, self._timeout = x_address, out_address, timeout

    def remember_as(self, collective, op, root, algorithm, x, out, view=None):
        """Have the runner recognise this call from now on (its Repeats):
        `collective` with these arguments on the very arrays `x` and `out`
        (None: in place, or, with `view`, the result is x[view]), which are
        the ones bound."""
        self._compiled.remember(self._entry[0], collective, op, root, algorithm, x, out, self._x, self._out, view)

    def run(self, arrays):
        """Run the call (`arrays`, the call's, are what keeps the addresses valid)."""
        compiled, entry = self._compiled, self._entry
        compiled.last_plan = entry[0]
        deadline = time.perf_counter() + self._timeout()
        try:
            result = compiled._runner.run(entry[1], self._x, self._out, 0, deadline)
        except BaseException as error:
            compiled._abort_for(error)
        if result != 0:
            compiled._run_on(entry, self._x, self._out, deadline, result)
