"""The public API: a Communicator validates, plans, and hands the plan to its ranks."""

import time

import numpy as np

from . import validation
from .algorithms import choose
from .algorithms.schedule import (
    ALLGATHER, ALLREDUCE, BROADCAST, REDUCE_SCATTER, REDUCE_TO_ROOT, REDUCING_COLLECTIVES,
)
from .config import resolve_timeout
from .errors import CollectiveError, InvalidUsageError
from .executors import host
from .ops import ReduceOp, as_reduce_op
from .plan import INPUT, OUTPUT, SCRATCH, WORK, build_plan


class VirtualHostRanks:
    """Every rank lives in this process and owns a NumPy workspace; a phase
    runs rank after rank, which is a valid order since the transfers of one
    phase are independent."""

    def __init__(self, nranks):
        self._workspaces = [np.empty(0, np.uint8) for _ in range(nranks)]

    def run(self, plan, inputs, outputs, deadline):
        for rank, workspace in enumerate(self._workspaces):
            if workspace.size < plan.workspace_bytes:
                self._workspaces[rank] = np.empty(max(plan.workspace_bytes, 2 * workspace.size), np.uint8)
        views = {}
        for rank, workspace in enumerate(self._workspaces):
            views[rank, INPUT] = inputs[rank].reshape(-1)
            views[rank, OUTPUT] = outputs[rank].reshape(-1)
            views[rank, WORK] = workspace[:plan.count * plan.dtype.itemsize].view(plan.dtype)
            views[rank, SCRATCH] = workspace[plan.scratch_offset:plan.workspace_bytes].view(plan.dtype)
        for phase in plan.phases:
            host.execute(phase.table, lambda rank, buffer_id: views[rank, buffer_id], plan.op, plan.nranks)

    def barrier(self, deadline):
        pass

    def abort(self, reason):
        pass

    def close(self):
        self._workspaces = []


