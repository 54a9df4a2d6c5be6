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
//
// The collectives: ncclAllReduce, ncclReduceScatter and ncclAllGather. Each declares to the
// shadow what NCCL reads and writes (a reduce-scatter reads the whole send buffer and writes
// this rank's shard; an all-gather reads this rank's shard and writes the whole receive buffer).
// A reduce-scatter or an all-gather whose buffers overlap must be NCCL's in-place form
// (recvbuff == sendbuff + rank * recvcount; sendbuff == recvbuff + rank * sendcount): any other
// overlap is reported on stderr and refused with ncclInvalidArgument (NCCL leaves it undefined).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "linkage.h"
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

// The collectives the transport carries (its `collective` argument).
enum NcclCollective { kNcclAllReduce = 0, kNcclReduceScatter = 1, kNcclAllGather = 2 };

// The transport: carries one collective over the ranks, in place on the whole buffer of
// `count` elements of `type` at `data`, the same bits on every rank; returns 0 on success
// (anything else: a remote error). kNcclAllReduce: data = data reduced over the ranks with
// `op`. kNcclReduceScatter: this rank's shard of data (elements [rank * count / ranks,
// (rank + 1) * count / ranks)) = that shard reduced over the ranks with `op`, the rest left as
// it is. kNcclAllGather: every rank's shard of data = that rank's (`op` is -1).
typedef int (*nccl_transport)(void* data, std::size_t count, int type, int op, int collective);

namespace detail {
inline std::atomic<nccl_transport>& nccl_transport_slot() {
  static std::atomic<nccl_transport> slot{nullptr};
  return slot;
}
}  // namespace detail

CGCPU_RUNTIME void set_nccl_transport(nccl_transport transport) {
  detail::nccl_transport_slot().store(transport);
}

}  // namespace cgcpu

CGCPU_RUNTIME const char* ncclGetErrorString(ncclResult_t result) {
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
CGCPU_RUNTIME ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (id == nullptr) return ncclInvalidArgument;
  std::memset(id->internal, 0, sizeof id->internal);
  std::memcpy(id->internal, "cuda_cpu nccl", 13);
  return ncclSuccess;
}

CGCPU_RUNTIME ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  (void)id;
  if (comm == nullptr || nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  *comm = new cgcpuNcclComm{rank, nranks};
  return ncclSuccess;
}

CGCPU_RUNTIME ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  delete comm;
  return ncclSuccess;
}

CGCPU_RUNTIME ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  if (comm == nullptr || count == nullptr) return ncclInvalidArgument;
  *count = comm->ranks;
  return ncclSuccess;
}

CGCPU_RUNTIME ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  if (comm == nullptr || rank == nullptr) return ncclInvalidArgument;
  *rank = comm->rank;
  return ncclSuccess;
}

CGCPU_RUNTIME std::size_t cgcpu_nccl_bytes(ncclDataType_t type) {
  switch (type) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    default: return 8;
  }
}

