"""collectives.tensorflow and collectives.keras.

In this process, on one rank: argument errors (typed, naming the argument),
how a graph runs its collectives (in program order, each time it runs, not
when traced), TensorFlow's errors turned back into ours, and one rank
training exactly as without the wrappers.

Under mpiexec (tests/tensorflow_worker.py is one rank): on 3 processes every
op's values and gradients against NumPy, eagerly and inside tf.function,
and the errors of mismatched ranks; on 2 processes a GradientTape and a
Keras fit landing on one process's parameters trained on the concatenated
batches (1e-5), then a peer that dies under a tf.function giving
RankFailedError, not a hang.
"""

import functools
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

import collectives
import mpi_launch
from collectives import CollectiveTimeoutError, InvalidUsageError, RankFailedError
from installed import needs, require

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
pytestmark = [needs("tensorflow", reason="the TensorFlow tests need TensorFlow: pip install '.[test]' "
                                         "(or '.[tensorflow]')"),
              needs("keras", reason="the Keras tests need Keras 3, which TensorFlow >= 2.17 brings")]

# TensorFlow, Keras and our modules over them, imported by the first test of
# this process that runs TensorFlow in it, not when pytest collects the
# module: the import costs about 5 CPU-s (Keras brings scikit-learn and
# SciPy), which each xdist worker paid at collection, and the tests marked
# mpi only start processes that import it themselves.
tf = keras = ctf = native = BroadcastGlobalVariablesCallback = DistributedOptimizer = MetricAverageCallback = None


@pytest.fixture(autouse=True)
def tensorflow_in_this_process(request):
    global tf, keras, ctf, native, BroadcastGlobalVariablesCallback, DistributedOptimizer, MetricAverageCallback
    if tf is None and request.node.get_closest_marker("mpi") is None:
        import tensorflow as tf
        import keras

        import collectives.tensorflow as ctf
        from collectives.keras import BroadcastGlobalVariablesCallback, DistributedOptimizer, MetricAverageCallback
        from collectives.tensorflow import native


WORKER = Path(__file__).with_name("tensorflow_worker.py")


@pytest.fixture
def comm():
    with collectives.Communicator.local(1) as one:
        yield one


# -- in this process, one rank ----------------------------------------------------------------


def test_bad_arguments_raise_invalid_usage_naming_the_argument(comm):
    cases = [
        (lambda: ctf.allreduce(tf.constant(["a"]), comm), "tensor: tensors of string cannot be reduced"),
        (lambda: ctf.allreduce(tf.zeros(2, tf.complex64), comm), "tensor: tensors of complex64 cannot be reduced"),
        (lambda: ctf.allreduce(tf.zeros(2, tf.bool), comm), "tensor: tensors of bool cannot be reduced"),
        (lambda: ctf.allgather(tf.constant(["a"]), comm), "tensor: tensors of string cannot be moved"),
        (lambda: ctf.allreduce(tf.zeros(2), comm, op="mean"), "op: unknown reduction 'mean'"),
        (lambda: ctf.allreduce(tf.zeros(2, tf.float64), comm, compression="int8"), "compression: 'int8' takes float32"),
        (lambda: ctf.allreduce(tf.zeros(2), comm, compression="zip"), "compression: unknown codec"),
        (lambda: ctf.broadcast(tf.zeros(2), comm, root=1), "root"),
        (lambda: ctf.allgather(tf.zeros(()), comm), "tensor: allgather concatenates along the first dimension"),
        (lambda: ctf.reduce_scatter(tf.zeros(()), comm), "tensor: reduce_scatter gives each"),
        (lambda: ctf.grouped_allreduce(tf.zeros(2), comm), "tensors: expected a list"),
        (lambda: ctf.grouped_allreduce([tf.zeros(2), tf.constant(["a"])], comm), "tensors[1]: tensors of string"),
        (lambda: ctf.grouped_allreduce([tf.zeros(2, tf.float16)], comm, compression="bf16"), "tensors[0]: compression"),
        (lambda: ctf.broadcast_variables([tf.zeros(2)], comm), "variables[0]: expected a tf.Variable"),
        (lambda: ctf.allreduce(tf.IndexedSlices(tf.zeros((1, 2)), tf.constant([0])), comm), "tensor: an IndexedSlices"),
        (lambda: ctf.DistributedGradientTape(object(), comm), "tape: expected a tf.GradientTape"),
        (lambda: ctf.DistributedGradientTape(tf.GradientTape(), comm, op="max"), "op: gradients are averaged"),
        (lambda: DistributedOptimizer(object(), comm), "optimizer: expected a keras.optimizers.Optimizer"),
        (lambda: DistributedOptimizer(DistributedOptimizer(keras.optimizers.SGD(), comm), comm), "optimizer: already"),
        (lambda: BroadcastGlobalVariablesCallback(comm, root=3), "root"),
        (lambda: ctf.CrossDeviceOps(fusion_threshold=0), "fusion_threshold"),
        (lambda: ctf.CrossDeviceOps(sum_across="avg"), "sum_across: expected 'sum' or 'mean'"),
    ]
    for call, message in cases:
        with pytest.raises(InvalidUsageError) as raised:
            call()
        assert str(raised.value).startswith(message.split(":")[0]) and message in str(raised.value), \
            (message, str(raised.value))
    with collectives.Communicator.local(2) as two:
        with pytest.raises(InvalidUsageError, match="comm: the TensorFlow ops need a communicator with one rank"):
            ctf.allreduce(tf.zeros(2), two)
        with pytest.raises(InvalidUsageError, match="comm: the TensorFlow ops need a communicator with one rank"):
            ctf.CrossDeviceOps(two)


