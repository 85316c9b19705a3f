"""Progress of a sweep on stderr: size reached, backend, time left."""

import sys
import time

PROGRESS_AFTER_SECONDS = 3.0   # a sweep shorter than this shows no progress
PROGRESS_EVERY_SECONDS = 0.25  # redraw at most this often
# A size's share of the sweep's time, for the estimate of the time left:
# bandwidth-bound sizes cost their bytes, the small ones about a fixed latency.
LATENCY_BYTES = 64 << 10


def human_bytes(nbytes):
    """64, 4K, 1.5M: the spelling -b and -e take."""
    for suffix, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g}{suffix}"
    return str(nbytes)


def progress_line(name, index, count, nbytes, maxbytes, backend, seconds_left):
    """The progress text: size reached of the sweep, backend, time left."""
    if seconds_left is None:
        left = "estimating time left"
    elif seconds_left >= 60:
        left = f"~{int(seconds_left // 60)} min {int(seconds_left % 60):02d} s left"
    else:
        left = f"~{seconds_left:.0f} s left"
    return f"# {name}: size {index + 1}/{count} ({human_bytes(nbytes)} of {human_bytes(maxbytes)}), {backend}, {left}"


class Progress:
    """One line on stderr, rewritten in place (\\r) while the sweep runs, and
    cleared before each table row so that the table on stdout stays clean."""

    def __init__(self, name, sweep, enabled, stream=None):
        self.name, self.sweep, self.enabled = name, list(sweep), enabled
        self.stream = stream if stream is not None else sys.stderr
        self.weights = [size + LATENCY_BYTES for size in self.sweep]
        self.start = time.perf_counter()
        self.index, self.size_start = 0, self.start
        self.width = 0        # characters now on the line, 0: nothing shown
        self.shown = False
        self.last_draw = 0.0

    def size(self, index):
        self.index, self.size_start = index, time.perf_counter()

    def seconds_left(self, now):
        """The sizes left at the pace of the sizes done, less the time already spent on this one."""
        done = sum(self.weights[:self.index])
        if not done:
            return None
        pace = (self.size_start - self.start) / done
        return max(pace * (sum(self.weights) - done) - (now - self.size_start), 0.0)

    def at(self, backend):
        """Now timing `backend` at the current size."""
        now = time.perf_counter()
        if not self.enabled or now - self.start < PROGRESS_AFTER_SECONDS \
                or now - self.last_draw < PROGRESS_EVERY_SECONDS:
            return
        left = self.seconds_left(now)
        line = progress_line(self.name, self.index, len(self.sweep), self.sweep[self.index], self.sweep[-1],
                             backend, left)
        self.stream.write("\r" + line.ljust(self.width))
        self.stream.flush()
        self.width, self.shown, self.last_draw = len(line), True, now

    def clear(self):
        if self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
            self.width = 0

    def finish(self):
        if self.shown:
            self.clear()
            self.stream.write(f"# {self.name}: {len(self.sweep)} sizes in {time.perf_counter() - self.start:.1f} s\n")
            self.stream.flush()
