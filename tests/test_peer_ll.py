"""The one-kernel collectives between ranks on several devices of one
process (executors/peer_ll.py), on emulated devices, one rank each.

A small call must be one ll_allreduce launch per device and nothing else
(no plan_step launch, no event), give the interpreter's bits for every
collective, in place and out of place, interleave with the event path's
calls, and fail loudly, never hang: a kernel that waits past the timeout
raises CollectiveTimeoutError naming the rank it waited for, a launch that
fails partway stops the kernels already launched at once, and the path
refuses every later call.
"""

import time

import numpy as np
import pytest

import collectives
from cases import capacity, expected, rank_input
from collectives import CollectiveError, CollectiveTimeoutError, InvalidUsageError
from collectives.config import ONE_KERNEL_ALLREDUCE_ENV
from collectives.devices.emulated import EmulatedDevice

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")
CASES = [(np.dtype(np.float32), "sum"), (np.dtype(np.float16), "avg"), (np.dtype(np.int8), "max"),
         (np.dtype(np.float64), "prod"), (np.dtype("int32"), "min"), (collectives.ops.BFLOAT16, "sum")]


@pytest.fixture
def one_kernel(monkeypatch):
    monkeypatch.setenv(ONE_KERNEL_ALLREDUCE_ENV, "1")


def communicator(n, timeout=None):
    return collectives.Communicator.local(n, devices=[f"emulated:{r}" for r in range(n)], timeout=timeout)


class Issued:
    """What the emulated devices are asked to queue, by kind, while counting."""

    KINDS = ("launch_ll_allreduce", "launch_step", "launch_copies", "record", "wait")

    def __init__(self, monkeypatch):
        self.counts = dict.fromkeys(self.KINDS, 0)
        for kind in self.KINDS:
            original = getattr(EmulatedDevice, kind)

            def counted(device, *args, kind=kind, original=original, **kwargs):
                self.counts[kind] += 1
                return original(device, *args, **kwargs)

            monkeypatch.setattr(EmulatedDevice, kind, counted)

    def take(self):
        counts, self.counts = self.counts, dict.fromkeys(self.KINDS, 0)
        return counts


class Arrays:
    """Every rank's input and output of one call, in place or not, as the API takes them."""

    def __init__(self, n, collective, dtype, count, in_place):
        self.elements = n * count if collective == "reduce_scatter" else count
        if collective in ("broadcast", "reduce") or (collective == "allreduce" and in_place):
            self.xs = [np.empty(count, dtype) for _ in range(n)]
            self.outs = None
        elif collective == "reduce_scatter":
            self.xs = [np.empty(n * count, dtype) for _ in range(n)]
            self.outs = [x[r * count:(r + 1) * count] if in_place else np.empty(count, dtype)
                         for r, x in enumerate(self.xs)]
        elif collective == "allgather":
            self.outs = [np.empty(n * count, dtype) for _ in range(n)]
            self.xs = [out[r * count:(r + 1) * count] if in_place else np.empty(count, dtype)
                       for r, out in enumerate(self.outs)]
        else:
            self.xs, self.outs = [np.empty(count, dtype) for _ in range(n)], [np.empty(count, dtype) for _ in range(n)]

    def call(self, comm, collective, op, root):
        if collective == "allreduce":
            return comm.allreduce(self.xs, op=op, out=self.outs)
        if collective == "reduce_scatter":
            return comm.reduce_scatter(self.xs, op=op, out=self.outs)
        if collective == "allgather":
            return comm.allgather(self.xs, out=self.outs)
        if collective == "broadcast":
            return comm.broadcast(self.xs, root=root)
        return comm.reduce(self.xs, root=root, op=op)


def fill(xs, seed, dtype):
    """Write each rank's random input (cases.rank_input) into its array; returns the inputs."""
    inputs = [rank_input(seed, q, dtype, x.size) for q, x in enumerate(xs)]
    for x, values in zip(xs, inputs):
        x[...] = values
    return inputs


