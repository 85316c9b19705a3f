"""Host-side cost of one in-process collective call.

    python -m bench.call_overhead [--ranks 4] [--devices 1] [--calls 20000]
    python -m bench.call_overhead --device host --algorithm auto --count 256

Runs allreduce (and the other collectives) on small arrays with ranks on
emulated devices (or GPUs: --device cuda; or virtual host ranks, NumPy
arrays in this process: --device host), after a warm-up (plans cached),
and reports per call (the median over batches of --batch calls too):

* the Python time spent outside the device adapter (its launch, record,
  wait and call_returned calls are timed and subtracted), the number the
  issue's 10 µs goal is about;
* the adapter calls the executor made (launches, records, waits).

`--adapter noop` replaces the adapter's calls by no-ops (nothing runs).
`--adapter dry` runs the CUDA adapter itself (devices/cuda.py) on stand-ins
for CuPy and its arrays (devices/dry_cuda.py): every line of ours that a
call on a GPU runs, CuPy arrays' attribute reads included, without a GPU;
only the driver's own cost is missing. Its time is all outside the driver,
and the launches, event records and waits are counted by the stand-in driver. `--callgrind` runs
this script under valgrind twice (with --adapter noop, or dry when asked),
with two call counts, and prints the instructions per call of the
difference, a number that does not move with the machine's load.
"""

import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import collectives
from bench import cli
from bench.environment import command_line
from bench.harness import held, put_back

ADAPTER_CALLS = ("launch_step", "launch_codec_batch", "launch_codec_round_sum", "launch_ll_allreduce", "record", "wait",
                 "call_returned")
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")


def instrument(devices, noop, wrapped=None):
    """Wrap each device's adapter calls; returns the per-call counters.
    Each (device, name, what its instance held) wrapped is added to
    `wrapped`, for `uninstrument`: devices are shared by every communicator
    of the process."""
    spent = {"seconds": 0.0, **{name: 0 for name in ADAPTER_CALLS}}
    wrapped = [] if wrapped is None else wrapped
    for device in devices:
        for name in ADAPTER_CALLS:
            wrapped.append(held(device, name))
            setattr(device, name, counted_and_timed(getattr(device, name), name, spent, noop))
        # The CUDA adapter's prepared launches (the executors' launch records): their issue(stream) is the launch.
        for maker, counted in (("step_launcher", "launch_step"), ("ll_launcher", "launch_ll_allreduce")):
            if hasattr(device, maker):
                wrapped.append(held(device, maker))
                setattr(device, maker, timed_launcher(getattr(device, maker), counted, spent, noop))
    return spent


def uninstrument(wrapped):
    """Give the devices back what they held before `instrument` (the wrappers are instance attributes)."""
    put_back(wrapped)


def counted_and_timed(method, counted, spent, noop):
    """`method`, its calls counted in spent[counted] and their seconds added
    to spent["seconds"]; with `noop` counted only, and not run."""
    clock = time.perf_counter

    def timed(*args):
        spent[counted] += 1
        if noop:
            return None
        began = clock()
        try:
            return method(*args)
        finally:
            spent["seconds"] += clock() - began
    return timed


def timed_launcher(prepare, counted, spent, noop):
    """`prepare` (a device's launcher maker), whose launches count as `counted` and are timed."""
    return lambda *args: counted_and_timed(prepare(*args), counted, spent, noop)


