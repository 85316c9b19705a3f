"""The control segment of ranks in separate processes, byte by byte.

One segment per communicator, made by rank 0 and mapped by every rank
(segments.py). The step protocol (protocol.py) and the compiled loop's
channel (fastpath.py, _shmloop.c) both live in it; this module is the one
place that says where, so both import it and neither imports the other.

    header      HEADER int64 slots: the ABORT flag, the aborting rank + 1,
                the class of the abort's cause; padded to 128 bytes
    rows        per rank, ROW int64 slots (128 bytes, so no two ranks'
                counters share a cache line): COUNTER, PID, SEQ, SIG, GEN,
                CAP; slots 6 and 7 the merged step's call (SMALL_SIG, by
                slot parity), in COUNTER's cache line so that a peer
                that sees the counter has it too; slots 8 and 9 the fast
                path's chunk counters, 10 its
                waits asleep on the row (which publish() wakes), 11 and 12
                the single-copy path's buffers, 13 whether it may reach
                peers, 14 raised while it writes into peers, 15 the
                address of its private scratch (what the reach probe writes)
    handles     per rank, HANDLE_BYTES: its workspace's IPC handle
    reason      REASON_BYTES: why the communicator was aborted, as text
    ll          from the next 256 bytes, per rank LL_REGION_BYTES: the
                one-kernel collectives' (kernels/ll_allreduce.cu) LL_FAULT
                word, which the rank's kernel sets when it stops waiting
                (why, for whom, in which call) and every rank's kernel and
                host read; LL_READY, raised once the rank's LL area (device
                memory) is allocated, zeroed and its handle is at
                LL_HANDLE_OFFSET; LL_STAGING, the bytes of the rank's
                staging buffer for calls on plain arrays through symmetric
                memory (executors/symmetric.py), raised once its handle is
                at LL_STAGING_HANDLE_OFFSET. GPUs map this part of the segment.
    calls       per rank, CALL_RECORDS records of CALL_RECORD_BYTES: GPU
                ranks' record of each call, whatever path it takes (a word:
                the call's number and signature; then its description), which
                peers compare (executors/device_protocol.py: CallRecords)
    channel     from the next page: the fast path's channel, per rank
                  small slots   2 x (SLOT_HEADER + small_max) bytes: the
                                merged step of messages up to small_max
                                (the first SLOT_HEADER bytes unused)
                  staging       2 x nranks chunks of `chunk` bytes: the
                                pipelined step of larger messages
                (small_max and chunk: the communicator's config.FastSizes)
    mailboxes   from the next page: point-to-point messages (p2p.py), one
                mailbox per ordered pair of ranks (sender, receiver), at
                index sender * size + receiver:
                  header      MAILBOX_HEADER bytes: SENT (fragments the
                              sender published, its cache line) and, a
                              line further, TAKEN (fragments the receiver
                              consumed, its own)
                  slots       MAILBOX_SLOTS of MAILBOX_SLOT_HEADER +
                              MAILBOX_SLOT_BYTES: fragment k in slot k %
                              MAILBOX_SLOTS, its header the message's bytes,
                              tag, the fragment's offset in it and its bytes
                Only the pairs that exchange messages touch their pages.
    recovery    from the next page: what the survivors of a failure agree
                through (recovery.py), which needs no failed rank:
                  rounds      per shrink round RECOVERY_ROUND_BYTES: DECIDED
                              (the rank whose proposal won, + 1: the one
                              compare-and-swap), NAME_READY, and from
                              RECOVERY_NAME_OFFSET the new communicator's
                              prefix
                  agreements  AGREE_DECISIONS words: agree()'s decisions,
                              call c's in word c % 2
                  rows        per rank RECOVERY_ROW_BYTES: JOINED (shrink
                              rounds entered), AGREE_SEQ and AGREE_FLAG
                              (agree calls made, and the last one's flag)
                  proposals   per round, per rank, the ranks it saw joined:
                              a bitmap of proposal_words(size) int64 words
"""


COUNTER, PID, SEQ, SIG, GEN, CAP = range(6)
ROW = 16
HEADER = 16
ABORT, ABORT_RANK, ABORT_KIND = 0, 1, 2
HANDLE_BYTES = 64            # sizeof(cudaIpcMemHandle_t)
REASON_BYTES = 1024
WORKSPACE_ALIGN = 4096
PAGE = 4096

# The LL region, per rank: int64 words (kLLRegionWords in kernels/ll_allreduce.cu).
LL_REGION_BYTES = 256
LL_REGION_WORDS = LL_REGION_BYTES // 8
LL_FAULT, LL_READY, LL_STAGING = 0, 1, 2
LL_HANDLE_OFFSET = 64        # bytes into the rank's region: HANDLE_BYTES of its LL area's handle
LL_STAGING_HANDLE_OFFSET = 128   # and of its current staging buffer's

# The call records, per rank: a ring of CALL_RECORDS, each a word and a description.
CALL_RECORDS = 64
CALL_RECORD_BYTES = 128
CALL_DESCRIPTION_BYTES = CALL_RECORD_BYTES - 8

# The channel's sizes are a communicator's config.FastSizes (small_max: the
# merged step's limit; chunk: the pipeline's), resolved when it is made;
# every rank must have the same (mpiexec passes the environment to all).
SLOT_HEADER = 128


