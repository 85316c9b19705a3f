"""One command for a machine with a GPU: python -m bench.gpu_check

1. runs the `gpu` tests (pytest -m gpu) on the chosen device;
2. measures plan_step's achieved bandwidth (bytes read plus written per
   second) for copy and reduce rows against a plain device-to-device copy of
   the same size, in the same run, alternating the two, for each variant of
   the kernel (unroll, launch bounds);
3. runs the allreduce benchmark on --ranks ranks of one GPU, then
   bench.floor: the same allreduce (plain, prepared, in a graph) beside an
   empty kernel launch and a device copy of the bytes it moves;
4. runs it again with one rank per process (--processes of them under
   mpiexec, sharing the GPU through CUDA IPC): the step protocol, the
   one-kernel path (COLLECTIVES_ONE_KERNEL_ALLREDUCE=1) on plain arrays and
   on symmetric memory (--symmetric); and the per-call comparison
   of those GPU ranks with host ranks (bench.spmd_overhead). On a GPU it
   starts an MPS daemon of its own first when it can (processes on one GPU
   then run at once instead of taking turns), stops it after, and the JSON
   says which mode was measured ("mps" or "time-sliced");
5. ours against NCCL, side by side, one rank per visible GPU (NCCL takes
   one rank per GPU); skipped, with the reason, on emulated devices;
6. writes everything to one JSON where -J says (no file without it: the
   verdict is printed either way) with the device, driver, CUDA, CuPy and
   NCCL versions and the exact command; the runs worth keeping are
   committed under bench/results/.

`--device emulated` runs the same steps on the CPU (our kernels compiled for
it): CI does, so that on a GPU only the CuPy adapter is new.
"""

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import cli
from bench import all_reduce_perf, floor, harness, mpis
from bench.environment import command_line, device_environment
from collectives import kernels
from collectives.binding import INPUT, OUTPUT
from collectives.config import ONE_KERNEL_ALLREDUCE_ENV
from collectives.executors.device import grid_for
from collectives.plan import COPY_OP, REDUCE_OP

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv):
    p = cli.Parser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "emulated"],
                   help="cuda: a GPU; emulated: our CUDA kernels on the CPU (a rehearsal of the GPU run)")
    p.add_argument("--ranks", type=int, default=4, help="ranks on the one GPU for the allreduce benchmark")
    p.add_argument("--bytes", default=None, help="message size of the kernel bandwidth test (default 256M on a "
                                                  "GPU, 1M emulated)")
    p.add_argument("--maxbytes", default=None, help="largest allreduce message (default 256M, 1M emulated)")
    p.add_argument("--unroll", default="1,2,4", help="unroll variants of plan_step to measure (GPU only)")
    p.add_argument("--min-blocks", default="4,8", help="launch-bound variants (blocks per multiprocessor) to measure")
    p.add_argument("--repeats", type=int, default=20, help="timed launches per measurement")
    p.add_argument("--processes", type=int, default=2, help="processes for the one-rank-per-process runs")
    p.add_argument("--skip-tests", action="store_true", help="do not run the gpu tests")
    p.add_argument("-J", "--output_file", default=None, help="write the report as JSON here (default: no file)")
    args = p.parse_args(argv)
    emulated = args.device == "emulated"
    args.nbytes = cli.parse_size(args.bytes or ("1M" if emulated else "256M"))
    args.maxbytes = args.maxbytes or ("1M" if emulated else "256M")
    args.variants = [(None, None)] if emulated else [
        (int(m), int(u)) for m in args.min_blocks.split(",") for u in args.unroll.split(",")]
    # Absolute: the steps run in the checkout's root.
    args.output_file = os.path.abspath(args.output_file) if args.output_file else None
    return args


# -- 1. the gpu tests ------------------------------------------------------------

def run_gpu_tests(device):
    # -n 0: in one process, one test at a time: the tests share the one GPU.
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-n", "0", "-p", "no:cacheprovider", "tests"]
    env = dict(os.environ, COLLECTIVES_TEST_DEVICE=device)
    start = time.perf_counter()
    done = run_shown(command, env, timeout=None)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
    return {"command": " ".join(command), "env": f"COLLECTIVES_TEST_DEVICE={device}", "returncode": done.returncode,
            "summary": summary, "seconds": round(time.perf_counter() - start, 1)}


def run_shown(command, env=None, timeout=1800):
    """Run a step's command in the checkout's root and show the end of its
    output: the report keeps the figures, the log what went wrong."""
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    print(done.stdout[-6000:], done.stderr[-3000:], sep="\n", flush=True)
    return done


def run_tool(command, shown, env=None):
    """A bench tool run for one step, its -J written to a temporary folder and
    read back (so nothing is left on disk but the report -J asks for): the
    command as shown, its exit code and its JSON (None if it wrote none)."""
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "result.json"
        print(shown, flush=True)
        done = run_shown([*command, "-J", str(path)], env)
        return {"command": shown, "returncode": done.returncode,
                "result": json.loads(path.read_text()) if path.exists() else None}


# -- 2. kernel bandwidth against a device copy -------------------------------------

