/* The compiled inner loop of host ranks in separate processes.
 *
 * Python decides what to run and with which memory; this file runs the
 * parts Python cannot run fast enough: copies, reductions and the waits
 * between ranks of the five collectives on the shared "channel" (fastpath.py
 * describes its layout), and the release/acquire accesses every counter of
 * the step protocol (protocol.py) goes through. The waits are shm_waits.h
 * (with the memory ordering every counter follows), the folds
 * executors/host_folds.h; both are shared with the compiled plan executor
 * (executors/_host_plan.c).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <time.h>

#include "shm_waits.h"
#include "host_folds.h"
#include "raised.h"
#include "signatures.h"

/* ------------------------------------------------------------------------ */
/* The channel                                                              */

/* The steps a taken call runs (Channel.last_step names them, as fastpath.STEPS does), and
 * STEP_PLANS: a large message the ranks may single copy, which the loop declines (the plans
 * run it: ShmRank's single-copy plans; a node's step across nodes too: HierarchyRanks.plans_step) */
enum { STEP_NONE, STEP_MERGED, STEP_STAGED, STEP_PLANS };

typedef struct {
    PyObject_HEAD
    Waits waits;
    char *small;            /* rank r's small slots: small + r * small_stride */
    size_t small_stride;    /* 2 slots of SLOT_HEADER + small_max */
    size_t small_max;       /* the slots' size */
    size_t merged_max;      /* messages of up to this many bytes take the merged step (<= small_max) */
    char *staging;          /* rank r's staging: staging + r * staging_stride */
    size_t staging_stride;  /* 2 parities of nranks chunks */
    size_t chunk;           /* bytes per chunk */
    int64_t small_calls;    /* small calls made, for the slot parity */
    int64_t chunks_done;    /* pipelined iterations made over the channel's life */
    int single_copy;        /* 1: large messages past the staging limits are the plans' single copy;
                             * 0: every one stages (COLLECTIVES_FAST_SINGLE_COPY=0, refuse_single_copy) */
    size_t staged_max;         /* a large fold (see copies_stage) of up to this many bytes per rank stages
                                * even where the ranks may single copy (0: never; config.LoopTunables.staged_max:
                                * copying and folding through staging in cache beat what a
                                * process_vm_readv per block brought in) */
    int copies_stage;          /* allgather and broadcast stage up to staged_max too (0 where the
                                * machine's processes outnumber its cores: fastpath.py says why) */
    size_t staged_spread_max;  /* allgather of up to this many bytes per rank stages even
                                * where the ranks may single copy (0: never; fastpath.py sets it when
                                * the ranks outnumber the cores, where staging measured faster) */
    int64_t staged_calls;      /* large calls of the other four run through staging, for the tests */
    int64_t steps_taken;       /* calls this channel took (what ran: Communicator.chosen_algorithm's check) */
    int last_step;             /* the step of the last one taken: STEP_MERGED or STEP_STAGED */
    /* The shortcuts' (bind_shortcuts): the communicator calls them with its
     * own arguments, so a call that succeeds runs no Python at all. */
    PyObject *arrays;       /* the array types taken (a tuple) */
    PyObject *ops;          /* op (a ReduceOp or its name) -> OP_ code */
    PyObject *kinds;        /* collective name -> K_ code */
    PyObject *on_failure;   /* on_failure(status, x, op, collective, root, error): raises */
    PyObject *allreduce_name;   /* "allreduce", what on_failure is told */
    int closed;             /* close() was called: the memory is about to go, decline every call */
} Channel;

static PyObject *failure(Waits *w, int status, int64_t seq)
{
    if (status == INTERRUPTED)
        return NULL;   /* the handler's exception (fastpath.py aborts the group) */
    return Py_BuildValue("(iiLLL)", status, w->failed_peer, (long long)w->failed_have,
                         (long long)w->failed_need, (long long)seq);
}

/* ---- What each collective is ------------------------------------------------
 *
 * All five collectives run the same two steps: a small message is one
 * merged step through the small slots; a larger one moves chunk by chunk
 * through staging (where the ranks may reach each other's memory, a large
 * message past the staging limits is the plans' single copy: "Large
 * messages" below). Each is its `direct`
 * algorithm: rank r reads, from every rank it needs, the part of its input
 * it needs, and folds those parts in rank order or copies them:
 *
 *   collective      its x is read by     rank r reads of rank p's x    into r's out
 *   allreduce       every rank           all of it                     fold, in rank order
 *   reduce_scatter  every rank           block r                       fold, in rank order
 *   allgather       every rank           all of it                     block p
 *   broadcast       the root's, only     all of it (r != root)         all of it
 *   reduce          all but the root's   all of it (r == root)         fold, in rank order
 *
 * Allreduce's large message is the pipeline below (a reduce-scatter and an
 * all-gather), the other four's segments of merged steps. The loop never
 * writes into a peer's memory; the plans' single copy does, and a failed
 * call of the loop still waits at the fence (fence_writes) for a peer's
 * plan still writing. */

enum { K_ALLREDUCE = 0, K_REDUCE_SCATTER = 1, K_ALLGATHER = 2, K_BROADCAST = 3, K_REDUCE = 4,
       K_BARRIER = 5 };   /* a merged step of no bytes: Channel.barrier */

typedef struct {
    int kind, root, type, op;
    size_t itemsize;
    const char *in;
    char *out;          /* for reduce_scatter, rank r's block of the result */
    size_t nbytes;      /* of every rank's x */
} Collective;

/* Whether some rank reads rank p's x. */
static int is_read(const Collective *k, int p)
{
    return k->kind == K_BROADCAST ? p == k->root : k->kind == K_REDUCE ? p != k->root : 1;
}

/* Whether rank r's output is computed from its peers' inputs. */
static int reads_peers(const Collective *k, int r)
{
    return k->kind == K_BROADCAST ? r != k->root : k->kind == K_REDUCE ? r == k->root : 1;
}

/* The bytes [*lo, *hi) of every rank's x that rank r wants. */
static void wanted(const Collective *k, int r, int n, size_t *lo, size_t *hi)
{
    size_t block = k->kind == K_REDUCE_SCATTER ? k->nbytes / (size_t)n : k->nbytes;
    *lo = k->kind == K_REDUCE_SCATTER ? (size_t)r * block : 0;
    *hi = *lo + block;
}

