"""Named shared-memory files in /dev/shm: what host ranks' workspaces, the
control segment and the emulated device's IPC memory are made of."""

import mmap
import os

SHM_DIR = "/dev/shm"


class Segment:
    """A named file in /dev/shm, mapped into this process.

    Plain files rather than multiprocessing.shared_memory: that module starts a
    resource-tracker process per rank which shares the rank's pipes with
    mpiexec and, in Python < 3.13, unlinks segments it merely attached to.
    """

    def __init__(self, name, size=0, create=False):
        self.name = name
        self.path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.buf = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)

    @property
    def handle(self):
        """What a peer passes to Segment(name) to map it."""
        return self.name.encode()

    def release(self, unlink):
        try:
            self.buf.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes with it
        if unlink:
            remove_file(self.path)


def remove_file(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class HostMemory:
    """The memory kind of host ranks (protocol.py): workspaces are files."""

    @staticmethod
    def create(name, nbytes):
        return Segment(name, nbytes, create=True)

    @staticmethod
    def open(handle):
        return Segment(handle.rstrip(b"\0").decode())

    @staticmethod
    def release(segment, own):
        segment.release(unlink=own)
