"""bench.half_precision_error: what rounding our float16/bfloat16 allreduce
does, checked against the models the benchmark reports with.

What holds (and what these tests pin down):

* Every transfer (one REDUCE row of a plan) accumulates in float32 and
  rounds to 16 bits once, however many sources it folds: the NumPy fold of
  executors/host.py and the step kernel (kernels/plan_step.cu, whose
  accumulator for 16-bit floats is float32) both do, and give the same bits.
  So direct, two_shot and star, which fold every rank in one transfer in
  rank order, give float32 accumulation rounded once, bit for bit, on host
  ranks and on emulated devices. Rounding after every add (a 16-bit
  accumulator, as before) differs only for transfers of more than two
  sources.
* Our ring adds in NCCL's ring order, one rounding per hop: the same bits as
  the NumPy simulation of NCCL's order, when the chunks are cut alike.
* Errors stay within the classical summation bounds, gamma_L * sum |x_i| with
  L the longest chain of roundings, u the dtype's unit roundoff (float32's
  for the additions inside one transfer).
"""

import json

import ml_dtypes
import numpy as np
import pytest

import collectives
from bench import half_precision_error as hpe

NRANKS = 8
COUNT = 4099            # not a multiple of 16 bytes: chunk tails and the kernel's scalar path
DISTRIBUTIONS = tuple(hpe.DISTRIBUTIONS)
MULTI_SOURCE = ("direct", "two_shot", "star")     # one transfer folds all ranks


def unit_roundoff(dtype):
    return 2.0 ** -(ml_dtypes.finfo(dtype).nmant + 1)


def gamma(k, u):
    return k * u / (1 - k * u)


def inputs(dtype_name, distribution, count=COUNT, seed=7):
    draws = hpe.make_inputs(distribution, NRANKS, count, np.random.default_rng(seed))
    return [row.astype(hpe.DTYPES[dtype_name]) for row in draws]


@pytest.fixture(scope="module")
def host():
    with collectives.Communicator.local(NRANKS) as comm:
        yield comm


@pytest.mark.parametrize("dtype_name", hpe.DTYPES)
@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_every_algorithm_rounds_once_per_transfer(host, dtype_name, distribution):
    xs = inputs(dtype_name, distribution)
    for algorithm in hpe.ALLREDUCE_ALGORITHMS:
        ours = hpe.ours(host, xs, algorithm)
        assert hpe.same_bits(ours, hpe.evaluate(algorithm, xs, hpe.PER_TRANSFER)), algorithm
        if algorithm in MULTI_SOURCE:
            assert hpe.same_bits(ours, hpe.fp32_once(xs)), algorithm
            # Not vacuous: rounding after every add would give other bits.
            assert not hpe.same_bits(ours, hpe.evaluate(algorithm, xs, hpe.PER_ADD)), algorithm


@pytest.mark.parametrize("dtype_name", hpe.DTYPES)
def test_the_step_kernel_gives_the_host_bits(host, dtype_name):
    xs = inputs(dtype_name, "normal")
    with collectives.Communicator.local(NRANKS, devices="emulated") as device:
        for algorithm in ("ring", "direct", "two_shot", "tree"):
            assert hpe.same_bits(hpe.ours(device, xs, algorithm), hpe.ours(host, xs, algorithm)), algorithm


def float32_once(xs, op):
    """The issue's meaning of a one-transfer reduction of 16-bit floats,
    computed here without the library: every rank's values in float32,
    folded in rank order with float32 operations, avg divided in float32,
    one rounding to the 16-bit type at the end."""
    acc = xs[0].astype(np.float32)
    for x in xs[1:]:
        x = x.astype(np.float32)
        if op in ("sum", "avg"):
            acc = acc + x
        elif op == "prod":
            acc = acc * x
        else:  # no NaNs, and zeros of one sign at most: NumPy's max/min are IEEE's here
            acc = np.maximum(acc, x) if op == "max" else np.minimum(acc, x)
    if op == "avg":
        acc = acc / np.float32(len(xs))
    return acc.astype(xs[0].dtype)


