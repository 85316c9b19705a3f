"""Rarer cyclic garbage collections, for the test processes that load
PyTorch or TensorFlow: each worker calls collect_rarely() before it imports
them, and the pytest workers do (conftest.py).

CPython collects its youngest generation every 700 net allocations of
container objects, and the older ones every 10th time. `import tensorflow`
leaves about a million objects behind, and tracing tf.functions makes and
drops many more, so each collection has a lot to walk: the three ranks of
tensorflow_worker.py's `ops` (test_every_op_on_three_processes_against_numpy)
spent 7 of their 17.5 CPU-s in the collector, and 0.3 of 10.7 with the
thresholds below (2-core machine). Cycles are still collected, only later.
"""

import gc

# Youngest generation every 50,000 net allocations (not 700); the middle one
# every 20th of those, the oldest every 100th of the middle one's.
THRESHOLDS = (50_000, 20, 100)


def collect_rarely():
    gc.set_threshold(*THRESHOLDS)
