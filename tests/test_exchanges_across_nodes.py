"""all_to_all, all_to_all_v, gather and scatter across pretend nodes: 4
processes under mpiexec, split into nodes by $COLLECTIVES_PRETEND_NODES,
as tests/test_hierarchy.py runs the other collectives; each test starts one
mpiexec job whose worker (tests/exchanges_across_worker.py) loops over its
cases itself. The plans (hierarchy.exchange_plan) are checked here too,
without processes: each block sent once, where its receiver expects it.
"""

import re
from pathlib import Path

import pytest

from collectives import hierarchy
from collectives.bootstrap import Topology
from mpi_launch import run_nodes_worker

WORKER = Path(__file__).with_name("exchanges_across_worker.py")
TWO_AND_TWO = "0,0,1,1"
THREE_AND_ONE = "0,0,0,1"
INTERLEAVED = "0,1,0,1"     # nodes that do not hold consecutive ranks
THREE_NODES = "0,1,1,2"     # uneven


def run_ranks(scenario, layout, *launcher_flags, limit=240):
    """Ranks of this module's worker, one per label of `layout`: their "OK" lines and a report."""
    pytest.importorskip("mpi4py", reason="the multi-process tests need mpi4py: pip install '.[test]'")
    return run_nodes_worker(WORKER, scenario, layout, *launcher_flags, limit=limit)


@pytest.mark.mpi
@pytest.mark.parametrize("layout", [TWO_AND_TWO, THREE_AND_ONE, INTERLEAVED, THREE_NODES])
def test_every_exchange_dtype_and_root_across_nodes_holds_the_right_bits(layout):
    oks, report = run_ranks("exchanges", layout)
    assert len(oks) == 4, report


@pytest.mark.mpi
def test_bad_exchanges_across_nodes_raise_on_every_rank_and_write_nothing():
    oks, report = run_ranks("refusals", THREE_NODES)
    assert len(oks) == 4, report


@pytest.mark.mpi
@pytest.mark.parametrize("layout", [TWO_AND_TWO, THREE_NODES])
def test_ranks_in_different_exchanges_all_raise_invalid_usage(layout):
    oks, report = run_ranks("mismatched", layout, "-disable-auto-cleanup")
    assert len(oks) == 4, report
    for case in (0, 1):   # some rank saw the mismatch itself and named it (the others were told)
        assert re.findall(rf"RAISED {case} \d.*InvalidUsageError: .*(different call|more bytes)", report), report


@pytest.mark.mpi
def test_a_killed_rank_makes_the_others_raise_rank_failed():
    oks, report = run_ranks("killed", TWO_AND_TWO, "-disable-auto-cleanup")
    assert len(oks) == 3, report


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("layout", [TWO_AND_TWO, THREE_AND_ONE])
def test_a_stalled_rank_makes_the_others_raise_in_time(layout):
    oks, report = run_ranks("stalled", layout, "-disable-auto-cleanup")
    assert len(oks) == 4, report


# -- the plans, without processes ------------------------------------------------------------------

def moved(topology, collective, count, root, counts):
    """Every rank's plan run on arrays of labelled elements: (what each rank's out holds, WORK
    use), each element of rank q's x labelled (q, i)."""
    n = topology.size
    matrix = counts or hierarchy.exchange_counts(collective, count, root, n)
    plans = [hierarchy.exchange_plan(topology, collective, count, root, counts, r) for r in range(n)]
    xs = [[(q, i) for i in range(sum(matrix[q]))] for q in range(n)]
    outs = [[None] * sum(matrix[q][r] for q in range(n)) for r in range(n)]
    works = [[None] * plan.workspace for plan in plans]
    for r, plan in enumerate(plans):
        for a, w, c in plan.staged:
            works[r][w:w + c] = xs[r][a:a + c]
    for r, plan in enumerate(plans):
        for peer, buffer, a, c in plan.link.sends:
            assert buffer == hierarchy.INPUT
            node = topology.nodes[topology.node_of(peer)]
            assert r not in node, (r, peer)
            theirs = [m for m in plans[peer].link.receives if m[0] == r]
            assert len(theirs) == 1 and theirs[0][3] == c, (r, peer, theirs)
            b = theirs[0][2]
            outs[peer][b:b + c] = xs[r][a:a + c]
        for local, w, b, c in plan.reads:
            mate = topology.nodes[topology.node_of(r)][local]
            outs[r][b:b + c] = works[mate][w:w + c]
        if plan.own:
            a, b, c = plan.own
            outs[r][b:b + c] = xs[r][a:a + c]
    return outs, [plan.workspace for plan in plans], matrix


@pytest.mark.parametrize("labels", [(0, 0, 1, 1), (0, 0, 0, 1), (0, 1, 0, 1), (0, 1, 1, 2), (0, 1, 2, 0, 1, 2)])
def test_each_block_of_an_exchange_lands_where_its_receiver_expects_it(labels):
    nodes = {}
    for rank, label in enumerate(labels):
        nodes.setdefault(label, []).append(rank)
    topology = Topology(tuple(tuple(node) for node in nodes.values()), ("machine",) * len(labels))
    n = len(labels)
    uneven = tuple(tuple((3 * q + 5 * r) % 4 * (q != 1) for r in range(n)) for q in range(n))
    cases = [("all_to_all", 3 * n, 0, None), ("all_to_all_v", sum(map(sum, uneven)), 0, uneven)]
    cases += [(c, (3 if c == "gather" else 3 * n), root, None) for c in ("gather", "scatter") for root in range(n)]
    for collective, count, root, counts in cases:
        outs, workspaces, matrix = moved(topology, collective, count, root, counts)
        for r in range(n):   # block q of rank r's out: rank q's block for r, whole and in order
            want = [(q, sum(matrix[q][:r]) + i) for q in range(n) for i in range(matrix[q][r])]
            assert outs[r] == want, (collective, root, r)
        for node in topology.nodes:   # (every rank of a node maps its node-mates' WORK at one size)
            assert len({workspaces[r] for r in node}) == 1, (collective, workspaces)
