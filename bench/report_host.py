"""bench.report's first question: how do host ranks compare with MPICH,
Open MPI and Gloo (and TensorFlow's MultiWorkerMirroredStrategy), collective
by collective, and, for the large calls that only move bytes (allgather,
broadcast and the exchanges), with a memory copy of the same bytes? Here are
its parts, which bench.report's QUESTIONS name, and the libraries' names and
versions, which the training question's README rows use too.

From bench.host_vs_mpich's runs (one per MPI, process count and collective;
the copy floor since --mpi), the suite's runs on host ranks with an mpi,
mpich, openmpi, gloo or mwms backend (bench/harness.py: the exchanges'
tools, alltoall_perf, gather_perf and scatter_perf, too), and
bench.hierarchy_perf's across pretend nodes; and point to point, from
bench.pingpong's runs."""

import re

from bench.report_runs import (PLACES, Measurement, and_join, cell, every_value, harness_rows, markdown, our_backend,
                               ratio, settings_of, short_machines, size_label, size_range, size_ratios, size_table,
                               span)
from collectives.bootstrap import PRETEND_NODES_ENV

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")
REFERENCES = ("MPICH", "Open MPI", "Gloo")  # the libraries host ranks are measured against, every collective
# TensorFlow's strategy is measured where it has the collective (allreduce, allgather), after those.
MWMS_NAME = "TensorFlow MWMS"
# Not a library: bench.host_vs_mpich's memory-copy floor (its "floor" cells), whose time over ours
# is the fraction of a copy's speed ours reaches; its column and README row come after the libraries'.
COPY_FLOOR = "the copy floor"
LINK_FLOOR = "the link floor"   # across hosts: the bytes the busiest host must send, over the measured link rate
FLOORS = (COPY_FLOOR, LINK_FLOOR)
# harness backends -> library (an MPI backend is named by the library its run loaded: reference_name)
HARNESS_REFERENCES = {"mpi": "MPICH", "mpich": "MPICH", "openmpi": "Open MPI", "gloo": "Gloo", "mwms": MWMS_NAME,
                      "tf:mwms": MWMS_NAME}
SOURCES = ("bench.host_vs_mpich", "the suite", "bench.hierarchy_perf")  # the order of their columns and README rows
# Harness backends whose in-place column times their out-of-place call again
# (bench/backends.py: Mwms.run takes a tf.Tensor and returns a new one):
# only their out-of-place figure is a comparison.
OUT_OF_PLACE_ONLY = {"mwms", "tf:mwms"}


# -- host ranks against MPICH and Gloo, per collective --------------------------------


def against_libraries(run):
    """Our time against another library's, per size, on host ranks: from
    bench.host_vs_mpich's runs, the suite's (bench/harness.py) runs with an
    mpi or gloo backend, and bench.hierarchy_perf's across pretend nodes."""
    data = run.data
    if isinstance(data.get("runs"), list):
        return [host_vs_mpich_measurement(run, r) for r in data["runs"] if isinstance(r.get("rows"), list)]
    rows = data.get("rows")
    if isinstance(rows, list) and rows and isinstance(rows[0].get("backends"), dict) and data.get("nodes"):
        return [hierarchy_measurement(run)]
    if harness_rows(data) and str(run.environment.get("device", "")).startswith("host"):
        found = suite_measurement(run)
        return [found] if found else []
    return []


