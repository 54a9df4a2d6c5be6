// cuda_cpu: the global-memory shadow, which finds launches that may run at the same time and
// touch the same memory, one of them writing (README.md, "The shadow"; docs/emulation.md).
//
// Built only in the shadow build (-DCG_CPU_SHADOW=1 with GCC's ThreadSanitizer instrumentation,
// -fsanitize=thread -U__SANITIZE_THREAD__, linked WITHOUT libtsan): the compiler then calls
// __tsan_read4(p), __tsan_write8(p), __tsan_atomic32_fetch_add(p, ...) ... before every load,
// store and atomic it cannot prove local, and this header is the runtime those calls reach (as
// the Linux kernel's KCSAN reuses the same instrumentation). In every other build the entry
// points below are empty inline functions.
//
// What is recorded. Device memory (every cudaMalloc) comes from one reserved region; each
// 2-byte granule of it has a cell: the last op that wrote it and up to three ops that read it
// since. An "op" is anything a stream runs (a kernel launch, a cuBLAS product, an NCCL call, a
// copy, a memset: stream.h); the op whose block or body the calling OS thread is running is in
// tls_shadow_op. Ordering is CUDA's, not the emulator's: every op carries the vector clock of its
// stream when it was enqueued (stream order, event waits, the legacy stream's implicit
// synchronisation, host synchronisation), and an access conflicts with a recorded one when
// neither op happens before the other and at least one of them writes. So a conflict is found
// whatever order the interleaving happened to run the two ops in, and ops that CUDA orders
// never conflict, however the emulator ran them.
//
// Why 2-byte granules: bfloat16 is the smallest element the emitted programs store; two
// concurrent launches writing neighbouring bfloat16 elements of one word do not conflict on a
// GPU, and are not reported here. (A 1-byte access is widened to its granule.)
//
// Reports (printed to stderr when the flush that found them ends, and kept for
// cgcpu::shadow_take_reports), one line per pair of ops, access kinds and allocation:
//
//   cuda_cpu shadow: global BASE SIZE OFFSET BYTES KIND1 [NAME1] [SITE1] KIND2 [NAME2] [SITE2]
//
// BASE and SIZE are the cudaMalloc allocation's start (hex) and size, OFFSET the first byte of
// it both touched, BYTES the extent from there to the last byte both touched, KIND read, write or
// atomic; op 1 was enqueued before op 2; NAME is the kernel (or cublasLtMatmul, ncclAllReduce,
// cudaMemcpyAsync ...), SITE the CG_LAUNCHED string of its launch ('?' if none). Atomics on a
// program variable (a __device__ counter) are kept in a side table and reported as
//   cuda_cpu shadow: symbol NAME SIZE OFFSET BYTES ...
// (NAME from dladdr; atomics count as writes: two concurrent launches updating one counter are
// reported, since the emitted kernels' ticket counters rely on one launch at a time).
#pragma once

#include "linkage.h"

#include <cstddef>
#include <cstdint>

namespace cgcpu {
namespace detail {

enum ShadowKind { kShadowRead = 0, kShadowWrite = 1, kShadowAtomic = 2 };

// What the shadow needs of the op being run: its number and the vector clock it was enqueued with.
struct ShadowOp {
  std::uint32_t id;
  std::uint32_t clock_size;
  const std::uint64_t* clock;
};

}  // namespace detail
}  // namespace cgcpu

#if defined(CG_CPU_SHADOW) && CG_CPU_SHADOW
#define CGCPU_SHADOW 1
#if defined(__SANITIZE_THREAD__)
#error "the shadow build reuses ThreadSanitizer's instrumentation without its runtime: add -U__SANITIZE_THREAD__"
#endif
#else
#define CGCPU_SHADOW 0
#endif

// The emulator's hot bookkeeping (fiber switches, barriers, warp collectives), left out of the
// shadow build's instrumentation: it touches no device memory, and instrumenting it would be most
// of the build's cost.
#if CGCPU_SHADOW
#define CGCPU_SHADOW_SKIP __attribute__((no_sanitize_thread))
#else
#define CGCPU_SHADOW_SKIP
#endif

#if CGCPU_SHADOW
#include <dlfcn.h>
#include <link.h>
#include <sys/mman.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#define CGCPU_SHADOW_RT __attribute__((no_sanitize_thread))
#define CGCPU_HIDDEN __attribute__((visibility("hidden")))

