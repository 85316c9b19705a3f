"""The cost models: counted from the schedules and plans, set beside what was measured.

    python -m bench.model [--ranks 8] [--bytes 1M] [--collective allreduce] [--transport host-processes]
    python -m bench.model --table | --results RUN.json... | --calibrate RUN.json...
    python -m bench.model hierarchy | compression | plans [FLAGS]      (each with its own --help)

What each model weighs and assumes, and what it said: docs/design.md
("Algorithms and auto"), docs/across-nodes.md ("A model for scale"),
docs/compression.md ("When compression pays between GPUs") and docs/gpu.md
("Plans: launches and memory traffic").
"""

import json
import math
import sys
import textwrap
from typing import NamedTuple

import numpy as np

from bench import cli
from bench.environment import command_line, git_commit
from bench.report_runs import markdown
from collectives.algorithms import (
    DEFAULT_TRANSPORT, MODELS, REGISTRY, bytes_moved, modelled_seconds, schedule_for, synchronisations,
)
from collectives.algorithms.schedule import (
    ALLGATHER, ALLREDUCE, BROADCAST, COLLECTIVES, REDUCE_SCATTER, REDUCE_TO_ROOT,
)
from collectives.binding import IN_PLACE, OUT_OF_PLACE, WORKSPACE
from collectives.compression.kernels import CODECS
from collectives.compression.wire import encoded_nbytes
from collectives.devices import open_device
from collectives.executors.device import DeviceRanks
from collectives.executors.symmetric_rows import call_traffic
from collectives.hierarchy import uses_two_shot
from collectives.plan import COUNT, NSRC, RANK, SRC0, SRC_RANK, build_plan

PROG = "python -m bench.model"


# What the models share.

def algorithms_for(collective):
    """The registered algorithms that run `collective`, in registry order."""
    return [name for name, spec in REGISTRY.items() if collective in spec.collectives]


ALLREDUCE_ALGORITHMS = algorithms_for(ALLREDUCE)


def least_squares(factors, seconds, relative=False):
    """The coefficients c for which factors @ c fits `seconds` best (a row
    of factors per measurement). relative: every row over its own seconds,
    so that the error minimised is relative and small messages count as
    much as large ones."""
    if relative:
        factors, seconds = factors / seconds[:, None], np.ones_like(seconds)
    return np.linalg.lstsq(factors, seconds, rcond=None)[0]


def write_counted_json(path, subcommand, argv, fields):
    """Write a subcommand's results where its -J says, with the command that
    made them. They are counted from the plans, not measured: the code sets
    them, so the commit is recorded and the machine is not."""
    document = {"command": command_line("bench.model", [subcommand, *argv]),
                "environment": {"git_commit": git_commit()},
                **fields}
    cli.write_json(path, document, say=None)


# No subcommand: every algorithm's costs and the time auto's model predicts
# (collectives/algorithms/__init__.py), the textbook table, auto against the
# fastest in measured runs, and auto's constants fitted to such runs.

# The textbook table: communication rounds for K nodes, as textbooks and lecture notes give them.
TEXTBOOK_ROUNDS = {
    "star": ("2K", lambda k: 2 * k),
    "tree": ("2 log2 K", lambda k: 2 * math.log2(k)),
    "butterfly": ("log2 K", lambda k: math.log2(k)),
    "ring": ("2(K-1)", lambda k: 2 * (k - 1)),
}
# Where our step count differs from the textbook rounds, why (one line).
WHY_DIFFERENT = {
    "star": "the textbook counts the master's 2K messages one at a time; our master reads all peers in one "
            "step, and all copy from it in one",
    "tree": "for K not a power of two the tree has ceil(log2 K) levels",
    "butterfly": "for K not a power of two the extra ranks fold in first and copy the result last: 2 more steps",
}
# Ranks in processes copy a call's N bytes in and out of their workspace as well.
WORKSPACE_TRANSPORTS = ("host-processes", "host-processes-oversubscribed", "gpu-processes")


