// The CUDA qualifiers and float intrinsics as plain C++, for code in kernels/
// compiled for the CPU: the emulated device (through cuda_host.h) and the
// compression codecs' CPU loops (collectives/compression/_codec.cpp). Needs
// no CUDA header, so the codecs' host extension builds without a toolkit.
// Compile with -ffp-contract=off, so that nothing fuses these operations
// into an FMA: then they round exactly as the GPU's __fadd_rn and friends.

#pragma once

#include <cstring>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__

inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }

inline unsigned int __float_as_uint(float x) { unsigned int b; std::memcpy(&b, &x, sizeof b); return b; }
inline float __uint_as_float(unsigned int b) { float x; std::memcpy(&x, &b, sizeof x); return x; }
inline long long __double_as_longlong(double x) { long long b; std::memcpy(&b, &x, sizeof b); return b; }
inline double __longlong_as_double(long long b) { double x; std::memcpy(&x, &b, sizeof x); return x; }
