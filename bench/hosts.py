"""Hosts on one machine: H network hosts that share nothing but the kernel.

    python -m bench.hosts up H --dir DIR [--link 10gbit] [--subnet 10.99.0]
    python -m bench.hosts mpiexec --dir DIR -- [mpiexec args] program...
    python -m bench.hosts exec --dir DIR HOST command...
    python -m bench.hosts link --dir DIR       # what one TCP stream carries from h0 to h1
    python -m bench.hosts torchrun --dir DIR [--nproc-per-node P] -- program.py args...
    python -m bench.hosts down --dir DIR

`up` makes H hosts h0..h{H-1}, each a process (PID 1 of its own PID
namespace) with its own network, UTS, IPC, PID and mount namespaces: its
hostname, a private /dev/shm (tmpfs), an /etc/hosts naming every host, and
one link, eth0, a veth to a bridge of its own, at SUBNET.10+i/24, its
egress shaped by `tc ... tbf` to --link. Two ranks on different hosts can
then meet only over that link: without the PID and IPC namespaces MPICH
(its UCX netmod) reached the other "host" through cross-memory attach and
SysV shared memory, and the link's shaping never applied.

Everything `up` makes is named in DIR/state.json, and `down` removes it all
(the hosts' processes, which takes their network namespaces and veths with
them, and the bridge), also after a rank or a host died. Nothing is written
outside DIR: no /run/netns entries (the namespaces live as long as their
PID 1), no change to the machine's /etc/hosts.

`torchrun` starts torchrun on every host at once, as on H machines:
`--nnodes H --node-rank i --nproc-per-node P`, its static rendezvous at
h0's address (`--master-addr`, a free port), and waits for all of them;
its exit code is the worst of theirs.

`mpiexec` runs MPICH's mpiexec (beside this Python) on the machine, as on a
login node, with `-launcher ssh -launcher-exec DIR/launch -localhost
SUBNET.1` (the bridge's address): hydra "sshes" to each host through that
script, which enters the host's namespaces with nsenter, and each host's
proxy connects back over the bridge. No rank runs outside the hosts. Run
under it, `-hosts h0:2,h1:2` puts ranks 0,1 on h0 and 2,3 on h1, as on two
machines. Needs root and iproute2; `python -m bench.hosts check` says why
hosts cannot be made here.
"""

import argparse
import itertools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STATE = "state.json"
_SETS = itertools.count()   # host sets made by this process


def _run(*argv, check=True):
    return subprocess.run(argv, check=check, capture_output=True, text=True)


def _in_host(pid, *argv, check=True):
    """argv in host `pid`'s network namespace (iproute2, tc)."""
    return _run("nsenter", "-t", str(pid), "-n", *argv, check=check)


def why_not():
    """Why hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "making namespaces needs root"
    missing = [tool for tool in ("ip", "tc", "unshare", "nsenter") if shutil.which(tool) is None]
    if missing:
        return f"missing {', '.join(missing)} (iproute2, util-linux)"
    return None


def link_bits_per_second(rate):
    """tc's words for a rate (10gbit, 1gbit, 100mbit) in bits per second; ValueError if they are not."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1}
    for unit, scale in units.items():
        if rate.endswith(unit):
            try:
                value = float(rate[:-len(unit)]) * scale
            except ValueError:
                break
            if value > 0:
                return value
    raise ValueError(f"--link: a rate such as 10gbit, 1gbit, 100mbit (got {rate!r})")


def _burst(rate):
    """tbf's bucket: at least one timer tick of the rate (HZ 250 assumed, twice), at least 64 KiB."""
    try:
        bits_per_second = link_bits_per_second(rate)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    return max(64 << 10, int(bits_per_second / 8 / 250 * 2))


