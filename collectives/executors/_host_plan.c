/* The compiled plan executor of host ranks in separate processes: the C
 * twin of kernels/plan_step.cu, and of the NumPy interpreter
 * (executors/host.py), which stays the reference meaning of a plan.
 *
 * It runs one rank's part of any plan (any collective, any algorithm: the
 * plan's op tables are the only input) through the step protocol of
 * transport/protocol.py, phase by phase, with no Python in between:
 *
 *   for each phase p from start_phase:
 *     wait until every peer named in the phase's waits has completed the
 *       phases it must have (its COUNTER), and, once a peer is in this
 *       call (done >= 1), check that its SIG names the same call;
 *     phase 0 only: this rank's workspace must hold the plan (else
 *       NEED_GROW: Python grows it, at the only moment no peer reads it,
 *       and calls again from phase 0), then name the call (SEQ, SIG);
 *     a peer workspace the phase reads must be the generation Python
 *       opened (else NEED_OPEN: Python opens the new one and calls again
 *       from this phase; no row of it has run);
 *     run this rank's rows: COPY (dst = src), REDUCE (dst = the fold of the
 *       sources in the order given), REDUCE_FINAL (avg divides by the rank
 *       count), over byte addresses of the four buffers (WORK and SCRATCH
 *       of any rank's workspace, this rank's INPUT and OUTPUT);
 *     publish COUNTER = base + p + 1 (release: a peer that sees it sees
 *       the rows' writes).
 *
 * The same waits, counters and signatures as the interpreter's ProcessGroup.run,
 * so ranks on either executor run one call together. It writes only this
 * rank's own memory, but for a single-copy plan's pushes (below). The
 * GIL is released for the whole run (the waits take it back briefly to
 * run Python's signal handlers).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <sys/uio.h>

#include "shm_waits.h"
#include "host_folds.h"
#include "signatures.h"
#include "raised.h"

enum { GEN = 4, CAP = 5 };                                  /* row slots (protocol.py) */
enum { WORK = 0, SCRATCH = 1, INPUT = 2, OUTPUT = 3 };      /* buffer ids (plan.py) */
enum { COPY_OP = 0, REDUCE_OP = 1, REDUCE_FINAL_OP = 2 };   /* row kinds (binding.py) */
enum { RANK = 0, KIND = 1, COUNT = 2, DST_BUF = 3, DST_OFF = 4, NSRC = 5, SRC0 = 6 };   /* row columns */
enum { MAX_SOURCES = 256 };

typedef struct {
    PyObject_HEAD
    Waits waits;
    int64_t base, seq, signature;   /* of the call running, or last run */
    long long waits_made;           /* peer waits over the runner's life (bench.spmd_overhead counts them) */
    long long repeats_run;          /* calls its Repeats ran (the tests count them) */
    /* Per rank, held for the runner's life (Python writes them, between calls):
     * the address of the rank's workspace as mapped here (0: not opened) and
     * the generation that is. */
    Py_buffer bases_view, generations_view;
    const int64_t *bases, *generations;
    PyObject *last;                 /* the Python plan of the last call run (CompiledPlans.last_plan), or None */
    char *peer_slices;              /* a single-copy fold's slices of peers' inputs (see "Single copy") */
    int pushes_reached;             /* 0: not known; 1: every rank may push into every peer; -1: not
                                     * (see "Single copy") */
    size_t peer_slices_bytes;
    struct Repeats *repeats;        /* a repeated call's shortcut (see "Repeats" below), or NULL */
} Runner;

/* The arrays and numbers of one call (see Runner_run). */
typedef struct {
    const int64_t *rows, *row_starts, *waits, *wait_starts;
    int64_t phases, width;
    const int64_t *bases;       /* per rank: the workspace's address (0: not opened) */
    const int64_t *generations; /* per rank: the generation `bases` holds */
    char *input, *output;
    int64_t scratch_offset, workspace_bytes;
    int type, op, nranks;
    int single_copy;            /* a plan that reads peers' inputs in place: SINGLE_COPY_* (see "Single copy" below) */
    int no_push_in_place;       /* the rank that takes no push where its output is its input, or -1 (a spread
                                 * broadcast's root in place: its x holds what a push would write) */
    int *pushes_reached;        /* the runner's verdict on pushes (Runner.pushes_reached) */
    size_t itemsize;
    char **peer_slices;         /* the runner's buffer for a fold's reads, and its size (grown here) */
    size_t *peer_slices_bytes;
} Call;

/* ---- Single copy ------------------------------------------------------------
 *
 * The single-copy plans (plan.single_copy_plan) read peers' INPUT straight
 * out of their processes (process_vm_readv): an exchange's copy row into
 * this rank's own memory, a fold's row (reduce_scatter, reduce, allreduce)
 * in slices (PEER_SLICE_MAX bytes at most) into the runner's buffer, one
 * per peer source, which it folds with its own sources in the row's order
 * (the same bits as the staged plan's fold of the same sources). A pushed
 * plan (plan.pushed_plan) also has push rows: a row in this rank's table
 * whose destination is a peer's OUTPUT (its RANK another rank), copied out
 * of this rank's own memory into the peer's process (process_vm_writev),
 * under shm_waits.h's rule for writes into peers (WRITING, the fence).
 * They have three phases, and the executor adds to each:
 *
 *   0  publish this call's input and output addresses (the row's IN_ADDR
 *      and OUT_ADDR, "not refused": REFUSED_FLAG clear) with the counter;
 *   1  the reads, and pushes: a peer's INPUT is read, or its OUTPUT
 *      written, once the peer has completed phase 0 (its addresses are
 *      this call's). A read or write the kernel refuses (EPERM: another
 *      user, a ptrace restriction, a seccomp rule) sets REFUSED_FLAG in
 *      OUT_ADDR and ends the phase's rows;
 *   2  every rank waits for every peer to have completed phase 1 (no
 *      reader is left in its input, which it may then overwrite or hand
 *      back to its caller, and no writer in its output), then looks at
 *      every rank's REFUSED_FLAG: one set, and every rank returns REFUSED
 *      before any row of phase 2 (nothing of the input overwritten: a
 *      pushed plan writes only outputs apart from inputs before it), and
 *      Python runs the call again on the staged plan, which writes every
 *      output whole. Else this phase's local rows (in place: the blocks
 *      read into SCRATCH copied over the input).
 *
 * (IN_ADDR and OUT_ADDR are the compiled loop's slots too: a call of either
 * engine sets them before any peer reads them.) */
#define REFUSED_FLAG ((int64_t)1 << 62)   /* above any user-space address */
#define PUSH_REFUSED_FLAG ((int64_t)1 << 61)
/* Plan(single_copy=): none, reads, reads and a probe of pushes, pushes
 * from every rank into every peer, other pushes. A plan that probes (the
 * read form of a fold that can push: allreduce, in place before the ranks
 * know pushes work) ends its phase 1 with a write into every peer's output
 * of the 8 bytes it just read there: in that form's phase 1 no rank writes
 * any output, so the bytes stay what they were. A write refused sets
 * PUSH_REFUSED_FLAG, which refuses nothing of the call. At phase 2's
 * verdict, a plan that probes or pushes from every rank into every peer
 * sets the runner's pushes_reached, on every rank alike: 1 where no rank's
 * push or probe was refused, else -1; Python then takes the pushed plan in
 * place (which writes inputs in phase 1, so may no longer fall back) only
 * at 1. Other pushes (a reduce's into the root, a broadcast's) prove
 * nothing of every pair. */
enum { SINGLE_COPY_NONE = 0, SINGLE_COPY_READS = 1, SINGLE_COPY_PROBES = 2, SINGLE_COPY_PUSHES_EVERY_PEER = 3,
       SINGLE_COPY_PUSHES = 4 };
/* Set by the tests alone: every read and push is refused (test_refuse_reads),
 * every push only (test_refuse_pushes), or
 * held this long before it starts (test_stall_reads: a rank that returned
 * before its readers were done would have its input overwritten under them). */
static int refuse_for_tests;
static int refuse_pushes_for_tests;
static double read_stall_for_tests;
static double write_stall_for_tests;   /* each push held this long inside its WRITING window (the fence's tests) */

/* Copy `nbytes` between `local` and `remote` in peer `peer`'s process,
 * out of it (process_vm_readv) or `into_peer` (process_vm_writev): OK,
 * REFUSED (EPERM: another user, a ptrace restriction, a seccomp rule),
 * PEER_DEAD, ABORTED (a peer that aborted may have handed its buffers
 * back), or READ_FAILED / WRITE_FAILED with the errno. */