class Communicator:
    """A group of ranks that run collectives together.

    Make one with `Communicator.local(nranks)` (all ranks in this process) or
    `collectives.init()` (one rank per process under mpiexec). Every method
    takes one array when this process owns one rank, or a sequence with one
    array per local rank, and returns the result in the same form.
    """

    def __init__(self, ranks, *, size, local_ranks, timeout):
        self._ranks = ranks
        self.size = size
        self.local_ranks = tuple(local_ranks)
        self.rank = self.local_ranks[0]
        self.timeout = timeout
        self._closed = False

    @classmethod
    def local(cls, nranks, *, timeout=None):
        """`nranks` ranks owned by this process ("virtual ranks")."""
        if isinstance(nranks, bool) or not isinstance(nranks, (int, np.integer)) or nranks < 1:
            raise InvalidUsageError(f"nranks must be a positive integer, got {nranks!r}")
        nranks = int(nranks)
        return cls(VirtualHostRanks(nranks), size=nranks, local_ranks=range(nranks),
                   timeout=resolve_timeout(timeout))

    def __repr__(self):
        state = "closed" if self._closed else "open"
        return f"<Communicator size={self.size} local_ranks={list(self.local_ranks)} {state}>"

    # -- collectives ----------------------------------------------------------

    def allreduce(self, x, op="sum", out=None, algorithm="auto"):
        """Every rank gets the reduction of all ranks' `x` (in place unless `out`)."""
        return self._collective(ALLREDUCE, x, op=op, out=out, algorithm=algorithm)

    def reduce_scatter(self, x, op="sum", out=None, algorithm="auto"):
        """`x` has size*k elements; rank r gets block r (k elements) of the reduction.

        In place, the result lands in `x`'s own block, which is returned as a
        view (along the first axis when it divides evenly, else flat); the
        other blocks of `x` are left as they were.
        """
        return self._collective(REDUCE_SCATTER, x, op=op, out=out, algorithm=algorithm)

    def allgather(self, x, out=None, algorithm="auto"):
        """Every rank gets all ranks' `x` (k elements each) concatenated in rank
        order: size*k elements, in `out` or a new array stacked along axis 0."""
        return self._collective(ALLGATHER, x, out=out, algorithm=algorithm)

    def broadcast(self, x, root=0, algorithm="auto"):
        """Every rank's `x` becomes a copy of the root's `x`."""
        return self._collective(BROADCAST, x, root=root, algorithm=algorithm)

    def reduce(self, x, root=0, op="sum", algorithm="auto"):
        """The root's `x` becomes the reduction of all ranks' `x`; the others' is unchanged."""
        return self._collective(REDUCE_TO_ROOT, x, op=op, root=root, algorithm=algorithm)

    def barrier(self):
        """Return once every rank has called barrier (or raise after the timeout)."""
        self._check_open()
        self._ranks.barrier(time.perf_counter() + self.timeout)

    # -- life cycle -------------------------------------------------------------

    def close(self):
        """Release the communicator's resources. Collective: every rank calls it.

        A peer that died or never calls in does not make close() raise; its
        shared buffers are released all the same.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._ranks.barrier(time.perf_counter() + self.timeout)
        except CollectiveError:
            pass
        finally:
            self._ranks.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is not None and not self._closed:
            # This rank is leaving early: tell the others instead of making
            # them wait in close() for the full timeout.
            self._ranks.abort(f"{exc_type.__name__} on rank {self.rank}: {exc}")
            self._closed = True
            self._ranks.close()
        else:
            self.close()

    def _check_open(self):
        if self._closed:
            raise InvalidUsageError("this communicator is closed")

    # -- the one path every collective takes -------------------------------------

    def _collective(self, collective, x, *, op="sum", out=None, root=0, algorithm="auto"):
        self._check_open()
        nlocal = len(self.local_ranks)
        inputs, as_sequence = validation.rank_arrays(x, nlocal)
        validation.same_dtype_and_shape(inputs)
        dtype, elements = inputs[0].dtype, inputs[0].size
        op = as_reduce_op(op) if collective in REDUCING_COLLECTIVES else ReduceOp.SUM
        root = validation.root_rank(root, self.size) if collective in (BROADCAST, REDUCE_TO_ROOT) else 0

        count = elements  # elements of each rank's WORK buffer
        if collective == REDUCE_SCATTER:
            if elements % self.size:
                raise InvalidUsageError(
                    f"reduce_scatter needs an input whose size divides by the communicator size "
                    f"{self.size}; it has {elements} elements")
            result_elements = elements // self.size
        elif collective == ALLGATHER:
            count = result_elements = elements * self.size
        else:
            result_elements = elements

        if out is not None:
            outputs = validation.output_arrays(out, nlocal, result_elements, dtype)
        elif collective == REDUCE_SCATTER:
            outputs = [self._own_block(a, rank) for a, rank in zip(inputs, self.local_ranks)]
        elif collective == ALLGATHER:
            outputs = [np.empty(self._gathered_shape(a), dtype) for a in inputs]
        else:
            outputs = inputs
        written = [o for o, rank in zip(outputs, self.local_ranks) if _receives(collective, rank, root)]
        validation.writable(written, "out" if out is not None else "x")
        validation.no_overlap_between_ranks(inputs, outputs)

        if not isinstance(algorithm, str):
            raise InvalidUsageError(f"algorithm must be a name, got {type(algorithm).__name__}")
        if algorithm == "auto":
            algorithm = choose(collective, self.size, count * dtype.itemsize, root)
        plan = build_plan(collective, algorithm, self.size, count, dtype, op, root)
        self._ranks.run(plan, inputs, outputs, time.perf_counter() + self.timeout)
        return outputs if as_sequence else outputs[0]

    def _own_block(self, a, rank):
        """Rank `rank`'s block of a reduce_scatter input, as a view."""
        if a.ndim >= 1 and a.shape[0] % self.size == 0:
            rows = a.shape[0] // self.size
            return a[rank * rows:(rank + 1) * rows]
        k = a.size // self.size
        return a.reshape(-1)[rank * k:(rank + 1) * k]

    def _gathered_shape(self, a):
        return (self.size * a.shape[0], *a.shape[1:]) if a.ndim >= 1 else (self.size,)


def _receives(collective, rank, root):
    """Whether `rank`'s output is written by the collective."""
    if collective == BROADCAST:
        return rank != root
    if collective == REDUCE_TO_ROOT:
        return rank == root
    return True
