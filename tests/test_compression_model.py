"""bench.model compression: the bytes it prices come from the plans and
agree with the closed forms; its break-even speed is where both times meet."""

import json
import math

import pytest

from bench import model
from collectives.compression.wire import encoded_nbytes

GB = 1e9
N, SIZE = 8, 1 << 20     # 8 ranks, 1 MiB of float32 each
MEMORY, CODEC, STEP = 2900 * GB, 250 * GB, 7.7e-6


def busiest(phases, field):
    return max(sum(getattr(ranks[r], field) for ranks in phases) for r in range(N))


def test_a_plain_ring_reads_2_n_minus_1_over_n_of_the_message_from_peers():
    phases = model.phases_bytes("ring", N, SIZE, None)
    assert busiest(phases, "link") == 2 * (N - 1) * SIZE // N


@pytest.mark.parametrize("codec", ["bf16", "fp16", "int8"])
def test_a_compressed_ring_reads_the_encoded_chunks_instead(codec):
    """Each of the 2(n-1) steps reads one encoded chunk from a peer, once:
    the all-gather half copies it into the rank's own wire copy and decodes
    it from there, not from the peer a second time."""
    phases = model.phases_bytes("ring", N, SIZE, codec)
    chunk = SIZE // 4 // N
    assert busiest(phases, "link") == 2 * (N - 1) * encoded_nbytes(codec, chunk)
    assert busiest(phases, "codec") > 0


@pytest.mark.parametrize("algorithm", ["ring", "two_shot", "direct"])
@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_at_the_break_even_link_both_take_the_same_time(algorithm, codec):
    plain = model.phases_bytes(algorithm, N, SIZE, None)
    compressed = model.phases_bytes(algorithm, N, SIZE, codec)
    even = model.break_even_link(plain, compressed, MEMORY, CODEC, STEP)
    assert even is not None and math.isfinite(even), "slow codecs cannot win on every link"

    def times(link):
        return (model.predicted_seconds(plain, link, MEMORY, CODEC, STEP),
                model.predicted_seconds(compressed, link, MEMORY, CODEC, STEP))
    plain_s, compressed_s = times(even)
    assert compressed_s == pytest.approx(plain_s, rel=1e-9)
    slower, faster = times(even / 2), times(even * 2)
    assert slower[1] < slower[0] and faster[1] > faster[0]


def test_a_codec_that_costs_nothing_wins_on_every_link_for_large_messages():
    plain = model.phases_bytes("two_shot", N, 64 << 20, None)
    compressed = model.phases_bytes("two_shot", N, 64 << 20, "int8")
    assert model.break_even_link(plain, compressed, MEMORY, 1e18, STEP) == math.inf


def test_the_command_prints_every_cell_and_writes_json(tmp_path, capsys):
    out = tmp_path / "model.json"
    model.main(["compression", "--ranks", "4", "--sizes", "64K,1M", "--codec-gbps", "250", "-J", str(out)])
    printed = capsys.readouterr().out
    assert "two_shot" in printed and "ring" in printed
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4
    for row in rows:
        assert set(row["plain_us"]) == set(model.LINKS)
        for codec in ("bf16", "fp16", "int8"):
            assert row[codec]["us"]["pcie"] < row["plain_us"]["pcie"]   # 25 GB/s: every codec pays there


def test_a_codec_that_wins_on_every_link_prints_so(capsys):
    model.main(["compression", "--ranks", "8", "--sizes", "64M", "--algorithms", "ring", "--codecs", "int8"])
    assert "always" in capsys.readouterr().out


def test_bad_flags_name_themselves(capsys):
    for argv, words in [(["--codecs", "fp8"], "--codecs"), (["--links", "wifi"], "--links"),
                        (["--algorithms", "rign"], "--algorithms")]:
        with pytest.raises(SystemExit):
            model.main(["compression", *argv])
        assert words in capsys.readouterr().err
