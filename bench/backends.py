"""The backends a benchmark runs side by side: this library (`ours`), MPI
(mpi4py over MPICH, or Open MPI: `mpich`, `openmpi`), Gloo (torch.distributed), and torch.distributed's
process groups by backend name (`torch:collectives`, this library through
torch.distributed; `torch:gloo`), TensorFlow's MultiWorkerMirroredStrategy
(`mwms`, also `tf:mwms`) and this library's TensorFlow ops in the same form
(`tf:collectives`), each behind one small class that runs a spec's call on its ranks'
buffers, and what each cannot do (so that the
harness skips it with a reason instead of failing).

Ranks in processes meet through a *world* (the harness's bookkeeping: the
slowest rank's time, the wrong elements over every rank): MPI's
COMM_WORLD under mpiexec, `TorchWorld` (a Gloo group) under torchrun."""

import argparse
import functools
import os
import socket
from dataclasses import dataclass

import numpy as np

import collectives
from collectives.ops import bfloat16, is_bfloat16, is_floating

OURS, MPI_BACKEND, GLOO, NCCL = "ours", "mpi", "gloo", "nccl"
# TensorFlow's MultiWorkerMirroredStrategy: its collectives (CollectiveReduceV2,
# a ring over gRPC between the workers on CPUs), one worker per process.
MWMS = "mwms"
# This library's TensorFlow ops (collectives.tensorflow) called the way mwms
# is: a tf.function per call on the rank's tf.Tensor, so the two compare like
# for like. `tf:mwms` names mwms beside it.
TF_COLLECTIVES, TF_MWMS = "tf:collectives", "tf:mwms"
TENSORFLOW_BACKENDS = (MWMS, TF_MWMS, TF_COLLECTIVES)
# Not a library: the memory-copy floor of a collective whose result each rank
# copies once (bench.host_vs_mpich's), see CopyFloor.
COPY_FLOOR = "floor"
# The collectives that have that floor, and the pieces of a rank's result it
# copies: the whole of it, from one rank, or a block from each rank.
WHOLE, BLOCKS = "whole", "blocks"
FLOOR_PIECES = {"allgather": BLOCKS, "broadcast": WHOLE, "gather": BLOCKS, "scatter": WHOLE, "all_to_all": BLOCKS}
# `mpi` is whichever MPI library the launch loaded (MPICH where the benchmark
# relaunches itself); `mpich` and `openmpi` name one, and a relaunch starts
# that library's launcher and Python (bench/mpis.py). One process loads one
# MPI library: a run takes one of them.
MPICH_BACKEND, OPENMPI_BACKEND = "mpich", "openmpi"
MPI_BACKENDS = (MPI_BACKEND, MPICH_BACKEND, OPENMPI_BACKEND)
# torch.distributed process groups of a registered backend, one rank per
# process: "torch:collectives" is this library behind torch.distributed (what
# its layer costs, beside `ours` in the same run), "torch:gloo" is Gloo's group
# made the same way (under torchrun, `gloo` is the same thing).
TORCH_PREFIX = "torch:"
TORCH_COLLECTIVES, TORCH_GLOO = "torch:collectives", "torch:gloo"
TORCH_BACKENDS = (TORCH_COLLECTIVES, TORCH_GLOO)
NO_COMPRESSION = "none"
# `host`, our backend's name before mpi and gloo joined it, is still accepted;
# rows keep the name the command used (older results files say `host`).
OLD_OURS = "host"
DEFAULT_BACKEND = OURS
BACKENDS = (OURS, OLD_OURS, *MPI_BACKENDS, GLOO, NCCL, *TORCH_BACKENDS, *TENSORFLOW_BACKENDS)
COMPRESSING_BACKENDS = (OURS, OLD_OURS)  # --compression applies to these; the others run uncompressed
PROCESS_BACKENDS = (*MPI_BACKENDS, GLOO, *TORCH_BACKENDS, *TENSORFLOW_BACKENDS)   # one rank per process
TORCH_PIN = "torch==2.13.0"
TENSORFLOW_INSTALL = "pip install -e '.[tensorflow]'"

