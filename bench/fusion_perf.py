"""Tensor fusion on a training step's gradients: fused against one call per array.

    python -m bench.fusion_perf [--models resnet50,transformer] [--ranks 4]
                                [--device host|emulated|cuda] [--steps 5]
                                [--threshold 64M] [--compression fp16] [--scale 1.0]

Each step allreduces (avg) a model's gradients, whose shapes are
bench/model_shapes.py's, either fused (`allreduce_many`) or one `allreduce`
per array; the two modes alternate step by step so the machine's noise hits
both alike. Per step it reports the median time, the collective calls, the
kernel launches (GPU path: step, batched copy and codec kernels) and the host
time outside kernels: on emulated devices, the step's time minus the time
spent running kernels; on a GPU, the time until the step's calls have
returned, before waiting for the device. Host ranks run no kernels.

Ranks: `--ranks` virtual ranks in this process, or under `mpiexec -n N` one
rank per process (`--processes` relaunches so, pinned one per core).
`--scale` shrinks every array (keeping their number) for quick runs.
"""

import contextlib
import statistics
import sys
import time

import numpy as np

import collectives
from bench import cli
from bench.environment import environment
from bench.harness import adding_calls, adding_seconds, held, mpi_world, put_back, relaunch_once, slowest
from bench.model_shapes import MODELS

MODES = ("fused", "per-array")


def parse_args(argv=None):
    p = cli.Parser(prog="python -m bench.fusion_perf", description=__doc__.splitlines()[0])
    p.add_argument("--models", default="resnet50,transformer", help="models whose gradient shapes are allreduced, comma-separated")
    p.add_argument("--ranks", type=int, default=4, help="ranks (virtual, or processes with --processes)")
    p.add_argument("--device", default="host", choices=["host", "emulated", "cuda"],
                   help="where the ranks run: host (NumPy), emulated (our CUDA kernels on the CPU), cuda")
    p.add_argument("--processes", action="store_true", help="one rank per process, under mpiexec")
    p.add_argument("--steps", type=int, default=5, help="timed steps per mode (after one warm-up step)")
    p.add_argument("--threshold", default="64M", type=cli.size, help="fusion threshold in bytes (suffixes K, M)")
    p.add_argument("--compression", default=None, choices=[None, "bf16", "fp16", "int8"],
                   help="codec on the wire (default: none)")
    p.add_argument("--scale", type=float, default=1.0, help="fraction of each array's elements to keep")
    p.add_argument("-J", "--output_file", help="write the results as JSON here (default: no file)")
    args = p.parse_args(argv)
    cli.require_device_toolchain(p.prog, args.device)
    args.models = cli.names(p, "--models", args.models, MODELS)
    args.threshold_bytes = cli.parse_size(args.threshold)
    return args


def gradient_sizes(model, scale):
    return [max(1, int(np.prod(shape) * scale)) for _, shape in MODELS[model]()]


def make_communicator(args, world):
    if world is not None:
        return collectives.init(comm=world, device=args.device)
    if args.device == "host":
        return collectives.Communicator.local(args.ranks)
    if args.device == "emulated":
        return collectives.Communicator.local(args.ranks, devices="emulated")
    # As `init(device="cuda")` places processes: rank r on GPU r modulo the
    # GPUs this process sees, so --ranks 4 runs on a one-GPU machine too.
    from collectives.devices.cuda import visible_gpus
    gpus = visible_gpus()
    return collectives.Communicator.local(args.ranks, devices=[r % gpus for r in range(args.ranks)])


def allocate(comm, args, sizes):
    """Per local rank, float32 gradients of `sizes` elements."""
    per_rank = []
    for local, rank in enumerate(comm.local_ranks):
        arrays = [np.random.default_rng([rank, i]).standard_normal(n).astype(np.float32) for i, n in enumerate(sizes)]
        if args.device == "cuda":
            import cupy
            devices = comm._ranks.rank_devices  # noqa: SLF001
            with cupy.cuda.Device(devices[local].index):
                arrays = [cupy.asarray(a) for a in arrays]
        per_rank.append(arrays)
    return per_rank


EMULATED_RUNS = ("_run_step", "_run_copies", "_run_codec", "_run_codec_batch", "_run_codec_round_sum", "_run_ll",
                 "_run_ll_barrier")
DEVICE_LAUNCHES = ("launch_step", "launch_copies", "launch_codec", "launch_codec_batch", "launch_codec_round_sum",
                   "launch_ll_allreduce", "launch_ll_barrier")


