"""bench.hosts: hosts made of namespaces on this machine, for runs across a
real network link. Needs root and iproute2; skipped, saying why,
elsewhere. Each test makes its hosts under tmp_path and removes them."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bench import hosts
from installed import require

pytest.importorskip("mpi4py", reason="the hosts' ranks need mpi4py: pip install '.[test]'")

PROBE = textwrap.dedent("""
    import os, socket
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    name = socket.gethostname()
    open(f"/dev/shm/hosts-test-{world.rank}", "w").close()
    world.Barrier()
    seen = sorted(entry for entry in os.listdir("/dev/shm") if entry.startswith("hosts-test-"))
    peer = socket.gethostbyname("h1" if name == "h0" else "h0")
    rows = world.gather(f"RANK {world.rank} {name} {','.join(seen)} {peer}")   # one writer: no interleaved lines
    if world.rank == 0:
        print(*rows, sep=chr(10), flush=True)
""")


@pytest.fixture
def made(tmp_path):
    yield from two_hosts_in(tmp_path / "hosts", "1gbit", 7)


def two_hosts_in(directory, link, third):
    """A fixture's body: 2 hosts in `directory` (skipped where they cannot be made), removed after,
    on 10.99.THIRD.0/24 moved by the xdist worker's number: each worker's hosts on a subnet of their own."""
    reason = hosts.why_not()
    if reason:
        pytest.skip(f"cannot make hosts here: {reason}")
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    state = hosts.up(2, directory, link=link, subnet=f"10.99.{third + 20 * worker}")
    try:
        yield directory, state
    finally:
        hosts.down(directory)


def leftovers(state):
    """What of `state`'s hosts still exists on the machine."""
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    names = [state["bridge"], *(h["veth"] for h in state["hosts"])]
    return ([name for name in names if f" {name}:" in links or f" {name}@" in links]
            + [h["pid"] for h in state["hosts"] if Path(f"/proc/{h['pid']}").exists()])


def test_check_says_whether_hosts_can_be_made_here_and_why_not(capsys):
    assert hosts.main(["check"]) == 0
    said = capsys.readouterr().out.strip()
    assert said == (hosts.why_not() or "hosts can be made here"), said


