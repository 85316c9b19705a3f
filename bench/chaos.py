"""Chaos: ranks killed or stopped at random moments; the survivors shrink and go on.

    python -m bench.chaos [--trials 200] [--seed 1] [--ranks 2,3,4] [--nodes 1] [-J chaos.json]

Each trial is one job of 2-4 host ranks in processes under MPICH's mpiexec
(split into pretend nodes with --nodes: then a HierarchicalCommunicator's),
each rank wrapped as docs/api.md says (a shell that ignores hydra's SIGUSR1
and turns a death by a signal into an exit status). The trial's seed picks,
the same on every rank: a collective (any of the five) and its size (1 KiB,
64 KiB or 4 MiB per rank: the compiled loop's merged step, single copy and
pipeline), an event, its victims and the moment (0-30 ms into a loop of the
collective, each result checked). Events:

    sigkill       one rank SIGKILLed, from a thread of its own
    sigkill2      two ranks at once (needs 3 or more ranks)
    stop          one rank stopped (SIGSTOP): the others wait out the timeout
    in_shrink     one rank SIGKILLed, then another at a random moment of its
                  shrink (3 or more ranks)

The survivors shrink (again, while a collective or the shrink itself
times out or fails: a shrink that timed out is called again) until every member
agrees the victims have had the time to die, and check a collective of
every kind on the new communicator. A trial passes when every survivor
printed the same membership, the victims are not in it, no survivor
failed, the job ended within its limit (no hang), and no file named with
a communicator's prefix appeared in /dev/shm. Recovery time: from the first kill (CLOCK_MONOTONIC,
the same clock in every process) to the last survivor's first correct
collective on the shrunk communicator (and the part of it after the first
survivor's call raised: what detection did not cost); p50 and p99 printed
per event, and every trial in the JSON. A trial is replayed by its seed:
`python -m bench.chaos --trials 1 --seed S --ranks N`.
"""

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback

import numpy as np

from bench import cli
from bench.mpis import remove_orphaned_mpich_segments
from bench.environment import command_line, git_commit
from bench.mpis import find_mpiexec

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")
SIZES = (1 << 10, 64 << 10, 4 << 20)
EVENTS = ("sigkill", "sigkill2", "stop", "in_shrink")
TIMEOUT = 3.0          # the communicator's: what a stop costs the survivors
LIMIT = 90.0           # a job running longer is a hang
SETTLE = 0.2           # seconds the survivors go on before they agree the victims are gone
REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def plan(seed, n):
    """What trial `seed` does on `n` ranks (every rank derives the same)."""
    rng = np.random.default_rng(seed)
    events = [e for e in EVENTS if n >= 3 or e in ("sigkill", "stop")]
    event = str(rng.choice(events))
    victims = [int(v) for v in rng.choice(n, size=2 if event in ("sigkill2", "in_shrink") else 1, replace=False)]
    return {"seed": seed, "ranks": n, "collective": str(rng.choice(COLLECTIVES)),
            "nbytes": int(rng.choice(SIZES)), "event": event, "victims": victims,
            "delay": float(rng.uniform(0, 0.03)), "shrink_delay": float(rng.uniform(0, 0.01))}


# -- one rank of a trial ------------------------------------------------------------

_LONGEST_PATTERN = [np.zeros(0, np.float32)]


def _pattern(elements):
    """0, 1, ..., 6, 0, 1, ... as float32: every rank's input less its offset.
    A prefix of the longest made so far: a reduce_scatter's inputs shrink
    with the membership, and made anew for the survivors (3M elements: 20
    to 80 ms of modulo here) they were counted in the recovery time (seed
    183, 114-211 ms). The first call, of the whole job, makes the longest."""
    if len(_LONGEST_PATTERN[0]) < elements:
        _LONGEST_PATTERN[0] = (np.arange(elements) % 7).astype(np.float32)
    return _LONGEST_PATTERN[0][:elements]


def _elements(collective, count, size):
    return count * size if collective == "reduce_scatter" else count


def inputs(collective, count, original, size, out=None):
    """Rank `original`'s input: small integers in float32, so sums are exact."""
    return np.add(_pattern(_elements(collective, count, size)), np.float32(original + 1), out=out)