namespace cgcpu {
namespace detail {

constexpr std::size_t kShadowGranule = 2;
constexpr std::uintptr_t kShadowPage = 4096;
constexpr std::uint32_t kShadowAtomicBit = 0x80000000u;  // in a cell's writer: an atomic write
constexpr std::size_t kShadowRing = 1u << 16;            // ops whose order is still open
constexpr std::uint64_t kShadowMaxOps = 1u << 30;        // op ids fit beside the cell's two flag bits

struct ShadowCell {
  std::uint32_t writer;     // op id (| kShadowAtomicBit, | kShadowLockBit while updated), 0: none
  std::uint32_t reader[3];  // op ids that read since that write, pairwise unordered; 0: none
};

struct ShadowOpKey {  // an op's place, for happens-before and for reports
  std::uint64_t id;
  std::uint32_t stream;
  std::uint64_t seq;
  const char* name;
  const char* site;
};

struct ShadowReport {
  std::uint32_t first, second;  // op ids, first < second
  int first_kind, second_kind;
  std::uintptr_t base;  // allocation start, or the symbol's address
  std::size_t size;
  std::string symbol;   // empty: a cudaMalloc allocation
  std::size_t offset, end;  // the first and one past the last byte found in conflict
};

struct ShadowState {
  // Written once, when the region is reserved (before any op runs); read on every access.
  std::uintptr_t lo = 0, span = 0;
  ShadowCell* cells = nullptr;
  std::uintptr_t next = 0;  // the region's bump pointer (under the device lock)
  // The module's writable data segment (__device__ variables), for atomics.
  std::uintptr_t data_lo = 0, data_hi = 0;
  // Ops with id < base happen before every op still to run (the host has waited for them).
  std::atomic<std::uint64_t> base{1};
  ShadowOpKey ring[kShadowRing];
  std::mutex mutex;  // the reports, the side table, the warnings
  std::map<std::tuple<std::uint32_t, int, std::uint32_t, int, std::uintptr_t>, ShadowReport> reports;
  std::vector<std::tuple<std::uint32_t, int, std::uint32_t, int, std::uintptr_t>> unpublished;
  std::unordered_map<std::uintptr_t, ShadowCell> side;  // granules of the data segment
  struct Scratch {  // a product's workspace, claimed whole (shadow_scratch)
    std::uintptr_t lo, hi;
    std::uint32_t op;
  };
  std::vector<Scratch> scratch;
  // Large writes to pages that nothing has touched yet (a cudaMemset of a fresh allocation, a
  // parameter upload: megabytes, the cuBLASLt workspace's 64 MiB) are kept as fills, an interval
  // each, not cell by cell: an empty cell's writer is the latest fill that covers it. `touched`
  // has a bit for each 4 KiB page of the region, set (under `mutex`) before any cell of the page
  // is first updated; fills never cover a touched page (shadow_fill).
  std::uint64_t* touched = nullptr;
  struct Fill {
    std::uintptr_t lo, hi;
    std::uint32_t op;
  };
  static constexpr unsigned kFills = 4096;
  Fill fills[kFills];
  std::atomic<unsigned> fill_count{0};
  std::string log;      // every report line so far, for shadow_take_reports
  bool print = true;
  bool warned_readers = false, warned_ring = false;
};

CGCPU_SHADOW_RT inline ShadowState& shadow_state_slow() {
  static ShadowState* state = new ShadowState;  // never freed: read until the process ends
  return *state;
}
// The hot path reads these three through hidden variables: no GOT, no guard.
inline CGCPU_HIDDEN std::uintptr_t g_shadow_lo = 0;
inline CGCPU_HIDDEN std::uintptr_t g_shadow_span = 0;
inline CGCPU_HIDDEN ShadowCell* g_shadow_cells = nullptr;
inline CGCPU_HIDDEN ShadowState* g_shadow = nullptr;  // set with the region, before any op runs
inline thread_local const ShadowOp* tls_shadow_op = nullptr;

CGCPU_SHADOW_RT CGCPU_RUNTIME bool shadow_find_allocation(std::uintptr_t at, std::uintptr_t* base, std::size_t* size);  // runtime_api.h

CGCPU_SHADOW_RT inline int shadow_module_segment(struct dl_phdr_info* info, std::size_t, void* data) {
  ShadowState& s = *static_cast<ShadowState*>(data);
  const std::uintptr_t probe = reinterpret_cast<std::uintptr_t>(&g_shadow_lo);
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& p = info->dlpi_phdr[i];
    if (p.p_type != PT_LOAD || (p.p_flags & PF_W) == 0) continue;
    const std::uintptr_t lo = info->dlpi_addr + p.p_vaddr, hi = lo + p.p_memsz;
    if (probe >= lo && probe < hi) {
      s.data_lo = lo;
      s.data_hi = hi;
      return 1;
    }
  }
  return 0;
}

// Reserves the device region and its cells (CG_CPU_SHADOW_GIB of address space, 16 by default;
// MAP_NORESERVE: only the pages touched take memory).
CGCPU_SHADOW_RT inline ShadowState& shadow_state() {
  ShadowState& s = shadow_state_slow();
  if (g_shadow != nullptr) return s;
  if (s.span != 0) {  // reserved by another copy of this code that shares the state (gnu_unique)
    g_shadow_cells = s.cells;
    g_shadow = &s;
    g_shadow_lo = s.lo;
    g_shadow_span = s.span;
    return s;
  }
  long gib = 16;
  if (const char* text = std::getenv("CG_CPU_SHADOW_GIB")) gib = std::strtol(text, nullptr, 0);
  if (gib < 1) gib = 1;
  const std::size_t bytes = static_cast<std::size_t>(gib) << 30;
  const std::size_t cell_bytes = bytes / kShadowGranule * sizeof(ShadowCell);
  void* region = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  void* cells = mmap(nullptr, cell_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  void* touched = mmap(nullptr, bytes / kShadowPage / 8, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (region == MAP_FAILED || cells == MAP_FAILED || touched == MAP_FAILED) {
    std::fprintf(stderr, "cuda_cpu shadow: cannot reserve %ld GiB of device memory and its shadow (CG_CPU_SHADOW_GIB)\n", gib);
    std::abort();
  }
  s.lo = s.next = reinterpret_cast<std::uintptr_t>(region);
  s.cells = static_cast<ShadowCell*>(cells);
  s.touched = static_cast<std::uint64_t*>(touched);
  dl_iterate_phdr(&shadow_module_segment, &s);
  g_shadow_cells = s.cells;
  g_shadow = &s;
  g_shadow_lo = s.lo;
  s.span = bytes;
  g_shadow_span = bytes;
  return s;
}

// Device memory in the shadow build: from the region, 256-byte aligned, never reused (a freed
// range's pages and cells are given back to the system; its stale cells are never read again).
CGCPU_SHADOW_RT inline void* shadow_allocate(std::size_t bytes) {
  ShadowState& s = shadow_state();
  const std::uintptr_t at = (s.next + 255) & ~static_cast<std::uintptr_t>(255);
  if (at + bytes > s.lo + s.span) return nullptr;
  s.next = at + bytes;
  return reinterpret_cast<void*>(at);
}
CGCPU_SHADOW_RT inline void shadow_release(void* pointer, std::size_t bytes) {
  ShadowState& s = shadow_state();
  const std::uintptr_t page = 4096, at = reinterpret_cast<std::uintptr_t>(pointer);
  const std::uintptr_t lo = (at + page - 1) & ~(page - 1), hi = (at + bytes) & ~(page - 1);
  if (hi > lo) {
    madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
    const std::uintptr_t cells_lo = reinterpret_cast<std::uintptr_t>(s.cells + (lo - s.lo) / kShadowGranule);
    const std::uintptr_t cells_hi = reinterpret_cast<std::uintptr_t>(s.cells + (hi - s.lo) / kShadowGranule);
    madvise(reinterpret_cast<void*>(cells_lo), cells_hi - cells_lo, MADV_DONTNEED);  // both page multiples
  }
}
CGCPU_SHADOW_RT inline bool shadow_owns(const void* pointer) {
  const std::uintptr_t at = reinterpret_cast<std::uintptr_t>(pointer);
  return at - g_shadow_lo < g_shadow_span;
}

// ---- happens-before ---------------------------------------------------------------------
// Whether op `id` happens before the op running now (whose clock is `me`).
CGCPU_SHADOW_RT inline bool shadow_before(std::uint32_t id, const ShadowOp* me) {
  const ShadowState& s = *g_shadow;
  if (id < s.base.load(std::memory_order_relaxed)) return true;
  const ShadowOpKey& key = s.ring[id % kShadowRing];
  if (key.id != id) return true;  // cannot happen: the ring is larger than the open ops (enqueue)
  return key.stream < me->clock_size && key.seq <= me->clock[key.stream];
}

CGCPU_SHADOW_RT inline void shadow_conflict(std::uint32_t earlier, int earlier_kind, const ShadowOp* me, int my_kind,
                                             std::uintptr_t at, bool side, std::size_t extent = kShadowGranule) {
  ShadowState& s = shadow_state_slow();
  std::uintptr_t base = 0;
  std::size_t size = 0;
  std::string symbol;
  if (side) {  // a program variable: its symbol (exported: a shared library, or -rdynamic)
    Dl_info info;
    void* found = nullptr;
    if (dladdr1(reinterpret_cast<void*>(at), &info, &found, RTLD_DL_SYMENT) != 0 && info.dli_sname != nullptr) {
      const ElfW(Sym)* entry = static_cast<const ElfW(Sym)*>(found);
      symbol = info.dli_sname;
      base = reinterpret_cast<std::uintptr_t>(info.dli_saddr);
      size = entry != nullptr ? entry->st_size : kShadowGranule;
    } else {
      symbol = "?";
      base = at & ~static_cast<std::uintptr_t>(kShadowGranule - 1);
      size = kShadowGranule;
    }
  } else if (!shadow_find_allocation(at, &base, &size)) {
    base = at & ~static_cast<std::uintptr_t>(kShadowGranule - 1);  // freed since: the granule alone
    size = kShadowGranule;
  }
  std::uint32_t first = earlier, second = me->id;
  int first_kind = earlier_kind, second_kind = my_kind;
  if (first > second) {
    std::swap(first, second);
    std::swap(first_kind, second_kind);
  }
  const auto key = std::make_tuple(first, first_kind, second, second_kind, base);
  const std::size_t offset = (at & ~static_cast<std::uintptr_t>(kShadowGranule - 1)) - base;
  std::lock_guard<std::mutex> lock(s.mutex);
  auto found = s.reports.find(key);
  if (found == s.reports.end()) {
    s.reports.emplace(key, ShadowReport{first, second, first_kind, second_kind, base, size, symbol, offset,
                                        offset + extent});
    s.unpublished.push_back(key);
  } else {  // (two workers may both see one granule's conflict: an extent, not a count)
    ShadowReport& r = found->second;
    if (offset < r.offset) r.offset = offset;
    if (offset + extent > r.end) r.end = offset + extent;
  }
}

// A cell is updated under its own lock (a bit of its writer word), so that two workers touching
// it at once cannot lose each other's record; an op that touches a cell it touched already
// (the common case: a kernel's threads, again and again) returns before taking it.
constexpr std::uint32_t kShadowLockBit = 0x40000000u;
constexpr std::uint32_t kShadowIdMask = ~(kShadowAtomicBit | kShadowLockBit);

CGCPU_SHADOW_RT inline std::uint32_t shadow_lock(ShadowCell& cell) {
  std::uint32_t w = __atomic_load_n(&cell.writer, __ATOMIC_RELAXED);
  for (;;) {
    if ((w & kShadowLockBit) == 0 &&
        __atomic_compare_exchange_n(&cell.writer, &w, w | kShadowLockBit, true, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
      return w;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
    w = __atomic_load_n(&cell.writer, __ATOMIC_RELAXED);
  }
}

// Before a cell of a page is first updated: the page is marked touched, under the mutex that
// shadow_fill holds while it decides which pages a fill covers (so that a fill either covers the
// page before any cell of it has a record, or not at all).
CGCPU_SHADOW_RT inline void shadow_touch(std::uintptr_t at) {
  ShadowState& s = *g_shadow;
  const std::uintptr_t page = (at - s.lo) / kShadowPage;
  std::uint64_t* const word = &s.touched[page / 64];
  const std::uint64_t bit = 1ull << (page % 64);
  if (__atomic_load_n(word, __ATOMIC_ACQUIRE) & bit) return;
  std::lock_guard<std::mutex> lock(s.mutex);
  __atomic_fetch_or(word, bit, __ATOMIC_RELEASE);
}

// The op of the latest fill covering `at`, or 0 (the fills were all made before `at`'s page was
// touched: none can be missing).
CGCPU_SHADOW_RT inline std::uint32_t shadow_fill_writer(std::uintptr_t at) {
  const ShadowState& s = *g_shadow;
  for (unsigned i = s.fill_count.load(std::memory_order_acquire); i-- > 0;)
    if (s.fills[i].lo <= at && at < s.fills[i].hi) return s.fills[i].op;
  return 0;
}

CGCPU_SHADOW_RT inline void shadow_cell(ShadowCell& cell, const ShadowOp* me, int kind, std::uintptr_t at, bool side) {
  const std::uint32_t id = me->id;
  std::uint32_t* const readers = cell.reader;
  const std::uint32_t mine = id | (kind == kShadowAtomic ? kShadowAtomicBit : 0u);
  if (kind == kShadowRead) {
    for (int i = 0; i < 3; ++i)
      if (__atomic_load_n(&readers[i], __ATOMIC_RELAXED) == id) return;  // read before by this op
  } else if ((__atomic_load_n(&cell.writer, __ATOMIC_RELAXED) & ~kShadowLockBit) == mine &&
             __atomic_load_n(&readers[0], __ATOMIC_RELAXED) == 0) {
    return;  // written before by this op, nobody read it since
  }
  if (!side) shadow_touch(at);
  std::uint32_t w = shadow_lock(cell);
  if (!side && w == 0 && cell.reader[0] == 0 && cell.reader[1] == 0 && cell.reader[2] == 0)
    w = shadow_fill_writer(at);  // an empty cell: what a fill wrote, if any
  const std::uint32_t writer = w & kShadowIdMask;
  const int writer_kind = (w & kShadowAtomicBit) ? kShadowAtomic : kShadowWrite;
  // (shadow_conflict takes the reports' mutex, never a cell's: no lock order to keep)
  if (writer != 0 && writer != id && !shadow_before(writer, me)) shadow_conflict(writer, writer_kind, me, kind, at, side);
  if (kind == kShadowRead) {
    // Keep the readers pairwise unordered: this one replaces any that happens before it (a
    // later write that conflicts with the replaced one conflicts with this one too).
    bool kept = false;
    for (int i = 0; i < 3 && !kept; ++i) {
      const std::uint32_t r = __atomic_load_n(&readers[i], __ATOMIC_RELAXED);
      if (r == id || r == 0 || shadow_before(r, me)) {
        __atomic_store_n(&readers[i], id, __ATOMIC_RELAXED);
        kept = true;
      }
    }
    __atomic_store_n(&cell.writer, w & ~kShadowLockBit, __ATOMIC_RELEASE);  // unlocked, the writer kept
    if (!kept) {
      ShadowState& s = *g_shadow;
      std::lock_guard<std::mutex> lock(s.mutex);
      if (!s.warned_readers) {
        s.warned_readers = true;
        std::fprintf(stderr, "cuda_cpu shadow: warning: more than 3 unordered ops read one element; later "
                             "conflicts with the 4th may be missed\n");
      }
    }
    return;
  }
  for (int i = 0; i < 3; ++i) {
    const std::uint32_t r = __atomic_load_n(&readers[i], __ATOMIC_RELAXED);
    if (r != 0 && r != id && !shadow_before(r, me)) shadow_conflict(r, kShadowRead, me, kind, at, side);
    __atomic_store_n(&readers[i], 0u, __ATOMIC_RELAXED);
  }
  __atomic_store_n(&cell.writer, mine, __ATOMIC_RELEASE);  // unlocked
}

// [p, p + bytes) accessed by the op running on this thread (if any, and if device memory).
CGCPU_SHADOW_RT inline void shadow_access(const void* p, std::size_t bytes, int kind) {
  const std::uintptr_t offset = reinterpret_cast<std::uintptr_t>(p) - g_shadow_lo;
  if (offset >= g_shadow_span || bytes == 0) return;
  const ShadowOp* me = tls_shadow_op;
  if (me == nullptr) return;  // the host program's own accesses: not an op's
  const std::uintptr_t first = offset / kShadowGranule, last = (offset + bytes - 1) / kShadowGranule;
  for (std::uintptr_t g = first; g <= last; ++g)
    shadow_cell(g_shadow_cells[g], me, kind, g_shadow_lo + g * kShadowGranule, false);
}

// An atomic: device memory as any access; a program variable (the data segment: a __device__
// counter) through the side table.
CGCPU_SHADOW_RT inline void shadow_atomic(const volatile void* p, std::size_t bytes, int kind) {
  const std::uintptr_t at = reinterpret_cast<std::uintptr_t>(p);
  if (at - g_shadow_lo < g_shadow_span) return shadow_access(const_cast<const void*>(p), bytes, kind);
  const ShadowOp* me = tls_shadow_op;
  if (me == nullptr || g_shadow == nullptr) return;
  ShadowState& s = *g_shadow;
  if (at < s.data_lo || at >= s.data_hi) return;  // a stack, the heap, thread-local storage
  for (std::uintptr_t g = at / kShadowGranule; g <= (at + bytes - 1) / kShadowGranule; ++g) {
    ShadowCell* cell;
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      cell = &s.side[g];  // node-based: the cell stays where it is
    }
    shadow_cell(*cell, me, kind, g * kShadowGranule, true);
  }
}

CGCPU_SHADOW_RT inline void shadow_range(const void* p, std::size_t bytes, int kind) { shadow_access(p, bytes, kind); }

// A write of [p, p + bytes) by the op running on this thread, as a copy or a memset makes it:
// the whole pages no access has touched as one fill (compared with the earlier fills it
// overlaps), the rest cell by cell.
CGCPU_SHADOW_RT inline void shadow_fill(const void* p, std::size_t bytes) {
  const ShadowOp* me = tls_shadow_op;
  const std::uintptr_t at = reinterpret_cast<std::uintptr_t>(p);
  if (me == nullptr || g_shadow == nullptr || at - g_shadow_lo >= g_shadow_span || bytes == 0) return;
  ShadowState& s = *g_shadow;
  const std::uintptr_t end = at + bytes;
  const std::uintptr_t first = s.lo + (at - s.lo + kShadowPage - 1) / kShadowPage * kShadowPage;
  const std::uintptr_t last = s.lo + (end - s.lo) / kShadowPage * kShadowPage;
  struct Piece {
    std::uintptr_t lo, hi;
    std::uint32_t op;  // a fill's conflict: the earlier fill's op; 0: a range for the cells
  };
  std::vector<Piece> cells, conflicts;
  if (first >= last) {
    cells.push_back(Piece{at, end, 0});
  } else {
    if (at < first) cells.push_back(Piece{at, first, 0});
    if (last < end) cells.push_back(Piece{last, end, 0});
    std::lock_guard<std::mutex> lock(s.mutex);
    std::uintptr_t run = 0;  // the start of the current run of untouched pages, or 0
    auto close = [&](std::uintptr_t hi) {
      const unsigned count = s.fill_count.load(std::memory_order_relaxed);
      if (count == ShadowState::kFills) {  // no room: cell by cell (shadow_touch marks the pages)
        cells.push_back(Piece{run, hi, 0});
      } else {
        for (unsigned i = 0; i < count; ++i) {
          const ShadowState::Fill& f = s.fills[i];
          if (f.hi > run && f.lo < hi && f.op != me->id && !shadow_before(f.op, me))
            conflicts.push_back(Piece{f.lo > run ? f.lo : run, f.hi < hi ? f.hi : hi, f.op});
        }
        s.fills[count] = ShadowState::Fill{run, hi, me->id};
        s.fill_count.store(count + 1, std::memory_order_release);
      }
      run = 0;
    };
    for (std::uintptr_t page = first; page < last; page += kShadowPage) {
      const std::uintptr_t index = (page - s.lo) / kShadowPage;
      const bool touched = (__atomic_load_n(&s.touched[index / 64], __ATOMIC_ACQUIRE) >> (index % 64)) & 1u;
      if (touched) {
        if (run != 0) close(page);
        cells.push_back(Piece{page, page + kShadowPage, 0});
      } else if (run == 0) {
        run = page;
      }
    }
    if (run != 0) close(last);
  }
  for (const Piece& c : conflicts) shadow_conflict(c.op, kShadowWrite, me, kShadowWrite, c.lo, false, c.hi - c.lo);
  for (const Piece& c : cells) shadow_access(reinterpret_cast<const void*>(c.lo), c.hi - c.lo, kShadowWrite);
}

// A library's scratch memory (cuBLASLt's workspace), which it may overwrite whole: claimed as one
// write of the whole range, not granule by granule (a workspace is megabytes, a product's operands
// kilobytes). Two unordered ops whose claims overlap conflict; a kernel's accesses to the range
// are not compared with the claims.
CGCPU_SHADOW_RT inline void shadow_scratch(const void* p, std::size_t bytes) {
  const ShadowOp* me = tls_shadow_op;
  if (me == nullptr || g_shadow == nullptr || bytes == 0) return;
  ShadowState& s = *g_shadow;
  const std::uintptr_t lo = reinterpret_cast<std::uintptr_t>(p), hi = lo + bytes;
  struct Found {
    std::uint32_t op;
    std::uintptr_t lo, hi;
  };
  std::vector<Found> conflicts;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    bool kept = false;
    for (ShadowState::Scratch& claim : s.scratch) {
      if (claim.hi <= lo || hi <= claim.lo) continue;
      if (claim.op != me->id && !shadow_before(claim.op, me))
        conflicts.push_back(Found{claim.op, claim.lo > lo ? claim.lo : lo, claim.hi < hi ? claim.hi : hi});
      if (claim.lo == lo && claim.hi == hi) {
        claim.op = me->id;
        kept = true;
      }
    }
    if (!kept) s.scratch.push_back(ShadowState::Scratch{lo, hi, me->id});
  }
  for (const Found& c : conflicts) shadow_conflict(c.op, kShadowWrite, me, kShadowWrite, c.lo, false, c.hi - c.lo);
}

// A column-major matrix: `cols` columns of `rows` elements, `ld` elements apart.
CGCPU_SHADOW_RT inline void shadow_matrix(const void* p, std::int64_t rows, std::int64_t cols, std::int64_t ld, std::size_t element,
                          int kind) {
  if (p == nullptr) return;
  const char* base = static_cast<const char*>(p);
  for (std::int64_t j = 0; j < cols; ++j)
    shadow_access(base + static_cast<std::size_t>(j * ld) * element, static_cast<std::size_t>(rows) * element, kind);
}

// ---- the ops' bookkeeping (stream.h, under the device lock) ----------------------------------
CGCPU_SHADOW_RT inline void shadow_note_op(std::uint64_t id, std::uint32_t stream, std::uint64_t seq, const char* name) {
  ShadowState& s = shadow_state();
  if (id - s.base.load() >= kShadowRing) {  // a program that never waits for the device
    s.base.store(id - kShadowRing + 1);
    std::lock_guard<std::mutex> lock(s.mutex);
    if (!s.warned_ring) {
      s.warned_ring = true;
      std::fprintf(stderr, "cuda_cpu shadow: warning: over %zu ops without the host waiting for them; the oldest "
                           "are taken as ordered before the rest\n", kShadowRing);
    }
  }
  if (id >= kShadowMaxOps) {
    std::fprintf(stderr, "cuda_cpu shadow: more than %llu ops in one process\n", static_cast<unsigned long long>(kShadowMaxOps));
    std::abort();
  }
  s.ring[id % kShadowRing] = ShadowOpKey{id, stream, seq, name, nullptr};
}
CGCPU_SHADOW_RT inline void shadow_note_site(std::uint64_t id, const char* site) {
  ShadowState& s = shadow_state();
  if (s.ring[id % kShadowRing].id == id) s.ring[id % kShadowRing].site = site;
}
CGCPU_SHADOW_RT inline void shadow_set_base(std::uint64_t base) {
  ShadowState& s = shadow_state();
  if (base > s.base.load()) s.base.store(base);
}

CGCPU_SHADOW_RT inline const char* shadow_kind_name(int kind) {
  return kind == kShadowRead ? "read" : kind == kShadowWrite ? "write" : "atomic";
}

// Prints (and keeps) the reports found since the last call.
CGCPU_SHADOW_RT inline void shadow_publish() {
  ShadowState& s = shadow_state_slow();
  std::lock_guard<std::mutex> lock(s.mutex);
  for (const auto& key : s.unpublished) {
    const ShadowReport& r = s.reports.at(key);
    const ShadowOpKey& a = s.ring[r.first % kShadowRing];
    const ShadowOpKey& b = s.ring[r.second % kShadowRing];
    const bool a_known = a.id == r.first, b_known = b.id == r.second;
    char line[2048];
    char where[600];
    if (r.symbol.empty())
      std::snprintf(where, sizeof where, "global 0x%lx %zu", static_cast<unsigned long>(r.base), r.size);
    else
      std::snprintf(where, sizeof where, "symbol %s %zu", r.symbol.c_str(), r.size);
    std::snprintf(line, sizeof line, "cuda_cpu shadow: %s %zu %zu %s [%s] [%s] %s [%s] [%s]\n", where, r.offset,
                  r.end - r.offset, shadow_kind_name(r.first_kind), a_known && a.name ? a.name : "?",
                  a_known && a.site ? a.site : "?", shadow_kind_name(r.second_kind), b_known && b.name ? b.name : "?",
                  b_known && b.site ? b.site : "?");
    s.log += line;
    if (s.print) std::fputs(line, stderr);
  }
  if (!s.unpublished.empty() && s.print) std::fflush(stderr);
  s.unpublished.clear();
}

// Reports still unpublished when the program ends (a conflict found by its last launch on the
// legacy stream, with no call after it) are printed then.
struct ShadowAtExit {
  CGCPU_SHADOW_RT ~ShadowAtExit() { shadow_publish(); }
};
inline CGCPU_HIDDEN ShadowAtExit g_shadow_at_exit;

}  // namespace detail

// Emulator extensions (shadow build): the report lines so far (and forget them); whether
// reports also go to stderr (the default).
CGCPU_SHADOW_RT inline std::string shadow_take_reports() {
  detail::shadow_publish();
  detail::ShadowState& s = detail::shadow_state_slow();
  std::lock_guard<std::mutex> lock(s.mutex);
  std::string out;
  out.swap(s.log);
  return out;
}
CGCPU_SHADOW_RT inline void shadow_print_reports(bool print) {
  detail::ShadowState& s = detail::shadow_state_slow();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.print = print;
}
inline constexpr bool shadow_enabled() { return true; }
// Whether this copy of the code records accesses (its device region is reserved and known).
inline bool shadow_active() { return detail::g_shadow_span != 0 && detail::g_shadow != nullptr; }

}  // namespace cgcpu

// ---- the instrumentation's entry points (GCC's -fsanitize=thread ABI) -----------------------
// Weak and hidden: every translation unit has them, the linker keeps one, and another module's
// never stands in for this one's.
#define CGCPU_TSAN_ENTRY extern "C" __attribute__((weak, visibility("hidden"), no_sanitize_thread))
#define CGCPU_TSAN_ACCESS(n)                                                                                     \
  CGCPU_TSAN_ENTRY void __tsan_read##n(void* p) { ::cgcpu::detail::shadow_access(p, n, ::cgcpu::detail::kShadowRead); } \
  CGCPU_TSAN_ENTRY void __tsan_write##n(void* p) {                                                               \
    ::cgcpu::detail::shadow_access(p, n, ::cgcpu::detail::kShadowWrite);                                         \
  }                                                                                                              \
  CGCPU_TSAN_ENTRY void __tsan_unaligned_read##n(void* p) {                                                      \
    ::cgcpu::detail::shadow_access(p, n, ::cgcpu::detail::kShadowRead);                                          \
  }                                                                                                              \
  CGCPU_TSAN_ENTRY void __tsan_unaligned_write##n(void* p) {                                                     \
    ::cgcpu::detail::shadow_access(p, n, ::cgcpu::detail::kShadowWrite);                                         \
  }                                                                                                              \
  CGCPU_TSAN_ENTRY void __tsan_volatile_read##n(void* p) {                                                       \
    ::cgcpu::detail::shadow_access(p, n, ::cgcpu::detail::kShadowRead);                                          \
  }                                                                                                              \
  CGCPU_TSAN_ENTRY void __tsan_volatile_write##n(void* p) {                                                      \
    ::cgcpu::detail::shadow_access(p, n, ::cgcpu::detail::kShadowWrite);                                         \
  }
