// Stand-ins for the CUDA built-ins, so that kernels/*.cu compile as plain C++
// for the CPU emulation (collectives/devices/emulated.py). Force-included
// (g++ -include) before the kernel source; __CUDACC__ stays undefined, so the
// CUDA headers take their host paths (cuda_fp16.h converts in software with
// round to nearest even, as the GPU does).
//
// A launch of a thread-independent kernel (plan_step, batched_copy) runs
// every (block, thread) of the grid one after another; a kernel whose
// threads exchange values (the codecs' __shfl_xor_sync) runs the threads of
// each CUDA block as fibers that meet at every shuffle (launch.cpp).

#pragma once

#include "host_math.h"  // the qualifiers and float intrinsics

#include <vector_types.h>

// Grid and thread indices of the (block, thread) being run; set by launch.cpp.
extern thread_local uint3 threadIdx;
extern thread_local uint3 blockIdx;
extern thread_local dim3 blockDim;
extern thread_local dim3 gridDim;

// plan_step's table of addresses, by reference: the walk calls the kernel
// once per thread, and a 2 KiB copy each time cost more than the kernel's
// work at small counts. The kernel only reads it, so nothing else changes.
#define COLLECTIVES_BUFFER_TABLE_PARAMETER const BufferTable&

// Warp shuffles, for kernels launched with launch.cpp's cooperative walk:
// every thread of the warp deposits its value, all meet, each reads its
// partner's (launch.cpp: shuffle_exchange).
unsigned long long shuffle_exchange(unsigned long long value, int source_lane);

template <typename T>
inline T __shfl_xor_sync(unsigned int /*mask: the walk runs whole warps*/, T var, int lane_mask, int width = 32) {
    static_assert(sizeof(T) <= sizeof(unsigned long long), "shuffle of a value wider than 64 bits");
    unsigned long long bits = 0;
    std::memcpy(&bits, &var, sizeof var);
    const int lane = static_cast<int>(threadIdx.x & 31u);
    const int partner = (lane ^ lane_mask) & 31;   // outside the lane's segment of `width` lanes: its own value
    const int source = (partner & -width) == (lane & -width) ? partner : lane;
    bits = shuffle_exchange(bits, source);
    T out;
    std::memcpy(&out, &bits, sizeof out);
    return out;
}

// SIMD on the bytes (4) or halves (2) of a 32-bit word; sums wrap.
template <int Lanes, typename Lane, typename Combine>
inline unsigned int simd_word(unsigned int a, unsigned int b, Combine combine) {
    constexpr int kBits = 32 / Lanes;
    constexpr unsigned int kMask = (1u << kBits) - 1;
    unsigned int out = 0;
    for (int i = 0; i < Lanes; ++i) {
        const Lane x = static_cast<Lane>((a >> (kBits * i)) & kMask);
        const Lane y = static_cast<Lane>((b >> (kBits * i)) & kMask);
        out |= (static_cast<unsigned int>(static_cast<Lane>(combine(x, y))) & kMask) << (kBits * i);
    }
    return out;
}

template <typename T> inline T simd_max(T x, T y) { return x > y ? x : y; }
template <typename T> inline T simd_min(T x, T y) { return x < y ? x : y; }
template <typename T> inline T simd_add(T x, T y) { return static_cast<T>(x + y); }

inline unsigned int __vadd4(unsigned int a, unsigned int b) { return simd_word<4, unsigned char>(a, b, simd_add<unsigned char>); }
inline unsigned int __vmaxs4(unsigned int a, unsigned int b) { return simd_word<4, signed char>(a, b, simd_max<signed char>); }
inline unsigned int __vmaxu4(unsigned int a, unsigned int b) { return simd_word<4, unsigned char>(a, b, simd_max<unsigned char>); }
inline unsigned int __vmins4(unsigned int a, unsigned int b) { return simd_word<4, signed char>(a, b, simd_min<signed char>); }
inline unsigned int __vminu4(unsigned int a, unsigned int b) { return simd_word<4, unsigned char>(a, b, simd_min<unsigned char>); }
inline unsigned int __vadd2(unsigned int a, unsigned int b) { return simd_word<2, unsigned short>(a, b, simd_add<unsigned short>); }
inline unsigned int __vmaxs2(unsigned int a, unsigned int b) { return simd_word<2, short>(a, b, simd_max<short>); }
inline unsigned int __vmaxu2(unsigned int a, unsigned int b) { return simd_word<2, unsigned short>(a, b, simd_max<unsigned short>); }
inline unsigned int __vmins2(unsigned int a, unsigned int b) { return simd_word<2, short>(a, b, simd_min<short>); }
inline unsigned int __vminu2(unsigned int a, unsigned int b) { return simd_word<2, unsigned short>(a, b, simd_min<unsigned short>); }

// ---- System-scope memory and the clock, for kernels that wait on peers ----
// (kernels/ll_allreduce.cu defines the GPU versions of these functions in
// PTX.) The emulated ranks are processes sharing the mapping, so each access
// is a GCC __atomic builtin: a line's two 64-bit words each single-copy
// atomic as on the GPU, release stores and acquire loads (plain moves on
// x86-64, and the order the protocol's argument needs on any CPU). A wait
// yields the core: the emulated ranks may outnumber the cores.

#include <sched.h>
#include <time.h>

#include <chrono>

inline void sys_store_line(unsigned long long* line, unsigned long long w0, unsigned long long w1) {
    __atomic_store_n(line, w0, __ATOMIC_RELEASE);
    __atomic_store_n(line + 1, w1, __ATOMIC_RELEASE);
}
inline void sys_load_line(const unsigned long long* line, unsigned long long& w0, unsigned long long& w1) {
    w0 = __atomic_load_n(line, __ATOMIC_ACQUIRE);
    w1 = __atomic_load_n(line + 1, __ATOMIC_ACQUIRE);
}
inline unsigned long long sys_load_acquire(const unsigned long long* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline unsigned long long sys_load_relaxed(const unsigned long long* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
inline void sys_store_relaxed(unsigned long long* p, unsigned long long v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
inline void sys_store_release(unsigned long long* p, unsigned long long v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline unsigned long long clock_ns() {
    return static_cast<unsigned long long>(std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now().time_since_epoch()).count());
}
// A GPU thread's __nanosleep suspends it for about `ns`; here the OS thread
// sleeps as long (Linux rounds it up to its timer slack, tens of µs), so a
// rank that waits out a stalled peer's timeout leaves the cores to the
// others instead of yielding in a loop. The kernels sleep only after their
// tight polls (kLLSpinPolls), so a wait that ends soon never gets here.
inline void __nanosleep(unsigned ns) {
    const timespec pause{0, static_cast<long>(ns)};
    nanosleep(&pause, nullptr);
}
