"""bench.report's second question: how do GPU ranks compare with the memory
floor and with NCCL? The step kernel against a device copy (bench.gpu_check),
allreduce against one device copy of what it must move (bench.floor, or a
sweep on a GPU beside the copy bandwidth bench.gpu_check measured there), and
ours against NCCL (any harness run with an nccl backend)."""

import re
import statistics

from bench.report_runs import (Measurement, Part, harness_rows, is_cpu, markdown, our_backend, pair,
                               place_times, ratio, rows_by_size, settings_of, short_machine,
                               short_machines, size_label, span)

# bench.floor judges a call by the copy from this size up; below, a call is bound by its launch, not by memory.
FLOOR_FROM_BYTES = 16 << 20


def on_gpu(environment):
    device = environment.get("device")
    return bool(device) and not is_cpu(device)


def flag(command, name):
    """A flag's value in a recorded command line, or None."""
    found = re.search(rf"{re.escape(name)}[ =](\S+)", command or "")
    return found[1] if found else None


# -- the step kernel against a device copy -------------------------------------------------


def step_kernel(run):
    """bench.gpu_check's kernel_bandwidth rows: the step kernel and a device copy, alternating."""
    rows = run.data.get("kernel_bandwidth")
    if not isinstance(rows, list) or not rows or not on_gpu(run.environment):
        return []
    device = run.environment["device"]
    return [Measurement(run, ("bench.gpu_check", device), device, rows)]


def write_step_kernel(shown, runs):
    lines = ["Bytes read plus written per second; the ratio is the step kernel's over the copy's.", ""]
    for m in shown:
        header = ["min blocks", "unroll", "sources", "bytes per source", "step kernel (GB/s)", "device copy (GB/s)",
                  "step / copy"]
        body = [[r.get("min_blocks"), r.get("unroll"), r.get("sources"), size_label(r["bytes_per_source"]),
                 f"{r['step_GBps']:.0f}", f"{r['copy_GBps']:.0f}", f"{r['step_vs_copy']:.2f}"] for r in m.content]
        lines += [f"**{m.label}**", "", *markdown(header, body), ""]
    return lines


def readme_step_kernel(shown, runs):
    rows = []
    for m in shown:
        sizes = sorted({size_label(r["bytes_per_source"]) for r in m.content})
        rows.append(["a device copy", f"the step kernel, {', '.join(sizes)} per source",
                     span([r["step_vs_copy"] for r in m.content]) + " of its bandwidth",
                     short_machine(m.machine_environment)])
    return rows


# -- allreduce against the copy floor --------------------------------------------------------


def against_floor(run):
    """Allreduce on a GPU against one device copy of every input read once and
    every output written once: bench.floor's rows (the copy timed at each
    size), and sweeps on a GPU (bench.all_reduce_perf, gpu_check's allreduce)
    judged by the copy bandwidth measured on the same GPU at the same commit."""
    data, environment = run.data, run.environment
    if not on_gpu(environment):
        return []
    found = []
    for floor in (data, data.get("against_floor")):
        if isinstance(floor, dict) and isinstance(floor.get("rows"), list) and floor["rows"] \
                and "copy_over_call" in floor["rows"][0]:
            found.append(floor_measurement(run, floor))
    sweeps = [(run.tool, harness_rows(data), run.command),
              ("bench.gpu_check", data.get("allreduce"), data.get("allreduce_command"))]
    for tool, rows, command in sweeps:
        if rows and our_backend({r["backend"] for r in rows}):
            found.append(sweep_measurement(run, tool, rows, command))
    return found


def floor_measurement(run, floor):
    """bench.floor's rows: its copy / call, out of place or in place as it ran."""
    environment = {**run.environment, **floor.get("environment", {})}
    place = 1 if environment.get("in_place") else 0
    ratios = {}
    for r in floor["rows"]:
        ratios.setdefault(r["bytes"], [None, None])[place] = r.get("copy_over_call")
    ranks = environment.get("ranks")
    configuration = ("bench.floor", environment.get("device"), ranks, bool(environment.get("in_place")))
    return Measurement(run, configuration, f"bench.floor, {ranks} ranks on one GPU",
                       {"ratios": ratios, "ranks": ranks}, environment)


def sweep_measurement(run, tool, rows, command):
    """A harness sweep's time per call of ours, to be judged by a copy bandwidth measured beside it."""
    ours = our_backend({r["backend"] for r in rows})
    environment = run.environment
    ranks = int(flag(command, "--ranks") or environment.get("ranks") or 1)
    algorithm = flag(command, "--algorithm") or next((r["algorithm"] for r in rows if r.get("algorithm")),
                                                     "the default algorithm")
    times = {size: place_times(got.get(ours)) for size, got in rows_by_size(rows).items()}
    configuration = (tool, environment.get("device"), ranks, environment.get("processes", 1), algorithm,
                     "--symmetric" in (command or ""), settings_of(environment))
    return Measurement(run, configuration, f"{tool}, {ranks} ranks, {algorithm}", {"times": times, "ranks": ranks})


def copy_bandwidth(measurement, runs):
    """The median device copy bandwidth (GB/s, read plus written) bench.gpu_check
    measured on the measurement's GPU at its commit, and the file it is from;
    (None, None) where none was."""
    device = measurement.machine_environment.get("device")
    for run in runs:
        copies = [r["copy_GBps"] for r in run.data.get("kernel_bandwidth") or [] if r.get("copy_GBps")]
        commit = run.environment.get("git_commit") or run.note.get("commit")
        if copies and run.environment.get("device") == device and commit == measurement.commit:
            return statistics.median(copies), run
    return None, None


