/* A call across nodes (hierarchy.py) in one compiled call: across.py's Programs.
 *
 * A small call across nodes, or a large allreduce of equal nodes, is a few
 * steps: the node's compiled loop (_shmloop's channel, called back through
 * Python's C API), one message to or from each counterpart on the other
 * nodes (MPI), a fold of the partials in node order, and for the large
 * allreduce the loop again. Driven from Python, a small call cost about 20
 * µs, most of it the interpreter; MPICH's own allreduce costs 3. Here one
 * Program runs a call's steps as across.py laid them out once per call
 * shape:
 *
 *   1. the receive headers zeroed, the receives' persistent requests
 *      started (a counterpart's message can land during the node step);
 *   2. the first node step, if any: call(*args), with the call's x, out
 *      and deadline put in their places; it returns 0 once done;
 *   3. `before` copies (a partial into each message), the call's signature
 *      into every message's header, the sends' requests started;
 *   4. polls until every request is done (MPI_Test, one request at a time,
 *      so an error is that request's own, never MPI_ERR_IN_STATUS), giving
 *      the GIL back and yielding the core once the first polls found
 *      nothing, until `poll_until`: then Python looks at the deadline, the
 *      abort channel and signals, and calls resume();
 *   5. every received header checked against the signature;
 *   6. the fold (host_folds.h's reduce_sources: the partials in node order,
 *      avg divided once at the end), the last node step, if any (a large
 *      allreduce's all-gather inside the node), and the `after` copies.
 *
 * A large allgather by node rows, or broadcast in slices, moves its
 * payload with no buffer between (Direct): each message is started per
 * call (MPI_Isend, MPI_Irecv) straight from or into the call's arrays,
 * after an 8-byte message of the call's signature alone on a persistent
 * request (MPI keeps a pair's messages in order). Its receives start in
 * step 1 and its sends of x before step 2, unless x overlaps out other
 * than at its own place there (x_home): then both after step 2, the sends
 * from out (an allgather by node ranges sends out's node range, after step 2).
 *
 * MPI is called through the functions of the MPI library mpi4py loaded
 * (their addresses come from bind_mpi), on the persistent requests mpi4py
 * made (their handles' addresses), so this file needs no MPI header and
 * works with either ABI: a request or status is passed by address (a
 * status is scratch space of the library's size, never read here), and
 * MPI_Isend's and MPI_Irecv's datatype and communicator handles by value,
 * as ints or pointers by the handles' size.
 *
 * A buffer is named by a base and an offset: the call's x, the call's out,
 * or an absolute address (memory the Program's owner keeps alive).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "shm_waits.h"
#include "host_folds.h"
#include "signatures.h"
#include "raised.h"

typedef int (*mpi_start_fn)(void *request);
typedef int (*mpi_test_fn)(void *request, int *flag, void *status);
typedef int (*mpi_cancel_fn)(void *request);
/* MPI_Isend and MPI_Irecv, whose datatype and communicator handles are
 * ints in one ABI (MPICH's) and pointers in others: both kinds are
 * declared, and the handles' size (bind_mpi) says which to call. */
typedef int (*mpi_isend_int_fn)(const void *buf, int count, int datatype, int dest, int tag, int comm, void *request);
typedef int (*mpi_irecv_int_fn)(void *buf, int count, int datatype, int source, int tag, int comm, void *request);
typedef int (*mpi_isend_ptr_fn)(const void *buf, int count, void *datatype, int dest, int tag, void *comm,
                                void *request);
typedef int (*mpi_irecv_ptr_fn)(void *buf, int count, void *datatype, int source, int tag, void *comm, void *request);

static mpi_start_fn mpi_start;
static mpi_test_fn mpi_test;
static mpi_cancel_fn mpi_cancel;
static void *mpi_isend, *mpi_irecv;
static Py_ssize_t status_size, handle_size;

enum { BASE_X = 0, BASE_OUT = 1, BASE_ADDRESS = 2 };
typedef struct { int base; intptr_t offset; } Where;
typedef struct { Where src, dst; size_t nbytes; } Copy;
/* A message started per call (MPI_Isend, MPI_Irecv) straight from or into
 * the call's arrays, with no buffer between; its call signature goes
 * before it, in a persistent request's 8-byte message to the same peer. */
typedef struct { int peer; Where where; int nbytes; } Direct;

/* What run() and resume() return besides 0 (done): PENDING, NODE_FAILED,
 * MPI_FAILED, MISMATCH (a counterpart in a different call) or
 * ABORT_ARRIVED, each with what it carries (statuses.h). */

/* A call of the node's loop: call(*args), the call's x, out, deadline and
 * `own` (what run() was given last, if anything: a view of out's block of
 * this rank) put at the indexes given (-1: nowhere). */
typedef struct {
    PyObject *call;             /* NULL: no step */
    PyObject *args;             /* a tuple */
    Py_ssize_t x_at, out_at, deadline_at, own_at;
} NodeStep;

typedef struct {
    PyObject_HEAD
    NodeStep first, last;
    double deadline;            /* of the call in flight (the last step's) */
    PyObject *own;              /* run()'s `own`, held until the call in flight ends */
    Copy *before, *after;
    Py_ssize_t nbefore, nafter;
    int64_t **send_headers, **receive_headers;
    Py_ssize_t nsends, nreceives;
    void **requests;            /* the receives' requests, then the sends' (mpi4py's, persistent), then the
                                 * direct receives', then the direct sends' (direct_requests) */
    char *done;                 /* per request, this call */
    Py_ssize_t npersistent, nrequests;
    Direct *direct;             /* the direct receives, then the direct sends */
    Py_ssize_t ndirect_receives, ndirect_sends;
    uint64_t *direct_requests;  /* their handles (MPI_Request: 4 or 8 bytes) */
    int64_t comm, byte_type;    /* the handles of the link's communicator and of MPI_BYTE */
    int tag;
    int has_x_home;             /* x_home is where x sits in out when the call is in place (see x_clear_of_out) */
    Where x_home;
    int sends_from_x;           /* the direct sends carry the call's x: from x, where clear (see run()) */
    PyObject *held;             /* (x, out) of the last call with direct messages, until it ends well: MPI
                                 * may still read or write them after a failure */
    Where *fold_sources;        /* none: no fold */
    Py_ssize_t nfold;
    Where fold_into;
    size_t fold_bytes, itemsize;
    int type, op, divisor;
    Py_ssize_t x_bytes, out_bytes;  /* what the call's arrays must hold */
    int writes_out;             /* whether a copy or the fold writes out (else an in-place x may be read-only) */
    uint64_t description_hash;
    int64_t signature;          /* of the call in flight */
    long spin;                  /* polls before the GIL is released and the core yielded */
    char *status;               /* MPI_Status scratch */
    void *abort_request;        /* the link's receive of abort messages (mpi4py's handle), */
    void *abort_status;         /* and the status it fills (mpi4py's): see abort_arrived */
    double next_abort_test;     /* (abort_arrived) */
    /* Every confirm_every-th send to a peer goes synchronous (mpi.py's
     * CONFIRM_EVERY says why): the sends' requests as made, their
     * synchronous twins, each send's peer, and the link's count per peer of
     * the sends since its last synchronous one (NULL: never synchronous). */
    void **eager_sends, **synchronous_sends;
    int *send_peers;
    int64_t *unconfirmed;
    long confirm_every;
} Program;

