"""bench.report's third and fourth questions: what does compression cost and
how much error does it add (a compressed allreduce against a plain one,
bench.compression_error, bench.half_precision_error); and what does a call
cost the host (bench.call_overhead in one process, bench.spmd_overhead
across processes)?"""

from bench.report_runs import (Measurement, Part, cell, harness_rows, markdown, pair, place_times, ratio,
                               rows_by_size, settings_of, size_label)


# -- compression: a compressed allreduce against a plain one -----------------------------


def compressed_allreduce(run):
    """A harness run with --compression: backends ours:none, ours:fp16, ..."""
    rows = harness_rows(run.data)
    if not rows or not any(r.get("compression") not in (None, "none") for r in rows):
        return []
    by_size = rows_by_size(rows)
    codecs = sorted({r["compression"] for r in rows if r.get("compression") not in (None, "none")})
    plain = next((r["backend"] for r in rows if r.get("compression") == "none"), None)
    content = {"codecs": codecs, "plain": {size: place_times(got.get(plain)) for size, got in by_size.items()},
               "ratios": {}, "maxrel": {}}
    for codec in codecs:
        backend = next(r["backend"] for r in rows if r.get("compression") == codec)
        content["ratios"][codec] = {size: [ratio(mine, theirs) for mine, theirs in
                                           zip(place_times(got.get(backend)), place_times(got.get(plain)))]
                                    for size, got in by_size.items()}
        content["maxrel"][codec] = max((r.get("maxrel") or 0 for r in rows if r["backend"] == backend), default=None)
    environment = run.environment
    processes, ranks = environment.get("processes", 1), environment.get("ranks")
    configuration = (run.tool, run.data.get("collective"), environment.get("device"), processes, ranks,
                     tuple(codecs), settings_of(environment))
    label = f"{run.data.get('collective')}, {ranks} ranks in {processes} processes, {environment.get('device')}"
    return [Measurement(run, configuration, label, content)]


def write_compressed_allreduce(shown, runs):
    lines = ["Each codec's time per call over the uncompressed call's, out of place · in place: below 1, "
             "compression pays.", ""]
    for m in shown:
        codecs = m.content["codecs"]
        header = ["size", "uncompressed (µs)"] + [f"{codec} / uncompressed" for codec in codecs]
        body = [[size_label(size), pair(times, 1)] + [pair(m.content["ratios"][c][size]) for c in codecs]
                for size, times in m.content["plain"].items()]
        error = ", ".join(f"{c} {cell(m.content['maxrel'][c])}" for c in codecs)
        lines += [f"**{m.label}**", "", *markdown(header, body), "",
                  f"Largest relative error of any element, any size: {error}.", ""]
    return lines


# -- compression: error against the bound ---------------------------------------------


def compression_error(run):
    rows = run.data.get("rows")
    if run.data.get("benchmark") != "compression_error" or not isinstance(rows, list):
        return []
    configuration = ("bench.compression_error", run.data.get("count"), tuple(sorted({r.get("ranks") for r in rows})))
    return [Measurement(run, configuration, f"{run.data.get('count')} elements", rows)]


def write_compression_error(shown, runs):
    lines = ["Worst over the input magnitudes measured; error / bound at most 1 means the bound held.", ""]
    for m in shown:
        groups = {}
        for r in m.content:
            groups.setdefault((r["codec"], r["algorithm"], r["ranks"]), []).append(r)
        header = ["codec", "algorithm", "ranks", "largest error / bound", "largest norm error"]
        body = [[codec, algorithm, ranks, cell(max(r["max_error_over_bound"] for r in rows)),
                 cell(max(r["norm_error"] for r in rows))] for (codec, algorithm, ranks), rows in groups.items()]
        lines += [*markdown(header, body, text_columns=2), ""]
    return lines


def half_precision_error(run):
    rows = run.data.get("rows")
    if run.tool != "bench.half_precision_error" or not isinstance(rows, list):
        return []
    configuration = ("bench.half_precision_error", run.data.get("ranks"), run.data.get("count"))
    return [Measurement(run, configuration, f"{run.data.get('ranks')} ranks, {run.data.get('count')} elements", rows)]


def write_half_precision_error(shown, runs):
    lines = ["The sum of 16-bit inputs over ranks, by accumulation order: the relative error of the result's "
             "norm, worst over the input distributions.", ""]
    for m in shown:
        dtypes = list(dict.fromkeys(r["dtype"] for r in m.content))
        methods = list(dict.fromkeys(r["method"] for r in m.content))
        worst = {}
        for r in m.content:
            key = (r["method"], r["dtype"])
            worst[key] = max(worst.get(key, 0), r["norm_rel_max"])
        body = [[method] + [cell(worst.get((method, dtype))) for dtype in dtypes] for method in methods]
        lines += [*markdown(["method", *dtypes], body), ""]
    return lines


