// The compression codecs' arithmetic, once: float32 <-> wire, per element and
// per block. Two forms use it and add only loops and memory access:
//
//     kernels/codec.cu                     the GPU kernels (NVRTC, nvcc; and the
//                                          emulated device, which compiles the
//                                          same file for the CPU)
//     collectives/compression/_codec.cpp   the CPU loops over blocks (host
//                                          ranks), a Python extension
//
// collectives/compression/kernels.py launches either and names the codecs.
//
// Wire format (other code depends on it bit for bit)
// ==================================================
//
//     input        float32, cut into blocks of kBlock = 32 consecutive elements
//                  (the last block of a buffer may be partial)
//
//     codec   payload / element      scales / block   decode
//     -----   --------------------   --------------   -------------------------
//     bf16    uint16 bfloat16 bits   none             float32(b)
//     fp16    uint16 float16 bits    uint8 E8M0       float32(h) * 2^e
//     int8    int8 in [-127, 127]    uint8 E8M0       float32(q) * 2^e
//
//     E8M0 scale byte  = e + 127, the block's power of two 2^e (MX's format)
//         k            = unbiased float32 exponent of the block's largest |x|
//                        (-126 when that maximum is zero or subnormal)
//         fp16         e = max(k - 14, -127): the maximum scales into [2^14, 2^15),
//                      float16 never overflows, and small blocks keep 11 bits
//         int8         e = max(k - 6, -127): the maximum M scales into [64, 128);
//                      but where rint(M * 2^-e) would be 128, e + 1 (unless
//                      e = 121: 64 * 2^122 is inf in float32), and it scales
//                      into [63.75, 64). So no |q| ever needs the clamp to 127.
//         byte 255     the block holds an inf or NaN: every element decodes to
//                      NaN (payload written as zeros)
//
//     encode  bf16     b = bfloat16_rne(x)              (NaN stays NaN, inf inf)
//             fp16     h = float16_rne(x * 2^-e)
//             int8     q = clamp(rint_half_even(x * 2^-e), -127, 127)
//
//     int8's error, one encode and decode: x * 2^-e is exact, rint is off by at
//     most half a step, q * 2^e is exact, so |x - q 2^e| <= min(|x|, 2^(e-1)),
//     and, M being the block's largest |x|,
//         2^(e-1) <= M / 128     where M * 2^-e is in [64, 127.5)
//         2^(e-1) <= M / 127.5   where it is in [63.75, 64) (e went up by one)
//         2^(e-1) =  2^-128      where e = -127 (M < 2^-121)
//     that is |err| <= max(M / 127.5, 2^-128), M / 127.5 = 2^-6.994 M: half a
//     step, unbiased. The exception is float32's top sliver,
//     M >= (2 - 2^-7) 2^127 (3.39e38), where the maximum is clamped to 127.
//
// Every step is float32 with IEEE round-to-nearest-even, no FMA contraction
// (__fmul_rn and friends here; -ffp-contract=off and --fmad=false in every
// build), no flush of subnormals (2^-127 is the subnormal float32
// 0x00400000), and integer steps in uint32 (no signed overflow), so the GPU
// kernels, the emulated device, the CPU loops and the NumPy reference
// (tests/codec_reference.py) agree bit for bit: the same bytes decode to the
// same floats everywhere.
//
// Written for speed on both targets: no branch per element, only selects on
// values both computed (vector lanes on the CPU, no divergence in a warp);
// what is rare is decided per block (a block with inf or NaN; float16
// payloads holding a subnormal, inf or NaN take the general decoding).
// Comparisons are between float32 values, and no float32 subnormal is an
// operand on the common paths (a CPU takes a microcode assist for each).
// Encoding returns the value its payload decodes to, so that round_x and the
// encoded outputs of decode_add and add never decode again.
//
// Needs only the CUDA qualifiers and the float intrinsics it uses
// (__fmul_rn, __fadd_rn, __fdiv_rn, __float_as_uint, __uint_as_float): the
// GPU has them; on the CPU kernels/emulation/host_math.h stands in (no CUDA
// header needed, so the host extension builds without a toolkit).

#pragma once

