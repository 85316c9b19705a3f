"""nccl-tests style benchmarks: python -m bench.all_reduce_perf --help"""
