/* Point-to-point mailboxes of host ranks in separate processes: send and
 * recv without Python in the loop (p2p.py: the protocol; layout.py: the
 * bytes). Apart from the collectives' loop (_shmloop.c) because it is
 * another protocol over other memory: per pair of ranks, a ring of slots
 * with SENT and TAKEN counters.
 *
 * The common case: a send whose every fragment fits the free slots now (it
 * never waits), a send that streams its fragments in as the receiver frees
 * slots, and a receive from one peer by a rank with nothing else pending,
 * whose head message has the receive's tag and bytes. Anything else is
 * declined (NOT_FAST, nothing consumed) and p2p.py's engine does it.
 *
 * Where p2p.py asks, a large message goes in one copy (its module doc): its
 * one fragment is a descriptor (FRAGMENT_OFFSET SINGLE_COPY, the sender's
 * pid and the address of its bytes), which the receiver reads straight out
 * of the sender's process (process_vm_readv) before it publishes TAKEN; the
 * sender returns once TAKEN passes the descriptor. A receiver that cannot
 * read the sender's memory raises the slot's REFUSED word instead, and the
 * sender then sends the message as fragments.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <sys/uio.h>
#include <time.h>

#include "shm_waits.h"
#include "host_folds.h"   /* element_type: the dtypes a message may carry */
#include "raised.h"


static struct {
    int ready;
    long header, sent, taken;          /* header bytes; SENT and TAKEN: its int64 words */
    long slots, slot_header, slot_bytes;
    long bytes_word, tag_word, offset_word, fragment_word;   /* a slot header's int64 words */
    long pid_word, address_word, refused_word;   /* and a descriptor's (single copy) */
    long fragment_min;                 /* layout.fragment_bytes's least fragment */
} box_layout;

enum { NOT_FAST = DECLINED };   /* and REFUSED: statuses.h */
enum { SINGLE_COPY = -1 };   /* FRAGMENT_OFFSET of a descriptor */

static PyObject *py_mailbox_layout(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 14) {
        PyErr_SetString(PyExc_TypeError, "mailbox_layout(header, sent, taken, slots, slot_header, slot_bytes, "
                                         "bytes_word, tag_word, offset_word, pid_word, address_word, refused_word, "
                                         "fragment_word, fragment_min)");
        return NULL;
    }
    long v[14];
    for (int i = 0; i < 14; i++) {
        v[i] = PyLong_AsLong(args[i]);
        if (PyErr_Occurred())
            return NULL;
    }
    box_layout.header = v[0], box_layout.sent = v[1], box_layout.taken = v[2], box_layout.slots = v[3];
    box_layout.slot_header = v[4], box_layout.slot_bytes = v[5];
    box_layout.bytes_word = v[6], box_layout.tag_word = v[7], box_layout.offset_word = v[8];
    box_layout.pid_word = v[9], box_layout.address_word = v[10], box_layout.refused_word = v[11];
    box_layout.fragment_word = v[12], box_layout.fragment_min = v[13];
    box_layout.ready = 1;
    Py_RETURN_NONE;
}

static inline char *box_slot(char *box, int64_t index)
{
    return box + box_layout.header + (index % box_layout.slots) * (box_layout.slot_header + box_layout.slot_bytes);
}

/* layout.fragment_bytes: a fourth of the message, between fragment_min and a slot, in whole cache lines */
static inline int64_t fragment_bytes(int64_t total)
{
    int64_t quarter = (total + box_layout.slots - 1) / box_layout.slots;
    int64_t lines = (quarter + 63) / 64 * 64;
    int64_t bytes = lines > box_layout.fragment_min ? lines : box_layout.fragment_min;
    return bytes < box_layout.slot_bytes ? bytes : box_layout.slot_bytes;
}

/* Fragment k of a message (`fragment` bytes each, the last shorter) into
 * the slot of SENT index `index`, published once copied in. */
static void put_fragment(char *box, int64_t index, const char *data, int64_t nbytes, int64_t tag, int64_t fragment,
                         int64_t k)
{
    char *slot = box_slot(box, index);
    int64_t *head = (int64_t *)slot, offset = k * fragment;
    int64_t length = nbytes - offset < fragment ? nbytes - offset : fragment;
    head[box_layout.bytes_word] = nbytes, head[box_layout.tag_word] = tag, head[box_layout.offset_word] = offset;
    head[box_layout.fragment_word] = length;
    if (length > 0)
        memcpy(slot + box_layout.slot_header, data + offset, (size_t)length);
    __atomic_store_n(&((int64_t *)box)[box_layout.sent], index + 1, __ATOMIC_RELEASE);   /* after its fragment */
}

