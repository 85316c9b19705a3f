/* Element types and reductions of host ranks' compiled code: the compiled
 * loop (transport/_shmloop.c) and the compiled plan executor
 * (executors/_host_plan.c); the including file includes Python.h first.
 *
 * Reductions fold the ranks' contributions in the order given, one element
 * at a time, exactly as the plan interpreter (executors/host.py) folds a
 * row's sources: the same bits as NumPy's. Floats: -ffp-contract=off
 * (setup.py), so no FMA contraction; max/min follow ops.py's IEEE
 * 754-2019 rule (NaN wins, the first NaN's bits; +0 beats -0 for max, -0
 * for min). Integers wrap as NumPy's do (computed in unsigned arithmetic),
 * and avg truncates toward zero. float16 and bfloat16 are not here: the
 * interpreter runs them.
 */

#ifndef COLLECTIVES_HOST_FOLDS_H
#define COLLECTIVES_HOST_FOLDS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* ------------------------------------------------------------------------ */
/* Element types and reductions                                             */

enum { OP_SUM = 0, OP_PROD = 1, OP_MAX = 2, OP_MIN = 3, OP_AVG = 4 };
enum { T_F32, T_F64, T_I8, T_U8, T_I16, T_U16, T_I32, T_U32, T_I64, T_U64, NTYPES };

/* acc = acc op src over n elements (acc never aliases src). */
typedef void (*fold_fn)(void *acc, const void *src, size_t n);
/* dst = a op b over n elements; dst may be a or b (the same elements, so
 * no element is written before it is read: `ivdep` lets the compiler
 * vectorize without a runtime overlap check that would fail then). */
typedef void (*fold3_fn)(void *dst, const void *a, const void *b, size_t n);
/* values /= nranks (avg's last step). */
typedef void (*divide_fn)(void *values, size_t n, int nranks);

#define FOLD3(T, NAME, OP, EXPR)                                                            \
    static void NAME##_##OP##3(void *d, const void *a, const void *b, size_t n)             \
    {                                                                                       \
        T *z = d; const T *x = a; const T *y = b;                                           \
        _Pragma("GCC ivdep") for (size_t i = 0; i < n; i++) z[i] = EXPR;                    \
    }

