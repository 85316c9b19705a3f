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
