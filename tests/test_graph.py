"""comm.graph(): calls captured once and replayed, on emulated devices (the
CUDA adapter records a CUDA graph the same way; tests/test_gpu.py)."""

import numpy as np
import pytest

import collectives
from collectives import CollectiveError, InvalidUsageError


def ranks_on_one_device(n=4):
    return collectives.Communicator.local(n, devices=["emulated:0"] * n)


def test_captured_calls_run_only_when_replayed_and_see_new_values_each_time():
    with ranks_on_one_device() as comm:
        xs = [np.full(1000, r + 1, np.float32) for r in range(4)]
        outs = [np.zeros(1000, np.float32) for _ in range(4)]
        ys = [np.arange(64, dtype=np.int32) * (r + 1) for r in range(4)]
        comm.allreduce(xs, out=outs)       # warm-up
        comm.allreduce(ys, op="max")
        for r, (o, y) in enumerate(zip(outs, ys)):
            o[:] = -1
            y[:] = np.arange(64) * (r + 1)
        with comm.graph() as graph:
            comm.allreduce(xs, out=outs)
            comm.allreduce(ys, op="max")
        assert all((o == -1).all() for o in outs), "a captured call ran during the capture"
        assert np.array_equal(ys[0], np.arange(64, dtype=np.int32)), "a captured call ran during the capture"
        graph.replay()
        assert all((o == 10).all() for o in outs)
        assert all(np.array_equal(y, np.arange(64, dtype=np.int32) * 4) for y in ys)
        for r, x in enumerate(xs):
            x[:] = 2 * (r + 1)               # new values in the same arrays
        graph.replay()
        graph.replay()
        assert all((o == 20).all() for o in outs)


def test_a_call_made_for_the_first_time_inside_the_capture_replays_too():
    """Emulated devices allow what CUDA refuses while capturing (allocation),
    so the warm-up the docs ask for is a CUDA matter; the bits are the same."""
    with ranks_on_one_device(3) as comm:
        xs = [np.full(33, r, np.float64) for r in range(3)]
        with comm.graph() as graph:
            comm.allreduce(xs, op="sum", algorithm="ring")
        assert all((x == r).all() for r, x in enumerate(xs))
        graph.replay()
        assert all((x == 3).all() for x in xs)


def test_graphs_need_every_rank_on_one_device():
    with collectives.Communicator.local(2) as host:
        with pytest.raises(InvalidUsageError, match="^graph: capturing needs every local rank on one device"):
            host.graph()
    with collectives.Communicator.local(2, devices=["emulated:0", "emulated:1"]) as two:
        with pytest.raises(InvalidUsageError, match="on 2 devices"):
            two.graph()


def test_a_failed_capture_leaves_nothing_to_replay_and_the_device_usable():
    with ranks_on_one_device(2) as comm:
        xs = [np.ones(8, np.float32) for _ in range(2)]
        with pytest.raises(InvalidUsageError, match="^op:"):
            with comm.graph() as graph:
                comm.allreduce(xs, op="add")
        with pytest.raises(InvalidUsageError, match="nothing to replay"):
            graph.replay()
        with pytest.raises(CollectiveError, match="capture failed: boom"):
            with comm.graph():
                raise RuntimeError("boom")
        comm.allreduce(xs)                   # the device's own stream is current again and runs
        assert all((x == 2).all() for x in xs)


def test_a_graph_outlives_no_communicator():
    comm = ranks_on_one_device(2)
    xs = [np.ones(8, np.float32) for _ in range(2)]
    comm.allreduce(xs)
    with comm.graph() as graph:
        comm.allreduce(xs)
    comm.close()
    with pytest.raises(InvalidUsageError, match="closed"):
        graph.replay()
