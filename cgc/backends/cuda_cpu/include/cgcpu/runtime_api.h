// cuda_cpu: the CUDA runtime API the emitted host programs use, on host memory.
// "Device" memory is host memory from operator new (256-byte aligned, the exact size asked
// for, so ASan sees every byte past an allocation; in the shadow build, from the shadow's
// region). Work on the legacy default stream has run when its call returns; work on created
// streams is queued and runs when the host waits (stream.h). Errors behave as on a GPU: a bad
// call returns its error and leaves it for cudaGetLastError (cleared by reading); a kernel that
// faults leaves a sticky cudaErrorLaunchFailure that every later call returns.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <set>

#include "linkage.h"
#include "scheduler.h"
#include "shadow.h"
#include "state.h"
#include "stream.h"
#include "types.h"

namespace cgcpu {
namespace detail {

constexpr std::size_t kAllocationAlignment = 256;

struct Registry {
  std::mutex mutex;
  std::map<std::uintptr_t, std::size_t> allocations;  // start -> bytes
  std::map<std::uintptr_t, std::size_t> pinned;       // cudaMallocHost: start -> bytes
  std::set<const void*> streams, events;
};
inline Registry& registry() {
  static Registry* r = new Registry;  // outlives static destructors that may still free memory
  return *r;
}

// Whether [p, p + bytes) lies inside one allocation.
CGCPU_RUNTIME bool device_range(const void* p, std::size_t bytes) {
  const std::uintptr_t at = reinterpret_cast<std::uintptr_t>(p);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.allocations.upper_bound(at);
  if (it == r.allocations.begin()) return false;
  --it;
  return at >= it->first && at - it->first <= it->second && bytes <= it->second - (at - it->first);
}

// The allocation holding `at` (the shadow's reports).
CGCPU_RUNTIME bool shadow_find_allocation(std::uintptr_t at, std::uintptr_t* base, std::size_t* size) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.allocations.upper_bound(at);
  if (it == r.allocations.begin()) return false;
  --it;
  if (at - it->first >= it->second) return false;
  *base = it->first;
  *size = it->second;
  return true;
}

// Whether [p, p + bytes) is page-locked host memory (cudaMallocHost): copies to and from it are
// asynchronous; other host memory is pageable, and its copies synchronise as CUDA's do.
CGCPU_RUNTIME bool pinned_range(const void* p, std::size_t bytes) {
  const std::uintptr_t at = reinterpret_cast<std::uintptr_t>(p);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.pinned.upper_bound(at);
  if (it == r.pinned.begin()) return false;
  --it;
  return at - it->first <= it->second && bytes <= it->second - (at - it->first);
}

CGCPU_RUNTIME bool stream_valid(cudaStream_t stream) {
  if (stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread) return true;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.streams.count(stream) != 0;
}

CGCPU_RUNTIME bool event_valid(cudaEvent_t event) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return event != nullptr && r.events.count(event) != 0;
}

#define CGCPU_STICKY_GUARD()                                                  \
  do {                                                                        \
    const cudaError_t sticky_now = ::cgcpu::detail::sticky();                 \
    if (sticky_now != cudaSuccess) return ::cgcpu::detail::record(sticky_now); \
  } while (0)

}  // namespace detail
}  // namespace cgcpu

namespace cgcpu {
namespace detail {
CGCPU_RUNTIME void* allocate_device(std::size_t bytes) {
  if (shadow_enabled()) return shadow_allocate(bytes);
  return ::operator new(bytes, std::align_val_t(kAllocationAlignment), std::nothrow);
}
CGCPU_RUNTIME void free_device(void* pointer, std::size_t bytes) {
  if (shadow_enabled())
    shadow_release(pointer, bytes);
  else
    ::operator delete(pointer, std::align_val_t(kAllocationAlignment));
}
// A stream's entry, once the stream is destroyed (its queue has run).
CGCPU_RUNTIME void retire_stream(unsigned index) {
  Device& d = device();
  std::lock_guard<std::mutex> lock(d.mutex);
  if (index < d.streams.size()) d.streams[index].alive = false;
}
}  // namespace detail
}  // namespace cgcpu