static int copy_with_peer(Waits *w, int peer, char *local, int64_t remote, size_t nbytes, int into_peer)
{
    pid_t pid = (pid_t)load_acquire(&w->rows[peer * ROW_SLOTS + PID]);
    while (nbytes > 0) {
        struct iovec here = {local, nbytes}, there = {(void *)(uintptr_t)remote, nbytes};
        ssize_t moved = into_peer ? process_vm_writev(pid, &here, 1, &there, 1, 0)
                                  : process_vm_readv(pid, &here, 1, &there, 1, 0);
        if (moved <= 0) {
            int error = moved < 0 ? errno : 0;
            if (error == EINTR)
                continue;
            w->failed_peer = peer;
            w->failed_have = error;
            w->failed_need = (int64_t)nbytes;
            if (error == ESRCH || !process_alive(pid))
                return PEER_DEAD;
            if (__atomic_load_n(&w->header[ABORT], __ATOMIC_ACQUIRE)) {
                w->failed_peer = -1;
                return ABORTED;
            }
            return error == EPERM || error == ENOSYS ? REFUSED : into_peer ? WRITE_FAILED : READ_FAILED;
        }
        local += moved;
        remote += moved;
        nbytes -= (size_t)moved;
    }
    return OK;
}

/* Copy `nbytes` out of peer `peer`'s process at `remote` into `local`
 * (copy_with_peer's statuses). */
static int read_peer(Waits *w, int peer, char *local, int64_t remote, size_t nbytes)
{
    if (refuse_for_tests && nbytes > 0) {
        w->failed_peer = peer;
        return REFUSED;
    }
    if (read_stall_for_tests > 0)
        sleep_seconds(read_stall_for_tests);
    return copy_with_peer(w, peer, local, remote, nbytes, 0);
}

/* Whether `peer`'s output is its input, this call (its phase 0's addresses). */
static int peer_in_place(Waits *w, int peer)
{
    int64_t output = load_acquire(&w->rows[peer * ROW_SLOTS + OUT_ADDR]) & ~(REFUSED_FLAG | PUSH_REFUSED_FLAG);
    return output == load_acquire(&w->rows[peer * ROW_SLOTS + IN_ADDR]);
}

/* Copy `nbytes` at `local` into peer `peer`'s output at byte `offset`,
 * inside this rank's WRITING window (copy_with_peer's statuses; ABORTED
 * too where the communicator was aborted before the write: its ranks may
 * have handed their buffers back). */
static int push_to_peer(Waits *w, int peer, const char *local, int64_t offset, size_t nbytes)
{
    if ((refuse_for_tests || refuse_pushes_for_tests) && nbytes > 0) {
        w->failed_peer = peer;
        return REFUSED;
    }
    if (!begin_writes(w)) {
        w->failed_peer = -1;
        return ABORTED;
    }
    if (write_stall_for_tests > 0)
        sleep_seconds(write_stall_for_tests);
    int64_t output = load_acquire(&w->rows[peer * ROW_SLOTS + OUT_ADDR]) & ~(REFUSED_FLAG | PUSH_REFUSED_FLAG);
    int status = copy_with_peer(w, peer, (char *)local, output + offset, nbytes, 1);
    end_writes(w);
    return status;
}

/* A plan that probes (SINGLE_COPY_PROBES): the 8 bytes at the start of
 * every peer's output, read and written back unchanged; PUSH_REFUSED_FLAG
 * where the kernel refuses either. OK, or ABORTED (the communicator was
 * aborted: no write made). */
static int probe_pushes(Waits *w)
{
    int64_t *mine = &w->rows[w->rank * ROW_SLOTS];
    if (!begin_writes(w)) {
        w->failed_peer = -1;
        return ABORTED;
    }
    int reached = !(refuse_for_tests || refuse_pushes_for_tests);
    for (int q = 0; q < w->nranks && reached; q++) {
        if (q == w->rank)
            continue;
        char bytes[8];
        pid_t pid = (pid_t)load_acquire(&w->rows[q * ROW_SLOTS + PID]);
        struct iovec here = {bytes, sizeof bytes};
        int64_t output = load_acquire(&w->rows[q * ROW_SLOTS + OUT_ADDR]) & ~(REFUSED_FLAG | PUSH_REFUSED_FLAG);
        struct iovec there = {(void *)(uintptr_t)output, sizeof bytes};
        reached = process_vm_readv(pid, &here, 1, &there, 1, 0) == (ssize_t)sizeof bytes
                  && process_vm_writev(pid, &here, 1, &there, 1, 0) == (ssize_t)sizeof bytes;
    }
    end_writes(w);
    if (!reached)
        __atomic_fetch_or(&mine[OUT_ADDR], PUSH_REFUSED_FLAG, __ATOMIC_RELEASE);   /* published with the counter */
    return OK;
}

static char *address(const Call *call, int me, int64_t rank, int64_t buffer, int64_t offset)
{
    char *start = NULL;
    if (buffer == WORK || buffer == SCRATCH) {
        if (rank >= 0 && rank < call->nranks && call->bases[rank] != 0)
            start = (char *)(uintptr_t)call->bases[rank] + (buffer == SCRATCH ? call->scratch_offset : 0);
    } else if (rank == me) {
        start = buffer == INPUT ? call->input : buffer == OUTPUT ? call->output : NULL;
    }
    return start == NULL ? NULL : start + (size_t)offset * call->itemsize;
}

/* Whether a row's sources name a peer's INPUT (a single-copy fold). */
static int reads_a_peer(const int64_t *row, int me)
{
    for (int64_t s = 0; s < row[NSRC]; s++)
        if (row[SRC0 + 3 * s] != me && row[SRC0 + 3 * s + 1] == INPUT)
            return 1;
    return 0;
}

/* Bytes a single-copy fold reads of each peer source at a time: the most
 * that, read by one process_vm_readv each, measured fastest (2 processes,
 * 16 MiB reduce_scatter: 64 KiB slices 3.1 ms, 256 KiB 2.4, 512 KiB and 1
 * MiB 1.8-1.9, the loop's single copy 2.3-2.4; docs/host-ranks.md), within
 * PEER_SLICES_BYTES for all of a row's peers together. */
enum { PEER_SLICE_MAX = 512 << 10, PEER_SLICES_BYTES = 4 << 20 };

/* A fold row of a single-copy plan, slice by slice: each peer INPUT source
 * read into the runner's buffer, then the row's sources folded in its
 * order into dst. */
static int fold_peers(Waits *w, const Call *call, int me, const int64_t *row, char *dst)
{
    int divisor = row[KIND] == REDUCE_FINAL_OP && call->op == OP_AVG ? call->nranks : 0;
    int64_t nsrc = row[NSRC], peers = 0;
    const char *srcs[MAX_SOURCES];
    int64_t remote[MAX_SOURCES];   /* a peer source's address in its process, else -1 */
    for (int64_t s = 0; s < nsrc; s++) {
        const int64_t *src = row + SRC0 + 3 * s;
        remote[s] = -1;
        if (src[0] != me && src[1] == INPUT) {
            if (src[0] < 0 || src[0] >= call->nranks)
                return BAD_PLAN;
            remote[s] = load_acquire(&w->rows[src[0] * ROW_SLOTS + IN_ADDR]) + src[2] * (int64_t)call->itemsize;
            peers++;
        } else if ((srcs[s] = address(call, me, src[0], src[1], src[2])) == NULL) {
            return BAD_PLAN;
        }
    }
    size_t slice = PEER_SLICES_BYTES / (size_t)peers < PEER_SLICE_MAX ? PEER_SLICES_BYTES / (size_t)peers
                                                                      : PEER_SLICE_MAX;
    slice -= slice % 64;   /* whole cache lines, whole elements (an itemsize divides 64) */
    size_t need = (size_t)peers * slice + 4096;   /* (and room to start half a page from dst: below) */
    if (*call->peer_slices_bytes < need) {
        char *grown = realloc(*call->peer_slices, need);
        if (grown == NULL) {   /* "reading rank q's buffer failed: Cannot allocate memory" */
            for (int64_t s = 0; s < nsrc; s++)
                if (remote[s] >= 0)
                    w->failed_peer = (int)row[SRC0 + 3 * s];
            w->failed_have = ENOMEM;
            w->failed_need = (int64_t)need;
            return READ_FAILED;
        }
        *call->peer_slices = grown;
        *call->peer_slices_bytes = need;
    }
    size_t nbytes = (size_t)row[COUNT] * call->itemsize;
    const char *slices[MAX_SOURCES];
    /* The slices start half a page away from dst's offset in its page: a
     * store to dst[i] and a load of a slice's [i] at the same offset in
     * their pages stall each other (4K aliasing), and malloc puts large
     * buffers, the caller's and this one, at one offset (the loop's
     * landing_for, measured there). */
    char *first = *call->peer_slices;
    first += (((uintptr_t)dst & 4095) + 2048 - ((uintptr_t)first & 4095)) & 4095 & ~(uintptr_t)63;
    for (size_t at = 0; at < nbytes; at += slice) {
        size_t len = nbytes - at < slice ? nbytes - at : slice;
        char *into = first;
        for (int64_t s = 0; s < nsrc; s++) {
            if (remote[s] < 0) {
                slices[s] = srcs[s] + at;
                continue;
            }
            int status = read_peer(w, (int)row[SRC0 + 3 * s], into, remote[s] + (int64_t)at, len);
            if (status != OK)
                return status;
            slices[s] = into;
            into += slice;
        }
        reduce_sources(call->type, call->op, slices, (int)nsrc, dst + at, NULL, len, call->itemsize, divisor);
    }
    return OK;
}

