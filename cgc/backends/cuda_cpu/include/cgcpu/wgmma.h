// cuda_cpu: twins of Hopper's warpgroup matrix products (templates/common.cuh.j2, "Hopper's
// warpgroup products"): wgmma.mma_async.sync.aligned.m64nNk16.f32.bf16.bf16 with A from shared
// memory (.ss) or from registers (.rs) and B from shared memory, both addressed by matrix
// descriptors; wgmma.fence, wgmma.commit_group and wgmma.wait_group. As the PTX ISA defines
// them ("Asynchronous Warpgroup Level Matrix Multiply-Accumulate Instructions"):
//
// A warpgroup is four consecutive warps (warp w / 4); warp w % 4 owns rows 16 (w % 4) ..
// 16 (w % 4) + 15 of the 64 x N product. Lane l, g = l / 4, t = l % 4:
//   D (f32, N / 2 registers):  d[i] = (16 (w % 4) + g + 8 ((i / 2) % 2), 8 (i / 4) + 2t + i % 2)
//   A in registers (4 x .b32, two bfloat16 each, the lower-numbered element in the low half):
//     a[0] = (g, 2t..2t+1), a[1] = (g+8, 2t..2t+1), a[2] = (g, 2t+8..2t+9), a[3] = (g+8, 2t+8..)
//     of the warp's 16 rows: mma.m16n8k16's A layout (ptx.h).
//   A matrix descriptor (64 bits): bits 0-13 the start address, 16-29 the leading dimension
//     byte offset (LBO), 32-45 the stride dimension byte offset (SBO), each (x & 0x3FFFF) >> 4;
//     49-51 the matrix base offset; 62-63 the swizzle: 0 none, 1 128B, 2 64B, 3 32B.
//   The canonical layouts, in CuTe's notation with T = 8 (bfloat16 elements in 16 bytes), the
//   offsets in elements, LBO and SBO counted in elements too, then Swizzle<B, 4, 3> (B = 0, 1,
//   2, 3 for none, 32B, 64B, 128B) applied to the byte address: bits 4.. 4+B-1 ^= bits 7.. 7+B-1.
//     K-major (rows mn, columns k):  none  ((8,m),(T,2k)):((1T,SBO),(1,LBO))
//                                   32B   ((8,m),(T,2k)):((2T,SBO),(1,T))
//                                   64B   ((8,m),(T,2k)):((4T,SBO),(1,T))
//                                   128B  ((8,m),(T,2k)):((8T,SBO),(1,T))
//     MN-major (mn contiguous):     none  ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO))
//                                   32B   ((T,2,m),(8,k)):((1,T,LBO),(2T,SBO))
//                                   64B   ((T,4,m),(8,k)):((1,T,LBO),(4T,SBO))
//                                   128B  ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO))
//   A is K-major unless transposed (then M-major); B is K-major unless transposed (N-major).
//
// Asynchrony: mma_async records what the thread issued (its A registers and its accumulators
// copied: the ISA leaves writing either before the wait undefined) and returns; the product is
// made at the wgmma.wait_group that covers its group, a warp collective (the instruction is
// .sync.aligned): the last lane to arrive gathers the warp's operands, reads the shared tiles
// then, and writes every lane's accumulators. So a thread that reads its accumulators before the
// wait reads what was there before, a thread that wrote them after the issue is a fault, and a
// tile overwritten before the wait is read overwritten: racecheck reports such a write against
// the product's reads, which are the warp's lane 0's, at its wait. D is C first, then the
// products in order of k, in float (as ptx.h's mma; the tensor cores add differently: README.md).
//
// Shared addresses (cg_shared_address): dynamic shared memory starts at shared address
// kDynamicSharedAddress (128), not on a 1024-byte boundary, as it may not on a GPU, where it
// follows the kernel's static shared memory; a kernel rounds its swizzled tiles up to the
// swizzle's repeat (1024 bytes for 128B) by cg_shared_address, and the twin faults on a swizzled
// tile off its repeat (the ISA then wants a matrix base offset, not modelled). A descriptor that
// points outside dynamic shared memory, or a tile that reads past it, is a fault. Lanes of a warp
// that issue different products, and a wait whose lanes have different products pending, are
// faults too (undefined in the ISA), and so are a product issued in a warpgroup the block does not
// hold whole and a thread that exits with products pending (scheduler.h). Not checked: that all
// four warps of the warpgroup issue the product (each warp's rows depend on its own operands
// only), and the wgmma.fence the ISA requires before a product whose registers other
// instructions wrote.
#pragma once