// ---- errors -------------------------------------------------------------------------------
CGCPU_RUNTIME const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInitializationError: return "initialization error";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidSymbol: return "invalid device symbol";
    case cudaErrorInvalidDevicePointer: return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorInvalidDeviceFunction: return "invalid device function";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    case cudaErrorLaunchTimeout: return "the launch timed out and was terminated";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorNotSupported: return "operation not supported";
    case cudaErrorIllegalState: return "the operation cannot be performed in the present state";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureUnjoined: return "capture was not joined: a stream forked from the capture did not rejoin it";
    case cudaErrorStreamCaptureImplicit: return "operation would make the legacy stream depend on a capturing blocking stream";
    default: return "unknown error";
  }
}

CGCPU_RUNTIME const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError: return "cudaErrorInitializationError";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidSymbol: return "cudaErrorInvalidSymbol";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorInvalidDeviceFunction: return "cudaErrorInvalidDeviceFunction";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorIllegalState: return "cudaErrorIllegalState";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureUnjoined: return "cudaErrorStreamCaptureUnjoined";
    case cudaErrorStreamCaptureImplicit: return "cudaErrorStreamCaptureImplicit";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorLaunchOutOfResources: return "cudaErrorLaunchOutOfResources";
    case cudaErrorLaunchTimeout: return "cudaErrorLaunchTimeout";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    default: return "cudaErrorUnknown";
  }
}

CGCPU_RUNTIME cudaError_t cudaGetLastError() {
  const cudaError_t last = cgcpu::detail::tls_last_error;
  cgcpu::detail::tls_last_error = cudaSuccess;
  const cudaError_t sticky = cgcpu::detail::sticky();
  return sticky != cudaSuccess ? sticky : last;
}

CGCPU_RUNTIME cudaError_t cudaPeekAtLastError() {
  const cudaError_t sticky = cgcpu::detail::sticky();
  return sticky != cudaSuccess ? sticky : cgcpu::detail::tls_last_error;
}

// ---- devices ------------------------------------------------------------------------------
CGCPU_RUNTIME cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return cgcpu::detail::record(cudaErrorInvalidValue);
  *count = 1;
  return cudaSuccess;
}
CGCPU_RUNTIME cudaError_t cudaSetDevice(int device) {
  return device == 0 ? cudaSuccess : cgcpu::detail::record(cudaErrorInvalidDevice);
}
CGCPU_RUNTIME cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return cgcpu::detail::record(cudaErrorInvalidValue);
  *device = 0;
  return cudaSuccess;
}
CGCPU_RUNTIME cudaError_t cudaDeviceSynchronize() {
  if (cgcpu::detail::capture_forbids() != cudaSuccess) return cudaErrorStreamCaptureUnsupported;
  cgcpu::detail::wait_device();
  CGCPU_STICKY_GUARD();
  return cudaSuccess;
}
// Ends the "context": frees every allocation, stream and event, forgets kernel attributes,
// and clears a sticky error (as a GPU does after cudaDeviceReset).
CGCPU_RUNTIME cudaError_t cudaDeviceReset() {
  std::lock_guard<std::recursive_mutex> device(cgcpu::detail::device_mutex());
  cgcpu::detail::wait_device();
  cgcpu::detail::Registry& r = cgcpu::detail::registry();
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    for (auto& entry : r.allocations) cgcpu::detail::free_device(reinterpret_cast<void*>(entry.first), entry.second);
    r.allocations.clear();
    for (const void* s : r.streams) {
      cgcpu::detail::retire_stream(static_cast<const CUstream_st*>(s)->index);
      delete static_cast<const CUstream_st*>(s);
    }
    r.streams.clear();
    for (const void* e : r.events) delete static_cast<const CUevent_st*>(e);
    r.events.clear();
  }
  {
    std::lock_guard<std::mutex> lock(cgcpu::detail::attribute_mutex());
    cgcpu::detail::shared_limits().clear();
  }
  cgcpu::detail::sticky_error.store(cudaSuccess);
  cgcpu::detail::tls_last_error = cudaSuccess;
  return cudaSuccess;
}

