"""Half-precision allreduce accuracy: our algorithms against NCCL's ring order.

    python -m bench.half_precision_error [--ranks 8] [--count 1M] [--seed 0] [--trials 3]
                                         [--emulated all|none|ring,direct] [-J PATH]

For float16 and bfloat16, `--ranks` ranks hold random inputs and sum them
with every allreduce algorithm of this library (host ranks, and the same
algorithms on emulated devices, where our CUDA step kernel computes), and
with three references computed here in NumPy:

    nccl_ring     NCCL's ring order: chunk c starts at rank c+1 and travels
                  the ring; each hop adds its rank's value to the incoming
                  16-bit partial sum in float32 and rounds the sum to 16 bits
                  before sending it on (one rounding per hop, n-1 in all).
    fp32_once     float32 accumulation over all ranks, one final rounding:
                  the best a 16-bit output can get from a float32 adder.
    correctly_rounded   the float64 sum rounded once to 16 bits (the floor,
                  at most 1/2 ulp).

Errors are measured against the float64 sum of the 16-bit inputs, which
`reference` checks is exact (it is for these inputs: eight 16-bit values
whose exponents span far less than float64's 53 bits). Reported per
(dtype, distribution, method):

    norm_rel      ||y - ref||_2 / ||ref||_2, per trial (max and mean over trials)
    max_ulp       max over elements of |y - ref| / ulp(ref), the spacing of
                  the output dtype at |ref| (subnormal spacing below the
                  normal range), over the elements whose ref is not 0
    mean_ulp      the mean of the same
    zero_ref_wrong    elements whose exact sum is 0 (the inputs cancel
                  exactly) and whose result is not 0: infinitely many ulps
    not_rn        the fraction of elements farther from ref than the
                  correctly rounded value is
    max_ulp_abs_sum, mean_ulp_abs_sum
                  |y - ref| / ulp(sum_i |x_i|): the error against the
                  scale summation bounds use (gamma_k sum |x_i|). ulp(ref)
                  explodes where the inputs cancel (ref near or at 0, while
                  the partial sums were rounded at the inputs' magnitude);
                  this one does not

What our code does is read from the schedules: `fold_expressions` takes each
algorithm's symbolic trace (which rank's value is added to which, in what
order, transfer by transfer) and `evaluate` computes it under the two
rounding rules one could mean:

    per_transfer  each transfer (a REDUCE row) sums all its sources in float32
                  and rounds to 16 bits once: what executors/host.py and
                  kernels/plan_step.cu do (the issue's "accumulates in float32
                  within each transfer and rounds once per transfer")
    per_add       every binary add computes in float32 and rounds to 16 bits,
                  as a 16-bit accumulator does (and NCCL at each ring hop):
                  what both did before, kept here as the comparison

The two differ only for transfers of more than two sources (direct, star,
two_shot fold every rank in one transfer, in rank order: per_transfer is
then fp32_once). The `matches` column says which of the two reproduces our
library's bits; per_add_model:ALGORITHM rows measure the per-add rounding
where it differs from ours.
"""

import argparse
import sys
import time

import ml_dtypes
import numpy as np

import collectives
from collectives.algorithms import REGISTRY, schedule_for
from collectives.algorithms.schedule import ALLREDUCE, Region
from collectives.plan import chunk_bounds
from bench import cli
from bench.environment import command_line

DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}

DISTRIBUTIONS = {
    "normal": "standard normal (random signs, partial sums of size ~sqrt(k))",
    "uniform_positive": "uniform on [0, 1): all positive, partial sums grow to ~n/2",
    "mixed_magnitude": "random sign x 10^U(-3, 2): five decades of magnitude, with cancellation",
}

ALLREDUCE_ALGORITHMS = tuple(name for name, spec in REGISTRY.items() if ALLREDUCE in spec.collectives)

NCCL_RING, FP32_ONCE, CORRECTLY_ROUNDED = "nccl_ring", "fp32_once", "correctly_rounded"
REFERENCES = (NCCL_RING, FP32_ONCE, CORRECTLY_ROUNDED)
PER_ADD, PER_TRANSFER = "per_add", "per_transfer"



