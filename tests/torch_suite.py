"""PyTorch's own torch.distributed suite on our backend "collectives":
torch's DistributedTest._DistTestBase, the tests that PyTorch's
test/distributed/test_distributed_spawn.py runs for Gloo and NCCL, each
test on 3 CPU ranks spawned as processes.

    .venv/bin/python tests/torch_suite.py                 # the whole suite: ~17 min on 2 cores
    .venv/bin/python tests/torch_suite.py -k all_to_all   # pytest's arguments (-k replaces the default)
    .venv/bin/python tests/torch_suite.py --ungated --list    # the tests torch skips for us by name alone
    .venv/bin/python tests/torch_suite.py --ungated -k "get_future or sparse"   # run them, those gates lifted

Not a test file of our suite (pytest collects test_*.py): it takes a
quarter of an hour, for a CI job or a test marked slow to run. Each test
costs ~4 s, nearly all of it 3 interpreters importing torch.

What test_distributed_spawn.py does, here for a backend it does not know:
- BACKEND and WORLD_SIZE are read by torch's module when it is imported,
  so they are set first (the defaults below; the environment's win).
  TEMP_DIR and INIT_METHOD are set by the test class's setUp (a fresh
  directory and a file:// rendezvous per test).
- The tests gate on feature sets naming the backends (DistTestCases:
  "ddp", "subgroup"; "plugin" makes require_backend_is_available accept a
  backend torch does not know): "collectives" joins them. Tests named for
  GPUs (cuda, gpu, nccl) are deselected.
- Every rank is a process started with "spawn", which imports this module
  again to find the test class: so it registers our backend
  (import collectives.torch) and joins the feature sets in every rank.

One difference: torch gates its CPU all_to_all tests on MPI, its only CPU
backend with all_to_all ("Only MPI supports ..."); ours has it, so they run
here (12 tests; the 4 *_group ones still skip, as torch skips every
*_group test below 8 ranks for a backend other than MPI).

`--ungated` (which sets $COLLECTIVES_TORCH_SUITE_UNGATED=1, so that the
spawned ranks do the same) lifts the skips that torch puts on a test by
the backend's name alone (NAME_GATES below: "requires backend ... one of
{gloo, ...}", "Only gloo backend supports timeouts" and the like), and
only those: a test's other skips (CUDA devices, world size, open torch
issues) still apply. `--list` prints the tests it lifts, with the reason
and any skip left on them.

Needs torch's test dependency expecttest (pip install expecttest).
Counts (torch 2.13.0, 3 ranks; docs/training.md says what fails and why):
ours 62 passed, 13 failed (point-to-point), 165 skipped; Gloo passes 90.
With send and recv since: 75 passed, 0 failed, 165 skipped (12 min 15 s).
"""

import os
import sys

os.environ.setdefault("BACKEND", "collectives")
os.environ.setdefault("WORLD_SIZE", "3")
# A test that hangs is killed after this many seconds (torch's default, 300, would let a few hangs take the run's
# whole budget); the slowest took 40 s on 2 loaded cores, most take 4 to 7.
os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "120")

try:
    import expecttest  # noqa: F401  (torch's test modules import it)
except ImportError:
    sys.exit("tests/torch_suite.py: PyTorch's test modules need expecttest: pip install expecttest")

from rare_collections import collect_rarely

collect_rarely()   # before PyTorch and TensorFlow load: rare_collections.py says why

import torch  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False   # as test_distributed_spawn.py

import collectives.torch  # noqa: E402,F401  (registers the backend, in the spawned ranks too)
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

BACKEND = os.environ["BACKEND"]
DESELECTED = "not cuda and not gpu and not nccl"

# before torch's test module is imported: its decorators read the sets when it is
for feature in ("ddp", "subgroup", "plugin"):
    DistTestCases.backend_feature[feature].add(BACKEND)

UNGATED_VARIABLE = "COLLECTIVES_TORCH_SUITE_UNGATED"
if __name__ == "__main__" and "--ungated" in sys.argv:
    sys.argv.remove("--ungated")
    os.environ[UNGATED_VARIABLE] = "1"

# The reasons torch gives for skipping a test by the backend's name alone
# (a prefix where the reason goes on to list the backends).
NAME_GATES = (
    f"Test requires backend {BACKEND} to be one of ",           # require_backend_is_available({...})
    "Only gloo backend supports timeouts",                       # BACKEND != "gloo"
    "get_future is only supported on mpi, nccl and gloo",
    "GLOO Batch Send Recv CPU",
    "Only Gloo backend supports sparse all reduce",
    "Only Nccl & Gloo backend support DistributedDataParallel",
)
LIFTED = {}   # test name -> the name gates lifted from it


def _lift_name_gates():
    """Make torch's skip decorators leave out the NAME_GATES skips; before
    torch's test module is imported, whose decorators run then."""
    from torch.testing._internal import common_utils
    skip_if, skip = common_utils.skip_but_pass_in_sandcastle_if, common_utils.skip_but_pass_in_sandcastle

    def name_gate(reason):
        return any(reason == gate or (gate.endswith(" ") and reason.startswith(gate)) for gate in NAME_GATES)

    def lifted(reason):
        def keep(test):
            LIFTED.setdefault(test.__name__, []).append(reason)
            return test
        return keep

    common_utils.skip_but_pass_in_sandcastle_if = \
        lambda condition, reason: lifted(reason) if condition and name_gate(reason) else skip_if(condition, reason)
    common_utils.skip_but_pass_in_sandcastle = lambda reason: lifted(reason) if name_gate(reason) else skip(reason)


# This file is imported twice in a process (as __main__, then by pytest or a spawned rank's unpickling by its
# name): the first import lifts the gates, before torch's test module, which the second finds imported.
TORCH_TESTS = "torch.testing._internal.distributed.distributed_test"
if os.environ.get(UNGATED_VARIABLE) == "1":
    if TORCH_TESTS not in sys.modules:
        _lift_name_gates()
    assert getattr(sys.modules.get(TORCH_TESTS), "name_gates_lifted", True), f"{TORCH_TESTS} came first"

from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402

if os.environ.get(UNGATED_VARIABLE) == "1":
    sys.modules[TORCH_TESTS].name_gates_lifted = True


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()


def _ungated(test):
    """`test` without its skip mark (which is on the function itself: a wrapper that copied its
    attributes, as functools.wraps does, would carry it)."""
    def run(self):
        return test(self)
    run.__name__ = run.__qualname__ = test.__name__
    return run


for _name in dir(DistributedTest._DistTestBase):
    _test = getattr(DistributedTest._DistTestBase, _name)
    if getattr(_test, "__unittest_skip_why__", "").startswith("Only MPI supports"):
        setattr(TestDistBackendWithSpawn, _name, _ungated(_test))


def main(argv):
    import pytest
    # tests/conftest.py, which pytest loads, imports the repository's bench package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if argv[:1] == ["--list"]:
        for name, reasons in sorted(LIFTED.items()):
            test = getattr(TestDistBackendWithSpawn, name, None)
            if test is None or not name.startswith("test_") or any(word in name for word in ("cuda", "gpu", "nccl")):
                continue
            left = getattr(test, "__unittest_skip_why__", "") if getattr(test, "__unittest_skip__", False) else ""
            print(f"{name}\t{' | '.join(reasons)}\t{left}")
        return 0
    # -n 0: each test already runs 3 ranks, more than the 2 cores of CI; -p no:cacheprovider: no .pytest_cache
    return pytest.main([__file__, "-n", "0", "-p", "no:cacheprovider", "-q", "-rfE", "-k", DESELECTED, *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