def arguments(collective, xs, outs, in_place, compression=None):
    if collective == "allreduce" and compression:
        return (xs,), ({"compression": compression} if in_place else {"out": outs, "compression": compression})
    if in_place:
        return (xs,), {}
    if collective == "allreduce":
        return (xs,), {"out": outs}
    if collective == "reduce_scatter":
        return (xs,), {"out": [o[:len(o) // len(xs)] for o in outs]}
    if collective == "allgather":
        return ([x[:len(x) // len(xs)] for x in xs],), {"out": outs}
    return (xs,), {}


def measure(args):
    wrapped = []
    try:
        return _measure(args, wrapped)
    finally:
        uninstrument(wrapped)


def _measure(args, wrapped):
    dry = None
    if args.adapter == "dry":   # the CUDA adapter on stand-ins: nothing to subtract
        from collectives.devices.dry_cuda import dry_devices
        from collectives.executors.device import DeviceRanks
        dry, devices = dry_devices(args.devices)
        ranks = DeviceRanks([devices[r % args.devices] for r in range(args.ranks)])
        comm = collectives.Communicator(ranks, size=args.ranks, local_ranks=range(args.ranks), timeout=60.0)
        spent = instrument((), False)
    elif args.device == "host":   # virtual ranks: no device, no adapter to time
        comm = collectives.Communicator.local(args.ranks)
        spent = instrument((), False)
    else:
        devices = [f"{args.device}:{r % args.devices}" for r in range(args.ranks)]
        comm = collectives.Communicator.local(args.ranks, devices=devices)
        spent = instrument(comm._ranks.devices, args.adapter == "noop", wrapped)
    count = args.count or args.ranks * 4
    if dry is not None:
        xp = dry
    elif args.device == "cuda":
        import cupy as xp
    else:
        xp = np
    def on_rank_device(r, make):  # rank r's array on its device (GPU r mod --devices)
        if xp is np:
            return make()
        with xp.cuda.Device(r % args.devices):
            return make()

    xs = [on_rank_device(r, lambda: xp.full(count, r + 1, np.float32)) for r in range(args.ranks)]
    outs = [on_rank_device(r, lambda: xp.empty(count, np.float32)) for r in range(args.ranks)]
    results = {}
    for collective in args.collectives:
        positional, keywords = arguments(collective, xs, outs, args.in_place, args.compression)
        keywords = {"algorithm": args.algorithm, **keywords}
        inputs = positional[0]
        if args.prepared:   # comm.prepare's call: checked once, then issued with no checks
            call, positional, keywords = comm.prepare(collective, *positional, **keywords), (), {}
        else:
            call = getattr(comm, collective)
        for _ in range(200):
            call(*positional, **keywords)
        for key in spent:
            spent[key] = 0
        driver_before = (dry.launches, dry.ll_launches, dry.records, dry.waits) if dry is not None else None
        # Objects from start-up move to the permanent generation: a full
        # collection's cost then does not land on whichever call triggers it.
        gc.collect()
        gc.freeze()
        batches, batch = [], min(args.batch, args.calls)
        began = time.perf_counter()
        for _ in range(args.calls // batch):
            started = time.perf_counter()
            for _ in range(batch):
                call(*positional, **keywords)
            batches.append((time.perf_counter() - started) / batch)
        total = time.perf_counter() - began
        comm.synchronize()
        calls = len(batches) * batch
        if dry is not None:  # the stand-in driver counted them; nothing of ours ran inside it
            launched, ll_launched, spent["record"], spent["wait"] = (
                now - before for now, before in zip((dry.launches, dry.ll_launches, dry.records, dry.waits),
                                                    driver_before))
            spent["launch_step"], spent["launch_ll_allreduce"] = launched - ll_launched, ll_launched   # (the rest: step, copy, codec)
        chosen = comm.chosen_algorithm(collective, inputs[0].nbytes, in_place=args.in_place,
                                       compression=args.compression if collective == "allreduce" else None,
                                       algorithm=args.algorithm)
        results[collective] = {
            "calls": calls,
            "total_us_per_call": total / calls * 1e6,
            "median_us_per_call": statistics.median(batches) * 1e6,
            "algorithm_run": call.algorithm if args.prepared else chosen.algorithm,
            "path_run": chosen.path,
            "outside_adapter_us_per_call": (total - spent["seconds"]) / calls * 1e6,
            **{f"{name}_per_call": spent[name] / calls for name in ADAPTER_CALLS},
        }
    comm.close()
    return results


def callgrind(args):
    """Instructions per call: the difference of two runs under callgrind."""
    if shutil.which("valgrind") is None:
        sys.exit("--callgrind needs valgrind")
    counts = {}
    adapter = "dry" if args.adapter == "dry" else "noop"
    for calls in (args.calls, 2 * args.calls):
        with tempfile.TemporaryDirectory() as scratch:
            out = os.path.join(scratch, "callgrind.out")
            command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-m",
                       "bench.call_overhead", "--adapter", adapter, "--ranks", str(args.ranks), "--devices",
                       str(args.devices), "--calls", str(calls), "--batch", str(args.batch), "--algorithm",
                       args.algorithm, "--device", args.device, "--count", str(args.count),
                       "--collectives", ",".join(args.collectives), *(["--in-place"] if args.in_place else []),
                       *(["--compression", args.compression] if args.compression else []),
                       *(["--prepared"] if args.prepared else [])]
            # A fixed hash seed: dict and set layouts, hence instruction counts, repeat.
            # One OpenBLAS thread: its idle threads' spinning would count too.
            subprocess.run(command, check=True, capture_output=True,
                           env=dict(os.environ, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1"))
            with open(out) as f:
                totals = [line for line in f if line.startswith("totals:") or line.startswith("summary:")]
            counts[calls] = int(totals[-1].split()[1])
    per_call = (counts[2 * args.calls] - counts[args.calls]) / args.calls / len(args.collectives)
    return {"instructions_per_call": per_call, "runs": counts, "adapter": adapter}


def measured_on(args):
    """bench.environment's block, saying which adapter ran (a dry run's
    device is stand-ins, whatever --device says)."""
    from bench.environment import environment
    env = environment(args.device, args.ranks, ["ours"])
    if args.adapter == "dry":
        env["device"] = "dry CUDA adapter (devices/dry_cuda.py: stand-ins for CuPy, no GPU)"
    if args.callgrind:
        env["valgrind"] = subprocess.run(["valgrind", "--version"], capture_output=True, text=True).stdout.strip()
    return env


def main(argv=None):
    p = cli.Parser(prog="python -m bench.call_overhead", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4, help="ranks, all in this process")
    p.add_argument("--device", default="emulated", choices=["emulated", "cuda", "host"],
                   help="host: virtual ranks on NumPy arrays (--adapter dry runs the CUDA adapter, whatever this says)")
    p.add_argument("--devices", type=int, default=1, help="devices the ranks are spread over")
    p.add_argument("--calls", type=int, default=20000, help="calls timed in all")
    p.add_argument("--batch", type=int, default=200, help="calls per timed batch (the median is over batches)")
    p.add_argument("--count", type=int, default=0, help="elements per rank (default: 0, meaning 4 per rank)")
    p.add_argument("--algorithm", default="ring", help="auto or a registered algorithm (python -m bench.model lists them)")
    p.add_argument("--collectives", default="allreduce", help=f"comma-separated, of {', '.join(COLLECTIVES)}")
    p.add_argument("--adapter", default="timed", choices=["timed", "noop", "dry"],
                   help="timed: the device's own adapter, its calls timed and subtracted; noop: its calls do "
                        "nothing; dry: the CUDA adapter on stand-ins for CuPy and its arrays (no GPU needed)")
    p.add_argument("--in-place", action="store_true", help="in place (else out= for the collectives that take it)")
    p.add_argument("--compression", choices=["bf16", "fp16", "int8"],
                   help="allreduce with this codec (its launches are codec kernels; default: none)")
    p.add_argument("--prepared", action="store_true",
                   help="time a prepared call (comm.prepare: checked once, no checks per call) instead of the method")
    p.add_argument("--callgrind", action="store_true", help="instructions per call, under valgrind")
    p.add_argument("-J", "--output_file", help="write the results as JSON here (default: no file)")
    args = p.parse_args(argv)
    args.collectives = cli.names(p, "--collectives", args.collectives, COLLECTIVES)
    if args.callgrind:
        args.calls = min(args.calls, 4000)
        report = callgrind(args)
    else:
        report = measure(args)
    report = {"command": command_line("bench.call_overhead", argv or sys.argv[1:]),
              "device": args.device, "ranks": args.ranks, "devices": args.devices, "algorithm": args.algorithm, "in_place": args.in_place,
              "adapter": args.adapter, "count": args.count or args.ranks * 4, "compression": args.compression,
              "prepared": args.prepared,
              "environment": measured_on(args), "results": report}
    print(json.dumps(report, indent=1))
    if args.output_file:
        cli.write_json(args.output_file, report, say=None)


if __name__ == "__main__":
    main()