// ---- memory -------------------------------------------------------------------------------

CGCPU_RUNTIME cudaError_t cudaMalloc(void** pointer, std::size_t bytes) {
  if (pointer == nullptr) return cgcpu::detail::record(cudaErrorInvalidValue);
  *pointer = nullptr;
  CGCPU_STICKY_GUARD();
  if (cgcpu::detail::capture_forbids() != cudaSuccess) return cudaErrorStreamCaptureUnsupported;
  if (bytes == 0) return cudaSuccess;
  void* memory = cgcpu::detail::allocate_device(bytes);
  if (memory == nullptr) return cgcpu::detail::record(cudaErrorMemoryAllocation);
  cgcpu::detail::Registry& r = cgcpu::detail::registry();
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    r.allocations[reinterpret_cast<std::uintptr_t>(memory)] = bytes;
  }
  *pointer = memory;
  return cudaSuccess;
}
template <class T>
inline cudaError_t cudaMalloc(T** pointer, std::size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(pointer), bytes);
}

// As on a GPU, freeing waits for the device: no queued op may still use the memory.
CGCPU_RUNTIME cudaError_t cudaFree(void* pointer) {
  if (cgcpu::detail::capture_forbids() != cudaSuccess) return cudaErrorStreamCaptureUnsupported;
  cgcpu::detail::wait_device();
  CGCPU_STICKY_GUARD();
  if (pointer == nullptr) return cudaSuccess;
  cgcpu::detail::Registry& r = cgcpu::detail::registry();
  std::size_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    auto found = r.allocations.find(reinterpret_cast<std::uintptr_t>(pointer));
    if (found == r.allocations.end()) return cgcpu::detail::record(cudaErrorInvalidValue);
    bytes = found->second;
    r.allocations.erase(found);
  }
  cgcpu::detail::free_device(pointer, bytes);
  return cudaSuccess;
}

CGCPU_RUNTIME cudaError_t cudaMallocHost(void** pointer, std::size_t bytes) {
  if (pointer == nullptr) return cgcpu::detail::record(cudaErrorInvalidValue);
  *pointer = ::operator new(bytes == 0 ? 1 : bytes, std::align_val_t(cgcpu::detail::kAllocationAlignment), std::nothrow);
  if (*pointer == nullptr) return cgcpu::detail::record(cudaErrorMemoryAllocation);
  cgcpu::detail::Registry& r = cgcpu::detail::registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.pinned[reinterpret_cast<std::uintptr_t>(*pointer)] = bytes;
  return cudaSuccess;
}
template <class T>
inline cudaError_t cudaMallocHost(T** pointer, std::size_t bytes) {
  return cudaMallocHost(reinterpret_cast<void**>(pointer), bytes);
}
CGCPU_RUNTIME cudaError_t cudaHostAlloc(void** pointer, std::size_t bytes, unsigned int) {
  return cudaMallocHost(pointer, bytes);
}
CGCPU_RUNTIME cudaError_t cudaFreeHost(void* pointer) {
  cgcpu::detail::wait_device();
  {
    cgcpu::detail::Registry& r = cgcpu::detail::registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    r.pinned.erase(reinterpret_cast<std::uintptr_t>(pointer));
  }
  ::operator delete(pointer, std::align_val_t(cgcpu::detail::kAllocationAlignment));
  return cudaSuccess;
}

