"""Compressed allreduce (compression/wire.py) on host ranks and emulated devices.

What is checked, for every allreduce algorithm:
* every rank ends with the same bits;
* the error against a float64 reference stays within the documented bound
  (README, "Compression"): q quantizations of partial sums of magnitude at
  most P = sum over ranks of |x|, plus float32 additions;
* emulated devices (the GPU path) give the host's bits;
* bytes on the wire: at most 52% (fp16, bf16) and 28% (int8) of float32's;
* a rejected call modifies nothing.
"""

import numpy as np
import pytest

import collectives
from collectives import InvalidUsageError
from collectives.algorithms import REGISTRY
from collectives.compression import wire
from collectives.compression.kernels import CODECS
from collectives.devices import open_device
from collectives.plan import build_plan
from collectives.plan import clear_cache as clear_plans

ALLREDUCE_ALGORITHMS = tuple(name for name, entry in REGISTRY.items() if "allreduce" in entry.collectives)
MAGNITUDES = ("1e-8", "1", "1e5", "mixed")

UNIT = wire.UNIT
error_bound = wire.error_bound   # the documented bound (docs/compression.md, "Error bounds")


def gradients(nranks, count, magnitude, seed):
    """Each rank's float32 input: normal values of one magnitude, or mixed
    magnitudes from 1e-8 to 1e5 within one array."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((nranks, count))
    if magnitude == "mixed":
        values *= 10.0 ** rng.uniform(-8, 5, size=(1, count))
    else:
        values *= float(magnitude)
    return [v.astype(np.float32) for v in values]


def run_host(nranks, inputs, codec, algorithm, op="sum"):
    comm = collectives.Communicator.local(nranks)
    results = comm.allreduce([x.copy() for x in inputs], op=op, algorithm=algorithm, compression=codec)
    return results


def assert_same_bits(results):
    for r in results[1:]:
        assert np.array_equal(r.view(np.uint32), results[0].view(np.uint32))


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("algorithm", ALLREDUCE_ALGORITHMS)
@pytest.mark.parametrize("nranks", [1, 2, 3, 4, 5, 8])
def test_every_algorithm_is_identical_on_all_ranks_and_within_the_bound(codec, algorithm, nranks):
    for count in (0, 1, 31, 33, 1000, 4099):
        for magnitude in MAGNITUDES:
            inputs = gradients(nranks, count, magnitude, seed=count + nranks)
            results = run_host(nranks, inputs, codec, algorithm)
            assert_same_bits(results)
            exact = np.sum(np.stack(inputs).astype(np.float64), axis=0)
            plan = build_plan("allreduce", algorithm, nranks, count, np.dtype(np.float32), "sum", compression=codec)
            q = wire.quantizations(plan)
            bound = error_bound(inputs, codec, q, "sum")
            error = np.abs(results[0].astype(np.float64) - exact)
            worst = np.argmax(error - bound) if count else 0
            assert np.all(error <= bound), (
                f"{codec} {algorithm} n={nranks} count={count} {magnitude}: element {worst} is off by "
                f"{error[worst]:.3g}, bound {bound[worst]:.3g} (q={q})")
            if count:  # normwise, the figure the README reports
                assert np.linalg.norm(error) <= np.linalg.norm(bound)


@pytest.mark.parametrize("codec", CODECS)
def test_avg_divides_once_in_float32(codec):
    inputs = gradients(4, 1000, "mixed", seed=7)
    results = run_host(4, inputs, codec, "ring", op="avg")
    assert_same_bits(results)
    plan = build_plan("allreduce", "ring", 4, 1000, np.dtype(np.float32), "avg", compression=codec)
    exact = np.mean(np.stack(inputs).astype(np.float64), axis=0)
    assert np.all(np.abs(results[0] - exact) <= error_bound(inputs, codec, wire.quantizations(plan), "avg"))


@pytest.mark.parametrize("codec", CODECS)
def test_small_and_large_gradients_survive(codec):
    """1e-8 does not flush to zero and 1e5 does not overflow (fp16 thanks to its block scale)."""
    for value in (1e-8, 1e5, -3e-7):
        inputs = [np.full(100, value, np.float32) for _ in range(4)]
        result = run_host(4, inputs, codec, "ring")[0]
        assert np.all(np.isfinite(result))
        np.testing.assert_allclose(result, 4 * value, rtol=2 * UNIT[codec] * 4)


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_a_non_finite_value_poisons_its_block_only(codec):
    inputs = [np.ones(96, np.float32) for _ in range(3)]
    inputs[1][40] = np.inf
    result = run_host(3, inputs, codec, "ring")[0]
    assert np.all(np.isnan(result[32:64]))
    assert np.all(result[:32] == 3) and np.all(result[64:] == 3)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("algorithm", ALLREDUCE_ALGORITHMS)
def test_bytes_on_the_wire(codec, algorithm):
    limit = {"bf16": 0.52, "fp16": 0.52, "int8": 0.28}[codec]
    for nranks in (2, 4, 8):
        count = 1 << 16
        plain = build_plan("allreduce", algorithm, nranks, count, np.dtype(np.float32), "sum")
        packed = build_plan("allreduce", algorithm, nranks, count, np.dtype(np.float32), "sum", compression=codec)
        assert 0 < packed.wire_bytes <= limit * plain.wire_bytes


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("algorithm", ["ring", "direct", "tree", "halving_doubling"])
def test_emulated_devices_give_the_host_bits(codec, algorithm):
    """The GPU path (codec kernels on emulated devices) equals the host's."""
    for nranks in (2, 3, 4):
        inputs = gradients(nranks, 777, "mixed", seed=nranks)
        want = run_host(nranks, inputs, codec, algorithm)
        comm = collectives.Communicator.local(nranks, devices="emulated")
        got = comm.allreduce([x.copy() for x in inputs], algorithm=algorithm, compression=codec)
        for g, w in zip(got, want):
            assert np.array_equal(g.view(np.uint32), w.view(np.uint32)), f"{codec} {algorithm} n={nranks}"


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("algorithm", ["ring", "two_shot", "butterfly", "star"])
def test_ranks_sharing_an_emulated_device_give_the_host_bits(codec, algorithm):
    """Ranks on one device: every rank's operations of the whole call go as
    batches (compression/kernels.py: batch_rows) on one stream, across
    ranks and phases; in place and out of place."""
    for nranks in (3, 4):
        inputs = gradients(nranks, 777, "mixed", seed=nranks)
        want = run_host(nranks, inputs, codec, algorithm)
        comm = collectives.Communicator.local(nranks, devices=["emulated:0"] * nranks)
        out_of_place = comm.allreduce(inputs, algorithm=algorithm, compression=codec,
                                      out=[np.empty_like(x) for x in inputs])
        in_place = comm.allreduce([x.copy() for x in inputs], algorithm=algorithm, compression=codec)
        for got in (out_of_place, in_place):
            for g, w in zip(got, want):
                assert np.array_equal(g.view(np.uint32), w.view(np.uint32)), f"{codec} {algorithm} n={nranks}"


