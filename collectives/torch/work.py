"""The work objects our process group returns (process_group.py).

torch.distributed hands back, for every collective, a `Work` with `wait()`
and `get_future()`; DDP's reducer and FSDP read the future (from C++), user
code calls wait(). Two facts of torch 2.13 shape this module:

- A Python `Future.set_exception` stores the exception as the future's
  *value*, with a function that raises it when Python asks: C++ sees a
  completed future holding a Python object, and DDP, which reads it as a
  list of tensors, crashes. So a failed call's future is made failed in
  C++: the child of a completed future whose callback raises, which C++
  marks with the error. DDP's backward then raises a RuntimeError naming
  our error (its class and message).
- `_create_work_from_future` swallows a failed future's error in wait().
  So `Work` is our own subclass, whose wait() raises the typed error
  itself (CollectiveTimeoutError, RankFailedError, InvalidUsageError...).

Calls on host ranks complete before they return, and calls on GPU ranks
are queued on the caller's current stream before they return, as NCCL's
are: a work is done when it is made, and wait() only reports.
"""

import torch
import torch.distributed as dist


class Work(dist._Work):
    """A finished call: `result` (what its future holds: the tensors it
    wrote) or `error`."""

    def __init__(self, result=(), error=None):
        super().__init__()
        self._error = error
        self._result = result
        self._future = None   # made when asked for (DDP and FSDP ask; a blocking dist.* call does not)

    def wait(self, timeout=None):
        """Return True, or raise the call's error (a collectives error)."""
        if self._error is not None:
            raise self._error
        return True

    def get_future(self):
        if self._future is None:
            if self._error is None:
                self._future = torch.futures.Future()
                self._future.set_result(list(self._result))
            else:
                self._future = failed_future(self._error)
        return self._future

    def is_completed(self):
        return True

    def is_success(self):
        return self._error is None

    def exception(self):
        return self._error

    def result(self):
        return list(self._result) if self._error is None else []

    def synchronize(self):
        self.wait()


def failed_future(error):
    """A future that C++ sees failed with `error` (see the module doc)."""
    parent = torch.futures.Future()

    def fail(_):
        raise error

    child = parent.then(fail)
    parent.set_result(None)
    return child


class PendingWork(Work):
    """A send or receive in flight (a transport.p2p.Request): wait() moves
    it to its end under the group's `lock` (and with it every pending
    message of this rank), then runs `finish` (a receive's copy into a
    non-contiguous tensor). `keep` holds the memory the request reads or
    writes until then."""

    def __init__(self, request, lock, result, keep, finish=None):
        super().__init__(result)
        self._request, self._lock, self._keep, self._finish = request, lock, keep, finish

    def wait(self, timeout=None):
        """Return True once done, or raise its error (the group's timeout
        applies: torch's `timeout` here is not looked at)."""
        if self._error is None and self._keep is not None:
            from ..errors import CollectiveError
            with self._lock:
                try:
                    self._request.wait()
                    if self._finish is not None:
                        self._finish()
                except CollectiveError as error:
                    self._error = error
            self._keep = self._finish = None
        return super().wait()

    def get_future(self):
        """A future of the finished call: asking for it waits for the call."""
        try:
            self.wait()
        except Exception:   # noqa: BLE001 - the future carries it (Work.get_future)
            pass
        return super().get_future()

    def is_completed(self):
        return self._keep is None or self._request.test()

    def _source_rank(self):
        """The rank a received message came from (dist.recv without src reads it)."""
        return self._request.source
