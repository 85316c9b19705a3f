"""A non-editable install ships only what pyproject.toml's packages list
names, and the build asks for what it needs without a deprecated hook."""

import fnmatch
from pathlib import Path

from setuptools.config.pyprojecttoml import load_file

ROOT = Path(__file__).resolve().parents[1]
SETUPTOOLS = load_file(ROOT / "pyproject.toml")["tool"]["setuptools"]


def test_every_source_folder_is_a_package_pyproject_ships():
    shipped = set(SETUPTOOLS["packages"])
    with_sources = {
        ".".join(path.parent.relative_to(ROOT).parts)
        for path in (ROOT / "collectives").rglob("*.py")
        if "__pycache__" not in path.parts
    }
    assert with_sources <= shipped, f"not installed by pip install .: {sorted(with_sources - shipped)}"


def test_the_kernel_sources_ship_with_the_package():
    """pyproject.toml installs kernels/ as collectives/kernel_sources: every
    file the kernels are built from must match its package-data patterns."""
    from collectives import kernels
    assert SETUPTOOLS["package-dir"]["collectives.kernel_sources"] == "kernels"
    needed = [p.relative_to(ROOT / "kernels") for p in (ROOT / "kernels").rglob("*")
              if p.is_file() and p.suffix in (".cu", ".cuh", ".h", ".cpp")]
    unshipped = []
    for source in needed:
        package = ".".join(("collectives.kernel_sources", *source.parent.parts))
        patterns = SETUPTOOLS["package-data"].get(package, []) if package in SETUPTOOLS["packages"] else []
        if not any(fnmatch.fnmatch(source.name, pattern) for pattern in patterns):
            unshipped.append(source.as_posix())
    assert needed and not unshipped, f"kernel sources no package ships: {unshipped}"
    assert kernels.source_dir() == ROOT / "kernels"


def test_the_tensorflow_op_source_ships_with_the_package():
    """collectives/tensorflow/native.py builds its op from a source beside
    it at first use: an installed package must carry it."""
    source = ROOT / "collectives" / "tensorflow" / "_call_op.cc"
    patterns = SETUPTOOLS["package-data"].get("collectives.tensorflow", [])
    assert source.is_file() and any(fnmatch.fnmatch(source.name, pattern) for pattern in patterns)


def test_numpy_is_a_build_requirement_not_a_setup_requires():
    """_arraystate.c includes NumPy's headers: pyproject.toml's build-system
    brings NumPy; setup_requires (deprecated, warned about on every build)
    is gone."""
    build = load_file(ROOT / "pyproject.toml")["build-system"]["requires"]
    assert any(requirement.startswith("numpy") for requirement in build), build
    assert "setup_requires" not in (ROOT / "setup.py").read_text()
