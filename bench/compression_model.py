"""When does gradient compression win? A model of a compressed allreduce
against a plain one, from the plans themselves, for links one GPU cannot show.

    python -m bench.compression_model [--ranks 8] [--sizes 1M,16M,64M,256M]
        [--algorithms ring,two_shot] [--codecs bf16,fp16,int8]
        [--links nvlink,pcie,ib400,host] [--memory-gbps 2900] [--codec-gbps G] [-J out.json]

Ranks on one GPU share its memory, so there the "wire" is the memory itself
and compression can only cost (bench.codec_speed measures what). Between
GPUs the bytes a rank reads from its peers cross a link, and compression
shrinks exactly those. This model says by how much that pays.

What it assumes (each a flag):

- The plan is the one `collectives` runs for ranks in separate processes, one
  per GPU (binding "workspace": inputs copied in, results copied out), for
  every rank count and algorithm, compressed or not (build_plan).
- A phase costs a fixed step (`--step-us`: a launch and a flag handshake,
  the GPU model's constant) plus, on its busiest rank, the bytes it reads
  from peers at the link's speed plus the bytes it reads and writes in its
  own memory: at `--memory-gbps` for copies and plain folds (a device copy's
  read plus write bandwidth, 2900 GB/s on the H100 we measured), at
  `--codec-gbps` for codec operations (encode, decode, decode_add). Link
  and memory time add up: no overlap, so the model is pessimistic for both.
- A link's speed is per direction, per GPU: NVLink 4 (H100) ~450 GB/s,
  PCIe 5 x16 ~25 GB/s achieved, 400 Gb/s InfiniBand ~50 GB/s, and `host`,
  our measured host transport between processes (the host-processes
  constant of `auto`'s model).
- Codec speed, unless given, is 0.8 of `--memory-gbps`, the goal the GPU
  codec kernels are built for; it is an assumption until
  `python -m bench.codec_speed --device cuda` has measured it on a GPU.

The break-even link speed is the one at which both take the same time: on a
slower link compression wins. It is independent of the link's latency,
which both pay alike.
"""

import math
import sys

import numpy as np

from bench import cli
from bench.environment import command_line, git_commit
from collectives.algorithms import MODELS, REGISTRY
from collectives.algorithms.schedule import ALLREDUCE
from collectives.binding import WORKSPACE
from collectives.compression.kernels import CODECS
from collectives.compression.wire import encoded_nbytes
from collectives.plan import COUNT, NSRC, RANK, SRC0, SRC_RANK, build_plan

GB = 1e9
LINKS = {   # bytes per second, one direction, one GPU
    "nvlink": 450 * GB,
    "pcie": 25 * GB,
    "ib400": 50 * GB,
    "host": MODELS["host-processes"].bytes_per_second,
}
FLOAT32 = np.dtype("float32")

# Which refs of a codec operation (compression/wire.py, lower_rows) it
# writes and reads, by position after the kind, and in which form:
# F float32, W the codec's wire form. Other positions are not memory.
OPERAND_FORMS = {   # kind: ((written...), (read...))
    "copy": (((0, "F"),), ((1, "F"),)),
    "decode": (((0, "F"),), ((1, "W"),)),
    "copy_wire": (((0, "W"),), ((1, "W"),)),
    "encode": (((0, "F"), (2, "W")), ((1, "F"),)),
    "add": (((0, "F"), (4, "W")), ((1, "F"), (2, "F"))),
    "decode_add": (((0, "F"), (4, "W")), ((1, "F"), (2, "W"))),
}
MEMORY_OPS = ("copy", "copy_wire")   # the rest run at codec speed


class PhaseBytes:
    """A rank's bytes in one phase: read from peers (the link), and read or
    written in its own memory by plain copies and folds or by codec ops."""

    def __init__(self):
        self.link = self.memory = self.codec = 0

    def seconds(self, link_bps, memory_bps, codec_bps):
        return self.link / link_bps + self.memory / memory_bps + self.codec / codec_bps