@pytest.mark.parametrize("devices", ["host", "emulated"])
@pytest.mark.parametrize("dtype_name", hpe.DTYPES)
def test_a_direct_allreduce_accumulates_in_float32_and_rounds_once(devices, dtype_name):
    """The issue: a float16 or bfloat16 allreduce without compression
    accumulates in float32 within each transfer and rounds once per transfer.
    direct is one transfer per element, so its result is float32
    accumulation rounded once, bit for bit, for every op; on emulated
    devices, the step kernel computes it (its vector path and its tail: 4099
    elements are not a whole number of 16-byte packs per chunk)."""
    dtype = hpe.DTYPES[dtype_name]
    rng = np.random.default_rng(11)
    with collectives.Communicator.local(NRANKS, **({} if devices == "host" else {"devices": "emulated"})) as comm:
        for op in ("sum", "prod", "max", "min", "avg"):
            draws = rng.standard_normal((NRANKS, COUNT))
            if op == "prod":  # products of 8 values stay in the normal range
                draws = np.sign(draws) * (0.5 + np.abs(draws) % 1.5)
            xs = [row.astype(dtype) for row in draws]
            want = float32_once(xs, op)
            results = comm.allreduce([x.copy() for x in xs], op=op, algorithm="direct")
            comm.synchronize()
            for r, result in enumerate(results):
                assert hpe.same_bits(np.asarray(result), want), (devices, dtype_name, op, r)
            if op == "sum":  # not vacuous: a 16-bit accumulator gives other bits
                assert not hpe.same_bits(want, hpe.evaluate("direct", xs, hpe.PER_ADD))


@pytest.mark.parametrize("dtype_name", hpe.DTYPES)
@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_our_ring_is_nccls_ring_order(host, dtype_name, distribution):
    xs = inputs(dtype_name, distribution)
    assert hpe.same_bits(hpe.ours(host, xs, "ring"), hpe.nccl_ring(xs))


@pytest.mark.parametrize("dtype_name", hpe.DTYPES)
def test_which_transfers_the_rounding_rule_matters_for(dtype_name):
    xs = inputs(dtype_name, "uniform_positive")
    for algorithm in hpe.ALLREDUCE_ALGORITHMS:
        summary = hpe.rounding_summary(algorithm, NRANKS)
        assert summary["roundings_per_element"][hpe.PER_ADD] == NRANKS - 1, algorithm
        per_add, per_transfer = (hpe.evaluate(algorithm, xs, r) for r in (hpe.PER_ADD, hpe.PER_TRANSFER))
        if algorithm in MULTI_SOURCE:
            # One transfer of all ranks in rank order: float32 within it is fp32_once.
            assert summary["sources_per_transfer"] == [NRANKS]
            assert hpe.same_bits(per_transfer, hpe.fp32_once(xs)), algorithm
        else:
            assert summary["sources_per_transfer"] == [2]
            assert hpe.same_bits(per_add, per_transfer), algorithm
    chains = {a: hpe.rounding_summary(a, NRANKS)["longest_rounding_chain"] for a in hpe.ALLREDUCE_ALGORITHMS}
    assert {a: c[hpe.PER_ADD] for a, c in chains.items()} == {
        "ring": 7, "direct": 7, "star": 7, "round_robin": 7, "two_shot": 7,
        "tree": 3, "butterfly": 3, "halving_doubling": 3}
    # What our code does: one rounding for the one-transfer algorithms.
    assert {a: c[hpe.PER_TRANSFER] for a, c in chains.items()} == {
        "ring": 7, "direct": 1, "star": 1, "round_robin": 7, "two_shot": 1,
        "tree": 3, "butterfly": 3, "halving_doubling": 3}


@pytest.mark.parametrize("dtype_name", hpe.DTYPES)
@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_errors_stay_within_the_summation_bounds(host, dtype_name, distribution):
    dtype = hpe.DTYPES[dtype_name]
    xs = inputs(dtype_name, distribution)
    ref = hpe.reference(xs)
    abs_sum = np.sum(np.abs(np.stack(xs).astype(np.float64)), axis=0)
    u = unit_roundoff(dtype)

    def error(y):
        return np.abs(y.astype(np.float64) - ref)

    # float32 accumulation of all ranks, one rounding: float32's bound for
    # the sum, then half an ulp of the 16-bit type (of a subnormal, at worst).
    e32 = gamma(NRANKS - 1, 2.0 ** -24) * abs_sum
    half_subnormal = 0.5 * hpe.ulp(np.zeros(1), dtype)[0]
    once_bound = e32 + u * (np.abs(ref) + e32) + half_subnormal
    for algorithm in hpe.ALLREDUCE_ALGORITHMS:
        summary = hpe.rounding_summary(algorithm, NRANKS)
        ours = error(hpe.ours(host, xs, algorithm))
        if summary["sources_per_transfer"] == [2]:
            # A float32 add of two 16-bit values rounded to 16 bits is one
            # correctly rounded 16-bit add. Sums that land in the subnormal
            # range are exact, so no underflow term.
            chain = summary["longest_rounding_chain"][hpe.PER_TRANSFER]
            assert np.all(ours <= gamma(chain, u) * abs_sum), algorithm
        else:
            assert algorithm in MULTI_SOURCE
            assert np.all(ours <= once_bound), algorithm
    assert np.all(error(hpe.nccl_ring(xs)) <= gamma(NRANKS - 1, u) * abs_sum)
    assert np.all(error(hpe.fp32_once(xs)) <= once_bound)
    assert hpe.errors(hpe.round_to(ref, dtype), ref, dtype)["max_ulp"] <= 0.5