def predictions(collective, nranks, nbytes, transport):
    """Per algorithm: (name, Costs, predicted seconds)."""
    root = 0 if collective in (BROADCAST, REDUCE_TO_ROOT) else None
    model = MODELS[transport]
    return [(name, REGISTRY[name].costs(collective, nranks, nbytes),
             modelled_seconds(schedule_for(name, collective, nranks, root), nbytes, model))
            for name in algorithms_for(collective)]


def print_model(collective, nranks, nbytes, transport, measured=None):
    """Per algorithm: steps, bytes, the model's time, and `measured` times
    (algorithm -> µs, out of place) where a results file has them."""
    model = MODELS[transport]
    measured = measured or {}
    print(f"# {collective}, {nranks} ranks, {nbytes} B; model {transport}: {model.step_seconds * 1e6:.2f} us "
          f"a step, {model.bytes_per_second / 1e9:.2f} GB/s ({model.measured_by})")
    print(f"# {'algorithm':>16s}  {'steps':>5s}  {'sent/rank (B)':>14s}  {'moved/rank (B)':>14s}  "
          f"{'predicted (us)':>14s}" + (f"  {'measured (us)':>14s}" if measured else ""))
    for name, costs, seconds in sorted(predictions(collective, nranks, nbytes, transport), key=lambda r: r[2]):
        line = f"  {name:>16s}  {costs.steps:5d}  {costs.sent:14.0f}  {costs.moved:14.0f}  {seconds * 1e6:14.1f}"
        if measured:
            line += f"  {measured[name]:14.1f}" if name in measured else f"  {'-':>14s}"
        print(line)
    if measured:
        print("# predicted leaves out what every algorithm pays alike (a call's fixed cost, and for ranks in "
              "processes the copies into and out of the workspace): compare differences, not totals")


def measured_times(paths, nranks, nbytes):
    """(transport, algorithm -> µs out of place) of the rows of `nranks` ranks
    and `nbytes` in results files that name their algorithm."""
    transport, times = None, {}
    for environment, row in load(paths):
        if environment["ranks"] == nranks and row["size"] == nbytes and row["algorithm"] != "auto":
            transport = transport_of(environment)
            times[row["algorithm"]] = row["out_of_place"]["time_us"]
    return transport, times


def print_table(nranks, nbytes):
    """The textbook allreduce table (rounds per algorithm), reproduced from the schedules."""
    k, n_bytes = nranks, nbytes
    print(f"# allreduce on K = {k} nodes, N = {n_bytes} B; ours = counted on the registered schedules "
          "(busiest rank)")
    body = []
    for name in ALLREDUCE_ALGORITHMS:
        costs = REGISTRY[name].costs(ALLREDUCE, k, n_bytes)
        formula, rounds = TEXTBOOK_ROUNDS.get(name, ("", None))
        value = "" if rounds is None else f"{rounds(k):g}"
        body.append([name, formula, value, costs.steps, f"{costs.sent / n_bytes:.3g} N",
                     f"{costs.moved / n_bytes:.3g} N"])
    header = ["algorithm", "textbook: rounds", f"= for K={k}", "ours: steps", "ours: sent per node",
              "ours: moved per node"]
    print("\n".join(markdown(header, body, text_columns=2)))
    for name, why in WHY_DIFFERENT.items():
        if name in REGISTRY:
            print(f"- {name}: {why}.")


def load(paths):
    """(environment, row) for every row of every results file whose algorithm
    is known: named in the row, or (older files) the one `--algorithm` of the
    command that made the file."""
    found = []
    for path in paths:
        report = json.loads(open(path).read())
        if report.get("collective", ALLREDUCE) != ALLREDUCE:
            continue  # the model is fitted and judged on allreduce runs
        words = report["environment"]["command"].split()
        named = words[words.index("--algorithm") + 1] if "--algorithm" in words else "auto"
        for row in report["rows"]:
            if "algorithm" not in row and "," not in named and row["backend"] in ("host", "ours"):
                row = dict(row, algorithm=named)
            if "algorithm" in row:
                found.append((report["environment"], row))
    return found


