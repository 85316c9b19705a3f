"""Collectives on tf.Tensors: eagerly and inside tf.function, with gradients.

    import collectives, collectives.tensorflow as ctf
    comm = collectives.init()                        # under mpiexec -n N
    y = ctf.allreduce(x, comm, op="avg")             # x: a tf.Tensor; y: a new one

How a call runs. Every op takes its tensors out of TensorFlow with
`.numpy()`, a copy (TensorFlow's buffers are never written), runs the
communicator's collective on that copy in place, and hands the result back
as a new tensor. Eagerly the op calls the communicator at once. Inside
tf.function it is a `tf.py_function` node, so the collective runs when the
graph runs, not when it is traced: the communicator numbers its calls as
they happen, and the same traced graph may run any number of times.
tf.function's automatic control dependencies chain stateful nodes (a
py_function is one) in the order the program made them, so every rank runs
a graph's collectives in program order, never in an order TensorFlow's
scheduler picked (tests/test_tensorflow.py checks the chain).

Before it moves any data, each op exchanges a small description of its call
(which op, reduction, root, dtype and shape) with one allgather of 12
integers, so that ranks passing different shapes or dtypes all raise the
same InvalidUsageError, naming the argument and every rank's shape, rather
than reducing mismatched bytes (the communicator alone catches only calls of
a different size). allgather needs that exchange anyway: ranks may pass
different numbers of rows.

Gradients (tf.custom_gradient): allreduce's is an allreduce of the upstream
gradient with the same op (sum or avg; max, min and prod have none here);
allgather's is this rank's rows of the sum of every rank's upstream
gradient (a reduce_scatter when ranks have the same rows); reduce_scatter's
is an allgather (divided by the size for avg); broadcast's is a reduce of
the upstream gradients to the root, zeros elsewhere.

16-bit floats: the communicator adds float16 and bfloat16 in float32 and
rounds once per transfer (docs/api.md), so these ops pass them as they are.

Errors. Eagerly a failed collective raises the library's typed error
(InvalidUsageError, CollectiveTimeoutError, RankFailedError). Inside
tf.function TensorFlow turns any exception raised in a py_function into one
of its own: InvalidUsageError (a ValueError) arrives as
tf.errors.InvalidArgumentError, the others as tf.errors.UnknownError, with
the typed error's class and message in the text. `typed_error(e)` returns
the original error behind such a TensorFlow error, and `with
typed_errors(): ...` re-raises it in place of TensorFlow's (what a
training loop that catches RankFailedError wants around `model.fit`).
Argument errors found while tracing (a dtype we do not carry, a bad op or
root) are raised at once, typed, eagerly; inside tf.function autograph
replaces them with its StagingError (same message), whose __context__ is
our error: typed_error and typed_errors find it there too.
"""

import collections
import contextlib
import hashlib
import itertools
import re
import threading

import numpy as np
import tensorflow as tf

from .. import validation
from ..compression import wire
from ..errors import CollectiveError, CollectiveTimeoutError, InvalidUsageError, RankFailedError
from ..fusion import DEFAULT_THRESHOLD
from ..ops import SUPPORTED_DTYPES, ReduceOp

__all__ = ["allreduce", "allgather", "reduce_scatter", "broadcast", "broadcast_variables", "grouped_allreduce",
           "typed_error", "typed_errors"]

# Our functions run as Python while tf.function traces them: autograph
# would rewrite them (and their checks) into graph control flow for nothing.
_plain = tf.autograph.experimental.do_not_convert

# The reductions whose gradient is the same reduction of the upstream gradient.
_DIFFERENTIABLE_OPS = (ReduceOp.SUM, ReduceOp.AVG)


# -- arguments ----------------------------------------------------------------------------


def check_communicator(comm, name="comm"):
    """The TensorFlow ops run one rank per process, as collectives.init() gives."""
    if len(getattr(comm, "local_ranks", ())) != 1 or not hasattr(comm, "allgather"):
        raise InvalidUsageError(
            f"{name}: the TensorFlow ops need a communicator with one rank in this process: "
            "collectives.init() (under mpiexec, one process per rank) or Communicator.local(1)")
    return comm