#include <cstdint>
#include <vector>

#include "scheduler.h"
#include "warp.h"

namespace cgcpu {
namespace detail {

// The shared address of dynamic shared memory's first byte: not on a swizzle's repeat.
constexpr std::uint32_t kDynamicSharedAddress = 128;

// The shared address of `p`, which must be in the block's dynamic shared memory.
inline std::uint32_t shared_window_address(Worker& w, const void* p, const char* what, const char* file, int line) {
  const unsigned char* base = tls_dynamic_shared;
  const unsigned char* at = static_cast<const unsigned char*>(p);
  if (base == nullptr || at < base || at >= base + tls_dynamic_shared_bytes)
    fiber_fault(w, "%s (%s:%d): %p is not in this block's dynamic shared memory (%zu bytes at %p), the only "
                "shared memory the emulation's matrix descriptors and tensor copies address", what, file, line, p,
                tls_dynamic_shared_bytes, static_cast<const void*>(base));
  return kDynamicSharedAddress + static_cast<std::uint32_t>(at - base);
}

// Swizzle<B, 4, 3> on a shared byte address (B = 0 none, 1 32B, 2 64B, 3 128B).
inline std::uint32_t swizzled(std::uint32_t address, int bits) {
  return address ^ (((address >> 7) & ((1u << bits) - 1u)) << 4);
}

// The descriptor's swizzle field (0 none, 1 128B, 2 64B, 3 32B) as Swizzle's B.
inline int swizzle_bits(unsigned field) {
  static const int bits[4] = {0, 3, 2, 1};
  return bits[field & 3u];
}

struct MatrixDescriptor {
  std::uint32_t start, leading, stride;  // bytes
  unsigned base_offset, swizzle;
};

inline MatrixDescriptor decode_descriptor(unsigned long long d) {
  return MatrixDescriptor{static_cast<std::uint32_t>(d & 0x3FFFu) << 4,
                          static_cast<std::uint32_t>((d >> 16) & 0x3FFFu) << 4,
                          static_cast<std::uint32_t>((d >> 32) & 0x3FFFu) << 4,
                          static_cast<unsigned>((d >> 49) & 7u), static_cast<unsigned>(d >> 62)};
}

// The shared byte address of element (mn, k) of a bfloat16 operand (the canonical layouts above).
inline std::uint32_t operand_address(const MatrixDescriptor& m, bool mn_major, int mn, int k) {
  constexpr std::uint32_t T = 8;
  const int bits = swizzle_bits(m.swizzle);
  const std::uint32_t span = 1u << bits;  // 16-byte chunks a swizzled row holds: 1, 2, 4, 8
  const std::uint32_t lbo = m.leading / 2, sbo = m.stride / 2;  // in elements
  std::uint32_t offset;
  if (!mn_major) {
    const std::uint32_t row = bits == 0 ? T : span * T;
    const std::uint32_t column = bits == 0 ? (k % 8) + (k / 8) * lbo : static_cast<std::uint32_t>(k);
    offset = (mn % 8) * row + (mn / 8) * sbo + column;
  } else if (bits == 0) {
    offset = (mn % 8) + (mn / 8) * sbo + (k % 8) * T + (k / 8) * lbo;
  } else {
    offset = (mn % 8) + ((mn / 8) % span) * T + (mn / (8 * span)) * lbo + (k % 8) * span * T + (k / 8) * sbo;
  }
  return swizzled(m.start + 2 * offset, bits);
}

inline float bf16_at(Worker& w, std::uint32_t address, std::vector<const void*>& read, const char* what,
                     const char* file, int line) {
  if (address < kDynamicSharedAddress || address + 2 > kDynamicSharedAddress + tls_dynamic_shared_bytes)
    fiber_fault(w, "%s (%s:%d): the matrix descriptor reads shared address %u, outside the block's %zu bytes of "
                "dynamic shared memory (from %u)", what, file, line, address, tls_dynamic_shared_bytes,
                kDynamicSharedAddress);
  const unsigned char* at = tls_dynamic_shared + (address - kDynamicSharedAddress);
  read.push_back(at);
  return bf16_bits_to_float(*reinterpret_cast<const std::uint16_t*>(at));  // not memcpy: TSan intercepts it
}

// Racecheck: lane `lane` of the warp read `addresses` (two bytes each), now.
CGCPU_NO_TSAN inline void tsan_reads_of_lane(Worker& w, const WarpState& warp, int lane,
                                             const std::vector<const void*>& addresses) {
#if CGCPU_TSAN
  void* const self = w.current->context.tsan;
  __tsan_switch_to_fiber(w.fibers[warp.first + lane].context.tsan, __tsan_switch_to_fiber_no_sync);
  __tsan_ignore_thread_end();
  for (const void* a : addresses) __tsan_read2(const_cast<void*>(a));
  __tsan_ignore_thread_begin();
  __tsan_switch_to_fiber(self, __tsan_switch_to_fiber_no_sync);
#else
  (void)w, (void)warp, (void)lane, (void)addresses;
#endif
}

// Whether the accumulators hold the bits `held` (plain loads: TSan intercepts memcmp).
inline bool same_bits(const float* d, const std::vector<float>& held) {
  const std::uint32_t* now = reinterpret_cast<const std::uint32_t*>(d);
  const std::uint32_t* then = reinterpret_cast<const std::uint32_t*>(held.data());
  for (std::size_t i = 0; i < held.size(); ++i)
    if (now[i] != then[i]) return false;
  return true;
}

inline bool same_product(const Fiber::WgmmaOp& a, const Fiber::WgmmaOp& b) {
  return a.n == b.n && a.a_in_registers == b.a_in_registers && a.b_descriptor == b.b_descriptor &&
         (a.a_in_registers || a.a_descriptor == b.a_descriptor) && a.scale_d == b.scale_d &&
         a.transpose_a == b.transpose_a && a.transpose_b == b.transpose_b;
}

// One warp's 16 rows of one product: every lane's op `index` of those due.
CGCPU_SHADOW_SKIP inline void make_product(Worker& w, WarpState& warp, const std::vector<Fiber::WgmmaOp*>& ops,
                                           std::vector<const void*>& read) {
  const Fiber::WgmmaOp& lead = *ops[0];
  const int n = lead.n, top = static_cast<int>(warp.first / 32 % 4) * 16;
  for (int lane = 1; lane < 32; ++lane)
    if (!same_product(lead, *ops[lane]))
      fiber_fault(w, "wgmma.mma_async (%s:%d): lanes 0 and %d of the warp issued different products (shape, "
                  "descriptors or flags)", lead.file, lead.line, lane);
  const MatrixDescriptor a = decode_descriptor(lead.a_descriptor), b = decode_descriptor(lead.b_descriptor);
  for (const MatrixDescriptor* m : {&a, &b}) {
    if (m == &a && lead.a_in_registers) continue;
    if (m->base_offset != 0)
      fiber_fault(w, "wgmma.mma_async (%s:%d): matrix base offset %u: only 0 (tiles on the swizzle's repeat) is "
                  "modelled", lead.file, lead.line, m->base_offset);
    // The pattern starts at the 128-byte row the descriptor starts in (a start inside a row is a
    // step along k); with base offset 0 the ISA wants it on the repeat: 256, 512, 1024 bytes.
    const std::uint32_t repeat = 128u << swizzle_bits(m->swizzle);
    if (m->swizzle != 0 && (m->start & ~127u) % repeat != 0)
      fiber_fault(w, "wgmma.mma_async (%s:%d): a swizzled tile at shared address %u is not on its swizzle's "
                  "%u-byte repeat (base offset 0); round the tile up with cg_shared_address", lead.file, lead.line,
                  m->start, repeat);
  }
  float A[16][16], B[16][256], D[16][256];
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    if (lead.a_in_registers) {
      const unsigned* r = ops[lane]->a;
      for (int e = 0; e < 2; ++e) {
        A[g][2 * t + e] = register_half(r[0], e);
        A[g + 8][2 * t + e] = register_half(r[1], e);
        A[g][2 * t + 8 + e] = register_half(r[2], e);
        A[g + 8][2 * t + 8 + e] = register_half(r[3], e);
      }
    }
    for (int i = 0; i < n / 2; ++i) D[g + 8 * ((i / 2) % 2)][8 * (i / 4) + 2 * t + i % 2] = ops[lane]->d[i];
  }
  if (!lead.a_in_registers)
    for (int i = 0; i < 16; ++i)
      for (int k = 0; k < 16; ++k)
        A[i][k] = bf16_at(w, operand_address(a, lead.transpose_a != 0, top + i, k), read, "wgmma.mma_async",
                          lead.file, lead.line);
  for (int k = 0; k < 16; ++k)
    for (int j = 0; j < n; ++j)
      B[k][j] = bf16_at(w, operand_address(b, lead.transpose_b != 0, j, k), read, "wgmma.mma_async", lead.file,
                        lead.line);
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < n; ++j) {
      float sum = lead.scale_d ? D[i][j] : 0.0f;
      for (int k = 0; k < 16; ++k) sum = sum + A[i][k] * B[k][j];  // exact products, float sums
      D[i][j] = sum;
    }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < n / 2; ++i) ops[lane]->d[i] = D[g + 8 * ((i / 2) % 2)][8 * (i / 4) + 2 * t + i % 2];
  }
}