static const double ABORT_TEST_EVERY = 1e-3;   /* seconds */

static char *resolve(Where w, char *x, char *out)
{
    if (w.base == BASE_ADDRESS)
        return (char *)w.offset;
    return (w.base == BASE_X ? x : out) + w.offset;
}

static void run_copies(const Copy *copies, Py_ssize_t n, char *x, char *out)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        char *dst = resolve(copies[i].dst, x, out);
        const char *src = resolve(copies[i].src, x, out);
        if (dst != src)   /* (x into out, in place) */
            memmove(dst, src, copies[i].nbytes);
    }
}

/* Whether `copy` writes out when out is x: a copy of x into out at the
 * same offset writes nothing then. */
static int writes_out_in_place(const Copy *copy)
{
    return copy->dst.base == BASE_OUT && !(copy->src.base == BASE_X && copy->src.offset == copy->dst.offset);
}

/* Poll every request until all are done or `poll_until` passes (PENDING),
 * or one fails: MPI_FAILED, with *failed the request's index and *code
 * MPI's error code. */
static int poll(Program *p, double poll_until, Py_ssize_t *failed, int *code)
{
    PyThreadState *released = NULL;
    int status = OK;
    for (long polls = 0;; polls++) {
        int all = 1;
        for (Py_ssize_t i = 0; i < p->nrequests; i++) {
            if (p->done[i])
                continue;
            int flag = 0;
            int rc = mpi_test(p->requests[i], &flag, p->status);
            if (rc != 0) {
                *failed = i;
                *code = rc;
                status = MPI_FAILED;
                break;
            }
            if (flag)
                p->done[i] = 1;
            else
                all = 0;
        }
        if (status != OK || all)
            break;
        if (polls < p->spin) {
            CPU_RELAX();
            continue;
        }
        if (released == NULL)
            released = PyEval_SaveThread();
        if (now_seconds() >= poll_until) {
            status = PENDING;
            break;
        }
        sched_yield();
    }
    if (released != NULL)
        PyEval_RestoreThread(released);
    return status;
}

typedef struct {
    Py_buffer x, out;
    int have_x, have_out;
} Arrays;

static void release(Arrays *a)
{
    if (a->have_out)
        PyBuffer_Release(&a->out);
    if (a->have_x)
        PyBuffer_Release(&a->x);
}

/* The call's x and out (out may be x): 0, or -1 when they are not what the
 * Program was laid out for (the caller declines the call). */