# -- inputs and the float64 reference --------------------------------------------


def make_inputs(distribution, nranks, count, rng):
    """Per rank, `count` float64 values of the distribution (cast them to the
    dtype under test; the same draws serve every dtype)."""
    if distribution == "normal":
        return rng.standard_normal((nranks, count))
    if distribution == "uniform_positive":
        return rng.random((nranks, count))
    if distribution == "mixed_magnitude":
        sign = np.where(rng.random((nranks, count)) < 0.5, -1.0, 1.0)
        return sign * 10.0 ** rng.uniform(-3.0, 2.0, (nranks, count))
    raise ValueError(f"unknown distribution {distribution!r}; expected one of {', '.join(DISTRIBUTIONS)}")


def reference(xs):
    """The float64 sum of the ranks' 16-bit values, checked exact: every
    float64 add's rounding error (Knuth's TwoSum) must be zero, or this
    raises (the inputs would need a wider reference)."""
    total = np.zeros(xs[0].shape, np.float64)
    for x in xs:
        a, b = total, x.astype(np.float64)
        total = a + b
        b_part = total - a
        error = (a - (total - b_part)) + (b - b_part)
        if np.any(error != 0):
            raise ValueError(f"the float64 sum is inexact at {np.count_nonzero(error)} elements")
    return total


def ulp(values, dtype):
    """The spacing of `dtype` at |values| (float64): 2^(floor(log2|v|) - mantissa
    bits), never below the subnormal spacing."""
    info = ml_dtypes.finfo(dtype)
    _, exponent = np.frexp(np.abs(values))          # |v| = m 2^e, m in [0.5, 1); 0 gives e = 0
    exponent = np.where(values == 0, info.minexp, np.maximum(exponent - 1, info.minexp))
    return np.ldexp(1.0, exponent - info.nmant)


def round_to(values, dtype):
    """float64 `values` rounded once, to nearest even, to `dtype`.

    Not `values.astype(bfloat16)`: ml_dtypes casts float64 to bfloat16 through
    float32, rounding twice (1 + 2^-8 + 2^-30 becomes 1, not 1 + 2^-7)."""
    spacing = ulp(values, dtype)
    rounded = np.rint(values / spacing) * spacing    # exact: spacing is a power of two
    return rounded.astype(dtype)                     # representable, so exact (overflow aside)


def errors(y, ref, dtype, abs_sum=None):
    """The error measures of one result `y` against float64 `ref`; `abs_sum`
    (the float64 sum of the inputs' magnitudes, what summation error bounds
    scale with) adds the *_ulp_abs_sum measures."""
    diff = np.abs(y.astype(np.float64) - ref)
    rn_diff = np.abs(round_to(ref, dtype).astype(np.float64) - ref)
    nonzero = ref != 0
    in_ulps = diff[nonzero] / ulp(ref[nonzero], dtype)
    norm = float(np.linalg.norm(ref))
    out = {
        "norm_rel": float(np.linalg.norm(diff)) / norm if norm else float(np.linalg.norm(diff)),
        "max_ulp": float(in_ulps.max()) if in_ulps.size else 0.0,
        "mean_ulp": float(in_ulps.mean()) if in_ulps.size else 0.0,
        "zero_ref_wrong": int(np.count_nonzero(diff[~nonzero])),
        "not_rn": float(np.mean(diff > rn_diff)) if diff.size else 0.0,
    }
    if abs_sum is not None:
        scaled = diff / ulp(abs_sum, dtype)
        out["max_ulp_abs_sum"] = float(scaled.max()) if diff.size else 0.0
        out["mean_ulp_abs_sum"] = float(scaled.mean()) if diff.size else 0.0
    return out


# -- the orders, computed here ------------------------------------------------------


def _add_rounded(acc, x, dtype):
    """One hop: float32 add, one rounding to the 16-bit dtype (RNE)."""
    return (acc.astype(np.float32) + x.astype(np.float32)).astype(dtype)


