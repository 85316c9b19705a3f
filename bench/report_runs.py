"""The runs bench.report digests: each JSON file under bench/results/ with
what notes.json says of it, the measurements a question takes from it, the
latest measurement of each configuration, and how the page names where a
number came from (machine, commit, command) and writes its tables."""

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from bench.cli import size_label

ROOT = Path(__file__).resolve().parents[1]
NOTES = "notes.json"  # per file: the commit a run describes where it recorded none, and what is stale
LINK_BASE = "../bench/results/"  # from docs/benchmarks.md to the files it digests
PLACES = ("out_of_place", "in_place")
OUR_BACKENDS = ("ours", "host")  # "host" is the old name of the `ours` backend


@dataclass(frozen=True)
class Run:
    """One JSON file under bench/results/ and its entry in notes.json."""
    path: str    # relative to the results directory, as notes.json names it
    data: dict
    note: dict

    @property
    def environment(self):
        return run_environment(self.data)

    @property
    def stale(self):
        return self.note.get("stale")

    @property
    def command(self):
        return run_command(self.data, self.environment)

    @property
    def tool(self):
        """The module that wrote the file, e.g. bench.host_vs_mpich ("" when the command does not say)."""
        found = re.search(r"-m (bench\.\w+)", self.command)
        return found[1] if found else ""

    @property
    def link(self):
        return f"[`{self.path}`]({LINK_BASE}{self.path})"


@dataclass(frozen=True)
class Measurement:
    """What one question takes from a run: a whole file, or one run of
    several in it (bench.host_vs_mpich writes one per process count)."""
    run: Run
    configuration: tuple   # what makes it a different measurement (tool, device, ranks, placement, ...)
    label: str             # how its table names it
    content: object        # what the question tabulates; its shape is the question's own
    environment: dict = None   # its own where it has one (a host_vs_mpich run's), else the file's

    @property
    def machine_environment(self):
        return self.environment if self.environment is not None else self.run.environment

    @property
    def recorded_commit(self):
        recorded = self.machine_environment.get("git_commit") or self.run.environment.get("git_commit")
        return recorded if recorded and recorded != "unknown" else None

    @property
    def commit(self):
        """The commit measured: recorded by the run, else notes.json's (None if neither)."""
        return self.recorded_commit or self.run.note.get("commit")


@dataclass(frozen=True)
class Part:
    """One table of a question: which measurements it takes from a run
    (`measure`: a file it does not answer gives none), its tables from the
    latest measurement of each configuration (`write`; the report puts their
    provenance under them), and its rows of the README's results table
    (`readme`, where it gives any)."""
    title: str                      # its heading; "" for a question of one part
    measure: Callable               # run -> [Measurement]
    write: Callable                 # (latest measurements, every run) -> markdown lines
    missing: str                    # what the page says where no current run answers it
    readme: Callable = None         # (latest measurements, every run) -> README rows


@dataclass(frozen=True)
class Question:
    title: str
    intro: str
    parts: tuple


def load_runs(results):
    """Every JSON file under `results` (a Path) but notes.json, sorted by path."""
    notes_path = results / NOTES
    notes = json.loads(notes_path.read_text()) if notes_path.is_file() else {}
    files = sorted(f for f in results.rglob("*.json") if f.name != NOTES)
    runs = []
    for f in files:
        relative = f.relative_to(results).as_posix()
        runs.append(Run(relative, json.loads(f.read_text()), notes.get(relative, {})))
    unknown = sorted(set(notes) - {run.path for run in runs})
    if unknown:
        raise ValueError(f"{notes_path} has notes for files that do not exist: {unknown}")
    return runs


# -- which run is the latest -------------------------------------------------------


