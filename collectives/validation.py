"""Argument checks, all done before a collective touches a byte.

Each check raises InvalidUsageError with a sentence whose first words name
the argument (`op: unknown ...`, `x[1] has dtype ...`), then what was wrong
and what was expected, so a rejected call modifies nothing and says why. The checks run
in the order a caller makes mistakes, so that the first one reported is the
real one: the call's own arguments (op, algorithm, compression, root), then
each array on its own (count per local rank, type, dtype, layout, device),
then what relates arguments and arrays (compression and dtype), then arrays
to each other (dtypes and shapes across ranks, `out` against `x`), and last
the memory they share. Arrays are checked as `arrays.ArrayInfo`s, whatever
library made them; which arrays a rank takes is its executor's say
(`host_only`, `locations`).
"""

import contextlib
import operator

import numpy as np

from . import arrays
from .algorithms import REGISTRY
from .algorithms.schedule import ALL_TO_ALL, ALL_TO_ALL_V, ALLREDUCE, REDUCING_COLLECTIVES, ROOTED_COLLECTIVES
from .compression import wire
from .errors import InvalidUsageError
from .ops import ReduceOp

# How a rank's output relates to its input, for binding.py.
DISJOINT, SAME, OVERLAPPING = "disjoint", "same", "overlapping"

_OPS = {**{o.value: o for o in ReduceOp}, **{o: o for o in ReduceOp}}
_OP_NAMES = ", ".join(repr(o.value) for o in ReduceOp)
# Compressed allreduce sums in float32 (compression/wire.py).
_COMPRESSED_OPS = (ReduceOp.SUM, ReduceOp.AVG)


def reduce_op(op, name="op"):
    """`op` as a ReduceOp: a ReduceOp, or its name in any case."""
    try:
        return _OPS[op]
    except (KeyError, TypeError):
        pass
    if isinstance(op, str) and op.lower() in _OPS:
        return _OPS[op.lower()]
    raise InvalidUsageError(
        f"{name}: unknown reduction {op!r}; expected one of {_OP_NAMES} (or a collectives.ReduceOp)")


def algorithm_name(algorithm, collective):
    """`algorithm` checked: "auto", or a registered algorithm that implements `collective`."""
    if not isinstance(algorithm, str):
        raise InvalidUsageError(f"algorithm: expected a name such as 'auto' or 'ring', got {type(algorithm).__name__}")
    if algorithm == "auto":
        return algorithm
    spec = REGISTRY.get(algorithm)
    if spec is None:
        valid = ", ".join(repr(name) for name in ["auto", *REGISTRY])
        raise InvalidUsageError(f"algorithm: unknown algorithm {algorithm!r}; expected one of {valid}")
    if collective not in spec.collectives:
        able = ", ".join(repr(name) for name, s in REGISTRY.items() if collective in s.collectives)
        raise InvalidUsageError(f"algorithm: {algorithm!r} does not implement {collective}; these do: 'auto', {able}")
    return algorithm


def compression_codec(compression, op, collective=ALLREDUCE):
    """`compression` checked on its own and against `op`: None, or a codec
    name for an allreduce whose op is sum or avg. (Its dtype is checked by
    `compressed_dtype`, once the arrays are known.)"""
    if compression is None:
        return None
    if not isinstance(compression, str) or compression not in wire.CODECS:
        raise InvalidUsageError(f"compression: unknown codec {compression!r}; expected None or one of "
                                f"{', '.join(map(repr, wire.CODECS))}")
    if collective != ALLREDUCE:
        raise InvalidUsageError(f"compression: applies to allreduce, not {collective}")
    if op not in _COMPRESSED_OPS:
        raise InvalidUsageError(f"compression: {compression!r} works with op 'sum' or 'avg', got op {op.value!r}")
    return compression


def compressed_dtype(compression, dtype):
    if compression is not None and dtype != np.float32:
        raise InvalidUsageError(f"compression: {compression!r} takes float32 arrays (it accumulates in float32), "
                                f"got {dtype}; pass compression=None for other dtypes")