def host_vs_mpich_measurement(run, one):
    """One run of bench.host_vs_mpich: {size: {"out_of_place": {"ours": {...}, "mpich": {...}}, ...}}."""
    environment = one.get("environment") or run.environment
    # A run names its collective; the tool's first runs measured allreduce alone and said so in "benchmark".
    collective = (one.get("collective") or run.data.get("collective")
                  or str(run.data.get("benchmark", "")).split(" ")[0])
    ratios = {}
    for row in one["rows"]:
        for i, place in enumerate(PLACES):
            times = row.get(place, {})
            ours = times.get("ours", {}).get("time_us")
            for backend, timed in times.items():
                if backend != "ours":   # (the floor too: its time over ours, as the libraries')
                    cells = ratios.setdefault(reference_name(backend, environment), {})
                    cells.setdefault(row["size"], [None, None])[i] = ratio(timed.get("time_us"), ours)
    processes, bind_to = one.get("processes"), one.get("bind_to")
    mpi = one.get("mpi", "mpich")   # each MPI in launches of its own; the runs before --mpi were MPICH's
    settings = settings_of(environment)
    nodes = pretend_nodes(dict(settings)) or across_hosts(one.get("hosts"), processes)
    where = "host ranks" if nodes is None else nodes
    # (--compute-between: each call after compute, as a training step's; --read-results: each call's
    # outputs read after it, as a step's optimizer reads its gradients; each a comparison of its own)
    method = run.data.get("method") or {}
    compute = method.get("compute_between_ms")
    after = f"each call after {compute:g} ms of compute" if compute \
        else "each call's results read after it" if method.get("read_results") else None
    if after is not None:
        where = f"{where}, {processes} processes, {after}" if nodes is None else f"{where}, {after}"
    content = comparison(collective, ratios, "bench.host_vs_mpich", where, processes)
    content["own_row"] = after is not None or across_hosts(one.get("hosts"), processes) is not None
    label = f"{processes} processes, -bind-to {bind_to}" + ("" if nodes is None else f", {nodes}") \
        + ("" if after is None else f", {after}")
    # (a run under the library's settings, pretend nodes say, or across hosts, or after compute, is a
    # configuration of its own)
    return Measurement(run, ("bench.host_vs_mpich", collective, processes, bind_to, settings, mpi, nodes, after),
                       label, content, environment)


def across_hosts(hosts, processes):
    """"2 hosts of 2 processes, 10gbit links" for a run across hosts (--hosts), else None."""
    if not hosts:
        return None
    count = hosts.get("count") or 1
    return f"{count} hosts of {processes // count} processes, {hosts.get('link')} links"


def pretend_nodes(settings):
    """"2 pretend nodes of 2 processes" where $COLLECTIVES_PRETEND_NODES split
    the run's ranks into nodes (bootstrap.py), else None."""
    labels = [label.strip() for label in settings.get(PRETEND_NODES_ENV, "").split(",") if label.strip()]
    if not labels:
        return None
    sizes = sorted({labels.count(label) for label in labels})
    per_node = and_join([str(size) for size in sizes])
    return f"{len(set(labels))} pretend nodes of {per_node} processes"


def suite_measurement(run):
    """A harness run on host ranks with ours and mpi or gloo among its backends."""
    rows, environment = harness_rows(run.data), run.environment
    backends = sorted({r["backend"] for r in rows})
    ours = our_backend(backends)
    references = [b for b in backends if b in HARNESS_REFERENCES]
    if not ours or not references:
        return None
    ratios = {reference_name(backend, environment):
              size_ratios(rows, backend, ours, PLACES[:1] if backend in OUT_OF_PLACE_ONLY else PLACES)
              for backend in references}
    processes, ranks = environment.get("processes", 1), environment.get("ranks")
    label = f"{processes} processes" + (f", {ranks} ranks" if ranks and ranks != processes else "")
    configuration = (run.tool, run.data.get("collective"), "host", processes, ranks, tuple(backends),
                     settings_of(environment))
    return Measurement(run, configuration, label,
                       comparison(run.data.get("collective"), ratios, "the suite", "host ranks", processes))


def hierarchy_measurement(run):
    """bench.hierarchy_perf: MPICH's time over the hierarchical allreduce's across pretend nodes."""
    nodes = run.data["nodes"]
    where = f"{len(nodes)} pretend nodes of {len(nodes[0])} processes"
    ratios = {reference_name("mpich", run.environment): {
        r["size"]: [ratio(r["backends"].get("mpich", {}).get(place), r["backends"].get("hierarchical", {}).get(place))
                    for place in PLACES] for r in run.data["rows"]}}
    configuration = ("bench.hierarchy_perf", run.data.get("collective"), tuple(tuple(n) for n in nodes))
    return Measurement(run, configuration, where, comparison(run.data.get("collective"), ratios,
                                                             "bench.hierarchy_perf", where, sum(map(len, nodes))))


