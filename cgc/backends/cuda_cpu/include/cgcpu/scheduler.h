// cuda_cpu: kernel launches. Every CUDA thread is a fiber; a block's fibers run cooperatively
// on one OS worker thread, switching only at barriers and warp collectives; the blocks of a
// launch are spread over the worker pool and run in parallel. A launch is an op of its stream
// (stream.h): on the legacy default stream it has run when the launch returns.
#pragma once

#include <algorithm>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include <pthread.h>

#include "fiber.h"
#include "linkage.h"
#include "state.h"
#include "stream.h"
#include "vector_types.h"

namespace cgcpu {
namespace detail {

// ---- what device code reads: per fiber (threadIdx) and per block (the rest) ---------------
inline thread_local uint3 tls_thread_idx{0, 0, 0};
inline thread_local uint3 tls_block_idx{0, 0, 0};
inline thread_local dim3 tls_block_dim{1, 1, 1};
inline thread_local dim3 tls_grid_dim{1, 1, 1};
inline thread_local unsigned char* tls_dynamic_shared = nullptr;
inline thread_local std::size_t tls_dynamic_shared_bytes = 0;

// ---- a launch, type-erased -------------------------------------------------------------
struct LaunchInfo {
  const char* name;
  dim3 grid, block;
  std::size_t shared;
  void (*invoke)(const void* self);  // runs the kernel body in the current fiber
  const void* self;
  std::uint64_t serial;  // launch number, for the scheduling seed
};

// ---- warp collectives --------------------------------------------------------------------
struct WarpState;
typedef void (*CompleteFunction)(Worker& w, WarpState& warp, std::uint32_t lanes);

// What a lane brings to a collective. `complete` identifies the operation (lanes of one
// collective must agree on it and on the mask) and computes every lane's result at once.
struct Post {
  CompleteFunction complete;
  const char* what;
  std::uint32_t mask;
  int width;
  std::uint64_t value;
  int arg;
  const void* a;
  const void* b;
  const void* c;
  void* d;
  unsigned ldm;
  int layout;
  const char* file;
  int line;
  int orders_memory;  // __syncwarp: the lanes' accesses before it happen before those after it
};

struct WarpState {
  std::uint32_t present = 0;  // lanes that exist (a last, partial warp has fewer)
  std::uint32_t exited = 0;
  std::uint32_t posted = 0;   // lanes waiting in a collective (their post[] is valid)
  unsigned first = 0;         // linear index of lane 0
  const Post* post[32];      // each waiting lane's operands, on its own stack
  std::uint64_t result[32];
  unsigned sync_generation = 0;  // __syncwarp completions (racecheck: which sync object)
};

enum class FiberState : unsigned char { Ready, Running, AtBarrier, AtWarp, AtMbarrier, Exited };

struct Fiber {
  Context context;
  char* stack = nullptr;
  std::size_t stack_size = 0;
  uint3 index{0, 0, 0};
  unsigned linear = 0;
  FiberState state = FiberState::Ready;
  const char* what = nullptr;  // where it waits
  const char* file = nullptr;
  int line = 0;
  int tsan_ignores = 0;  // racecheck: the emulator's bookkeeping scopes this fiber is inside
  // cp.async (ptx.h): the copies this thread issued and has not yet waited for, each with its
  // group (the number of commit_groups before it), and the groups committed so far.
  struct AsyncCopy {
    void* to;
    const void* from;
    unsigned bytes;
    unsigned group;
  };
  std::vector<AsyncCopy> async_copies;
  unsigned async_groups = 0;
  // mbarrier.h: the barrier this thread waits on (AtMbarrier), and for which phase parity.
  const void* mbarrier = nullptr;
  unsigned mbarrier_parity = 0;
  // wgmma.h: the wgmma.mma_async this thread issued and no wgmma.wait_group has completed yet,
  // each with its group (the commit_groups before it), and the groups committed so far.
  struct WgmmaOp {
    float* d;                  // the thread's accumulator registers (n / 2 floats)
    std::vector<float> held;   // what they held at issue (or after a product before this one made them)
    int n;                     // the N of m64nNk16
    bool a_in_registers;       // the .rs form: A from the warpgroup's registers
    unsigned a[4];             // the .rs form: this thread's A registers, as issued
    unsigned long long a_descriptor, b_descriptor;
    int scale_d, transpose_a, transpose_b;
    unsigned group;
    const char* file;
    int line;
  };
  std::vector<WgmmaOp> wgmma_ops;
  unsigned wgmma_groups = 0;
};

// mbarrier.h: an asynchronous barrier's state (the block's table holds one per barrier, from
// its mbarrier.init): its phase, the arrivals it expects each phase and those still to come,
// its tx-count, the bulk copies of its phase not yet made, and its synchronisation object for
// racecheck.
struct MbarrierState {
  struct Copy {
    void* to;
    const void* from;  // null: the bytes are `staged` (a tensor copy, gathered when issued)
    unsigned bytes;
    std::vector<std::uint32_t> staged;
  };
  unsigned phase = 0;
  unsigned expected = 0, pending = 0;
  long long tx = 0;
  std::vector<Copy> copies;
  char tsan = 0;
};

// The emulator's bookkeeping in a CUDA thread (racecheck): hidden from TSan, and counted, so
// that a thread a fault abandons inside it can be cleaned up (run_block).
struct FiberIgnore {
  CGCPU_SHADOW_SKIP explicit FiberIgnore(Fiber& fiber) : fiber(fiber) {
    tsan_ignore_begin();
    ++fiber.tsan_ignores;
  }
  CGCPU_SHADOW_SKIP ~FiberIgnore() {
    --fiber.tsan_ignores;
    tsan_ignore_end();
  }
  FiberIgnore(const FiberIgnore&) = delete;
  FiberIgnore& operator=(const FiberIgnore&) = delete;
  Fiber& fiber;
};

// ---- one per OS thread: its fibers and the block it runs ------------------------------------
struct Worker {
  Context scheduler;
  const void* scheduler_stack = nullptr;
  std::size_t scheduler_stack_size = 0;
  StackRegion stacks;
  std::vector<Fiber> fibers;
  std::vector<WarpState> warps;
  std::vector<unsigned> queue;  // ready fibers, a ring of capacity fibers.size()
  std::size_t queue_head = 0, queue_count = 0;
  std::uint64_t rng = 0;  // non-zero: random order

