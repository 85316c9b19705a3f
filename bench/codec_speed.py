"""Speed of the codecs: their CPU loops on one core, or their kernels on a device against a device copy.

    python -m bench.codec_speed [--mib 64] [--repeat 7] [--codecs fp16,int8] [--ops encode,decode]
    python -m bench.codec_speed --device cuda [--mib 256] [-J out.json]

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

With --device cuda (or emulated), each operation is the codec kernel of
kernels/codec.cu through the device's launch_codec, two more are what
compressed allreduces of 4 ranks launch (they are not CPU loops):

    batch4:decode_add+encode    four ring hops of a quarter of the elements
                                each, as one codec_batch launch
    round_sum4                  codec_round_sum: 4 inputs rounded and summed
                                into 4 outputs (direct, ranks on one GPU)

and what is reported is
bytes read plus written per second, beside a device-to-device copy moving
as many bytes (half read, half written), the two alternating in one run:
the floor a kernel that reads and writes each byte once can reach. The
codec kernels are built to reach 0.8 of it. On emulated devices the
numbers say nothing of a GPU; the mode runs there so CI checks it.
"""

import inspect
import sys

import numpy as np

from bench import cli
from bench.harness import DeviceTimer, seconds_per_call, upload
from collectives.compression import kernels
from collectives.compression.wire import Region

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
            best[key] = min(best[key], seconds_per_call(call, 1))
    return {key: 4 * n / seconds / 1e9 for key, seconds in best.items()}


# -- the kernels on a device ---------------------------------------------------------

# per operation: (kernel, which regions it takes, divisor); names as in _calls
DEVICE_OPS = {
    "encode": ("encode", ("x", "out_payload", "out_scales")),
    "encode+round": ("encode_round", ("rounded", "out_payload", "out_scales")),
    "decode": ("decode", ("payload", "scales", "out")),
    "decode_add": ("decode_add", ("acc", "payload", "scales", "out", None, None)),
    "decode_add+encode": ("decode_add", ("acc", "payload", "scales", "out", "out_payload", "out_scales")),
    "decode_add+encode-nowrite": ("decode_add", ("acc", "payload", "scales", None, "out_payload", "out_scales")),
    "add+encode": ("add", ("acc", "x", "out", "out_payload", "out_scales")),
}


# Device-only operations: what a 4-rank compressed allreduce launches.
BATCH4, ROUND_SUM4 = "batch4:decode_add+encode", "round_sum4"
DEVICE_ONLY_OPS = (BATCH4, ROUND_SUM4)


def _quarters(region):
    """`region` cut into 4 regions of a quarter of its elements each."""
    quarter = region.count // 4
    size = np.dtype(region.dtype).itemsize
    return [Region(region.address + k * quarter * size, quarter, region.dtype) for k in range(4)]


def _device_only_op(op, device, kind, codec, buffers, n, rng, stream):
    """(run once, bytes read plus written) for BATCH4 or ROUND_SUM4."""
    if op == BATCH4:   # the rows a ring hop of 4 ranks gives each: n/4 elements, block aligned
        names = DEVICE_OPS["decode_add+encode"][1]
        quarters = [_quarters(buffers[name][1]) if name != "scales" and name != "out_scales" else None
                    for name in names]
        rows = []
        for k in range(4):
            regions = []
            for name, parts in zip(names, quarters):
                if parts is not None:
                    regions.append(parts[k])
                else:   # scale bytes: a quarter's blocks
                    whole = buffers[name][1]
                    blocks = whole.count // 4
                    regions.append(Region(whole.address + k * blocks, blocks, whole.dtype))
            rows.append(kernels.device_row("decode_add", codec, tuple(regions), 0))
        moved = bytes_moved(tuple(buffers[name][1] for name in names), "decode_add")
        return (lambda: device.launch_codec_batch(stream, codec, rows)), moved
    assert op == ROUND_SUM4
    memory = [device.allocate(4 * n) for _ in range(8)]
    for m in memory[:4]:
        upload(kind, m, rng.standard_normal(n).astype(np.float32))
    inputs, outputs = [m.address for m in memory[:4]], [m.address for m in memory[4:]]
    buffers["round_sum"] = (memory, None)   # kept alive with the other buffers
    return (lambda: device.launch_codec_round_sum(stream, codec, inputs, outputs, n, 0)), 8 * 4 * n


def device_buffers(device, kind, codec, n, rng):
    """{name: (device memory, Region)} for every operand, filled as _calls fills its arrays."""
    x = rng.standard_normal(n).astype(np.float32)
    payload, scales = np.empty(n, kernels.payload_dtype(codec)), np.empty(kernels.wire_nbytes(codec, n)[1], np.uint8)
    kernels.cpu_encode(codec, x, payload, scales)
    host = {"x": x, "rounded": x.copy(), "acc": rng.standard_normal(n).astype(np.float32),
            "out": np.zeros(n, np.float32), "payload": payload, "scales": scales,
            "out_payload": np.zeros_like(payload), "out_scales": np.zeros_like(scales)}
    buffers = {}
    for name, values in host.items():
        memory = device.allocate(max(values.nbytes, 16))
        upload(kind, memory, values)
        buffers[name] = (memory, Region(memory.address, values.size, values.dtype.name))
    return buffers


