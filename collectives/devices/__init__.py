"""Devices: what the GPU executors (executors/) run on.

Two implementations of one interface, `Device` below, so that everything
above it is the same code on a real GPU and on a CPU:

    cuda.CudaDevice          a CUDA GPU, through CuPy (the only code here that needs one;
                             dry_cuda.py runs it on stand-ins for CuPy, without a GPU)
    emulated.EmulatedDevice  the same kernels compiled for the CPU, with streams and events

As Gloo's transport classes (gloo/transport/device.h, pair.h) declare
every call the algorithms make on them, `Device` lists every method and
attribute the executors use on a device, each with what it must do; both
implementations subclass it, and tests/test_device_interface.py checks
that the executors use nothing else and that both implement all of it.
`PreparedLaunches` lists the optional prepared forms of some launches
(the CUDA adapter's), which the executors take where a device has them.

Device specs, as `Communicator.local(devices=...)` takes them: an int or
"cuda:N" for a GPU, "emulated" or "emulated:N" for an emulated device.
"""

import re

from ..errors import InvalidUsageError

class Device:
    """The interface of a device (see the module doc). Attributes:

    name              "cuda:0", "emulated:1"
    array_location    where its ranks' arrays live, as ArrayInfo.device says it ("cuda:0", "host")
    resident_blocks   step-kernel blocks the device runs at once (sizes grids)
    ll_grid_threads   threads of ll_allreduce's fixed grid: the state words of an LL area it uses
    """

    name: str
    array_location: str
    resident_blocks: int
    ll_grid_threads: int

    # -- memory --------------------------------------------------------------

    def allocate(self, nbytes):
        """Device memory of `nbytes`; the returned object's .address is valid while it lives."""
        raise NotImplementedError

    def upload(self, array):
        """Device memory holding a copy of a host int64 array, complete before any later launch."""
        raise NotImplementedError

    def download(self, address, nbytes):
        """`nbytes` of device memory at `address`, as bytes, once the device is idle."""
        raise NotImplementedError

    def empty(self, shape, dtype):
        """An uninitialised array of this device's ranks (CuPy; NumPy on the emulated device)."""
        raise NotImplementedError

    def from_host(self, array):
        """A copy of a NumPy array as an array of this device's ranks."""
        raise NotImplementedError

    def to_host(self, array):
        """A NumPy copy of an array of this device's ranks, after the current stream's work."""
        raise NotImplementedError

    # -- memory shared with ranks in other processes (device_process.py) ----------

    def allocate_shared(self, nbytes, name):
        """Memory peers can open: .address, and .handle (at most 64 bytes).
        `name` starts with the communicator's prefix (the emulated device
        names its segment so)."""
        raise NotImplementedError

    def open_shared(self, handle):
        """A peer's shared memory, mapped here (.address)."""
        raise NotImplementedError

    def release_shared(self, memory, own):
        """Free one's own shared memory (`own`), or unmap a peer's."""
        raise NotImplementedError

    def wrap_shared(self, memory, shape, dtype):
        """An array of `shape` and `dtype` at the start of one's own shared
        memory (symmetric memory, Communicator.alloc), holding it alive."""
        raise NotImplementedError

    def clear_shared(self, memory):
        """Zero memory (shared, or from allocate) before peers see it."""
        raise NotImplementedError

    def map_host(self, address, nbytes):
        """Page-lock `nbytes` of host memory at `address` and map it for the
        device's kernels; the address they use (the same, with unified addressing)."""
        raise NotImplementedError

    def unmap_host(self, address):
        """Undo map_host."""
        raise NotImplementedError

    # -- streams, events, graphs --------------------------------------------------

    def use(self):
        """Make it the calling thread's current device (init does, for its rank)."""
        raise NotImplementedError

    def current_stream(self):
        """The caller's current stream on this device."""
        raise NotImplementedError

    def new_event(self):
        """An event for record and wait."""
        raise NotImplementedError

    def record(self, event, stream):
        """Record `event` on `stream`."""
        raise NotImplementedError

    def wait(self, stream, event):
        """Make `stream` wait for the most recent record of `event` before this call (CUDA's semantics)."""
        raise NotImplementedError

    def query(self, event):
        """Whether the work before the event's latest record is done."""
        raise NotImplementedError

    def is_capturing(self, stream):
        """Whether `stream` is capturing a graph."""
        raise NotImplementedError

    def enable_peer_access(self, other):
        """Let this device's kernels read and write `other`'s memory."""
        raise NotImplementedError

    def begin_capture(self):
        """Make a new stream current and capture what is issued on it
        (nothing runs); the capture, for end_capture."""
        raise NotImplementedError

    def end_capture(self, capture):
        """Stop capturing, give the caller's stream back: the graph."""
        raise NotImplementedError

    def replay(self, graph):
        """Issue a captured graph on the current stream."""
        raise NotImplementedError

    def synchronize(self):
        """Return once every stream's work on the device is done."""
        raise NotImplementedError

    def call_returned(self):
        """A collective is about to return to its caller (the emulated
        device runs what was queued: its arrays are the caller's NumPy
        arrays, which the caller reads at once)."""
        raise NotImplementedError

    # -- kernels ----------------------------------------------------------------------

    def launch_step(self, stream, instance, grid, table, width, addresses, divisor, fanout=1):
        """plan_step<instance> over grid = (blocks per row, rows / fanout):
        groups of `fanout` rows that share their sources (plan_step.cu);
        `table` from upload, `addresses` a kernels.buffer_table."""
        raise NotImplementedError

    def launch_copies(self, stream, table, rows, grid=None):
        """batched_copy: every (src, dst, nbytes) row of `table` (memory from
        upload, kernels.copy_table's layout) in one launch; grid defaults to
        kernels.copy_grid(None, rows, resident_blocks). Checks rows and the
        table's size before queuing; 0 rows launches nothing."""
        raise NotImplementedError

    def launch_codec(self, stream, kernel, codec, args, divisor):
        """A codec kernel of kernels/codec.cu; `args` are compression.wire.Regions."""
        raise NotImplementedError

    def launch_codec_batch(self, stream, codec, rows):
        """One codec_batch of kernels/codec.cu: `rows` (compression/kernels.py) side by side."""
        raise NotImplementedError

    def launch_codec_round_sum(self, stream, codec, inputs, outputs, n, divisor):
        """codec_round_sum of kernels/codec.cu: every output the rank-order
        sum of the `n`-element inputs, each rounded through the codec."""
        raise NotImplementedError

    def launch_ll_allreduce(self, stream, instance, args):
        """ll_allreduce<instance> (kernels/ll_allreduce.cu: any of the five
        collectives) on its fixed grid; `args` (kernels.LLAllreduceArgs) are
        copied at the launch."""
        raise NotImplementedError

    def launch_ll_barrier(self, stream, args):
        """ll_barrier, one thread; `args` are copied at the launch."""
        raise NotImplementedError


class PreparedLaunches:
    """Optional: launches prepared once, issued with no argument packing
    (the CUDA adapter's; the executors' launch records take them where a
    device has them, else the Device launches above)."""

    def buffer_block(self):
        """A block of buffer addresses: `.update(addresses)` (a kernels.buffer_table)."""
        raise NotImplementedError

    def step_launcher(self, instance, grid, table, width, divisor, block, fanout=1):
        """issue(stream): launch_step with the addresses `block` holds when issued."""
        raise NotImplementedError

    def codec_batch_launcher(self, codec, rows):
        """issue(stream): launch_codec_batch of `rows`."""
        raise NotImplementedError

    def codec_round_sum_launcher(self, codec, inputs, outputs, n, divisor):
        """issue(stream): launch_codec_round_sum of these arguments."""
        raise NotImplementedError

    def ll_launcher(self, instance, args):
        """issue(stream): launch_ll_allreduce with `args` as they are when issued."""
        raise NotImplementedError


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