/* Rank r's share of bytes [lo, hi) of the inputs, whose copies it can see:
 * at[p] is where rank p's byte `lo` lies here (at[r]: this rank's own x).
 * Copies skip a destination that is their source (in place). */
static void take_segment(const Collective *k, int r, int n, const char *const *at, size_t lo, size_t hi)
{
    size_t want_lo, want_hi;
    wanted(k, r, n, &want_lo, &want_hi);
    size_t from = lo > want_lo ? lo : want_lo, to = hi < want_hi ? hi : want_hi;
    if (from >= to)
        return;
    size_t skip = from - lo, len = to - from;
    if (k->kind == K_ALLGATHER) {
        for (int p = 0; p < n; p++) {
            char *dst = k->out + (size_t)p * k->nbytes + from;
            if (dst != at[p] + skip)
                memmove(dst, at[p] + skip, len);
        }
    } else if (k->kind == K_BROADCAST) {
        if (k->out + from != at[k->root] + skip)
            memmove(k->out + from, at[k->root] + skip, len);
    } else if (reads_peers(k, r)) {
        const char *srcs[256];
        for (int p = 0; p < n; p++)
            srcs[p] = at[p] + skip;
        reduce_sources(k->type, k->op, srcs, n, k->out + (from - want_lo), NULL, len, k->itemsize,
                       k->op == OP_AVG ? n : 0);
    }
}

/* The signature's path: the merged step's, or a large message's, whatever
 * made it stage (a rank that stages where its peers single copy is named
 * at once: the plans' signatures differ from every one of the loop's). */
enum { PATH_MERGED = 1, PATH_STAGED = 2 };

/* The call's signature (signatures.h): its number and its shape (a
 * Collective's root is 0 where the collective has none). */
static int64_t collective_signature(const Collective *k, int64_t seq, int path)
{
    return call_signature(loop_shape_hash(k->kind, k->type, k->op, k->nbytes, k->root, path), seq);
}

/* Small messages, one merged step: copy into this rank's slot of this
 * call's parity (where a peer reads it), name the call in the row's
 * SMALL_SIG slot of that parity, publish, wait once, take this rank's share
 * of every rank's slot. A slot is rewritten two small calls later, by when
 * every peer has entered the next small call and so finished reading it. */
static PyObject *run_small(Channel *c, const Collective *k, int64_t base, int64_t seq)
{
    Waits *w = &c->waits;
    int r = w->rank, n = w->nranks;
    int odd = (int)(c->small_calls & 1);
    size_t parity = (size_t)odd * (SLOT_HEADER + c->small_max);
    int64_t signature = collective_signature(k, seq, PATH_MERGED);
    int64_t *mine = &w->rows[r * ROW_SLOTS];
    char *slot = c->small + r * c->small_stride + parity;

    /* The row's SIG is left alone: a peer still checking the previous call
     * may read it (protocol.py writes SIG only once every peer has left the
     * previous call, a wait this step does without). SMALL_SIG names this
     * call instead, in the cache line of COUNTER, which a peer has just
     * loaded when it sees the publish (a signature in the slot cost every
     * peer one more line from this core: a quarter of the step's time at
     * 1 KiB). A peer on another path sees the stale SIG, which names no
     * call of this number, and reports the mismatch. */
    if (is_read(k, r) && k->nbytes > 0)
        memcpy(slot + SLOT_HEADER, k->in, k->nbytes);
    mine[SMALL_SIG + odd] = signature;
    mine[SEQ] = seq;
    publish(mine, COUNTER, base + 1);
    c->small_calls++;

    int status = wait_peers(w, COUNTER, base + 1);
    if (status != OK)
        return failure(w, status, seq);
    const char *at[256];
    for (int p = 0; p < n; p++) {
        int64_t named = load_acquire(&w->rows[p * ROW_SLOTS + SMALL_SIG + odd]);
        if (p != r && named != signature) {
            w->failed_peer = p;
            w->failed_have = named;
            w->failed_need = signature;
            return failure(w, MISMATCH, seq);
        }
        at[p] = p == r ? k->in : c->small + p * c->small_stride + parity + SLOT_HEADER;
    }
    if (k->nbytes > 0)
        take_segment(k, r, n, at, 0, k->nbytes);
    publish(mine, COUNTER, base + 2);
    return PyLong_FromLong(OK);
}

/* ---- Large messages ----------------------------------------------------------
 *
 * The loop moves a large message through staging only: the segments below
 * (run_staged_segments) and allreduce's pipeline (run_pipelined). Where
 * every rank may read and write every peer's memory (process_vm_readv and
 * writev: the same user, and no ptrace restriction in the way) a large
 * message skips the staging copies instead, and that single copy is the
 * plans' (STEP_PLANS: _host_plan.c running plan.single_copy_plan,
 * pushed_plan and spread_plan). The plans learn whether the ranks may, as
 * the communicator starts (ShmRank._learn_reach), and hand a refusal to
 * the loop (refuse_single_copy), which then stages every large message. */

/* Enter a large call as protocol.py's phase 0 does: once every peer has
 * left the previous call (which may still read this row's SIG), name this
 * call; then every peer is in it, and named the same, before any byte
 * moves. */
static int enter_large(Channel *c, int64_t base, int64_t seq, int64_t signature)
{
    Waits *w = &c->waits;
    int r = w->rank, n = w->nranks;
    int64_t *mine = &w->rows[r * ROW_SLOTS];
    mine[SEQ] = seq;
    int status = wait_peers(w, COUNTER, base);
    if (status != OK)
        return status;
    mine[SIG] = signature;
    publish(mine, COUNTER, base + 1);
    status = wait_peers(w, COUNTER, base + 1);
    if (status != OK)
        return status;
    for (int p = 0; p < n; p++) {
        if (p != r && load_acquire(&w->rows[p * ROW_SLOTS + SIG]) != signature) {
            w->failed_peer = p;
            w->failed_have = w->rows[p * ROW_SLOTS + SIG];
            w->failed_need = signature;
            return MISMATCH;
        }
    }
    return OK;
}

/* The other four collectives' large messages where some rank may not reach
 * another's memory: segment by segment through staging (each rank's two
 * parities of nranks chunks), every segment a merged step:
 *   stage    copy segment t of x into my staging (if anyone reads my x), publish STAGED;
 *   take     wait for every peer's STAGED, take my share of the segment, publish REDUCED.
 * A parity is rewritten two iterations later, once every peer published
 * REDUCED for the iteration that used it; before this call's first two,
 * every peer left the previous call (enter_large), so it read them. (The
 * REDUCED wait is implied by the STAGED wait of the iteration between: a
 * peer stages iteration t-1 only after it took from t-2 and published
 * REDUCED; so a build without it still gives the right bits, and no test
 * can tell the two apart. It stays as the statement of the rule.) */
