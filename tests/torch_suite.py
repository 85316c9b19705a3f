"""PyTorch's own torch.distributed suite on our backend "collectives":
torch's DistributedTest._DistTestBase, the tests that PyTorch's
test/distributed/test_distributed_spawn.py runs for Gloo and NCCL, each
test on 3 CPU ranks spawned as processes.

    .venv/bin/python tests/torch_suite.py                 # the whole suite: ~17 min on 2 cores
    .venv/bin/python tests/torch_suite.py -k all_to_all   # pytest's arguments (-k replaces the default)

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
import torch  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False   # as test_distributed_spawn.py

import collectives.torch  # noqa: E402,F401  (registers the backend, in the spawned ranks too)
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

BACKEND = os.environ["BACKEND"]
DESELECTED = "not cuda and not gpu and not nccl"

# before torch's test module is imported: its decorators read the sets when it is
for feature in ("ddp", "subgroup", "plugin"):
    DistTestCases.backend_feature[feature].add(BACKEND)

from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402


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
    # -n 0: each test already runs 3 ranks, more than the 2 cores of CI; -p no:cacheprovider: no .pytest_cache
    return pytest.main([__file__, "-n", "0", "-p", "no:cacheprovider", "-q", "-rfE", "-k", DESELECTED, *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
