"""Where the suite's CPU goes: `pytest --cpu-times=PATH` writes, for each
test, its wall time and the CPU time (user and system) of the process that
ran it and of the processes it started and waited for (ranks under mpiexec
or torchrun, the tools), one line each, to PATH.<worker> (PATH.main
without xdist); at the end the run prints the modules that used the most.
The suite is bound by CPU on 2 cores (docs/testing.md, "Where the CPU
goes"), so CPU-seconds, not wall time, say what a change saves.

Each line: node id, wall s, own CPU s, children's CPU s (tab-separated).
"""

import glob
import os
import resource
import time

import pytest

TOP_MODULES = 15


def pytest_addoption(parser):
    parser.addoption("--cpu-times", metavar="PATH", default=None,
                     help="write each test's wall time and its own and its child processes' CPU time to "
                          "PATH.<xdist worker> and print the modules that used the most (tests/cpu_times.py)")


def pytest_configure(config):
    """A new run's files replace the last's (the controller, before it starts its workers)."""
    path = config.getoption("cpu_times")
    if path is not None and not hasattr(config, "workerinput"):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        for name in glob.glob(glob.escape(path) + ".*"):
            os.remove(name)


def _cpu(who):
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = item.config.getoption("cpu_times")
    if path is None:
        yield
        return
    own, children, wall = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN), time.monotonic()
    yield
    own, children = _cpu(resource.RUSAGE_SELF) - own, _cpu(resource.RUSAGE_CHILDREN) - children
    # (from the config, not $PYTEST_XDIST_WORKER, which a pytest started by a test inherits)
    worker = getattr(item.config, "workerinput", {}).get("workerid", "main")
    with open(f"{path}.{worker}", "a") as f:
        f.write(f"{item.nodeid}\t{time.monotonic() - wall:.3f}\t{own:.3f}\t{children:.3f}\n")


def module_totals(path):
    """{module: [tests, wall s, own CPU s, children's CPU s]} from every PATH.<worker> file."""
    totals = {}
    for name in glob.glob(glob.escape(path) + ".*"):
        with open(name) as f:
            for line in f:
                node, *figures = line.rstrip("\n").split("\t")
                row = totals.setdefault(node.split("::")[0], [0, 0.0, 0.0, 0.0])
                row[0] += 1
                for i, figure in enumerate(figures, 1):
                    row[i] += float(figure)
    return totals


def pytest_terminal_summary(terminalreporter, config):
    path = config.getoption("cpu_times")
    if path is None or hasattr(config, "workerinput"):   # (the controller prints, once its workers are done)
        return
    totals = module_totals(path)
    cpu = sum(row[2] + row[3] for row in totals.values())
    terminalreporter.section(f"CPU by module ({cpu:.0f} CPU-s in all; every test in {path}.*)", sep="-")
    for module, (tests, wall, own, children) in sorted(totals.items(), key=lambda kv: -(kv[1][2] + kv[1][3]))[
            :TOP_MODULES]:
        terminalreporter.write_line(f"{own + children:8.1f} CPU-s  (own {own:7.1f}, children {children:7.1f}; "
                                    f"wall {wall:7.1f} s)  {tests:6d} tests  {module}")