namespace cgcpu {
namespace detail {

// A copy or a memset as an op: made when the op runs, its ranges declared to the shadow (the
// copy is libc's, which the instrumentation does not see).
struct CopyWork : Work {
  void* to;
  const void* from;
  std::size_t bytes;
  bool to_device, from_device;
  std::vector<unsigned char> staged;  // a pageable source, copied when the call was made
  std::uint64_t start(Op&) override {
    const void* source = staged.empty() ? from : staged.data();
    if (from_device) shadow_range(from, bytes, kShadowRead);
    if (to_device) shadow_fill(to, bytes);
    std::memcpy(to, source, bytes);  // overlapping ranges are an error (ASan reports them)
    return 0;
  }
};
struct MemsetWork : Work {
  void* to;
  int value;
  std::size_t bytes;
  std::uint64_t start(Op&) override {
    shadow_fill(to, bytes);
    std::memset(to, value, bytes);
    return 0;
  }
};

inline bool is_device(const void* p, std::size_t bytes) { return device_range(p, bytes); }

// cudaMemcpyAsync's rules (CUDA Runtime API, "API synchronization behavior"): device to device
// is asynchronous; from pageable host memory, the stream's earlier work is waited for and the
// source staged before the call returns (the copy into device memory may finish later); to
// pageable host memory, the call returns once the copy is done; with page-locked host memory
// (cudaMallocHost) both directions are asynchronous; host to host is synchronous.
CGCPU_RUNTIME cudaError_t copy(void* destination, const void* source, std::size_t bytes, cudaMemcpyKind kind,
                        cudaStream_t stream, const char* name) {
  CGCPU_STICKY_GUARD();
  if (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDefault) return record(cudaErrorInvalidMemcpyDirection);
  if (bytes == 0) return cudaSuccess;
  if (destination == nullptr || source == nullptr) return record(cudaErrorInvalidValue);
  bool to_device = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  bool from_device = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (kind == cudaMemcpyDefault) {  // unified addressing: the pointers say
    to_device = is_device(destination, bytes);
    from_device = is_device(source, bytes);
  }
  // The device side of a copy must lie inside one allocation (as on a GPU).
  if ((to_device && !device_range(destination, bytes)) || (from_device && !device_range(source, bytes)))
    return record(cudaErrorInvalidValue);
  if (to_device && from_device &&
      capture_call(stream, [=]() { copy(destination, source, bytes, cudaMemcpyDeviceToDevice, stream, name); }))
    return cudaSuccess;
  if (capture_refuses(stream)) return cudaErrorStreamCaptureUnsupported;  // host memory: not kept
  std::lock_guard<std::recursive_mutex> device(device_mutex());
  std::unique_ptr<CopyWork> work(new CopyWork);
  work->to = destination;
  work->from = source;
  work->bytes = bytes;
  work->to_device = to_device;
  work->from_device = from_device;
  if (!to_device && !from_device) {  // host to host
    wait_stream(stream);
    std::memcpy(destination, source, bytes);
    return cudaSuccess;
  }
  const bool pageable_source = !from_device && !pinned_range(source, bytes);
  const bool pageable_target = !to_device && !pinned_range(destination, bytes);
  if (pageable_source) {
    wait_stream(stream);
    const unsigned char* from = static_cast<const unsigned char*>(source);
    work->staged.assign(from, from + bytes);
  }
  enqueue(stream, name, std::move(work));
  if (pageable_target) {
    wait_stream(stream);
  } else if (is_legacy(stream)) {
    run_pending();
  }
  return sticky() != cudaSuccess ? record(sticky()) : cudaSuccess;
}

CGCPU_RUNTIME cudaError_t fill(void* pointer, int value, std::size_t bytes, cudaStream_t stream, const char* name) {
  CGCPU_STICKY_GUARD();
  if (bytes == 0) return cudaSuccess;
  if (!device_range(pointer, bytes)) return record(cudaErrorInvalidValue);
  if (capture_call(stream, [=]() { fill(pointer, value, bytes, stream, name); })) return cudaSuccess;
  std::lock_guard<std::recursive_mutex> device(device_mutex());
  std::unique_ptr<MemsetWork> work(new MemsetWork);
  work->to = pointer;
  work->value = value;
  work->bytes = bytes;
  enqueue(stream, name, std::move(work));
  if (is_legacy(stream)) run_pending();
  return cudaSuccess;
}

}  // namespace detail
}  // namespace cgcpu