@pytest.mark.mpi
@pytest.mark.slow
def test_ranks_on_two_hosts_have_their_own_names_shm_and_addresses_and_nothing_is_left(made, tmp_path):
    directory, state = made
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    done = subprocess.run(hosts.mpiexec_command(directory, ["-hosts", "h0:1,h1:1", "-n", "2",
                                                            sys.executable, str(script)]),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = sorted(line.split()[1:] for line in done.stdout.splitlines() if line.startswith("RANK"))
    # each rank on its host, which sees only its own rank's /dev/shm file, and resolves the other host
    h0, h1 = (h["address"] for h in state["hosts"])
    assert rows == [["0", "h0", "hosts-test-0", h1], ["1", "h1", "hosts-test-1", h0]], done.stdout
    assert not list(Path("/dev/shm").glob("hosts-test-*"))
    # each host's only link is shaped as asked
    qdisc = subprocess.run(["nsenter", "-t", str(state["hosts"][1]["pid"]), "-n", "tc", "qdisc", "show", "dev", "eth0"],
                           capture_output=True, text=True, check=True).stdout
    assert "tbf" in qdisc and "1Gbit" in qdisc, qdisc
    hosts.down(directory)
    assert not leftovers(state) and not directory.exists()


@pytest.mark.mpi
@pytest.mark.slow
def test_down_removes_everything_after_a_host_died(made):
    directory, state = made
    assert len(leftovers(state)) == 1 + 2 + 2   # the bridge, two veths, two hosts
    os.kill(state["hosts"][0]["pid"], 9)
    hosts.down(directory)
    assert not leftovers(state) and not directory.exists()


@pytest.mark.mpi
@pytest.mark.slow
def test_host_vs_mpich_across_two_hosts_times_the_link_floor_and_ours_compressed(tmp_path):
    """python -m bench.host_vs_mpich --hosts 2: its own hosts, the ranks spread
    over them, the link measured before each launch and its floor beside every
    size, ours compressed beside the allreduce; every host removed after."""
    reason = hosts.why_not()
    if reason:
        pytest.skip(f"cannot make hosts here: {reason}")
    require("torch", reason="needs PyTorch for Gloo: pip install torch")
    path = tmp_path / "across.json"
    command = [sys.executable, "-m", "bench.host_vs_mpich", "--hosts", "2", "--link", "1gbit", "--ranks", "2",
               "--quick", "--sizes", "64K", "--collectives", "allreduce,reduce", "--compression", "int8",
               "--timeout", "60", "-J", str(path)]
    done = subprocess.run(command, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                          timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(path.read_text())
    assert [r["collective"] for r in report["runs"]] == ["allreduce", "reduce"]
    for run in report["runs"]:
        across = run["hosts"]
        assert across["count"] == 2 and across["link"] == "1gbit" and across["hostnames"] == ["h0", "h1"]
        rate = across["measured_bytes_per_second"]
        assert 0.05e9 / 8 < rate <= 1.1e9 / 8, rate   # tbf holds one TCP stream to the link's rate
        assert "-hosts h0:1,h1:1" in run["launch"]
        (row,) = run["rows"]
        must_send = {"allreduce": 65536, "reduce": 65536}[run["collective"]]   # 2 hosts: each byte once
        for place in ("out_of_place", "in_place"):
            timed = row[place]
            assert timed["link"]["time_us"] == pytest.approx(must_send / rate * 1e6)
            assert all(timed[lib]["wrong"] == 0 for lib in ("ours", "mpich", "gloo"))
            if run["collective"] == "allreduce":
                assert 0 < timed["ours:int8"]["maxrel"] < 0.05 and timed["ours:int8"]["time_us"] > 0
            else:
                assert "ours:int8" not in timed
    # the tool's hosts are on 10.99.0.0/24 (bench.hosts' default): none of it is left on the machine
    addresses = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True).stdout
    assert " 10.99.0." not in addresses, addresses


TORCH_PROBE = textwrap.dedent("""
    import socket, torch, torch.distributed as dist
    import collectives.torch   # registers the "collectives" backend
    dist.init_process_group("collectives")
    rank, size = dist.get_rank(), dist.get_world_size()
    x = torch.full((1000,), float(rank + 1))
    dist.all_reduce(x)
    names = [None] * size
    dist.all_gather_object(names, socket.gethostname())
    if rank == 0:
        print("RESULT", float(x[0]), float(x[-1]), ",".join(names), flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.processes
@pytest.mark.slow
def test_torchrun_on_every_host_meets_at_h0_and_our_backend_reduces_across_them(made, tmp_path):
    require("torch", reason="needs PyTorch: pip install torch")
    directory, state = made
    script = tmp_path / "probe.py"
    script.write_text(TORCH_PROBE)
    commands = hosts.torchrun_commands(directory, 2, [str(script)], port=29613)
    assert [c[c.index("--node-rank") + 1] for c in commands] == ["0", "1"]
    assert all(c[c.index("--master-addr") + 1] == state["hosts"][0]["address"] for c in commands)
    started = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in commands]
    try:
        outputs = [p.communicate(timeout=200)[0] for p in started]
    finally:
        for p in started:
            p.kill()
    assert [p.returncode for p in started] == [0, 0], outputs
    (line,) = [line for line in outputs[0].splitlines() if line.startswith("RESULT")]
    assert line.split()[1:] == ["10.0", "10.0", "h0,h0,h1,h1"], line


# -- the across-node path between hosts: tests/hierarchy_worker.py's scenarios, nodes found by hostname --

WORKER = Path(__file__).with_name("hierarchy_worker.py")
OK_FILES = "HIERARCHY_WORKER_OK_FILES"


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    yield from two_hosts_in(tmp_path_factory.mktemp("across") / "hosts", "10gbit", 9)


def our_shared_memory(state):
    """Our segments (coll-*) left in each host's own /dev/shm (MPICH's files are its own)."""
    return {h["name"]: [name for name in subprocess.run(["nsenter", "-t", str(h["pid"]), "-m", "ls", "/dev/shm"],
                                                       capture_output=True, text=True, check=True).stdout.split()
                        if name.startswith("coll-")]
            for h in state["hosts"]}


def scenario_on_hosts(directory, state, scenario, per_host, tmp_path, *flags, cut_host=None, limit=200):
    """hierarchy_worker.py's `scenario` with `per_host` ranks on each host; the
    ranks that printed OK, and a report. Each rank also writes its OK line (or
    its traceback) to a file: output from a host whose link was cut never
    reaches mpiexec. With `cut_host`, its link is put back once every rank
    wrote, and mpiexec (which waits for that host's proxy) is stopped."""
    written = tmp_path / f"{scenario}-{per_host}"
    written.mkdir()
    ranks = per_host * len(state["hosts"])
    placement = ",".join(f"{h['name']}:{per_host}" for h in state["hosts"])
    command = hosts.mpiexec_command(directory, [*flags, "-genv", OK_FILES, str(written), "-hosts", placement,
                                                "-n", str(ranks), sys.executable, str(WORKER), scenario, "hosts"])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(WORKER.parent), os.environ.get("PYTHONPATH", "")]))
    env.pop("COLLECTIVES_TIMEOUT", None)
    launched = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
    try:
        if cut_host is None:
            output = launched.communicate(timeout=limit)[0]
        else:
            until = time.monotonic() + limit
            while len(list(written.iterdir())) < ranks and time.monotonic() < until:
                time.sleep(0.2)
            subprocess.run(["nsenter", "-t", str(cut_host["pid"]), "-n", "ip", "link", "set", "eth0", "up"],
                           check=True)
            os.killpg(launched.pid, 9)
            output = launched.communicate()[0]
    finally:
        if launched.poll() is None:
            os.killpg(launched.pid, 9)
            launched.wait()
    files = {path.name: path.read_text() for path in written.iterdir()}
    report = f"exit {launched.returncode}\n--- output\n{output[-4000:]}\n--- files\n{files}"
    oks = sorted(line for name, text in files.items() if name.startswith("ok-") for line in text.split("\n") if line)
    assert not [name for name in files if name.startswith("failed-")], report
    return oks, report


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("per_host", [1, 2, 3])
def test_every_collective_across_two_hosts_holds_the_interpreters_bits(two_hosts, tmp_path, per_host):
    """Every collective, dtype and op, in and out of place, between hosts
    whose ranks meet only over their link: nodes found by hostname, no
    pretend nodes; nothing of ours left in either host's /dev/shm."""
    directory, state = two_hosts
    oks, report = scenario_on_hosts(directory, state, "matrix", per_host, tmp_path)
    assert len(oks) == 2 * per_host, report
    assert our_shared_memory(state) == {"h0": [], "h1": []}


