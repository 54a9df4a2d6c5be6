// cuda_cpu: CUDA's device math functions and intrinsics, on the host's libm.
// expf, logf, sqrtf, tanhf, powf, exp2f, fmaxf, ... are the C library's own (glibc: correctly
// rounded in nearly all cases; CUDA's are within 1-2 ulp). The fast intrinsics (__expf,
// __logf, __fdividef, rsqrtf) are computed accurately here, where the GPU approximates them
// (README.md, "Not emulated faithfully").
#pragma once

#include <math.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

// ---- bit casts -------------------------------------------------------------------------
inline constexpr float __int_as_float(int x) { return __builtin_bit_cast(float, x); }
inline constexpr int __float_as_int(float x) { return __builtin_bit_cast(int, x); }
inline constexpr float __uint_as_float(unsigned int x) { return __builtin_bit_cast(float, x); }
inline constexpr unsigned int __float_as_uint(float x) { return __builtin_bit_cast(unsigned int, x); }
inline constexpr double __longlong_as_double(long long x) { return __builtin_bit_cast(double, x); }
inline constexpr long long __double_as_longlong(double x) { return __builtin_bit_cast(long long, x); }

// ---- fast-math intrinsics, computed accurately ---------------------------------------------
inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return exp10f(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __log10f(float x) { return log10f(x); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline void __sincosf(float x, float* s, float* c) { sincosf(x, s, c); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __fadd_rn(float x, float y) { return x + y; }
inline float __fsub_rn(float x, float y) { return x - y; }
inline float __fmul_rn(float x, float y) { return x * y; }
inline float __fdiv_rn(float x, float y) { return x / y; }
inline float __fmaf_rn(float x, float y, float z) { return fmaf(x, y, z); }
inline float __saturatef(float x) { return x != x ? 0.0f : (x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x)); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float rcbrtf(float x) { return 1.0f / cbrtf(x); }
// sin(pi x) and cos(pi x): x reduced to [-1, 1] exactly (x - 2 round(x / 2) is exact for any
// float), then pi r in double: no error from rounding pi x to float first, as on a GPU, whose
// sinpif family reduces exactly too (within 1 ulp of the true value; not bit for bit).
namespace cgcpu::detail {
inline double half_turns(float x) { return static_cast<double>(x) - 2.0 * ::nearbyint(0.5 * static_cast<double>(x)); }
}  // namespace cgcpu::detail
inline float sinpif(float x) { return static_cast<float>(::sin(M_PI * cgcpu::detail::half_turns(x))); }
inline float cospif(float x) { return static_cast<float>(::cos(M_PI * cgcpu::detail::half_turns(x))); }
inline void sincospif(float x, float* s, float* c) {
  *s = sinpif(x);
  *c = cospif(x);
}
inline float normcdff(float x) { return 0.5f * erfcf(-x * static_cast<float>(M_SQRT1_2)); }

// ---- min / max, as CUDA's overload set (global namespace) -----------------------------------
inline int min(int a, int b) { return a < b ? a : b; }
inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline unsigned int min(int a, unsigned int b) { return min(static_cast<unsigned int>(a), b); }
inline unsigned int min(unsigned int a, int b) { return min(a, static_cast<unsigned int>(b)); }
inline long min(long a, long b) { return a < b ? a : b; }
inline unsigned long min(unsigned long a, unsigned long b) { return a < b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double min(float a, double b) { return fmin(a, b); }
inline double min(double a, float b) { return fmin(a, b); }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
inline unsigned int max(int a, unsigned int b) { return max(static_cast<unsigned int>(a), b); }
inline unsigned int max(unsigned int a, int b) { return max(a, static_cast<unsigned int>(b)); }
inline long max(long a, long b) { return a > b ? a : b; }
inline unsigned long max(unsigned long a, unsigned long b) { return a > b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
inline double max(float a, double b) { return fmax(a, b); }
inline double max(double a, float b) { return fmax(a, b); }
inline unsigned int umin(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline unsigned int umax(unsigned int a, unsigned int b) { return a > b ? a : b; }
inline long long llmin(long long a, long long b) { return a < b ? a : b; }
inline long long llmax(long long a, long long b) { return a > b ? a : b; }

// ---- integer intrinsics --------------------------------------------------------------------
inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned int>(x)); }
inline int __clzll(long long x) {
  return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x));
}
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned int __brev(unsigned int x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0F0F0F0Fu) | ((x & 0x0F0F0F0Fu) << 4);
  return __builtin_bswap32(x);
}
inline int __mul24(int a, int b) {
  return static_cast<int>((static_cast<long long>(a) << 40 >> 40) * (static_cast<long long>(b) << 40 >> 40));
}
inline int __mulhi(int a, int b) { return static_cast<int>((static_cast<long long>(a) * b) >> 32); }
inline unsigned int __umulhi(unsigned int a, unsigned int b) {
  return static_cast<unsigned int>((static_cast<unsigned long long>(a) * b) >> 32);
}

// ---- memory access hints -----------------------------------------------------------------
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline T __ldlu(const T* p) { return *p; }
template <class T> inline T __ldcv(const T* p) { return *p; }
template <class T> inline void __stcg(T* p, T v) { *p = v; }
template <class T> inline void __stcs(T* p, T v) { *p = v; }
template <class T> inline void __stwb(T* p, T v) { *p = v; }
template <class T> inline void __stwt(T* p, T v) { *p = v; }

// ---- fences and atomics --------------------------------------------------------------------
// Blocks run in parallel on several OS threads, so atomics are real atomics (sequentially
// consistent); within a block, fibers never run at the same time.
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

namespace cgcpu {
namespace detail {
template <class T, class F>
inline T atomic_update(T* address, F f) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "32- or 64-bit atomics");
  using Bits = typename std::conditional<sizeof(T) == 4, std::uint32_t, std::uint64_t>::type;
  Bits* where = reinterpret_cast<Bits*>(address);
  Bits old_bits = __atomic_load_n(where, __ATOMIC_SEQ_CST);
  for (;;) {
    T old_value;
    std::memcpy(&old_value, &old_bits, sizeof old_value);
    const T new_value = f(old_value);
    Bits new_bits;
    std::memcpy(&new_bits, &new_value, sizeof new_bits);
    if (__atomic_compare_exchange_n(where, &old_bits, new_bits, false, __ATOMIC_SEQ_CST,
                                    __ATOMIC_SEQ_CST))
      return old_value;
  }
}
}  // namespace detail
}  // namespace cgcpu