def transport_of(environment):
    """The cost model a run's ranks ask: which device, in one process or
    several, and for host processes whether they outnumber the cores."""
    device = "host" if environment.get("device", "host").startswith("host") else "gpu"
    processes = environment.get("processes", 1)
    if processes == 1:
        return f"{device}-in-process"
    crowded = device == "host" and processes > environment.get("cores", processes)
    return f"{device}-processes" + ("-oversubscribed" if crowded else "")


def observations(found):
    """(transport, ranks, algorithm, bytes, seconds) of every measured row and placement."""
    out = []
    for environment, row in found:
        if row["algorithm"] == "auto":
            continue
        for place in ("out_of_place", "in_place"):
            out.append((transport_of(environment), environment["ranks"], row["algorithm"], row["size"],
                        row[place]["time_us"] * 1e-6))
    return out


def features(transport, nranks, algorithm, nbytes):
    """(steps, bytes moved) the model weighs for one call."""
    schedule = schedule_for(algorithm, ALLREDUCE, nranks, None)
    moved = bytes_moved(schedule, nbytes, MODELS[transport])
    if transport in WORKSPACE_TRANSPORTS:
        moved += 2 * nbytes
    return synchronisations(schedule, MODELS[transport]), moved


def calibrate(paths):
    """Fit t = t0 + steps * step_seconds + moved / bytes_per_second per
    transport, relative error weighted (small messages count as much as
    large ones). t0, the fixed cost of a call, is the same for every
    algorithm, so it moves no choice and the model leaves it out."""
    fitted = {}
    by_transport = {}
    for obs in observations(load(paths)):
        by_transport.setdefault(obs[0], []).append(obs)
    for transport, obs in sorted(by_transport.items()):
        a = np.array([[1.0, *features(transport, n, alg, b)] for _, n, alg, b, _ in obs])
        t = np.array([o[4] for o in obs])
        t0, step, per_byte = least_squares(a, t, relative=True)
        if step <= 0 or per_byte <= 0:
            print(f"# {transport}: the fit gave a non-positive constant ({step:.3g} s/step, {per_byte:.3g} s/B); "
                  "measure more sizes or algorithms")
            continue
        predicted = a @ np.array([t0, step, per_byte])
        error = np.median(np.abs(predicted - t) / t)
        fitted[transport] = MODELS[transport]._replace(step_seconds=float(step), bytes_per_second=float(1 / per_byte))
        print(f"# {transport}: {len(obs)} measurements; step {step * 1e6:.2f} us, "
              f"{1 / per_byte / 1e9:.2f} GB/s, fixed {t0 * 1e6:.1f} us a call; median |error| {error:.1%}")
        model = MODELS[transport]
        print(f'    "{transport}": CostModel({step:.3g}, {1 / per_byte:.3g}, {model.fused_reduce}, '
              f'{model.one_engine}, {model.contended}, {model.per_transfer}, "<the command that made the run>"),')
    return fitted


def auto_against_fastest(paths):
    """Per run and size: the fastest algorithm measured, auto's pick and its
    measured time relative to the fastest (1.00 = as fast)."""
    runs = {}
    for environment, row in load(paths):
        key = (environment["command"], environment["ranks"], row["size"])
        runs.setdefault(key, {})[row["algorithm"]] = row
    body = []
    worst = 0.0
    for (_, nranks, size), by_algorithm in sorted(runs.items(), key=lambda item: (item[0][1], item[0][2])):
        if "auto" not in by_algorithm:
            continue
        timed = {name: row["out_of_place"]["time_us"] for name, row in by_algorithm.items() if name != "auto"}
        fastest = min(timed, key=timed.get)
        auto = by_algorithm["auto"]
        ratio = auto["out_of_place"]["time_us"] / timed[fastest]
        worst = max(worst, ratio)
        body.append([nranks, size, fastest, f"{timed[fastest]:.1f}", auto["picked"],
                     f"{timed.get(auto['picked'], float('nan')):.1f}", f"{auto['out_of_place']['time_us']:.1f}",
                     f"{ratio:.2f}"])
    header = ["processes", "size", "fastest", "its time (us)", "auto picks", "the pick's own time (us)",
              "auto's time (us)", "auto / fastest"]
    print("\n".join(markdown(header, body, text_columns=0)))
    return worst


