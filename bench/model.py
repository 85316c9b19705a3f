"""The cost model you can read, next to what was measured.

    python -m bench.model [--ranks 8] [--bytes 1M] [--collective allreduce] [--transport host-processes]
    python -m bench.model --table [--ranks 8]          the textbook allreduce table, from the schedules
    python -m bench.model --results RUN.json... [--ranks N --bytes S]
                                   the model beside the times measured at N ranks and S bytes; auto
                                   against the fastest algorithm at every size
    python -m bench.model --calibrate RUN.json...      fit a transport's two constants to such runs

Every number of the first two comes from the registered schedules themselves:
steps, bytes the busiest rank sends (peers read from its buffers), bytes it
moves through memory (reads plus writes), and the time `auto`'s model
predicts (algorithms/__init__.py). RUN.json is what the benchmarks write with
-J when run with several algorithms side by side, for example

    python -m bench.all_reduce_perf --ranks 2 --backend host --algorithm auto,ring,direct,... -J RUN.json

(under mpiexec, or with --backend mpi,host to relaunch as processes).
"""

import json
import math
import sys

import numpy as np

from bench import cli
from collectives.algorithms import (
    DEFAULT_TRANSPORT, MODELS, REGISTRY, bytes_moved, modelled_seconds, schedule_for, synchronisations,
)
from collectives.algorithms.schedule import ALLREDUCE, BROADCAST, COLLECTIVES, REDUCE_TO_ROOT

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


def algorithms_for(collective):
    return [name for name, spec in REGISTRY.items() if collective in spec.collectives]


def rows(collective, nranks, nbytes, transport):
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
    for name, costs, seconds in sorted(rows(collective, nranks, nbytes, transport), key=lambda r: r[2]):
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
    print(f"| algorithm | textbook: rounds | = for K={k} | ours: steps | ours: sent per node | ours: moved per node |")
    print("|---|---|---:|---:|---:|---:|")
    for name in algorithms_for(ALLREDUCE):
        costs = REGISTRY[name].costs(ALLREDUCE, k, n_bytes)
        formula, rounds = TEXTBOOK_ROUNDS.get(name, ("", None))
        value = "" if rounds is None else f"{rounds(k):g}"
        print(f"| {name} | {formula} | {value} | {costs.steps} | {costs.sent / n_bytes:.3g} N | "
              f"{costs.moved / n_bytes:.3g} N |")
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
        (t0, step, per_byte), *_ = np.linalg.lstsq(a / t[:, None], np.ones_like(t), rcond=None)
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
    print("| processes | size | fastest | its time (us) | auto picks | the pick's own time (us) | auto's time (us) "
          "| auto / fastest |")
    print("|---:|---:|---|---:|---|---:|---:|---:|")
    worst = 0.0
    for (_, nranks, size), by_algorithm in sorted(runs.items(), key=lambda item: (item[0][1], item[0][2])):
        if "auto" not in by_algorithm:
            continue
        timed = {name: row["out_of_place"]["time_us"] for name, row in by_algorithm.items() if name != "auto"}
        fastest = min(timed, key=timed.get)
        auto = by_algorithm["auto"]
        ratio = auto["out_of_place"]["time_us"] / timed[fastest]
        worst = max(worst, ratio)
        print(f"| {nranks} | {size} | {fastest} | {timed[fastest]:.1f} | {auto['picked']} | "
              f"{timed.get(auto['picked'], float('nan')):.1f} | {auto['out_of_place']['time_us']:.1f} | {ratio:.2f} |")
    return worst


def main(argv=None):
    p = cli.Parser(prog="python -m bench.model", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=8, help="ranks to model")
    p.add_argument("--bytes", default="1M", type=cli.size, help="message size (suffixes K, M, G)")
    p.add_argument("--collective", default=ALLREDUCE, choices=COLLECTIVES, help="collective to model")
    p.add_argument("--transport", default=DEFAULT_TRANSPORT, choices=sorted(MODELS), help="whose fitted constants predict the time")
    p.add_argument("--table", action="store_true", help="each algorithm's rounds, bytes sent and bytes moved per rank, from the schedules")
    p.add_argument("--results", nargs="+", help="benchmark JSONs of several algorithms: auto against the fastest")
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


if __name__ == "__main__":
    sys.exit(main())
