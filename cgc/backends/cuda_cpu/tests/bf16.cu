// bfloat16 conversions against the project's reference rule (cgc/backends/numerics.py):
// bits + 0x7FFF + ((bits >> 16) & 1), >> 16; NaN -> 0x7FC0; here computed independently as
// "the nearer neighbour, the even one on a tie" (and the pytest compares with NumPy itself).
//   bf16                    the checks: 2^26 float patterns (every high half with pseudo-random low
//                           halves) and the edge cases, through every conversion path
//   bf16 convert IN OUT     converts the float32 patterns in file IN to bfloat16 bits in OUT
//                           (the test compares them with the NumPy reference itself)
#include "check.h"

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <vector>

static double bf16_value(std::uint16_t b) {  // with 0x7F80 / 0xFF80 standing for +-2^128
  std::uint32_t wide = static_cast<std::uint32_t>(b) << 16;
  if ((b & 0x7FFFu) == 0x7F80u) return (b & 0x8000u) ? -std::ldexp(1.0, 128) : std::ldexp(1.0, 128);
  float f;
  std::memcpy(&f, &wide, 4);
  return f;
}

// The reference rule, computed independently of the headers' bit trick: pick the nearer of the
// two bfloat16 neighbours (exact distances in double), the even one on a tie.
static std::uint16_t reference(std::uint32_t bits) {
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;  // NaN
  const std::uint16_t low = static_cast<std::uint16_t>(bits >> 16);  // toward zero
  if ((bits & 0xFFFFu) == 0) return low;
  const std::uint16_t high = static_cast<std::uint16_t>(low + 1);  // away from zero
  std::uint32_t b = bits;
  float f;
  std::memcpy(&f, &b, 4);
  const double below = std::fabs(static_cast<double>(f) - bf16_value(low));
  const double above = std::fabs(bf16_value(high) - static_cast<double>(f));
  if (below < above) return low;
  if (above < below) return high;
  return (low & 1u) ? high : low;
}

static float as_float(std::uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

static std::uint16_t bits_of(__nv_bfloat16 b) {
  std::uint16_t u;
  std::memcpy(&u, &b, 2);
  return u;
}

// Every conversion from float the headers offer, for one pattern.
static int check_pattern(std::uint32_t bits) {
  const float f = as_float(bits);
  const std::uint16_t want = reference(bits);
  int bad = 0;
  bad += bits_of(__float2bfloat16_rn(f)) != want;
  bad += bits_of(__float2bfloat16(f)) != want;
  __nv_bfloat16 constructed(f);
  bad += bits_of(constructed) != want;
  bad += bits_of(static_cast<__nv_bfloat16>(f)) != want;
  __nv_bfloat16 assigned;
  assigned = f;
  bad += bits_of(assigned) != want;
  const __nv_bfloat162 pair = __floats2bfloat162_rn(f, -f);
  bad += bits_of(pair.x) != want;
  bad += bits_of(pair.y) != reference(bits ^ 0x80000000u);
  const __nv_bfloat162 pair2 = __float22bfloat162_rn(make_float2(f, f));
  bad += bits_of(pair2.y) != want;
  return bad;
}

__global__ void device_convert(std::uint16_t* out, const float* in, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    const __nv_bfloat16 b = __float2bfloat16_rn(in[i]);
    std::memcpy(out + i, &b, 2);
  }
}