def plain_phase_bytes(table, nranks, itemsize):
    """Per rank, the bytes of one phase of an uncompressed plan."""
    ranks = [PhaseBytes() for _ in range(nranks)]
    for row in table:
        rank, nbytes = int(row[RANK]), int(row[COUNT]) * itemsize
        mine = ranks[rank]
        mine.memory += nbytes                                  # the write
        for s in range(int(row[NSRC])):
            if int(row[SRC0 + 3 * s + SRC_RANK]) == rank:
                mine.memory += nbytes
            else:
                mine.link += nbytes
    return ranks


def codec_phase_bytes(ops_by_rank, codec):
    """Per rank, the bytes of one phase of a compressed plan's codec program."""
    ranks = []
    for rank, ops in enumerate(ops_by_rank):
        mine = PhaseBytes()
        for kind, *operands in ops:
            written, read = OPERAND_FORMS[kind]
            for position, form, reading in [(*w, False) for w in written] + [(*r, True) for r in read]:
                ref = operands[position]
                if ref is None:
                    continue
                owner, _buffer, _offset, count = ref
                nbytes = 4 * count if form == "F" else encoded_nbytes(codec, count)
                if reading and owner != rank:
                    mine.link += nbytes
                elif kind in MEMORY_OPS:
                    mine.memory += nbytes
                else:
                    mine.codec += nbytes
        ranks.append(mine)
    return ranks