def ring_bounds(nranks, count, dtype):
    """The chunk bounds our ring uses (n chunks, 16-byte aligned starts)."""
    return chunk_bounds(ALLREDUCE, nranks, nranks, count, np.dtype(dtype).itemsize)


def nccl_ring(xs, bounds=None):
    """NCCL's ring order: chunk c starts at rank c+1, and each hop adds its own
    value to the incoming partial sum in float32, rounding the sum to the
    16-bit type before sending it on (NCCL's FuncSum on half/bfloat16 is
    __hadd2: one correctly rounded 16-bit add per hop).

    `bounds` places the chunks (default: our ring's). NCCL itself cuts the
    buffer per channel and per loop of nranks x chunkSize elements, which
    changes which rank starts a given element, not how many roundings it
    takes or in what kind of order (a chain of n-1)."""
    n, dtype = len(xs), xs[0].dtype
    if bounds is None:
        bounds = ring_bounds(n, xs[0].size, dtype)
    out = np.empty_like(xs[0])
    for c, (lo, hi) in enumerate(bounds):
        acc = xs[(c + 1) % n][lo:hi]
        for hop in range(2, n + 1):
            acc = _add_rounded(acc, xs[(c + hop) % n][lo:hi], dtype)
        out[lo:hi] = acc
    return out


def fp32_once(xs):
    """float32 accumulation over all ranks in rank order, one final rounding."""
    acc = np.zeros(xs[0].shape, np.float32)
    for x in xs:
        acc += x.astype(np.float32)
    return acc.astype(xs[0].dtype)


def fold_expressions(algorithm, nranks):
    """Per chunk, the expression our allreduce computes: an int is that
    rank's input, a tuple the left fold of its members (one transfer).
    Every rank's result has the same expression (checked here)."""
    schedule = schedule_for(algorithm, ALLREDUCE, nranks)
    if nranks == 1:
        return 1, (0,)
    final = schedule.trace().final
    exprs = tuple(final[Region(0, schedule.result_buffer, c)] for c in range(schedule.nchunks))
    for r in range(nranks):
        for c in range(schedule.nchunks):
            assert final[Region(r, schedule.result_buffer, c)] == exprs[c], (algorithm, r, c)
    return schedule.nchunks, exprs


def _evaluate(expr, xs, lo, hi, rounding):
    if isinstance(expr, int):
        return xs[expr][lo:hi]
    dtype = xs[0].dtype
    members = [_evaluate(m, xs, lo, hi, rounding) for m in expr]
    if rounding == PER_ADD:
        acc = members[0]
        for m in members[1:]:
            acc = _add_rounded(acc, m, dtype)
        return acc
    if rounding == PER_TRANSFER:
        acc = members[0].astype(np.float32)
        for m in members[1:]:
            acc = acc + m.astype(np.float32)
        return acc.astype(dtype)
    raise ValueError(f"unknown rounding {rounding!r}")


def evaluate(algorithm, xs, rounding):
    """`algorithm`'s allreduce of `xs` computed here, under `rounding`."""
    nchunks, exprs = fold_expressions(algorithm, len(xs))
    bounds = chunk_bounds(ALLREDUCE, len(xs), nchunks, xs[0].size, xs[0].dtype.itemsize)
    out = np.empty_like(xs[0])
    for expr, (lo, hi) in zip(exprs, bounds):
        out[lo:hi] = _evaluate(expr, xs, lo, hi, rounding)
    return out


def describe(expr):
    """An expression as text: (1+2)+3 ..."""
    if isinstance(expr, int):
        return str(expr)
    inner = "+".join(describe(m) for m in expr)
    return f"({inner})"


def _chain(expr, rounding):
    """The most roundings any one input goes through on its way to the result."""
    if isinstance(expr, int):
        return 0
    depths = [_chain(m, rounding) for m in expr]
    if rounding == PER_TRANSFER:
        return 1 + max(depths)
    d = depths[0]
    for m in depths[1:]:
        d = max(d, m) + 1
    return d


