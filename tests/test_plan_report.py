"""bench.model plans: every plan against the floor, and the compressed plans'
codec launches and bytes beside the plain ones."""

import json

import numpy as np
import pytest

from bench import model
from collectives.plan import build_plan


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    path = tmp_path_factory.mktemp("plans") / "plans.json"
    model.main(["plans", "--ranks", "4", "--bytes", "64K", "--compression", "bf16,int8", "-J", str(path)])
    return json.loads(path.read_text())["rows"]


def test_no_plan_moves_less_than_the_floor(rows):
    for r in rows:
        assert r["traffic_bytes"] >= r["traffic_one_device_bytes"] >= r["floor_bytes"] > 0, r
        assert r["one_device_over_floor"] == pytest.approx(r["traffic_one_device_bytes"] / r["floor_bytes"])


def test_direct_allreduce_of_ranks_on_one_device_is_one_launch_at_the_floor(rows):
    """Every rank's output is the fold of every input: one fan-out group,
    which reads each input once and writes each output once."""
    direct = [r for r in rows if (r["collective"], r["algorithm"], r["binding"], r["compression"])
              == ("allreduce", "direct", "out_of_place", None)]
    assert len(direct) == 1
    assert direct[0]["launches_one_device"] == 1
    assert direct[0]["traffic_one_device_bytes"] == direct[0]["floor_bytes"]
    assert direct[0]["traffic_bytes"] > direct[0]["floor_bytes"]   # one rank per device: no shared reads


def test_the_floor_is_one_read_of_each_input_and_one_write_of_each_output():
    n, count, itemsize = 4, 1024, 4
    s = count * itemsize
    assert model.floor_bytes("allreduce", n, count, itemsize) == 2 * n * s
    assert model.floor_bytes("reduce_scatter", n, count, itemsize) == n * s + s
    assert model.floor_bytes("allgather", n, count, itemsize) == s + n * s
    assert model.floor_bytes("allgather", n, count, itemsize, in_place=True) == s + (n - 1) * s
    assert model.floor_bytes("broadcast", n, count, itemsize) == s + n * s
    assert model.floor_bytes("broadcast", n, count, itemsize, in_place=True) == n * s   # the root's x is its output
    assert model.floor_bytes("reduce", n, count, itemsize) == n * s + s


def codec_operations(algorithm, codec, nranks=4, count=64 << 10 >> 2):
    """Per rank, the codec operations (kernels and copies) of a compressed
    plan: what a launch per operation would launch."""
    from collectives.compression import wire
    plan = build_plan("allreduce", algorithm, nranks, count - count % nranks, np.dtype(np.float32), "sum",
                      compression=codec)
    length = lambda ref: wire.Region(0, ref[3], "float32")    # noqa: E731
    return [sum(1 for phase in plan.phases
                for _ in wire.codec_launches(phase.wire_ops_by_rank[rank], length, lambda ref: (length(ref),) * 2))
            for rank in range(nranks)]


def test_compressed_allreduce_rows_count_codec_batches(rows):
    """A compressed plan's operations go as codec_batch launches
    (compression/kernels.py: batch_rows): on one device, the operations of
    every rank that touch no common memory share one, so a call launches
    fewer kernels than it has operations, and a ring one per hop (2(n-1))
    after the encoding of the inputs; with a device each, no more than one
    rank's operations."""
    compressed = [r for r in rows if r["compression"]]
    assert {r["compression"] for r in compressed} == {"bf16", "int8"}
    assert all(r["collective"] == "allreduce" and r["binding"] == "workspace" for r in compressed)
    for r in compressed:
        operations = codec_operations(r["algorithm"], r["compression"])
        if r["algorithm"] == "direct":   # one codec_round_sum at the floor (the next test)
            continue
        assert 2 <= r["launches_one_device"] < sum(operations), (r, operations)
        assert 2 <= r["launches_per_device"] <= max(operations), (r, operations)
        if r["algorithm"] == "ring":
            assert r["launches_one_device"] == 2 * (4 - 1) + 1, r
    # int8 puts a quarter of the bytes on the wire: a ring moves less than bf16's
    ring = {r["compression"]: r["traffic_bytes"] for r in compressed if r["algorithm"] == "ring"}
    assert ring["int8"] < ring["bf16"]


def test_an_unknown_codec_is_refused(capsys):
    with pytest.raises(SystemExit):
        model.main(["plans", "--compression", "fp8"])
    assert "--compression" in capsys.readouterr().err


def test_compressed_direct_on_one_device_is_one_pass_at_the_floor(rows):
    """Ranks sharing a device need no wire form: direct rounds each input in
    registers and sums (codec_round_sum), one launch that reads each input
    once and writes each output once."""
    direct = [r for r in rows if r["compression"] and r["algorithm"] == "direct"]
    assert {r["compression"] for r in direct} == {"bf16", "int8"}
    for r in direct:
        assert r["launches_one_device"] == 1 and r["traffic_one_device_bytes"] == r["floor_bytes"], r
        assert r["launches_per_device"] > 1 and r["traffic_bytes"] > r["floor_bytes"], r


def test_calls_on_symmetric_memory_move_the_floor_and_staged_ones_add_their_copies(rows):
    # One rank per process sharing a GPU: the share reads each input once and
    # writes each output once; staging copies each rank's input in and result out.
    for collective in ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce"):
        symmetric, = [r for r in rows if (r["collective"], r["binding"]) == (collective, "symmetric")]
        staged, = [r for r in rows if (r["collective"], r["binding"]) == (collective, "staged")]
        assert symmetric["traffic_bytes"] == symmetric["floor_bytes"] and symmetric["launches_per_device"] == 3
        assert staged["traffic_bytes"] == symmetric["traffic_bytes"] + staged["workspace_copy_bytes"]
        assert staged["workspace_copy_bytes"] > 0 and staged["launches_per_device"] in (4, 5)
    # A broadcast in place leaves out the root's copy to itself, in the share and in staging.
    in_place = {r["binding"]: r for r in rows if r["collective"] == "broadcast" and r["binding"].endswith("in place")}
    assert in_place["symmetric in place"]["traffic_bytes"] == in_place["symmetric in place"]["floor_bytes"]
    out_of_place, = [r for r in rows if (r["collective"], r["binding"]) == ("broadcast", "staged")]
    assert in_place["staged in place"]["workspace_copy_bytes"] < out_of_place["workspace_copy_bytes"]
    allreduce, = [r for r in rows if (r["collective"], r["binding"]) == ("allreduce", "staged")]
    assert allreduce["one_device_over_floor"] == 3   # 2 n S of share, and 4 S of copies per rank