def up(count, directory, link="10gbit", subnet="10.99.0", cpus=None):
    reason = why_not()
    if reason:
        raise SystemExit(f"cannot make hosts: {reason}")
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / STATE).exists():
        raise SystemExit(f"{directory / STATE} exists: `down` those hosts first")
    # names unique on the machine (interface names <= 15 chars), also for several sets of one process
    tag = f"{os.getpid() % 10000:04d}{next(_SETS) % 10}"
    if cpus is not None and len(cpus) != count:
        raise SystemExit(f"--cpus: one CPU list per host, '/'-separated ({count} hosts, got {len(cpus)})")
    taken = _run("ip", "-o", "-4", "addr", "show").stdout
    if f" {subnet}." in taken:   # a second bridge on the same /24 would take half of the hosts' traffic
        raise SystemExit(f"the subnet {subnet}.0/24 is in use on this machine (other hosts? `down` them, "
                         "or pass another --subnet)")
    state = {"bridge": f"clbr{tag}", "link": link, "hosts": [], "dir": str(directory), "cpus": cpus}
    names = [f"h{i}" for i in range(count)]
    addresses = [f"{subnet}.{10 + i}" for i in range(count)]
    (directory / "hosts").write_text("127.0.0.1 localhost\n" + "".join(
        f"{address} {name}\n" for name, address in zip(names, addresses)))
    _save(directory, state)   # first, so that `down` finds whatever exists if the rest fails
    try:
        _run("ip", "link", "add", state["bridge"], "type", "bridge")
        # The machine itself is on the hosts' network as SUBNET.1, where mpiexec runs (a host's
        # /proc shows only its own processes, so a launcher run inside one could not enter another)
        # and its proxies connect back to (mpiexec -localhost).
        _run("ip", "addr", "add", f"{subnet}.1/24", "dev", state["bridge"])
        _run("ip", "link", "set", state["bridge"], "up")
        state["launching_address"] = f"{subnet}.1"
        for i, (name, address) in enumerate(zip(names, addresses)):
            pid = _start_host(name, directory)
            veth = f"clv{tag}h{i}"
            state["hosts"].append({"name": name, "pid": pid, "address": address, "veth": veth})
            _save(directory, state)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", str(pid))
            _run("ip", "link", "set", veth, "master", state["bridge"], "up")
            _in_host(pid, "ip", "link", "set", "lo", "up")
            _in_host(pid, "ip", "addr", "add", f"{address}/24", "dev", "eth0")
            _in_host(pid, "ip", "link", "set", "eth0", "up")
            _in_host(pid, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", link,
                     "burst", str(_burst(link)), "latency", "50ms")
        _write_launcher(directory, state)
    except BaseException:
        down(directory)
        raise
    return state


def _start_host(name, directory):
    """A host's PID 1: sets its hostname, /dev/shm and /etc/hosts in its own
    namespaces, then sleeps until `down` kills it (which ends every process
    of its PID namespace, and with the last, its network namespace)."""
    setup = (f"hostname {name} && mount -t tmpfs tmpfs /dev/shm && "
             f"mount --bind {shlex.quote(str(directory / 'hosts'))} /etc/hosts && "
             f"touch {shlex.quote(str(directory / (name + '.ready')))} && exec sleep infinity")
    holder = subprocess.Popen(["unshare", "--net", "--uts", "--ipc", "--mount", "--pid", "--fork", "--mount-proc",
                               "--propagation", "private", "--kill-child", "sh", "-c", setup],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=(directory / f"{name}.log").open("w"), start_new_session=True)
    ready = directory / f"{name}.ready"
    until = time.monotonic() + 10
    while not ready.exists():
        if holder.poll() is not None or time.monotonic() > until:
            raise RuntimeError(f"host {name} did not start (unshare exited {holder.poll()}): "
                               f"{(directory / (name + '.log')).read_text().strip()}")
        time.sleep(0.01)
    ready.unlink()
    children = Path(f"/proc/{holder.pid}/task/{holder.pid}/children").read_text().split()
    return int(children[0])   # the forked child: PID 1 inside, this number outside


def _write_launcher(directory, state):
    """DIR/launch: hydra's ssh launcher calls it as `launch [ssh options] HOST COMMAND...`."""
    cpus = state.get("cpus") or [None] * len(state["hosts"])
    cases = "".join(f"    {h['name']}) pid={h['pid']}; cpus={c or ''} ;;\n" for h, c in zip(state["hosts"], cpus))
    script = f"""#!/bin/sh
# hydra's -launcher ssh -launcher-exec: [ssh options] HOST COMMAND... run inside HOST's namespaces
while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
host=$1; shift
case "$host" in
{cases}    *) echo "launch: no host $host" >&2; exit 255 ;;
esac
[ -n "$cpus" ] && exec nsenter -t "$pid" -a taskset -c "$cpus" sh -c "$*"
exec nsenter -t "$pid" -a sh -c "$*"
"""
    launcher = directory / "launch"
    launcher.write_text(script)
    launcher.chmod(0o755)


