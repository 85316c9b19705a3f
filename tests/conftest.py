"""Test configuration: markers, a global hang guard, shared fixtures."""

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped with a reason when none is usable)")
    config.addinivalue_line("markers", "mpi: starts several processes under mpiexec")
    # No test may hang CI: every test gets a hard limit unless it sets its own.
    if config.pluginmanager.hasplugin("timeout") and not config.getoption("timeout", None):
        config.option.timeout = 300
