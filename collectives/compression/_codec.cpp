// The compression codecs' CPU loops: kernels/codec.cuh's arithmetic over
// blocks of 32 elements, for host ranks. A Python extension (setup.py builds
// it, optional like _shmloop); collectives/compression/kernels.py validates
// the arrays and passes their addresses.
//
// Speed: host ranks pay for these loops on every hop of a compressed
// allreduce, so they must run near memory speed (bench/codec_speed.py).
// Each pass over a block (its largest |v|, then each value's encoding) is a
// loop of 32 steps with selects, no branches, that the compiler vectorizes;
// what is rare (inf or NaN in a block, unusual float16 payloads) is decided
// per block. Every case that pays is its own instance (in place or not, a
// divisor or not, whole blocks of 32 or the partial last one), so that each
// loop is straight-line code over known pointers.
//
// A block's operation reads its float32 values v (x; acc + decode(b);
// acc + b) in up to two passes: the largest |v|, for the scale, then each
// value's encoding. The second pass computes v again, in the same float32
// steps, so it has the same bits; out may be acc (or b, for add), and with
// write_out false out is never written.
//
// Built with -O3 -ffp-contract=off: no FMA contraction, so every float32 step
// rounds as on the GPU and in the NumPy reference.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstddef>
#include <cstdint>

#include "emulation/host_math.h"
#include "codec.cuh"