  const LaunchInfo* launch = nullptr;
  unsigned threads = 0, exited = 0;
  Fiber* current = nullptr;
  // the block barrier
  unsigned arrived = 0;
  const char* barrier_what = nullptr;
  const char* barrier_file = nullptr;
  int barrier_line = 0;
  int barrier_count = 0, barrier_result = 0;
  unsigned barrier_generation = 0;  // completed barriers (racecheck: which sync object)

  // ThreadSanitizer's synchronisation objects (only their addresses matter; README.md,
  // "Racecheck"): block start (the worker releases, each CUDA thread acquires as it starts),
  // block end (each CUDA thread releases as it exits, the worker acquires), the block barrier
  // and each warp's __syncwarp (arrivals release, departures acquire). A barrier's object
  // alternates with its generation: a thread that has left barrier g and arrived at g + 1
  // must not hand its new accesses to a thread still leaving g.
  char tsan_block_start = 0, tsan_block_end = 0;
  char tsan_barrier[2] = {0, 0};
  char tsan_warp[32][2] = {};

  std::map<const void*, MbarrierState> mbarriers;  // this block's (mbarrier.h)

  bool fault = false;
  char message[8192];

  Worker() {
    pthread_attr_t attributes;
    if (pthread_getattr_np(pthread_self(), &attributes) == 0) {
      void* low = nullptr;
      std::size_t size = 0;
      if (pthread_attr_getstack(&attributes, &low, &size) == 0) {
        scheduler_stack = low;
        scheduler_stack_size = size;
      }
      pthread_attr_destroy(&attributes);
    }
  }

