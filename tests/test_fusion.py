"""Tensor fusion: allreduce_many and fusion_buffer (collectives/fusion.py),
on host ranks in one process and on emulated devices. Across processes:
tests/test_mpi.py (scenario "fusion")."""

import threading

import ml_dtypes
import numpy as np
import pytest

import collectives
from collectives import CollectiveTimeoutError, InvalidUsageError
from collectives.fusion import Packer, gaps

DTYPES = (np.float32, np.float16, np.int32, ml_dtypes.bfloat16, np.float64)


def model_arrays(nranks, seed, shapes=None, dtypes=DTYPES, exact=True):
    """Per rank, a list of arrays of many shapes and dtypes. With `exact`,
    small integers, so every sum is exact in every dtype and the expected
    result is closed-form."""
    rng = np.random.default_rng(seed)
    shapes = shapes or [(3,), (), (0,), (17, 5), (1000,), (2, 3, 4), (1,), (129,), (64, 64)]
    per_rank = [[] for _ in range(nranks)]
    for i, shape in enumerate(shapes):
        dtype = dtypes[i % len(dtypes)]
        for r in range(nranks):
            if exact:
                values = rng.integers(-8, 8, size=shape)
            else:
                values = rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3)
            per_rank[r].append(np.asarray(values).astype(dtype))
    return per_rank


def expected_sums(per_rank):
    return [np.sum([rank[i].astype(np.float64) for rank in per_rank], axis=0) for i in range(len(per_rank[0]))]


@pytest.mark.parametrize("devices", [None, "emulated"])
@pytest.mark.parametrize("threshold", [64 << 20, 4096, 100])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_allreduce_many_reduces_every_array_in_place(devices, threshold, op):
    n = 3
    comm = collectives.Communicator.local(n, devices=devices)
    per_rank = model_arrays(n, seed=threshold)
    want = expected_sums(per_rank)
    ids = [[id(a) for a in rank] for rank in per_rank]
    result = comm.allreduce_many(per_rank, op=op, fusion_threshold=threshold)
    assert result is per_rank and [[id(a) for a in rank] for rank in per_rank] == ids
    for rank in per_rank:
        for got, total, dtype in zip(rank, want, [a.dtype for a in per_rank[0]]):
            expect = total if op == "sum" else total / n
            if op == "avg" and np.dtype(dtype).kind == "i":
                expect = np.trunc(total / n)
            np.testing.assert_array_equal(got.astype(np.float64), expect.astype(dtype).astype(np.float64))


@pytest.mark.parametrize("devices", [None, "emulated"])
def test_fused_results_are_the_same_bits_as_a_fusion_buffer(devices):
    n = 4
    comm = collectives.Communicator.local(n, devices=devices)
    shapes = [(s,) for s in np.random.default_rng(0).integers(0, 300, size=60)]
    many = model_arrays(n, seed=1, shapes=shapes, exact=False)
    queued = [[a.copy() for a in rank] for rank in many]
    comm.allreduce_many(many, fusion_threshold=2048)
    buffer = comm.fusion_buffer(threshold=2048)
    for i in range(len(shapes)):
        buffer.add([rank[i] for rank in queued])
    buffer.wait()
    for a_rank, b_rank in zip(many, queued):
        for a, b in zip(a_rank, b_rank):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    # and all ranks agree
    for rank in many[1:]:
        for a, b in zip(many[0], rank):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_packer_groups_by_dtype_within_the_threshold_on_aligned_offsets():
    f32, f16 = np.dtype(np.float32), np.dtype(np.float16)
    packer = Packer(threshold=256)
    closed = []
    for index, (dtype, size) in enumerate([(f32, 3), (f16, 5), (f32, 10), (f32, 50), (f16, 200), (f32, 0)]):
        closed += packer.add(index, dtype, size)
    closed += packer.close_all()
    by_indices = {tuple(s.index for s in g.slots): g for g in closed}
    assert set(by_indices) == {(0, 2), (1,), (3,), (4,)}
    group = by_indices[0, 2]
    assert [s.offset * 4 % 16 for s in group.slots] == [0, 0] and group.slots[1].offset == 4
    assert by_indices[4,].count == 200       # 400 bytes: alone, where it lies
    for g in closed:
        assert g.count * g.dtype.itemsize <= 256 or len(g.slots) == 1


def test_compressed_groups_start_arrays_on_codec_blocks_and_know_their_gaps():
    packer = Packer(threshold=1 << 20, compression="int8")
    f32 = np.dtype(np.float32)
    for index, size in enumerate([33, 1, 64]):
        packer.add(index, f32, size)
    (group,) = packer.close_all()
    assert [s.offset for s in group.slots] == [0, 64, 96]
    assert gaps(group) == [(33, 31), (65, 31)]


