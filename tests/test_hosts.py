"""bench.hosts: hosts made of namespaces on this machine, for runs across a
real network link. Needs root and iproute2; skipped, saying why,
elsewhere. Each test makes its hosts under tmp_path and removes them."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench import hosts

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
    reason = hosts.why_not()
    if reason:
        pytest.skip(f"cannot make hosts here: {reason}")
    directory = tmp_path / "hosts"
    state = hosts.up(2, directory, link="1gbit", subnet="10.99.7")
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
    assert rows == [["0", "h0", "hosts-test-0", "10.99.7.11"], ["1", "h1", "hosts-test-1", "10.99.7.10"]], done.stdout
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
    pytest.importorskip("torch", reason="needs PyTorch for Gloo: pip install torch")
    bridges = set(subprocess.run(["ip", "-o", "link", "show", "type", "bridge"], capture_output=True,
                                 text=True, check=True).stdout.split())
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
    left = set(subprocess.run(["ip", "-o", "link", "show", "type", "bridge"], capture_output=True,
                              text=True, check=True).stdout.split())
    assert not {w for w in left - bridges if w.startswith("clbr")}, left - bridges


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
    pytest.importorskip("torch", reason="needs PyTorch: pip install torch")
    directory, _ = made
    script = tmp_path / "probe.py"
    script.write_text(TORCH_PROBE)
    commands = hosts.torchrun_commands(directory, 2, [str(script)], port=29613)
    assert [c[c.index("--node-rank") + 1] for c in commands] == ["0", "1"]
    assert all(c[c.index("--master-addr") + 1] == "10.99.7.10" for c in commands)
    started = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in commands]
    try:
        outputs = [p.communicate(timeout=200)[0] for p in started]
    finally:
        for p in started:
            p.kill()
    assert [p.returncode for p in started] == [0, 0], outputs
    (line,) = [line for line in outputs[0].splitlines() if line.startswith("RESULT")]
    assert line.split()[1:] == ["10.0", "10.0", "h0,h0,h1,h1"], line
