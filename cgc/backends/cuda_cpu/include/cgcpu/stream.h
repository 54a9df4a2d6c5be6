// cuda_cpu: streams, events, and the ops they queue (README.md, "Streams and events",
// "Interleaving").
//
// Every launch, cuBLAS product, NCCL call, copy, memset, event record and event wait is an op
// of a stream. Ops of the legacy default stream (0, cudaStreamLegacy, cudaStreamPerThread) run
// when they are issued, after everything queued before them, so a program that uses only the
// default stream runs exactly as if every call were synchronous. Ops of created streams are
// queued, and run when the host waits (cudaStreamSynchronize, cudaEventSynchronize,
// cudaDeviceSynchronize, a copy to pageable host memory, cudaFree, work on the legacy stream):
// then every queued op runs, each stream in order, an event wait after the record it waits for,
// and the ops that are runnable at the same time have their items (a kernel's blocks, a
// product's row groups) handed to the one pool of workers interleaved, in an order drawn from
// CG_CPU_INTERLEAVE_SEED (0: round robin over the runnable ops; else pseudo-random picks).
//
// Each op also carries the vector clock of its stream at the time it was issued: stream order,
// event waits, the legacy stream's implicit synchronisation with blocking streams, and what the
// host has waited for. That is CUDA's happens-before, whatever order the emulator ran the ops
// in; the shadow (shadow.h) compares accesses with it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "fiber.h"
#include "linkage.h"
#include "shadow.h"
#include "state.h"
#include "types.h"

struct CUstream_st {
  unsigned flags;
  unsigned index;  // in the device's table of streams
};
struct CUevent_st {
  std::chrono::steady_clock::time_point time;
  bool recorded;    // cudaEventRecord has been called on it
  bool complete;    // its last record has run
  unsigned stream;  // the last record: its stream and place there
  std::uint64_t seq;
  std::vector<std::uint64_t> clock;  // and what happens before it
};

