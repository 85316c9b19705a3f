"""Reduce_scatter bandwidth sweep, nccl-tests compatible: python -m bench.reduce_scatter_perf -h
(the harness's sweep of REDUCE_SCATTER, bench/specs.py: its inputs, checks and calls)."""

import sys

from bench.harness import main
from bench.specs import REDUCE_SCATTER

if __name__ == "__main__":
    sys.exit(main(REDUCE_SCATTER))
