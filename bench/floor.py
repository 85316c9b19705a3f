"""Allreduce of ranks sharing one device against its floor, side by side in one run.

    python -m bench.floor --device cuda [--ranks 4] [-b 4] [-e 256M] [-f 4]

For each size S (bytes per rank), in one process, the ways of issuing the
same allreduce of --ranks ranks on one device (float32 sum, out of place
unless --in-place), and the two floors it is judged against:

    call      comm.allreduce(xs, out=outs): the plain call, repeated
    prepared  comm.prepare("allreduce", ...)(): checked once, issued bare
    graph     that call captured once with comm.graph(), replayed
    launch    the floor of a small call: an empty kernel's launch through
              the driver (cuLaunchKernel, as the library launches; on the
              emulated device, which has no launch cost to speak of, not
              measured)
    cupy_launch  the same kernel launched by calling CuPy's RawKernel,
              the yardstick of the GPU goals ("an empty CuPy launch")
    copy      the floor of a large call: one device-to-device copy of the
              bytes the allreduce must move on one device, every input read
              once and every output written once (ranks x S bytes copied;
              in place the same: each input is its output)

Each is timed as --calls issues back to back, then one synchronize, per
call; the methods alternate within each of --rounds rounds (so the
machine's noise hits all alike) and the table gives medians. Every size's
result is checked against NumPy first. Ratios: call / launch and
prepared / launch (the goal for 4 B to 1 MiB: at most 1.5, and at
most 10 µs a call), graph (at most 2.5 µs), copy / call (for 16 MiB and
up: at least 0.9 of the floor's speed).
"""

import ctypes
import statistics
import sys

import numpy as np

import collectives
from bench import cli
from bench.environment import command_line, device_environment, git_commit
from bench.harness import seconds_per_call

METHODS = ("call", "prepared", "graph", "launch", "cupy_launch", "copy")


class WrongResult(Exception):
    """An allreduce that did not give NumPy's result: a failure, not a row."""


class Device:
    """The arrays, floors and synchronize of --device."""

    def __init__(self, kind):
        self.kind = kind
        if kind == "cuda":
            import cupy
            self.xp = cupy
            self._empty = cupy.RawKernel('extern "C" __global__ void empty() {}', "empty")
            self._empty.compile()
        else:
            self.xp = np
            self._empty = None

    def array(self, values):
        """A new array of the device holding a copy of `values`."""
        return self.xp.array(values, copy=True)

    def to_host(self, array):
        return self.xp.asnumpy(array) if self.kind == "cuda" else np.asarray(array)

    def synchronize(self):
        if self.kind == "cuda":
            self.xp.cuda.get_current_stream().synchronize()

    def empty_launch(self):
        """An empty kernel's launch through the driver, as devices/cuda.py
        launches ours (one cuLaunchKernel, no argument packing), or None
        where there is no such floor."""
        if self._empty is None:
            return None
        launch_kernel, function, cuda = self.xp.cuda.driver.launchKernel, self._empty.kernel.ptr, self.xp.cuda
        return lambda: launch_kernel(function, 1, 1, 1, 1, 1, 1, 0, cuda.get_current_stream().ptr, 0, 0)

    def cupy_launch(self):
        """The same kernel launched by calling CuPy's RawKernel, or None."""
        if self._empty is None:
            return None
        kernel = self._empty
        return lambda: kernel((1,), (1,), ())

    def copy(self, dst, src):
        """A device-to-device copy of all of `src` into `dst` (bytes)."""
        kind, nbytes = self.kind, src.nbytes
        d, s = (dst.data.ptr, src.data.ptr) if kind == "cuda" else (dst.ctypes.data, src.ctypes.data)
        return lambda: device_copy(kind, d, s, nbytes)


def device_copy(kind, dst_address, src_address, nbytes):
    """The floor of a large call: one copy of `nbytes` from one device
    address to another, on the current stream (cudaMemcpyAsync); on the
    emulated device, whose memory is the host's, a memmove."""
    if kind == "cuda":
        import cupy
        runtime = cupy.cuda.runtime
        runtime.memcpyAsync(dst_address, src_address, nbytes, runtime.memcpyDeviceToDevice,
                            cupy.cuda.get_current_stream().ptr)
    else:
        ctypes.memmove(dst_address, src_address, nbytes)


