"""The README's Python snippets run as written, and say what they do.

A newcomer copies them first: the API block (its comments state results)
and the training block (which must define what it uses). The GPU and
several-process blocks need a GPU or mpiexec and are not run here."""

import re
from pathlib import Path

import numpy as np
import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def snippet(heading):
    """The first ```python block under `## heading`."""
    text = README.read_text(encoding="utf-8")
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_api_snippet_runs_and_its_comments_hold():
    names = {}
    exec(compile(snippet("The API"), "README: The API", "exec"), names)
    xs, gathered, y = names["xs"], names["gathered"], names["y"]
    # allreduce made every xs[r] 6.0; broadcast from 2 and max to 0 keep it.
    assert all((x == 6.0).all() for x in xs)
    # Each rank gets the 4 blocks of 250: 1000 elements, each block 4 x 6.0.
    assert all(g.shape == (1000,) and (g == 24.0).all() for g in gathered)
    assert isinstance(y, np.ndarray) and (y == 1.0).all()
    assert names["step"].algorithm is not None
    assert [u.size for u in names["uneven"]] == [400, 800, 1200, 1600]


def test_the_training_snippet_runs():
    pytest.importorskip("torch", reason="the training snippet needs PyTorch: pip install '.[test]'")
    names = {}
    exec(compile(snippet("Training with PyTorch"), "README: Training with PyTorch", "exec"), names)
    assert names["loss"].item() > 0


def test_docs_and_code_name_things_not_issue_numbers():
    """A reader cannot open the tracker's numbers ("issue" and a number):
    docs, code and tests say what they mean instead."""
    root = README.parent
    sources = [p for folder in ("collectives", "bench", "kernels", "tests", "examples")
               for p in (root / folder).rglob("*") if p.suffix in (".py", ".c", ".cpp", ".h", ".cu", ".cuh", ".md")]
    files = [README, *root.glob("docs/*.md"), *root.glob("*.toml"), root / "setup.py", *sources]
    pattern = re.compile(r"\b[Ii]ssues? #?\d+|\b[Ii]ssue #\d+")
    cited = [f"{p.relative_to(root)}: {m.group(0)}" for p in files for m in pattern.finditer(p.read_text(errors="replace"))]
    assert not cited, cited