/* mailbox_put(box, data, tag) -> True once every fragment of the message
 * (`data`: any object with the buffer protocol, all its bytes) is in a
 * slot and published, False (nothing written) where they do not all fit
 * the free slots now. Each fragment is published as soon as it is copied
 * in: a waiting receiver copies it out while this copies the next. */
static PyObject *py_mailbox_put(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !box_layout.ready) {
        PyErr_SetString(PyExc_TypeError, "mailbox_put(box, data, tag), after mailbox_layout()");
        return NULL;
    }
    char *box = (char *)PyLong_AsVoidPtr(args[0]);
    long long tag = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const char *data = (const char *)view.buf;
    long long nbytes = (long long)view.len;
    int64_t *words = (int64_t *)box;
    int64_t sent = load_acquire(&words[box_layout.sent]), taken = load_acquire(&words[box_layout.taken]);
    int64_t fragment = fragment_bytes(nbytes);
    int64_t fragments = nbytes == 0 ? 1 : (nbytes + fragment - 1) / fragment;
    if (sent + fragments - taken > box_layout.slots) {
        PyBuffer_Release(&view);
        Py_RETURN_FALSE;
    }
    for (int64_t k = 0; k < fragments; k++)
        put_fragment(box, sent + k, data, nbytes, tag, fragment, k);
    PyBuffer_Release(&view);
    Py_RETURN_TRUE;
}

/* Wait until the mailbox's counter `sent` passes `taken`: spin, yield, then
 * sleep, looking at the abort flag, the peer's process and the deadline.
 * (The senders wait so on TAKEN, for the receiver: the single copy's for
 * its descriptor to be read, the stream's for a free slot.) */
static int wait_for_fragment(const int64_t *sent, int64_t taken, const int64_t *abort_flag, int64_t pid,
                             double deadline, long spin, double yield_seconds)
{
    for (long i = 0; i < spin; i++) {
        if (load_acquire(sent) > taken)
            return OK;
        CPU_RELAX();   /* as the loop's waits (shm_waits.h) */
    }
    int status = OK;
    PyThreadState *released = PyEval_SaveThread();
    double now = now_seconds(), yield_until = now + yield_seconds, next_check = now + FIRST_LOOK_SECONDS, nap = 1e-5;
    while (load_acquire(sent) <= taken) {
        now = now_seconds();
        if (__atomic_load_n(abort_flag, __ATOMIC_ACQUIRE)) {
            status = load_acquire(sent) > taken ? OK : ABORTED;
            break;
        }
        if (now >= next_check) {
            if (!process_alive(pid)) {
                status = load_acquire(sent) > taken ? OK : PEER_DEAD;   /* published, then died */
                break;
            }
            PyEval_RestoreThread(released);
            int raised = PyErr_CheckSignals() < 0;
            released = PyEval_SaveThread();
            if (raised) {
                status = INTERRUPTED;
                break;
            }
            next_check = now + LIVENESS_SECONDS;
        }
        if (now >= deadline) {
            status = TIMED_OUT;
            break;
        }
        if (now < yield_until) {
            sched_yield();
        } else {
            struct timespec ts = {0, (long)(nap * 1e9)};
            nanosleep(&ts, NULL);
            nap = nap * 2 < 1e-3 ? nap * 2 : 1e-3;
        }
    }
    PyEval_RestoreThread(released);
    return status;
}

static int take_message(char *box, char *data, int64_t nbytes, int64_t tag, double deadline,
                        const int64_t *abort_flag, int64_t pid, long spin, double yield_seconds);

/* Set by the tests alone (mailbox_test_refuse): this process reads no
 * sender's memory, as where it may not, so that the fragments after a
 * refusal run where it may. */
static int refuse_for_tests;

/* Read `nbytes` at `address` in process `pid` into `data`: OK, PEER_DEAD
 * (gone), or REFUSED (no permission: another user, a ptrace restriction,
 * a seccomp filter). */
