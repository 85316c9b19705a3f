// The compression codecs' CPU loops over blocks: included once per
// instruction set they are built for, inside a namespace of its own (by
// _codec.cpp, and under #pragma GCC target by _codec_avx2.cpp and
// _codec_avx512.cpp), so no include guard. See _codec.cpp.

// The payload's storage: float16/bfloat16 bits, or int8's byte.
template <int C> struct Payload { using type = std::uint16_t; };
template <> struct Payload<kInt8> { using type = std::uint8_t; };

template <int C>
COLLECTIVES_INLINE unsigned int payload_bits(typename Payload<C>::type p) { return p; }

// Operands of one call. `acc` is out's address when in place: the instances
// for that case read `out` instead, one pointer, so the compiler needs no
// overlap check (which fails when the two are equal, and falls back to
// scalar code).
template <int C>
struct Call {
    using P = typename Payload<C>::type;
    const float* acc;
    const float* b;                      // add's second operand
    const P* payload;                    // decode_add's operand (decode's)
    const std::uint8_t* scales;
    float* out;
    float divisor;
    P* __restrict__ out_payload;         // encoded output (encode's payload)
    std::uint8_t* __restrict__ out_scales;
};

// Which value a pass reads: the source of the float32 values v of a block.
enum Source { kX, kSum, kAdd };

// v at element i of the block starting at lo.
template <int C, Source S, bool InPlace, bool Divide>
COLLECTIVES_INLINE float value(const Call<C>& c, std::size_t i, float scale, bool plain) {
    if (S == kX) return c.out[i];   // encode: out is x
    const float a = InPlace ? c.out[i] : c.acc[i];
    const float other = S == kSum ? decode_value<C>(payload_bits<C>(c.payload[i]), scale, plain) : c.b[i];
    const float v = add(a, other);
    return Divide ? __fdiv_rn(v, c.divisor) : v;   // Divide: divisor > 0 (finish)
}

// The encoding pass over [lo, lo + count): payloads into `payload` (the
// block's first), a __restrict__ parameter: payload stores then alias none
// of the float reads, which a byte store (int8) would otherwise be assumed to
// (a char may alias anything), checked at run time in every block.
template <int C, Source S, bool InPlace, bool Divide, bool Write, bool Plain, bool Clamp>
COLLECTIVES_INLINE void encode_pass(const Call<C>& c, typename Payload<C>::type* __restrict__ payload, std::size_t lo,
                        std::size_t count, float scale, unsigned int byte) {
    const float inverse = inverse_scale_of(byte), out_scale = pow2(static_cast<int>(byte) - 127);
    for (std::size_t j = 0; j < count; ++j) {
        float decoded;
        const float v = value<C, S, InPlace, Divide>(c, lo + j, scale, Plain);
        payload[j] = static_cast<typename Payload<C>::type>(encode_value<C, Clamp>(v, inverse, &decoded));
        if (Write) c.out[lo + j] = rescale<C>(decoded, out_scale);
    }
}

// The passes over one block's elements [lo, lo + count), for a block whose
// payloads are `Plain` (see decode_value). Count is kBlock, a constant, for
// every whole block, so each loop is 32 known steps.
template <int C, Source S, bool InPlace, bool Divide, bool Encode, bool Write, bool Plain>
COLLECTIVES_INLINE void block_body(const Call<C>& c, std::size_t blk, std::size_t lo, std::size_t count, float scale) {
    if (!Encode) {   // sums only
        for (std::size_t j = 0; j < count; ++j) c.out[lo + j] = value<C, S, InPlace, Divide>(c, lo + j, scale, Plain);
        return;
    }
    unsigned int byte = 127;   // e = 0 (bf16 has no scale)
    if (C != kBf16) {
        int largest = 0;   // magnitude bits are below 2^31: signed lanes compare them (SSE2 has no unsigned max)
        for (std::size_t j = 0; j < count; ++j) {
            const int m = static_cast<int>(magnitude_bits(value<C, S, InPlace, Divide>(c, lo + j, scale, Plain)));
            largest = m > largest ? m : largest;
        }
        byte = scale_byte(C, static_cast<unsigned int>(largest));
        c.out_scales[blk] = static_cast<std::uint8_t>(byte);
        if (byte == kSpecialScale) {   // inf or NaN in the block: payload zeros, out NaN
            for (std::size_t j = 0; j < count; ++j) {
                c.out_payload[lo + j] = 0;
                if (Write) c.out[lo + j] = nan32();
            }
            return;
        }
    }
    if (C == kInt8 && int8_may_clamp(byte))   // float32's top sliver only
        encode_pass<C, S, InPlace, Divide, Write, Plain, true>(c, c.out_payload + lo, lo, count, scale, byte);
    else
        encode_pass<C, S, InPlace, Divide, Write, Plain, false>(c, c.out_payload + lo, lo, count, scale, byte);
}