def test_one_batched_copy_each_way_per_fusion_buffer(monkeypatch):
    """The GPU path: packing 200 arrays is one launch, unpacking another.
    (Host ranks copy with NumPy: there are no launches to count.)"""
    devices = "emulated"
    n = 4
    comm = collectives.Communicator.local(n, devices=devices)
    device = comm._ranks.devices[0]
    counts = {"step": 0, "copies": 0}
    real_step, real_copies = device.launch_step, device.launch_copies

    def step(*args):
        counts["step"] += 1
        return real_step(*args)

    def copies(*args):
        counts["copies"] += 1
        return real_copies(*args)

    monkeypatch.setattr(device, "launch_step", step)
    monkeypatch.setattr(device, "launch_copies", copies)
    per_rank = model_arrays(n, seed=3, shapes=[(i % 50 + 1,) for i in range(200)], dtypes=(np.float32,))
    comm.allreduce_many(per_rank)
    assert counts["copies"] == 2
    fused_steps = counts["step"]
    counts["step"] = 0
    for i in range(200):
        comm.allreduce([rank[i] for rank in per_rank])
    assert counts["step"] >= 20 * (fused_steps + 2)


def test_bad_lists_are_rejected_before_anything_is_written():
    comm = collectives.Communicator.local(2)
    good = [[np.ones(4, np.float32), np.ones(3, np.int32)] for _ in range(2)]
    shared = np.ones(8, np.float32)
    cases = [
        ([[np.ones(4, np.float32)], [np.ones(5, np.float32)]], {}),          # shapes differ between ranks
        ([[np.ones(4, np.float32)], []], {}),                                # counts differ
        ([good[0]], {}),                                                     # one list for two ranks
        (good, {"compression": "fp16"}),                                     # int32 with compression
        (good, {"op": "maximum"}),
        (good, {"fusion_threshold": 0}),
        ([[shared[:5], shared[3:]], [np.ones(5, np.float32), np.ones(5, np.float32)]], {}),  # overlap
    ]
    for arrays, kwargs in cases:
        before = [[a.copy() for a in rank] for rank in arrays]
        with pytest.raises(InvalidUsageError):
            comm.allreduce_many(arrays, **kwargs)
        for rank, rank_before in zip(arrays, before):
            for a, b in zip(rank, rank_before):
                assert np.array_equal(a, b)


def test_a_fusion_buffer_runs_in_the_background_and_reports_errors_at_wait(monkeypatch):
    comm = collectives.Communicator.local(2, timeout=1.0)
    release = threading.Event()
    started = threading.Event()
    real_run = comm._ranks.run

    def slow_run(*args):
        started.set()
        assert release.wait(5.0)
        return real_run(*args)

    monkeypatch.setattr(comm._ranks, "run", slow_run)
    buffer = comm.fusion_buffer(threshold=64)
    grads = [[np.ones(16, np.float32), np.ones(16, np.float32)] for _ in range(2)]
    buffer.add([rank[0] for rank in grads])        # 64 bytes: the buffer is full and starts
    assert started.wait(5.0)                       # ...in the background: add returned while it runs
    with pytest.raises(InvalidUsageError, match="wait"):
        comm.allreduce([np.ones(2, np.float32)] * 2)   # may not overtake the fused allreduce
    buffer.add([rank[1] for rank in grads])
    release.set()
    buffer.wait()
    assert all(np.all(a == 2) for rank in grads for a in rank)

    def failing_run(*args):
        raise CollectiveTimeoutError("peer 1 did not arrive")

    monkeypatch.setattr(comm._ranks, "run", failing_run)
    buffer.add([np.ones(16, np.float32)] * 2 and [np.ones(16, np.float32), np.ones(16, np.float32)])
    with pytest.raises(CollectiveTimeoutError, match="peer 1"):
        buffer.wait()
    monkeypatch.setattr(comm._ranks, "run", real_run)
    comm.allreduce([np.ones(2, np.float32), np.ones(2, np.float32)])   # usable again after wait


@pytest.mark.parametrize("codec", ["fp16", "int8", "bf16"])
def test_compressed_fusion_matches_the_compressed_allreduce_of_the_buffer(codec):
    n = 3
    comm = collectives.Communicator.local(n)
    per_rank = model_arrays(n, seed=5, shapes=[(40,), (7,), (100,)], dtypes=(np.float32,), exact=False)
    flat = [np.concatenate([np.pad(a, (0, -a.size % 32)) for a in rank]) for rank in per_rank]
    comm.allreduce(flat, compression=codec)
    comm.allreduce_many(per_rank, compression=codec)
    offsets = np.cumsum([0] + [a.size + (-a.size % 32) for a in per_rank[0]])
    for rank, packed in zip(per_rank, flat):
        for a, start in zip(rank, offsets):
            assert np.array_equal(a.view(np.uint32), packed[start:start + a.size].view(np.uint32))


