"""Speed of the codecs' CPU loops (collectives/compression/_codec.cpp), one core.

    python -m bench.codec_speed [--mib 64] [--repeat 7] [--codecs fp16,int8] [--ops encode,decode]

For each codec and operation: float32 GB/s processed (4 bytes per element
of the float32 side, divided by the best of --repeat runs), on --mib MiB of
standard normal float32 (so the wire side of the operations is real data;
make --mib larger than the caches to measure what a collective sees). The
runs go round robin over codecs and operations. These are the loops host
ranks and emulated devices run; a compressed allreduce on host ranks pays
for them on every hop, so they must run near memory speed for compression
to win over plain float32 (a plain copy of float32 on the same core is the
yardstick: about 12 GB/s here).

    encode                      x -> payload, scales
    encode+round                the same, and x = decode(encode(x))
    decode                      payload, scales -> out
    decode_add                  out = acc + decode(payload)
    decode_add+encode           the same, then out encoded into out_payload
                                and out = its decoding (a ring hop)
    decode_add+encode-nowrite   the same with write_out=False: only the
                                encoded output is written
    add+encode                  out = acc + b, then encoded as above
"""

import inspect
import time

import numpy as np

from bench import cli
from collectives.compression import kernels

OPS = ("encode", "encode+round", "decode", "decode_add", "decode_add+encode", "decode_add+encode-nowrite",
       "add+encode")


def _calls(codec, n, rng):
    """{op: a function of no arguments that runs it once}."""
    x = rng.standard_normal(n).astype(np.float32)
    acc = rng.standard_normal(n).astype(np.float32)
    out = np.empty(n, np.float32)
    dtype = kernels.payload_dtype(codec)
    payload_bytes, scale_bytes = kernels.wire_nbytes(codec, n)
    payload, scales = np.empty(n, dtype), np.empty(scale_bytes, np.uint8)
    kernels.cpu_encode(codec, x, payload, scales)
    out_payload, out_scales = np.empty(n, dtype), np.empty(scale_bytes, np.uint8)
    rounded = x.copy()
    has_write_out = "write_out" in inspect.signature(kernels.cpu_decode_add).parameters
    calls = {
        "encode": lambda: kernels.cpu_encode(codec, x, out_payload, out_scales),
        "encode+round": lambda: kernels.cpu_encode(codec, rounded, out_payload, out_scales, round_x=True),
        "decode": lambda: kernels.cpu_decode(codec, payload, scales, out),
        "decode_add": lambda: kernels.cpu_decode_add(codec, acc, payload, scales, out),
        "decode_add+encode": lambda: kernels.cpu_decode_add(codec, acc, payload, scales, out, 0, out_payload,
                                                            out_scales),
        "add+encode": lambda: kernels.cpu_add(codec, acc, x, out, 0, out_payload, out_scales),
    }
    if has_write_out:
        calls["decode_add+encode-nowrite"] = lambda: kernels.cpu_decode_add(
            codec, acc, payload, scales, out, 0, out_payload, out_scales, write_out=False)
    return calls


def measure(codecs, ops, mib, repeat):
    """{(codec, op): float32 GB/s}, best of `repeat` runs. The runs go round
    robin over every codec and operation, so that the machine's noise hits
    all of them alike."""
    n = (mib << 20) // 4 // kernels.BLOCK * kernels.BLOCK
    rng = np.random.default_rng(0)
    calls = {}
    for codec in codecs:
        for op, call in _calls(codec, n, rng).items():
            if op in ops:
                call()                                     # compile or load, and touch every page
                calls[codec, op] = call
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeat):
        for key, call in calls.items():
            best[key] = min(best[key], _time(call))
    return {key: 4 * n / seconds / 1e9 for key, seconds in best.items()}


def _time(call):
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main(argv=None):
    parser = cli.Parser(prog="python -m bench.codec_speed", description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="MiB of float32 per operand (default 64)")
    parser.add_argument("--repeat", type=int, default=7, help="runs per measurement, the best counts (default 7)")
    parser.add_argument("--codecs", default=",".join(kernels.CODECS), help="codecs to time, comma-separated")
    parser.add_argument("--ops", default=",".join(OPS), help="codec operations to time, comma-separated")
    args = parser.parse_args(argv)
    codecs, ops = args.codecs.split(","), args.ops.split(",")
    results = measure(codecs, ops, args.mib, args.repeat)
    width = max(map(len, ops + ["operation"])) + 2
    print(f"float32 GB/s, one core, {args.mib} MiB, best of {args.repeat}")
    print(f"{'operation':<{width}}" + "".join(f"{codec:>8}" for codec in codecs))
    for op in ops:
        cells = [f"{results[codec, op]:8.2f}" if (codec, op) in results else f"{'-':>8}" for codec in codecs]
        print(f"{op:<{width}}" + "".join(cells))


if __name__ == "__main__":
    main()
