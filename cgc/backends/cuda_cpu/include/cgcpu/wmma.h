// cuda_cpu: nvcuda::wmma, the warp-level matrix products.
//
// A fragment holds the WHOLE tile in every lane (row-major in x[], num_elements = the tile's
// size), where a GPU spreads it over the 32 lanes' registers. Every operation that touches
// memory or combines fragments (load_matrix_sync, mma_sync, store_matrix_sync) is a warp
// collective: all 32 lanes rendezvous, each must pass the same pointer, ldm and layout (and,
// to mma_sync and store_matrix_sync, bitwise-equal fragments), and the last lane to arrive
// does the operation once for the warp, writing every lane's fragment. So a store can never
// overtake another lane's load of the same tile. fill_fragment touches only this lane's
// fragment and is not a collective (as on a GPU). Element-wise code over x[] works when every
// lane applies the same operation to every element; code that treats x[i] as a lane's own
// share of the tile does not (the templates never touch x[]).
//
// mma_sync computes d[i][j] = c[i][j] + a[i][0] b[0][j] + ... + a[i][K-1] b[K-1][j] in float,
// adding the products one at a time in order of k. Products of bfloat16 are exact in float, so
// only the additions round. Tensor cores add differently (README.md).
// CUDA's requirements are checked: the pointer 32-byte aligned, ldm a multiple of 16 bytes.
// Racecheck (a ThreadSanitizer build): the copy is hidden from TSan, then each element's access
// is declared as made by the lane that owns the element (scheduler.h: tsan_tile_access).
#pragma once

#include <cstdint>
#include <cstring>

#include "bf16.h"
#include "warp.h"

