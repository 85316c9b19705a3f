"""What each plan costs on the GPU path, without running it.

    python -m bench.plan_report [--ranks 4] [--bytes 64M] [--compression fp16,...] [-J out.json]

For every collective, algorithm and binding: the kernel launches per device
(all ranks on one device, and one rank per device), the bytes of device
memory the plan reads plus writes over all ranks (one rank per device), the
same with all ranks on one device (where fan-out groups read shared
sources once, executors/device.py) against the floor, and how many bytes
are copies between a caller's array and a workspace. Ranks in one process
use the in-place or out-of-place binding (no workspace copies, binding.py);
`workspace` is what ranks in separate processes do on the step protocol,
shown for scale; `symmetric` and `staged` what they do with
COLLECTIVES_ONE_KERNEL_ALLREDUCE=1 beyond 64 KiB (any plan with direct's
bits: barrier, share, barrier on symmetric memory, or with a copy into and
out of each rank's staging buffer; launches per rank, the staging copies
as workspace copies).

The floor is what ranks sharing one device must move at least: every input
read once and every output written once (allreduce: 2 n S for n ranks of S
bytes; broadcast: S read, (n-1) S written). Between devices a plan must also
move bytes across links, so the floor is lower than any plan there.

`--compression` adds the allreduce plans with each codec: their launches
are codec_batch kernels, each running the codec operations
(compression/wire.py) that touch no common memory side by side
(compression/kernels.py: batch_rows), and their traffic is what those
kernels read and write, wire form and float32 alike. Direct with every
rank on one device is one codec_round_sum instead, at the floor (the
rounding done in registers: no wire form is written).
"""

import sys

import numpy as np

from bench import cli
from bench.compression_model import codec_phase_bytes
from bench.environment import command_line, git_commit
from collectives.algorithms import REGISTRY
from collectives.algorithms.schedule import ALLGATHER, ALLREDUCE, BROADCAST, COLLECTIVES, REDUCE_SCATTER, REDUCE_TO_ROOT
from collectives.binding import IN_PLACE, OUT_OF_PLACE, WORKSPACE
from collectives.compression.kernels import CODECS
from collectives.devices import open_device
from collectives.executors.device import DeviceRanks
from collectives.executors.symmetric_rows import call_traffic
from collectives.plan import build_plan


def floor_bytes(collective, nranks, count, itemsize, in_place=False):
    """The least traffic of a collective whose ranks share one device: each
    input read once, each output written once (`count`: a rank's WORK). In
    place, allgather's own block and a broadcast's root are already where
    they belong."""
    message = count * itemsize
    if collective == ALLREDUCE:
        return 2 * nranks * message
    if collective in (REDUCE_SCATTER, REDUCE_TO_ROOT):
        return nranks * message + message   # every input, and one block per rank (or the root's result)
    if collective == ALLGATHER:
        return message + (nranks - 1 if in_place else nranks) * message
    assert collective == BROADCAST
    return (nranks if in_place else nranks + 1) * message


def codec_traffic_bytes(plan):
    """Bytes a compressed plan's codec kernels read plus write, all ranks."""
    return sum(r.link + r.memory + r.codec for phase in plan.phases
               for r in codec_phase_bytes(phase.wire_ops_by_rank, plan.compression))


