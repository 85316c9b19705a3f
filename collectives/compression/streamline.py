"""Fewer passes over memory for a compressed plan's codec operations.

`wire.lower_rows` turns each row into codec operations as the plain plan
lays it out: copy the input into WORK, work there, copy WORK into the
output. On host ranks memory is the wire, so those copies cost as much as
the traffic compression saves. Peers only ever read wire copies, so a
rank's float32 regions are its own business, and three rewrites of its own
operations (in call order, across phases) keep every bit of the result:

1. Forward the input: a read of WORK that still holds what the copy-in put
   there reads INPUT instead.
2. Write results where they are wanted: the operations whose float32
   results the copy-out moves to OUTPUT write OUTPUT themselves, when they
   tile the copied region exactly and nothing else reads it.
3. Drop dead writes: a float32 write that no later operation of the rank
   reads (OUTPUT is always read: by the caller) is not made. A copy or a
   decode then disappears, an encode does not round its source, an add
   writes only its encoded output.

The caller's INPUT and OUTPUT may be one array (in place), so (2) is only
done where no forwarded read of the same elements of INPUT comes after the
first write it moves to OUTPUT.

An operation is a list [kind, out, a, b, divisor, out_wire] (wire.py's
tuples, padded); a float32 output of None means "not written".
"""

from ..algorithms.schedule import SCRATCH, WORK
from ..binding import INPUT, OUTPUT

TEMP = 4   # wire.TEMP (not imported: wire imports this module)
RANK, BUFFER, OFFSET, COUNT = range(4)


def streamline(ops_by_phase):
    """One rank's operations, per phase, rewritten (see the module doc)."""
    sequence = [(p, list(op) + [None] * (6 - len(op))) for p, ops in enumerate(ops_by_phase) for op in ops]
    _forward_input(sequence)
    _write_results_in_place(sequence)
    _drop_dead_writes(sequence)
    result = [[] for _ in ops_by_phase]
    for p, op in sequence:
        if op[0] is not None:
            result[p].append(tuple(op[:3]) if op[0] in ("copy", "decode", "copy_wire") else
                             tuple(op[:4]) if op[0] == "encode" else tuple(op))
    return [tuple(ops) for ops in result]


# -- what an operation reads and writes, as float32 regions ------------------------


def float_reads(op):
    """The slots of `op` that hold float32 regions it reads."""
    kind = op[0]
    if kind in ("copy", "encode"):
        return (2,)
    if kind == "add":
        return (2, 3)
    if kind == "decode_add":
        return (2,)
    return ()


def float_write(op):
    """The float32 region `op` writes, or None."""
    return op[1] if op[0] in ("copy", "decode", "encode", "add", "decode_add") else None


def _overlaps(x, y):
    return x[RANK] == y[RANK] and x[BUFFER] == y[BUFFER] and \
        x[OFFSET] < y[OFFSET] + y[COUNT] and y[OFFSET] < x[OFFSET] + x[COUNT]


def _inside(inner, outer):
    return inner[RANK] == outer[RANK] and inner[BUFFER] == outer[BUFFER] and \
        outer[OFFSET] <= inner[OFFSET] and inner[OFFSET] + inner[COUNT] <= outer[OFFSET] + outer[COUNT]


def _moved(ref, buffer, shift):
    return (ref[RANK], buffer, ref[OFFSET] + shift, ref[COUNT])


# -- 1. forward the input ----------------------------------------------------------


def _forward_input(sequence):
    for i, (_, op) in enumerate(sequence):
        if op[0] != "copy" or op[2][BUFFER] != INPUT or op[1][BUFFER] not in (WORK, SCRATCH):
            continue
        copied, shift = op[1], op[2][OFFSET] - op[1][OFFSET]
        held = [(copied[OFFSET], copied[OFFSET] + copied[COUNT])]   # still holding the input there
        for _, later in sequence[i + 1:]:
            if not held:
                break
            for slot in float_reads(later):
                region = later[slot]
                if region[RANK] == copied[RANK] and region[BUFFER] == copied[BUFFER] and any(
                        a <= region[OFFSET] and region[OFFSET] + region[COUNT] <= b for a, b in held):
                    later[slot] = _moved(region, INPUT, shift)
            written = float_write(later)
            if written is not None and written[RANK] == copied[RANK] and written[BUFFER] == copied[BUFFER]:
                held = _subtract(held, written[OFFSET], written[OFFSET] + written[COUNT])


