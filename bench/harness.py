"""The benchmark harness shared by the *_perf scripts, after nccl-tests.

A collective is a small spec (what to allocate, the bus-bandwidth factor, how
each backend runs it, what a correct result is); this module does the sweep,
the timing, the check outside the timed loop, the table and the JSON.

Ranks: under `mpiexec -n N` one rank per process; otherwise `--ranks N`
virtual ranks in this process. `--backend` may list several backends, run on
identical inputs in one invocation; asking for `mpi` without a launcher
relaunches the benchmark under MPICH's mpiexec with `--ranks` processes.
"""

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

import collectives
from collectives.bootstrap import LAUNCHER_VARIABLES
from collectives.ops import BFLOAT16

DTYPE_NAMES = {  # nccl-tests' type names -> NumPy
    "int8": "int8", "uint8": "uint8", "int32": "int32", "uint32": "uint32", "int64": "int64",
    "uint64": "uint64", "half": "float16", "float16": "float16", "float": "float32",
    "float32": "float32", "double": "float64", "float64": "float64", "int16": "int16", "uint16": "uint16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}
RELAUNCHED = "COLLECTIVES_BENCH_RELAUNCHED"


@dataclass
class Spec:
    name: str                      # e.g. "allreduce"
    busbw_factor: Callable         # nranks -> factor, as nccl-tests
    counts: Callable               # (bytes, itemsize, nranks) -> (input count, output count)
    run_ours: Callable             # (comm, inputs, outputs, args) -> None
    run_mpi: Callable              # (mpi_comm, input, output, args) -> None; output is input in place
    expected: Callable             # (dtype, op, nranks, rank, count) -> expected output of `rank`
    fill: Callable                 # (dtype, op, nranks, rank, count) -> input of `rank`
    has_op: bool = True
    root: int = -1
    # Where rank `rank`'s result is after an in-place call on buffer x.
    in_place_result: Callable = lambda x, rank, nranks: x


def module_name():
    """The benchmark's module as `python -m` takes it, e.g. bench.all_reduce_perf."""
    return f"bench.{os.path.splitext(os.path.basename(sys.argv[0]))[0]}"


def parse_args(spec, argv=None):
    p = argparse.ArgumentParser(prog=f"python -m {module_name()}",
                                description=f"{spec.name} bandwidth sweep, nccl-tests style")
    p.add_argument("-b", "--minbytes", default="8", help="smallest message (suffixes K, M, G)")
    p.add_argument("-e", "--maxbytes", default="32M", help="largest message")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="multiply the size by this each step")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size")
    p.add_argument("-w", "--warmup_iters", type=int, default=5, help="untimed iterations first")
    p.add_argument("--rounds", type=int, default=1,
                   help="timed batches of -n iterations per backend, taken in turn; the time is their median")
    p.add_argument("-o", "--op", default="sum", choices=[op.value for op in collectives.ReduceOp])
    p.add_argument("-d", "--datatype", default="float", choices=sorted(DTYPE_NAMES))
    p.add_argument("-c", "--check", type=int, default=1, help="check results (outside the timed loop)")
    p.add_argument("-J", "--output_file", help="write rows and environment as JSON here")
    p.add_argument("--ranks", type=int, default=4, help="virtual ranks when not under mpiexec")
    p.add_argument("--device", default="host", choices=["host", "emulated", "cuda"],
                   help="where our ranks run: host (NumPy), emulated (our CUDA kernels on the CPU), "
                        "cuda (virtual ranks: every rank on GPU 0; under mpiexec: GPU local rank modulo the GPUs)")
    p.add_argument("--backend", default="host", help="comma-separated: host (ours, on --device), mpi (mpi4py Allreduce)")
    p.add_argument("--algorithm", default="auto",
                   help="our algorithm, or several comma-separated (each runs as a backend of its own, "
                        "alternating per size): auto or a registered name (python -m bench.model lists them)")
    p.add_argument("--timeout", type=float, default=None, help="communicator timeout in seconds")
    args = p.parse_args(argv)
    args.minbytes, args.maxbytes = parse_size(args.minbytes), parse_size(args.maxbytes)
    name = DTYPE_NAMES[args.datatype]
    args.dtype = BFLOAT16 if name == "bfloat16" else np.dtype(name)
    args.backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    args.algorithms = [a.strip() for a in args.algorithm.split(",") if a.strip()]
    from collectives.algorithms import REGISTRY
    unknown = set(args.algorithms) - {"auto", *REGISTRY}
    if unknown or not args.algorithms:
        p.error(f"unknown algorithm(s) {sorted(unknown)}; choose from auto, {', '.join(REGISTRY)}")
    unknown = set(args.backends) - {"host", "mpi"}
    if unknown or not args.backends:
        p.error(f"unknown backend(s) {sorted(unknown)}; choose from host, mpi")
    if args.minbytes > args.maxbytes or args.stepfactor < 2 or args.iters < 1 or args.warmup_iters < 0 \
            or args.rounds < 1:
        p.error("need -b <= -e, -f >= 2, -n >= 1, -w >= 0 and --rounds >= 1")
    if args.ranks < 1:
        p.error("--ranks must be at least 1")
    if args.device != "host" and "mpi" in args.backends:
        p.error("--backend mpi runs on the host; compare it with --device host")
    return args


