// cuda_cpu: twins of the inline-PTX device primitives the emitted file uses (templates/
// common.cuh.j2, "device primitives"): the same names and arguments, the same per-lane register
// contents, so that a kernel written against the PTX runs here unchanged. The emitted file keeps
// its own asm versions for nvcc and NVRTC and takes these when CG_PTX_TWINS is defined.
//
// Per-lane fragment layouts, as the PTX ISA documents them ("Matrix fragments for mma.m16n8k16
// with floating point type", "Warp-level matrix load instruction: ldmatrix"); lane l, g = l / 4,
// t = l % 4; a 32-bit register holds two bfloat16, the lower-numbered element in its low half:
//   mma A (16 x 16, row):  a[0] = (g, 2t..2t+1)  a[1] = (g+8, 2t..2t+1)
//                          a[2] = (g, 2t+8..2t+9) a[3] = (g+8, 2t+8..2t+9)
//   mma B (16 x 8, col):   b[0] = (2t..2t+1, g)  b[1] = (2t+8..2t+9, g)
//   mma C, D (16 x 8, f32): c[0], c[1] = (g, 2t), (g, 2t+1); c[2], c[3] = (g+8, 2t), (g+8, 2t+1)
//   ldmatrix .x4: lanes 8i..8i+7 give the addresses of rows 0..7 of matrix i (16 bytes each);
//                 register i of lane l = matrix i's (l/4, 2t..2t+1), or with .trans its
//                 (2t, l/4) and (2t+1, l/4).
// Unlike the WMMA emulation (wmma.h: the whole tile in every lane), a lane here holds exactly
// its own registers, so a kernel that puts a value in the wrong register gets a wrong answer,
// as on a GPU (tests/ptx.cu feeds known matrices through lane by lane).
//
// mma and ldmatrix are warp collectives (all 32 lanes rendezvous; the last to arrive does the
// operation for the warp). mma adds in float, c first, then the products in order of k, as
// wmma.h's mma_sync does (tensor cores add differently: README.md). cp.async is per thread:
// the copy is made by the issuing thread when a cp.async.wait_group that covers its group
// returns (not at issue), so that reading the destination before the wait reads the old bytes,
// and racecheck sees the write as the issuing thread's, at the wait: another thread's read of it
// needs a __syncthreads after that wait, as on a GPU.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "warp.h"

#define CG_PTX_TWINS 1

