/* Waiting between host ranks in separate processes, and the control
 * segment's slots the waits read (collectives/transport/layout.py says where
 * each is; protocol.py, fastpath.py and executors/host_process.py use them).
 * Included by the compiled loop (transport/_shmloop.c), the mailboxes
 * (transport/_mailbox.c), the across-node Programs (transport/_across.c)
 * and the compiled plan executor (executors/_host_plan.c); the including
 * file includes Python.h
 * first.
 *
 * Memory ordering: a rank writes its data, then publishes a counter with a
 * release store; a peer reads the counter with an acquire load, then the
 * data. C11 atomics give that order on every architecture (on x86-64 they
 * compile to plain moves; on aarch64 to stlr/ldar).
 *
 * Waits keep every guarantee of the Python waits: a deadline, the abort
 * flag, a dead peer (its pid), and the GIL released once a wait stops
 * spinning, so another thread of the process can run.
 *
 * A wait spins, then yields its core for a while, then sleeps on a futex
 * over the counter it waits for. Yielding is what ranks that outnumber the
 * cores need first: the rank waited for is often queued on the same core,
 * and a yield hands it the core in about a microsecond, where waking a
 * sleeper costs tens (an interrupt to another core, in a VM). But the
 * scheduler may also pick another waiter, again and again: a yield phase
 * without end made 4 MiB over 4 ranks on 2 cores take 25 ms instead of
 * 1.5 (bench/host_vs_mpich.py), so after a short while the wait sleeps,
 * which leaves the core to whoever can run. A sleeper counts itself in the
 * SLEEPERS slot of the row it waits on; a rank that publishes a counter
 * with a sequentially consistent store, then finds sleepers in its row,
 * wakes them. Either the sleeper's recheck sees the new value or the
 * publisher sees the sleeper (both orders are sequentially consistent),
 * and the kernel compares the futex word again before sleeping, so no
 * wake is lost. Sleeps last at most 10 ms: the abort flag, the deadline
 * and a peer's death wake no one, and are checked between sleeps.
 */

#ifndef COLLECTIVES_SHM_WAITS_H
#define COLLECTIVES_SHM_WAITS_H

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

/* How often a sleeping wait reads its peer's process (/proc: 10-30 us) and
 * lets Python's signal handlers run: a peer that died shows within this
 * long of the wait's sleep, which is most of what a survivor's recovery
 * costs (bench.chaos: 50 ms made a SIGKILL's recovery take 63 ms at the
 * median). protocol.py's Waiter uses the same period. MPI is looked at
 * less often (transport/mpi.py HEALTH_EVERY, WATCH_EVERY): at 10 ms a
 * survivor across pretend nodes hung inside MPICH's MPI_Test. */
#define LIVENESS_SECONDS 0.01
/* A wait's first look comes sooner: a survivor usually starts waiting on
 * its dead peer after the death, and with the first look a whole period
 * in, every death cost at least 10 ms to see. A wait that lasted this long
 * is long enough that a look (10-30 us) costs it little. */
#define FIRST_LOOK_SECONDS 0.002

/* ------------------------------------------------------------------------ */
/* The layout shared with protocol.py and fastpath.py (FastAllreduce        */
/* asserts ROW and HEADER against the Python constants; the slots are the  */
/* ones protocol.py lists).                                                */

enum { HEADER_SLOTS = 16, ROW_SLOTS = 16 };        /* int64 slots: 128 bytes each */
enum { ABORT = 0 };                                 /* header slot */
enum { COUNTER = 0, PID = 1, SEQ = 2, SIG = 3,      /* row slots (protocol.py) */
       SMALL_SIG = 6,                               /* 6 and 7: the merged step's call, by slot parity */
       STAGED = 8, REDUCED = 9,                     /* the pipelined path's chunk counters */
       SLEEPERS = 10,                               /* waits asleep on this row's counters */
       IN_ADDR = 11, OUT_ADDR = 12,                 /* the single-copy plans' buffers, this call */
       WRITING = 14 };                              /* 1 while writing into peers' memory (13 and 15: free) */
enum { SLOT_HEADER = 128 };                         /* a small slot's first bytes, unused: the data starts a line pair on */

/* What waits return to Python: statuses.h, the C side's one table. */
#include "statuses.h"