// cudaMemcpy is the legacy stream's copy, with cudaMemcpyAsync's rules for pageable memory.
CGCPU_RUNTIME cudaError_t cudaMemcpy(void* destination, const void* source, std::size_t bytes, cudaMemcpyKind kind) {
  return cgcpu::detail::copy(destination, source, bytes, kind, nullptr, "cudaMemcpy");
}
CGCPU_RUNTIME cudaError_t cudaMemcpyAsync(void* destination, const void* source, std::size_t bytes, cudaMemcpyKind kind,
                                   cudaStream_t stream = nullptr) {
  if (!cgcpu::detail::stream_valid(stream)) return cgcpu::detail::record(cudaErrorInvalidResourceHandle);
  return cgcpu::detail::copy(destination, source, bytes, kind, stream, "cudaMemcpyAsync");
}

// cudaMemset is asynchronous with respect to the host for device memory, on the legacy stream.
CGCPU_RUNTIME cudaError_t cudaMemset(void* pointer, int value, std::size_t bytes) {
  return cgcpu::detail::fill(pointer, value, bytes, nullptr, "cudaMemset");
}
CGCPU_RUNTIME cudaError_t cudaMemsetAsync(void* pointer, int value, std::size_t bytes, cudaStream_t stream = nullptr) {
  if (!cgcpu::detail::stream_valid(stream)) return cgcpu::detail::record(cudaErrorInvalidResourceHandle);
  return cgcpu::detail::fill(pointer, value, bytes, stream, "cudaMemsetAsync");
}

// ---- streams and events (stream.h) ---------------------------------------------------------
CGCPU_RUNTIME cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  if (stream == nullptr) return cgcpu::detail::record(cudaErrorInvalidValue);
  CGCPU_STICKY_GUARD();
  const unsigned index = cgcpu::detail::add_stream((flags & cudaStreamNonBlocking) == 0);
  CUstream_st* s = new CUstream_st{flags, index};
  cgcpu::detail::Registry& r = cgcpu::detail::registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.streams.insert(s);
  *stream = s;
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreate(cudaStream_t* stream) { return cudaStreamCreateWithFlags(stream, cudaStreamDefault); }
// The stream's work is run first (CUDA lets it finish after the call returns).
CGCPU_RUNTIME cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  if (stream == nullptr || cgcpu::detail::is_legacy(stream) || !cgcpu::detail::stream_valid(stream))
    return cgcpu::detail::record(cudaErrorInvalidResourceHandle);
  cgcpu::detail::run_pending();
  cgcpu::detail::Registry& r = cgcpu::detail::registry();
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    if (r.streams.erase(stream) == 0) return cgcpu::detail::record(cudaErrorInvalidResourceHandle);
  }
  cgcpu::detail::retire_stream(stream->index);
  delete stream;
  return cudaSuccess;
}
CGCPU_RUNTIME cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  if (!cgcpu::detail::stream_valid(stream)) return cgcpu::detail::record(cudaErrorInvalidResourceHandle);
  if (cgcpu::detail::any_capture()) {  // the legacy stream, or a stream that captures: refused
    if (cgcpu::detail::is_legacy(stream)) return cgcpu::detail::capture_forbids(cudaErrorStreamCaptureImplicit);
    if (cgcpu::detail::Capture* capture = cgcpu::detail::capture_of(stream)) {
      cgcpu::detail::invalidate(*capture, cudaErrorStreamCaptureUnsupported);
      return cgcpu::detail::record(cudaErrorStreamCaptureUnsupported);
    }
  }
  cgcpu::detail::wait_stream(stream);
  CGCPU_STICKY_GUARD();
  return cudaSuccess;
}
inline cudaError_t cudaStreamQuery(cudaStream_t stream) { return cudaStreamSynchronize(stream); }

