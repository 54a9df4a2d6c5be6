// cuda_cpu: stream capture, the state behind CUDA graphs (README.md, "Graphs").
//
// A graph here is the list of calls a capture saw, each kept as a closure that makes the same
// call again with the same arguments (values the call reads at once, such as cuBLASLt's
// descriptor and alpha, copied when it was captured, as CUDA bakes them into the graph's node).
// Launching the graph makes those calls again, in capture order, on the streams they were
// captured on: the order of a fork and a join (an event record, then a wait) is kept by the
// calls themselves, so a replay runs, races and is checked as an eager step of the same calls.
//
// What CUDA refuses while a stream captures (cudaStreamCaptureModeGlobal, the mode the emitted
// programs use), the twin refuses: work on the legacy stream, waiting on the host for a capturing
// stream or the device, an allocation or a free, and any op the twin cannot keep as a closure
// (a copy from or to host memory): the call returns its error and the capture is invalidated,
// so cudaStreamEndCapture returns cudaErrorStreamCaptureInvalidated. A stream that joined the
// capture (it waited for an event recorded in it) must rejoin its origin before the capture
// ends (cudaErrorStreamCaptureUnjoined).
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "linkage.h"
#include "stream.h"
#include "types.h"

struct CUgraph_st {
  // One captured call: `issue` makes it again; `site` is what CG_LAUNCHED named it, if anything.
  struct Call {
    std::function<void()> issue;
    const char* site = nullptr;
  };
  std::vector<Call> calls;
  cudaStream_t origin = nullptr;
};
struct CUgraphExec_st {
  std::vector<CUgraph_st::Call> calls;
  cudaStream_t origin = nullptr;
};
typedef CUgraph_st* cudaGraph_t;
typedef CUgraphExec_st* cudaGraphExec_t;