/* Run rows [first, last) of the table. BAD_PLAN where a row names memory
 * this rank cannot address (a peer's INPUT, but in a single-copy plan's
 * copy or fold; a peer's OUTPUT, but as a single-copy plan's push of this
 * rank's own memory) or has more sources than the loop takes. */
static int run_rows(Waits *w, const Call *call, int me, int64_t first, int64_t last)
{
    const char *srcs[MAX_SOURCES];
    for (int64_t i = first; i < last; i++) {
        const int64_t *row = call->rows + i * call->width;
        int64_t nsrc = row[NSRC];
        size_t nbytes = (size_t)row[COUNT] * call->itemsize;
        if (row[RANK] != me) {   /* a push: this rank's memory into the peer's OUTPUT */
            const char *src = nsrc == 1 && row[SRC0] == me ? address(call, me, me, row[SRC0 + 1], row[SRC0 + 2]) : NULL;
            if (!call->single_copy || row[KIND] != COPY_OP || row[DST_BUF] != OUTPUT || src == NULL
                || row[RANK] < 0 || row[RANK] >= call->nranks)
                return BAD_PLAN;
            if (row[RANK] == call->no_push_in_place && peer_in_place(w, (int)row[RANK]))
                continue;
            int status = push_to_peer(w, (int)row[RANK], src, row[DST_OFF] * (int64_t)call->itemsize, nbytes);
            if (status != OK)
                return status;
            continue;
        }
        char *dst = address(call, me, row[RANK], row[DST_BUF], row[DST_OFF]);
        if (dst == NULL || nsrc < 1 || nsrc > MAX_SOURCES || SRC0 + 3 * nsrc > call->width)
            return BAD_PLAN;
        int64_t peer = row[SRC0];
        if (call->single_copy && row[KIND] == COPY_OP && row[SRC0 + 1] == INPUT && peer != me) {
            if (peer < 0 || peer >= call->nranks)
                return BAD_PLAN;
            int64_t there = load_acquire(&w->rows[peer * ROW_SLOTS + IN_ADDR]);
            int status = read_peer(w, (int)peer, dst, there + row[SRC0 + 2] * (int64_t)call->itemsize, nbytes);
            if (status != OK)
                return status;
            continue;
        }
        if (call->single_copy && row[KIND] != COPY_OP && reads_a_peer(row, me)) {
            int status = fold_peers(w, call, me, row, dst);
            if (status != OK)
                return status;
            continue;
        }
        for (int64_t s = 0; s < nsrc; s++) {
            const int64_t *src = row + SRC0 + 3 * s;
            if ((srcs[s] = address(call, me, src[0], src[1], src[2])) == NULL)
                return BAD_PLAN;
        }
        if (row[KIND] == COPY_OP) {
            memmove(dst, srcs[0], nbytes);
            continue;
        }
        int divisor = row[KIND] == REDUCE_FINAL_OP && call->op == OP_AVG ? call->nranks : 0;
        reduce_sources(call->type, call->op, srcs, (int)nsrc, dst, NULL, nbytes, call->itemsize, divisor);
    }
    return OK;
}

/* NEED_OPEN (with the peer in w->failed_peer) where a row of rows
 * [first, last) reads a peer's workspace of another generation than the
 * one opened; else OK. */
static int check_generations(Waits *w, const Call *call, int64_t first, int64_t last)
{
    for (int64_t i = first; i < last; i++) {
        const int64_t *row = call->rows + i * call->width;
        for (int64_t s = 0; s < row[NSRC] && SRC0 + 3 * s + 2 < call->width; s++) {
            int64_t peer = row[SRC0 + 3 * s], buffer = row[SRC0 + 3 * s + 1];
            if (peer == w->rank || peer < 0 || peer >= w->nranks || (buffer != WORK && buffer != SCRATCH))
                continue;
            if (call->bases[peer] == 0 || load_acquire(&w->rows[peer * ROW_SLOTS + GEN]) != call->generations[peer]) {
                w->failed_peer = (int)peer;
                return NEED_OPEN;
            }
        }
    }
    return OK;
}

static int run_phases(Waits *w, const Call *call, int64_t start_phase, int64_t base, int64_t seq,
                      int64_t signature, int64_t *stopped_at, long long *waits_made, PyThreadState **released)
{
    int me = w->rank;
    int64_t *mine = &w->rows[me * ROW_SLOTS];
    for (int64_t p = start_phase; p < call->phases; p++) {
        *stopped_at = p;
        for (int64_t k = call->wait_starts[p]; k < call->wait_starts[p + 1]; k++) {
            int peer = (int)call->waits[2 * k];
            int64_t done = call->waits[2 * k + 1];
            ++*waits_made;
            int status = wait_for(w, peer, COUNTER, base + done, released);
            if (status != OK)
                return status;
            if (done >= 1 && load_acquire(&w->rows[peer * ROW_SLOTS + SIG]) != signature) {
                w->failed_peer = peer;
                w->failed_have = w->rows[peer * ROW_SLOTS + SIG];
                w->failed_need = signature;
                return MISMATCH;
            }
        }
        if (p == 0) {
            if (call->workspace_bytes > 0 && (call->bases[me] == 0 || mine[CAP] < call->workspace_bytes))
                return NEED_GROW;
            mine[SEQ] = seq;
            mine[SIG] = signature;
            if (call->single_copy) {   /* published with the counter below */
                mine[IN_ADDR] = (int64_t)(uintptr_t)call->input;
                mine[OUT_ADDR] = (int64_t)(uintptr_t)call->output;
            }
        }
        if (call->single_copy && p == 2) {   /* every peer is done reading: the verdict */
            for (int q = 0; q < call->nranks; q++)
                if (load_acquire(&w->rows[q * ROW_SLOTS + OUT_ADDR]) & REFUSED_FLAG) {
                    /* the call ends here, its rows unrun: counted whole, so that the staged call
                     * that follows waits until every peer has looked at the verdict (and at SIGs) */
                    publish(mine, COUNTER, base + call->phases);
                    w->failed_peer = q;
                    return REFUSED;
                }
            if (call->single_copy == SINGLE_COPY_PROBES || call->single_copy == SINGLE_COPY_PUSHES_EVERY_PEER) {
                /* (a pushed plan got here with every push made) */
                *call->pushes_reached = 1;
                for (int q = 0; q < call->nranks; q++)
                    if (load_acquire(&w->rows[q * ROW_SLOTS + OUT_ADDR]) & PUSH_REFUSED_FLAG)
                        *call->pushes_reached = -1;
            }
        }
        int64_t first = call->row_starts[p], last = call->row_starts[p + 1];
        int status = check_generations(w, call, first, last);
        if (status == OK)
            status = run_rows(w, call, me, first, last);
        if (status == OK && call->single_copy == SINGLE_COPY_PROBES && p == 1)
            status = probe_pushes(w);
        if (status == REFUSED && call->single_copy && p == 1)
            __atomic_fetch_or(&mine[OUT_ADDR], REFUSED_FLAG, __ATOMIC_RELEASE);   /* published with the counter */
        else if (status != OK)
            return status;
        publish(mine, COUNTER, base + p + 1);
    }
    return OK;
}

/* A C-contiguous int64 array's data, or NULL with an exception set. */
static const int64_t *int64s(PyObject *object, Py_buffer *view, Py_ssize_t at_least)
{
    if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (view->itemsize != 8 || (f[0] != 'q' && f[0] != 'l') || view->len / 8 < at_least) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_TypeError, "the runner takes C-contiguous int64 arrays");
        return NULL;
    }
    return view->buf;
}

/* ---- A plan, prepared once ---------------------------------------------------
 *
 * Plan(rows, row_starts, waits, wait_starts, scratch_offset, workspace_bytes,
 *      type, op, nranks, description_hash, single_copy[, no_push_in_place])
 *
 * One rank's part of a plan, checked and copied into memory of its own
 * once, so that a call passes only what changes between calls (the arrays'
 * addresses, the phase to start from, the deadline): rows, the rank's rows
 * of every phase in one table; row_starts, phases + 1 row indexes; waits,
 * (peer, phases done) pairs, wait_starts their phases' starts;
 * single_copy, a plan that reads peers' inputs in place (see "Single
 * copy"); no_push_in_place, the rank whose pushes are skipped where its
 * output is its input (plan.Plan.no_push_in_place; -1: none). */