def comparison(collective, ratios, source, where, processes):
    """What this question's tables read: {library: {size: [out of place, in place]}} of the
    library's time over ours; and which tool measured it, where (for the README's rows)."""
    return {"collective": collective, "ratios": ratios, "source": source, "where": where, "processes": processes}


def reference_name(backend, environment):
    """"MPICH" or "Open MPI" for the mpi backend over either (another MPI by its own name), "Gloo" for gloo,
    MWMS_NAME for mwms."""
    if backend in ("mpi", "mpich", "openmpi"):
        library = " ".join(str(environment.get("mpi_library", "")).split())
        if library.startswith("Open MPI") or (not library and backend == "openmpi"):
            return "Open MPI"
        return "MPICH" if not library or library.startswith("MPICH") else library.split(",")[0]
    if backend.startswith("ours:"):
        return f"ours with {backend.split(':', 1)[1]}"
    return {**HARNESS_REFERENCES, "floor": COPY_FLOOR, "link": LINK_FLOOR}.get(backend, backend)


def write_against_libraries(shown, runs):
    """One table per collective: each configuration's ratio against each library, size by size."""
    lines = []
    named = [m.content["collective"] for m in shown]
    for collective in [*COLLECTIVES, *sorted(set(named) - set(COLLECTIVES))]:
        mine = sorted((m for m in shown if m.content["collective"] == collective),
                      key=lambda m: (SOURCES.index(m.content["source"]), m.content["where"] != "host ranks"))
        lines += [f"### {collective}", ""]
        if not mine:
            lines += [f"No current run measures {collective} on host ranks against another library.", ""]
            continue
        columns = [(m, name) for m in mine for name in sorted(m.content["ratios"], key=reference_order)]
        lines += [*size_table([(f"{name} / ours, {m.label}", m.content["ratios"][name]) for m, name in columns]), ""]
        measured = {name for m, name in columns}
        notes = [f"No current run against {name}." for name in REFERENCES if name not in measured]
        if not any(m.configuration[0] == "bench.host_vs_mpich" for m in mine):
            notes.append(f"`bench.host_vs_mpich` has not measured {collective} yet.")
        lines += [*notes, ""] if notes else []
    return lines


def reference_order(name):
    return (REFERENCES.index(name) if name in REFERENCES else len(REFERENCES) + (name in FLOORS), name)


def readme_against_libraries(shown, runs):
    """A row per library and tool: the range of its time over ours, over every size, placement and
    configuration; bench.host_vs_mpich's, the comparison users rerun, a row per collective too on
    one node (across pretend nodes, a row of its own for all of them)."""
    groups = {}
    for m in shown:
        source = SOURCES.index(m.content["source"])
        one_node = m.content["where"] == "host ranks"
        collective = m.content["collective"] if m.content["source"] == SOURCES[0] and one_node else None
        for name in m.content["ratios"]:   # (across pretend nodes: a row per library, after one node's)
            key = (source, not one_node, m.content["where"] if m.content.get("own_row") else "",
                   reference_order(name), collective_order(collective))
            groups.setdefault(key, []).append((m, name))
    rows = []
    for (source, *_), members in sorted(groups.items()):
        name = members[0][1]
        collectives = sorted({m.content["collective"] for m, _ in members}, key=collective_order)
        tables = [m.content["ratios"][n] for m, n in members]
        # (the README names the first tool's command; the suite's rows name their tools)
        tools = sorted({m.run.tool for m, _ in members if m.run.tool}) if SOURCES[source] == "the suite" else []
        tool = f" ({', '.join(f'`{t}`' for t in tools)})" if tools else f" (`{SOURCES[source]}`)" if source else ""
        what = (f"{', '.join(collectives)}; {where_text([m.content for m, _ in members])}{tool}; "
                f"{size_range([size for table in tables for size in table])}")
        if name == MWMS_NAME:   # (what a TensorFlow user calls: the tf.function is its cost, not ours)
            what += "; theirs a tf.function of strategy.run per call, ours the NumPy API"
        result = span(every_value(tables)) + (" of its speed" if name in FLOORS else "")
        rows.append([library_version(name, [m.machine_environment for m, _ in members]), what, result,
                     short_machines([m for m, _ in members])])
    return rows


