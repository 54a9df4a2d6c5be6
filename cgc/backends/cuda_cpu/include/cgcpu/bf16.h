// cuda_cpu: __nv_bfloat16 and __nv_bfloat162 with CUDA's conversion semantics.
//
// float -> bfloat16 rounds to nearest, ties to even, exactly as the project's NumPy reference
// (cgc/backends/numerics.py, to_bfloat16_bits): bits + 0x7FFF + ((bits >> 16) & 1), >> 16;
// infinities stay infinite, a finite value past the largest bfloat16 rounds to infinity,
// subnormals round like any other value (no flush to zero). NaN becomes 0x7FC0 (positive quiet
// NaN), the reference's choice; CUDA itself gives its canonical NaN 0x7FFF (cvt.rn.bf16.f32 on
// the GPU, and cuda_bf16.hpp's host path). The two are both quiet NaNs that compare and
// compute alike; only their bits differ (README.md, "Not emulated faithfully").
// bfloat16 -> float is exact (the 16 bits shifted up).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "vector_types.h"

namespace cgcpu {

inline unsigned short float_to_bfloat16_bits(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;  // NaN
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<unsigned short>(bits >> 16);
}

// float -> bfloat16, rounding toward zero (CUDA's __float2bfloat16_rz); NaN as above.
inline unsigned short float_to_bfloat16_bits_rz(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
  return static_cast<unsigned short>(bits >> 16);
}

inline float bfloat16_bits_to_float(unsigned short bits) {
  const std::uint32_t wide = static_cast<std::uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}

// double -> bfloat16 rounded once, to nearest even: double -> float rounding to odd (inexact
// results get their last bit set), then float -> bfloat16 to nearest even. Rounding to odd
// through a format at least 2 bits wider than the target is exact-once rounding.
inline unsigned short double_to_bfloat16_bits(double value) {
  if (value != value) return 0x7FC0u;
  float narrow = static_cast<float>(value);
  if (static_cast<double>(narrow) != value) {
    std::uint32_t bits;
    std::memcpy(&bits, &narrow, sizeof bits);
    const double magnitude = value < 0 ? -value : value;
    const double rounded = narrow < 0 ? -static_cast<double>(narrow) : static_cast<double>(narrow);
    if (rounded > magnitude) bits -= 1;  // rounded away from zero: step back toward zero
    bits |= 1u;
    std::memcpy(&narrow, &bits, sizeof bits);
  }
  return float_to_bfloat16_bits(narrow);
}

}  // namespace cgcpu

struct __nv_bfloat16_raw {
  unsigned short x;
};

struct __nv_bfloat162_raw {
  unsigned short x, y;
};

// may_alias: kernels read and write rows of bfloat16 through uint4 / uint2 and back.
struct __attribute__((aligned(2), may_alias)) __nv_bfloat16 {
  unsigned short __x;

  __nv_bfloat16() = default;
  constexpr __nv_bfloat16(const __nv_bfloat16_raw& raw) : __x(raw.x) {}
  __nv_bfloat16(float value) : __x(cgcpu::float_to_bfloat16_bits(value)) {}
  __nv_bfloat16(double value) : __x(cgcpu::double_to_bfloat16_bits(value)) {}
  // Integers convert to nearest even as CUDA's __int2bfloat16_rn does (through float: float
  // keeps more than 2 * 8 + 2 bits, so the double rounding is harmless).
  template <class I, typename std::enable_if<std::is_integral<I>::value, int>::type = 0>
  __nv_bfloat16(I value) : __x(cgcpu::float_to_bfloat16_bits(static_cast<float>(value))) {}

  __nv_bfloat16& operator=(const __nv_bfloat16_raw& raw) {
    __x = raw.x;
    return *this;
  }
  __nv_bfloat16& operator=(float value) {
    __x = cgcpu::float_to_bfloat16_bits(value);
    return *this;
  }
  __nv_bfloat16& operator=(double value) {
    __x = cgcpu::double_to_bfloat16_bits(value);
    return *this;
  }
  operator __nv_bfloat16_raw() const { return __nv_bfloat16_raw{__x}; }
  operator float() const { return cgcpu::bfloat16_bits_to_float(__x); }
};

struct __attribute__((aligned(4), may_alias)) __nv_bfloat162 {
  __nv_bfloat16 x, y;

