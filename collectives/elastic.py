"""Training that goes on when a rank fails, without restarting a process.

Horovod Elastic's idea (commit, roll back, go on) on `Communicator.shrink`:

    state = collectives.elastic.ArrayState(comm, weights=w, step=0)

    def train(state):
        while state.step < steps:
            g = state.comm.allreduce(gradient(state.weights, shard(state)), op="avg")
            state.weights -= lr * g
            state.step += 1
            state.commit()            # the point a failure rolls back to
        return state.weights

    weights = collectives.elastic.run(train, state)

`run` starts every rank from rank 0's state. When a rank dies or stalls,
the collective it was part of raises on every survivor (RankFailedError,
CollectiveTimeoutError, or RevokedError where a peer revoked); `run` then
shrinks the communicator (the survivors agree on who is left), puts the
new one in `state.comm`, restores the last commit, makes every survivor's
state rank 0's (the lowest live rank), tells the callbacks registered with
`state.on_reset` (to rescale the learning rate, reshard the data by the
new `state.comm.size`), and calls `train` again. Steps lost: at most those
since the last commit.

`commit()` is uniform: it keeps the copy only once every rank reached it
(`comm.agree`), so the survivors of a failure all roll back to the same
commit; a commit that a failed rank never reached raises, and rolls back
to the one before. It costs one agree (tens of microseconds between host
processes) and a copy of the state.

A rank the others left out (it came to the shrink after they decided)
gets RankExcludedError from `run`; other errors of `train` propagate.
Host ranks in processes on one machine (where `shrink` is offered).
"""

import copy
import os
import pickle
import signal
import warnings

import numpy as np

from .bootstrap import failure_signal_before_mpi
from .errors import CollectiveTimeoutError, InvalidUsageError, RankFailedError, RevokedError

# What a failure of a peer raises on a survivor (RankFailedError is a CollectiveTimeoutError).
FAILURES = (CollectiveTimeoutError, RevokedError)


def run(train, state):
    """Call `train(state)` until it returns, shrinking and rolling back
    after each failure of a peer; returns what `train` returned. Warns
    (RuntimeWarning) where the launcher would end the survivors of a
    failure (launcher_kills_survivors)."""
    if not isinstance(state, State):
        raise InvalidUsageError(f"state: expected a collectives.elastic State, got {type(state).__name__}")
    why = launcher_kills_survivors()
    if why:
        warnings.warn(f"collectives.elastic: {why}", RuntimeWarning, stacklevel=2)
    state.sync()
    state.save()
    while True:
        try:
            return train(state)
        except FAILURES:
            state.reset(state.comm.shrink())