typedef struct {
    PyObject_HEAD
    int64_t *data;              /* rows, row_starts, waits, wait_starts, one allocation */
    Call call;                  /* all but the arrays' addresses (input, output) and the runner's bases */
    uint64_t description_hash;
} Plan;

static void Plan_dealloc(Plan *self)
{
    PyMem_Free(self->data);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Plan_init(Plan *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"rows", "row_starts", "waits", "wait_starts", "scratch_offset", "workspace_bytes",
                            "type", "op", "nranks", "description_hash", "single_copy", "no_push_in_place",
                            NULL};   /* SINGLE_COPY_* */
    PyObject *objects[4];
    long long scratch_offset, workspace_bytes;
    int type, op, nranks, single_copy, no_push_in_place = -1;
    unsigned long long description_hash;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOLLiiiKi|i", names, &objects[0], &objects[1], &objects[2],
                                     &objects[3], &scratch_offset, &workspace_bytes, &type, &op, &nranks,
                                     &description_hash, &single_copy, &no_push_in_place))
        return -1;
    if (type < 0 || type >= NTYPES || op < 0 || op > OP_AVG || nranks < 1 || nranks > MAX_SOURCES
        || single_copy < SINGLE_COPY_NONE || single_copy > SINGLE_COPY_PUSHES) {
        PyErr_SetString(PyExc_ValueError,
                        "Plan(): an element type, op, rank count or single-copy form no runner takes");
        return -1;
    }
    Py_buffer views[4];
    const int64_t *arrays[4];
    int held = 0, failed = -1;
    for (; held < 4; held++)
        if ((arrays[held] = int64s(objects[held], &views[held], 0)) == NULL)
            goto done;
    Py_ssize_t lengths[4] = {views[0].len / 8, views[1].len / 8, views[2].len / 8, views[3].len / 8};
    int64_t phases = lengths[1] - 1, width = views[0].ndim == 2 ? views[0].shape[1] : SRC0;
    if (phases < 0 || lengths[3] != phases + 1 || width < SRC0
        || (phases > 0 && (arrays[1][phases] * width > lengths[0] || arrays[3][phases] * 2 > lengths[2]))) {
        PyErr_SetString(PyExc_ValueError, "Plan(): the plan's arrays do not fit together");
        goto done;
    }
    PyMem_Free(self->data);
    self->data = PyMem_Malloc(8 * (size_t)(lengths[0] + lengths[1] + lengths[2] + lengths[3]) + 8);
    if (self->data == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *at = self->data, *copies[4];
    for (int i = 0; i < 4; i++) {
        copies[i] = at;
        memcpy(at, arrays[i], 8 * (size_t)lengths[i]);
        at += lengths[i];
    }
    static const size_t itemsizes[NTYPES] = {4, 8, 1, 1, 2, 2, 4, 4, 8, 8};   /* host_folds.h's T_ order */
    memset(&self->call, 0, sizeof self->call);
    self->call.rows = copies[0];
    self->call.row_starts = copies[1];
    self->call.waits = copies[2];
    self->call.wait_starts = copies[3];
    self->call.phases = phases;
    self->call.width = width;
    self->call.scratch_offset = scratch_offset;
    self->call.workspace_bytes = workspace_bytes;
    self->call.type = type;
    self->call.op = op;
    self->call.nranks = nranks;
    self->call.single_copy = single_copy;
    self->call.no_push_in_place = no_push_in_place;
    self->call.itemsize = itemsizes[type];
    self->description_hash = description_hash;
    failed = 0;
done:
    while (held > 0)
        PyBuffer_Release(&views[--held]);
    return failed;
}

static PyTypeObject PlanType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "collectives.executors._host_plan.Plan",
    .tp_basicsize = sizeof(Plan),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Plan_init,
    .tp_dealloc = (destructor)Plan_dealloc,
    .tp_doc = "One rank's part of a plan, prepared for a Runner (see _host_plan.c).",
};

/* runner.run(plan, input, output, start_phase, deadline)
 * -> 0 once the rank's phases of `plan` (a Plan) ran, else (status, peer,
 * have, need, seq, phase): a wait's failure (shm_waits.h), MISMATCH,
 * NEED_GROW or NEED_OPEN at `phase` (call again from there), or BAD_PLAN.
 * input and output are addresses (0 where the plan names no such buffer).
 * A call from phase 0 is a new call: its number (the row's SEQ + 1),
 * counter base (the row's COUNTER) and signature are taken then, and kept
 * for the calls that resume it; it first finds this rank's workspace of
 * the generation opened (else NEED_OPEN naming this rank). For a
 * single-copy plan, REFUSED means run the call again on the staged plan. */
static PyObject *run_plan(Runner *self, Plan *plan, char *input, char *output, int64_t start_phase, double deadline)
{
    Call call = plan->call;
    call.input = input;
    call.output = output;
    if (call.nranks != self->waits.nranks || start_phase < 0 || start_phase > call.phases) {
        PyErr_SetString(PyExc_ValueError, "run(): a plan of another rank count, or a phase it does not have");
        return NULL;
    }
    call.bases = self->bases;
    call.generations = self->generations;
    call.peer_slices = &self->peer_slices;
    call.peer_slices_bytes = &self->peer_slices_bytes;
    call.pushes_reached = &self->pushes_reached;

    Waits *w = &self->waits;
    if (start_phase == 0) {   /* a new call */
        const int64_t *mine = &w->rows[w->rank * ROW_SLOTS];
        if (load_acquire(&mine[GEN]) != call.generations[w->rank])   /* grown since: Python opens it */
            return Py_BuildValue("(iiLLLL)", NEED_OPEN, w->rank, 0LL, 0LL, (long long)(mine[SEQ] + 1), 0LL);
        self->base = mine[COUNTER];
        self->seq = mine[SEQ] + 1;
        self->signature = call_signature(plan->description_hash, self->seq);
    }
    int64_t base = self->base, seq = self->seq, signature = self->signature;
    w->deadline = deadline;
    w->failed_peer = -1;
    w->failed_have = w->failed_need = 0;
    int64_t stopped_at = start_phase;
    int status;
    PyThreadState *released = PyEval_SaveThread();
    if (__atomic_load_n(&w->header[ABORT], __ATOMIC_ACQUIRE))
        status = ABORTED;
    else
        status = run_phases(w, &call, start_phase, base, seq, signature, &stopped_at, &self->waits_made, &released);
    PyEval_RestoreThread(released);
    if (status == INTERRUPTED)
        return NULL;   /* the signal handler's exception */
    if (status == OK)
        return PyLong_FromLong(OK);
    return Py_BuildValue("(iiLLLL)", status, w->failed_peer, (long long)w->failed_have, (long long)w->failed_need,
                         (long long)seq, (long long)stopped_at);
}

static PyObject *Runner_run(Runner *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 || !PyObject_TypeCheck(args[0], &PlanType)) {
        PyErr_SetString(PyExc_TypeError, "run(plan, input, output, start_phase, deadline): see _host_plan.c");
        return NULL;
    }
    char *input = (char *)(uintptr_t)PyLong_AsUnsignedLongLong(args[1]);
    char *output = (char *)(uintptr_t)PyLong_AsUnsignedLongLong(args[2]);
    int64_t start_phase = PyLong_AsLongLong(args[3]);
    double deadline = PyFloat_AsDouble(args[4]);
    if (PyErr_Occurred())
        return NULL;
    return run_plan(self, (Plan *)args[0], input, output, start_phase, deadline);
}

/* ---- Repeats: a repeated call's shortcut -----------------------------------
 *
 * A call of the plans' path repeated on the very NumPy arrays of an earlier
 * call, with the same arguments, runs the plan that call bound to them
 * (CompiledPlans.bind) from here: the communicator tries
 * `runner.repeat(...)` first (Communicator._collective), so such a call
 * runs no Python between the collective's method and the run, as the
 * compiled loop's calls do (its shortcuts, _shmloop.c). The communicator
 * remembers a call here once it has bound it (`remember`), and forgets it
 * when one of its arrays goes (`forget`) or when it forgets all its calls.
 * A call is recognised as the communicator recognises it: the arrays by
 * their ids and their states (_arraystate.numpy_states: address, dtype,
 * flags, shape) equal to the remembered ones, its collective, op,
 * algorithm (the same objects, or equal ones) and root (an int). Anything
 * else returns None, and the Python path runs the call. A run that stops
 * (a workspace to grow or open, a failure) goes on in Python, as a bound
 * plan's does (on_stop: CompiledPlans._stopped_repeat). */

enum { REPEATS_KEPT = 32 };

