// cuda_cpu: CUDA's built-in vector types (float4, uint4, ...), dim3 and make_*.
// Alignments are CUDA's (float4, int4, uint4, double2: 16 bytes; float2, int2, uint2: 8).
// Every vector type is declared may_alias: CUDA code routinely reinterprets memory of one
// type as another (a row of bfloat16 read as uint4, floats written as float4), which is
// fine for nvcc but undefined behaviour to g++'s type-based alias analysis; may_alias makes
// such accesses as safe as char accesses, so -O2 cannot reorder them.
#pragma once

#define CGCPU_VEC1(name, T, A) \
  struct __attribute__((aligned(A), may_alias)) name { T x; };                                 \
  static inline constexpr name make_##name(T x) { return name{x}; }
#define CGCPU_VEC2(name, T, A) \
  struct __attribute__((aligned(A), may_alias)) name { T x, y; };                              \
  static inline constexpr name make_##name(T x, T y) { return name{x, y}; }
#define CGCPU_VEC3(name, T, A) \
  struct __attribute__((aligned(A), may_alias)) name { T x, y, z; };                           \
  static inline constexpr name make_##name(T x, T y, T z) { return name{x, y, z}; }
#define CGCPU_VEC4(name, T, A) \
  struct __attribute__((aligned(A), may_alias)) name { T x, y, z, w; };                        \
  static inline constexpr name make_##name(T x, T y, T z, T w) { return name{x, y, z, w}; }

CGCPU_VEC1(char1, signed char, 1)
CGCPU_VEC2(char2, signed char, 2)
CGCPU_VEC3(char3, signed char, 1)
CGCPU_VEC4(char4, signed char, 4)
CGCPU_VEC1(uchar1, unsigned char, 1)
CGCPU_VEC2(uchar2, unsigned char, 2)
CGCPU_VEC3(uchar3, unsigned char, 1)
CGCPU_VEC4(uchar4, unsigned char, 4)
CGCPU_VEC1(short1, short, 2)
CGCPU_VEC2(short2, short, 4)
CGCPU_VEC3(short3, short, 2)
CGCPU_VEC4(short4, short, 8)
CGCPU_VEC1(ushort1, unsigned short, 2)
CGCPU_VEC2(ushort2, unsigned short, 4)
CGCPU_VEC3(ushort3, unsigned short, 2)
CGCPU_VEC4(ushort4, unsigned short, 8)
CGCPU_VEC1(int1, int, 4)
CGCPU_VEC2(int2, int, 8)
CGCPU_VEC3(int3, int, 4)
CGCPU_VEC4(int4, int, 16)
CGCPU_VEC1(uint1, unsigned int, 4)
CGCPU_VEC2(uint2, unsigned int, 8)
CGCPU_VEC3(uint3, unsigned int, 4)
CGCPU_VEC4(uint4, unsigned int, 16)
CGCPU_VEC1(long1, long, 8)
CGCPU_VEC2(long2, long, 16)
CGCPU_VEC3(long3, long, 8)
CGCPU_VEC4(long4, long, 16)
CGCPU_VEC1(ulong1, unsigned long, 8)
CGCPU_VEC2(ulong2, unsigned long, 16)
CGCPU_VEC3(ulong3, unsigned long, 8)
CGCPU_VEC4(ulong4, unsigned long, 16)
CGCPU_VEC1(longlong1, long long, 8)
CGCPU_VEC2(longlong2, long long, 16)
CGCPU_VEC3(longlong3, long long, 8)
CGCPU_VEC4(longlong4, long long, 16)
CGCPU_VEC1(ulonglong1, unsigned long long, 8)
CGCPU_VEC2(ulonglong2, unsigned long long, 16)
CGCPU_VEC3(ulonglong3, unsigned long long, 8)
CGCPU_VEC4(ulonglong4, unsigned long long, 16)
CGCPU_VEC1(float1, float, 4)
CGCPU_VEC2(float2, float, 8)
CGCPU_VEC3(float3, float, 4)
CGCPU_VEC4(float4, float, 16)
CGCPU_VEC1(double1, double, 8)
CGCPU_VEC2(double2, double, 16)
CGCPU_VEC3(double3, double, 8)
CGCPU_VEC4(double4, double, 16)

#undef CGCPU_VEC1
#undef CGCPU_VEC2
#undef CGCPU_VEC3
#undef CGCPU_VEC4

static_assert(sizeof(float4) == 16 && alignof(float4) == 16, "float4 is 16 bytes, 16-aligned");
static_assert(sizeof(uint4) == 16 && alignof(uint4) == 16, "uint4 is 16 bytes, 16-aligned");
static_assert(sizeof(uint2) == 8 && alignof(uint2) == 8, "uint2 is 8 bytes, 8-aligned");
static_assert(sizeof(float2) == 8 && alignof(float2) == 8, "float2 is 8 bytes, 8-aligned");
static_assert(sizeof(uint3) == 12, "uint3 is 12 bytes");

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
      : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return uint3{x, y, z}; }
};