def run_algorithms_model(argv):
    subcommands = [textwrap.fill(summary, 79, initial_indent=f"  {name:12s} ", subsequent_indent=" " * 15)
                   for name, (_, summary) in SUBCOMMANDS.items()]
    p = cli.Parser(prog=PROG, description=(
        "Without a subcommand: each algorithm's steps and bytes, counted from its schedule, and the time auto's "
        "model predicts; the textbook table (--table); auto against the fastest in measured runs (--results); "
        "auto's constants fitted to such runs (--calibrate); docs/design.md, \"Algorithms and auto\"."),
        epilog="\n".join(["subcommands (python -m bench.model SUBCOMMAND --help: their flags):", *subcommands]))
    p.add_argument("--ranks", type=int, default=8, help="ranks to model")
    p.add_argument("--bytes", default="1M", type=cli.size, help="message size (suffixes K, M, G)")
    p.add_argument("--collective", default=ALLREDUCE, choices=COLLECTIVES, help="collective to model")
    p.add_argument("--transport", default=DEFAULT_TRANSPORT, choices=sorted(MODELS), help="whose fitted constants predict the time")
    p.add_argument("--table", action="store_true", help="each algorithm's rounds, bytes sent and bytes moved per rank, from the schedules")
    p.add_argument("--results", nargs="+", help="benchmark JSONs of several algorithms side by side "
                   "(bench.all_reduce_perf --algorithm auto,ring,... -J): auto against the fastest")
    p.add_argument("--calibrate", nargs="+", help="benchmark JSONs to fit each transport's constants to")
    args = p.parse_args(argv)
    nbytes = cli.parse_size(args.bytes)
    if args.ranks < 1:
        p.error("--ranks must be at least 1")
    if args.calibrate:
        calibrate(args.calibrate)
    elif args.results:
        transport, times = measured_times(args.results, args.ranks, nbytes)
        if times:  # the model next to what was measured at --ranks and --bytes
            print_model(ALLREDUCE, args.ranks, nbytes, transport, times)
        worst = auto_against_fastest(args.results)
        print(f"# auto is within {worst - 1:.0%} of the fastest algorithm measured at every size"
              if worst >= 1 else "# auto was the fastest at every size")
    elif args.table:
        print_table(args.ranks, nbytes)
    else:
        print_model(args.collective, args.ranks, nbytes, args.transport)
    return 0


# hierarchy: the hierarchical allreduce (collectives/hierarchy.py) on K
# nodes of G ranks, S bytes per rank, step by step.

class Links(NamedTuple):
    intra_latency: float      # s a step inside a node
    intra_bandwidth: float    # B/s a rank inside a node
    inter_latency: float      # s a round across nodes
    inter_bandwidth: float    # B/s a rank across nodes
    per_message: float        # s each further message of a round
    fold_bandwidth: float     # B/s of the fold across nodes (read + write)
    source: str


# Assumed, not measured: b_out is what one rank gets across the network,
# with one NIC per GPU as in rail-optimised GPU nodes.
NVLINK_400G = Links(3e-6, 360e9, 8e-6, 45e9, 5e-7, 2.5e12,
                    "assumed: NVLink-class inside a node, 400 Gb/s-class between nodes, one NIC per GPU")