static int take_arrays(Program *p, PyObject *x, PyObject *out, Arrays *a)
{
    a->have_x = a->have_out = 0;
    if (PyObject_GetBuffer(x, &a->x, PyBUF_C_CONTIGUOUS | (x == out && p->writes_out ? PyBUF_WRITABLE : 0)) < 0)
        goto decline;
    a->have_x = 1;
    if (x != out) {
        if (PyObject_GetBuffer(out, &a->out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
            goto decline;
        a->have_out = 1;
    }
    if (a->x.len != p->x_bytes || (x == out ? a->x.len : a->out.len) != p->out_bytes)
        goto decline;
    return 0;
decline:
    PyErr_Clear();
    release(a);
    return -1;
}

/* Whether a peer's abort message has arrived (or MPI fails on its
 * request): no call starts then, and none writes its output. Python's
 * check_health finds the request completed (its handle MPI_REQUEST_NULL)
 * and reads the message and its status. Looked at before a call starts,
 * once a millisecond at most (a test drives MPI's progress, about 0.25 µs,
 * a sixth of a small call between two processes), and, whatever the time
 * (`now_or_never`), before a failure is reported: another call's message
 * may be the stale one of a call a peer left when it aborted. A call whose
 * messages all came, with its signature, completes. */
static int abort_arrived(Program *p, int now_or_never)
{
    double now = now_seconds();
    if (now < p->next_abort_test && !now_or_never)
        return 0;
    p->next_abort_test = now + ABORT_TEST_EVERY;
    int arrived = 0;
    return mpi_test(p->abort_request, &arrived, p->abort_status) != 0 || arrived;
}

/* Whether `result` (run's or resume's) says PENDING. */
static int pending(PyObject *result)
{
    return result != NULL && PyTuple_Check(result) && PyTuple_GET_SIZE(result) > 0
           && PyLong_AsLong(PyTuple_GET_ITEM(result, 0)) == PENDING;
}

static PyObject *outcome(int status, long a, long b)
{
    return status == OK ? PyLong_FromLong(0) : Py_BuildValue("(ill)", status, a, b);
}

/* Run `step` for the call of x and out: NULL (an exception: a signal
 * handler's) or 0 once done, else (NODE_FAILED, its result, which step). */
static PyObject *run_step(const NodeStep *step, int which, PyObject *x, PyObject *out, PyObject *own,
                          double deadline)
{
    if (step->call == NULL)
        return PyLong_FromLong(0);
    Py_ssize_t n = PyTuple_GET_SIZE(step->args);
    PyObject *call_args[n > 0 ? n : 1];
    PyObject *deadline_object = PyFloat_FromDouble(deadline);
    if (deadline_object == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        call_args[i] = i == step->x_at ? x : i == step->out_at ? out : i == step->own_at && own != NULL ? own
                     : i == step->deadline_at ? deadline_object : PyTuple_GET_ITEM(step->args, i);
    PyObject *stepped = PyObject_Vectorcall(step->call, call_args, (size_t)n, NULL);
    Py_DECREF(deadline_object);
    if (stepped == NULL || (PyLong_CheckExact(stepped) && PyLong_AsLong(stepped) == 0))
        return stepped;
    return Py_BuildValue("(iNi)", NODE_FAILED, stepped, which);
}

/* MPI_Start requests [from, to): NULL once done, else (MPI_FAILED, request, code). */
static PyObject *start_requests(Program *p, Py_ssize_t from, Py_ssize_t to)
{
    for (Py_ssize_t i = from; i < to; i++) {
        int rc = mpi_start(p->requests[i]);
        if (rc != 0)
            return outcome(MPI_FAILED, (long)i, rc);
    }
    return NULL;
}

/* Start direct messages [from, to) of p->direct, the sends from `from_x`
 * if not NULL: NULL once done, else (MPI_FAILED, request, code). */
static PyObject *post_direct(Program *p, Py_ssize_t from, Py_ssize_t to, char *x, char *out, char *from_x)
{
    for (Py_ssize_t i = from; i < to; i++) {
        const Direct *d = &p->direct[i];
        char *buf = from_x != NULL ? from_x : resolve(d->where, x, out);
        void *request = &p->direct_requests[i];
        int rc;
        if (i < p->ndirect_receives)
            rc = handle_size == sizeof(int)
                 ? ((mpi_irecv_int_fn)mpi_irecv)(buf, d->nbytes, (int)p->byte_type, d->peer, p->tag, (int)p->comm,
                                                 request)
                 : ((mpi_irecv_ptr_fn)mpi_irecv)(buf, d->nbytes, (void *)(intptr_t)p->byte_type, d->peer, p->tag,
                                                 (void *)(intptr_t)p->comm, request);
        else
            rc = handle_size == sizeof(int)
                 ? ((mpi_isend_int_fn)mpi_isend)(buf, d->nbytes, (int)p->byte_type, d->peer, p->tag, (int)p->comm,
                                                 request)
                 : ((mpi_isend_ptr_fn)mpi_isend)(buf, d->nbytes, (void *)(intptr_t)p->byte_type, d->peer, p->tag,
                                                 (void *)(intptr_t)p->comm, request);
        if (rc != 0)
            return outcome(MPI_FAILED, (long)(p->npersistent + i), rc);
    }
    return NULL;
}

/* Which request each persistent send starts this call: its synchronous
 * twin where this is the confirm_every-th send to its peer since the last
 * synchronous one. poll() then tests the one started. */
static void choose_send_requests(Program *p)
{
    if (p->unconfirmed == NULL)
        return;
    for (Py_ssize_t i = 0; i < p->npersistent - p->nreceives; i++) {
        if (p->send_peers[i] < 0)   /* a message MPI sends only once the peer takes it */
            continue;
        int64_t *count = &p->unconfirmed[p->send_peers[i]];
        int confirm = ++*count >= p->confirm_every;
        if (confirm)
            *count = 0;
        p->requests[p->nreceives + i] = confirm ? p->synchronous_sends[i] : p->eager_sends[i];
    }
}

/* The persistent sends (call signatures) and the direct sends, from `from_x` if not NULL. */
static PyObject *start_sends(Program *p, char *x, char *out, char *from_x)
{
    for (Py_ssize_t i = 0; i < p->nsends; i++)
        *p->send_headers[i] = p->signature;
    choose_send_requests(p);
    PyObject *failed = start_requests(p, p->nreceives, p->npersistent);
    if (failed == NULL)
        failed = post_direct(p, p->ndirect_receives, p->ndirect_receives + p->ndirect_sends, x, out, from_x);
    return failed;
}

/* Whether the direct messages may start before the first node step (the
 * sends from x where they carry x's bytes, sends_from_x): unless x
 * overlaps out other than at x_home, where it sits in place (the first
 * step, or a receive, may write over x then: the messages go after the
 * first step, the sends from out). */
static int x_clear_of_out(const Program *p, char *x, Py_ssize_t x_len, char *out, Py_ssize_t out_len)
{
    if (!p->has_x_home)
        return 1;
    return x == resolve(p->x_home, x, out) || x + x_len <= out || out + out_len <= x;
}

static PyObject *finish_polled(Program *p, int status, Py_ssize_t failed, int code, PyObject *x_obj,
                               PyObject *out_obj, char *x, char *out);

/* Steps 4 to 6. */
static PyObject *finish(Program *p, PyObject *x_obj, PyObject *out_obj, char *x, char *out, double poll_until)
{
    Py_ssize_t failed = -1;
    int code = 0;
    int status = poll(p, poll_until, &failed, &code);
    if (status == PENDING)
        return outcome(status, (long)failed, code);
    PyObject *result = finish_polled(p, status, failed, code, x_obj, out_obj, x, out);
    Py_CLEAR(p->own);   /* the call is over */
    if (status == OK)
        Py_CLEAR(p->held);   /* (after a failure MPI may still hold them: see cancel()) */
    return result;
}

/* finish() once the polls are over. */
static PyObject *finish_polled(Program *p, int status, Py_ssize_t failed, int code, PyObject *x_obj,
                               PyObject *out_obj, char *x, char *out)
{
    if (status != OK)   /* (a peer's abort may explain it: the stale message of a call it left) */
        return outcome(abort_arrived(p, 1) ? ABORT_ARRIVED : status, (long)failed, code);
    for (Py_ssize_t i = 0; i < p->nreceives; i++)
        if (*p->receive_headers[i] != p->signature)
            return outcome(abort_arrived(p, 1) ? ABORT_ARRIVED : MISMATCH, (long)i, 0);
    if (p->nfold > 0) {
        const char *sources[p->nfold];
        for (Py_ssize_t i = 0; i < p->nfold; i++)
            sources[i] = resolve(p->fold_sources[i], x, out);
        reduce_sources(p->type, p->op, sources, (int)p->nfold, resolve(p->fold_into, x, out), NULL, p->fold_bytes,
                       p->itemsize, p->divisor);
    }
    PyObject *stepped = run_step(&p->last, 1, x_obj, out_obj, p->own, p->deadline);
    if (stepped == NULL || !PyLong_CheckExact(stepped))
        return stepped;
    Py_DECREF(stepped);
    run_copies(p->after, p->nafter, x, out);
    return outcome(OK, 0, 0);
}

/* run(x, out, seq, deadline, poll_until[, own]): call number `seq` (the
 * hierarchy's count, which makes its signature); 0 once done, else
 * (PENDING, 0, 0): resume (always where poll_until < 0: the messages
 * started, nothing polled, so the last node step runs only in resume());
 * (NODE_FAILED, result, 0 or 1): the first or last node step returned
 * `result`; (MPI_FAILED, request, code);
 * (MISMATCH, receive, 0); (ABORT_ARRIVED, 0, 0): a peer's abort
 * message is there (nothing ran); None: the arrays are not this Program's
 * (nothing ran). */
static PyObject *Program_run(Program *p, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 && nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "run(x, out, seq, deadline, poll_until[, own])");
        return NULL;
    }
    long long seq = PyLong_AsLongLong(args[2]);
    double deadline = PyFloat_AsDouble(args[3]), poll_until = PyFloat_AsDouble(args[4]);
    if (PyErr_Occurred())
        return NULL;
    if (abort_arrived(p, 0))
        return outcome(ABORT_ARRIVED, 0, 0);
    Arrays a;
    if (take_arrays(p, args[0], args[1], &a) < 0)
        Py_RETURN_NONE;
    char *x = a.x.buf, *out = a.have_out ? a.out.buf : a.x.buf;
    p->signature = call_signature(p->description_hash, (int64_t)seq);
    p->deadline = deadline;
    Py_XSETREF(p->own, nargs == 6 ? Py_NewRef(args[5]) : NULL);
    /* The receives first, so that a counterpart's message can land while
     * this rank is still in its node step; the sends once their data is there. */
    memset(p->done, 0, (size_t)p->nrequests);
    for (Py_ssize_t i = 0; i < p->nreceives; i++)
        *p->receive_headers[i] = 0;
    if (p->direct != NULL) {   /* (zeroed: cancel() then skips a message never started) */
        memset(p->direct_requests, 0, (size_t)(p->ndirect_receives + p->ndirect_sends) * sizeof(uint64_t));
        Py_XSETREF(p->held, PyTuple_Pack(2, args[0], args[1]));
        if (p->held == NULL) {
            release(&a);
            return NULL;
        }
    }
    int x_clear = x_clear_of_out(p, x, a.x.len, out, a.have_out ? a.out.len : a.x.len);
    int sends_early = x_clear && p->sends_from_x;   /* (a counterpart's MPI reads x while this rank is in its node step) */
    PyObject *result = start_requests(p, 0, p->nreceives);
    if (result == NULL && x_clear)
        result = post_direct(p, 0, p->ndirect_receives, x, out, NULL);
    if (result == NULL && sends_early)
        result = start_sends(p, x, out, x);
    if (result != NULL)
        goto done;
    result = run_step(&p->first, 0, args[0], args[1], p->own, deadline);
    if (result == NULL || !PyLong_CheckExact(result))
        goto done;
    Py_CLEAR(result);
    run_copies(p->before, p->nbefore, x, out);
    if (!x_clear)
        result = post_direct(p, 0, p->ndirect_receives, x, out, NULL);
    if (result == NULL && !sends_early)
        result = start_sends(p, x, out, NULL);
    if (result != NULL)
        goto done;
    if (poll_until < 0) {   /* started only (across.STARTED_ONLY): no poll, the last step left to resume() */
        result = outcome(PENDING, 0, 0);
        goto done;
    }
    result = finish(p, args[0], args[1], x, out, poll_until);
done:
    if (!pending(result))
        Py_CLEAR(p->own);   /* (finish() clears it too) */
    release(&a);
    return result;
}

/* resume(x, out, poll_until): run's steps 4 to 6 again, after PENDING. */
static PyObject *Program_resume(Program *p, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "resume(x, out, poll_until)");
        return NULL;
    }
    double poll_until = PyFloat_AsDouble(args[2]);
    if (PyErr_Occurred())
        return NULL;
    Arrays a;
    if (take_arrays(p, args[0], args[1], &a) < 0) {
        PyErr_SetString(PyExc_ValueError, "resume() takes the arrays run() took");
        return NULL;
    }
    PyObject *result = finish(p, args[0], args[1], a.x.buf, a.have_out ? a.out.buf : a.x.buf, poll_until);
    release(&a);
    return result;
}