def parse_size(text):
    text = str(text).strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def sizes(args):
    size = args.minbytes
    while size <= args.maxbytes:
        yield size
        size *= args.stepfactor


def mpi_world():
    """The MPI world when launched by mpiexec, else None (and no MPI import)."""
    if not any(v in os.environ for v in LAUNCHER_VARIABLES):
        return None
    from mpi4py import MPI
    return MPI.COMM_WORLD


def find_mpiexec():
    """MPICH's mpiexec beside this Python (the mpich wheel), else the PATH's."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        sys.exit("running ranks as processes needs mpiexec: pip install '.[mpi]'")
    return mpiexec


def relaunch_under_mpiexec(args, argv, launcher_flags=()):
    """Run this same benchmark as `--ranks` processes; return its exit code."""
    mpiexec = find_mpiexec()
    command = [mpiexec, *launcher_flags, "-n", str(args.ranks), sys.executable, "-m", module_name(), *argv]
    print(f"# relaunching as {args.ranks} processes: {' '.join(command)}", flush=True)
    return subprocess.call(command, env=dict(os.environ, **{RELAUNCHED: "1"}))


class Backend:
    """One way of running the collective on this process's ranks."""

    def __init__(self, name, spec, args, world, algorithm=None, comm=None):
        self.name, self.spec = name, spec
        self.algorithm = algorithm if name == "host" else None
        self.args = argparse.Namespace(**{**vars(args), "algorithm": self.algorithm})
        self.label = name if algorithm is None or len(args.algorithms) == 1 else f"{name}:{algorithm}"
        self.device = args.device if name == "host" else "host"
        if name == "host" and comm is not None:  # another algorithm on the same ranks
            self.comm = comm
            self.local_ranks, self.nranks = list(comm.local_ranks), comm.size
        elif name == "host":
            if world is None:
                devices = None if args.device == "host" else ["cuda:0" if args.device == "cuda" else "emulated"] * args.ranks
                self.comm = collectives.Communicator.local(args.ranks, devices=devices, timeout=args.timeout)
            else:  # one rank per process, on the host or on this process's device
                self.comm = collectives.init(timeout=args.timeout, comm=world, device=args.device)
            self.local_ranks, self.nranks = list(self.comm.local_ranks), self.comm.size
        else:
            if world is None and args.ranks != 1:
                raise SystemExit("the mpi backend runs one rank per process: run under mpiexec")
            from mpi4py import MPI
            self.comm = world if world is not None else MPI.COMM_WORLD
            self.local_ranks, self.nranks = [self.comm.rank], self.comm.size

    def run(self, inputs, outputs):
        """One collective; `outputs` None means in place."""
        if self.name == "mpi":
            self.spec.run_mpi(self.comm, inputs[0], None if outputs is None else outputs[0], self.args)
        elif len(self.local_ranks) > 1:
            self.spec.run_ours(self.comm, inputs, outputs, self.args)
        else:
            self.spec.run_ours(self.comm, inputs[0], None if outputs is None else outputs[0], self.args)

    def barrier(self):
        """Every rank here, and every rank's issued work done."""
        if self.name == "host":
            self.comm.synchronize()
            self.comm.barrier()
        else:
            self.comm.Barrier()

    def to_device(self, array):
        """A rank's array where this backend takes it (a GPU copy on cuda)."""
        if self.device == "cuda":
            import cupy
            return cupy.asarray(array)
        return array

    def to_host(self, array):
        if self.device == "cuda":
            import cupy
            return cupy.asnumpy(array)
        return array

    def close(self):
        if self.name == "host":
            self.comm.close()


def count_wrong(got, want):
    """Elements whose bits differ from the expectation."""
    differs = got.reshape(-1).view(np.uint8) != want.reshape(-1).view(np.uint8)
    return int(np.count_nonzero(differs.reshape(-1, got.itemsize).any(axis=1)))


