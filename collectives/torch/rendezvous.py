"""Start-up through a c10d store: the rendezvous torchrun and torch.distributed hand us.

A torch.distributed backend is given a store private to its process group
(a PrefixStore over the job's TCPStore); torchrun serves one at
MASTER_ADDR:MASTER_PORT to every process it starts. Either is all the
library needs to meet its peers without MPI: `StoreRendezvous` does
bootstrap.py's exchanges (allgather, barrier) with the store's set and
wait, and opens the messages between nodes on a Gloo group made from the
same store (link.py). Only handles travel through the store (process ids,
shared-memory names, CUDA IPC handles, NCCL's id), never data.

Every wait is bounded by the deadline: a rank that never arrives is a
CollectiveTimeoutError naming the ranks that were missing, not a hang.
"""

import datetime
import itertools
import os
import time

import torch.distributed as dist

from ..errors import CollectiveTimeoutError, InvalidUsageError

# torchrun sets it when its agent serves the store, which every worker then
# reaches as a client (torch.distributed's env:// convention does the same).
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
# Attempts of a job torchrun restarted: a new attempt's keys must not meet an
# old attempt's, in a store that may outlive the attempt.
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"


class StoreRendezvous:
    """bootstrap.py's rendezvous over a c10d store (set, wait, get, add,
    delete_key). `rank` and `size` are this process's place in the group
    whose store it is. Every rank makes the same exchanges in the same order;
    exchange n uses keys `n/<rank>`, which the last rank to read them deletes.
    `world_rank` and `world_size` place a group of some ranks in its job
    (bootstrap.topology reads $COLLECTIVES_PRETEND_NODES by world rank);
    by default the group is the world."""

    def __init__(self, store, rank, size, world_rank=None, world_size=None):
        self.store, self.rank, self.size = store, rank, size
        self.world_rank = rank if world_rank is None else world_rank
        self.world_size = size if world_size is None else world_size
        self._exchanges = 0

    def allgather(self, data, nbytes, deadline, what):
        """Every rank's `data` (at most `nbytes` bytes), in rank order, each
        padded with zero bytes to `nbytes` (as MPI's fixed-size allgather)."""
        self._exchanges += 1
        round_ = self._exchanges
        keys = [f"{round_}/{r}" for r in range(self.size)]
        self.store.set(keys[self.rank], bytes(data[:nbytes]).ljust(nbytes, b"\0"))
        self._wait(keys, deadline, what)
        values = self.store.multi_get(keys)
        if self.store.add(f"{round_}/read", 1) == self.size:   # every rank has its copy: tidy up
            for key in (*keys, f"{round_}/read"):
                self.store.delete_key(key)
        return [bytes(v) for v in values]

    def barrier(self, deadline, what):
        self.allgather(b"", 0, deadline, what)

    def link(self, deadline):
        """hierarchy.py's messages between nodes: point-to-point on a Gloo
        group made from this store (link.py)."""
        from .link import TorchLink
        return TorchLink.over_gloo(dist.PrefixStore("link/", self.store), self.rank, self.size, deadline)

    def _wait(self, keys, deadline, what):
        remaining = deadline - time.perf_counter()
        try:
            if remaining <= 0:
                raise dist.DistStoreError("no time left")
            self.store.wait(keys, datetime.timedelta(seconds=remaining))
        except dist.DistStoreError:
            missing = [r for r, key in enumerate(keys) if not self.store.check([key])]
            raise CollectiveTimeoutError(
                f"timed out at start-up waiting for {what}: rank(s) {', '.join(map(str, missing))} did not "
                "arrive (through the c10d store)") from None


def torchrun_rendezvous(deadline, environ=os.environ):
    """The rendezvous of a process torchrun started: the store at
    MASTER_ADDR:MASTER_PORT (torchrun's agent serves it; without the agent,
    rank 0 does, as torch.distributed's env:// does), under a prefix of its
    own per init() call, so that neither a later torch.distributed group nor
    another init() meets its keys."""
    try:
        rank, size, port = int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ["MASTER_PORT"])
    except ValueError as error:
        raise InvalidUsageError(f"torchrun's RANK, WORLD_SIZE and MASTER_PORT must be integers: {error}") from None
    if not 0 <= rank < size:
        raise InvalidUsageError(f"RANK={rank} is not a rank of WORLD_SIZE={size}")
    serves = rank == 0 and environ.get(AGENT_STORE_ENV, "").lower() not in ("1", "true")
    seconds = max(deadline - time.perf_counter(), 1e-3)
    try:
        store = dist.TCPStore(environ["MASTER_ADDR"], port, size, is_master=serves,
                              timeout=datetime.timedelta(seconds=seconds), multi_tenant=True)
    except (RuntimeError, dist.DistError) as error:
        raise CollectiveTimeoutError(
            f"could not reach the c10d store at {environ['MASTER_ADDR']}:{port} within {seconds:.0f} s: "
            f"{error}") from None
    prefix = f"collectives/{environ.get(RESTART_COUNT_ENV, '0')}/init/{next(_INITS)}/"
    return StoreRendezvous(dist.PrefixStore(prefix, store), rank, size)


# Numbers init() calls under torchrun: every rank makes them in the same
# order, so the n-th call of every rank meets under one prefix.
_INITS = itertools.count(1)
