"""Allgather bandwidth sweep, nccl-tests compatible: python -m bench.all_gather_perf -h
(the harness's sweep of ALLGATHER, bench/specs.py: its inputs, checks and calls)."""

import sys

from bench.harness import main
from bench.specs import ALLGATHER

if __name__ == "__main__":
    sys.exit(main(ALLGATHER))