// Whether the fp16 payloads [lo, lo + count) are all plain (no subnormal,
// inf or NaN float16): one decision per block, not per element.
template <int C>
COLLECTIVES_INLINE bool plain_payloads(const Call<C>& c, std::size_t lo, std::size_t count) {
    if (C != kFp16) return true;
    unsigned int unusual = 0;   // an integer OR reduction vectorizes; a bool one did not (GCC 13)
    for (std::size_t j = 0; j < count; ++j) unusual |= static_cast<unsigned int>(unusual_f16(c.payload[lo + j]));
    return unusual == 0;
}

template <int C, Source S, bool InPlace, bool Divide, bool Encode, bool Write>
COLLECTIVES_INLINE void block_pass(const Call<C>& c, std::size_t blk, std::size_t lo, std::size_t count) {
    if (S != kSum) return block_body<C, S, InPlace, Divide, Encode, Write, true>(c, blk, lo, count, 0.0f);
    const float scale = C == kBf16 ? 0.0f : scale_of(c.scales[blk]);
    if (plain_payloads(c, lo, count))
        block_body<C, S, InPlace, Divide, Encode, Write, true>(c, blk, lo, count, scale);
    else
        block_body<C, S, InPlace, Divide, Encode, Write, false>(c, blk, lo, count, scale);
}

// The Call is copied (by value): its pointers are then locals that no store
// can change, which the compiler must otherwise assume of every byte store
// (int8 payloads, scales), reloading them and checking overlaps per block.
template <int C, Source S, bool InPlace, bool Divide, bool Encode, bool Write>
void blocks(const Call<C> c, std::size_t n) {
    if (C == kBf16 || (S == kAdd && !Encode)) {   // no scale to find or apply: one pass over everything
        block_pass<C, S, InPlace, Divide, Encode, Write>(c, 0, 0, n);
        return;
    }
    const std::size_t whole = n / kBlock;
    for (std::size_t blk = 0; blk < whole; ++blk)
        block_pass<C, S, InPlace, Divide, Encode, Write>(c, blk, blk * kBlock, kBlock);
    if (n % kBlock) block_pass<C, S, InPlace, Divide, Encode, Write>(c, whole, whole * kBlock, n % kBlock);
}

// decode: out = decode(payload), a pass of its own (no sum).
template <int C, bool Plain>
COLLECTIVES_INLINE void decode_body(const Call<C>& c, std::size_t lo, std::size_t count, float scale) {
    for (std::size_t j = 0; j < count; ++j) c.out[lo + j] = decode_value<C>(c.payload[lo + j], scale, Plain);
}

template <int C>
COLLECTIVES_INLINE void decode_block(const Call<C>& c, std::size_t blk, std::size_t lo, std::size_t count) {
    const float scale = C == kBf16 ? 0.0f : scale_of(c.scales[blk]);
    if (plain_payloads(c, lo, count))
        decode_body<C, true>(c, lo, count, scale);
    else
        decode_body<C, false>(c, lo, count, scale);
}

template <int C>
void decode_blocks(const Call<C> c, std::size_t n) {   // by value: see blocks
    if (C == kBf16) return decode_block(c, 0, 0, n);   // no scale: one pass over everything
    const std::size_t whole = n / kBlock;
    for (std::size_t blk = 0; blk < whole; ++blk) decode_block(c, blk, blk * kBlock, kBlock);
    if (n % kBlock) decode_block(c, whole, whole * kBlock, n % kBlock);
}

// The instance for the flags of one call.
template <int C, Source S>
void dispatch(const Call<C>& c, std::size_t n, bool in_place, bool divide, bool encode, bool write) {
#define COLLECTIVES_CASE(InPlace, Divide, Encode, Write)                                       \
    if (in_place == InPlace && divide == Divide && encode == Encode && write == Write)         \
        return blocks<C, S, InPlace, Divide, Encode, Write>(c, n);
#define COLLECTIVES_CASES(InPlace, Divide)                                                    \
    COLLECTIVES_CASE(InPlace, Divide, false, true)                                            \
    COLLECTIVES_CASE(InPlace, Divide, true, true)                                             \
    COLLECTIVES_CASE(InPlace, Divide, true, false)
    COLLECTIVES_CASES(false, false)
    COLLECTIVES_CASES(false, true)
    COLLECTIVES_CASES(true, false)
    COLLECTIVES_CASES(true, true)
#undef COLLECTIVES_CASES
#undef COLLECTIVES_CASE
}