def special_gradients(nranks, count, seed):
    """Inputs whose magnitudes differ between ranks at each element (so the
    float32 sums depend on their order), with an inf, a NaN, float32
    subnormals and zeros in some blocks of some ranks: the rounding's
    special cases."""
    rng = np.random.default_rng(seed)
    inputs = [(rng.standard_normal(count) * 10.0 ** rng.uniform(-3, 6, count)).astype(np.float32)
              for _ in range(nranks)]
    for r, x in enumerate(inputs):
        x[r % count] = np.inf if r % 2 else np.nan
        x[min(count - 1, 40 + r)] = np.float32(1e-40)       # subnormal
        x[64:96] = 0 if r == 0 else x[64:96]
    return inputs


@pytest.mark.parametrize("codec", CODECS)
def test_direct_on_one_device_is_one_rounding_pass_with_the_host_bits(monkeypatch, codec):
    """Ranks sharing a device run compressed direct as one codec_round_sum:
    every input rounded in registers and summed in rank order, every output
    written once (executors/device.py: rounds_in_one_pass). Its bits are
    the host's codec operations', in place and out of place, sum and avg."""
    device = open_device("emulated:0")
    launched = []
    original = device.launch_codec_round_sum
    monkeypatch.setattr(device, "launch_codec_round_sum", lambda *a: (launched.append(a[2]), original(*a)))
    for nranks in (2, 3, 5):
        for count in (1, 37, 777):
            for op in ("sum", "avg"):
                inputs = special_gradients(nranks, count, seed=nranks * count)
                want = run_host(nranks, inputs, codec, "direct", op)
                comm = collectives.Communicator.local(nranks, devices=["emulated:0"] * nranks)
                launched.clear()
                out_of_place = comm.allreduce(inputs, algorithm="direct", compression=codec, op=op,
                                              out=[np.empty_like(x) for x in inputs])
                in_place = comm.allreduce([x.copy() for x in inputs], algorithm="direct", compression=codec, op=op)
                assert len(launched) == 2, launched
                for got in (out_of_place, in_place):
                    for g, w in zip(got, want):
                        assert np.array_equal(g.view(np.uint32), w.view(np.uint32)), (codec, nranks, count, op)