def down(directory):
    directory = Path(directory).resolve()
    path = directory / STATE
    if not path.exists():
        return
    state = json.loads(path.read_text())
    for host in state["hosts"]:
        try:
            os.kill(host["pid"], signal.SIGKILL)   # PID 1 of its namespace: every process in it goes too
        except ProcessLookupError:
            pass
    until = time.monotonic() + 10
    while any(Path(f"/proc/{h['pid']}").exists() for h in state["hosts"]) and time.monotonic() < until:
        time.sleep(0.02)
    for host in state["hosts"]:   # gone with the namespace; deleted in case it was not
        _run("ip", "link", "del", host["veth"], check=False)
    _run("ip", "link", "del", state["bridge"], check=False)
    made = [f"h{i}.{what}" for i in range(len(state["hosts"]) + 1) for what in ("ready", "log")]
    for name in (STATE, "hosts", "launch", *made):
        (directory / name).unlink(missing_ok=True)
    try:
        directory.rmdir()   # only where it is now empty: never what someone else put there
    except OSError:
        pass


def _save(directory, state):
    (directory / STATE).write_text(json.dumps(state, indent=1))


def _state(directory):
    path = Path(directory).resolve() / STATE
    if not path.exists():
        raise SystemExit(f"no hosts in {path.parent} (python -m bench.hosts up H --dir {directory})")
    return json.loads(path.read_text())


class Hosts:
    """`with Hosts(count, link) as state:` hosts made in a temporary
    directory of their own, removed on the way out, whatever happened."""

    def __init__(self, count, link="10gbit", subnet="10.99.0"):
        self.count, self.link, self.subnet = count, link, subnet
        self.directory = None

    def __enter__(self):
        self.directory = tempfile.mkdtemp(prefix="collectives-hosts-")
        try:
            return up(self.count, self.directory, self.link, self.subnet)
        except BaseException:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise

    def __exit__(self, *exc):
        down(self.directory)
        shutil.rmtree(self.directory, ignore_errors=True)
        return False


# The link's rate, as an application sees it: one TCP stream from host 0 to
# host 1 for a second, its bytes over the time from the first byte to the last,
# at the receiver (tbf lets a burst through at once: a second outweighs it).
_SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); got = 0; first = last = None
while True:
    data = c.recv(1 << 20)
    if not data:
        break
    last = time.perf_counter(); first = first or last; got += len(data)
print(got, last - first, flush=True)
"""
_SOURCE = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); block = bytes(1 << 20)
until = time.perf_counter() + float(sys.argv[3])
while time.perf_counter() < until:
    c.sendall(block)
c.close()
"""


def measure_link(directory, seconds=1.0, source=0, sink=1):
    """Bytes per second one TCP stream carries from host `source` to host `sink`."""
    hosts = _state(directory)["hosts"]
    src, dst = hosts[source], hosts[sink]
    enter = ["nsenter", "-a", "-t"]
    receiver = subprocess.Popen([*enter, str(dst["pid"]), sys.executable, "-c", _SINK, dst["address"]],
                                stdout=subprocess.PIPE, text=True)
    try:
        port = receiver.stdout.readline().strip()
        _run(*enter, str(src["pid"]), sys.executable, "-c", _SOURCE, dst["address"], port, str(seconds))
        got, elapsed = receiver.stdout.readline().split()
        receiver.wait(timeout=10)
    finally:
        if receiver.poll() is None:
            receiver.kill()
    return int(got) / float(elapsed)


def torchrun_commands(directory, nproc_per_node, program, port=29512):
    """One command per host: torchrun there, node i of H, rendezvous at h0."""
    state = _state(directory)
    count = len(state["hosts"])
    return [["nsenter", "-t", str(h["pid"]), "-a", "--wd=" + os.getcwd(), sys.executable, "-m",
             "torch.distributed.run", "--nnodes", str(count), "--node-rank", str(i),
             "--nproc-per-node", str(nproc_per_node), "--master-addr", state["hosts"][0]["address"],
             "--master-port", str(port), *program]
            for i, h in enumerate(state["hosts"])]


