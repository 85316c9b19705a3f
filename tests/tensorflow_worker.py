"""One rank of the TensorFlow and Keras tests; tests/test_tensorflow.py starts N of these under mpiexec.

    mpiexec -n N python tests/tensorflow_worker.py SCENARIO [OUTPUT.json]

TensorFlow's import costs seconds per process, so each scenario starts once
and checks many things: `ops` every op's values and gradients against NumPy,
eagerly and inside tf.function, and its errors; `training` a tape and a
Keras fit against one process trained on the concatenated batches, then a
rank that dies under a tf.function; `keras_torch` the same Keras fit on
Keras' torch backend (the test launches it with KERAS_BACKEND=torch). Each rank prints "OK <part> <rank>" for
every part that held and fails with a traceback otherwise. Rank 0 writes
what it measured to OUTPUT.json when one is named.
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")      # TensorFlow's start-up banners
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# Keras imports scikit-learn (its estimator wrappers) and matplotlib.pyplot
# (its image gallery) when they are installed, as the test install has them:
# 1.5 of the 7 CPU-s `import tensorflow` costs each rank. Both imports are
# optional to Keras (an ImportError leaves the wrapper or the plot without
# them), and no scenario uses either: None in sys.modules is that ImportError.
sys.modules.update(sklearn=None, matplotlib=None)

from rare_collections import collect_rarely

collect_rarely()   # before PyTorch and TensorFlow load: rare_collections.py says why

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from mpi4py import MPI  # noqa: E402

import collectives  # noqa: E402
import collectives.tensorflow as ctf  # noqa: E402
from collectives import InvalidUsageError, RankFailedError  # noqa: E402

TIMEOUT = 30.0   # ranks share two cores with TensorFlow's tracing: generous, and still no hang


def ok(part, comm):
    print(f"OK {part} {comm.rank}", flush=True)


def inputs(shape_of, dtype, n, seed=0):
    """Every rank's input (each rank makes them all, to compute the references): small integers, exact in any dtype."""
    return [np.random.default_rng(seed + r).integers(-4, 5, shape_of(r)).astype(dtype) for r in range(n)]


def both_modes(fn, *args):
    """fn(*args) eagerly, then as a tf.function traced once and run twice
    (the collectives run when the graph runs: twice, not once)."""
    graph = tf.function(fn)
    return [fn(*args), graph(*args), graph(*args)]


def value_and_gradient(op, x, upstream):
    """op(x), and the gradient of sum(op(x) * upstream) with respect to x."""
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = op(x)
        loss = tf.reduce_sum(tf.cast(y, tf.float32) * upstream)
    return y, tape.gradient(loss, x)


def check_value_and_gradient(op, x, upstream, want_y, want_grad, exact=True):
    compare = np.testing.assert_array_equal if exact else (
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6))
    for y, grad in both_modes(lambda t: value_and_gradient(op, t, upstream), tf.constant(x)):
        assert y.dtype.as_numpy_dtype == want_y.dtype, (y.dtype, want_y.dtype)
        compare(y.numpy(), want_y)
        compare(grad.numpy(), want_grad)


def raises(error_type, match, fn, *args):
    """fn(*args) must raise `error_type` whose message contains `match`, eagerly and inside tf.function
    (there through typed_errors)."""
    for mode in ("eager", "graph"):
        try:
            with ctf.typed_errors():
                (fn if mode == "eager" else tf.function(fn))(*args)
        except error_type as error:
            assert match in str(error), (mode, str(error))
        else:
            raise AssertionError(f"{mode}: no {error_type.__name__} ({match})")


# -- ops: 3 ranks ----------------------------------------------------------------------------------


