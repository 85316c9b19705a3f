"""Allreduce bandwidth sweep, nccl-tests compatible: python -m bench.all_reduce_perf -h
(the harness's sweep of ALLREDUCE, bench/specs.py: its inputs, checks and calls)."""

import sys

from bench.harness import main
from bench.specs import ALLREDUCE

if __name__ == "__main__":
    sys.exit(main(ALLREDUCE))