def test_keras_helpers_refuse_a_backend_and_gradients_they_cannot_reduce(comm, monkeypatch):
    """JAX is refused by name; on the torch backend a gradient not on the CPU
    or not dense is named before anything is reduced, and None stays None."""
    import torch
    from collectives.keras import _backend
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(InvalidUsageError, match="optimizer: collectives.keras runs on Keras' TensorFlow or PyTorch "
                                                "backend, not 'jax'"):
        DistributedOptimizer(keras.optimizers.SGD(), comm)
    monkeypatch.setattr(keras.backend, "backend", lambda: "torch")
    kept = torch.arange(4, dtype=torch.float32)
    for bad, message in [(torch.zeros(2, device="meta"), "gradients[1]: on meta"),
                         (torch.zeros(2).to_sparse(), "gradients[1]: expected a dense torch.Tensor")]:
        with pytest.raises(InvalidUsageError, match=re.escape(message)):
            _backend.reduce_gradients([kept, bad], comm, "avg", None, False, 1 << 20)
        assert kept.tolist() == [0, 1, 2, 3]
    with collectives.Communicator.local(2) as two:
        with pytest.raises(InvalidUsageError, match="comm: collectives.keras' optimizer and callbacks need a "
                                                    "communicator with one rank"):
            DistributedOptimizer(keras.optimizers.SGD(), two)
    reduced = _backend.reduce_gradients([None, kept], comm, "sum", None, False, 1 << 20)
    assert reduced[0] is None and reduced[1].data_ptr() == kept.data_ptr()   # in place, one rank: the same values
    assert kept.tolist() == [0, 1, 2, 3]


@pytest.fixture(params=["native", "numpy_function"])
def graph_node(request, monkeypatch):
    """The node type our ops make in a graph: native.py's op (the default),
    or, where it cannot be built, tf.numpy_function's PyFunc."""
    if request.param == "numpy_function":
        monkeypatch.setattr(native, "_loaded", False)
        return "PyFunc"
    assert native.op() is not None, "the graph op did not build here"
    return native.OP_NAME