static int run_staged_segments(Channel *c, const Collective *k)
{
    Waits *w = &c->waits;
    int r = w->rank, n = w->nranks;
    int64_t *mine = &w->rows[r * ROW_SLOTS];
    size_t segment = (size_t)n * c->chunk;
    int64_t iterations = (int64_t)((k->nbytes + segment - 1) / segment);
    const char *at[256];
    for (int64_t t = 0; t < iterations; t++) {
        int64_t g = c->chunks_done + t;      /* this iteration's number over the channel's life */
        size_t parity = (size_t)(g & 1) * segment;
        size_t lo = (size_t)t * segment, hi = k->nbytes - lo < segment ? k->nbytes : lo + segment;
        int status = t >= 2 ? wait_peers(w, REDUCED, g - 1) : OK;
        if (status != OK)
            return status;
        if (is_read(k, r))                                                        /* stage */
            memcpy(c->staging + r * c->staging_stride + parity, k->in + lo, hi - lo);
        publish(mine, STAGED, g + 1);
        if ((status = wait_peers(w, STAGED, g + 1)) != OK)                        /* take */
            return status;
        for (int p = 0; p < n; p++)
            at[p] = p == r ? k->in + lo : c->staging + p * c->staging_stride + parity;
        take_segment(k, r, n, at, lo, hi);
        publish(mine, REDUCED, g + 1);
    }
    c->chunks_done += iterations;
    return OK;
}

/* Whether a large message of `kind` stages even where the ranks may single
 * copy: a fold up to staged_max, allgather and broadcast too where
 * copies_stage, and an allgather up to staged_spread_max. */
static int stages_anyway(const Channel *c, int kind, size_t nbytes)
{
    int folds = kind == K_ALLREDUCE || kind == K_REDUCE_SCATTER || kind == K_REDUCE;
    return (nbytes <= c->staged_max && (folds || c->copies_stage))
           || (kind == K_ALLGATHER && nbytes <= c->staged_spread_max);
}

/* The step a call of `kind` with `nbytes` per rank takes: the one place
 * that decides it, which run_taken follows and Channel.step_for reports
 * (Communicator.chosen_algorithm). Up to merged_max the merged step; a
 * larger message stages where stages_anyway says so or where the ranks may
 * not single copy (single_copy 0: COLLECTIVES_FAST_SINGLE_COPY=0, or the
 * plans found a read refused: refuse_single_copy); every other the loop
 * declines, and the plans single copy it (STEP_PLANS). */
static int step_for(const Channel *c, int kind, size_t nbytes)
{
    if (nbytes <= c->merged_max)
        return STEP_MERGED;
    return stages_anyway(c, kind, nbytes) || !c->single_copy ? STEP_STAGED : STEP_PLANS;
}

static PyObject *run_large(Channel *c, const Collective *k, int64_t base, int64_t seq)
{
    Waits *w = &c->waits;
    int status = enter_large(c, base, seq, collective_signature(k, seq, PATH_STAGED));
    if (status != OK)
        return failure(w, status, seq);
    c->last_step = STEP_STAGED;
    if ((status = run_staged_segments(c, k)) != OK)
        return failure(w, status, seq);
    c->staged_calls++;
    publish(&w->rows[w->rank * ROW_SLOTS], COUNTER, base + 2);
    return PyLong_FromLong(OK);
}

/* Large messages, pipelined: the buffer is cut into nranks blocks (rank b
 * reduces block b) and every block into chunks; iteration t moves chunk t
 * of every block through two staging parities:
 *   stage    copy chunk t of every other block into my staging, publish STAGED;
 *   reduce   wait for every peer's STAGED, fold chunk t of my block in rank
 *            order into my output and my staging's own-block chunk, publish REDUCED;
 *   gather   wait for every peer's REDUCED, copy their reduced chunks out.
 * The input is read once and the output written once, through buffers that
 * stay in cache. A parity is rewritten two iterations later: by then every
 * peer has published the next iteration's counters, so it read this one. */
static PyObject *run_pipelined(Channel *c, const char *in, char *out, size_t nbytes, size_t itemsize,
                               int type, int op, int64_t base, int64_t seq)
{
    Waits *w = &c->waits;
    int r = w->rank, n = w->nranks;
    int64_t *mine = &w->rows[r * ROW_SLOTS];
    int64_t signature = call_signature(loop_shape_hash(K_ALLREDUCE, type, op, nbytes, 0, PATH_STAGED), seq);
    size_t count = nbytes / itemsize;
    size_t chunk_items = c->chunk / itemsize;
    size_t block_start[257];
    size_t longest = 0;
    for (int b = 0; b <= n; b++)
        block_start[b] = count * (size_t)b / (size_t)n;
    for (int b = 0; b < n; b++)
        if (block_start[b + 1] - block_start[b] > longest)
            longest = block_start[b + 1] - block_start[b];
    int64_t iterations = (int64_t)((longest + chunk_items - 1) / chunk_items);

    /* The chunk counters run on from the last call's. */
    int status = enter_large(c, base, seq, signature);
    if (status != OK)
        return failure(w, status, seq);
    c->last_step = STEP_STAGED;

    const char *srcs[256];
    for (int64_t t = 0; t < iterations; t++) {
        int64_t g = c->chunks_done + t;      /* this iteration's number over the channel's life */
        size_t parity = (size_t)(g & 1) * (size_t)n * c->chunk;
        char *my_staging = c->staging + r * c->staging_stride + parity;
        size_t first = (size_t)t * chunk_items;

        for (int b = 0; b < n; b++) {        /* stage */
            size_t len = block_start[b + 1] - block_start[b];
            if (b == r || first >= len)
                continue;
            size_t items = len - first < chunk_items ? len - first : chunk_items;
            memcpy(my_staging + b * c->chunk, in + (block_start[b] + first) * itemsize, items * itemsize);
        }
        publish(mine, STAGED, g + 1);

        status = wait_peers(w, STAGED, g + 1);   /* reduce */
        if (status != OK)
            return failure(w, status, seq);
        size_t my_len = block_start[r + 1] - block_start[r];
        if (first < my_len) {
            size_t items = my_len - first < chunk_items ? my_len - first : chunk_items;
            size_t offset = (block_start[r] + first) * itemsize;
            for (int p = 0; p < n; p++)
                srcs[p] = p == r ? in + offset : c->staging + p * c->staging_stride + parity + r * c->chunk;
            reduce_sources(type, op, srcs, n, out + offset, my_staging + r * c->chunk, items * itemsize, itemsize,
                           op == OP_AVG ? n : 0);
        }
        publish(mine, REDUCED, g + 1);

        status = wait_peers(w, REDUCED, g + 1);  /* gather */
        if (status != OK)
            return failure(w, status, seq);
        for (int p = 0; p < n; p++) {
            size_t len = block_start[p + 1] - block_start[p];
            if (p == r || first >= len)
                continue;
            size_t items = len - first < chunk_items ? len - first : chunk_items;
            memcpy(out + (block_start[p] + first) * itemsize,
                   c->staging + p * c->staging_stride + parity + p * c->chunk, items * itemsize);
        }
    }
    c->chunks_done += iterations;
    publish(mine, COUNTER, base + 2);
    return PyLong_FromLong(OK);
}

