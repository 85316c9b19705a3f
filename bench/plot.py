"""Plot benchmark results: bus bandwidth and latency against message size.

    python -m bench.plot RESULTS.json... -o FILE.png [--placement out_of_place|in_place] [--title ...]

Reads what `-J` of bench.all_reduce_perf (bench/harness.py) writes, and draws
one line per backend per file. With several files each label names what sets
that file apart (processes, device, CPU, ...), or else the file's name.
Needs matplotlib: pip install '.[bench]'.
"""

import json
import math
from pathlib import Path
from typing import NamedTuple
from bench import cli
from bench.report_runs import PLACES


class Series(NamedTuple):
    label: str
    sizes: list     # bytes
    busbw: list     # GB/s
    time_us: list


def load(path):
    """A results JSON as a dict, or ValueError saying why it is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error})") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list) \
            or not isinstance(data.get("environment"), dict):
        raise ValueError(f"{path}: not a benchmark results JSON (no 'rows' and 'environment'; "
                         "write one with bench.all_reduce_perf -J)")
    if not data["rows"]:
        raise ValueError(f"{path}: no rows")
    return data


def _mode(env):
    processes = env.get("processes", 1)
    return f"{processes} proc" if processes > 1 else f"{env.get('ranks', '?')} ranks, 1 proc"


def _device(env):
    return env.get("device") and str(env["device"]).split(" (")[0]  # "host (no GPU)" -> "host"


# What may tell files apart, in the order it is named in a label; None where a file does not say.
_DISTINGUISHING = (_mode, _device, lambda env: env.get("cpu"),
                   lambda env: env.get("cores") and f"{env['cores']} cores",
                   lambda env: env.get("mpi_library") and " ".join(env["mpi_library"].split()))


def series(files, placement="out_of_place"):
    """One Series per backend per file, files being {name: results dict}."""
    if placement not in PLACES:
        raise ValueError(f"unknown placement {placement!r}: one of {', '.join(PLACES)}")
    envs = [data["environment"] for data in files.values()]
    differ = [f for f in _DISTINGUISHING if len({f(env) for env in envs} - {None}) > 1]
    suffixes = [", ".join(str(f(env)) for f in differ if f(env) is not None) for env in envs]
    if len(set(suffixes)) < len(files):  # the environments do not tell them apart: the names do
        suffixes = list(files)
    out = []
    for (name, data), suffix in zip(files.items(), suffixes):
        by_backend = {}
        for row in data["rows"]:
            try:
                point = (row["size"], row[placement]["busbw"], row[placement]["time_us"])
                by_backend.setdefault(row["backend"], []).append(point)
            except (KeyError, TypeError):
                raise ValueError(f"{name}: a row without backend, size, or {placement} busbw and time_us: "
                                 f"{row}") from None
        for backend, points in by_backend.items():
            sizes, busbw, time_us = zip(*sorted(points))
            out.append(Series(backend + (f" ({suffix})" if len(files) > 1 else ""),
                              list(sizes), list(busbw), list(time_us)))
    return out


def size_label(nbytes):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def machine(files):
    """The CPU, cores and GPU (where one is named) of every file, once each."""
    seen = []
    for data in files.values():
        env = data["environment"]
        text = f"{env.get('cpu', '?')}, {env.get('cores', '?')} cores"
        if _device(env) not in ("host", None):
            text += f", {_device(env)}"
        if text not in seen:
            seen.append(text)
    return "; ".join(seen)


def draw(lines, path, title, subtitle=""):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator
    except ImportError:
        raise SystemExit("bench.plot needs matplotlib: pip install '.[bench]'") from None
    ncol = max(1, min(len(lines), 170 // (max(len(s.label) for s in lines) + 8)))
    fig = Figure(figsize=(13, 5.2 + 0.2 * -(-len(lines) // ncol)), layout="constrained")
    FigureCanvasAgg(fig)  # non-interactive: render to a file, never a display
    bandwidth, latency = fig.subplots(1, 2)
    markers, linestyles = "osD^v<>ph*", ("-", "--", ":", "-.")
    for i, s in enumerate(lines):  # ten colours, each with its own marker; then the next line style
        style = dict(marker=markers[i % 10], markersize=4, linestyle=linestyles[i // 10 % 4])
        bandwidth.plot(s.sizes, s.busbw, label=s.label, **style)
        latency.plot(s.sizes, s.time_us, **style)
    low, high = (math.log2(f(n for s in lines for n in s.sizes)) for f in (min, max))
    low, high = math.floor(low), math.ceil(high)
    ticks = [2 ** e for e in range(low, high + 1, max(1, -(-(high - low) // 8)))]  # powers of 2, at most 9
    for ax, ylabel in ((bandwidth, "bus bandwidth (GB/s)"), (latency, "time (µs)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: size_label(x)))
        ax.set_xlabel("message size")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    bandwidth.set_title("bus bandwidth (higher is better)")
    latency.set_title("latency (lower is better)")
    fig.suptitle(f"{title}\n{subtitle}" if subtitle else title)
    fig.legend(loc="outside lower center", ncol=ncol, fontsize="small")
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = cli.Parser(prog="python -m bench.plot", description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", metavar="RESULTS.json", help="written by a benchmark's -J")
    p.add_argument("-o", "--output", required=True, help="the picture to write (.png, .svg, .pdf)")
    p.add_argument("--placement", default="out_of_place", help=f"one of {', '.join(PLACES)}")
    p.add_argument("--title", help="put before the title's collective and placement (default: none)")
    args = p.parse_args(argv)
    try:
        names = [Path(f).stem for f in args.files]
        names = names if len(set(names)) == len(names) else args.files
        files = {name: load(f) for name, f in zip(names, args.files)}
        lines = series(files, args.placement)
    except (OSError, ValueError) as error:
        raise SystemExit(f"bench.plot: {error}") from None
    collectives = ", ".join(dict.fromkeys(str(d.get("collective", "?")) for d in files.values()))
    title = f"{collectives}, {args.placement.replace('_', ' ')}"
    title = f"{args.title}: {title}" if args.title else title
    draw(lines, args.output, title, machine(files))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