namespace cgcpu {
namespace detail {

typedef std::vector<std::uint64_t> Clock;

CGCPU_RUNTIME void clock_join(Clock& into, const Clock& from) {
  if (into.size() < from.size()) into.resize(from.size(), 0);
  for (std::size_t i = 0; i < from.size(); ++i)
    if (from[i] > into[i]) into[i] = from[i];
}

struct Op;

// What an op does, in three parts, run by the device's workers: `start` once when the op's
// turn comes (alone; returns how many items to run, 0 if it did all its work there), `item(i)`
// for each i (in parallel with other items of this op and of other ops; returns true to cancel
// the items not yet handed out), `finish` once after the last item (under the device's lock).
struct Work {
  virtual ~Work() {}
  virtual std::uint64_t start(Op&) { return 0; }
  virtual bool item(Op&, std::uint64_t) { return false; }
  virtual void finish(Op&) {}
  // How many items it will have (known when it is issued): the queue runs on no more workers
  // than its ops have items, as a launch always has (a one-block launch on the calling thread).
  virtual std::uint64_t expected_items() const { return 0; }
  // Started only by the host thread that runs the queue (NCCL's transport calls into the
  // process that loaded the program).
  virtual bool host_only() const { return false; }
};

struct Op {
  std::uint64_t id = 0;
  unsigned stream = 0;
  std::uint64_t seq = 0;  // its place on its stream, from 1
  Clock clock;            // what happens before it (its own entry: seq)
  ShadowOp shadow{};
  const char* name = "";
  const char* site = nullptr;  // CG_LAUNCHED's string
  std::unique_ptr<Work> work;
  // Runs once each (stream, seq) has run, besides its own stream's earlier ops: an event wait's
  // record, and the legacy stream's implicit synchronisation with blocking streams.
  std::vector<std::pair<unsigned, std::uint64_t>> after;
  CUevent_st* records = nullptr;  // an event record
  enum State { Queued, Starting, Running, Done } state = Queued;
  std::uint64_t items = 0, next = 0, finished = 0;
  cudaError_t error = cudaSuccess;  // what it left (a kernel's fault)
};

struct StreamState {
  bool blocking = true;  // synchronises with the legacy stream (not cudaStreamNonBlocking)
  bool alive = true;
  std::uint64_t seq = 0, retired = 0;
  Clock clock;
  std::deque<std::shared_ptr<Op>> queue;  // not yet run, in order
  // (seq, id) of the ops the host has not waited for: the shadow's base (shadow.h)
  std::deque<std::pair<std::uint64_t, std::uint64_t>> open;
};

struct Device {
  std::mutex mutex;  // everything below
  std::condition_variable wake;
  std::vector<StreamState> streams;  // [0]: the legacy default stream
  Clock host;                        // what the host has waited for
  std::uint64_t next_id = 1;
  std::uint64_t pending = 0;         // ops not yet run to the end
  std::vector<Op*> active;           // started ops with items
  std::uint64_t picks = 0;
  std::uint64_t rng = 0;
  std::set<std::string> sites;       // CG_LAUNCHED strings, kept for the reports
  Device() {
    streams.emplace_back();
    streams[0].clock.assign(1, 0);
  }
};

inline Device& device() {
  static Device* instance = new Device;  // never freed: ops may run until the process ends
  return *instance;
}

// The host thread's last issued op, for CG_LAUNCHED to name (kept: a legacy stream's op has run,
// and would be gone, by then).
inline thread_local std::shared_ptr<Op> tls_last_op;
// Whether this thread runs the queue (run_pending): the one that may start host-only ops.
inline thread_local bool tls_runs_queue = false;

// capture.h: an op issued on a capturing stream that no capture hook kept is refused there;
// CG_LAUNCHED after a captured call names the call.
CGCPU_RUNTIME bool capture_refuses(cudaStream_t stream);
CGCPU_RUNTIME bool capture_site(const char* site);

CGCPU_RUNTIME bool is_legacy(cudaStream_t stream) {
  return stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread;
}
inline unsigned stream_index(cudaStream_t stream) { return is_legacy(stream) ? 0 : stream->index; }

// A new stream's entry (d.mutex not held).
CGCPU_RUNTIME unsigned add_stream(bool blocking) {
  Device& d = device();
  std::lock_guard<std::mutex> lock(d.mutex);
  d.streams.emplace_back();
  StreamState& s = d.streams.back();
  s.blocking = blocking;
  s.clock = d.host;
  return static_cast<unsigned>(d.streams.size() - 1);
}

// Issues an op on `stream`; `wait_on` makes it an event wait, `record` an event record.
CGCPU_RUNTIME std::shared_ptr<Op> enqueue(cudaStream_t stream, const char* name, std::unique_ptr<Work> work,
                                   const CUevent_st* wait_on = nullptr, CUevent_st* record = nullptr) {
  if (capture_refuses(stream)) {  // never queued: the capture is invalidated, the call's error left
    std::shared_ptr<Op> refused = std::make_shared<Op>();
    refused->state = Op::Done;
    refused->error = is_legacy(stream) ? cudaErrorStreamCaptureImplicit : cudaErrorStreamCaptureUnsupported;
    refused->work = std::move(work);
    return refused;
  }
  Device& d = device();
  std::lock_guard<std::mutex> lock(d.mutex);
  const unsigned s = stream_index(stream);
  StreamState& st = d.streams[s];
  std::shared_ptr<Op> op = std::make_shared<Op>();
  clock_join(st.clock, d.host);
  auto follow = [&](unsigned t) {  // op runs after stream t's work so far, and is ordered after it
    clock_join(st.clock, d.streams[t].clock);
    if (d.streams[t].seq > d.streams[t].retired) op->after.emplace_back(t, d.streams[t].seq);
  };
  if (s == 0) {  // the legacy stream waits for every blocking stream's work so far ...
    for (unsigned t = 1; t < d.streams.size(); ++t)
      if (d.streams[t].blocking && d.streams[t].alive) follow(t);
  } else if (st.blocking) {  // ... and a blocking stream for the legacy stream's
    follow(0);
  }
  if (wait_on != nullptr && wait_on->recorded) {  // the event's last record, in host order
    clock_join(st.clock, wait_on->clock);
    if (d.streams[wait_on->stream].retired < wait_on->seq) op->after.emplace_back(wait_on->stream, wait_on->seq);
  }
  if (st.clock.size() <= s) st.clock.resize(s + 1, 0);
  st.clock[s] = ++st.seq;
  op->id = d.next_id++;
  op->stream = s;
  op->seq = st.seq;
  op->clock = st.clock;
  op->shadow = ShadowOp{static_cast<std::uint32_t>(op->id), static_cast<std::uint32_t>(op->clock.size()),
                        op->clock.data()};
  op->name = name;
  op->work = work ? std::move(work) : std::unique_ptr<Work>(new Work);
  if (record != nullptr) {
    record->recorded = true;
    record->complete = false;
    record->stream = s;
    record->seq = st.seq;
    record->clock = st.clock;
    op->records = record;
  }
  st.queue.push_back(op);
  st.open.emplace_back(op->seq, op->id);
  ++d.pending;
  shadow_note_op(op->id, s, op->seq, name);
  tls_last_op = op;
  return op;
}

// ---- running the queue ---------------------------------------------------------------------
struct ShadowScope {  // the op this OS thread is running, for the shadow
  explicit ShadowScope(const ShadowOp& op) { tls_shadow_op = &op; }
  ~ShadowScope() { tls_shadow_op = nullptr; }
};

CGCPU_RUNTIME bool op_ready(const Device& d, const Op& op) {
  if (op.state != Op::Queued) return false;
  for (const auto& prerequisite : op.after)
    if (d.streams[prerequisite.first].retired < prerequisite.second) return false;
  return true;
}

CGCPU_SHADOW_SKIP CGCPU_RUNTIME void retire(Device& d, Op& op) {  // d.mutex held
  op.work->finish(op);
  op.state = Op::Done;
  if (op.records != nullptr) {
    op.records->time = std::chrono::steady_clock::now();
    op.records->complete = op.records->stream == op.stream && op.records->seq == op.seq;
  }
  StreamState& st = d.streams[op.stream];
  st.retired = op.seq;
  st.queue.pop_front();  // op: only a stream's first op runs
  --d.pending;
  d.wake.notify_all();
}

// The next item to run: an op among the active ones that has items left, round robin or drawn
// from the interleaving seed.
CGCPU_SHADOW_SKIP CGCPU_RUNTIME Op* pick(Device& d) {
  Op* candidates[64];
  std::size_t count = 0;
  for (Op* op : d.active)
    if (op->next < op->items && count < 64) candidates[count++] = op;
  if (count <= 1) return count == 1 ? candidates[0] : nullptr;
  const std::uint64_t seed = config().interleave_seed.load(std::memory_order_relaxed);
  if (seed == 0) return candidates[d.picks++ % count];
  if (d.rng == 0) d.rng = mix(seed) | 1u;
  d.rng ^= d.rng << 13;
  d.rng ^= d.rng >> 7;
  d.rng ^= d.rng << 17;
  return candidates[d.rng % count];
}

// One worker's part in running the queue: start what may start, run items, until every op has run.
CGCPU_SHADOW_SKIP CGCPU_RUNTIME void participate(void*, std::uint64_t) {
  Device& d = device();
  std::unique_lock<std::mutex> lock(d.mutex);
  for (;;) {
    Op* starting = nullptr;
    for (StreamState& st : d.streams) {
      if (st.queue.empty()) continue;
      Op& first = *st.queue.front();
      if (op_ready(d, first) && (tls_runs_queue || !first.work->host_only())) {
        starting = &first;
        break;
      }
    }
    if (starting != nullptr) {
      starting->state = Op::Starting;
      lock.unlock();
      std::uint64_t items;
      {
        ShadowScope scope(starting->shadow);
        items = starting->work->start(*starting);
      }
      lock.lock();
      starting->items = items;
      if (items == 0) {
        retire(d, *starting);
      } else {
        starting->state = Op::Running;
        d.active.push_back(starting);
        d.wake.notify_all();
      }
      continue;
    }
    if (Op* op = pick(d)) {
      const std::uint64_t index = op->next++;
      lock.unlock();
      bool cancel;
      {
        ShadowScope scope(op->shadow);
        cancel = op->work->item(*op, index);
      }
      lock.lock();
      if (cancel && op->items > op->next) op->items = op->next;  // hand out no more
      if (++op->finished == op->items) {
        for (std::size_t i = 0; i < d.active.size(); ++i)
          if (d.active[i] == op) {
            d.active.erase(d.active.begin() + static_cast<std::ptrdiff_t>(i));
            break;
          }
        retire(d, *op);
      }
      continue;
    }
    if (d.pending == 0) return;
    d.wake.wait(lock);
  }
}

// Runs every queued op, on this thread and the pool's helpers. `publish`: print the shadow's
// reports at the end (a launch on the legacy stream leaves them for CG_LAUNCHED to name it).
CGCPU_RUNTIME void run_pending(bool publish = true) {
  if (tls_worker_active()) return;  // device code does not wait for the device
  std::lock_guard<std::recursive_mutex> serial(device_mutex());
  shadow_publish();
  Device& d = device();
  {
    std::lock_guard<std::mutex> lock(d.mutex);
    if (d.pending == 0) return;
  }
  std::uint64_t items = 0;
  {
    std::lock_guard<std::mutex> lock(d.mutex);
    for (const StreamState& st : d.streams)
      for (const std::shared_ptr<Op>& op : st.queue) items += op->work->expected_items();
  }
  const std::uint64_t threads = config().threads;
  tls_runs_queue = true;
  pool().parallel_for(items < 1 ? 1 : (items < threads ? items : threads), &participate, nullptr);
  tls_runs_queue = false;
  if (publish) shadow_publish();
}

// The host has waited for `clock`: later ops are ordered after it, and ops it covers no
// longer need the shadow's bookkeeping.
CGCPU_RUNTIME void host_waited(const Clock& clock) {
  Device& d = device();
  std::lock_guard<std::mutex> lock(d.mutex);
  clock_join(d.host, clock);
  std::uint64_t base = d.next_id;
  for (std::size_t s = 0; s < d.streams.size(); ++s) {
    auto& open = d.streams[s].open;
    const std::uint64_t waited = s < d.host.size() ? d.host[s] : 0;
    while (!open.empty() && open.front().first <= waited) open.pop_front();
    if (!open.empty() && open.front().second < base) base = open.front().second;
  }
  shadow_set_base(base);
}

CGCPU_RUNTIME void wait_stream(cudaStream_t stream) {
  run_pending();
  Clock clock;
  {
    Device& d = device();
    std::lock_guard<std::mutex> lock(d.mutex);
    clock = d.streams[stream_index(stream)].clock;
  }
  host_waited(clock);
}

CGCPU_RUNTIME void wait_device() {
  run_pending();
  Clock clock;
  {
    Device& d = device();
    std::lock_guard<std::mutex> lock(d.mutex);
    for (const StreamState& s : d.streams) clock_join(clock, s.clock);
  }
  host_waited(clock);
}

// CG_LAUNCHED(where): names the op this thread issued last (its site, in faults and reports).
CGCPU_RUNTIME const char* intern_site(const char* where) {
  Device& d = device();
  std::lock_guard<std::mutex> lock(d.mutex);
  return d.sites.insert(where).first->c_str();
}

}  // namespace detail

CGCPU_RUNTIME void launch_site(const char* where) {
  if (where != nullptr && detail::capture_site(where)) return;
  std::shared_ptr<detail::Op> op = detail::tls_last_op;
  if (op != nullptr && where != nullptr) {
    const char* site = detail::intern_site(where);
    detail::Device& d = detail::device();
    std::lock_guard<std::mutex> lock(d.mutex);
    op->site = site;
    detail::shadow_note_site(op->id, site);
  }
  detail::shadow_publish();
}

// Emulator extension: the order in which the items of ops runnable at the same time are handed
// out (0: round robin; else pseudo-random from the seed). Also CG_CPU_INTERLEAVE_SEED.
CGCPU_RUNTIME void set_interleave_seed(std::uint64_t seed) {
  config().interleave_seed.store(seed);
  detail::Device& d = detail::device();
  std::lock_guard<std::mutex> lock(d.mutex);
  d.rng = 0;
  d.picks = 0;
}

}  // namespace cgcpu