static int read_sender(int64_t pid, int64_t address, char *data, int64_t nbytes)
{
    if (refuse_for_tests)
        return REFUSED;
    while (nbytes > 0) {
        struct iovec here = {data, (size_t)nbytes}, there = {(void *)(uintptr_t)address, (size_t)nbytes};
        ssize_t got = process_vm_readv((pid_t)pid, &here, 1, &there, 1, 0);
        if (got <= 0) {
            if (got < 0 && errno == EINTR)
                continue;
            return (got < 0 && errno == ESRCH) || !process_alive((pid_t)pid) ? PEER_DEAD : REFUSED;
        }
        data += got, address += got, nbytes -= got;
    }
    return OK;
}

static PyObject *py_mailbox_test_refuse(PyObject *Py_UNUSED(self), PyObject *arg)
{
    int refuse = PyObject_IsTrue(arg);
    if (refuse < 0)
        return NULL;
    refuse_for_tests = refuse;
    Py_RETURN_NONE;
}

/* read_process(pid, address, data, abort_address) -> OK, PEER_DEAD,
 * REFUSED or ABORTED: a descriptor's bytes into `data` (a writable buffer
 * of exactly their size), for p2p.py's engine; ABORTED where the abort
 * flag was up once they were read (see take_message). */
static PyObject *py_read_process(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "read_process(pid, address, data, abort_address)");
        return NULL;
    }
    long long pid = PyLong_AsLongLong(args[0]), address = PyLong_AsLongLong(args[1]);
    const int64_t *abort_flag = (const int64_t *)PyLong_AsVoidPtr(args[3]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[2], &view, PyBUF_WRITABLE) < 0)
        return NULL;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = read_sender(pid, address, (char *)view.buf, (int64_t)view.len);
    if (status == OK && __atomic_load_n(abort_flag, __ATOMIC_SEQ_CST))
        status = ABORTED;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromLong(status);
}

/* The arguments the mailbox's waiting calls share, parsed: (box, data, tag,
 * deadline, abort_address, pid, spin, yield_seconds), data left to each. */
typedef struct {
    char *box;
    long long tag;
    double deadline;
    const int64_t *abort_flag;
    long long pid;
    long spin;
    double yield_seconds;
} BoxCall;

static int box_call(const char *name, PyObject *const *args, Py_ssize_t nargs, BoxCall *call)
{
    if (nargs != 8 || !box_layout.ready) {
        PyErr_Format(PyExc_TypeError, "%s(box, data, tag, deadline, abort_address, pid, spin, yield_seconds), "
                                      "after mailbox_layout()", name);
        return -1;
    }
    call->box = (char *)PyLong_AsVoidPtr(args[0]);
    call->tag = PyLong_AsLongLong(args[2]);
    call->deadline = PyFloat_AsDouble(args[3]);
    call->abort_flag = (const int64_t *)PyLong_AsVoidPtr(args[4]);
    call->pid = PyLong_AsLongLong(args[5]);
    call->spin = PyLong_AsLong(args[6]);
    call->yield_seconds = PyFloat_AsDouble(args[7]);
    return PyErr_Occurred() ? -1 : 0;
}

/* mailbox_send_single_copy(box, data, tag, deadline, abort_address, pid, spin, yield_seconds) -> status:
 * the message `data` (its bytes, which stay put until this returns) as a
 * descriptor in the mailbox: OK once the receiver (process `pid`) has read
 * it; REFUSED once the receiver said it cannot (then send it as fragments,
 * which it now expects); NOT_FAST where no slot is free (nothing written);
 * else why it stopped (TIMED_OUT, ABORTED, PEER_DEAD, INTERRUPTED with the
 * exception set), the descriptor left in its slot: the communicator is
 * then aborted. */