def _as_tensor(tensor, name):
    if isinstance(tensor, tf.IndexedSlices):
        raise InvalidUsageError(
            f"{name}: an IndexedSlices; densify it (tf.convert_to_tensor) or allgather its values and indices")
    try:
        return tf.convert_to_tensor(tensor)
    except (TypeError, ValueError) as error:
        raise InvalidUsageError(f"{name}: cannot be made a tf.Tensor ({error})") from None


def _numpy_name(dtype):
    try:
        return np.dtype(dtype.as_numpy_dtype).name
    except TypeError:
        return None


def check_reducible(dtype, name, op):
    """Collectives reduce the NumPy dtypes of ops.SUPPORTED_DTYPES (bfloat16 is ml_dtypes', TensorFlow's own)."""
    if dtype.is_quantized or _numpy_name(dtype) not in SUPPORTED_DTYPES:
        raise InvalidUsageError(
            f"{name}: tensors of {dtype.name} cannot be reduced by collectives (op {op.value}); it reduces "
            f"{', '.join(SUPPORTED_DTYPES)} (for bool, reduce a uint8 copy)")


def _check_movable(dtype, name):
    """broadcast and allgather move bytes, so they carry any fixed-size number (bool and complex too)."""
    if dtype.is_quantized or not (dtype.is_bool or dtype.is_integer or dtype.is_floating or dtype.is_complex):
        raise InvalidUsageError(
            f"{name}: tensors of {dtype.name} cannot be moved by collectives; it carries booleans, integers, "
            "floats and complex numbers (strings, resources and variants have no fixed size in bytes)")


def _gradient_op(op, collective):
    if op not in _DIFFERENTIABLE_OPS:
        raise InvalidUsageError(
            f"op: {collective} with op {op.value!r} has no gradient here (sum and avg have); "
            "wrap its input in tf.stop_gradient, or reduce with op 'sum' or 'avg'")


# -- how a call runs ----------------------------------------------------------------------


def _owned(tensor):
    """A NumPy copy of `tensor` that the collective may write (never TensorFlow's buffer)."""
    array = tensor.numpy()   # a copy for every dtype TensorFlow hands to NumPy
    if not isinstance(array, np.ndarray):
        return np.array(array)   # a 0-d tensor gives a NumPy scalar
    if not array.flags.writeable or not array.flags.c_contiguous:
        return np.array(array, order="C")
    return array


def _run(name, body, inputs, output_dtypes):
    """`body` (NumPy arrays in, NumPy arrays out) on `inputs`' values: at
    once when eager, as a py_function node of the graph being traced otherwise."""
    if tf.executing_eagerly():
        return [tf.convert_to_tensor(out) for out in body(*[_owned(t) for t in inputs])]

    @tf.autograph.experimental.do_not_convert   # plain Python, run as it is (autograph would rewrite it)
    def in_graph(*tensors):
        try:
            return body(*[_owned(t) for t in tensors])
        except CollectiveError as error:
            raise _carried(error) from error

    return tf.py_function(in_graph, list(inputs), list(output_dtypes), name=name)


# Errors raised inside a py_function, kept so that typed_error can return
# them: TensorFlow keeps only their text. A handful is plenty (a training
# loop stops at its first), and bounding it keeps their tracebacks' frames
# from living forever.
_RAISED = collections.OrderedDict()
_RAISED_KEPT = 32
_RAISED_LOCK = threading.Lock()
_TOKENS = itertools.count(1)
_TOKEN = re.compile(r"\[collectives error (\d+)\]")
# The classes typed_error can rebuild from a message, the most specific first.
_TYPED_CLASSES = (RankFailedError, CollectiveTimeoutError, InvalidUsageError, CollectiveError)
_TYPED = re.compile(r"\b(" + "|".join(cls.__name__ for cls in _TYPED_CLASSES) + r"): (.*?) \[collectives error \d+\]",
                    re.S)


def _carried(error):
    """`error` again with a token in its message that finds it after
    TensorFlow has turned it into one of its own errors."""
    token = next(_TOKENS)
    with _RAISED_LOCK:
        _RAISED[token] = error
        while len(_RAISED) > _RAISED_KEPT:
            _RAISED.popitem(last=False)
    try:
        return type(error)(f"{error} [collectives error {token}]")
    except TypeError:   # a subclass whose constructor takes other arguments
        return CollectiveError(f"{type(error).__name__}: {error} [collectives error {token}]")