int main(int argc, char** argv) {
  if (argc == 4 && std::strcmp(argv[1], "convert") == 0) {
    FILE* in = std::fopen(argv[2], "rb");
    if (in == nullptr) return 2;
    std::vector<float> values;
    float f;
    while (std::fread(&f, 4, 1, in) == 1) values.push_back(f);
    std::fclose(in);
    // Through a kernel, as the emitted code converts.
    const int n = static_cast<int>(values.size());
    float* din = nullptr;
    std::uint16_t* dout = nullptr;
    CUDA_OK(cudaMalloc(&din, n * 4));
    CUDA_OK(cudaMalloc(&dout, n * 2));
    CUDA_OK(cudaMemcpy(din, values.data(), n * 4, cudaMemcpyHostToDevice));
    CG_LAUNCH(device_convert, dim3((n + 255) / 256), dim3(256), 0, nullptr)(dout, din, n);
    CUDA_OK(cudaGetLastError());
    std::vector<std::uint16_t> bits(n);
    CUDA_OK(cudaMemcpy(bits.data(), dout, n * 2, cudaMemcpyDeviceToHost));
    FILE* out = std::fopen(argv[3], "wb");
    if (out == nullptr || std::fwrite(bits.data(), 2, n, out) != static_cast<size_t>(n)) return 2;
    std::fclose(out);
    return 0;
  }

  // 2^26 patterns: every high 16 bits, 1024 low halves each (pseudo-random, plus the ties).
  long long bad = 0, tested = 0;
  std::uint32_t lcg = 1;
  for (std::uint32_t high = 0; high < 65536; ++high) {
    for (std::uint32_t k = 0; k < 1024; ++k) {
      std::uint32_t low;
      switch (k) {
        case 0: low = 0x0000; break;
        case 1: low = 0x7FFF; break;
        case 2: low = 0x8000; break;  // exactly half way: ties to even
        case 3: low = 0x8001; break;
        case 4: low = 0xFFFF; break;
        case 5: low = 0x0001; break;
        default: lcg = lcg * 1664525u + 1013904223u; low = lcg >> 16; break;
      }
      const std::uint32_t bits = (high << 16) | low;
      const std::uint16_t want = reference(bits);
      const std::uint16_t got = bits_of(__float2bfloat16_rn(as_float(bits)));
      if (got != want) {
        if (bad < 5) std::printf("0x%08x -> 0x%04x, expected 0x%04x\n", bits, got, want);
        ++bad;
      }
      ++tested;
    }
  }
  std::printf("%lld patterns, %lld wrong\n", tested, bad);
  CHECK(bad == 0, "%lld of %lld float patterns convert differently from the reference", bad, tested);

  // The edge cases, through every path.
  const std::uint32_t edges[] = {
      0x00000000u, 0x80000000u,              // zeros
      0x00000001u, 0x80000001u, 0x00008000u, 0x00018000u, 0x00007FFFu, 0x0000FFFFu,  // subnormals
      0x007FFFFFu, 0x00800000u, 0x007F8000u, 0x007FC000u,  // around the smallest normal
      0x3F800000u, 0x3F808000u, 0x3F818000u, 0x3F807FFFu, 0x3F808001u,  // ties near 1
      0x7F7FFFFFu, 0xFF7FFFFFu, 0x7F7F7FFFu, 0x7F7F8000u, 0x7F7F8001u, 0x7F7EFFFFu,  // largest finite
      0x7F800000u, 0xFF800000u,              // infinities
      0x7F800001u, 0x7FC00000u, 0x7FFFFFFFu, 0xFFC00000u, 0xFF800001u, 0x7FA00000u,  // NaNs
  };
  for (std::uint32_t e : edges) {
    const int wrong = check_pattern(e);
    CHECK(wrong == 0, "0x%08x: %d conversion paths disagree with the reference 0x%04x", e, wrong, reference(e));
  }
  CHECK(bits_of(__float2bfloat16_rn(as_float(0x7F7FFFFFu))) == 0x7F80u, "largest float rounds to infinity");
  CHECK(bits_of(__float2bfloat16_rn(std::nanf(""))) == 0x7FC0u, "NaN is 0x7FC0");
  CHECK(bits_of(__float2bfloat16_rn(-std::nanf(""))) == 0x7FC0u, "negative NaN is 0x7FC0 as well");

  // A sample through every path.
  long long path_bad = 0;
  for (std::uint32_t i = 0; i < (1u << 20); ++i) path_bad += check_pattern(i * 4099u + (i >> 3));
  CHECK(path_bad == 0, "%lld conversions disagree with the reference across the paths", path_bad);

  // bfloat16 -> float is exact: the 16 bits shifted up, for all 65536 patterns.
  int widen_bad = 0;
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const __nv_bfloat16 v = __ushort_as_bfloat16(static_cast<unsigned short>(b));
    const float f = __bfloat162float(v);
    const float g = v;  // implicit conversion
    std::uint32_t fb, gb;
    std::memcpy(&fb, &f, 4);
    std::memcpy(&gb, &g, 4);
    widen_bad += fb != (b << 16) || gb != (b << 16);
    const float2 two = __bfloat1622float2(__nv_bfloat162(v, v));
    std::uint32_t tb;
    std::memcpy(&tb, &two.y, 4);
    widen_bad += tb != (b << 16);
  }
  CHECK(widen_bad == 0, "%d bfloat16 patterns widen inexactly", widen_bad);

  // double -> bfloat16 rounds once (not through a float rounding to nearest).
  const double just_above_tie = 1.0 + 1.0 / 256 + 1e-12;  // rounds up; through float it would tie down
  CHECK(bits_of(__double2bfloat16(just_above_tie)) == 0x3F81u, "double %.17g -> 0x%04x", just_above_tie,
        bits_of(__double2bfloat16(just_above_tie)));
  CHECK(bits_of(__nv_bfloat16(just_above_tie)) == 0x3F81u, "double constructor");
  CHECK(bits_of(__nv_bfloat16(1.0 + 1.0 / 256)) == 0x3F80u, "double tie to even");
  CHECK(bits_of(__nv_bfloat16(3)) == 0x4040u && bits_of(__nv_bfloat16(257)) == 0x4380u, "from integers");

  // Arithmetic: CUDA's operators return bfloat16, rounded once.
  const __nv_bfloat16 a = 1.5f, b = 2.375f, c = 0.00390625f;
  CHECK(bits_of(a * b) == reference(0x40640000u), "1.5 * 2.375 -> 0x%04x", bits_of(a * b));
  CHECK(__bfloat162float(a + c) == 1.5f, "1.5 + 2^-8 rounds to 1.5 (ties to even): %g", __bfloat162float(a + c));
  CHECK(__bfloat162float(b - a) == 0.875f, "2.375 - 1.5");
  CHECK(__bfloat162float(-a) == -1.5f && __bfloat162float(__habs(-a)) == 1.5f, "negation");
  CHECK(a < b && !(b < a) && a == a, "comparisons");
  FINISH("bf16");
}