CGCPU_TSAN_ACCESS(1)
CGCPU_TSAN_ACCESS(2)
CGCPU_TSAN_ACCESS(4)
CGCPU_TSAN_ACCESS(8)
CGCPU_TSAN_ACCESS(16)
#undef CGCPU_TSAN_ACCESS
CGCPU_TSAN_ENTRY void __tsan_read_range(void* p, unsigned long size) {
  ::cgcpu::detail::shadow_access(p, size, ::cgcpu::detail::kShadowRead);
}
CGCPU_TSAN_ENTRY void __tsan_write_range(void* p, unsigned long size) {
  ::cgcpu::detail::shadow_access(p, size, ::cgcpu::detail::kShadowWrite);
}
CGCPU_TSAN_ENTRY void __tsan_init() {}
CGCPU_TSAN_ENTRY void __tsan_func_entry(void*) {}
CGCPU_TSAN_ENTRY void __tsan_func_exit() {}
CGCPU_TSAN_ENTRY void __tsan_vptr_update(void**, void*) {}
CGCPU_TSAN_ENTRY void __tsan_vptr_read(void**) {}
CGCPU_TSAN_ENTRY void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
CGCPU_TSAN_ENTRY void __tsan_atomic_signal_fence(int) { __atomic_signal_fence(__ATOMIC_SEQ_CST); }