// `stream`'s later work waits for the work before the event's last record (in host order; an
// event never recorded: nothing).
CGCPU_RUNTIME cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags = 0) {
  if (!cgcpu::detail::event_valid(event) || !cgcpu::detail::stream_valid(stream))
    return cgcpu::detail::record(cudaErrorInvalidResourceHandle);
  if (flags != 0) return cgcpu::detail::record(cudaErrorInvalidValue);
  CGCPU_STICKY_GUARD();
  if (cgcpu::detail::skip_this_wait()) return cudaSuccess;  // CG_CPU_SKIP_WAIT
  cgcpu::detail::capture_note_wait(stream, event);  // may join `stream` to a capture
  if (cgcpu::detail::capture_call(stream, [=]() { cudaStreamWaitEvent(stream, event, 0); })) return cudaSuccess;
  std::lock_guard<std::recursive_mutex> device(cgcpu::detail::device_mutex());
  cgcpu::detail::enqueue(stream, "cudaStreamWaitEvent", nullptr, event, nullptr);
  if (cgcpu::detail::is_legacy(stream)) cgcpu::detail::run_pending();
  return cudaSuccess;
}

CGCPU_RUNTIME cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int) {
  if (event == nullptr) return cgcpu::detail::record(cudaErrorInvalidValue);
  CUevent_st* e = new CUevent_st{std::chrono::steady_clock::now(), false, false, 0, 0, {}};
  cgcpu::detail::Registry& r = cgcpu::detail::registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.events.insert(e);
  *event = e;
  return cudaSuccess;
}
inline cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, cudaEventDefault); }
CGCPU_RUNTIME cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream = nullptr) {
  if (!cgcpu::detail::event_valid(event) || !cgcpu::detail::stream_valid(stream))
    return cgcpu::detail::record(cudaErrorInvalidResourceHandle);
  CGCPU_STICKY_GUARD();
  const bool captured = cgcpu::detail::capture_call(stream, [=]() { cudaEventRecord(event, stream); });
  cgcpu::detail::capture_note_record(stream, event);
  if (captured) return cudaSuccess;
  std::lock_guard<std::recursive_mutex> device(cgcpu::detail::device_mutex());
  cgcpu::detail::enqueue(stream, "cudaEventRecord", nullptr, nullptr, event);
  if (cgcpu::detail::is_legacy(stream)) cgcpu::detail::run_pending();
  return cudaSuccess;
}
CGCPU_RUNTIME cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (!cgcpu::detail::event_valid(event)) return cgcpu::detail::record(cudaErrorInvalidResourceHandle);
  if (cgcpu::detail::captured_event(event)) return cgcpu::detail::record(cudaErrorStreamCaptureUnsupported);
  cgcpu::detail::run_pending();
  std::vector<std::uint64_t> clock;
  {
    cgcpu::detail::Device& d = cgcpu::detail::device();
    std::lock_guard<std::mutex> lock(d.mutex);
    clock = event->clock;
  }
  cgcpu::detail::host_waited(clock);
  CGCPU_STICKY_GUARD();
  return cudaSuccess;
}
inline cudaError_t cudaEventQuery(cudaEvent_t event) { return cudaEventSynchronize(event); }
CGCPU_RUNTIME cudaError_t cudaEventElapsedTime(float* milliseconds, cudaEvent_t start, cudaEvent_t end) {
  if (milliseconds == nullptr) return cgcpu::detail::record(cudaErrorInvalidValue);
  if (!cgcpu::detail::event_valid(start) || !cgcpu::detail::event_valid(end))
    return cgcpu::detail::record(cudaErrorInvalidResourceHandle);
  if (cgcpu::detail::captured_event(start) || cgcpu::detail::captured_event(end))
    return cgcpu::detail::record(cudaErrorStreamCaptureUnsupported);
  cgcpu::detail::run_pending();
  if (!start->recorded || !end->recorded) return cgcpu::detail::record(cudaErrorInvalidResourceHandle);
  *milliseconds = std::chrono::duration<float, std::milli>(end->time - start->time).count();
  return cudaSuccess;
}
CGCPU_RUNTIME cudaError_t cudaEventDestroy(cudaEvent_t event) {
  cgcpu::detail::run_pending();  // a queued record still refers to it
  cgcpu::detail::Registry& r = cgcpu::detail::registry();
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    if (event == nullptr || r.events.erase(event) == 0) return cgcpu::detail::record(cudaErrorInvalidResourceHandle);
  }
  delete event;
  return cudaSuccess;
}