def scenario_ops(comm, output):
    n, r = comm.size, comm.rank

    # allreduce: every op on three dtypes; sum and avg gradients.
    for dtype in (np.float32, np.float64, np.int32):
        xs = inputs(lambda q: (3, 4), dtype, n)
        for op, reference in (("sum", np.sum), ("max", np.max), ("min", np.min), ("prod", np.prod)):
            want = reference(np.stack(xs), axis=0).astype(dtype)
            for got in both_modes(lambda t: ctf.allreduce(t, comm, op=op), tf.constant(xs[r])):
                np.testing.assert_array_equal(got.numpy(), want, err_msg=f"{op} {dtype}")
    xs = inputs(lambda q: (3, 4), np.float32, n)
    upstreams = inputs(lambda q: (3, 4), np.float32, n, seed=100)
    check_value_and_gradient(lambda t: ctf.allreduce(t, comm), xs[r], upstreams[r],
                             np.sum(xs, axis=0), np.sum(upstreams, axis=0))
    check_value_and_gradient(lambda t: ctf.allreduce(t, comm, op="avg"), xs[r], upstreams[r],
                             (np.sum(xs, axis=0) / n).astype(np.float32),
                             (np.sum(upstreams, axis=0) / n).astype(np.float32), exact=False)
    x = tf.constant(xs[r])
    ctf.allreduce(x, comm)
    np.testing.assert_array_equal(x.numpy(), xs[r])   # TensorFlow's buffer was not written
    ok("allreduce", comm)

    # 16-bit floats add in float32 and round once: 1024 + 0.5 + 0.5 is 1025,
    # where float16 additions one at a time would give 1024 (and bfloat16's
    # 256 + 1 + 1: 258, not 256).
    assert n == 3
    for dtype, values, want in ((np.float16, [1024.0, 0.5, 0.5], 1025.0),
                                (tf.bfloat16.as_numpy_dtype, [256.0, 1.0, 1.0], 258.0)):
        x = np.full(5, values[r], dtype)
        for got in both_modes(lambda t: ctf.allreduce(t, comm), tf.constant(x)):
            assert got.dtype.as_numpy_dtype == dtype and (got.numpy().astype(np.float32) == want).all(), got
        _, grad = value_and_gradient(lambda t: ctf.allreduce(t, comm), tf.constant(x), tf.ones(5))
        assert grad.dtype.as_numpy_dtype == dtype and (grad.numpy().astype(np.float32) == n).all(), grad
    # compression passes through (float32 only): int8's error bound, not exact
    big = np.random.default_rng(r).standard_normal(4096).astype(np.float32)
    got = ctf.allreduce(tf.constant(big), comm, op="avg", compression="int8").numpy()
    want = np.mean([np.random.default_rng(q).standard_normal(4096).astype(np.float32) for q in range(n)], axis=0)
    assert 1e-4 < np.abs(got - want).max() < 0.05, np.abs(got - want).max()   # not float32 rounding alone
    ok("half_precision", comm)

    # allgather: uneven rows (rank q has q + 1, then q rows: rank 0 none), even rows, any dtype.
    for rows_of in (lambda q: q + 1, lambda q: q, lambda q: 2):
        xs = inputs(lambda q: (rows_of(q), 2, 3), np.float32, n)
        whole = np.concatenate(xs)
        upstreams = inputs(lambda q: whole.shape, np.float32, n, seed=100)
        start = sum(rows_of(q) for q in range(r))
        check_value_and_gradient(lambda t: ctf.allgather(t, comm), xs[r], upstreams[r],
                                 whole, np.sum(upstreams, axis=0)[start:start + rows_of(r)])
    for dtype in (np.bool_, np.complex64, np.int64, np.uint8):
        xs = [(np.arange(3 * (q + 1)).reshape(q + 1, 3) % 2 + 1j * q).astype(dtype)
              if dtype == np.complex64 else (np.arange(3 * (q + 1)).reshape(q + 1, 3) % (2 + q)).astype(dtype)
              for q in range(n)]
        for got in both_modes(lambda t: ctf.allgather(t, comm), tf.constant(xs[r])):
            np.testing.assert_array_equal(got.numpy(), np.concatenate(xs))
    ok("allgather", comm)

    # reduce_scatter: rank r's block of the sum (avg, max); gradients of sum and avg.
    xs = inputs(lambda q: (2 * n, 3), np.float32, n)
    upstreams = inputs(lambda q: (2, 3), np.float32, n, seed=100)
    block = slice(2 * r, 2 * r + 2)
    check_value_and_gradient(lambda t: ctf.reduce_scatter(t, comm), xs[r], upstreams[r],
                             np.sum(xs, axis=0)[block], np.concatenate(upstreams))
    check_value_and_gradient(lambda t: ctf.reduce_scatter(t, comm, op="avg"), xs[r], upstreams[r],
                             (np.sum(xs, axis=0) / n).astype(np.float32)[block],
                             (np.concatenate(upstreams) / n).astype(np.float32), exact=False)
    for got in both_modes(lambda t: ctf.reduce_scatter(t, comm, op="max"), tf.constant(xs[r])):
        np.testing.assert_array_equal(got.numpy(), np.max(xs, axis=0)[block])
    ok("reduce_scatter", comm)

    # broadcast from rank 1: its values everywhere; the gradient is the sum at the root, zeros elsewhere.
    xs = inputs(lambda q: (4, 2), np.float32, n)
    upstreams = inputs(lambda q: (4, 2), np.float32, n, seed=100)
    check_value_and_gradient(lambda t: ctf.broadcast(t, comm, root=1), xs[r], upstreams[r],
                             xs[1], np.sum(upstreams, axis=0) if r == 1 else np.zeros((4, 2), np.float32))
    for dtype in (np.bool_, np.int64, np.complex128):
        values = [np.array([q % 2, 1, 0], dtype) + (1j * q if dtype == np.complex128 else 0) for q in range(n)]
        for got in both_modes(lambda t: ctf.broadcast(t, comm, root=2), tf.constant(values[r])):
            np.testing.assert_array_equal(got.numpy(), values[2])
    ok("broadcast", comm)

    # grouped_allreduce: mixed dtypes and shapes (an empty one, a scalar), one fused call; its gradient.
    shapes = [(3, 4), (5,), (0, 2), (), (2, 2)]
    dtypes = [np.float32, np.float32, np.float32, np.float64, np.int32]
    xs = [inputs(lambda q: shape, dtype, n, seed=10 * i) for i, (shape, dtype) in enumerate(zip(shapes, dtypes))]
    for op, reduce in (("sum", lambda a: np.sum(a, axis=0)), ("avg", lambda a: np.sum(a, axis=0) / n)):
        for got in both_modes(lambda *ts: ctf.grouped_allreduce(list(ts), comm, op=op, fusion_threshold=64),
                              *[tf.constant(x[r]) for x in xs]):
            for g, x, dtype in zip(got, xs, dtypes):
                total = np.sum(np.stack(x), axis=0)
                want = total if op == "sum" else np.trunc(total / n) if dtype == np.int32 else total / n
                np.testing.assert_allclose(g.numpy(), want.astype(dtype), rtol=1e-6)   # avg of ints truncates
    floats = [tf.constant(x[r]) for x in xs[:2]]
    ups = [inputs(lambda q: shapes[i], np.float32, n, seed=200 + i) for i in range(2)]
    with tf.GradientTape() as tape:
        tape.watch(floats)
        ys = ctf.grouped_allreduce(floats, comm, op="avg")
        loss = sum(tf.reduce_sum(y * u[r]) for y, u in zip(ys, ups))
    for grad, u in zip(tape.gradient(loss, floats), ups):
        np.testing.assert_allclose(grad.numpy(), np.sum(u, axis=0) / n, rtol=1e-6)
    # compression reaches the fused call: bf16 on the wire, within its bound and not exact
    randoms = [np.random.default_rng(50 + q).standard_normal(300).astype(np.float32) for q in range(n)]
    got, = ctf.grouped_allreduce([tf.constant(randoms[r])], comm, op="avg", compression="bf16")
    error = np.abs(got.numpy() - np.mean(randoms, axis=0)).max()
    assert 1e-4 < error < 0.05, error   # float32 rounding alone would stay near 1e-7
    ok("grouped_allreduce", comm)

    # broadcast_variables: rank 1's values in every rank's variables, one broadcast.
    variables = [tf.Variable(np.full((3, 2), r, np.float32)), tf.Variable(np.int64(10 + r)),
                 tf.Variable([r == 1, r != 1, True]), tf.Variable(np.zeros((0,), np.float16))]
    ctf.broadcast_variables(variables, comm, root=1)
    assert (variables[0].numpy() == 1).all() and variables[1].numpy() == 11, variables
    assert variables[2].numpy().tolist() == [True, False, True], variables[2]
    graph_variables = [tf.Variable(np.full(4, r + 0.5, np.float32))]
    tf.function(lambda: ctf.broadcast_variables(graph_variables, comm, root=2))()
    assert (graph_variables[0].numpy() == 2.5).all(), graph_variables[0]
    ok("broadcast_variables", comm)

    # A graph traced on one rank runs against eager calls on the others:
    # calls are numbered when they run. Independent collectives in one
    # graph run in program order on every rank (20 runs, no mismatch).
    def several(a, b, c):
        return ctf.allreduce(a, comm), ctf.allgather(b, comm), ctf.broadcast(c, comm, root=0), \
            ctf.allreduce(c, comm, op="max")
    args = [tf.constant(np.full(3, r, np.float32)), tf.constant(np.full((1, 2), r, np.int32)),
            tf.constant(np.full(2, r + 1.0))]
    traced = tf.function(several)
    for step in range(20):
        got = traced(*args) if r == 0 or step % 2 else several(*args)
        assert (got[0].numpy() == sum(range(n))).all() and got[1].numpy()[:, 0].tolist() == list(range(n))
        assert (got[2].numpy() == 1).all() and (got[3].numpy() == n).all()
    ok("order", comm)

    # Errors: typed, naming the argument, on every rank alike; the communicator goes on working after them.
    raises(InvalidUsageError, "tensor: tensors of string", lambda: ctf.allreduce(tf.constant(["a", "b"]), comm))
    raises(InvalidUsageError, "tensor: tensors of complex64", lambda: ctf.allreduce(tf.zeros(2, tf.complex64), comm))
    raises(InvalidUsageError, "tensor: tensors of string cannot be moved",
           lambda: ctf.broadcast(tf.constant(["a"]), comm))
    raises(InvalidUsageError, "op: unknown reduction", lambda: ctf.allreduce(tf.zeros(2), comm, op="mean"))
    raises(InvalidUsageError, "root:", lambda: ctf.broadcast(tf.zeros(2), comm, root=n))
    raises(InvalidUsageError, "compression:", lambda: ctf.allreduce(tf.zeros(2, tf.float64), comm,
                                                                     compression="bf16"))
    raises(InvalidUsageError, f"must be a multiple of {n}", lambda: ctf.reduce_scatter(tf.zeros((n + 1, 2)), comm))
    raises(InvalidUsageError, "scalar", lambda: ctf.allgather(tf.zeros(()), comm))
    # Different shapes on different ranks: all raise, and the message says every rank's shape.
    mismatched = tf.zeros((2, r + 1))
    raises(InvalidUsageError, "tensor: every rank must pass the same dtype and shape",
           lambda: ctf.allreduce(mismatched, comm))
    raises(InvalidUsageError, f"rank {r}: allreduce (op sum, compression None) of float32 (2, {r + 1})",
           lambda: ctf.allreduce(mismatched, comm))
    raises(InvalidUsageError, "every dimension but the first", lambda: ctf.allgather(mismatched, comm))
    raises(InvalidUsageError, "tensor: every rank", lambda: ctf.broadcast(mismatched, comm, root=0))
    raises(InvalidUsageError, "tensors: every rank",
           lambda: ctf.grouped_allreduce([tf.zeros(2), mismatched], comm))
    differently_typed = tf.zeros(7, tf.float32 if r else tf.float64)   # (7,): no rank agreed on it before
    raises(InvalidUsageError, "float64 (7,)", lambda: ctf.allreduce(differently_typed, comm))
    # Inside tf.function, without typed_errors: TensorFlow's InvalidArgumentError, whose typed error we recover.
    try:
        tf.function(lambda: ctf.allreduce(mismatched, comm))()
    except tf.errors.InvalidArgumentError as error:
        assert isinstance(ctf.typed_error(error), InvalidUsageError), error
    else:
        raise AssertionError("mismatched shapes went through a tf.function")
    # A reduction without a gradient says so when the gradient is asked for.
    with tf.GradientTape() as tape:
        t = tf.constant([1.0, 2.0])
        tape.watch(t)
        y = ctf.allreduce(t, comm, op="max")
    try:
        tape.gradient(y, t)
    except InvalidUsageError as error:
        assert "op: allreduce with op 'max' has no gradient" in str(error), error
    else:
        raise AssertionError("max's gradient was computed")
    assert ctf.allreduce(tf.ones(2), comm).numpy().tolist() == [n, n]   # still working
    ok("errors", comm)

    # Calls agreed on once are not agreed on again (ops.py, _agree_once).
    # Two shapes of one dtype and size, each agreed on before, pass unseen:
    # the flat elements are reduced (the documented limit of the cache).
    for shape in ((2, 3), (3, 2)):
        ctf.allreduce(tf.ones(shape), comm)
    got = ctf.allreduce(tf.reshape(tf.range(6.0), (2, 3) if r == 0 else (3, 2)), comm)
    assert got.shape == ((2, 3) if r == 0 else (3, 2)) and got.numpy().reshape(-1).tolist() == [n * v for v in range(6)]
    # A rank with a call it agreed on against ranks with one they did not:
    # the agreement's allgather meets the allreduce, which the communicator
    # itself catches on every rank (and aborts the communicator: last here).
    try:
        ctf.allreduce(tf.ones((2, 3)) if r == 0 else tf.ones(4), comm)
    except InvalidUsageError as error:
        assert "a different call" in str(error), error
    else:
        raise AssertionError("an agreed call against an unagreed one went through")
    ok("cached", comm)