/* cancel(): after a failed call, its direct receives that have not
 * completed are cancelled (a matched one may still write into out: MPI
 * cannot take it back); the Program, which holds the arrays, is then
 * kept alive and never run again (across.py orphans it). */
static PyObject *Program_cancel(Program *p, PyObject *Py_UNUSED(ignored))
{
    for (Py_ssize_t i = 0; i < p->ndirect_receives; i++)
        if (!p->done[p->npersistent + i] && p->direct_requests[i] != 0)
            mpi_cancel(&p->direct_requests[i]);
    Py_RETURN_NONE;
}

/* -- construction ----------------------------------------------------------- */

static int parse_where(PyObject *pair, Where *w)
{
    long long offset;
    if (!PyArg_ParseTuple(pair, "iL", &w->base, &offset))
        return -1;
    if (w->base < BASE_X || w->base > BASE_ADDRESS) {
        PyErr_SetString(PyExc_ValueError, "a base is X, OUT or ADDRESS");
        return -1;
    }
    w->offset = (intptr_t)offset;
    return 0;
}

static int parse_copies(PyObject *list, Copy **copies, Py_ssize_t *n)
{
    PyObject *seq = PySequence_Fast(list, "copies: a list of (source, destination, nbytes)");
    if (seq == NULL)
        return -1;
    *n = PySequence_Fast_GET_SIZE(seq);
    *copies = PyMem_Calloc(*n > 0 ? (size_t)*n : 1, sizeof(Copy));
    int ok = *copies != NULL;
    for (Py_ssize_t i = 0; ok && i < *n; i++) {
        PyObject *src, *dst;
        Py_ssize_t nbytes;
        ok = PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "OOn", &src, &dst, &nbytes)
             && parse_where(src, &(*copies)[i].src) == 0 && parse_where(dst, &(*copies)[i].dst) == 0;
        if (ok)
            (*copies)[i].nbytes = (size_t)nbytes;
    }
    Py_DECREF(seq);
    if (!ok && !PyErr_Occurred())
        PyErr_NoMemory();
    return ok ? 0 : -1;
}