// ---- kernel attributes ----------------------------------------------------------------------
CGCPU_RUNTIME cudaError_t cudaFuncSetAttribute(const void* kernel, cudaFuncAttribute attribute, int value) {
  CGCPU_STICKY_GUARD();
  if (kernel == nullptr) return cgcpu::detail::record(cudaErrorInvalidDeviceFunction);
  switch (attribute) {
    case cudaFuncAttributeMaxDynamicSharedMemorySize: {
      if (value < 0 || static_cast<std::size_t>(value) > cgcpu::detail::kMaxSharedOptIn)
        return cgcpu::detail::record(cudaErrorInvalidValue);
      std::lock_guard<std::mutex> lock(cgcpu::detail::attribute_mutex());
      cgcpu::detail::shared_limits()[kernel] = static_cast<std::size_t>(value);
      return cudaSuccess;
    }
    case cudaFuncAttributePreferredSharedMemoryCarveout:
      return value < -1 || value > 100 ? cgcpu::detail::record(cudaErrorInvalidValue) : cudaSuccess;
    default:
      return cgcpu::detail::record(cudaErrorInvalidValue);
  }
}
template <class T>
inline cudaError_t cudaFuncSetAttribute(T* kernel, cudaFuncAttribute attribute, int value) {
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), attribute, value);
}

// The emitted program times the algorithms cuBLASLt's heuristic offers (CG_TIME_ALGORITHMS): the
// CPU build keeps the first (a time on the CPU says nothing of a GPU); -DCG_TIME_ALGORITHMS=1
// runs the choice here too, to test it.
#ifndef CG_TIME_ALGORITHMS
#define CG_TIME_ALGORITHMS 0
#endif

// After every launch in the emitted host program (its own definition is the fallback): names the
// launch (cgcpu::launch_site: faults and the shadow's reports say where it was issued), then the
// emitted program's check of the launch's error.
#ifndef CG_LAUNCHED
#define CG_LAUNCHED(where) (::cgcpu::launch_site(where), cg_check(cudaGetLastError(), where))
#endif
// After a library call (a cuBLASLt product, an NCCL collective) in the emitted host program,
// where the emitted file says CG_ISSUED(where) (nothing on a GPU): names the op it issued.
#ifndef CG_ISSUED
#define CG_ISSUED(where) ::cgcpu::launch_site(where)
#endif

// ---- stream capture and graphs (capture.h) ------------------------------------------------------
enum cudaStreamCaptureStatus {
  cudaStreamCaptureStatusNone = 0,
  cudaStreamCaptureStatusActive = 1,
  cudaStreamCaptureStatusInvalidated = 2,
};
enum cudaStreamCaptureMode {
  cudaStreamCaptureModeGlobal = 0,
  cudaStreamCaptureModeThreadLocal = 1,
  cudaStreamCaptureModeRelaxed = 2,
};

// Every mode is held to the global mode's rules (the strictest; the one the emitted programs use).
CGCPU_RUNTIME cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode) {
  using namespace cgcpu::detail;
  if (!stream_valid(stream)) return record(cudaErrorInvalidResourceHandle);
  CGCPU_STICKY_GUARD();
  if (is_legacy(stream)) return record(cudaErrorStreamCaptureUnsupported);  // CUDA captures no legacy stream
  Captures& c = captures();
  std::lock_guard<std::recursive_mutex> lock(c.mutex);
  if (capture_of(stream) != nullptr) return record(cudaErrorIllegalState);
  c.active.emplace_back(new Capture);
  Capture* capture = c.active.back().get();
  capture->graph = new CUgraph_st;
  capture->graph->origin = stream;
  capture->origin = stream_index(stream);
  capture->calls[capture->origin] = 0;
  c.members[capture->origin] = capture;
  c.count.store(static_cast<int>(c.active.size()), std::memory_order_release);
  return cudaSuccess;
}