def _subtract(intervals, start, stop):
    """[start, stop) taken out of a list of [a, b) intervals."""
    left = []
    for a, b in intervals:
        left += [(x, y) for x, y in ((a, min(b, start)), (max(a, stop), b)) if x < y]
    return left


# -- 2. write results where they are wanted --------------------------------------


def _write_results_in_place(sequence):
    for i, (_, op) in enumerate(sequence):
        if op[0] != "copy" or op[1][BUFFER] != OUTPUT or op[2][BUFFER] not in (WORK, SCRATCH):
            continue
        writers = _last_writers(sequence, i, op[2])
        if writers is None or not _dead_after(sequence, i, op[2]):
            continue
        first = min(writers)
        output_as_input = (op[1][RANK], INPUT, op[1][OFFSET], op[1][COUNT])
        if any(_overlaps(later[slot], output_as_input)
               for _, later in sequence[first + 1:] for slot in float_reads(later)):
            continue    # in place, OUTPUT is INPUT: it must not change before those reads
        shift = op[1][OFFSET] - op[2][OFFSET]
        for j in writers:
            writer = sequence[j][1]
            writer[1] = _moved(writer[1], OUTPUT, shift)
        op[0] = None


def _last_writers(sequence, i, region):
    """Indices of the operations whose writes, before i, last set `region`,
    if they tile it exactly and nothing between them and i reads what they
    wrote; else None."""
    uncovered = [(region[OFFSET], region[OFFSET] + region[COUNT])]   # elements whose last writer is not found yet
    writers = []
    for j in range(i - 1, -1, -1):
        op = sequence[j][1]
        if op[0] is None:
            continue
        written = float_write(op)
        mine = written if written is not None and _overlaps(written, region) else None
        for slot in float_reads(op):   # reads of a value whose last write came before j
            read = op[slot]
            if read[RANK] == region[RANK] and read[BUFFER] == region[BUFFER]:
                pending = uncovered if mine is None else _subtract(uncovered, mine[OFFSET], mine[OFFSET] + mine[COUNT])
                if any(read[OFFSET] < b and a < read[OFFSET] + read[COUNT] for a, b in pending):
                    return None
        if mine is None:
            continue
        start, stop = mine[OFFSET], mine[OFFSET] + mine[COUNT]
        piece = next(((a, b) for a, b in uncovered if a <= start and stop <= b), None)
        if piece is None or not _inside(mine, region):
            return None         # overlaps what a later write set, or spills outside
        uncovered = _subtract(uncovered, start, stop)
        writers.append(j)
        if not uncovered:
            return writers
    return None                 # some of it was not written in this call


def _dead_after(sequence, i, region):
    """Whether nothing after operation i reads `region` before it is overwritten."""
    for _, later in sequence[i + 1:]:
        if later[0] is None:
            continue
        if any(_overlaps(later[slot], region) for slot in float_reads(later)):
            return False
        written = float_write(later)
        if written is not None and _inside(region, written):
            return True
    return True


# -- 3. drop dead writes -----------------------------------------------------------


def _drop_dead_writes(sequence):
    live = []   # float32 regions some later operation reads
    for _, op in reversed(sequence):
        if op[0] is None:
            continue
        written = float_write(op)
        if written is not None and written[BUFFER] != OUTPUT and not any(_overlaps(written, r) for r in live):
            if op[0] in ("copy", "decode"):
                op[0] = None
                continue
            op[1] = None    # encode: no rounding of the source; add, decode_add: only the encoded output
            if op[0] in ("add", "decode_add") and op[5] is None:
                op[0] = None
                continue
        elif written is not None:
            live = [r for r in live if not _inside(r, written)]
        live += [op[slot] for slot in float_reads(op) if op[slot][BUFFER] in (WORK, SCRATCH, TEMP)]