def across_nodes(nodes, range_bytes):
    """(scheme, rounds R, bytes V a rank sends, bytes W its fold reads and
    writes) of the step across nodes for a rank's range, the scheme the
    code's (hierarchy.uses_two_shot). R and V are the scheme's own costs;
    W is not its `moved`, which for two_shot also counts the all-gather's
    copies: the fold reads K partials and writes one, of the whole range
    (direct) or of its 1/K (two_shot)."""
    two_shot = uses_two_shot(nodes, range_bytes)
    scheme = "two_shot" if two_shot else "direct"
    costs = REGISTRY[scheme].costs(ALLREDUCE, nodes, range_bytes)
    return scheme, costs.steps, costs.sent, ((nodes + 1) / nodes if two_shot else nodes + 1) * range_bytes


def predict(links, nodes, ranks_per_node, nbytes):
    """(seconds, {step: seconds}, across-node scheme) of one allreduce of S
    = `nbytes` per rank on K nodes of G ranks, the steps one after another:
    inside = 2 [(G-1) a_in + (G-1)/G S / b_in], across = R a_out + R (K-2) o
    + V / b_out (a round's K-1 messages: o for each after the first), fold =
    W / b_fold, with across_nodes' R, V and W (docs/across-nodes.md)."""
    k, g = nodes, ranks_per_node
    inside = 2 * ((g - 1) * links.intra_latency + (g - 1) / g * nbytes / links.intra_bandwidth)
    scheme, rounds, sent, folded = across_nodes(k, nbytes / g)
    across = rounds * links.inter_latency + rounds * (k - 2) * links.per_message + sent / links.inter_bandwidth
    fold = folded / links.fold_bandwidth
    return inside + across + fold, {"inside": inside, "across": across, "fold": fold}, scheme


def print_hierarchy_table(links, node_counts, ranks_per_node, sizes):
    """Markdown: per node count and size, the predicted time, bus bandwidth and where the time goes."""
    print(f"# model of the hierarchical allreduce, {ranks_per_node} ranks a node; {links.source}")
    body = []
    for k in node_counts:
        n = k * ranks_per_node
        for nbytes in sizes:
            seconds, parts, scheme = predict(links, k, ranks_per_node, nbytes)
            busbw = nbytes / seconds * 2 * (n - 1) / n / 1e9
            shares = [f"{parts[p] / seconds:.0%}" for p in ("inside", "across", "fold")]
            body.append([k, n, cli.size_label(nbytes), scheme, f"{seconds * 1e6:.1f}", f"{busbw:.1f}", *shares])
    header = ["nodes", "ranks", "size", "across nodes", "predicted time (µs)", "busbw (GB/s)",
              "inside nodes", "across nodes", "fold"]
    print("\n".join(markdown(header, body, text_columns=0)))