namespace nvcuda {
namespace wmma {

struct row_major {};
struct col_major {};
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
enum layout_t { mem_row_major, mem_col_major };

namespace detail {
template <class Use, int M, int N, int K>
struct Shape;
template <int M, int N, int K>
struct Shape<matrix_a, M, N, K> {
  static constexpr int rows = M, cols = K;
};
template <int M, int N, int K>
struct Shape<matrix_b, M, N, K> {
  static constexpr int rows = K, cols = N;
};
template <int M, int N, int K>
struct Shape<accumulator, M, N, K> {
  static constexpr int rows = M, cols = N;
};
}  // namespace detail

template <class Use, int M, int N, int K, class T, class Layout = void>
class fragment {
 public:
  static_assert((M == 16 && N == 16 && K == 16) || (M == 32 && N == 8 && K == 16) || (M == 8 && N == 32 && K == 16),
                "WMMA shapes for bfloat16: m16n16k16, m32n8k16, m8n32k16");
  static constexpr int rows = detail::Shape<Use, M, N, K>::rows;
  static constexpr int cols = detail::Shape<Use, M, N, K>::cols;
  static constexpr int num_elements = rows * cols;
  static constexpr int num_storage_elements = num_elements;
  typedef T element_type;
  typedef T storage_element_type;
  alignas(32) T x[num_elements];  // the whole tile, row-major: x[r * cols + c]
};

template <class Use, int M, int N, int K, class T, class Layout>
inline void fill_fragment(fragment<Use, M, N, K, T, Layout>& f,
                          const typename fragment<Use, M, N, K, T, Layout>::element_type& value) {
  for (int i = 0; i < f.num_elements; ++i) f.x[i] = value;
}

namespace detail {
using cgcpu::detail::Post;
using cgcpu::detail::WarpState;
using cgcpu::detail::Worker;

template <class Layout>
struct IsRow : std::false_type {};
template <>
struct IsRow<row_major> : std::true_type {};

// Every lane of the warp passed the same pointer, ldm and layout.
inline void require_uniform(Worker& w, const WarpState& warp, const Post& lead, bool memory_in_a) {
  for (int lane = 1; lane < 32; ++lane) {
    const Post& p = *warp.post[lane];
    const void* mine = memory_in_a ? p.a : static_cast<const void*>(p.d);
    const void* theirs = memory_in_a ? lead.a : static_cast<const void*>(lead.d);
    if (mine != theirs || p.ldm != lead.ldm || p.layout != lead.layout)
      cgcpu::detail::fiber_fault(w, "%s (%s:%d): lanes 0 and %d passed different pointers, ldm or layouts (%p, %u, %d vs %p, %u, %d)",
                                 lead.what, lead.file, lead.line, lane, theirs, lead.ldm, lead.layout, mine, p.ldm, p.layout);
  }
}

inline void require_aligned(Worker& w, const Post& p, const void* memory, std::size_t element) {
  if (reinterpret_cast<std::uintptr_t>(memory) % 32 != 0)
    cgcpu::detail::fiber_fault(w, "%s (%s:%d): pointer %p is not 32-byte aligned", p.what, p.file, p.line, memory);
  if ((p.ldm * element) % 16 != 0)
    cgcpu::detail::fiber_fault(w, "%s (%s:%d): ldm %u is not a multiple of 16 bytes (%zu-byte elements)", p.what,
                               p.file, p.line, p.ldm, element);
}

template <class Fragment>
inline void require_equal_fragments(Worker& w, const WarpState& warp, const Post& lead, int which) {
  const void* first = which == 0 ? lead.a : (which == 1 ? lead.b : lead.c);
  for (int lane = 1; lane < 32; ++lane) {
    const Post& p = *warp.post[lane];
    const void* other = which == 0 ? p.a : (which == 1 ? p.b : p.c);
    if (std::memcmp(first, other, sizeof(Fragment)) != 0)
      cgcpu::detail::fiber_fault(w, "%s (%s:%d): lane %d's fragment differs from lane 0's (the emulator keeps the "
                                 "whole tile in every lane; fragments must be changed alike in every lane)",
                                 lead.what, lead.file, lead.line, lane);
  }
}

// load_matrix_sync for matrix_a / matrix_b (layout from the fragment type) and accumulator
// (layout from the argument).
template <class Fragment, class T, bool kRowMajor, bool kAccumulator>
inline void complete_load(Worker& w, WarpState& warp, std::uint32_t lanes) {
  const Post& lead = *warp.post[0];
  cgcpu::detail::require_whole_warp(w, warp, lanes, lead);
  require_uniform(w, warp, lead, true);
  require_aligned(w, lead, lead.a, sizeof(T));
  const T* memory = static_cast<const T*>(lead.a);
  const bool row = kAccumulator ? lead.layout == mem_row_major : kRowMajor;
  const std::size_t ldm = lead.ldm;
  Fragment tile;
  // Element (r, c) of the tile: row-major memory keeps r's row at r * ldm; column-major keeps
  // column c at c * ldm. (matrix_b is K x N; its "rows" are k.)
  for (int r = 0; r < Fragment::rows; ++r)
    for (int c = 0; c < Fragment::cols; ++c)
      tile.x[r * Fragment::cols + c] = row ? memory[static_cast<std::size_t>(r) * ldm + c] : memory[static_cast<std::size_t>(c) * ldm + r];
  for (int lane = 0; lane < 32; ++lane) std::memcpy(warp.post[lane]->d, &tile, sizeof tile);
  // Racecheck: each lane's share of the reads, as that lane's (nothing but a __syncwarp orders
  // them after the other lanes' accesses).
  cgcpu::detail::tsan_tile_access(w, warp, memory, ldm, row, Fragment::rows, Fragment::cols, sizeof(T), false);
}

template <class Fragment, class T>
inline void complete_store(Worker& w, WarpState& warp, std::uint32_t lanes) {
  const Post& lead = *warp.post[0];
  cgcpu::detail::require_whole_warp(w, warp, lanes, lead);
  require_uniform(w, warp, lead, false);
  require_aligned(w, lead, lead.d, sizeof(T));
  require_equal_fragments<Fragment>(w, warp, lead, 0);
  const Fragment& tile = *static_cast<const Fragment*>(lead.a);
  T* memory = static_cast<T*>(lead.d);
  const bool row = lead.layout == mem_row_major;
  const std::size_t ldm = lead.ldm;
  for (int r = 0; r < Fragment::rows; ++r)
    for (int c = 0; c < Fragment::cols; ++c) {
      const std::size_t at = row ? static_cast<std::size_t>(r) * ldm + c : static_cast<std::size_t>(c) * ldm + r;
      memory[at] = tile.x[r * Fragment::cols + c];
    }
  // Racecheck: each lane's share of the writes, as that lane's.
  cgcpu::detail::tsan_tile_access(w, warp, memory, ldm, row, Fragment::rows, Fragment::cols, sizeof(T), true);
}

template <class D, class A, class B, class C>
inline void complete_mma(Worker& w, WarpState& warp, std::uint32_t lanes) {
  const Post& lead = *warp.post[0];
  cgcpu::detail::require_whole_warp(w, warp, lanes, lead);
  require_equal_fragments<A>(w, warp, lead, 0);
  require_equal_fragments<B>(w, warp, lead, 1);
  require_equal_fragments<C>(w, warp, lead, 2);
  const A& a = *static_cast<const A*>(lead.a);
  const B& b = *static_cast<const B*>(lead.b);
  const C& c = *static_cast<const C*>(lead.c);
  constexpr int M = A::rows, K = A::cols, N = B::cols;
  D result;
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      float sum = static_cast<float>(c.x[i * N + j]);
      for (int k = 0; k < K; ++k) {
        const float product = static_cast<float>(a.x[i * K + k]) * static_cast<float>(b.x[k * N + j]);
        sum = sum + product;
      }
      result.x[i * N + j] = sum;
    }
  for (int lane = 0; lane < 32; ++lane) std::memcpy(warp.post[lane]->d, &result, sizeof result);
}

inline Post wmma_post(cgcpu::detail::CompleteFunction complete, const char* what, const char* file, int line) {
  return cgcpu::detail::make_post(complete, what, 0xFFFFFFFFu, file, line);
}
}  // namespace detail

template <class Use, int M, int N, int K, class T, class Layout>
inline void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f, const T* memory, unsigned ldm,
                             const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  static_assert(!std::is_same<Use, accumulator>::value, "an accumulator load names its memory layout");
  typedef fragment<Use, M, N, K, T, Layout> F;
  detail::Post p = detail::wmma_post(
      &detail::complete_load<F, T, detail::IsRow<Layout>::value, false>,
      "wmma::load_matrix_sync", file, line);
  p.a = memory;
  p.d = &f;
  p.ldm = ldm;
  p.layout = detail::IsRow<Layout>::value ? 0 : 1;
  cgcpu::detail::warp_collective(p);
}

