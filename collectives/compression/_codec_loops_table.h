// What _codec.cpp and each instruction set's unit of the loops share: the
// headers the loops need, the inlining they rely on, and the table of their
// four entry points that each unit hands to _codec.cpp.
//
// One unit per instruction set (_codec.cpp: the baseline; _codec_avx2.cpp,
// _codec_avx512.cpp), so that setup.py compiles them side by side: as one
// unit the three copies of the loops were about a minute of one core in
// every install.

#ifndef COLLECTIVES_CODEC_LOOPS_TABLE_H
#define COLLECTIVES_CODEC_LOOPS_TABLE_H

#include <cstddef>
#include <cstdint>

#include "emulation/host_math.h"
#include "codec.cuh"

// Every pass inlined into its loop over blocks, where a whole block's
// bound is the constant 32: the vector loops then need no remainder code.
#if defined(__GNUC__)
#define COLLECTIVES_INLINE inline __attribute__((always_inline))
#else
#define COLLECTIVES_INLINE inline
#endif

// AVX2 and AVX-512 copies of the loops: x86-64 with GCC (#pragma GCC target).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define COLLECTIVES_CODEC_MULTIVERSION 1
#endif

namespace collectives_codec {

struct Loops {
    const char* target;
    void (*encode)(int codec, std::uintptr_t x, std::uintptr_t payload, std::uintptr_t scales, std::size_t n,
                   bool round_x);
    void (*decode)(int codec, std::uintptr_t payload, std::uintptr_t scales, std::uintptr_t out, std::size_t n);
    void (*decode_add)(int codec, std::uintptr_t acc, std::uintptr_t payload, std::uintptr_t scales,
                       std::uintptr_t out, std::size_t n, float divisor, std::uintptr_t out_payload,
                       std::uintptr_t out_scales, bool encode, bool write);
    void (*add)(int codec, std::uintptr_t acc, std::uintptr_t b, std::uintptr_t out, std::size_t n, float divisor,
                std::uintptr_t out_payload, std::uintptr_t out_scales, bool encode, bool write);
};

#define COLLECTIVES_LOOPS(ns) \
    ::collectives_codec::Loops{#ns, ns::encode_any, ns::decode_any, ns::decode_add_any, ns::add_any}

// Each instruction set's table, from its own unit (x86-64 with GCC only);
// hidden: the module's one exported symbol stays PyInit__codec.
#ifdef COLLECTIVES_CODEC_MULTIVERSION
__attribute__((visibility("hidden"))) Loops avx2_loops();
__attribute__((visibility("hidden"))) Loops avx512_loops();
#endif

}  // namespace collectives_codec

#endif
