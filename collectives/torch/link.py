"""Messages between nodes on a torch.distributed group: hierarchy.py's link under torchrun.

The hierarchical communicator (hierarchy.py) keeps our shared memory inside
each node and moves the bytes that cross nodes with an existing engine,
never a network layer of its own: MPI under mpiexec (transport/mpi.py),
and here, where the processes met through a c10d store, Gloo's
point-to-point messages on a group made from that store. Every rank is in
the group: each carries its own range of the data across nodes, as with MPI
(and as NCCL does, one NIC per GPU), rather than funnelling every byte
through one leader per node.

`TorchLink` has MpiLink's interface (begin, exchange, check_health, abort,
close) and its protocol: before its data, a rank sends each peer of an
exchange the call's signature and checks the one it receives; between two
ranks, messages of one tag arrive in the order they were sent (Gloo matches
a pair's messages of one tag in order, as MPI does).

What Gloo does not give is a message that can be polled: its send and
receive works complete only inside a blocking wait, and a wait that times
out ends the work. So one thread of the link blocks in Gloo's waits (each
bounded by the call's deadline), while the caller's thread watches that
thread, the deadline and the abort flag:

  - a peer that died closes its connections: Gloo's waits fail at once
    ("Connection closed by peer"), which becomes RankFailedError;
  - a rank that fails otherwise writes an abort record (the class of its
    failure, errors.kind_of, and why) into the store, which waiting ranks
    read every HEALTH_EVERY seconds and raise the same class;
  - a peer that stalls is a CollectiveTimeoutError at the deadline.
"""

import concurrent.futures
import datetime
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist

from ..errors import CollectiveError, CollectiveTimeoutError, InvalidUsageError, RankFailedError, class_of_kind, kind_of

DATA_TAG = 2
HEALTH_EVERY = 0.02     # seconds between looks at the store's abort record while waiting
ABORT_KEY = "abort"
REASON_BYTES = 1024
# Gloo's message when a peer's connection closed, which a dead process's does.
_PEER_GONE = "Connection closed by peer"