def test_a_graphs_collectives_run_in_program_order(graph_node):
    """Every rank must run the same collectives in the same order. In a
    tf.function, automatic control dependencies chain our stateful nodes
    in the order the program made them; were they free, TensorFlow's
    scheduler could run independent ones in any order, differently on
    different ranks."""
    with collectives.Communicator.local(1) as comm:
        @tf.function
        def independent(a, b, c):
            return (ctf.allreduce(a, comm), ctf.allgather(b, comm), ctf.broadcast(c, comm),
                    ctf.grouped_allreduce([a, c], comm))

        spec = tf.TensorSpec([None], tf.float32)
        graph = independent.get_concrete_function(spec, spec, spec).graph
        nodes = [op for op in graph.get_operations() if op.type == graph_node]
        assert [op.name.split("_")[0] for op in nodes] == [
            "CollectivesAllreduce", "CollectivesAllgather", "CollectivesBroadcast", "CollectivesGroupedAllreduce"]
        for before, after in zip(nodes, nodes[1:]):
            assert before in after.control_inputs, f"{after.name} may run before {before.name}"


def test_the_graph_op_is_built_once_into_the_cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    built = native.build()
    assert Path(built).parent == tmp_path and Path(built).is_file()
    made = Path(built).stat().st_mtime_ns
    assert native.build() == built and Path(built).stat().st_mtime_ns == made   # found, not built again
    changed = tmp_path / "changed" / "_call_op.cc"                             # another source: another name
    changed.parent.mkdir()
    changed.write_text(Path(native.SOURCE).read_text() + "\n// changed\n")
    monkeypatch.setattr(native, "SOURCE", str(changed))
    assert native.library_path() != built
    assert sorted(p.suffix for p in tmp_path.iterdir() if p.is_file()) == [".lock", ".so"]   # nothing half-written


def test_without_a_compiler_graph_nodes_fall_back_to_numpy_function_with_one_warning(tmp_path, monkeypatch, comm):
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PATH", str(tmp_path))   # (nor g++ nor c++ to be found)
    traced = tf.function(lambda x: ctf.allreduce(x, comm))
    with pytest.warns(RuntimeWarning, match="graph nodes are tf.numpy_function") as warned:
        assert traced(tf.ones(3)).numpy().tolist() == [1.0] * 3
        assert tf.function(lambda x: ctf.allgather(x, comm))(tf.ones(2)).numpy().tolist() == [1.0] * 2
    assert len(warned) == 1
    graph = traced.get_concrete_function(tf.TensorSpec([3], tf.float32)).graph
    assert "PyFunc" in {op.type for op in graph.get_operations()}
    assert not list(tmp_path.glob("*.so")), "a failed build left a library"


def test_graph_results_read_and_dropped_by_python_at_once(comm):
    """A result that Python drops at once releases its array on Python's own
    thread, the GIL held: the op must not let go of the GIL there (it did,
    and crashed the process within a few calls of this loop)."""
    t = tf.constant(np.arange(256, dtype=np.float32))
    graph = tf.function(lambda v: ctf.allreduce(v, comm, op="max"))
    for _ in range(200):
        np.testing.assert_array_equal(graph(t).numpy(), t.numpy())
    assert native.OP_NAME in {op.type for op in graph.get_concrete_function(t).graph.get_operations()}


def test_a_graph_nodes_other_errors_reach_tensorflow_named(graph_node):
    """What a body raises that is not ours (a bug) fails the node with its
    class and message; a body answering another dtype than the node's fails too."""
    def broken(a):
        raise ZeroDivisionError("division by zero in the body")

    def other_dtype(a):
        return [np.zeros(a.shape, np.float64)]

    for body, error, message in ((broken, tf.errors.UnknownError, "ZeroDivisionError: division by zero"),
                                 (other_dtype, tf.errors.OpError, "float64|double")):
        traced = tf.function(tf.autograph.experimental.do_not_convert(
            lambda x, body=body: ctf.ops._run("Broken", body, [x], [tf.float32])[0]))
        with pytest.raises(error, match=message):
            traced(tf.ones(2))