def typed_error(error):
    """The collectives error behind `error`, or None when there is none.

    error    an exception: a CollectiveError is returned as it is; a
             tf.errors.OpError raised by a graph (tf.function, model.fit)
             whose collective failed gives the CollectiveError that the
             collective raised (the same object, with its traceback, while
             this process still keeps it; else a new one of the same class
             and message); autograph's StagingError, which replaces an
             error raised while tracing (a bad argument), gives the error it
             replaced (its __context__).

    Returns a CollectiveError (InvalidUsageError, CollectiveTimeoutError,
    RankFailedError, ...) or None. Raises nothing.
    """
    seen = set()
    while error is not None and id(error) not in seen:   # the chain of causes and contexts
        seen.add(id(error))
        if isinstance(error, CollectiveError):
            return error
        found = _from_message(str(getattr(error, "message", None) or error))
        if found is not None:
            return found
        error = error.__cause__ or error.__context__
    return None


def _from_message(text):
    found = _TOKEN.search(text)
    if found is None:
        return None
    with _RAISED_LOCK:
        original = _RAISED.get(int(found.group(1)))
    if original is not None:
        return original
    typed = _TYPED.search(text)
    if typed is None:
        return CollectiveError(text)
    cls = next(cls for cls in _TYPED_CLASSES if cls.__name__ == typed.group(1))
    return cls(typed.group(2))


@contextlib.contextmanager
def typed_errors():
    """Inside this block, a TensorFlow error caused by a failed collective is
    re-raised as the collectives error that caused it (RankFailedError when
    a peer died, InvalidUsageError for a bad argument, ...), chained to
    TensorFlow's:

        with collectives.tensorflow.typed_errors():
            model.fit(...)

    Other errors pass through unchanged. Raises what the block raises.
    """
    try:
        yield
    except CollectiveError:
        raise
    except Exception as error:
        typed = typed_error(error)
        if typed is None:
            raise
        raise typed from error


# -- every rank's description of its call --------------------------------------------------
#
# One row of 12 int64 per rank: [kind, op, extra, dtype, ndim, d0 .. d6]
# (extra: the compression's index for allreduce, the root for broadcast).
# Shapes of more than 7 dimensions keep d0..d5 and, in the last slot, a hash
# of every dimension but the first (allgather compares all but d0).

_ROW = 12
_FIRST_DIM = 5
_KINDS = ("allreduce", "allgather", "reduce_scatter", "broadcast", "grouped_allreduce", "broadcast_variables")
_OP_CODES = {op: code for code, op in enumerate(ReduceOp)}
_COMPRESSIONS = (None, *wire.CODECS)


def _hash63(text):
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def _row(kind, op, extra, dtype, shape):
    row = np.full(_ROW, -1, np.int64)
    row[:5] = _KINDS.index(kind), _OP_CODES[op], extra, dtype.as_datatype_enum, len(shape)
    if len(shape) <= _ROW - _FIRST_DIM:
        row[_FIRST_DIM:_FIRST_DIM + len(shape)] = shape
    else:
        row[_FIRST_DIM:_ROW - 1] = shape[:_ROW - 1 - _FIRST_DIM]
        row[_ROW - 1] = _hash63(repr(tuple(shape[1:])))
    return row


def _group_row(kind, op, extra, arrays):
    """A row for a list of arrays: its length and a hash of their dtypes and shapes."""
    row = np.full(_ROW, -1, np.int64)
    row[:6] = (_KINDS.index(kind), _OP_CODES[op], extra, -1, len(arrays),
               _hash63(repr([(a.dtype.name, a.shape) for a in arrays])))
    return row


def _describe(row):
    kind, op, extra, dtype, ndim = (int(v) for v in row[:5])
    name = _KINDS[kind] if 0 <= kind < len(_KINDS) else f"call {kind}"
    what = name
    if name in ("allreduce", "reduce_scatter", "grouped_allreduce"):
        what += f" (op {list(ReduceOp)[op].value}"
        what += f", compression {_COMPRESSIONS[extra]})" if name != "reduce_scatter" else ")"
    elif name in ("broadcast", "broadcast_variables"):
        what += f" (root {extra})"
    if dtype < 0:
        return f"{what} of {int(row[4])} tensors (dtypes and shapes hashed to {int(row[5]):x})"
    dims = [int(d) for d in row[_FIRST_DIM:_FIRST_DIM + min(ndim, _ROW - _FIRST_DIM)]]
    shape = tuple(dims) if ndim <= _ROW - _FIRST_DIM else f"({', '.join(map(str, dims[:-1]))}, ...: {ndim} dims)"
    return f"{what} of {tf.dtypes.as_dtype(dtype).name} {shape}"