def _roundings(expr, rounding):
    """How many roundings produce one output element."""
    if isinstance(expr, int):
        return 0
    own = len(expr) - 1 if rounding == PER_ADD else 1
    return own + sum(_roundings(m, rounding) for m in expr)


def rounding_summary(algorithm, nranks):
    """What rounding each output element of `algorithm` goes through."""
    _, exprs = fold_expressions(algorithm, nranks)
    expr = exprs[0]
    return {
        "order_chunk0": describe(expr),
        "sources_per_transfer": sorted({len(e) for e in _transfers(expr)}),
        "roundings_per_element": {PER_ADD: _roundings(expr, PER_ADD), PER_TRANSFER: _roundings(expr, PER_TRANSFER)},
        "longest_rounding_chain": {PER_ADD: _chain(expr, PER_ADD), PER_TRANSFER: _chain(expr, PER_TRANSFER)},
    }


def _transfers(expr):
    if isinstance(expr, int):
        return []
    return [expr] + [t for m in expr for t in _transfers(m)]


# -- ours ---------------------------------------------------------------------------


def ours(comm, xs, algorithm):
    """Our allreduce of copies of `xs`; checks every rank got the same bits."""
    results = comm.allreduce([x.copy() for x in xs], algorithm=algorithm)
    comm.synchronize()
    results = [np.asarray(r) for r in results]
    bits = results[0].view(np.uint16)
    for r, res in enumerate(results[1:], 1):
        if not np.array_equal(res.view(np.uint16), bits):
            raise AssertionError(f"{algorithm}: rank {r}'s result differs from rank 0's")
    return results[0]


def same_bits(a, b):
    return bool(np.array_equal(a.view(np.uint16), b.view(np.uint16)))


# -- the measurement ------------------------------------------------------------------


def measure(nranks, count, seed, trials, algorithms=ALLREDUCE_ALGORITHMS, emulated=ALLREDUCE_ALGORITHMS,
            dtypes=tuple(DTYPES), distributions=tuple(DISTRIBUTIONS), progress=None):
    """Rows of error measures, one per (dtype, distribution, method)."""
    stats = {}   # (dtype, distribution, method) -> list of per-trial error dicts, and flags

    def record(key, y, ref, dtype, abs_sum, **flags):
        entry = stats.setdefault(key, {"trials": [], "flags": {}})
        entry["trials"].append(errors(y, ref, dtype, abs_sum))
        for name, value in flags.items():
            entry["flags"][name] = entry["flags"].get(name, True) and value

    host = collectives.Communicator.local(nranks)
    device = collectives.Communicator.local(nranks, devices="emulated") if emulated else None
    try:
        for trial in range(trials):
            rng = np.random.default_rng([seed, trial])
            draws = {d: make_inputs(d, nranks, count, rng) for d in distributions}
            for dtype_name in dtypes:
                dtype = DTYPES[dtype_name]
                for dist in distributions:
                    xs = [row.astype(dtype) for row in draws[dist]]
                    ref = reference(xs)
                    abs_sum = np.sum(np.abs(np.stack(xs).astype(np.float64)), axis=0)
                    rn = round_to(ref, dtype)
                    record((dtype_name, dist, CORRECTLY_ROUNDED), rn, ref, dtype, abs_sum)
                    once = fp32_once(xs)
                    record((dtype_name, dist, FP32_ONCE), once, ref, dtype, abs_sum)
                    nccl = nccl_ring(xs)
                    record((dtype_name, dist, NCCL_RING), nccl, ref, dtype, abs_sum)
                    for algorithm in algorithms:
                        y = ours(host, xs, algorithm)
                        per_add = evaluate(algorithm, xs, PER_ADD)
                        per_transfer = evaluate(algorithm, xs, PER_TRANSFER)
                        flags = {"matches_per_add": same_bits(y, per_add),
                                 "matches_per_transfer": same_bits(y, per_transfer),
                                 "equals_nccl_ring": same_bits(y, nccl),
                                 "equals_fp32_once": same_bits(y, once)}
                        if device is not None and algorithm in emulated:
                            flags["emulated_equals_host"] = same_bits(ours(device, xs, algorithm), y)
                        record((dtype_name, dist, f"ours:{algorithm}"), y, ref, dtype, abs_sum, **flags)
                        record((dtype_name, dist, f"per_add_model:{algorithm}"), per_add, ref, dtype, abs_sum,
                               equals_ours=same_bits(per_add, y))
                    if progress:
                        progress(f"trial {trial} {dtype_name} {dist} done")
    finally:
        host.close()
        if device is not None:
            device.close()

    rows = []
    for (dtype_name, dist, method), entry in stats.items():
        t = entry["trials"]
        rows.append({
            "dtype": dtype_name, "distribution": dist, "method": method, "trials": len(t),
            "norm_rel_max": max(e["norm_rel"] for e in t),
            "norm_rel_mean": sum(e["norm_rel"] for e in t) / len(t),
            "max_ulp": max(e["max_ulp"] for e in t),
            "mean_ulp": sum(e["mean_ulp"] for e in t) / len(t),
            "not_rn": sum(e["not_rn"] for e in t) / len(t),
            "zero_ref_wrong": sum(e["zero_ref_wrong"] for e in t),
            "max_ulp_abs_sum": max(e["max_ulp_abs_sum"] for e in t),
            "mean_ulp_abs_sum": sum(e["mean_ulp_abs_sum"] for e in t) / len(t),
            **entry["flags"],
        })
    return rows


