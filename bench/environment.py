"""What a benchmark's numbers were measured on and with, for its JSON."""

import os
import platform
import socket
import subprocess
import sys

import numpy as np

import collectives
from bench.backends import GLOO, MPI_BACKENDS, TENSORFLOW_BACKENDS, TORCH_BACKENDS, launched_by_torchrun

# The launcher and its flags, as the relaunching process ran them (the
# ranks themselves cannot see `-bind-to core`, say).
LAUNCHER_COMMAND = "COLLECTIVES_BENCH_LAUNCHER"
# The -bind-to a relaunching benchmark passed mpiexec, for its ranks' record.
BIND_TO = "COLLECTIVES_BENCH_BIND_TO"
# The benchmarks' own variables (COLLECTIVES_BENCH_*: these and bench/mpis.py's), not the library's settings.
_BENCH_PREFIX = "COLLECTIVES_BENCH_"


def module_name():
    """The benchmark's module as `python -m` takes it, e.g. bench.all_reduce_perf."""
    return f"bench.{os.path.splitext(os.path.basename(sys.argv[0]))[0]}"


def command_line(module, arguments, launcher=()):
    """The command that ran a benchmark, as a reader would type it in the
    repository: `python -m module ...` (under torchrun, `torchrun ... -m
    module ...`), with no interpreter path (a record names nothing outside
    the repository)."""
    python = [] if launcher and launcher[0].startswith("torchrun") else ["python"]
    return " ".join([*launcher, *python, "-m", module, *arguments])


def library_settings():
    """The library's settings from the environment, which change what runs
    (COLLECTIVES_ONE_KERNEL_ALLREDUCE=1, COLLECTIVES_PRETEND_NODES=0,0,1,1)."""
    return {name: value for name, value in sorted(os.environ.items())
            if name.startswith("COLLECTIVES_") and not name.startswith(_BENCH_PREFIX)}


def environment(device, nranks, backends):
    """What the numbers were measured on and with: this machine, the command,
    the ranks and backends, and `device` (--device: host, emulated, cuda)."""
    torchrun = launched_by_torchrun()
    # (MPICH's hydra says PMI_SIZE, Open MPI's mpirun OMPI_COMM_WORLD_SIZE)
    processes = int(os.environ.get("WORLD_SIZE", "1") if torchrun else
                    os.environ.get("PMI_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or "1")
    default_launcher = f"torchrun --nproc-per-node {processes}" if torchrun else f"mpiexec -n {processes}"
    launcher = [os.environ.get(LAUNCHER_COMMAND, default_launcher)] if processes > 1 else []
    env = {
        "command": command_line(module_name(), sys.argv[1:], launcher),
        "host": socket.gethostname(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_bytes": _memory_bytes(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "collectives": collectives.__version__,
        "git_commit": git_commit(),
        "ranks": nranks,
        "processes": processes,
        "backends": backends,
        "settings": library_settings(),
        **device_environment(device),
    }
    if set(MPI_BACKENDS) & set(backends) or (env["processes"] > 1 and not torchrun):
        from mpi4py import MPI
        import mpi4py
        env["mpi4py"] = mpi4py.__version__
        # (Open MPI's version string ends in a NUL)
        env["mpi_library"] = MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip()
    if GLOO in backends or any(b in TORCH_BACKENDS for b in backends):
        import torch
        env["torch"] = torch.__version__
    if any(b in TENSORFLOW_BACKENDS for b in backends):
        import tensorflow as tf
        env["tensorflow"] = tf.__version__
    return env


def _memory_bytes():
    """Total memory, from /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def git_commit():
    """The commit of the checkout the library was imported from, or "unknown"."""
    here = os.path.dirname(os.path.abspath(collectives.__file__))
    try:
        done = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "unknown"


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

