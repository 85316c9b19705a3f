"""Collectives on tf.Tensors: eagerly and inside tf.function, with gradients.

    import collectives, collectives.tensorflow as ctf
    comm = collectives.init()                        # under mpiexec -n N
    y = ctf.allreduce(x, comm, op="avg")             # x: a tf.Tensor; y: a new one

How a call runs. Every op reads its tensors where TensorFlow keeps them
(np.asarray of an eager tensor, or what a graph node is handed: views,
never written), runs the communicator's collective out of place into a new
array aligned to 64 bytes, and hands that array to TensorFlow without a
copy (DLPack eagerly; a graph node's output in a graph). From
64 KiB the new arrays are buffers TensorFlow has let go of, kept for reuse
(_Buffers: fresh pages cost more than the collective at 1 MiB). Eagerly the
op calls the communicator at once, through tf.custom_gradient only while a
GradientTape (or ForwardAccumulator) records. Inside tf.function it is a
node of our own op (native.py; a `tf.numpy_function` node, the fallback
where the op cannot be built, costs 30-70 µs more a call here), so the collective runs when the graph runs, not when it is traced: the communicator numbers its calls as they happen, and
the same traced graph may run any number of times. tf.function's automatic
control dependencies chain stateful nodes (this one is) in the order the
program made them, so every rank runs a graph's collectives in program
order, never in an order TensorFlow's scheduler picked
(tests/test_tensorflow.py checks the chain).

The first time a rank makes a call of a given description (which op,
reduction, root, dtype and shape), the ranks exchange it with one
allgather of 12 integers, so that ranks passing different shapes or dtypes
all raise the same InvalidUsageError, naming the argument and every rank's
shape, rather than reducing mismatched bytes; later calls of that
description skip the exchange (see _agree_once for what is still caught).
allgather exchanges every time: ranks may pass different numbers of rows.

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
tf.function a graph node's failure is one of TensorFlow's errors (our node
gives the codes a numpy_function's would): InvalidUsageError (a ValueError) arrives as
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
import itertools
import math
import re
import sys
import threading
import weakref

import numpy as np
import tensorflow as tf

from .. import validation
from . import native
from ..compression import wire
from ..errors import CollectiveError, CollectiveTimeoutError, InvalidUsageError, RankFailedError
from ..fusion import DEFAULT_THRESHOLD
from ..ops import SUPPORTED_DTYPES, ReduceOp
from ..transport.protocol import description_hash

__all__ = ["allreduce", "allgather", "reduce_scatter", "broadcast", "broadcast_variables", "grouped_allreduce",
           "typed_error", "typed_errors"]

# Our functions run as Python while tf.function traces them: autograph
# would rewrite them (and their checks) into graph control flow for nothing.
_plain = tf.autograph.experimental.do_not_convert

# -- arguments ----------------------------------------------------------------------------


def check_communicator(comm, name="comm"):
    """The TensorFlow ops run one rank per process, as collectives.init() gives."""
    return validation.one_rank_in_this_process(comm, name, "the TensorFlow ops")


def _as_tensor(tensor, name):
    if isinstance(tensor, tf.Tensor):   # already one (the common case): no conversion to pay for
        return tensor
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


# The dtypes found reducible, so that a call pays for the test once per dtype, not each time.
_REDUCIBLE = set()


def check_reducible(dtype, name, op):
    """Collectives reduce the NumPy dtypes of ops.SUPPORTED_DTYPES (bfloat16 is ml_dtypes', TensorFlow's own)."""
    if dtype in _REDUCIBLE:
        return
    if dtype.is_quantized or _numpy_name(dtype) not in SUPPORTED_DTYPES:
        raise InvalidUsageError(
            f"{name}: tensors of {dtype.name} cannot be reduced by collectives (op {op.value}); it reduces "
            f"{', '.join(SUPPORTED_DTYPES)} (for bool, reduce a uint8 copy)")
    _REDUCIBLE.add(dtype)


def _check_movable(dtype, name):
    """broadcast and allgather move bytes, so they carry any fixed-size number (bool and complex too)."""
    if dtype.is_quantized or not (dtype.is_bool or dtype.is_integer or dtype.is_floating or dtype.is_complex):
        raise InvalidUsageError(
            f"{name}: tensors of {dtype.name} cannot be moved by collectives; it carries booleans, integers, "
            "floats and complex numbers (strings, resources and variants have no fixed size in bytes)")


def _gradient_op(op, collective):
    if op not in validation.GRADIENT_OPS:
        raise InvalidUsageError(
            f"op: {collective} with op {op.value!r} has no gradient here (sum and avg have); "
            "wrap its input in tf.stop_gradient, or reduce with op 'sum' or 'avg'")


# -- how a call runs ----------------------------------------------------------------------

# TensorFlow's (Eigen's) alignment: an array that starts on it becomes a
# tensor without a copy (DLPack eagerly; a graph node's output in a graph).
_ALIGN = 64

try:   # whether a GradientTape or ForwardAccumulator is recording on this thread (TensorFlow's own test)
    from tensorflow.python.eager.record import could_possibly_record as _could_record
except ImportError:   # a TensorFlow without it: always take the path that records (correct, slower)
    def _could_record():
        return True


def _untaped():
    """Eager, and no tape or accumulator recording: nothing can ask for a
    gradient of this call, so tf.custom_gradient's eager bookkeeping (the
    largest part of an eager call's cost) is skipped. In a graph being traced
    the custom gradient is recorded once, at tracing, and costs nothing per run."""
    return tf.executing_eagerly() and not _could_record()


class _Buffers:
    """Output buffers kept for reuse once TensorFlow has let go of them.

    A new array's pages fault in on first write: at 1 MiB that cost more
    than the collective itself here (~250 of ~380 us). TensorFlow holds a
    reference to the array behind every tensor made from it (DLPack's
    capsule, a graph node's output), and any view of a buffer holds the
    buffer, so a buffer whose only references are ours is free: nothing of
    TensorFlow's reads it any more, and it is handed out again, its pages
    already mapped. (A reference TensorFlow drops late only delays reuse.)
    Only buffers of at least MIN bytes are kept (smaller ones come from
    malloc's free lists at no page cost), and at most LIMIT bytes in all;
    beyond that buffers are plain new arrays."""

    MIN = 64 << 10
    LIMIT = 512 << 20

    def __init__(self):
        self._kept = {}        # nbytes -> [raw uint8 arrays of nbytes + _ALIGN]
        self._total = 0
        self._lock = threading.Lock()

    def take(self, nbytes):
        """A uint8 array of nbytes + _ALIGN bytes that nothing else references."""
        if nbytes < self.MIN:
            return np.empty(nbytes + _ALIGN, np.uint8)
        with self._lock:
            kept = self._kept.setdefault(nbytes, [])
            for raw in kept:
                if sys.getrefcount(raw) <= _FREE_REFS:
                    return raw
            raw = np.empty(nbytes + _ALIGN, np.uint8)
            if self._total + raw.nbytes <= self.LIMIT:
                kept.append(raw)
                self._total += raw.nbytes
            return raw


def _references_when_free():
    """What sys.getrefcount says, inside _Buffers.take's loop, of a kept
    buffer that nothing else holds: measured the same way rather than
    assumed (3 on CPython 3.11: the list's, the loop's, the argument's;
    interpreters that borrow references count fewer)."""
    kept = [np.empty(1, np.uint8)]
    for raw in kept:
        return sys.getrefcount(raw)


_FREE_REFS = _references_when_free()
_BUFFERS = _Buffers()


def _fresh(shape, dtype):
    """An array of `shape` and `dtype` that nothing else uses, whose data
    starts on _ALIGN bytes (NumPy aligns to 16) so that TensorFlow takes it
    without a copy; from 64 KiB a buffer TensorFlow let go of (_Buffers)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = _BUFFERS.take(nbytes)
    start = -raw.ctypes.data % _ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _copy(a):
    """A copy of `a` that a collective may write in place (never TensorFlow's buffer)."""
    out = _fresh(a.shape, a.dtype)
    np.copyto(out, a)
    return out


# DLPack takes NumPy's integers, floats, complex and bool (bfloat16, ml_dtypes',
# it refuses): those dtypes become eager tensors without a copy.
_DLPACK_KINDS = frozenset("biufc")
_from_dlpack = tf.experimental.dlpack.from_dlpack


def _tensor(a):
    """An eager tensor of the NumPy array `a`, sharing its memory where
    DLPack can (the array is ours and nothing else writes it), else a copy
    (tf.convert_to_tensor: ~2 ms per 16 MiB here, and ~10 us even at 1 KiB)."""
    if a.dtype.kind in _DLPACK_KINDS and a.size:
        try:
            return _from_dlpack(a.__dlpack__())
        except (BufferError, TypeError, ValueError):   # an older NumPy without this dtype in DLPack
            pass
    return tf.convert_to_tensor(a)


def _run(name, body, inputs, output_dtypes):
    """`body` (NumPy arrays in, NumPy arrays out) on `inputs`' values: at
    once when eager, as a node of the graph being traced otherwise: our
    op's (native.py), or where it cannot be built a numpy_function's.

    `body` reads its inputs and never writes them: they are views of
    TensorFlow's buffers (np.asarray of an eager tensor, and what a graph
    node is handed, share memory with the tensor). Its outputs are new
    arrays that TensorFlow takes as they are (_fresh, _tensor). Both nodes
    are stateful, which keeps them in tf.function's chain of automatic
    control dependencies (program order, on every rank). The fallback is
    numpy_function rather than py_function: py_function wraps its inputs
    and outputs in eager tensors, which copies both (5 ms against 1.2 ms
    for a 16 MiB call here) and costs tens of microseconds more per call."""
    if tf.executing_eagerly():
        return [_tensor(out) for out in body(*[np.asarray(t) for t in inputs])]

    node = native.call(body, inputs, output_dtypes, name)
    if node is not None:
        return node

    def in_graph(*arrays):
        try:   # a 0-d tensor arrives as a NumPy scalar
            return body(*[np.asarray(a) for a in arrays])
        except CollectiveError as error:
            raise _carried(error) from error

    return tf.numpy_function(in_graph, list(inputs), list(output_dtypes), stateful=True, name=name)


# Errors raised inside a numpy_function, kept so that typed_error can return
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


def describe_failure(error):
    """(TensorFlow's error code, message) for `error`, raised by a body in
    our graph op (native.py): a collectives error carried as _carried makes
    it, so that typed_error finds it; the code numpy_function would give
    (INVALID_ARGUMENT for a ValueError or TypeError, else UNKNOWN)."""
    if isinstance(error, CollectiveError):
        error = _carried(error)
    code = native.INVALID_ARGUMENT if isinstance(error, (ValueError, TypeError)) else native.UNKNOWN
    return code, f"{type(error).__name__}: {error}"


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
# (extra: the compression's index for allreduce, the root for broadcast,
# the replica count for CrossDeviceOps' reductions).
# Shapes of more than 7 dimensions keep d0..d5 and, in the last slot, a hash
# of every dimension but the first (allgather compares all but d0).

_ROW = 12
_FIRST_DIM = 5
_KINDS = ("allreduce", "allgather", "reduce_scatter", "broadcast", "grouped_allreduce", "broadcast_variables",
          "cross_device_reduce")
_OP_CODES = {op: code for code, op in enumerate(ReduceOp)}
_COMPRESSIONS = (None, *wire.CODECS)


def _hash63(text):
    return description_hash(text) >> 1   # an int64 that is never negative


def _row(kind, op, extra, dtype, shape):
    row = np.full(_ROW, -1, np.int64)
    row[:5] = _KINDS.index(kind), _OP_CODES[op], extra, dtype.as_datatype_enum, len(shape)
    if len(shape) <= _ROW - _FIRST_DIM:
        row[_FIRST_DIM:_FIRST_DIM + len(shape)] = shape
    else:
        row[_FIRST_DIM:_ROW - 1] = shape[:_ROW - 1 - _FIRST_DIM]
        row[_ROW - 1] = _hash63(repr(tuple(shape[1:])))
    return row


def _layout(arrays):
    """The dtypes and shapes of a list of arrays, as _group_row and _agree_once take them."""
    return tuple((a.dtype.name, a.shape) for a in arrays)


def _group_row(kind, op, extra, layout):
    """A row for a list of arrays: its length and a hash of their dtypes and shapes (`layout`)."""
    row = np.full(_ROW, -1, np.int64)
    row[:6] = (_KINDS.index(kind), _OP_CODES[op], extra, -1, len(layout), _hash63(repr(list(layout))))
    return row


def _describe(row):
    kind, op, extra, dtype, ndim = (int(v) for v in row[:5])
    name = _KINDS[kind] if 0 <= kind < len(_KINDS) else f"call {kind}"
    what = name
    if name == "cross_device_reduce":
        what += f" (op {list(ReduceOp)[op].value}, {extra} replicas)"
    elif name in ("allreduce", "reduce_scatter", "grouped_allreduce"):
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


# Calls every rank already agreed on, per communicator: (kind, op, extra,
# dtype, shape). A call seen before skips the agreement allgather, which
# cost a round trip per call (more than the collective itself at 1 KiB).
# Every rank making the same calls holds the same set, so they skip alike.
# What is still caught: any call whose description this rank has not agreed
# before runs the agreement, and a peer that skips it meanwhile makes a
# different call, which the communicator itself catches (its call signature
# holds the collective, op, root, dtype and byte count: InvalidUsageError on
# every rank, and the communicator is aborted); a different element count or
# dtype is always caught by that signature. What is no longer caught: ranks
# passing two different shapes of the same dtype and element count that
# were each agreed on before, e.g. (2, 3) on one rank and (3, 2) on another
# after both were used alike (the flat elements are reduced). Bounded: a
# program with ever new shapes clears it (on every rank at the same call).
_AGREED = weakref.WeakKeyDictionary()
_AGREED_KEPT = 4096


def _agree_once(comm, kind, op, extra, dtype, shape, argument):
    """_agree on this call's description unless every rank agreed on it before."""
    try:
        seen = _AGREED.get(comm)
        if seen is None:
            seen = _AGREED[comm] = set()
    except TypeError:   # a communicator that takes no weak reference: agree every time
        seen = set()
    key = (kind, op, extra, dtype.as_datatype_enum if hasattr(dtype, "as_datatype_enum") else dtype, shape)
    if key in seen:
        return
    if kind == "grouped_allreduce":
        _agree(comm, _group_row(kind, op, extra, shape), argument)
    else:
        _agree(comm, _row(kind, op, extra, dtype, shape), argument)
    if len(seen) >= _AGREED_KEPT:
        seen.clear()
    seen.add(key)


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
        _agree_once(comm, "allreduce", op, code, dtype, a.shape, "tensor")
        out = _fresh(a.shape, a.dtype)
        if a.size:   # every rank has the same shape (agreed): all skip an empty one alike
            # out of place: reads TensorFlow's buffer, writes ours (no copy before the call)
            comm.allreduce(a.reshape(-1), op=op.value, out=out.reshape(-1), compression=compression)
        return [out]

    if _untaped():
        return _tensor(body(np.asarray(tensor))[0])

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
        # Always exchanged: the ranks' first dimensions may change from call to call.
        table = _agree(comm, _row("allgather", ReduceOp.SUM, 0, dtype, a.shape), "tensor", free_first_dim=True)
        if a.ndim == 0:   # every rank's tensor is 0-d (the rows agree on ndim): all raise alike
            raise InvalidUsageError("tensor: allgather concatenates along the first dimension, and a scalar has "
                                    "none; reshape it to [1]")
        rows = table[:, _FIRST_DIM].copy()
        return [_gather_rows(comm, a, rows), rows]

    if _untaped():
        return _tensor(body(np.asarray(tensor))[0])

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
    gathered = _fresh((total, *a.shape[1:]), a.dtype)
    if (rows == most).all():
        comm.allgather(mine, out=gathered.reshape(total, row_elements).view(np.uint8))
    else:
        padded = np.zeros((most, row_bytes), np.uint8)
        padded[:len(mine)] = mine
        blocks = comm.allgather(padded).reshape(comm.size, most, row_bytes)
        np.concatenate([blocks[rank, :count] for rank, count in enumerate(rows)],
                       out=gathered.reshape(total, row_elements).view(np.uint8))
    return gathered


def _allgather_gradient(upstream, rows, comm):
    check_reducible(upstream.dtype, "tensor", ReduceOp.SUM)

    def body(g, counts):
        counts = counts.astype(np.int64)
        start, mine = int(counts[:comm.rank].sum()), int(counts[comm.rank])
        out = _fresh((mine, *g.shape[1:]), g.dtype)
        if g.size == 0:
            out[...] = 0
            return [out]
        if (counts == counts[0]).all():   # rank r's rows are block r: a reduce_scatter along the first axis
            comm.reduce_scatter(g.reshape(-1), op="sum", out=out.reshape(-1))
            return [out]
        total = _fresh(g.shape, g.dtype)
        comm.allreduce(g.reshape(-1), op="sum", out=total.reshape(-1))
        np.copyto(out, total[start:start + mine])
        return [out]

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
        _agree_once(comm, "reduce_scatter", op, 0, dtype, a.shape, "tensor")
        if a.ndim == 0 or a.shape[0] % size:   # the same shape on every rank: all raise alike
            raise InvalidUsageError(_indivisible(a.shape, size))
        out = _fresh((a.shape[0] // size, *a.shape[1:]), a.dtype)
        if a.size:   # block r of the flat elements is block r along the first axis
            comm.reduce_scatter(a.reshape(-1), op=op.value, out=out.reshape(-1))
        return [out]

    if _untaped():
        return _tensor(body(np.asarray(tensor))[0])

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
        _agree_once(comm, "broadcast", ReduceOp.SUM, root, dtype, a.shape, "tensor")
        out = _fresh(a.shape, a.dtype)
        if a.size:   # the bytes, out of place: only the root's input is read
            comm.broadcast(a.reshape(-1).view(np.uint8), root=root, out=out.reshape(-1).view(np.uint8))
        return [out]

    def reduce_to_root(g):
        out = _fresh(g.shape, g.dtype)
        if g.size:
            comm.reduce(g.reshape(-1), root=root, op="sum", out=out.reshape(-1))   # written at the root only
        if comm.rank != root or not g.size:
            out[...] = 0
        return [out]

    if _untaped():
        return _tensor(body(np.asarray(tensor))[0])

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
        _agree(comm, _group_row("broadcast_variables", ReduceOp.SUM, root, _layout(arrays)), "variables")
        offsets, total = [], 0
        for a in arrays:   # each on _ALIGN bytes: TensorFlow takes its part of the buffer without a copy
            offsets.append(total)
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        if total == 0:
            return [_copy(a) for a in arrays]
        flat = _fresh((total,), np.uint8)
        for a, offset in zip(arrays, offsets):
            flat[offset:offset + a.nbytes] = a.reshape(-1).view(np.uint8)
        comm.broadcast(flat, root=root)
        return [flat[offset:offset + a.nbytes].view(a.dtype).reshape(a.shape)
                for a, offset in zip(arrays, offsets)]

    received = _run("CollectivesBroadcastVariables", body, values, [v.dtype for v in values])
    for variable, value, old in zip(variables, received, values):
        variable.assign(tf.reshape(value, tf.shape(old)))   # the shape a numpy_function's output lost


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
        _agree_once(comm, "grouped_allreduce", op, code, None, _layout(arrays), "tensors")
        owned = [_copy(a) for a in arrays]   # allreduce_many reduces in place: in our copies
        filled = [a.reshape(-1) for a in owned if a.size]
        if filled:
            comm.allreduce_many(filled, op=op.value, fusion_threshold=threshold, compression=compression)
        return owned

    if _untaped():
        return [_tensor(a) for a in body(*[np.asarray(t) for t in tensors])]

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