def call_arguments(collective, op, root, algorithm, compression, size):
    """A call's own arguments, checked before its arrays: (op as a ReduceOp,
    root as an int). `op` counts for reducing collectives only, `root` for
    broadcast, reduce, gather and scatter only (others get SUM and 0)."""
    op = reduce_op(op) if collective in REDUCING_COLLECTIVES else ReduceOp.SUM
    algorithm_name(algorithm, ALL_TO_ALL if collective == ALL_TO_ALL_V else collective)   # (its schedules)
    compression_codec(compression, op, collective)
    root = root_rank(root, size) if collective in ROOTED_COLLECTIVES else 0
    return op, root


@contextlib.contextmanager
def naming(argument):
    """Checks made elsewhere (a device spec's, say) whose InvalidUsageError
    should name `argument` first, as every message of the API does."""
    try:
        yield
    except InvalidUsageError as error:
        if str(error).startswith(argument):
            raise
        raise InvalidUsageError(f"{argument}: {error}") from None


def rank_arrays(x, nlocal, ranks, name="x"):
    """`x` as (arrays, ArrayInfos), one per local rank, and whether it came as
    a sequence. `ranks.host_only` asks for NumPy arrays; `ranks.locations`,
    when not None, says where each rank's array must be (ArrayInfo.device).

    A communicator that owns one rank takes a bare array (or a sequence of
    one); one that owns several takes a sequence with one array per rank.
    """
    if isinstance(x, (list, tuple)):
        if len(x) != nlocal:
            raise InvalidUsageError(f"{name}: {len(x)} arrays given for {nlocal} local ranks; "
                                    f"pass one array per local rank")
        objects, as_sequence = list(x), True
    elif arrays.is_array(x):
        if nlocal != 1:
            raise InvalidUsageError(
                f"{name}: one array given, but this communicator owns {nlocal} local ranks; pass a list of "
                f"{nlocal} arrays, one per local rank")
        objects, as_sequence = [x], False
    else:
        raise InvalidUsageError(f"{name}: expected an array or a list of arrays (one per local rank), "
                                f"got {type(x).__name__}")
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
    """How messages name local rank `rank`'s array: `name`[rank], or where
    the rank's index is not last, `name` with "{rank}" in it (allreduce_many's
    arrays[{rank}][3])."""
    if "{rank}" in name:
        return name.format(rank=rank)
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
    first = _name(name, 0, True)
    for i, a in enumerate(infos[1:], start=1):
        if a.dtype != dtype:
            raise InvalidUsageError(f"{_name(name, i, True)} has dtype {a.dtype} but {first} has {dtype}")
        if a.shape != shape:
            raise InvalidUsageError(f"{_name(name, i, True)} has shape {a.shape} but {first} has {shape}")


def writable(infos, name, written=None, writer="the collective"):
    """Every array the call (`writer`, as the message names it) writes is
    writable: `infos` (one per local rank), those whose index `written`
    says when not all."""
    for i, a in enumerate(infos):
        if not a.writable and (written is None or written(i)):
            raise InvalidUsageError(f"{_name(name, i, True)} is read-only, but {writer} writes it")


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


def ranks_own_their_memory(inputs, outputs, out_given, inputs_written, objects=None):
    """No local rank may write memory that another local rank reads or
    writes: they would race. A rank's own input and output may overlap (see
    `relation`); ranks may share an input that nobody writes.

    `out_given`: the caller passed `out` (named so in messages); else the
    outputs are the inputs or views of them (`inputs_written`, the inputs
    then count as written) or new arrays (not checked). `objects`, the
    arrays by name ({"x": inputs, "out": outputs}), tell the same array
    from two views of one memory.

    One sweep over the buffers sorted by address, keeping those still open:
    linear for buffers that do not overlap, the usual case."""
    spans = [(a.device, a.address, a.address + a.nbytes, rank, "x", inputs_written)
             for rank, a in enumerate(inputs) if a.size]
    if out_given:
        spans += [(a.device, a.address, a.address + a.nbytes, rank, "out", True)
                  for rank, a in enumerate(outputs) if a.size]
    spans.sort()
    open_spans = []
    for span in spans:
        device, start = span[0], span[1]
        open_spans = [s for s in open_spans if s[0] == device and s[2] > start]
        for other in open_spans:
            if other[3] != span[3] and (other[5] or span[5]):
                _shared_memory(other, span, objects)
        open_spans.append(span)