def test_the_headline_comparison():
    """Fixed seed, 2^15 elements: our one-transfer algorithms are float32
    accumulation rounded once, about twice as accurate as NCCL's ring (a
    chain of 7 roundings), which our ring matches; the trees (chains of 3)
    are a little better than the ring."""
    with collectives.Communicator.local(NRANKS) as comm:
        for dtype_name in hpe.DTYPES:
            for distribution in ("normal", "uniform_positive"):
                xs = inputs(dtype_name, distribution, count=1 << 15, seed=1)
                ref, dtype = hpe.reference(xs), hpe.DTYPES[dtype_name]
                results = {"nccl": hpe.nccl_ring(xs), "once": hpe.fp32_once(xs),
                           **{a: hpe.ours(comm, xs, a) for a in ("direct", "ring", "tree")}}
                norm = {name: hpe.errors(y, ref, dtype)["norm_rel"] for name, y in results.items()}
                case = (dtype_name, distribution, norm)
                assert hpe.same_bits(results["direct"], results["once"]), case
                assert hpe.same_bits(results["ring"], results["nccl"]), case
                assert norm["tree"] < 0.95 * norm["nccl"], case
                assert norm["direct"] < 0.6 * norm["nccl"], case


def test_ulp_and_rounding():
    f16, bf16 = hpe.DTYPES["float16"], hpe.DTYPES["bfloat16"]
    values = np.array([1.0, 1.5, -3.0, 0.0, 2.0 ** -20])
    assert list(hpe.ulp(values, f16)) == [2.0 ** -10, 2.0 ** -10, 2.0 ** -9, 2.0 ** -24, 2.0 ** -24]
    assert list(hpe.ulp(values, bf16)) == [2.0 ** -7, 2.0 ** -7, 2.0 ** -6, 2.0 ** -133, 2.0 ** -27]
    # Just above a bfloat16 midpoint: ml_dtypes' float64 cast rounds through float32 and gets it wrong.
    x = np.array([1 + 2.0 ** -8 + 2.0 ** -30, 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8])
    assert list(hpe.round_to(x, bf16).astype(np.float64)) == [1 + 2.0 ** -7, 1.0, 1 + 2.0 ** -6]
    assert list(hpe.round_to(np.array([1 + 2.0 ** -11, 2.0 ** -25]), f16).astype(np.float64)) == [1.0, 0.0]
    with pytest.raises(ValueError, match="inexact"):
        hpe.reference([np.array([1.0], np.float32), np.array([2.0 ** -60], np.float32)])


def test_main_prints_the_table_and_writes_json(tmp_path, capsys):
    path = tmp_path / "out.json"
    hpe.main(["--ranks", "4", "--count", "257", "--trials", "1", "--emulated", "ring", "-J", str(path)])
    printed = capsys.readouterr().out
    assert "ours:ring" in printed and "nccl_ring" in printed and "fp32_once" in printed
    result = json.loads(path.read_text())
    assert result["command"].endswith("-m bench.half_precision_error --ranks 4 --count 257 --trials 1 "
                                      f"--emulated ring -J {path}")
    assert result["environment"]["cpu"] and result["ranks"] == 4
    rows = {(r["dtype"], r["distribution"], r["method"]): r for r in result["rows"]}
    assert len(rows) == 2 * len(DISTRIBUTIONS) * (3 + 2 * len(hpe.ALLREDUCE_ALGORITHMS))
    ring = rows["float16", "normal", "ours:ring"]
    assert ring["equals_nccl_ring"] and ring["emulated_equals_host"]
    assert ring["matches_per_transfer"] and ring["matches_per_add"]  # two sources per transfer: the same
    direct = rows["float16", "normal", "ours:direct"]
    assert direct["matches_per_transfer"] and direct["equals_fp32_once"] and not direct["matches_per_add"]
    assert "emulated_equals_host" not in direct
    assert rows["float16", "normal", "per_add_model:ring"]["equals_ours"]
    assert not rows["float16", "normal", "per_add_model:direct"]["equals_ours"]