def bytes_moved(regions, kernel):
    """Bytes an operation reads plus writes: each region once (encode_round
    reads and writes x)."""
    total = sum(r.count * np.dtype(r.dtype).itemsize for r in regions if r is not None)
    return total + (regions[0].count * 4 if kernel == "encode_round" else 0)


def measure_device(kind, codecs, ops, mib, repeat, rounds=3):
    """Per codec and operation: the kernel's and a same-bytes device copy's
    GB/s (read plus written), best of `rounds` alternating batches."""
    from collectives.devices import open_device
    device = open_device("cuda:0" if kind == "cuda" else "emulated:0")
    timer = DeviceTimer(kind, device)
    n = (mib << 20) // 4 // kernels.BLOCK * kernels.BLOCK
    rng = np.random.default_rng(0)
    rows = []
    for codec in codecs:
        buffers = device_buffers(device, kind, codec, n, rng)
        copy_from, copy_to = device.allocate(16 * n), device.allocate(16 * n)   # room for the largest operation's bytes
        stream = device.current_stream()
        for op in ops:
            if op in DEVICE_ONLY_OPS:
                run_codec, moved = _device_only_op(op, device, kind, codec, buffers, n, rng, stream)
            else:
                kernel, names = DEVICE_OPS[op]
                regions = tuple(None if name is None else buffers[name][1] for name in names)
                moved = bytes_moved(regions, kernel)

                def run_codec(kernel=kernel, regions=regions):
                    device.launch_codec(stream, kernel, codec, regions, 0)
            half = moved // 2
            src = Region(copy_from.address, half, "uint8")
            dst = Region(copy_to.address, half, "uint8")

            def run_copy(src=src, dst=dst):
                device.launch_codec(stream, "copy", codec, (dst, src), 0)

            codec_s, copy_s = [], []
            for _ in range(rounds):   # alternating, so the machine's noise hits both alike
                codec_s.append(timer.seconds(run_codec, repeat))
                copy_s.append(timer.seconds(run_copy, repeat))
            codec_gbps, copy_gbps = moved / min(codec_s) / 1e9, 2 * half / min(copy_s) / 1e9
            rows.append({"codec": codec, "op": op, "elements": n, "bytes_moved": moved,
                         "codec_us": min(codec_s) * 1e6, "codec_GBps": codec_gbps,
                         "copy_us": min(copy_s) * 1e6, "copy_GBps": copy_gbps, "codec_vs_copy": codec_gbps / copy_gbps})
    return rows


def main(argv=None):
    parser = cli.Parser(prog="python -m bench.codec_speed", description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="MiB of float32 per operand (default 64)")
    parser.add_argument("--repeat", type=int, default=7, help="runs per measurement, the best counts (default 7)")
    parser.add_argument("--codecs", default=",".join(kernels.CODECS), help="codecs to time, comma-separated")
    parser.add_argument("--ops", default="", help="codec operations to time, comma-separated (default: all; "
                        f"on a device also {', '.join(DEVICE_ONLY_OPS)})")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "emulated"],
                        help="cpu: the C++ loops on one core; cuda or emulated: the codec kernels against a device copy")
    parser.add_argument("-J", "--output_file", help="write the results as JSON here (device modes; default: no file)")
    args = parser.parse_args(argv)
    known_ops = OPS + DEVICE_ONLY_OPS if args.device != "cpu" else OPS
    codecs = cli.names(parser, "--codecs", args.codecs, kernels.CODECS)
    ops = cli.names(parser, "--ops", args.ops or ",".join(known_ops), known_ops)
    if args.device != "cpu":
        cli.require_device_toolchain(parser.prog, args.device)
        return report_device(args, codecs, ops, argv)
    results = measure(codecs, ops, args.mib, args.repeat)
    width = max(map(len, ops + ["operation"])) + 2
    print(f"float32 GB/s, one core, {args.mib} MiB, best of {args.repeat}")
    print(f"{'operation':<{width}}" + "".join(f"{codec:>8}" for codec in codecs))
    for op in ops:
        cells = [f"{results[codec, op]:8.2f}" if (codec, op) in results else f"{'-':>8}" for codec in codecs]
        print(f"{op:<{width}}" + "".join(cells))



def report_device(args, codecs, ops, argv=None):
    rows = measure_device(args.device, codecs, ops, args.mib, args.repeat)
    print(f"# codec kernels on {args.device}, {args.mib} MiB of float32 per operand; GB/s = bytes read + written "
          "per second; the copy moves as many bytes")
    print(f"# {'codec':6s} {'operation':28s} {'kernel us':>10s} {'GB/s':>8s} {'copy GB/s':>10s} {'ratio':>6s}")
    for r in rows:
        print(f"  {r['codec']:6s} {r['op']:28s} {r['codec_us']:10.1f} {r['codec_GBps']:8.1f} {r['copy_GBps']:10.1f} "
              f"{r['codec_vs_copy']:6.2f}")
    if args.output_file:
        from bench.environment import command_line, device_environment, git_commit
        environment = device_environment(args.device)
        environment["git_commit"] = git_commit()
        environment["command"] = command_line("bench.codec_speed", sys.argv[1:] if argv is None else argv)
        cli.write_json(args.output_file, {"environment": environment, "rows": rows}, say=None)
    return 0


if __name__ == "__main__":
    main()