def calibrate_hierarchy(path, fallback):
    """The constants of the machine a bench.hierarchy_perf run measured
    (least squares over its sizes, of each step's measured "components"),
    and the model beside its times. `fallback` gives what the fit leaves
    out: the cost of a round's further messages."""
    report = json.loads(open(path).read())
    nodes = report["nodes"]
    k, g = len(nodes), max(len(node) for node in nodes)
    rows = [row for row in report["rows"] if not row["components"].get("compiled")]   # (one C call: no split)
    if len(rows) < 2:
        raise SystemExit(f"{path}: fewer than 2 sizes ran as phases (the others were compiled Programs, one C "
                         "call each, which cannot be split); measure the phases with COLLECTIVES_FAST_PATH=0 "
                         "python -m bench.hierarchy_perf ... -J <file>")
    sizes = np.array([row["size"] for row in rows], float)
    part = {name: np.array([row["components"][name] for row in rows]) * 1e-6
            for name in ("inside_nodes", "exchanges", "folds_across")}
    # inside = 2 (G-1) a_in + 2 (G-1)/G S / b_in
    a_in, per_byte_in = fit_latency_and_bandwidth(np.full_like(sizes, 2 * (g - 1)), 2 * (g - 1) / g * sizes,
                                                  part["inside_nodes"])
    # across = R a_out + V / b_out and fold = W / b_fold, with the code's scheme at each size
    rounds, sent, folded = np.array([across_nodes(k, s / g)[1:] for s in sizes], float).T
    a_out, per_byte_out = fit_latency_and_bandwidth(rounds, sent, part["exchanges"])
    per_byte_fold = float(least_squares(folded[:, None], part["folds_across"])[0])
    links = Links(a_in, 1 / per_byte_in, a_out, 1 / per_byte_out, fallback.per_message, 1 / per_byte_fold,
                  f"fitted to {path} ({report['environment']['command']})")
    print(f"# {links.source}")
    print(f"# inside a node: {links.intra_latency * 1e6:.1f} µs a step, "
          f"{links.intra_bandwidth / 1e9:.2f} GB/s a rank; "
          f"across nodes: {links.inter_latency * 1e6:.1f} µs a round, {links.inter_bandwidth / 1e9:.2f} GB/s a rank; "
          f"folds: {links.fold_bandwidth / 1e9:.2f} GB/s")
    body = []
    for row in rows:
        measured = row["backends"]["hierarchical"]["out_of_place"]
        seconds, _, _ = predict(links, k, g, row["size"])
        body.append([cli.size_label(row["size"]), f"{measured:.1f}", f"{seconds * 1e6:.1f}",
                     f"{seconds * 1e6 / measured:.2f}"])
    print("\n".join(markdown(["size", "measured (µs)", "model (µs)", "model / measured"], body, text_columns=0)))
    return links


def fit_latency_and_bandwidth(latency_factor, byte_factor, seconds):
    """(a, 1/b) of t = latency_factor * a + byte_factor / b, least squares,
    both kept non-negative: where the best fit's latency is negative, the
    bytes alone are fitted."""
    a, per_byte = least_squares(np.stack([latency_factor, byte_factor], 1), seconds)
    if a < 0:
        a, (per_byte,) = 0.0, least_squares(byte_factor[:, None], seconds)
    return float(a), float(max(per_byte, 1e-15))


def run_hierarchy_model(argv):
    p = subcommand_parser("hierarchy")
    p.add_argument("--ranks-per-node", type=int, default=8, help="ranks (GPUs) per node")
    p.add_argument("--nodes", default="2,4,8,16,32,64", help="node counts to predict, comma-separated")
    p.add_argument("--bytes", default="1M,64M,1G", type=cli.sizes, help="bytes per rank, comma-separated (suffixes K, M, G)")
    p.add_argument("--intra-latency", type=float, default=NVLINK_400G.intra_latency, help="seconds per step inside a node")
    p.add_argument("--intra-bandwidth", type=float, default=NVLINK_400G.intra_bandwidth, help="bytes per second per rank inside a node")
    p.add_argument("--inter-latency", type=float, default=NVLINK_400G.inter_latency, help="seconds per round between nodes")
    p.add_argument("--inter-bandwidth", type=float, default=NVLINK_400G.inter_bandwidth, help="bytes per second per rank between nodes")
    p.add_argument("--per-message", type=float, default=NVLINK_400G.per_message, help="seconds per further message of a round between nodes")
    p.add_argument("--fold-bandwidth", type=float, default=NVLINK_400G.fold_bandwidth, help="bytes per second a fold reads and writes")
    p.add_argument("--calibrate", help="a bench.hierarchy_perf JSON: fit the constants to it, then predict with them")
    args = p.parse_args(argv)
    links = Links(args.intra_latency, args.intra_bandwidth, args.inter_latency, args.inter_bandwidth,
                  args.per_message, args.fold_bandwidth, NVLINK_400G.source)
    if links[:6] != NVLINK_400G[:6]:
        links = links._replace(source="the figures given on the command line")
    if args.calibrate:
        links = calibrate_hierarchy(args.calibrate, links)
    node_counts = [int(v) for v in args.nodes.split(",")]
    if min(node_counts) < 2 or args.ranks_per_node < 1:
        p.error("the model is of 2 nodes or more, of 1 rank or more each")
    print_hierarchy_table(links, node_counts, args.ranks_per_node, [cli.parse_size(v) for v in args.bytes.split(",")])
    return 0