def kernel_bandwidth(args, device, buffers, timer, variant):
    """plan_step rows moving `args.nbytes` per source, against a device copy."""
    dtype = np.dtype(np.float32)
    count = args.nbytes // dtype.itemsize
    results = []
    for nsrc in (1, 2, 4):
        kind = COPY_OP if nsrc == 1 else REDUCE_OP
        row = [0, kind, count, OUTPUT, 0, nsrc]
        for q in range(nsrc):
            row += [q, INPUT, 0]  # source q is rank q's INPUT
        table = np.array([row], np.int64)
        memory = device.upload(table)
        addresses = kernels.buffer_table([])
        for q in range(nsrc):
            addresses[q * kernels.BUFFERS + INPUT] = buffers[q].address
        addresses[OUTPUT] = buffers[-1].address
        instance = kernels.StepInstance("float32", 0)
        grid = grid_for(table, device, dtype.itemsize)
        stream = device.current_stream()

        def step():
            device.launch_step(stream, instance, grid, memory, table.shape[1], addresses, 0)

        def copy():
            floor.device_copy(args.device, buffers[-1].address, buffers[0].address, args.nbytes)

        # Alternate the two, so that the machine's noise hits both alike.
        step_times, copy_times = [], []
        for _ in range(3):
            step_times.append(timer.seconds(step, args.repeats))
            copy_times.append(timer.seconds(copy, args.repeats))
        step_s, copy_s = min(step_times), min(copy_times)
        moved = (nsrc + 1) * args.nbytes
        results.append({
            "min_blocks": variant[0], "unroll": variant[1], "sources": nsrc, "bytes_per_source": args.nbytes, "grid": list(grid),
            "step_us": step_s * 1e6, "step_GBps": moved / step_s / 1e9,
            "copy_us": copy_s * 1e6, "copy_GBps": 2 * args.nbytes / copy_s / 1e9,
            "step_vs_copy": (moved / step_s) / (2 * args.nbytes / copy_s),
        })
        r = results[-1]
        print(f"  min blocks {variant[0]} unroll {variant[1]}  {nsrc} source(s)  grid {grid}  plan_step {r['step_us']:9.1f} us "
              f"{r['step_GBps']:8.1f} GB/s   device copy {r['copy_GBps']:8.1f} GB/s   ratio {r['step_vs_copy']:.3f}",
              flush=True)
    return results


def open_device(kind, variant):
    if kind == "cuda":
        from collectives.devices.cuda import CudaDevice
        min_blocks, unroll = variant
        return CudaDevice(0, defines={"COLLECTIVES_STEP_MIN_BLOCKS": min_blocks, "COLLECTIVES_STEP_UNROLL": unroll})
    from collectives.devices import open_device as open_named
    return open_named("emulated")


# -- 4. one rank per process ---------------------------------------------------------

MPS, TIME_SLICED = "mps", "time-sliced"


@contextlib.contextmanager
def mps_daemon(device):
    """An MPS control daemon of our own for the block, when the device is a
    GPU and nvidia-cuda-mps-control is there; yields (mode, environment for
    the processes, why not MPS or None). Its pipe and log folders are a
    private temporary folder, so it neither meets nor stops another daemon;
    it is told to quit however the block ends."""
    control = shutil.which("nvidia-cuda-mps-control")
    if device != "cuda" or control is None:
        yield TIME_SLICED, dict(os.environ), ("not a GPU" if device != "cuda" else "no nvidia-cuda-mps-control")
        return
    with tempfile.TemporaryDirectory(prefix="collectives-mps-") as folder:
        env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=os.path.join(folder, "pipe"),
                   CUDA_MPS_LOG_DIRECTORY=os.path.join(folder, "log"))
        os.makedirs(env["CUDA_MPS_PIPE_DIRECTORY"])
        os.makedirs(env["CUDA_MPS_LOG_DIRECTORY"])
        started = subprocess.run([control, "-d"], env=env, stdin=subprocess.DEVNULL, capture_output=True,
                                 text=True, timeout=60)
        if started.returncode != 0:
            yield TIME_SLICED, dict(os.environ), f"nvidia-cuda-mps-control -d failed: {started.stderr.strip()[-500:]}"
            return
        try:
            yield MPS, env, None
        finally:
            subprocess.run([control], input="quit\n", env=env, capture_output=True, text=True, timeout=60)


def run_processes(args):
    """The allreduce sweep and the per-call comparison, each under mpiexec
    (under MPS when mps_daemon can start one); and how the processes shared
    the device."""
    with mps_daemon(args.device) as (mode, env, why_not):
        print(f"# processes share the device: {mode}" + (f" ({why_not})" if why_not else ""), flush=True)
        results = run_process_benchmarks(args, env)
    return results, {"mode": mode, "why_not_mps": why_not}