/* A call the loop takes, as its number `seq`: failed at once where the
 * communicator was aborted, else the merged step or the large message's
 * (allreduce's pipeline, the other four's run_large). */
static PyObject *run_taken(Channel *c, const Collective *k, double deadline)
{
    Waits *w = &c->waits;
    const int64_t *mine = &w->rows[w->rank * ROW_SLOTS];
    int64_t base = mine[COUNTER], seq = mine[SEQ] + 1;
    w->deadline = deadline;
    c->steps_taken++;
    c->last_step = STEP_NONE;   /* until the step is known (a large call's, once the ranks agreed) */
    if (__atomic_load_n(&w->header[ABORT], __ATOMIC_ACQUIRE)) {
        w->failed_peer = -1;
        return failure(w, ABORTED, seq);
    }
    if (step_for(c, k->kind, k->nbytes) == STEP_MERGED) {
        c->last_step = STEP_MERGED;
        return run_small(c, k, base, seq);
    }
    if (k->kind == K_ALLREDUCE)
        return run_pipelined(c, k->in, k->out, k->nbytes, k->itemsize, k->type, k->op, base, seq);
    return run_large(c, k, base, seq);
}

static int overlap_ranges(const char *a, size_t a_bytes, const char *b, size_t b_bytes)
{
    return a < b + b_bytes && b < a + a_bytes;
}

/* What a call reads as this rank's x: x itself, or, where the output
 * overlaps x other than in an in-place form (legal: the plans take it, and
 * other ranks may not have such an output), a private copy, which the
 * caller frees (*copy): so every rank takes the same calls. NULL, with
 * MemoryError set, when the copy cannot be made. */