  __nv_bfloat162() = default;
  constexpr __nv_bfloat162(const __nv_bfloat16& a, const __nv_bfloat16& b) : x(a), y(b) {}
  __nv_bfloat162(const __nv_bfloat162_raw& raw) {
    x.__x = raw.x;
    y.__x = raw.y;
  }
  __nv_bfloat162& operator=(const __nv_bfloat162_raw& raw) {
    x.__x = raw.x;
    y.__x = raw.y;
    return *this;
  }
  operator __nv_bfloat162_raw() const { return __nv_bfloat162_raw{x.__x, y.__x}; }
};

static_assert(sizeof(__nv_bfloat16) == 2 && alignof(__nv_bfloat16) == 2, "bfloat16 is 2 bytes");
static_assert(sizeof(__nv_bfloat162) == 4 && alignof(__nv_bfloat162) == 4, "bfloat162 is 4 bytes");
static_assert(std::is_trivially_copyable<__nv_bfloat16>::value, "bfloat16 is trivially copyable");
static_assert(std::is_trivially_default_constructible<__nv_bfloat16>::value,
              "bfloat16 may live in __shared__ arrays");

typedef __nv_bfloat16 nv_bfloat16;
typedef __nv_bfloat162 nv_bfloat162;

// ---- conversions -----------------------------------------------------------------------
inline __nv_bfloat16 cgcpu_bf16_from_bits(unsigned short bits) {
  return __nv_bfloat16(__nv_bfloat16_raw{bits});
}
inline __nv_bfloat16 __float2bfloat16_rn(float a) {
  return cgcpu_bf16_from_bits(cgcpu::float_to_bfloat16_bits(a));
}
inline __nv_bfloat16 __float2bfloat16(float a) { return __float2bfloat16_rn(a); }
inline __nv_bfloat16 __float2bfloat16_rz(float a) {
  return cgcpu_bf16_from_bits(cgcpu::float_to_bfloat16_bits_rz(a));
}
inline __nv_bfloat16 __double2bfloat16(double a) {
  return cgcpu_bf16_from_bits(cgcpu::double_to_bfloat16_bits(a));
}
inline float __bfloat162float(__nv_bfloat16 a) { return cgcpu::bfloat16_bits_to_float(a.__x); }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return __nv_bfloat162(__float2bfloat16_rn(a), __float2bfloat16_rn(b));
}
inline __nv_bfloat162 __float2bfloat162_rn(float a) {
  return __nv_bfloat162(__float2bfloat16_rn(a), __float2bfloat16_rn(a));
}
inline __nv_bfloat162 __float22bfloat162_rn(float2 a) { return __floats2bfloat162_rn(a.x, a.y); }
inline float2 __bfloat1622float2(__nv_bfloat162 a) {
  return make_float2(__bfloat162float(a.x), __bfloat162float(a.y));
}
inline float __low2float(__nv_bfloat162 a) { return __bfloat162float(a.x); }
inline float __high2float(__nv_bfloat162 a) { return __bfloat162float(a.y); }
inline __nv_bfloat16 __low2bfloat16(__nv_bfloat162 a) { return a.x; }
inline __nv_bfloat16 __high2bfloat16(__nv_bfloat162 a) { return a.y; }
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) {
  return __nv_bfloat162(a, b);
}
inline __nv_bfloat162 __bfloat162bfloat162(__nv_bfloat16 a) { return __nv_bfloat162(a, a); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 a) { return a.__x; }
inline short __bfloat16_as_short(__nv_bfloat16 a) { return static_cast<short>(a.__x); }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short bits) { return cgcpu_bf16_from_bits(bits); }
inline __nv_bfloat16 __short_as_bfloat16(short bits) {
  return cgcpu_bf16_from_bits(static_cast<unsigned short>(bits));
}