typedef struct {
    uintptr_t x_id, out_id;         /* ids; out_id 0: in place (the result is x); x_id 0: a free slot */
    PyObject *collective, *op, *algorithm, *states;   /* held */
    long root;
    PyObject *entry;                /* held: (plan, Plan, description), CompiledPlans._prepare's */
    PyObject *view;                 /* held, or NULL: the result is x[view] (a reduce_scatter's or a scatter's
                                     * own block of x, without `out`), else out, or x in place */
    char *input, *output;           /* the arrays' addresses the plan is bound to */
} Repeat;

/* ---- Shapes: the same call on new arrays ------------------------------------
 *
 * A call on other arrays than any remembered one, but of a shape the
 * communicator has run on the plans' path (remember_shape), arrays whose
 * states differ from that call's only in their data addresses (the same
 * dtype, flags, dimensions: so the same checks pass and the same plan
 * binds) and, with `out`, that do not overlap (as the shape's did not),
 * runs that plan on the new addresses: where the plan reads (INPUT) and
 * writes (OUTPUT) lie at the same offsets from x's or out's data as in the
 * remembered call. An out that overlapped x (in place: a reduce_scatter's
 * out=x's own block, a view made anew each call) is taken where it lies
 * at the same offset from x's data as the remembered one did, the plan
 * the same. So a new array each call (a result made per step, a tensor's
 * fresh buffer) runs no Python either, as the compiled loop's calls do.
 * Runs are counted with the Repeats'. */

enum { SHAPES_KEPT = 16 };

typedef struct {
    PyObject *collective, *op, *algorithm;   /* held; collective NULL: a free slot */
    long root;
    int has_out;                    /* out given (else in place, or the result is x[view]) */
    PyObject *states;               /* held: the shape's arrays' states, their data words not compared */
    PyObject *dtype;                /* held: x's dtype, whose address the states hold */
    PyObject *entry;                /* held: (plan, Plan, description) */
    PyObject *view;                 /* held, or NULL: as a Repeat's */
    PyObject *make_output;          /* held, or NULL: makes a new out each call (an allgather or gather without
                                     * out), whose states are then not compared (a new array of one shape) */
    int input_base, output_base;    /* where INPUT and OUTPUT lie: 0 in x's data, 1 in out's, -1 none (address 0) */
    int64_t input_offset, output_offset;   /* bytes from that data's start */
    int64_t x_bytes, out_bytes;     /* the arrays' sizes (the same for every call of the shape) */
    int out_overlaps;               /* out overlapped x: a call's must lie out_from_x bytes from x's data */
    int64_t out_from_x;
} Shape;

struct Repeats {
    PyObject *states_of;            /* _arraystate.numpy_states */
    PyObject *ndarray;              /* numpy.ndarray: the one array type taken */
    PyObject *on_stop;              /* on_stop(entry, input, output, deadline, result, error) */
    int next;                       /* the slot a new call takes when none is free */
    Repeat slots[REPEATS_KEPT];
    int next_shape;                 /* the shape slot a new shape takes when none is free */
    Shape shapes[SHAPES_KEPT];
};

static void shape_clear(Shape *shape)
{
    PyObject *collective = shape->collective;
    shape->collective = NULL;   /* first, as repeat_clear does */
    Py_XDECREF(collective);
    Py_CLEAR(shape->op);
    Py_CLEAR(shape->algorithm);
    Py_CLEAR(shape->states);
    Py_CLEAR(shape->dtype);
    Py_CLEAR(shape->entry);
    Py_CLEAR(shape->view);
    Py_CLEAR(shape->make_output);
}

static void repeat_clear(Repeat *r)
{
    r->x_id = r->out_id = 0;   /* first: a release below may run Python that looks the slots up */
    Py_CLEAR(r->collective);
    Py_CLEAR(r->op);
    Py_CLEAR(r->algorithm);
    Py_CLEAR(r->states);
    Py_CLEAR(r->entry);
    Py_CLEAR(r->view);
}

static void repeats_free(Runner *self)
{
    struct Repeats *repeats = self->repeats;
    if (repeats == NULL)
        return;
    for (int i = 0; i < REPEATS_KEPT; i++)
        repeat_clear(&repeats->slots[i]);
    for (int i = 0; i < SHAPES_KEPT; i++)
        shape_clear(&repeats->shapes[i]);
    Py_CLEAR(repeats->states_of);
    Py_CLEAR(repeats->ndarray);
    Py_CLEAR(repeats->on_stop);
    PyMem_Free(repeats);
    self->repeats = NULL;
}

/* runner.bind_repeats(states_of, ndarray, on_stop): what the shortcut reads
 * the arrays' states with, the array type it takes, and whom a run that
 * stops goes on with. */
static PyObject *Runner_bind_repeats(Runner *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyCallable_Check(args[0]) || !PyType_Check(args[1]) || !PyCallable_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "bind_repeats(states_of, ndarray, on_stop)");
        return NULL;
    }
    repeats_free(self);
    struct Repeats *repeats = PyMem_Calloc(1, sizeof *repeats);
    if (repeats == NULL)
        return PyErr_NoMemory();
    repeats->states_of = Py_NewRef(args[0]);
    repeats->ndarray = Py_NewRef(args[1]);
    repeats->on_stop = Py_NewRef(args[2]);
    self->repeats = repeats;
    Py_RETURN_NONE;
}

/* The states of the call's arrays: of (x,) in place, of (x, out) else. */
static PyObject *states_now(struct Repeats *repeats, PyObject *x, PyObject *out)
{
    PyObject *arrays = out == Py_None ? PyTuple_Pack(1, x) : PyTuple_Pack(2, x, out);
    if (arrays == NULL)
        return NULL;
    PyObject *states = PyObject_CallOneArg(repeats->states_of, arrays);
    Py_DECREF(arrays);
    return states;
}

/* The same object, or an equal one (as the communicator's dictionary of calls compares them). */
static int same_argument(PyObject *remembered, PyObject *given)
{
    if (remembered == given)
        return 1;
    int equal = PyObject_RichCompareBool(remembered, given, Py_EQ);
    if (equal < 0) {
        PyErr_Clear();
        return 0;
    }
    return equal;
}

/* Whether a slot's arguments (*slot_collective, *slot_op, *slot_algorithm)
 * are the given ones: the same objects, or equal ones. Comparing equal
 * ones may run Python, and that may clear the slot (an array's weak
 * reference forgets a call): the objects are held while compared, and
 * the slot counts only if it still holds them after. */
static int same_arguments(PyObject **slot_collective, PyObject **slot_op, PyObject **slot_algorithm,
                          PyObject *collective, PyObject *op, PyObject *algorithm)
{
    if (*slot_collective == collective && *slot_op == op && *slot_algorithm == algorithm)
        return 1;   /* the same objects: no Python ran */
    PyObject *held[3] = {Py_NewRef(*slot_collective), Py_NewRef(*slot_op), Py_NewRef(*slot_algorithm)};
    int same = same_argument(held[0], collective) && same_argument(held[1], op) && same_argument(held[2], algorithm)
               && *slot_collective == held[0] && *slot_op == held[1] && *slot_algorithm == held[2];
    for (int j = 0; j < 3; j++)
        Py_DECREF(held[j]);
    return same;
}

/* What a call returns: out, x in place, or x[view] (the view released). */
static PyObject *result_of(PyObject *x, PyObject *out, PyObject *view)
{
    if (view == NULL)
        return Py_NewRef(out == Py_None ? x : out);
    PyObject *block = PyObject_GetItem(x, view);
    Py_DECREF(view);
    return block;
}

/* The remembered call of these arrays and arguments, or NULL. */
static Repeat *find_repeat(struct Repeats *repeats, uintptr_t x_id, uintptr_t out_id, PyObject *collective,
                           PyObject *op, long root, PyObject *algorithm)
{
    for (int i = 0; i < REPEATS_KEPT; i++) {
        Repeat *r = &repeats->slots[i];
        if (r->x_id != x_id || r->out_id != out_id || r->root != root)
            continue;
        if (same_arguments(&r->collective, &r->op, &r->algorithm, collective, op, algorithm)
            && r->x_id == x_id && r->out_id == out_id)   /* (still: a comparison may have run Python) */
            return r;
    }
    return NULL;
}

/* runner.remember(collective, op, root, algorithm, x, out, entry, input, output, view): a call
 * the communicator bound (out None: in place, or, with a view, the result is x[view]), to be
 * recognised from now on. */
