"""tests/cpu_times.py: `pytest --cpu-times=PATH` on a run of its own."""

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def test_cpu_times_counts_a_tests_child_processes_and_replaces_the_last_runs_files(tmp_path):
    # a test that starts a process of 0.3 CPU-s or more (its spin), in a pytest of its own
    (tmp_path / "test_spin.py").write_text(
        "import subprocess, sys\n"
        "def test_spin():\n"
        "    subprocess.run([sys.executable, '-c', 'import time\\nt = time.process_time()\\n"
        "while time.process_time() - t < 0.3: pass'], check=True)\n")
    path = tmp_path / "out" / "times"
    path.parent.mkdir()
    (path.parent / "times.gw7").write_text("stale\t1\t1\t1\n")   # a file of an earlier run
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), "-c", "/dev/null", "-p", "cpu_times",
                           f"--cpu-times={path}", str(tmp_path / "test_spin.py")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(TESTS)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in path.parent.glob("times.*")) == ["times.main"]
    node, wall, own, children = (path.parent / "times.main").read_text().strip().split("\t")
    assert node.endswith("test_spin.py::test_spin") and float(children) >= 0.3, (node, children)
    assert float(wall) >= float(children) - 0.05, (wall, children)
    assert "CPU by module" in done.stdout and "test_spin.py" in done.stdout, done.stdout
