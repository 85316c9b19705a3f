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