def test_auto_on_one_device_runs_compressed_calls_as_the_rounding_pass(monkeypatch):
    """No plan beats direct's one pass at the floor: auto picks it for ranks
    on one device at every size; on a device each, it prices the plans."""
    device = open_device("emulated:0")
    launched = []
    original = device.launch_codec_round_sum
    monkeypatch.setattr(device, "launch_codec_round_sum", lambda *a: (launched.append(1), original(*a)))
    comm = collectives.Communicator.local(4, devices=["emulated:0"] * 4)
    for nbytes in (4, 1 << 20, 256 << 20):
        assert comm.chosen_algorithm("allreduce", nbytes, compression="int8") == "direct"
    inputs = gradients(4, 100, "1", seed=1)
    got = comm.allreduce([x.copy() for x in inputs], compression="int8")
    assert launched == [1]
    want = run_host(4, inputs, "int8", "direct")
    assert all(np.array_equal(g.view(np.uint32), w.view(np.uint32)) for g, w in zip(got, want))
    apart = collectives.Communicator.local(4, devices=[f"emulated:{r}" for r in range(4)])
    assert apart.chosen_algorithm("allreduce", 256 << 20, compression="int8") != "direct"


def test_a_rounding_pass_that_sums_in_another_order_gives_wrong_bits(monkeypatch):
    """The check above can fail: summing the same rounded inputs last rank
    first changes the float32 rounding of the sums (where the ranks'
    magnitudes differ: rounded values of like magnitude add exactly)."""
    device = open_device("emulated:0")
    original = device.launch_codec_round_sum
    monkeypatch.setattr(device, "launch_codec_round_sum",
                        lambda stream, codec, inputs, *rest: original(stream, codec, inputs[::-1], *rest))
    rng = np.random.default_rng(4)
    inputs = [(rng.standard_normal(777) * 10.0 ** rng.uniform(-3, 6, 777)).astype(np.float32) for _ in range(4)]
    want = run_host(4, inputs, "fp16", "direct")
    got = collectives.Communicator.local(4, devices=["emulated:0"] * 4).allreduce(
        [x.copy() for x in inputs], algorithm="direct", compression="fp16")
    assert not all(np.array_equal(g.view(np.uint32), w.view(np.uint32)) for g, w in zip(got, want))


def test_a_batch_that_ignores_the_order_of_operations_gives_wrong_bits(monkeypatch):
    """The check above can fail: with batches cut in program order, ignoring
    which operations depend on which, the emulated device (which runs a
    batch's rows last first, as a GPU may) no longer gives the host's bits."""
    from collectives.compression import kernels as codecs
    monkeypatch.setattr(codecs, "batch_rows", lambda rows, name: [rows[i:i + 40] for i in range(0, len(rows), 40)])
    inputs = gradients(4, 777, "mixed", seed=4)
    want = run_host(4, inputs, "fp16", "ring")
    got = collectives.Communicator.local(4, devices=["emulated:0"] * 4).allreduce(
        [x.copy() for x in inputs], algorithm="ring", compression="fp16")
    assert not all(np.array_equal(g.view(np.uint32), w.view(np.uint32)) for g, w in zip(got, want))