def _matches(row):
    if "matches_per_add" not in row:
        return "-"
    names = [n for n, key in ((PER_ADD, "matches_per_add"), (PER_TRANSFER, "matches_per_transfer")) if row[key]]
    return "+".join(names) or "neither"


def print_table(rows, file=None):
    """The rows, leaving out per-add models that equal our bits (the JSON
    keeps them)."""
    file = sys.stdout if file is None else file
    print(f"# {'dtype':8s} {'distribution':16s} {'method':36s} {'matches':20s} {'norm_rel':>9s} {'norm_rel':>9s} "
          f"{'max ulp':>8s} {'mean ulp':>8s} {'max ulp':>8s} {'mean ulp':>8s} {'not RN':>7s} {'=nccl':>5s} "
          f"{'=fp32':>5s} {'emulated':>8s}", file=file)
    print(f"# {'':8s} {'':16s} {'':36s} {'':20s} {'max':>9s} {'mean':>9s} "
          f"{'at ref':>8s} {'at ref':>8s} {'@sum|x|':>8s} {'@sum|x|':>8s} {'%':>7s} {'order':>5s} {'once':>5s} "
          f"{'=host':>8s}",
          file=file)
    for r in rows:
        if r.get("equals_ours"):
            continue
        flag = lambda key: "-" if key not in r else ("yes" if r[key] else "no")  # noqa: E731
        print(f"  {r['dtype']:8s} {r['distribution']:16s} {r['method']:36s} {_matches(r):20s} "
              f"{r['norm_rel_max']:9.3e} {r['norm_rel_mean']:9.3e} {r['max_ulp']:8.4g} {r['mean_ulp']:8.4f} "
              f"{r['max_ulp_abs_sum']:8.4g} {r['mean_ulp_abs_sum']:8.4f} {100 * r['not_rn']:7.3f} "
              f"{flag('equals_nccl_ring'):>5s} {flag('equals_fp32_once'):>5s} {flag('emulated_equals_host'):>8s}",
              file=file)


def _algorithm_list(text):
    if text == "all":
        return ALLREDUCE_ALGORITHMS
    if text == "none":
        return ()
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [n for n in names if n not in ALLREDUCE_ALGORITHMS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown allreduce algorithm(s) {unknown}; "
                                         f"expected {', '.join(ALLREDUCE_ALGORITHMS)}, all or none")
    return names