def report(nranks, nbytes, dtype=np.dtype("float32"), codecs=()):
    one_device = DeviceRanks([open_device("emulated:0")] * nranks)
    own_devices = DeviceRanks([open_device(f"emulated:{r}") for r in range(nranks)])
    rows = []
    for collective in COLLECTIVES:
        count = nbytes // dtype.itemsize  # each rank's WORK buffer: the message, or all blocks
        count -= count % nranks
        bindings = (OUT_OF_PLACE, IN_PLACE, WORKSPACE)
        for algorithm in sorted(name for name, spec in REGISTRY.items() if collective in spec.collectives):
            for codec in (None, *codecs) if collective == ALLREDUCE else (None,):
                # A compressed plan always runs through the workspace, which
                # holds the wire copies and the float32 accumulator.
                for binding in bindings if codec is None else (WORKSPACE,):
                    plan = build_plan(collective, algorithm, nranks, count, dtype, "sum", 0, binding,
                                      compression=codec)
                    floor = floor_bytes(collective, nranks, count, dtype.itemsize, binding == IN_PLACE)
                    # In place, ranks on one device run the lockstep form (binding.py).
                    shared = plan if binding != IN_PLACE else build_plan(
                        collective, algorithm, nranks, count, dtype, "sum", 0, one_device.in_place_binding)
                    launches = (max(one_device.launches(shared)), max(own_devices.launches(plan)))
                    if codec is None:
                        traffic, on_one_device = plan.traffic.total, one_device.traffic(shared)
                    else:
                        traffic = on_one_device = codec_traffic_bytes(plan)
                        if one_device.rounds_in_one_pass(plan):   # codec_round_sum: each input once, each output once
                            on_one_device = floor_bytes(collective, nranks, count, dtype.itemsize)
                    rows.append({
                        "collective": collective, "algorithm": algorithm, "binding": binding,
                        "compression": codec,
                        "launches_one_device": launches[0],
                        "launches_per_device": launches[1],
                        "traffic_bytes": traffic,
                        "traffic_one_device_bytes": on_one_device,
                        "floor_bytes": floor,
                        "one_device_over_floor": on_one_device / floor,
                        # a compressed plan's first pass encodes the input: no plain copy
                        "workspace_copy_bytes": plan.traffic.workspace_copies if codec is None else None,
                        "workspace_bytes_per_rank": plan.workspace_bytes,
                    })
        # GPU ranks in separate processes with COLLECTIVES_ONE_KERNEL_ALLREDUCE=1,
        # past the LL path: any plan with direct's bits runs as barrier, share,
        # barrier on symmetric memory (comm.alloc), or with a copy in and out
        # of each rank's staging buffer (executors/symmetric.py).
        # Out of place, as the plans above; a broadcast in place too (its
        # root's copy to itself is left out).
        for binding, staged, in_place in (("symmetric", False, False), ("staged", True, False),
                                          *((("symmetric in place", False, True), ("staged in place", True, True))
                                            if collective == BROADCAST else ())):
            traffic, launches = call_traffic(collective, nranks, 0, count, dtype.itemsize, staged, in_place)
            floor = floor_bytes(collective, nranks, count, dtype.itemsize, in_place)
            copies = call_traffic(collective, nranks, 0, count, dtype.itemsize, True, in_place)[0] - \
                call_traffic(collective, nranks, 0, count, dtype.itemsize, False, in_place)[0] if staged else 0
            rows.append({
                "collective": collective, "algorithm": "direct", "binding": binding, "compression": None,
                "launches_one_device": launches, "launches_per_device": launches,
                "traffic_bytes": traffic, "traffic_one_device_bytes": traffic, "floor_bytes": floor,
                "one_device_over_floor": traffic / floor, "workspace_copy_bytes": copies,
                "workspace_bytes_per_rank": 0,
            })
    return rows


def main(argv=None):
    p = cli.Parser(prog="python -m bench.plan_report", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4, help="ranks, all on one device")
    p.add_argument("--bytes", default="64M", type=cli.size, help="the message: each rank's buffer (allgather: the output)")
    p.add_argument("--compression", default="",
                   help=f"also the compressed allreduce plans with these codecs, comma-separated ({', '.join(CODECS)})")
    p.add_argument("-J", "--output_file", help="write the results as JSON here (default: no file)")
    args = p.parse_args(argv)
    nbytes = cli.parse_size(args.bytes)
    codecs = [c for c in args.compression.split(",") if c]
    for codec in codecs:
        if codec not in CODECS:
            p.error(f"--compression: unknown codec {codec!r}; expected some of {', '.join(CODECS)}")
    rows = report(args.ranks, nbytes, codecs=codecs)
    mib = 1 << 20
    print(f"# {args.ranks} ranks, {nbytes} bytes of float32 per rank's buffer; traffic = bytes read + written, "
          "all ranks")
    print(f"# {'collective':15s} {'algorithm':21s} {'binding':13s} {'launches':>8s} {'launches':>9s} "
          f"{'traffic':>9s} {'1 device':>9s} {'workspace':>10s} {'workspace':>10s}")
    print(f"# {'':15s} {'':21s} {'':13s} {'1 device':>8s} {'per dev.':>9s} {'(MiB)':>9s} {'/ floor':>9s} "
          f"{'copies MiB':>10s} {'MiB/rank':>10s}")
    for r in rows:
        name = r["algorithm"] + (f" {r['compression']}" if r["compression"] else "")
        print(f"  {r['collective']:15s} {name:21s} {r['binding']:13s} {r['launches_one_device']:8d} "
              f"{r['launches_per_device']:9d} {r['traffic_bytes'] / mib:9.1f} {r['one_device_over_floor']:9.2f} "
              f"{'-' if r['workspace_copy_bytes'] is None else format(r['workspace_copy_bytes'] / mib, '.1f'):>10s} "
              f"{r['workspace_bytes_per_rank'] / mib:10.1f}")
    if args.output_file:
        document = {"command": command_line("bench.plan_report", argv or sys.argv[1:]),
                    # counted from the plans: the code, not the machine, sets them
                    "environment": {"git_commit": git_commit()},
                    "ranks": args.ranks, "bytes": nbytes, "rows": rows}
        cli.write_json(args.output_file, document, say=None)


if __name__ == "__main__":
    main()