def _shared_memory(a, b, objects):
    """Raise for spans `a` and `b` (device, start, end, rank, name, written)
    of two local ranks that share memory."""
    if a[4] != b[4]:   # an output over another rank's input: name the output first
        a, b = (a, b) if a[4] == "out" else (b, a)
        raise InvalidUsageError(
            f"out[{a[3]}] shares memory with x[{b[3]}], the input of local rank {b[3]}; local rank {a[3]}'s "
            "output may overlap its own input only")
    name = a[4]
    first, second = sorted((a[3], b[3]))
    if a[1:3] == b[1:3]:
        same = objects is not None and objects[name][first] is objects[name][second]
        what = "the same array is given" if same else "the same memory is given (two views of it)"
        raise InvalidUsageError(
            f"{name}: {what} for local ranks {first} and {second}; each local rank needs an array of its own, "
            "since the collective writes it")
    raise InvalidUsageError(
        f"{name}: {name}[{first}] and {name}[{second}] overlap in memory; each local rank needs memory of its "
        "own, since the collective writes it")


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


def rank_name(name, rank, as_sequence):
    """`name`, or `name[rank]` where the argument is a list, one per local rank."""
    return _name(name, rank, as_sequence)


def block_counts(counts, nlocal, size, as_sequence, name):
    """all_to_all_v's `send_counts` or `recv_counts`: per local rank a tuple
    of `size` ints >= 0 (a list of such where `x` is a list)."""
    rows = counts if as_sequence else [counts]
    if as_sequence and (not isinstance(counts, (list, tuple)) or len(counts) != nlocal):
        raise InvalidUsageError(f"{name}: expected a list of {nlocal} rows (one per local rank) of {size} counts, "
                                f"got {counts!r}")
    checked = []
    for i, row in enumerate(rows):
        label = _name(name, i, as_sequence)
        try:
            values = [operator.index(c) for c in row]
        except TypeError:
            raise InvalidUsageError(f"{label}: expected {size} ints >= 0, one per rank, got {row!r}") from None
        if len(values) != size or any(c < 0 for c in values):
            raise InvalidUsageError(f"{label}: expected {size} ints >= 0, one per rank, got {list(values)}")
        checked.append(tuple(values))
    return checked


def received_counts(matrix, expects, out_sizes, as_sequence, every_rank=False):
    """all_to_all_v's counts against each other: `matrix[q][r]` elements go
    from rank q to rank r; rank r's recv_counts (`expects[r]`, None where
    not given) must be column r, and its `out` (`out_sizes[r]` elements,
    None where not given) their sum. `every_rank`: the rows of every rank,
    exchanged, which every rank checks alike and so raises alike."""
    for r, expected in enumerate(expects or ()):
        column = tuple(row[r] for row in matrix)
        if expected is not None and tuple(expected) != column:
            q = next(q for q in range(len(matrix)) if expected[q] != column[q])
            label = f"rank {r}'s recv_counts" if every_rank else _name("recv_counts", r, as_sequence)
            raise InvalidUsageError(f"{label}: expects {expected[q]} elements from rank {q}, which sends "
                                    f"{column[q]}; every rank's counts must match its peers' (nothing was written)")
    for r, elements in enumerate(out_sizes or ()):
        receives = sum(row[r] for row in matrix)
        if elements is not None and elements != receives:
            label = f"rank {r}'s out" if every_rank else _name("out", r, as_sequence)
            raise InvalidUsageError(f"{label}: has {elements} elements, but the rank receives {receives}")


# The ops whose gradient is the same collective again (frameworks' gradients).
GRADIENT_OPS = (ReduceOp.SUM, ReduceOp.AVG)