def _agree(comm, row, argument, free_first_dim=False):
    """Every rank's row (one allgather); every rank raises the same
    InvalidUsageError when they differ (beyond the first dimension when
    `free_first_dim`). Returns the rows, one per rank."""
    table = comm.allgather(row).reshape(comm.size, _ROW)
    compared = np.ones(_ROW, bool)
    compared[_FIRST_DIM] = not free_first_dim
    if (table[:, compared] != table[0, compared]).any():
        groups = {}
        for rank, other in enumerate(table):
            groups.setdefault(_describe(other), []).append(rank)
        said = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {text}"
                         for text, ranks in groups.items())
        rule = "the same dtype and every dimension but the first" if free_first_dim else "the same dtype and shape"
        raise InvalidUsageError(f"{argument}: every rank must pass {rule} to the same call; {said}")
    return table


# -- the ops --------------------------------------------------------------------------------


@_plain
def allreduce(tensor, comm, op="sum", compression=None):
    """Every rank gets the reduction of all ranks' `tensor`, as a new tensor.

    tensor       a tf.Tensor (or anything tf.convert_to_tensor takes) of a
                 dtype collectives reduces (ints, floats, bfloat16), of the
                 same shape on every rank
    comm         a communicator with one rank in this process (collectives.init())
    op           "sum" (default), "prod", "max", "min", "avg", or a ReduceOp
    compression  None, or "bf16", "fp16", "int8" for float32 tensors with op
                 sum or avg (see docs/compression.md)

    Its gradient is the same allreduce of the upstream gradient (sum and
    avg only). Returns a tf.Tensor of `tensor`'s shape and dtype. Raises
    InvalidUsageError for a bad argument (a dtype we do not reduce, ranks
    with different shapes), CollectiveTimeoutError or RankFailedError when a
    peer stalls or dies (inside tf.function: see typed_error).
    """
    check_communicator(comm)
    op = validation.reduce_op(op)
    validation.compression_codec(compression, op)
    tensor = _as_tensor(tensor, "tensor")
    check_reducible(tensor.dtype, "tensor", op)
    if compression is not None:
        validation.compressed_dtype(compression, np.dtype(tensor.dtype.as_numpy_dtype))
    return _allreduce(tensor, comm, op, compression)


def _allreduce(tensor, comm, op, compression):
    dtype, code = tensor.dtype, _COMPRESSIONS.index(compression)

    def body(a):
        _agree(comm, _row("allreduce", op, code, dtype, a.shape), "tensor")
        if a.size:   # every rank has the same shape (just checked): all skip an empty one alike
            comm.allreduce(a.reshape(-1), op=op.value, compression=compression)
        return [a]

    @tf.custom_gradient
    def forward(x):
        y, = _run("CollectivesAllreduce", body, [x], [dtype])
        y.set_shape(x.shape)

        def gradient(dy):
            _gradient_op(op, "allreduce")
            return _allreduce(_dense(dy, y), comm, op, compression)

        return y, gradient

    return forward(tensor)


def _dense(upstream, like):
    """An upstream gradient as a dense tensor (zeros where none flowed)."""
    if upstream is None:
        return tf.zeros_like(like)
    return tf.convert_to_tensor(upstream)


@_plain
def allgather(tensor, comm):
    """Every rank gets all ranks' `tensor` concatenated along the first
    dimension, in rank order.

    tensor   a tf.Tensor of at least one dimension; every rank passes the
             same dtype and the same dimensions but the first, which may
             differ (the ranks exchange their sizes first). Any dtype of
             fixed size moves (bool and complex too).
    comm     a communicator with one rank in this process

    Its gradient is this rank's rows of the sum over ranks of the upstream
    gradient. Returns a tf.Tensor of shape (sum of the ranks' first
    dimensions, *tensor.shape[1:]). Raises InvalidUsageError for a bad
    argument (a scalar, a string tensor, ranks whose other dimensions
    differ), CollectiveTimeoutError or RankFailedError when a peer stalls or
    dies.
    """
    check_communicator(comm)
    tensor = _as_tensor(tensor, "tensor")
    _check_movable(tensor.dtype, "tensor")
    if tensor.shape.rank == 0:
        raise InvalidUsageError("tensor: allgather concatenates along the first dimension, and a scalar has "
                                "none; reshape it to [1]")
    return _allgather(tensor, comm)


