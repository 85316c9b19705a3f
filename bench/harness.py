"""The benchmark harness shared by the *_perf scripts, after nccl-tests.

A collective is a small spec (what to allocate, the bus-bandwidth factor, how
each backend runs it, what a correct result is); this module does the sweep,
the timing, the check outside the timed loop, the table and the JSON.

Ranks: under `mpiexec -n N` one rank per process; otherwise `--ranks N`
virtual ranks in this process. `--backend` may list several backends, run on
identical inputs in one invocation, alternating size by size:

    ours   this library, on --device (`host` is its older name, still accepted)
    mpi    mpi4py over MPICH, on host arrays (under a launcher: its MPI)
    mpich, openmpi  mpi4py over that MPI library; openmpi relaunches under
           Open MPI's mpirun in its own environment (bench/mpis.py)
    gloo   torch.distributed with the Gloo backend, on host arrays
    nccl   NCCL, through this library's backend="nccl" (--device cuda)

    torch:collectives  this library through torch.distributed: a process
                       group of the backend collectives.torch registers
    torch:gloo         a Gloo process group made the same way
    mwms   TensorFlow's MultiWorkerMirroredStrategy (allreduce sum and avg,
           allgather): a tf.function of strategy.run per call, its
           collectives a ring over gRPC; started from our ranks' addresses
           (also named tf:mwms)
    tf:collectives  this library's TensorFlow ops the same way: a
           tf.function per call on tf.Tensors (allreduce, allgather,
           reduce_scatter, broadcast), a node of our graph op each

mpi, gloo, torch:*, mwms and tf:collectives run one rank per process. Under torchrun (no MPI),
the ranks' bookkeeping runs on a Gloo group (backends.TorchWorld), `ours`
starts from torchrun's store (collectives.init) and `gloo` is torch:gloo's
group; `mpi`, `mwms` and `tf:collectives` need mpiexec. Asking for torch:* without a launcher
relaunches the benchmark under torchrun with `--ranks` processes (under
mpiexec when mpi or mwms is asked for too); asking for mpi, gloo or mwms
without a launcher relaunches it under MPICH's mpiexec with `--ranks`
processes, pinned one per core (`--bind-to core`: rank r on core r mod cores; `none`
leaves placement to the kernel; `auto` is core up to one process per core and
none beyond, which bench/host_vs_mpich.py found best for both libraries). A
backend that cannot run the chosen op or type (MPI has no average, Gloo no
int16, ...) is skipped with a line that says why; the others run.

`--compression` (allreduce on float32, sum or avg) may list codecs too
(none,fp16,bf16,int8): each runs as a backend of ours of its own. Then the
timed inputs are seeded standard-normal floats, and every row gets two more
columns: maxrel, the error against a float64 reference computed from every
rank's regenerated input, and wire B, what a call makes a rank read from its
peers. Compressed rows have no bitwise #wrong; uncompressed rows keep it.
"""

import importlib.util
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

import collectives
from bench import cli, mpis
from bench.backends import (
    BACKENDS, COMPRESSING_BACKENDS, DEFAULT_BACKEND, GLOO, MPI_BACKENDS, NCCL, NO_COMPRESSION,
    OPENMPI_BACKEND, PROCESS_BACKENDS, TENSORFLOW_BACKENDS, TENSORFLOW_INSTALL, TORCH_BACKENDS, TORCH_PIN, Buffers, TorchWorld,
    launched_by_torchrun, make_backends, unsupported,
)
from bench.environment import LAUNCHER_COMMAND, environment, module_name
from bench.progress import Progress
from collectives.bootstrap import LAUNCHER_VARIABLES
from collectives.compression.kernels import CODECS
from collectives.ops import bfloat16