namespace collectives {
namespace codec {

constexpr int kBlock = 32;                 // elements per block (kernels.py: BLOCK)
enum Codec { kBf16 = 0, kFp16 = 1, kInt8 = 2 };   // kernels.py: codec_id
constexpr unsigned int kSpecialScale = 255;       // the block holds inf or NaN

__host__ __device__ __forceinline__ unsigned int bits(float x) { return __float_as_uint(x); }
__host__ __device__ __forceinline__ float from_bits(unsigned int b) { return __uint_as_float(b); }
__host__ __device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__host__ __device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
__host__ __device__ __forceinline__ float sub(float a, float b) { return __fadd_rn(a, -b); }
__host__ __device__ __forceinline__ float abs_of(float x) { return from_bits(bits(x) & 0x7FFFFFFFu); }
__host__ __device__ __forceinline__ float nan32() { return from_bits(0x7FC00000u); }

// The bits of |x|: for finite x they order like |x|; inf and NaN above them all.
__host__ __device__ __forceinline__ unsigned int magnitude_bits(float x) { return bits(x) & 0x7FFFFFFFu; }

// 2^e as float32 for -127 <= e <= 127 (2^-127 is subnormal).
__host__ __device__ __forceinline__ float pow2(int e) {
    return e == -127 ? from_bits(0x00400000u) : from_bits(static_cast<unsigned int>(e + 127) << 23);
}

// bfloat16 bits of float32 x, round to nearest even.
__host__ __device__ __forceinline__ unsigned int to_bf16(float x) {
    const unsigned int b = bits(x);
    // Adding 0x7FFF plus the lowest kept bit carries into the kept bits exactly
    // when the dropped half is above one half, or is one half and the kept part
    // odd. A carry out of the mantissa raises the exponent, up to inf. (Only
    // NaNs' bits come near 2^32, and they take the other value.)
    const unsigned int rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
    const unsigned int quiet_nan = (b >> 16) | 0x0040u;   // NaN: keep it a (quiet) NaN
    return x != x ? quiet_nan : rounded;
}

__host__ __device__ __forceinline__ float from_bf16(unsigned int h) { return from_bits((h & 0xFFFFu) << 16); }

// IEEE float16 bits of float32 x, round to nearest even, subnormals included,
// and (in *value) the float32 value of those bits, exact; for finite x below
// 65520 in magnitude, where float16 does not overflow: every x a block's
// scale 2^-e has brought below 2^15.
__host__ __device__ __forceinline__ unsigned int to_f16(float x, float* value) {
    const float magnitude = abs_of(x);
    const float min_normal = 6.103515625e-05f;   // 2^-14
    // e: the exponent field of |x|, 2^-14 if below (float16's subnormals).
    const unsigned int e = bits(magnitude > min_normal ? magnitude : min_normal) & 0x7F800000u;
    // c = 1.5 2^(E + 13) is a float32 whose spacing, 2^(E - 10), is float16's
    // at exponent E (below 2^-14: 2^-24, its subnormals' spacing). So the IEEE
    // sum |x| + c rounds |x| to float16, half to even, and stays below 2c: the
    // sum's bits minus c's count float16 steps from 0 at exponent E, a carry
    // into the next exponent included, and the sum minus c, exact, is the
    // rounded |x|.
    const unsigned int c = e + 0x06C00000u;
    const float rounded = add(magnitude, from_bits(c));
    const unsigned int h = ((e >> 13) - (113u << 10)) + (bits(rounded) - c);   // (E + 14) << 10, minus one
    const unsigned int sign = bits(x) & 0x80000000u;
    *value = from_bits(bits(sub(rounded, from_bits(c))) | sign);
    return (sign >> 16) | h;
}

// The float32 value of float16 bits h (exact).
__host__ __device__ __forceinline__ float from_f16(unsigned int h) {
    h &= 0xFFFFu;
    // Rebiased (15 -> 127), the bits are a normal float16's value; with the
    // smallest exponent, 0, they read 2^-15 (1 + m/1024) instead of the
    // subnormal's m 2^-24, which two exact steps recover (no float32 subnormal
    // on the way: they are slow on CPUs); with the largest, 31, 2^16 (1 + m/1024)
    // instead of inf or NaN, whose bits 112 more exponent gives.
    const float v = from_bits((((h & 0x7FFFu) << 13) + 0x38000000u) | ((h & 0x8000u) << 16));
    const float magnitude = abs_of(v);
    float subnormal = mul(sub(magnitude, 3.0517578125e-05f /* 2^-15 */), 2.0f);
    subnormal = v > 0.0f ? subnormal : -subnormal;   // -(+0) is -0: the sign of -0 kept
    const float low = magnitude < 6.103515625e-05f /* 2^-14 */ ? subnormal : v;
    return magnitude >= 65536.0f ? from_bits(bits(v) + 0x38000000u) : low;
}

// from_f16 for zero and normal float16s only (no subnormal, inf, NaN), in
// fewer steps: moved into float32's place, such bits read as the value times
// 2^-112 (a normal float32, or zero), and one exact product puts the exponent
// back. (For a subnormal float16 it would take a float32 subnormal, which
// CPUs handle slowly.)
__host__ __device__ __forceinline__ float from_plain_f16(unsigned int h) {
    const unsigned int sign_extended = ((h & 0xFFFFu) ^ 0x8000u) - 0x8000u;   // shifted by 13, the sign lands on bit 31
    return mul(from_bits((sign_extended << 13) & 0x8FFFE000u), 5.192296858534828e+33f /* 2^112 */);
}

// Whether a float16 payload is a subnormal, inf or NaN (not "plain"): a
// block holding one decodes with from_f16 instead of from_plain_f16.
__host__ __device__ __forceinline__ bool unusual_f16(unsigned int h) {
    const unsigned int u = h & 0x7FFFu;
    return (u >= 0x7C00u) | ((u != 0u) & (u < 0x400u));
}

// e = k - headroom: the block's maximum scales into [2^h, 2^(h+1)).
__host__ __device__ __forceinline__ int headroom(int codec) { return codec == kFp16 ? 14 : 6; }

// E8M0 byte (fp16, int8) of a block whose largest |x| has the bits `largest`:
// e + 127, or kSpecialScale if the block holds inf or NaN.
__host__ __device__ __forceinline__ unsigned int scale_byte(int codec, unsigned int largest) {
    // k, the exponent of the largest |x| (zero and subnormal maxima count as
    // 2^-126); for int8, of it rounded to 8 significant bits: adding 2^16 to
    // the bits carries into the exponent exactly when the mantissa is at least
    // 1 + 127/128, when the maximum scaled into [64, 128) would be >= 127.5 and
    // round to 128. Then e is one larger and it scales to [63.75, 64). Not past
    // k = 127, though: 64 2^122 = 2^128 would decode to inf, so in float32's
    // top sliver the maximum is clamped to 127 2^121 instead.
    const unsigned int rounding = codec == kInt8 ? (1u << 16) : 0u;
    int k = static_cast<int>((largest + rounding) >> 23);
    k = (k < 1 ? 1 : k > 254 ? 254 : k) - 127;
    const int e = k - headroom(codec);
    const unsigned int byte = static_cast<unsigned int>((e < -127 ? -127 : e) + 127);
    return largest >= 0x7F800000u ? kSpecialScale : byte;
}

// 2^e of a scale byte (NaN for kSpecialScale: every element decodes to NaN).
__host__ __device__ __forceinline__ float scale_of(unsigned int byte) {
    return byte == kSpecialScale ? nan32() : pow2(static_cast<int>(byte) - 127);
}

// 2^-e, the factor that encodes, of a scale byte that is not kSpecialScale.
__host__ __device__ __forceinline__ float inverse_scale_of(unsigned int byte) {
    return pow2(127 - static_cast<int>(byte));
}

// int8: whether a block of scale byte `byte` may need the clamp to 127: only
// at e = 121, float32's top sliver (see the wire format); at every other
// scale |x 2^-e| < 127.5, so rint gives at most 127 and the clamp is a no-op.
__host__ __device__ __forceinline__ bool int8_may_clamp(unsigned int byte) { return byte == 127u + 121u; }

// The payload of float32 v (as the low bits of a uint32; int8's as its two's
// complement byte) and, in *value, its decoding times 2^-e, exact (inverse =
// 2^-e; unused for bf16, whose decoding is returned). Clamp false leaves out
// int8's clamp, for blocks where int8_may_clamp is false (the same result;
// the CPU loops vectorize better without it).
template <int Codec, bool Clamp = true>
__host__ __device__ __forceinline__ unsigned int encode_value(float v, float inverse, float* value) {
    if (Codec == kBf16) {
        const unsigned int p = to_bf16(v);
        *value = from_bf16(p);
        return p;
    }
    const float y = mul(v, inverse);   // exact unless it lands below 2^-126
    if (Codec == kFp16) return to_f16(y, value);
    const float magic = 12582912.0f;   // 1.5 2^23: (y + M) - M rounds y to an integer, half to even, for |y| < 2^22
    float q = sub(add(y, magic), magic);
    if (Clamp) {
        q = q < -127.0f ? -127.0f : q;
        q = q > 127.0f ? 127.0f : q;
    }
    *value = q;
    return static_cast<unsigned int>(static_cast<int>(q)) & 0xFFu;
}

// The decoding of a payload, from the value encode_value gave with it.
template <int Codec>
__host__ __device__ __forceinline__ float rescale(float value, float scale) {
    return Codec == kBf16 ? value : mul(value, scale);
}

// The float32 of payload p (its low bits) in a block of scale 2^e (NaN:
// special; unused for bf16); `plain`: no payload of the block is unusual_f16
// (the same result, in fewer steps).
template <int Codec>
__host__ __device__ __forceinline__ float decode_value(unsigned int p, float scale, bool plain) {
    if (Codec == kBf16) return from_bf16(p);
    if (Codec == kFp16) return mul(plain ? from_plain_f16(p) : from_f16(p), scale);
    const int q = static_cast<int>(p & 0xFFu) - static_cast<int>((p & 0x80u) << 1);   // the int8 it holds
    return mul(static_cast<float>(q), scale);
}

// v, divided by divisor if divisor > 0 (IEEE float32 division).
__host__ __device__ __forceinline__ float finish(float v, float divisor) {
    return divisor > 0.0f ? __fdiv_rn(v, divisor) : v;
}

}  // namespace codec
}  // namespace collectives