def check_call(comm, reference, arrays, collective, dtype, op, root, seed):
    """Fill the inputs, call, compare every rank's result with the interpreter's direct plan."""
    n = comm.size
    inputs = fill(arrays.xs, seed, dtype)
    results = arrays.call(comm, collective, op, root)
    want = expected(reference, collective, inputs, op, root, "direct")
    for r in range(n):
        if collective == "reduce" and r != root:
            continue   # only the root's result is defined
        case = f"{collective} {dtype} {op} elements={arrays.elements} root={root} rank {r}"
        assert results[r].tobytes() == want[r].tobytes(), f"{case}: {results[r][:6]} != {want[r][:6]}"


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_collective_is_one_launch_per_device_with_the_interpreters_bits(one_kernel, monkeypatch, n):
    issued = Issued(monkeypatch)
    with communicator(n) as comm, collectives.Communicator.local(n) as reference:
        assert comm._ranks.peer_ll is not None   # noqa: SLF001
        for k, collective in enumerate(COLLECTIVES):
            for j, (dtype, op) in enumerate(CASES):
                for count in (1, 13 + j, capacity(collective, n, dtype)):
                    for in_place in (False, True):
                        arrays = Arrays(n, collective, dtype, count, in_place)
                        root = (j + in_place) % n
                        for repeat in range(2):   # the second call takes the bound path
                            issued.take()
                            check_call(comm, reference, arrays, collective, dtype, op, root,
                                       seed=[k, j, count, in_place, repeat])
                            assert issued.take() == {"launch_ll_allreduce": n, "launch_step": 0, "launch_copies": 0,
                                                     "record": 0, "wait": 0}, (collective, dtype, count, in_place)
        plan = comm._plan("allreduce", np.dtype(np.float32), 13, "sum", 0, "auto", collectives.binding.OUT_OF_PLACE)  # noqa: SLF001
        assert comm._ranks.launches(plan) == (1,) * n   # noqa: SLF001


def test_small_and_large_calls_interleave_on_the_same_arrays(one_kernel, monkeypatch):
    """Calls past the LL (the event path) between one-kernel calls, on the
    same arrays and on others, in a random order: every result right, and
    each small call still one launch a device."""
    n, dtype = 3, np.dtype(np.float32)
    small = capacity("allreduce", n, dtype)
    issued = Issued(monkeypatch)
    rng = np.random.default_rng(5)
    with communicator(n) as comm, collectives.Communicator.local(n) as reference:
        shared = [np.empty(small + 1, dtype) for _ in range(n)]
        for i in range(30):
            count = int(rng.choice([7, small, small + 1, 3 * small]))
            xs = [a[:count] for a in shared] if count <= small + 1 else [np.empty(count, dtype) for _ in range(n)]
            inputs = fill(xs, i, dtype)
            issued.take()
            comm.allreduce(xs)
            counts = issued.take()
            want = expected(reference, "allreduce", inputs, "sum", 0, "direct")
            for r in range(n):
                assert xs[r].tobytes() == want[r].tobytes(), (i, count, r)
            one_kernel_call = count <= small
            assert (counts["launch_ll_allreduce"] == n and counts["record"] == 0) == one_kernel_call, (count, counts)


def test_without_the_setting_small_calls_take_the_event_path(monkeypatch):
    monkeypatch.delenv(ONE_KERNEL_ALLREDUCE_ENV, raising=False)
    issued = Issued(monkeypatch)
    with communicator(2) as comm:
        assert comm._ranks.peer_ll is None   # noqa: SLF001
        xs = [np.ones(8, np.float32) for _ in range(2)]
        comm.allreduce(xs)
        assert xs[1].tolist() == [2.0] * 8
        counts = issued.take()
        assert counts["launch_ll_allreduce"] == 0 and counts["launch_step"] >= 2 and counts["wait"] > 0


def test_two_ranks_sharing_a_device_keep_the_event_path(one_kernel):
    """One kernel per rank would queue two waiting kernels on one stream."""
    with collectives.Communicator.local(4, devices=["emulated:0", "emulated:1"] * 2) as comm:
        assert comm._ranks.peer_ll is None   # noqa: SLF001


def test_a_switched_stream_is_ordered_after_the_previous_call(one_kernel, monkeypatch):
    issued = Issued(monkeypatch)
    n = 2
    with communicator(n) as comm, collectives.Communicator.local(n) as reference:
        devices = comm._ranks.devices   # noqa: SLF001
        xs = [np.empty(9, np.float32) for _ in range(n)]
        for call in range(4):
            if call == 2:
                for device in devices:
                    device._current = device.new_stream()   # noqa: SLF001 - the caller made another stream current
            inputs = fill(xs, call, np.dtype(np.float32))
            issued.take()
            comm.allreduce(xs)
            counts = issued.take()
            want = expected(reference, "allreduce", inputs, "sum", 0, "direct")
            assert all(xs[r].tobytes() == want[r].tobytes() for r in range(n))
            switched = n if call == 2 else 0   # one event from the old stream to the new, per device
            assert (counts["record"], counts["wait"]) == (switched, switched), (call, counts)
        assert {comm._ranks.peer_ll.generation(r) for r in range(n)} == {4}   # noqa: SLF001