def test_the_benchmark_tools_tensorflow_calls_give_their_expected_results(comm):
    """What `--backend tf:collectives` runs for each tool (its spec's
    run_tf, in a tf.function), on one rank: the tool's own expected output."""
    from bench.all_gather_perf import ALLGATHER
    from bench.all_reduce_perf import ALLREDUCE
    from bench.broadcast_perf import BROADCAST
    from bench.reduce_scatter_perf import REDUCE_SCATTER
    for spec in (ALLREDUCE, ALLGATHER, REDUCE_SCATTER, BROADCAST):
        args = type("Args", (), {"op": "sum", "root": 0})()
        count, out_count = spec.counts(64, 4, 1)
        x = spec.fill(np.dtype(np.float32), "sum", 1, 0, count, 0)
        step = tf.function(functools.partial(spec.run_tf, ctf, comm, args=args))
        got = step(tf.constant(x)).numpy()
        np.testing.assert_array_equal(got, spec.expected(np.dtype(np.float32), "sum", 1, 0, out_count, 0), spec.name)


class CountingCommunicator:
    """A one-rank communicator that counts the collectives it runs."""

    def __init__(self, comm):
        self._comm, self.calls = comm, []

    def __getattr__(self, name):
        attribute = getattr(self._comm, name)
        if name in ("allreduce", "allgather", "broadcast", "reduce", "reduce_scatter", "allreduce_many"):
            def counted(*args, **kwargs):
                self.calls.append(name)
                return attribute(*args, **kwargs)
            return counted
        return attribute


def test_a_traced_graph_runs_its_collectives_each_time_it_runs(comm, graph_node):
    counting = CountingCommunicator(comm)
    traced = tf.function(lambda x: ctf.allreduce(x, counting, op="avg"))
    for value in (1.0, 2.0, 3.0):
        assert traced(tf.fill([4], value)).numpy().tolist() == [value] * 4
    # one trace, three runs: the first agrees on the call (an allgather) and
    # reduces; the others reduce alone (the ranks agreed on that call already)
    assert counting.calls == ["allgather", "allreduce"] + ["allreduce"] * 2
    assert traced.experimental_get_tracing_count() == 1
    # a shape not agreed on yet is agreed on once, eagerly as in the graph
    counting.calls.clear()
    for _ in range(2):
        assert ctf.allreduce(tf.ones([2, 3]), counting).numpy().tolist() == [[1.0] * 3] * 2
        assert traced(tf.ones([5])).numpy().tolist() == [1.0] * 5
    assert counting.calls == ["allgather", "allreduce", "allgather", "allreduce", "allreduce", "allreduce"]


def test_results_are_new_tensors_that_later_calls_never_write(comm, graph_node):
    """Results come from reused buffers once TensorFlow lets go of them
    (from 64 KiB): a result still alive must keep its values while later
    calls run, and no result shares memory with its input."""
    big = [tf.fill([1 << 15], float(i)) for i in range(4)]          # 128 KiB each
    kept = [ctf.allreduce(t, comm) for t in big]                     # alive: their buffers are not free
    graph = tf.function(lambda t: ctf.allreduce(t, comm, op="max"))
    kept += [graph(t) for t in big]
    for _ in range(3):                                               # released at once: reused
        ctf.allreduce(big[0], comm)
        graph(big[1])
    for i, result in enumerate(kept):
        assert (result.numpy() == i % 4).all(), i
    pointers = {np.asarray(t).ctypes.data for t in kept + big}
    assert len(pointers) == len(kept) + len(big), "two live tensors share a buffer"
    assert ctf.ops._BUFFERS._kept[1 << 17], "no buffer was kept for reuse"
    x = tf.constant(np.arange(6, dtype=np.float32))
    y = ctf.allreduce(x, comm)
    assert not np.shares_memory(np.asarray(x), np.asarray(y)) and x.numpy().tolist() == list(range(6))


def test_the_gradient_bookkeeping_is_skipped_only_where_no_tape_records():
    assert ctf.ops._untaped()
    with tf.GradientTape() as tape:
        assert not ctf.ops._untaped()
        with tape.stop_recording():
            assert ctf.ops._untaped()
    with tf.autodiff.ForwardAccumulator(tf.constant(1.0), tf.constant(1.0)):
        assert not ctf.ops._untaped()
    traced = []
    tf.function(lambda: traced.append(ctf.ops._untaped()))()   # tracing a graph: the gradient is recorded
    assert traced == [False]


