"""The GPU path on emulated devices: plans bound to the caller's arrays, the
executor's ordering between devices, the emulated streams, and the errors.

The collective matrix itself runs on emulated devices in test_collectives.py.
"""

import gc
import threading
import time

import numpy as np
import pytest

import collectives
from collectives import CollectiveError, InvalidUsageError, auto
from collectives.algorithms import REGISTRY
from collectives.algorithms.schedule import COLLECTIVES
from collectives import binding as bindings
from collectives.algorithms import schedule_for
from collectives.algorithms.schedule import SCRATCH, WORK
from collectives.binding import (
    IN_PLACE, IN_PLACE_LOCKSTEP, OUT_OF_PLACE, WORKSPACE, WORKSPACE_APART, WORKSPACE_IN_PLACE,
)
from collectives.devices import emulated, open_device
from collectives.executors import device as device_executor
from collectives.plan import build_plan
from collectives.plan import clear_cache as clear_plans
from cases import keeps_a_workspace_copy

ROOTED = ("broadcast", "reduce")
IMPLEMENTED = pytest.mark.parametrize("collective,algorithm", [
    (collective, name) for collective in COLLECTIVES for name, spec in sorted(REGISTRY.items())
    if collective in spec.collectives])


# -- plans bound to the caller's arrays ---------------------------------------------------

@IMPLEMENTED
@pytest.mark.parametrize("n", range(1, 9))
def test_in_process_plans_copy_nothing_through_a_workspace(collective, algorithm, n):
    """The workspace binding copies every input in and every result out;
    bound plans do not, but for the cases `keeps_a_workspace_copy` lists."""
    count = 1024 * n
    plain = build_plan(collective, algorithm, n, count, np.dtype("float32"), "sum", 0, WORKSPACE)
    for binding in (IN_PLACE, OUT_OF_PLACE):
        bound = build_plan(collective, algorithm, n, count, np.dtype("float32"), "sum", 0, binding)
        if keeps_a_workspace_copy(collective, algorithm, binding, n):
            assert 0 < bound.traffic.workspace_copies <= count * 4 * 2 * n, binding
        else:
            assert bound.traffic.workspace_copies == 0, binding
        # (a result kept in a workspace costs what the workspace plan's direct write does)
        assert bound.traffic.total < plain.traffic.total or n == 1 and binding == IN_PLACE \
            or keeps_a_workspace_copy(collective, algorithm, binding, n) and bound.traffic.total <= plain.traffic.total
    assert plain.traffic.workspace_copies > 0
    # In place through a workspace (ranks in processes) only the copies out
    # of input no step touched go: a broadcast's root's, allgather's own
    # blocks, and for one rank every output; and the copies in that nothing
    # reads then (one rank's: no peer reads its workspace).
    through = build_plan(collective, algorithm, n, count, np.dtype("float32"), "sum", 0, WORKSPACE_IN_PLACE)
    untouched_input_bytes = count * 4 if collective in ("broadcast", "allgather") or n == 1 else 0
    unread_input_bytes = count * 4 if n == 1 else 0
    assert plain.traffic.workspace_copies - through.traffic.workspace_copies \
        == 2 * untouched_input_bytes + 2 * unread_input_bytes


@IMPLEMENTED
@pytest.mark.parametrize("n", range(2, 9))
def test_workspace_plans_write_results_straight_to_the_output(collective, algorithm, n):
    """Ranks in processes: peers still read only workspaces, the caller's
    input only before any step where input and output may overlap in any
    way (WORKSPACE: so any overlap is safe), and a result chunk no one
    reads after its last write goes straight to the output, with no copy
    out: fewer bytes than the plain plan."""
    schedule = schedule_for(algorithm, collective, n, n - 1 if collective in ROOTED else None)
    plain = bindings.logical_phases(schedule)

    def accesses(phases):
        return sum(len(m.srcs) + 1 for phase in phases for m in phase)
    for binding in (WORKSPACE, WORKSPACE_APART, WORKSPACE_IN_PLACE):
        bound = bindings.bind(plain, schedule, binding)
        assert all(src.rank == m.rank or src.buffer in (WORK, SCRATCH) for phase in bound for m in phase
                   for src in m.srcs), binding
        if binding == WORKSPACE:
            assert all(src.buffer != bindings.INPUT for phase in bound[1:] for m in phase for src in m.srcs)
            assert all(m.dst.buffer != bindings.OUTPUT for m in bound[0])
        assert accesses(bound) < accesses(plain), binding
    assert bindings.bind(plain, schedule, WORKSPACE, rewrite_workspace_plans=False) is plain


