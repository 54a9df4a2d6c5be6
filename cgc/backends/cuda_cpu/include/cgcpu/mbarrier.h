// cuda_cpu: twins of the asynchronous-barrier primitives (templates/common.cuh.j2, "device
// primitives"): mbarrier.init, mbarrier.arrive, mbarrier.arrive.expect_tx, a wait on
// mbarrier.try_wait.parity, and cp.async.bulk (global to shared memory, completing its bytes on
// a barrier), as the PTX ISA defines them ("Parallel Synchronization and Communication
// Instructions: mbarrier", "Data Movement: cp.async.bulk").
//
// A barrier is a 64-bit word of shared memory; its state here (the phase, the arrivals pending
// of those expected each phase, the tx-count) is kept beside it, in the block's table, from its
// init. A phase completes when its arrivals are all in and its tx-count is back to zero: the
// barrier then flips its phase and expects its arrivals again. A bulk copy is made (its bytes
// written, the barrier's tx-count lowered by them) once the phase it belongs to has every
// arrival: the data is not there before (a thread that reads it without waiting reads what was
// there, and racecheck sees its read race the copy), and it is there when the phase completes.
// The wait for parity P returns once the phase of parity P has completed (the current phase's
// parity is not P: the wait for the phase before the first returns at once, as producers use
// it). A waiting thread sleeps until the barrier moves: threads that all wait, or wait on a
// barrier nobody will complete, are a deadlock, reported as a failed launch with each barrier's
// state. What the ISA leaves undefined is a fault: a barrier used before its init or not
// 8-byte aligned, a count outside [1, 2^20 - 1], more arrivals than a phase expects, more bytes
// completed than expected, a bulk copy that is not 16-byte aligned or a multiple of 16 bytes.
//
// Racecheck: an arrival releases the barrier's synchronisation object and a wait that returns
// acquires it, so what a thread wrote before arriving happens before what a waiter does after;
// the bulk copy's writes are the completing thread's, before its release.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "scheduler.h"

namespace cgcpu {
namespace detail {

constexpr std::uint32_t kMbarrierMaxCount = (1u << 20) - 1;

inline MbarrierState& mbarrier_state(Worker& w, const void* bar, const char* what, const char* file, int line,
                                     bool init = false) {
  if (reinterpret_cast<std::uintptr_t>(bar) % 8 != 0)
    fiber_fault(w, "%s (%s:%d): the barrier %p is not 8-byte aligned", what, file, line, bar);
  auto found = w.mbarriers.find(bar);
  if (found == w.mbarriers.end()) {
    if (!init) fiber_fault(w, "%s (%s:%d): the barrier %p was never initialised (mbarrier.init)", what, file, line, bar);
    found = w.mbarriers.emplace(bar, MbarrierState{}).first;
  }
  return found->second;
}

// The phase's bulk copies, once every arrival is in: taken from the barrier, its tx-count lowered
// by their bytes, to be made by the caller where racecheck sees them (make_copies).
inline std::vector<MbarrierState::Copy> mbarrier_due(MbarrierState& s) {
  std::vector<MbarrierState::Copy> due;
  if (s.pending != 0) return due;
  due.swap(s.copies);
  for (const MbarrierState::Copy& copy : due) s.tx -= copy.bytes;
  return due;
}

// This thread's writes (not hidden from racecheck), in words.
inline void mbarrier_make_copies(const std::vector<MbarrierState::Copy>& due) {
  for (const MbarrierState::Copy& copy : due) {
    const std::uint32_t* from = copy.from ? static_cast<const std::uint32_t*>(copy.from) : copy.staged.data();
    std::uint32_t* to = static_cast<std::uint32_t*>(copy.to);
    for (unsigned i = 0; i < copy.bytes / 4; ++i) to[i] = from[i];
  }
}

// Completes the phase if every arrival and every byte is in: the barrier flips, and its
// waiters wake (what this thread did, its copies included, happens before what they do next).
CGCPU_SHADOW_SKIP inline void mbarrier_complete(Worker& w, const void* bar, MbarrierState& s, const char* what,
                                                const char* file, int line) {
  if (s.pending != 0) return;
  if (s.tx < 0)
    fiber_fault(w, "%s (%s:%d): the barrier %p's phase completed %lld bytes more than it expected (expect_tx)", what,
                file, line, bar, static_cast<long long>(-s.tx));
  if (s.tx != 0) return;
  tsan_release(&s.tsan);
  s.phase ^= 1u;
  s.pending = s.expected;
  for (unsigned i = 0; i < w.threads; ++i) {
    Fiber& f = w.fibers[i];
    if (f.state == FiberState::AtMbarrier && f.mbarrier == bar) {
      f.state = FiberState::Ready;
      w.push(i);
    }
  }
}

// After a call changed the barrier: its due copies made (outside the bookkeeping), then the
// phase completed if it may be.
CGCPU_SHADOW_SKIP inline void mbarrier_settle(Worker& w, const void* bar, const char* what, const char* file,
                                              int line) {
  std::vector<MbarrierState::Copy> due;
  {
    FiberIgnore ignore(*w.current);
    due = mbarrier_due(mbarrier_state(w, bar, what, file, line));
  }
  mbarrier_make_copies(due);
  FiberIgnore ignore(*w.current);
  mbarrier_complete(w, bar, mbarrier_state(w, bar, what, file, line), what, file, line);
}

CGCPU_SHADOW_SKIP inline void mbarrier_arrive(void* bar, std::uint32_t bytes, const char* what, const char* file,
                                              int line) {
  Worker& w = device_worker(what);
  {
    FiberIgnore ignore(*w.current);
    MbarrierState& s = mbarrier_state(w, bar, what, file, line);
    if (s.pending == 0)
      fiber_fault(w, "%s (%s:%d): the barrier %p's phase has had all %u of its arrivals", what, file, line, bar,
                  s.expected);
    tsan_release(&s.tsan);
    s.tx += bytes;
    --s.pending;
  }
  mbarrier_settle(w, bar, what, file, line);
}

}  // namespace detail
}  // namespace cgcpu