def repository_history(root=ROOT):
    """{commit: commit time} of every commit in the checkout's git history: the
    files record commits, not dates, and only the history says which came
    later. Empty where there is no git or no history."""
    try:
        done = subprocess.run(["git", "-C", str(root), "log", "--all", "--format=%H %ct"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return {}
    if done.returncode != 0:
        return {}
    return {commit: int(seconds) for commit, seconds in (line.split() for line in done.stdout.splitlines())}


def age(measurement, history):
    """Sorts a configuration's measurements oldest first: by the time of the
    commit measured (one the history does not know is oldest), then by path,
    so that the pick never depends on the order the files were read in."""
    seconds = history.get(measurement.commit or "")
    return (seconds is not None, seconds or 0, measurement.run.path)


def latest(measurements, history):
    """The latest measurement of each configuration, sorted by configuration.
    A stale run (notes.json) is never the latest: a configuration measured
    only by stale runs shows none, and its files are linked with the reason."""
    newest = {}
    for m in measurements:
        if m.run.stale:
            continue
        if m.configuration not in newest or age(m, history) > age(newest[m.configuration], history):
            newest[m.configuration] = m
    return sorted(newest.values(), key=lambda m: sort_key(m.configuration))


def sort_key(values):
    """Tuples of numbers, strings and None, comparable with each other."""
    return tuple((0, v, "") if isinstance(v, (int, float)) and not isinstance(v, bool) else (1, 0, str(v))
                 for v in values)


# -- where a number came from --------------------------------------------------------


def run_environment(data):
    """What bench/environment.py recorded, wherever this kind of file keeps it."""
    for key in ("environment", "machine"):
        if isinstance(data.get(key), dict):
            return data[key]
    runs = data.get("runs")
    if isinstance(runs, list) and runs and isinstance(runs[0].get("environment"), dict):
        return runs[0]["environment"]
    return {}


def run_command(data, environment):
    return environment.get("command") or data.get("command") or "not recorded"


def shown_command(run):
    """The command as a reader would type it in the repository, with the
    library's settings it ran under (COLLECTIVES_*=...) in front."""
    command = written_here(readable_command(run.command), run.path)
    settings = [f"{name}={value}" for name, value in settings_of(run.environment) if f"{name}=" not in command]
    return " ".join([*settings, command])


def settings_of(environment):
    """The library's settings from the environment (COLLECTIVES_*), which change what runs: part of a configuration."""
    return tuple(sorted((environment.get("settings") or {}).items()))


def written_here(command, relative):
    """The command with its JSON output (-J, --output_file) named where the
    file is kept now, bench/results/<relative>: runs made elsewhere wrote it
    to a scratch path first, which means nothing to a reader of this repository."""
    return re.sub(r"(-J|--output_file)(\s+|=)\S+", lambda m: f"{m[1]}{m[2]}bench/results/{relative}", command)


def readable_command(command):
    """The command as a reader would type it: `python -m`, not the venv's path."""
    return re.sub(r"\S*/python3?(\.\d+)? -m ", "python -m ", command)


def machine(environment):
    if not environment:
        return "not recorded"
    parts = []
    device = environment.get("device")
    if device and not is_cpu(device):
        gpu = [device]
        for key, label in (("compute_capability", "sm"), ("driver_release", "driver"),
                           ("cuda_runtime", "CUDA runtime"), ("cupy", "CuPy"), ("nccl", "NCCL")):
            if environment.get(key):
                gpu.append(f"{label} {environment[key]}")
        parts.append(", ".join(gpu))
    if environment.get("cpu"):
        cpu = environment["cpu"]
        if environment.get("cores"):
            cpu += f", {environment['cores']} cores"
        if environment.get("memory_bytes"):
            cpu += f", {environment['memory_bytes'] / 2 ** 30:.0f} GiB"
        parts.append(cpu)
    if device and str(device).startswith("host"):
        parts.append("no GPU")
    for key, label in (("mpi_library", ""), ("mpi4py", "mpi4py "), ("torch", "torch "), ("python", "Python "),
                       ("numpy", "NumPy ")):
        if environment.get(key):
            parts.append(label + " ".join(str(environment[key]).replace("\x00", " ").split()))   # (NUL: Open MPI's)
    return "; ".join(parts) or "not recorded"


def short_machine(environment):
    """The machine in a few words, for the README: the GPU, or the CPU's cores."""
    device = str(environment.get("device") or "")
    if device and not is_cpu(device):
        return device
    cores = environment.get("cores")
    kind = "emulated GPU ranks" if device.startswith("emulated") else "no GPU"
    return f"{cores}-core CPU, {kind}" if cores else "not recorded"


def short_machines(measurements):
    """Each measurement's machine in a few words, once each."""
    return "; ".join(dict.fromkeys(short_machine(m.machine_environment) for m in measurements))


def is_cpu(device):
    """Host ranks, and our CUDA kernels compiled for the CPU, and the dry adapter run on no GPU."""
    return str(device).startswith(("host", "emulated", "dry"))


def commit_text(measurement):
    if measurement.recorded_commit:
        return f"commit `{measurement.recorded_commit[:10]}`"
    if measurement.commit:
        return (f"commit `{measurement.commit[:10]}` (the run recorded none: notes.json gives the commit that added "
                f"the file)")
    return "commit not recorded"


def provenance(measurements):
    """Under a part's tables: each file once, with the labels of what it
    measured, its commit, command and notes, under the machines it ran on
    (named once for all the files that share them)."""
    files = {}
    for m in measurements:
        files.setdefault(m.run.path, []).append(m)
    by_machines = {}
    for mine in files.values():
        by_machines.setdefault(tuple(dict.fromkeys(machine(m.machine_environment) for m in mine)), []).append(mine)
    lines = []
    for machines, group in by_machines.items():
        lines += [machines_text(machines), ""]
        for mine in group:
            run = mine[0].run
            labels = "; ".join(dict.fromkeys(m.label for m in mine))
            commits = ", ".join(dict.fromkeys(commit_text(m) for m in mine))
            line = f"- {labels}: {run.link}, {commits}; `{shown_command(run)}`"
            lines.append(line + (f". {run.note['note']}" if run.note.get("note") else ""))
        lines.append("")
    return lines


def machines_text(machines):
    """"Machine: A." or, for a file whose runs ran under several (each MPI in
    launches of its own, say), "Machines: (1) A; (2) B.": numbered, since a
    machine's own parts are separated by semicolons."""
    if len(machines) == 1:
        return f"Machine: {machines[0]}."
    return "Machines: " + "; ".join(f"({i}) {name}" for i, name in enumerate(machines, 1)) + "."


# -- bench/harness.py's rows -----------------------------------------------------------


def harness_rows(data):
    """The rows of a harness run (one per backend and size), or None."""
    rows = data.get("rows")
    if isinstance(rows, list) and rows and "backend" in rows[0] and isinstance(rows[0].get("out_of_place"), dict):
        return rows
    return None


def rows_by_size(rows):
    """{size: {backend: row}}."""
    by_size = {}
    for r in rows:
        by_size.setdefault(r["size"], {})[r["backend"]] = r
    return dict(sorted(by_size.items()))


def our_backend(backends):
    return next((b for b in OUR_BACKENDS if b in backends), None)


def place_times(row):
    """A row's time per call in µs, out of place and in place (None where not measured)."""
    return [(row or {}).get(place, {}).get("time_us") for place in PLACES]


def size_times(rows, backend):
    """{size: [out of place, in place]}: `backend`'s place_times at every size
    of a harness run's rows."""
    return {size: place_times(got.get(backend)) for size, got in rows_by_size(rows).items()}


def size_ratios(rows, numerator, denominator, places=PLACES):
    """{size: [out of place, in place]}: backend `numerator`'s time per call
    over `denominator`'s in a harness run's rows (None where either was not
    timed, and for a placement not in `places`)."""
    under = size_times(rows, denominator)
    return {size: [ratio(t, u) if place in places else None for place, t, u in zip(PLACES, times, under[size])]
            for size, times in size_times(rows, numerator).items()}


# -- tables ------------------------------------------------------------------------


def markdown(header, body, text_columns=1):
    """A table whose first `text_columns` columns are left-aligned, the rest (numbers) right-aligned."""
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" if i < text_columns else "---:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in line) + " |" for line in body]
    return lines