MPI_OPS = ("sum", "prod", "max", "min")   # MPI has no average
# What torch.distributed's Gloo backend takes (torch 2.13): no 16-bit or
# unsigned types beyond uint8 ("Invalid scalar type"), and its average
# divides in the tensor's type, which it refuses for integers.
GLOO_DTYPES = ("int8", "uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64")
# What MultiWorkerMirroredStrategy's replica context reduces (TensorFlow 2.21:
# 8-bit types raise TypeError), with its two reductions; its MEAN of integers
# comes back as floats, where ours divides in the integer type.
MWMS_DTYPES = ("int32", "int64", "float16", "bfloat16", "float32", "float64")
MWMS_OPS = {"sum": "sum", "avg": "mean"}


def unsupported(backend, spec, args):
    """Why `backend` cannot run this spec with these flags, or None."""
    reduces = spec.has_op
    if backend in MPI_BACKENDS:
        if reduces and args.op not in MPI_OPS:
            return f"MPI has no {args.op!r} reduction (it has {', '.join(MPI_OPS)})"
        if reduces and is_bfloat16(args.dtype) and _mpi_bfloat16() is None:
            return "this MPI library has no bfloat16 type to reduce (mpi4py's BFLOAT16_T is null)"
    if backend in (GLOO, TORCH_GLOO, TORCH_COLLECTIVES) and spec.run_gloo is None:
        return f"no torch.distributed call for {spec.name}"
    if backend == TORCH_COLLECTIVES and reduces:
        from collectives.ops import SUPPORTED_DTYPES
        if args.dtype.name not in SUPPORTED_DTYPES:
            return f"collectives reduces {', '.join(SUPPORTED_DTYPES)}, not {args.dtype.name}"
    if backend == TF_COLLECTIVES:
        from collectives.ops import SUPPORTED_DTYPES
        if spec.run_tf is None:
            return f"collectives.tensorflow has no {spec.name}"
        if reduces and args.dtype.name not in SUPPORTED_DTYPES:
            return f"collectives reduces {', '.join(SUPPORTED_DTYPES)}, not {args.dtype.name}"
    if backend in (MWMS, TF_MWMS):
        if spec.run_mwms is None:
            return f"MultiWorkerMirroredStrategy's replica context has no {spec.name}"
        if args.dtype.name not in MWMS_DTYPES:
            return f"MultiWorkerMirroredStrategy has no {args.dtype.name} (it takes {', '.join(MWMS_DTYPES)})"
        if reduces and args.op not in MWMS_OPS:
            return f"MultiWorkerMirroredStrategy has no {args.op!r} reduction (it has {', '.join(MWMS_OPS)})"
        if reduces and args.op == "avg" and not is_floating(args.dtype):
            return "MultiWorkerMirroredStrategy's mean of integers is a float, not the integer average"
    if backend in (GLOO, TORCH_GLOO):
        if args.dtype.name not in GLOO_DTYPES:
            return f"Gloo has no {args.dtype.name} (it takes {', '.join(GLOO_DTYPES)})"
        if reduces and args.op == "avg" and not is_floating(args.dtype):
            return "Gloo averages floating-point types only"
    return None


def _mpi_bfloat16():
    from mpi4py import MPI
    datatype = getattr(MPI, "BFLOAT16_T", MPI.DATATYPE_NULL)
    return None if datatype == MPI.DATATYPE_NULL else datatype


def mpi_op(op):
    from mpi4py import MPI
    return {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}[op]


def mpi_buffer(array):
    """`array` as mpi4py takes it: NumPy infers the MPI type, except for
    bfloat16, which NumPy's buffer protocol does not describe."""
    if is_bfloat16(array.dtype):
        return [array.view(np.uint16), _mpi_bfloat16()]
    return array