# -- training: 2 ranks ----------------------------------------------------------------------------


def global_batches(steps, batch, seed=0):
    """Features (batch, 8), embedding ids (batch,) and labels (batch,) of every global batch."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, 8)).astype(np.float32), rng.integers(0, 10, batch),
             rng.integers(0, 4, batch)) for _ in range(steps)]


def tape_model(seed):
    """A Keras-free model: an embedding table (its gradient is an IndexedSlices) and two dense layers."""
    rng = np.random.default_rng(seed)
    shapes = [(10, 8), (8, 16), (16,), (16, 4), (4,)]
    return [tf.Variable(rng.standard_normal(shape).astype(np.float32) * 0.3) for shape in shapes]


def tape_loss(params, features, ids, labels):
    table, w1, b1, w2, b2 = params
    hidden = tf.nn.relu((features + tf.gather(table, ids)) @ w1 + b1)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, hidden @ w2 + b2))


def sgd(params, grads, lr=0.1):
    for p, g in zip(params, grads):
        if isinstance(g, tf.IndexedSlices):
            p.scatter_sub(tf.IndexedSlices(lr * g.values, g.indices, g.dense_shape))   # duplicate indices add
        else:
            p.assign_sub(lr * g)


def flat(variables):
    return np.concatenate([np.asarray(v).reshape(-1) for v in variables])


def same_bits_everywhere(values):
    everyone = MPI.COMM_WORLD.allgather(values.tobytes())
    return all(b == everyone[0] for b in everyone)


def scenario_training(comm, output):
    n, r = comm.size, comm.rank
    measured = {}
    batches = global_batches(12, 16)
    local = 16 // n

    # The tape: rank r takes rows r*local.. of every global batch; averaged
    # gradients must land where one process on the whole batches lands.
    for sparse_as_dense in (False, True):
        params = tape_model(seed=100 + r)          # different on every rank until the broadcast
        ctf.broadcast_variables(params, comm, root=0)

        @tf.function
        def step(features, ids, labels):
            with tf.GradientTape() as tape:
                loss = tape_loss(params, features, ids, labels)
            grads = ctf.DistributedGradientTape(tape, comm, sparse_as_dense=sparse_as_dense).gradient(loss, params)
            assert isinstance(grads[0], tf.IndexedSlices) != sparse_as_dense, type(grads[0])
            sgd(params, grads)

        for features, ids, labels in batches:
            mine = slice(r * local, (r + 1) * local)
            step(features[mine], ids[mine], labels[mine])
        alone = tape_model(seed=100)               # rank 0's start, trained on the whole batches
        for features, ids, labels in batches:
            with tf.GradientTape() as tape:
                loss = tape_loss(alone, features, ids, labels)
            sgd(alone, tape.gradient(loss, alone))
        difference = float(np.abs(flat(params) - flat(alone)).max())
        assert same_bits_everywhere(flat(params)), "ranks' parameters differ"
        assert difference <= 1e-5, difference
        assert np.abs(flat(alone) - flat(tape_model(seed=100))).max() > 1e-2   # training moved them
        measured[f"tape sparse_as_dense={sparse_as_dense}"] = difference
    ok("tape", comm)

    scenario_keras(comm, measured)
    ok("keras", comm)
    if output and r == 0:
        with open(output, "w") as f:
            json.dump(measured, f)
    scenario_killed(comm)


def keras_model(seed):
    import keras
    keras.utils.set_random_seed(seed)
    ids = keras.Input((1,), dtype="int32")
    features = keras.Input((8,))
    embedded = keras.layers.Flatten()(keras.layers.Embedding(10, 8)(ids))
    hidden = keras.layers.Dense(16, activation="relu")(keras.layers.Concatenate()([features, embedded]))
    return keras.Model([features, ids], keras.layers.Dense(4)(hidden))


def scenario_keras(comm, measured):
    """Keras fit on 2 ranks (each half of every global batch) against one
    process on the global batches: the same weights to 1e-5, and the same
    epoch losses once averaged. Clipping is active (global_clipnorm 0.05),
    so clipping each rank's gradients before averaging would not match."""
    import keras
    from collectives.keras import BroadcastGlobalVariablesCallback, DistributedOptimizer, MetricAverageCallback

    n, r = comm.size, comm.rank
    batches = global_batches(8, 16, seed=1)
    local = 16 // n

    def data(rows):
        return ([np.concatenate([b[0][rows] for b in batches]), np.concatenate([b[1][rows] for b in batches])[:, None]],
                np.concatenate([b[2][rows] for b in batches]))

    def compile_(model, optimizer):
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    model = compile_(keras_model(seed=r),
                     DistributedOptimizer(keras.optimizers.Adam(0.01, global_clipnorm=0.05), comm))
    x, y = data(slice(r * local, (r + 1) * local))
    history = model.fit(x, y, batch_size=local, epochs=2, shuffle=False, verbose=0,
                        callbacks=[BroadcastGlobalVariablesCallback(comm, root=0), MetricAverageCallback(comm)])
    alone = compile_(keras_model(seed=0), keras.optimizers.Adam(0.01, global_clipnorm=0.05))
    x, y = data(slice(None))
    reference = alone.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    weights, want = flat([w.numpy() for w in model.weights]), flat([w.numpy() for w in alone.weights])
    difference = float(np.abs(weights - want).max())
    assert same_bits_everywhere(weights), "ranks' Keras weights differ"
    assert difference <= 1e-5, difference
    assert np.abs(want - flat([w.numpy() for w in keras_model(seed=0).weights])).max() > 1e-3   # it trained
    losses = np.array(history.history["loss"])
    assert same_bits_everywhere(losses), "MetricAverageCallback left the ranks' losses different"
    np.testing.assert_allclose(losses, reference.history["loss"], rtol=1e-5)
    measured["keras fit"] = difference
    measured["keras loss"] = float(np.abs(losses - reference.history["loss"]).max())