class Counters:
    """Counts collective calls and kernel launches, and times kernels run on
    emulated devices, by wrapping the methods that do them (instance
    attributes, put back as they were afterwards)."""

    def __init__(self, comm):
        self.comm = comm
        self.counts = {"calls": 0, "launches": 0}
        self.spent = {}   # "kernels": seconds in the emulated device's kernels

    @contextlib.contextmanager
    def active(self):
        comm, ranks = self.comm, self.comm._ranks  # noqa: SLF001 - the benchmark looks inside on purpose
        # A collective call is one of the communicator's: every fused bucket
        # and every per-array allreduce enters _collective, but for the one
        # a process's compiled loop answers (its fast allreduce, which says
        # None where it declines and the call goes on to _collective). The
        # ranks' run is no count: a repeated call runs its bound form.
        patched = [(comm, "_collective", adding_calls(comm._collective, self.counts, "calls"))]  # noqa: SLF001
        fast = comm._fast_allreduce  # noqa: SLF001
        if fast is not None:
            patched.append((comm, "_fast_allreduce", self._counted_when_taken(fast)))
        for device in dict.fromkeys(getattr(ranks, "rank_devices", ())):
            # An emulated device runs each launch, prepared or not, through
            # one of its _run_ methods (looked up as it queues the launch):
            # counted and timed there. A GPU's launches are counted as they
            # are asked for; a repeated call's prepared launches (made at its
            # first repeat, in the warm-up) are not seen.
            emulated = [name for name in EMULATED_RUNS if hasattr(device, name)]
            for name in emulated:
                run = adding_seconds(getattr(device, name), self.spent, "kernels")
                patched.append((device, name, adding_calls(run, self.counts, "launches")))
            for name in () if emulated else DEVICE_LAUNCHES:
                if hasattr(device, name):
                    patched.append((device, name, adding_calls(getattr(device, name), self.counts, "launches")))
        helds = [held(target, name) for target, name, _ in patched]
        for target, name, wrapper in patched:
            setattr(target, name, wrapper)
        try:
            yield self
        finally:
            put_back(helds)

    def _counted_when_taken(self, fast):
        def counted(*args):
            result = fast(*args)
            if result is not None:
                self.counts["calls"] += 1
            return result
        return counted



def step(comm, mode, per_rank, args):
    """One step's allreduces; returns (seconds, seconds until the calls returned)."""
    one_rank = len(per_rank) == 1
    start = time.perf_counter()
    if mode == "fused":
        comm.allreduce_many(per_rank[0] if one_rank else per_rank, op="avg",
                            fusion_threshold=args.threshold_bytes, compression=args.compression)
    else:
        for i in range(len(per_rank[0])):
            arrays = per_rank[0][i] if one_rank else [rank[i] for rank in per_rank]
            comm.allreduce(arrays, op="avg", compression=args.compression)
    issued = time.perf_counter()
    comm.synchronize()
    comm.barrier()
    return time.perf_counter() - start, issued - start


def measure(comm, args, model, world):
    sizes = gradient_sizes(model, args.scale)
    per_rank = allocate(comm, args, sizes)
    rows = {mode: {"seconds": [], "host_seconds": [], "calls": [], "launches": []} for mode in MODES}
    for mode in MODES:   # warm-up: plans, kernels, workspaces, fusion buffers
        step(comm, mode, per_rank, args)
    for _ in range(args.steps):
        for mode in MODES:
            counters = Counters(comm)
            with counters.active():
                seconds, issued = step(comm, mode, per_rank, args)
            if args.device == "emulated":
                host = seconds - counters.spent.get("kernels", 0.0)
            elif args.device == "cuda":
                host = issued
            else:
                host = seconds
            if world is not None:   # a collective is as slow as its slowest rank
                seconds, host = slowest(world, seconds), slowest(world, host)
            row = rows[mode]
            row["seconds"].append(seconds)
            row["host_seconds"].append(host)
            row["calls"].append(counters.counts["calls"])
            row["launches"].append(counters.counts["launches"])
    summary = {}
    for mode, row in rows.items():
        summary[mode] = {
            "median_step_ms": 1e3 * statistics.median(row["seconds"]),
            "median_host_ms": 1e3 * statistics.median(row["host_seconds"]),
            "collective_calls_per_step": row["calls"][-1],
            "kernel_launches_per_step": row["launches"][-1],
            "samples_ms": [1e3 * s for s in row["seconds"]],
        }
    fused, single = summary["fused"], summary["per-array"]
    summary["speedup"] = single["median_step_ms"] / fused["median_step_ms"]
    summary["host_time_ratio"] = single["median_host_ms"] / max(fused["median_host_ms"], 1e-9)
    summary["launch_ratio"] = (single["kernel_launches_per_step"] / fused["kernel_launches_per_step"]
                               if fused["kernel_launches_per_step"] else None)
    summary["tensors"] = len(sizes)
    summary["parameters"] = int(sum(sizes))
    return summary


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    world = mpi_world()
    if world is None and args.processes:
        return relaunch_once(args, argv, ["-bind-to", "core"])
    comm = make_communicator(args, world)
    leader = world is None or world.rank == 0
    results = {}
    if leader:
        where = f"{comm.size} {'processes' if world is not None else 'ranks in one process'}, device {args.device}"
        print(f"# fusion_perf: {where}, threshold {args.threshold_bytes} B, compression {args.compression}, "
              f"op avg, {args.steps} alternating steps per mode, scale {args.scale:g}")
        print(f"# {'model':>12s} {'tensors':>7s} {'mode':>10s} {'step ms':>9s} {'host ms':>9s} {'calls':>6s} "
              f"{'launches':>8s}")
    for model in args.models:
        summary = measure(comm, args, model, world)
        results[model] = summary
        if leader:
            for mode in MODES:
                s = summary[mode]
                print(f"  {model:>12s} {summary['tensors']:7d} {mode:>10s} {s['median_step_ms']:9.2f} "
                      f"{s['median_host_ms']:9.2f} {s['collective_calls_per_step']:6d} "
                      f"{s['kernel_launches_per_step']:8d}")
            ratio = summary["launch_ratio"]
            print(f"  {model:>12s} fused: {summary['speedup']:.1f}x faster per step, "
                  f"{summary['host_time_ratio']:.1f}x less host time"
                  + (f", {ratio:.1f}x fewer launches" if ratio else ""))
    if args.output_file and leader:
        report = {"benchmark": "fusion_perf", "threshold_bytes": args.threshold_bytes,
                  "compression": args.compression, "scale": args.scale, "op": "avg",
                  "environment": environment(args.device, comm.size, ["ours"]),
                  "models": results}
        cli.write_json(args.output_file, report)
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