def pair(values, digits=2):
    """Out of place and in place in one cell: "1.74 · 1.62"; "-" for one not measured, or both."""
    if all(v is None for v in values):
        return "-"
    return " · ".join("-" if v is None else f"{v:.{digits}f}" for v in values)


def size_table(columns, first="size"):
    """A table of a row per size: `columns` are (header, {size: [out of place,
    in place]}), or (header, cells, digits) for other than 2 digits; a pair()
    a cell, "-" where its column lacks the size."""
    sizes = sorted({size for column in columns for size in column[1]})
    body = [[size_label(size)] + [pair(cells.get(size, [None, None]), *digits) for _, cells, *digits in columns]
            for size in sizes]
    return markdown([first, *(column[0] for column in columns)], body)


def size_range(sizes):
    """"1 KiB to 64 MiB": the smallest and the largest of some sizes."""
    return f"{size_label(min(sizes))} to {size_label(max(sizes))}"


def every_value(tables):
    """Every value, out of place and in place, of some {size: [out of place, in place]} tables."""
    return [v for table in tables for cells in table.values() for v in cells]


def ratio(numerator, denominator):
    return numerator / denominator if numerator and denominator else None


def and_join(items):
    """"a", "a and b", "a, b and c"."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def cell(value):
    """A number as a table shows it: enough digits to compare, no more."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return readable_command(" ".join(str(value).split()))
    if isinstance(value, int):
        return str(value)
    if value == 0:
        return "0"
    if abs(value) >= 1e7 or abs(value) < 1e-3:
        return f"{value:.3g}"
    if abs(value) >= 100:
        return f"{value:.1f}"
    return f"{value:.3g}"


def span(values, unit="x"):
    """The range of some ratios as the README gives it: "1.47x to 3.57x"."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    low, high = min(values), max(values)
    return f"{low:.2f}{unit}" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}{unit} to {high:.2f}{unit}"