  CGCPU_SHADOW_SKIP void push(unsigned fiber) {
    std::size_t tail = queue_head + queue_count;
    if (tail >= queue.size()) tail -= queue.size();
    queue[tail] = fiber;
    ++queue_count;
  }
  CGCPU_SHADOW_SKIP Fiber* pop() {
    if (queue_count == 0) return nullptr;
    if (rng != 0 && queue_count > 1) {  // random order: swap a random entry to the head
      rng ^= rng << 13;
      rng ^= rng >> 7;
      rng ^= rng << 17;
      const std::size_t pick = (queue_head + rng % queue_count) % queue.size();
      std::swap(queue[pick], queue[queue_head]);
    }
    const unsigned fiber = queue[queue_head];
    if (++queue_head == queue.size()) queue_head = 0;
    --queue_count;
    return &fibers[fiber];
  }
};

CGCPU_SHADOW_SKIP inline Worker& this_worker() {
  static thread_local Worker worker;
  return worker;
}

// ---- fiber stack overflow -------------------------------------------------------------
// A CUDA thread that overflows its fiber stack hits a guard page. Unless the program has its
// own SIGSEGV handler (ASan has one, and reports the overflow itself), a handler on an
// alternate signal stack names the kernel and CG_CPU_STACK_KIB, then lets the signal kill the
// process as before.
CGCPU_RUNTIME void append_text(char* buffer, std::size_t size, std::size_t& used, const char* text) {
  while (*text != '\0' && used + 1 < size) buffer[used++] = *text++;
  buffer[used] = '\0';
}

CGCPU_RUNTIME void overflow_handler(int signal_number, siginfo_t* info, void*) {
  Worker* w = tls_worker;
  if (w != nullptr && info != nullptr && w->stacks.in_guard(info->si_addr)) {
    char digits[24];
    int n = 23;
    digits[n] = '\0';
    std::size_t kib = w->stacks.size() / 1024;
    do {
      digits[--n] = static_cast<char>('0' + kib % 10);
      kib /= 10;
    } while (kib != 0 && n > 0);
    char text[512];
    std::size_t used = 0;
    append_text(text, sizeof text, used, "cuda_cpu: kernel ");
    append_text(text, sizeof text, used, w->launch != nullptr ? w->launch->name : "?");
    append_text(text, sizeof text, used, ": a CUDA thread overflowed its fiber stack; set CG_CPU_STACK_KIB above ");
    append_text(text, sizeof text, used, digits + n);
    append_text(text, sizeof text, used, "\n");
    if (write(2, text, used) < 0) {
    }
  }
  signal(signal_number, SIG_DFL);  // the faulting access repeats and ends the process
}

inline void prepare_overflow_report() {
#if !CGCPU_ASAN
  static const bool installed = [] {
    struct sigaction old;
    if (sigaction(SIGSEGV, nullptr, &old) != 0) return false;
    if ((old.sa_flags & SA_SIGINFO) != 0 || old.sa_handler != SIG_DFL) return false;  // not ours to replace
    struct sigaction mine;
    std::memset(&mine, 0, sizeof mine);
    mine.sa_sigaction = &overflow_handler;
    mine.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&mine.sa_mask);
    return sigaction(SIGSEGV, &mine, nullptr) == 0;
  }();
  if (!installed) return;
  // This thread needs an alternate stack: the overflowing fiber's own is exhausted.
  static thread_local std::unique_ptr<char[]> alternate;
  if (alternate == nullptr) {
    stack_t current;
    if (sigaltstack(nullptr, &current) == 0 && (current.ss_flags & SS_DISABLE) != 0) {
      const std::size_t size = 64 * 1024;
      alternate.reset(new char[size]);
      stack_t mine;
      mine.ss_sp = alternate.get();
      mine.ss_size = size;
      mine.ss_flags = 0;
      if (sigaltstack(&mine, nullptr) != 0) alternate.reset();
    }
  }
#endif
}

// ---- messages ------------------------------------------------------------------------------
CGCPU_RUNTIME std::string strformat(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
CGCPU_RUNTIME std::string strformat(const char* fmt, ...) {
  char buffer[1024];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buffer, sizeof buffer, fmt, args);
  va_end(args);
  return buffer;
}

CGCPU_RUNTIME std::string thread_text(const Worker& w, unsigned linear) {
  const dim3 b = w.launch->block;
  const unsigned x = linear % b.x, y = linear / b.x % b.y, z = linear / (b.x * b.y);
  if (b.y == 1 && b.z == 1) return strformat("%u", x);
  return strformat("(%u,%u,%u)", x, y, z);
}

// "threads 0-31, 64" from a sorted list of linear indices.
CGCPU_RUNTIME std::string thread_list(const Worker& w, const std::vector<unsigned>& linear) {
  std::string text = linear.size() == 1 ? "thread " : "threads ";
  for (std::size_t i = 0; i < linear.size();) {
    std::size_t j = i;
    while (j + 1 < linear.size() && linear[j + 1] == linear[j] + 1) ++j;
    if (i > 0) text += ", ";
    text += thread_text(w, linear[i]);
    if (j > i) text += "-" + thread_text(w, linear[j]);
    i = j + 1;
  }
  return text;
}

CGCPU_RUNTIME std::string block_text(const Worker& w) {
  const LaunchInfo& l = *w.launch;
  return strformat("kernel %s, block (%u,%u,%u) of grid (%u,%u,%u), blockDim (%u,%u,%u)", l.name,
                tls_block_idx.x, tls_block_idx.y, tls_block_idx.z, l.grid.x, l.grid.y, l.grid.z,
                l.block.x, l.block.y, l.block.z);
}

// ---- switching -----------------------------------------------------------------------------
CGCPU_SHADOW_SKIP inline void enter(Worker& w, Fiber& to) {
  w.current = &to;
  to.state = FiberState::Running;
  tls_thread_idx = to.index;
}

// The current fiber waits (its state says for what): run the next ready fiber, or return to
// the scheduler when none is ready (all done, or a deadlock).
CGCPU_SHADOW_SKIP __attribute__((noinline)) inline void suspend(Worker& w) {
  Fiber* self = w.current;
  Fiber* next = w.pop();
  if (next != nullptr) {
    enter(w, *next);
    context_switch(self->context, next->context, next->stack, next->stack_size);
  } else {
    w.current = nullptr;
    context_switch(self->context, w.scheduler, w.scheduler_stack, w.scheduler_stack_size);
  }
  // resumed: whoever switched here has already set w.current and threadIdx
}

// A fault inside a fiber: the message (printf-style) goes to the scheduler, and the block is
// abandoned. No heap memory may be left owned by the abandoned fiber's stack, so callers format
// into char buffers, never into std::string temporaries that would outlive this call.
[[noreturn]] __attribute__((noinline, format(printf, 2, 3))) CGCPU_NO_TSAN inline void fiber_fault(Worker& w, const char* fmt, ...) {
  tsan_ignore_begin();  // this fiber is abandoned; run_block gives its slot a fresh TSan fiber
  if (w.current != nullptr) ++w.current->tsan_ignores;
  int used;
  {
    const std::string where = block_text(w) +
        (w.current != nullptr ? ", thread " + thread_text(w, w.current->linear) : std::string()) + ": ";
    used = std::snprintf(w.message, sizeof w.message, "%s", where.c_str());
  }
  if (used < 0 || static_cast<std::size_t>(used) >= sizeof w.message) used = 0;
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(w.message + used, sizeof w.message - used, fmt, args);
  va_end(args);
  w.fault = true;
  Fiber* self = w.current;
  w.current = nullptr;
  context_leave(self->context, w.scheduler, w.scheduler_stack, w.scheduler_stack_size);
}

CGCPU_SHADOW_SKIP inline Worker& device_worker(const char* what) {
  Worker* w = tls_worker;
  if (w == nullptr || w->current == nullptr) {
    std::fprintf(stderr, "cuda_cpu: %s called outside a kernel\n", what);
    std::abort();
  }
  return *w;
}

// ---- block barrier -----------------------------------------------------------------------
// All threads of the block must arrive at the same barrier (same call site, same kind); a
// thread arriving at a different one is a fault, and threads that exited or wait elsewhere
// while others wait here are a deadlock, reported when no fiber can run.
CGCPU_SHADOW_SKIP __attribute__((noinline)) inline int block_barrier(const char* what, int predicate, const char* file,
                                                   int line) {
  __asm__ volatile("" ::: "memory");
  Worker& w = device_worker(what);
  Fiber& self = *w.current;
  FiberIgnore ignore(self);
  char* const sync = &w.tsan_barrier[w.barrier_generation & 1];
  tsan_release(sync);  // this thread's accesses so far happen before every thread's after it
  if (w.arrived == 0) {
    w.barrier_what = what;
    w.barrier_file = file;
    w.barrier_line = line;
    w.barrier_count = 0;
  } else if (w.barrier_line != line ||
             (w.barrier_what != what && std::strcmp(w.barrier_what, what) != 0) ||
             (w.barrier_file != file && std::strcmp(w.barrier_file, file) != 0)) {
    char list[1024];
    {
      std::vector<unsigned> waiting;
      for (const Fiber& f : w.fibers)
        if (f.linear < w.threads && f.state == FiberState::AtBarrier) waiting.push_back(f.linear);
      std::snprintf(list, sizeof list, "%s", thread_list(w, waiting).c_str());
    }
    fiber_fault(w, "divergent barriers: this thread reached %s (%s:%d) while %s wait at %s (%s:%d)", what, file,
                line, list, w.barrier_what, w.barrier_file, w.barrier_line);
  }
  w.barrier_count += predicate != 0;
  ++w.arrived;
  if (w.arrived == w.threads) {
    w.arrived = 0;
    ++w.barrier_generation;
    w.barrier_result = w.barrier_count;
    for (unsigned i = 0; i < w.threads; ++i) {
      Fiber& f = w.fibers[i];
      if (f.state == FiberState::AtBarrier) {
        f.state = FiberState::Ready;
        w.push(i);
      }
    }
  } else {
    self.state = FiberState::AtBarrier;
    self.what = what;
    self.file = file;
    self.line = line;
    suspend(w);
  }
  tsan_acquire(sync);
  __asm__ volatile("" ::: "memory");
  return w.barrier_result;
}

// ---- warp collectives ----------------------------------------------------------------------
// Completes the collective of `mask` if every lane it names that has not exited has posted it.
// Lanes that exited (or do not exist) are not waited for: __syncwarp counts them as arrived,
// and a shuffle that reads one gets an undefined value (all bits set).
CGCPU_SHADOW_SKIP inline bool try_complete(Worker& w, WarpState& warp, std::uint32_t mask) {
  const std::uint32_t need = mask & warp.present & ~warp.exited;
  if (need == 0 || (warp.posted & need) != need) return false;
  for (std::uint32_t m = need; m != 0; m &= m - 1) {
    if (warp.post[__builtin_ctz(m)]->mask != mask) return false;  // some lane is in another one
  }
  const Post& lead = *warp.post[__builtin_ctz(need)];
  for (std::uint32_t m = need; m != 0; m &= m - 1) {
    const Post& p = *warp.post[__builtin_ctz(m)];
    if (p.complete != lead.complete) {
      fiber_fault(w, "mismatched warp collectives on mask 0x%08x: lane %d is at %s (%s:%d), lane %d at %s (%s:%d)",
                  mask, __builtin_ctz(need), lead.what, lead.file, lead.line, __builtin_ctz(m), p.what, p.file,
                  p.line);
    }
  }
  lead.complete(w, warp, need);
  if (lead.orders_memory) ++warp.sync_generation;
  warp.posted &= ~need;
  for (std::uint32_t m = need; m != 0; m &= m - 1) {
    const unsigned fiber = warp.first + static_cast<unsigned>(__builtin_ctz(m));
    Fiber& f = w.fibers[fiber];
    if (f.state == FiberState::AtWarp) {
      f.state = FiberState::Ready;
      w.push(fiber);
    }
  }
  return true;
}

// Posts this lane's part of a collective, waits for the others, returns this lane's result.
// Racecheck: only __syncwarp orders memory (a shuffle, vote or WMMA operation does not, as on a
// GPU); the operands and results travel through the emulator's bookkeeping, hidden from TSan.
CGCPU_SHADOW_SKIP __attribute__((noinline)) inline std::uint64_t warp_collective(const Post& post) {
  __asm__ volatile("" ::: "memory");
  Worker& w = device_worker(post.what);
  Fiber& self = *w.current;
  FiberIgnore ignore(self);
  const unsigned lane = self.linear % 32;
  WarpState& warp = w.warps[self.linear / 32];
  char* const sync = post.orders_memory ? &w.tsan_warp[self.linear / 32][warp.sync_generation & 1] : nullptr;
  if (sync != nullptr) tsan_release(sync);
  if (((post.mask >> lane) & 1u) == 0)
    fiber_fault(w, "%s (%s:%d) with mask 0x%08x, which does not include this lane %u", post.what, post.file,
                post.line, post.mask, lane);
  warp.post[lane] = &post;  // lives on this lane's stack until it resumes
  warp.posted |= 1u << lane;
  if (!try_complete(w, warp, post.mask)) {
    self.state = FiberState::AtWarp;
    self.what = post.what;
    self.file = post.file;
    self.line = post.line;
    suspend(w);
  }
  if (sync != nullptr) tsan_acquire(sync);
  __asm__ volatile("" ::: "memory");
  return warp.result[lane];
}

#if CGCPU_TSAN
extern "C" {
void __tsan_read2(void* address);
void __tsan_read4(void* address);
void __tsan_write2(void* address);
void __tsan_write4(void* address);
}
#endif

// Racecheck: the memory accesses a WMMA load or store makes for the whole warp (the last lane
// to arrive does the copy, hidden from TSan) are declared to TSan afterwards, each element's by
// the lane that owns it in the fragment: lane (r % 8) * 4 + (c % 8) / 2 for element (r, c) of
// the tile, the accumulator layout of mma.m16n8k16. A load and a store of one tile thus agree on
// which lane touches each element, as on a GPU (a warp may load a tile, multiply and store it
// back with no __syncwarp), while an element one lane stored and another lane reads (or a tile
// the warp loads while another lane writes it) is a race unless a barrier separates them.
CGCPU_NO_TSAN inline void tsan_tile_access(Worker& w, const WarpState& warp, const void* memory, std::size_t ldm,
                                           bool row, int rows, int cols, std::size_t element, bool write) {
#if CGCPU_TSAN
  void* const self = w.current->context.tsan;
  char* const base = static_cast<char*>(const_cast<void*>(memory));
  for (int lane = 0; lane < 32; ++lane) {
    __tsan_switch_to_fiber(w.fibers[warp.first + lane].context.tsan, __tsan_switch_to_fiber_no_sync);
    __tsan_ignore_thread_end();  // the lane waits in the collective, ignoring: check these
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c) {
        if ((r % 8) * 4 + (c % 8) / 2 != lane) continue;
        const std::size_t at = row ? static_cast<std::size_t>(r) * ldm + c : static_cast<std::size_t>(c) * ldm + r;
        void* const address = base + at * element;
        if (element == 2)
          write ? __tsan_write2(address) : __tsan_read2(address);
        else
          write ? __tsan_write4(address) : __tsan_read4(address);
      }
    __tsan_ignore_thread_begin();
  }
  __tsan_switch_to_fiber(self, __tsan_switch_to_fiber_no_sync);
#else
  (void)w, (void)warp, (void)memory, (void)ldm, (void)row, (void)rows, (void)cols, (void)element, (void)write;
#endif
}

