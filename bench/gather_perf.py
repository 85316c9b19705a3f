"""Gather bandwidth sweep, nccl-tests compatible: python -m bench.gather_perf -h
(the harness's sweep of GATHER, bench/specs.py: its inputs, checks and calls)."""

import sys

from bench.harness import main
from bench.specs import GATHER

if __name__ == "__main__":
    sys.exit(main(GATHER))