/* A list of addresses (ints) into a new array of pointers. */
static int parse_addresses(PyObject *list, void ***addresses, Py_ssize_t *n)
{
    PyObject *seq = PySequence_Fast(list, "a list of addresses");
    if (seq == NULL)
        return -1;
    *n = PySequence_Fast_GET_SIZE(seq);
    *addresses = PyMem_Calloc(*n > 0 ? (size_t)*n : 1, sizeof(void *));
    int ok = *addresses != NULL;
    for (Py_ssize_t i = 0; ok && i < *n; i++) {
        (*addresses)[i] = PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(seq, i));
        ok = !PyErr_Occurred();
    }
    Py_DECREF(seq);
    if (!ok && !PyErr_Occurred())
        PyErr_NoMemory();
    return ok ? 0 : -1;
}

/* None, or (callable, args, x_at, out_at, deadline_at, own_at), into `step`. */
static int parse_step(PyObject *spec, NodeStep *step)
{
    if (spec == Py_None)
        return 0;
    PyObject *call, *args;
    if (!PyArg_ParseTuple(spec, "OO!nnnn", &call, &PyTuple_Type, &args, &step->x_at, &step->out_at,
                          &step->deadline_at, &step->own_at))
        return -1;
    step->call = Py_NewRef(call);
    step->args = Py_NewRef(args);
    return 0;
}

/* direct: None, or (receives, sends, comm handle, MPI_BYTE handle, tag,
 * x_home or None, sends_from_x), each message (peer, (base, offset), nbytes). */
static int parse_direct(PyObject *spec, Program *p)
{
    if (spec == Py_None)
        return 0;
    if (mpi_isend == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "direct messages: bind_mpi() without MPI_Isend");
        return -1;
    }
    PyObject *receives, *sends, *x_home;
    unsigned long long comm, byte_type;   /* (mpi4py gives MPICH's int handles sign-extended to 64 bits) */
    if (!PyArg_ParseTuple(spec, "O!O!KKiOp", &PyList_Type, &receives, &PyList_Type, &sends, &comm, &byte_type,
                          &p->tag, &x_home, &p->sends_from_x))
        return -1;
    p->has_x_home = x_home != Py_None;
    if (p->has_x_home && parse_where(x_home, &p->x_home) < 0)
        return -1;
    if (p->sends_from_x && !p->has_x_home) {
        PyErr_SetString(PyExc_ValueError, "direct: sends of x need x's place in out");
        return -1;
    }
    p->comm = (int64_t)comm;
    p->byte_type = (int64_t)byte_type;
    p->ndirect_receives = PyList_GET_SIZE(receives);
    p->ndirect_sends = PyList_GET_SIZE(sends);
    Py_ssize_t n = p->ndirect_receives + p->ndirect_sends;
    p->direct = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(Direct));
    p->direct_requests = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(uint64_t));
    if (p->direct == NULL || p->direct_requests == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = i < p->ndirect_receives ? PyList_GET_ITEM(receives, i)
                                                  : PyList_GET_ITEM(sends, i - p->ndirect_receives);
        PyObject *where;
        if (!PyArg_ParseTuple(item, "iOi", &p->direct[i].peer, &where, &p->direct[i].nbytes)
            || parse_where(where, &p->direct[i].where) < 0)
            return -1;
        if (i < p->ndirect_receives && p->direct[i].where.base == BASE_OUT)
            p->writes_out = 1;
    }
    return 0;
}

/* confirm: None, or (synchronous send addresses, each send's peer (-1:
 * never synchronous), the address of the link's int64 count per peer,
 * every), the first two in the order of the sends' requests. */
static int parse_confirm(PyObject *spec, Program *p)
{
    if (spec == Py_None)
        return 0;
    PyObject *synchronous, *peers;
    unsigned long long counts;
    if (!PyArg_ParseTuple(spec, "OOKl", &synchronous, &peers, &counts, &p->confirm_every))
        return -1;
    Py_ssize_t nsync, nsend_requests = p->npersistent - p->nreceives;
    if (parse_addresses(synchronous, &p->synchronous_sends, &nsync) < 0)
        return -1;
    PyObject *seq = PySequence_Fast(peers, "confirm: a list of peers");
    if (seq == NULL)
        return -1;
    int ok = nsync == nsend_requests && PySequence_Fast_GET_SIZE(seq) == nsend_requests && p->confirm_every >= 1;
    p->send_peers = PyMem_Calloc(nsend_requests > 0 ? (size_t)nsend_requests : 1, sizeof(int));
    p->eager_sends = PyMem_Calloc(nsend_requests > 0 ? (size_t)nsend_requests : 1, sizeof(void *));
    if (p->send_peers == NULL || p->eager_sends == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; ok && i < nsend_requests; i++) {
        p->send_peers[i] = (int)PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        ok = !PyErr_Occurred() && p->send_peers[i] >= -1;
        p->eager_sends[i] = p->requests[p->nreceives + i];
    }
    Py_DECREF(seq);
    if (!ok) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "confirm: a synchronous send and a peer (or -1) per send, every >= 1");
        return -1;
    }
    p->unconfirmed = (int64_t *)(uintptr_t)counts;
    return 0;
}