class FailingCommunicator(CountingCommunicator):
    """A one-rank communicator whose allreduce raises `error`, as one whose peer died would."""

    def __init__(self, comm, error):
        super().__init__(comm)
        self.error = error

    def allreduce(self, *args, **kwargs):
        raise self.error


def test_inside_tf_function_a_collectives_error_comes_back_typed(comm, graph_node):
    died = RankFailedError("rank 1 died (process 4242 exited) in call #3")
    failing = FailingCommunicator(comm, died)
    step = tf.function(lambda x: ctf.allreduce(x, failing))
    with pytest.raises(tf.errors.UnknownError, match="RankFailedError: rank 1 died") as raised:
        step(tf.ones(2))
    assert ctf.typed_error(raised.value) is died               # the very object, with its traceback
    with pytest.raises(RankFailedError) as typed:
        with ctf.typed_errors():
            step(tf.ones(2))
    assert typed.value is died and isinstance(typed.value.__cause__, tf.errors.UnknownError)
    assert isinstance(typed.value, CollectiveTimeoutError) and isinstance(typed.value, TimeoutError)
    # When the kept error is gone (only the latest few are kept), the class and message are rebuilt.
    ctf.ops._RAISED.clear()
    rebuilt = ctf.typed_error(raised.value)
    assert type(rebuilt) is RankFailedError and str(rebuilt) == str(died)
    # An InvalidUsageError is a ValueError: TensorFlow raises InvalidArgumentError for it.
    failing.error = InvalidUsageError("x: something wrong")
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        step(tf.ones(2))
    assert ctf.typed_error(raised.value) is failing.error
    # Eagerly there is no wrapping at all.
    failing.error = died
    with pytest.raises(RankFailedError):
        ctf.allreduce(tf.ones(2), failing)
    # Errors raised while tracing: autograph's StagingError, whose context is ours.
    with pytest.raises(Exception) as staged:
        tf.function(lambda x: ctf.allreduce(x, comm, op="nope"))(tf.ones(2))
    assert isinstance(ctf.typed_error(staged.value), InvalidUsageError), repr(staged.value)
    with pytest.raises(InvalidUsageError, match="op: unknown reduction 'nope'"):
        with ctf.typed_errors():
            tf.function(lambda x: ctf.allreduce(x, comm, op="nope"))(tf.ones(2))
    # Errors that are not ours pass through typed_errors unchanged.
    with pytest.raises(ZeroDivisionError):
        with ctf.typed_errors():
            1 / 0
    assert ctf.typed_error(ZeroDivisionError()) is None