def torchrun(directory, nproc_per_node, program, port=29512):
    """Run torchrun on every host (torchrun_commands); the worst exit code."""
    codes, _ = run_together(torchrun_commands(directory, nproc_per_node, program, port))
    return max(codes, key=abs)


def run_together(commands, timeout=None, **popen):
    """Start `commands` at once (one job's launchers, one per host) and wait
    for every one, killing those still running if the wait fails (a
    timeout, Ctrl-C); their exit codes and outputs (None where not piped)."""
    started = [subprocess.Popen(command, **popen) for command in commands]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in started]
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
    return [p.returncode for p in started], outputs


def mpiexec_command(directory, args):
    """MPICH's mpiexec on the machine, launching through DIR/launch; its
    proxies (one per host) connect back to the bridge's address."""
    state = _state(directory)
    mpiexec = Path(sys.executable).with_name("mpiexec")
    return [str(mpiexec), "-launcher", "ssh", "-launcher-exec", str(Path(state["dir"]) / "launch"),
            "-localhost", state["launching_address"], *args]


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.hosts", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    sub = p.add_subparsers(dest="what", required=True)
    u = sub.add_parser("up", help="make H hosts")
    u.add_argument("count", type=int)
    u.add_argument("--link", default="10gbit", help="each host's egress rate (tc tbf): 10gbit, 1gbit, ...")
    u.add_argument("--subnet", default="10.99.0", help="the hosts' /24: host i is SUBNET.(10+i)")
    u.add_argument("--cpus", default=None,
                   help="each host's own CPUs, '/'-separated, taskset's syntax (0/1: h0 on CPU 0, h1 on CPU 1); "
                        "default: every host shares all of the machine's")
    for name in ("down", "mpiexec", "exec", "check", "link", "torchrun"):
        sub.add_parser(name)
    for s in sub.choices.values():
        s.add_argument("--dir", required=s.prog.split()[-1] != "check",
                       help="where the hosts' state, /etc/hosts and launcher are kept (nothing is written elsewhere)")
    sub.choices["mpiexec"].add_argument("rest", nargs=argparse.REMAINDER, help="mpiexec's arguments")
    sub.choices["torchrun"].add_argument("--nproc-per-node", type=int, default=1, help="ranks on each host")
    sub.choices["torchrun"].add_argument("--port", type=int, default=29512, help="the rendezvous port on h0")
    sub.choices["torchrun"].add_argument("rest", nargs=argparse.REMAINDER, help="the program and its arguments")
    sub.choices["exec"].add_argument("host")
    sub.choices["exec"].add_argument("rest", nargs=argparse.REMAINDER, help="the command")
    args = p.parse_args(argv)
    if args.what == "check":
        print(why_not() or "hosts can be made here")
        return 0
    if args.what == "up":
        if args.count < 1:
            p.error("H: at least 1")
        state = up(args.count, args.dir, args.link, args.subnet, None if args.cpus is None else args.cpus.split("/"))
        hosts = ",".join(f"{h['name']}:2" for h in state["hosts"])
        print(f"# {args.count} hosts ({', '.join(h['name'] + ' ' + h['address'] for h in state['hosts'])}), "
              f"each link {args.link}; launch with:\n"
              f"python -m bench.hosts mpiexec --dir {args.dir} -- -hosts {hosts} {sys.executable} program.py\n"
              f"# remove them with: python -m bench.hosts down --dir {args.dir}")
        return 0
    if args.what == "down":
        down(args.dir)
        return 0
    if args.what == "link":
        rate = measure_link(args.dir)
        print(f"h0 -> h1: {rate * 8 / 1e9:.2f} Gbit/s ({rate / 1e6:.0f} MB/s), one TCP stream for 1 s")
        return 0
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    if args.what == "mpiexec":
        return subprocess.call(mpiexec_command(args.dir, rest))
    if args.what == "torchrun":
        return torchrun(args.dir, args.nproc_per_node, rest, args.port)
    host = next((h for h in _state(args.dir)["hosts"] if h["name"] == args.host), None)
    if host is None:
        raise SystemExit(f"no host {args.host}")
    return subprocess.call(["nsenter", "-t", str(host["pid"]), "-a", "--wd=" + os.getcwd(), *rest])


if __name__ == "__main__":
    sys.exit(main())
