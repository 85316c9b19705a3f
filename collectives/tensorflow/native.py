"""The graph node of our TensorFlow ops: a small C++ op (_call_op.cc) whose
kernel runs a Python body with the GIL, where tf.numpy_function's machinery
costs 30-70 us more a node here (docs/training.md).

    node = native.call(body, inputs, output_dtypes, name)   # in a graph being traced

`body` takes NumPy arrays (read-only views of the inputs' buffers, valid
during the call) and returns a list of new C-contiguous arrays, which
become the node's outputs without a copy. The node is stateful, as
numpy_function(stateful=True) is: tf.function chains it in program order.

The op is built at first use by the C++ compiler the emulated device uses
($CXX, else g++, else c++: kernels.cxx_compiler), against the installed TensorFlow's C API headers
(tensorflow/c: declarations only, a second to build, where TensorFlow's
C++ headers take 40). It is kept where the emulated device keeps its
kernels (kernels.cache_dir: $COLLECTIVES_CACHE_DIR, else
~/.cache/collectives), under a name that hashes the source and the
TensorFlow and Python versions, so it is built once; processes that start
together build it once too (a file lock), and a build is renamed into
place whole. Where it cannot be built or loaded (no compiler, no headers),
`call` returns None and the ops fall back to tf.numpy_function, with one
warning saying why; COLLECTIVES_TF_NODE=numpy_function asks for that
fallback (to compare the two).

How a body reaches the kernel: `call` files it under an integer key (the
node's `body` attr) for the process's life, since a traced function may
run while its graph object is gone (numpy_function keeps its functions on
the outermost graph, which for tf.function in an eager program is the
global one: for the process's life too). A body is made once per trace.
The kernel calls `dispatch(key, inputs)`, which finds the body, runs it,
and answers the outputs, or (TensorFlow's error code, message) for an
error: InvalidUsageError (a ValueError) as INVALID_ARGUMENT and the
others as UNKNOWN, as numpy_function does.
"""

import hashlib
import itertools
import os
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings

import numpy as np
import tensorflow as tf

from .. import kernels
from ..errors import CollectiveError

SOURCE = os.path.join(os.path.dirname(__file__), "_call_op.cc")
OP_NAME = "CollectivesCall"
NODE_ENV = "COLLECTIVES_TF_NODE"   # "native" (default) or "numpy_function"
CACHE_ENV = "COLLECTIVES_CACHE_DIR"   # (read by kernels.cache_dir, where the emulated kernels are kept too)

# TensorFlow's error codes (tensorflow/c/tf_status.h) for dispatch's answers.
INVALID_ARGUMENT, UNKNOWN = 3, 2

_bodies = {}                  # key -> body
_keys = itertools.count(1)
_lock = threading.Lock()
_loaded = None                # the op's Python function, False where it cannot be had
_dtypes = {}                  # TensorFlow's dtype enum -> NumPy dtype


def build_command(output):
    """The compiler's command line that builds the op into `output`."""
    compiler = kernels.cxx_compiler("the TensorFlow graph op needs a C++ compiler (g++ or $CXX)")
    tf_include = tf.sysconfig.get_include()
    tf_lib = tf.sysconfig.get_lib()
    return [compiler, "-O2", "-shared", "-fPIC", "-std=c++17", "-o", output, SOURCE,
            "-I" + tf_include, "-I" + sysconfig.get_paths()["include"],
            "-L" + tf_lib, "-l:libtensorflow_framework.so.2", "-Wl,-rpath," + tf_lib]


def library_path():
    """The built op's path in the cache: its name hashes what makes it."""
    with open(SOURCE, "rb") as source:
        digest = hashlib.sha256(source.read())
    digest.update(f"{tf.__version__} {sys.version} {os.environ.get('CXX', '')}".encode())
    return os.path.join(kernels.cache_dir(), f"tf_call_op-{digest.hexdigest()[:16]}.so")


def build():
    """The op's library, built unless the cache has it: its path."""
    path = library_path()
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with kernels.build_lock(path):
        if not os.path.exists(path):   # (built by another process while this one waited)
            made, partial = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
            os.close(made)
            try:
                result = subprocess.run(build_command(partial), capture_output=True, text=True)
                if result.returncode != 0:
                    raise RuntimeError(f"building {os.path.basename(SOURCE)} failed: {result.stderr.strip()[-2000:]}")
                os.replace(partial, path)   # whole or not at all: a reader never loads half a library
            finally:
                if os.path.exists(partial):
                    os.remove(partial)
    return path


def op():
    """The op's Python function (tf.raw_ops-like: op(inputs=, Tout=, body=)),
    or None where it cannot be had (then one warning says why)."""
    global _loaded
    if _loaded is None:
        with _lock:
            if _loaded is None:
                _loaded = _load()
    return _loaded or None


def _load():
    if os.environ.get(NODE_ENV, "native") == "numpy_function":
        return False
    try:
        module = tf.load_op_library(build())
        return getattr(module, "collectives_call")
    except (OSError, RuntimeError, AttributeError, CollectiveError, tf.errors.NotFoundError,
            subprocess.SubprocessError) as error:
        warnings.warn(f"collectives.tensorflow: the graph op could not be built or loaded, so graph nodes are "
                      f"tf.numpy_function (30-70 us more a call): {error}", RuntimeWarning, stacklevel=4)
        return False


@tf.autograph.experimental.do_not_convert   # (else a body made here runs as autograph's converted code: ~400 us)
def call(body, inputs, output_dtypes, name):
    """A node of the graph being traced that runs `body` on `inputs` when
    the graph runs: its output tensors, or None where the op cannot be had."""
    function = op()
    if function is None:
        return None
    key = next(_keys)
    expected = [np.dtype(dtype.as_numpy_dtype) for dtype in output_dtypes]

    def checked(*arrays):
        outputs = body(*arrays)
        return [np.ascontiguousarray(out) if out.flags.writeable else np.array(out)   # never a view of an input
                for out in outputs]

    checked.expected = expected
    _bodies[key] = checked
    return function(inputs=list(inputs), Tout=list(output_dtypes), body=key, name=name)


def _numpy_dtype(code):
    dtype = _dtypes.get(code)
    if dtype is None:
        dtype = _dtypes[code] = np.dtype(tf.dtypes.as_dtype(code).as_numpy_dtype)
    return dtype


def dispatch(key, inputs):
    """What the kernel calls: the body filed under `key`, on `inputs`
    ((memoryview, dtype enum, shape) each): its outputs, or (code, message)."""
    body = _bodies.get(key)
    if body is None:
        return UNKNOWN, f"{OP_NAME}: no body {key} in this process (a graph made by another process?)"
    try:
        arrays = [np.frombuffer(view, _numpy_dtype(code)).reshape(shape) for view, code, shape in inputs]
        outputs = body(*arrays)
        for out, dtype in zip(outputs, body.expected):
            if out.dtype != dtype:
                raise TypeError(f"{OP_NAME}: an output of {out.dtype} where the node has {dtype}")
        return outputs
    except Exception as error:   # noqa: BLE001 - every error becomes the node's, as numpy_function's do
        from .ops import describe_failure   # (ops imports this module)
        return describe_failure(error)
