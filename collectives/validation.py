"""Argument checks, all done before a collective touches a byte.

Each check raises InvalidUsageError with a sentence that names the argument,
the rank and what was expected, so a rejected call modifies nothing and says
why. Arrays are checked as `arrays.ArrayInfo`s, whatever library made them;
which arrays a rank takes is its executor's say (`host_only`, `locations`).
"""

import operator

import numpy as np

from . import arrays
from .errors import InvalidUsageError

# How a rank's output relates to its input, for binding.py.
DISJOINT, SAME, OVERLAPPING = "disjoint", "same", "overlapping"


def rank_arrays(x, nlocal, ranks, name="x"):
    """`x` as (arrays, ArrayInfos), one per local rank, and whether it came as
    a sequence. `ranks.host_only` asks for NumPy arrays; `ranks.locations`,
    when not None, says where each rank's array must be (ArrayInfo.device).

    A communicator that owns one rank takes a bare array (or a sequence of
    one); one that owns several takes a sequence with one array per rank.
    """
    if isinstance(x, (list, tuple)):
        if len(x) != nlocal:
            raise InvalidUsageError(f"{name} holds {len(x)} arrays but this communicator owns {nlocal} ranks")
        objects, as_sequence = list(x), True
    elif arrays.is_array(x):
        if nlocal != 1:
            raise InvalidUsageError(
                f"this communicator owns {nlocal} ranks, so {name} must be a sequence of {nlocal} arrays, "
                "one per local rank")
        objects, as_sequence = [x], False
    else:
        raise InvalidUsageError(f"{name} must be an array or a sequence of them, got {type(x).__name__}")
    infos = []
    describe = arrays.describe
    for rank, obj in enumerate(objects):
        if ranks.host_only and not isinstance(obj, np.ndarray):
            _refuse_for_host(obj, _name(name, rank, as_sequence))
        try:
            infos.append(describe(obj))
        except InvalidUsageError:
            describe(obj, _name(name, rank, as_sequence))  # the same error, naming the argument
            raise
    locations = ranks.locations
    if locations is not None and [info.device for info in infos] != locations:
        for rank, (info, location) in enumerate(zip(infos, locations)):
            if info.device != location:
                where = "host memory" if info.device == arrays.HOST else info.device
                raise InvalidUsageError(
                    f"{_name(name, rank, as_sequence)} is in {where}, but local rank {rank} lives on "
                    f"{ranks.rank_devices[rank].name}; pass arrays in {location} for it")
    return objects, infos, as_sequence


def _name(name, rank, as_sequence):
    return f"{name}[{rank}]" if as_sequence else name


def _refuse_for_host(obj, name):
    """A host communicator was given something other than a NumPy array:
    say what, and which communicator takes it, without touching it."""
    if arrays.is_array(obj):
        kind = type(obj)
        raise InvalidUsageError(
            f"{name} is a {kind.__module__}.{kind.__name__}; this communicator works on NumPy (host) arrays. "
            "For GPU arrays make a GPU communicator: collectives.init(device='cuda') with one rank per "
            "process (mpiexec), or Communicator.local(n, devices=[...]) for ranks in this process")
    raise InvalidUsageError(f"{name} must be a NumPy array, got {type(obj).__name__}")


def same_dtype_and_shape(infos, name="x"):
    dtype, shape = infos[0].dtype, infos[0].shape
    for info in infos:
        if info.dtype is not dtype or info.shape != shape:
            break
    else:
        return
    for i, a in enumerate(infos[1:], start=1):
        if a.dtype != dtype:
            raise InvalidUsageError(f"{name}[{i}] has dtype {a.dtype} but {name}[0] has {dtype}")
        if a.shape != shape:
            raise InvalidUsageError(f"{name}[{i}] has shape {a.shape} but {name}[0] has {shape}")


def writable(infos, name):
    for i, a in enumerate(infos):
        if not a.writable:
            raise InvalidUsageError(f"{name}[{i}] is read-only, but the collective writes it")


def output_arrays(out, nlocal, count, dtype, ranks):
    """Validate caller-given outputs: `count` elements of `dtype` each."""
    objects, infos, _ = rank_arrays(out, nlocal, ranks, name="out")
    for i, o in enumerate(infos):
        if o.dtype != dtype:
            raise InvalidUsageError(f"out[{i}] has dtype {o.dtype}, expected {dtype} like the input")
        if o.size != count:
            raise InvalidUsageError(f"out[{i}] has {o.size} elements, expected {count}")
    return objects, infos


def _overlap(a, b):
    return a.device == b.device and a.address < b.address + b.nbytes and b.address < a.address + a.nbytes \
        and a.size and b.size


def no_overlap_between_ranks(inputs, outputs):
    """No output may share memory with another local rank's input or output:
    two ranks writing one buffer (or one reading what another writes) race.
    A rank's own input and output may overlap (see `relation`).

    One sweep over the buffers sorted by address, keeping those still open:
    linear for buffers that do not overlap, the usual case."""
    spans = [(a.device, a.address, a.address + a.size * a.dtype.itemsize, rank, kind)
             for kind, infos in (("input", inputs), ("out", outputs)) for rank, a in enumerate(infos) if a.size]
    spans.sort()
    open_spans = []
    for device, start, end, rank, kind in spans:
        open_spans = [s for s in open_spans if s[0] == device and s[2] > start]
        for _, _, _, other_rank, other_kind in open_spans:
            if other_rank != rank and "out" in (kind, other_kind):
                raise InvalidUsageError(
                    f"{other_kind} of local rank {other_rank} and {kind} of local rank {rank} share memory")
        open_spans.append((device, start, end, rank, kind))


def relation(inputs, outputs, same_chunks):
    """SAME when `same_chunks(rank, input, output)` holds for every rank (its
    output is its input, chunk for chunk); DISJOINT when no rank's input and
    output share memory; else OVERLAPPING."""
    kinds = set()
    for rank, (i, o) in enumerate(zip(inputs, outputs)):
        if same_chunks(rank, i, o):
            kinds.add(SAME)
        elif _overlap(i, o):
            kinds.add(OVERLAPPING)
        else:
            kinds.add(DISJOINT)
    return kinds.pop() if len(kinds) == 1 else OVERLAPPING


def root_rank(root, size):
    if isinstance(root, bool):
        raise InvalidUsageError(f"root must be a rank number, got {root!r}")
    try:
        value = operator.index(root)
    except TypeError:
        raise InvalidUsageError(f"root must be an integer rank, got {type(root).__name__}") from None
    if not 0 <= value < size:
        raise InvalidUsageError(f"root {value} is out of range for a communicator of size {size}")
    return value
