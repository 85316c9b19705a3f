"""The control segment's layout has one home (transport/layout.py): the step
protocol and the compiled loop's channel import it, and not each other."""

import ast
from pathlib import Path

import pytest

from collectives.config import FastSizes, check_switches, resolve_fast_sizes, resolve_loop_tunables
from collectives.errors import InvalidUsageError
from collectives.transport import layout

TRANSPORT = Path(__file__).resolve().parents[1] / "collectives" / "transport"


def imported_modules(name):
    tree = ast.parse((TRANSPORT / f"{name}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found.add(node.module or "")
            found.update(alias.name for alias in node.names if not node.module)
    return found


@pytest.mark.parametrize("module, other", [("protocol", "fastpath"), ("fastpath", "protocol")])
def test_the_protocol_and_the_fast_path_do_not_import_each_other(module, other):
    assert "layout" in imported_modules(module)
    assert other not in imported_modules(module)


def test_the_programs_across_nodes_do_not_import_the_hierarchy_that_runs_them():
    """across.py's Programs are what hierarchy.py runs: the import goes one way."""
    tree = ast.parse((TRANSPORT.parent / "across.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "hierarchy" not in imported and "across" in {
        node.module for node in ast.walk(ast.parse((TRANSPORT.parent / "hierarchy.py").read_text()))
        if isinstance(node, ast.ImportFrom)}


@pytest.mark.parametrize("sizes", [resolve_fast_sizes(), FastSizes(small_max=8, chunk=64),
                                   FastSizes(small_max=1 << 20, chunk=1 << 20)])
def test_the_channel_starts_on_a_page_after_the_reason_and_fits_every_rank(sizes):
    for size in (1, 2, 3, 8, 64):
        offset = layout.channel_offset(size)
        assert offset % layout.PAGE == 0
        assert offset >= 8 * (layout.HEADER + layout.ROW * size) + layout.HANDLE_BYTES * size + layout.REASON_BYTES
        assert layout.mailboxes_offset(size, sizes) - offset == layout.channel_bytes(size, sizes)
        assert layout.mailboxes_offset(size, sizes) % layout.PAGE == 0
        assert layout.control_bytes(size, sizes) - layout.mailboxes_offset(size, sizes) >= \
            size * size * layout.mailbox_bytes()
        assert layout.channel_bytes(size, sizes) >= size * 2 * (layout.SLOT_HEADER + sizes.small_max + size * sizes.chunk)
        assert layout.small_area(size, sizes) % layout.PAGE == 0   # (the staging starts on a page)


@pytest.mark.parametrize("size", [1, 2, 3, 64, 65, 200])
def test_the_recovery_area_starts_on_a_page_after_the_mailboxes_and_its_parts_do_not_overlap(size):
    sizes = resolve_fast_sizes()
    start = layout.recovery_offset(size, sizes)
    assert start % layout.PAGE == 0
    assert start - layout.mailboxes_offset(size, sizes) >= size * size * layout.mailbox_bytes()
    agreements, rows, proposals, end = layout.recovery_parts(size)
    assert agreements >= layout.RECOVERY_ROUNDS * layout.RECOVERY_ROUND_BYTES
    assert rows - agreements >= 8 * layout.AGREE_DECISIONS and rows % 64 == 0
    assert proposals - rows >= size * layout.RECOVERY_ROW_BYTES
    assert layout.RECOVERY_ROW_BYTES >= 8 * (max(layout.JOINED, layout.AGREE_SEQ, layout.AGREE_FLAG) + 1)
    assert 64 * layout.proposal_words(size) >= size
    assert end - proposals >= layout.RECOVERY_ROUNDS * size * 8 * layout.proposal_words(size)
    assert layout.control_bytes(size, sizes) >= start + end
    assert 8 * (layout.NAME_READY + 1) <= layout.RECOVERY_NAME_OFFSET
    assert layout.RECOVERY_NAME_OFFSET + layout.RECOVERY_NAME_BYTES <= layout.RECOVERY_ROUND_BYTES


def test_a_mailboxs_counters_are_on_cache_lines_of_their_own_and_its_slots_aligned():
    # the sender publishes SENT, the receiver TAKEN: no line written by both
    assert layout.MAILBOX_TAKEN * 8 - layout.MAILBOX_SENT * 8 >= 64
    assert layout.MAILBOX_HEADER >= 8 * (layout.MAILBOX_TAKEN + 1)
    assert layout.MAILBOX_HEADER % 64 == 0 and layout.MAILBOX_SLOT_HEADER % 64 == 0
    assert layout.MAILBOX_SLOT_BYTES % 64 == 0 and layout.mailbox_bytes() % 64 == 0


def test_a_mailbox_fragment_is_a_fourth_of_its_message_between_the_least_and_a_slot_in_whole_lines():
    assert layout.MESSAGE_BYTES < layout.MESSAGE_TAG < layout.FRAGMENT_OFFSET < layout.DESCRIPTOR_PID \
        < layout.DESCRIPTOR_ADDRESS < layout.DESCRIPTOR_REFUSED < layout.FRAGMENT_BYTES < layout.MAILBOX_SLOT_HEADER // 8
    assert layout.fragment_bytes(0) == layout.fragment_bytes(1) == layout.MAILBOX_FRAGMENT_MIN
    assert layout.fragment_bytes(64 << 10) == 16 << 10
    assert layout.fragment_bytes(100_001) == 25_024          # a fourth, 25,000.25, up to a whole line
    assert layout.fragment_bytes(layout.MAILBOX_SLOTS * layout.MAILBOX_SLOT_BYTES) == layout.MAILBOX_SLOT_BYTES
    assert layout.fragment_bytes(64 << 20) == layout.MAILBOX_SLOT_BYTES


@pytest.mark.parametrize("nbytes", [0, 1, 8 << 10, (8 << 10) + 1, 40_000, 64 << 10, 100_001, 512 << 10])
def test_the_compiled_send_cuts_and_the_compiled_receive_joins_the_fragments_layout_py_names(nbytes):
    """_mailbox.c's mailbox_put writes fragments of layout.fragment_bytes,
    each with its bytes in its header (what p2p.py's engine reads too), and
    mailbox_take puts them back together."""
    import os

    import numpy as np

    from collectives.transport import p2p
    if p2p._mailbox is None:
        pytest.skip("the compiled send and receive (_mailbox) are not built")
    box = np.zeros(layout.mailbox_bytes() // 8, np.int64)
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, np.uint8)
    assert p2p._mailbox.mailbox_put(box.ctypes.data, data, 7)
    fragment, slot_words = layout.fragment_bytes(nbytes), (layout.MAILBOX_SLOT_HEADER + layout.MAILBOX_SLOT_BYTES) // 8
    count = max(1, -(-nbytes // fragment))
    assert box[layout.MAILBOX_SENT] == count
    for k in range(count):
        head = box[(layout.MAILBOX_HEADER // 8) + k * slot_words:][:layout.MAILBOX_SLOT_HEADER // 8]
        assert (head[layout.MESSAGE_BYTES], head[layout.MESSAGE_TAG], head[layout.FRAGMENT_OFFSET],
                head[layout.FRAGMENT_BYTES]) == (nbytes, 7, k * fragment, min(fragment, nbytes - k * fragment))
    out, abort = np.zeros(nbytes, np.uint8), np.zeros(1, np.int64)
    assert p2p._mailbox.mailbox_take(box.ctypes.data, out, 7, 1e18, abort.ctypes.data, os.getpid(), 10, 0.0) == 0
    assert box[layout.MAILBOX_TAKEN] == count and np.array_equal(out, data)


def test_the_loops_sizes_come_from_the_environment_when_resolved_and_bad_ones_are_named(monkeypatch):
    monkeypatch.delenv("COLLECTIVES_FAST_SMALL_MAX", raising=False)
    monkeypatch.delenv("COLLECTIVES_FAST_CHUNK", raising=False)
    assert resolve_fast_sizes() == (64 << 10, 256 << 10)
    monkeypatch.setenv("COLLECTIVES_FAST_SMALL_MAX", "4096")
    monkeypatch.setenv("COLLECTIVES_FAST_CHUNK", "65536")
    assert resolve_fast_sizes() == (4096, 65536)
    assert resolve_fast_sizes(small_max=8) == (8, 65536)
    for variable, value in (("COLLECTIVES_FAST_SMALL_MAX", "4097"), ("COLLECTIVES_FAST_SMALL_MAX", "0"),
                            ("COLLECTIVES_FAST_CHUNK", "100"), ("COLLECTIVES_FAST_CHUNK", "64K")):
        monkeypatch.setenv(variable, value)
        with pytest.raises(InvalidUsageError, match=variable):
            resolve_fast_sizes()
        with pytest.raises(InvalidUsageError, match=variable):
            check_switches()
        monkeypatch.setenv(variable, "65536")



def test_the_loops_tunables_come_from_the_environment_when_resolved_and_bad_ones_are_named(monkeypatch):
    for variable in ("COLLECTIVES_FENCE_SECONDS", "COLLECTIVES_SPREAD_STAGED_MAX", "COLLECTIVES_STAGED_MAX",
                     "COLLECTIVES_TEST_WRITE_STALL", "COLLECTIVES_TEST_READ_STALL"):
        monkeypatch.delenv(variable, raising=False)
    assert resolve_loop_tunables() == (5.0, 2 << 20, None, 0.0, 0.0)   # (staged_max None: measured)
    monkeypatch.setenv("COLLECTIVES_FENCE_SECONDS", "0.2")
    monkeypatch.setenv("COLLECTIVES_SPREAD_STAGED_MAX", "0")
    monkeypatch.setenv("COLLECTIVES_STAGED_MAX", "65536")
    monkeypatch.setenv("COLLECTIVES_TEST_READ_STALL", "1.5")
    assert resolve_loop_tunables() == (0.2, 0, 65536, 0.0, 1.5)
    assert resolve_loop_tunables(fence_seconds=1, staged_max=0) == (1.0, 0, 0, 0.0, 1.5)
    for variable, value in (("COLLECTIVES_FENCE_SECONDS", "-1"), ("COLLECTIVES_FENCE_SECONDS", "inf"),
                            ("COLLECTIVES_SPREAD_STAGED_MAX", "2.5"), ("COLLECTIVES_STAGED_MAX", "big"),
                            ("COLLECTIVES_TEST_WRITE_STALL", "soon")):
        monkeypatch.setenv(variable, value)
        with pytest.raises(InvalidUsageError, match=variable):
            resolve_loop_tunables()
        with pytest.raises(InvalidUsageError, match=variable):
            check_switches()
        monkeypatch.setenv(variable, "0")

def test_the_plans_segment_comes_from_the_environment_and_bad_ones_are_named(monkeypatch):
    """$COLLECTIVES_PLAN_SEGMENT_BYTES: 2 MiB unset, 0 never, else a multiple of a page."""
    from collectives.config import resolve_plan_segment_bytes
    monkeypatch.delenv("COLLECTIVES_PLAN_SEGMENT_BYTES", raising=False)
    assert resolve_plan_segment_bytes() == 2 << 20 and resolve_plan_segment_bytes(0) == 0
    monkeypatch.setenv("COLLECTIVES_PLAN_SEGMENT_BYTES", "8192")
    assert resolve_plan_segment_bytes() == 8192
    for value in ("1000", "-4096", "2M"):
        monkeypatch.setenv("COLLECTIVES_PLAN_SEGMENT_BYTES", value)
        with pytest.raises(InvalidUsageError, match="COLLECTIVES_PLAN_SEGMENT_BYTES"):
            check_switches()


def test_the_compressed_piece_across_nodes_comes_from_the_environment_and_bad_ones_are_named(monkeypatch):
    """$COLLECTIVES_COMPRESSED_PIECE_BYTES: 4 MiB unset, 0 one piece, else bytes a rank."""
    from collectives.config import resolve_compressed_piece_bytes
    monkeypatch.delenv("COLLECTIVES_COMPRESSED_PIECE_BYTES", raising=False)
    assert resolve_compressed_piece_bytes() == 4 << 20 and resolve_compressed_piece_bytes(0) == 0
    monkeypatch.setenv("COLLECTIVES_COMPRESSED_PIECE_BYTES", "512")
    assert resolve_compressed_piece_bytes() == 512
    for value in ("-4096", "2M", "1.5"):
        monkeypatch.setenv("COLLECTIVES_COMPRESSED_PIECE_BYTES", value)
        with pytest.raises(InvalidUsageError, match="COLLECTIVES_COMPRESSED_PIECE_BYTES"):
            check_switches()


def test_send_and_recvs_single_copy_threshold_comes_from_the_environment_and_never_fits_the_slots(monkeypatch):
    """$COLLECTIVES_MESSAGE_SINGLE_COPY_MIN: 4 MiB unset, 0 never, and a
    value at or below the slots' bytes still streams what fits them."""
    from collectives.config import resolve_message_single_copy_min
    from collectives.transport.p2p import SLOTS_BYTES, PointToPoint

    def threshold():
        return PointToPoint(0, 2, None, lambda: 1.0, None, None).single_copy_min

    monkeypatch.delenv("COLLECTIVES_MESSAGE_SINGLE_COPY_MIN", raising=False)
    assert resolve_message_single_copy_min() == 4 << 20 == threshold()
    for value, expected in (("0", float("inf")), ("1", SLOTS_BYTES + 1), (str(8 << 20), 8 << 20)):
        monkeypatch.setenv("COLLECTIVES_MESSAGE_SINGLE_COPY_MIN", value)
        assert threshold() == expected, value
    for value in ("-1", "4M"):
        monkeypatch.setenv("COLLECTIVES_MESSAGE_SINGLE_COPY_MIN", value)
        with pytest.raises(InvalidUsageError, match="COLLECTIVES_MESSAGE_SINGLE_COPY_MIN"):
            check_switches()


def test_the_compiled_loop_agrees_on_the_row_and_header_sizes():
    _shmloop = pytest.importorskip("collectives.transport._shmloop", reason="built without a C compiler")
    assert (layout.ROW, layout.HEADER) == (_shmloop.ROW_SLOTS, _shmloop.HEADER_SLOTS)



@pytest.mark.parametrize("module", ["collectives.transport._shmloop", "collectives.transport._mailbox",
                                    "collectives.executors._host_plan", "collectives.transport._across"])
def test_every_c_module_exports_the_one_table_of_statuses(module):
    """statuses.h is the C side's one table; failures.py repeats it for
    Python, which translates the statuses of all three engines."""
    from collectives.transport import failures
    built = pytest.importorskip(module, reason="built without a C compiler")
    assert {name: getattr(built, name, None) for name in failures.NAMES} == failures.NAMES
    assert len(set(failures.NAMES.values())) == len(failures.NAMES) == 17

def test_the_ll_region_lies_between_the_reason_and_the_channel_and_gpus_map_all_of_it():
    for size in (1, 2, 3, 8, 64):
        start = layout.ll_region_offset(size)
        assert start % layout.LL_REGION_BYTES == 0
        assert start >= 8 * (layout.HEADER + layout.ROW * size) + layout.HANDLE_BYTES * size + layout.REASON_BYTES
        end = start + layout.LL_REGION_BYTES * size
        assert end <= layout.channel_offset(size) and end <= layout.ll_mapped_bytes(size)
        assert layout.ll_mapped_bytes(size) % layout.PAGE == 0
        assert layout.LL_HANDLE_OFFSET + layout.HANDLE_BYTES <= layout.LL_REGION_BYTES
        assert max(layout.LL_FAULT, layout.LL_READY) < layout.LL_HANDLE_OFFSET // 8


def test_the_call_records_lie_between_the_ll_region_and_the_channel():
    for size in (1, 2, 3, 8, 64):
        start = layout.calls_offset(size)
        assert start >= layout.ll_region_offset(size) + layout.LL_REGION_BYTES * size and start % 8 == 0
        assert start + layout.CALL_RECORDS * layout.CALL_RECORD_BYTES * size <= layout.channel_offset(size)
        assert layout.CALL_RECORD_BYTES % 8 == 0 and layout.CALL_DESCRIPTION_BYTES == layout.CALL_RECORD_BYTES - 8