static const char *input_to_read(const char *x, size_t nbytes, const char *out, size_t out_bytes, int in_place_form,
                                 char **copy)
{
    *copy = NULL;
    if (in_place_form || !overlap_ranges(x, nbytes, out, out_bytes))
        return x;
    if ((*copy = PyMem_Malloc(nbytes)) == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    memcpy(*copy, x, nbytes);
    return *copy;
}

/* An allreduce of x into out (x itself: in place): 0, or None when this
 * loop does not take the call (the plans' path then checks it and runs or
 * refuses it: a message whose step is STEP_PLANS, too), or (status, peer,
 * have, need, seq) when it failed, or NULL with an exception (a signal
 * handler's while it waited). */
static PyObject *run_allreduce(Channel *c, PyObject *x_object, PyObject *out_object, int op, double deadline)
{
    if (c->closed)
        Py_RETURN_NONE;
    int in_place = x_object == out_object;
    Py_buffer x, y;
    if (PyObject_GetBuffer(x_object, &x, (in_place ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (!in_place && PyObject_GetBuffer(out_object, &y, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        PyBuffer_Release(&x);
        Py_RETURN_NONE;
    }
    Py_buffer *o = in_place ? &x : &y;
    int type = element_type(&x);
    PyObject *result = Py_None;
    size_t nbytes = (size_t)x.len;
    int takes = type >= 0 && op >= 0 && op <= OP_AVG && x.len > 0 && c->waits.nranks <= 256
                && o->len == x.len && element_type(o) == type && o->itemsize == x.itemsize
                && step_for(c, K_ALLREDUCE, nbytes) != STEP_PLANS;
    char *copy = NULL;
    const char *in = takes ? input_to_read(x.buf, nbytes, o->buf, nbytes, x.buf == o->buf, &copy) : x.buf;
    if (in == NULL) {
        takes = 0;
        result = NULL;
    }
    if (takes) {
        Collective k = {K_ALLREDUCE, 0, type, op, (size_t)x.itemsize, in, o->buf, nbytes};
        result = run_taken(c, &k, deadline);
    } else {
        Py_XINCREF(result);
    }
    PyMem_Free(copy);
    if (!in_place)
        PyBuffer_Release(&y);
    PyBuffer_Release(&x);
    return result;
}

/* channel.allreduce(x, out, op, deadline): run_allreduce's answer; `out`
 * is x for in place, op an OP_ code, the deadline a time.perf_counter()
 * value (a node's steps across nodes: across.py's Programs, hierarchy.py's
 * phases, which leave a step of STEP_PLANS to the plans themselves). */
static PyObject *Channel_allreduce(Channel *c, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "allreduce(x, out, op, deadline)");
        return NULL;
    }
    int op = (int)PyLong_AsLong(args[2]);
    double deadline = PyFloat_AsDouble(args[3]);
    if (PyErr_Occurred())
        return NULL;
    return run_allreduce(c, args[0], args[1], op, deadline);
}

/* Whether rank `rank` writes its output in a call of `kind` (`root`'s):
 * a broadcast's root only when it has an output of its own. */
static int writes_output(int kind, int rank, int root, int in_place)
{
    return kind == K_BROADCAST ? rank != root || !in_place : kind == K_REDUCE ? rank == root : 1;
}

/* A reduce_scatter, allgather, broadcast or reduce (kind 1 to 4): 0, None
 * or a failure, as run_allreduce. `out` None is the call without `out`:
 * the result in x (reduce_scatter: in x's own block); allgather needs
 * `out`. The loop takes C-contiguous buffers of one element type it folds,
 * of the sizes the collective needs, and outputs that are apart from x or
 * exactly its in-place form; a buffer is asked to be writable only where
 * this rank writes it. Anything else returns None: the Python path checks
 * it (a fold whose step is STEP_PLANS, too). */
static PyObject *run_collective(Channel *c, int kind, PyObject *x_object, PyObject *out_object, int op, int root,
                                double deadline)
{
    Waits *w = &c->waits;
    int r = w->rank, n = w->nranks;
    /* out=x is in place for broadcast and reduce; for reduce_scatter and
     * allgather it names a wrong size, which the Python path reports */
    int in_place = out_object == Py_None || (out_object == x_object && (kind == K_BROADCAST || kind == K_REDUCE));
    int writes = writes_output(kind, r, root, in_place);
    if (c->closed || kind < K_REDUCE_SCATTER || kind > K_REDUCE || op < 0 || op > OP_AVG || root < 0 || root >= n
        || n > 256 || (in_place && kind == K_ALLGATHER))
        Py_RETURN_NONE;
    Py_buffer x, y;
    if (PyObject_GetBuffer(x_object, &x, (in_place && writes ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (step_for(c, kind, (size_t)x.len) == STEP_PLANS) {   /* declined: the sooner the cheaper */
        PyBuffer_Release(&x);
        Py_RETURN_NONE;
    }
    if (!in_place && PyObject_GetBuffer(out_object, &y, (writes ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        PyBuffer_Release(&x);
        Py_RETURN_NONE;
    }
    size_t nbytes = (size_t)x.len;
    int type = element_type(&x);
    /* the output's bytes, and where its in-place form lies */
    size_t out_bytes = kind == K_REDUCE_SCATTER ? nbytes / (size_t)n : kind == K_ALLGATHER ? nbytes * (size_t)n : nbytes;
    char *out = in_place ? (char *)x.buf + (kind == K_REDUCE_SCATTER ? (size_t)r * out_bytes : 0) : y.buf;
    char *in_place_out = kind == K_ALLGATHER ? NULL : (char *)x.buf + (kind == K_REDUCE_SCATTER ? (size_t)r * out_bytes : 0);
    const char *in_place_x = kind == K_ALLGATHER ? out + (size_t)r * nbytes : NULL;
    int takes = type >= 0 && nbytes > 0 && (kind != K_REDUCE_SCATTER || nbytes % ((size_t)n * (size_t)x.itemsize) == 0)
                && (in_place || ((size_t)y.len == out_bytes && element_type(&y) == type && y.itemsize == x.itemsize));
    char *copy = NULL;
    const char *in = takes ? input_to_read(x.buf, nbytes, out, out_bytes,
                                           in_place || out == in_place_out || (const char *)x.buf == in_place_x, &copy)
                           : x.buf;
    PyObject *result = Py_None;
    if (in == NULL) {
        takes = 0;
        result = NULL;
    }
    if (takes) {
        Collective k = {kind, kind == K_BROADCAST || kind == K_REDUCE ? root : 0, type,
                        kind == K_ALLGATHER || kind == K_BROADCAST ? 0 : op, (size_t)x.itemsize, in, out, nbytes};
        result = run_taken(c, &k, deadline);
    } else {
        Py_XINCREF(result);
    }
    PyMem_Free(copy);
    if (!in_place)
        PyBuffer_Release(&y);
    PyBuffer_Release(&x);
    return result;
}

/* channel.collective(kind, x, out, op, root, deadline): run_collective's
 * answer (the calls across.py's Programs make). */
static PyObject *Channel_collective(Channel *c, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "collective(kind, x, out, op, root, deadline)");
        return NULL;
    }
    int kind = (int)PyLong_AsLong(args[0]);
    int op = (int)PyLong_AsLong(args[3]);
    int root = (int)PyLong_AsLong(args[4]);
    double deadline = PyFloat_AsDouble(args[5]);
    if (PyErr_Occurred())
        return NULL;
    return run_collective(c, kind, args[1], args[2], op, root, deadline);
}

/* channel.barrier(deadline) -> 0 once every rank has entered it, or a
 * failure, as run_allreduce's: a merged step that moves no bytes, its
 * signature a barrier's: 0.84 us between 2 processes, where protocol.py's
 * took 4.6 (MPICH's 1.7), 3.3 us between 4 on 2 cores (MPICH's 10.8). */
static PyObject *Channel_barrier(Channel *c, PyObject *arg)
{
    double deadline = PyFloat_AsDouble(arg);
    if (deadline == -1.0 && PyErr_Occurred())
        return NULL;
    if (c->closed)
        Py_RETURN_NONE;
    Collective k = {K_BARRIER, 0, 0, 0, 1, NULL, NULL, 0};
    return run_taken(c, &k, deadline);
}

/* ---- The shortcuts ---------------------------------------------------------
 *
 * The communicator's first try at a call (communicator.py's
 * _fast_allreduce and _fast_collective): its own arguments, checked here
 * as far as the loop needs, so that a call that succeeds runs no Python.
 * Python frames between the communicator and the loop cost about 0.4 us of
 * a 1 KiB broadcast's 1.05 between 2 processes, more than the step itself
 * leaves to win. A call the loop does not take returns None (the caller's
 * checks and plans run it); a failed one, or one a signal handler
 * interrupted, goes to on_failure (fastpath.py), which aborts the
 * communicator and raises. */

/* The OP_ code of `op`, or -1 (an op the loop does not know, or unhashable:
 * the caller's checks name it). */
static int op_code(Channel *c, PyObject *op)
{
    PyObject *code = PyDict_GetItemWithError(c->ops, op);
    long value = code == NULL ? -1 : PyLong_AsLong(code);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return (int)value;
}

/* The array types the shortcuts take: exactly these (a subclass may mean
 * anything by its buffer), as fastpath.ARRAYS. */
static int taken_array(Channel *c, PyObject *a)
{
    Py_ssize_t n = PyTuple_GET_SIZE(c->arrays);
    for (Py_ssize_t i = 0; i < n; i++)
        if ((PyObject *)Py_TYPE(a) == PyTuple_GET_ITEM(c->arrays, i))
            return 1;
    return 0;
}

/* The answer of a run: `done` once it succeeded, None where it declined,
 * else on_failure's (which raises). */
static PyObject *answer(Channel *c, PyObject *status, PyObject *done, PyObject *x, PyObject *op,
                        PyObject *collective, int root)
{
    if (status != NULL && PyLong_CheckExact(status)) {   /* 0: done */
        Py_DECREF(status);
        Py_INCREF(done);
        return done;
    }
    if (status == Py_None)
        return status;
    PyObject *error = NULL;
    if (status == NULL) {   /* a signal handler raised while the call waited */
        error = take_raised();
        if (error == NULL)
            return NULL;
        status = Py_NewRef(Py_None);
    }
    PyObject *raised = PyObject_CallFunction(c->on_failure, "OOOOiO", status, x, op, collective, root,
                                             error != NULL ? error : Py_None);
    Py_DECREF(status);
    Py_XDECREF(error);
    return raised;
}

/* channel.shortcut_allreduce(x, op, out, timeout) -> out (x when out is
 * None) once done, None where the loop declines; failures raise. */
static PyObject *Channel_shortcut_allreduce(Channel *c, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "shortcut_allreduce(x, op, out, timeout)");
        return NULL;
    }
    PyObject *x = args[0], *out = args[2] == Py_None ? args[0] : args[2];
    if (c->on_failure == NULL || !taken_array(c, x) || !taken_array(c, out))
        Py_RETURN_NONE;
    int op = op_code(c, args[1]);
    double timeout = PyFloat_AsDouble(args[3]);
    if (timeout == -1.0 && PyErr_Occurred())
        return NULL;
    if (op < 0)
        Py_RETURN_NONE;
    PyObject *status = run_allreduce(c, x, out, op, now_seconds() + timeout);
    return answer(c, status, out, x, args[1], c->allreduce_name, 0);
}

/* channel.shortcut(collective, x, op, out, root, timeout) -> True once
 * done, None where the loop declines; failures raise. `collective` is a
 * name (reduce_scatter, allgather, broadcast, reduce), root an int. */
static PyObject *Channel_shortcut(Channel *c, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "shortcut(collective, x, op, out, root, timeout)");
        return NULL;
    }
    PyObject *x = args[1], *out = args[3];
    if (c->on_failure == NULL || !taken_array(c, x) || (out != Py_None && !taken_array(c, out)))
        Py_RETURN_NONE;
    PyObject *kind = PyDict_GetItemWithError(c->kinds, args[0]);   /* (borrowed: read before any Python runs) */
    if (kind == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    long kind_code = PyLong_AsLong(kind);
    if (kind_code == -1 && PyErr_Occurred())
        return NULL;
    int op = op_code(c, args[2]);   /* (may run an op's __hash__ and __eq__) */
    long root = PyLong_AsLong(args[4]);
    if (root == -1 && PyErr_Occurred()) {   /* no rank: the caller's checks say so */
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    double timeout = PyFloat_AsDouble(args[5]);
    if (timeout == -1.0 && PyErr_Occurred())
        return NULL;
    if (op < 0 || root < 0 || root >= c->waits.nranks)
        Py_RETURN_NONE;
    PyObject *status = run_collective(c, (int)kind_code, x, out, op, (int)root, now_seconds() + timeout);
    return answer(c, status, Py_True, x, args[2], args[0], (int)root);
}

/* channel.bind_shortcuts(arrays, ops, kinds, on_failure): what the
 * shortcuts take and whom they tell of a failure. */
static PyObject *Channel_bind_shortcuts(Channel *c, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyTuple_Check(args[0]) || !PyDict_Check(args[1]) || !PyDict_Check(args[2])
        || !PyCallable_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "bind_shortcuts(arrays: tuple, ops: dict, kinds: dict, on_failure)");
        return NULL;
    }
    Py_XSETREF(c->arrays, Py_NewRef(args[0]));
    Py_XSETREF(c->ops, Py_NewRef(args[1]));
    Py_XSETREF(c->kinds, Py_NewRef(args[2]));
    Py_XSETREF(c->on_failure, Py_NewRef(args[3]));
    Py_RETURN_NONE;
}

/* channel.close(): every later call declines (the memory is about to be
 * unmapped), and the shortcuts let go of what they hold. */
static PyObject *Channel_close(Channel *c, PyObject *Py_UNUSED(ignored))
{
    c->closed = 1;
    Py_CLEAR(c->on_failure);
    Py_RETURN_NONE;
}

static int Channel_init(Channel *c, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"header", "rows", "rank", "nranks", "spin", "yield_seconds", "small", "small_max",
                            "staging", "chunk", "single_copy", "staged_spread_max", "merged_max", "staged_max",
                            "copies_stage", NULL};
    unsigned long long header, rows, small, staging;
    unsigned long long small_max, chunk;
    int rank, nranks;
    long spin;
    double yield_seconds;
    int single_copy = 1, copies_stage = 1;
    unsigned long long staged_spread_max = 0, merged_max = ULLONG_MAX, staged_max = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KKiildKKKK|pKKKp", names, &header, &rows, &rank, &nranks,
                                     &spin, &yield_seconds, &small, &small_max, &staging, &chunk, &single_copy,
                                     &staged_spread_max, &merged_max, &staged_max, &copies_stage))
        return -1;
    if (nranks < 1 || nranks > 256 || rank < 0 || rank >= nranks || chunk == 0 || chunk % 64) {
        PyErr_SetString(PyExc_ValueError, "a channel has 1 to 256 ranks and chunks of a multiple of 64 bytes");
        return -1;
    }
    memset(&c->waits, 0, sizeof c->waits);
    c->waits.header = (int64_t *)(uintptr_t)header;
    c->waits.rows = (int64_t *)(uintptr_t)rows;
    c->waits.rank = rank;
    c->waits.nranks = nranks;
    c->waits.spin = spin;
    c->waits.yield_seconds = yield_seconds;
    c->small = (char *)(uintptr_t)small;
    c->small_max = (size_t)small_max;
    c->merged_max = merged_max < small_max ? (size_t)merged_max : (size_t)small_max;
    c->small_stride = 2 * (SLOT_HEADER + (size_t)small_max);
    c->staging = (char *)(uintptr_t)staging;
    c->chunk = (size_t)chunk;
    c->staging_stride = 2 * (size_t)nranks * (size_t)chunk;
    c->small_calls = 0;
    c->chunks_done = 0;
    c->single_copy = single_copy;
    c->copies_stage = copies_stage;
    c->staged_spread_max = (size_t)staged_spread_max;
    c->staged_max = (size_t)staged_max;
    c->staged_calls = 0;
    Py_XSETREF(c->allreduce_name, PyUnicode_InternFromString("allreduce"));
    if (c->allreduce_name == NULL)
        return -1;
    return 0;
}