static PyObject *py_mailbox_send_single_copy(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    BoxCall a;
    if (box_call("mailbox_send_single_copy", args, nargs, &a) < 0)
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    int64_t *words = (int64_t *)a.box;
    int64_t sent = load_acquire(&words[box_layout.sent]);
    if (sent - load_acquire(&words[box_layout.taken]) >= box_layout.slots) {
        PyBuffer_Release(&view);
        return PyLong_FromLong(NOT_FAST);
    }
    int64_t *head = (int64_t *)box_slot(a.box, sent);
    head[box_layout.bytes_word] = (int64_t)view.len, head[box_layout.tag_word] = a.tag;
    head[box_layout.offset_word] = SINGLE_COPY, head[box_layout.pid_word] = (int64_t)getpid();
    head[box_layout.address_word] = (int64_t)(uintptr_t)view.buf, head[box_layout.refused_word] = 0;
    __atomic_store_n(&words[box_layout.sent], sent + 1, __ATOMIC_RELEASE);   /* last: the descriptor first */
    int status = wait_for_fragment(&words[box_layout.taken], sent, a.abort_flag, a.pid, a.deadline, a.spin,
                                   a.yield_seconds);
    if (status == OK && __atomic_load_n(&head[box_layout.refused_word], __ATOMIC_ACQUIRE))
        status = REFUSED;
    PyBuffer_Release(&view);
    if (status == INTERRUPTED)
        return NULL;
    return PyLong_FromLong(status);
}

/* mailbox_stream(box, data, tag, deadline, abort_address, pid, spin, yield_seconds) -> status:
 * the message `data` as fragments through the slots, each put in as soon
 * as the receiver (process `pid`) has freed a slot: OK once the last one
 * is in (as mailbox_put, the send is then done); else why it stopped
 * (TIMED_OUT, ABORTED, PEER_DEAD, INTERRUPTED with the exception set),
 * with some fragments published: the communicator is then aborted. For
 * messages that do not fit the free slots now, the larger than the slots
 * among them (below p2p.py's single-copy size): the receiver copies one
 * fragment out while this copies the next in. */
static PyObject *py_mailbox_stream(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    BoxCall a;
    if (box_call("mailbox_stream", args, nargs, &a) < 0)
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    int64_t *words = (int64_t *)a.box;
    int64_t nbytes = (int64_t)view.len, sent = load_acquire(&words[box_layout.sent]);
    int64_t fragment = fragment_bytes(nbytes);
    int64_t fragments = nbytes == 0 ? 1 : (nbytes + fragment - 1) / fragment;
    int status = OK;
    for (int64_t k = 0; k < fragments && status == OK; k++) {
        int64_t index = sent + k;   /* its slot is free once TAKEN passes index - slots */
        if (index - load_acquire(&words[box_layout.taken]) >= box_layout.slots)
            status = wait_for_fragment(&words[box_layout.taken], index - box_layout.slots, a.abort_flag, a.pid,
                                       a.deadline, a.spin, a.yield_seconds);
        if (status == OK)
            put_fragment(a.box, index, (const char *)view.buf, nbytes, a.tag, fragment, k);
    }
    PyBuffer_Release(&view);
    if (status == INTERRUPTED)
        return NULL;
    return PyLong_FromLong(status);
}

/* mailbox_take(box, data, tag, deadline, abort_address, pid, spin, yield_seconds) -> status:
 * OK once the whole message is in `data` (a writable buffer of exactly its
 * bytes); NOT_FAST where the head message is not one of `tag` and of
 * `data`'s bytes (nothing taken); else why it stopped
 * (TIMED_OUT, ABORTED, PEER_DEAD, INTERRUPTED with the exception set),
 * possibly with some fragments taken: the communicator is then aborted. */
static PyObject *py_mailbox_take(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    BoxCall a;
    if (box_call("mailbox_take", args, nargs, &a) < 0)
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_WRITABLE) < 0)
        return NULL;
    int status = take_message(a.box, (char *)view.buf, (int64_t)view.len, a.tag, a.deadline, a.abort_flag, a.pid,
                              a.spin, a.yield_seconds);
    PyBuffer_Release(&view);
    if (status == INTERRUPTED)
        return NULL;
    return PyLong_FromLong(status);
}