def collective_order(collective):
    """Sorts COLLECTIVES' order first, others by name after, None (all of them) first."""
    if collective is None:
        return (-1, "")
    return (COLLECTIVES.index(collective) if collective in COLLECTIVES else len(COLLECTIVES), collective)


def where_text(contents):
    """Where the runs ran, in a few words: "host ranks, 2 and 4 processes"."""
    wheres = {}
    for content in contents:
        wheres.setdefault(content["where"], set()).add(content["processes"])
    return "; ".join(f"{where}, {and_join([str(n) for n in sorted(counts)])} processes" if where == "host ranks"
                     else where for where, counts in wheres.items())


def library_version(name, environments):
    """"MPICH 5.0.2", "Gloo (torch 2.13.0)", "TensorFlow 2.21.0 MultiWorkerMirroredStrategy": the
    versions the runs recorded."""
    if name in ("MPICH", "Open MPI"):
        found = (re.search(r"\d+(\.\d+)+", str(e.get("mpi_library", ""))) for e in environments
                 if str(e.get("mpi_library", "")).startswith(name))
        return " ".join([name, *sorted({version[0] for version in found if version})])
    if name == COPY_FLOOR:
        return "a memory copy (the same processes)"
    if name == LINK_FLOOR:
        return "the link (its rate measured in the same run)"
    if name == "Gloo":
        versions = sorted({str(e["torch"]).split("+")[0] for e in environments if e.get("torch")})
        return f"Gloo (torch {', '.join(versions)})" if versions else "Gloo"
    if name == MWMS_NAME:
        versions = sorted({str(e["tensorflow"]) for e in environments if e.get("tensorflow")})
        return " ".join(["TensorFlow", *([", ".join(versions)] if versions else []), "MultiWorkerMirroredStrategy"])
    return name


# -- point to point against MPI -----------------------------------------------------------


def pingpong(run):
    """bench.pingpong: one-way times of our send/recv and an MPI's (the one
    its ranks loaded: MPICH, or Open MPI), per message size."""
    rows = run.data.get("one_way")
    if not isinstance(rows, list) or not rows or "mpi_over_ours" not in rows[0]:
        return []
    processes = run.environment.get("processes", 2)
    mpi = pingpong_mpi(run.environment)
    return [Measurement(run, ("bench.pingpong", mpi, processes, settings_of(run.environment)),
                        f"{processes} processes", rows)]


def pingpong_mpi(environment):
    """The MPI a ping-pong ran beside: Open MPI where its ranks loaded it, else MPICH (older runs name none)."""
    return "Open MPI" if str(environment.get("mpi_library", "")).startswith("Open MPI") else "MPICH"


def write_pingpong(shown, runs):
    lines = []
    for m in shown:
        mpi = pingpong_mpi(m.machine_environment)
        body = [[size_label(r["bytes"]), cell(r["ours_us"]), cell(r["mpi_us"]), f"{r['mpi_over_ours']:.2f}"]
                for r in m.content]
        lines += [f"{m.label}, beside {mpi}:", "", *markdown(["message", "ours, µs one way", f"{mpi}, µs one way",
                                                               f"{mpi} / ours"], body), ""]
    return lines


def readme_pingpong(shown, runs):
    rows = []
    for m in shown:
        rows.append([library_version(pingpong_mpi(m.machine_environment), [m.machine_environment]),
                     f"send/recv one way; host ranks, {m.label} (`bench.pingpong`); "
                     f"{size_range([r['bytes'] for r in m.content])}",
                     span([r["mpi_over_ours"] for r in m.content]), short_machines([m])])
    return rows