def gradient_op(op):
    """`op` checked for gradients: avg (the mean over ranks) or sum."""
    op = reduce_op(op)
    if op not in GRADIENT_OPS:
        raise InvalidUsageError(f"op: gradients are averaged ('avg') or summed ('sum'), got {op.value!r}")
    return op


def one_rank_in_this_process(comm, name, needed_by):
    """`comm`, a communicator with one rank in this process (what a
    framework's helpers take: collectives.init() under mpiexec, or
    Communicator.local(1)); `needed_by` names them in the error."""
    if len(getattr(comm, "local_ranks", ())) != 1 or not hasattr(comm, "allgather"):
        raise InvalidUsageError(
            f"{name}: {needed_by} need a communicator with one rank in this process: "
            "collectives.init() (under mpiexec, one process per rank) or Communicator.local(1)")
    return comm


def root_rank(root, size):
    return rank_number(root, size, "root")


def rank_number(rank, size, name):
    """A rank argument (`name`: root, peer): an int in [0, size)."""
    value = _integer(rank, name, "a rank number (an int)")
    if not 0 <= value < size:
        raise InvalidUsageError(f"{name}: {value} is out of range; this communicator's ranks are 0 to {size - 1}")
    return value


def _integer(value, name, expected):
    """`value` as an int (a NumPy integer too, not a bool), or InvalidUsageError naming `name`."""
    if isinstance(value, bool):
        raise InvalidUsageError(f"{name}: expected {expected}, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidUsageError(f"{name}: expected {expected}, got {type(value).__name__}") from None


def byte_count(nbytes, name="nbytes"):
    """A size in bytes: an int >= 0."""
    value = _integer(nbytes, name, "a number of bytes (an int)")
    if value < 0:
        raise InvalidUsageError(f"{name}: {value} is negative")
    return value


# Tags travel in a slot's int64 word; MPI guarantees at least 32767.
MAX_TAG = (1 << 62) - 1


def message_tag(tag):
    """A point-to-point call's tag: an int, 0 <= tag <= MAX_TAG."""
    value = _integer(tag, "tag", "an int")
    if not 0 <= value <= MAX_TAG:
        raise InvalidUsageError(f"tag: {value} is out of range; tags are 0 to {MAX_TAG}")
    return value


def message_bytes(array, ranks, name, written):
    """A point-to-point call's array as a flat view of its bytes: one
    C-contiguous array of a supported dtype (writable where `written`)."""
    if array.__class__ is np.ndarray and ranks.host_only and array.dtype in MESSAGE_DTYPES:
        flags = array.flags   # the common case, decided without describing the array
        if flags.c_contiguous and (flags.writeable or not written):
            return array.reshape(-1).view(np.uint8)
    objects, infos, _ = rank_arrays(array, 1, ranks, name=name)   # (describing refuses other layouts)
    if written:
        writable(infos, name, writer="the receive")
    return objects[0].reshape(-1).view(np.uint8)


def _message_dtypes():
    """The supported dtypes as dtype objects (ops.supported_dtype_set)."""
    from .ops import supported_dtype_set
    return supported_dtype_set()


MESSAGE_DTYPES = _message_dtypes()


def allocation(shape, dtype):
    """Communicator.alloc's (shape as a tuple of ints, np.dtype), or
    InvalidUsageError naming the argument."""
    from .ops import SUPPORTED_DTYPES, bfloat16, is_bfloat16
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        dims = tuple(operator.index(d) for d in shape)
    except TypeError:
        raise InvalidUsageError(f"shape: expected an int or a sequence of ints, got {shape!r}") from None
    if any(d < 0 for d in dims):
        raise InvalidUsageError(f"shape: dimensions must be >= 0, got {dims}")
    try:
        kind = bfloat16() if str(dtype) == "bfloat16" else np.dtype(dtype)
    except TypeError:
        kind = None
    if kind is None or (kind.name not in SUPPORTED_DTYPES and not is_bfloat16(kind)):
        raise InvalidUsageError(f"dtype: {dtype!r} is not supported; supported: {', '.join(SUPPORTED_DTYPES)}")
    return dims, kind
