"""Reduce bandwidth sweep, nccl-tests compatible: python -m bench.reduce_perf -h
(the harness's sweep of REDUCE, bench/specs.py: its inputs, checks and calls)."""

import sys

from bench.harness import main
from bench.specs import REDUCE

if __name__ == "__main__":
    sys.exit(main(REDUCE))