static int take_message(char *box, char *data, int64_t nbytes, int64_t tag, double deadline,
                        const int64_t *abort_flag, int64_t pid, long spin, double yield_seconds)
{
    int64_t *words = (int64_t *)box;
    int64_t taken = load_acquire(&words[box_layout.taken]);
    for (int first = 1;; first = 0) {
        int status = wait_for_fragment(&words[box_layout.sent], taken, abort_flag, pid, deadline, spin, yield_seconds);
        if (status != OK)
            return status;
        const char *slot = box_slot(box, taken);
        int64_t *head = (int64_t *)slot;
        int64_t total = head[box_layout.bytes_word], offset = head[box_layout.offset_word];
        if (first && (head[box_layout.tag_word] != tag || total != nbytes || (offset != 0 && offset != SINGLE_COPY)))
            return NOT_FAST;
        if (offset == SINGLE_COPY) {   /* a descriptor: the bytes are read out of the sender */
            int read = read_sender(head[box_layout.pid_word], head[box_layout.address_word], data, total);
            if (read == PEER_DEAD)
                return PEER_DEAD;
            /* A sender whose send failed (its timeout) aborts the communicator
             * before its caller may change the array: a read that overlapped
             * such a change sees the abort here, and the receive fails. */
            if (__atomic_load_n(abort_flag, __ATOMIC_SEQ_CST))
                return ABORTED;
            if (read == REFUSED)   /* the sender sends fragments next, from offset 0 */
                __atomic_store_n(&head[box_layout.refused_word], 1, __ATOMIC_RELAXED);   /* (TAKEN releases it) */
            __atomic_store_n(&words[box_layout.taken], ++taken, __ATOMIC_RELEASE);
            if (read == OK)
                return OK;
            continue;
        }
        int64_t length = head[box_layout.fragment_word];
        if (offset < 0 || length < 0 || length > box_layout.slot_bytes || length > total - offset)
            return MISMATCH;   /* a fragment outside its message: never written so by a sender */
        if (length > 0)
            memcpy(data + offset, slot + box_layout.slot_header, (size_t)length);
        __atomic_store_n(&words[box_layout.taken], ++taken, __ATOMIC_RELEASE);
        if (offset + length >= total)
            return OK;
    }
}

/* ---- The mailboxes' shortcuts: send and recv with no Python frame ----------
 *
 * A Postbox is one rank's view of the mailboxes (p2p.py makes it), whose
 * send and recv the communicator calls first with its own arguments: a
 * send whose fragments fit the free slots (mailbox_put), a receive from a
 * named peer (take_message), each checked here as far as the mailbox needs
 * (the array's type and layout, a supported element, the peer and tag in
 * range). The Python frames and checks they skip were about 0.9-1.4 us of
 * an 8-byte message's 1.1-1.9 us one way between 2 processes. Anything else
 * declines (None: nothing done), and p2p.py's engine does it; so does every
 * call while that engine has something pending (`busy`, which it keeps
 * current: a request waiting, a message read ahead), since the shortcuts
 * move no request and match nothing read ahead. A failed receive goes to
 * on_failure, which aborts the communicator and raises. */

typedef struct {
    PyObject_HEAD
    char *mailboxes;            /* pair (sender * size + receiver) at mailboxes + pair * stride */
    Py_ssize_t stride;
    int rank, size;
    const int64_t *rows;        /* the ranks' rows (ROW_SLOTS each): each one's PID */
    const int64_t *abort_flag;
    long spin;
    double yield_seconds;
    int busy;                   /* p2p.py's engine has requests pending or messages read ahead */
    int closed;                 /* the mailboxes' memory is about to go */
    PyObject *arrays;           /* the array types taken (a tuple) */
    PyObject *on_failure;       /* on_failure(status, peer, tag, nbytes, kind): aborts and raises */
} Postbox;

static int Postbox_init(Postbox *b, PyObject *args, PyObject *kwargs)
{
    unsigned long long mailboxes, rows, abort_address;
    PyObject *arrays, *on_failure;
    static char *names[] = {"mailboxes", "stride", "rank", "size", "rows", "abort_address", "spin",
                            "yield_seconds", "arrays", "on_failure", NULL};
    if (!box_layout.ready) {
        PyErr_SetString(PyExc_RuntimeError, "Postbox: mailbox_layout() first");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KniiKKldO!O", names, &mailboxes, &b->stride, &b->rank,
                                     &b->size, &rows, &abort_address, &b->spin, &b->yield_seconds,
                                     &PyTuple_Type, &arrays, &on_failure))
        return -1;
    b->mailboxes = (char *)(uintptr_t)mailboxes;
    b->rows = (const int64_t *)(uintptr_t)rows;
    b->abort_flag = (const int64_t *)(uintptr_t)abort_address;
    Py_XSETREF(b->arrays, Py_NewRef(arrays));
    Py_XSETREF(b->on_failure, Py_NewRef(on_failure));
    return 0;
}

static int Postbox_traverse(Postbox *b, visitproc visit, void *arg)
{
    Py_VISIT(b->arrays);
    Py_VISIT(b->on_failure);
    return 0;
}