namespace cgcpu {
namespace detail {

CGCPU_RUNTIME ncclResult_t nccl_carry(void* data, std::size_t count, ncclDataType_t type, int op,
                               NcclCollective collective) {
  nccl_transport transport = nccl_transport_slot().load();
  if (transport == nullptr) return ncclInvalidUsage;
  return transport(data, count, static_cast<int>(type), op, static_cast<int>(collective)) == 0 ? ncclSuccess
                                                                                            : ncclRemoteError;
}

CGCPU_RUNTIME ncclResult_t nccl_all_reduce_now(const void* send, void* receive, std::size_t count, ncclDataType_t type,
                                        ncclRedOp_t op, ncclComm_t comm) {
  const std::size_t bytes = count * cgcpu_nccl_bytes(type);
  shadow_range(send, bytes, kShadowRead);
  shadow_fill(receive, bytes);
  // Always: in place too, so that a sanitizer sees the whole range a collective binds even on
  // one rank, where nothing else touches it (a count past the buffer is a report, not silence).
  std::memmove(receive, send, bytes);
  if (comm->ranks == 1) return ncclSuccess;  // the sum, the mean... of one rank: itself
  return nccl_carry(receive, count, type, static_cast<int>(op), kNcclAllReduce);
}

// The reduce-scatter: NCCL reads the whole send buffer (recvcount elements a rank) and writes
// this rank's shard into the receive buffer. In place (receive == send + rank * recvcount),
// the transport reduces the shard where it is; with disjoint buffers, it reduces a copy.
CGCPU_RUNTIME ncclResult_t nccl_reduce_scatter_now(const void* send, void* receive, std::size_t recvcount,
                                            ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm) {
  const std::size_t bytes = recvcount * cgcpu_nccl_bytes(type);
  const char* const mine = static_cast<const char*>(send) + comm->rank * bytes;
  shadow_range(send, bytes * comm->ranks, kShadowRead);
  shadow_fill(receive, bytes);
  std::memmove(receive, mine, bytes);  // in place too: the sanitizer sees the range (all of it on one rank)
  if (comm->ranks == 1) return ncclSuccess;
  if (receive == mine)  // in place: the receive buffer lies in the send buffer, which is as writable
    return nccl_carry(const_cast<void*>(send), recvcount * comm->ranks, type, static_cast<int>(op),
                      kNcclReduceScatter);
  std::vector<char> whole(static_cast<const char*>(send), static_cast<const char*>(send) + bytes * comm->ranks);
  const ncclResult_t carried = nccl_carry(whole.data(), recvcount * comm->ranks, type, static_cast<int>(op),
                                          kNcclReduceScatter);
  if (carried == ncclSuccess) std::memcpy(receive, whole.data() + comm->rank * bytes, bytes);
  return carried;
}

// The all-gather: NCCL reads this rank's send buffer (sendcount elements) and writes every
// rank's into the receive buffer, this one's at receive + rank * sendcount (in place: send is
// that shard already).
CGCPU_RUNTIME ncclResult_t nccl_all_gather_now(const void* send, void* receive, std::size_t sendcount,
                                        ncclDataType_t type, ncclComm_t comm) {
  const std::size_t bytes = sendcount * cgcpu_nccl_bytes(type);
  shadow_range(send, bytes, kShadowRead);
  shadow_fill(receive, bytes * comm->ranks);
  std::memmove(static_cast<char*>(receive) + comm->rank * bytes, send, bytes);  // in place too, as above
  if (comm->ranks == 1) return ncclSuccess;
  return nccl_carry(receive, sendcount * comm->ranks, type, -1, kNcclAllGather);
}

struct NcclWork : Work {
  NcclCollective collective = kNcclAllReduce;
  const void* send;
  void* receive;
  std::size_t count;  // NCCL's count: the all-reduce's, the reduce-scatter's recvcount, the all-gather's sendcount
  ncclDataType_t type;
  ncclRedOp_t op;
  ncclComm_t comm;
  ncclResult_t result = ncclSuccess;
  bool host_only() const override { return true; }
  std::uint64_t start(Op&) override {
    if (sticky() != cudaSuccess) return 0;
    switch (collective) {
      case kNcclAllReduce: result = nccl_all_reduce_now(send, receive, count, type, op, comm); break;
      case kNcclReduceScatter: result = nccl_reduce_scatter_now(send, receive, count, type, op, comm); break;
      case kNcclAllGather: result = nccl_all_gather_now(send, receive, count, type, comm); break;
    }
    return 0;
  }
};

// What NCCL checks of every collective's arguments, then the call queued on its stream and run.
CGCPU_RUNTIME ncclResult_t nccl_issue(const char* name, NcclCollective collective, const void* send, void* receive,
                               std::size_t count, ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream) {
  if (comm == nullptr || (count > 0 && (send == nullptr || receive == nullptr))) return ncclInvalidArgument;
  if (!stream_valid(stream)) return ncclInvalidArgument;
  if (comm->ranks > 1 && nccl_transport_slot().load() == nullptr) return ncclInvalidUsage;
  if (capture_call(stream, [=]() { nccl_issue(name, collective, send, receive, count, type, op, comm, stream); }))
    return ncclSuccess;  // capture.h: the same call again, at each replay
  std::lock_guard<std::recursive_mutex> device(device_mutex());
  std::unique_ptr<NcclWork> work(new NcclWork);
  work->collective = collective;
  work->send = send;
  work->receive = receive;
  work->count = count;
  work->type = type;
  work->op = op;
  work->comm = comm;
  NcclWork* const own = work.get();
  std::shared_ptr<Op> issued = enqueue(stream, name, std::move(work));
  run_pending();
  return own->result;  // the op (and its work) outlive the run: `issued` holds them
}

// A reduce-scatter or all-gather whose two buffers overlap must be NCCL's in-place form, the
// shard at rank * count of the whole buffer: any other overlap is one NCCL leaves undefined
// (the other ranks' data would land on this rank's input). Reported, and refused.
CGCPU_RUNTIME bool nccl_in_place_or_apart(const char* name, const void* whole, const void* shard, std::size_t shard_bytes,
                                   ncclComm_t comm, const char* form) {
  const std::uintptr_t w = reinterpret_cast<std::uintptr_t>(whole), s = reinterpret_cast<std::uintptr_t>(shard);
  const std::uintptr_t whole_bytes = shard_bytes * static_cast<std::uintptr_t>(comm->ranks);
  const bool apart = s + shard_bytes <= w || w + whole_bytes <= s;
  if (apart || s == w + static_cast<std::uintptr_t>(comm->rank) * shard_bytes || shard_bytes == 0) return true;
  std::fprintf(stderr,
               "cuda_cpu: %s on rank %d of %d: the buffers overlap but are not in place (%s): the shard is "
               "%lld bytes from the start of the whole buffer, not %lld\n",
               name, comm->rank, comm->ranks, form, static_cast<long long>(s - w),
               static_cast<long long>(comm->rank) * static_cast<long long>(shard_bytes));
  return false;
}

}  // namespace detail
}  // namespace cgcpu