def launcher_kills_survivors(environ=os.environ):
    """Why the launcher of this process would end every rank when one dies
    (a sentence with the way out), or "" where nothing says it would."""
    parent = _process_name(os.getppid())
    if parent == "hydra_pmi_proxy":
        return ("this rank is a direct child of MPICH's mpiexec, which ends every rank when one dies by a signal; "
                "start each rank through a shell that lets the others live: mpiexec -disable-auto-cleanup -n N "
                "sh -c 'trap \"\" USR1; python ...; exit $?'")
    if _process_name(_parent_of(os.getppid())) == "hydra_pmi_proxy" \
            and failure_signal_before_mpi() == signal.SIG_DFL:
        return ("MPICH's mpiexec sends SIGUSR1 to every rank when one fails, and this process does not ignore it "
                "(its default action ends the process): start the shell with trap \"\" USR1, and mpiexec with "
                "-disable-auto-cleanup")
    if "TORCHELASTIC_RUN_ID" in environ and int(environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
        return ("torchrun's agent ends all its workers when one fails, and this agent has "
                f"{environ['LOCAL_WORLD_SIZE']}: run one agent per rank (--nproc-per-node 1)")
    return ""


def _process_name(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _parent_of(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


class State:
    """What a failure rolls back: a subclass says how to save, restore and
    sync (make every rank's equal to rank 0's) its values."""

    def __init__(self, comm):
        self.comm = comm
        self.commits = 0          # commits kept since run() started
        self._callbacks = []

    def on_reset(self, callback):
        """Call `callback(state)` after each shrink, once the state is rolled
        back and synced (state.comm is the new communicator)."""
        self._callbacks.append(callback)

    def commit(self):
        """Keep the state as the point a failure rolls back to, once every
        rank has reached this commit; raises RankFailedError (which run()
        handles) where a rank failed before reaching it."""
        if not self.comm.agree(True):
            raise RankFailedError(f"a rank failed before commit #{self.commits + 1}: rolling back to the last one")
        self.save()
        self.commits += 1

    def reset(self, comm):
        """After a shrink: the new communicator, the last commit, rank 0's values."""
        self.comm = comm
        self.restore()
        self.sync()
        for callback in self._callbacks:
            callback(self)

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def sync(self):
        raise NotImplementedError


class ArrayState(State):
    """NumPy arrays and Python values, as attributes: `ArrayState(comm,
    weights=w, step=0)`, then `state.weights`, `state.step`. Arrays are
    restored in place (views of them stay valid); other values are
    replaced. Every rank gives the same names, and arrays of the same
    shapes and dtypes."""

    def __init__(self, comm, **values):
        if not values:
            raise InvalidUsageError("ArrayState needs at least one value: ArrayState(comm, name=value, ...)")
        super().__init__(comm)
        self._names = tuple(values)
        for name, value in values.items():
            if isinstance(value, np.ndarray) and not value.flags.c_contiguous:
                raise InvalidUsageError(f"{name}: arrays must be C-contiguous")
            setattr(self, name, value)
        self._saved = None

    def _arrays(self):
        return [name for name in self._names if isinstance(getattr(self, name), np.ndarray)]

    def save(self):
        self._saved = {name: copy.deepcopy(getattr(self, name)) for name in self._names}

    def restore(self):
        for name, value in self._saved.items():
            current = getattr(self, name)
            if isinstance(current, np.ndarray) and isinstance(value, np.ndarray) and current.shape == value.shape \
                    and current.dtype == value.dtype:
                current[...] = value
            else:
                setattr(self, name, copy.deepcopy(value))

    def sync(self):
        for name in self._arrays():
            self.comm.broadcast(getattr(self, name), root=0)
        others = {name: getattr(self, name) for name in self._names if name not in self._arrays()}
        for name, value in broadcast_object(self.comm, others).items():
            setattr(self, name, value)


class TorchState(State):
    """A PyTorch model, its optimizer and other values: `TorchState(comm,
    model, optimizer, epoch=0)`. Saved as copies of their state_dicts;
    synced with collectives.torch.broadcast_parameters. A
    collectives.torch.DistributedOptimizer is moved to the new
    communicator after a shrink."""

    def __init__(self, comm, model, optimizer=None, **extra):
        import torch
        if not isinstance(model, torch.nn.Module):
            raise InvalidUsageError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        super().__init__(comm)
        self.model, self.optimizer = model, optimizer
        self._extra = tuple(extra)
        for name, value in extra.items():
            setattr(self, name, value)
        self._saved = None

    def save(self):
        self._saved = (copy.deepcopy(self.model.state_dict()),
                       None if self.optimizer is None else copy.deepcopy(self.optimizer.state_dict()),
                       {name: copy.deepcopy(getattr(self, name)) for name in self._extra})

    def restore(self):
        model, optimizer, extra = self._saved
        self.model.load_state_dict(model)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(optimizer)
        for name, value in extra.items():
            setattr(self, name, copy.deepcopy(value))

    def reset(self, comm):
        move = getattr(self.optimizer, "use_communicator", None)
        if move is not None:
            move(comm)
        super().reset(comm)

    def sync(self):
        import torch

        from .torch import broadcast_parameters
        broadcast_parameters(self.model, self.comm, root=0)
        if self.optimizer is not None:
            tensors = [t for state in self.optimizer.state_dict()["state"].values() for t in state.values()
                       if isinstance(t, torch.Tensor)]
            if tensors:
                broadcast_parameters(tensors, self.comm, root=0)
        for name, value in broadcast_object(self.comm, {n: getattr(self, n) for n in self._extra}).items():
            setattr(self, name, value)


def broadcast_object(comm, value, root=0):
    """`value` (picklable) from `root` to every rank: its length, then its bytes."""
    data = np.frombuffer(pickle.dumps(value), np.uint8) if comm.rank == root else np.empty(0, np.uint8)
    length = comm.broadcast(np.array([data.size], np.int64), root=root)
    buffer = data.copy() if comm.rank == root else np.empty(int(length[0]), np.uint8)
    if buffer.size:
        comm.broadcast(buffer, root=root)
    return pickle.loads(buffer.tobytes()) if comm.rank != root else value