@pytest.mark.mpi
@pytest.mark.slow
def test_every_rank_across_two_hosts_holds_the_documented_fold_orders_bits_and_compressed_pieces_too(two_hosts,
                                                                                                     tmp_path):
    """The fold order's bits; then compressed allreduces in pieces, two in
    flight over the link (what the pieces are for): the reference's bits."""
    directory, state = two_hosts
    oks, report = scenario_on_hosts(directory, state, "order,compressed_in_pieces", 2, tmp_path)
    assert oks == sorted(f"OK {scenario} {rank}" for scenario in ("order", "compressed_in_pieces")
                         for rank in range(4)), report


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("scenario, survivors", [("stalled", 4), ("killed_awaited", 3)])
def test_a_rank_that_stalls_or_dies_on_the_other_host_makes_the_others_raise_in_time(two_hosts, tmp_path,
                                                                                      scenario, survivors):
    """The worker asserts each rank's typed error and its time (the timeout
    and 1.5 s; a dead rank's node-mate tells the other host within 1.5 s).
    The rank dies once the others have sent to it: MPICH's UCX netmod can
    crash a rank that sends to a dead rank of another host
    (hierarchy_worker.DEAD_PEER_CRASH)."""
    directory, state = two_hosts
    oks, report = scenario_on_hosts(directory, state, scenario, 2, tmp_path, "-disable-auto-cleanup")
    assert len(oks) == survivors, report
    assert our_shared_memory(state) == {"h0": [], "h1": []}


@pytest.mark.mpi
@pytest.mark.slow
def test_a_cut_link_makes_every_rank_on_either_side_raise_in_time(made, tmp_path):
    """The last rank takes its host's link down (the hosts of `made`, not the
    module's: this one's link goes down): every rank, on both sides, raises
    within the timeout and closes; none crashes sending its abort across."""
    directory, state = made
    oks, report = scenario_on_hosts(directory, state, "link_cut", 2, tmp_path, "-disable-auto-cleanup",
                                    cut_host=state["hosts"][1], limit=60)
    assert len(oks) == 4, report
    assert our_shared_memory(state) == {"h0": [], "h1": []}