static int Program_init(Program *p, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"first_step", "before", "send_headers", "receive_headers", "requests", "fold",
                            "last_step", "after", "x_bytes", "out_bytes", "description_hash", "spin",
                            "abort_request", "abort_status", "direct", "confirm", NULL};
    PyObject *first, *last, *before, *send_headers, *receive_headers, *requests, *fold, *after, *direct = Py_None,
             *confirm = Py_None;
    unsigned long long description_hash;
    if (mpi_test == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "bind_mpi() first");
        return -1;
    }
    if (p->status != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a Program is made once");
        return -1;
    }
    unsigned long long abort_request, abort_status;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOOOOnnKlKK|OO", names, &first, &before, &send_headers,
                                     &receive_headers, &requests, &fold, &last, &after, &p->x_bytes, &p->out_bytes,
                                     &description_hash, &p->spin, &abort_request, &abort_status, &direct, &confirm))
        return -1;
    p->abort_request = (void *)(uintptr_t)abort_request;
    p->abort_status = (void *)(uintptr_t)abort_status;
    if (parse_step(first, &p->first) < 0 || parse_step(last, &p->last) < 0)
        return -1;
    p->description_hash = description_hash;
    if (parse_copies(before, &p->before, &p->nbefore) < 0 || parse_copies(after, &p->after, &p->nafter) < 0
        || parse_addresses(send_headers, (void ***)&p->send_headers, &p->nsends) < 0
        || parse_addresses(receive_headers, (void ***)&p->receive_headers, &p->nreceives) < 0
        || parse_addresses(requests, &p->requests, &p->npersistent) < 0 || parse_direct(direct, p) < 0
        || parse_confirm(confirm, p) < 0)
        return -1;
    p->nrequests = p->npersistent + p->ndirect_receives + p->ndirect_sends;
    if (p->nrequests > p->npersistent) {   /* the direct messages' requests after the persistent ones */
        void **all = PyMem_Realloc(p->requests, (size_t)p->nrequests * sizeof(void *));
        if (all == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        p->requests = all;
        for (Py_ssize_t i = p->npersistent; i < p->nrequests; i++)
            p->requests[i] = &p->direct_requests[i - p->npersistent];
    }
    for (Py_ssize_t i = 0; i < p->nbefore; i++)
        p->writes_out |= writes_out_in_place(&p->before[i]);
    for (Py_ssize_t i = 0; i < p->nafter; i++)
        p->writes_out |= writes_out_in_place(&p->after[i]);
    p->done = PyMem_Calloc(p->nrequests > 0 ? (size_t)p->nrequests : 1, 1);
    p->status = PyMem_Calloc((size_t)status_size, 1);
    if (p->done == NULL || p->status == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (fold != Py_None) {   /* (sources, into, nbytes, itemsize, type, op, divisor) */
        PyObject *sources, *into;
        Py_ssize_t nbytes, itemsize;
        if (!PyArg_ParseTuple(fold, "OOnniii", &sources, &into, &nbytes, &itemsize, &p->type, &p->op, &p->divisor)
            || parse_where(into, &p->fold_into) < 0)
            return -1;
        if (p->type < 0 || p->type >= NTYPES || p->op < OP_SUM || p->op > OP_AVG) {
            PyErr_SetString(PyExc_ValueError, "fold: an element type and op of host_folds.h");
            return -1;
        }
        PyObject *seq = PySequence_Fast(sources, "fold sources: a list of (base, offset)");
        if (seq == NULL)
            return -1;
        p->nfold = PySequence_Fast_GET_SIZE(seq);
        p->fold_sources = PyMem_Calloc(p->nfold > 0 ? (size_t)p->nfold : 1, sizeof(Where));
        int ok = p->fold_sources != NULL && p->nfold >= 1;
        for (Py_ssize_t i = 0; ok && i < p->nfold; i++)
            ok = parse_where(PySequence_Fast_GET_ITEM(seq, i), &p->fold_sources[i]) == 0;
        Py_DECREF(seq);
        if (!ok) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "fold: one source or more");
            return -1;
        }
        p->fold_bytes = (size_t)nbytes;
        p->itemsize = (size_t)itemsize;
        p->writes_out |= p->fold_into.base == BASE_OUT;
    }
    return 0;
}

static void Program_dealloc(Program *p)
{
    Py_XDECREF(p->first.call);
    Py_XDECREF(p->first.args);
    Py_XDECREF(p->last.call);
    Py_XDECREF(p->last.args);
    Py_XDECREF(p->own);
    Py_XDECREF(p->held);
    PyMem_Free(p->direct);
    PyMem_Free(p->direct_requests);
    PyMem_Free(p->before);
    PyMem_Free(p->after);
    PyMem_Free(p->send_headers);
    PyMem_Free(p->receive_headers);
    PyMem_Free(p->requests);
    PyMem_Free(p->eager_sends);
    PyMem_Free(p->synchronous_sends);
    PyMem_Free(p->send_peers);
    PyMem_Free(p->done);
    PyMem_Free(p->fold_sources);
    PyMem_Free(p->status);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

static PyMethodDef Program_methods[] = {
    {"run", (PyCFunction)(void (*)(void))Program_run, METH_FASTCALL,
     "run(x, out, seq, deadline, poll_until): one call (see the module's doc)"},
    {"resume", (PyCFunction)(void (*)(void))Program_resume, METH_FASTCALL,
     "resume(x, out, poll_until): go on polling after run() returned PENDING"},
    {"cancel", (PyCFunction)Program_cancel, METH_NOARGS,
     "cancel(): a failed call's direct receives that have not completed cancelled"},
    {NULL},
};

static PyTypeObject ProgramType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "collectives.transport._across.Program",
    .tp_basicsize = sizeof(Program),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Program_init,
    .tp_dealloc = (destructor)Program_dealloc,
    .tp_methods = Program_methods,
    .tp_doc = "One small call shape across nodes: its node step, messages and fold (see the module's doc).",
};

/* -- the communicator's shortcuts ---------------------------------------------
 *
 * The communicator's first try at a call across nodes (across.py's
 * Programs: _fast_allreduce, _fast_collective): the shape's Program looked
 * up and run from here, so that a call that ends at once runs no Python.
 * Through three Python frames a 1 KiB broadcast on 2 pretend nodes of 2
 * took 6.2 us where its Program's run took 2.4 (4 processes on 2 cores:
 * every rank's interpreter time adds up). What is not the plain case (no
 * Program for the shape, a Program that needs its `own` view, reduce_scatter
 * in place, a run that did not end at once, an exception) goes to Python. */

typedef struct {
    PyObject_HEAD
    PyObject *laid;         /* Programs._laid: (collective, dtype, count, op, root) -> Laid (program first) */
    PyObject *counter;      /* whose `calls` number the calls (the HierarchyRanks) */
    PyObject *array_type;   /* the array type taken (numpy.ndarray) */
    PyObject *slow;         /* slow(collective, x, op, out, root, timeout): Python's shortcut, the rest */
    PyObject *finish;       /* finish(laid, status, x, out, deadline, error): after a run that did not end */
    PyObject *allreduce_name, *reduce_scatter_name, *zero, *one, *dtype_name, *size_name, *calls_name;
    Py_ssize_t own_index;   /* Laid's field that is not None where the Program needs `own` */
    double health_every;    /* seconds a run polls before Python looks at the deadline and signals */
} Shortcuts;