// wgmma.wait_group N: every lane's products but those of its N most recent groups are made.
CGCPU_SHADOW_SKIP inline void complete_wgmma_wait(Worker& w, WarpState& warp, std::uint32_t lanes) {
  const Post& lead = *warp.post[0];
  require_whole_warp(w, warp, lanes, lead);
  const unsigned pending = static_cast<unsigned>(lead.arg);
  std::size_t due = 0;
  for (int lane = 0; lane < 32; ++lane) {
    const Fiber& f = w.fibers[warp.first + lane];
    std::size_t count = 0;
    for (const Fiber::WgmmaOp& op : f.wgmma_ops) count += op.group + pending < f.wgmma_groups;
    if (lane == 0) due = count;
    if (count != due)
      fiber_fault(w, "%s (%s:%d): lanes 0 and %d have %zu and %zu products to complete", lead.what, lead.file,
                  lead.line, lane, due, count);
  }
  std::vector<const void*> read;
  std::vector<Fiber::WgmmaOp*> ops(32);
  for (std::size_t index = 0; index < due; ++index) {
    for (int lane = 0; lane < 32; ++lane) {
      auto& list = w.fibers[warp.first + lane].wgmma_ops;
      ops[lane] = &list[index];
      if (!same_bits(ops[lane]->d, ops[lane]->held))
        fiber_fault(w, "%s (%s:%d): lane %d's accumulators of the product at %s:%d were written between its issue "
                    "and this wait (undefined)", lead.what, lead.file, lead.line, lane, ops[lane]->file,
                    ops[lane]->line);
    }
    make_product(w, warp, ops, read);
    for (int lane = 0; lane < 32; ++lane) {  // later products on these accumulators start from the result
      auto& list = w.fibers[warp.first + lane].wgmma_ops;
      for (std::size_t later = index + 1; later < list.size(); ++later)
        if (list[later].d == ops[lane]->d) list[later].held.assign(ops[lane]->d, ops[lane]->d + list[later].n / 2);
    }
  }
  for (int lane = 0; lane < 32; ++lane) {
    auto& list = w.fibers[warp.first + lane].wgmma_ops;
    list.erase(list.begin(), list.begin() + static_cast<std::ptrdiff_t>(due));
  }
  tsan_reads_of_lane(w, warp, 0, read);
}