static int Postbox_clear(Postbox *b)
{
    Py_CLEAR(b->arrays);
    Py_CLEAR(b->on_failure);
    return 0;
}

static void Postbox_dealloc(Postbox *b)
{
    PyObject_GC_UnTrack(b);
    Postbox_clear(b);
    Py_TYPE(b)->tp_free((PyObject *)b);
}

/* The peer's rank, or -1 where the shortcuts decline it (not an int, out of
 * range, this rank itself, or a peer not attached yet). */
static int postbox_peer(Postbox *b, PyObject *peer)
{
    if (!PyLong_CheckExact(peer))
        return -1;
    long q = PyLong_AsLong(peer);
    if (q == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    if (q < 0 || q >= b->size || q == b->rank || b->rows[q * ROW_SLOTS + PID] == 0)
        return -1;
    return (int)q;
}

/* The tag, or -1 where declined (not an int, or outside 0..MAX_TAG: the checks name it). */
static long long postbox_tag(PyObject *tag)
{
    if (!PyLong_CheckExact(tag))
        return -1;
    long long t = PyLong_AsLongLong(tag);
    if (t == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return t <= (1LL << 62) - 1 ? t : -1;   /* validation.MAX_TAG */
}

/* A view of `a` (flags: PyBUF_WRITABLE or 0) where the shortcuts take it:
 * an array of the taken types, C-contiguous, of an element a message
 * carries; else 0 with nothing held. */
static int postbox_view(Postbox *b, PyObject *a, int flags, Py_buffer *view)
{
    Py_ssize_t n = PyTuple_GET_SIZE(b->arrays), i = 0;
    while (i < n && (PyObject *)Py_TYPE(a) != PyTuple_GET_ITEM(b->arrays, i))
        i++;
    if (i == n)
        return 0;
    if (PyObject_GetBuffer(a, view, flags | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();   /* (bfloat16 exports no format: the engine's checks take it) */
        return 0;
    }
    const char *f = view->format ? view->format : "B";
    if (element_type(view) < 0 && !(f[0] == 'e' && f[1] == '\0')) {   /* float16 is carried too */
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

/* postbox.send(x, peer, tag) -> True once every fragment of x is in the
 * free slots of the mailbox to `peer`, None where declined (nothing sent). */
static PyObject *Postbox_send(Postbox *b, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "send(x, peer, tag)");
        return NULL;
    }
    if (b->busy || b->closed)
        Py_RETURN_NONE;
    int peer = postbox_peer(b, args[1]);
    long long tag = postbox_tag(args[2]);
    Py_buffer view;
    if (peer < 0 || tag < 0 || !postbox_view(b, args[0], 0, &view))
        Py_RETURN_NONE;
    char *box = b->mailboxes + ((Py_ssize_t)b->rank * b->size + peer) * b->stride;
    int64_t *words = (int64_t *)box;
    int64_t nbytes = (int64_t)view.len, sent = load_acquire(&words[box_layout.sent]);
    int64_t fragment = fragment_bytes(nbytes);
    int64_t fragments = nbytes == 0 ? 1 : (nbytes + fragment - 1) / fragment;
    int fits = sent + fragments - load_acquire(&words[box_layout.taken]) <= box_layout.slots;
    for (int64_t k = 0; fits && k < fragments; k++)
        put_fragment(box, sent + k, (const char *)view.buf, nbytes, tag, fragment, k);
    PyBuffer_Release(&view);
    if (!fits)
        Py_RETURN_NONE;
    Py_RETURN_TRUE;
}

/* postbox.recv(out, peer, tag, timeout) -> peer once the head message of
 * the mailbox from `peer` (of `tag` and of out's bytes) is in `out`, None
 * where declined (nothing taken); a failure goes to on_failure. */
static PyObject *Postbox_recv(Postbox *b, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "recv(out, peer, tag, timeout)");
        return NULL;
    }
    if (b->busy || b->closed)
        Py_RETURN_NONE;
    int peer = postbox_peer(b, args[1]);
    long long tag = postbox_tag(args[2]);
    double timeout = PyFloat_AsDouble(args[3]);
    if (timeout == -1.0 && PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (peer < 0 || tag < 0 || !postbox_view(b, args[0], PyBUF_WRITABLE, &view))
        Py_RETURN_NONE;
    char *box = b->mailboxes + ((Py_ssize_t)peer * b->size + b->rank) * b->stride;
    Py_ssize_t nbytes = view.len;
    int status = take_message(box, (char *)view.buf, (int64_t)nbytes, tag, now_seconds() + timeout, b->abort_flag,
                              b->rows[peer * ROW_SLOTS + PID], b->spin, b->yield_seconds);
    PyBuffer_Release(&view);
    if (status == OK)
        return PyLong_FromLong(peer);
    if (status == NOT_FAST)
        Py_RETURN_NONE;
    if (status == INTERRUPTED)
        return NULL;
    return PyObject_CallFunction(b->on_failure, "iiLns", status, peer, tag, nbytes, "recv");
}

static PyMemberDef Postbox_members[] = {
    {"busy", T_INT, offsetof(Postbox, busy), 0,
     "the engine has requests pending or messages read ahead: the shortcuts decline"},
    {"closed", T_INT, offsetof(Postbox, closed), 0, "the mailboxes are going: the shortcuts decline"},
    {NULL},
};

static PyMethodDef Postbox_methods[] = {
    {"send", (PyCFunction)(void (*)(void))Postbox_send, METH_FASTCALL,
     "send(x, peer, tag): True once x is in the free slots, None where declined"},
    {"recv", (PyCFunction)(void (*)(void))Postbox_recv, METH_FASTCALL,
     "recv(out, peer, tag, timeout): peer once its message is in out, None where declined; failures go to "
     "on_failure"},
    {NULL},
};

static PyTypeObject PostboxType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "collectives.transport._mailbox.Postbox",
    .tp_basicsize = sizeof(Postbox),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Postbox_init,
    .tp_dealloc = (destructor)Postbox_dealloc,
    .tp_traverse = (traverseproc)Postbox_traverse,
    .tp_clear = (inquiry)Postbox_clear,
    .tp_methods = Postbox_methods,
    .tp_members = Postbox_members,
    .tp_doc = "This rank's view of the mailboxes: send and recv's shortcuts (see _mailbox.c).",
};

static PyMethodDef module_methods[] = {
    {"mailbox_layout", (PyCFunction)(void (*)(void))py_mailbox_layout, METH_FASTCALL,
     "mailbox_layout(header, sent, taken, slots, slot_header, slot_bytes, bytes_word, tag_word, offset_word, "
     "pid_word, address_word, refused_word, fragment_word, fragment_min): "
     "layout.py's mailbox, once"},
    {"mailbox_put", (PyCFunction)(void (*)(void))py_mailbox_put, METH_FASTCALL,
     "mailbox_put(box, data, tag): every fragment into the free slots and published (True), or nothing (False)"},
    {"mailbox_send_single_copy", (PyCFunction)(void (*)(void))py_mailbox_send_single_copy, METH_FASTCALL,
     "mailbox_send_single_copy(box, data, tag, deadline, abort_address, pid, spin, yield_seconds): a status; "
     "see _mailbox.c"},
    {"mailbox_test_refuse", py_mailbox_test_refuse, METH_O,
     "mailbox_test_refuse(flag): for the tests, this process refuses every single-copy message (or no longer)"},
    {"read_process", (PyCFunction)(void (*)(void))py_read_process, METH_FASTCALL,
     "read_process(pid, address, data, abort_address): a descriptor's bytes into data; OK, PEER_DEAD, REFUSED "
     "or ABORTED"},
    {"mailbox_stream", (PyCFunction)(void (*)(void))py_mailbox_stream, METH_FASTCALL,
     "mailbox_stream(box, data, tag, deadline, abort_address, pid, spin, yield_seconds): a status; every fragment "
     "put in as the receiver frees slots"},
    {"mailbox_take", (PyCFunction)(void (*)(void))py_mailbox_take, METH_FASTCALL,
     "mailbox_take(box, data, tag, deadline, abort_address, pid, spin, yield_seconds): a status; see _mailbox.c"},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_mailbox", "The compiled send and recv of host ranks in separate processes.", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__mailbox(void)
{
    if (PyType_Ready(&PostboxType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Postbox", (PyObject *)&PostboxType) < 0
            || PyModule_AddIntConstant(m, "NOT_FAST", NOT_FAST) < 0
            || PyModule_AddIntConstant(m, "SINGLE_COPY", SINGLE_COPY) < 0
            || add_status_constants(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
