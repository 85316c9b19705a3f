// Element types and reduction ops, shared by every kernel in this folder.
//
// An element type is a small struct: `Storage`, the bits that move through
// memory; `Accumulator`, what a reduction folds in; `load` and `store`
// between the two; and the ops on accumulators (`combine`, `divide`).
// Kernels never do arithmetic on anything else, so every kernel reduces the
// way executors/host.py does with NumPy (the reference meaning):
//
//   * integers: sum and prod wrap around, computed in the unsigned twin type
//     (signed overflow is undefined in C++); avg truncates toward zero.
//   * float32 and float64: one correctly rounded operation per fold step
//     (__fadd_rn and friends are never contracted into an FMA).
//   * float16 and bfloat16 accumulate in float32: a fold (one REDUCE row of
//     a plan, however many sources it has) converts each source to float32
//     exactly, folds with correctly rounded float32 operations (and avg's
//     division), and rounds to the 16-bit type once, to nearest even, at the
//     end. Subnormals are kept (no flush to zero anywhere). NCCL rounds to
//     16 bits at every hop of its ring; a row of n sources here rounds once.
//   * max and min of floats follow IEEE 754-2019 maximum/minimum: a NaN
//     operand gives NaN, and -0 < +0. executors/host.py applies the same rule.
//
// For every type but the 16-bit floats the accumulator is the storage type
// and load/store are the identity: their arithmetic is what it was before
// the distinction.
//
// Plain C++ with CUDA qualifiers and no device-only built-ins outside the
// helpers below, so the same file compiles for the GPU (nvcc, NVRTC) and for
// the CPU (emulation/cuda_host.h).

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace collectives {

// Reduction ops, as plan tables and collectives/kernels.py number them.
// avg is not an op here: it folds as kSum and divides in REDUCE_FINAL rows.
enum Op { kSum = 0, kProd = 1, kMax = 2, kMin = 3 };

// Bit patterns of floats, without unions or pointer casts (both would push
// values into local memory on the GPU).
__device__ __forceinline__ unsigned int float_bits(float x) { return __float_as_uint(x); }
__device__ __forceinline__ float float_from_bits(unsigned int b) { return __uint_as_float(b); }
__device__ __forceinline__ unsigned long long double_bits(double x) {
    return static_cast<unsigned long long>(__double_as_longlong(x));
}
__device__ __forceinline__ double double_from_bits(unsigned long long b) {
    return __longlong_as_double(static_cast<long long>(b));
}

// A storage value as the low bits of a 64-bit word, and back: how lanes go
// in and out of the 32-bit words a 16-byte load brings in.
template <typename S>
struct Bits {  // integers
    __device__ __forceinline__ static S from(unsigned long long bits) { return static_cast<S>(bits); }
    __device__ __forceinline__ static unsigned long long to(S x) {
        return static_cast<unsigned long long>(x) & (sizeof(S) == 8 ? ~0ull : (1ull << (8 * sizeof(S))) - 1);
    }
};
template <>
struct Bits<float> {
    __device__ __forceinline__ static float from(unsigned long long bits) {
        return float_from_bits(static_cast<unsigned int>(bits));
    }
    __device__ __forceinline__ static unsigned long long to(float x) { return float_bits(x); }
};
template <>
struct Bits<double> {
    __device__ __forceinline__ static double from(unsigned long long bits) { return double_from_bits(bits); }
    __device__ __forceinline__ static unsigned long long to(double x) { return double_bits(x); }
};

// max/min on bit patterns whose numeric values are a and b (see the header).
// Equal values have equal bits except +0/-0, where AND keeps -0 only if both
// are -0 (max) and OR gives -0 if either is (min).
template <typename Bits, typename Value>
__device__ __forceinline__ Bits ieee_max(Bits a, Bits b, Value va, Value vb) {
    if (va != va) return a;
    if (vb != vb) return b;
    if (va > vb) return a;
    if (vb > va) return b;
    return a & b;
}

template <typename Bits, typename Value>
__device__ __forceinline__ Bits ieee_min(Bits a, Bits b, Value va, Value vb) {
    if (va != va) return a;
    if (vb != vb) return b;
    if (va < vb) return a;
    if (vb < va) return b;
    return a | b;
}

// std::conditional without <type_traits>, which NVRTC does not provide.
template <bool Condition, typename IfTrue, typename IfFalse>
struct Select { using type = IfTrue; };
template <typename IfTrue, typename IfFalse>
struct Select<false, IfTrue, IfFalse> { using type = IfFalse; };

// Element types combine one element at a time by default. Some also combine
// a 32-bit word of packed elements at once (`kWordwise`): 8- and 16-bit
// integers, whose sum, max and min have SIMD instructions; combined one by
// one, a 16-byte pack of them needs more registers than a thread has.
struct ElementByElement {
    template <int Op>
    static constexpr bool kWordwise = false;

    template <int Op>
    __device__ __forceinline__ static unsigned int combine_word(unsigned int a, unsigned int) { return a; }
};

// Types that fold in their own storage type.
template <typename S>
struct FoldsInStorage {
    using Accumulator = S;
    __device__ __forceinline__ static S load(S x) { return x; }
    __device__ __forceinline__ static S store(S x) { return x; }
};

// Integers. `Wide` is what the arithmetic runs in: the unsigned twin, or
// unsigned int for 8- and 16-bit types, which C++ would otherwise promote to
// (signed) int, where 65535 * 65535 overflows.
template <typename S, typename Unsigned, typename Quotient>
struct Integer : FoldsInStorage<S> {
    using Storage = S;
    using Wide = typename Select<(sizeof(S) < 4), unsigned int, Unsigned>::type;
    static constexpr bool kSigned = static_cast<S>(-1) < static_cast<S>(0);

    template <int Op>
    static constexpr bool kWordwise = sizeof(S) <= 2 && Op != kProd;

    // Four bytes or two halves of a word at once; sums wrap like combine's.
    template <int Op>
    __device__ __forceinline__ static unsigned int combine_word(unsigned int a, unsigned int b) {
        if (sizeof(S) == 1) {
            if (Op == kSum) return __vadd4(a, b);
            if (Op == kMax) return kSigned ? __vmaxs4(a, b) : __vmaxu4(a, b);
            return kSigned ? __vmins4(a, b) : __vminu4(a, b);
        }
        if (Op == kSum) return __vadd2(a, b);
        if (Op == kMax) return kSigned ? __vmaxs2(a, b) : __vmaxu2(a, b);
        return kSigned ? __vmins2(a, b) : __vminu2(a, b);
    }

    template <int Op>
    __device__ __forceinline__ static S combine(S a, S b) {
        if (Op == kSum) return static_cast<S>(static_cast<Wide>(static_cast<Unsigned>(a)) +
                                              static_cast<Wide>(static_cast<Unsigned>(b)));
        if (Op == kProd) return static_cast<S>(static_cast<Wide>(static_cast<Unsigned>(a)) *
                                               static_cast<Wide>(static_cast<Unsigned>(b)));
        if (Op == kMax) return a > b ? a : b;
        return a < b ? a : b;
    }

    // avg's division: C's integer division truncates toward zero.
    __device__ __forceinline__ static S divide(S a, int divisor) {
        return static_cast<S>(static_cast<Quotient>(a) / static_cast<Quotient>(divisor));
    }
};

// The quotient type is the narrowest that holds every value and divisor:
// 64-bit division is a subroutine call on the GPU, with a stack frame.
using Int8 = Integer<signed char, unsigned char, int>;
using Int16 = Integer<short, unsigned short, int>;
using Int32 = Integer<int, unsigned int, int>;
using Int64 = Integer<long long, unsigned long long, long long>;
using Uint8 = Integer<unsigned char, unsigned char, unsigned int>;
using Uint16 = Integer<unsigned short, unsigned short, unsigned int>;
using Uint32 = Integer<unsigned int, unsigned int, unsigned int>;
using Uint64 = Integer<unsigned long long, unsigned long long, unsigned long long>;

// float and double: one correctly rounded operation per fold step.
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double div_rn(double a, double b) { return __ddiv_rn(a, b); }

template <typename T>
struct IeeeFloat : ElementByElement, FoldsInStorage<T> {
    using Storage = T;

    template <int Op>
    __device__ __forceinline__ static T combine(T a, T b) {
        if (Op == kSum) return add_rn(a, b);
        if (Op == kProd) return mul_rn(a, b);
        const unsigned long long x = Bits<T>::to(a), y = Bits<T>::to(b);
        return Bits<T>::from(Op == kMax ? ieee_max(x, y, a, b) : ieee_min(x, y, a, b));
    }

    __device__ __forceinline__ static T divide(T a, int divisor) { return div_rn(a, static_cast<T>(divisor)); }
};

using Float32 = IeeeFloat<float>;
using Float64 = IeeeFloat<double>;

// A 16-bit float stored as its bits, folded in float32 (see the top of this
// file): Codec converts to float32 (exact) and back (to nearest even), once
// per source and once per result. Folding in float32 also keeps max and min
// exact, and the IEEE rule of Float32's applies.
template <typename Codec>
struct Float16Like : ElementByElement {
    using Storage = unsigned short;
    using Accumulator = float;

    __device__ __forceinline__ static float load(unsigned short bits) { return Codec::to_float(bits); }
    __device__ __forceinline__ static unsigned short store(float x) { return Codec::from_float(x); }

    template <int Op>
    __device__ __forceinline__ static float combine(float a, float b) { return Float32::combine<Op>(a, b); }

    __device__ __forceinline__ static float divide(float a, int divisor) { return Float32::divide(a, divisor); }
};

struct HalfCodec {
    __device__ __forceinline__ static float to_float(unsigned short bits) { return __half2float(__ushort_as_half(bits)); }
    __device__ __forceinline__ static unsigned short from_float(float x) { return __half_as_ushort(__float2half_rn(x)); }
};

// bfloat16 is the top half of a float32, so both conversions are integer
// operations, written out here because the hardware's are not exact:
// on sm_90, __bfloat162float (cvt.f32.bf16) flushes subnormals to zero,
// which an H100 showed against NumPy (bench/results/gpu_check_cuda.json).
struct BFloat16Codec {
    __device__ __forceinline__ static float to_float(unsigned short bits) {
        return float_from_bits(static_cast<unsigned int>(bits) << 16);
    }
    // Round to nearest, ties to even: add just under half a unit of the kept
    // part, plus one if the kept part is odd; the carry does the rest (also
    // into the exponent, and up to infinity). NaNs stay NaNs (quiet).
    __device__ __forceinline__ static unsigned short from_float(float x) {
        const unsigned int bits = float_bits(x);
        if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>((bits >> 16) | 0x40u);
        return static_cast<unsigned short>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    }
};

using Float16 = Float16Like<HalfCodec>;
using BFloat16 = Float16Like<BFloat16Codec>;

}  // namespace collectives

// Every element type and op, for explicit instantiation (the nvcc build and
// the CPU emulation). collectives/kernels.py holds the same list.
#define COLLECTIVES_FOR_EACH_ELEMENT(X) \
    X(Int8) X(Int16) X(Int32) X(Int64) X(Uint8) X(Uint16) X(Uint32) X(Uint64) \
    X(Float16) X(BFloat16) X(Float32) X(Float64)