def phases_bytes(algorithm, nranks, nbytes, codec):
    """Per phase, per rank PhaseBytes of the plan (codec None: uncompressed)."""
    count = max(nranks, nbytes // FLOAT32.itemsize)
    plan = build_plan(ALLREDUCE, algorithm, nranks, count, FLOAT32, "sum", 0, WORKSPACE, compression=codec)
    if codec is None:
        return [plain_phase_bytes(phase.table, nranks, FLOAT32.itemsize) for phase in plan.phases]
    return [codec_phase_bytes(phase.wire_ops_by_rank, codec) for phase in plan.phases]


def predicted_seconds(phases, link_bps, memory_bps, codec_bps, step_seconds):
    """Phases run one after another; each costs its busiest rank plus a step."""
    return sum(step_seconds + max(r.seconds(link_bps, memory_bps, codec_bps) for r in ranks) for ranks in phases)


def break_even_link(plain, compressed, memory_bps, codec_bps, step_seconds, low=1e6, high=1e15):
    """The link speed (bytes/s) below which the compressed plan is faster:
    None if it is never faster in [low, high], math.inf if it always is
    (its own memory traffic is smaller too).
    Bisection on a log scale: the difference only grows as the link slows."""
    def gain(link_bps):
        return (predicted_seconds(plain, link_bps, memory_bps, codec_bps, step_seconds)
                - predicted_seconds(compressed, link_bps, memory_bps, codec_bps, step_seconds))
    if gain(low) <= 0:
        return None
    if gain(high) > 0:
        return math.inf
    for _ in range(100):
        middle = math.sqrt(low * high)
        low, high = (middle, high) if gain(middle) > 0 else (low, middle)
    return math.sqrt(low * high)


def model(nranks, sizes, algorithms, codecs, links, memory_bps, codec_bps, step_seconds):
    rows = []
    for nbytes in sizes:
        for algorithm in algorithms:
            plain = phases_bytes(algorithm, nranks, nbytes, None)
            row = {"bytes": nbytes, "algorithm": algorithm,
                   "plain_us": {link: predicted_seconds(plain, bps, memory_bps, codec_bps, step_seconds) * 1e6
                                for link, bps in links.items()}}
            for codec in codecs:
                compressed = phases_bytes(algorithm, nranks, nbytes, codec)
                even = break_even_link(plain, compressed, memory_bps, codec_bps, step_seconds)
                row[codec] = {
                    "us": {link: predicted_seconds(compressed, bps, memory_bps, codec_bps, step_seconds) * 1e6
                           for link, bps in links.items()},
                    # None: never faster; "always": faster on any link
                    "break_even_gbps": None if even is None else "always" if math.isinf(even) else even / GB,
                }
            rows.append(row)
    return rows


def print_table(rows, codecs, links):
    print("# predicted time per allreduce (us): plain / " + " / ".join(codecs) + "; break-even link (GB/s) per codec")
    header = f"{'bytes':>10s} {'algorithm':>10s}" + "".join(f" {link:>28s}" for link in links)
    print(header + "".join(f" {'even ' + c:>10s}" for c in codecs))
    for row in rows:
        line = f"{row['bytes']:>10d} {row['algorithm']:>10s}"
        for link in links:
            cells = [row["plain_us"][link]] + [row[c]["us"][link] for c in codecs]
            line += " " + f"{' / '.join(f'{t:.0f}' for t in cells):>28s}"
        for codec in codecs:
            even = row[codec]["break_even_gbps"]
            text = "never" if even is None else even if isinstance(even, str) else f"{even:.0f}"
            line += f" {text:>10s}"
        print(line)


def parse_args(argv=None):
    p = cli.Parser(prog="python -m bench.compression_model", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=8, help="ranks, one GPU each")
    p.add_argument("--sizes", default="1M,16M,64M,256M", type=cli.sizes, help="message sizes per rank, comma-separated")
    p.add_argument("--algorithms", default="ring,two_shot", help="allreduce algorithms, comma-separated")
    p.add_argument("--codecs", default=",".join(CODECS), help="codecs, comma-separated")
    p.add_argument("--links", default=",".join(LINKS), help=f"links to price, of {', '.join(LINKS)}")
    p.add_argument("--memory-gbps", type=float, default=2900.0,
                   help="a device copy's bytes read plus written per second, GB/s")
    p.add_argument("--codec-gbps", type=float, default=None,
                   help="codec operations' bytes read plus written per second, GB/s (default: 0.8 x memory)")
    p.add_argument("--step-us", type=float, default=MODELS["gpu-processes"].step_seconds * 1e6,
                   help="fixed cost of a phase, us")
    p.add_argument("-J", "--output_file", help="write the rows as JSON here (default: no file)")
    args = p.parse_args(argv)
    args.sizes = [cli.parse_size(s) for s in args.sizes.split(",")]
    args.algorithms = args.algorithms.split(",")
    args.codecs = args.codecs.split(",")
    for name in args.algorithms:
        if name not in REGISTRY or ALLREDUCE not in REGISTRY[name].collectives:
            p.error(f"--algorithms: {name!r} is not an allreduce algorithm")
    for name in args.codecs:
        if name not in CODECS:
            p.error(f"--codecs: unknown codec {name!r}; expected some of {', '.join(CODECS)}")
    unknown = [name for name in args.links.split(",") if name not in LINKS]
    if unknown:
        p.error(f"--links: unknown link {unknown[0]!r}; expected some of {', '.join(LINKS)}")
    args.links = {name: LINKS[name] for name in args.links.split(",")}
    if args.codec_gbps is None:
        args.codec_gbps = 0.8 * args.memory_gbps
    return args


def main(argv=None):
    args = parse_args(argv)
    rows = model(args.ranks, args.sizes, args.algorithms, args.codecs, args.links,
                 args.memory_gbps * GB, args.codec_gbps * GB, args.step_us * 1e-6)
    print(f"# {args.ranks} ranks, one GPU each; memory {args.memory_gbps:.0f} GB/s, codecs {args.codec_gbps:.0f} GB/s, "
          f"step {args.step_us:.2f} us; links (GB/s): "
          + ", ".join(f"{name} {bps / GB:.0f}" for name, bps in args.links.items()))
    print_table(rows, args.codecs, args.links)
    if args.output_file:
        report = {"command": command_line("bench.compression_model", sys.argv[1:] if argv is None else argv),
                  "environment": {"git_commit": git_commit()},   # a model: the code, not the machine
                  "ranks": args.ranks, "memory_gbps": args.memory_gbps, "codec_gbps": args.codec_gbps,
                  "step_us": args.step_us, "links_gbps": {k: v / GB for k, v in args.links.items()},
                  "rows": rows}
        cli.write_json(args.output_file, report, say=None)


if __name__ == "__main__":
    main()
