"""send, recv, isend, irecv in one process: a rank messaging itself, and
what is refused before anything is sent. Between processes:
tests/test_mpi.py (mpi_worker.py's point_to_point scenarios)."""

import numpy as np
import pytest

import collectives
from collectives import CollectiveTimeoutError, InvalidUsageError


@pytest.fixture
def comm():
    with collectives.Communicator.local(1, timeout=0.2) as one:
        yield one


def test_a_rank_receives_its_own_messages_by_tag_in_the_order_sent(comm):
    for tag, value in ((2, 20), (1, 10), (2, 21)):
        comm.send(np.full(3, value, np.int16), 0, tag=tag)
    got = []
    for tag in (2, 1, 2):
        out = np.empty(3, np.int16)
        assert comm.recv(out, 0, tag=tag) == 0
        got.append(int(out[0]))
    assert got == [20, 10, 21]
    request = comm.irecv(np.empty(0, np.float32), None, tag=5)   # empty, from any rank: itself
    assert not request.test()
    comm.isend(np.empty(0, np.float32), 0, tag=5).wait()
    assert request.wait() == 0 and request.source == 0


def test_a_receive_nobody_sends_to_times_out(comm):
    with pytest.raises(CollectiveTimeoutError, match="recv of 8 bytes"):
        comm.recv(np.empty(2, np.float32), 0)


@pytest.mark.parametrize("call, message", [
    (lambda c: c.send(np.zeros(2), 1), "peer: 1 is out of range"),
    (lambda c: c.send(np.zeros(2), True), "peer: expected a rank number"),
    (lambda c: c.send(np.zeros(2), 0, tag=-1), "tag: -1 is out of range"),
    (lambda c: c.send(np.zeros(2), 0, tag="a"), "tag: expected an int"),
    (lambda c: c.send(np.zeros((4, 4))[:, 1], 0), "x must be C-contiguous"),
    (lambda c: c.send([np.zeros(1), np.zeros(1)], 0), "x: 2 arrays given for 1 local ranks"),
    (lambda c: c.recv(np.zeros(2), 0, tag=1 << 62), "tag: .* is out of range"),
])
def test_bad_arguments_are_refused_naming_them_and_nothing_is_sent(comm, call, message):
    with pytest.raises(InvalidUsageError, match=message):
        call(comm)
    with pytest.raises(CollectiveTimeoutError):   # nothing was sent
        comm.recv(np.empty(2), 0)


def test_a_read_only_receive_array_is_refused(comm):
    out = np.zeros(2)
    out.setflags(write=False)
    with pytest.raises(InvalidUsageError, match="out.* is read-only, but the receive writes it"):
        comm.recv(out, 0)


def test_several_local_ranks_and_device_ranks_say_what_takes_send_and_recv():
    with collectives.Communicator.local(2) as two:
        with pytest.raises(InvalidUsageError, match="owns 2 local ranks; send and recv take one rank per process"):
            two.send([np.zeros(1), np.zeros(1)], 1)
    with collectives.Communicator.local(1, devices="emulated") as device:
        with pytest.raises(InvalidUsageError, match="recv: not available yet on DeviceRanks ranks"):
            device.recv(np.zeros(1), 0)


def test_a_closed_communicators_requests_raise_instead_of_touching_its_memory():
    comm = collectives.Communicator.local(1)
    pending = comm.irecv(np.empty(4), 0)
    comm.close()
    with pytest.raises(InvalidUsageError, match="closed"):
        pending.wait()
    assert not pending.test()
    with pytest.raises(InvalidUsageError, match="closed"):
        comm.send(np.zeros(4), 0)
