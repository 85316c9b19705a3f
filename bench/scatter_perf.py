"""Scatter bandwidth sweep, nccl-tests compatible: python -m bench.scatter_perf -h
(the harness's sweep of SCATTER, bench/specs.py: its inputs, checks and calls)."""

import sys

from bench.harness import main
from bench.specs import SCATTER

if __name__ == "__main__":
    sys.exit(main(SCATTER))