static PyObject *Runner_remember(Runner *self, PyObject *const *args, Py_ssize_t nargs)
{
    struct Repeats *repeats = self->repeats;
    if (nargs != 10 || !PyLong_CheckExact(args[2]) || !PyTuple_Check(args[6]) || PyTuple_GET_SIZE(args[6]) != 3
        || !PyObject_TypeCheck(PyTuple_GET_ITEM(args[6], 1), &PlanType) || (args[9] != Py_None && args[5] != Py_None)) {
        PyErr_SetString(PyExc_TypeError,
                        "remember(collective, op, root, algorithm, x, out, entry, input, output, view)");
        return NULL;
    }
    if (repeats == NULL)
        Py_RETURN_NONE;
    long root = PyLong_AsLong(args[2]);
    char *input = (char *)(uintptr_t)PyLong_AsUnsignedLongLong(args[7]);
    char *output = (char *)(uintptr_t)PyLong_AsUnsignedLongLong(args[8]);
    if (PyErr_Occurred())
        return NULL;
    PyObject *states = states_now(repeats, args[4], args[5]);
    if (states == NULL)
        return NULL;
    uintptr_t x_id = (uintptr_t)args[4], out_id = args[5] == Py_None ? 0 : (uintptr_t)args[5];
    Repeat *slot = find_repeat(repeats, x_id, out_id, args[0], args[1], root, args[3]);   /* the same call again */
    for (int i = 0; i < REPEATS_KEPT && slot == NULL; i++)
        if (repeats->slots[i].x_id == 0)
            slot = &repeats->slots[i];
    if (slot == NULL) {   /* all taken: the oldest goes */
        slot = &repeats->slots[repeats->next];
        repeats->next = (repeats->next + 1) % REPEATS_KEPT;
    }
    repeat_clear(slot);
    slot->x_id = x_id;
    slot->out_id = out_id;
    slot->collective = Py_NewRef(args[0]);
    slot->op = Py_NewRef(args[1]);
    slot->algorithm = Py_NewRef(args[3]);
    slot->states = states;
    slot->root = root;
    slot->entry = Py_NewRef(args[6]);
    slot->input = input;
    slot->output = output;
    slot->view = args[9] == Py_None ? NULL : Py_NewRef(args[9]);
    Py_RETURN_NONE;
}

/* runner.forget(x_id, out_id): the calls of these arrays (out_id 0: in
 * place), whose x or out went; runner.forget(None): every call. */
static PyObject *Runner_forget(Runner *self, PyObject *const *args, Py_ssize_t nargs)
{
    struct Repeats *repeats = self->repeats;
    if (nargs == 1 && args[0] == Py_None) {
        for (int i = 0; repeats != NULL && i < REPEATS_KEPT; i++)
            repeat_clear(&repeats->slots[i]);
        Py_RETURN_NONE;
    }
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "forget(x_id, out_id) or forget(None)");
        return NULL;
    }
    uintptr_t x_id = (uintptr_t)PyLong_AsUnsignedLongLong(args[0]);
    uintptr_t out_id = (uintptr_t)PyLong_AsUnsignedLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    for (int i = 0; repeats != NULL && i < REPEATS_KEPT; i++)
        if (repeats->slots[i].x_id == x_id && repeats->slots[i].out_id == out_id)
            repeat_clear(&repeats->slots[i]);
    Py_RETURN_NONE;
}

/* Run a remembered call's plan (`entry`: CompiledPlans._prepare's) on
 * `input` and `output`, and return its result (out, x in place, or
 * x[view]); a run that stops goes on in Python (on_stop). Takes the
 * references to entry and view. */
static PyObject *run_remembered(Runner *self, PyObject *entry, char *input, char *output, PyObject *view,
                                PyObject *x, PyObject *out, double timeout)
{
    struct Repeats *repeats = self->repeats;
    Py_XSETREF(self->last, Py_NewRef(PyTuple_GET_ITEM(entry, 0)));
    self->repeats_run++;
    double deadline = now_seconds() + timeout;
    PyObject *result = run_plan(self, (Plan *)PyTuple_GET_ITEM(entry, 1), input, output, 0, deadline);
    if (result != NULL && PyLong_CheckExact(result)) {   /* done */
        Py_DECREF(result);
        Py_DECREF(entry);
        return result_of(x, out, view);
    }
    /* stopped: Python goes on with the call (a workspace to grow or open), or raises its failure */
    PyObject *error = NULL;
    if (result == NULL && (error = take_raised()) == NULL) {
        Py_DECREF(entry);
        Py_XDECREF(view);
        return NULL;
    }
    PyObject *on_stop = Py_NewRef(repeats->on_stop);
    PyObject *went_on = PyObject_CallFunction(on_stop, "OKKdOO", entry, (unsigned long long)(uintptr_t)input,
                                              (unsigned long long)(uintptr_t)output, deadline,
                                              result != NULL ? result : Py_None, error != NULL ? error : Py_None);
    Py_DECREF(on_stop);
    Py_XDECREF(result);
    Py_XDECREF(error);
    Py_DECREF(entry);
    if (went_on == NULL || went_on == Py_False) {   /* False: a refused single copy, run again from Python */
        Py_XDECREF(view);
        if (went_on == NULL)
            return NULL;
        Py_DECREF(went_on);
        Py_RETURN_NONE;
    }
    Py_DECREF(went_on);
    return result_of(x, out, view);
}


/* The data address of a call's first (x) or second (out) array, from its states. */
static intptr_t data_of(PyObject *states, int second)
{
    const intptr_t *word = (const intptr_t *)PyBytes_AS_STRING(states);
    return second ? word[4 + word[3]] : word[0];
}

/* Whether two calls' states (per array: data, dtype, flags, ndim, each
 * dimension) differ at most in the arrays' data words. */
static int same_but_addresses(PyObject *then, PyObject *now)
{
    if (!PyBytes_CheckExact(then) || !PyBytes_CheckExact(now) || PyBytes_GET_SIZE(then) != PyBytes_GET_SIZE(now))
        return 0;
    const intptr_t *a = (const intptr_t *)PyBytes_AS_STRING(then), *b = (const intptr_t *)PyBytes_AS_STRING(now);
    Py_ssize_t words = PyBytes_GET_SIZE(now) / (Py_ssize_t)sizeof(intptr_t), i = 0;
    while (i < words) {
        if (i + 4 > words || a[i + 1] != b[i + 1] || a[i + 2] != b[i + 2] || a[i + 3] != b[i + 3] || b[i + 3] < 0
            || i + 4 + b[i + 3] > words || memcmp(a + i + 4, b + i + 4, (size_t)b[i + 3] * sizeof *a) != 0)
            return 0;
        i += 4 + b[i + 3];
    }
    return 1;
}

static int apart(intptr_t x, int64_t x_bytes, intptr_t out, int64_t out_bytes)
{
    return x + x_bytes <= out || out + out_bytes <= x;
}

/* Where `address` lies: in x's data (base 0) or out's (1), at *offset; -1 for address 0; -2 elsewhere. */
static int locate(intptr_t address, intptr_t x, int64_t x_bytes, intptr_t out, int64_t out_bytes, int64_t *offset)
{
    *offset = 0;
    if (address == 0)
        return -1;
    if (address >= x && address < x + x_bytes) {
        *offset = address - x;
        return 0;
    }
    if (out != 0 && address >= out && address < out + out_bytes) {
        *offset = address - out;
        return 1;
    }
    return -2;
}

static char *address_in(int base, int64_t offset, intptr_t x, intptr_t out)
{
    return base < 0 ? NULL : (char *)(base == 0 ? x : out) + offset;
}

/* The remembered shape of these arguments whose arrays' states differ from
 * `states` at most in their data words, or NULL. */
static Shape *find_shape(struct Repeats *repeats, PyObject *collective, PyObject *op, long root, PyObject *algorithm,
                         int has_out, PyObject *states)
{
    for (int i = 0; i < SHAPES_KEPT; i++) {
        Shape *shape = &repeats->shapes[i];
        if (shape->collective == NULL || shape->root != root || shape->has_out != has_out
            || !same_but_addresses(shape->states, states))
            continue;
        if (same_arguments(&shape->collective, &shape->op, &shape->algorithm, collective, op, algorithm))
            return shape;
    }
    return NULL;
}

/* runner.remember_shape(collective, op, root, algorithm, x, out, entry,
 * input, output, view, x_bytes, out_bytes, make_output): a call the
 * communicator ran on the plans' path (out None: in place, or, with a
 * view, the result is x[view]; with make_output, a callable, `out` is the
 * output the call made, which later calls make with it), whose shape later
 * calls on new arrays may take (see Shapes); nothing where its plan's
 * buffers do not lie in x and out. */
