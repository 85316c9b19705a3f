"""Error of compressed allreduce against a float64 reference, with its bound.

    python -m bench.compression_error [--ranks 8] [--count 1M] [--seed 0] [-J FILE]

For each codec and allreduce algorithm, on `--ranks` ranks in this process
holding standard-normal gradients scaled to 1e-8, 1 and 1e5, and mixed
magnitudes (1e-8 to 1e5 within one array), prints the normwise error
||y - s|| / ||s||, the largest elementwise error as a fraction of P_i (the
sum over ranks of |x_i|), and the largest ratio of the error to the
documented bound (collectives.compression.wire.error_bound, README "Error
bounds"; at most 1), beside q, the most encodings any element went through.
"""

import sys

import numpy as np

import collectives
from bench import cli
from bench.environment import environment
from collectives.algorithms import REGISTRY
from collectives.compression import wire
from collectives.compression.kernels import CODECS
from collectives.plan import build_plan

MAGNITUDES = ("1e-8", "1", "1e5", "mixed")
ALLREDUCE_ALGORITHMS = [name for name, algorithm in REGISTRY.items() if "allreduce" in algorithm.collectives]


def gradients(nranks, count, magnitude, seed):
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((nranks, count))
    values *= 10.0 ** rng.uniform(-8, 5, size=(1, count)) if magnitude == "mixed" else float(magnitude)
    return values.astype(np.float32)


def main(argv=None):
    p = cli.Parser(prog="python -m bench.compression_error", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=8, help="virtual ranks in this process")
    p.add_argument("--count", default="1M", type=cli.size, help="float32 elements per rank (suffixes K, M)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random gradients")
    p.add_argument("--algorithms", default=",".join(ALLREDUCE_ALGORITHMS),
                   help="allreduce algorithms, comma-separated")
    p.add_argument("-J", "--output_file", help="write the results as JSON here (default: no file)")
    args = p.parse_args(argv)
    count = cli.parse_size(args.count)
    algorithms = cli.names(p, "--algorithms", args.algorithms, ALLREDUCE_ALGORITHMS)
    comm = collectives.Communicator.local(args.ranks)
    rows = []
    print(f"# compressed allreduce (sum) of {count} float32 on {args.ranks} ranks; error against float64")
    print(f"# {'codec':>5s} {'algorithm':>17s} {'q':>2s} {'magnitude':>9s} {'norm error':>11s} "
          f"{'max err/P':>10s} {'max err/bound':>13s}")
    for codec in CODECS:
        for algorithm in algorithms:
            plan = build_plan("allreduce", algorithm, args.ranks, count, np.dtype(np.float32), "sum",
                              compression=codec)
            q = wire.quantizations(plan)
            for magnitude in MAGNITUDES:
                inputs = gradients(args.ranks, count, magnitude, args.seed)
                exact = np.sum(inputs.astype(np.float64), axis=0)
                result = comm.allreduce([x.copy() for x in inputs], algorithm=algorithm, compression=codec)[0]
                error = np.abs(result.astype(np.float64) - exact)
                magnitudes = np.sum(np.abs(inputs.astype(np.float64)), axis=0)
                bound = wire.error_bound(inputs, codec, q)
                row = {"codec": codec, "algorithm": algorithm, "ranks": args.ranks, "q": q, "magnitude": magnitude,
                       "norm_error": float(np.linalg.norm(error) / np.linalg.norm(exact)),
                       "max_error_over_P": float(np.max(error / np.where(magnitudes > 0, magnitudes, 1))),
                       "max_error_over_bound": float(np.max(error / bound))}
                rows.append(row)
                print(f"  {codec:>5s} {algorithm:>17s} {q:2d} {magnitude:>9s} {row['norm_error']:11.3e} "
                      f"{row['max_error_over_P']:10.3e} {row['max_error_over_bound']:13.3f}")
    if args.output_file:
        report = {"benchmark": "compression_error", "count": count, "seed": args.seed,
                  "environment": environment("host", args.ranks, ["ours"]),
                  "rows": rows}
        cli.write_json(args.output_file, report)
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
