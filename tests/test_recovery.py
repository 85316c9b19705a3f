"""Going on after a failure: revoke, agree and shrink (transport/recovery.py).

Ranks in separate processes under MPICH's mpiexec, each wrapped the way
docs/api.md tells users to (a shell that ignores hydra's SIGUSR1 and turns a
rank's death by a signal into an exit status, so hydra lets the survivors
live). Ranks die by os._exit or by SIGKILL from a thread of their own, at a
seeded random moment of a loop of allreduces on each path (the compiled
loop's merged step and pipeline, and the ring plan through the step
protocol); every survivor must raise RankFailedError, shrink to the same
ranks, and compute right on the new communicator. The checks of each rank
are in tests/recovery_worker.py.
"""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import collectives
from collectives import InvalidUsageError, elastic
from collectives.bootstrap import PRETEND_NODES_ENV
from collectives.transport import fastpath
from installed import require
from test_mpi import mpich_mpiexec, run_launch, survivable_launch

WORKER = Path(__file__).with_name("recovery_worker.py")
ELASTIC_WORKER = Path(__file__).with_name("elastic_worker.py")
LIMIT = 90

needs_the_loop = pytest.mark.skipif(not fastpath.available(), reason="the compiled loop (_shmloop) is not built: "
                                    "python setup.py build_ext --inplace")


def run_survivors(n, scenario, *arguments, survivors, worker=WORKER, device="host"):
    """Run the worker's scenario on n ranks; the ranks `survivors` must each print OK."""
    pytest.importorskip("mpi4py", reason="the multi-process tests need mpi4py: pip install '.[test]'")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(WORKER.parent), os.environ.get("PYTHONPATH", "")]))
    env.pop("COLLECTIVES_TIMEOUT", None)
    env["RECOVERY_DEVICE"] = device
    done = run_launch(survivable_launch(n, [str(worker), scenario, *arguments]), LIMIT, env)
    report = f"exit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    oks = sorted(int(rank) for rank in re.findall(rf"OK {scenario} (\d+)", done.stdout))
    assert oks == sorted(survivors), report
    return done.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("n, path, how, victims", [
    pytest.param(3, "fast", "exit", "1", marks=needs_the_loop, id="3-ranks-compiled-loop-exit"),
    pytest.param(4, "fast", "sigkill", "2", marks=needs_the_loop, id="4-ranks-compiled-loop-sigkill"),
    pytest.param(3, "large", "sigkill", "0", marks=needs_the_loop, id="3-ranks-pipeline-sigkill-rank-0"),
    pytest.param(4, "ring", "sigkill", "1,3", id="4-ranks-step-protocol-two-sigkilled"),
])
def test_the_survivors_of_killed_ranks_shrink_to_the_same_ranks_and_compute_right(n, path, how, victims):
    dead = {int(v) for v in victims.split(",")}
    printed = run_survivors(n, "killed", path, how, victims, "7", survivors=[r for r in range(n) if r not in dead])
    assert len(re.findall(r"SHRINK [\d.]+ ms", printed)) == n - len(dead), printed


@pytest.mark.mpi
@pytest.mark.parametrize("path, victims", [("fast", "2"), ("ring", "0")])
def test_ranks_on_emulated_devices_shrink_and_compute_right(path, victims):
    dead = {int(victims)}
    run_survivors(3, "killed", path, "sigkill", victims, "5", survivors=[r for r in range(3) if r not in dead],
                  device="emulated")


@pytest.mark.mpi
@pytest.mark.parametrize("path", [pytest.param("fast", marks=needs_the_loop), "ring"])
def test_a_stopped_rank_is_left_out_and_told_so_once_it_runs_again(path):
    run_survivors(3, "stalled", path, survivors=[0, 1, 2])


@pytest.mark.mpi
def test_agree_is_an_and_that_counts_a_dead_rank_as_false_and_works_after_a_shrink():
    run_survivors(3, "agree", survivors=[0, 2])