// The atomics, done sequentially consistent (as the emulator's own are), then recorded: a load
// as a read, anything that stores as an atomic write.
#define CGCPU_TSAN_ATOMICS(bits, T)                                                                            \
  CGCPU_TSAN_ENTRY T __tsan_atomic##bits##_load(const volatile T* a, int) {                                    \
    ::cgcpu::detail::shadow_atomic(a, sizeof(T), ::cgcpu::detail::kShadowRead);                                \
    return __atomic_load_n(a, __ATOMIC_SEQ_CST);                                                               \
  }                                                                                                            \
  CGCPU_TSAN_ENTRY void __tsan_atomic##bits##_store(volatile T* a, T v, int) {                                 \
    ::cgcpu::detail::shadow_atomic(a, sizeof(T), ::cgcpu::detail::kShadowAtomic);                              \
    __atomic_store_n(a, v, __ATOMIC_SEQ_CST);                                                                  \
  }                                                                                                            \
  CGCPU_TSAN_ENTRY T __tsan_atomic##bits##_exchange(volatile T* a, T v, int) {                                 \
    ::cgcpu::detail::shadow_atomic(a, sizeof(T), ::cgcpu::detail::kShadowAtomic);                              \
    return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST);                                                        \
  }                                                                                                            \
  CGCPU_TSAN_ENTRY T __tsan_atomic##bits##_fetch_add(volatile T* a, T v, int) {                                \
    ::cgcpu::detail::shadow_atomic(a, sizeof(T), ::cgcpu::detail::kShadowAtomic);                              \
    return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST);                                                         \
  }                                                                                                            \
  CGCPU_TSAN_ENTRY T __tsan_atomic##bits##_fetch_sub(volatile T* a, T v, int) {                                \
    ::cgcpu::detail::shadow_atomic(a, sizeof(T), ::cgcpu::detail::kShadowAtomic);                              \
    return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST);                                                         \
  }                                                                                                            \
  CGCPU_TSAN_ENTRY T __tsan_atomic##bits##_fetch_and(volatile T* a, T v, int) {                                \
    ::cgcpu::detail::shadow_atomic(a, sizeof(T), ::cgcpu::detail::kShadowAtomic);                              \
    return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST);                                                         \
  }                                                                                                            \
  CGCPU_TSAN_ENTRY T __tsan_atomic##bits##_fetch_or(volatile T* a, T v, int) {                                 \
    ::cgcpu::detail::shadow_atomic(a, sizeof(T), ::cgcpu::detail::kShadowAtomic);                              \
    return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST);                                                          \
  }                                                                                                            \
  CGCPU_TSAN_ENTRY T __tsan_atomic##bits##_fetch_xor(volatile T* a, T v, int) {                                \
    ::cgcpu::detail::shadow_atomic(a, sizeof(T), ::cgcpu::detail::kShadowAtomic);                              \
    return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST);                                                         \
  }                                                                                                            \
  CGCPU_TSAN_ENTRY T __tsan_atomic##bits##_fetch_nand(volatile T* a, T v, int) {                               \
    ::cgcpu::detail::shadow_atomic(a, sizeof(T), ::cgcpu::detail::kShadowAtomic);                              \
    return __atomic_fetch_nand(a, v, __ATOMIC_SEQ_CST);                                                        \
  }                                                                                                            \
  CGCPU_TSAN_ENTRY int __tsan_atomic##bits##_compare_exchange_strong(volatile T* a, T* c, T v, int, int) {     \
    ::cgcpu::detail::shadow_atomic(a, sizeof(T), ::cgcpu::detail::kShadowAtomic);                              \
    return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                    \
  }                                                                                                            \
  CGCPU_TSAN_ENTRY int __tsan_atomic##bits##_compare_exchange_weak(volatile T* a, T* c, T v, int, int) {       \
    ::cgcpu::detail::shadow_atomic(a, sizeof(T), ::cgcpu::detail::kShadowAtomic);                              \
    return __atomic_compare_exchange_n(a, c, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                     \
  }                                                                                                            \
  CGCPU_TSAN_ENTRY T __tsan_atomic##bits##_compare_exchange_val(volatile T* a, T c, T v, int, int) {           \
    ::cgcpu::detail::shadow_atomic(a, sizeof(T), ::cgcpu::detail::kShadowAtomic);                              \
    __atomic_compare_exchange_n(a, &c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                          \
    return c;                                                                                                  \
  }
