"""Shared memory between the processes of one machine, with no name in
/dev/shm: what host ranks' workspaces, the control segment and the emulated
device's IPC memory are made of.

A segment is anonymous shared memory, `memfd_create` + `ftruncate` + `mmap`.
It exists while some process holds its descriptor or a mapping of it, and
the kernel frees it when the last one goes, however they go: a job whose
every rank is killed with SIGKILL leaves nothing behind. (Named files in
/dev/shm, which this module made before, outlive the processes that made
them unless someone unlinks them, and a killed rank unlinks nothing.)

Peers find a segment by its name, which says which process holds it:
`<label>@<pid>`. The holder keeps the descriptor open until it releases the
segment; a peer lists /proc/<pid>/fd, finds the link that reads
`/memfd:<name> (deleted)` and opens it, which maps the same memory (for a
process of the same user, as ptrace's read check allows: no attach rights
needed, so Yama's ptrace_scope=1 is no obstacle). The name, not the
descriptor number, is what a peer asks for: names carry the communicator's
random token, so a descriptor number reused by the holder, or a pid reused
by another process, can never hand a peer the wrong memory; the cost is one
scan of the holder's descriptor table, once per segment a peer maps. Keeping
the name as the handle also keeps `Segment(name, size, create)` one call for
the maker and the peers alike. (A handle of `<pid>:<fd>` would skip the scan
but needs an inode check against reuse, and a different call for peers.)
The control segment's name, `<prefix>-control@<pid in the prefix>`
(protocol.control_name), follows from the prefix alone, so the bootstrap
still exchanges nothing but the prefix.

Descriptors are close-on-exec; a child forked without exec (and not told to
die with its parent) inherits them and keeps the memory, never a file, alive
until it exits.

A holder that died before a peer mapped its segment is reported as
`RankFailedError`. There is no fallback to named files: without
memfd_create (Linux >= 3.17) or a readable /proc, making or opening a
segment raises a CollectiveError that says so. A fallback would have to
unlink each name once every peer has mapped it, and peers map workspaces
lazily, so the window in which a kill leaves files behind would remain.

Not multiprocessing.shared_memory: that module starts a resource-tracker
process per rank which shares the rank's pipes with mpiexec and, in
Python < 3.13, unlinks segments it merely attached to.
"""

import mmap
import os

from ..errors import CollectiveError, InvalidUsageError, RankFailedError

HANDLE_LIMIT = 64   # bytes: a name is a handle in protocol.py's HANDLE_BYTES slots


def held_here(label):
    """The name of a segment this process holds: `<label>@<pid>`."""
    return f"{label}@{os.getpid()}"


def holder(name):
    """The pid of the process that holds segment `name`."""
    label, _, pid = name.rpartition("@")
    if not label or not pid.isdigit():
        raise InvalidUsageError(f"a shared-memory segment's name is <label>@<pid of its holder>, got {name!r}")
    return int(pid)


class Segment:
    """Anonymous shared memory, mapped into this process.

    `Segment(name, size, create=True)` makes it: `name` is `<label>@<pid of
    this process>` (held_here), or a bare label to which this process's
    `@<pid>` is added. `Segment(name)` maps the one that the process named
    in `name` holds. Either way `.name` and `.handle` are the full name.
    """

    def __init__(self, name, size=0, create=False):
        if create and "@" not in name:
            name = held_here(name)
        self.name = name
        self._fd = None
        pid = holder(name)
        if create:
            if pid != os.getpid():
                raise InvalidUsageError(
                    f"segment {name!r} names process {pid} as its holder, but process {os.getpid()} makes it "
                    "(a communicator's prefix comes from new_prefix() in its rank 0's process)")
            if len(name.encode()) > HANDLE_LIMIT:
                raise InvalidUsageError(f"segment name {name!r} is longer than {HANDLE_LIMIT} bytes")
            fd = _memfd(name)
        else:
            fd = _open_held(name, pid)
        try:
            if create:
                os.ftruncate(fd, size)
            self.buf = mmap.mmap(fd, os.fstat(fd).st_size)
        except BaseException:
            os.close(fd)
            raise
        if create:
            self._fd = fd      # peers open it through /proc until release
        else:
            os.close(fd)       # the mapping keeps the memory

    @property
    def handle(self):
        """What a peer passes to Segment() to map it: the name."""
        return self.name.encode()

    def release(self):
        """Unmap; the holder also closes its descriptor, after which no peer
        can open the segment. The memory goes with the last mapping."""
        try:
            self.buf.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes with it
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Released(CollectiveError):
    """The process that made a segment is alive but holds it no more: it
    released it (a communicator it gave up on), or never made it."""


def _memfd(name):
    if not hasattr(os, "memfd_create"):
        raise CollectiveError(
            "shared memory between processes needs memfd_create (Linux 3.17 or later, Python 3.8 or later); "
            "collectives makes no files in /dev/shm, which a killed job would leave behind")
    return os.memfd_create(name, os.MFD_CLOEXEC)


def _open_held(name, pid):
    """A new descriptor of segment `name`, found among process `pid`'s."""
    fds = f"/proc/{pid}/fd"
    target = f"/memfd:{name} (deleted)"
    try:
        entries = os.listdir(fds)
    except FileNotFoundError:
        if os.path.isdir("/proc/self/fd"):
            raise RankFailedError(f"process {pid}, which held shared memory {name}, has exited") from None
        raise CollectiveError(f"cannot map shared memory {name}: this machine has no /proc to find it in") from None
    except PermissionError as error:
        if exited(pid):
            raise RankFailedError(f"process {pid}, which held shared memory {name}, has exited") from None
        raise CollectiveError(
            f"cannot map shared memory {name}: /proc/{pid}/fd is not readable here ({error}); the ranks of a "
            "communicator must run as one user, and stay dumpable (prctl PR_SET_DUMPABLE)") from None
    for entry in entries:
        path = f"{fds}/{entry}"
        try:
            if os.readlink(path) == target:
                return os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue  # closed meanwhile, or not ours to read
    if exited(pid):
        raise RankFailedError(f"process {pid}, which held shared memory {name}, has exited")
    raise Released(f"process {pid} holds no shared memory named {name}: it released it, or never made it")


PF_EXITING = 0x4   # linux/sched.h: the task has begun do_exit()


def exited(pid):
    """Whether process `pid` is gone or going, and so holds nothing.

    A zombie (dead, not reaped yet) has exited too. So has a process that
    is still in the kernel's exit path: it closes its descriptors there
    before it turns into a zombie, and a peer that looks in that window
    finds no segment yet no zombie. It set PF_EXITING before it closed the
    first one, so the flag, read after the descriptors were found missing,
    tells a dying holder from one that released the segment.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return gone_or_going(stat.read())
    except OSError:
        return True


def gone_or_going(stat):
    """From the text of /proc/<pid>/stat: state is field 3, flags field 9,
    counted from the first; the name in field 2 may hold anything, ")" too."""
    fields = stat.rsplit(b")", 1)[1].split()
    return fields[0] in (b"Z", b"X") or bool(int(fields[6]) & PF_EXITING)


class HostMemory:
    """The memory kind of host ranks (protocol.py): workspaces are segments."""

    @staticmethod
    def create(name, nbytes):
        return Segment(held_here(name), nbytes, create=True)

    @staticmethod
    def open(handle):
        return Segment(handle.rstrip(b"\0").decode())

    @staticmethod
    def release(segment, own):
        segment.release()