def scenario_keras_torch(comm, output):
    """scenario_keras's fit on Keras' torch backend: collectives.keras
    reduces the torch gradients (CPU tensors, in place, one fused call)."""
    import keras
    assert keras.backend.backend() == "torch", keras.backend.backend()
    measured = {}
    scenario_keras(comm, measured)
    ok("keras_torch", comm)
    if output and comm.rank == 0:
        json.dump(measured, open(output, "w"))


def scenario_killed(comm):
    """Rank 1 dies between steps of a tf.function; rank 0's next step raises,
    inside the graph: TensorFlow's UnknownError naming RankFailedError,
    which typed_errors turns back into RankFailedError, within the timeout."""
    params = [tf.Variable(np.ones(64, np.float32))]

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(params[0] ** 2)
        sgd(params, ctf.DistributedGradientTape(tape, comm).gradient(loss, params))

    for number in range(10):
        if number == 5 and comm.rank == 1:
            os._exit(0)
        start = time.perf_counter()
        try:
            with ctf.typed_errors():
                step()
        except RankFailedError as error:
            elapsed = time.perf_counter() - start
            assert number == 5, f"step {number} raised: {error}"
            assert isinstance(error.__cause__, tf.errors.UnknownError), type(error.__cause__)
            assert "RankFailedError" in str(error.__cause__), error.__cause__
            assert elapsed < TIMEOUT, f"took {elapsed:.1f}s to notice, with a {TIMEOUT}s timeout"
            print(f"rank {comm.rank} raised {type(error).__name__} {elapsed:.3f}s into step {number}", flush=True)
            ok("killed", comm)
            return
    raise AssertionError("training went on without rank 1")