def _pages(nbytes):
    return -(-nbytes // PAGE) * PAGE


def ll_region_offset(size):
    """Where the LL region starts: the first LL_REGION_BYTES boundary after the reason."""
    used = 8 * (HEADER + ROW * size) + HANDLE_BYTES * size + REASON_BYTES
    return -(-used // LL_REGION_BYTES) * LL_REGION_BYTES


def ll_mapped_bytes(size):
    """The segment's first bytes, through the LL region, in whole pages:
    what a GPU maps to read the abort flag and the fault words."""
    return _pages(ll_region_offset(size) + LL_REGION_BYTES * size)


def calls_offset(size):
    """Where the call records start: after the LL region."""
    return ll_region_offset(size) + LL_REGION_BYTES * size


def channel_offset(size):
    """Where the channel starts: the first page after the call records."""
    used = calls_offset(size) + CALL_RECORDS * CALL_RECORD_BYTES * size
    return -(-used // WORKSPACE_ALIGN) * WORKSPACE_ALIGN


def small_area(size, sizes):
    """The channel's small slots, every rank's (sizes: config.FastSizes)."""
    return _pages(size * 2 * (SLOT_HEADER + sizes.small_max))


def channel_bytes(size, sizes):
    """The channel's bytes for `size` ranks."""
    return small_area(size, sizes) + _pages(size * 2 * size * sizes.chunk)


# A mailbox (p2p.py): its header's words, and its slots.
MAILBOX_HEADER = 128
MAILBOX_SENT, MAILBOX_TAKEN = 0, 8         # int64 words of the header, on separate cache lines
MAILBOX_SLOTS = 4
MAILBOX_SLOT_HEADER = 64
MAILBOX_SLOT_BYTES = 128 << 10
MESSAGE_BYTES, MESSAGE_TAG, FRAGMENT_OFFSET = 0, 1, 2   # int64 words of a slot's header
FRAGMENT_BYTES = 6                                       # and the fragment's own bytes
# A message that fits the slots is cut into up to MAILBOX_SLOTS fragments of
# at least MAILBOX_FRAGMENT_MIN bytes, each published once copied in: the
# receiver copies one out while the sender copies the next in, so the
# message costs about one copy and a fragment rather than two copies.
MAILBOX_FRAGMENT_MIN = 8 << 10
# A message larger than the slots goes in one copy (p2p.py): its one
# fragment, FRAGMENT_OFFSET SINGLE_COPY, is a descriptor whose header also
# gives the sender's pid and the address of its bytes, and a word the
# receiver raises where it cannot read them.
SINGLE_COPY = -1
DESCRIPTOR_PID, DESCRIPTOR_ADDRESS, DESCRIPTOR_REFUSED = 3, 4, 5


def fragment_bytes(total):
    """The bytes of each fragment (the last may be shorter) of a message of
    `total` bytes sent through the slots: a fourth of it, between
    MAILBOX_FRAGMENT_MIN and a slot, in whole cache lines."""
    quarter = -(-total // MAILBOX_SLOTS)
    return min(MAILBOX_SLOT_BYTES, max(MAILBOX_FRAGMENT_MIN, -(-quarter // 64) * 64))


def mailbox_bytes():
    """One mailbox's bytes: its header and slots."""
    return MAILBOX_HEADER + MAILBOX_SLOTS * (MAILBOX_SLOT_HEADER + MAILBOX_SLOT_BYTES)


def mailboxes_offset(size, sizes):
    """Where the mailboxes start: the first page after the channel."""
    return channel_offset(size) + channel_bytes(size, sizes)


def recovery_offset(size, sizes):
    """Where the recovery area starts: the first page after the mailboxes."""
    return mailboxes_offset(size, sizes) + _pages(size * size * mailbox_bytes())


# The recovery area (recovery.py): its rounds, agreements, rows and proposals.
RECOVERY_ROUNDS = 4                  # shrink rounds one segment holds (a round fails only when a member dies)
RECOVERY_ROUND_BYTES = 256
DECIDED, NAME_READY = 0, 1           # int64 words of a round
RECOVERY_NAME_OFFSET = 64            # bytes into a round: the new prefix, up to RECOVERY_NAME_BYTES
RECOVERY_NAME_BYTES = RECOVERY_ROUND_BYTES - RECOVERY_NAME_OFFSET
AGREE_DECISIONS = 2
RECOVERY_ROW_BYTES = 128
JOINED, AGREE_SEQ, AGREE_FLAG = 0, 1, 2   # int64 words of a rank's row


def proposal_words(size):
    """The int64 words of one proposal: a bit per rank."""
    return -(-size // 64)


def recovery_parts(size):
    """Byte offsets into the recovery area: (agreements, rows, proposals, end)."""
    agreements = RECOVERY_ROUNDS * RECOVERY_ROUND_BYTES
    rows = agreements + RECOVERY_ROW_BYTES   # the two decision words, padded to their own line
    proposals = rows + size * RECOVERY_ROW_BYTES
    return agreements, rows, proposals, proposals + RECOVERY_ROUNDS * size * 8 * proposal_words(size)


def control_bytes(size, sizes):
    """The whole control segment, page-aligned. Pages nobody touches cost nothing."""
    return recovery_offset(size, sizes) + _pages(recovery_parts(size)[3])