@IMPLEMENTED
@pytest.mark.parametrize("n", [2, 3, 5])
def test_bound_plans_give_the_plain_plans_bits(collective, algorithm, n):
    """The symbolic proof in binding.py, checked on numbers: random floats
    through the host interpreter with each binding, same bits."""
    rng = np.random.default_rng(n)
    with collectives.Communicator.local(n) as comm:
        count = 7 * n + 3 if collective != "reduce_scatter" else 7 * n
        xs = [rng.standard_normal(count).astype(np.float32) for _ in range(n)]
        call = getattr(comm, collective)
        kwargs = {"algorithm": algorithm} | ({"root": n - 1} if collective in ROOTED else {})
        in_place = call([x.copy() for x in xs], **kwargs)
        size = count // n if collective == "reduce_scatter" else count * n if collective == "allgather" else count
        out_of_place = call([x.copy() for x in xs], out=[np.empty(size, np.float32) for _ in xs], **kwargs)
        # The same call through plain workspace plans, as processes run them:
        plain = build_plan(collective, algorithm, n, count * (n if collective == "allgather" else 1),
                           np.dtype("float32"), "sum", n - 1 if collective in ROOTED else 0, WORKSPACE)
        assert plain.traffic.workspace_copies > 0
        from collectives.communicator import VirtualHostRanks
        ys = [x.copy() for x in xs]
        outs = [np.empty(np.asarray(r).size, np.float32) for r in in_place] if collective == "allgather" else ys
        if collective == "reduce_scatter":
            outs = [np.empty(count // n, np.float32) for _ in xs]
        VirtualHostRanks(n).run(plain, ys, outs, None, None, None)
        expected = outs if collective in ("allgather", "reduce_scatter") else ys
        # In place through a workspace, as processes run x = out.
        through = build_plan(collective, algorithm, n, count * (n if collective == "allgather" else 1),
                             np.dtype("float32"), "sum", n - 1 if collective in ROOTED else 0, WORKSPACE_IN_PLACE)
        if collective == "allgather":   # x is the rank's own block of out
            outs_through = [np.zeros(count * n, np.float32) for _ in xs]
            for r, out in enumerate(outs_through):
                out[r * count:(r + 1) * count] = xs[r]
            ins_through = [out[r * count:(r + 1) * count] for r, out in enumerate(outs_through)]
        else:
            ins_through = [x.copy() for x in xs]
            outs_through = [x[r * (count // n):(r + 1) * (count // n)] for r, x in enumerate(ins_through)] \
                if collective == "reduce_scatter" else ins_through
        VirtualHostRanks(n).run(through, ins_through, outs_through, None, None, None)
        # Out of place through a workspace, as processes run separate arrays.
        apart = build_plan(collective, algorithm, n, count * (n if collective == "allgather" else 1),
                           np.dtype("float32"), "sum", n - 1 if collective in ROOTED else 0, WORKSPACE_APART)
        outs_apart = [np.full(np.asarray(o).size, np.nan, np.float32) for o in out_of_place]
        VirtualHostRanks(n).run(apart, [x.copy() for x in xs], outs_apart, None, None, None)
        for r in range(n):
            want = expected[r].reshape(-1).view(np.uint32)
            got = np.asarray(in_place[r]).reshape(-1)
            assert np.array_equal(got.view(np.uint32), want), r
            if collective == "reduce" and r != n - 1:   # out of place, the other ranks' out are not written
                continue
            assert np.array_equal(out_of_place[r].view(np.uint32), want), r
            assert np.array_equal(outs_through[r].view(np.uint32), want), r
            assert np.array_equal(outs_apart[r].view(np.uint32), want), r


def test_overlapping_input_and_output_fall_back_to_the_workspace():
    """An output that overlaps its input in any other way than chunk for
    chunk gets the plain plan, which reads all inputs before writing."""
    with collectives.Communicator.local(2, devices="emulated") as comm:
        buffers = [np.arange(12, dtype=np.int32) + 100 * r for r in range(2)]
        xs = [b[:8] for b in buffers]
        outs = [b[4:12] for b in buffers]  # shifted by 4 elements
        want = xs[0] + xs[1]
        comm.allreduce(xs, out=outs)
        assert all(np.array_equal(o, want) for o in outs)
        assert comm._last_checked[1] == WORKSPACE


# -- the executor's ordering between devices ---------------------------------------------

def test_the_emulated_streams_catch_a_missing_wait(monkeypatch):
    """Ranks on four emulated devices: correct with the executor's waits;
    with every cross-device wait dropped, the random drain order runs a
    device's phase before the one it reads from, and results go wrong."""
    def run(seeds):
        wrong = 0
        for seed in seeds:
            monkeypatch.setattr(emulated._ENGINE, "random", np.random.default_rng(seed))
            with collectives.Communicator.local(4, devices=[f"emulated:{r}" for r in range(4)]) as comm:
                xs = [np.full(4096, r + 1, np.int32) for r in range(4)]
                comm.allreduce(xs, algorithm="ring")
                wrong += sum(not (x == 10).all() for x in xs)
        return wrong

    assert run(range(8)) == 0
    order = device_executor.DeviceRanks._order

    def without_waits(self, plan, launches):
        steps, recorded = order(self, plan, launches)
        return [s for s in steps if s[0] is not device_executor.WAIT], recorded

    monkeypatch.setattr(device_executor.DeviceRanks, "_order", without_waits)
    assert run(range(8)) > 0


def test_ranks_on_one_device_need_no_events():
    with collectives.Communicator.local(4, devices="emulated") as comm:
        comm.allreduce([np.ones(100, np.float32) for _ in range(4)], algorithm="ring")
        (program,) = comm._ranks._programs.values()
        assert {step[0] for step in program.steps} == {device_executor.LAUNCH}
        assert program.launches == (6,)  # the 2(n-1) steps of ring, one launch each; no copies in or out


def test_emulated_stream_semantics():
    device = open_device("emulated:7")
    a, b = device.new_stream(), device.new_stream()
    event, log = device.new_event(), []
    # A wait holds its stream until the work recorded before the event ran.
    b.queue.append(("launch", log.append, "b waits for nothing"))
    device.wait(a, event)  # never recorded: no wait, as in CUDA
    a.queue.append(("launch", log.append, "a first"))
    device.record(event, a)
    device.wait(b, event)
    b.queue.append(("launch", log.append, "b after a"))
    device.synchronize()
    assert log.index("a first") < log.index("b after a")
    # A wait for a record that never comes is a deadlock, reported, not hung.
    late = device.new_event()
    device.record(late, b)
    b.queue.appendleft(("wait", lambda *_: None, late, 1))
    with pytest.raises(CollectiveError, match="deadlocked"):
        device.synchronize()
    assert not a.queue and not b.queue


def test_emulated_kernels_that_wait_for_each_other_run_at_once():
    """SPIN operations (kernels that wait for other kernels' writes) of two
    streams run concurrently, as on two GPUs; what follows one on its stream
    runs after it; an error in one is raised by the drain, after the other ended."""
    a_device, b_device = open_device("emulated:5"), open_device("emulated:6")
    a, b = a_device.new_stream(), b_device.new_stream()
    flags, log = {"a": threading.Event(), "b": threading.Event()}, []

    def handshake(mine, theirs):
        flags[mine].set()
        if not flags[theirs].wait(timeout=10):
            raise AssertionError(f"{mine} never saw {theirs}: the kernels did not run at once")
        log.append(mine)

    a.queue.append((emulated.SPIN, handshake, "a", "b"))
    b.queue.append((emulated.SPIN, handshake, "b", "a"))
    b.queue.append((emulated.LAUNCH, log.append, "after b"))
    a_device.synchronize()
    assert sorted(log) == ["a", "after b", "b"] and log.index("after b") > log.index("b")

    # A stream freed by a kernel that ended is looked at again before the
    # one-stream shortcut runs another stream's waiting kernel on the draining thread.
    for seed in range(8):
        emulated._ENGINE.random.seed(seed)   # noqa: SLF001
        flag = threading.Event()
        a.queue.extend([(emulated.SPIN, lambda: None), (emulated.SPIN, flag.set)])
        b.queue.extend([(emulated.LAUNCH, time.sleep, 0.05), (emulated.SPIN, lambda: flag.wait(timeout=10) or log.append("late"))])
        began = time.perf_counter()
        a_device.synchronize()
        assert "late" not in log and time.perf_counter() - began < 5, seed

    def fails():
        raise ValueError("a kernel failed")

    a.queue.append((emulated.SPIN, fails))
    b.queue.append((emulated.SPIN, time.sleep, 0.2))
    b.queue.append((emulated.LAUNCH, log.append, "never"))
    with pytest.raises(ValueError, match="a kernel failed"):
        a_device.synchronize()
    assert "never" not in log and not a.queue and not b.queue


# -- bad input ---------------------------------------------------------------------------

def test_device_specs_are_checked():
    for bad in ("gpu", "cuda:x", -1, True, "emulated:-2", 1.5):
        with pytest.raises(InvalidUsageError, match="device"):
            collectives.Communicator.local(1, devices=[bad])
    with pytest.raises(InvalidUsageError, match="names 3 devices for 2 ranks"):
        collectives.Communicator.local(2, devices=["emulated"] * 3)


def test_a_gpu_communicator_without_a_gpu_says_so():
    with pytest.raises(CollectiveError, match="cuda:0"):
        collectives.Communicator.local(2, devices=[0, 0])


def test_emulated_ranks_refuse_what_is_not_in_host_memory():
    class OnTheGpu:  # what a GPU array looks like from here, without touching a GPU
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (1 << 40, False), "version": 3}

    with collectives.Communicator.local(2, devices="emulated") as comm:
        x = np.ones(4, np.float32)
        with pytest.raises(InvalidUsageError):
            comm.allreduce([x, OnTheGpu()])
        assert (x == 1).all()


def test_too_many_ranks_for_the_buffer_table():
    with pytest.raises(InvalidUsageError, match="at most 64"):
        collectives.Communicator.local(65, devices="emulated")


# -- one rank per process: init(device=...) ---------------------------------------------
# Several processes are tested under mpiexec in test_mpi.py; without a
# launcher, init makes a communicator of one rank on the device.

def test_init_on_an_emulated_device_without_a_launcher():
    with collectives.init(device="emulated") as comm:
        assert comm.size == 1 and comm.rank == 0
        x = np.arange(10, dtype=np.float32)
        assert np.array_equal(comm.allreduce(x.copy(), op="avg"), x)
        assert np.array_equal(comm.allgather(x), x)


def test_init_checks_the_device_before_anything_else():
    for bad in ("gpu", "cuda:x", -1, True, 1.5):
        with pytest.raises(InvalidUsageError, match="device"):
            collectives.init(device=bad)


def test_init_on_cuda_without_a_gpu_says_so():
    from backends import gpu_unavailable_reason
    if not gpu_unavailable_reason():
        pytest.skip("this machine has a GPU; the test is of a machine without one")
    with pytest.raises(CollectiveError, match="needs a GPU"):
        collectives.init(device="cuda")


def test_a_host_communicator_tells_how_to_make_a_gpu_one():
    class OnTheGpu:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (1 << 40, False), "version": 3}

    with collectives.init() as comm:
        with pytest.raises(InvalidUsageError, match=r"init\(device='cuda'\)"):
            comm.allreduce(OnTheGpu())


def test_auto_on_one_device_prices_bound_plans_with_fan_out():
    """Out of place, direct is one launch reading every input once. In place
    it needs a copy phase (IN_PLACE), so auto would pick a plan that moves
    less; but ranks on one device run in place in lockstep
    (IN_PLACE_LOCKSTEP), and there direct is one launch at the floor again."""
    costs = auto.bound_plan_costs("allreduce", 4, 0, IN_PLACE)
    out_of_place = auto.bound_plan_costs("allreduce", 4, 0, OUT_OF_PLACE)
    lockstep = auto.bound_plan_costs("allreduce", 4, 0, IN_PLACE_LOCKSTEP)
    assert out_of_place["direct"] == lockstep["direct"] == (1, 2 * 4)   # one launch, n reads and n writes
    for nbytes in (4, 1 << 20, 256 << 20):
        for binding in (OUT_OF_PLACE, IN_PLACE_LOCKSTEP):
            assert auto.one_device_choice("allreduce", 4, nbytes, 0, binding, "gpu-in-process") == "direct"
        picked = auto.one_device_choice("allreduce", 4, nbytes, 0, IN_PLACE, "gpu-in-process")
        assert costs[picked][1] < costs["direct"][1], (nbytes, picked, costs)


def test_direct_allreduce_in_place_on_one_device_is_one_lockstep_launch(monkeypatch):
    """In place, every rank's x is read by all and overwritten by its owner
    in the same phase: safe only because the group of rows runs in lockstep
    (plan_step.cu reads every source at an element before writing there).
    The results are the host's bits; and the same plan run row by row, as
    an executor without groups would, is not."""
    rng = np.random.default_rng(5)
    inputs = [(rng.standard_normal(1003) * 100).astype(np.float32) for _ in range(4)]
    want = collectives.Communicator.local(4).allreduce([x.copy() for x in inputs], algorithm="direct")

    def run():
        launches = []
        device = open_device("emulated:0")
        original = device.launch_step
        monkeypatch.setattr(device, "launch_step", lambda *a, **k: (launches.append(1), original(*a, **k)))
        with collectives.Communicator.local(4, devices=["emulated:0"] * 4) as comm:
            for _ in range(3):   # bound at the first repeat
                launches.clear()
                got = comm.allreduce([x.copy() for x in inputs], algorithm="direct")
            comm.synchronize()
            assert comm.chosen_algorithm("allreduce", 1003 * 4, in_place=True) == "direct"
        return got, launches

    got, launches = run()
    assert launches == [1]
    assert all(np.array_equal(g.view(np.uint32), w.view(np.uint32)) for g, w in zip(got, want))
    # Row by row, the plan is wrong: the executor refuses to run it so ...
    monkeypatch.setattr(device_executor, "fan_out", lambda rows: (rows, 1))
    with pytest.raises(AssertionError, match="fan-out groups"):
        run()
    # ... and where it did not know to refuse, the bits would be wrong.
    from collectives import binding
    clear_plans()
    monkeypatch.setattr(binding, "lockstep_phases", lambda phases, schedule: frozenset())
    got, launches = run()
    clear_plans()
    assert launches == [1]   # one launch of 4 rows, each its own group
    assert not all(np.array_equal(g.view(np.uint32), w.view(np.uint32)) for g, w in zip(got, want))


@pytest.mark.parametrize("in_place", [False, True])
def test_an_auto_allreduce_on_one_device_runs_the_priced_plan(monkeypatch, in_place):
    device = open_device("emulated:0")
    launches = []
    original = device.launch_step
    monkeypatch.setattr(device, "launch_step", lambda *a, **k: (launches.append(a[7] if len(a) > 7 else 1),
                                                                  original(*a, **k)))
    with collectives.Communicator.local(4, devices=["emulated:0"] * 4) as comm:
        xs = [np.full(1000, r + 1, np.float32) for r in range(4)]
        outs = None if in_place else [np.empty_like(x) for x in xs]
        results = comm.allreduce(xs, out=outs)
        comm.synchronize()
    assert all(np.array_equal(r, np.full(1000, 10, np.float32)) for r in results)
    assert launches == [4]   # direct: one fan-out group of every rank's row (in place: in lockstep)


def test_chosen_algorithm_names_what_an_in_place_or_out_of_place_call_runs():
    with collectives.Communicator.local(4, devices=["emulated:0"] * 4) as comm:
        assert comm.chosen_algorithm("allreduce", 64 << 20) == "direct"
        assert comm.chosen_algorithm("allreduce", 64 << 20, in_place=True) == "direct"
    with collectives.Communicator.local(4) as host:   # virtual host ranks: binding changes nothing
        assert host.chosen_algorithm("allreduce", 1 << 20) == host.chosen_algorithm("allreduce", 1 << 20, in_place=True)


# -- repeated calls on device ranks: the bound program (executors/device.py BoundProgram) ----------


@pytest.mark.parametrize("devices", [["emulated:0"] * 4, ["emulated:0", "emulated:1"] * 2])
@pytest.mark.parametrize("algorithm", ["auto", "ring"])
def test_a_repeated_call_on_device_ranks_uses_the_arrays_it_is_given(devices, algorithm):
    """Once a call repeats, its launches are bound to its arrays' addresses.
    Each later call with other arrays (a new list, the same list with an
    array replaced, a view of other memory, in place after out of place)
    must launch with its own, and leave the arrays it was not given alone."""
    with collectives.Communicator.local(4, devices=devices) as comm:
        xs = [np.full(256, r + 1, np.float32) for r in range(4)]
        outs = [np.zeros(256, np.float32) for _ in range(4)]
        for _ in range(3):
            comm.allreduce(xs, out=outs, algorithm=algorithm)
            assert all((o == 10).all() for o in outs)
        others = [np.zeros(256, np.float32) for _ in range(4)]
        for _ in range(3):   # two repeated calls in turn: each repeat's addresses differ from the last call's
            for target in (outs, others):
                for o in target:
                    o[...] = 0
                result = comm.allreduce(xs, out=target, algorithm=algorithm)
                assert all(r is o for r, o in zip(result, target)) and all((o == 10).all() for o in target)
        outs[0][...] = -1   # left alone by the repeat below, which writes the same list's new array
        outs_before = outs[0]
        outs[0] = np.zeros(256, np.float32)
        xs[3] = np.full(256, 100, np.float32)
        for _ in range(2):
            comm.allreduce(xs, out=outs, algorithm=algorithm)
            assert all((o == 106).all() for o in outs)
        assert (outs_before == -1).all()
        bases = [np.full(512, r + 1, np.float32) for r in range(4)]
        views = [b[256:] for b in bases]   # other memory, an offset into it
        for _ in range(2):
            comm.allreduce(views, out=outs, algorithm=algorithm)
            assert all((o == 10).all() for o in outs) and all((b[:256] == r + 1).all() for r, b in enumerate(bases))
        comm.allreduce(xs, algorithm=algorithm)
        assert all((x == 106).all() for x in xs) and all((o == 10).all() for o in outs)


@pytest.mark.slow
def test_arrays_made_anew_at_the_ids_of_gone_ones_on_device_ranks():
    """Arrays made anew each step often get the ids of the last step's.
    A remembered call is forgotten when one of its arrays goes, so a new
    array at an old id takes the full path and the launches use its memory,
    not the memory of the array that had the id. (The old arrays are views
    of bases kept alive: were a stale call reused, it would write there.)"""
    with collectives.Communicator.local(4, devices=["emulated:0"] * 4) as comm:
        kept_bases, previous_ids, reused = [], set(), 0
        for step in range(20):
            bases = [np.zeros(64, np.float32) for _ in range(8)]
            kept_bases.append(bases)
            xs, outs = [b[:32] for b in bases[:4]], [b[32:] for b in bases[4:]]
            for r, x in enumerate(xs):
                x[...] = r + step
            for _ in range(2):   # the second call is a repeat
                comm.allreduce(xs, out=outs)
                assert all((o == 6 + 4 * step).all() for o in outs), step
            ids = set(map(id, xs + outs))
            reused += bool(ids & previous_ids)
            previous_ids = ids
            del xs, outs
            gc.collect()
            assert all(r() is not None for c in comm._calls.values() for r in c.refs), "a call of gone arrays"
        assert reused, "no id was reused: the case this test is about did not arise"
