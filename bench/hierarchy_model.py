"""A model of the hierarchical allreduce (collectives/hierarchy.py) at scale:
K nodes of G ranks, S bytes per rank. A model, not a measurement.

    python -m bench.hierarchy_model [--ranks-per-node 8] [--nodes 2,4,8,16,32,64] [--bytes 1M,64M,1G]
                                    [--intra-latency 3e-6 --intra-bandwidth 360e9]
                                    [--inter-latency 8e-6 --inter-bandwidth 45e9 --per-message 5e-7]
                                    [--fold-bandwidth 2.5e12]
    python -m bench.hierarchy_model --calibrate bench/results/hierarchy_2x2_vs_mpich.json [--ranks-per-node 8 ...]

The algorithm's three steps, each a latency and a bandwidth term:

    inside  = 2 [(G-1) a_in + (G-1)/G S / b_in]       reduce-scatter and all-gather inside a node
    across  = R a_out + (P-1) o + V / b_out            R rounds, P peers a round, V bytes a rank sends
    fold    = W / b_fold                               the fold across nodes: W bytes read and written
    T       = inside + across + fold

Across nodes the code picks direct or two_shot (hierarchy.uses_two_shot),
and so does the model. With s = S/G, a rank's range:

    direct     R = 1, P = K-1, V = (K-1) s,       W = (K+1) s
    two_shot   R = 2, P = K-1, V = 2 (K-1)/K s,   W = (K+1)/K s

b_out is what one rank gets across the network: with one NIC per GPU, as
in rail-optimised GPU nodes, every rank's traffic has a NIC of its own.
The default figures are NVLink-class inside a node (360 GB/s a rank, 3 µs a
step) and 400 Gb/s-class between nodes (45 GB/s of the 50 GB/s line rate,
8 µs a round, 0.5 µs a further message), folds at HBM speed (2.5 TB/s):
assumed, not measured. --calibrate takes the constants of this machine
instead, from a bench.hierarchy_perf run (its "components"), and prints
the model beside the times that run measured.
"""

import json
import sys
from typing import NamedTuple

import numpy as np

from bench import cli
from collectives.hierarchy import uses_two_shot


class Links(NamedTuple):
    intra_latency: float      # s a step inside a node
    intra_bandwidth: float    # B/s a rank inside a node
    inter_latency: float      # s a round across nodes
    inter_bandwidth: float    # B/s a rank across nodes
    per_message: float        # s each further message of a round
    fold_bandwidth: float     # B/s of the fold across nodes (read + write)
    source: str


NVLINK_400G = Links(3e-6, 360e9, 8e-6, 45e9, 5e-7, 2.5e12,
                    "assumed: NVLink-class inside a node, 400 Gb/s-class between nodes, one NIC per GPU")


def predict(links, nodes, ranks_per_node, nbytes):
    """(seconds, {step: seconds}, across-node scheme) of one allreduce of `nbytes` per rank."""
    k, g, s = nodes, ranks_per_node, nbytes / ranks_per_node
    inside = 2 * ((g - 1) * links.intra_latency + (g - 1) / g * nbytes / links.intra_bandwidth)
    if uses_two_shot(k, s):
        scheme, rounds, sent, folded = "two_shot", 2, 2 * (k - 1) / k * s, (k + 1) / k * s
    else:
        scheme, rounds, sent, folded = "direct", 1, (k - 1) * s, (k + 1) * s
    across = rounds * links.inter_latency + rounds * (k - 2) * links.per_message + sent / links.inter_bandwidth
    fold = folded / links.fold_bandwidth
    return inside + across + fold, {"inside": inside, "across": across, "fold": fold}, scheme


