// The codec loops compiled for AVX2: one of the three units of the _codec
// extension (_codec_loops_table.h says why three), whose table _codec.cpp
// picks when the CPU has AVX2. The same IEEE operations in wider vectors,
// so the same bits: -ffp-contract=off keeps FMA out whatever the target.

#include "_codec_loops_table.h"

#ifdef COLLECTIVES_CODEC_MULTIVERSION
#pragma GCC target("avx2")

namespace {
namespace avx2 {
using namespace collectives::codec;
#include "_codec_loops.h"
}  // namespace avx2
}  // namespace

collectives_codec::Loops collectives_codec::avx2_loops() { return COLLECTIVES_LOOPS(avx2); }
#endif