/* The shortcuts' tables and callback, which the garbage collector sees
 * through these (the callback holds its owner weakly, fastpath.weakly, so
 * that a dropped communicator's channel goes at once, cycle or no). */
static int Channel_traverse(Channel *c, visitproc visit, void *arg)
{
    Py_VISIT(c->arrays);
    Py_VISIT(c->ops);
    Py_VISIT(c->kinds);
    Py_VISIT(c->on_failure);
    return 0;
}

static int Channel_clear(Channel *c)
{
    Py_CLEAR(c->arrays);
    Py_CLEAR(c->ops);
    Py_CLEAR(c->kinds);
    Py_CLEAR(c->on_failure);
    return 0;
}

static void Channel_dealloc(Channel *c)
{
    PyObject_GC_UnTrack(c);
    Channel_clear(c);
    Py_CLEAR(c->allreduce_name);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

/* channel.fence_writes(seconds) -> -1 once no live peer writes into this
 * rank's memory, or the first peer still writing after `seconds`. Called
 * by a failed call after it aborted the communicator, before the caller
 * gets its buffers back (a peer's plan may still push into them: shm_waits.h's rule). Sets the
 * abort flag itself where the abort did not (a second Ctrl-C in it). */
static PyObject *Channel_fence_writes(Channel *c, PyObject *arg)
{
    double seconds = PyFloat_AsDouble(arg);
    if (PyErr_Occurred())
        return NULL;
    Waits *w = &c->waits;
    int still_writing;
    Py_BEGIN_ALLOW_THREADS
    still_writing = fence_peer_writes(w, seconds);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(still_writing);
}

/* channel.refuse_single_copy(): large messages stage from now on
 * (single_copy 0): the plans met a refused read or write (ShmRank._refusal,
 * at the communicator's start or later), on every rank alike, between the
 * same two calls. */
static PyObject *Channel_refuse_single_copy(Channel *c, PyObject *Py_UNUSED(ignored))
{
    c->single_copy = 0;
    Py_RETURN_NONE;
}

static const char *const step_names[] = {NULL, "merged", "staged", "plans"};

/* channel.step_for(kind, nbytes) -> the step's name (step_for) */
static PyObject *Channel_step_for(Channel *c, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "step_for(kind, nbytes)");
        return NULL;
    }
    long kind = PyLong_AsLong(args[0]);
    Py_ssize_t nbytes = PyLong_AsSsize_t(args[1]);
    if (PyErr_Occurred())
        return NULL;
    if (kind < K_ALLREDUCE || kind > K_REDUCE || nbytes < 0) {
        PyErr_SetString(PyExc_ValueError, "step_for: kind is a K_ code of the five collectives, nbytes >= 0");
        return NULL;
    }
    return PyUnicode_FromString(step_names[step_for(c, (int)kind, (size_t)nbytes)]);
}

