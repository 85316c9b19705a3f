"""Broadcast bandwidth sweep, nccl-tests compatible: python -m bench.broadcast_perf -h
(the harness's sweep of BROADCAST, bench/specs.py: its inputs, checks and calls)."""

import sys

from bench.harness import main
from bench.specs import BROADCAST

if __name__ == "__main__":
    sys.exit(main(BROADCAST))