// ---- arithmetic (CUDA's operators return bfloat16) ---------------------------------------
// Each is computed in float and rounded once to bfloat16: exact products of bfloat16 fit in
// float, and float carries more than 2 * 8 + 2 bits, so +, -, *, / rounded through float
// equal the singly rounded results CUDA's bfloat16 instructions give.
inline __nv_bfloat16 __hadd(__nv_bfloat16 a, __nv_bfloat16 b) {
  return __float2bfloat16_rn(__bfloat162float(a) + __bfloat162float(b));
}
inline __nv_bfloat16 __hsub(__nv_bfloat16 a, __nv_bfloat16 b) {
  return __float2bfloat16_rn(__bfloat162float(a) - __bfloat162float(b));
}
inline __nv_bfloat16 __hmul(__nv_bfloat16 a, __nv_bfloat16 b) {
  return __float2bfloat16_rn(__bfloat162float(a) * __bfloat162float(b));
}
inline __nv_bfloat16 __hdiv(__nv_bfloat16 a, __nv_bfloat16 b) {
  return __float2bfloat16_rn(__bfloat162float(a) / __bfloat162float(b));
}
inline __nv_bfloat16 __hneg(__nv_bfloat16 a) {
  return cgcpu_bf16_from_bits(static_cast<unsigned short>(a.__x ^ 0x8000u));
}
inline __nv_bfloat16 __habs(__nv_bfloat16 a) {
  return cgcpu_bf16_from_bits(static_cast<unsigned short>(a.__x & 0x7FFFu));
}
// fma: the exact product plus c, rounded once (double holds the product and the sum of a
// bfloat16 product and a bfloat16 exactly enough: 2 * 8 + 2 bits < 53).
inline __nv_bfloat16 __hfma(__nv_bfloat16 a, __nv_bfloat16 b, __nv_bfloat16 c) {
  return __double2bfloat16(static_cast<double>(__bfloat162float(a)) * __bfloat162float(b) +
                           __bfloat162float(c));
}
inline __nv_bfloat162 __hadd2(__nv_bfloat162 a, __nv_bfloat162 b) {
  return __nv_bfloat162(__hadd(a.x, b.x), __hadd(a.y, b.y));
}
inline __nv_bfloat162 __hmul2(__nv_bfloat162 a, __nv_bfloat162 b) {
  return __nv_bfloat162(__hmul(a.x, b.x), __hmul(a.y, b.y));
}
inline __nv_bfloat162 __hsub2(__nv_bfloat162 a, __nv_bfloat162 b) {
  return __nv_bfloat162(__hsub(a.x, b.x), __hsub(a.y, b.y));
}
inline __nv_bfloat162 __hfma2(__nv_bfloat162 a, __nv_bfloat162 b, __nv_bfloat162 c) {
  return __nv_bfloat162(__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y));
}
inline bool __hisnan(__nv_bfloat16 a) { return (a.__x & 0x7FFFu) > 0x7F80u; }
inline int __hisinf(__nv_bfloat16 a) {
  return a.__x == 0x7F80u ? 1 : (a.__x == 0xFF80u ? -1 : 0);
}

inline __nv_bfloat16 operator+(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hadd(a, b); }
inline __nv_bfloat16 operator-(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hsub(a, b); }
inline __nv_bfloat16 operator*(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hmul(a, b); }
inline __nv_bfloat16 operator/(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hdiv(a, b); }
inline __nv_bfloat16 operator-(const __nv_bfloat16& a) { return __hneg(a); }
inline __nv_bfloat16 operator+(const __nv_bfloat16& a) { return a; }
inline __nv_bfloat16& operator+=(__nv_bfloat16& a, const __nv_bfloat16& b) { return a = __hadd(a, b); }
inline __nv_bfloat16& operator-=(__nv_bfloat16& a, const __nv_bfloat16& b) { return a = __hsub(a, b); }
inline __nv_bfloat16& operator*=(__nv_bfloat16& a, const __nv_bfloat16& b) { return a = __hmul(a, b); }
inline __nv_bfloat16& operator/=(__nv_bfloat16& a, const __nv_bfloat16& b) { return a = __hdiv(a, b); }
inline __nv_bfloat162 operator+(const __nv_bfloat162& a, const __nv_bfloat162& b) { return __hadd2(a, b); }
inline __nv_bfloat162 operator-(const __nv_bfloat162& a, const __nv_bfloat162& b) { return __hsub2(a, b); }
inline __nv_bfloat162 operator*(const __nv_bfloat162& a, const __nv_bfloat162& b) { return __hmul2(a, b); }
// Comparisons go through the implicit conversion to float (CUDA's results: NaN unordered).