CGCPU_TSAN_ATOMICS(8, unsigned char)
CGCPU_TSAN_ATOMICS(16, unsigned short)
CGCPU_TSAN_ATOMICS(32, unsigned int)
CGCPU_TSAN_ATOMICS(64, unsigned long long)
#undef CGCPU_TSAN_ATOMICS

#else  // not the shadow build: nothing is recorded

#include <string>

namespace cgcpu {
namespace detail {
inline thread_local const ShadowOp* tls_shadow_op = nullptr;
inline void shadow_range(const void*, std::size_t, int) {}
inline void shadow_fill(const void*, std::size_t) {}
inline void shadow_scratch(const void*, std::size_t) {}
inline void shadow_matrix(const void*, std::int64_t, std::int64_t, std::int64_t, std::size_t, int) {}
inline void shadow_note_op(std::uint64_t, std::uint32_t, std::uint64_t, const char*) {}
inline void shadow_note_site(std::uint64_t, const char*) {}
inline void shadow_set_base(std::uint64_t) {}
inline void shadow_publish() {}
inline bool shadow_owns(const void*) { return false; }
inline void* shadow_allocate(std::size_t) { return nullptr; }
inline void shadow_release(void*, std::size_t) {}
}  // namespace detail
inline constexpr bool shadow_enabled() { return false; }
inline bool shadow_active() { return false; }
inline std::string shadow_take_reports() { return std::string(); }
inline void shadow_print_reports(bool) {}
}  // namespace cgcpu

#endif  // CGCPU_SHADOW