def without_launch(monkeypatch, rank, error=None):
    """Rank `rank`'s kernel is never launched (its launch raises `error`,
    if given); returns what puts the launch back."""
    original = EmulatedDevice.launch_ll_allreduce

    def launch(device, stream, instance, args):
        if args.rank != rank:
            return original(device, stream, instance, args)
        if error is not None:
            raise error

    monkeypatch.setattr(EmulatedDevice, "launch_ll_allreduce", launch)
    return lambda: monkeypatch.setattr(EmulatedDevice, "launch_ll_allreduce", original)


def test_a_rank_whose_kernel_never_runs_times_out_naming_it(one_kernel, monkeypatch):
    n = 3
    with communicator(n, timeout=0.5) as comm:
        xs = [np.ones(16, np.float32) for _ in range(n)]
        comm.allreduce(xs)
        put_back = without_launch(monkeypatch, 2)
        start = time.perf_counter()
        with pytest.raises(CollectiveTimeoutError, match=r"waiting for rank 2 \(on emulated:2\)"):
            comm.allreduce(xs)
        assert time.perf_counter() - start < 5.0
        put_back()
        with pytest.raises(CollectiveError, match="aborted"):
            comm.allreduce(xs)


def test_a_launch_that_fails_partway_stops_the_kernels_launched(one_kernel, monkeypatch):
    n = 3
    with communicator(n, timeout=60) as comm:
        xs = [np.ones(16, np.float32) for _ in range(n)]
        comm.allreduce(xs)
        put_back = without_launch(monkeypatch, 1, RuntimeError("no launch for rank 1"))
        with pytest.raises(RuntimeError, match="no launch for rank 1"):
            comm.allreduce(xs)
        put_back()
        start = time.perf_counter()
        with pytest.raises(CollectiveError, match="aborted: a launch of "):
            comm.synchronize()   # rank 0's kernel, queued, runs now: it stops for the abort, not the 60 s
        assert time.perf_counter() - start < 5.0
        with pytest.raises(CollectiveError, match="aborted"):
            comm.allreduce(xs)


def test_a_prepared_call_made_first_runs_with_the_communicators_timeout(one_kernel):
    n = 3
    with communicator(n, timeout=30) as comm, collectives.Communicator.local(n) as reference:
        xs = [np.empty(11, np.float32) for _ in range(n)]
        step = comm.prepare("allreduce", xs)   # bound before any call was made
        for call in range(3):
            inputs = fill(xs, call, np.dtype(np.float32))
            step()
            want = expected(reference, "allreduce", inputs, "sum", 0, "direct")
            assert all(xs[r].tobytes() == want[r].tobytes() for r in range(n))


def test_a_new_timeout_applies_to_the_calls_after(one_kernel, monkeypatch):
    """Repeated calls (bound launches) and prepared ones take the
    communicator's timeout when they are issued, not when they were bound."""
    n = 3
    with communicator(n, timeout=30) as comm:
        xs = [np.ones(16, np.float32) for _ in range(n)]
        step = comm.prepare("allreduce", xs)
        step()               # its launches made, with 30 s
        comm.timeout = 0.5
        without_launch(monkeypatch, 2)
        start = time.perf_counter()
        with pytest.raises(CollectiveTimeoutError, match="timed out after 0.5 s waiting for rank 2"):
            step()
        assert time.perf_counter() - start < 5.0


def test_a_call_on_a_closed_path_writes_nothing(one_kernel):
    n = 2
    with communicator(n) as comm:
        xs = [np.ones(4, np.float32) for _ in range(n)]
        comm.allreduce(xs)
        comm._ranks.abort("a test stops it")   # noqa: SLF001
        before = [x.copy() for x in xs]
        with pytest.raises(CollectiveError, match="a test stops it"):
            comm.allreduce(xs)
        assert all(np.array_equal(x, b) for x, b in zip(xs, before))


def test_graphs_of_several_devices_are_refused(one_kernel):
    with communicator(2) as comm:
        with pytest.raises(InvalidUsageError, match="2 devices"):
            with comm.graph():
                pass
