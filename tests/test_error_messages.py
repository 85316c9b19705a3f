"""Every bad input of the public API, and the message it gives.

One table: each row is a call with one mistake (or, in the rows named
"... before ...", two, where the first one the caller would fix must be the
one reported) and the start of the message it must raise. A message starts
with the argument it is about ("op: ...", "x[1] ..."), then says what is
wrong. Every rejected call raises InvalidUsageError (a ValueError) and
modifies none of the arrays it was given.

The rows run on host virtual ranks (Communicator.local(3)); those marked
EMULATED also on emulated devices, where the checks are the same but the
ranks are GPU ranks (executors/device.py).
"""

import re
from typing import Callable, NamedTuple

import numpy as np
import pytest

import collectives
from collectives import InvalidUsageError
from collectives.algorithms import REGISTRY

N = 3   # local ranks
COUNT = 6


class Arrays:
    """Makes the arrays of one row and remembers them, with a copy of each,
    so that the test can check that the rejected call changed none."""

    def __init__(self):
        self.made = []

    def one(self, count=COUNT, dtype=np.float32, value=1):
        a = np.full(count, value, dtype)
        self.made.append((a, a.copy()))
        return a

    def ranks(self, count=COUNT, dtype=np.float32):
        """One array per local rank, rank r's holding r + 1."""
        return [self.one(count, dtype, r + 1) for r in range(N)]

    def unchanged(self):
        return all(np.array_equal(a.view(np.uint8), before.view(np.uint8)) for a, before in self.made)


class Row(NamedTuple):
    name: str
    call: Callable      # call(comm, arrays: Arrays) makes the call that must be refused
    message: str        # a regular expression the message must match from its start
    emulated: bool = False


class FakeDeviceArray:
    """Looks like a GPU array (to a host communicator, which refuses it unread)."""
    __cuda_array_interface__ = {"shape": (COUNT,), "typestr": "<f4", "data": (0, False), "version": 3}


def not_implementing(collective):
    """A registered algorithm that does not implement `collective`."""
    return next(name for name, spec in REGISTRY.items() if collective not in spec.collectives)


def views_of_one_buffer(a):
    buffer = a.one(COUNT * 2)
    return [buffer[:COUNT], buffer[:COUNT], a.one()]


def overlapping(a):
    buffer = a.one(COUNT * 2)
    return [buffer[:COUNT], buffer[2:COUNT + 2], a.one()]


def read_only(a):
    xs = a.ranks()
    xs[1].setflags(write=False)
    return xs


def with_rank(xs, rank, replacement):
    xs[rank] = replacement
    return xs


def bad_buffer(comm, *adds, **options):
    buffer = comm.fusion_buffer(**options)
    for array in adds:
        buffer.add(array)