namespace {

using namespace collectives::codec;

// The payload's storage: float16/bfloat16 bits, or int8's byte.
template <int C> struct Payload { using type = std::uint16_t; };
template <> struct Payload<kInt8> { using type = std::uint8_t; };

template <int C>
inline unsigned int payload_bits(typename Payload<C>::type p) { return p; }

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
inline float value(const Call<C>& c, std::size_t i, float scale, bool plain) {
    if (S == kX) return c.out[i];   // encode: out is x
    const float a = InPlace ? c.out[i] : c.acc[i];
    const float other = S == kSum ? decode_value<C>(payload_bits<C>(c.payload[i]), scale, plain) : c.b[i];
    const float v = add(a, other);
    return Divide ? __fdiv_rn(v, c.divisor) : v;   // Divide: divisor > 0 (finish)
}

// The passes over one block's elements [lo, lo + count), for a block whose
// payloads are `Plain` (see decode_value). Count is kBlock, a constant, for
// every whole block, so each loop is 32 known steps.
template <int C, Source S, bool InPlace, bool Divide, bool Encode, bool Write, bool Plain>
inline void block_body(const Call<C>& c, std::size_t blk, std::size_t lo, int count, float scale) {
    if (!Encode) {   // sums only
        for (int j = 0; j < count; ++j) c.out[lo + j] = value<C, S, InPlace, Divide>(c, lo + j, scale, Plain);
        return;
    }
    unsigned int byte = 127;   // e = 0 (bf16 has no scale)
    if (C != kBf16) {
        int largest = 0;   // magnitude bits are below 2^31: signed lanes compare them (SSE2 has no unsigned max)
        for (int j = 0; j < count; ++j) {
            const int m = static_cast<int>(magnitude_bits(value<C, S, InPlace, Divide>(c, lo + j, scale, Plain)));
            largest = m > largest ? m : largest;
        }
        byte = scale_byte(C, static_cast<unsigned int>(largest));
        c.out_scales[blk] = static_cast<std::uint8_t>(byte);
        if (byte == kSpecialScale) {   // inf or NaN in the block: payload zeros, out NaN
            for (int j = 0; j < count; ++j) {
                c.out_payload[lo + j] = 0;
                if (Write) c.out[lo + j] = nan32();
            }
            return;
        }
    }
    const float inverse = inverse_scale_of(byte), out_scale = pow2(static_cast<int>(byte) - 127);
    for (int j = 0; j < count; ++j) {
        float decoded;
        const float v = value<C, S, InPlace, Divide>(c, lo + j, scale, Plain);
        c.out_payload[lo + j] = static_cast<typename Payload<C>::type>(encode_value<C>(v, inverse, &decoded));
        if (Write) c.out[lo + j] = rescale<C>(decoded, out_scale);
    }
}

// Whether the fp16 payloads [lo, lo + count) are all plain (no subnormal,
// inf or NaN float16): one decision per block, not per element.
template <int C>
inline bool plain_payloads(const Call<C>& c, std::size_t lo, int count) {
    if (C != kFp16) return true;
    bool unusual = false;
    for (int j = 0; j < count; ++j) unusual |= unusual_f16(c.payload[lo + j]);
    return !unusual;
}

template <int C, Source S, bool InPlace, bool Divide, bool Encode, bool Write>
inline void block_pass(const Call<C>& c, std::size_t blk, std::size_t lo, int count) {
    if (S != kSum) return block_body<C, S, InPlace, Divide, Encode, Write, true>(c, blk, lo, count, 0.0f);
    const float scale = C == kBf16 ? 0.0f : scale_of(c.scales[blk]);
    if (plain_payloads(c, lo, count))
        block_body<C, S, InPlace, Divide, Encode, Write, true>(c, blk, lo, count, scale);
    else
        block_body<C, S, InPlace, Divide, Encode, Write, false>(c, blk, lo, count, scale);
}

template <int C, Source S, bool InPlace, bool Divide, bool Encode, bool Write>
void blocks(const Call<C>& c, std::size_t n) {
    const std::size_t whole = n / kBlock;
    for (std::size_t blk = 0; blk < whole; ++blk)
        block_pass<C, S, InPlace, Divide, Encode, Write>(c, blk, blk * kBlock, kBlock);
    if (n % kBlock)
        block_pass<C, S, InPlace, Divide, Encode, Write>(c, whole, whole * kBlock, static_cast<int>(n % kBlock));
}

// decode: out = decode(payload), a pass of its own (no sum).
template <int C, bool Plain>
inline void decode_body(const Call<C>& c, std::size_t lo, int count, float scale) {
    for (int j = 0; j < count; ++j) c.out[lo + j] = decode_value<C>(c.payload[lo + j], scale, Plain);
}

template <int C>
inline void decode_block(const Call<C>& c, std::size_t blk, std::size_t lo, int count) {
    const float scale = C == kBf16 ? 0.0f : scale_of(c.scales[blk]);
    if (plain_payloads(c, lo, count))
        decode_body<C, true>(c, lo, count, scale);
    else
        decode_body<C, false>(c, lo, count, scale);
}

template <int C>
void decode_blocks(const Call<C>& c, std::size_t n) {
    const std::size_t whole = n / kBlock;
    for (std::size_t blk = 0; blk < whole; ++blk) decode_block(c, blk, blk * kBlock, kBlock);
    if (n % kBlock) decode_block(c, whole, whole * kBlock, static_cast<int>(n % kBlock));
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

// -- Python: addresses and sizes in, checked by kernels.py ------------------------

PyObject* py_encode(PyObject*, PyObject* args) {
    int codec, round_x;
    unsigned long long x, payload, scales;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "iKKKnp", &codec, &x, &payload, &scales, &n, &round_x)) return nullptr;
    Py_BEGIN_ALLOW_THREADS
#define COLLECTIVES_CALL(C) encode<C>(x, payload, scales, static_cast<std::size_t>(n), round_x)
    switch (codec) {
        case kBf16: COLLECTIVES_CALL(kBf16); break;
        case kFp16: COLLECTIVES_CALL(kFp16); break;
        case kInt8: COLLECTIVES_CALL(kInt8); break;
        default: break;
    }
#undef COLLECTIVES_CALL
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyObject* py_decode(PyObject*, PyObject* args) {
    int codec;
    unsigned long long payload, scales, out;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "iKKKn", &codec, &payload, &scales, &out, &n)) return nullptr;
    Py_BEGIN_ALLOW_THREADS
#define COLLECTIVES_CALL(C) decode<C>(payload, scales, out, static_cast<std::size_t>(n))
    switch (codec) {
        case kBf16: COLLECTIVES_CALL(kBf16); break;
        case kFp16: COLLECTIVES_CALL(kFp16); break;
        case kInt8: COLLECTIVES_CALL(kInt8); break;
        default: break;
    }
