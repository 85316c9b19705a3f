// The codec loops compiled for AVX-512: one of the three units of the _codec
// extension (_codec_loops_table.h says why three), whose table _codec.cpp
// picks when the CPU has AVX-512. The same IEEE operations in wider vectors,
// so the same bits: -ffp-contract=off keeps FMA out whatever the target.

#include "_codec_loops_table.h"

#ifdef COLLECTIVES_CODEC_MULTIVERSION
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

namespace {
namespace avx512 {
using namespace collectives::codec;
#include "_codec_loops.h"
}  // namespace avx512
}  // namespace

collectives_codec::Loops collectives_codec::avx512_loops() { return COLLECTIVES_LOOPS(avx512); }
#endif
