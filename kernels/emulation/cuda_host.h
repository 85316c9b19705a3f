// Stand-ins for the CUDA built-ins, so that kernels/*.cu compile as plain C++
// for the CPU emulation (collectives/devices/emulated.py). Force-included
// (g++ -include) before the kernel source; __CUDACC__ stays undefined, so the
// CUDA headers take their host paths (cuda_fp16.h converts in software with
// round to nearest even, as the GPU does).
//
// A launch runs every (block, thread) of the grid one after another; that is
// exact because kernels here are thread-independent (see plan_step.cu).

#pragma once

#include <cstring>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)

#include <vector_types.h>

// Grid and thread indices of the (block, thread) being run; set by launch.cpp.
extern thread_local uint3 threadIdx;
extern thread_local uint3 blockIdx;
extern thread_local dim3 blockDim;
extern thread_local dim3 gridDim;

// Correctly rounded float and double operations, as the GPU's __fadd_rn and
// friends. Compile with -ffp-contract=off so that nothing fuses them.
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