def measure(backends, spec, args, nbytes, world):
    """Per backend, [seconds, #wrong] out of place then in place, for one size.

    Seconds: the median over --rounds rounds; in each round every backend
    runs one timed batch of -n iterations in turn, so that the machine's
    noise hits all alike; a batch's time is its slowest rank's mean (ranks in
    other processes report through MPI). #wrong: over every rank, from a run
    on fresh inputs after the timed rounds.
    """
    shared = {}  # backends on the same ranks (algorithms of one communicator) share their buffers
    buffers = [shared.setdefault(id(backend.comm), allocate(backend, spec, args, nbytes)) for backend in backends]
    rows = [[] for _ in backends]
    for in_place in (False, True):
        for backend, (inputs, outputs) in zip(backends, buffers):
            for _ in range(args.warmup_iters):
                backend.run(inputs, None if in_place else outputs)
        batches = [[] for _ in backends]
        for _ in range(args.rounds):
            for backend, (inputs, outputs), times in zip(backends, buffers, batches):
                times.append(timed_batch(backend, inputs, None if in_place else outputs, args.iters, world))
        for backend, row, times in zip(backends, rows, batches):
            wrong = check(backend, spec, args, nbytes, in_place) if args.check else 0
            if world is not None:
                wrong = world.allreduce(wrong)
            row += [statistics.median(times), wrong]
    return rows


def allocate(backend, spec, args, nbytes):
    """A backend's inputs and outputs for one message size."""
    in_count, out_count = spec.counts(nbytes, args.dtype.itemsize, backend.nranks)
    ranks = backend.local_ranks
    inputs = [backend.to_device(spec.fill(args.dtype, args.op, backend.nranks, r, in_count)) for r in ranks]
    outputs = [backend.to_device(np.empty(out_count, args.dtype)) for _ in ranks]
    return inputs, outputs


def timed_batch(backend, inputs, outputs, iters, world):
    """Seconds per call of `iters` calls, the slowest rank's."""
    backend.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        backend.run(inputs, outputs)
    backend.barrier()  # GPU work is asynchronous: the time is until it is done
    seconds = (time.perf_counter() - start) / iters
    return world.allreduce(seconds, op=_mpi_max()) if world is not None else seconds


def check(backend, spec, args, nbytes, in_place):
    """Wrong elements on this process's ranks, from one call on fresh inputs."""
    dtype, op, n = args.dtype, args.op, backend.nranks
    _, out_count = spec.counts(nbytes, dtype.itemsize, n)
    fresh, checked = allocate(backend, spec, args, nbytes)
    backend.run(fresh, None if in_place else checked)
    ranks = backend.local_ranks
    results = [spec.in_place_result(f, r, n) for f, r in zip(fresh, ranks)] if in_place else checked
    return sum(count_wrong(backend.to_host(got), spec.expected(dtype, op, n, r, out_count))
               for got, r in zip(results, ranks))


def _mpi_max():
    from mpi4py import MPI
    return MPI.MAX


