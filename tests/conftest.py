"""Test configuration (the rest is pyproject.toml's [tool.pytest.ini_options]):
which collective-matrix cases run, which tests share an xdist worker, the
skips grouped by reason, a temporary folder of the run's own, and MPICH's
files that killed ranks left behind."""

import compileall
import gc
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

from bench.mpis import remove_orphaned_mpich_segments
from rare_collections import collect_rarely

pytest_plugins = ("cpu_times",)   # pytest --cpu-times=PATH: where the suite's CPU goes

# Every process the tests start (ranks under mpiexec and torchrun, the tools)
# inherits this. OpenBLAS starts a thread per core when NumPy is imported,
# and their start spins: `import numpy` took 0.15-0.19 CPU-s with them on
# the 2-core machine, 0.09 without, in a suite that starts thousands of
# ranks (docs/testing.md). No test gives BLAS enough work to want threads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# This process loads PyTorch and TensorFlow as it collects, and keeps every
# test item; its collector runs rarely, as in the workers that load them.
collect_rarely()

# The algorithms whose schedules the emulated backends run on the whole
# collective matrix; the others run it whole on host ranks, and on emulated
# devices only for these (ranks, count) cases, powers of two and not: their
# op tables are run by the same kernel, so what is left to check there is
# little, and CI's time is not. A real GPU (the `gpu` backend, which CI never
# runs) runs every algorithm on the whole matrix.
FULL_MATRIX_ON_DEVICES = ("auto", "ring", "direct")
REDUCED_MATRIX_ON_DEVICES = {"emulated": {(3, 4), (3, 1000), (4, 1000), (5, 6), (5, 1000), (8, 1000)},
                             "emulated-3": {(5, 1000)}}


