"""Skips for tests that need a package only in the processes they start.

`pytest.importorskip("torch")` imports torch in the pytest worker to tell
whether it is installed: 1-2.5 CPU-s for torch, 1.2-2.8 for scikit-learn
(SciPy comes with it), in each xdist worker, for tests whose ranks, under
mpiexec or torchrun, import it themselves. `importlib.util.find_spec` tells
the same without running the package. (A package that is installed but
fails to import then fails the test that needs it, not skip it.)
"""

import importlib.util

import pytest


def installed(module):
    """Whether `module` (a top-level package) can be imported, without importing it."""
    return importlib.util.find_spec(module) is not None


def needs(module, reason):
    """A mark that skips a test, or a module's tests, where `module` is not installed."""
    return pytest.mark.skipif(not installed(module), reason=reason)


def require(module, reason):
    """Skip the calling test where `module` is not installed."""
    if not installed(module):
        pytest.skip(reason)