def run_process_benchmarks(args, env):
    mpiexec = mpis.find_mpiexec()
    emulated = args.device == "emulated"
    processes = [mpiexec, "-bind-to", "core", "-n", str(args.processes), sys.executable, "-m"]
    sweep = ["bench.all_reduce_perf", "--device", args.device, "-b", "8", "-e", args.maxbytes, "-f", "4",
             "-n", "3" if emulated else "20", "-w", "1" if emulated else "5"]
    one_kernel = {ONE_KERNEL_ALLREDUCE_ENV: "1"}
    # name: (command, extra environment): the step protocol's sweep, then the
    # one-kernel path's on plain arrays and on symmetric memory (comm.alloc),
    # whose large calls are barrier, step kernel, barrier: the 128 MiB goal
    # of processes sharing a GPU (at least 0.7 of the copy floor).
    commands = {
        "allreduce": (processes + sweep, {}),
        "allreduce_one_kernel": (processes + sweep, one_kernel),
        "allreduce_one_kernel_symmetric": (processes + sweep + ["--symmetric"], one_kernel),
        "overhead": (processes + ["bench.spmd_overhead", "--device", args.device,
                                  "--batches", "5" if emulated else "20"], {}),
    }
    # (the command shown without its -J, which names a folder that is gone)
    return {name: run_tool(command, " ".join([*(f"{k}={v}" for k, v in extra.items()), *command]),
                           dict(env, **extra))
            for name, (command, extra) in commands.items()}


# -- 5. ours against NCCL ------------------------------------------------------------

def ours_against_nccl(args):
    """all_reduce_perf with --backend ours,nccl on every visible GPU, or why not."""
    if args.device != "cuda":
        return {"skipped": "NCCL needs a GPU"}
    import cupy
    ranks = cupy.cuda.runtime.getDeviceCount()
    command = [sys.executable, "-m", "bench.all_reduce_perf", "--device", "cuda", "--backend", "ours,nccl",
               "--ranks", str(ranks), "-b", "8", "-e", args.maxbytes, "-f", "4", "-n", "20", "-w", "5",
               "--rounds", "3"]
    return run_tool(command, " ".join(command))


# -- 3. and 6. ----------------------------------------------------------------------

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    report = {"command": command_line("bench.gpu_check", argv),
              "environment": device_environment(args.device)}
    print(f"# gpu_check on {report['environment']['device']}", flush=True)

    if not args.skip_tests:
        print("# 1. gpu tests", flush=True)
        report["gpu_tests"] = run_gpu_tests(args.device)

    print(f"# 2. plan_step bandwidth against a device copy, {args.nbytes} bytes per source, float32", flush=True)
    report["kernel_bandwidth"] = []
    for variant in args.variants:
        device = open_device(args.device, variant)
        buffers = [device.allocate(args.nbytes) for _ in range(5)]
        for b in buffers:
            fill(args.device, b, args.nbytes)
        report["kernel_bandwidth"] += kernel_bandwidth(args, device, buffers, harness.DeviceTimer(args.device, device), variant)
        del buffers

    print(f"# 3. allreduce on {args.ranks} ranks of one device", flush=True)
    with tempfile.TemporaryDirectory() as scratch:   # the tool's table, read back: no file left anywhere
        table = Path(scratch) / "allreduce.json"
        bench_argv = ["--device", args.device, "--ranks", str(args.ranks), "-b", "8", "-e", args.maxbytes, "-f", "4",
                      "-n", "20" if args.device == "cuda" else "3", "-w", "5" if args.device == "cuda" else "1",
                      "-J", str(table)]
        code = harness.main(all_reduce_perf.ALLREDUCE, bench_argv)
        report["allreduce"] = json.loads(table.read_text())["rows"]
    report["allreduce_command"] = command_line("bench.all_reduce_perf", bench_argv[:-2])

    print(f"# 3b. allreduce on {args.ranks} ranks of one device against its floor (an empty launch, a copy)",
          flush=True)
    floor_argv = ["--device", args.device, "--ranks", str(args.ranks)]
    if args.device == "cuda":
        floor_argv += ["-b", "4", "-e", args.maxbytes]
    try:
        report["against_floor"] = floor.main(floor_argv)
    except floor.WrongResult as error:   # recorded and failed, but the sections after it still run
        print(f"# bench.floor FAILED: {error}", flush=True)
        report["against_floor"] = {"error": str(error)}

    print(f"# 4. one rank per process: {args.processes} processes sharing the device", flush=True)
    report["processes"], report["processes_sharing"] = run_processes(args)

    print("# 5. ours against NCCL", flush=True)
    report["ours_vs_nccl"] = ours_against_nccl(args)

    if args.output_file:
        cli.write_json(args.output_file, report)
    failed = (report.get("gpu_tests", {}).get("returncode", 0) not in (0, 5)) or code != 0 \
        or any(run["returncode"] != 0 for run in report["processes"].values()) \
        or report["ours_vs_nccl"].get("returncode", 0) != 0 or "error" in report["against_floor"]
    print("# gpu_check " + ("FAILED" if failed else "passed"))
    return 1 if failed else 0


def fill(kind, memory, nbytes):
    """Random float32 data (never zeros: they hide unwritten outputs)."""
    harness.upload(kind, memory, np.random.default_rng(0).standard_normal(nbytes // 4).astype(np.float32))


if __name__ == "__main__":
    sys.exit(main())