def _allgather(tensor, comm):
    dtype = tensor.dtype

    def body(a):
        table = _agree(comm, _row("allgather", ReduceOp.SUM, 0, dtype, a.shape), "tensor", free_first_dim=True)
        if a.ndim == 0:   # every rank's tensor is 0-d (the rows agree on ndim): all raise alike
            raise InvalidUsageError("tensor: allgather concatenates along the first dimension, and a scalar has "
                                    "none; reshape it to [1]")
        rows = table[:, _FIRST_DIM].copy()
        return [_gather_rows(comm, a, rows), rows]

    @tf.custom_gradient
    def forward(x):
        y, rows = _run("CollectivesAllgather", body, [x], [dtype, tf.int64])
        y.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]))
        rows.set_shape([comm.size])

        def gradient(dy):
            return _allgather_gradient(_dense(dy, y), rows, comm)

        return y, gradient

    return forward(tensor)


def _gather_rows(comm, a, rows):
    """Allgather of `a`'s rows as bytes, where rank r has rows[r] of them:
    ranks with fewer rows pad to the most, and the padding is cut out after."""
    total, most = int(rows.sum()), int(rows.max())
    row_elements = int(np.prod(a.shape[1:], dtype=np.int64))
    row_bytes = a.dtype.itemsize * row_elements
    if most * row_bytes == 0:
        return np.zeros((total, *a.shape[1:]), a.dtype)
    mine = a.reshape(a.shape[0], row_elements).view(np.uint8)   # (rows, row_bytes)
    if (rows == most).all():
        gathered = comm.allgather(mine)
    else:
        padded = np.zeros((most, row_bytes), np.uint8)
        padded[:len(mine)] = mine
        blocks = comm.allgather(padded).reshape(comm.size, most, row_bytes)
        gathered = np.concatenate([blocks[rank, :count] for rank, count in enumerate(rows)])
    return gathered.view(a.dtype).reshape(total, *a.shape[1:])


def _allgather_gradient(upstream, rows, comm):
    check_reducible(upstream.dtype, "tensor", ReduceOp.SUM)

    def body(g, counts):
        counts = counts.astype(np.int64)
        start, mine = int(counts[:comm.rank].sum()), int(counts[comm.rank])
        if g.size == 0:
            return [np.zeros((mine, *g.shape[1:]), g.dtype)]
        if (counts == counts[0]).all():   # rank r's rows are block r: a reduce_scatter along the first axis
            return [comm.reduce_scatter(g, op="sum").copy()]
        comm.allreduce(g.reshape(-1), op="sum")
        return [g[start:start + mine].copy()]

    grad, = _run("CollectivesAllgatherGrad", body, [upstream, rows], [upstream.dtype])
    grad.set_shape(tf.TensorShape([None]).concatenate(upstream.shape[1:]))
    return grad


@_plain
def reduce_scatter(tensor, comm, op="sum"):
    """Reduce all ranks' `tensor` and give rank r block r of the result
    along the first dimension.

    tensor   a tf.Tensor whose first dimension is `comm.size` times k, of the
             same shape and a reducible dtype on every rank
    comm     a communicator with one rank in this process
    op       "sum" (default), "prod", "max", "min", "avg", or a ReduceOp

    Its gradient is the allgather of the upstream gradient (divided by the
    size for avg). Returns a tf.Tensor of shape (k, *tensor.shape[1:]).
    Raises InvalidUsageError for a bad argument (a first dimension that
    `comm.size` does not divide, a dtype we do not reduce, ranks with
    different shapes), CollectiveTimeoutError or RankFailedError when a peer
    stalls or dies.
    """
    check_communicator(comm)
    op = validation.reduce_op(op)
    tensor = _as_tensor(tensor, "tensor")
    check_reducible(tensor.dtype, "tensor", op)
    rows = tensor.shape[0] if tensor.shape.rank else None
    if tensor.shape.rank == 0 or (rows is not None and rows % comm.size):
        raise InvalidUsageError(_indivisible(tensor.shape, comm.size))
    return _reduce_scatter(tensor, comm, op)