CGCPU_SHADOW_SKIP inline void require_whole_warp(Worker& w, const WarpState& warp, std::uint32_t lanes, const Post& p) {
  if (lanes != 0xFFFFFFFFu || warp.present != 0xFFFFFFFFu) {
    fiber_fault(w, "%s (%s:%d) needs all 32 lanes of the warp; lanes present and not exited: 0x%08x", p.what,
                p.file, p.line, lanes);
  }
}

// ---- the fibers' lives -------------------------------------------------------------------
[[noreturn]] CGCPU_NO_TSAN inline void fiber_finish(Worker& w) {
  tsan_ignore_begin();
  tsan_release(&w.tsan_block_end);  // kernel end: everything this thread did, to the worker
  Fiber* self = w.current;
  ++self->tsan_ignores;
  self->state = FiberState::Exited;
  ++w.exited;
  WarpState& warp = w.warps[self->linear / 32];
  warp.exited |= 1u << (self->linear % 32);
  // Lanes waiting for this one in a __syncwarp (or a shuffle) may now complete.
  for (std::uint32_t m = warp.posted; m != 0; m &= m - 1) {
    const int lane = __builtin_ctz(m);
    if ((warp.posted >> lane) & 1u) try_complete(w, warp, warp.post[lane]->mask);
  }
  Fiber* next = w.pop();
  if (next != nullptr) {
    enter(w, *next);
    --self->tsan_ignores;
    tsan_ignore_end();  // the TSan fiber is reused by the next block, not ignoring
    context_leave(self->context, next->context, next->stack, next->stack_size);
  }
  w.current = nullptr;
  --self->tsan_ignores;
  tsan_ignore_end();
  context_leave(self->context, w.scheduler, w.scheduler_stack, w.scheduler_stack_size);
}

