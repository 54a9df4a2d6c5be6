// cuda_cpu: configuration (environment), error state and the worker thread pool.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "linkage.h"
#include "types.h"

namespace cgcpu {

// ---- configuration, read once from the environment ------------------------------------------
// CG_CPU_THREADS       OS worker threads (default: std::thread::hardware_concurrency()).
// CG_CPU_STACK_KIB     stack of each CUDA thread's fiber (default 64, 256 under ASan).
// CG_CPU_SCHEDULE_SEED 0 (default): a block's ready fibers run in order of their thread
//                      index; any other value: in a pseudo-random order drawn from that seed
//                      (and the launch and block), to shake out missing barriers.
// CG_CPU_SHARED_FILL   byte that fills a block's dynamic shared memory before the block
//                      starts (default 255: floats read before written are NaN); -1: none.
// CG_CPU_ABORT         1: abort() on a kernel fault (deadlock, misused collective) instead of
//                      failing the launch with a sticky cudaErrorLaunchFailure.
// CG_CPU_BLOCKS        a comma-separated list of linear block indices (negative: from the
//                      end, -1 the last block): every launch runs only those of its blocks
//                      that exist (block sampling; unset or empty: every block).
// CG_CPU_UNSAMPLED     a comma-separated list of kernel names whose launches run every block
//                      whatever CG_CPU_BLOCKS says (a kernel whose last block needs them all).
// CG_CPU_DISABLE_BARRIER  a barrier site number: cgcpu::barrier_disabled(n) is true for it
//                      (the racecheck campaign's hook; default -1, none).
// CG_CPU_INTERLEAVE_SEED  the order in which the blocks of launches that may run at the same
//                      time (on different streams, unordered by events) are handed out:
//                      0 (default) round robin over them, any other value pseudo-random picks
//                      drawn from it (stream.h).
// CG_CPU_SKIP_WAIT     a number n: the n-th cudaStreamWaitEvent of the process (from 0) waits
//                      for nothing (the concurrency campaign's hook: a join or fork removed,
//                      which the shadow must report; default -1, none).
struct Config {
  unsigned threads = 1;
  std::size_t stack_bytes = 64 * 1024;
  int shared_fill = 255;
  bool abort_on_fault = false;
  std::atomic<std::uint64_t> seed{0};
  std::atomic<long> disabled_barrier{-1};
  std::atomic<std::uint64_t> interleave_seed{0};
  std::atomic<long> skipped_wait{-1};
  std::atomic<long> waits{0};
  // Block sampling: written by the host between launches (under the device lock).
  std::mutex blocks_mutex;
  std::vector<long long> blocks;
  std::vector<std::string> unsampled;  // kernels that run every block (CG_CPU_UNSAMPLED)
};

namespace detail {
CGCPU_RUNTIME long env_long(const char* name, long fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  const long value = std::strtol(text, &end, 0);
  if (end == text || *end != '\0') {
    std::fprintf(stderr, "cuda_cpu: ignoring %s=%s (not a number)\n", name, text);
    return fallback;
  }
  return value;
}
}  // namespace detail

inline Config& config() {
  static Config* instance = [] {
    Config* c = new Config;  // never freed: read by worker threads until the process ends
    const unsigned cores = std::thread::hardware_concurrency();
    long threads = detail::env_long("CG_CPU_THREADS", cores == 0 ? 1 : cores);
    c->threads = threads < 1 ? 1u : (threads > 1024 ? 1024u : static_cast<unsigned>(threads));
#if defined(__SANITIZE_ADDRESS__)
    const long stack_default = 256;
#else
    const long stack_default = 64;
#endif
    long stack = detail::env_long("CG_CPU_STACK_KIB", stack_default);
    if (stack < 16) stack = 16;
    c->stack_bytes = static_cast<std::size_t>(stack) * 1024;
    c->shared_fill = static_cast<int>(detail::env_long("CG_CPU_SHARED_FILL", 255));
    c->abort_on_fault = detail::env_long("CG_CPU_ABORT", 0) != 0;
    c->seed.store(static_cast<std::uint64_t>(detail::env_long("CG_CPU_SCHEDULE_SEED", 0)));
    c->disabled_barrier.store(detail::env_long("CG_CPU_DISABLE_BARRIER", -1));
    c->interleave_seed.store(static_cast<std::uint64_t>(detail::env_long("CG_CPU_INTERLEAVE_SEED", 0)));
    c->skipped_wait.store(detail::env_long("CG_CPU_SKIP_WAIT", -1));
    if (const char* text = std::getenv("CG_CPU_BLOCKS")) {
      for (const char* at = text; *at != '\0';) {
        char* end = nullptr;
        const long long block = std::strtoll(at, &end, 0);
        if (end == at) {
          std::fprintf(stderr, "cuda_cpu: ignoring CG_CPU_BLOCKS=%s (not a list of numbers)\n", text);
          c->blocks.clear();
          break;
        }
        c->blocks.push_back(block);
        at = *end == ',' ? end + 1 : end;
      }
    }
    if (const char* text = std::getenv("CG_CPU_UNSAMPLED")) {
      std::string names = text;
      for (std::size_t at = 0; at <= names.size();) {
        const std::size_t comma = std::min(names.find(',', at), names.size());
        if (comma > at) c->unsampled.push_back(names.substr(at, comma - at));
        at = comma + 1;
      }
    }
    return c;
  }();
  return *instance;
}

// Emulator extension: the order in which ready fibers run (0: thread order; see Config).
inline void set_schedule_seed(std::uint64_t seed) { config().seed.store(seed); }

// Emulator extension: every later launch runs only these linear block indices (negative: from
// the end of the grid; indices outside the grid are skipped); count 0 runs every block again.
CGCPU_RUNTIME void set_block_sample(const long long* blocks, std::size_t count) {
  Config& c = config();
  std::lock_guard<std::mutex> lock(c.blocks_mutex);
  c.blocks.assign(blocks, blocks + count);
}

// Emulator extension, the racecheck campaign's hook: the emitted file's barriers, numbered and
// rewritten as `if (!cgcpu::barrier_disabled(n)) __syncthreads();`, skip barrier site n.
inline void set_disabled_barrier(long site) { config().disabled_barrier.store(site); }
inline bool barrier_disabled(long site) {
  return site == config().disabled_barrier.load(std::memory_order_relaxed);
}

// Emulator extension, the concurrency campaign's hook: the n-th cudaStreamWaitEvent of the
// process (from 0) waits for nothing; -1: none.
CGCPU_RUNTIME void set_skipped_wait(long n) {
  config().skipped_wait.store(n);
  config().waits.store(0);
}
namespace detail {
CGCPU_RUNTIME bool skip_this_wait() {
  const long n = config().waits.fetch_add(1);
  return n == config().skipped_wait.load(std::memory_order_relaxed);
}
}  // namespace detail

// ---- error state -------------------------------------------------------------------------
namespace detail {
inline std::uint64_t mix(std::uint64_t x) {  // splitmix64
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

struct Worker;
inline thread_local Worker* tls_worker = nullptr;  // set while this OS thread runs a block
inline bool tls_worker_active() { return tls_worker != nullptr; }

// The last error of this host thread (cudaGetLastError clears it), and the sticky error a
// faulting kernel leaves: as on a GPU, every later call returns it.
inline thread_local cudaError_t tls_last_error = cudaSuccess;
inline std::atomic<int> sticky_error{cudaSuccess};

inline cudaError_t record(cudaError_t error) {
  if (error != cudaSuccess) tls_last_error = error;
  return error;
}
inline cudaError_t sticky() { return static_cast<cudaError_t>(sticky_error.load()); }
}  // namespace detail

// ---- the worker pool -------------------------------------------------------------------
// parallel_for(count, fn, context) runs fn(context, i) for every i < count on the calling
// thread and up to config().threads - 1 helper threads; each takes the next index in turn.
// One job at a time: the queue of stream.h (run_pending), each thread one participant.
namespace detail {
typedef void (*IndexFunction)(void* context, std::uint64_t index);

class Pool {
 public:
  explicit Pool(unsigned helpers) {
    for (unsigned i = 0; i < helpers; ++i) threads_.emplace_back([this, i] { loop(i); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (std::thread& t : threads_) t.join();
  }
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  unsigned helpers() const { return static_cast<unsigned>(threads_.size()); }

  void parallel_for(std::uint64_t count, IndexFunction fn, void* context) {
    if (count == 0) return;
    const std::uint64_t helpers_wanted = count - 1 < threads_.size() ? count - 1 : threads_.size();
    if (helpers_wanted == 0) {
      for (std::uint64_t i = 0; i < count; ++i) {
        if (cancel_.load(std::memory_order_relaxed)) break;
        fn(context, i);
      }
      cancel_.store(false);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      fn_ = fn;
      context_ = context;
      count_ = count;
      next_.store(0);
      participants_ = static_cast<unsigned>(helpers_wanted);
      pending_ = participants_;
      ++generation_;
    }
    wake_.notify_all();
    work();
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return pending_ == 0; });
    cancel_.store(false);
  }

  // Stops handing out indices of the current job (a kernel faulted).
  void cancel() { cancel_.store(true); }

 private:
  void work() {
    for (;;) {
      if (cancel_.load(std::memory_order_relaxed)) return;
      const std::uint64_t i = next_.fetch_add(1);
      if (i >= count_) return;
      fn_(context_, i);
    }
  }
  void loop(unsigned id) {
    std::uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        if (id >= participants_) continue;
      }
      work();
      {
        std::lock_guard<std::mutex> lock(mutex_);
        --pending_;
      }
      done_.notify_one();
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  bool stop_ = false;
  std::uint64_t generation_ = 0;
  unsigned participants_ = 0, pending_ = 0;
  IndexFunction fn_ = nullptr;
  void* context_ = nullptr;
  std::uint64_t count_ = 0;
  std::atomic<std::uint64_t> next_{0};
  std::atomic<bool> cancel_{false};
};

inline Pool& pool() {
  static Pool instance(config().threads - 1);
  return instance;
}

// The host's calls that issue or run work, one at a time (stream.h runs the queue under it).
inline std::recursive_mutex& device_mutex() {
  static std::recursive_mutex m;
  return m;
}
}  // namespace detail
}  // namespace cgcpu
