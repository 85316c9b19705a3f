"""cluster_resolver: tf.distribute.MultiWorkerMirroredStrategy started from our ranks.

    comm = collectives.init()                       # under mpiexec -n N
    resolver = collectives.tensorflow.cluster_resolver(comm)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver)

MultiWorkerMirroredStrategy needs every worker's address (a gRPC server's
host:port) and its own index, usually from the TF_CONFIG variable written
by a launcher. Here each rank picks a free TCP port on its machine, the
ranks allgather "host:port" through the communicator, and rank r becomes
worker r: one process per rank, as collectives.init gives. TensorFlow's
own collectives then run the strategy's reductions (gRPC between the
workers): this only starts it from our ranks, for comparing the two, or
for programs written for that strategy.

TensorFlow wants the strategy made before any other TensorFlow op runs in
the process. The port is free when picked and bound by TensorFlow's server
a moment later: another program taking it in between makes the strategy
fail to start (rare; run again).
"""

import json
import socket

import numpy as np
import tensorflow as tf

from ..errors import InvalidUsageError
from .ops import check_communicator

__all__ = ["cluster_resolver", "tf_config"]

_ADDRESS_BYTES = 256   # per rank in the exchange: "host:port", padded


def _free_port():
    """A TCP port nothing listens on now (the kernel's pick of an ephemeral
    port, on every interface: TensorFlow's server listens on all of them)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _addresses(comm, host):
    """Every rank's "host:port", in rank order (one allgather)."""
    if host is None:
        name = socket.gethostname()
    elif isinstance(host, str) and host and ":" not in host:
        name = host
    else:
        raise InvalidUsageError(f"host: expected None or a host name without a port, got {host!r}")
    mine = name.encode()
    if len(mine) > _ADDRESS_BYTES - 8:
        raise InvalidUsageError(f"host: {name!r} is longer than {_ADDRESS_BYTES - 8} bytes")
    row = np.zeros(_ADDRESS_BYTES, np.uint8)
    row[:len(mine)] = np.frombuffer(mine, np.uint8)
    row[-8:] = np.frombuffer(np.int64(_free_port()).tobytes(), np.uint8)
    table = comm.allgather(row).reshape(comm.size, _ADDRESS_BYTES)
    names = [bytes(t[:-8]).rstrip(b"\0").decode() for t in table]
    ports = [int(np.frombuffer(t[-8:].tobytes(), np.int64)[0]) for t in table]
    if host is None and len(set(names)) == 1:   # one machine: localhost needs no name resolution
        names = ["localhost"] * comm.size
    return [f"{n}:{p}" for n, p in zip(names, ports)]


def cluster_resolver(comm, host=None):
    """A tf.distribute.cluster_resolver.SimpleClusterResolver for
    MultiWorkerMirroredStrategy: rank r of `comm` is worker r, each at a
    free port of its machine.

    comm   a communicator with one rank in this process (collectives.init());
           every rank must call this, as a collective
    host   None (default): each rank's host name (socket.gethostname()),
           or "localhost" for all when every rank has the same one; else
           the name or address under which the other ranks reach this one

    Returns the resolver (task_type "worker", task_id comm.rank, rpc_layer
    "grpc"). Raises InvalidUsageError for a bad argument,
    CollectiveTimeoutError or RankFailedError when a peer stalls or dies.
    """
    check_communicator(comm)
    workers = _addresses(comm, host)
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": workers}), task_type="worker", task_id=comm.rank, rpc_layer="grpc")


def tf_config(comm, host=None):
    """The TF_CONFIG text for this rank, for programs that read it from the
    environment (os.environ["TF_CONFIG"] = tf_config(comm)): the same
    cluster as cluster_resolver(comm, host) gives (`comm`, `host`: as
    there; a new port per call). Raises what cluster_resolver raises."""
    check_communicator(comm)
    return json.dumps({"cluster": {"worker": _addresses(comm, host)}, "task": {"type": "worker", "index": comm.rank}})