static PyObject *Channel_large_path(Channel *c, void *Py_UNUSED(closure))
{
    return PyUnicode_FromString(c->single_copy ? "single-copy" : "staged");
}

static PyObject *Channel_merged_max(Channel *c, void *Py_UNUSED(closure))
{
    return PyLong_FromSize_t(c->merged_max);
}

static PyObject *Channel_get_staged_max(Channel *c, void *Py_UNUSED(closure))
{
    return PyLong_FromSize_t(c->staged_max);
}

/* Every rank sets the same value between the same two calls (fastpath.py's
 * measured choice): a rank whose value differs at a call is named at once
 * (run_large's path 4), not waited for. */
static int Channel_set_staged_max(Channel *c, PyObject *value, void *Py_UNUSED(closure))
{
    if (value == NULL) {
        PyErr_SetString(PyExc_TypeError, "staged_max cannot be deleted");
        return -1;
    }
    size_t staged_max = PyLong_AsSize_t(value);
    if (staged_max == (size_t)-1 && PyErr_Occurred())
        return -1;
    c->staged_max = staged_max;
    return 0;
}

static PyObject *Channel_staged_calls(Channel *c, void *Py_UNUSED(closure))
{
    return PyLong_FromLongLong(c->staged_calls);
}

static PyObject *Channel_steps_taken(Channel *c, void *Py_UNUSED(closure))
{
    return PyLong_FromLongLong(c->steps_taken);
}

static PyObject *Channel_last_step(Channel *c, void *Py_UNUSED(closure))
{
    if (c->last_step == STEP_NONE)
        Py_RETURN_NONE;
    return PyUnicode_FromString(step_names[c->last_step]);
}

static PyGetSetDef Channel_getset[] = {
    {"steps_taken", (getter)Channel_steps_taken, NULL, "calls this channel took so far", NULL},
    {"last_step", (getter)Channel_last_step, NULL,
     "the step of the last call taken: merged or staged (None: none, or it failed first)", NULL},
    {"merged_max", (getter)Channel_merged_max, NULL, "messages of up to this many bytes take the merged step", NULL},
    {"staged_max", (getter)Channel_get_staged_max, (setter)Channel_set_staged_max,
     "a large fold (allgather and broadcast too where copies_stage) of up to this many bytes per rank stages "
     "even where the ranks may single copy (0: never); every rank sets the same value between the same two "
     "calls", NULL},
    {"staged_calls", (getter)Channel_staged_calls, NULL,
     "large calls of reduce_scatter, allgather, broadcast and reduce run through staging so far", NULL},
    {"large_path", (getter)Channel_large_path, NULL,
     "how large messages past the staging limits move: single-copy (the plans'), or staged (some rank "
     "cannot read and write another's memory, or COLLECTIVES_FAST_SINGLE_COPY=0)", NULL},
    {NULL},
};

