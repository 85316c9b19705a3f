"""DDP's step time on our process group against Gloo, with and without our compression hook: examples/ddp.py.

    python -m bench.ddp_step [--nproc-per-node 4] [--runs gloo,collectives,gloo+int8] [-J FILE]
    python -m bench.ddp_step --hosts 2 --link 1gbit --nproc-per-node 2 --hidden 4096 [-J FILE]

Each run is one torchrun job of examples/ddp.py, the way a PyTorch user
trains: `init_process_group(BACKEND)`, DistributedDataParallel, SGD on
scikit-learn's digits, a 64-H-10 MLP (--hidden H), a global batch of 64.
A run is named BACKEND or BACKEND+CODEC: `gloo`, `collectives` (our
process group), `gloo+int8` (Gloo's group, DDP's buckets through
`collectives.torch.compression_hook("int8")` on a communicator of ours
beside it), `collectives+int8`, `gloo+torch-fp16` (torch's own hook), ...

The runs go in turn, --rounds times, so that the machine's load hits all
alike; the table gives, per run, the median over rounds of rank 0's time
per step (the example's own clock around zero_grad, forward, backward and
step), the final test accuracy, and whether the ranks ended bitwise equal;
and each run's median over the first run's (above 1: slower than it).

On one machine torchrun starts every process (--standalone). With
--hosts H (root), the tool makes H hosts on this machine (bench/hosts.py:
their own network, PID, IPC and mount namespaces, each link shaped to
--link), starts torchrun on each, rendezvous at h0, and removes them
afterwards: the bytes between hosts cross a shaped link.
"""

import os
import re
import signal
import statistics
import subprocess
import sys
from pathlib import Path

from bench import cli, hosts
from bench.environment import command_line, environment

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "ddp.py"
BACKENDS = ("gloo", "collectives")
CODECS = ("bf16", "fp16", "int8", "torch-fp16", "torch-bf16")
# what rank 0 of examples/ddp.py prints at the end
ACCURACY = re.compile(r"final test accuracy ([0-9.]+)")
STEP = re.compile(r"([0-9.]+) ms per step \(rank 0, (\d+) steps\)")
SAME = re.compile(r"bitwise identical on all \d+ ranks: (True|False); their digest ([0-9a-f]+)")


def parse_args(argv=None):
    p = cli.Parser(prog="python -m bench.ddp_step", description=__doc__.splitlines()[0],
                   epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--runs", default="gloo,collectives,gloo+int8,collectives+int8",
                   help=f"comma-separated BACKEND or BACKEND+CODEC: backends {', '.join(BACKENDS)}; "
                        f"codecs {', '.join(CODECS)}")
    p.add_argument("--nproc-per-node", type=int, default=4, help="processes (on each host, with --hosts)")
    p.add_argument("--hosts", type=int, default=0, help="across this many hosts made on this machine (root)")
    p.add_argument("--link", default="1gbit", help="with --hosts: each host's link rate, tc's words")
    p.add_argument("--hidden", type=int, default=32, help="the MLP's hidden width (examples/ddp.py --hidden)")
    p.add_argument("--epochs", type=int, default=5, help="epochs of each run")
    p.add_argument("--rounds", type=int, default=3, help="times each run goes, in turn with the others")
    p.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    p.add_argument("-J", "--output_file", default=None, help="write the JSON report here (default: no file)")
    args = p.parse_args(argv)
    args.run_list = [r.strip() for r in args.runs.split(",") if r.strip()]
    for run in args.run_list:
        backend, _, codec = run.partition("+")
        if backend not in BACKENDS or (codec and codec not in CODECS):
            p.error(f"--runs: {run!r} is not BACKEND or BACKEND+CODEC (backends {', '.join(BACKENDS)}; "
                    f"codecs {', '.join(CODECS)})")
    if not args.run_list or args.nproc_per_node < 1 or args.epochs < 1 or args.rounds < 1:
        p.error("need --runs, and --nproc-per-node, --epochs and --rounds of at least 1")
    if 64 % (args.nproc_per_node * max(args.hosts, 1)):
        p.error("the global batch, 64, must split evenly over the processes")
    if args.hosts:
        reason = hosts.why_not()
        if args.hosts < 2 or reason:
            p.error(f"--hosts: at least 2, on a machine that can make them ({reason or 'it can'})")
        try:
            hosts.link_bits_per_second(args.link)
        except ValueError as error:
            p.error(str(error))
    return args


