"""A non-editable install ships only what setup.py's packages list names."""

from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[1]


def test_every_source_folder_is_a_package_setup_py_ships():
    shipped = set(find_packages(where=str(ROOT), include=["collectives", "collectives.*"]))
    with_sources = {
        ".".join(path.parent.relative_to(ROOT).parts)
        for path in (ROOT / "collectives").rglob("*.py")
        if "__pycache__" not in path.parts
    }
    assert with_sources <= shipped, f"not installed by pip install .: {sorted(with_sources - shipped)}"


def test_the_kernel_sources_ship_with_the_package():
    """setup.py installs kernels/ as collectives/kernel_sources: every file the
    kernels are built from must match its package_data patterns."""
    import fnmatch
    import re
    setup_py = (ROOT / "setup.py").read_text()
    patterns = re.findall(r'"([^"]+)"', re.search(r'package_data=\{"collectives.kernel_sources": \[([^]]*)\]', setup_py)[1])
    from collectives import kernels
    needed = [p.relative_to(ROOT / "kernels").as_posix() for p in (ROOT / "kernels").rglob("*")
              if p.is_file() and p.suffix in (".cu", ".cuh", ".h", ".cpp")]
    assert needed and all(any(fnmatch.fnmatch(f, pattern) for pattern in patterns) for f in needed), needed
    assert kernels.source_dir() == ROOT / "kernels"
