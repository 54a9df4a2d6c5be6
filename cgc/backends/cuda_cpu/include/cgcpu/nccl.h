// cuda_cpu: the NCCL calls the emitted host programs make, carried by the process that loads
// the program (cgc's emulated backend) through a transport callback: NCCL's collectives over
// MPI ranks on the CPU (cgc/backends/parallel.py). No transport of its own: a communicator of
// one rank needs none (each collective is then the identity, as NCCL's is), and a
// communicator of several fails with ncclInvalidUsage until a transport is set.
//
// The types, values and signatures are NCCL's own (nccl.h of NCCL 2.x), so that the emitted
// file compiles unchanged against either. A collective is an op of its stream (stream.h),
// ordered as CUDA orders it (the shadow compares it with the ops it may run beside), but it runs
// when it is issued, after everything queued before it, on the calling host thread: the transport
// calls into the process that loaded the program, and its failure is the call's result, as the
// emitted program expects (a GPU's NCCL may also report it later).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "runtime_api.h"

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct { char internal[NCCL_UNIQUE_ID_BYTES]; } ncclUniqueId;

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
} ncclResult_t;

typedef enum {
  ncclInt8 = 0, ncclChar = 0, ncclUint8 = 1, ncclInt32 = 2, ncclInt = 2, ncclUint32 = 3,
  ncclInt64 = 4, ncclUint64 = 5, ncclFloat16 = 6, ncclHalf = 6, ncclFloat32 = 7,
  ncclFloat = 7, ncclFloat64 = 8, ncclDouble = 8, ncclBfloat16 = 9,
} ncclDataType_t;

typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4 } ncclRedOp_t;

struct cgcpuNcclComm {
  int rank;
  int ranks;
};
typedef cgcpuNcclComm* ncclComm_t;

namespace cgcpu {

// The transport: reduces `count` elements of `type` at `data` over the ranks with `op`, in
// place, the same result on every rank; returns 0 on success (anything else: a remote error).
typedef int (*nccl_transport)(void* data, std::size_t count, int type, int op);

namespace detail {
inline std::atomic<nccl_transport>& nccl_transport_slot() {
  static std::atomic<nccl_transport> slot{nullptr};
  return slot;
}
}  // namespace detail

inline void set_nccl_transport(nccl_transport transport) {
  detail::nccl_transport_slot().store(transport);
}

}  // namespace cgcpu

inline const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage:
      return "invalid usage (cuda_cpu: a communicator of several ranks needs the emulated "
             "backend's MPI transport)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    default: return "unknown result code";
  }
}

// The id only names the communicator: the transport (MPI) knows its ranks.
inline ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (id == nullptr) return ncclInvalidArgument;
  std::memset(id->internal, 0, sizeof id->internal);
  std::memcpy(id->internal, "cuda_cpu nccl", 13);
  return ncclSuccess;
}

inline ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  (void)id;
  if (comm == nullptr || nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  *comm = new cgcpuNcclComm{rank, nranks};
  return ncclSuccess;
}

inline ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  delete comm;
  return ncclSuccess;
}

inline ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  if (comm == nullptr || count == nullptr) return ncclInvalidArgument;
  *count = comm->ranks;
  return ncclSuccess;
}

inline ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  if (comm == nullptr || rank == nullptr) return ncclInvalidArgument;
  *rank = comm->rank;
  return ncclSuccess;
}

inline std::size_t cgcpu_nccl_bytes(ncclDataType_t type) {
  switch (type) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    default: return 8;
  }
}

namespace cgcpu {
namespace detail {

inline ncclResult_t nccl_all_reduce_now(const void* send, void* receive, std::size_t count, ncclDataType_t type,
                                        ncclRedOp_t op, ncclComm_t comm) {
  const std::size_t bytes = count * cgcpu_nccl_bytes(type);
  shadow_range(send, bytes, kShadowRead);
  shadow_fill(receive, bytes);
  // Always: in place too, so that a sanitizer sees the whole range a collective binds even on
  // one rank, where nothing else touches it (a count past the buffer is a report, not silence).
  std::memmove(receive, send, bytes);
  if (comm->ranks == 1) return ncclSuccess;  // the sum, the mean... of one rank: itself
  nccl_transport transport = nccl_transport_slot().load();
  if (transport == nullptr) return ncclInvalidUsage;
  return transport(receive, count, static_cast<int>(type), static_cast<int>(op)) == 0 ? ncclSuccess
                                                                                       : ncclRemoteError;
}

struct NcclWork : Work {
  const void* send;
  void* receive;
  std::size_t count;
  ncclDataType_t type;
  ncclRedOp_t op;
  ncclComm_t comm;
  ncclResult_t result = ncclSuccess;
  bool host_only() const override { return true; }
  std::uint64_t start(Op&) override {
    if (sticky() != cudaSuccess) return 0;
    result = nccl_all_reduce_now(send, receive, count, type, op, comm);
    return 0;
  }
};

}  // namespace detail
}  // namespace cgcpu

inline ncclResult_t ncclAllReduce(const void* send, void* receive, std::size_t count,
                                  ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                                  cudaStream_t stream) {
  if (comm == nullptr || (count > 0 && (send == nullptr || receive == nullptr)))
    return ncclInvalidArgument;
  if (!cgcpu::detail::stream_valid(stream)) return ncclInvalidArgument;
  if (comm->ranks > 1 && cgcpu::detail::nccl_transport_slot().load() == nullptr) return ncclInvalidUsage;
  std::lock_guard<std::recursive_mutex> device(cgcpu::detail::device_mutex());
  std::unique_ptr<cgcpu::detail::NcclWork> work(new cgcpu::detail::NcclWork);
  work->send = send;
  work->receive = receive;
  work->count = count;
  work->type = type;
  work->op = op;
  work->comm = comm;
  cgcpu::detail::NcclWork* const own = work.get();
  std::shared_ptr<cgcpu::detail::Op> issued = cgcpu::detail::enqueue(stream, "ncclAllReduce", std::move(work));
  cgcpu::detail::run_pending();
  return own->result;  // the op (and its work) outlive the run: `issued` holds them
}