ROWS = [
    # -- allreduce: the call's own arguments
    Row("allreduce unknown op", lambda c, a: c.allreduce(a.ranks(), op="add"),
        r"op: unknown reduction 'add'; expected one of 'sum', 'prod', 'max', 'min', 'avg'", emulated=True),
    Row("allreduce op of another type", lambda c, a: c.allreduce(a.ranks(), op=7), r"op: unknown reduction 7"),
    Row("allreduce unknown algorithm", lambda c, a: c.allreduce(a.ranks(), algorithm="rign"),
        r"algorithm: unknown algorithm 'rign'; expected one of 'auto', 'ring'", emulated=True),
    Row("allreduce algorithm not a name", lambda c, a: c.allreduce(a.ranks(), algorithm=None),
        r"algorithm: expected a name such as 'auto' or 'ring', got NoneType"),
    Row("allreduce unknown compression", lambda c, a: c.allreduce(a.ranks(), compression="zip"),
        r"compression: unknown codec 'zip'; expected None or one of 'bf16', 'fp16', 'int8'"),
    Row("allreduce compression with op max", lambda c, a: c.allreduce(a.ranks(), op="max", compression="fp16"),
        r"compression: 'fp16' works with op 'sum' or 'avg', got op 'max'"),
    # -- allreduce: each array on its own
    Row("allreduce compression on int32", lambda c, a: c.allreduce(a.ranks(dtype=np.int32), compression="int8"),
        r"compression: 'int8' takes float32 arrays .*got int32", emulated=True),
    Row("allreduce compression on float64", lambda c, a: c.allreduce(a.ranks(dtype=np.float64), compression="bf16"),
        r"compression: 'bf16' takes float32 arrays .*got float64"),
    Row("allreduce bool", lambda c, a: c.allreduce(a.ranks(dtype=bool)), r"x\[0\] has dtype bool \(use uint8"),
    Row("allreduce complex", lambda c, a: c.allreduce(a.ranks(dtype=np.complex64)),
        r"x\[0\] has dtype complex64; supported: int8"),
    Row("allreduce too few arrays", lambda c, a: c.allreduce(a.ranks()[:2]),
        r"x: 2 arrays given for 3 local ranks; pass one array per local rank", emulated=True),
    Row("allreduce one bare array", lambda c, a: c.allreduce(a.one()),
        r"x: one array given, but this communicator owns 3 local ranks; pass a list of 3 arrays"),
    Row("allreduce not an array", lambda c, a: c.allreduce("abc"),
        r"x: expected an array or a list of arrays \(one per local rank\), got str"),
    Row("allreduce GPU arrays on host ranks", lambda c, a: c.allreduce([FakeDeviceArray()] * N),
        r"x\[0\] is a \S+FakeDeviceArray; this communicator works on NumPy \(host\) arrays"),
    Row("allreduce lists for arrays", lambda c, a: c.allreduce([[1.0, 2.0]] * N), r"x\[0\] must be a NumPy array"),
    Row("allreduce non-contiguous", lambda c, a: c.allreduce([x[::2] for x in a.ranks(2 * COUNT)]),
        r"x\[0\] must be C-contiguous"),
    # -- allreduce: arrays against each other
    Row("allreduce dtypes differ", lambda c, a: c.allreduce(with_rank(a.ranks(), 1, a.one(dtype=np.float64))),
        r"x\[1\] has dtype float64 but x\[0\] has float32"),
    Row("allreduce shapes differ", lambda c, a: c.allreduce(with_rank(a.ranks(), 2, a.one(COUNT + 1))),
        r"x\[2\] has shape \(7,\) but x\[0\] has \(6,\)"),
    Row("allreduce read-only", lambda c, a: c.allreduce(read_only(a)), r"x\[1\] is read-only"),
    Row("allreduce out of the wrong size", lambda c, a: c.allreduce(a.ranks(), out=a.ranks(COUNT - 1)),
        r"out\[0\] has 5 elements, expected 6"),
    Row("allreduce out of the wrong dtype", lambda c, a: c.allreduce(a.ranks(), out=a.ranks(dtype=np.float64)),
        r"out\[0\] has dtype float64, expected float32"),
    Row("allreduce too few outs", lambda c, a: c.allreduce(a.ranks(), out=a.ranks()[:2]),
        r"out: 2 arrays given for 3 local ranks"),
    # -- allreduce: memory shared between local ranks
    Row("allreduce the same array twice", lambda c, a: c.allreduce([a.one()] * N),
        r"x: the same array is given for local ranks 0 and 1; each local rank needs an array of its own",
        emulated=True),
    Row("allreduce two views of one memory", lambda c, a: c.allreduce(views_of_one_buffer(a)),
        r"x: the same memory is given \(two views of it\) for local ranks 0 and 1"),
    Row("allreduce overlapping inputs", lambda c, a: c.allreduce(overlapping(a)),
        r"x: x\[0\] and x\[1\] overlap in memory"),
    Row("allreduce the same out twice", lambda c, a: c.allreduce(a.ranks(), out=[a.one()] * N),
        r"out: the same array is given for local ranks 0 and 1"),
    Row("allreduce out over another rank's input",
        lambda c, a: (lambda xs: c.allreduce(xs, out=[xs[1], a.one(), a.one()]))(a.ranks()),
        r"out\[0\] shares memory with x\[1\], the input of local rank 1"),
    # -- allreduce: the first mistake a caller would fix is the one reported
    Row("allreduce op before the same array", lambda c, a: c.allreduce([a.one()] * N, op="add"),
        r"op: unknown reduction 'add'", emulated=True),
    Row("allreduce algorithm before the same array", lambda c, a: c.allreduce([a.one()] * N, algorithm="rign"),
        r"algorithm: unknown algorithm 'rign'"),
    Row("allreduce compression dtype before the same array",
        lambda c, a: c.allreduce([a.one(dtype=np.float64)] * N, compression="int8"),
        r"compression: 'int8' takes float32 arrays .*got float64", emulated=True),
    Row("allreduce op before a bad dtype", lambda c, a: c.allreduce(a.ranks(dtype=bool), op="xor"),
        r"op: unknown reduction 'xor'"),
    Row("allreduce op before the array count", lambda c, a: c.allreduce(a.ranks()[:2], op="xor"),
        r"op: unknown reduction 'xor'"),
    Row("allreduce dtype before dtypes across ranks",
        lambda c, a: c.allreduce(with_rank(a.ranks(), 2, a.one(dtype=np.complex64))), r"x\[2\] has dtype complex64"),
    # -- reduce_scatter
    Row("reduce_scatter unknown op", lambda c, a: c.reduce_scatter(a.ranks(), op="add"), r"op: unknown reduction"),
    Row("reduce_scatter algorithm without it", lambda c, a: c.reduce_scatter(
        a.ranks(), algorithm=not_implementing("reduce_scatter")),
        r"algorithm: '\w+' does not implement reduce_scatter; these do: 'auto', 'ring'"),
    Row("reduce_scatter size not a multiple", lambda c, a: c.reduce_scatter(a.ranks(COUNT + 1)),
        r"x: has 7 elements, which do not split into 3 equal blocks"),
    Row("reduce_scatter out of the wrong size", lambda c, a: c.reduce_scatter(a.ranks(), out=a.ranks()),
        r"out\[0\] has 6 elements, expected 2"),
    Row("reduce_scatter the same array twice", lambda c, a: c.reduce_scatter([a.one()] * N),
        r"x: the same array is given for local ranks 0 and 1"),
    Row("reduce_scatter bool", lambda c, a: c.reduce_scatter(a.ranks(dtype=bool)), r"x\[0\] has dtype bool"),
    # -- allgather
    Row("allgather algorithm without it", lambda c, a: c.allgather(a.ranks(), algorithm=not_implementing("allgather")),
        r"algorithm: '\w+' does not implement allgather"),
    Row("allgather out of the wrong size", lambda c, a: c.allgather(a.ranks(), out=a.ranks()),
        r"out\[0\] has 6 elements, expected 18"),
    Row("allgather the same out twice", lambda c, a: c.allgather(a.ranks(), out=[a.one(N * COUNT)] * N),
        r"out: the same array is given for local ranks 0 and 1"),
    Row("allgather too many arrays", lambda c, a: c.allgather(a.ranks() + [a.one()]), r"x: 4 arrays given for 3"),
    # -- broadcast
    Row("broadcast root out of range", lambda c, a: c.broadcast(a.ranks(), root=3),
        r"root: 3 is out of range; this communicator's ranks are 0 to 2", emulated=True),
    Row("broadcast negative root", lambda c, a: c.broadcast(a.ranks(), root=-1), r"root: -1 is out of range"),
    Row("broadcast root True", lambda c, a: c.broadcast(a.ranks(), root=True), r"root: expected a rank number"),
    Row("broadcast root float", lambda c, a: c.broadcast(a.ranks(), root=1.0), r"root: expected a rank number"),
    Row("broadcast root string", lambda c, a: c.broadcast(a.ranks(), root="0"), r"root: expected a rank number"),
    Row("broadcast root before the same array", lambda c, a: c.broadcast([a.one()] * N, root=5),
        r"root: 5 is out of range"),
    Row("broadcast the same array twice", lambda c, a: c.broadcast([a.one()] * N),
        r"x: the same array is given for local ranks 0 and 1"),
    # -- reduce
    Row("reduce root out of range", lambda c, a: c.reduce(a.ranks(), root=3), r"root: 3 is out of range"),
    Row("reduce unknown op", lambda c, a: c.reduce(a.ranks(), op="mean"), r"op: unknown reduction 'mean'"),
    Row("reduce the same array twice", lambda c, a: c.reduce([a.one()] * N),
        r"x: the same array is given for local ranks 0 and 1"),
    # -- allreduce_many (one list of arrays per local rank)
    Row("allreduce_many threshold", lambda c, a: c.allreduce_many([[x] for x in a.ranks()], fusion_threshold=0),
        r"fusion_threshold: expected a positive number of bytes, got 0"),
    Row("allreduce_many unknown op", lambda c, a: c.allreduce_many([[x] for x in a.ranks()], op="add"),
        r"op: unknown reduction 'add'"),
    Row("allreduce_many unknown algorithm", lambda c, a: c.allreduce_many([[x] for x in a.ranks()], algorithm="x"),
        r"algorithm: unknown algorithm 'x'"),
    Row("allreduce_many unknown compression", lambda c, a: c.allreduce_many([[x] for x in a.ranks()],
                                                                             compression="zip"),
        r"compression: unknown codec 'zip'"),
    Row("allreduce_many compression on float64", lambda c, a: c.allreduce_many(
        [[x] for x in a.ranks(dtype=np.float64)], compression="fp16"), r"compression: 'fp16' takes float32 arrays"),
    Row("allreduce_many not a list", lambda c, a: c.allreduce_many(a.one()), r"arrays: expected a list of arrays"),
    Row("allreduce_many flat list for 3 ranks", lambda c, a: c.allreduce_many(a.ranks()),
        r"arrays: this communicator owns 3 local ranks; pass one list of arrays per local rank"),
    Row("allreduce_many unequal lists", lambda c, a: c.allreduce_many([[x] for x in a.ranks()[:2]] + [[]]),
        r"arrays: every local rank must pass the same number of arrays, got 1, 1, 0"),
    Row("allreduce_many bool", lambda c, a: c.allreduce_many([[x, y] for x, y in zip(a.ranks(), a.ranks(dtype=bool))]),
        r"arrays\[0\]\[1\] has dtype bool"),
    Row("allreduce_many shapes differ", lambda c, a: c.allreduce_many(
        [[x] for x in with_rank(a.ranks(), 1, a.one(COUNT + 1))]),
        r"arrays\[1\]\[0\] has shape \(7,\) but arrays\[0\]\[0\]"),
    Row("allreduce_many the same array twice", lambda c, a: c.allreduce_many([[a.one()]] * N),
        r"arrays: arrays\[0\]\[0\] and arrays\[1\]\[0\] share memory"),
    Row("allreduce_many op before the same array", lambda c, a: c.allreduce_many([[a.one()]] * N, op="add"),
        r"op: unknown reduction 'add'"),
    # -- fusion_buffer and its add
    Row("fusion_buffer threshold", lambda c, a: c.fusion_buffer(threshold=-1),
        r"threshold: expected a positive number of bytes, got -1"),
    Row("fusion_buffer unknown op", lambda c, a: c.fusion_buffer(op="add"), r"op: unknown reduction 'add'"),
    Row("fusion_buffer unknown algorithm", lambda c, a: c.fusion_buffer(algorithm="rign"),
        r"algorithm: unknown algorithm 'rign'"),
    Row("fusion_buffer unknown compression", lambda c, a: c.fusion_buffer(compression="zip"),
        r"compression: unknown codec 'zip'"),
    Row("fusion_buffer error feedback without compression", lambda c, a: c.fusion_buffer(error_feedback=True),
        r"error_feedback: True needs a compression codec"),
    Row("fusion_buffer add too few arrays", lambda c, a: bad_buffer(c, a.ranks()[:2]),
        r"array: 2 arrays given for 3 local ranks"),
    Row("fusion_buffer add float64 to a compressed buffer",
        lambda c, a: bad_buffer(c, a.ranks(dtype=np.float64), compression="fp16"),
        r"compression: 'fp16' takes float32 arrays .*got float64"),
    Row("fusion_buffer add the same array twice", lambda c, a: bad_buffer(c, [a.one()] * N),
        r"array: shares memory with an array already queued in this fusion buffer \(or with another local rank's\)"),
    # -- the communicator's other methods
    Row("chosen_algorithm unknown collective", lambda c, a: c.chosen_algorithm("allreduce_all", 64),
        r"collective: unknown collective 'allreduce_all'; expected one of allreduce"),
    Row("chosen_algorithm root out of range", lambda c, a: c.chosen_algorithm("broadcast", 64, root=7),
        r"root: 7 is out of range"),
    Row("chosen_algorithm an array for nbytes", lambda c, a: c.chosen_algorithm("allreduce", a.one()),
        r"nbytes: expected a number of bytes \(an int\), got ndarray"),
    Row("chosen_algorithm negative nbytes", lambda c, a: c.chosen_algorithm("allreduce", -1), r"nbytes: -1 is negative"),
    Row("local nranks", lambda c, a: collectives.Communicator.local(0), r"nranks: expected a positive integer, got 0"),
    Row("local timeout zero", lambda c, a: collectives.Communicator.local(2, timeout=0),
        r"timeout: expected a positive, finite number of seconds, got 0"),
    Row("local timeout negative", lambda c, a: collectives.Communicator.local(2, timeout=-1),
        r"timeout: expected a positive, finite number of seconds, got -1"),
    Row("local timeout not a number", lambda c, a: collectives.Communicator.local(2, timeout="soon"),
        r"timeout: expected a number of seconds, got 'soon'"),
    Row("local devices for other ranks", lambda c, a: collectives.Communicator.local(2, devices=["emulated"] * 3),
        r"devices: names 3 devices for 2 ranks"),
    Row("local unknown device", lambda c, a: collectives.Communicator.local(2, devices=["emulated", "gpu"]),
        r"devices\[1\]: a device is an int or a name like 'cuda:0' or 'emulated:1', got 'gpu'"),
    Row("local negative device", lambda c, a: collectives.Communicator.local(2, devices=[-1, 0]),
        r"devices\[0\]: device index must be >= 0"),
    Row("local nccl on an emulated device",
        lambda c, a: collectives.Communicator.local(2, devices=["emulated", 0], backend="nccl"),
        r"devices\[0\]: backend='nccl' runs on CUDA GPUs, and device 'emulated' is not one"),
    Row("local unknown backend", lambda c, a: collectives.Communicator.local(2, backend="gloo"),
        r"backend: unknown backend 'gloo'; expected one of 'ours', 'nccl'"),
    Row("init timeout zero", lambda c, a: collectives.init(timeout=0), r"timeout: expected a positive"),
    Row("init unknown device", lambda c, a: collectives.init(device="gpu"),
        r"device: a device is an int or a name like 'cuda:0'"),
    Row("init unknown backend", lambda c, a: collectives.init(backend="gloo"), r"backend: unknown backend 'gloo'"),
]


