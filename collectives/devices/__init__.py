"""Devices: what the GPU executor (executors/device.py) runs on.

Two implementations of one small interface, so that everything above it is
the same code on a real GPU and on a CPU:

    cuda.CudaDevice          a CUDA GPU, through CuPy (the only code here that needs one;
                             dry_cuda.py runs it on stand-ins for CuPy, without a GPU)
    emulated.EmulatedDevice  the same kernels compiled for the CPU, with streams and events

The interface, duck-typed:

    name                     "cuda:0", "emulated:1"
    array_location           where its ranks' arrays live, as ArrayInfo.device says it ("cuda:0", "host")
    resident_blocks          step-kernel blocks the device runs at once (sizes grids)
    allocate(nbytes)         device memory; the returned object's .address is valid while it lives
    upload(array)            a device copy of a host int64 array, complete before any later launch
    current_stream()         the caller's current stream on this device
    launch_step(stream, instance, grid, table, width, addresses, divisor, fanout=1)
                             plan_step<instance> over grid = (blocks per row, rows / fanout):
                             groups of `fanout` rows that share their sources (plan_step.cu)
    launch_copies(stream, table, rows, grid=None)
                             batched_copy: copies every (src, dst, nbytes) row of
                             `table` (memory from upload, kernels.copy_table's
                             layout) in one launch; grid defaults to
                             kernels.copy_grid(None, rows, resident_blocks).
                             Checks rows and the table's size before queuing;
                             0 rows launches nothing
    buffer_block(), step_launcher(instance, grid, table, width, divisor, block, fanout=1)
                             optional, a prepared launch_step (executors/device.py's
                             launch record): issue(stream) launches with the
                             addresses block.update(addresses) last put in `block`.
                             Without them the executor calls launch_step
    new_event(), record(event, stream), wait(stream, event)
                             cross-stream ordering with CUDA's semantics: a wait
                             is for the most recent record before it
    begin_capture(), end_capture(capture), replay(graph)
                             CUDA graphs: make a new stream current and record
                             what is issued on it (nothing runs), then the graph,
                             issued on the current stream by replay
    query(event)             whether the work before the event's latest record is done
    use()                    make it the calling thread's current device (init does, for its rank)
    enable_peer_access(other), is_capturing(stream), synchronize()
    call_returned()          a collective is about to return to its caller

and, for ranks in other processes (executors/device_process.py), memory
they can open, exchanged as a handle of at most 64 bytes:

    allocate_shared(nbytes, name)   memory with .address and .handle; `name`
                                    starts with the communicator's prefix
                                    (the emulated device names its file so)
    open_shared(handle)             a peer's memory, mapped here (.address)
    release_shared(memory, own)     free one's own, or unmap a peer's

Device specs, as `Communicator.local(devices=...)` takes them: an int or
"cuda:N" for a GPU, "emulated" or "emulated:N" for an emulated device.
"""

import re

from ..errors import InvalidUsageError

_SPEC = re.compile(r"^(cuda|emulated)(?::(\d+))?$")
_OPEN = {}  # (kind, index) -> device: one object per device per process


def parse_spec(spec):
    """(kind, index) of a device spec."""
    if isinstance(spec, bool):
        raise InvalidUsageError(f"a device is an int or a name like 'cuda:0' or 'emulated:1', got {spec!r}")
    if isinstance(spec, int):
        kind, index = "cuda", spec
    else:
        match = _SPEC.match(str(spec).strip().lower()) if isinstance(spec, str) else None
        if match is None:
            raise InvalidUsageError(f"a device is an int or a name like 'cuda:0' or 'emulated:1', got {spec!r}")
        kind, index = match[1], int(match[2] or 0)
    if index < 0:
        raise InvalidUsageError(f"device index must be >= 0, got {spec!r}")
    return kind, index


def device_for_rank(spec, local_rank):
    """The device of one rank per process: "cuda" is GPU local_rank modulo
    the GPUs this process sees (so several processes may share one GPU),
    "emulated" is emulated device local_rank; "cuda:N", "emulated:N" and an
    int name one."""
    if isinstance(spec, str) and spec.strip().lower() == "emulated":
        return open_device(f"emulated:{local_rank}")
    if isinstance(spec, str) and spec.strip().lower() == "cuda":
        from .cuda import visible_gpus
        return open_device(local_rank % visible_gpus())
    return open_device(spec)


def open_device(spec):
    """The process-wide device object for `spec`."""
    key = parse_spec(spec)
    device = _OPEN.get(key)
    if device is None:
        kind, index = key
        if kind == "emulated":
            from .emulated import EmulatedDevice
            device = EmulatedDevice(index)
        else:
            from .cuda import CudaDevice
            device = CudaDevice(index)
        _OPEN[key] = device
    return device