CGCPU_NO_TSAN CGCPU_RUNTIME void fiber_main(void* argument) {
  fiber_started();
  Worker& w = *static_cast<Worker*>(argument);
  tsan_acquire(&w.tsan_block_start);  // block start: what the host did before the launch
  w.launch->invoke(w.launch->self);
  if (!w.current->wgmma_ops.empty()) {  // wgmma.h: undefined in the ISA
    const Fiber::WgmmaOp& op = w.current->wgmma_ops.front();
    fiber_fault(w, "the thread exited with %zu warpgroup products pending, the first issued at %s:%d (no "
                "wgmma.wait_group completed them)", w.current->wgmma_ops.size(), op.file, op.line);
  }
  fiber_finish(w);
}

CGCPU_RUNTIME std::string deadlock_text(Worker& w) {
  struct Group {
    std::string what;
    std::vector<unsigned> threads;
  };
  std::vector<Group> groups;
  auto add = [&](const std::string& what, unsigned linear) {
    for (Group& g : groups)
      if (g.what == what) {
        g.threads.push_back(linear);
        return;
      }
    groups.push_back(Group{what, {linear}});
  };
  for (unsigned i = 0; i < w.threads; ++i) {
    const Fiber& f = w.fibers[i];
    switch (f.state) {
      case FiberState::AtBarrier:
        add(strformat("wait at %s (%s:%d)", f.what, f.file, f.line), i);
        break;
      case FiberState::AtWarp: {
        const Post& p = *w.warps[i / 32].post[i % 32];
        add(strformat("wait at %s (%s:%d) with mask 0x%08x (warp %u)", f.what, f.file, f.line, p.mask, i / 32), i);
        break;
      }
      case FiberState::AtMbarrier: {
        const auto found = w.mbarriers.find(f.mbarrier);
        const MbarrierState* s = found != w.mbarriers.end() ? &found->second : nullptr;
        add(strformat("wait at %s (%s:%d) for phase parity %u of the barrier %p (%u of %u arrivals pending, "
                      "tx-count %lld)", f.what, f.file, f.line, f.mbarrier_parity, f.mbarrier, s ? s->pending : 0u,
                      s ? s->expected : 0u, s ? s->tx : 0ll), i);
        break;
      }
      case FiberState::Exited:
        add("have exited", i);
        break;
      default:
        add("are runnable (scheduler error)", i);
        break;
    }
  }
  std::string text = block_text(w) + ": deadlock: ";
  for (std::size_t g = 0; g < groups.size(); ++g) {
    if (g > 0) text += "; ";
    std::string list = thread_list(w, groups[g].threads);
    std::string what = groups[g].what;
    if (groups[g].threads.size() == 1 && what == "have exited") what = "has exited";
    if (groups[g].threads.size() == 1 && what.compare(0, 5, "wait ") == 0) what = "waits" + what.substr(4);
    text += list + " " + what;
  }
  return text;
}