inline int atomicAdd(int* a, int v) { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); }
inline unsigned int atomicAdd(unsigned int* a, unsigned int v) {
  return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST);
}
inline unsigned long long atomicAdd(unsigned long long* a, unsigned long long v) {
  return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST);
}
inline float atomicAdd(float* a, float v) {
  return cgcpu::detail::atomic_update(a, [v](float old) { return old + v; });
}
inline double atomicAdd(double* a, double v) {
  return cgcpu::detail::atomic_update(a, [v](double old) { return old + v; });
}
inline int atomicSub(int* a, int v) { return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST); }
inline unsigned int atomicSub(unsigned int* a, unsigned int v) {
  return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST);
}
inline int atomicExch(int* a, int v) { return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST); }
inline unsigned int atomicExch(unsigned int* a, unsigned int v) {
  return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST);
}
inline unsigned long long atomicExch(unsigned long long* a, unsigned long long v) {
  return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST);
}
inline float atomicExch(float* a, float v) {
  return cgcpu::detail::atomic_update(a, [v](float) { return v; });
}
inline int atomicMax(int* a, int v) {
  return cgcpu::detail::atomic_update(a, [v](int old) { return old > v ? old : v; });
}
inline unsigned int atomicMax(unsigned int* a, unsigned int v) {
  return cgcpu::detail::atomic_update(a, [v](unsigned int old) { return old > v ? old : v; });
}
inline int atomicMin(int* a, int v) {
  return cgcpu::detail::atomic_update(a, [v](int old) { return old < v ? old : v; });
}
inline unsigned int atomicMin(unsigned int* a, unsigned int v) {
  return cgcpu::detail::atomic_update(a, [v](unsigned int old) { return old < v ? old : v; });
}
inline int atomicAnd(int* a, int v) { return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST); }
inline unsigned int atomicAnd(unsigned int* a, unsigned int v) {
  return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST);
}
inline int atomicOr(int* a, int v) { return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST); }
inline unsigned int atomicOr(unsigned int* a, unsigned int v) {
  return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST);
}
inline int atomicXor(int* a, int v) { return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST); }
inline unsigned int atomicXor(unsigned int* a, unsigned int v) {
  return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST);
}
inline int atomicCAS(int* a, int compare, int v) {
  __atomic_compare_exchange_n(a, &compare, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return compare;
}
inline unsigned int atomicCAS(unsigned int* a, unsigned int compare, unsigned int v) {
  __atomic_compare_exchange_n(a, &compare, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return compare;
}
inline unsigned long long atomicCAS(unsigned long long* a, unsigned long long compare,
                                    unsigned long long v) {
  __atomic_compare_exchange_n(a, &compare, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return compare;
}
inline unsigned int atomicInc(unsigned int* a, unsigned int limit) {
  return cgcpu::detail::atomic_update(a, [limit](unsigned int old) { return old >= limit ? 0u : old + 1u; });
}
inline unsigned int atomicDec(unsigned int* a, unsigned int limit) {
  return cgcpu::detail::atomic_update(
      a, [limit](unsigned int old) { return (old == 0u || old > limit) ? limit : old - 1u; });
}