// ---- the twins (names and arguments as in templates/common.cuh.j2) ---------------------------

// mbarrier.init.shared::cta.b64: phase 0, `count` arrivals expected each phase, tx-count 0.
inline void cg_mbarrier_init(unsigned long long* bar, unsigned count, const char* file = __builtin_FILE(),
                             int line = __builtin_LINE()) {
  using namespace cgcpu::detail;
  Worker& w = device_worker("mbarrier.init");
  FiberIgnore ignore(*w.current);
  if (count < 1 || count > kMbarrierMaxCount)
    fiber_fault(w, "mbarrier.init (%s:%d): count %u is outside [1, %u]", file, line, count, kMbarrierMaxCount);
  MbarrierState& s = mbarrier_state(w, bar, "mbarrier.init", file, line, true);
  s = MbarrierState{};
  s.expected = s.pending = count;
  *bar = 0;  // the word itself: opaque on a GPU
}

// mbarrier.arrive.shared::cta.b64: one arrival on the current phase.
inline void cg_mbarrier_arrive(unsigned long long* bar, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  cgcpu::detail::mbarrier_arrive(bar, 0, "mbarrier.arrive", file, line);
}

// mbarrier.arrive.expect_tx.shared::cta.b64: the phase expects `bytes` more, then one arrival.
inline void cg_mbarrier_arrive_expect_tx(unsigned long long* bar, unsigned bytes, const char* file = __builtin_FILE(),
                                         int line = __builtin_LINE()) {
  if (bytes > cgcpu::detail::kMbarrierMaxCount) {
    cgcpu::detail::Worker& w = cgcpu::detail::device_worker("mbarrier.arrive.expect_tx");
    cgcpu::detail::fiber_fault(w, "mbarrier.arrive.expect_tx (%s:%d): %u bytes is past the tx-count's %u", file,
                               line, bytes, cgcpu::detail::kMbarrierMaxCount);
  }
  cgcpu::detail::mbarrier_arrive(bar, bytes, "mbarrier.arrive.expect_tx", file, line);
}

// mbarrier.try_wait.parity.shared::cta.b64 until it succeeds: the phase of parity `parity` has
// completed.
inline void cg_mbarrier_wait(unsigned long long* bar, unsigned parity, const char* file = __builtin_FILE(),
                             int line = __builtin_LINE()) {
  using namespace cgcpu::detail;
  Worker& w = device_worker("mbarrier.try_wait.parity");
  Fiber& self = *w.current;
  FiberIgnore ignore(self);
  for (;;) {
    MbarrierState& s = mbarrier_state(w, bar, "mbarrier.try_wait.parity", file, line);
    if (s.phase != (parity & 1u)) {
      tsan_acquire(&s.tsan);
      return;
    }
    self.state = FiberState::AtMbarrier;
    self.mbarrier = bar;
    self.mbarrier_parity = parity & 1u;
    self.what = "mbarrier.try_wait.parity";
    self.file = file;
    self.line = line;
    suspend(w);
    self.mbarrier = nullptr;
  }
}

// cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes: `bytes` from global to
// shared memory, completing them on `bar` (both addresses 16-byte aligned, bytes a multiple of 16).
inline void cg_bulk_copy_to_shared(void* shared, const void* global, unsigned bytes, unsigned long long* bar,
                                   const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  using namespace cgcpu::detail;
  Worker& w = device_worker("cp.async.bulk");
  {
    FiberIgnore ignore(*w.current);
    if (reinterpret_cast<std::uintptr_t>(shared) % 16 != 0 || reinterpret_cast<std::uintptr_t>(global) % 16 != 0 ||
        bytes % 16 != 0 || bytes == 0)
      fiber_fault(w, "cp.async.bulk (%s:%d): addresses %p and %p and %u bytes are not all multiples of 16", file,
                  line, shared, global, bytes);
    mbarrier_state(w, bar, "cp.async.bulk", file, line).copies.push_back(MbarrierState::Copy{shared, global, bytes, {}});
  }
  mbarrier_settle(w, bar, "cp.async.bulk", file, line);
}