#if CGCPU_TSAN
// Ends an abandoned TSan fiber's `ignores` (TSan dies when a fiber ends ignoring), destroys it
// and creates a fresh one in its place; `self` is the calling OS thread's own context.
// What it did before it was abandoned is released to `end` (the block end), as at its exit.
CGCPU_NO_TSAN CGCPU_RUNTIME void tsan_replace_fiber(void*& fiber, int ignores, void* self, void* end) {
  __tsan_switch_to_fiber(fiber, __tsan_switch_to_fiber_no_sync);
  __tsan_release(end);
  for (int i = 0; i < ignores; ++i) __tsan_ignore_thread_end();
  __tsan_switch_to_fiber(self, __tsan_switch_to_fiber_no_sync);
  __tsan_destroy_fiber(fiber);
  fiber = __tsan_create_fiber(0);
}
#endif

// Runs block `linear_block` of `launch` on this OS thread, to completion (or a fault).
CGCPU_SHADOW_SKIP CGCPU_RUNTIME void run_block(const LaunchInfo& launch, std::uint64_t linear_block) {
  TsanIgnore ignore;
  Worker& w = this_worker();
  tls_worker = &w;
  const dim3 b = launch.block, g = launch.grid;
  const unsigned n = b.x * b.y * b.z;
  if (w.fibers.size() < n) {
    const std::size_t had = w.fibers.size();
    w.fibers.resize(n);
    w.queue.resize(n);
#if CGCPU_TSAN
    for (std::size_t i = had; i < n; ++i) w.fibers[i].context.tsan = __tsan_create_fiber(0);
#else
    (void)had;
#endif
  }
#if CGCPU_TSAN
  w.scheduler.tsan = __tsan_get_current_fiber();
#endif
  w.stacks.ensure(w.fibers.size(), config().stack_bytes);
  prepare_overflow_report();
  const unsigned warps = (n + 31) / 32;
  if (w.warps.size() < warps) w.warps.resize(warps);
  for (unsigned i = 0; i < warps; ++i) {
    WarpState& warp = w.warps[i];
    warp.first = i * 32;
    const unsigned lanes = std::min(32u, n - i * 32);
    warp.present = lanes == 32 ? 0xFFFFFFFFu : ((1u << lanes) - 1u);
    warp.exited = 0;
    warp.posted = 0;
  }
  w.launch = &launch;
  w.threads = n;
  w.mbarriers.clear();
  w.exited = 0;
  w.arrived = 0;
  w.fault = false;
  w.queue_head = 0;
  w.queue_count = 0;
  const std::uint64_t seed = config().seed.load(std::memory_order_relaxed);
  w.rng = seed == 0 ? 0 : (mix(seed ^ mix(launch.serial * 0x100000001B3ull + linear_block)) | 1u);

  tls_block_idx = uint3{static_cast<unsigned>(linear_block % g.x),
                        static_cast<unsigned>(linear_block / g.x % g.y),
                        static_cast<unsigned>(linear_block / (static_cast<std::uint64_t>(g.x) * g.y))};
  tls_block_dim = b;
  tls_grid_dim = g;
  unsigned char* shared = static_cast<unsigned char*>(::operator new(launch.shared, std::align_val_t(128)));
  if (config().shared_fill >= 0 && launch.shared > 0) std::memset(shared, config().shared_fill & 255, launch.shared);
  tls_dynamic_shared = shared;
  tls_dynamic_shared_bytes = launch.shared;

  for (unsigned i = 0; i < n; ++i) {
    Fiber& f = w.fibers[i];
    f.linear = i;
    f.index = uint3{i % b.x, i / b.x % b.y, i / (b.x * b.y)};
    f.state = FiberState::Ready;
    f.async_copies.clear();  // a thread that left copies unwaited does not pass them on
    f.async_groups = 0;
    f.wgmma_ops.clear();
    f.wgmma_groups = 0;
    f.stack = w.stacks.stack(i);
    f.stack_size = w.stacks.size();
    // Start each fiber's frames at a different offset modulo 4 KiB: stacks a fixed stride apart
    // would otherwise put every lane's frame in the same few cache sets, and a collective reads
    // all 32 of them.
    context_make(f.context, f.stack, f.stack_size - (i % 64) * 64, &fiber_main, &w);
    w.push(i);
#if CGCPU_TSAN
    // Reports name the CUDA thread: "cgImageLayerNorm block (3,0,0) thread 37".
    char name[160];
    std::snprintf(name, sizeof name, "%s block (%u,%u,%u) thread %s", launch.name, tls_block_idx.x, tls_block_idx.y,
                  tls_block_idx.z, thread_text(w, i).c_str());
    __tsan_set_fiber_name(f.context.tsan, name);
#endif
  }
  tsan_release(&w.tsan_block_start);
  Fiber* first = w.pop();
  enter(w, *first);
  context_switch(w.scheduler, first->context, first->stack, first->stack_size);
  // Back on the worker's own stack: every fiber has finished, or none can run, or a fault.
  tsan_acquire(&w.tsan_block_end);
  if (!w.fault && w.exited != n) {
    std::snprintf(w.message, sizeof w.message, "%s", deadlock_text(w).c_str());
    w.fault = true;
  }
#if CGCPU_TSAN
  // A thread that never exited (a fault, a deadlock) is left inside the emulator's bookkeeping,
  // ignoring, with frames on TSan's shadow stack: its slot gets a fresh TSan fiber.
  for (unsigned i = 0; i < n; ++i) {
    Fiber& f = w.fibers[i];
    if (f.state != FiberState::Exited || f.tsan_ignores != 0) {
      tsan_replace_fiber(f.context.tsan, f.tsan_ignores, w.scheduler.tsan, &w.tsan_block_end);
      f.tsan_ignores = 0;
    }
  }
  tsan_acquire(&w.tsan_block_end);
#endif
  ::operator delete(shared, std::align_val_t(128));
  tls_dynamic_shared = nullptr;
  tls_dynamic_shared_bytes = 0;
  w.current = nullptr;
  tls_worker = nullptr;
}