def _row(op, reads=(), writes=(), n=64):
    """A CodecRow whose accesses are the given (address, bytes) ranges: a
    copy reads acc and writes out; a decode reads payload and scales."""
    from collectives.compression import kernels as codecs
    if op == codecs.COPY:
        (src, nbytes), (dst, _) = reads[0], writes[0]
        return codecs.CodecRow(codecs.CodecArgs(acc=src, out=dst, n=nbytes), codecs.COPY)
    return codecs.CodecRow(codecs.CodecArgs(payload=reads[0], scales=reads[1], out=writes[0], n=n),
                           codecs.KERNELS.index("decode"))


def test_batches_keep_each_row_after_the_rows_it_must_follow():
    from collectives.compression import kernels as codecs
    copy = codecs.COPY
    a, b, c, d = 0x10000, 0x20000, 0x30000, 0x40000
    write_then_read = [_row(copy, [(a, 256)], [(b, 256)]), _row(copy, [(b + 128, 64)], [(c, 64)])]
    read_then_write = [_row(copy, [(a, 256)], [(b, 256)]), _row(copy, [(c, 64)], [(a + 192, 64)])]
    write_twice = [_row(copy, [(a, 256)], [(b, 256)]), _row(copy, [(c, 64)], [(b, 64)])]
    side_by_side = [_row(copy, [(a, 256)], [(b, 256)]), _row(copy, [(a, 256)], [(b + 256, 256)]),
                    _row(copy, [(c, 64)], [(d, 64)])]      # reads shared, writes only adjacent
    for rows, batches in ((write_then_read, [[0], [1]]), (read_then_write, [[0], [1]]),
                          (write_twice, [[0], [1]]), (side_by_side, [[0, 1, 2]])):
        got = codecs.batch_rows(rows, "fp16")
        assert [[rows.index(r) for r in batch] for batch in got] == batches
    # A decode reads its payload (2 bytes an element for fp16) and scales (a byte a block).
    decode = _row(None, reads=(c, d), writes=(a,), n=64)
    assert len(codecs.batch_rows([_row(copy, [(b, 8)], [(c + 126, 2)]), decode], "fp16")) == 2
    assert len(codecs.batch_rows([_row(copy, [(b, 8)], [(c + 128, 2)]), decode], "fp16")) == 1
    assert len(codecs.batch_rows([_row(copy, [(b, 8)], [(d + 1, 1)]), decode], "fp16")) == 2
    assert len(codecs.batch_rows([_row(copy, [(b, 8)], [(d + 2, 1)]), decode], "fp16")) == 1
    # A row goes after the latest batch it must follow, not merely after the first.
    chain = [_row(copy, [(a, 64)], [(b, 64)]), _row(copy, [(b, 64)], [(c, 64)]), _row(copy, [(d, 64)], [(a, 64)])]
    assert [[chain.index(r) for r in batch] for batch in codecs.batch_rows(chain, "int8")] == [[0], [1, 2]]


def test_batches_hold_at_most_a_launchs_rows():
    from collectives import kernels
    from collectives.compression import kernels as codecs
    rows = [_row(codecs.COPY, [(0x10000 + 64 * i, 64)], [(0x90000 + 64 * i, 64)]) for i in range(100)]
    sizes = [len(batch) for batch in codecs.batch_rows(rows, "bf16")]
    assert sizes == [kernels.CODEC_BATCH_ROWS, kernels.CODEC_BATCH_ROWS, 100 - 2 * kernels.CODEC_BATCH_ROWS]