def measure_size(comm, device, nbytes, args):
    """One size: the methods' medians (seconds per call), after a check."""
    n, count = args.ranks, max(nbytes // 4, 1)
    rng = np.random.default_rng(count)
    inputs = [rng.integers(-8, 8, count).astype(np.float32) for _ in range(n)]   # exact sums
    xs = [device.array(v) for v in inputs]
    outs = None if args.in_place else [device.array(np.empty(count, np.float32)) for _ in range(n)]
    keywords = {} if outs is None else {"out": outs}
    results = comm.allreduce(xs, **keywords)
    comm.synchronize()
    want = expected(inputs)
    wrong = sum(int(np.count_nonzero(device.to_host(r) != want)) for r in results)
    if wrong:
        raise WrongResult(f"{wrong} wrong elements at {4 * count} bytes per rank")
    step = comm.prepare("allreduce", xs, **keywords)
    step()
    with comm.graph() as graph:
        step()
    floor_src = device.array(np.zeros(n * count, np.float32))
    floor_dst = device.array(np.zeros(n * count, np.float32))
    issues = {"call": lambda: comm.allreduce(xs, **keywords), "prepared": step, "graph": graph.replay,
              "launch": device.empty_launch(), "cupy_launch": device.cupy_launch(),
              "copy": device.copy(floor_dst, floor_src)}
    issues = {name: issue for name, issue in issues.items() if issue is not None}
    for issue in issues.values():   # warm-up: kernels loaded, caches made
        seconds_per_call(issue, 2, after=device.synchronize)
    seconds = {name: [] for name in issues}
    for _ in range(args.rounds):
        for name, issue in issues.items():
            seconds[name].append(seconds_per_call(issue, args.calls, after=device.synchronize))
    return {name: statistics.median(values) for name, values in seconds.items()}, step.algorithm


def expected(inputs):
    """Their float32 sum (small integers: exact in any order)."""
    return np.sum(inputs, axis=0, dtype=np.float32)


def row_of(nbytes, medians, algorithm):
    us = {name: medians[name] * 1e6 if name in medians else None for name in METHODS}
    ratio = (lambda a, b: a / b if a is not None and b else None)
    return {"bytes": nbytes, "algorithm": algorithm, **{f"{name}_us": us[name] for name in METHODS},
            "call_over_launch": ratio(us["call"], us["launch"]),
            "prepared_over_launch": ratio(us["prepared"], us["launch"]),
            "copy_over_call": ratio(us["copy"], us["call"]),
            "copy_over_prepared": ratio(us["copy"], us["prepared"])}


def print_row(row):
    def cell(value, width=9, digits=2):
        return f"{value:{width}.{digits}f}" if value is not None else f"{'-':>{width}s}"
    print(f"{row['bytes']:>11d} {row['algorithm']:>10s} " + " ".join(cell(row[f'{m}_us']) for m in METHODS)
          + " " + " ".join(cell(row[k], 8) for k in ("call_over_launch", "prepared_over_launch", "copy_over_call")),
          flush=True)


def parse_args(argv):
    p = cli.Parser(prog="python -m bench.floor", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="emulated", choices=["emulated", "cuda"],
                   help="cuda: GPU 0; emulated: our CUDA kernels on the CPU (a rehearsal: no launch floor)")
    p.add_argument("--ranks", type=int, default=4, help="ranks, all on the one device")
    p.add_argument("-b", "--minbytes", type=cli.size, default="4", help="smallest size per rank")
    p.add_argument("-e", "--maxbytes", type=cli.size, default=None,
                   help="largest size per rank (default 256M on a GPU, 64K emulated)")
    p.add_argument("-f", "--stepfactor", type=int, default=4, help="size multiplier between rows")
    p.add_argument("--calls", type=int, default=None, help="issues per timed batch (default 200 on a GPU, 5 emulated)")
    p.add_argument("--rounds", type=int, default=None, help="rounds, each timing every method once (default 5, 2 emulated)")
    p.add_argument("--in-place", action="store_true", help="in place (else out=)")
    p.add_argument("-J", "--output_file", help="write the rows as JSON here (default: no file)")
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    args.maxbytes = args.maxbytes or ("256M" if gpu else "64K")
    args.calls = args.calls or (200 if gpu else 5)
    args.rounds = args.rounds or (5 if gpu else 2)
    if args.ranks < 1 or args.stepfactor < 2 or args.calls < 1 or args.rounds < 1:
        p.error("--ranks, --calls and --rounds must be at least 1, -f at least 2")
    args.sizes = cli.size_sweep(args.minbytes, args.maxbytes, args.stepfactor)
    if not args.sizes:
        p.error("-b is above -e: no size to measure")
    cli.require_device_toolchain(p.prog, args.device)
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    devices = [0] * args.ranks if args.device == "cuda" else ["emulated:0"] * args.ranks
    device = Device(args.device)
    print(f"# bench.floor: {args.ranks} ranks on one {args.device} device, float32 sum, "
          f"{'in place' if args.in_place else 'out of place'}; µs per call, medians of {args.rounds} rounds "
          f"of {args.calls} calls", flush=True)
    print(f"# {'bytes':>9s} {'algorithm':>10s} " + " ".join(f"{m.replace('cupy_launch', 'cupy ln'):>9s}" for m in METHODS)
          + f" {'call/ln':>8s} {'prep/ln':>8s} {'copy/call':>8s}", flush=True)
    rows = []
    with collectives.Communicator.local(args.ranks, devices=devices) as comm:
        for nbytes in args.sizes:
            medians, algorithm = measure_size(comm, device, nbytes, args)
            rows.append(row_of(4 * max(nbytes // 4, 1), medians, algorithm))   # whole float32 elements
            print_row(rows[-1])
    report = {"command": command_line("bench.floor", argv), "environment": {
        **device_environment(args.device), "git_commit": git_commit(), "ranks": args.ranks,
        "in_place": args.in_place, "calls": args.calls, "rounds": args.rounds}, "rows": rows}
    if args.output_file:
        cli.write_json(args.output_file, report, say=None)
    return report


if __name__ == "__main__":
    try:
        main()
    except WrongResult as error:
        cli.fail("python -m bench.floor", error)
