"""Collectives checked and planned once, issued many times: `Communicator.prepare`.

A plain call on arrays it has seen before is recognised by the arrays'
identities and re-reads each array's shape, dtype and flags (or address),
because the caller may have changed them in place since: about 2,000 host
instructions per array, most of a repeated call's cost (docs/gpu.md). A
prepared call is the caller's promise that the arrays stay as they were,
as MPI-4's persistent collectives (MPI_Allreduce_init, then MPI_Start) are:

    step = comm.prepare("allreduce", grads, out=averaged, op="avg")
    for batch in data:
        ...                      # write new values into grads
        step()                   # no checks: the bound launches, issued

`prepare` runs every check of the call and plans it, and binds the plan
to the arrays where the ranks can (ranks in this process: DeviceRanks'
BoundProgram, VirtualHostRanks' bound tables); it keeps the arrays alive.
A call then issues what was bound. The values in the arrays may change
between calls; their memory, shape, dtype and writability may not (do not
reshape, retype or resize them in place). Ranks in separate processes
(and NCCL) make the plain call each time: their cost per call is the
exchange with their peers, not the checks, and their fast paths (the
compiled loop of host ranks, the one-kernel path of GPU ranks) stay theirs.
"""

import inspect
import time

from .algorithms.schedule import ALL_COLLECTIVES as COLLECTIVES, ALLGATHER, GATHER
from .errors import InvalidUsageError


def call_arguments(comm, collective, arguments):
    """`arguments` completed with the defaults of the collective's method
    (whose signature is the one list of what it takes), as (op, out, root,
    algorithm, compression); InvalidUsageError for an unknown collective or
    an argument the method does not take."""
    if collective not in COLLECTIVES:
        raise InvalidUsageError(
            f"collective: unknown collective {collective!r}; expected one of {', '.join(COLLECTIVES)}")
    taken = taken_arguments(type(comm), collective)
    unknown = sorted(set(arguments) - set(taken))
    if unknown:
        raise InvalidUsageError(
            f"{unknown[0]}: {collective} takes no {unknown[0]!r} argument; it takes {', '.join(taken)}")
    given = {"op": "sum", "out": None, "root": 0, "compression": None, **taken, **arguments}
    return given["op"], given["out"], given["root"], given["algorithm"], given["compression"]


def taken_arguments(kind, collective):
    """{name: default} of the arguments after `x` of `kind`'s method `collective`."""
    parameters = list(inspect.signature(getattr(kind, collective)).parameters.values())[2:]   # self, x
    return {p.name: p.default for p in parameters}


class PreparedCall:
    """One collective on fixed arrays (see the module doc). Calling it runs
    the collective and returns what the plain call returns: the outputs (a
    list for a list), the same arrays every time.

    `algorithm`: the algorithm it runs (what "auto" chose)."""

    def __init__(self, comm, collective, x, arguments, checked):
        inputs, outputs, input_infos, output_infos, _, plan, as_sequence = checked
        self._comm, self._collective, self._x, self._arguments = comm, collective, x, arguments
        self._inputs, self._outputs = list(inputs), list(outputs)
        self._input_infos, self._output_infos = list(input_infos), list(output_infos)
        self._plan = plan
        self._as_sequence = as_sequence
        self.algorithm = getattr(plan, "algorithm", None)
        ranks = comm._ranks
        bind = getattr(ranks, "bind", None)
        # Outputs a plain call would make anew (allgather without out) were
        # made once by the checks: bound like given ones.
        self._bound = bind(plan, self._inputs, self._outputs, self._input_infos, self._output_infos) \
            if bind is not None else None
        self._arrays = [*self._inputs, *self._outputs]
        self._plain = bind is None   # ranks in processes, NCCL: the plain call (module doc)
        # A plain call that made its outputs (allgather and gather without
        # out) would make new ones every time: hand it the ones made here instead.
        made_outputs = collective in (ALLGATHER, GATHER) and arguments.get("out") is None
        if self._plain and made_outputs:
            self._arguments = {**arguments, "out": self._outputs if as_sequence else self._outputs[0]}
        # What a call returns: the outputs, but where a gather made them, the
        # root's alone (None elsewhere), as the plain call returns.
        self._results = list(self._outputs)
        if collective == GATHER and made_outputs:
            root = arguments.get("root", 0)
            self._results = [out if rank == root else None for out, rank in zip(self._outputs, comm.local_ranks)]

    def __repr__(self):
        return f"<PreparedCall {self._collective} ({self.algorithm})>"

    def __call__(self):
        """Run the collective on the prepared arrays. Raises what the plain
        call raises at run time (CollectiveTimeoutError, RankFailedError,
        CollectiveError), and InvalidUsageError where the communicator is
        closed or a fusion buffer has allreduces in flight."""
        comm = self._comm
        if comm._closed:
            comm._check_open()
        if comm._busy:
            comm._check_idle()
        if self._plain:   # its results are the arrays kept here (a reduce_scatter's block, as a new view)
            getattr(comm, self._collective)(self._x, **self._arguments)
        elif self._bound:
            self._bound.run(self._arrays)
        else:   # no bound form (compressed plans): the ranks' run, with the descriptions made once
            comm._ranks.run(self._plan, self._inputs, self._outputs, self._input_infos, self._output_infos,
                            time.perf_counter() + comm.timeout)
        return list(self._results) if self._as_sequence else self._results[0]