def example_argv(run, args):
    backend, _, codec = run.partition("+")
    return [str(EXAMPLE), "--backend", backend, "--compression", codec or "none", "--epochs", str(args.epochs),
            "--hidden", str(args.hidden)]


def parse_output(text):
    """Rank 0's last lines: step ms, steps, accuracy, ranks bitwise equal, digest (None where missing)."""
    step, accuracy, same = STEP.search(text), ACCURACY.search(text), SAME.search(text)
    if not (step and accuracy and same):
        return None
    return {"step_ms": float(step[1]), "steps": int(step[2]), "test_accuracy": float(accuracy[1]),
            "ranks_bitwise_identical": same[1] == "True", "digest": same[2]}


def run_once(run, args, made=None, port=29541):
    """One torchrun job (one per host with `made`); rank 0's figures, or raise with its output."""
    program = example_argv(run, args)
    if made is None:
        commands = [[sys.executable, "-m", "torch.distributed.run", "--standalone",
                     "--nproc-per-node", str(args.nproc_per_node), *program]]
    else:
        commands = hosts.torchrun_commands(made["dir"], args.nproc_per_node, program, port)
    codes, outputs = hosts.run_together(commands, args.timeout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    found = parse_output(outputs[0])
    if any(codes) or found is None:
        raise SystemExit(f"{run} failed (exit {codes}):\n" + "\n".join(outputs)[-3000:])
    return found


def measure(args, made=None):
    results = {run: [] for run in args.run_list}
    for round_ in range(args.rounds):
        for i, run in enumerate(args.run_list):
            found = run_once(run, args, made, port=29541 + (round_ * len(args.run_list) + i) % 200)
            results[run].append(found)
            print(f"# round {round_ + 1}: {run:20s} {found['step_ms']:8.2f} ms per step, accuracy "
                  f"{found['test_accuracy']:.4f}", flush=True)
    return results


def summary(results):
    first = None
    rows = []
    for run, rounds in results.items():
        median = statistics.median(r["step_ms"] for r in rounds)
        first = first or median
        rows.append({"run": run, "step_ms_median": median, "step_ms": [r["step_ms"] for r in rounds],
                     "over_first": median / first, "test_accuracy": [r["test_accuracy"] for r in rounds],
                     "ranks_bitwise_identical": all(r["ranks_bitwise_identical"] for r in rounds),
                     "steps": rounds[0]["steps"]})
    return rows


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    processes = args.nproc_per_node * max(args.hosts, 1)
    where = f"{args.hosts} hosts of {args.nproc_per_node}, {args.link} links" if args.hosts else "one machine"
    print(f"# examples/ddp.py, {processes} processes ({where}), hidden {args.hidden}, {args.epochs} epochs, "
          f"{args.rounds} rounds of {', '.join(args.run_list)} in turn", flush=True)
    link_rate = None
    if args.hosts:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))   # the hosts go too
        with hosts.Hosts(args.hosts, args.link) as made:
            link_rate = hosts.measure_link(made["dir"])
            print(f"# the link h0 -> h1: {link_rate * 8 / 1e9:.2f} Gbit/s, one TCP stream for 1 s", flush=True)
            results = measure(args, made)
    else:
        results = measure(args)
    rows = summary(results)
    print(f"# {'run':20s} {'ms/step':>9s} {'/first':>7s}  accuracy   ranks equal")
    for row in rows:
        print(f"  {row['run']:20s} {row['step_ms_median']:9.2f} {row['over_first']:7.2f}  "
              f"{statistics.median(row['test_accuracy']):.4f}     {row['ranks_bitwise_identical']}")
    if args.output_file:
        env = environment("host", processes, ["torch:gloo", "torch:collectives"])
        env["command"] = command_line("bench.ddp_step", argv)
        report = {"benchmark": "examples/ddp.py under torchrun: DDP's time per step, ours against Gloo, with and "
                               "without our compression hook",
                  "environment": env, "processes": processes, "hidden": args.hidden, "epochs": args.epochs,
                  "rounds": args.rounds,
                  "hosts": ({"count": args.hosts, "link": args.link, "measured_bytes_per_second": link_rate}
                            if args.hosts else None),
                  "runs": rows}
        cli.write_json(Path(args.output_file), report)
    return 0 if all(row["ranks_bitwise_identical"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