@pytest.mark.mpi
def test_a_revoke_stops_a_waiting_rank_at_once_and_everyone_shrinks_to_every_rank():
    run_survivors(3, "revoke", survivors=[0, 1, 2])


@pytest.mark.mpi
@pytest.mark.skipif(not fastpath.available(), reason="the compiled loop (_shmloop) is not built")
def test_two_failures_two_shrinks_chain_epochs_and_old_ranks():
    run_survivors(4, "twice", survivors=[0, 3])


@pytest.mark.mpi
@pytest.mark.skipif(not fastpath.available(), reason="the compiled loop (_shmloop) is not built")
@pytest.mark.parametrize("seed", [1, 2])
def test_a_rank_that_dies_during_the_shrink_is_left_out_by_a_later_one_on_every_survivor(seed):
    printed = run_survivors(4, "in_shrink", str(seed), survivors=[0, 3])
    assert sorted(re.findall(r"MEMBERS \[[\d, ]*\]", printed)) == ["MEMBERS [0, 3]"] * 2, printed


@pytest.mark.mpi
def test_a_member_that_left_a_failed_round_before_its_barrier_fails_the_round_for_the_others():
    run_survivors(3, "maker_dies_in_barrier", survivors=[1, 2])


@pytest.mark.mpi
def test_a_shrink_that_timed_out_goes_on_when_called_again():
    run_survivors(3, "shrink_again", survivors=[0, 1, 2])


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_elastic_training_loses_a_rank_and_ends_on_the_one_process_weights(kind):
    if kind == "torch":
        require("torch", "needs PyTorch: pip install '.[test]'")
    printed = run_survivors(3, kind, "3", survivors=[0, 2], worker=ELASTIC_WORKER)
    assert len(re.findall(r"KILLED at step \d+, 40 commits", printed)) == 2, printed


@pytest.mark.mpi
def test_torch_distributeds_default_group_shrinks_and_its_training_goes_on(tmp_path):
    """A rank of torch.distributed's default group (ours, from a FileStore)
    dies; the survivors' all_reduce raises, shrink_default_group makes the
    default group theirs, and the steps end on one process's weights."""
    require("torch", "needs PyTorch: pip install '.[test]'")
    printed = run_survivors(3, "torch_group", "3", str(tmp_path / "store"), survivors=[0, 2], worker=ELASTIC_WORKER)
    assert sorted(re.findall(r"rank (\d) is rank (\d) of 2", printed)) == [("0", "0"), ("2", "1")], printed


@pytest.mark.mpi
def test_the_elastic_example_loses_a_rank_and_ends_on_the_uninterrupted_runs_accuracy_on_one_node_and_across_two():
    require("sklearn", "needs scikit-learn: pip install '.[test]'")
    example = Path(__file__).parent.parent / "examples" / "elastic.py"

    def accuracy(n, *flags, pretend_nodes=None):
        env = {name: value for name, value in os.environ.items() if name != PRETEND_NODES_ENV}
        if pretend_nodes:
            env[PRETEND_NODES_ENV] = pretend_nodes
        done = run_launch(survivable_launch(n, [str(example), "--epochs", "8", *flags]), LIMIT, env)
        found = re.search(r"(\d) ranks finished (\d+) steps; test accuracy ([\d.]+); parameters bitwise identical: "
                          r"True", done.stdout)
        assert found, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
        return int(found[1]), float(found[3]), done.stdout

    _, uninterrupted, _ = accuracy(4, "--kill-step", "-1")
    # on one machine, and across two pretend nodes (the survivors agree and shrink over MPI there)
    for nodes in (None, "0,0,1,1"):
        ranks, interrupted, printed = accuracy(4, "--kill-rank", "1", "--kill-step", "57", pretend_nodes=nodes)
        assert ranks == 3 and "go on from the commit at step 50" in printed, printed
        assert abs(interrupted - uninterrupted) <= 0.005, (nodes, interrupted, uninterrupted)