static PyTypeObject ShortcutsType;

/* One shortcut call: `done` once run, None where declined; else what slow
 * or finish return (or raise). */
static PyObject *shortcut_call(Shortcuts *s, PyObject *collective, PyObject *x, PyObject *op, PyObject *out,
                               PyObject *root, PyObject *timeout_object, int is_allreduce)
{
    if (Py_TYPE(x) != (PyTypeObject *)s->array_type || (out != Py_None && Py_TYPE(out) != (PyTypeObject *)s->array_type))
        Py_RETURN_NONE;
    double timeout = PyFloat_AsDouble(timeout_object);
    if (timeout == -1.0 && PyErr_Occurred())
        return NULL;
    if (out == Py_None && collective == s->reduce_scatter_name)   /* its own block of x: Python makes the view */
        goto slow;
    PyObject *dtype = PyObject_GetAttr(x, s->dtype_name);
    PyObject *size = dtype == NULL ? NULL : PyObject_GetAttr(x, s->size_name);
    PyObject *key = size == NULL ? NULL : PyTuple_Pack(5, collective, dtype, size, op, root);
    Py_XDECREF(size);
    if (key == NULL) {
        Py_XDECREF(dtype);
        return NULL;
    }
    PyObject *laid = PyDict_GetItemWithError(s->laid, key);
    Py_DECREF(key);
    if (laid == NULL) {
        Py_DECREF(dtype);
        if (!PyErr_Occurred())
            Py_RETURN_NONE;
        if (!PyErr_ExceptionMatches(PyExc_TypeError))   /* an unhashable op: the checks name it */
            return NULL;
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_INCREF(laid);   /* (held: Python code below, a collection included, may drop it from the dict) */
    PyObject *result = NULL, *deadline_object = NULL, *poll_object = NULL, *seq = NULL, *status = NULL;
    if (!PyTuple_Check(laid) || PyTuple_GET_SIZE(laid) <= s->own_index
        || !PyObject_TypeCheck(PyTuple_GET_ITEM(laid, 0), &ProgramType)) {
        PyErr_SetString(PyExc_TypeError, "Programs._laid holds something other than a Laid");
        goto done;
    }
    if (PyTuple_GET_ITEM(laid, s->own_index) != Py_None) {   /* a large allreduce's blocks */
        result = PyObject_CallFunctionObjArgs(s->slow, collective, x, op, out, root, timeout_object, NULL);
        goto done;
    }
    if (out == Py_None) {
        out = x;
    } else {
        PyObject *out_dtype = PyObject_GetAttr(out, s->dtype_name);
        int same = out_dtype == NULL ? -1 : PyObject_RichCompareBool(out_dtype, dtype, Py_EQ);
        Py_XDECREF(out_dtype);
        if (same <= 0) {   /* another dtype: declined (the checks name it) */
            result = same < 0 ? NULL : Py_NewRef(Py_None);
            goto done;
        }
    }
    double now = now_seconds(), deadline = now + timeout;
    double poll_until = now + s->health_every < deadline ? now + s->health_every : deadline;
    deadline_object = PyFloat_FromDouble(deadline);
    poll_object = PyFloat_FromDouble(poll_until);
    PyObject *calls = deadline_object == NULL || poll_object == NULL ? NULL
                    : PyObject_GetAttr(s->counter, s->calls_name);
    seq = calls == NULL ? NULL : PyNumber_Add(calls, s->one);
    Py_XDECREF(calls);
    if (seq == NULL || PyObject_SetAttr(s->counter, s->calls_name, seq) < 0)   /* (nothing ran) */
        goto done;
    PyObject *args[5] = {x, out, seq, deadline_object, poll_object};
    status = Program_run((Program *)PyTuple_GET_ITEM(laid, 0), args, 5);
    if (status != NULL && PyLong_CheckExact(status)) {   /* 0: done */
        result = Py_NewRef(is_allreduce ? out : Py_True);
    } else if (status == Py_None) {   /* the arrays are not the Program's: nothing ran, the checks run it */
        PyObject *back = PyNumber_Subtract(seq, s->one);
        if (back != NULL && PyObject_SetAttr(s->counter, s->calls_name, back) == 0)
            result = Py_NewRef(Py_None);
        Py_XDECREF(back);
    } else {   /* went on, failed or raised: Python resumes, aborts or raises */
        PyObject *error = status == NULL ? take_raised() : NULL;
        if (status != NULL || error != NULL) {
            PyObject *finished = PyObject_CallFunctionObjArgs(s->finish, laid, status != NULL ? status : Py_None, x,
                                                              out, deadline_object, error != NULL ? error : Py_None,
                                                              NULL);
            if (finished != NULL) {
                Py_DECREF(finished);
                result = Py_NewRef(is_allreduce ? out : Py_True);
            }
        }
        Py_XDECREF(error);
    }
done:
    Py_XDECREF(status);
    Py_XDECREF(seq);
    Py_XDECREF(poll_object);
    Py_XDECREF(deadline_object);
    Py_DECREF(dtype);
    Py_DECREF(laid);
    return result;
slow:
    return PyObject_CallFunctionObjArgs(s->slow, collective, x, op, out, root, timeout_object, NULL);
}

/* shortcuts.allreduce(x, op, out, timeout) -> out (x in place) once done, None where declined. */
static PyObject *Shortcuts_allreduce(Shortcuts *s, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "allreduce(x, op, out, timeout)");
        return NULL;
    }
    return shortcut_call(s, s->allreduce_name, args[0], args[1], args[2], s->zero, args[3], 1);
}

/* shortcuts.collective(collective, x, op, out, root, timeout) -> True once done, None where declined. */
static PyObject *Shortcuts_collective(Shortcuts *s, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "collective(collective, x, op, out, root, timeout)");
        return NULL;
    }
    return shortcut_call(s, args[0], args[1], args[2], args[3], args[4], args[5], 0);
}