# -- host cost per call --------------------------------------------------------------


def call_overhead(run):
    """bench.call_overhead: µs per call (or instructions per call under
    callgrind) of one allreduce issued by one process."""
    results = run.data.get("results")
    if run.tool != "bench.call_overhead" or not isinstance(results, dict):
        return []
    data = run.data
    setup = (data.get("device"), data.get("adapter"), data.get("ranks"), data.get("devices"), data.get("algorithm"),
             bool(data.get("in_place")), bool(data.get("prepared")), data.get("compression"), data.get("count"),
             settings_of(run.environment))
    counted = "instructions_per_call" in results
    timed = results.get("allreduce") or {}
    content = {"setup": setup, "instructions": results.get("instructions_per_call"),
               "us": timed.get("total_us_per_call"), "ran": timed.get("algorithm_run"),
               "launches": sum(v for k, v in timed.items() if k.startswith("launch_") and k.endswith("_per_call"))
               if timed else None}
    # The file's name and command say which row it is; the label says which column.
    label = "instructions per call" if counted else "µs per call"
    return [Measurement(run, (*setup, label), label, content)]


def settings_text(settings):
    return " ".join(f"{name}={value}" for name, value in settings)


def write_call_overhead(shown, runs):
    """One row per setup: the latest timing and the latest instruction count beside each other."""
    rows = {}
    for m in shown:
        row = rows.setdefault(m.content["setup"], {})
        for key in ("us", "instructions", "ran", "launches"):
            if m.content[key] is not None:
                row[key] = m.content[key]
    header = ["device", "adapter", "ranks on devices", "algorithm (ran)", "placement", "prepared", "compression",
              "settings", "elements", "µs per call", "instructions per call", "launches per call"]
    body = []
    for setup, row in rows.items():
        device, adapter, ranks, devices, algorithm, in_place, prepared, compression, count, settings = setup
        ran = f"{algorithm} ({row['ran']})" if row.get("ran") and row["ran"] != algorithm else algorithm
        body.append([device, adapter or "-", f"{ranks} on {devices}", ran, "in place" if in_place else "out of place",
                     "yes" if prepared else "no", compression or "none", settings_text(settings) or "-", cell(count),
                     cell(row.get("us")), cell(row.get("instructions")), cell(row.get("launches"))])
    return ["The adapters: `timed` is the device's own, `noop` launches nothing, `dry` stands in for CuPy with "
            "no GPU (bench/call_overhead.py).", "", *markdown(header, body, text_columns=8)]


def spmd_overhead(run):
    """bench.spmd_overhead: µs per call of host ranks and GPU ranks in processes, side by side."""
    data = run.data
    if data.get("benchmark") != "spmd_overhead" or not isinstance(data.get("median_us_per_call"), dict):
        return []
    collective = data.get("collective", "allreduce")   # the first runs measured allreduce alone and did not say
    setup = (collective, data.get("bytes"), bool(data.get("in_place")), bool(data.get("symmetric")),
             data.get("algorithm"), run.environment.get("processes"), settings_of(run.environment))
    placement = "in place" if data.get("in_place") else "out of place"
    label = (f"{collective}, {size_label(data.get('bytes') or 0)}, {placement}"
             + (", symmetric" if data.get("symmetric") else "") + f", {data.get('algorithm')}")
    return [Measurement(run, ("bench.spmd_overhead", *setup), label, data)]


def write_spmd_overhead(shown, runs):
    modes = list(dict.fromkeys(mode for m in shown for mode in m.content["median_us_per_call"]))
    header = ["call", *[f"{mode} µs (/ host)" for mode in modes]]
    body = [[m.label] + [mode_cell(m.content, mode) for mode in modes] for m in shown]
    return ["Median µs per call of each way of running the same call across processes, and its ratio to host "
            "ranks'.", "", *markdown(header, body)]


def mode_cell(data, mode):
    us = data["median_us_per_call"].get(mode)
    against = (data.get("ratio_to_host") or {}).get(mode)
    return "-" if us is None else f"{us:.1f}" + (f" ({against:.2f})" if against is not None else "")


COMPRESSION_PARTS = (
    Part("Cost: a compressed allreduce against a plain one", compressed_allreduce, write_compressed_allreduce,
         "No current run times a compressed allreduce."),
    Part("Error against the bound", compression_error, write_compression_error,
         "No current run of `python -m bench.compression_error`."),
    Part("16-bit sums: the error of each accumulation order", half_precision_error, write_half_precision_error,
         "No current run of `python -m bench.half_precision_error`."),
)

HOST_COST_PARTS = (
    Part("One process: bench.call_overhead", call_overhead, write_call_overhead,
         "No current run of `python -m bench.call_overhead`."),
    Part("Across processes: bench.spmd_overhead", spmd_overhead, write_spmd_overhead,
         "No current run of `python -m bench.spmd_overhead`."),
)
