"""`pytest -m quick`, the working loop's tier, runs something of every test
module: a module whose every test is marked slow would drop out of it
unnoticed."""

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_the_quick_tier_covers_every_module():
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-m", "quick",
                             "-p", "no:cacheprovider", str(TESTS)],
                            cwd=TESTS.parent, capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0, listed.stdout[-3000:] + listed.stderr[-3000:]
    quick_modules = {line.split("::")[0].split("/")[-1] for line in listed.stdout.splitlines() if "::" in line}
    every_module = {path.name for path in TESTS.glob("test_*.py")}
    assert quick_modules == every_module, f"no quick test in {sorted(every_module - quick_modules)}"
