// cuda_cpu: warp-level primitives. Each is a rendezvous of the lanes its mask names (lanes
// that have exited are not waited for): every lane posts its operand, the last to arrive
// computes every lane's result at once, and all continue. Lanes of a warp are the threads
// whose linear index (x + y * blockDim.x + z * blockDim.x * blockDim.y) / 32 is equal.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "scheduler.h"

namespace cgcpu {
namespace detail {

enum ShuffleMode { kShuffleIndex, kShuffleUp, kShuffleDown, kShuffleXor };

// PTX shfl.sync: c = ((32 - width) << 8) | clamp; clamp is 0 for .up, 31 otherwise.
template <int Mode>
CGCPU_SHADOW_SKIP inline void complete_shuffle(Worker&, WarpState& warp, std::uint32_t lanes) {
  for (std::uint32_t m = lanes; m != 0; m &= m - 1) {
    const int lane = __builtin_ctz(m);
    const Post& p = *warp.post[lane];
    const int segment = (32 - p.width) & 31;  // the bits of the lane that name its segment
    const int clamp = Mode == kShuffleUp ? 0 : 31;
    const int b = p.arg & 31;
    const int min_lane = lane & segment;
    const int max_lane = min_lane | (clamp & ~segment);
    int j = lane;
    bool valid = true;
    switch (Mode) {
      case kShuffleUp: j = lane - b; valid = j >= max_lane; break;
      case kShuffleDown: j = lane + b; valid = j <= max_lane; break;
      case kShuffleXor: j = lane ^ b; valid = j <= max_lane; break;
      default: j = min_lane | (b & ~segment); valid = j <= max_lane; break;
    }
    if (!valid) j = lane;
    // A source lane outside the collective (exited, or not in the mask): undefined; all ones.
    warp.result[lane] = ((lanes >> j) & 1u) ? warp.post[j]->value : ~static_cast<std::uint64_t>(0);
  }
}

CGCPU_SHADOW_SKIP inline void complete_ballot(Worker&, WarpState& warp, std::uint32_t lanes) {
  std::uint64_t ballot = 0;
  for (std::uint32_t m = lanes; m != 0; m &= m - 1) {
    const int lane = __builtin_ctz(m);
    if (warp.post[lane]->value != 0) ballot |= 1u << lane;
  }
  for (std::uint32_t m = lanes; m != 0; m &= m - 1) warp.result[__builtin_ctz(m)] = ballot;
}

CGCPU_SHADOW_SKIP inline void complete_any(Worker&, WarpState& warp, std::uint32_t lanes) {
  bool any = false;
  for (std::uint32_t m = lanes; m != 0; m &= m - 1) any = any || warp.post[__builtin_ctz(m)]->value != 0;
  for (std::uint32_t m = lanes; m != 0; m &= m - 1) warp.result[__builtin_ctz(m)] = any;
}

CGCPU_SHADOW_SKIP inline void complete_all(Worker&, WarpState& warp, std::uint32_t lanes) {
  bool all = true;
  for (std::uint32_t m = lanes; m != 0; m &= m - 1) all = all && warp.post[__builtin_ctz(m)]->value != 0;
  for (std::uint32_t m = lanes; m != 0; m &= m - 1) warp.result[__builtin_ctz(m)] = all;
}

CGCPU_SHADOW_SKIP inline void complete_sync(Worker&, WarpState&, std::uint32_t) {}

template <int Op>  // 0 add, 1 min, 2 max, 3 and, 4 or, 5 xor (unsigned 32-bit; signed min/max: 6, 7)
CGCPU_SHADOW_SKIP inline void complete_reduce(Worker&, WarpState& warp, std::uint32_t lanes) {
  std::uint32_t acc = static_cast<std::uint32_t>(warp.post[__builtin_ctz(lanes)]->value);
  for (std::uint32_t m = lanes & (lanes - 1); m != 0; m &= m - 1) {
    const std::uint32_t v = static_cast<std::uint32_t>(warp.post[__builtin_ctz(m)]->value);
    switch (Op) {
      case 0: acc += v; break;
      case 1: acc = v < acc ? v : acc; break;
      case 2: acc = v > acc ? v : acc; break;
      case 3: acc &= v; break;
      case 4: acc |= v; break;
      case 5: acc ^= v; break;
      case 6: acc = static_cast<int>(v) < static_cast<int>(acc) ? v : acc; break;
      default: acc = static_cast<int>(v) > static_cast<int>(acc) ? v : acc; break;
    }
  }
  for (std::uint32_t m = lanes; m != 0; m &= m - 1) warp.result[__builtin_ctz(m)] = acc;
}

CGCPU_SHADOW_SKIP inline Post make_post(CompleteFunction complete, const char* what, unsigned mask, const char* file, int line) {
  Post p;
  std::memset(&p, 0, sizeof p);
  p.complete = complete;
  p.what = what;
  p.mask = mask;
  p.width = 32;
  p.file = file;
  p.line = line;
  return p;
}

template <class T>
inline std::uint64_t to_bits(T value) {
  static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8, "a shuffled value is at most 8 bytes");
  std::uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof value);
  return bits;
}
template <class T>
inline T from_bits(std::uint64_t bits) {
  T value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

template <int Mode, class T>
inline T shuffle(const char* what, unsigned mask, T var, int arg, int width, const char* file, int line) {
  if (width < 1 || width > 32 || (width & (width - 1)) != 0) {
    Worker& w = device_worker(what);
    fiber_fault(w, "%s (%s:%d) with width %d: not a power of 2 from 1 to 32", what, file, line, width);
  }
  Post p = make_post(&complete_shuffle<Mode>, what, mask, file, line);
  p.value = to_bits(var);
  p.arg = arg;
  p.width = width;
  return from_bits<T>(warp_collective(p));
}

template <class T>
struct Shufflable
    : std::integral_constant<bool, std::is_trivially_copyable<T>::value && (sizeof(T) <= 8) &&
                                       !std::is_pointer<T>::value> {};

}  // namespace detail
}  // namespace cgcpu