#undef COLLECTIVES_CALL
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyObject* py_decode_add(PyObject*, PyObject* args) {
    int codec, encode, write;
    unsigned long long acc, payload, scales, out, out_payload, out_scales;
    Py_ssize_t n;
    float divisor;
    if (!PyArg_ParseTuple(args, "iKKKKnfKKpp", &codec, &acc, &payload, &scales, &out, &n, &divisor, &out_payload,
                          &out_scales, &encode, &write))
        return nullptr;
    Py_BEGIN_ALLOW_THREADS
#define COLLECTIVES_CALL(C) \
    decode_add<C>(acc, payload, scales, out, static_cast<std::size_t>(n), divisor, out_payload, out_scales, encode, write)
    switch (codec) {
        case kBf16: COLLECTIVES_CALL(kBf16); break;
        case kFp16: COLLECTIVES_CALL(kFp16); break;
        case kInt8: COLLECTIVES_CALL(kInt8); break;
        default: break;
    }
#undef COLLECTIVES_CALL
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyObject* py_add(PyObject*, PyObject* args) {
    int codec, encode, write;
    unsigned long long acc, b, out, out_payload, out_scales;
    Py_ssize_t n;
    float divisor;
    if (!PyArg_ParseTuple(args, "iKKKnfKKpp", &codec, &acc, &b, &out, &n, &divisor, &out_payload, &out_scales,
                          &encode, &write))
        return nullptr;
    Py_BEGIN_ALLOW_THREADS
#define COLLECTIVES_CALL(C) \
    add_<C>(acc, b, out, static_cast<std::size_t>(n), divisor, out_payload, out_scales, encode, write)
    switch (codec) {
        case kBf16: COLLECTIVES_CALL(kBf16); break;
        case kFp16: COLLECTIVES_CALL(kFp16); break;
        case kInt8: COLLECTIVES_CALL(kInt8); break;
        default: break;
    }
#undef COLLECTIVES_CALL
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

// The per-element conversions alone, over arrays, for the tests that compare
// them with NumPy on every float16 and a sweep of float32 values.
PyObject* py_convert(PyObject*, PyObject* args) {
    unsigned long long x, f16, f16_value, bf16, payload, general, plain;
    Py_ssize_t n, m;
    if (!PyArg_ParseTuple(args, "KKKKnKKKn", &x, &f16, &f16_value, &bf16, &n, &payload, &general, &plain, &m))
        return nullptr;
    const float* xs = reinterpret_cast<const float*>(x);
    for (Py_ssize_t i = 0; i < n; ++i) {
        float value;
        reinterpret_cast<std::uint16_t*>(f16)[i] = static_cast<std::uint16_t>(to_f16(xs[i], &value));
        reinterpret_cast<float*>(f16_value)[i] = value;
        reinterpret_cast<std::uint16_t*>(bf16)[i] = static_cast<std::uint16_t>(to_bf16(xs[i]));
    }
    const std::uint16_t* ps = reinterpret_cast<const std::uint16_t*>(payload);
    for (Py_ssize_t i = 0; i < m; ++i) {
        reinterpret_cast<float*>(general)[i] = from_f16(ps[i]);
        reinterpret_cast<float*>(plain)[i] = from_plain_f16(ps[i]);
    }
    Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"encode", py_encode, METH_VARARGS, "encode(codec, x, payload, scales, n, round_x)"},
    {"decode", py_decode, METH_VARARGS, "decode(codec, payload, scales, out, n)"},
    {"decode_add", py_decode_add, METH_VARARGS,
     "decode_add(codec, acc, payload, scales, out, n, divisor, out_payload, out_scales, encode_out, write_out)"},
    {"add", py_add, METH_VARARGS,
     "add(codec, acc, b, out, n, divisor, out_payload, out_scales, encode_out, write_out)"},
    {"convert", py_convert, METH_VARARGS,
     "convert(x, f16, f16_value, bf16, n, payload, general, plain, m): the conversions alone (tests)"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_codec",
                      "The compression codecs' CPU loops (kernels/codec.cuh); addresses in, see kernels.py.", -1,
                      methods};

}  // namespace

PyMODINIT_FUNC PyInit__codec(void) {
    PyObject* m = PyModule_Create(&module);
    if (m != nullptr) PyModule_AddIntConstant(m, "BLOCK", kBlock);
    return m;
}