// ---- launching -----------------------------------------------------------------------------
constexpr std::size_t kDefaultSharedLimit = 48 * 1024;      // without cudaFuncSetAttribute
constexpr std::size_t kMaxSharedOptIn = 227 * 1024;         // H100 / H200: 232448 bytes

inline std::mutex& attribute_mutex() {
  static std::mutex m;
  return m;
}
inline std::unordered_map<const void*, std::size_t>& shared_limits() {
  static std::unordered_map<const void*, std::size_t> limits;
  return limits;
}
CGCPU_RUNTIME std::size_t shared_limit(const void* kernel) {
  std::lock_guard<std::mutex> lock(attribute_mutex());
  auto found = shared_limits().find(kernel);
  return found == shared_limits().end() ? kDefaultSharedLimit : found->second;
}

CGCPU_RUNTIME bool stream_valid(cudaStream_t stream);  // runtime_api.h

// A launch as an op of its stream (stream.h): its blocks are its items. The fault reported is
// the lowest-numbered block's that faulted: a launch's blocks are handed out in order and a
// fault only stops new ones from being handed out, so every lower block has run; the report
// does not depend on the number of workers or on what ran beside it.
struct KernelWork : Work {
  // The same launch, with copies of its arguments, for each replay of a captured graph.
  virtual std::unique_ptr<KernelWork> clone() const = 0;
  LaunchInfo info{};
  std::vector<std::uint64_t> sample;  // the blocks to run (block sampling)
  bool sampled = false;
  std::uint64_t blocks = 0;
  std::mutex mutex;
  bool faulted = false;
  std::uint64_t fault_block = 0;
  std::string message;

  std::uint64_t start(Op&) override {
    if (sticky() != cudaSuccess) return 0;  // a kernel faulted before: the context is lost
    return expected_items();
  }
  std::uint64_t expected_items() const override { return sampled ? sample.size() : blocks; }
  CGCPU_SHADOW_SKIP bool item(Op&, std::uint64_t index) override {
    const std::uint64_t block = sampled ? sample[index] : index;
    run_block(info, block);
    Worker& w = this_worker();
    if (!w.fault) return false;
    std::lock_guard<std::mutex> lock(mutex);
    if (!faulted || block < fault_block) {
      faulted = true;
      fault_block = block;
      message = w.message;
    }
    return true;
  }
  void finish(Op& op) override {
    if (!faulted) return;
    if (op.site != nullptr)
      std::fprintf(stderr, "cuda_cpu: %s (launched at %s)\n", message.c_str(), op.site);
    else
      std::fprintf(stderr, "cuda_cpu: %s\n", message.c_str());
    std::fflush(stderr);
    if (config().abort_on_fault) std::abort();
    int expected = cudaSuccess;
    sticky_error.compare_exchange_strong(expected, cudaErrorLaunchFailure);
    op.error = cudaErrorLaunchFailure;
  }
};

inline std::atomic<std::uint64_t>& launch_serial() {
  static std::atomic<std::uint64_t> serial{0};
  return serial;
}

// Checks a launch as the CUDA runtime does, then issues it on `stream`. Returns the launch's own
// error (the configuration); a fault while running sets the sticky cudaErrorLaunchFailure (and,
// on the legacy stream, where the launch has run when this returns, is returned too).
CGCPU_RUNTIME cudaError_t launch(std::unique_ptr<KernelWork> work, const void* kernel, cudaStream_t stream) {
  LaunchInfo& info = work->info;
  if (tls_worker != nullptr) {
    std::fprintf(stderr, "cuda_cpu: kernel %s launched from device code (not supported)\n", info.name);
    std::abort();
  }
  const cudaError_t sticky_now = sticky();
  if (sticky_now != cudaSuccess) return record(sticky_now);
  const dim3 b = info.block, g = info.grid;
  const unsigned long long threads = static_cast<unsigned long long>(b.x) * b.y * b.z;
  if (b.x == 0 || b.y == 0 || b.z == 0 || b.x > 1024 || b.y > 1024 || b.z > 64 || threads > 1024 ||
      g.x == 0 || g.y == 0 || g.z == 0 || g.x > 2147483647u || g.y > 65535 || g.z > 65535)
    return record(cudaErrorInvalidConfiguration);
  if (info.shared > shared_limit(kernel)) return record(cudaErrorInvalidValue);
  if (any_capture() && capture_of(stream) != nullptr) {  // capture.h: a copy of it at each replay
    std::shared_ptr<KernelWork> captured(std::move(work));
    capture_call(stream, [captured, kernel, stream]() { launch(captured->clone(), kernel, stream); });
    return cudaSuccess;
  }
  std::lock_guard<std::recursive_mutex> lock(device_mutex());
  // Numbered in the order issued: the fibers' order (CG_CPU_SCHEDULE_SEED) depends on it, not on
  // when the launch runs.
  info.serial = launch_serial().fetch_add(1);
  work->blocks = static_cast<std::uint64_t>(g.x) * g.y * g.z;
  // Block sampling (CG_CPU_BLOCKS, cgcpu::set_block_sample) as it is when the launch is issued:
  // the listed blocks that exist, in increasing order, each once.
  {
    Config& c = config();
    std::lock_guard<std::mutex> blocks_lock(c.blocks_mutex);
    const bool unsampled = std::find(c.unsampled.begin(), c.unsampled.end(), info.name) != c.unsampled.end();
    if (!unsampled)
      for (long long listed : c.blocks) {
        const long long block = listed < 0 ? static_cast<long long>(work->blocks) + listed : listed;
        if (block >= 0 && static_cast<std::uint64_t>(block) < work->blocks)
          work->sample.push_back(static_cast<std::uint64_t>(block));
      }
    if (!c.blocks.empty() && !unsampled) {
      std::sort(work->sample.begin(), work->sample.end());
      work->sample.erase(std::unique(work->sample.begin(), work->sample.end()), work->sample.end());
      work->sampled = true;
    }
  }
  const char* name = info.name;
  std::shared_ptr<Op> op = enqueue(stream, name, std::move(work));
  if (!is_legacy(stream)) return cudaSuccess;
  run_pending(false);  // CG_LAUNCHED names it, then publishes the shadow's reports
  return op->error != cudaSuccess ? record(op->error) : cudaSuccess;
}

