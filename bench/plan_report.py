"""What each plan costs on the GPU path, without running it.

    python -m bench.plan_report [--ranks 4] [--bytes 64M] [-J out.json]

For every collective, algorithm and binding: the kernel launches per device
(all ranks on one device, and one rank per device), the bytes of device
memory the plan reads plus writes over all ranks, and how many of those are
copies between a caller's array and a workspace. Ranks in one process use
the in-place or out-of-place binding (no workspace copies, binding.py);
`workspace` is what ranks in separate processes must do, shown for scale.
"""

import json
import sys

import numpy as np

from bench import cli
from bench.harness import parse_size
from collectives.algorithms import REGISTRY
from collectives.algorithms.schedule import COLLECTIVES
from collectives.binding import IN_PLACE, OUT_OF_PLACE, WORKSPACE
from collectives.devices import open_device
from collectives.executors.device import DeviceRanks
from collectives.plan import build_plan

ROOTED = ("broadcast", "reduce")


def report(nranks, nbytes, dtype=np.dtype("float32")):
    one_device = DeviceRanks([open_device("emulated:0")] * nranks)
    own_devices = DeviceRanks([open_device(f"emulated:{r}") for r in range(nranks)])
    rows = []
    for collective in COLLECTIVES:
        count = nbytes // dtype.itemsize  # each rank's WORK buffer: the message, or all blocks
        count -= count % nranks
        bindings = (IN_PLACE, WORKSPACE) if collective in ROOTED else (OUT_OF_PLACE, IN_PLACE, WORKSPACE)
        for algorithm in sorted(name for name, spec in REGISTRY.items() if collective in spec.collectives):
            for binding in bindings:
                plan = build_plan(collective, algorithm, nranks, count, dtype, "sum", 0, binding)
                rows.append({
                    "collective": collective, "algorithm": algorithm, "binding": binding,
                    "launches_one_device": max(one_device.launches(plan)),
                    "launches_per_device": max(own_devices.launches(plan)),
                    "traffic_bytes": plan.traffic.total,
                    "workspace_copy_bytes": plan.traffic.workspace_copies,
                    "workspace_bytes_per_rank": plan.workspace_bytes,
                })
    return rows


def main(argv=None):
    p = cli.Parser(prog="python -m bench.plan_report", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4, help="ranks, all on one device")
    p.add_argument("--bytes", default="64M", type=cli.size, help="the message: each rank's buffer (allgather: the output)")
    p.add_argument("-J", "--output_file", help="write the results as JSON here (default: no file)")
    args = p.parse_args(argv)
    nbytes = parse_size(args.bytes)
    rows = report(args.ranks, nbytes)
    mib = 1 << 20
    print(f"# {args.ranks} ranks, {nbytes} bytes of float32 per rank's buffer; traffic = bytes read + written, "
          "all ranks")
    print(f"# {'collective':15s} {'algorithm':16s} {'binding':13s} {'launches':>8s} {'launches':>9s} "
          f"{'traffic':>9s} {'workspace':>10s} {'workspace':>10s}")
    print(f"# {'':15s} {'':16s} {'':13s} {'1 device':>8s} {'per dev.':>9s} {'(MiB)':>9s} {'copies MiB':>10s} "
          f"{'MiB/rank':>10s}")
    for r in rows:
        print(f"  {r['collective']:15s} {r['algorithm']:16s} {r['binding']:13s} {r['launches_one_device']:8d} "
              f"{r['launches_per_device']:9d} {r['traffic_bytes'] / mib:9.1f} {r['workspace_copy_bytes'] / mib:10.1f} "
              f"{r['workspace_bytes_per_rank'] / mib:10.1f}")
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump({"command": " ".join([sys.executable, "-m", "bench.plan_report", *(argv or sys.argv[1:])]),
                       "ranks": args.ranks, "bytes": nbytes, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