DTYPE_NAMES = {  # nccl-tests' type names -> NumPy
    "int8": "int8", "uint8": "uint8", "int32": "int32", "uint32": "uint32", "int64": "int64",
    "uint64": "uint64", "half": "float16", "float16": "float16", "float": "float32",
    "float32": "float32", "double": "float64", "float64": "float64", "int16": "int16", "uint16": "uint16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}
RELAUNCHED = "COLLECTIVES_BENCH_RELAUNCHED"
# Set by the relaunching process when its stderr is a terminal: under mpiexec
# the ranks' stderr is a pipe, but what they write still reaches that terminal.
SHOW_PROGRESS = "COLLECTIVES_BENCH_PROGRESS"
COMPRESSIONS = (NO_COMPRESSION, *CODECS)
COMPRESSION_OPS = ("sum", "avg")
SEED = 20250610   # of the seeded inputs that --compression measures errors on


def whole(buffer, rank, nranks):
    """In place, the call's input and output are the buffer itself (allreduce, broadcast, reduce)."""
    return buffer


def own_block(buffer, rank, nranks):
    """Rank `rank`'s block of a buffer of `nranks` blocks (a view, on any array library)."""
    block = len(buffer) // nranks
    return buffer[rank * block:(rank + 1) * block]


def as_users_call(x, out):
    """The call's arrays as its users pass them: one rank per process, the
    arrays themselves (which the compiled loop of host ranks takes); ranks
    in one process, the lists."""
    return (x[0], out[0]) if len(x) == 1 else (x, out)


def first_block(buffer, rank, nranks):
    return buffer[:len(buffer) // nranks]


def rank_pattern(dtype, rank, count, start=0):
    """Data that tells ranks and positions apart, for collectives that move
    data without reducing it: (i + 17 r) mod 97 + 1, for i from `start`
    (a block of a longer pattern, made without the rest of it). Under 128,
    so int8 and bfloat16 hold every value exactly."""
    return ((np.arange(start, start + count) + 17 * rank) % 97 + 1).astype(dtype)


def pattern_fill(dtype, op, nranks, rank, count, root=0):
    """A Spec's fill for collectives that move data: rank_pattern(rank)."""
    return rank_pattern(dtype, rank, count)


@dataclass
class Spec:
    name: str                      # the collective as collectives names it, e.g. "allreduce"
    busbw_factor: Callable         # nranks -> factor, as nccl-tests
    counts: Callable               # (bytes, itemsize, nranks) -> (input count, output count) per rank
    # How each backend runs the collective once, on this process's ranks:
    #   run_ours(comm, x, out, args): x and out are lists, one array per local rank;
    #     in place, out aliases x as nccl-tests lays them out (in_place_input/result),
    #     which our library recognises as in place.
    #   run_mpi(mpi_comm, x, out, args) and run_gloo(torch.distributed, x, out, args):
    #     x None means in place, as MPI_IN_PLACE: the data is in `out`, the rank's whole buffer.
    run_ours: Callable
    run_mpi: Callable
    expected: Callable             # (dtype, op, nranks, rank, output count, root) -> output of `rank`; None: unchecked
    fill: Callable                 # (dtype, op, nranks, rank, input count, root) -> input of `rank`
    run_gloo: Optional[Callable] = None
    #   run_mwms(replica_context, x, args) -> the result: inside MultiWorkerMirroredStrategy.run
    #     (a tf.function), x the rank's input tf.Tensor; None where its replica context has no such call.
    run_mwms: Optional[Callable] = None
    #   run_tf(collectives.tensorflow, comm, x, args) -> the result: inside a tf.function, x the
    #     rank's input tf.Tensor, comm the rank's communicator; None where collectives.tensorflow has no such op.
    run_tf: Optional[Callable] = None
    has_op: bool = True            # whether -o applies (the redop column says none otherwise)
    rooted: bool = False           # whether -r applies (the root column says -1 otherwise)
    # In place every rank has one buffer of max(input, output) elements; these
    # are the views of it that the call takes as input and leaves its result in.
    in_place_input: Callable = whole
    in_place_result: Callable = whole
    # Where MPI_IN_PLACE leaves the result, where that is elsewhere (reduce_scatter: the start).
    mpi_in_place_result: Optional[Callable] = None
    # (op, nranks, every rank's float32 input) -> the float64 result every rank
    # should approximate; set where --compression applies (allreduce).
    reference: Optional[Callable] = None
    # (bytes, itemsize, nranks) -> the count column where it is not the
    # smaller count (all_to_all: one block, what a rank sends each peer).
    count_column: Optional[Callable] = None

    def param_count(self, nbytes, itemsize, nranks):
        """The count column, nccl-tests' count argument: elements per rank
        (for allgather what each rank sends, for reduce_scatter what it receives)."""
        if self.count_column is not None:
            return self.count_column(nbytes, itemsize, nranks)
        return min(self.counts(nbytes, itemsize, nranks))

    def bytes_moved(self, nbytes, itemsize, nranks):
        """The size column: the larger of a rank's input and output in bytes
        (allgather: the gathered bytes; reduce_scatter: the input bytes)."""
        return max(self.counts(nbytes, itemsize, nranks)) * itemsize


def parse_args(spec, argv=None):
    p = cli.Parser(prog=f"python -m {module_name()}",
                   description=f"Times {spec.name} over a sweep of message sizes, nccl-tests style: our "
                               f"library and, side by side, MPICH, Gloo or NCCL; prints time, algorithm "
                               f"and bus bandwidth per size, and checks every result.")
    p.add_argument("-b", "--minbytes", default="8", type=cli.size, help="smallest message (suffixes K, M, G)")
    p.add_argument("-e", "--maxbytes", default="32M", type=cli.size, help="largest message")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="multiply the size by this each step")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size")
    p.add_argument("-w", "--warmup_iters", type=int, default=5, help="untimed iterations first")
    p.add_argument("--rounds", type=int, default=1,
                   help="timed batches of -n iterations per backend, taken in turn; the time is their median")
    p.add_argument("-o", "--op", default="sum", choices=[op.value for op in collectives.ReduceOp],
                   help="reduction, where the collective reduces")
    p.add_argument("-d", "--datatype", default="float", choices=sorted(DTYPE_NAMES), metavar="TYPE",
                   help=f"element type, nccl-tests' names or NumPy's: {', '.join(sorted(DTYPE_NAMES))}")
    p.add_argument("-r", "--root", type=int, default=0, help="root rank of broadcast, reduce, gather and scatter")
    p.add_argument("-c", "--check", type=int, default=1, help="1: check every result against the closed form, bit for bit (outside the timed loop); 0: do not")
    p.add_argument("-G", "--cudagraph", type=int, default=0,
                   help="with --device cuda: capture the -n timed calls as a CUDA graph and launch it this "
                        "many times (nccl-tests' -G); ignored elsewhere")
    p.add_argument("-J", "--output_file", help="write rows and environment as JSON here (default: no file)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line on stderr")
    p.add_argument("--ranks", type=int, default=4, help="ranks when not under mpiexec (virtual, or processes "
                                                          "for the mpi and gloo backends)")
    p.add_argument("--device", default="host", choices=["host", "emulated", "cuda"],
                   help="where our ranks run: host (NumPy), emulated (our CUDA kernels on the CPU), "
                        "cuda (virtual ranks: every rank on GPU 0; under mpiexec: GPU local rank modulo the GPUs)")
    p.add_argument("--backend", default=DEFAULT_BACKEND,
                   help="comma-separated: ours (this library, on --device; the default; `host` is its older "
                        "name), mpi (mpi4py over MPICH), mpich, openmpi (mpi4py over Open MPI, in its own "
                        "environment, bench/mpis.py; one MPI a run), "
                        f"gloo (torch.distributed with Gloo; needs {TORCH_PIN}), nccl (NCCL through this "
                        "library's backend='nccl'; --device cuda, one rank per GPU), torch:collectives (this "
                        "library through torch.distributed, under torchrun), torch:gloo (a Gloo group made the "
                        "same way), mwms or tf:mwms (TensorFlow's MultiWorkerMirroredStrategy: allreduce with "
                        "sum or avg, "
                        "allgather; under mpiexec; needs TensorFlow), tf:collectives (this library's TensorFlow "
                        "ops, a tf.function per call as mwms; under mpiexec; needs TensorFlow)")
    p.add_argument("--algorithm", default="auto",
                   help="our algorithm, or several comma-separated (each runs as a backend of its own, "
                        "alternating per size): auto or a registered name (python -m bench.model lists them)")
    p.add_argument("--compression", default=NO_COMPRESSION,
                   help="allreduce of float32 with op sum or avg: what our ranks read from peers, encoded. "
                        f"Comma-separated, each runs as a backend of its own, alternating per size: "
                        f"{', '.join(COMPRESSIONS)}. Beyond none, inputs are seeded random floats and every "
                        "row gets maxrel (max |result - float64 reference| / max |reference|) and wire B "
                        "(bytes a rank reads from its peers per call); compressed rows have no bitwise #wrong. "
                        "mpi, gloo and nccl rows run uncompressed")
    p.add_argument("--symmetric", action="store_true",
                   help="our backend's buffers from comm.alloc (symmetric memory): GPU ranks in separate "
                        "processes with COLLECTIVES_ONE_KERNEL_ALLREDUCE=1 then read and write each other's "
                        "arrays with no workspace copies (docs/device-protocol.md); elsewhere plain arrays")
    p.add_argument("--timeout", type=float, default=None,
                   help="communicator timeout in seconds (default: the library's, 300 or $COLLECTIVES_TIMEOUT)")
    p.add_argument("--compute-between", type=float, default=0.0, metavar="MS",
                   help="MS milliseconds of compute before each timed call (a pass over a buffer larger than the "
                        "cache, as a training step's compute leaves it), the call alone timed, and no warm-up "
                        "calls before a batch: what a training step's collective costs (default 0: calls back "
                        "to back after about 20 ms of warm-up calls)")
    p.add_argument("--read-results", action="store_true",
                   help="after each timed call, untimed, every rank reads its outputs (a sum over them, as a "
                        "training step's optimizer reads its gradients; after each warm-up call too), the calls "
                        "timed one by one: where a peer's core wrote a rank's result, the rank's read brings it "
                        "over, and the next call writes it there again; host arrays only (default: calls back "
                        "to back, their outputs never read)")
    p.add_argument("--bind-to", default="core",
                   help="when the mpi or gloo backend relaunches the benchmark as processes: mpiexec's -bind-to "
                        "(core: rank r on core r mod cores; none; hwthread; hydra's user:C0,C1,...; "
                        "or auto: core while the processes have a core each, none beyond)")
    args = p.parse_args(argv)
    if args.compute_between < 0:
        p.error("--compute-between must be >= 0")
    if args.read_results and (args.compute_between or args.device != "host"):
        p.error("--read-results reads host arrays between calls back to back: not with --compute-between "
                "or --device emulated/cuda")
    args.minbytes, args.maxbytes = cli.parse_size(args.minbytes), cli.parse_size(args.maxbytes)
    name = DTYPE_NAMES[args.datatype]
    args.dtype = bfloat16() if name == "bfloat16" else np.dtype(name)
    from collectives.algorithms import REGISTRY
    args.backends = cli.names(p, "--backend", args.backend, BACKENDS)
    args.algorithms = cli.names(p, "--algorithm", args.algorithm, ["auto", *REGISTRY])
    args.compressions = cli.names(p, "--compression", args.compression, COMPRESSIONS)
    args.compressed = args.compressions != [NO_COMPRESSION]  # the error columns, and labels that name the codec
    if args.compressed:
        asked = f"--compression {args.compression}"
        if spec.reference is None:
            p.error(f"{asked}: compression applies to allreduce, not {spec.name} (python -m bench.all_reduce_perf)")
        if args.dtype != np.float32:
            p.error(f"{asked}: compression takes float32 (-d float), not {args.dtype.name}")
        if args.op not in COMPRESSION_OPS:
            p.error(f"{asked}: compression reduces with -o sum or avg, not {args.op}")
        if not set(args.backends) & set(COMPRESSING_BACKENDS):
            p.error(f"{asked}: compression applies to our backend: add --backend ours "
                    "(mpi, gloo and nccl run uncompressed beside it)")
    if args.minbytes > args.maxbytes or args.stepfactor < 2 or args.iters < 1 or args.warmup_iters < 0 \
            or args.rounds < 1 or args.cudagraph < 0:
        p.error("need -b <= -e, -f >= 2, -n >= 1, -w >= 0, -G >= 0 and --rounds >= 1")
    if args.ranks < 1:
        p.error("--ranks must be at least 1")
    # --device places our ranks only: mpi and gloo are host collectives, and
    # run on host arrays beside ours wherever ours run (an emulated device's
    # arrays are host arrays too).
    if args.device == "cuda" and any(b in PROCESS_BACKENDS for b in args.backends):
        p.error("--backend mpi, gloo, mwms and tf:collectives run on host arrays; with --device cuda compare ours "
                "with nccl on a GPU")
    if NCCL in args.backends and args.device != "cuda":
        p.error("--backend nccl runs on GPUs: add --device cuda")
    torch_backends = [b for b in args.backends if b in (GLOO, *TORCH_BACKENDS)]
    if torch_backends and importlib.util.find_spec("torch") is None:
        p.error(f"--backend {','.join(torch_backends)} needs PyTorch (torch.distributed): pip install {TORCH_PIN}")
    tensorflow_backends = [b for b in args.backends if b in TENSORFLOW_BACKENDS]
    if tensorflow_backends and importlib.util.find_spec("tensorflow") is None:
        p.error(f"--backend {','.join(tensorflow_backends)} needs TensorFlow: {TENSORFLOW_INSTALL}")
    mpi_backends = [b for b in args.backends if b in MPI_BACKENDS]
    if OPENMPI_BACKEND in mpi_backends and len(mpi_backends) > 1:
        p.error(f"--backend {','.join(mpi_backends)}: one process loads one MPI library; run once per MPI, "
                "or python -m bench.host_vs_mpich --mpi mpich,openmpi, which does")
    for needs_mpiexec in (*mpi_backends, *tensorflow_backends):
        if needs_mpiexec in args.backends and launched_by_torchrun():
            p.error(f"--backend {needs_mpiexec} needs mpiexec: under torchrun compare ours, gloo, torch:collectives, "
                    "torch:gloo")
    return args


def sizes(args):
    return cli.size_sweep(args.minbytes, args.maxbytes, args.stepfactor)


def mpi_world():
    """The ranks' world: MPI's when launched by mpiexec (an exception no code
    catches then ends every rank: abort_on_uncaught_exceptions), a Gloo
    group's (TorchWorld) when launched by torchrun, else None (and no MPI
    import)."""
    if launched_by_torchrun():
        return TorchWorld()
    if not any(v in os.environ for v in LAUNCHER_VARIABLES):
        return None
    from mpi4py import MPI
    abort_on_uncaught_exceptions(MPI.COMM_WORLD)
    return MPI.COMM_WORLD


def abort_on_uncaught_exceptions(world):
    """Make an exception that no code catches end every rank of `world`
    (MPI_Abort, after the traceback), not this rank alone: its exit would
    finalize MPI, which waits for the peers, themselves waiting in a
    collective for this rank, and the launch would never end (as
    `python -m mpi4py` does for a script). Once per process."""
    if getattr(sys.excepthook, "aborts_world", False):
        return
    previous = sys.excepthook

    def excepthook(kind, value, traceback):
        previous(kind, value, traceback)
        sys.stderr.flush()
        time.sleep(0.2)   # (the launcher forwards the ranks' output: an abort cut the traceback's last line)
        world.Abort(1)
    excepthook.aborts_world = True
    sys.excepthook = excepthook


def bind_to(value, nranks):
    """mpiexec's -bind-to for `nranks` processes on this machine: `value`,
    except `auto`, which is `core` while every process has a core of its own
    (os.cpu_count(), the count the library judges oversubscription by) and
    `none` beyond: pinned ranks that share a core wait for each other's time
    slices (bench/host_vs_mpich.py has the measurements)."""
    if value != "auto":
        return value
    return "core" if nranks <= (os.cpu_count() or 1) else "none"


def relaunch_under_torchrun(args, argv):
    """Run this same benchmark as `--ranks` processes started by torchrun
    (one machine, its own store); return its exit code."""
    launcher = ["-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks), "--standalone"]
    command = [sys.executable, *launcher, "-m", module_name(), *argv]
    print(f"# relaunching as {args.ranks} processes: {' '.join(command)}", flush=True)
    env = dict(os.environ, **{RELAUNCHED: "1", LAUNCHER_COMMAND: f"torchrun --nproc-per-node {args.ranks} --standalone"})
    env.setdefault("OMP_NUM_THREADS", "1")   # torchrun's own default, said here so that it does not warn
    if not getattr(args, "quiet", True) and sys.stderr.isatty():
        env[SHOW_PROGRESS] = "1"
    return subprocess.call(command, env=env)


def relaunch_under_mpiexec(args, argv, launcher_flags=(), ranks=None, variables=None):
    """Run this same benchmark as `ranks` processes (default `--ranks`) under
    MPICH's mpiexec, or under Open MPI's mpirun with its environment's Python
    for --backend openmpi (`launcher_flags` in hydra's syntax, translated:
    bench/mpis.py); return its exit code. `variables` ({name: value}) are
    set for the ranks and written before the launcher in the command the
    record shows, so that it reruns as it ran (hierarchy_perf's pretend
    nodes)."""
    ranks = args.ranks if ranks is None else ranks
    variables = dict(variables or {})
    install = mpis.find(mpis.OPEN_MPI if OPENMPI_BACKEND in getattr(args, "backends", ()) else mpis.MPICH)
    launcher = [install.mpiexec, *mpis.translate_hydra_flags(install.name, ranks, launcher_flags),
                "-n", str(ranks)]
    command = [*launcher, install.python, "-m", module_name(), *argv]
    prefix = "".join(f"{name}={value} " for name, value in variables.items())
    print(f"# relaunching as {ranks} processes: {prefix}{' '.join(command)}", flush=True)
    env = dict(os.environ, **variables, **{RELAUNCHED: "1", LAUNCHER_COMMAND: prefix + " ".join(
        [os.path.basename(launcher[0]), *launcher[1:]])})
    if not getattr(args, "quiet", True) and sys.stderr.isatty():
        env[SHOW_PROGRESS] = "1"
    return subprocess.call(command, env=env)


def relaunch_once(args, argv, launcher_flags=(), ranks=None, variables=None,
                  missing="the relaunched benchmark found no MPI launcher"):
    """relaunch_under_mpiexec for a tool that runs only under a launcher;
    in the relaunched process itself (which found none after all) it stops
    with `missing` instead, rather than relaunching again and again."""
    if os.environ.get(RELAUNCHED):
        sys.exit(missing)
    return relaunch_under_mpiexec(args, argv, launcher_flags, ranks, variables)


# -- what each backend can run ------------------------------------------------------

# -- measuring -------------------------------------------------------------------

def count_wrong(got, want):
    """Elements whose bits differ from the expectation."""
    got, want = np.asarray(got).reshape(-1), np.asarray(want).reshape(-1)
    if got.size != want.size:
        return max(got.size, want.size)
    differs = got.view(np.uint8) != want.view(np.uint8)
    return int(np.count_nonzero(differs.reshape(-1, got.itemsize).any(axis=1)))


class SeededInputs:
    """--compression's inputs: rank r's is seeded standard-normal float32, which
    any process can regenerate, so each computes the float64 reference of all
    ranks' inputs without communicating. Kept for one count at a time (its
    local ranks' inputs and the reference)."""

    def __init__(self, spec, op, nranks, seed=SEED):
        self.spec, self.op, self.nranks, self.seed = spec, op, nranks, seed
        self.count, self.inputs, self.ref = None, {}, None

    def generate(self, rank, count):
        return np.random.default_rng([self.seed, rank, count]).standard_normal(count, dtype=np.float32)

    def _at(self, count):
        if count != self.count:
            self.count, self.inputs, self.ref = count, {}, None

    def input(self, rank, count):
        """Rank `rank`'s input of `count` elements (do not modify it: copy)."""
        self._at(count)
        if rank not in self.inputs:
            self.inputs[rank] = self.generate(rank, count)
        return self.inputs[rank]

    def reference(self, count):
        """The float64 result every rank should approximate."""
        self._at(count)
        if self.ref is None:
            every = (self.inputs[r] if r in self.inputs else self.generate(r, count) for r in range(self.nranks))
            self.ref = self.spec.reference(self.op, self.nranks, every)
        return self.ref


def max_relative_error(got, ref, chunk=1 << 22):
    """max_i |got_i - ref_i| / max_i |ref_i| (NaN if any result is NaN), in chunks."""
    got = np.asarray(got).reshape(-1)
    worst, scale = np.float64(0.0), np.float64(0.0)
    for start in range(0, ref.size, chunk):
        r = ref[start:start + chunk]
        worst = np.maximum(worst, np.max(np.abs(got[start:start + chunk] - r), initial=0.0))
        scale = np.maximum(scale, np.max(np.abs(r), initial=0.0))
    if scale == 0:
        return float(worst) if worst != 0 else 0.0
    return float(worst / scale)


def measure(backends, spec, args, nbytes, world, progress=None, seeded=None, placements=(False, True)):
    """Per backend, for one size, out of place then in place (`placements`:
    in_place flags, in order; e.g. (True,) for in place only): a dict of
    seconds, rounds (each round's seconds), wrong and maxrel.

    Seconds: the median over --rounds rounds; in each round every backend
    runs one timed batch of -n iterations in turn, so that the machine's
    noise hits all alike, each batch right after untimed calls of its own
    for about WARM_SECONDS (warm_up); a batch's time is its slowest rank's
    mean (ranks in other processes report through MPI). wrong: over every rank, from a run
    on fresh inputs after the timed rounds (None for compressed backends,
    whose results are approximate). maxrel: with `seeded` (--compression),
    over every rank, from a run on fresh seeded inputs; else None. With
    `seeded` the timed runs take the seeded inputs too, put back in place
    before each batch.
    """
    rows = [[] for _ in backends]
    for in_place in placements:
        shared = {}  # backends on the same ranks (algorithms, codecs of one communicator) share their buffers
        buffers = []
        for backend in backends:
            key = id(getattr(backend, "comm", backend))
            if key not in shared:
                shared[key] = allocate(backend, spec, args, nbytes, in_place, seeded)
            buffers.append(shared[key])
        for backend, bufs in zip(backends, buffers):
            for _ in range(args.warmup_iters):
                backend.run(bufs)
        batches = [[] for _ in backends]
        for _ in range(args.rounds):
            for backend, bufs, times in zip(backends, buffers, batches):
                if progress is not None:
                    progress.at(backend.label)
                if not args.compute_between:   # (after compute, calls come cold: that is what is timed)
                    warm_up(backend, bufs, world, times[-1] if times else None,
                            after=(lambda: read_results(bufs)) if args.read_results else None)
                if seeded is not None and in_place:
                    refill(backend, spec, args, nbytes, bufs, seeded)
                times.append(timed_batch(backend, bufs, args, world))
        for backend, row, times in zip(backends, rows, batches):
            if backend.compression is not None:
                wrong = None   # approximate: judged by maxrel
            else:
                wrong = check(backend, spec, args, nbytes, in_place) if args.check else 0
                if world is not None:
                    wrong = world.allreduce(wrong)
            maxrel = None
            if seeded is not None and args.check:
                maxrel = error_check(backend, spec, args, nbytes, in_place, seeded)
                if world is not None:  # not MPI's MAX: NaN must win
                    maxrel = float(np.max(world.allgather(maxrel)))
            row.append({"seconds": statistics.median(times), "rounds": times, "wrong": wrong, "maxrel": maxrel})
    return rows


def allocate(backend, spec, args, nbytes, in_place, seeded=None):
    """A backend's Buffers for one message size, filled with fresh inputs
    (`seeded`'s if given). Arrays are made on the host and moved, so every
    backend starts from the same bytes."""
    dtype, n = args.dtype, backend.nranks
    in_count, out_count = spec.counts(nbytes, dtype.itemsize, n)
    inputs, outputs, whole_buffers = [], [], []
    symmetric = getattr(backend, "symmetric", None) if getattr(args, "symmetric", False) else None
    for i, r in enumerate(backend.local_ranks):
        if seeded is not None:
            x = seeded.input(r, in_count).copy()
        else:
            x = spec.fill(dtype, args.op, n, r, in_count, args.root)
        if in_place:
            if symmetric is not None:
                buffer = symmetric(0, i, max(in_count, out_count), dtype)
                spec.in_place_input(buffer, r, n)[...] = backend.to_device(x)
            else:
                buffer = np.empty(max(in_count, out_count), dtype)
                spec.in_place_input(buffer, r, n)[...] = x
                buffer = backend.to_device(buffer)
            whole_buffers.append(buffer)
            inputs.append(spec.in_place_input(buffer, r, n))
            outputs.append(spec.in_place_result(buffer, r, n))
        elif symmetric is not None:
            inputs.append(symmetric(0, i, in_count, dtype))
            inputs[-1][...] = backend.to_device(x)
            outputs.append(symmetric(1, i, out_count, dtype))
        else:
            inputs.append(backend.to_device(x))
            outputs.append(backend.to_device(np.empty(out_count, dtype)))
    return Buffers(inputs, outputs, whole_buffers if in_place else None)


def refill(backend, spec, args, nbytes, buffers, seeded):
    """Put the seeded inputs back into in-place buffers, untimed. In place,
    each sum multiplies the data by about the number of ranks, which would
    reach inf after a hundred-odd calls on two ranks; a codec meets inf and
    NaN blocks on another path (wire.py), and its time would change with it.
    Inside a batch of -n calls the data grows by nranks^n at most."""
    in_count, _ = spec.counts(nbytes, args.dtype.itemsize, backend.nranks)
    for view, r in zip(buffers.inputs, backend.local_ranks):
        view[...] = backend.to_device(seeded.input(r, in_count))


# Untimed calls of a backend right before each of its timed batches, for
# about this long: a batch runs on the machine the batch before it left, and
# on the 2-core VM the calls after an idle spell run slow for several ms,
# whoever makes them (after a 50 ms sleep, 20 calls of a 1 KiB allreduce
# across 2 pretend nodes of 2 took 40-280 µs each for ours, 77-210 for
# MPICH, against 11 and 31 once warm). Gloo's 3 ms calls block in the
# kernel and leave the cores that idle: ours, timed right after them, took
# 33-46 µs a call where it takes 11 beside MPICH alone.
WARM_SECONDS = 20e-3


def warm_up(backend, buffers, world, last_per_call, after=None):
    """Untimed calls for about WARM_SECONDS, as many on every rank: from
    `last_per_call` (the backend's last batch, the slowest rank's), else
    from one call timed first; none where a call takes that long anyway.
    `after()` after each, as after each timed call (--read-results)."""
    if last_per_call is None:
        last_per_call = timed_calls(backend, buffers, 1, world)
    for _ in range(warm_calls(last_per_call)):
        backend.run(buffers)
        if after is not None:
            after()


def warm_calls(per_call):
    """How many calls of `per_call` seconds make about WARM_SECONDS: none
    where one call takes that long anyway."""
    if per_call >= WARM_SECONDS:
        return 0
    return int(WARM_SECONDS / max(per_call, 1e-6)) + 1


def timed_batch(backend, buffers, args, world):
    """Seconds per call of -n calls, the slowest rank's."""
    if args.cudagraph and backend.device == "cuda":
        seconds = graph_timed_batch(backend, buffers, args.iters, args.cudagraph)
        return seconds if world is None else slowest(world, seconds)
    if args.compute_between:
        seconds = args.compute_between / 1e3
        return timed_one_by_one(backend, buffers, args.iters, world, before=lambda: compute(seconds))
    if args.read_results:
        return timed_one_by_one(backend, buffers, args.iters, world, after=lambda: read_results(buffers))
    return timed_calls(backend, buffers, args.iters, world)


def seconds_per_call(call, calls, *arguments, before=None, after=None):
    """Seconds per call of `calls` calls of `call(*arguments)`, on this
    process's clock: the one timing loop of the bench tools. The arguments
    are passed as they are, not bound in a lambda, so that no wrapper's frame
    is timed with every call. `before` runs untimed first (a barrier, so
    that the ranks start together); `after` inside the timed span (a barrier
    or a synchronize: work a call leaves queued, as GPU work is, counts
    until it is done)."""
    if before is not None:
        before()
    start = time.perf_counter()
    for _ in range(calls):
        call(*arguments)
    if after is not None:
        after()
    return (time.perf_counter() - start) / calls


def adding_seconds(method, spent, key):
    """`method`, wrapped to add the seconds of its every call to spent[key]
    (a dict): a part of a call timed from inside it (a device's kernels, a
    hierarchy's exchanges), for the tools that split a call's time into
    parts. The wrapper's own cost lands outside the parts it times."""
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent[key] = spent.get(key, 0.0) + time.perf_counter() - start
    return timed


_CLASS_ATTRIBUTE = object()   # what held() records where the attribute was the class's


def held(target, name):
    """(target, name, what `target` itself held as `name`), before a tool
    wraps it with an instance attribute: for put_back."""
    return target, name, vars(target).get(name, _CLASS_ATTRIBUTE)


def put_back(helds):
    """Give each target what held() saw it hold (an instance attribute
    back; a class's uncovered), the last wrapped first."""
    for target, name, original in reversed(helds):
        if original is _CLASS_ATTRIBUTE:
            vars(target).pop(name, None)
        else:
            setattr(target, name, original)


def adding_calls(method, counts, key):
    """`method`, wrapped to add 1 to counts[key] (a dict) at its every call:
    the launches, waits or collective calls a call makes, for the tools that
    count them."""
    def counted(*args, **kwargs):
        counts[key] += 1
        return method(*args, **kwargs)
    return counted


class DeviceTimer:
    """Seconds per launch of `issue` on one device (a kernel's, a copy's), after
    one untimed launch that warms up (and compiles): on a GPU by its own
    clock (CUDA events around the launches), on the emulated device by
    this process's, up to a synchronize."""

    def __init__(self, device_kind, device):
        self.kind, self.device = device_kind, device

    def seconds(self, issue, repeats):
        issue()  # warm up (and compile)
        self.device.synchronize()
        if self.kind == "cuda":
            import cupy
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            for _ in range(repeats):
                issue()
            stop.record()
            stop.synchronize()
            return cupy.cuda.get_elapsed_time(start, stop) / 1e3 / repeats
        return seconds_per_call(issue, repeats, after=self.device.synchronize)


def upload(kind, memory, values):
    """Copy the host array `values` to the start of `memory`, an allocation
    of a device of `kind`: a GPU's by cudaMemcpy, the emulated device's
    (host memory) by assignment."""
    if kind == "cuda":
        import cupy
        runtime = cupy.cuda.runtime
        runtime.memcpy(memory.address, values.ctypes.data, values.nbytes, runtime.memcpyHostToDevice)
    else:
        memory.array[:values.nbytes] = values.view(np.uint8)


def timed_calls(backend, buffers, calls, world):
    """Seconds per call of `calls` calls, the slowest rank's."""
    seconds = seconds_per_call(backend.run, calls, buffers, before=backend.barrier, after=backend.barrier)
    return seconds if world is None else slowest(world, seconds)


def timed_one_by_one(backend, buffers, calls, world, before=None, after=None):
    """Seconds per call of `calls` calls, each call alone timed, `before()`
    and `after()` untimed around each (a training step's compute, its read
    of the results); the slowest rank's. No barrier between calls: as in a
    training step, ranks come from their own work when they are done with it."""
    backend.barrier()
    seconds = 0.0
    for _ in range(calls):
        if before is not None:
            before()
        start = time.perf_counter()
        backend.run(buffers)
        seconds += time.perf_counter() - start
        if after is not None:
            after()
    backend.barrier()
    seconds /= calls
    return seconds if world is None else slowest(world, seconds)


def read_results(buffers):
    """Read every output this process holds, as the code after a call would
    (a sum: every line read, none written): host arrays, torch's CPU tensors."""
    for out in buffers.outputs:
        np.asarray(out).sum()


COMPUTE_BYTES = 64 << 20   # larger than the caches: what compute leaves in them is its own data
# Elements of float32 a step of compute (16 KiB: a few µs), so that every rank's compute ends within
# microseconds of its deadline: with 4 MiB steps (about 1 ms each) the ranks came out up to a step
# apart, and a call's time was mostly its wait for the later peer (130 µs for a 1 KiB allreduce).
_COMPUTE_SLICE = 1 << 12
_compute_buffer = None


def compute(seconds):
    """Busy this core for `seconds`, streaming through a private buffer of
    COMPUTE_BYTES (a scaled add, slice by slice), as a training step's
    compute would: the collective after it finds the caches full of other data."""
    global _compute_buffer
    if _compute_buffer is None:
        _compute_buffer = np.ones(COMPUTE_BYTES // 4, np.float32)
    end = time.perf_counter() + seconds
    at = 0
    while time.perf_counter() < end:
        part = _compute_buffer[at:at + _COMPUTE_SLICE]
        np.multiply(part, np.float32(1.0000001), out=part)
        at = (at + _COMPUTE_SLICE) % _compute_buffer.size


def slowest(world, seconds):
    """The largest of the ranks' `seconds` (a collective is as slow as its
    last rank), on an MPI communicator or a TorchWorld."""
    return world.allreduce(seconds, op=world.MAX if isinstance(world, TorchWorld) else _mpi_max())


def graph_timed_batch(backend, buffers, iters, launches):
    """-G: the `iters` calls captured once as a CUDA graph, which is then
    launched `launches` times, as nccl-tests' -G; seconds per call. Our GPU
    collectives queue their work on the caller's current stream, which is
    the stream being captured here. (Untested without a GPU.)"""
    import cupy
    stream = cupy.cuda.Stream(non_blocking=True)
    backend.barrier()
    with stream:
        stream.begin_capture()
        try:
            for _ in range(iters):
                backend.run(buffers)
        finally:
            graph = stream.end_capture()
    backend.barrier()
    start = time.perf_counter()
    for _ in range(launches):
        graph.launch(stream)
    stream.synchronize()
    backend.barrier()
    return (time.perf_counter() - start) / (iters * launches)


def check(backend, spec, args, nbytes, in_place):
    """Wrong elements on this process's ranks, from one call on fresh inputs."""
    dtype, op, n = args.dtype, args.op, backend.nranks
    _, out_count = spec.counts(nbytes, dtype.itemsize, n)
    fresh = allocate(backend, spec, args, nbytes, in_place)
    backend.run(fresh)
    wrong = 0
    for got, r in zip(backend.results(fresh), backend.local_ranks):
        want = spec.expected(dtype, op, n, r, out_count, args.root)
        if want is not None:  # e.g. reduce: only the root's output is defined
            wrong += count_wrong(backend.to_host(got), want)
    return wrong


def error_check(backend, spec, args, nbytes, in_place, seeded):
    """maxrel on this process's ranks, from one call on fresh seeded inputs."""
    _, out_count = spec.counts(nbytes, args.dtype.itemsize, backend.nranks)
    fresh = allocate(backend, spec, args, nbytes, in_place, seeded)
    backend.run(fresh)
    ref = seeded.reference(out_count)
    errors = [max_relative_error(backend.to_host(got), ref) for got in backend.results(fresh)]
    return float(np.max(errors)) if errors else 0.0


def picked_algorithm(backend, spec, args, in_count, in_place=None):
    """What our backend's calls ran (Communicator.chosen_algorithm): the
    algorithm, its own or what auto picks, a str with the execution path
    that ran it in `.path` (symmetric memory where --symmetric asks for it);
    `in_place` as chosen_algorithm takes it (None: as a call without `out`)."""
    nbytes = in_count * args.dtype.itemsize   # (with a compression, chosen_algorithm weighs the encoded size)
    return backend.comm.chosen_algorithm(spec.name, nbytes, root=args.root if spec.rooted else 0,
                                         dtype=args.dtype, in_place=in_place, compression=backend.compression,
                                         algorithm=backend.algorithm, symmetric=getattr(args, "symmetric", False))


def wire_bytes_per_rank(backend, spec, args, in_count):
    """Bytes one call makes a rank read from its peers (its plan's wire_bytes
    over the ranks; for the compiled loop's steps, the plan's that moves as
    much); None for backends other than ours (no plan to ask), and for a
    communicator across nodes, whose steps are no registered algorithm's plan."""
    if backend.algorithm is None:
        return None
    from collectives.algorithms import REGISTRY
    from collectives.plan import build_plan
    algorithm = picked_algorithm(backend, spec, args, in_count)
    if algorithm not in REGISTRY:   # ("hierarchical")
        return None
    plan = build_plan(spec.name, algorithm, backend.nranks, in_count,
                      args.dtype, collectives.ReduceOp(args.op), compression=backend.compression)
    per_rank = plan.wire_bytes / backend.nranks
    return int(per_rank) if per_rank == int(per_rank) else per_rank


def _mpi_max():
    from mpi4py import MPI
    return MPI.MAX


HEADER = (
    "#                                                              out-of-place                       in-place\n"
    "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong\n"
    "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)"
)


# With --compression, after the in-place columns (before the backend's):
# maxrel, the worse of both placements, and wire B, bytes read from peers per rank and call.
COMPRESSION_HEADER = ("", "    maxrel      wire B", "                (B/rank)")


def header(compressed=False):
    if not compressed:
        return HEADER
    return "\n".join(line + extra for line, extra in zip(HEADER.split("\n"), COMPRESSION_HEADER))


def format_row(row):
    cells = f"{row['size']:12d}  {row['count']:12d}  {row['type']:>8s}  {row['redop']:>6s}  {row['root']:6d}"
    for place in ("out_of_place", "in_place"):
        m = row[place]
        wrong = f"{m['wrong']:5d}" if m["wrong"] is not None else "    -"  # compressed: see maxrel
        cells += f"  {m['time_us']:7.1f}  {m['algbw']:6.2f}  {m['busbw']:6.2f}  {wrong}"
    if "wire_bytes" in row:
        cells += f"  {row['maxrel']:8.1e}" if row["maxrel"] is not None else f"  {'-':>8s}"
        cells += f"  {row['wire_bytes']:10.0f}" if row["wire_bytes"] is not None else f"  {'-':>10s}"
    return cells + f"  {row['backend']:>6s}" + (f"  {row['vs_first']:5.2f}x" if "vs_first" in row else "")


def wrong_count(rows):
    """Wrong elements in rows checked bitwise (compressed rows are not)."""
    return sum(r[place]["wrong"] or 0 for r in rows for place in ("out_of_place", "in_place"))


def worst_error(values):
    """The largest maxrel, NaN if any is NaN, None if none was measured."""
    values = [v for v in values if v is not None]
    return float(np.max(values)) if values else None


def footer(label, rows):
    """nccl-tests' two summary lines, for one backend (compressed: the largest maxrel instead)."""
    average = sum(r["out_of_place"]["busbw"] for r in rows) / max(len(rows), 1)
    if rows and all(r["out_of_place"]["wrong"] is None for r in rows):
        worst = worst_error(r.get("maxrel") for r in rows)
        checked = f"{worst:.2e} (approximate: not checked bitwise)" if worst is not None else "not checked"
        checked = f"# Max relative error  : {checked}"
    else:
        wrong = wrong_count(rows)
        checked = f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}"
    return (f"# Backend {label}\n{checked}\n"
            f"# Avg bus bandwidth    : {average:.3f} GB/s")


def main(spec, argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(spec, argv)
    cli.require_device_toolchain(f"python -m {module_name()}", args.device)
    world = mpi_world()
    if world is None and args.ranks > 1 and any(b in PROCESS_BACKENDS for b in args.backends) \
            and not os.environ.get(RELAUNCHED):
        if any(b in TORCH_BACKENDS for b in args.backends) \
                and not {*MPI_BACKENDS, *TENSORFLOW_BACKENDS} & set(args.backends):
            return relaunch_under_torchrun(args, argv)
        return relaunch_under_mpiexec(args, argv, ("-bind-to", bind_to(args.bind_to, args.ranks)))
    leader = world is None or world.rank == 0
    say = print if leader else (lambda *a, **k: None)
    nranks = world.size if world is not None else args.ranks
    if spec.rooted and not 0 <= args.root < nranks:
        say(f"# error: -r {args.root} is not a rank of {nranks}", file=sys.stderr)
        return 2
    if args.cudagraph and args.device != "cuda":
        say("# -G ignored: CUDA graphs apply to --device cuda")
    names = []
    for name in args.backends:
        reason = unsupported(name, spec, args)
        if reason:
            say(f"# {name} skipped: {reason}")
        else:
            names.append(name)
    if not names:
        say("# error: none of the backends asked for can run this", file=sys.stderr)
        return 2
    backends = make_backends(names, spec, args, world)
    mode = f"{nranks} processes" if world is not None else f"{nranks} virtual ranks in one process"
    mode += f" on {args.device}" if args.device != "host" else ""
    say(f"# collectives {spec.name} benchmark: {mode}, backends {', '.join(names)}, "
        f"algorithm {args.algorithm}, {args.iters} iterations after {args.warmup_iters} warm-up"
        + (f", compression {','.join(args.compressions)}" if args.compressed else ""))
    seeded = None
    if args.compressed:
        plain = [n for n in names if n not in COMPRESSING_BACKENDS]
        if plain:
            say(f"# {', '.join(plain)} run uncompressed: --compression applies to ours")
        say(f"# inputs: seeded standard-normal float32 per rank; maxrel = max |result - float64 {args.op}| "
            f"/ max |float64 {args.op}|; wire B = bytes read from peers per rank and call; "
            f"compressed rows: no bitwise #wrong")
        seeded = SeededInputs(spec, args.op, nranks)
    say(header(args.compressed) + ("  backend" + ("  vs first" if len(backends) > 1 else "")))
    itemsize = args.dtype.itemsize
    sweep = [s for s in sizes(args) if spec.param_count(s, itemsize, nranks) > 0]
    if len(sweep) < len(sizes(args)):
        say(f"# sizes under {nranks * itemsize} B skipped: less than one {args.dtype.name} per rank")
    showing = leader and not args.quiet and (sys.stderr.isatty() or os.environ.get(SHOW_PROGRESS) == "1")
    progress = Progress(spec.name, sweep, showing)
    rows = []
    for index, nbytes in enumerate(sweep):
        progress.size(index)
        in_count, out_count = spec.counts(nbytes, itemsize, nranks)
        size = spec.bytes_moved(nbytes, itemsize, nranks)
        first_time = None
        measured = measure(backends, spec, args, nbytes, world, progress, seeded)
        progress.clear()
        for backend, placements in zip(backends, measured):
            t_out = placements[0]["seconds"]
            row = {"backend": backend.label, "size": size, "count": spec.param_count(nbytes, itemsize, nranks),
                   "type": args.dtype.name, "redop": args.op if spec.has_op else "none",
                   "root": args.root if spec.rooted else -1}
            if backend.algorithm is not None:
                picked = picked_algorithm(backend, spec, args, in_count)
                row["algorithm"] = backend.algorithm
                row["picked"], row["path"] = picked.algorithm, picked.path
                if picked.step is not None:   # (the compiled loop's)
                    row["step"] = picked.step
            factor = spec.busbw_factor(nranks)
            for place, m in zip(("out_of_place", "in_place"), placements):
                seconds = m["seconds"]
                algbw = size / seconds / 1e9 if seconds > 0 else 0.0
                row[place] = {"time_us": seconds * 1e6, "algbw": algbw, "busbw": algbw * factor, "wrong": m["wrong"]}
                if args.compressed:
                    row[place]["maxrel"] = m["maxrel"]
            if args.compressed:
                row["compression"] = backend.compression or NO_COMPRESSION
                row["maxrel"] = worst_error(m["maxrel"] for m in placements)
                row["wire_bytes"] = wire_bytes_per_rank(backend, spec, args, in_count)
            if len(backends) > 1:
                first_time = first_time or t_out
                row["vs_first"] = t_out / first_time
            rows.append(row)
            say(format_row(row), flush=True)
    progress.finish()
    for backend in backends:
        say(footer(backend.label, [r for r in rows if r["backend"] == backend.label]))
    wrong = wrong_count(rows)
    worst = worst_error(r.get("maxrel") for r in rows)
    if args.output_file and leader:
        report = {"collective": spec.name, "environment": environment(args.device, nranks, names),
                  "rows": rows}
        cli.write_json(args.output_file, report, say)
    for backend in backends:
        backend.close()
    if isinstance(world, TorchWorld):
        world.close()
    say("# " + ("all results correct" if wrong == 0 else f"{wrong} WRONG elements")
        + (" (compressed rows: approximate, see maxrel)" if args.compressed and wrong == 0 else ""))
    if worst is not None and not np.isfinite(worst):
        say("# a result was not finite (maxrel nan or inf)")
        return 1
    return 1 if wrong else 0
