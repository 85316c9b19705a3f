"""docs/benchmarks.md is exactly what `python -m bench.report` writes from
bench/results/, so its tables cannot drift from the measurements."""

import json
import os
import subprocess
import sys

import pytest

from bench import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = report.ROOT / report.RESULTS


def test_committed_page_is_what_the_report_writes_today():
    committed = (report.ROOT / report.OUTPUT).read_text()
    assert committed == report.render(RESULTS), (
        "docs/benchmarks.md is out of date with bench/results/: run python -m bench.report and commit it")


def test_every_run_names_the_commit_it_measured():
    """A run whose JSON records no commit gets one in bench/results/notes.json
    (the commit that added the file), or is deleted."""
    notes = json.loads((RESULTS / report.NOTES).read_text())
    unmarked = []
    for path in sorted(RESULTS.rglob("*.json")):
        if path.name == report.NOTES:
            continue
        relative = path.relative_to(RESULTS).as_posix()
        recorded = report.run_environment(json.loads(path.read_text())).get("git_commit")
        if (not recorded or recorded == "unknown") and not notes.get(relative, {}).get("commit"):
            unmarked.append(relative)
    assert not unmarked, f"add their commit to bench/results/notes.json: {unmarked}"


def test_no_run_names_a_path_outside_the_repository():
    """Recorded commands say `python -m ...` and name output files as the
    repository keeps them: no interpreter or folder of the machine that
    ran them (bench.environment.command_line)."""
    import re
    outside = re.compile(r"(?<![\w.])/(?:work|tmp|root|home|opt|usr|mnt|scratch)/")
    named = [path.relative_to(RESULTS).as_posix() for path in sorted(RESULTS.rglob("*.json"))
             if outside.search(path.read_text())]
    assert not named, f"these runs name a path outside the repository: {named}"


def harness_run(command, commit=None, backends=("ours", "mpi")):
    environment = {"command": command, "cpu": "Test CPU", "cores": 2, "device": "host (no GPU)"}
    if commit:
        environment["git_commit"] = commit
    rows = [{"backend": b, "size": size, "type": "float32", "redop": "sum",
             "out_of_place": {"time_us": 10.0 * (i + 1)}, "in_place": {"time_us": 5.0 * (i + 1)}}
            for size in (1024, 4) for i, b in enumerate(backends)]
    return {"collective": "allreduce", "environment": environment, "rows": rows}


def test_the_page_comes_from_the_files_sorted_with_their_command_machine_and_commit(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.json").write_text(json.dumps(harness_run("mpiexec -n 2 /x/.venv/bin/python -m bench.all_reduce_perf",
                                                            commit="0123456789abcdef")))
    (tmp_path / "a.json").write_text(json.dumps({"command": "python -m bench.plan_report", "rows": [{"x": 1}]}))
    (tmp_path / "sub" / "c.json").write_text(json.dumps({"rows": []}))
    (tmp_path / report.NOTES).write_text(json.dumps({"a.json": {"commit": "fedcba9876543210", "stale": "old"}}))
    page = report.render(tmp_path)
    assert page == report.render(tmp_path)
    a, b, c = (page.index(f"## bench/results/{name}") for name in ("a.json", "b.json", "sub/c.json"))
    assert a < b < c
    assert "- Command: `mpiexec -n 2 python -m bench.all_reduce_perf`" in page
    assert "- Machine: Test CPU, 2 cores; no GPU" in page
    assert "- Commit: `0123456789`" in page
    assert "- Commit: `fedcba9876` (the run recorded none" in page and "**No longer describes the code:** old" in page
    assert "- Command: `not recorded`" in page and "- Machine: not recorded" in page  # sub/c.json has neither
    # Rows sorted by size, each backend's two placements, then mpi's time over ours.
    assert "| 4 B | 10.0 | 5.0 | 20.0 | 10.0 | 2.00 | 2.00 |" in page
    assert page.index("| 4 B |") < page.index("| 1 KiB |")


def test_notes_for_missing_files_are_an_error(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"rows": []}))
    (tmp_path / report.NOTES).write_text(json.dumps({"gone.json": {"commit": "abc"}}))
    with pytest.raises(ValueError, match="gone.json"):
        report.render(tmp_path)


def test_the_command_writes_the_page(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(harness_run("python -m bench.all_reduce_perf", commit="1" * 40)))
    output = tmp_path / "page.md"
    done = subprocess.run([sys.executable, "-m", "bench.report", "--results", str(tmp_path), "-o", str(output)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert output.read_text() == report.render(tmp_path)