def expected(collective, count, members, rank, out=None):
    """What rank `rank` of a communicator whose rank r is `members[r]` gets
    from one call of `collective`. The inputs are small integers, so their
    sum in any order is the same float32: len(members) times the pattern
    plus the offsets, the bits NumPy's sum of the inputs gives."""
    size = len(members)
    if collective == "allgather":
        out = np.empty(size * count, np.float32) if out is None else out
        for i, m in enumerate(members):
            inputs(collective, count, m, size, out=out[i * count:(i + 1) * count])
        return out
    if collective == "broadcast" or (collective == "reduce" and rank != 0):   # reduce: root 0's
        return inputs(collective, count, members[0 if collective == "broadcast" else rank], size, out=out)
    pattern = _pattern(_elements(collective, count, size))
    if collective == "reduce_scatter":
        pattern = pattern[rank * count:(rank + 1) * count]
    total = np.multiply(pattern, np.float32(size), out=out)
    return np.add(total, np.float32(sum(m + 1 for m in members)), out=total)


# Memory the checks reuse from call to call and membership to membership,
# made at the whole job's sizes (the largest) by the first call. Arrays made
# anew for the survivors cost their page faults, which on this VM came to
# most of a slow recovery (perf, seed 183: clear_page under NumPy's add and
# multiply, and under the copy of the input, 200-300 ms of one survivor's).
_REUSED = {}


def _reused(name, elements):
    if name not in _REUSED or len(_REUSED[name]) < elements:
        _REUSED[name] = np.zeros(elements, np.float32)   # (its pages touched now, at the job's start)
    return _REUSED[name][:elements]


# The last communicator's input and expected result (checking made them once
# per membership: a trial's time between calls is then the library's).
_CHECKED = {}


def check(comm, collective, count, members):
    """One call of `collective` on `comm` (whose rank r is `members[r]` of the
    job), checked bitwise against the closed form (`expected`)."""
    key = (collective, count, tuple(members), comm.rank)
    elements = _elements(collective, count, comm.size)
    if key not in _CHECKED:
        _CHECKED.clear()
        _CHECKED[key] = (
            inputs(collective, count, members[comm.rank], comm.size, out=_reused("input", elements)),
            expected(collective, count, members, comm.rank,
                     out=_reused("expected", count * comm.size if collective == "allgather" else count)))
    source, want = _CHECKED[key]
    x = _reused("x", elements)
    np.copyto(x, source)
    if collective == "allreduce":
        got = comm.allreduce(x)
    elif collective == "reduce_scatter":
        got = comm.reduce_scatter(x, out=_reused("out", count))
    elif collective == "allgather":
        got = comm.allgather(x)
    elif collective == "broadcast":
        got = comm.broadcast(x, root=0)
    else:
        got = comm.reduce(x, root=0)
    if not np.array_equal(got, want):
        raise AssertionError(f"{collective} of {count} float32 on ranks {members} gave wrong bits")


