"""All_to_all bandwidth sweep, nccl-tests compatible: python -m bench.alltoall_perf -h
(the harness's sweep of ALL_TO_ALL, bench/specs.py: its inputs, checks and calls)."""

import sys

from bench.harness import main
from bench.specs import ALL_TO_ALL

if __name__ == "__main__":
    sys.exit(main(ALL_TO_ALL))