def parse_args(argv=None):
    p = cli.Parser(prog="python -m bench.half_precision_error", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=8, help="virtual ranks in this process")
    p.add_argument("--count", type=cli.size, default="1M", help="elements per rank (K, M suffixes)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--trials", type=int, default=3, help="random inputs per distribution; the worst error is kept")
    p.add_argument("--algorithms", type=_algorithm_list, default=ALLREDUCE_ALGORITHMS,
                   help="our algorithms on host ranks: all, or a comma-separated list")
    p.add_argument("--emulated", type=_algorithm_list, default=ALLREDUCE_ALGORITHMS,
                   help="algorithms also run on emulated devices (our CUDA kernel on the CPU): all, none, or a list")
    p.add_argument("-J", "--output_file", "--json", dest="json", default=None,
                   help="write the results as JSON here (default: no file)")
    args = p.parse_args(argv)
    args.count = cli.parse_size(args.count)
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    emulated = tuple(a for a in args.emulated if a in args.algorithms)
    started = time.time()
    rows = measure(args.ranks, args.count, args.seed, args.trials, args.algorithms, emulated,
                   progress=lambda text: print(f"# {time.time() - started:6.1f} s  {text}", file=sys.stderr))
    print(f"# allreduce sum, {args.ranks} ranks, {args.count} elements per rank, {args.trials} trials, "
          f"seed {args.seed}; errors against the float64 sum")
    print("# matches: which rounding model reproduces our bits (per_transfer: float32 within a transfer, one "
          "rounding per transfer, what our code does; per_add: every add rounds to 16 bits, as it did before)")
    print_table(rows)
    summaries = {a: rounding_summary(a, args.ranks) for a in args.algorithms}
    print(f"# rounding per algorithm ({args.ranks} ranks): roundings per element and longest chain, "
          "per_add | per_transfer")
    for a, s in summaries.items():
        r, c = s["roundings_per_element"], s["longest_rounding_chain"]
        print(f"#   {a:16s} sources/transfer {s['sources_per_transfer']!s:8s} roundings {r[PER_ADD]}|{r[PER_TRANSFER]}"
              f"  chain {c[PER_ADD]}|{c[PER_TRANSFER]}  order {s['order_chunk0']}")
    if args.json:
        from bench.environment import environment
        env = environment("host", args.ranks, ["ours"])
        env["command"] = command_line("bench.half_precision_error", argv)
        env["devices"] = ["host", "emulated"] if emulated else ["host"]
        env["emulated_device"] = "emulated (our CUDA kernels compiled for the CPU)" if emulated else None
        env["ml_dtypes"] = ml_dtypes.__version__
        out = {
            "command": env["command"], "environment": env,
            "ranks": args.ranks, "count": args.count, "seed": args.seed, "trials": args.trials,
            "seconds": round(time.time() - started, 1),
            "distributions": {d: DISTRIBUTIONS[d] for d in DISTRIBUTIONS},
            "methods": {
                "ours:ALGORITHM": "our allreduce on host ranks (NumPy interpreter of the op tables: float32 "
                                  "within each transfer, one rounding per transfer); emulated_equals_host: the "
                                  "emulated device (plan_step.cu on the CPU) gave the same bits; "
                                  "equals_nccl_ring, equals_fp32_once: the same bits as those references",
                "per_add_model:ALGORITHM": "the algorithm's order with every add rounded to 16 bits, as a 16-bit "
                                           "accumulator does (computed here: what our code did before it "
                                           "accumulated in float32 within a transfer; equals_ours where the "
                                           "algorithm's transfers have two sources)",
                NCCL_RING: nccl_ring.__doc__.split("\n\n")[0].replace("\n    ", " "),
                FP32_ONCE: fp32_once.__doc__,
                CORRECTLY_ROUNDED: "the float64 sum rounded once",
            },
            "rounding": summaries,
            "rows": rows,
        }
        cli.write_json(args.json, out, say=lambda text: print(text, file=sys.stderr))   # stdout: the tables
    return rows


if __name__ == "__main__":
    main()