def rank_main(seed, n):
    import collectives
    from collectives import CollectiveError
    trial = plan(seed, n)
    comm = collectives.init(timeout=float(os.environ.get("CHAOS_TIMEOUT", TIMEOUT)))
    me, count = comm.rank, trial["nbytes"] // 4
    first, second = trial["victims"][0], trial["victims"][-1]
    members = list(range(comm.size))
    check(comm, trial["collective"], count, members)
    # Every rank past its first call before a victim's timer starts: a rank
    # done with its own part (a reduce's non-root) may be ahead of the others
    # (seed 33 across nodes: a kill inside the others' first call, 1 in 20).
    comm.barrier()

    def die(how):
        print(f"KILL {time.perf_counter():.6f}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)

    if me in trial["victims"] and not (trial["event"] == "in_shrink" and me == second):
        threading.Timer(trial["delay"], die, ("stop" if trial["event"] == "stop" else "kill",)).start()
    try:
        while True:
            check(comm, trial["collective"], count, members)
    except CollectiveError:
        print(f"DETECTED {time.perf_counter():.6f}", flush=True)
    if me in trial["victims"] and trial["event"] != "in_shrink":
        time.sleep(60)   # its signal is on the way (a stopped rank continued at the end exits here)
        return
    stopped = [pid_of(comm, v) for v in trial["victims"]] if trial["event"] == "stop" else []
    if trial["event"] == "in_shrink" and me == second:
        threading.Timer(trial["shrink_delay"], die, ("kill",)).start()
    current, recovered, shrinks = comm, None, 0
    stop_at = time.perf_counter() + SETTLE
    while True:
        try:
            if current is comm or recovered is None:
                # A shrink that raised CollectiveTimeoutError leaves `current`
                # open (aborted): calling it again goes on with a new round.
                current = current.shrink()
                shrinks += 1
                members = [members[old] for old in current.old_ranks]
            check(current, trial["collective"], count, members)
            if recovered is None:
                recovered = time.perf_counter()
            for collective in COLLECTIVES:
                check(current, collective, 256, members)
        except (collectives.CollectiveTimeoutError, collectives.RevokedError):
            recovered = None
            continue
        if current.agree(time.perf_counter() > stop_at):
            break
    print(f"RECOVERED {recovered:.6f} SHRINKS {shrinks} MEMBERS {members} RANK {me}", flush=True)
    if current.rank == 0:
        for pid in stopped:
            os.kill(pid, signal.SIGKILL)
    current.close()


def pid_of(comm, rank):
    """The process id of `rank` of `comm` (on this machine)."""
    ranks = comm._ranks   # noqa: SLF001
    processes = getattr(ranks, "processes", None)   # across (pretend) nodes: hierarchy.HierarchyRanks
    return processes[rank][0] if processes is not None else ranks.group.pid_of(rank)


# -- the trials ------------------------------------------------------------------------

def pretend_nodes(n, nodes):
    """$COLLECTIVES_PRETEND_NODES for `n` ranks in `nodes` nodes of consecutive ranks ("" for one)."""
    return "" if nodes <= 1 else ",".join(str(r * nodes // n) for r in range(n))


def run_trial(seed, n, mpiexec, timeout=TIMEOUT, nodes=1):
    """Run trial `seed` on `n` ranks in `nodes` pretend nodes, their communicator's `timeout`; its record."""
    trial = plan(seed, n)
    trial["nodes"] = pretend_nodes(n, nodes) or None
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    rank = " ".join(shlex.quote(p) for p in (sys.executable, "-m", "bench.chaos", "--rank-of-trial", str(seed)))
    command = [mpiexec, "-disable-auto-cleanup", "-n", str(n), "sh", "-c", f'trap "" USR1; {rank}; exit $?']
    start, started = time.perf_counter(), time.time()
    # A session of its own, so that a hung job's every process can be ended.
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True,
                           env=dict(os.environ, CHAOS_RANKS=str(n), CHAOS_TIMEOUT=str(timeout),
                                    COLLECTIVES_PRETEND_NODES=pretend_nodes(n, nodes)))
    try:
        out, err = job.communicate(timeout=LIMIT)
        hung = False
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        out, err = job.communicate()
        hung = True
    trial["seconds"] = round(time.perf_counter() - start, 3)
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    # MPICH's own files, which a killed rank (and a survivor leaving by
    # os._exit) leaves: 2-4 MB of memory each, so 200 trials would keep
    # hundreds of MB. Removed where no process maps them any more.
    trial["mpich_files_removed"] = len(remove_orphaned_mpich_segments(started))
    # Ours would carry the communicator's prefix (protocol.new_prefix); the
    # library names nothing there (memfd segments). MPICH's files are
    # removed below, not judged: its killed ranks cannot remove them.
    ours_left = sorted(f for f in after - before if f.startswith("coll-"))
    kills = [float(t) for t in re.findall(r"KILL ([\d.]+)", out)]
    recovered = re.findall(r"RECOVERED ([\d.]+) SHRINKS (\d+) MEMBERS (\[[\d, ]*\]) RANK (\d+)", out)
    survivors = sorted(set(range(n)) - set(trial["victims"]))
    memberships = {m for _, _, m, _ in recovered}
    problems = []
    if hung:
        problems.append(f"hung: past {LIMIT:g} s")
    if sorted(int(r) for *_, r in recovered) != survivors:
        problems.append(f"survivors that finished: {sorted(int(r) for *_, r in recovered)}, expected {survivors}")
    if len(memberships) > 1:
        problems.append(f"different memberships: {sorted(memberships)}")
    elif memberships and json.loads(memberships.pop()) != survivors:
        problems.append(f"membership is not the survivors {survivors}")
    if ours_left:
        problems.append(f"left in /dev/shm: {ours_left}")
    if "Traceback" in out + err:   # what a survivor raised, for the record (a victim prints none)
        # (its files named from the repository's root: a record names no path of the machine it ran on)
        problems.append("a rank raised: " + err[err.find("Traceback"):][-2000:].replace(f"{REPOSITORY}{os.sep}", ""))
    trial["problems"] = problems
    detected = [float(t) for t in re.findall(r"DETECTED ([\d.]+)", out)]
    if kills and recovered and not problems:
        trial["recovery_ms"] = round((max(float(t) for t, *_ in recovered) - min(kills)) * 1e3, 2)
        if detected:   # the first survivor's error: what the rest of the recovery starts from
            trial["detected_ms"] = round((min(detected) - min(kills)) * 1e3, 2)
        trial["shrinks"] = max(int(s) for _, s, *_ in recovered)
    return trial


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def main(argv=None):
    p = cli.Parser(prog="python -m bench.chaos", description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=200, help="trials, seeds --seed, --seed + 1, ...")
    p.add_argument("--seed", type=int, default=1, help="the first trial's seed")
    p.add_argument("--ranks", default="2,3,4", help="processes per trial, taken in turn (comma-separated)")
    p.add_argument("--timeout", type=float, default=TIMEOUT,
                   help="the ranks' communicator timeout in seconds: what a stop costs, and how long a survivor "
                        "waits for a slow one before it leaves it out")
    p.add_argument("--nodes", type=int, default=1,
                   help="pretend nodes each trial's ranks are split into (consecutive ranks; at most one per rank): "
                        "the survivors shrink across nodes (default: 1, one node)")
    p.add_argument("--rank-of-trial", type=int, help=argparse.SUPPRESS)
    p.add_argument("-J", "--output_file", help="write every trial and the summary as JSON here (default: no file)")
    args = p.parse_args(argv)
    if args.rank_of_trial is not None:
        # Out through os._exit either way: MPI_Finalize at exit would wait for the dead ranks.
        try:
            rank_main(args.rank_of_trial, int(os.environ["CHAOS_RANKS"]))
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        sys.stdout.flush()
        os._exit(0)
    ranks = [int(r) for r in args.ranks.split(",")]
    if any(r < 2 for r in ranks):
        p.error("--ranks: every trial needs 2 or more ranks")
    if args.nodes < 1 or any(args.nodes > r for r in ranks):
        p.error(f"--nodes: between 1 and the fewest ranks of a trial ({min(ranks)}), got {args.nodes}")
    mpiexec = find_mpiexec()
    trials = []
    for i in range(args.trials):
        trial = run_trial(args.seed + i, ranks[i % len(ranks)], mpiexec, args.timeout, args.nodes)
        trials.append(trial)
        verdict = "ok" if not trial["problems"] else "FAILED: " + "; ".join(trial["problems"])
        print(f"seed {trial['seed']:5d}  {trial['ranks']} ranks  {trial['event']:9s} {trial['collective']:14s} "
              f"{trial['nbytes']:>8d} B  victims {trial['victims']}  "
              f"{trial.get('recovery_ms', float('nan')):8.1f} ms  {verdict}", flush=True)
    summary = summarize(trials)
    print(json.dumps(summary, indent=1))
    if args.output_file:
        report = {"command": command_line("bench.chaos", sys.argv[1:] if argv is None else argv),
                  "machine": machine(), "timeout_s": args.timeout, "summary": summary, "trials": trials}
        cli.write_json(args.output_file, report, say=None)
    return 1 if summary["failed"] else 0


def summarize(trials):
    summary = {"trials": len(trials), "failed": sum(bool(t["problems"]) for t in trials),
               "hangs": sum(any(p.startswith("hung") for p in t["problems"]) for t in trials), "recovery_ms": {}}
    for event in EVENTS:
        times = [t["recovery_ms"] for t in trials if t["event"] == event and "recovery_ms" in t]
        if times:
            after = [t["recovery_ms"] - t["detected_ms"] for t in trials
                     if t["event"] == event and "recovery_ms" in t and "detected_ms" in t]
            summary["recovery_ms"][event] = {"trials": len(times), "p50": percentile(times, 50),
                                             "p99": percentile(times, 99), "max": max(times),
                                             "after_detection_p50": round(percentile(after, 50), 2),
                                             "after_detection_p99": round(percentile(after, 99), 2),
                                             "median_shrinks": statistics.median(
                                                 t["shrinks"] for t in trials if t["event"] == event and "shrinks" in t)}
    return summary


def machine():
    """What the trials ran on."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    def installed(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
            **{name: installed(name) for name in ("mpich", "mpi4py", "numpy")}, "git_commit": git_commit()}


if __name__ == "__main__":
    sys.exit(main())