def table(links, node_counts, ranks_per_node, sizes):
    """Markdown: per node count and size, the predicted time, bus bandwidth and where the time goes."""
    print(f"# model of the hierarchical allreduce, {ranks_per_node} ranks a node; {links.source}")
    print("| nodes | ranks | size | across nodes | predicted time (µs) | busbw (GB/s) "
          "| inside nodes | across nodes | fold |")
    print("|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for k in node_counts:
        n = k * ranks_per_node
        for nbytes in sizes:
            seconds, parts, scheme = predict(links, k, ranks_per_node, nbytes)
            busbw = nbytes / seconds * 2 * (n - 1) / n / 1e9
            shares = " | ".join(f"{parts[p] / seconds:.0%}" for p in ("inside", "across", "fold"))
            print(f"| {k} | {n} | {cli.size_label(nbytes)} | {scheme} | {seconds * 1e6:.1f} | {busbw:.1f} | {shares} |")


def calibrate(path, fallback):
    """The constants of the machine a bench.hierarchy_perf run measured
    (least squares over its sizes), and the model beside its times."""
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
    a_in, per_byte_in = _fit(np.full_like(sizes, 2 * (g - 1)), 2 * (g - 1) / g * sizes, part["inside_nodes"])
    # across = R a_out + V / b_out, with the code's choice of scheme at each size
    schemes = [uses_two_shot(k, s / g) for s in sizes]
    rounds = np.array([2.0 if two else 1.0 for two in schemes])
    sent = np.array([(2 * (k - 1) / k if two else k - 1) * s / g for two, s in zip(schemes, sizes)])
    a_out, per_byte_out = _fit(rounds, sent, part["exchanges"])
    folded = np.array([((k + 1) / k if two else k + 1) * s / g for two, s in zip(schemes, sizes)])
    per_byte_fold = float(np.dot(folded, part["folds_across"]) / np.dot(folded, folded))
    links = Links(a_in, 1 / per_byte_in, a_out, 1 / per_byte_out, fallback.per_message, 1 / per_byte_fold,
                  f"fitted to {path} ({report['environment']['command']})")
    print(f"# {links.source}")
    print(f"# inside a node: {links.intra_latency * 1e6:.1f} µs a step, "
          f"{links.intra_bandwidth / 1e9:.2f} GB/s a rank; "
          f"across nodes: {links.inter_latency * 1e6:.1f} µs a round, {links.inter_bandwidth / 1e9:.2f} GB/s a rank; "
          f"folds: {links.fold_bandwidth / 1e9:.2f} GB/s")
    print("| size | measured (µs) | model (µs) | model / measured |")
    print("|---:|---:|---:|---:|")
    for row in rows:
        measured = row["backends"]["hierarchical"]["out_of_place"]
        seconds, _, _ = predict(links, k, g, row["size"])
        print(f"| {cli.size_label(row['size'])} | {measured:.1f} | {seconds * 1e6:.1f} | {seconds * 1e6 / measured:.2f} |")
    return links


def _fit(latency_factor, byte_factor, seconds):
    """t = latency_factor * a + byte_factor / b, least squares, a and 1/b kept non-negative."""
    a, per_byte = np.linalg.lstsq(np.stack([latency_factor, byte_factor], 1), seconds, rcond=None)[0]
    if a < 0:
        a, per_byte = 0.0, float(np.dot(byte_factor, seconds) / np.dot(byte_factor, byte_factor))
    return float(a), float(max(per_byte, 1e-15))


def main(argv=None):
    p = cli.Parser(prog="python -m bench.hierarchy_model", description=__doc__.splitlines()[0])
    p.add_argument("--ranks-per-node", type=int, default=8, help="ranks (GPUs) per node")
    p.add_argument("--nodes", default="2,4,8,16,32,64", help="node counts to predict, comma-separated")
    p.add_argument("--bytes", default="1M,64M,1G", type=cli.sizes, help="bytes per rank, comma-separated (suffixes K, M, G)")
    p.add_argument("--intra-latency", type=float, default=NVLINK_400G.intra_latency, help="seconds per step inside a node")
    p.add_argument("--intra-bandwidth", type=float, default=NVLINK_400G.intra_bandwidth, help="bytes per second per rank inside a node")
    p.add_argument("--inter-latency", type=float, default=NVLINK_400G.inter_latency, help="seconds per round between nodes")
    p.add_argument("--inter-bandwidth", type=float, default=NVLINK_400G.inter_bandwidth, help="bytes per second per rank between nodes")
    p.add_argument("--per-message", type=float, default=NVLINK_400G.per_message, help="seconds per message between nodes")
    p.add_argument("--fold-bandwidth", type=float, default=NVLINK_400G.fold_bandwidth, help="bytes per second a fold reads and writes")
    p.add_argument("--calibrate", help="a bench.hierarchy_perf JSON: fit the constants to it, then predict with them")
    args = p.parse_args(argv)
    links = Links(args.intra_latency, args.intra_bandwidth, args.inter_latency, args.inter_bandwidth,
                  args.per_message, args.fold_bandwidth, NVLINK_400G.source)
    if links[:6] != NVLINK_400G[:6]:
        links = links._replace(source="the figures given on the command line")
    if args.calibrate:
        links = calibrate(args.calibrate, links)
    node_counts = [int(v) for v in args.nodes.split(",")]
    if min(node_counts) < 2 or args.ranks_per_node < 1:
        p.error("the model is of 2 nodes or more, of 1 rank or more each")
    table(links, node_counts, args.ranks_per_node, [cli.parse_size(v) for v in args.bytes.split(",")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