def test_rejected_calls_modify_nothing():
    comm = collectives.Communicator.local(2)
    x32 = [np.arange(64, dtype=np.float32) for _ in range(2)]
    cases = [
        dict(x=[a.astype(np.float64) for a in x32], compression="fp16"),   # not float32
        dict(x=[a.astype(np.float16) for a in x32], compression="bf16"),
        dict(x=x32, compression="fp8"),                                     # unknown codec
        dict(x=x32, compression="int8", op="max"),                          # not sum or avg
        dict(x=x32, compression=16),
    ]
    for case in cases:
        before = [a.copy() for a in case["x"]]
        with pytest.raises(InvalidUsageError):
            comm.allreduce(case["x"], op=case.get("op", "sum"), compression=case["compression"])
        for a, b in zip(case["x"], before):
            assert np.array_equal(a, b)


def test_quantizations_per_algorithm():
    """q of the bound: the ring re-encodes a partial sum at each of its n - 1
    hops and the result once; direct encodes each input once (every rank
    then sums all of them); two_shot each input once and the result once."""
    f32 = np.dtype(np.float32)
    for n in (2, 3, 5, 8):
        assert wire.quantizations(build_plan("allreduce", "ring", n, 4096, f32, "sum", compression="fp16")) == n
        assert wire.quantizations(build_plan("allreduce", "direct", n, 4096, f32, "sum", compression="fp16")) == 1
        assert wire.quantizations(build_plan("allreduce", "two_shot", n, 4096, f32, "sum", compression="fp16")) == 2


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("in_place", [True, False])
def test_streamlined_operations_give_the_plain_lowerings_bits(codec, in_place, monkeypatch):
    """streamline.py only removes float32 passes nothing needs: the results
    are the bits of the plain lowering, in place (INPUT is OUTPUT) and not."""
    def run(nranks, inputs, algorithm):
        clear_plans()
        comm = collectives.Communicator.local(nranks)
        xs = [x.copy() for x in inputs]
        out = None if in_place else [np.full_like(x, np.nan) for x in inputs]
        return comm.allreduce(xs, algorithm=algorithm, compression=codec, out=out)

    for algorithm in ALLREDUCE_ALGORITHMS:
        for nranks in (2, 3, 4, 5):
            inputs = gradients(nranks, 1000, "mixed", seed=nranks)
            streamlined = run(nranks, inputs, algorithm)
            with monkeypatch.context() as m:
                m.setattr(wire, "streamline", lambda ops_by_phase: [tuple(ops) for ops in ops_by_phase])
                plain = run(nranks, inputs, algorithm)
            for s, p in zip(streamlined, plain):
                assert np.array_equal(s.view(np.uint32), p.view(np.uint32)), f"{algorithm} n={nranks}"
    clear_plans()


def test_streamlining_removes_the_copies_of_a_ring():
    """Ring on 2 ranks: the rank's own chunk is encoded straight from its
    input, the reduced chunk and the peer's decoded chunk land in the output,
    and no float32 copy is left."""
    plan = build_plan("allreduce", "ring", 2, 4096, np.dtype(np.float32), "sum", compression="fp16")
    ops = [op for phase in plan.phases for op in phase.wire_ops_by_rank[0]]
    kinds = [op[0] for op in ops]
    assert "copy" not in kinds, ops
    assert kinds.count("encode") == 1 and kinds.count("decode_add") == 1 and kinds.count("decode") == 1, ops


@pytest.mark.parametrize("algorithm", ["ring", "two_shot", "halving_doubling"])
def test_an_output_overlapping_the_input_gets_the_same_bits(algorithm):
    """Neither the same array nor apart: streamline.py's rewrites do not hold,
    so the plain lowering runs, with the bits of a separate output."""
    n, count = 3, 1000
    inputs = gradients(n, count, "1", seed=3)
    want = collectives.Communicator.local(n).allreduce(
        [x.copy() for x in inputs], out=[np.empty_like(x) for x in inputs], algorithm=algorithm, compression="fp16")
    for shift in (5, 40):
        buffers = [np.zeros(count + shift, np.float32) for _ in range(n)]
        for b, x in zip(buffers, inputs):
            b[:count] = x
        got = collectives.Communicator.local(n).allreduce(
            [b[:count] for b in buffers], out=[b[shift:] for b in buffers], algorithm=algorithm, compression="fp16")
        for g, w in zip(got, want):
            assert np.array_equal(g.view(np.uint32), w.view(np.uint32)), f"shift {shift}"
