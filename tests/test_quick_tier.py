"""`pytest -m quick`, the working loop's tier, runs something of every test
module: a module whose every test is marked slow would drop out of it
unnoticed."""

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def quick_modules_of_a_new_collection():
    """The modules `pytest -m quick` would run, collected anew in a subprocess."""
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-m", "quick",
                             "-p", "no:cacheprovider", str(TESTS)],
                            cwd=TESTS.parent, capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0, listed.stdout[-3000:] + listed.stderr[-3000:]
    return {line.split("::")[0].split("/")[-1] for line in listed.stdout.splitlines() if "::" in line}


def test_the_quick_tier_covers_every_module(request):
    every_module = {path.name for path in TESTS.glob("test_*.py")}
    # When this session collected every module (the whole suite, as CI runs
    # it), its own items carry the quick marks (tests/conftest.py puts them
    # at collection, before -m selects): no second collection is needed.
    # Otherwise (a module, -k or -m run) the suite is collected anew.
    collected = request.session.items
    if {item.path.name for item in collected} == every_module:
        quick_modules = {item.path.name for item in collected if item.get_closest_marker("quick")}
    else:
        quick_modules = quick_modules_of_a_new_collection()
    assert quick_modules == every_module, f"no quick test in {sorted(every_module - quick_modules)}"