def _indivisible(shape, size):
    return (f"tensor: reduce_scatter gives each of the {size} ranks an equal block of the first dimension, "
            f"so it must be a multiple of {size}; got shape {tuple(shape)}")


def _reduce_scatter(tensor, comm, op):
    dtype, size = tensor.dtype, comm.size

    def body(a):
        _agree(comm, _row("reduce_scatter", op, 0, dtype, a.shape), "tensor")
        if a.ndim == 0 or a.shape[0] % size:   # the same shape on every rank: all raise alike
            raise InvalidUsageError(_indivisible(a.shape, size))
        if a.size == 0:
            return [np.zeros((a.shape[0] // size, *a.shape[1:]), a.dtype)]
        return [comm.reduce_scatter(a, op=op.value).copy()]   # this rank's block, along the first axis

    @tf.custom_gradient
    def forward(x):
        y, = _run("CollectivesReduceScatter", body, [x], [dtype])
        first = x.shape[0] // size if x.shape.rank and x.shape[0] is not None else None
        y.set_shape(tf.TensorShape([first]).concatenate(x.shape[1:]) if x.shape.rank else None)

        def gradient(dy):
            _gradient_op(op, "reduce_scatter")
            gathered = _allgather(_dense(dy, y), comm)
            return gathered / tf.cast(size, gathered.dtype) if op is ReduceOp.AVG else gathered

        return y, gradient

    return forward(tensor)


@_plain
def broadcast(tensor, comm, root=0):
    """Every rank gets the root's `tensor`, as a new tensor.

    tensor   a tf.Tensor of the same shape and dtype on every rank (only the
             root's values are read); any dtype of fixed size
    comm     a communicator with one rank in this process
    root     the rank whose tensor every rank gets

    Its gradient is the sum of every rank's upstream gradient at the root,
    and zeros on the other ranks. Returns a tf.Tensor of `tensor`'s shape
    and dtype. Raises InvalidUsageError for a bad argument (a root out of
    range, ranks with different shapes), CollectiveTimeoutError or
    RankFailedError when a peer stalls or dies.
    """
    check_communicator(comm)
    root = validation.root_rank(root, comm.size)
    tensor = _as_tensor(tensor, "tensor")
    _check_movable(tensor.dtype, "tensor")
    return _broadcast(tensor, comm, root)


def _broadcast(tensor, comm, root):
    dtype = tensor.dtype

    def body(a):
        _agree(comm, _row("broadcast", ReduceOp.SUM, root, dtype, a.shape), "tensor")
        if a.size:
            comm.broadcast(a.reshape(-1).view(np.uint8), root=root)   # in place: the bytes of our copy
        return [a]

    def reduce_to_root(g):
        if g.size:
            comm.reduce(g.reshape(-1), root=root, op="sum")   # the root's copy becomes the sum
        return [g if comm.rank == root else np.zeros_like(g)]

    @tf.custom_gradient
    def forward(x):
        y, = _run("CollectivesBroadcast", body, [x], [dtype])
        y.set_shape(x.shape)

        def gradient(dy):
            upstream = _dense(dy, y)
            check_reducible(upstream.dtype, "tensor", ReduceOp.SUM)
            grad, = _run("CollectivesBroadcastGrad", reduce_to_root, [upstream], [upstream.dtype])
            grad.set_shape(upstream.shape)
            return grad

        return y, gradient

    return forward(tensor)


@_plain
def broadcast_variables(variables, comm, root=0):
    """Assign the root's values to every rank's `variables`, in place.

    variables  tf.Variables (or Keras variables), the same list of shapes
               and dtypes on every rank; they travel as the bytes of one
               buffer, one broadcast whatever their number
    comm       a communicator with one rank in this process
    root       the rank whose values every rank gets

    Call it on every rank, e.g. once the model and its optimizer are built.
    Returns None (inside tf.function the assignments run with the graph,
    as every stateful op there does). Raises
    InvalidUsageError for a bad argument (not a variable, a string
    variable, ranks with different lists), CollectiveTimeoutError or
    RankFailedError when a peer stalls or dies.
    """
    check_communicator(comm)
    root = validation.root_rank(root, comm.size)
    variables = list(variables)
    for i, variable in enumerate(variables):
        if not hasattr(variable, "assign") or not hasattr(variable, "dtype"):
            raise InvalidUsageError(f"variables[{i}]: expected a tf.Variable, got {type(variable).__name__}")
    values = [_as_tensor(v, f"variables[{i}]") for i, v in enumerate(variables)]   # reads their values
    for i, value in enumerate(values):
        _check_movable(value.dtype, f"variables[{i}]")
    if not values:
        return None

    def body(*arrays):
        _agree(comm, _group_row("broadcast_variables", ReduceOp.SUM, root, arrays), "variables")
        offsets, total = [], 0
        for a in arrays:   # each on a 16-byte boundary, as the torch adapter packs them
            offsets.append(total)
            total += -(-a.nbytes // 16) * 16
        if total == 0:
            return list(arrays)
        flat = np.empty(total, np.uint8)
        for a, offset in zip(arrays, offsets):
            flat[offset:offset + a.nbytes] = a.reshape(-1).view(np.uint8)
        comm.broadcast(flat, root=root)
        return [flat[offset:offset + a.nbytes].view(a.dtype).reshape(a.shape)
                for a, offset in zip(arrays, offsets)]

    received = _run("CollectivesBroadcastVariables", body, values, [v.dtype for v in values])
    for variable, value, old in zip(variables, received, values):
        variable.assign(tf.reshape(value, tf.shape(old)))   # the shape a py_function's output lost


@_plain
def grouped_allreduce(tensors, comm, op="sum", compression=None, fusion_threshold=DEFAULT_THRESHOLD):
    """allreduce of every tensor of `tensors`, fused: one call of the
    communicator's allreduce_many, which packs tensors of one dtype into
    buffers of up to `fusion_threshold` bytes and reduces each buffer once.

    tensors           a list of tf.Tensors of reducible dtypes (shapes and
                      dtypes may differ from each other, not across ranks)
    comm              a communicator with one rank in this process
    op                "sum" (default), "prod", "max", "min", "avg", or a ReduceOp
    compression       None, or "bf16", "fp16", "int8" (float32 tensors, sum or avg)
    fusion_threshold  bytes per fusion buffer

    Its gradient is the same grouped allreduce of the upstream gradients
    (sum and avg). Returns a list of new tf.Tensors, in the order given.
    Raises InvalidUsageError for a bad argument (ranks with different lists
    of shapes included), CollectiveTimeoutError or RankFailedError when a
    peer stalls or dies.
    """
    check_communicator(comm)
    op = validation.reduce_op(op)
    validation.compression_codec(compression, op)
    from ..fusion import check_threshold
    check_threshold(fusion_threshold, "fusion_threshold")
    if isinstance(tensors, (tf.Tensor, tf.Variable)) or not isinstance(tensors, (list, tuple)):
        raise InvalidUsageError(f"tensors: expected a list of tensors, got {type(tensors).__name__}")
    tensors = [_as_tensor(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
    for i, t in enumerate(tensors):
        check_reducible(t.dtype, f"tensors[{i}]", op)
        if compression is not None:
            with validation.naming(f"tensors[{i}]"):
                validation.compressed_dtype(compression, np.dtype(t.dtype.as_numpy_dtype))
    if not tensors:
        return []
    return _grouped_allreduce(tensors, comm, op, compression, fusion_threshold)


def _grouped_allreduce(tensors, comm, op, compression, threshold):
    code = _COMPRESSIONS.index(compression)
    dtypes = [t.dtype for t in tensors]

    def body(*arrays):
        _agree(comm, _group_row("grouped_allreduce", op, code, arrays), "tensors")
        filled = [a.reshape(-1) for a in arrays if a.size]   # views: reduced in place, in our copies
        if filled:
            comm.allreduce_many(filled, op=op.value, fusion_threshold=threshold, compression=compression)
        return list(arrays)

    @tf.custom_gradient
    def forward(*xs):
        ys = _run("CollectivesGroupedAllreduce", body, xs, dtypes)
        for y, x in zip(ys, xs):
            y.set_shape(x.shape)

        def gradient(*dys):
            _gradient_op(op, "grouped_allreduce")
            return _grouped_allreduce([_dense(dy, y) for dy, y in zip(dys, ys)], comm, op, compression, threshold)

        return ys, gradient

    return list(forward(*tensors))