template <class T, typename std::enable_if<cgcpu::detail::Shufflable<T>::value, int>::type = 0>
inline T __shfl_sync(unsigned mask, T var, int srcLane, int width = 32, const char* file = __builtin_FILE(),
                     int line = __builtin_LINE()) {
  return cgcpu::detail::shuffle<cgcpu::detail::kShuffleIndex>("__shfl_sync", mask, var, srcLane, width, file, line);
}
template <class T, typename std::enable_if<cgcpu::detail::Shufflable<T>::value, int>::type = 0>
inline T __shfl_up_sync(unsigned mask, T var, unsigned int delta, int width = 32,
                        const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return cgcpu::detail::shuffle<cgcpu::detail::kShuffleUp>("__shfl_up_sync", mask, var, static_cast<int>(delta),
                                                           width, file, line);
}
template <class T, typename std::enable_if<cgcpu::detail::Shufflable<T>::value, int>::type = 0>
inline T __shfl_down_sync(unsigned mask, T var, unsigned int delta, int width = 32,
                          const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return cgcpu::detail::shuffle<cgcpu::detail::kShuffleDown>("__shfl_down_sync", mask, var,
                                                             static_cast<int>(delta), width, file, line);
}
template <class T, typename std::enable_if<cgcpu::detail::Shufflable<T>::value, int>::type = 0>
inline T __shfl_xor_sync(unsigned mask, T var, int laneMask, int width = 32, const char* file = __builtin_FILE(),
                         int line = __builtin_LINE()) {
  return cgcpu::detail::shuffle<cgcpu::detail::kShuffleXor>("__shfl_xor_sync", mask, var, laneMask, width, file,
                                                            line);
}

// The one warp collective that orders memory (racecheck: the lanes' accesses before it happen
// before theirs after it).
inline void __syncwarp(unsigned mask = 0xFFFFFFFFu, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  cgcpu::detail::Post p = cgcpu::detail::make_post(&cgcpu::detail::complete_sync, "__syncwarp", mask, file, line);
  p.orders_memory = 1;
  cgcpu::detail::warp_collective(p);
}

inline unsigned __ballot_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
  cgcpu::detail::Post p = cgcpu::detail::make_post(&cgcpu::detail::complete_ballot, "__ballot_sync", mask, file, line);
  p.value = predicate != 0;
  return static_cast<unsigned>(cgcpu::detail::warp_collective(p));
}
inline int __any_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  cgcpu::detail::Post p = cgcpu::detail::make_post(&cgcpu::detail::complete_any, "__any_sync", mask, file, line);
  p.value = predicate != 0;
  return static_cast<int>(cgcpu::detail::warp_collective(p));
}
inline int __all_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  cgcpu::detail::Post p = cgcpu::detail::make_post(&cgcpu::detail::complete_all, "__all_sync", mask, file, line);
  p.value = predicate != 0;
  return static_cast<int>(cgcpu::detail::warp_collective(p));
}

#define CGCPU_REDUCE(name, op, T)                                                                         \
  inline T name(unsigned mask, T value, const char* file = __builtin_FILE(), int line = __builtin_LINE()) { \
    cgcpu::detail::Post p = cgcpu::detail::make_post(&cgcpu::detail::complete_reduce<op>, #name, mask, file, line); \
    p.value = static_cast<std::uint32_t>(value);                                                         \
    return static_cast<T>(cgcpu::detail::warp_collective(p));                                             \
  }
CGCPU_REDUCE(__reduce_add_sync, 0, unsigned)
CGCPU_REDUCE(__reduce_min_sync, 1, unsigned)
CGCPU_REDUCE(__reduce_max_sync, 2, unsigned)
CGCPU_REDUCE(__reduce_and_sync, 3, unsigned)
CGCPU_REDUCE(__reduce_or_sync, 4, unsigned)
CGCPU_REDUCE(__reduce_xor_sync, 5, unsigned)
inline int __reduce_add_sync(unsigned mask, int value, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return static_cast<int>(__reduce_add_sync(mask, static_cast<unsigned>(value), file, line));
}
CGCPU_REDUCE(__reduce_min_sync, 6, int)
CGCPU_REDUCE(__reduce_max_sync, 7, int)
#undef CGCPU_REDUCE

// Lanes of this warp that have not exited. (On a GPU, the lanes converged with this one at
// this point: the emulator has no notion of convergence; README.md.)
inline unsigned __activemask() {
  cgcpu::detail::Worker& w = cgcpu::detail::device_worker("__activemask");
  const cgcpu::detail::WarpState& warp = w.warps[w.current->linear / 32];
  return warp.present & ~warp.exited;
}
