"""bench.plot: results JSON -> series -> a PNG of bus bandwidth and latency against size."""

import json
import sys

import pytest

from bench import plot

SIZES = (1024, 4096, 16384)


def results(processes=2, device="host (no GPU)", backends=("host", "mpi")):
    """A small results dict as harness -J writes it: time = size/1000 µs times (backend index + 1),
    in place half that; busbw is made up of the same numbers so each value is traceable."""
    rows = []
    for size in reversed(SIZES):  # the series sort by size whatever order the rows come in
        for i, backend in enumerate(backends):
            time = size / 1000 * (i + 1)
            rows.append({"backend": backend, "size": size, "count": size // 4, "type": "float32",
                         "redop": "sum", "root": -1,
                         "out_of_place": {"time_us": time, "algbw": 1.0, "busbw": size / time, "wrong": 0},
                         "in_place": {"time_us": time / 2, "algbw": 2.0, "busbw": 2 * size / time, "wrong": 0}})
    return {"collective": "allreduce", "rows": rows,
            "environment": {"cpu": "Test CPU", "cores": 2, "processes": processes, "ranks": processes,
                            "backends": list(backends), "device": device, "command": "python -m ..."}}


def test_one_file_one_line_per_backend():
    host, mpi = plot.series({"a": results()})
    assert (host.label, mpi.label) == ("host", "mpi")
    assert host.sizes == mpi.sizes == list(SIZES)
    assert host.time_us == [s / 1000 for s in SIZES] and mpi.time_us == [2 * s / 1000 for s in SIZES]
    assert host.busbw == pytest.approx([1000] * 3) and mpi.busbw == pytest.approx([500] * 3)


def test_in_place():
    host, mpi = plot.series({"a": results()}, "in_place")
    assert host.time_us == [s / 2000 for s in SIZES] and mpi.time_us == [s / 1000 for s in SIZES]
    assert host.busbw == pytest.approx([2000] * 3) and mpi.busbw == pytest.approx([1000] * 3)


def test_several_files_are_labelled_by_what_sets_them_apart():
    lines = plot.series({"two": results(2), "four": results(4, "NVIDIA H100 80GB HBM3")})
    assert [s.label for s in lines] == ["host (2 proc, host)", "mpi (2 proc, host)",
                                        "host (4 proc, NVIDIA H100 80GB HBM3)",
                                        "mpi (4 proc, NVIDIA H100 80GB HBM3)"]
    lines = plot.series({"two": results(2), "virtual": results(1) | {"environment": {"processes": 1, "ranks": 4}}})
    assert [s.label for s in lines][1:3] == ["mpi (2 proc)", "host (4 ranks, 1 proc)"]


def test_files_with_one_environment_are_labelled_by_name():
    lines = plot.series({"ring": results(), "direct": results()})
    assert [s.label for s in lines] == ["host (ring)", "mpi (ring)", "host (direct)", "mpi (direct)"]


def test_size_labels_and_title():
    assert [plot.size_label(n) for n in (8, 1024, 1536, 64 << 20, 2 << 30)] == \
        ["8 B", "1 KiB", "1.5 KiB", "64 MiB", "2 GiB"]
    files = {"a": results(), "b": results(device="NVIDIA H100 80GB HBM3")}
    assert plot.machine(files) == "Test CPU, 2 cores; Test CPU, 2 cores, NVIDIA H100 80GB HBM3"


def test_draws_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: pip install '.[bench]'")
    paths = []
    for processes in (2, 4):
        paths.append(tmp_path / f"r{processes}.json")
        paths[-1].write_text(json.dumps(results(processes)))
    out = tmp_path / "plot.png"
    plot.main([*map(str, paths), "-o", str(out), "--placement", "in_place", "--title", "test"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    assert f"wrote {out}" in capsys.readouterr().out


def test_without_matplotlib_says_how_to_install_it(tmp_path, monkeypatch):
    for name in [name for name in sys.modules if name.split(".")[0] == "matplotlib"] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # any import of it now fails
    with pytest.raises(SystemExit, match=r"pip install '\.\[bench\]'"):
        plot.draw(plot.series({"a": results()}), tmp_path / "x.png", "title")


@pytest.mark.parametrize("content, message", [
    ("not json", "not JSON"),
    ("[1, 2]", "not a benchmark results JSON"),
    ('{"command": "x", "results": []}', "not a benchmark results JSON"),  # call_overhead's kind
    (json.dumps(results() | {"rows": []}), "no rows"),
    (json.dumps(results() | {"rows": [{"backend": "host", "size": 8}]}), "a row without"),
])
def test_bad_files_are_clear_errors(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(SystemExit, match=message):
        plot.main([str(path), "-o", str(tmp_path / "x.png")])
    assert not (tmp_path / "x.png").exists()


def test_missing_file_and_unknown_placement(tmp_path):
    with pytest.raises(SystemExit, match="No such file"):
        plot.main([str(tmp_path / "absent.json"), "-o", str(tmp_path / "x.png")])
    path = tmp_path / "r.json"
    path.write_text(json.dumps(results()))
    with pytest.raises(SystemExit, match="unknown placement 'sideways'"):
        plot.main([str(path), "-o", str(tmp_path / "x.png"), "--placement", "sideways"])
    with pytest.raises(ValueError, match="unknown placement"):
        plot.series({"r": results()}, "both")
