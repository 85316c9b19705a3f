"""collectives/router.py's table names every path a call can take, and
only those: the paths' own names, read from the code that runs them
(tests/test_routes.py holds each answer against what ran)."""

import re

import numpy as np
import pytest

import collectives
from collectives import hierarchy, router
from collectives.communicator import VirtualHostRanks
from collectives.executors import device, device_process, ll_collectives, paths, peer_ll, symmetric
from collectives.executors.nccl import NcclRanks
from collectives.transport import fastpath


def table_rows():
    """The router's table: the lines between its header and the first blank line."""
    lines = router.__doc__.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:3] == ["ranks", "the", "call"])
    rows = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        rows.append(line)
    return rows


def path_column_words():
    """Every word of the table's path column (the column under "path")."""
    header = next(line for line in router.__doc__.splitlines() if line.split()[:3] == ["ranks", "the", "call"])
    start, stop = header.index("path"), header.index("algorithm")
    return {word for row in table_rows() for word in re.findall(r"[a-z_]+", row[start:stop])}


def every_path_name():
    """The names of the paths, from the modules that define them."""
    gpu = {cls.name for module in (device, device_process, ll_collectives, peer_ll, symmetric)
           for cls in vars(module).values()
           if isinstance(cls, type) and issubclass(cls, paths.Path) and cls is not paths.Path}
    host_processes = {router.COMPILED_LOOP, "single_copy", "compiled_plan", "step"}   # ShmRank.route's
    across_nodes = {hierarchy.PROGRAM, hierarchy.COUNTERPARTS, hierarchy.PHASES, hierarchy.COMPRESSED,
                    hierarchy.EXCHANGE}
    return gpu | host_processes | across_nodes | {VirtualHostRanks.path, NcclRanks.path}


def test_the_table_names_every_path_and_no_other():
    names = every_path_name()
    assert {"ll", "symmetric", "staged", "step", "peer_ll", "events"} <= names   # (the walk found the GPU paths)
    words = path_column_words() - {"its", "or"}   # ("+ its step", "program, or counterparts")
    assert names <= words, f"paths the table does not name: {names - words}"
    assert words <= names, f"words of the path column that name no path: {words - names}"


def test_the_table_names_the_loops_steps():
    for step in fastpath.STEPS:
        assert f'"{step}"' in router.__doc__, step


@pytest.mark.parametrize("ranks", [1, 3])
def test_one_process_host_ranks_answer_the_interpreter(ranks):
    with collectives.Communicator.local(ranks) as comm:
        for collective in ("allreduce", "broadcast", "all_to_all_v"):
            chosen = comm.chosen_algorithm(collective, 4096, dtype=np.float32)
            assert chosen.path == "interpreter" and chosen.step is None, chosen
