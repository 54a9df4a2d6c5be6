// cuda_cpu: the CUDA runtime API the emitted host programs use, on host memory.
// "Device" memory is host memory from operator new (256-byte aligned, the exact size asked
// for, so ASan sees every byte past an allocation). Streams are synchronous: a launch, copy or
// product has finished when its call returns. Errors behave as on a GPU: a bad call returns
// its error and leaves it for cudaGetLastError (cleared by reading); a kernel that faults
// leaves a sticky cudaErrorLaunchFailure that every later call returns.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <set>

#include "scheduler.h"
#include "state.h"
#include "types.h"

struct CUstream_st {
  unsigned flags;
};
struct CUevent_st {
  std::chrono::steady_clock::time_point time;
  bool recorded;
};

namespace cgcpu {
namespace detail {

constexpr std::size_t kAllocationAlignment = 256;

struct Registry {
  std::mutex mutex;
  std::map<std::uintptr_t, std::size_t> allocations;  // start -> bytes
  std::set<const void*> streams, events;
};
inline Registry& registry() {
  static Registry* r = new Registry;  // outlives static destructors that may still free memory
  return *r;
}

// Whether [p, p + bytes) lies inside one allocation.
inline bool device_range(const void* p, std::size_t bytes) {
  const std::uintptr_t at = reinterpret_cast<std::uintptr_t>(p);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.allocations.upper_bound(at);
  if (it == r.allocations.begin()) return false;
  --it;
  return at >= it->first && at - it->first <= it->second && bytes <= it->second - (at - it->first);
}

inline bool stream_valid(cudaStream_t stream) {
  if (stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread) return true;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.streams.count(stream) != 0;
}

inline bool event_valid(cudaEvent_t event) {
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

// ---- errors -------------------------------------------------------------------------------
inline const char* cudaGetErrorString(cudaError_t error) {
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
    default: return "unknown error";
  }
}

inline const char* cudaGetErrorName(cudaError_t error) {
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
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorLaunchOutOfResources: return "cudaErrorLaunchOutOfResources";
    case cudaErrorLaunchTimeout: return "cudaErrorLaunchTimeout";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    default: return "cudaErrorUnknown";
  }
}

inline cudaError_t cudaGetLastError() {
  const cudaError_t last = cgcpu::detail::tls_last_error;
  cgcpu::detail::tls_last_error = cudaSuccess;
  const cudaError_t sticky = cgcpu::detail::sticky();
  return sticky != cudaSuccess ? sticky : last;
}

inline cudaError_t cudaPeekAtLastError() {
  const cudaError_t sticky = cgcpu::detail::sticky();
  return sticky != cudaSuccess ? sticky : cgcpu::detail::tls_last_error;
}

// ---- devices ------------------------------------------------------------------------------
inline cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return cgcpu::detail::record(cudaErrorInvalidValue);
  *count = 1;
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int device) {
  return device == 0 ? cudaSuccess : cgcpu::detail::record(cudaErrorInvalidDevice);
}
inline cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return cgcpu::detail::record(cudaErrorInvalidValue);
  *device = 0;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceSynchronize() {
  CGCPU_STICKY_GUARD();
  return cudaSuccess;
}
// Ends the "context": frees every allocation, stream and event, forgets kernel attributes,
// and clears a sticky error (as a GPU does after cudaDeviceReset).
inline cudaError_t cudaDeviceReset() {
  std::lock_guard<std::recursive_mutex> device(cgcpu::detail::device_mutex());
  cgcpu::detail::Registry& r = cgcpu::detail::registry();
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    for (auto& entry : r.allocations)
      ::operator delete(reinterpret_cast<void*>(entry.first), std::align_val_t(cgcpu::detail::kAllocationAlignment));
    r.allocations.clear();
    for (const void* s : r.streams) delete static_cast<const CUstream_st*>(s);
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
inline cudaError_t cudaMalloc(void** pointer, std::size_t bytes) {
  if (pointer == nullptr) return cgcpu::detail::record(cudaErrorInvalidValue);
  *pointer = nullptr;
  CGCPU_STICKY_GUARD();
  if (bytes == 0) return cudaSuccess;
  void* memory = ::operator new(bytes, std::align_val_t(cgcpu::detail::kAllocationAlignment), std::nothrow);
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

inline cudaError_t cudaFree(void* pointer) {
  CGCPU_STICKY_GUARD();
  if (pointer == nullptr) return cudaSuccess;
  cgcpu::detail::Registry& r = cgcpu::detail::registry();
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    auto found = r.allocations.find(reinterpret_cast<std::uintptr_t>(pointer));
    if (found == r.allocations.end()) return cgcpu::detail::record(cudaErrorInvalidValue);
    r.allocations.erase(found);
  }
  ::operator delete(pointer, std::align_val_t(cgcpu::detail::kAllocationAlignment));
  return cudaSuccess;
}

inline cudaError_t cudaMallocHost(void** pointer, std::size_t bytes) {
  if (pointer == nullptr) return cgcpu::detail::record(cudaErrorInvalidValue);
  *pointer = ::operator new(bytes == 0 ? 1 : bytes, std::align_val_t(cgcpu::detail::kAllocationAlignment), std::nothrow);
  return *pointer == nullptr ? cgcpu::detail::record(cudaErrorMemoryAllocation) : cudaSuccess;
}
template <class T>
inline cudaError_t cudaMallocHost(T** pointer, std::size_t bytes) {
  return cudaMallocHost(reinterpret_cast<void**>(pointer), bytes);
}
inline cudaError_t cudaHostAlloc(void** pointer, std::size_t bytes, unsigned int) {
  return cudaMallocHost(pointer, bytes);
}
inline cudaError_t cudaFreeHost(void* pointer) {
  ::operator delete(pointer, std::align_val_t(cgcpu::detail::kAllocationAlignment));
  return cudaSuccess;
}

inline cudaError_t cudaMemcpy(void* destination, const void* source, std::size_t bytes, cudaMemcpyKind kind) {
  CGCPU_STICKY_GUARD();
  if (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDefault) return cgcpu::detail::record(cudaErrorInvalidMemcpyDirection);
  if (bytes == 0) return cudaSuccess;
  if (destination == nullptr || source == nullptr) return cgcpu::detail::record(cudaErrorInvalidValue);
  // The device side of a copy must lie inside one allocation (as on a GPU).
  const bool to_device = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool from_device = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if ((to_device && !cgcpu::detail::device_range(destination, bytes)) ||
      (from_device && !cgcpu::detail::device_range(source, bytes)))
    return cgcpu::detail::record(cudaErrorInvalidValue);
  std::lock_guard<std::recursive_mutex> device(cgcpu::detail::device_mutex());
  std::memcpy(destination, source, bytes);  // overlapping ranges are an error (ASan reports them)
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* destination, const void* source, std::size_t bytes, cudaMemcpyKind kind,
                                   cudaStream_t stream = nullptr) {
  if (!cgcpu::detail::stream_valid(stream)) return cgcpu::detail::record(cudaErrorInvalidResourceHandle);
  return cudaMemcpy(destination, source, bytes, kind);
}

inline cudaError_t cudaMemset(void* pointer, int value, std::size_t bytes) {
  CGCPU_STICKY_GUARD();
  if (bytes == 0) return cudaSuccess;
  if (!cgcpu::detail::device_range(pointer, bytes)) return cgcpu::detail::record(cudaErrorInvalidValue);
  std::lock_guard<std::recursive_mutex> device(cgcpu::detail::device_mutex());
  std::memset(pointer, value, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* pointer, int value, std::size_t bytes, cudaStream_t stream = nullptr) {
  if (!cgcpu::detail::stream_valid(stream)) return cgcpu::detail::record(cudaErrorInvalidResourceHandle);
  return cudaMemset(pointer, value, bytes);
}

// ---- streams and events (synchronous) -------------------------------------------------------
inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  if (stream == nullptr) return cgcpu::detail::record(cudaErrorInvalidValue);
  CGCPU_STICKY_GUARD();
  CUstream_st* s = new CUstream_st{flags};
  cgcpu::detail::Registry& r = cgcpu::detail::registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.streams.insert(s);
  *stream = s;
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreate(cudaStream_t* stream) { return cudaStreamCreateWithFlags(stream, cudaStreamDefault); }
inline cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  cgcpu::detail::Registry& r = cgcpu::detail::registry();
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    if (stream == nullptr || r.streams.erase(stream) == 0) return cgcpu::detail::record(cudaErrorInvalidResourceHandle);
  }
  delete stream;
  return cudaSuccess;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  if (!cgcpu::detail::stream_valid(stream)) return cgcpu::detail::record(cudaErrorInvalidResourceHandle);
  CGCPU_STICKY_GUARD();
  return cudaSuccess;
}
inline cudaError_t cudaStreamQuery(cudaStream_t stream) { return cudaStreamSynchronize(stream); }

inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int) {
  if (event == nullptr) return cgcpu::detail::record(cudaErrorInvalidValue);
  CUevent_st* e = new CUevent_st{std::chrono::steady_clock::now(), false};
  cgcpu::detail::Registry& r = cgcpu::detail::registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.events.insert(e);
  *event = e;
  return cudaSuccess;
}
inline cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, cudaEventDefault); }
inline cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream = nullptr) {
  if (!cgcpu::detail::event_valid(event) || !cgcpu::detail::stream_valid(stream))
    return cgcpu::detail::record(cudaErrorInvalidResourceHandle);
  event->time = std::chrono::steady_clock::now();
  event->recorded = true;
  return cudaSuccess;
}
inline cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (!cgcpu::detail::event_valid(event)) return cgcpu::detail::record(cudaErrorInvalidResourceHandle);
  CGCPU_STICKY_GUARD();
  return cudaSuccess;
}
inline cudaError_t cudaEventQuery(cudaEvent_t event) { return cudaEventSynchronize(event); }
inline cudaError_t cudaEventElapsedTime(float* milliseconds, cudaEvent_t start, cudaEvent_t end) {
  if (milliseconds == nullptr) return cgcpu::detail::record(cudaErrorInvalidValue);
  if (!cgcpu::detail::event_valid(start) || !cgcpu::detail::event_valid(end))
    return cgcpu::detail::record(cudaErrorInvalidResourceHandle);
  if (!start->recorded || !end->recorded) return cgcpu::detail::record(cudaErrorInvalidResourceHandle);
  *milliseconds = std::chrono::duration<float, std::milli>(end->time - start->time).count();
  return cudaSuccess;
}
inline cudaError_t cudaEventDestroy(cudaEvent_t event) {
  cgcpu::detail::Registry& r = cgcpu::detail::registry();
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    if (event == nullptr || r.events.erase(event) == 0) return cgcpu::detail::record(cudaErrorInvalidResourceHandle);
  }
  delete event;
  return cudaSuccess;
}

// ---- kernel attributes ----------------------------------------------------------------------
inline cudaError_t cudaFuncSetAttribute(const void* kernel, cudaFuncAttribute attribute, int value) {
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