@pytest.fixture(scope="module")
def host_comm():
    with collectives.Communicator.local(N) as comm:
        yield comm


@pytest.fixture(scope="module")
def emulated_comm():
    with collectives.Communicator.local(N, devices=["emulated"] * N) as comm:
        yield comm


def check_row(row, comm):
    arrays = Arrays()
    with pytest.raises(InvalidUsageError) as raised:
        row.call(comm, arrays)
    assert isinstance(raised.value, ValueError)
    assert re.match(row.message, str(raised.value)), f"{row.name}:\n  got      {raised.value}\n  expected {row.message}"
    assert arrays.unchanged(), f"{row.name}: a rejected call modified its arrays"


@pytest.mark.parametrize("row", ROWS, ids=[row.name for row in ROWS])
def test_bad_input_on_host_ranks(row, host_comm):
    check_row(row, host_comm)


EMULATED = [row for row in ROWS if row.emulated]


@pytest.mark.parametrize("row", EMULATED, ids=[row.name for row in EMULATED])
def test_bad_input_on_emulated_devices(row, emulated_comm):
    check_row(row, emulated_comm)


def test_the_communicator_still_works_after_every_rejected_call(host_comm):
    """The rows above ran on this communicator: a rejected call leaves it usable."""
    xs = [np.full(COUNT, r + 1, np.float32) for r in range(N)]
    host_comm.allreduce(xs)
    assert all((x == N * (N + 1) / 2).all() for x in xs)


def test_an_input_only_read_may_be_shared_by_local_ranks(host_comm):
    """What is refused above is memory that a collective writes: an input
    that is only read (allgather, or any collective with separate outputs)
    may be one array for every local rank."""
    shared = np.arange(COUNT, dtype=np.float32)
    gathered = host_comm.allgather([shared] * N)
    assert all(np.array_equal(g, np.tile(shared, N)) for g in gathered)
    outs = [np.empty(COUNT, np.float32) for _ in range(N)]
    host_comm.allreduce([shared] * N, out=outs)
    assert all(np.array_equal(o, shared * N) for o in outs)