def test_one_rank_trains_exactly_as_without_the_wrappers(comm):
    """avg over one rank is the identity: every gradient (dense and
    IndexedSlices) and every variable goes through the library and must
    come back with the same bits."""
    rng = np.random.default_rng(0)
    x, ids = rng.standard_normal((32, 4)).astype(np.float32), rng.integers(0, 6, 32)
    y = rng.integers(0, 3, 32)

    def model():
        keras.utils.set_random_seed(1)
        features, index = keras.Input((4,)), keras.Input((1,), dtype="int32")
        embedded = keras.layers.Flatten()(keras.layers.Embedding(6, 4)(index))
        hidden = keras.layers.Dense(8, activation="relu")(keras.layers.Add()([features, embedded]))
        return keras.Model([features, index], keras.layers.Dense(3)(hidden))

    def fit(optimizer, callbacks):
        m = model()
        m.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        history = m.fit([x, ids[:, None]], y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
        return np.concatenate([w.numpy().reshape(-1) for w in m.weights]), history.history["loss"]

    wrapped = DistributedOptimizer(keras.optimizers.Adam(0.01, global_clipnorm=0.5), comm)
    assert type(wrapped).__name__ == "Adam" and isinstance(wrapped, keras.optimizers.Adam)
    assert wrapped.global_clipnorm == 0.5 and float(wrapped.learning_rate) == pytest.approx(0.01)
    got = fit(wrapped, [BroadcastGlobalVariablesCallback(comm), MetricAverageCallback(comm)])
    want = fit(keras.optimizers.Adam(0.01, global_clipnorm=0.5), [])
    assert np.array_equal(got[0], want[0]) and got[1] == want[1]

    table = tf.Variable(rng.standard_normal((6, 4)).astype(np.float32))
    weight = tf.Variable(rng.standard_normal((4, 3)).astype(np.float32))
    for sparse_as_dense in (False, True):
        with tf.GradientTape() as plain:
            plain_loss = tf.reduce_sum((tf.gather(table, ids) + x) @ weight)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum((tf.gather(table, ids) + x) @ weight)
        want = plain.gradient(plain_loss, [table, weight])
        got = ctf.DistributedGradientTape(tape, comm, sparse_as_dense=sparse_as_dense).gradient(loss, [table, weight])
        assert isinstance(got[0], tf.IndexedSlices) != sparse_as_dense and isinstance(want[0], tf.IndexedSlices)
        assert np.array_equal(tf.convert_to_tensor(got[0]).numpy(), tf.convert_to_tensor(want[0]).numpy())
        assert np.array_equal(got[1].numpy(), want[1].numpy())


def test_metric_average_callback_averages_numbers_and_leaves_the_rest(comm):
    logs = {"loss": np.float32(0.5), "accuracy": 0.25, "note": "text", "flag": True}
    MetricAverageCallback(comm).on_epoch_end(0, logs)
    assert logs == {"loss": 0.5, "accuracy": 0.25, "note": "text", "flag": True}
    assert type(logs["loss"]) is float


# -- across processes -------------------------------------------------------------------------


def mpiexec():
    pytest.importorskip("mpi4py", reason="the multi-process tests need mpi4py: pip install '.[test]'")
    return mpi_launch.mpiexec()


def run_worker(n, scenario, *arguments, launcher_flags=(), limit=240, environment=None):
    # (the repository's root too: the `mwms` scenario runs bench's MultiWorkerMirroredStrategy backend)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(WORKER.parent), str(WORKER.parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]), **(environment or {}))
    env.pop("COLLECTIVES_TIMEOUT", None)
    done = mpi_launch.run_launch([*mpi_launch.mpi_launch(n, *launcher_flags), str(WORKER), scenario,
                                  *map(str, arguments)], limit, env)
    report = f"exit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr[-20000:]}"
    oks = {}
    for part, rank in re.findall(r"OK (\w+) (\d+)", done.stdout):   # ranks' lines can arrive glued together
        oks.setdefault(part, set()).add(int(rank))
    return done.returncode, oks, report


@pytest.mark.slow
@pytest.mark.mpi
def test_every_op_on_three_processes_against_numpy():
    returncode, oks, report = run_worker(3, "ops")
    assert returncode == 0, report
    parts = ["allreduce", "half_precision", "allgather", "reduce_scatter", "broadcast", "grouped_allreduce",
             "broadcast_variables", "order", "errors", "cached"]
    assert {part: oks.get(part) for part in parts} == {part: {0, 1, 2} for part in parts}, report


@pytest.mark.slow
@pytest.mark.mpi
def test_cross_device_ops_match_reduction_to_one_device_and_reduce_across_processes():
    """tests/tensorflow_worker.py's `mirrored`: 2 processes of 4 logical CPU
    devices each; CrossDeviceOps() against ReductionToOneDevice (reduce,
    batch_reduce_to, IndexedSlices, gather, in tf.function, a Keras fit's
    weights, to 1e-6), then CrossDeviceOps(comm) over the 8 replicas against
    NumPy, processes with different shapes raising, and a Keras fit over
    both processes' 8 replicas (sum_across="mean") landing on one process's
    weights trained on the global batches (1e-5)."""
    returncode, oks, report = run_worker(2, "mirrored")
    assert returncode == 0, report
    parts = ["mirrored_local", "mirrored_keras", "mirrored_across", "mirrored_keras_across"]
    assert {part: oks.get(part) for part in parts} == {part: {0, 1} for part in parts}, report


@pytest.mark.slow
@pytest.mark.mpi
def test_multi_worker_mirrored_strategy_starts_from_our_ranks():
    """tests/tensorflow_worker.py's `mwms`: cluster_resolver on 2 processes,
    the strategy's all_reduce (SUM, MEAN, in tf.function) against ours, and
    the benchmarks' mwms backend (which starts the strategy) checked."""
    returncode, oks, report = run_worker(2, "mwms")
    assert returncode == 0, report
    assert oks.get("mwms") == {0, 1}, report


@pytest.mark.slow
@pytest.mark.mpi
def test_two_processes_train_as_one_on_the_whole_batches_and_a_dead_peer_raises(tmp_path):
    # Hydra would otherwise kill the survivor itself when rank 1 exits.
    returncode, oks, report = run_worker(2, "training", tmp_path / "measured.json",
                                         launcher_flags=["-disable-auto-cleanup"])
    assert returncode == 0, report
    assert oks.get("tape") == {0, 1} and oks.get("keras") == {0, 1}, report
    assert oks.get("killed") == {0}, report
    measured = json.loads((tmp_path / "measured.json").read_text())
    assert len(measured) == 4 and all(difference <= 1e-5 for difference in measured.values()), measured


@pytest.mark.slow
@pytest.mark.mpi
def test_keras_fit_on_the_torch_backend_trains_as_one_process_on_the_whole_batches(tmp_path):
    """The Keras fit of the `training` scenario with KERAS_BACKEND=torch: 2
    ranks land on one process's weights to 1e-5 (clipping on: averaged
    gradients), the same on every rank, losses averaged."""
    returncode, oks, report = run_worker(2, "keras_torch", tmp_path / "measured.json",
                                         environment={"KERAS_BACKEND": "torch"})
    assert returncode == 0, report
    assert oks.get("keras_torch") == {0, 1}, report
    measured = json.loads((tmp_path / "measured.json").read_text())
    assert measured["keras fit"] <= 1e-5, measured


# (named, so that collecting them imports nothing)
PUBLIC = ["allreduce", "allgather", "reduce_scatter", "broadcast", "broadcast_variables", "grouped_allreduce",
          "reduce_gradients", "typed_error", "DistributedGradientTape", "DistributedGradientTape.gradient",
          "keras.DistributedOptimizer", "keras.BroadcastGlobalVariablesCallback", "keras.MetricAverageCallback",
          "CrossDeviceOps", "CrossDeviceOps.reduce_implementation", "CrossDeviceOps.batch_reduce_implementation",
          "cluster_resolver", "tf_config"]


@pytest.mark.parametrize("name", PUBLIC)
def test_every_argument_and_the_errors_are_documented(name):
    """As tests/test_docstrings.py asks of the core API: help() names each argument and says what is raised."""
    import inspect
    function = functools.reduce(getattr, name.split("."), collectives if name.startswith("keras.") else ctf)
    doc = inspect.getdoc(function)
    assert doc, f"{function.__qualname__} has no docstring"
    target = function.__init__ if inspect.isclass(function) else function
    arguments = [name for name in inspect.signature(target).parameters if name not in ("self", "cls")]
    missing = [name for name in arguments if not re.search(rf"(^|\W){name}(\W|$)", doc)]
    assert not missing, f"{function.__qualname__}'s docstring does not name {missing}"
    assert "Raises" in doc or "raises" in doc, f"{function.__qualname__}'s docstring does not say what it raises"


@pytest.mark.slow
@pytest.mark.mpi
def test_the_keras_example_runs():
    require("sklearn", reason="the digits data set comes with scikit-learn: pip install scikit-learn")
    example = Path(__file__).resolve().parent.parent / "examples" / "keras_digits.py"
    done = mpi_launch.run_launch([*mpi_launch.mpi_launch(2), str(example), "--epochs", "2"], 240)
    report = f"exit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr[-20000:]}"
    assert done.returncode == 0, report
    assert re.search(r"epoch +2 +loss \d\.\d+ +test accuracy 0\.\d+", done.stdout), report
    assert "parameters bitwise identical on all 2 ranks: True" in done.stdout, report