template <class T>
inline T implicit_convert(T value) {  // copy-initialisation: the conversions a call allows
  return value;
}

template <class... Params>
class Launcher {
 public:
  typedef void (*Kernel)(Params...);
  Launcher(Kernel kernel, const char* name, dim3 grid, dim3 block, std::size_t shared, cudaStream_t stream)
      : kernel_(kernel), name_(name), grid_(grid), block_(block), shared_(shared), stream_(stream) {}

  template <class... Args>
  void operator()(Args&&... args) const {
    static_assert(sizeof...(Args) == sizeof...(Params), "a kernel launch passes one argument per parameter");
    if (!stream_valid(stream_)) {
      record(cudaErrorInvalidResourceHandle);
      return;
    }
    // The arguments are copied into the op, which may run after this returns.
    std::unique_ptr<BoundWork> work(new BoundWork(
        kernel_, std::tuple<typename std::decay<Params>::type...>(
                     implicit_convert<typename std::decay<Params>::type>(std::forward<Args>(args))...)));
    work->info = LaunchInfo{name_, grid_, block_, shared_, &Launcher::invoke, work.get(), 0};
    launch(std::move(work), reinterpret_cast<const void*>(kernel_), stream_);
  }

 private:
  struct BoundWork : KernelWork {
    BoundWork(Kernel k, std::tuple<typename std::decay<Params>::type...>&& a) : kernel(k), arguments(std::move(a)) {}
    Kernel kernel;
    std::tuple<typename std::decay<Params>::type...> arguments;
    std::unique_ptr<KernelWork> clone() const override {  // a graph's replay (capture.h)
      std::unique_ptr<BoundWork> copy(
          new BoundWork(kernel, std::tuple<typename std::decay<Params>::type...>(arguments)));
      copy->info = info;
      copy->info.self = copy.get();
      return copy;
    }
  };
  static void invoke(const void* self) {
    const BoundWork& bound = *static_cast<const BoundWork*>(self);
    std::apply(bound.kernel, bound.arguments);  // every thread gets its own copies
  }

  Kernel kernel_;
  const char* name_;
  dim3 grid_, block_;
  std::size_t shared_;
  cudaStream_t stream_;
};

template <class... Params>
inline Launcher<Params...> make_launcher(void (*kernel)(Params...), const char* name, dim3 grid, dim3 block,
                                         std::size_t shared, cudaStream_t stream) {
  return Launcher<Params...>(kernel, name, grid, block, shared, stream);
}

}  // namespace detail
}  // namespace cgcpu

// ---- what device code sees -------------------------------------------------------------------
#define threadIdx (static_cast<const uint3&>(::cgcpu::detail::tls_thread_idx))
#define blockIdx (static_cast<const uint3&>(::cgcpu::detail::tls_block_idx))
#define blockDim (static_cast<const dim3&>(::cgcpu::detail::tls_block_dim))
#define gridDim (static_cast<const dim3&>(::cgcpu::detail::tls_grid_dim))
inline constexpr int warpSize = 32;

// The launch and dynamic shared memory macros of the emitted file (its #ifndef keeps these).
#define CG_LAUNCH(kernel, grid, block, shared, stream) \
  ::cgcpu::detail::make_launcher(kernel, #kernel, grid, block, shared, stream)
#define CG_DYNAMIC_SHARED(name) \
  unsigned char* const name __attribute__((unused)) = ::cgcpu::detail::tls_dynamic_shared

inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::cgcpu::detail::block_barrier("__syncthreads", 0, file, line);
}
inline int __syncthreads_count(int predicate, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return ::cgcpu::detail::block_barrier("__syncthreads_count", predicate, file, line);
}
inline int __syncthreads_and(int predicate, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return ::cgcpu::detail::block_barrier("__syncthreads_and", predicate, file, line) ==
         static_cast<int>(blockDim.x * blockDim.y * blockDim.z);
}
inline int __syncthreads_or(int predicate, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return ::cgcpu::detail::block_barrier("__syncthreads_or", predicate, file, line) != 0;
}