#define DEFINE_FLOAT_FOLDS(T, NAME, BITS)                                                   \
    static void NAME##_sum(void *a, const void *s, size_t n)                                \
    { T *x = a; const T *y = s; for (size_t i = 0; i < n; i++) x[i] = x[i] + y[i]; }       \
    static void NAME##_prod(void *a, const void *s, size_t n)                               \
    { T *x = a; const T *y = s; for (size_t i = 0; i < n; i++) x[i] = x[i] * y[i]; }       \
    static inline T NAME##_ieee(T a, T b, int is_max)                                       \
    {                                                                                       \
        if (isnan(a)) return a;                                                             \
        if (isnan(b)) return b;                                                             \
        if (a == 0 && b == 0) {                                                             \
            BITS ba, bb; T r; memcpy(&ba, &a, sizeof a); memcpy(&bb, &b, sizeof b);         \
            ba = is_max ? (ba & bb) : (ba | bb); memcpy(&r, &ba, sizeof r); return r;       \
        }                                                                                   \
        return is_max ? (a >= b ? a : b) : (a <= b ? a : b);                                \
    }                                                                                       \
    static void NAME##_max(void *a, const void *s, size_t n)                                \
    { T *x = a; const T *y = s; for (size_t i = 0; i < n; i++) x[i] = NAME##_ieee(x[i], y[i], 1); } \
    static void NAME##_min(void *a, const void *s, size_t n)                                \
    { T *x = a; const T *y = s; for (size_t i = 0; i < n; i++) x[i] = NAME##_ieee(x[i], y[i], 0); } \
    static void NAME##_divide(void *v, size_t n, int nranks)                                \
    { T *x = v; T d = (T)nranks; for (size_t i = 0; i < n; i++) x[i] = x[i] / d; }          \
    FOLD3(T, NAME, sum, x[i] + y[i])                                                        \
    FOLD3(T, NAME, prod, x[i] * y[i])                                                       \
    FOLD3(T, NAME, max, NAME##_ieee(x[i], y[i], 1))                                         \
    FOLD3(T, NAME, min, NAME##_ieee(x[i], y[i], 0))

/* Integers: sum and product wrap (unsigned arithmetic, as NumPy wraps);
 * avg divides in 64 bits of the same signedness, truncating toward zero. */
#define WIDE(T) __typeof__(_Generic((T)0, int8_t: (int64_t)0, int16_t: (int64_t)0, int32_t: (int64_t)0,      \
                                    int64_t: (int64_t)0, default: (uint64_t)0))
#define DEFINE_INT_FOLDS(T, U, NAME)                                                        \
    static void NAME##_sum(void *a, const void *s, size_t n)                                \
    { T *x = a; const T *y = s; for (size_t i = 0; i < n; i++) x[i] = (T)((U)x[i] + (U)y[i]); } \
    static void NAME##_prod(void *a, const void *s, size_t n)                               \
    { T *x = a; const T *y = s; for (size_t i = 0; i < n; i++) x[i] = (T)((U)x[i] * (U)y[i]); } \
    static void NAME##_max(void *a, const void *s, size_t n)                                \
    { T *x = a; const T *y = s; for (size_t i = 0; i < n; i++) x[i] = x[i] >= y[i] ? x[i] : y[i]; } \
    static void NAME##_min(void *a, const void *s, size_t n)                                \
    { T *x = a; const T *y = s; for (size_t i = 0; i < n; i++) x[i] = x[i] <= y[i] ? x[i] : y[i]; } \
    static void NAME##_divide(void *v, size_t n, int nranks)  /* in 64 bits: nranks may not fit T */ \
    { T *x = v; for (size_t i = 0; i < n; i++) x[i] = (T)(WIDE(T))((WIDE(T))x[i] / (WIDE(T))nranks); } \
    FOLD3(T, NAME, sum, (T)((U)x[i] + (U)y[i]))                                             \
    FOLD3(T, NAME, prod, (T)((U)x[i] * (U)y[i]))                                            \
    FOLD3(T, NAME, max, x[i] >= y[i] ? x[i] : y[i])                                         \
    FOLD3(T, NAME, min, x[i] <= y[i] ? x[i] : y[i])

DEFINE_FLOAT_FOLDS(float, f32, uint32_t)
DEFINE_FLOAT_FOLDS(double, f64, uint64_t)
DEFINE_INT_FOLDS(int8_t, uint8_t, i8)
DEFINE_INT_FOLDS(uint8_t, uint8_t, u8)
DEFINE_INT_FOLDS(int16_t, uint16_t, i16)
DEFINE_INT_FOLDS(uint16_t, uint16_t, u16)
DEFINE_INT_FOLDS(int32_t, uint32_t, i32)
DEFINE_INT_FOLDS(uint32_t, uint32_t, u32)
DEFINE_INT_FOLDS(int64_t, uint64_t, i64)
DEFINE_INT_FOLDS(uint64_t, uint64_t, u64)

#define FOLDS(NAME) {NAME##_sum, NAME##_prod, NAME##_max, NAME##_min, NAME##_sum}
static const fold_fn FOLD[NTYPES][5] = {
    FOLDS(f32), FOLDS(f64), FOLDS(i8), FOLDS(u8), FOLDS(i16),
    FOLDS(u16), FOLDS(i32), FOLDS(u32), FOLDS(i64), FOLDS(u64),
};
#define FOLDS3(NAME) {NAME##_sum3, NAME##_prod3, NAME##_max3, NAME##_min3, NAME##_sum3}
static const fold3_fn FOLD3[NTYPES][5] = {
    FOLDS3(f32), FOLDS3(f64), FOLDS3(i8), FOLDS3(u8), FOLDS3(i16),
    FOLDS3(u16), FOLDS3(i32), FOLDS3(u32), FOLDS3(i64), FOLDS3(u64),
};
static const divide_fn DIVIDE[NTYPES] = {
    f32_divide, f64_divide, i8_divide, u8_divide, i16_divide,
    u16_divide, i32_divide, u32_divide, i64_divide, u64_divide,
};

/* The element type of a buffer, from its struct format and item size; -1
 * for the types this loop leaves to the interpreter (float16, bfloat16,
 * bool, complex...). */
static inline int element_type(const Py_buffer *view)
{
    const char *f = view->format ? view->format : "B";
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (*f == '<')
        f++;
#endif
    if (*f == '=' || *f == '@')
        f++;
    if (f[0] == '\0' || f[1] != '\0')
        return -1;
    switch (f[0]) {
    case 'f': return view->itemsize == 4 ? T_F32 : -1;
    case 'd': return view->itemsize == 8 ? T_F64 : -1;
    case 'b': return T_I8;
    case 'B': return T_U8;
    case 'h': return view->itemsize == 2 ? T_I16 : -1;
    case 'H': return view->itemsize == 2 ? T_U16 : -1;
    case 'i': case 'l': case 'q':
        return view->itemsize == 4 ? T_I32 : view->itemsize == 8 ? T_I64 : -1;
    case 'I': case 'L': case 'Q':
        return view->itemsize == 4 ? T_U32 : view->itemsize == 8 ? T_U64 : -1;
    default: return -1;
    }
}

enum { REDUCE_TILE = 4096 };   /* bytes folded at a time, in a stack buffer */

/* dst (and, when not NULL, dst2) = the fold of srcs[0..n) in the order
 * given, divided by `divisor` at the end when it is not 0 (avg's last
 * step: the rank count, on the fold that completes an element). `op` is
 * the fold (avg folds as sum). dst may be any source at the same offsets
 * (in place): with two sources each element is read before it is written;
 * with more, a tile is folded aside first (writing dst early would lose a
 * later source). (Unused where a file includes this header for element_type alone.) */
__attribute__((unused)) static void reduce_sources(int type, int op, const char *const *srcs, int n, char *dst, char *dst2,
                           size_t nbytes, size_t itemsize, int divisor)
{
    fold_fn fold = FOLD[type][op];
    fold3_fn fold3 = FOLD3[type][op];
    if (n == 1) {
        memmove(dst, srcs[0], nbytes);
        if (divisor)
            DIVIDE[type](dst, nbytes / itemsize, divisor);
        if (dst2 != NULL)
            memcpy(dst2, dst, nbytes);
        return;
    }
    if (n == 2) {
        for (size_t at = 0; at < nbytes; at += REDUCE_TILE) {
            size_t len = nbytes - at < REDUCE_TILE ? nbytes - at : REDUCE_TILE;
            fold3(dst + at, srcs[0] + at, srcs[1] + at, len / itemsize);
            if (divisor)
                DIVIDE[type](dst + at, len / itemsize, divisor);
            if (dst2 != NULL)
                memcpy(dst2 + at, dst + at, len);
        }
        return;
    }
    _Alignas(64) char acc[REDUCE_TILE];
    for (size_t at = 0; at < nbytes; at += REDUCE_TILE) {
        size_t len = nbytes - at < REDUCE_TILE ? nbytes - at : REDUCE_TILE;
        size_t count = len / itemsize;
        fold3(acc, srcs[0] + at, srcs[1] + at, count);
        for (int s = 2; s < n; s++)
            fold(acc, srcs[s] + at, count);
        if (divisor)
            DIVIDE[type](acc, count, divisor);
        memcpy(dst + at, acc, len);
        if (dst2 != NULL)
            memcpy(dst2 + at, acc, len);
    }
}

#endif