def mark_the_quick_tier(items):
    """`pytest -m quick`, a working loop of a minute or two: the middle case
    of every test function that is not marked slow (the middle one rather
    than the first, which is often the empty or one-rank case)."""
    cases = {}
    for item in items:
        cases.setdefault((item.module.__name__, item.originalname), []).append(item)
    for same_function in cases.values():
        middle = same_function[len(same_function) // 2]
        if not middle.get_closest_marker("slow"):
            middle.add_marker(pytest.mark.quick)


# Markers of tests that take seconds each: ranks started as processes, or a
# case marked slow.
LONG_TEST_MARKERS = ("mpi", "processes", "slow")
# The modules whose tests take 10 s to a minute each (torchrun jobs, training
# runs, the nvcc build, bench.gpu_check: `pytest --durations`), first of all.
LONGEST_MODULES = ("test_torch_examples.py", "test_tensorflow.py", "test_torch_backend.py", "test_training.py",
                   "test_torch_hook.py", "test_kernels.py", "test_bench.py", "test_recovery.py")


def long_modules_first(items):
    """Run the modules of LONGEST_MODULES first, then those that have a test
    marked mpi, processes or slow, then the others; each module's tests in
    their own order (a module's fixtures are still set up once). Under
    `--dist worksteal` (pyproject.toml) a worker that runs out takes the
    second half of what another has left, so the tests left at the very end
    are those in the middle of this order: short ones, where a torchrun job
    or a build left last kept one worker busy for a minute while the other
    idled. (Only the time the run takes depends on this order.)"""
    long = {item.path.name for item in items if any(item.get_closest_marker(m) for m in LONG_TEST_MARKERS)}

    def rank(item):
        name = item.path.name
        return LONGEST_MODULES.index(name) if name in LONGEST_MODULES else \
            len(LONGEST_MODULES) + (name not in long)

    items.sort(key=rank)   # stable: the order within each module is kept


@pytest.hookimpl(tryfirst=True)   # before -m selects: the quick marker must be there
def pytest_collection_modifyitems(config, items):
    """Drop the collective-matrix cases that cannot or need not run: an
    algorithm on a collective it does not implement, and the device
    backends' cases beyond the reduced matrix for the newer algorithms.
    Mark the quick tier among the cases that run, and put the modules of
    long tests first."""
    from collectives.algorithms import REGISTRY
    from collectives.algorithms.schedule import ALL_COLLECTIVES

    kept, dropped = [], []
    for item in items:
        params = getattr(item, "callspec", None) and item.callspec.params
        collective = item.originalname[len("test_"):] if item.originalname else ""
        if not params or "algorithm" not in params or item.module.__name__ != "test_collectives":
            kept.append(item)
            continue
        algorithm, backend = params["algorithm"], params.get("backend")
        implemented = algorithm == "auto" or collective not in ALL_COLLECTIVES \
            or collective in REGISTRY[algorithm].collectives
        on_device = backend in REDUCED_MATRIX_ON_DEVICES and algorithm not in FULL_MATRIX_ON_DEVICES
        if not implemented or (on_device and (params["n"], params["count"]) not in REDUCED_MATRIX_ON_DEVICES[backend]):
            dropped.append(item)
        else:
            kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    mark_the_quick_tier(items)
    long_modules_first(items)
    config.stash[MATRIX_DESELECTED] = len(dropped)
    if hasattr(config, "workeroutput"):   # an xdist worker: the controller, which collects nothing, reports it
        config.workeroutput[MATRIX_DESELECTED_KEY] = len(dropped)


def pytest_collection_finish(session):
    """Take what collection left (tens of thousands of test items, every
    imported module: torch and TensorFlow among them, a million objects in
    all) out of the cyclic garbage collector's reach: they live until the
    run ends, and each full collection walked all of them again. The
    collective matrix keeps thousands of prepared plans alive (a
    communicator's caches), so full collections came every few tests and
    took about a second each on the 2-core machine: a third of the CPU time
    of the emulated-3 matrix. Objects made by the tests themselves are
    collected as before (tests/test_call_path.py's gc.collect() checks)."""
    gc.collect()
    gc.freeze()


# How many collective-matrix cases pytest_collection_modifyitems dropped, for the report.
MATRIX_DESELECTED = pytest.StashKey[int]()
MATRIX_DESELECTED_KEY = "collectives_matrix_deselected"


def matrix_deselected_line(dropped):
    return (f"collectives: {dropped} collective-matrix cases deselected on purpose: an algorithm on a "
            f"collective it does not implement, and on emulated devices the algorithms other than "
            f"{', '.join(FULL_MATRIX_ON_DEVICES)} beyond a reduced (ranks, count) set (tests/conftest.py)")


def pytest_report_collectionfinish(config, items):
    """Says once why thousands of cases are deselected, right under pytest's
    count (in one process, -n 0; under xdist the summary says it)."""
    dropped = config.stash.get(MATRIX_DESELECTED, 0)
    return [matrix_deselected_line(dropped)] if dropped else []


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """An xdist worker is done: keep what it deselected (every worker
    collects the same list, so any one's count is the run's)."""
    dropped = getattr(node, "workeroutput", {}).get(MATRIX_DESELECTED_KEY)
    if dropped is not None:
        node.config.stash[MATRIX_DESELECTED] = dropped


def pytest_terminal_summary(terminalreporter, config):
    """Skips grouped by reason with their counts, most frequent first: one
    line per reason instead of one per test (pytest -rs still lists them all);
    under xdist, also the deselected matrix cases, which pytest's own count
    leaves out there."""
    dropped = config.stash.get(MATRIX_DESELECTED, 0)
    if dropped and config.pluginmanager.hasplugin("dsession"):   # the xdist controller
        terminalreporter.write_line(matrix_deselected_line(dropped))
    reasons = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    if reasons:
        terminalreporter.section("skips by reason", sep="-")
        for reason, count in sorted(reasons.items(), key=lambda item: (-item[1], item[0])):
            terminalreporter.write_line(f"{count:6d}  {reason}")


SESSION_STARTED = pytest.StashKey[float]()
ROOT = Path(__file__).resolve().parent.parent


RUN_TEMP_FOLDER = pytest.StashKey[str]()


def pytest_configure(config):
    """On the controller (or the one process), before any worker or rank
    starts: every process of the run makes its temporary files in a folder
    of the run's own ($TMPDIR, which xdist's workers, the ranks and the tools
    inherit), removed at the end. TensorFlow's autograph leaves a
    `__autograph_generated_file*.py` there for every function it converts,
    and torchrun a `torchelastic_*` folder per job: a run of the suite left
    hundreds in /tmp. pytest's own `tmp_path` folders stay where they were
    (PYTEST_DEBUG_TEMPROOT, which pytest reads for that), kept for a look
    after a failure."""
    if hasattr(config, "workerinput"):
        return
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    folder = tempfile.mkdtemp(prefix="collectives-tests-")
    config.stash[RUN_TEMP_FOLDER] = folder
    os.environ["TMPDIR"] = folder
    tempfile.tempdir = None   # gettempdir() reads $TMPDIR again


def pytest_unconfigure(config):
    folder = config.stash.get(RUN_TEMP_FOLDER, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def pytest_sessionstart(session):
    session.config.stash[SESSION_STARTED] = time.time()
    if not hasattr(session.config, "workerinput"):
        compile_the_projects_own_modules()


def compile_the_projects_own_modules():
    """Byte-compile collectives/, bench/ and tests/ once, before any process
    starts. An editable install (the README's) leaves them uncompiled, and
    under PYTHONDONTWRITEBYTECODE=1 (set on this project's machines) no
    process writes what it compiled: every rank the suite starts, well over a
    thousand, compiled `import collectives` anew, about 0.08 CPU-s each, 6%
    of tests/test_hierarchy.py's CPU (docs/testing.md). Python only reads
    these files where their source is unchanged; __pycache__ is git-ignored.
    (pip writes the same files for an installed package.)"""
    if sys.dont_write_bytecode:
        for package in ("collectives", "bench", "tests"):
            compileall.compile_dir(ROOT / package, quiet=2)


def pytest_sessionfinish(session):
    """Once every test is done (on the xdist controller, after its workers,
    or in the one process): MPICH's shared-memory files that the run's
    killed ranks left in /dev/shm, which nothing else would ever free."""
    if not hasattr(session.config, "workerinput"):
        remove_orphaned_mpich_segments(session.config.stash.get(SESSION_STARTED, time.time()))