static PyObject *Runner_remember_shape(Runner *self, PyObject *const *args, Py_ssize_t nargs)
{
    struct Repeats *repeats = self->repeats;
    if (nargs != 13 || !PyLong_CheckExact(args[2]) || !PyTuple_Check(args[6]) || PyTuple_GET_SIZE(args[6]) != 3
        || !PyObject_TypeCheck(PyTuple_GET_ITEM(args[6], 1), &PlanType) || (args[9] != Py_None && args[5] != Py_None)
        || (args[12] != Py_None && (!PyCallable_Check(args[12]) || args[5] == Py_None))) {
        PyErr_SetString(PyExc_TypeError, "remember_shape(collective, op, root, algorithm, x, out, entry, input, "
                                         "output, view, x_bytes, out_bytes, make_output)");
        return NULL;
    }
    PyObject *x = args[4], *out = args[5], *make_output = args[12] == Py_None ? NULL : args[12];
    int has_out = out != Py_None && make_output == NULL;   /* (the caller's: a made out is no argument) */
    if (repeats == NULL || (PyObject *)Py_TYPE(x) != repeats->ndarray
        || (has_out && (PyObject *)Py_TYPE(out) != repeats->ndarray))
        Py_RETURN_NONE;
    long root = PyLong_AsLong(args[2]);
    intptr_t input = (intptr_t)PyLong_AsUnsignedLongLong(args[7]), output = (intptr_t)PyLong_AsUnsignedLongLong(args[8]);
    int64_t x_bytes = PyLong_AsLongLong(args[10]), out_bytes = PyLong_AsLongLong(args[11]);
    if (PyErr_Occurred())
        return NULL;
    PyObject *states = states_now(repeats, x, out);
    if (states == NULL)
        return NULL;
    intptr_t x_data = data_of(states, 0), out_data = out != Py_None ? data_of(states, 1) : 0;
    if (make_output != NULL) {   /* the shape is x's alone */
        Py_DECREF(states);
        if ((states = states_now(repeats, x, Py_None)) == NULL)
            return NULL;
    }
    int64_t input_offset, output_offset;
    int input_base = locate(input, x_data, x_bytes, out_data, out_bytes, &input_offset);
    int output_base = locate(output, x_data, x_bytes, out_data, out_bytes, &output_offset);
    if (x_bytes <= 0 || input_base == -2 || output_base == -2
        || (out != Py_None && out_bytes <= 0)) {
        Py_DECREF(states);
        Py_RETURN_NONE;
    }
    PyObject *dtype = PyObject_GetAttrString(x, "dtype");
    if (dtype == NULL) {
        Py_DECREF(states);
        return NULL;
    }
    Shape *slot = find_shape(repeats, args[0], args[1], root, args[3], has_out, states);   /* the same shape again */
    for (int i = 0; i < SHAPES_KEPT && slot == NULL; i++)
        if (repeats->shapes[i].collective == NULL)
            slot = &repeats->shapes[i];
    if (slot == NULL) {   /* all taken: the oldest goes */
        slot = &repeats->shapes[repeats->next_shape];
        repeats->next_shape = (repeats->next_shape + 1) % SHAPES_KEPT;
    }
    shape_clear(slot);
    slot->op = Py_NewRef(args[1]);
    slot->algorithm = Py_NewRef(args[3]);
    slot->root = root;
    slot->has_out = has_out;
    slot->states = states;
    slot->dtype = dtype;
    slot->entry = Py_NewRef(args[6]);
    slot->view = args[9] == Py_None ? NULL : Py_NewRef(args[9]);
    slot->make_output = Py_XNewRef(make_output);
    slot->input_base = input_base;
    slot->output_base = output_base;
    slot->input_offset = input_offset;
    slot->output_offset = output_offset;
    slot->x_bytes = x_bytes;
    slot->out_bytes = out != Py_None ? out_bytes : 0;
    slot->out_overlaps = out != Py_None && !apart(x_data, x_bytes, out_data, out_bytes);
    slot->out_from_x = out != Py_None ? (int64_t)(out_data - x_data) : 0;
    slot->collective = Py_NewRef(args[0]);   /* last: the slot is taken once it is whole */
    Py_RETURN_NONE;
}

/* runner.forget_shapes(): every shape (the communicator's choice of path
 * for some of them changed: shm.py's exchange limits). */
static PyObject *Runner_forget_shapes(Runner *self, PyObject *Py_UNUSED(ignored))
{
    for (int i = 0; self->repeats != NULL && i < SHAPES_KEPT; i++)
        shape_clear(&self->repeats->shapes[i]);
    Py_RETURN_NONE;
}

/* A call of no remembered arrays: run as a remembered shape's (see Shapes), or None. */
static PyObject *repeat_shape(Runner *self, PyObject *const *args, PyObject *x, PyObject *out, long root)
{
    struct Repeats *repeats = self->repeats;
    int has_out = out != Py_None, any = 0;
    for (int i = 0; i < SHAPES_KEPT && !any; i++)   /* (no states read for a call of no shape kept) */
        any = repeats->shapes[i].collective != NULL && repeats->shapes[i].root == root
              && repeats->shapes[i].has_out == has_out;
    if (!any)
        Py_RETURN_NONE;
    double timeout = PyFloat_AsDouble(args[6]);
    if (timeout == -1.0 && PyErr_Occurred())
        return NULL;
    PyObject *states = states_now(repeats, x, out);
    if (states == NULL)
        return NULL;
    Shape *shape = find_shape(repeats, args[0], args[2], root, args[5], has_out, states);
    intptr_t x_data = data_of(states, 0), out_data = has_out ? data_of(states, 1) : 0;
    Py_DECREF(states);
    if (shape == NULL || (has_out && (shape->out_overlaps ? (int64_t)(out_data - x_data) != shape->out_from_x
                                                          : !apart(x_data, shape->x_bytes, out_data, shape->out_bytes))))
        Py_RETURN_NONE;
    PyObject *entry = Py_NewRef(shape->entry), *view = Py_XNewRef(shape->view), *made = NULL;
    int input_base = shape->input_base, output_base = shape->output_base;
    int64_t input_offset = shape->input_offset, output_offset = shape->output_offset;
    if (shape->make_output != NULL) {   /* a new out, as the call made it (a new array: apart from x) */
        PyObject *make_output = Py_NewRef(shape->make_output);
        made = PyObject_CallNoArgs(make_output);
        Py_DECREF(make_output);
        PyObject *made_states = made == NULL ? NULL : states_now(repeats, x, made);
        if (made_states == NULL) {
            Py_XDECREF(made);
            Py_DECREF(entry);
            Py_XDECREF(view);
            return NULL;
        }
        out_data = data_of(made_states, 1);
        Py_DECREF(made_states);
        out = made;
    }
    PyObject *result = run_remembered(self, entry, address_in(input_base, input_offset, x_data, out_data),
                                      address_in(output_base, output_offset, x_data, out_data), view, x, out,
                                      timeout);
    Py_XDECREF(made);
    return result;
}

/* runner.repeat(collective, x, op, out, root, algorithm, timeout) -> the
 * result (out, or x in place) once a remembered call, or a call of a
 * remembered shape on new arrays, ran; None where it is neither (the
 * Python path runs it); failures raise (on_stop's). */
static PyObject *Runner_repeat(Runner *self, PyObject *const *args, Py_ssize_t nargs)
{
    struct Repeats *repeats = self->repeats;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "repeat(collective, x, op, out, root, algorithm, timeout)");
        return NULL;
    }
    PyObject *x = args[1], *out = args[3];
    if (repeats == NULL || (PyObject *)Py_TYPE(x) != repeats->ndarray
        || (out != Py_None && (PyObject *)Py_TYPE(out) != repeats->ndarray) || !PyLong_CheckExact(args[4]))
        Py_RETURN_NONE;
    long root = PyLong_AsLong(args[4]);
    if (root == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Repeat *found = find_repeat(repeats, (uintptr_t)x, out == Py_None ? 0 : (uintptr_t)out, args[0], args[2], root,
                                args[5]);
    if (found == NULL)
        return repeat_shape(self, args, x, out, root);
    /* What the run needs, held from here on: reading the states may run
     * Python (a collection, an array's weak reference) that forgets the
     * slot, and so may another thread while the run releases the GIL. */
    PyObject *entry = Py_NewRef(found->entry), *remembered = Py_NewRef(found->states), *view = Py_XNewRef(found->view);
    char *input = found->input, *output = found->output;
    double timeout = PyFloat_AsDouble(args[6]);
    PyObject *states = timeout == -1.0 && PyErr_Occurred() ? NULL : states_now(repeats, x, out);
    if (states == NULL) {
        Py_DECREF(entry);
        Py_DECREF(remembered);
        Py_XDECREF(view);
        return NULL;
    }
    int same = PyBytes_CheckExact(states) && PyBytes_CheckExact(remembered)
               && PyBytes_GET_SIZE(states) == PyBytes_GET_SIZE(remembered)
               && memcmp(PyBytes_AS_STRING(states), PyBytes_AS_STRING(remembered),
                         (size_t)PyBytes_GET_SIZE(states)) == 0;
    Py_DECREF(states);
    Py_DECREF(remembered);
    if (!same) {
        Py_DECREF(entry);
        Py_XDECREF(view);
        Py_RETURN_NONE;
    }
    return run_remembered(self, entry, input, output, view, x, out, timeout);
}