def floor_ratios(measurement, runs):
    """{size: [out, in]}: the copy's time over the call's, from 16 MiB per rank up."""
    if "ratios" in measurement.content:
        ratios = measurement.content["ratios"]
    else:
        gbps, _ = copy_bandwidth(measurement, runs)
        moved = 2 * measurement.content["ranks"]   # every input read once, every output written once
        ratios = {size: [ratio(moved * size / (gbps * 1e3), t) if gbps else None for t in times]
                  for size, times in measurement.content["times"].items()}
    return {size: cells for size, cells in ratios.items() if size >= FLOOR_FROM_BYTES}


def copy_source(measurement, runs):
    """Where the floor of a measurement came from, in words."""
    if "times" not in measurement.content:
        return "the copy timed beside the call, size by size (bench.floor)"
    gbps, source = copy_bandwidth(measurement, runs)
    if not gbps:
        return "no device copy was measured on the same GPU at the same commit, so no ratio"
    return f"the copy at {gbps:.0f} GB/s, as {source.link} measured it on the same GPU at the same commit"


def write_against_floor(shown, runs):
    ratios = [floor_ratios(m, runs) for m in shown]
    sizes = sorted({size for r in ratios for size in r})
    header = ["size per rank"] + [f"copy / call, {m.label}" for m in shown]
    body = [[size_label(size)] + [pair(r.get(size, [None, None])) for r in ratios] for size in sizes]
    lines = [f"The floor is one device copy of every input read once and every output written once "
             f"(2 × ranks × size bytes); each cell is its time over the call's, out of place · in place, from "
             f"{size_label(FLOOR_FROM_BYTES)} per rank up (below, a call is bound by its launch).", "",
             *markdown(header, body), ""]
    sources = {}
    for m in shown:
        sources.setdefault(copy_source(m, runs), []).append(m.label)
    if len(sources) == 1:
        lines.append(f"For every column: {next(iter(sources))}.")
    else:
        lines += [f"- {'; '.join(labels)}: {source}." for source, labels in sources.items()]
    return lines


def readme_against_floor(shown, runs):
    if not shown:
        return []
    ratios = [floor_ratios(m, runs) for m in shown]
    sizes = sorted({size for r in ratios for size in r})
    ranks = sorted({m.content["ranks"] for m in shown})
    what = (f"allreduce, {' or '.join(map(str, ranks))} ranks on one GPU, "
            f"{size_label(sizes[0])} to {size_label(sizes[-1])} per rank" if sizes else "allreduce")
    values = [v for r in ratios for cells in r.values() for v in cells]
    return [["a device copy", what, span(values) + " of its speed", short_machines(shown)]]


# -- against NCCL ------------------------------------------------------------------


def against_nccl(run):
    """Harness rows with ours and nccl, in a file or in gpu_check's ours_vs_nccl."""
    nested = (run.data.get("ours_vs_nccl") or {}).get("result") or {}
    found = []
    for data in (run.data, nested):
        rows = harness_rows(data)
        backends = {r["backend"] for r in rows or []}
        if rows and "nccl" in backends and our_backend(backends):
            environment = data.get("environment") or run.environment
            ours = our_backend(backends)
            ratios = {size: [ratio(theirs, mine) for theirs, mine in zip(place_times(got.get("nccl")),
                                                                         place_times(got.get(ours)))]
                      for size, got in rows_by_size(rows).items()}
            ranks = environment.get("ranks")
            configuration = (run.tool, data.get("collective"), environment.get("device"), ranks,
                             environment.get("processes", 1))
            found.append(Measurement(run, configuration, f"{data.get('collective')}, {ranks} ranks",
                                     ratios, environment))
    return found


def write_against_nccl(shown, runs):
    header = ["size"] + [f"NCCL / ours, {m.label}" for m in shown]
    sizes = sorted({size for m in shown for size in m.content})
    body = [[size_label(size)] + [pair(m.content.get(size, [None, None])) for m in shown] for size in sizes]
    return ["NCCL's time over ours, out of place · in place: above 1, we are faster.", "",
            *markdown(header, body)]


def readme_against_nccl(shown, runs):
    if not shown:
        return [["NCCL", "any collective on GPU ranks", "not measured yet", "-"]]
    values = [v for m in shown for cells in m.content.values() for v in cells]
    versions = sorted({str(m.machine_environment.get("nccl")) for m in shown if m.machine_environment.get("nccl")})
    return [[" ".join(["NCCL", *versions]), ", ".join(sorted({m.label for m in shown})), span(values),
             short_machines(shown)]]


GPU_PARTS = (
    Part("The step kernel against a device copy", step_kernel, write_step_kernel,
         "No current run of `python -m bench.gpu_check` on a GPU.", readme_step_kernel),
    Part("Allreduce against one device copy", against_floor, write_against_floor,
         "No current run of allreduce on a GPU.", readme_against_floor),
    Part("Against NCCL", against_nccl, write_against_nccl,
         "Not measured yet: no run under `bench/results/` has an `nccl` backend. `python -m bench.gpu_check` "
         "measures it on a machine with GPUs (its section 5), as does `python -m bench.all_reduce_perf "
         "--device cuda --backend ours,nccl`.", readme_against_nccl),
)