namespace cgcpu {
namespace detail {

inline float bf16_bits_to_float(std::uint16_t bits) {
  const std::uint32_t wide = static_cast<std::uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

// Element e (0 or 1) of a register holding two bfloat16.
inline float register_half(std::uint32_t r, int e) {
  return bf16_bits_to_float(static_cast<std::uint16_t>(e == 0 ? r & 0xFFFFu : r >> 16));
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: gather A, B, C from the lanes' registers
// by the documented layout, multiply, scatter D back the same way.
CGCPU_SHADOW_SKIP inline void complete_mma_16816(Worker& w, WarpState& warp, std::uint32_t lanes) {
  const Post& lead = *warp.post[0];
  require_whole_warp(w, warp, lanes, lead);
  float A[16][16], B[16][8], C[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    const Post& p = *warp.post[lane];
    const std::uint32_t* a = static_cast<const std::uint32_t*>(p.a);
    const std::uint32_t* b = static_cast<const std::uint32_t*>(p.b);
    const float* c = static_cast<const float*>(p.c);
    const int g = lane / 4, t = lane % 4;
    for (int e = 0; e < 2; ++e) {
      A[g][2 * t + e] = register_half(a[0], e);
      A[g + 8][2 * t + e] = register_half(a[1], e);
      A[g][2 * t + 8 + e] = register_half(a[2], e);
      A[g + 8][2 * t + 8 + e] = register_half(a[3], e);
      B[2 * t + e][g] = register_half(b[0], e);
      B[2 * t + 8 + e][g] = register_half(b[1], e);
      C[g][2 * t + e] = c[e];
      C[g + 8][2 * t + e] = c[2 + e];
    }
  }
  float D[16][8];
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 8; ++j) {
      float sum = C[i][j];
      for (int k = 0; k < 16; ++k) sum = sum + A[i][k] * B[k][j];  // exact products, float sums
      D[i][j] = sum;
    }
  for (int lane = 0; lane < 32; ++lane) {
    float* d = static_cast<float*>(warp.post[lane]->d);
    const int g = lane / 4, t = lane % 4;
    d[0] = D[g][2 * t];
    d[1] = D[g][2 * t + 1];
    d[2] = D[g + 8][2 * t];
    d[3] = D[g + 8][2 * t + 1];
  }
}

// Racecheck: lane `lane` read the 16 bytes of the row it gave the address of (TSan is told
// after the copy, as that lane's access; cf. tsan_tile_access).
CGCPU_NO_TSAN inline void tsan_row_reads(Worker& w, const WarpState& warp) {
#if CGCPU_TSAN
  void* const self = w.current->context.tsan;
  for (int lane = 0; lane < 32; ++lane) {
    __tsan_switch_to_fiber(w.fibers[warp.first + lane].context.tsan, __tsan_switch_to_fiber_no_sync);
    __tsan_ignore_thread_end();
    char* const row = static_cast<char*>(const_cast<void*>(warp.post[lane]->a));
    for (int e = 0; e < 8; ++e) __tsan_read2(row + 2 * e);
    __tsan_ignore_thread_begin();
  }
  __tsan_switch_to_fiber(self, __tsan_switch_to_fiber_no_sync);
#else
  (void)w, (void)warp;
#endif
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16.
CGCPU_SHADOW_SKIP inline void complete_ldmatrix_x4(Worker& w, WarpState& warp, std::uint32_t lanes) {
  const Post& lead = *warp.post[0];
  require_whole_warp(w, warp, lanes, lead);
  std::uint16_t M[4][8][8];  // matrix, row, column
  for (int lane = 0; lane < 32; ++lane) {
    const Post& p = *warp.post[lane];
    if (reinterpret_cast<std::uintptr_t>(p.a) % 16 != 0)
      fiber_fault(w, "%s (%s:%d): lane %d's row address %p is not 16-byte aligned", p.what, p.file, p.line, lane,
                  p.a);
    if (p.layout != lead.layout)
      fiber_fault(w, "%s (%s:%d): lanes 0 and %d differ on .trans", p.what, p.file, p.line, lane);
    const std::uint16_t* row = static_cast<const std::uint16_t*>(p.a);  // plain loads, hidden (not
    for (int e = 0; e < 8; ++e) M[lane / 8][lane % 8][e] = row[e];      // memcpy: TSan intercepts it)
  }
  const bool trans = lead.layout != 0;
  for (int lane = 0; lane < 32; ++lane) {
    std::uint32_t* r = static_cast<std::uint32_t*>(warp.post[lane]->d);
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
      const std::uint16_t first = trans ? M[i][2 * t][g] : M[i][g][2 * t];
      const std::uint16_t second = trans ? M[i][2 * t + 1][g] : M[i][g][2 * t + 1];
      r[i] = static_cast<std::uint32_t>(first) | (static_cast<std::uint32_t>(second) << 16);
    }
  }
  tsan_row_reads(w, warp);
}

inline Fiber& ptx_thread(const char* what) { return *device_worker(what).current; }

}  // namespace detail
}  // namespace cgcpu

// ---- the twins (names and arguments as in templates/common.cuh.j2) ---------------------------

inline void cg_mma_bf16_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2], const float (&c)[4],
                              const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  float result[4];
  cgcpu::detail::Post p = cgcpu::detail::make_post(&cgcpu::detail::complete_mma_16816,
                                                   "mma.sync.m16n8k16", 0xFFFFFFFFu, file, line);
  p.a = a;
  p.b = b;
  p.c = c;
  p.d = result;  // d may be c: written only after every lane has posted
  cgcpu::detail::warp_collective(p);
  for (int i = 0; i < 4; ++i) d[i] = result[i];
}

