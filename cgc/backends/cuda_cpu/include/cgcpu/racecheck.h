// cuda_cpu: racecheck, the report side. In a ThreadSanitizer build (-fsanitize=thread; the
// emulated backend's `racecheck`), every CUDA thread is a TSan fiber named after its kernel,
// block and thread, and the happens-before edges between them are exactly CUDA's: barriers
// (__syncthreads, __syncwarp), block start and end (README.md, "Racecheck"). TSan prints its
// own report for each race; the hook below follows it with one line that places the address:
//
//   cuda_cpu racecheck: KIND OFFSET ACCESS SIZE PREVIOUS-ACCESS SIZE [THREAD] [PREVIOUS-THREAD]
//
// KIND is `dynamic` (OFFSET from the block's dynamic shared memory), `tls` (OFFSET from
// cgcpu::detail::tls_racecheck_anchor in the worker's thread-local storage, where static
// __shared__ variables live: the symbol table names the variable), `global` (OFFSET from the
// start of a cudaMalloc allocation, whose size follows as `global+SIZE`) or `other`; an access
// is `read` or `write`; a thread is its TSan fiber's name, "cgImageLayerNorm block (3,0,0)
// thread 37", or the OS thread's. Nothing here exists without ThreadSanitizer.
#pragma once

#include "runtime_api.h"
#include "scheduler.h"

#if CGCPU_TSAN
#include <cstdio>
#include <cstring>

extern "C" {
int __tsan_get_report_data(void* report, const char** description, int* count, int* stack_count, int* mop_count,
                           int* loc_count, int* mutex_count, int* thread_count, int* unique_tid_count,
                           void** sleep_trace, unsigned long trace_size);
int __tsan_get_report_mop(void* report, unsigned long idx, int* tid, void** addr, int* size, int* write,
                          int* atomic, void** trace, unsigned long trace_size);
int __tsan_get_report_thread(void* report, unsigned long idx, int* tid, unsigned long* os_id, int* running,
                             const char** name, int* parent_tid, void** trace, unsigned long trace_size);
}

namespace cgcpu {
namespace detail {

// Static shared memory is thread-local: its addresses are given relative to this variable's.
inline thread_local char tls_racecheck_anchor __attribute__((used)) = 0;

__attribute__((no_sanitize_thread)) inline const char* racecheck_thread_name(void* report, int thread_count,
                                                                             int tid) {
  for (int t = 0; t < thread_count; ++t) {
    int id = -1, running = 0, parent = 0;
    unsigned long os_id = 0;
    const char* name = nullptr;
    void* trace[1];
    if (__tsan_get_report_thread(report, t, &id, &os_id, &running, &name, &parent, trace, 1) && id == tid)
      return name != nullptr && name[0] != '\0' ? name : (tid == 0 ? "main thread" : "OS thread");
  }
  return "?";
}

__attribute__((no_sanitize_thread)) inline void racecheck_report(void* report) {
  const char* description = "";
  int count = 0, stacks = 0, mops = 0, locations = 0, mutexes = 0, threads = 0, unique = 0;
  void* sleep[1];
  if (!__tsan_get_report_data(report, &description, &count, &stacks, &mops, &locations, &mutexes, &threads, &unique,
                              sleep, 1))
    return;
  if (std::strcmp(description, "data-race") != 0 || mops < 1) {
    std::fprintf(stderr, "cuda_cpu racecheck: other %s\n", description);
    return;
  }
  int tid[2] = {-1, -1}, size[2] = {0, 0}, write[2] = {0, 0}, atomic[2] = {0, 0};
  void* address[2] = {nullptr, nullptr};
  for (int m = 0; m < 2 && m < mops; ++m) {
    void* trace[1];
    __tsan_get_report_mop(report, m, &tid[m], &address[m], &size[m], &write[m], &atomic[m], trace, 1);
  }
  const std::uintptr_t at = reinterpret_cast<std::uintptr_t>(address[0]);
  char where[96];
  const Worker* w = tls_worker;
  const std::uintptr_t shared = reinterpret_cast<std::uintptr_t>(tls_dynamic_shared);
  if (w != nullptr && w->launch != nullptr && shared != 0 && at >= shared && at < shared + w->launch->shared) {
    std::snprintf(where, sizeof where, "dynamic %lu", static_cast<unsigned long>(at - shared));
  } else {
    const std::uintptr_t anchor = reinterpret_cast<std::uintptr_t>(&tls_racecheck_anchor);
    // This worker's static TLS block (the emitted program's __shared__ variables among it) lies
    // within a few MiB of the anchor; device memory and the heap are far from it.
    const long long delta = static_cast<long long>(at - anchor);
    bool global = false;
    const Registry& r = registry();  // not locked: allocations change only between launches
    auto it = r.allocations.upper_bound(at);
    if (it != r.allocations.begin()) {
      --it;
      if (at - it->first < it->second) {
        std::snprintf(where, sizeof where, "global+%lu %lu", static_cast<unsigned long>(it->second),
                      static_cast<unsigned long>(at - it->first));
        global = true;
      }
    }
    if (!global) {
      if (delta > -(1ll << 24) && delta < (1ll << 24))
        std::snprintf(where, sizeof where, "tls %lld", delta);
      else
        std::snprintf(where, sizeof where, "other 0x%lx", static_cast<unsigned long>(at));
    }
  }
  std::fprintf(stderr, "cuda_cpu racecheck: %s %s %d %s %d [%s] [%s]\n", where, write[0] ? "write" : "read", size[0],
               mops > 1 ? (write[1] ? "write" : "read") : "?", mops > 1 ? size[1] : 0,
               racecheck_thread_name(report, threads, tid[0]),
               mops > 1 ? racecheck_thread_name(report, threads, tid[1]) : "?");
  std::fflush(stderr);
}

}  // namespace detail
}  // namespace cgcpu

// Called by ThreadSanitizer after it prints each report (weak, as its own default is).
extern "C" __attribute__((weak, no_sanitize_thread)) void __tsan_on_report(void* report) {
  cgcpu::detail::racecheck_report(report);
}
#endif  // CGCPU_TSAN