@pytest.mark.mpi
@pytest.mark.parametrize("nodes, first, trials, ranks, events, timeout", [
    (1, 1, 3, "2,3,4", {"sigkill", "in_shrink"}, 10),
    (1, 4, 1, "2", {"stop"}, 3),
    (2, 6, 1, "4", {"sigkill2"}, 10),
    (2, 198, 1, "4", {"sigkill2"}, 10),
    (2, 176, 1, "3", {"sigkill"}, 10),
], ids=["one node", "a stopped rank", "two pretend nodes", "a whole node dies under a broadcast's root",
        "the same, through exchange()"])
def test_a_sample_of_the_chaos_benchmark_passes(tmp_path, nodes, first, trials, ranks, events, timeout):
    """bench.chaos's first trials (seeds 1-3: a SIGKILL on 2 ranks, a rank
    dying during the shrink on 3 and 4; seed 4, a stop on 2, the same trial
    as in the benchmark's run of seeds 1-4); across two pretend
    nodes seed 6 (two SIGKILLs at once on 4 ranks, one on each node: the
    survivors still span both), and seed 198 (both ranks of node 1 killed
    while rank 0 broadcasts 1 KiB to them: its one-way sends to the dead
    filled MPICH's send cells, and its shrink messages never left, until
    every 8th became synchronous: mpi.CONFIRM_EVERY), and seed 176, the
    same on nodes of 2 and 1 ranks (MpiLink.exchange's sends, not a
    Program's). The benchmark run makes 200 (docs/api.md;
    across nodes a rank dying during the shrink fails it where MPI was
    making the survivors' communicator, so the sample leaves that out). With a 10 s timeout: in one run beside the
    rest of the suite on 2 cores, with the benchmark's 3 s, one survivor of
    seed 3 did not finish, in a trial that took 4.1 s, so the timeout is
    the likely cause (not confirmed: that run kept no traceback; the JSON
    records a survivor's now). The stop alone keeps the benchmark's 3 s:
    its survivor waits the whole timeout, and its only peer is the stopped
    rank, so no live rank can be taken for a stalled one."""
    pytest.importorskip("mpi4py")
    result = tmp_path / "chaos.json"
    done = subprocess.run([sys.executable, "-m", "bench.chaos", "--trials", str(trials), "--seed", str(first),
                           "--ranks", ranks, "--timeout", str(timeout), "--nodes", str(nodes), "-J", str(result)],
                          capture_output=True, text=True, timeout=4 * LIMIT, cwd=Path(__file__).parent.parent)
    assert result.exists(), done.stdout + done.stderr
    summary = json.loads(result.read_text())["summary"]
    ran = json.loads(result.read_text())["trials"]
    assert summary["trials"] == trials and summary["failed"] == 0 and summary["hangs"] == 0, \
        [(t["seed"], t["event"], t["problems"]) for t in ran if t["problems"]]
    assert set(summary["recovery_ms"]) == events, summary
    assert all(t["nodes"] == (None if nodes == 1 else ",".join(str(r * 2 // t["ranks"]) for r in range(t["ranks"])))
               for t in ran), [t["nodes"] for t in ran]


@pytest.mark.mpi
@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather", "broadcast", "reduce"])
def test_the_chaos_checks_closed_form_is_numpys_sum_of_the_inputs_bit_for_bit(collective):
    """bench.chaos checks each call against a closed form made once per
    membership (so the time between its calls is the library's): it must be
    what NumPy makes of the ranks' inputs, for any membership after a shrink."""
    from bench import chaos
    count = 1000
    for members in ([0, 1], [1, 3], [0, 2, 3], [0, 1, 2, 3]):
        n = len(members)
        xs = [chaos.inputs(collective, count, m, n) for m in members]
        total = np.sum(xs, axis=0, dtype=np.float32)
        for r in range(n):
            want = {"allreduce": total, "reduce_scatter": total[r * count:(r + 1) * count],
                    "allgather": np.concatenate(xs), "broadcast": xs[0],
                    "reduce": total if r == 0 else xs[r]}[collective]
            got = chaos.expected(collective, count, members, r)
            assert got.dtype == np.float32 and got.tobytes() == want.tobytes(), (members, r)


def test_elastic_names_a_launcher_that_would_end_the_survivors():
    pytest.importorskip("mpi4py")
    mpiexec = mpich_mpiexec   # what elastic says of hydra's mpiexec, whichever MPI the other tests launch
    ask = f"{shlex.quote(sys.executable)} -c 'from collectives import elastic; print(\"[\" + elastic.launcher_kills_survivors() + \"]\")'"
    direct = subprocess.run([mpiexec(), "-n", "1", "sh", "-c", f"exec {ask}"], capture_output=True, text=True,
                            timeout=LIMIT)
    assert "direct child of MPICH's mpiexec" in direct.stdout, direct.stdout + direct.stderr
    untrapped = subprocess.run([mpiexec(), "-n", "1", "sh", "-c", f"{ask}; exit $?"], capture_output=True, text=True,
                               timeout=LIMIT)
    assert "does not ignore it" in untrapped.stdout, untrapped.stdout + untrapped.stderr
    wrapped = subprocess.run([mpiexec(), "-n", "1", "sh", "-c", f'trap "" USR1; {ask}; exit $?'],
                             capture_output=True, text=True, timeout=LIMIT)
    assert wrapped.stdout.strip() == "[]", wrapped.stdout + wrapped.stderr
    assert "--nproc-per-node 1" in elastic.launcher_kills_survivors({"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "4"})
    assert elastic.launcher_kills_survivors({"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "1"}) == ""


# One process that starts MPI through collectives.init (a singleton: MPI_Init
# runs as under mpiexec) and prints what became of SIGUSR1 (bootstrap.py's
# FAILURE_SIGNAL): `handler` sets a Python handler first; `thread` calls
# init from a thread other than the main one.
SIGNAL_AFTER_INIT = r"""
import json, os, signal, sys, threading
import collectives
from collectives import bootstrap

case, fired = sys.argv[1], []
if case == "handler":
    signal.signal(signal.SIGUSR1, lambda *_: fired.append(1))
if case == "thread":
    started = threading.Thread(target=collectives.init)
    started.start()
    started.join()
else:
    collectives.init()
from mpi4py import MPI
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
bit = 1 << (signal.SIGUSR1 - 1)
ignored, caught = bool(int(status["SigIgn"], 16) & bit), bool(int(status["SigCgt"], 16) & bit)
if ignored or caught:   # (the default action would end the process)
    os.kill(os.getpid(), signal.SIGUSR1)
print(json.dumps({"mpich": MPI.Get_library_version().startswith("MPICH"),
                  "ignored": ignored, "caught": caught,
                  "fired": len(fired), "before": str(bootstrap.failure_signal_before_mpi())}))
"""


def test_under_mpich_a_launchers_failure_signal_leaves_mpi_alone():
    """MPICH's handler for SIGUSR1 would make the next MPI call wait for
    mpiexec's word on dead processes, forever where mpiexec is out of reach
    (tests/test_hosts.py's cut link): after init the signal is ignored, or
    goes to the Python handler the process had, from the main thread or
    another."""
    pytest.importorskip("mpi4py")
    def default_action():   # (as a launch without a trap gives it; pytest's workers may ignore the signal)
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    launched = {case: subprocess.Popen([sys.executable, "-c", SIGNAL_AFTER_INIT, case], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, preexec_fn=default_action)
                for case in ("plain", "handler", "thread")}
    seen = {}
    for case, process in launched.items():
        out, err = process.communicate(timeout=LIMIT)
        assert process.returncode == 0, f"{case}: exit {process.returncode}\n{out}{err}"
        seen[case] = json.loads(out)
    if not seen["plain"]["mpich"]:
        pytest.skip("MPICH's handler only: this mpi4py runs on another MPI")
    assert seen["plain"] == {"mpich": True, "ignored": True, "caught": False, "fired": 0,
                             "before": str(signal.SIG_DFL)}, seen
    assert seen["thread"]["ignored"] and not seen["thread"]["caught"], seen
    assert seen["handler"]["caught"] and not seen["handler"]["ignored"] and seen["handler"]["fired"] == 1, seen


@pytest.mark.parametrize("what", ["revoke", "agree", "shrink"])
def test_ranks_that_cannot_recover_say_so(what):
    with collectives.Communicator.local(2) as comm:
        arguments = (True,) if what == "agree" else ()
        with pytest.raises(InvalidUsageError, match=f"{what}: not available on VirtualHostRanks"):
            getattr(comm, what)(*arguments)


class _NamesGiven:
    """A rendezvous of `size` ranks, this one `rank`, whose exchanges have
    already happened: every allgather returns `names`."""

    def __init__(self, rank, size, names):
        self.rank, self.size, self._names = rank, size, names

    def allgather(self, data, nbytes, deadline, what):
        return [name.encode() for name in self._names]

    def barrier(self, deadline, what):
        pass


@pytest.mark.parametrize("start", ["process_rank", "node_process_rank"])
def test_a_rank_whose_leader_gave_up_the_start_raises_a_timeout_that_shrink_goes_on_from(start):
    """The leader made the control segment and sent its name, then gave up
    (a member it waited for died) and released it: the rank that attaches
    after that raises CollectiveTimeoutError, as the leader did, so a
    shrink keeps its communicator for another round on both, where this
    rank had raised CollectiveError and closed it (bench.chaos --nodes 2,
    seed 93)."""
    from collectives import bootstrap
    from collectives.errors import CollectiveTimeoutError
    from collectives.transport.protocol import new_prefix
    from collectives.transport.shm import ShmRank
    prefix = new_prefix()
    ShmRank(0, 2, prefix).close()   # made, named, released
    rendezvous = _NamesGiven(1, 2, [prefix, ""])
    with pytest.raises(CollectiveTimeoutError, match="rank 0, which makes this communicator's shared memory, gave "
                                                     "up starting it before this rank attached"):
        if start == "process_rank":
            bootstrap.process_rank(rendezvous, float("inf"), ShmRank)
        else:
            one_node = bootstrap.Topology(nodes=((0, 1),), machines=("m", "m"))
            bootstrap.node_process_rank(rendezvous, float("inf"), lambda *a: ShmRank(*a), one_node)


@pytest.mark.parametrize("flag", [2, "yes", None, np.ones(2, bool)])
def test_agree_takes_a_bool(flag):
    with collectives.Communicator.local(1) as comm:
        with pytest.raises(InvalidUsageError, match="flag: expected a bool"):
            comm.agree(flag)
        assert comm.agree(True) is True and comm.agree(np.bool_(False)) is False   # alone, it agrees with itself


def test_an_array_state_rolls_back_in_place_to_its_last_commit_and_run_returns_trains_result():
    with collectives.Communicator.local(1) as comm:
        w = np.arange(4.0)
        state = elastic.ArrayState(comm, w=w, step=0, note="a")

        def train(state):
            state.w += 1
            state.step += 1
            state.commit()
            state.w *= 10
            state.step, state.note = 99, "b"
            return "done"

        assert elastic.run(train, state) == "done"
        assert state.commits == 1
        state.restore()
        assert state.w is w and np.array_equal(w, np.arange(4.0) + 1)
        assert (state.step, state.note) == (1, "a")


def test_elastic_says_what_is_wrong():
    with collectives.Communicator.local(1) as comm:
        with pytest.raises(InvalidUsageError, match="needs at least one value"):
            elastic.ArrayState(comm)
        with pytest.raises(InvalidUsageError, match="C-contiguous"):
            elastic.ArrayState(comm, w=np.zeros((4, 4))[:, 0])
        with pytest.raises(InvalidUsageError, match="state: expected a collectives.elastic State"):
            elastic.run(lambda state: None, {"w": 1})