def mpi_bytes(array):
    """`array` as bytes, for collectives that move data without reducing it (any type)."""
    from mpi4py import MPI
    return [array.view(np.uint8), MPI.BYTE]


def gloo_op(dist, op):
    return {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "max": dist.ReduceOp.MAX,
            "min": dist.ReduceOp.MIN, "avg": dist.ReduceOp.AVG}[op]


# -- backends ------------------------------------------------------------------

@dataclass
class Buffers:
    """One rank's arrays per local rank for one call shape."""
    inputs: list
    outputs: list
    in_place: list = None   # in place: each rank's one buffer, which inputs and outputs view


class Backend:
    """One way of running the collective on this process's ranks."""

    device = "host"
    algorithm = None
    compression = None   # the codec this backend's calls use (our backend only), None: uncompressed

    def __init__(self, name, spec, args):
        self.name, self.label, self.spec = name, name, spec
        self.args = argparse.Namespace(**vars(args))
        self.args.codec = None   # what run_ours passes as compression=

    def run(self, buffers):
        raise NotImplementedError

    def results(self, buffers):
        """Where each local rank's result is after run(buffers)."""
        return buffers.outputs

    def to_device(self, array):
        """A rank's array where this backend takes it."""
        return array

    def to_host(self, array):
        return array

    def close(self):
        pass