CGCPU_RUNTIME ncclResult_t ncclAllReduce(const void* send, void* receive, std::size_t count,
                                  ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                                  cudaStream_t stream) {
  return cgcpu::detail::nccl_issue("ncclAllReduce", cgcpu::kNcclAllReduce, send, receive, count, type, op, comm,
                                   stream);
}

// sendbuff holds recvcount elements a rank; recvbuff gets this rank's recvcount, reduced.
CGCPU_RUNTIME ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, std::size_t recvcount,
                                      ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                      cudaStream_t stream) {
  if (comm != nullptr && sendbuff != nullptr && recvbuff != nullptr &&
      !cgcpu::detail::nccl_in_place_or_apart("ncclReduceScatter", sendbuff, recvbuff,
                                             recvcount * cgcpu_nccl_bytes(datatype), comm,
                                             "recvbuff == sendbuff + rank * recvcount"))
    return ncclInvalidArgument;
  return cgcpu::detail::nccl_issue("ncclReduceScatter", cgcpu::kNcclReduceScatter, sendbuff, recvbuff, recvcount,
                                   datatype, op, comm, stream);
}

// sendbuff holds this rank's sendcount elements; recvbuff gets every rank's, rank by rank.
CGCPU_RUNTIME ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, std::size_t sendcount,
                                  ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
  if (comm != nullptr && sendbuff != nullptr && recvbuff != nullptr &&
      !cgcpu::detail::nccl_in_place_or_apart("ncclAllGather", recvbuff, sendbuff,
                                             sendcount * cgcpu_nccl_bytes(datatype), comm,
                                             "sendbuff == recvbuff + rank * sendcount"))
    return ncclInvalidArgument;
  return cgcpu::detail::nccl_issue("ncclAllGather", cgcpu::kNcclAllGather, sendbuff, recvbuff, sendcount,
                                   datatype, ncclSum, comm, stream);
}