namespace cgcpu {
namespace detail {

struct Capture {
  CUgraph_st* graph = nullptr;
  unsigned origin = 0;
  cudaError_t invalidated = cudaSuccess;  // the first refused call's error
  std::map<unsigned, std::uint64_t> calls;  // member stream -> calls captured on it
  // A member's work is joined into another member up to this many calls (a wait, there, for
  // an event it recorded after them).
  std::map<unsigned, std::vector<std::pair<unsigned, std::uint64_t>>> joins;
};

struct CaptureRecord {  // an event recorded in a capture: by which member, after how many calls
  Capture* capture;
  unsigned stream;
  std::uint64_t calls;
};

struct Captures {
  std::recursive_mutex mutex;
  // How many captures are active (active.size()), read without the lock: every hook below
  // returns at once where none is, so the calls of a program that never captures pay nothing.
  std::atomic<int> count{0};
  std::vector<std::unique_ptr<Capture>> active;
  std::map<unsigned, Capture*> members;  // stream index -> its capture
  std::map<const CUevent_st*, CaptureRecord> records;
  CUgraph_st::Call* last = nullptr;  // the call captured last (CG_LAUNCHED names it)
};
inline Captures& captures() {
  static Captures* instance = new Captures;
  return *instance;
}

CGCPU_RUNTIME Capture* capture_of(cudaStream_t stream) {
  Captures& c = captures();
  std::lock_guard<std::recursive_mutex> lock(c.mutex);
  auto found = c.members.find(stream_index(stream));
  return found == c.members.end() ? nullptr : found->second;
}

inline bool any_capture() { return captures().count.load(std::memory_order_acquire) != 0; }

CGCPU_RUNTIME void invalidate(Capture& capture, cudaError_t why) {
  if (capture.invalidated == cudaSuccess) capture.invalidated = why;
}

// A call CUDA refuses while any stream captures (global mode): every capture is invalidated.
// Returns the call's error, or cudaSuccess where nothing captures.
CGCPU_RUNTIME cudaError_t capture_forbids(cudaError_t why = cudaErrorStreamCaptureUnsupported) {
  Captures& c = captures();
  std::lock_guard<std::recursive_mutex> lock(c.mutex);
  if (c.active.empty()) return cudaSuccess;
  for (auto& capture : c.active) invalidate(*capture, why);
  return record(why);
}

// Where `stream` captures, keeps `issue` (a closure that makes the same call again) as its next
// call and returns true (the caller does nothing more); else false, and `issue` is dropped
// unused (no std::function is made).
template <class Issue>
inline bool capture_call(cudaStream_t stream, Issue&& issue) {
  if (!any_capture()) return false;
  Captures& c = captures();
  std::lock_guard<std::recursive_mutex> lock(c.mutex);
  Capture* capture = capture_of(stream);
  if (capture == nullptr) return false;
  capture->graph->calls.push_back(CUgraph_st::Call{std::function<void()>(std::forward<Issue>(issue)), nullptr});
  ++capture->calls[stream_index(stream)];
  c.last = &capture->graph->calls.back();
  tls_last_op = nullptr;  // CG_LAUNCHED names the captured call, not an op run before
  return true;
}

// An op issued on a capturing stream that no hook above kept (enqueue's guard): refused.
CGCPU_RUNTIME bool capture_refuses(cudaStream_t stream) {
  if (!any_capture()) return false;
  if (is_legacy(stream)) return capture_forbids(cudaErrorStreamCaptureImplicit) != cudaSuccess;
  Capture* capture = capture_of(stream);
  if (capture == nullptr) return false;
  invalidate(*capture, cudaErrorStreamCaptureUnsupported);
  record(cudaErrorStreamCaptureUnsupported);
  return true;
}

// CG_LAUNCHED after a captured call: the site goes with the call, for its replays' faults.
CGCPU_RUNTIME bool capture_site(const char* site) {
  if (!any_capture()) return false;
  Captures& c = captures();
  std::lock_guard<std::recursive_mutex> lock(c.mutex);
  if (c.last == nullptr || tls_last_op != nullptr) return false;
  c.last->site = site;
  c.last = nullptr;
  return true;
}

// An event recorded on a capturing stream: a later wait for it joins the waiting stream.
CGCPU_RUNTIME void capture_note_record(cudaStream_t stream, const CUevent_st* event) {
  if (!any_capture()) return;  // no capture, no captured record (an ended one takes its own)
  Captures& c = captures();
  std::lock_guard<std::recursive_mutex> lock(c.mutex);
  Capture* capture = capture_of(stream);
  if (capture == nullptr) {
    c.records.erase(event);
    return;
  }
  const unsigned s = stream_index(stream);
  c.records[event] = CaptureRecord{capture, s, capture->calls[s]};
}

// A wait for an event recorded in a capture: the waiting stream joins that capture, and the
// recording stream's calls up to the record are joined into the waiting one.
CGCPU_RUNTIME void capture_note_wait(cudaStream_t stream, const CUevent_st* event) {
  if (!any_capture()) return;
  Captures& c = captures();
  std::lock_guard<std::recursive_mutex> lock(c.mutex);
  auto found = c.records.find(event);
  if (found == c.records.end()) return;
  const CaptureRecord recorded = found->second;
  const unsigned s = stream_index(stream);
  Capture* mine = capture_of(stream);
  if (mine == nullptr && s != 0) {
    c.members[s] = recorded.capture;
    recorded.capture->calls[s];
    mine = recorded.capture;
  }
  if (mine != recorded.capture) return;
  recorded.capture->joins[recorded.stream].emplace_back(s, recorded.calls);
}

// Whether the event's last record was captured (a node of a graph being made, not an event the
// host may wait for or time): if so, its capture is invalidated and the call's error left.
CGCPU_RUNTIME bool captured_event(const CUevent_st* event) {
  if (!any_capture()) return false;
  Captures& c = captures();
  std::lock_guard<std::recursive_mutex> lock(c.mutex);
  auto found = c.records.find(event);
  if (found == c.records.end()) return false;
  invalidate(*found->second.capture, cudaErrorStreamCaptureUnsupported);
  return true;
}

// Whether every call of member `s` is joined, through waits, into the origin.
CGCPU_RUNTIME bool capture_joined(const Capture& capture, unsigned s, std::vector<unsigned>& visiting) {
  if (s == capture.origin) return true;
  for (unsigned v : visiting)
    if (v == s) return false;
  auto calls = capture.calls.find(s);
  auto joins = capture.joins.find(s);
  if (joins == capture.joins.end()) return false;
  visiting.push_back(s);
  bool joined = false;
  for (const auto& join : joins->second)
    if (join.second == calls->second && capture_joined(capture, join.first, visiting)) joined = true;
  visiting.pop_back();
  return joined;
}

}  // namespace detail
}  // namespace cgcpu