static int Shortcuts_init(Shortcuts *s, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"laid", "counter", "array_type", "slow", "finish", "own_index", "health_every", NULL};
    PyObject *laid, *counter, *array_type, *slow, *finish;
    Py_ssize_t own_index;
    double health_every;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!OO!OOnd", names, &PyDict_Type, &laid, &counter, &PyType_Type,
                                     &array_type, &slow, &finish, &own_index, &health_every))
        return -1;
    Py_XSETREF(s->laid, Py_NewRef(laid));
    Py_XSETREF(s->counter, Py_NewRef(counter));
    Py_XSETREF(s->array_type, Py_NewRef(array_type));
    Py_XSETREF(s->slow, Py_NewRef(slow));
    Py_XSETREF(s->finish, Py_NewRef(finish));
    Py_XSETREF(s->allreduce_name, PyUnicode_InternFromString("allreduce"));
    Py_XSETREF(s->reduce_scatter_name, PyUnicode_InternFromString("reduce_scatter"));
    Py_XSETREF(s->dtype_name, PyUnicode_InternFromString("dtype"));
    Py_XSETREF(s->size_name, PyUnicode_InternFromString("size"));
    Py_XSETREF(s->calls_name, PyUnicode_InternFromString("calls"));
    Py_XSETREF(s->zero, PyLong_FromLong(0));
    Py_XSETREF(s->one, PyLong_FromLong(1));
    s->own_index = own_index;
    s->health_every = health_every;
    if (s->allreduce_name == NULL || s->reduce_scatter_name == NULL || s->dtype_name == NULL || s->size_name == NULL
        || s->calls_name == NULL || s->zero == NULL || s->one == NULL)
        return -1;
    return 0;
}

static int Shortcuts_traverse(Shortcuts *s, visitproc visit, void *arg)
{
    Py_VISIT(s->laid);
    Py_VISIT(s->counter);
    Py_VISIT(s->array_type);
    Py_VISIT(s->slow);
    Py_VISIT(s->finish);
    return 0;
}

static int Shortcuts_clear(Shortcuts *s)
{
    Py_CLEAR(s->laid);
    Py_CLEAR(s->counter);
    Py_CLEAR(s->array_type);
    Py_CLEAR(s->slow);
    Py_CLEAR(s->finish);
    return 0;
}

static void Shortcuts_dealloc(Shortcuts *s)
{
    PyObject_GC_UnTrack(s);
    Shortcuts_clear(s);
    Py_CLEAR(s->allreduce_name);
    Py_CLEAR(s->reduce_scatter_name);
    Py_CLEAR(s->dtype_name);
    Py_CLEAR(s->size_name);
    Py_CLEAR(s->calls_name);
    Py_CLEAR(s->zero);
    Py_CLEAR(s->one);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyMethodDef Shortcuts_methods[] = {
    {"allreduce", (PyCFunction)(void (*)(void))Shortcuts_allreduce, METH_FASTCALL,
     "allreduce(x, op, out, timeout): the communicator's allreduce through its shape's Program"},
    {"collective", (PyCFunction)(void (*)(void))Shortcuts_collective, METH_FASTCALL,
     "collective(collective, x, op, out, root, timeout): the other four through their shape's Program"},
    {NULL},
};

static PyTypeObject ShortcutsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "collectives.transport._across.Shortcuts",
    .tp_basicsize = sizeof(Shortcuts),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Shortcuts_init,
    .tp_dealloc = (destructor)Shortcuts_dealloc,
    .tp_traverse = (traverseproc)Shortcuts_traverse,
    .tp_clear = (inquiry)Shortcuts_clear,
    .tp_methods = Shortcuts_methods,
    .tp_doc = "The communicator's shortcuts across nodes: a call shape's Program run with no Python (across.py).",
};

/* -- the module ------------------------------------------------------------- */

static PyObject *py_bind_mpi(PyObject *Py_UNUSED(self), PyObject *args)
{
    unsigned long long start, test, isend, irecv, cancel;
    Py_ssize_t size, handles;
    if (!PyArg_ParseTuple(args, "KKKKKnn", &start, &test, &isend, &irecv, &cancel, &size, &handles))
        return NULL;
    if (start == 0 || test == 0 || isend == 0 || irecv == 0 || cancel == 0 || size <= 0
        || (handles != sizeof(int) && handles != sizeof(void *))) {
        PyErr_SetString(PyExc_ValueError, "bind_mpi: five function addresses, the size of MPI_Status and of a handle");
        return NULL;
    }
    mpi_start = (mpi_start_fn)(uintptr_t)start;
    mpi_test = (mpi_test_fn)(uintptr_t)test;
    mpi_isend = (void *)(uintptr_t)isend;
    mpi_irecv = (void *)(uintptr_t)irecv;
    mpi_cancel = (mpi_cancel_fn)(uintptr_t)cancel;
    status_size = size;
    handle_size = handles;
    Py_RETURN_NONE;
}

static PyObject *py_element_type(PyObject *Py_UNUSED(self), PyObject *array)
{
    Py_buffer view;
    if (PyObject_GetBuffer(array, &view, PyBUF_FORMAT | PyBUF_ANY_CONTIGUOUS) < 0)
        return NULL;
    int type = element_type(&view);
    PyBuffer_Release(&view);
    return PyLong_FromLong(type);
}

static PyMethodDef module_methods[] = {
    {"bind_mpi", py_bind_mpi, METH_VARARGS,
     "bind_mpi(MPI_Start, MPI_Test, MPI_Isend, MPI_Irecv, MPI_Cancel, sizeof(MPI_Status), sizeof(MPI_Comm)): the "
     "loaded MPI library's functions, by address"},
    {"element_type", py_element_type, METH_O,
     "element_type(array): host_folds.h's code for the array's element type, -1 where the folds lack it"},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "collectives.transport._across",
    "The small path across nodes in one compiled call (hierarchy.py).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__across(void)
{
    if (PyType_Ready(&ProgramType) < 0 || PyType_Ready(&ShortcutsType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&ProgramType);
    if (PyModule_AddObject(m, "Program", (PyObject *)&ProgramType) < 0) {
        Py_DECREF(&ProgramType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&ShortcutsType);
    if (PyModule_AddObject(m, "Shortcuts", (PyObject *)&ShortcutsType) < 0) {
        Py_DECREF(&ShortcutsType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "X", BASE_X);
    PyModule_AddIntConstant(m, "OUT", BASE_OUT);
    PyModule_AddIntConstant(m, "ADDRESS", BASE_ADDRESS);
    if (add_status_constants(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
