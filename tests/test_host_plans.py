"""The compiled plan executor of host ranks in separate processes
(collectives/executors/_host_plan.c): the interpreter's bits for every
collective and algorithm, with ranks on either executor in one job, and a
build broken on purpose (a fold out of order, a flag before its data, a
missing wait) caught by those same checks."""

import os
import re
import subprocess
import sysconfig
from pathlib import Path

import pytest

from test_mpi import launcher_flags, mpiexec, run_launch, worker_python

pytest.importorskip("mpi4py", reason="the multi-process tests need mpi4py: pip install '.[test]'")
host_process = pytest.importorskip("collectives.executors.host_process")
if not host_process.available():
    pytest.skip("the compiled executor is not built (no C compiler at install)", allow_module_level=True)
pytestmark = pytest.mark.mpi

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("host_plan_worker.py")
SOURCE = ROOT / "collectives" / "executors" / "_host_plan.c"


def run(ranks, scenario, *arguments, environments=None, limit=180, flags=()):
    """mpiexec of `ranks` workers; `environments`: per rank, extra variables
    (MPMD: one program block per rank); `flags`: the launcher's. Returns
    (exit code, output)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(WORKER.parent), os.environ.get("PYTHONPATH", "")]))
    env.pop("COLLECTIVES_COMPILED_PLANS", None)
    command = [mpiexec(), *launcher_flags(ranks, *flags)]
    for rank in range(ranks):
        if rank:
            command.append(":")
        command += ["-n", "1"]
        for name, value in (environments or {}).get(rank, {}).items():
            command += launcher_flags(1, "-env", name, value, whole_launch=False)
        command += [worker_python(), str(WORKER), scenario, *arguments]
    done = run_launch(command, limit, env)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize("interpreted", [(), (0,), (1, 2)], ids=["all-compiled", "rank0-interpreted",
                                                                  "ranks12-interpreted"])
def test_every_collective_gives_the_interpreters_bits_whichever_executor_each_rank_runs(interpreted):
    code, output = run(3, "bits", environments={r: {"COLLECTIVES_COMPILED_PLANS": "0"} for r in interpreted})
    assert code == 0 and len(re.findall(r"OK bits \d", output)) == 3, output


@pytest.mark.parametrize("interpreted", [(), (0,)], ids=["all-compiled", "rank0-interpreted"])
def test_large_calls_on_the_plans_run_in_segments_with_the_bits_of_calls_on_each_segment(interpreted):
    segments = {"COLLECTIVES_PLAN_SEGMENT_BYTES": "4096", "COLLECTIVES_FAST_PATH": "0"}
    code, output = run(3, "segments", environments={
        r: dict(segments, **({"COLLECTIVES_COMPILED_PLANS": "0"} if r in interpreted else {})) for r in range(3)})
    assert code == 0 and len(re.findall(r"OK segments \d", output)) == 3, output


def test_ranks_that_cut_a_call_into_other_segments_are_told_so():
    sizes = {0: "4096", 1: "8192"}
    code, output = run(2, "segments_differ", environments={
        r: {"COLLECTIVES_PLAN_SEGMENT_BYTES": sizes[r], "COLLECTIVES_FAST_PATH": "0"} for r in range(2)})
    assert code == 0 and len(re.findall(r"OK segments_differ \d", output)) == 2, output


def test_the_compiled_executor_takes_the_plans_and_leaves_float16_to_the_interpreter():
    code, output = run(2, "takes_the_plans")
    assert code == 0 and len(re.findall(r"OK takes_the_plans \d", output)) == 2, output


def test_calls_repeated_on_the_same_arrays_or_on_new_ones_of_their_shape_run_from_c_with_the_interpreters_bits():
    code, output = run(3, "repeats")
    assert code == 0 and len(re.findall(r"OK repeats \d", output)) == 3, output


def test_a_rank_killed_between_repeats_run_from_c_is_reported_at_once():
    # (hydra would otherwise end the survivors itself when one rank exits)
    code, output = run(3, "repeat_killed", flags=("-disable-auto-cleanup",))
    assert sorted(re.findall(r"OK repeat_killed (\d)", output)) == ["0", "2"], output


# (what the build gets wrong, the text it replaces, its replacement)
BROKEN = {
    "fold out of order": (
        "        int divisor = row[KIND]",
        "        for (int64_t a = 0, b = nsrc - 1; a < b; a++, b--) {\n"
        "            const char *swapped = srcs[a]; srcs[a] = srcs[b]; srcs[b] = swapped;\n"
        "        }\n"
        "        int divisor = row[KIND]"),
    "flag before its data": (
        "        int64_t first = call->row_starts[p], last = call->row_starts[p + 1];",
        "        publish(mine, COUNTER, base + p + 1);\n"
        "        { struct timespec pause = {0, 1000000}; nanosleep(&pause, NULL); }\n"
        "        int64_t first = call->row_starts[p], last = call->row_starts[p + 1];"),
    # Every wait for a peer's phase of this call, after the executor's first
    # two calls: the start's reach probe (ShmRank._learn_reach) and the
    # scenario's first, which makes every rank's workspace (without it a
    # peer's would not exist yet; the loop's calls as the communicator
    # starts came before them).
    "missing wait": (
        "            int status = wait_for(w, peer, COUNTER, base + done, released);",
        "            static int64_t first_seqs[2] = {0, 0};\n"
        "            if (first_seqs[0] == 0) first_seqs[0] = seq;\n"
        "            else if (first_seqs[1] == 0 && seq != first_seqs[0]) first_seqs[1] = seq;\n"
        "            if (done >= 1 && first_seqs[1] != 0 && seq > first_seqs[1]) continue;\n"
        "            int status = wait_for(w, peer, COUNTER, base + done, released);"),
}


def broken_build(tmp_path, old, new):
    """_host_plan.c with `old` replaced by `new`, compiled as the extension is."""
    source = SOURCE.read_text()
    assert source.count(old) == 1, f"the test's anchor is not in _host_plan.c once: {old!r}"
    broken = tmp_path / "_host_plan.c"
    broken.write_text(source.replace(old, new))
    target = tmp_path / f"_host_plan{sysconfig.get_config_var('EXT_SUFFIX')}"
    compiler = os.environ.get("CC", "cc")
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-std=c11", "-ffp-contract=off", "-fno-strict-aliasing",
                    f"-I{sysconfig.get_paths()['include']}", f"-I{ROOT / 'collectives' / 'transport'}",
                    f"-I{ROOT / 'collectives' / 'executors'}", str(broken), "-o", str(target)],
                   check=True, capture_output=True, text=True)
    return target


@pytest.mark.parametrize("mistake", list(BROKEN))
def test_a_broken_build_is_caught(tmp_path, mistake):
    module = broken_build(tmp_path, *BROKEN[mistake])
    # Limits pinned, so that the ranks time no exchange as they start: the
    # executor's first call is then the scenario's, which grows every workspace.
    pinned = {"COLLECTIVES_EXCHANGE_SINGLE_COPY_MIN": str(4 << 20), "COLLECTIVES_STAGED_MAX": str(4 << 20)}
    code, output = run(3, "broken", str(module), environments={rank: pinned for rank in range(3)})
    assert code == 0, output
    assert len(re.findall(r"CAUGHT broken \d", output)) == 3, f"{mistake} went unnoticed:\n{output}"