static PyMethodDef Channel_methods[] = {
    {"allreduce", (PyCFunction)(void (*)(void))Channel_allreduce, METH_FASTCALL,
     "allreduce(x, out, op, deadline): a node's allreduce step; see _shmloop.c"},
    {"refuse_single_copy", (PyCFunction)Channel_refuse_single_copy, METH_NOARGS,
     "refuse_single_copy(): large messages stage from now on (the plans met a refused single copy)"},
    {"collective", (PyCFunction)(void (*)(void))Channel_collective, METH_FASTCALL,
     "collective(kind, x, out, op, root, deadline): reduce_scatter, allgather, broadcast or reduce; see _shmloop.c"},
    {"shortcut_allreduce", (PyCFunction)(void (*)(void))Channel_shortcut_allreduce, METH_FASTCALL,
     "shortcut_allreduce(x, op, out, timeout): the communicator's allreduce in the loop: out (x in place) "
     "once done, None where declined; failures go to on_failure"},
    {"shortcut", (PyCFunction)(void (*)(void))Channel_shortcut, METH_FASTCALL,
     "shortcut(collective, x, op, out, root, timeout): the communicator's other four in the loop: True "
     "once done, None where declined; failures go to on_failure"},
    {"bind_shortcuts", (PyCFunction)(void (*)(void))Channel_bind_shortcuts, METH_FASTCALL,
     "bind_shortcuts(arrays, ops, kinds, on_failure): what the shortcuts take, whom they tell of failures"},
    {"step_for", (PyCFunction)(void (*)(void))Channel_step_for, METH_FASTCALL,
     "step_for(kind, nbytes): the step ('merged', 'staged', or 'plans': declined) such a "
     "call takes; see _shmloop.c"},
    {"barrier", (PyCFunction)Channel_barrier, METH_O,
     "barrier(deadline): 0 once every rank entered it, None once closed, else a failure; see _shmloop.c"},
    {"close", (PyCFunction)Channel_close, METH_NOARGS,
     "close(): decline every later call (the channel's memory is about to be unmapped)"},
    {"fence_writes", (PyCFunction)Channel_fence_writes, METH_O,
     "fence_writes(seconds): after an abort, wait until no peer writes into this rank's memory; -1, or "
     "the peer still writing after `seconds`"},
    {NULL},
};

static PyTypeObject ChannelType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "collectives.transport._shmloop.Channel",
    .tp_basicsize = sizeof(Channel),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Channel_init,
    .tp_dealloc = (destructor)Channel_dealloc,
    .tp_traverse = (traverseproc)Channel_traverse,
    .tp_clear = (inquiry)Channel_clear,
    .tp_methods = Channel_methods,
    .tp_getset = Channel_getset,
    .tp_doc = "This rank's view of the fast path's shared channel (addresses into mapped memory).",
};

/* ------------------------------------------------------------------------ */
/* Counters for the Python side of the protocol                             */

static PyObject *py_publish(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "publish(row_address, slot, value)");
        return NULL;
    }
    int64_t *row = (int64_t *)PyLong_AsVoidPtr(args[0]);
    long slot = PyLong_AsLong(args[1]);
    long long v = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred())
        return NULL;
    if (slot < 0 || slot >= ROW_SLOTS) {
        PyErr_SetString(PyExc_ValueError, "a row has ROW_SLOTS slots");
        return NULL;
    }
    publish(row, (int)slot, (int64_t)v);
    Py_RETURN_NONE;
}

static PyObject *py_wake_sleepers(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "wake_sleepers(rows_address, nranks)");
        return NULL;
    }
    int64_t *rows = (int64_t *)PyLong_AsVoidPtr(args[0]);
    long nranks = PyLong_AsLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    wake_every_sleeper(rows, (int)nranks);
    Py_RETURN_NONE;
}

static PyObject *py_load_acquire(PyObject *Py_UNUSED(self), PyObject *arg)
{
    const int64_t *p = (const int64_t *)PyLong_AsVoidPtr(arg);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromLongLong(load_acquire(p));
}

/* compare_exchange(address, expected, desired): one sequentially consistent
   compare-and-swap of an int64 in shared memory; returns the value it found
   (== expected when it stored). The one consensus step of the recovery area
   (transport/recovery.py): of the ranks racing to decide, exactly one wins. */
static PyObject *py_compare_exchange(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "compare_exchange(address, expected, desired)");
        return NULL;
    }
    int64_t *p = (int64_t *)PyLong_AsVoidPtr(args[0]);
    int64_t expected = (int64_t)PyLong_AsLongLong(args[1]);
    int64_t desired = (int64_t)PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred())
        return NULL;
    __atomic_compare_exchange_n(p, &expected, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return PyLong_FromLongLong(expected);
}

static PyObject *py_store_release(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "store_release(address, value)");
        return NULL;
    }
    int64_t *p = (int64_t *)PyLong_AsVoidPtr(args[0]);
    int64_t v = (int64_t)PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"store_release", (PyCFunction)(void (*)(void))py_store_release, METH_FASTCALL,
     "store_release(address, value): an int64 store with release order (no wake: see publish)"},
    {"compare_exchange", (PyCFunction)(void (*)(void))py_compare_exchange, METH_FASTCALL,
     "compare_exchange(address, expected, desired): an int64 compare-and-swap, sequentially consistent; "
     "returns the value found"},
    {"publish", (PyCFunction)(void (*)(void))py_publish, METH_FASTCALL,
     "publish(row_address, slot, value): store a row's int64 slot with release order (and more), "
     "waking waits asleep on the row"},
    {"wake_sleepers", (PyCFunction)(void (*)(void))py_wake_sleepers, METH_FASTCALL,
     "wake_sleepers(rows_address, nranks): wake every wait asleep on the rows (after an abort)"},
    {"load_acquire", py_load_acquire, METH_O, "load_acquire(address): an int64 load with acquire order"},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_shmloop", "The compiled inner loop of host ranks in separate processes.", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__shmloop(void)
{
    if (PyType_Ready(&ChannelType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Channel", (PyObject *)&ChannelType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "HEADER_SLOTS", HEADER_SLOTS);
    PyModule_AddIntConstant(m, "ROW_SLOTS", ROW_SLOTS);
    PyModule_AddIntConstant(m, "STAGED", STAGED);
    PyModule_AddIntConstant(m, "REDUCED", REDUCED);
    PyModule_AddIntConstant(m, "SLEEPERS", SLEEPERS);
    PyModule_AddIntConstant(m, "SLOT_HEADER", SLOT_HEADER);
    PyModule_AddIntConstant(m, "REDUCE_SCATTER", K_REDUCE_SCATTER);
    PyModule_AddIntConstant(m, "ALLGATHER", K_ALLGATHER);
    PyModule_AddIntConstant(m, "BROADCAST", K_BROADCAST);
    PyModule_AddIntConstant(m, "REDUCE", K_REDUCE);
    if (add_status_constants(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