# compression: a compressed allreduce against a plain one, priced from the
# plans' own bytes, for links one GPU cannot show. A phase costs a fixed step
# plus, on its busiest rank, the bytes it reads from peers at the link's
# speed, plain copies and folds at the memory's, codec operations at the
# codecs'; link and memory time add up (no overlap: pessimistic for both).

GB = 1e9
LINKS = {   # bytes per second, one direction, one GPU
    "nvlink": 450 * GB,    # NVLink 4 (H100)
    "pcie": 25 * GB,       # PCIe 5 x16, achieved
    "ib400": 50 * GB,      # 400 Gb/s InfiniBand
    "host": MODELS["host-processes"].bytes_per_second,   # our host transport between processes, as auto's model fits it
}
FLOAT32 = np.dtype("float32")
# A phase's fixed cost, the GPU model's step (rounded: in binary floating
# point 7.11e-6 * 1e6 is 7.109999999999999, which --help would show).
GPU_STEP_US = round(MODELS["gpu-processes"].step_seconds * 1e6, 6)

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
    """Per phase, per rank PhaseBytes of the plan (codec None: uncompressed)
    that collectives runs for ranks in separate processes, one per GPU
    (binding workspace: inputs copied in, results copied out)."""
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
    (its own memory traffic is smaller too). It does not depend on the
    link's latency, which both pay alike.
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


def compression_rows(nranks, sizes, algorithms, codecs, links, memory_bps, codec_bps, step_seconds):
    """Per size and algorithm: the plain plan's µs per link, and per codec
    the compressed plan's µs per link and its break-even link in GB/s."""
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


def print_compression_table(rows, codecs, links):
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


def parse_compression_args(argv):
    p = subcommand_parser("compression")
    p.add_argument("--ranks", type=int, default=8, help="ranks, one GPU each")
    p.add_argument("--sizes", default="1M,16M,64M,256M", type=cli.sizes, help="message sizes per rank, comma-separated")
    p.add_argument("--algorithms", default="ring,two_shot", help="allreduce algorithms, comma-separated")
    p.add_argument("--codecs", default=",".join(CODECS), help="codecs, comma-separated")
    p.add_argument("--links", default=",".join(LINKS), help=f"links to price, of {', '.join(LINKS)}")
    p.add_argument("--memory-gbps", type=float, default=2900.0,
                   help="a device copy's bytes read plus written per second, GB/s, as measured on an H100")
    p.add_argument("--codec-gbps", type=float, default=None,
                   help="codec operations' bytes read plus written per second, GB/s (default: 0.8 x memory, the "
                        "goal the GPU codec kernels are built for; bench.codec_speed --device cuda measures it)")
    p.add_argument("--step-us", type=float, default=GPU_STEP_US,
                   help="fixed cost of a phase (a launch and a flag handshake: the GPU model's step), us")
    p.add_argument("-J", "--output_file", help="write the rows as JSON here (default: no file)")
    args = p.parse_args(argv)
    args.sizes = [cli.parse_size(s) for s in args.sizes.split(",")]
    args.algorithms = cli.names(p, "--algorithms", args.algorithms, ALLREDUCE_ALGORITHMS)
    args.codecs = cli.names(p, "--codecs", args.codecs, CODECS)
    args.links = {name: LINKS[name] for name in cli.names(p, "--links", args.links, LINKS)}
    if args.codec_gbps is None:
        args.codec_gbps = 0.8 * args.memory_gbps
    return args