# One encoding's error, per rank: relative to the element (bf16, fp16), or
# to the largest magnitude in its block (int8), as in test_compression.py.
FEEDBACK_UNIT = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11, "int8": 2 / 255}


@pytest.mark.parametrize("codec", ["int8", "fp16", "bf16"])
def test_error_feedback_keeps_the_accumulated_error_bounded(codec):
    """1,000 steps of biased gradients: in every block one large value sets
    the scale and small ones, which the codec rounds the same way each step,
    carry the signal. With feedback the sum of the results differs from the
    sum of the gradients by no more than the ranks' residuals, each within
    one encoding's error, at every step; without, the error keeps growing
    (fp16, int8: past that bound)."""
    n, count, steps = 4, 256, 1000
    errors = {}
    for feedback in (False, True):
        rng = np.random.default_rng(11)
        base = rng.uniform(0.001, 0.003, size=(n, count)).astype(np.float32)
        base[:, ::32] = 1.0
        comm = collectives.Communicator.local(n)
        # direct: what error feedback runs by default; the same for both, to compare like with like
        buffer = comm.fusion_buffer(compression=codec, error_feedback=feedback, algorithm="direct")
        applied, exact, worst = np.zeros(count), np.zeros(count), []
        for _ in range(steps):
            grads = [(base[r] + rng.normal(0, 1e-4, count)).astype(np.float32) for r in range(n)]
            exact += np.sum(np.array(grads, np.float64), axis=0)
            buffer.add(grads)
            buffer.wait()
            applied += grads[0]
            worst.append(np.max(np.abs(applied - exact)))
        errors[feedback] = np.array(worst)
    # Residuals of values up to 1.0005 (block maxima too), plus float32 sums over the steps.
    bound = n * FEEDBACK_UNIT[codec] * 1.0005 * 1.01 + steps * n * 2.0 ** -24 * 4
    assert np.all(errors[True] <= bound), (errors[True].max(), bound)
    if codec != "bf16":   # bf16 has no block scale: its small values round well even without feedback
        assert errors[False][-1] > 2 * bound and errors[False][-1] > 5 * errors[False][99]


def test_error_feedback_needs_a_codec():
    comm = collectives.Communicator.local(2)
    with pytest.raises(InvalidUsageError, match="compression"):
        comm.fusion_buffer(error_feedback=True)


def test_error_feedback_on_one_rank_keeps_nothing():
    """One rank encodes nothing, so there is nothing to feed back: the result is the input."""
    comm = collectives.Communicator.local(1)
    buffer = comm.fusion_buffer(compression="int8", error_feedback=True)
    for step in range(20):
        g = np.random.default_rng(step).standard_normal(100).astype(np.float32)
        want = g.copy()
        buffer.add([g])
        buffer.wait()
        assert np.array_equal(g, want)


def test_emulated_results_are_there_when_the_call_returns():
    comm = collectives.Communicator.local(3, devices="emulated")
    per_rank = [[np.ones(3, np.float32), np.ones(5, np.float32)] for _ in range(3)]
    comm.allreduce_many(per_rank)    # no synchronize: emulated arrays are read at once, as after any call
    assert all(np.all(a == 3) for rank in per_rank for a in rank)


def test_close_lets_started_fused_allreduces_finish():
    comm = collectives.Communicator.local(2)
    buffer = comm.fusion_buffer(threshold=64)
    grads = [[np.ones(16, np.float32) for _ in range(2)] for _ in range(50)]
    for pair in grads:
        buffer.add(pair)     # each fills a buffer: 50 allreduces queued in the background
    comm.close()
    assert all(np.all(a == 2) for pair in grads for a in pair)


def test_a_fusion_buffer_refuses_an_array_queued_twice():
    comm = collectives.Communicator.local(1)
    buffer = comm.fusion_buffer(threshold=1 << 20)
    a, b = np.ones(4, np.float32), np.ones(8, np.float32)
    buffer.add([a])
    buffer.add([b[:4]])
    with pytest.raises(InvalidUsageError, match="shares memory"):
        buffer.add([a])
    with pytest.raises(InvalidUsageError, match="shares memory"):
        buffer.add([b[2:6]])
    buffer.add([b[4:]])
    buffer.wait()
    buffer.add([a])          # a new step: the same arrays again
    buffer.wait()


def test_ops_are_spelled_as_everywhere_with_compression():
    comm = collectives.Communicator.local(2)
    per_rank = [[np.ones(40, np.float32)] for _ in range(2)]
    comm.allreduce_many(per_rank, op="SUM", compression="fp16")
    assert all(np.all(rank[0] == 2) for rank in per_rank)
    comm.fusion_buffer(op="AVG", compression="bf16")