class Ours(Backend):
    """This library: virtual ranks in this process, or one rank per process
    under mpiexec. As `nccl`, the same API with backend="nccl": NCCL runs
    each collective (one rank per GPU: rank r on GPU r in one process)."""

    def __init__(self, name, spec, args, world, algorithm, comm=None, compression=NO_COMPRESSION):
        super().__init__(name, spec, args)
        # NCCL picks its own algorithm: the row names none (algorithm None),
        # and its calls pass the API's default, "auto", which the NCCL
        # executor takes (None is no algorithm name, and the API refuses it).
        self.algorithm = algorithm if name != NCCL else None
        self.args.algorithm = algorithm if name != NCCL else "auto"
        if name != NCCL and compression != NO_COMPRESSION:
            self.compression = self.args.codec = compression
        # The label names the algorithm when several run, and the codec when
        # any compression was asked for (ours:fp16, ours:ring:none, ...).
        self.label = name
        if name != NCCL and len(args.algorithms) > 1:
            self.label += f":{algorithm}"
        if name != NCCL and getattr(args, "compressed", False):
            self.label += f":{compression}"
        self.device = args.device
        library = "nccl" if name == NCCL else "ours"
        if comm is not None:  # another algorithm on the same ranks
            self.comm = comm
        elif world is None:
            if args.device == "host":
                devices = None
            elif library == "nccl":
                devices = [f"cuda:{r}" for r in range(args.ranks)]
            else:
                devices = ["cuda:0" if args.device == "cuda" else "emulated"] * args.ranks
            self.comm = collectives.Communicator.local(args.ranks, devices=devices, timeout=args.timeout,
                                                       backend=library)
        else:  # one rank per process, on the host or on this process's device (under torchrun: its store)
            self.comm = collectives.init(timeout=args.timeout, comm=None if isinstance(world, TorchWorld) else world,
                                         device=args.device, backend=library)
        self.local_ranks, self.nranks = list(self.comm.local_ranks), self.comm.size
        self.owns_comm = comm is None

    def run(self, buffers):
        self.spec.run_ours(self.comm, buffers.inputs, buffers.outputs, self.args)

    def symmetric(self, which, local, count, dtype):
        """The first `count` elements of symmetric buffer `which` (0: inputs,
        1: outputs) of local rank `local` (--symmetric): two comm.alloc'd
        buffers per rank, made once for the largest message, so every size
        uses the same memory at the same place on every rank."""
        if not hasattr(self, "_symmetric"):
            counts = self.spec.counts(self.args.maxbytes, 1, self.nranks)
            nbytes = -(-max(counts) // 16) * 16 + 16
            self._symmetric = []
            for _ in range(2):
                made = self.comm.alloc(nbytes, "uint8")
                self._symmetric.append(made if isinstance(made, list) else [made])
        return self._symmetric[which][local][:count * dtype.itemsize].view(dtype)

    def barrier(self):
        """Every rank here, and every rank's issued work done."""
        self.comm.synchronize()
        self.comm.barrier()

    def to_device(self, array):
        """A GPU copy on cuda; NumPy elsewhere (emulated devices work on NumPy arrays)."""
        if self.device == "cuda":
            import cupy
            return cupy.asarray(array)
        return array

    def to_host(self, array):
        if self.device == "cuda":
            import cupy
            return cupy.asnumpy(array)
        return array

    def close(self):
        if self.owns_comm:
            self.comm.close()


class Mpi(Backend):
    """mpi4py over the MPI library this process loaded (MPICH or Open MPI), one rank per process."""

    def __init__(self, name, spec, args, world):
        super().__init__(name, spec, args)
        if (world is None and args.ranks != 1) or isinstance(world, TorchWorld):
            raise SystemExit(f"the {name} backend runs one rank per process: run under mpiexec")
        from bench.mpis import loaded_mpi
        if name != MPI_BACKEND and loaded_mpi() != name:
            raise SystemExit(f"--backend {name}: this process's mpi4py loaded {loaded_mpi()}, not {name} "
                             "(run without a launcher: the benchmark starts the right one)")
        from mpi4py import MPI
        self.comm = world if world is not None else MPI.COMM_WORLD
        self.local_ranks, self.nranks = [self.comm.rank], self.comm.size

    def run(self, buffers):
        in_place = buffers.in_place is not None
        self.spec.run_mpi(self.comm, None if in_place else buffers.inputs[0],
                          buffers.in_place[0] if in_place else buffers.outputs[0], self.args)

    def results(self, buffers):
        where = self.spec.mpi_in_place_result
        if buffers.in_place is None or where is None:
            return buffers.outputs
        return [where(b, r, self.nranks) for b, r in zip(buffers.in_place, self.local_ranks)]

    def barrier(self):
        self.comm.Barrier()


class Gloo(Backend):
    """torch.distributed with Gloo, one rank per process, on tensors that share
    memory with the NumPy inputs (so fill and check are the same code)."""

    def __init__(self, name, spec, args, world):
        super().__init__(name, spec, args)
        if world is None and args.ranks != 1:
            raise SystemExit(f"the {name} backend runs one rank per process: run under mpiexec or torchrun")
        try:
            import torch
            import torch.distributed as dist
        except ImportError as error:
            raise SystemExit(f"--backend gloo needs PyTorch: pip install {TORCH_PIN} ({error})") from None
        self.torch, self.dist = torch, dist
        self.calls = dist   # run_gloo's torch.distributed: the default group's calls
        self.owns_group = default_group(world)
        self.local_ranks, self.nranks = [dist.get_rank()], dist.get_world_size()

    def run(self, buffers):
        in_place = buffers.in_place is not None
        self.spec.run_gloo(self.calls, None if in_place else buffers.inputs[0],
                           buffers.in_place[0] if in_place else buffers.outputs[0], self.args)

    def barrier(self):
        self.dist.barrier()

    def to_device(self, array):
        if is_bfloat16(array.dtype):  # the same two bytes, seen as torch's bfloat16
            return self.torch.from_numpy(array.view(np.int16)).view(self.torch.bfloat16)
        return self.torch.from_numpy(array)

    def to_host(self, tensor):
        if tensor.dtype == self.torch.bfloat16:
            return tensor.view(self.torch.int16).numpy().view(bfloat16())
        return tensor.numpy()

    def close(self):
        if self.owns_group and self.dist.is_initialized():
            self.dist.destroy_process_group()


class CopyFloor(Backend):
    """The memory-copy floor of a collective that moves bytes without
    reducing them, one rank per process: each call, every rank copies into
    its result, once, the bytes the collective must bring it, from a private
    array that holds them, every rank at the same time. The result is one
    piece from one rank (broadcast, scatter: all of it, but at the root in
    place, where it is there already) or a block from every rank (allgather,
    all_to_all, and gather at the root: every block but its own in place,
    all of them out of place; a gather's other ranks receive nothing). An
    implementation that copies each byte once, straight from a peer's array,
    moves the same bytes through the same memory, so its time over this one
    says how near it comes to the floor (the check holds this backend to
    the collective's result too: it copies the right bytes)."""

    def __init__(self, name, spec, args, world):
        super().__init__(name, spec, args)
        if spec.name not in FLOOR_PIECES:
            raise ValueError(f"the copy floor is of {', '.join(FLOOR_PIECES)}, not of {spec.name}")
        self.comm = world
        self.local_ranks, self.nranks = [world.rank], world.size
        self._prepared = (None, [])

    def _copies(self, buffers):
        """(destination, source) pairs for these buffers, made on their first call (untimed: warm-up)."""
        if self._prepared[0] is not buffers:
            rank, n, args = self.local_ranks[0], self.nranks, self.args
            result = self.results(buffers)[0]
            wanted = self.spec.expected(args.dtype, args.op, n, rank, len(result), args.root)
            in_place = buffers.in_place is not None
            if wanted is None:   # a rank whose output the collective leaves alone (gather's non-roots)
                pieces = []
            elif FLOOR_PIECES[self.spec.name] == WHOLE:
                pieces = [] if in_place and rank == args.root else [slice(0, len(result))]
            else:
                block = len(result) // n
                pieces = [slice(r * block, (r + 1) * block) for r in range(n) if not (in_place and r == rank)]
            self._prepared = (buffers, [(result[p], np.array(wanted[p])) for p in pieces])
        return self._prepared[1]

    def run(self, buffers):
        for destination, source in self._copies(buffers):
            np.copyto(destination, source)

    def barrier(self):
        self.comm.Barrier()


class TorchGroup(Gloo):
    """A torch.distributed process group of a registered backend
    (`torch:collectives`: this library's, collectives.torch; `torch:gloo`),
    made with new_group beside the default group, one rank per process.
    Runs the spec's torch.distributed call (run_gloo) on that group."""

    def __init__(self, name, spec, args, world):
        super().__init__(name, spec, args, world)
        backend = name[len(TORCH_PREFIX):]
        if backend == "collectives":
            import collectives.torch  # noqa: F401  (registers the backend)
        self.group = self.dist.new_group(backend=backend)
        self.calls = GroupCalls(self.dist, self.group)

    def barrier(self):
        self.dist.barrier(group=self.group)

    def close(self):
        if self.dist.is_initialized():
            self.dist.destroy_process_group(self.group)
        super().close()


class GroupCalls:
    """torch.distributed's module as run_gloo uses it, bound to one group:
    the collectives and get_rank/get_world_size take group=, the rest
    (ReduceOp...) passes through."""

    def __init__(self, dist, group):
        self._dist, self._group = dist, group

    def __getattr__(self, name):
        found = getattr(self._dist, name)
        if callable(found) and not isinstance(found, type) and name[:1].islower() and name != "is_initialized":
            return functools.partial(found, group=self._group)
        return found


# The process's MultiWorkerMirroredStrategy, once made: TensorFlow's runtime
# joins one cluster per process, so every mwms backend of a process shares it.
_STRATEGIES = []


def _tensorflow(backend):
    """TensorFlow, set up once per process for the ranks' shared cores (as
    bench.tensorflow_overhead); `backend` names who asked, for the error."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")   # TensorFlow's start-up banners
    try:
        import tensorflow as tf
    except ImportError as error:
        raise SystemExit(f"--backend {backend} needs TensorFlow: {TENSORFLOW_INSTALL} ({error})") from None
    if not _TENSORFLOW_SET:
        # Both settings, and MWMS's strategy, must come before TensorFlow's first op.
        tf.config.threading.set_inter_op_parallelism_threads(2)
        tf.config.threading.set_intra_op_parallelism_threads(1)
        _TENSORFLOW_SET.append(True)
    return tf


_TENSORFLOW_SET = []


class TensorFlowBackend(Backend):
    """What the TensorFlow backends share: a rank per process on the world,
    tf.Tensors in and out, and the last call's result kept for the check
    (TensorFlow's tensors are immutable: every call returns a new one)."""

    def __init__(self, name, spec, args, world, unit="rank"):
        super().__init__(name, spec, args)
        if world is None or isinstance(world, TorchWorld):
            raise SystemExit(f"the {name} backend runs one {unit} per process: run under mpiexec")
        self.tf, self.world = _tensorflow(name), world
        self.local_ranks, self.nranks = [world.rank], world.size
        self.last = (None, None)   # (the Buffers of the last call, its result)

    def results(self, buffers):
        ran, result = self.last
        if ran is not buffers:
            raise RuntimeError(f"results() of buffers the {self.name} backend did not run last")
        return [result]

    def barrier(self):
        self.world.Barrier()   # a call returns when its result is made: nothing is left in flight

    def to_device(self, array):
        return self.tf.constant(array)

    def to_host(self, tensor):
        return tensor.numpy()

    def close(self):
        if self.owns_comm:
            self.comm.close()


class Mwms(TensorFlowBackend):
    """TensorFlow's tf.distribute.MultiWorkerMirroredStrategy, one worker per
    process, started from our ranks (collectives.tensorflow.cluster_resolver:
    the workers' addresses go round through a communicator of ours, used
    for nothing else; the process's first mwms backend makes the strategy,
    any later one shares it). A call is what a training step runs: one tf.function
    of strategy.run whose replica makes the spec's call (run_mwms) on the
    rank's tf.Tensor, traced once per shape. TensorFlow's tensors are
    immutable: every call returns a new tensor, in place or not (both
    columns time the same call), and the check reads the last call's."""

    def __init__(self, name, spec, args, world, comm=None):
        super().__init__(name, spec, args, world, unit="worker")
        tf = self.tf
        import collectives.tensorflow as ctf
        if not _STRATEGIES:
            # (our backend's communicator where it runs too, else one of its own)
            self.owns_comm = comm is None
            self.comm = collectives.init(comm=world, timeout=args.timeout) if comm is None else comm
            resolver = ctf.cluster_resolver(self.comm)
            _STRATEGIES.append(tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver))
        else:
            self.owns_comm, self.comm = False, None
        self.strategy = _STRATEGIES[0]
        call, call_args, strategy = spec.run_mwms, self.args, self.strategy

        @tf.function
        def step(x):
            # tf.identity puts the input on the replica's device (a captured
            # tensor has none, and the strategy refuses it: "destinations empty")
            return strategy.run(lambda: call(tf.distribute.get_replica_context(), tf.identity(x), call_args))

        self.step = step

    def run(self, buffers):
        result = self.step(buffers.inputs[0])
        self.last = (buffers, self.strategy.experimental_local_results(result)[0])


class TfCollectives(TensorFlowBackend):
    """This library's TensorFlow ops (collectives.tensorflow), one rank per
    process, called as the mwms backend calls MultiWorkerMirroredStrategy:
    one tf.function per call, traced once per shape, whose body is the
    spec's op (run_tf) on the rank's tf.Tensor: a node of our graph op. On
    our backend's communicator where it runs too, else one of its own. As
    for mwms, every call returns a new tensor: in place and out of place
    time the same call, and the check reads the last call's."""

    def __init__(self, name, spec, args, world, comm=None):
        super().__init__(name, spec, args, world)
        import collectives.tensorflow as ctf
        self.device = "host"
        self.owns_comm = comm is None
        self.comm = collectives.init(comm=world, timeout=args.timeout) if comm is None else comm
        call, call_args, comm = spec.run_tf, self.args, self.comm
        self.step = self.tf.function(lambda x: call(ctf, comm, x, call_args))

    def run(self, buffers):
        self.last = (buffers, self.step(buffers.inputs[0]))


class TorchWorld:
    """The harness's world under torchrun (no MPI): mpi4py's few calls it
    makes (rank, size, allreduce, allgather, bcast), on torch.distributed's
    default group, Gloo's, which torchrun's environment starts (env://).
    Only bookkeeping runs on it, outside the timed loops."""

    MAX = "max"

    def __init__(self):
        import torch.distributed as dist
        self.dist = dist
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def allgather(self, value):
        everyone = [None] * self.size
        self.dist.all_gather_object(everyone, value)
        return everyone

    def allreduce(self, value, op=None):
        everyone = self.allgather(value)
        return max(everyone) if op == self.MAX else sum(everyone)

    def bcast(self, value, root=0):
        sent = [value]
        self.dist.broadcast_object_list(sent, src=root)
        return sent[0]

    def close(self):
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


def launched_by_torchrun(environ=os.environ):
    """Whether torchrun (or torch.distributed's env:// convention) started this
    process, and no MPI launcher did."""
    from collectives.bootstrap import LAUNCHER_VARIABLES, TORCHRUN_VARIABLES
    return all(v in environ for v in TORCHRUN_VARIABLES) and not any(v in environ for v in LAUNCHER_VARIABLES)


def default_group(world):
    """Make torch.distributed's default group (Gloo) unless one exists; True
    when this made it. Under mpiexec Gloo meets its peers through a TCP
    store: rank 0 picks a free port and MPI tells the others, with the
    address they reach rank 0 at: 127.0.0.1 where every rank runs on rank
    0's host, else the address rank 0's host name resolves to (ranks on
    other hosts, bench.hosts' included, cannot reach its loopback)."""
    import torch.distributed as dist
    if dist.is_initialized():
        return False
    rank, size = (world.rank, world.size) if world is not None else (0, 1)
    host = socket.gethostname()
    where = (host, free_port()) if rank == 0 else None
    if world is not None:
        where = world.bcast(where, root=0)
        one_host = world.allreduce(int(host == where[0]), op=_mpi_min()) == 1
    else:
        one_host = True
    address = "127.0.0.1" if one_host else socket.gethostbyname(where[0])
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{where[1]}", rank=rank, world_size=size)
    return True


def free_port():
    """A TCP port that nothing listens on now (on any address: the store may listen on every one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _mpi_min():
    from mpi4py import MPI
    return MPI.MIN


def make_backends(names, spec, args, world):
    backends = []
    for name in names:
        if name in (OURS, OLD_OURS):
            shared = None  # every algorithm and codec runs on the same communicator
            for algorithm in args.algorithms:
                for compression in getattr(args, "compressions", [NO_COMPRESSION]):
                    backends.append(Ours(name, spec, args, world, algorithm, comm=shared, compression=compression))
                    shared = backends[-1].comm
        elif name == NCCL:
            backends.append(Ours(name, spec, args, world, "auto"))
        elif name in MPI_BACKENDS:
            backends.append(Mpi(name, spec, args, world))
        elif name == COPY_FLOOR:
            backends.append(CopyFloor(name, spec, args, world))
        elif name in TORCH_BACKENDS:
            backends.append(TorchGroup(name, spec, args, world))
        elif name in TENSORFLOW_BACKENDS:
            ours = next((b.comm for b in backends if isinstance(b, (Ours, TfCollectives)) and b.device == "host"),
                        None)
            backends.append((TfCollectives if name == TF_COLLECTIVES else Mwms)(name, spec, args, world, comm=ours))
        else:
            backends.append(Gloo(name, spec, args, world))
    return backends