template <int M, int N, int K, class T>
inline void load_matrix_sync(fragment<accumulator, M, N, K, T, void>& f, const T* memory, unsigned ldm, layout_t layout,
                             const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  typedef fragment<accumulator, M, N, K, T, void> F;
  detail::Post p = detail::wmma_post(&detail::complete_load<F, T, true, true>, "wmma::load_matrix_sync", file, line);
  p.a = memory;
  p.d = &f;
  p.ldm = ldm;
  p.layout = layout;
  cgcpu::detail::warp_collective(p);
}

template <int M, int N, int K, class T>
inline void store_matrix_sync(T* memory, const fragment<accumulator, M, N, K, T, void>& f, unsigned ldm, layout_t layout,
                              const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  typedef fragment<accumulator, M, N, K, T, void> F;
  detail::Post p = detail::wmma_post(&detail::complete_store<F, T>, "wmma::store_matrix_sync", file, line);
  p.a = &f;
  p.d = memory;
  p.ldm = ldm;
  p.layout = layout;
  cgcpu::detail::warp_collective(p);
}

template <int M, int N, int K, class LayoutA, class LayoutB>
inline void mma_sync(fragment<accumulator, M, N, K, float, void>& d,
                     const fragment<matrix_a, M, N, K, __nv_bfloat16, LayoutA>& a,
                     const fragment<matrix_b, M, N, K, __nv_bfloat16, LayoutB>& b,
                     const fragment<accumulator, M, N, K, float, void>& c, const char* file = __builtin_FILE(),
                     int line = __builtin_LINE()) {
  typedef fragment<accumulator, M, N, K, float, void> D;
  typedef fragment<matrix_a, M, N, K, __nv_bfloat16, LayoutA> A;
  typedef fragment<matrix_b, M, N, K, __nv_bfloat16, LayoutB> B;
  detail::Post p = detail::wmma_post(&detail::complete_mma<D, A, B, D>, "wmma::mma_sync", file, line);
  p.a = &a;
  p.b = &b;
  p.c = &c;
  p.d = &d;
  cgcpu::detail::warp_collective(p);
}

}  // namespace wmma
}  // namespace nvcuda
