"""The dry CUDA adapter (devices/dry_cuda.py): the real devices/cuda.py on
stand-ins for CuPy, so that CI runs, and bench.call_overhead times, every
line of ours that a call on a GPU runs. These tests check that it really
goes through the adapter: the stand-in driver is asked for exactly the
launches the plan has, for every collective, in place and out of place, on
one device and on two (where the adapter records and waits for events)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import collectives
from collectives import InvalidUsageError, arrays
from collectives.devices.cuda import CudaDevice
from collectives.devices.dry_cuda import DryArray, DryMemory, dry_devices
from collectives.executors.device import DeviceRanks

ROOT = Path(__file__).resolve().parents[1]
N = 4


def dry_communicator(ndevices):
    dry, devices = dry_devices(ndevices)
    ranks = DeviceRanks([devices[r % ndevices] for r in range(N)])
    return dry, collectives.Communicator(ranks, size=N, local_ranks=range(N), timeout=10.0)


def on_rank_device(dry, count):
    """One DryArray per rank, each on its rank's device."""
    made = []
    for r in range(N):
        with dry.cuda.Device(r % dry.ndevices):
            made.append(dry.empty(count, np.float32))
    return made


def calls(dry, count):
    """Every collective, in place and out of place, on DryArrays."""
    xs, outs = on_rank_device(dry, count), on_rank_device(dry, count)
    blocks = [o[:count // N] for o in outs]
    return {
        "allreduce in place": lambda comm, a: comm.allreduce(xs, algorithm=a),
        "allreduce": lambda comm, a: comm.allreduce(xs, out=outs, algorithm=a),
        "reduce_scatter": lambda comm, a: comm.reduce_scatter(xs, out=blocks, algorithm=a),
        "reduce_scatter in place": lambda comm, a: comm.reduce_scatter(xs, algorithm=a),
        "allgather": lambda comm, a: comm.allgather([x[:count // N] for x in xs], out=outs, algorithm=a),
        "broadcast": lambda comm, a: comm.broadcast(xs, root=1, algorithm=a),
        "reduce": lambda comm, a: comm.reduce(xs, root=2, algorithm=a),
    }


@pytest.mark.parametrize("ndevices", [1, 2])
@pytest.mark.parametrize("algorithm", ["ring", "direct", "auto"])
def test_the_stand_in_driver_launches_what_the_plan_has(ndevices, algorithm):
    dry, comm = dry_communicator(ndevices)
    assert all(type(d).launch_step is CudaDevice.launch_step for d in comm._ranks.devices)
    for name, call in calls(dry, 4 * N).items():
        call(comm, algorithm)   # the first call plans; repeats take the repeated-call path
        before = dry.launches
        for _ in range(3):
            call(comm, algorithm)
        planned = {id(p): p for p in comm._plans.values()}
        launches = [sum(comm._ranks.launches(p)) for p in planned.values()]
        assert (dry.launches - before) % 3 == 0 and (dry.launches - before) // 3 in launches, name
        assert dry.launches > before, name
        comm._plans.clear()
    comm.close()


def test_dry_arrays_are_described_as_cupy_arrays_and_checked_as_such():
    dry, comm = dry_communicator(1)
    x = dry.empty((2, 8), np.float16)
    info = arrays.describe(x)
    assert (info.library, info.device, info.shape, info.size, info.address) == \
        ("cupy", "cuda:0", (2, 8), 16, x.data.ptr)
    elsewhere = DryArray((8,), np.float32, DryMemory(x.data.ptr + 4096, 32, device=1))
    with pytest.raises(InvalidUsageError, match=r"x\[3\] is in cuda:1, but local rank 3 lives on cuda:0"):
        comm.allreduce([dry.empty(8, np.float32) for _ in range(3)] + [elsewhere])
    with pytest.raises(InvalidUsageError, match="host memory"):
        comm.allreduce([np.ones(8, np.float32)] * N)
    comm.close()


def test_call_overhead_runs_the_cuda_adapter_dry():
    done = subprocess.run([sys.executable, "-m", "bench.call_overhead", "--adapter", "dry", "--calls", "200",
                           "--batch", "50", "--count", "256", "--algorithm", "ring",
                           "--collectives", "allreduce,allgather"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)["results"]
    # A ring over 4 ranks out of place: 3 reduce-scatter and 3 allgather steps.
    assert results["allreduce"]["launch_step_per_call"] == 6
    assert results["allgather"]["launch_step_per_call"] == 3
    assert all(r["median_us_per_call"] > 0 for r in results.values())


def test_each_call_launches_with_its_own_arrays_addresses():
    """The launch record's buffer-address block is patched when a call's
    arrays differ from the last call's (same shapes, other memory), and
    holds every rank's input and output address as the call passed them."""
    from collectives import kernels
    from collectives.binding import INPUT, OUTPUT
    dry, comm = dry_communicator(1)
    first, second, outs = on_rank_device(dry, 64), on_rank_device(dry, 64), on_rank_device(dry, 64)
    for xs in (first, second, first, first):
        comm.allreduce(xs, out=outs, algorithm="ring")
        (program,) = comm._ranks._programs.values()
        table = program.blocks[0]._table.reshape(kernels.MAX_RANKS, kernels.BUFFERS)
        assert list(table[:N, INPUT]) == [x.data.ptr for x in xs]
        assert list(table[:N, OUTPUT]) == [o.data.ptr for o in outs]
    comm.close()


def test_repeated_calls_on_device_arrays_skip_the_checks_until_an_array_changes(monkeypatch):
    from collectives import validation
    checked = []
    real = validation.rank_arrays
    monkeypatch.setattr(validation, "rank_arrays", lambda *a, **k: checked.append(1) or real(*a, **k))
    dry, comm = dry_communicator(1)
    xs = on_rank_device(dry, 64)
    for _ in range(5):
        comm.allreduce(xs, algorithm="ring")
    assert len(checked) == 1
    xs[2]._shape = (8, 8)   # what `a.shape = (8, 8)` does to a CuPy array: the same memory, reshaped
    with pytest.raises(InvalidUsageError, match=r"x\[2\] has shape \(8, 8\) but x\[0\] has \(64,\)"):
        comm.allreduce(xs, algorithm="ring")
    assert len(checked) == 2
    comm.close()


@pytest.mark.parametrize("ndevices", [1, 2])
def test_a_repeated_compressed_call_issues_prepared_codec_launches(monkeypatch, ndevices):
    """The codec launches of a compressed program are prepared once per set
    of buffers (executors/device.py, the codec launch record): a repeat
    issues them without preparing anything, new arrays prepare them again,
    and each time the driver gets the same launches, fewer than the
    operations (compression/kernels.py: batch_rows puts several in one)."""
    from collectives.compression import kernels as codecs
    dry, comm = dry_communicator(ndevices)
    prepared = []
    original = codecs.device_row
    monkeypatch.setattr(codecs, "device_row", lambda *a: (prepared.append(a[0]), original(*a))[1])
    xs = on_rank_device(dry, 1024)
    launched = []
    for xs_now in (xs, xs, on_rank_device(dry, 1024)):
        before, prepared_before = dry.launches, len(prepared)
        comm.allreduce(xs_now, compression="fp16", algorithm="ring")
        launched.append((dry.launches - before, len(prepared) - prepared_before))
    (first, made_first), (repeat, made_repeat), (fresh, made_fresh) = launched
    assert first == repeat == fresh > 0
    assert made_first == made_fresh > first and made_repeat == 0


@pytest.mark.parametrize("compression", [None, "fp16"])
def test_a_repeated_call_launches_with_the_workspaces_that_replaced_its_own(compression):
    """A repeated call's launches are bound to its arrays' addresses and the
    ranks' workspaces (executors/device.py BoundProgram). When a larger call
    (uncompressed, or compressed: the codec path grows them too) replaces
    the workspaces, the repeat launches with the new ones, and each call
    with its own arrays."""
    from collectives import kernels
    from collectives.binding import INPUT, WORK
    dry, comm = dry_communicator(1)
    ranks = comm._ranks
    small, large = on_rank_device(dry, 64), on_rank_device(dry, 4096)
    for xs in (small, small, small, large, small, small):
        if xs is large:
            # both grow the workspaces (compressed direct on one device would need none)
            comm.allreduce(xs, algorithm="butterfly" if compression is None else "ring", compression=compression)
            continue
        comm.allreduce(xs, algorithm="butterfly")   # in place, butterfly goes through a workspace
        (program,) = [p for p in ranks._programs.values() if p.plan.count == xs[0].size]
        assert program.plan.workspace_bytes > 0
        table = program.blocks[0]._table.reshape(kernels.MAX_RANKS, kernels.BUFFERS)
        assert list(table[:N, WORK]) == [ranks._workspaces[r].address for r in range(N)]
        assert list(table[:N, INPUT]) == [x.data.ptr for x in xs]
    assert ranks._retired, "the large call replaced the small call's workspaces"
    comm.close()


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_compressed_direct_on_one_gpu_is_one_codec_round_sum_with_the_arrays(op):
    """The CUDA adapter's side of the one rounding pass (executors/device.py,
    rounds_in_one_pass): one launch of codec_round_sum<int8>, whose by-value
    CodecSumArgs name every rank's input in rank order, every output, the
    count and avg's divisor; and a repeat launches the same."""
    import ctypes

    from collectives import kernels
    from collectives.compression import kernels as codecs
    dry, comm = dry_communicator(1)
    launched = []

    def launch_kernel(function, gx, gy, gz, bx, by, bz, shared, stream, parameters, extra):
        args = codecs.CodecSumArgs.from_address(ctypes.cast(parameters, ctypes.POINTER(ctypes.c_void_p))[0])
        launched.append((function, (gx, gy), bx, list(args.inputs[:args.ninputs]), list(args.outputs[:args.noutputs]),
                         args.n, args.divisor))

    dry.cuda.driver.launchKernel = launch_kernel
    xs, outs = on_rank_device(dry, 1000), on_rank_device(dry, 1000)
    for _ in range(2):
        comm.allreduce(xs, out=outs, op=op, compression="int8")
    (device,) = comm._ranks.devices
    function = device._functions[kernels.CodecSumInstance(codecs.codec_id("int8"))]
    want = (function, (kernels.codec_grid(1000, device.resident_blocks), 1), kernels.CODEC_THREADS,
            [x.data.ptr for x in xs], [o.data.ptr for o in outs], 1000, 4.0 if op == "avg" else 0.0)
    assert launched == [want, want]
    comm.close()


@pytest.mark.parametrize("one_kernel", ["0", "1"])
def test_ranks_on_four_gpus_issue_what_their_path_needs(one_kernel):
    """The CUDA adapter on four pretend GPUs, a 1 KiB allreduce: the event
    path's 4 launches, 8 records and 24 waits; the one-kernel path's 4
    ll_allreduce launches (CudaDevice.ll_launcher) and nothing else."""
    done = subprocess.run([sys.executable, "-m", "bench.call_overhead", "--adapter", "dry", "--calls", "200",
                           "--batch", "50", "--count", "256", "--algorithm", "auto", "--ranks", "4", "--devices", "4"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, COLLECTIVES_ONE_KERNEL_ALLREDUCE=one_kernel))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)["results"]["allreduce"]
    issued = [result[f"{kind}_per_call"] for kind in ("launch_step", "launch_ll_allreduce", "record", "wait")]
    assert issued == ([0, 4, 0, 0] if one_kernel == "1" else [4, 0, 8, 24])