template <int C>
void encode(std::uintptr_t x, std::uintptr_t payload, std::uintptr_t scales, std::size_t n, bool round_x) {
    Call<C> c{};
    c.out = reinterpret_cast<float*>(x);
    c.out_payload = reinterpret_cast<typename Payload<C>::type*>(payload);
    c.out_scales = reinterpret_cast<std::uint8_t*>(scales);
    if (round_x)
        blocks<C, kX, false, false, true, true>(c, n);
    else
        blocks<C, kX, false, false, true, false>(c, n);
}

template <int C>
void decode(std::uintptr_t payload, std::uintptr_t scales, std::uintptr_t out, std::size_t n) {
    Call<C> c{};
    c.payload = reinterpret_cast<const typename Payload<C>::type*>(payload);
    c.scales = reinterpret_cast<const std::uint8_t*>(scales);
    c.out = reinterpret_cast<float*>(out);
    decode_blocks<C>(c, n);
}

template <int C>
void decode_add(std::uintptr_t acc, std::uintptr_t payload, std::uintptr_t scales, std::uintptr_t out, std::size_t n,
                float divisor, std::uintptr_t out_payload, std::uintptr_t out_scales, bool encode, bool write) {
    Call<C> c{};
    c.acc = reinterpret_cast<const float*>(acc);
    c.payload = reinterpret_cast<const typename Payload<C>::type*>(payload);
    c.scales = reinterpret_cast<const std::uint8_t*>(scales);
    c.out = reinterpret_cast<float*>(out);
    c.divisor = divisor;
    c.out_payload = reinterpret_cast<typename Payload<C>::type*>(out_payload);
    c.out_scales = reinterpret_cast<std::uint8_t*>(out_scales);
    dispatch<C, kSum>(c, n, acc == out, divisor > 0.0f, encode, write || !encode);
}

template <int C>
void add_(std::uintptr_t acc, std::uintptr_t b, std::uintptr_t out, std::size_t n, float divisor,
          std::uintptr_t out_payload, std::uintptr_t out_scales, bool encode, bool write) {
    if (b == out) {   // acc + b == b + acc, bit for bit: the in-place operand goes first
        const std::uintptr_t t = acc;
        acc = b;
        b = t;
    }
    Call<C> c{};
    c.acc = reinterpret_cast<const float*>(acc);
    c.b = reinterpret_cast<const float*>(b);
    c.out = reinterpret_cast<float*>(out);
    c.divisor = divisor;
    c.out_payload = reinterpret_cast<typename Payload<C>::type*>(out_payload);
    c.out_scales = reinterpret_cast<std::uint8_t*>(out_scales);
    dispatch<C, kAdd>(c, n, acc == out, divisor > 0.0f, encode, write || !encode);
}

// The loops for a codec id, as the Python functions call them.
void encode_any(int codec, std::uintptr_t x, std::uintptr_t payload, std::uintptr_t scales, std::size_t n,
                bool round_x) {
    switch (codec) {
        case kBf16: return encode<kBf16>(x, payload, scales, n, round_x);
        case kFp16: return encode<kFp16>(x, payload, scales, n, round_x);
        case kInt8: return encode<kInt8>(x, payload, scales, n, round_x);
    }
}

void decode_any(int codec, std::uintptr_t payload, std::uintptr_t scales, std::uintptr_t out, std::size_t n) {
    switch (codec) {
        case kBf16: return decode<kBf16>(payload, scales, out, n);
        case kFp16: return decode<kFp16>(payload, scales, out, n);
        case kInt8: return decode<kInt8>(payload, scales, out, n);
    }
}

void decode_add_any(int codec, std::uintptr_t acc, std::uintptr_t payload, std::uintptr_t scales, std::uintptr_t out,
                    std::size_t n, float divisor, std::uintptr_t out_payload, std::uintptr_t out_scales, bool encode,
                    bool write) {
    switch (codec) {
        case kBf16: return decode_add<kBf16>(acc, payload, scales, out, n, divisor, out_payload, out_scales, encode, write);
        case kFp16: return decode_add<kFp16>(acc, payload, scales, out, n, divisor, out_payload, out_scales, encode, write);
        case kInt8: return decode_add<kInt8>(acc, payload, scales, out, n, divisor, out_payload, out_scales, encode, write);
    }
}

void add_any(int codec, std::uintptr_t acc, std::uintptr_t b, std::uintptr_t out, std::size_t n, float divisor,
             std::uintptr_t out_payload, std::uintptr_t out_scales, bool encode, bool write) {
    switch (codec) {
        case kBf16: return add_<kBf16>(acc, b, out, n, divisor, out_payload, out_scales, encode, write);
        case kFp16: return add_<kFp16>(acc, b, out, n, divisor, out_payload, out_scales, encode, write);
        case kInt8: return add_<kInt8>(acc, b, out, n, divisor, out_payload, out_scales, encode, write);
    }
}