inline void cg_ldmatrix(unsigned (&r)[4], const void* row, bool trans, const char* what, const char* file, int line) {
  unsigned result[4];
  cgcpu::detail::Post p =
      cgcpu::detail::make_post(&cgcpu::detail::complete_ldmatrix_x4, what, 0xFFFFFFFFu, file, line);
  p.a = row;
  p.d = result;
  p.layout = trans ? 1 : 0;
  cgcpu::detail::warp_collective(p);
  for (int i = 0; i < 4; ++i) r[i] = result[i];
}

inline void cg_ldmatrix_x4(unsigned (&r)[4], const void* row, const char* file = __builtin_FILE(),
                           int line = __builtin_LINE()) {
  cg_ldmatrix(r, row, false, "ldmatrix.x4", file, line);
}

inline void cg_ldmatrix_x4_trans(unsigned (&r)[4], const void* row, const char* file = __builtin_FILE(),
                                 int line = __builtin_LINE()) {
  cg_ldmatrix(r, row, true, "ldmatrix.x4.trans", file, line);
}

// cp.async.{cg,ca}.shared.global of `bytes` (16 or 4): both addresses aligned to it, as PTX
// requires; the copy is made at the wait that covers its group.
inline void cg_cp_async(void* shared, const void* global, unsigned bytes, const char* file, int line) {
  cgcpu::detail::Worker& w = cgcpu::detail::device_worker("cp.async");
  if (reinterpret_cast<std::uintptr_t>(shared) % bytes != 0 || reinterpret_cast<std::uintptr_t>(global) % bytes != 0)
    cgcpu::detail::fiber_fault(w, "cp.async (%s:%d): addresses %p and %p are not both %u-byte aligned", file, line,
                               shared, global, bytes);
  cgcpu::detail::Fiber& self = *w.current;
  cgcpu::detail::TsanIgnore ignore;
  self.async_copies.push_back({shared, global, bytes, self.async_groups});
}

inline void cg_cp_async_16(void* shared, const void* global, const char* file = __builtin_FILE(),
                           int line = __builtin_LINE()) {
  cg_cp_async(shared, global, 16u, file, line);
}

inline void cg_cp_async_4(void* shared, const void* global, const char* file = __builtin_FILE(),
                          int line = __builtin_LINE()) {
  cg_cp_async(shared, global, 4u, file, line);
}

// An empty asm statement on a GPU (it only keeps ptxas from hoisting): here, `x` itself.
inline int cg_opaque(int x) { return x; }

// ex2.approx.ftz.f32: 2^x, a subnormal argument read as zero and a subnormal result written as
// zero (PTX ISA, "ex2"): the twin rounds 2^x correctly where the hardware is within 2 ulp.
inline float cg_exp2_approx(float x) {
  if (std::fpclassify(x) == FP_SUBNORMAL) x = 0.0f;
  const float y = std::exp2(x);
  return std::fpclassify(y) == FP_SUBNORMAL ? 0.0f : y;
}

inline void cg_cp_async_commit() {
  cgcpu::detail::Fiber& self = cgcpu::detail::ptx_thread("cp.async.commit_group");
  cgcpu::detail::TsanIgnore ignore;
  ++self.async_groups;
}

// cp.async.wait_group N: every committed group but the N most recent has landed. The copies
// are made here, by this thread (visible to racecheck as its writes).
template <int N>
inline void cg_cp_async_wait() {
  cgcpu::detail::Fiber& self = cgcpu::detail::ptx_thread("cp.async.wait_group");
  std::vector<cgcpu::detail::Fiber::AsyncCopy> due;
  {
    cgcpu::detail::TsanIgnore ignore;
    auto& copies = self.async_copies;
    std::size_t kept = 0;
    for (std::size_t i = 0; i < copies.size(); ++i) {
      if (copies[i].group + N < self.async_groups)
        due.push_back(copies[i]);
      else
        copies[kept++] = copies[i];
    }
    copies.resize(kept);
  }
  for (const auto& copy : due) {  // the thread's own accesses, in words: not hidden from racecheck
    const std::uint32_t* from = static_cast<const std::uint32_t*>(copy.from);
    std::uint32_t* to = static_cast<std::uint32_t*>(copy.to);
    for (unsigned i = 0; i < copy.bytes / 4; ++i) to[i] = from[i];
  }
}