static inline int64_t load_acquire(const int64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

/* The futex word of a counter: its low 32 bits, which change whenever the
 * counter does (counters only grow, by less than 2^32 at a time). */
static inline uint32_t *futex_word(const int64_t *counter)
{
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return (uint32_t *)counter + 1;
#else
    return (uint32_t *)counter;
#endif
}

/* Store `v` in slot `slot` of `row` (a release store and more), and wake
 * any wait asleep on the row. Shared, not process-private, futexes: the
 * rows are mapped by every rank's process. */
static inline void publish(int64_t *row, int slot, int64_t v)
{
    __atomic_store_n(&row[slot], v, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&row[SLEEPERS], __ATOMIC_SEQ_CST) != 0)
        syscall(SYS_futex, futex_word(&row[slot]), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Wake every wait asleep on any rank's row, whatever slot it waits on. An
 * abort wakes no one by itself: a rank asleep on a live peer saw it only
 * when its nap ended, up to 10 ms after the rank that saw a death aborted,
 * and each rank of a chain of waits (a ring) added its own. A wake that
 * reaches a sleeper between its look at the flag and its sleep is lost,
 * and it learns at the nap's end, as before. */
static inline void wake_every_sleeper(int64_t *rows, int nranks)
{
    for (int r = 0; r < nranks; r++) {
        int64_t *row = &rows[r * ROW_SLOTS];
        if (__atomic_load_n(&row[SLEEPERS], __ATOMIC_SEQ_CST) == 0)
            continue;
        for (int slot = 0; slot < ROW_SLOTS; slot++)
            if (slot != SLEEPERS)
                syscall(SYS_futex, futex_word(&row[slot]), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    }
}

static double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);   /* time.perf_counter's clock on Linux */
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Whether process `pid` still runs; a zombie (dead, not yet reaped) is dead. */
static int process_alive(int64_t pid)
{
    if (pid <= 0)
        return 1;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
    FILE *f = fopen(path, "r");
    if (f != NULL) {
        size_t n = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[n] = '\0';
        char *close_paren = strrchr(buf, ')');
        if (close_paren != NULL && close_paren[1] == ' ')
            return close_paren[2] != 'Z' && close_paren[2] != 'X';
        return 1;
    }
    if (errno == ENOENT)
        return 0;
    return !(kill((pid_t)pid, 0) == -1 && errno == ESRCH);
}

/* ------------------------------------------------------------------------ */
/* Waiting                                                                  */

typedef struct {
    int64_t *header;     /* the control segment's header (ABORT) */
    int64_t *rows;       /* ROW_SLOTS int64 per rank */
    int rank, nranks;
    long spin;           /* polls before the wait yields */
    double yield_seconds; /* then yields for as long, before it sleeps */
    double deadline;     /* time.perf_counter() value */
    /* filled when a wait fails */
    int failed_peer;
    int64_t failed_have, failed_need;
} Waits;

/* The slow part of a wait for `peer`'s slot: yield, then sleep until the
 * peer publishes, looking at the abort flag, the deadline and the peer's
 * process between sleeps. Called without the GIL. */
static int wait_slowly(Waits *w, int peer, const int64_t *counter, int64_t need, PyThreadState **released)
{
    int status = OK;
    double yield_until = now_seconds() + w->yield_seconds;
    while (load_acquire(counter) < need && !__atomic_load_n(&w->header[ABORT], __ATOMIC_RELAXED)
           && now_seconds() < yield_until)
        sched_yield();
    int64_t *sleepers = &w->rows[peer * ROW_SLOTS + SLEEPERS];
    __atomic_fetch_add(sleepers, 1, __ATOMIC_SEQ_CST);
    double next_check = now_seconds() + FIRST_LOOK_SECONDS;
    for (;;) {
        int64_t have = __atomic_load_n(counter, __ATOMIC_SEQ_CST);
        if (have >= need)
            break;
        double now = now_seconds();
        if (__atomic_load_n(&w->header[ABORT], __ATOMIC_ACQUIRE)) {
            status = load_acquire(counter) >= need ? OK : ABORTED;   /* published, then aborted */
            break;
        }
        if (now >= next_check) {
            if (!process_alive(load_acquire(&w->rows[peer * ROW_SLOTS + PID]))) {
                /* a peer may publish, then exit, between the load above and this check */
                status = load_acquire(counter) >= need ? OK : PEER_DEAD;
                break;
            }
            /* Python's signal handlers run here, as in the interpreter's waits */
            PyEval_RestoreThread(*released);
            int raised = PyErr_CheckSignals() < 0;
            *released = PyEval_SaveThread();
            if (raised) {
                status = INTERRUPTED;
                break;
            }
            next_check = now + LIVENESS_SECONDS;
        }
        if (now >= w->deadline) {
            status = TIMED_OUT;
            break;
        }
        double nap = w->deadline - now < 0.01 ? w->deadline - now : 0.01;
        if (next_check - now < nap)   /* (positive: a look just past moved next_check on) */
            nap = next_check - now;
        struct timespec ts = {0, (long)(nap * 1e9) + 1};
        syscall(SYS_futex, futex_word(counter), FUTEX_WAIT, (uint32_t)have, &ts, NULL, 0);
    }
    __atomic_fetch_sub(sleepers, 1, __ATOMIC_SEQ_CST);
    if (status != OK) {
        w->failed_peer = peer;
        w->failed_have = load_acquire(counter);
        w->failed_need = need;
    }
    return status;
}

/* Wait until `peer`'s row slot `slot` is at least `need`: spin, then the
 * slow wait, without the GIL (*released keeps it released across waits). */
static int wait_for(Waits *w, int peer, int slot, int64_t need, PyThreadState **released)
{
    const int64_t *counter = &w->rows[peer * ROW_SLOTS + slot];
    if (load_acquire(counter) >= need)
        return OK;
    for (long polls = 0; polls < w->spin; polls++) {
        if (load_acquire(counter) >= need || __atomic_load_n(&w->header[ABORT], __ATOMIC_RELAXED))
            break;
        CPU_RELAX();
    }
    if (load_acquire(counter) >= need)
        return OK;
    if (*released == NULL)
        *released = PyEval_SaveThread();
    return wait_slowly(w, peer, counter, need, released);
}

/* Wait until every peer's row slot `slot` is at least `need`. */
static inline int wait_peers(Waits *w, int slot, int64_t need)
{
    PyThreadState *released = NULL;
    int status = OK;
    for (int peer = 0; peer < w->nranks && status == OK; peer++)
        if (peer != w->rank)
            status = wait_for(w, peer, slot, need, &released);
    if (released != NULL)
        PyEval_RestoreThread(released);
    return status;
}

/* ------------------------------------------------------------------------ */
/* Writing into peers' memory                                               */
/*                                                                          */
/* Nothing may be written into a rank's buffers once the rank has handed   */
/* them back to its caller. A rank returns normally only after every peer  */
/* has published the end of its writes; a rank that fails aborts the       */
/* communicator, then fences (fence_peer_writes). Before each write a      */
/* writer raises its row's WRITING slot, then looks at the abort flag, and */
/* gives up if it is set; the fence, once the abort flag is stored, issues */
/* a full barrier and waits until no live peer's WRITING is raised. Each   */
/* side stores, then loads, with a sequentially consistent barrier between: */
/* either the writer sees the abort or the fence sees the writer, and      */
/* waits for the one write it is making. Both engines that write into      */
/* peers (the compiled loop, the plan executor's pushes) follow it.        */

/* Raise this rank's WRITING slot before writing into peers: 1 to go on,
 * or 0 (the slot lowered again) when the communicator was aborted. */
static inline int begin_writes(Waits *w)
{
    int64_t *writing = &w->rows[w->rank * ROW_SLOTS + WRITING];
    __atomic_store_n(writing, 1, __ATOMIC_SEQ_CST);
    if (!__atomic_load_n(&w->header[ABORT], __ATOMIC_SEQ_CST))
        return 1;
    __atomic_store_n(writing, 0, __ATOMIC_RELEASE);
    return 0;
}

static inline void end_writes(Waits *w)
{
    __atomic_store_n(&w->rows[w->rank * ROW_SLOTS + WRITING], 0, __ATOMIC_RELEASE);
}

/* Sleep `seconds`. */
static inline void sleep_seconds(double seconds)
{
    struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

/* The fence of a rank whose call failed: set the abort flag (where the
 * abort did not), then wait up to `seconds` until no live peer is writing
 * into peers' memory. Returns the peer still writing then, or -1. Called
 * without the GIL. */
static inline int fence_peer_writes(Waits *w, double seconds)
{
    if (!__atomic_load_n(&w->header[ABORT], __ATOMIC_SEQ_CST))
        __atomic_store_n(&w->header[ABORT], 1, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);   /* the abort flag's store before the loads below */
    wake_every_sleeper(w->rows, w->nranks);
    double give_up = now_seconds() + seconds;
    for (int p = 0; p < w->nranks; p++) {
        const int64_t *writing = &w->rows[p * ROW_SLOTS + WRITING];
        int64_t pid = load_acquire(&w->rows[p * ROW_SLOTS + PID]);
        /* a write takes microseconds; a writer that died writes no more */
        while (p != w->rank && __atomic_load_n(writing, __ATOMIC_SEQ_CST) && process_alive(pid)) {
            if (now_seconds() >= give_up)
                return p;
            sleep_seconds(1e-4);
        }
    }
    return -1;
}

#endif