class TorchLink:
    """This rank's end of the messages between nodes: `group` is a
    torch.distributed process group with send and recv (Gloo's), `store` a
    store private to the link, where an abort is recorded."""

    @classmethod
    def over_gloo(cls, store, rank, size, deadline):
        """A link on a Gloo group of every rank, made from `store`; every
        rank calls this together."""
        seconds = max(deadline - time.perf_counter(), 1e-3)
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size,
                                          datetime.timedelta(seconds=seconds))
        except (RuntimeError, dist.DistError) as error:
            raise CollectiveTimeoutError(f"could not open the Gloo group between nodes within {seconds:.0f} s: "
                                         f"{error}") from None
        return cls(group, store, rank, size)

    def __init__(self, group, store, rank, size):
        self.group, self.store = group, store
        self.rank, self.size = rank, size
        self._signature = np.zeros(1, np.int64)
        self._aborted = None     # (error class, message): raised from now on
        # One thread blocks in Gloo's waits, so that the caller's can watch.
        self._waiter = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="collectives-link")
        self._orphans = []       # works and buffers of failed exchanges: Gloo may still hold them

    # -- health ------------------------------------------------------------------

    def begin(self, signature):
        """Start a call whose signature is `signature`; raise if this link was
        aborted. (A peer's abort is read from the store while waiting, not
        here: that costs a round trip to the store.)"""
        self._raise_if_aborted()
        self._signature[0] = signature

    def check_health(self):
        """Raise if this communicator was aborted, here or by another rank."""
        if self._aborted is None and self.store.check([ABORT_KEY]):
            text = self.store.get(ABORT_KEY).decode(errors="replace")
            kind, reason = (int(text[0]), text[1:]) if text[:1].isdigit() else (0, text)
            self._aborted = (class_of_kind(kind), f"a rank aborted the communicator: {reason}")
        self._raise_if_aborted()

    def _raise_if_aborted(self):
        if self._aborted is not None:
            kind, message = self._aborted
            raise kind(message)

    def abort(self, error, unreachable=()):   # (the store reaches every rank that is left: no one is skipped)
        """Tell every other rank that this communicator cannot go on: the
        first abort record in the store stays (a later one, caused by it, would
        hide the reason)."""
        if self._aborted is not None:
            return
        self._aborted = (class_of_kind(kind_of(error)),
                         f"this communicator was aborted: {type(error).__name__}: {error}")
        record = f"{kind_of(error)}{type(error).__name__} on rank {self.rank}: {error}".encode()[:REASON_BYTES]
        try:
            self.store.compare_set(ABORT_KEY, "", record)
        except (RuntimeError, dist.DistError):
            pass   # the store is gone too: the peers see our connections close, or time out

    # -- moving bytes ----------------------------------------------------------------

    def exchange(self, sends, receives, deadline, what):
        """Send each (peer, array) of `sends` and fill each (peer, array) of
        `receives`, all at once; return when all are done. Arrays are
        contiguous; between two ranks, the sender's list and the receiver's
        list name their messages in the same order."""
        sources = list(dict.fromkeys(peer for peer, _ in receives))
        targets = list(dict.fromkeys(peer for peer, _ in sends))
        heard = np.zeros(len(sources), np.int64)
        signature = self._signature.copy()   # a later call's begin() may change ours while Gloo still sends it
        group = self.group
        works = []
        try:   # Gloo raises at once, not in the wait, where a peer's connection is already closed
            works += [group.recv([_tensor(heard[i:i + 1])], peer, DATA_TAG) for i, peer in enumerate(sources)]
            works += [group.recv([_tensor(a)], peer, DATA_TAG) for peer, a in receives if a.size]
            works += [group.send([_tensor(signature)], peer, DATA_TAG) for peer in targets]
            works += [group.send([_tensor(a)], peer, DATA_TAG) for peer, a in sends if a.size]
        except (RuntimeError, dist.DistError) as error:
            self._orphans.append((works, heard, signature, sends, receives))
            self._raise_gloo_error(error, what, sources)
        waited = self._waiter.submit(_wait_all, works, deadline)
        try:
            self._watch(waited, deadline, what, sources)
        except BaseException:
            self._orphans.append((works, heard, signature, sends, receives))
            raise
        wrong = [peer for peer, theirs in zip(sources, heard) if theirs != signature[0]]
        if wrong:
            raise InvalidUsageError(
                f"rank {wrong[0]} is in a different call from rank {self.rank}'s {what}; every rank must make "
                "the same calls in the same order")

    def _watch(self, waited, deadline, what, sources):
        """Until Gloo's waits are done: look at the abort record every
        HEALTH_EVERY seconds and at the deadline."""
        while True:
            done, _ = concurrent.futures.wait([waited], timeout=HEALTH_EVERY)
            if done:
                break
            self.check_health()
            if time.perf_counter() >= deadline:
                raise CollectiveTimeoutError(
                    f"timed out waiting for rank(s) {', '.join(map(str, sources)) or '-'} on other nodes in "
                    f"{what} (is every rank making the same calls?)")
        error = waited.exception()
        if error is None:
            return
        self._raise_gloo_error(error, what, sources)

    def _raise_gloo_error(self, error, what, sources):
        """Gloo's failure as our typed error (a peer's abort record, if any, first)."""
        self.check_health()   # a peer's abort explains the failure better than Gloo's words
        message = str(error)
        if _PEER_GONE in message:
            raise RankFailedError(f"a rank on another node died during {what} (Gloo: {message.splitlines()[0]})")
        if "Timed out" in message or "timeout" in message.lower():
            raise CollectiveTimeoutError(
                f"timed out waiting for rank(s) {', '.join(map(str, sources)) or '-'} on other nodes in {what} "
                f"(is every rank making the same calls?)")
        raise CollectiveError(f"Gloo failed during {what}: {message}")

    def close(self):
        """Stop the waiting thread (not waiting for it when an exchange
        failed: it ends at that exchange's deadline)."""
        self._waiter.shutdown(wait=not self._orphans and self._aborted is None)
        self.group = None


def _wait_all(works, deadline):
    for work in works:
        work.wait(datetime.timedelta(seconds=max(deadline - time.perf_counter(), 1e-3)))


def _tensor(array):
    """A byte tensor sharing `array`'s memory (contiguous). Arrays that are
    only sent may be read-only, which torch warns about and Gloo never writes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array.reshape(-1).view(np.uint8))