template <int N>
CGCPU_SHADOW_SKIP inline void issue_wgmma(float* d, const unsigned* a, unsigned long long a_descriptor,
                                          unsigned long long b_descriptor, int scale_d, int transpose_a,
                                          int transpose_b, const char* file, int line) {
  static_assert(N % 8 == 0 && N >= 8 && N <= 256, "wgmma m64nNk16: N a multiple of 8 in [8, 256]");
  Worker& w = device_worker("wgmma.mma_async");
  Fiber& self = *w.current;
  FiberIgnore ignore(self);
  if ((self.linear / 128 + 1) * 128 > w.threads)
    fiber_fault(w, "wgmma.mma_async (%s:%d): thread %u's warpgroup (threads %u-%u) is not whole in a block of %u "
                "threads", file, line, self.linear, self.linear / 128 * 128, self.linear / 128 * 128 + 127,
                w.threads);
  Fiber::WgmmaOp op{};
  op.d = d;
  op.held.assign(d, d + N / 2);
  op.n = N;
  op.a_in_registers = a != nullptr;
  if (a != nullptr)
    for (int i = 0; i < 4; ++i) op.a[i] = a[i];
  op.a_descriptor = a_descriptor;
  op.b_descriptor = b_descriptor;
  op.scale_d = scale_d != 0;
  op.transpose_a = transpose_a;
  op.transpose_b = transpose_b;
  op.group = self.wgmma_groups;
  op.file = file;
  op.line = line;
  self.wgmma_ops.push_back(op);
}

}  // namespace detail
}  // namespace cgcpu