def run_compression_model(argv):
    args = parse_compression_args(argv)
    rows = compression_rows(args.ranks, args.sizes, args.algorithms, args.codecs, args.links,
                            args.memory_gbps * GB, args.codec_gbps * GB, args.step_us * 1e-6)
    print(f"# {args.ranks} ranks, one GPU each; memory {args.memory_gbps:.0f} GB/s, codecs {args.codec_gbps:.0f} GB/s, "
          f"step {args.step_us:.2f} us; links (GB/s): "
          + ", ".join(f"{name} {bps / GB:.0f}" for name, bps in args.links.items()))
    print_compression_table(rows, args.codecs, args.links)
    if args.output_file:
        write_counted_json(args.output_file, "compression", argv, {
            "ranks": args.ranks, "memory_gbps": args.memory_gbps, "codec_gbps": args.codec_gbps,
            "step_us": args.step_us, "links_gbps": {k: v / GB for k, v in args.links.items()}, "rows": rows})
    return 0


# plans: what each plan costs on the GPU path, counted without running it.

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


def plan_rows(nranks, nbytes, dtype=np.dtype("float32"), codecs=()):
    """A row per collective, algorithm and binding (and per codec, the
    compressed allreduce plans): kernel launches with all ranks on one device
    and with a device each, bytes read plus written over all ranks against
    the floor, and the bytes copied into and out of a workspace."""
    one_device = DeviceRanks([open_device("emulated:0")] * nranks)
    own_devices = DeviceRanks([open_device(f"emulated:{r}") for r in range(nranks)])
    rows = []
    for collective in COLLECTIVES:
        count = nbytes // dtype.itemsize  # each rank's WORK buffer: the message, or all blocks
        count -= count % nranks
        bindings = (OUT_OF_PLACE, IN_PLACE, WORKSPACE)
        for algorithm in sorted(algorithms_for(collective)):
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


def run_plans_model(argv):
    p = subcommand_parser("plans")
    p.add_argument("--ranks", type=int, default=4, help="ranks, all on one device")
    p.add_argument("--bytes", default="64M", type=cli.size, help="the message: each rank's buffer (allgather: the output)")
    p.add_argument("--compression", default="",
                   help=f"also the compressed allreduce plans with these codecs, comma-separated ({', '.join(CODECS)})")
    p.add_argument("-J", "--output_file", help="write the results as JSON here (default: no file)")
    args = p.parse_args(argv)
    nbytes = cli.parse_size(args.bytes)
    codecs = cli.names(p, "--compression", args.compression, CODECS) if args.compression else []
    rows = plan_rows(args.ranks, nbytes, codecs=codecs)
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
        write_counted_json(args.output_file, "plans", argv, {"ranks": args.ranks, "bytes": nbytes, "rows": rows})
    return 0


# The command line.

SUBCOMMANDS = {   # name: (what runs it, what it models and where the doc is: its --help and its line in ours)
    "hierarchy": (run_hierarchy_model,
                  "The hierarchical allreduce on K nodes of G ranks at scale: predicted time and where it goes, "
                  "from assumed or fitted (--calibrate) constants (docs/across-nodes.md, \"A model for scale\")."),
    "compression": (run_compression_model,
                    "A compressed allreduce against a plain one, priced from the plans' bytes per link speed, and "
                    "the break-even link below which compression wins (docs/compression.md)."),
    "plans": (run_plans_model,
              "What each plan costs on the GPU path, counted without running it: kernel launches, bytes read "
              "plus written against the floor, workspace copies (docs/gpu.md)."),
}


def subcommand_parser(name):
    """`python -m bench.model NAME`'s parser, described by its line in SUBCOMMANDS."""
    return cli.Parser(prog=f"{PROG} {name}", description=SUBCOMMANDS[name][1])


def main(argv=None):
    """python -m bench.model [SUBCOMMAND] [FLAGS]: without a subcommand, the
    algorithms' cost model."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        run, _ = SUBCOMMANDS[argv[0]]
        return run(argv[1:])
    return run_algorithms_model(argv)


if __name__ == "__main__":
    sys.exit(main())
