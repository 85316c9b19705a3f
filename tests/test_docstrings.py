"""The public API documents itself: help() on every public method of
Communicator, and on collectives.init, names each argument and says what
the call raises (the sections a newcomer looks for first)."""

import inspect
import re

import pytest

import collectives
from collectives import Communicator

PUBLIC = [getattr(Communicator, name) for name in (
    "allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "allreduce_many", "fusion_buffer",
    "barrier", "synchronize", "close", "chosen_algorithm", "local")] + [collectives.init]


@pytest.mark.parametrize("function", PUBLIC, ids=[f.__name__ for f in PUBLIC])
def test_every_argument_and_the_errors_are_documented(function):
    doc = inspect.getdoc(function)
    assert doc, f"{function.__name__} has no docstring"
    arguments = [name for name in inspect.signature(function).parameters if name not in ("self", "cls")]
    missing = [name for name in arguments if not re.search(rf"(^|\W){name}(\W|$)", doc)]
    assert not missing, f"{function.__name__}'s docstring does not name {missing}"
    if function.__name__ != "close":   # close raises nothing: it says so
        assert "Raises" in doc, f"{function.__name__}'s docstring does not say what it raises"


def test_the_collectives_say_what_they_return():
    for function in PUBLIC[:6]:
        assert "Returns" in inspect.getdoc(function), function.__name__