// ---- the twins (names and arguments as in templates/common.cuh.j2) ---------------------------

// The shared address of `p`, a byte of the block's dynamic shared memory (from 128: see above).
inline unsigned cg_shared_address(const void* p, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  using namespace cgcpu::detail;
  return shared_window_address(device_worker("cvta.to.shared"), p, "cvta.to.shared", file, line);
}

// A matrix descriptor for the bfloat16 tile at `tile` (dynamic shared memory): `leading` and
// `stride` bytes (LBO, SBO), `swizzle` the descriptor's code (0 none, 1 128B, 2 64B, 3 32B).
inline unsigned long long cg_wgmma_descriptor(const void* tile, unsigned leading, unsigned stride, unsigned swizzle,
                                              const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  using namespace cgcpu::detail;
  Worker& w = device_worker("wgmma descriptor");
  const std::uint32_t address = shared_window_address(w, tile, "wgmma descriptor", file, line);
  auto encode = [](std::uint32_t x) { return static_cast<unsigned long long>((x & 0x3FFFFu) >> 4); };
  return encode(address) | encode(leading) << 16 | encode(stride) << 32 |
         static_cast<unsigned long long>(swizzle & 3u) << 62;
}

// wgmma.fence.sync.aligned: orders this thread's register and shared accesses before the
// products it issues next (nothing to do here: a product reads its operands at its wait).
inline void cg_wgmma_fence() { (void)cgcpu::detail::device_worker("wgmma.fence"); }

// fence.proxy.async.shared::cta: shared memory written by threads, visible to the async proxy
// (wgmma, TMA). The emulation has one proxy.
inline void cg_fence_proxy_async() { (void)cgcpu::detail::device_worker("fence.proxy.async"); }

// Keeps the compiler from moving accumulator reads across the asynchronous product (GPU only).
template <int K>
inline void cg_wgmma_fence_operand(float (&)[K]) {}

// wgmma.commit_group.sync.aligned: the products issued since the last commit form a group.
inline void cg_wgmma_commit() {
  cgcpu::detail::Worker& w = cgcpu::detail::device_worker("wgmma.commit_group");
  cgcpu::detail::FiberIgnore ignore(*w.current);
  ++w.current->wgmma_groups;
}

// wgmma.wait_group.sync.aligned N: every group but the N most recent has completed.
template <int N>
inline void cg_wgmma_wait(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  cgcpu::detail::Post p = cgcpu::detail::make_post(&cgcpu::detail::complete_wgmma_wait, "wgmma.wait_group",
                                                   0xFFFFFFFFu, file, line);
  p.arg = N;
  cgcpu::detail::warp_collective(p);
}

// wgmma.mma_async.sync.aligned.m64nNk16.f32.bf16.bf16, A and B from shared memory:
// d = A B + (scale_d ? d : 0).
template <int N, int TransposeA, int TransposeB>
inline void cg_wgmma_bf16_ss(float (&d)[N / 2], unsigned long long a, unsigned long long b, int scale_d,
                             const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  cgcpu::detail::issue_wgmma<N>(d, nullptr, a, b, scale_d, TransposeA, TransposeB, file, line);
}

// The same with A from the warpgroup's registers (mma.m16n8k16's A layout, each warp its rows).
template <int N, int TransposeB>
inline void cg_wgmma_bf16_rs(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long b, int scale_d,
                             const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  cgcpu::detail::issue_wgmma<N>(d, a, 0, b, scale_d, 0, TransposeB, file, line);
}