# -- mirrored: 2 processes of 4 logical CPU devices each ------------------------------------------

REPLICAS = 4


def per_replica(strategy, make):
    """A PerReplica value: make(replica) on each replica's device."""
    return strategy.experimental_distribute_values_from_function(lambda ctx: make(ctx.replica_id_in_sync_group))


def local_results(strategy, value):
    return [tf.convert_to_tensor(v).numpy() for v in strategy.experimental_local_results(value)]


def close(a, b, what, tolerance=1e-6):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=tolerance,
                               atol=tolerance, err_msg=what)


def sparse_gradient(ids_of):
    """In a replica: the gradient of a gather from a table, an IndexedSlices, all-reduced with `op`."""
    def step(op, table):
        replica = tf.distribute.get_replica_context()
        ids = tf.stack([tf.cast(i, tf.int32) for i in ids_of(replica.replica_id_in_sync_group)])
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(table, ids) * tf.cast(tf.reshape(ids, (-1, 1)) + 1, tf.float32))
        grad = tape.gradient(loss, table)
        assert isinstance(grad, tf.IndexedSlices), type(grad)
        return replica.all_reduce(op, grad)
    return step


def scenario_mirrored(comm, output):
    """CrossDeviceOps against ReductionToOneDevice on 4 logical CPU devices
    in each process (comm=None), then with comm over the 2 processes'
    8 replicas against NumPy, eagerly and in tf.function; a Keras fit under
    MirroredStrategy with ours against ReductionToOneDevice."""
    import keras
    n, r = comm.size, comm.rank
    devices = [f"/cpu:{i}" for i in range(REPLICAS)]
    assert len(tf.config.list_logical_devices("CPU")) == REPLICAS
    SUM, MEAN = tf.distribute.ReduceOp.SUM, tf.distribute.ReduceOp.MEAN
    ours_ops = ctf.CrossDeviceOps()
    ours = tf.distribute.MirroredStrategy(devices, cross_device_ops=ours_ops)
    ref = tf.distribute.MirroredStrategy(devices, cross_device_ops=tf.distribute.ReductionToOneDevice())
    rng = np.random.default_rng(7)
    data = {dtype: rng.standard_normal((REPLICAS, 3, 5)).astype(dtype) * (1 if dtype != np.int32 else 100)
            for dtype in (np.float32, np.float64, np.int32)}

    # The ops' reduce (MirroredStrategy itself sends strategy.reduce and
    # extended.reduce_to to CPU destinations, and int32 values, to its own
    # ReductionToOneDevice: only batch_reduce_to, what a replica's all_reduce
    # and Keras' gradients take, and gather come to the CrossDeviceOps).
    theirs_ops = tf.distribute.ReductionToOneDevice()
    for dtype, values in data.items():
        for op in ((SUM, MEAN) if dtype != np.int32 else (SUM,)):
            mine, theirs = (per_replica(s, lambda i: tf.constant(values[i])) for s in (ours, ref))
            got = local_results(ours, ours_ops.reduce(op, mine, destinations=mine))
            want = local_results(ref, theirs_ops.reduce(op, theirs, destinations=theirs))
            assert len(got) == REPLICAS and got[0].dtype == want[0].dtype, (len(got), got[0].dtype, want[0].dtype)
            for a, b in zip(got, want):
                close(a, b, f"reduce {op} {dtype}")
            close(got[0], values.sum(0) / (REPLICAS if op == MEAN else 1), f"reduce {op} {dtype} against NumPy")
    values = [per_replica(s, lambda i: tf.constant(data[np.float32][i])) for s in (ours, ref)]
    others = [per_replica(s, lambda i: tf.constant(data[np.float64][i, 0])) for s in (ours, ref)]
    for op in (SUM, MEAN):
        got = ours.extended.batch_reduce_to(op, [(values[0], values[0]), (others[0], others[0])])
        want = ref.extended.batch_reduce_to(op, [(values[1], values[1]), (others[1], others[1])])
        for g, w in zip(got, want):
            mine, theirs = local_results(ours, g), local_results(ref, w)
            assert len(mine) == REPLICAS
            for a, b in zip(mine, theirs):
                close(a, b, f"batch_reduce {op}")
        one, = ours.experimental_local_results(ours_ops.reduce(op, values[0], destinations="/cpu:2"))
        assert one.device.endswith("CPU:2"), one.device
        close(one.numpy(), local_results(ref, theirs_ops.reduce(op, values[1], destinations="/cpu:2"))[0],
              "reduce to one device")
    # In a graph (strategy.run inside tf.function: the replicas' all_reduce
    # goes through merge_call to batch_reduce), run twice.
    for strategy, results in ((ours, []), (ref, [])):
        with strategy.scope():
            scale = tf.Variable(1.0)
        @tf.function
        def step():
            def replica_fn():
                ctx = tf.distribute.get_replica_context()
                x = tf.cast(tf.fill([4], ctx.replica_id_in_sync_group + 1), tf.float32) * scale
                return ctx.all_reduce(SUM, x), ctx.all_reduce(MEAN, [x, 2 * x])
            return strategy.run(replica_fn)
        for _ in range(2):
            summed, (m1, m2) = step()
            results.append([local_results(strategy, v) for v in (summed, m1, m2)])
        if strategy is ours:
            got = results
        else:
            for a, b in zip(got, results):
                for x, y in zip(a, b):
                    close(x, y, "all_reduce in tf.function")
            close(got[0][0][0], np.full(4, 10.0), "all_reduce SUM in tf.function against 1 + 2 + 3 + 4")
    # IndexedSlices stay sparse, as ReductionToOneDevice keeps them.
    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    step = sparse_gradient(lambda replica: [replica, replica + 1, 0])
    for op in (SUM, MEAN):
        grads = []
        for strategy in (ours, ref):
            with strategy.scope():
                variable = tf.Variable(table)
            for run in (lambda f: f(), lambda f: tf.function(f)()):
                grad = run(lambda: strategy.run(step, args=(op, variable)))
                locals_ = strategy.experimental_local_results(grad)
                assert all(isinstance(g, tf.IndexedSlices) for g in locals_), [type(g) for g in locals_]
                grads.append([tf.convert_to_tensor(g).numpy() for g in locals_])
        for g in grads[1:]:
            for a, b in zip(grads[0], g):
                close(a, b, f"IndexedSlices {op}")
    # strategy.gather along two axes.
    for axis in (0, 1):
        got = ours.gather(values[0], axis=axis).numpy()
        close(got, ref.gather(values[1], axis=axis).numpy(), f"gather axis {axis}")
        assert got.shape == ((REPLICAS * 3, 5) if axis == 0 else (3, REPLICAS * 5)), got.shape
    # Errors: typed, naming the argument.
    for call, message in (
            (lambda: ours_ops.reduce(SUM, per_replica(ours, lambda i: tf.constant([True])), "/cpu:0"),
             "per_replica_value (value 0): tensors of bool cannot be reduced"),
            (lambda: ours_ops.reduce_implementation("max", values[0], values[0], None), "reduce_op:"),
            (lambda: ctf.CrossDeviceOps(fusion_threshold=0), "fusion_threshold"),
            (lambda: ctf.CrossDeviceOps(collectives.Communicator.local(2)), "comm: the TensorFlow ops need")):
        try:
            call()
        except InvalidUsageError as error:
            assert message in str(error), (message, str(error))
        else:
            raise AssertionError(f"no InvalidUsageError: {message}")
    ok("mirrored_local", comm)

    # Keras fit under MirroredStrategy: ours against ReductionToOneDevice, the same weights.
    calls = []
    batch_reduce = ours_ops.batch_reduce_implementation
    ours_ops.batch_reduce_implementation = lambda *a, **k: calls.append(1) or batch_reduce(*a, **k)
    weights = []
    for strategy in (ours, ref):
        with strategy.scope():
            model = keras_model(seed=3)
            model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        batches = global_batches(6, 16, seed=5)
        x = [np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches])[:, None]]
        y = np.concatenate([b[2] for b in batches])
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        weights.append(flat([w.numpy() for w in model.weights]))
    start = flat([w.numpy() for w in keras_model(seed=3).weights])
    assert np.abs(weights[1] - start).max() > 1e-3, "Keras did not train"
    difference = float(np.abs(weights[0] - weights[1]).max())
    assert calls, "Keras' gradients did not come to our CrossDeviceOps"   # else the comparison proves nothing
    assert difference <= 1e-6, difference
    print(f"rank {r}: Keras fit, ours against ReductionToOneDevice: {difference:.2e}", flush=True)
    ok("mirrored_keras", comm)

    # With comm: the 8 replicas of both processes, against NumPy.
    across_ops = ctf.CrossDeviceOps(comm, fusion_threshold=256)
    across = tf.distribute.MirroredStrategy(devices, cross_device_ops=across_ops)
    everyone = np.random.default_rng(11).standard_normal((n, REPLICAS, 6, 3)).astype(np.float32)
    mine = everyone[r]
    for op, want in ((SUM, everyone.sum((0, 1))), (MEAN, everyone.mean((0, 1)))):
        value = per_replica(across, lambda i: tf.constant(mine[i]))
        for got in local_results(across, across_ops.reduce(op, value, destinations=value)):
            close(got, want, f"across {op}", 1e-5)
    # batch_reduce: several values, one fused allreduce across processes; int64 too
    # (MirroredStrategy sends int32 to its ReductionToOneDevice, and will not mix it in a batch)
    small = [per_replica(across, lambda i, k=k: tf.constant(mine[i, k])) for k in range(6)]
    got = across.extended.batch_reduce_to(SUM, [(v, v) for v in small])
    for k, value in enumerate(got):
        for local in local_results(across, value):
            close(local, everyone[:, :, k].sum((0, 1)), f"across batch_reduce {k}", 1e-5)
    ints = per_replica(across, lambda i: tf.constant([r * 10 + i], tf.int64))
    got, = across.extended.batch_reduce_to(SUM, [(ints, ints)])
    assert all(v.tolist() == [sum(q * 10 + i for q in range(n) for i in range(REPLICAS))]
               for v in local_results(across, got)), local_results(across, got)
    # in tf.function, run 3 times: the collectives run each time
    counter = tf.Variable(0.0)
    @tf.function
    def graph_step():
        counter.assign_add(1.0)
        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            return ctx.all_reduce(MEAN, tf.fill([3], counter * (r * REPLICAS + tf.cast(ctx.replica_id_in_sync_group,
                                                                                            tf.float32))))
        return across.run(replica_fn)
    for run in range(1, 4):
        for local in local_results(across, graph_step()):
            close(local, np.full(3, run * np.arange(n * REPLICAS).mean()), f"across in tf.function, run {run}")
    # IndexedSlices across processes: allgathered, still sparse.
    step = sparse_gradient(lambda replica: [r * REPLICAS + replica, 9])
    with across.scope():
        variable = tf.Variable(table)
    want = np.zeros_like(table)
    for q in range(n * REPLICAS):
        for i in (q, 9):
            want[i] += i + 1
    for op, divisor in ((SUM, 1), (MEAN, n * REPLICAS)):
        for local in across.experimental_local_results(across.run(step, args=(op, variable))):
            assert isinstance(local, tf.IndexedSlices), type(local)
            close(tf.convert_to_tensor(local).numpy(), want / divisor, f"across IndexedSlices {op}")
    gathered = across.gather(per_replica(across, lambda i: tf.constant([[r * REPLICAS + i]], tf.int64)), axis=1).numpy()
    assert gathered.tolist() == [list(range(n * REPLICAS))], gathered
    # Processes passing different shapes: every process raises, naming them.
    try:
        value = per_replica(across, lambda i: tf.zeros(13 + r))   # shapes no process agreed on before
        across.extended.batch_reduce_to(SUM, [(value, value)])
    except InvalidUsageError as error:
        assert "per_replica_value: every rank must pass the same dtype and shape" in str(error), error
        assert "(op sum, 4 replicas) of float32 (14,)" in str(error), error
    else:
        raise AssertionError("processes with different shapes went through")
    ok("mirrored_across", comm)

    # Keras fit across the processes (sum_across="mean"), each on its half
    # of every global batch, against one process's fit on the global batches
    # (the ReductionToOneDevice run above: weights[1]). SGD, not Adam: Adam
    # would hide gradients off by a constant factor (sum_across="sum" here).
    keras_ops = ctf.CrossDeviceOps(comm, sum_across="mean")
    keras_calls = []
    keras_reduce = keras_ops.batch_reduce_implementation
    keras_ops.batch_reduce_implementation = lambda *a, **k: keras_calls.append(1) or keras_reduce(*a, **k)
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=keras_ops)
    with strategy.scope():
        model = keras_model(seed=3)
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    share = slice(r * 16 // n, (r + 1) * 16 // n)
    batches = global_batches(6, 16, seed=5)
    x = [np.concatenate([b[0][share] for b in batches]), np.concatenate([b[1][share] for b in batches])[:, None]]
    y = np.concatenate([b[2][share] for b in batches])
    model.fit(x, y, batch_size=16 // n, epochs=2, shuffle=False, verbose=0)
    got = flat([w.numpy() for w in model.weights])
    difference = float(np.abs(got - weights[1]).max())
    assert keras_calls, "Keras' gradients did not come to our CrossDeviceOps"
    assert same_bits_everywhere(got), "the processes' Keras weights differ"
    assert difference <= 1e-5, difference
    print(f"rank {r}: Keras fit on 2 processes x {REPLICAS} replicas against one process: {difference:.2e}",
          flush=True)
    for ops_ in (ours_ops, across_ops, keras_ops):
        ops_.close()
    ok("mirrored_keras_across", comm)


# -- mwms: MultiWorkerMirroredStrategy started from our ranks -------------------------------------


def scenario_mwms(comm, output):
    """cluster_resolver gives every rank the same cluster, rank r as worker
    r; MultiWorkerMirroredStrategy starts from it (before any other
    TensorFlow op, as it must) and its all_reduce agrees with ours. The
    strategy is the benchmarks' (`--backend mwms`, bench/backends.py), which
    made it: their allreduce and allgather checked as the harness checks
    every backend, in and out of place."""
    import json as json_
    from bench import harness
    from bench.all_gather_perf import ALLGATHER
    from bench.all_reduce_perf import ALLREDUCE
    from bench.backends import Mwms
    n, r = comm.size, comm.rank
    checked = {}
    for spec, flags, nbytes in ((ALLREDUCE, ["-o", "avg"], 4096), (ALLREDUCE, ["-d", "bfloat16"], 1024),
                                (ALLGATHER, ["-d", "int32"], 4104)):
        args = harness.parse_args(spec, ["-n", "2", "-w", "1", *flags])
        backend = Mwms("mwms", spec, args, MPI.COMM_WORLD, comm=comm)
        placements = harness.measure([backend], spec, args, nbytes, MPI.COMM_WORLD)[0]
        checked[spec.name, args.dtype.name] = [(m["wrong"], m["seconds"] > 0) for m in placements]
    assert all(v == [(0, True), (0, True)] for v in checked.values()), checked
    strategy = backend.strategy
    resolver = strategy.cluster_resolver
    workers = resolver.cluster_spec().as_dict()["worker"]
    assert len(workers) == n and len(set(workers)) == n, workers
    assert all(w.startswith("localhost:") for w in workers), workers   # one machine: localhost
    assert resolver.task_type == "worker" and resolver.task_id == r, (resolver.task_type, resolver.task_id)
    assert MPI.COMM_WORLD.allgather(workers) == [workers] * n, "ranks got different clusters"
    assert strategy.num_replicas_in_sync == n, strategy.num_replicas_in_sync

    @tf.function
    def step(x):
        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            mine = tf.identity(x)   # on the replica's device (a captured input has none: "destinations empty")
            return ctx.all_reduce("sum", mine), ctx.all_reduce("mean", mine)
        return strategy.run(replica_fn)

    x = tf.constant(np.arange(6, dtype=np.float32) * (r + 1))
    for _ in range(2):
        summed, mean = (strategy.experimental_local_results(v)[0] for v in step(x))
        theirs = summed.numpy()
        np.testing.assert_array_equal(theirs, ctf.allreduce(x, comm).numpy())
        np.testing.assert_allclose(mean.numpy(), ctf.allreduce(x, comm, op="avg").numpy(), rtol=1e-6)
    assert theirs.tolist() == [v * sum(range(1, n + 1)) for v in range(6)], theirs
    config = json_.loads(ctf.tf_config(comm))
    assert config["task"] == {"type": "worker", "index": r} and len(config["cluster"]["worker"]) == n, config
    for host, message in ((":1", "host: expected None or a host name without a port"), ("", "host:")):
        try:
            ctf.cluster_resolver(comm, host=host)
        except InvalidUsageError as error:
            assert message in str(error), error
        else:
            raise AssertionError(f"host={host!r} went through")
    ok("mwms", comm)


def main():
    scenario, output = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    if scenario == "mirrored":   # before TensorFlow's runtime starts: it fixes the devices then
        cpu, = tf.config.list_physical_devices("CPU")
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * REPLICAS)
    tf.config.threading.set_inter_op_parallelism_threads(2)   # several ranks share the machine's cores
    tf.config.threading.set_intra_op_parallelism_threads(1)
    comm = collectives.init(timeout=TIMEOUT)
    assert comm.size == MPI.COMM_WORLD.size and comm.rank == MPI.COMM_WORLD.rank
    globals()[f"scenario_{scenario}"](comm, output)
    if scenario == "training":
        os._exit(0)   # rank 1 died: MPI_Finalize would wait for it
    comm.close()


if __name__ == "__main__":
    main()