CGCPU_RUNTIME cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status) {
  using namespace cgcpu::detail;
  if (status == nullptr) return record(cudaErrorInvalidValue);
  if (!stream_valid(stream)) return record(cudaErrorInvalidResourceHandle);
  *status = cudaStreamCaptureStatusNone;
  if (is_legacy(stream)) return any_capture() ? record(cudaErrorStreamCaptureImplicit) : cudaSuccess;
  if (Capture* capture = capture_of(stream))
    *status = capture->invalidated != cudaSuccess ? cudaStreamCaptureStatusInvalidated : cudaStreamCaptureStatusActive;
  return cudaSuccess;
}

// Ends the capture `stream` began: its graph, unless a refused call invalidated it or a stream it
// forked has work the origin never waited for.
CGCPU_RUNTIME cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  using namespace cgcpu::detail;
  if (graph == nullptr) return record(cudaErrorInvalidValue);
  *graph = nullptr;
  if (!stream_valid(stream)) return record(cudaErrorInvalidResourceHandle);
  Captures& c = captures();
  std::lock_guard<std::recursive_mutex> lock(c.mutex);
  Capture* capture = capture_of(stream);
  if (capture == nullptr || capture->origin != stream_index(stream)) return record(cudaErrorIllegalState);
  cudaError_t result = capture->invalidated != cudaSuccess ? cudaErrorStreamCaptureInvalidated : cudaSuccess;
  if (result == cudaSuccess)
    for (const auto& member : capture->calls) {
      std::vector<unsigned> visiting;
      if (!capture_joined(*capture, member.first, visiting)) result = cudaErrorStreamCaptureUnjoined;
    }
  for (auto it = c.members.begin(); it != c.members.end();) it = it->second == capture ? c.members.erase(it) : ++it;
  for (auto it = c.records.begin(); it != c.records.end();)
    it = it->second.capture == capture ? c.records.erase(it) : ++it;
  c.last = nullptr;
  std::unique_ptr<CUgraph_st> made(capture->graph);
  for (std::size_t i = 0; i < c.active.size(); ++i)
    if (c.active[i].get() == capture) {
      c.active.erase(c.active.begin() + static_cast<std::ptrdiff_t>(i));
      break;
    }
  c.count.store(static_cast<int>(c.active.size()), std::memory_order_release);
  if (result != cudaSuccess) return record(result);
  *graph = made.release();
  return cudaSuccess;
}

CGCPU_RUNTIME cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long flags = 0) {
  if (exec == nullptr || graph == nullptr || flags != 0) return cgcpu::detail::record(cudaErrorInvalidValue);
  *exec = new CUgraphExec_st{graph->calls, graph->origin};
  return cudaSuccess;
}

// The graph's calls again, in capture order, on the streams they were captured on; ordered after
// `stream`'s earlier work, and `stream`'s later work after them (through the capture's origin).
CGCPU_RUNTIME cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  using namespace cgcpu::detail;
  if (exec == nullptr) return record(cudaErrorInvalidValue);
  if (!stream_valid(stream) || !stream_valid(exec->origin)) return record(cudaErrorInvalidResourceHandle);
  CGCPU_STICKY_GUARD();
  if (capture_refuses(stream)) return cudaErrorStreamCaptureUnsupported;  // a graph inside a capture: not kept
  cudaEvent_t before = nullptr, after = nullptr;
  const bool elsewhere = stream != exec->origin;
  if (elsewhere) {
    cudaEventCreateWithFlags(&before, 0);
    cudaEventCreateWithFlags(&after, 0);
    cudaEventRecord(before, stream);
    cudaStreamWaitEvent(exec->origin, before, 0);
  }
  for (const CUgraph_st::Call& call : exec->calls) {
    call.issue();
    if (call.site != nullptr) cgcpu::launch_site(call.site);
  }
  if (elsewhere) {
    cudaEventRecord(after, exec->origin);
    cudaStreamWaitEvent(stream, after, 0);
    cudaEventDestroy(before);
    cudaEventDestroy(after);
  }
  return cudaSuccess;
}

CGCPU_RUNTIME cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  delete exec;
  return cudaSuccess;
}
CGCPU_RUNTIME cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  delete graph;
  return cudaSuccess;
}
