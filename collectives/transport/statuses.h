/* What a call of the C side returns: one table for the three engines
 * (_shmloop.c, executors/_host_plan.c, _across.c) and the mailboxes
 * (_mailbox.c), which Python reads back
 * as module constants (add_status_constants) and turns into our errors in
 * one place (transport/failures.py; tests/test_layout.py checks that every
 * module exports the same numbers).
 *
 * 0 is done. The failures of a wait (shm_waits.h) and of a copy come first:
 * failures.raise_wait_failure translates them. Then the outcomes that are
 * not failures but ask Python to act (a declined call, a workspace to open
 * or grow, a Program still pending, a single copy refused), and the across-node Program's own
 * failures, which carry more than a wait's status (across.py). */

#ifndef COLLECTIVES_STATUSES_H
#define COLLECTIVES_STATUSES_H

enum {
    OK = 0,
    TIMED_OUT = 1,       /* a peer did not arrive before the deadline */
    ABORTED = 2,         /* the communicator's abort flag was raised */
    PEER_DEAD = 3,       /* a peer's process is gone */
    MISMATCH = 4,        /* a peer is in a different call */
    READ_FAILED = 5,     /* reading a peer's buffer failed (the errno is carried) */
    INTERRUPTED = 6,     /* a signal handler raised (Ctrl-C): the exception is set */
    WRITE_FAILED = 7,    /* writing into a peer's buffer failed (the errno is carried) */
    DECLINED = 8,        /* the compiled path does not take this call; nothing was done */
    NEED_OPEN = 9,       /* a peer's workspace of a newer generation must be opened first */
    NEED_GROW = 10,      /* this rank's workspace must grow first */
    BAD_PLAN = 11,       /* a plan's row names memory the executor cannot reach */
    PENDING = 12,        /* an across-node Program is waiting: resume it */
    NODE_FAILED = 13,    /* a node step failed: its own status is carried */
    MPI_FAILED = 14,     /* an MPI request failed: its error code is carried */
    ABORT_ARRIVED = 15,  /* an abort message came on the between-node channel */
    REFUSED = 16,        /* a single-copy read of a peer was not allowed: send as fragments instead */
};

#ifdef Py_PYTHON_H
/* Every status as a constant of module `m`, under its name above. */
static int add_status_constants(PyObject *m) {
    static const struct { const char *name; int value; } table[] = {
        {"OK", OK}, {"TIMED_OUT", TIMED_OUT}, {"ABORTED", ABORTED}, {"PEER_DEAD", PEER_DEAD},
        {"MISMATCH", MISMATCH}, {"READ_FAILED", READ_FAILED}, {"INTERRUPTED", INTERRUPTED},
        {"WRITE_FAILED", WRITE_FAILED}, {"DECLINED", DECLINED}, {"NEED_OPEN", NEED_OPEN},
        {"NEED_GROW", NEED_GROW}, {"BAD_PLAN", BAD_PLAN}, {"PENDING", PENDING}, {"NODE_FAILED", NODE_FAILED},
        {"MPI_FAILED", MPI_FAILED}, {"ABORT_ARRIVED", ABORT_ARRIVED}, {"REFUSED", REFUSED},
    };
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (PyModule_AddIntConstant(m, table[i].name, table[i].value) < 0)
            return -1;
    return 0;
}
#endif

#endif
