"""Collectives captured once and replayed: `Communicator.graph()`.

A call on GPU ranks costs host time (checks, the plan's launches through
the driver) every time it is made; a CUDA graph of it replays the same
launches with one. So a sequence of calls on fixed arrays, a training
step's allreduces for instance, is captured once:

    for step in range(2):            # warm-up: kernels compiled, workspaces made
        comm.allreduce(grads)
    with comm.graph() as graph:      # captured, not run
        comm.allreduce(grads)
    graph.replay()                   # runs them; as often as wanted

What a graph holds is the launches as they were issued: the arrays'
addresses, the plan, the algorithm. So it replays on the same memory (write
new values into the arrays, do not rebind them to new arrays), and it is
valid while the communicator is open. Every local rank must share one
device (CUDA cannot capture across devices), and only calls of that
communicator may be made while capturing. GPU ranks in separate processes
capture the calls of the one-kernel path (COLLECTIVES_ONE_KERNEL_ALLREDUCE=1,
executors/device_protocol.py), whose kernels count their calls in device
memory; every rank must capture and replay the same calls. On emulated devices a graph is
the recorded queue of kernels, run on replay: the same rules, testable on
a CPU.
"""

from .errors import CollectiveError, InvalidUsageError


class Graph:
    """Captured collectives (see the module doc); `replay()` runs them.
    `replay`: how the ranks replay a graph, device.replay by default (GPU
    ranks in separate processes order it after their previous call and
    check for a kernel that gave up: DeviceProcessRank.replay_graph)."""

    def __init__(self, comm, device, replay=None):
        self._comm = comm
        self._device = device
        self._replay = replay or device.replay
        self._graph = None

    def replay(self):
        """Issue every captured call again on the current stream, as one
        graph launch. Returns at once on a GPU, like the calls themselves.

        Raises InvalidUsageError while the capture is still open, when it
        failed, or when the communicator was closed.
        """
        if self._graph is None:
            raise InvalidUsageError("graph: nothing to replay: the `with comm.graph()` block has not ended, "
                                    "or it ended with an error")
        if self._comm.closed:
            raise InvalidUsageError("graph: its communicator was closed, and with it the memory the graph uses")
        self._replay(self._graph)


class Capture:
    """The context manager `Communicator.graph()` returns."""

    def __init__(self, comm, device, replay=None):
        self._device = device
        self._graph = Graph(comm, device, replay)
        self._capture = None

    def __enter__(self):
        self._capture = self._device.begin_capture()
        return self._graph

    def __exit__(self, kind, error, traceback):
        capture, self._capture = self._capture, None
        if error is None:
            self._graph._graph = self._device.end_capture(capture)
            return False
        try:
            self._device.end_capture(capture)   # discarded: what failed half-way is no graph
        except Exception:   # noqa: BLE001 - a broken capture ends in its own error; the caller's comes first
            pass
        if isinstance(error, CollectiveError):
            return False
        raise CollectiveError(
            f"graph: the capture failed: {error}. A call made for the first time compiles kernels and allocates "
            "memory, which CUDA refuses while capturing: make each call once before capturing it") from error