def environment(args, nranks, backends):
    """What the numbers were measured on and with."""
    processes = int(os.environ.get("PMI_SIZE", "1"))
    launcher = ["mpiexec", "-n", str(processes)] if processes > 1 else []
    env = {
        "command": " ".join([*launcher, sys.executable, "-m", module_name(), *sys.argv[1:]]),
        "host": socket.gethostname(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "collectives": collectives.__version__,
        "ranks": nranks,
        "processes": processes,
        "backends": backends,
        **device_environment(args.device),
    }
    if "mpi" in backends or env["processes"] > 1:
        from mpi4py import MPI
        import mpi4py
        env["mpi4py"] = mpi4py.__version__
        env["mpi_library"] = MPI.Get_library_version().splitlines()[0].strip()
    return env


def device_environment(device):
    """The device, driver and library versions the numbers were measured with."""
    if device == "host":
        return {"device": "host (no GPU)"}
    if device == "emulated":
        return {"device": "emulated (our CUDA kernels compiled for the CPU)"}
    import cupy
    runtime = cupy.cuda.runtime
    properties = runtime.getDeviceProperties(0)
    env = {
        "device": properties["name"].decode() if isinstance(properties["name"], bytes) else properties["name"],
        "compute_capability": f"{properties['major']}.{properties['minor']}",
        "driver": _cuda_version(runtime.driverGetVersion()),
        "cuda_runtime": _cuda_version(runtime.runtimeGetVersion()),
        "cupy": cupy.__version__,
    }
    try:
        from cupy.cuda import nccl
        env["nccl"] = _nccl_version(nccl.get_version())
    except Exception as error:  # NCCL is optional for our own backend
        env["nccl"] = f"unavailable ({type(error).__name__})"
    try:
        import subprocess
        env["driver_release"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except Exception:
        pass
    return env


def _cuda_version(code):
    return f"{code // 1000}.{code % 1000 // 10}"


def _nccl_version(code):
    return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


HEADER = (
    "#                                                              out-of-place                       in-place\n"
    "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong\n"
    "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)"
)


def format_row(row):
    cells = f"{row['size']:12d}  {row['count']:12d}  {row['type']:>8s}  {row['redop']:>6s}  {row['root']:6d}"
    for place in ("out_of_place", "in_place"):
        m = row[place]
        cells += f"  {m['time_us']:7.1f}  {m['algbw']:6.2f}  {m['busbw']:6.2f}  {m['wrong']:5d}"
    return cells + f"  {row['backend']:>6s}" + (f"  {row['vs_first']:5.2f}x" if "vs_first" in row else "")


def main(spec, argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(spec, argv)
    world = mpi_world()
    if world is None and "mpi" in args.backends and args.ranks > 1 and not os.environ.get(RELAUNCHED):
        return relaunch_under_mpiexec(args, argv)
    backends = []
    for name in args.backends:
        if name == "host":
            shared = None
            for algorithm in args.algorithms:
                backends.append(Backend(name, spec, args, world, algorithm, comm=shared))
                shared = backends[-1].comm
        else:
            backends.append(Backend(name, spec, args, world))
    nranks = backends[0].nranks
    leader = world is None or world.rank == 0
    say = print if leader else (lambda *a, **k: None)
    mode = f"{nranks} processes" if world is not None else f"{nranks} virtual ranks in one process"
    mode += f" on {args.device}" if args.device != "host" else ""
    say(f"# collectives {spec.name} benchmark: {mode}, backends {', '.join(args.backends)}, "
        f"algorithm {args.algorithm}, {args.iters} iterations after {args.warmup_iters} warm-up")
    say(HEADER + ("  backend" + ("  vs first" if len(backends) > 1 else "")))
    rows = []
    for nbytes in sizes(args):
        in_count, out_count = spec.counts(nbytes, args.dtype.itemsize, nranks)
        first_time = None
        measured = measure(backends, spec, args, nbytes, world)
        for backend, (t_out, w_out, t_in, w_in) in zip(backends, measured):
            row = {"backend": backend.label, "size": nbytes, "count": max(in_count, out_count),
                   "type": args.dtype.name, "redop": args.op if spec.has_op else "none", "root": spec.root}
            if backend.algorithm is not None:
                row["algorithm"] = backend.algorithm
                row["picked"] = backend.comm.chosen_algorithm(spec.name, in_count * args.dtype.itemsize,
                                                              root=max(spec.root, 0)) \
                    if backend.algorithm == "auto" else backend.algorithm
            factor = spec.busbw_factor(nranks)
            for place, seconds, wrong in (("out_of_place", t_out, w_out), ("in_place", t_in, w_in)):
                algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
                row[place] = {"time_us": seconds * 1e6, "algbw": algbw, "busbw": algbw * factor, "wrong": wrong}
            if len(backends) > 1:
                first_time = first_time or t_out
                row["vs_first"] = t_out / first_time
            rows.append(row)
            say(format_row(row), flush=True)
    for backend in backends:
        mine = [r for r in rows if r["backend"] == backend.label]
        average = sum(r["out_of_place"]["busbw"] for r in mine) / max(len(mine), 1)
        mine_wrong = sum(r["out_of_place"]["wrong"] + r["in_place"]["wrong"] for r in mine)
        say(f"# {backend.label:>6s}: out of bounds values: {mine_wrong}  avg bus bandwidth: {average:.3f} GB/s")
    wrong = sum(r["out_of_place"]["wrong"] + r["in_place"]["wrong"] for r in rows)
    if args.output_file and leader:
        with open(args.output_file, "w") as f:
            json.dump({"collective": spec.name, "environment": environment(args, nranks, args.backends),
                       "rows": rows}, f, indent=1)
        say(f"# wrote {args.output_file}")
    for backend in backends:
        backend.close()
    say("# " + ("all results correct" if wrong == 0 else f"{wrong} WRONG elements"))
    return 1 if wrong else 0