static PyObject *Runner_call(Runner *self, PyObject *Py_UNUSED(ignored))
{
    return Py_BuildValue("(LLL)", (long long)self->seq, (long long)self->base, (long long)self->signature);
}

static void Runner_release_arrays(Runner *self)
{
    if (self->bases != NULL)
        PyBuffer_Release(&self->bases_view);
    if (self->generations != NULL)
        PyBuffer_Release(&self->generations_view);
    self->bases = self->generations = NULL;
}

static void Runner_dealloc(Runner *self)
{
    Runner_release_arrays(self);
    repeats_free(self);
    Py_CLEAR(self->last);
    free(self->peer_slices);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Runner_init(Runner *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"header", "rows", "rank", "nranks", "spin", "yield_seconds", "bases", "generations",
                            NULL};
    unsigned long long header, rows;
    int rank, nranks;
    long spin;
    double yield_seconds;
    PyObject *bases, *generations;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KKiildOO", names, &header, &rows, &rank, &nranks, &spin,
                                     &yield_seconds, &bases, &generations))
        return -1;
    if (nranks < 1 || nranks > MAX_SOURCES || rank < 0 || rank >= nranks) {
        PyErr_SetString(PyExc_ValueError, "a runner has 1 to 256 ranks");
        return -1;
    }
    Runner_release_arrays(self);
    if ((self->bases = int64s(bases, &self->bases_view, nranks)) == NULL)
        return -1;
    if ((self->generations = int64s(generations, &self->generations_view, nranks)) == NULL) {
        Runner_release_arrays(self);
        return -1;
    }
    memset(&self->waits, 0, sizeof self->waits);
    self->waits.header = (int64_t *)(uintptr_t)header;
    self->waits.rows = (int64_t *)(uintptr_t)rows;
    self->waits.rank = rank;
    self->waits.nranks = nranks;
    self->waits.spin = spin;
    self->waits.yield_seconds = yield_seconds;
    self->base = self->seq = self->signature = 0;
    self->waits_made = self->repeats_run = 0;
    self->pushes_reached = 0;
    repeats_free(self);
    Py_XSETREF(self->last, Py_NewRef(Py_None));
    return 0;
}

/* The tests' hooks (module functions below): a flag, or seconds, set. */
static PyObject *set_test_flag(int *flag, PyObject *arg)
{
    int value = PyObject_IsTrue(arg);
    if (value < 0)
        return NULL;
    *flag = value;
    Py_RETURN_NONE;
}

static PyObject *set_test_seconds(double *seconds, PyObject *arg)
{
    double value = PyFloat_AsDouble(arg);
    if (value == -1.0 && PyErr_Occurred())
        return NULL;
    *seconds = value;
    Py_RETURN_NONE;
}

static PyObject *py_test_refuse_reads(PyObject *Py_UNUSED(self), PyObject *arg)
{
    return set_test_flag(&refuse_for_tests, arg);
}

static PyObject *py_test_refuse_pushes(PyObject *Py_UNUSED(self), PyObject *arg)
{
    return set_test_flag(&refuse_pushes_for_tests, arg);
}

static PyObject *py_test_stall_reads(PyObject *Py_UNUSED(self), PyObject *arg)
{
    return set_test_seconds(&read_stall_for_tests, arg);
}

static PyObject *py_test_stall_writes(PyObject *Py_UNUSED(self), PyObject *arg)
{
    return set_test_seconds(&write_stall_for_tests, arg);
}

/* runner.fence_writes(seconds) -> the peer still writing into peers'
 * memory `seconds` after this rank's call failed, or -1 (shm_waits.h's
 * fence_peer_writes: it sets the abort flag where the abort did not). */
static PyObject *Runner_fence_writes(Runner *self, PyObject *arg)
{
    double seconds = PyFloat_AsDouble(arg);
    if (seconds == -1.0 && PyErr_Occurred())
        return NULL;
    int still_writing;
    Py_BEGIN_ALLOW_THREADS
    still_writing = fence_peer_writes(&self->waits, seconds);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(still_writing);
}

static PyMethodDef module_functions[] = {
    {"test_refuse_pushes", py_test_refuse_pushes, METH_O,
     "test_refuse_pushes(flag): for the tests, this process's pushes into peers are refused (or no longer)"},
    {"test_stall_writes", py_test_stall_writes, METH_O,
     "test_stall_writes(seconds): for the tests, each push of this process waits so long inside its window"},
    {"test_stall_reads", py_test_stall_reads, METH_O,
     "test_stall_reads(seconds): for the tests, each single-copy read of this process waits so long first"},
    {"test_refuse_reads", py_test_refuse_reads, METH_O,
     "test_refuse_reads(flag): for the tests, this process's single-copy reads are refused (or no longer)"},
    {NULL},
};

static PyMethodDef Runner_methods[] = {
    {"run", (PyCFunction)(void (*)(void))Runner_run, METH_FASTCALL,
     "run(plan, input, output, start_phase, deadline): see _host_plan.c"},
    {"fence_writes", (PyCFunction)Runner_fence_writes, METH_O,
     "fence_writes(seconds) -> the peer still writing into peers' memory after so long, or -1"},
    {"call", (PyCFunction)Runner_call, METH_NOARGS,
     "call() -> (seq, base, signature) of the call running, or last run"},
    {"bind_repeats", (PyCFunction)(void (*)(void))Runner_bind_repeats, METH_FASTCALL,
     "bind_repeats(states_of, ndarray, on_stop): see Repeats in _host_plan.c"},
    {"remember", (PyCFunction)(void (*)(void))Runner_remember, METH_FASTCALL,
     "remember(collective, op, root, algorithm, x, out, entry, input, output, view): a bound call, recognised "
     "from now on"},
    {"remember_shape", (PyCFunction)(void (*)(void))Runner_remember_shape, METH_FASTCALL,
     "remember_shape(collective, op, root, algorithm, x, out, entry, input, output, view, x_bytes, out_bytes, "
     "make_output): "
     "a call's shape, taken from now on by calls on new arrays (see Shapes in _host_plan.c)"},
    {"forget_shapes", (PyCFunction)Runner_forget_shapes, METH_NOARGS,
     "forget_shapes(): every remembered shape"},
    {"forget", (PyCFunction)(void (*)(void))Runner_forget, METH_FASTCALL,
     "forget(x_id, out_id): the calls of these arrays; forget(None): every call"},
    {"repeat", (PyCFunction)(void (*)(void))Runner_repeat, METH_FASTCALL,
     "repeat(collective, x, op, out, root, algorithm, timeout): a remembered call's result once run, else None"},
    {NULL},
};

static PyMemberDef Runner_members[] = {
    {"waits_made", T_LONGLONG, offsetof(Runner, waits_made), READONLY, "peer waits made over the runner's life"},
    {"pushes_reached", T_INT, offsetof(Runner, pushes_reached), 0,
     "1 where every rank may push into every peer's output, -1 where not, 0 before a call found out "
     "(a shrunk communicator's runner is given its parent's)"},
    {"repeats_run", T_LONGLONG, offsetof(Runner, repeats_run), READONLY,
     "calls its Repeats ran (of remembered arrays, or of remembered shapes on new ones)"},
    {"last", T_OBJECT, offsetof(Runner, last), 0, "the plan of the last call run (CompiledPlans.last_plan), or None"},
    {NULL},
};

static PyTypeObject RunnerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "collectives.executors._host_plan.Runner",
    .tp_basicsize = sizeof(Runner),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Runner_init,
    .tp_dealloc = (destructor)Runner_dealloc,
    .tp_methods = Runner_methods,
    .tp_members = Runner_members,
    .tp_doc = "This rank's compiled plan executor over the control segment (addresses into mapped memory).",
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_host_plan",
    "The compiled plan executor of host ranks in separate processes (see _host_plan.c).", -1, module_functions,
};

PyMODINIT_FUNC PyInit__host_plan(void)
{
    if (PyType_Ready(&RunnerType) < 0 || PyType_Ready(&PlanType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&RunnerType);
    if (PyModule_AddObject(m, "Runner", (PyObject *)&RunnerType) < 0) {
        Py_DECREF(&RunnerType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&PlanType);
    if (PyModule_AddObject(m, "Plan", (PyObject *)&PlanType) < 0) {
        Py_DECREF(&PlanType);
        Py_DECREF(m);
        return NULL;
    }
    /* host_folds.h's element types, in their T_ order; the Python side maps dtypes by these names */
    PyModule_AddStringConstant(m, "TYPES", "float32 float64 int8 uint8 int16 uint16 int32 uint32 int64 uint64");
    PyModule_AddIntConstant(m, "GEN", GEN);
    PyModule_AddIntConstant(m, "CAP", CAP);
    if (add_status_constants(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
