/* The call signature, one function for every engine: 64 bits that differ
 * when two ranks make different calls, which a rank publishes in its row's
 * SIG slot (protocol.py) and a peer compares with its own, or which heads
 * every message of a Program between nodes (_across.c). Python's twin is
 * protocol.call_signature, and a call's signature is the same whichever
 * engine runs it, so ranks on different engines meet in one call
 * (tests/test_host_plans.py runs such jobs).
 *
 * It mixes the call's number with a hash of its shape. The plan executor
 * and the Programs take the hash of the call's description
 * (protocol.description_hash: blake2b, once per description, in Python);
 * the compiled loop, whose calls have no description, hashes the numbers of
 * its shape (loop_shape_hash). */
#ifndef COLLECTIVES_SIGNATURES_H
#define COLLECTIVES_SIGNATURES_H

#include <stddef.h>
#include <stdint.h>

static inline int64_t call_signature(uint64_t shape_hash, int64_t seq)
{
    uint64_t mixed = shape_hash ^ ((uint64_t)seq * 0x9E3779B97F4A7C15ULL);
    mixed = (mixed ^ (mixed >> 31)) * 0xBF58476D1CE4E5B9ULL;
    mixed ^= mixed >> 29;
    return (int64_t)mixed;
}

/* A 64-bit finalizer (MurmurHash3's): every input bit moves every output bit. */
static inline uint64_t mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

/* The compiled loop's shape: collective (its K_ code), element type, op,
 * bytes per rank, root, and the path its ranks take (a rank that may not
 * take the single copy makes another call than one that may). */
static inline uint64_t loop_shape_hash(int kind, int type, int op, size_t nbytes, int root, int path)
{
    return mix64(mix64((uint64_t)nbytes) ^ ((uint64_t)kind << 40 | (uint64_t)(root + 1) << 16
                                            | (uint64_t)type << 8 | (uint64_t)op << 4 | (uint64_t)path));
}

#endif
