// cuda_cpu test: NCCL's CPU twin (cgcpu/nccl.h): the reduce-scatter and the all-gather beside
// the all-reduce, on a communicator of two ranks whose transport this program registers (the
// other rank, as the transport makes it, holds this rank's values plus 2), and of one.
//   values   what each collective hands the transport (the whole buffer, its count, the
//            operator and the collective), what it leaves in memory, in place and with
//            disjoint buffers, on two ranks and on one; the buffers that overlap without being
//            NCCL's in-place form refused (ncclInvalidArgument, a report on stderr) before
//            anything is carried; a failed transport is ncclRemoteError.
//   shadow   (the shadow build) what each declares to the shadow: a reduce-scatter reads the
//            whole send buffer and writes this rank's shard, an all-gather reads this rank's
//            shard and writes the whole receive buffer. Each case's name goes to stderr first
//            ("nccl: case NAME"), the shadow's reports after it.
#include "check.h"

#include <nccl.h>

#include <vector>

constexpr int kShard = 256;  // floats a rank: 1 KiB
constexpr int kThreads = 128;

__global__ void write_range(float* x, int from, int to, float value) {
  const int i = from + blockIdx.x * blockDim.x + threadIdx.x;
  if (i < to) x[i] = value;
}
__global__ void read_range(float* out, const float* x, int from, int to) {
  const int i = from + blockIdx.x * blockDim.x + threadIdx.x;
  if (i < to) out[i - from] = x[i] * 2.0f;
}

static unsigned grid(int n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

// ---- the transport: records every call; the other rank holds this rank's values plus 2 ----
struct Carried {
  void* data;
  size_t count;
  int type, op, collective;
};
static std::vector<Carried> g_carried;
static int g_rank = 1;
static bool g_touch = true;  // false: carry nothing (the shadow cases declare, they do not compute)
static bool g_fail = false;

static int transport(void* data, size_t count, int type, int op, int collective) {
  g_carried.push_back(Carried{data, count, type, op, collective});
  if (g_fail) return 1;
  if (!g_touch) return 0;
  float* x = static_cast<float*>(data);
  const size_t shard = count / 2, mine = static_cast<size_t>(g_rank) * shard, other = shard - mine;
  if (collective == cgcpu::kNcclAllReduce)
    for (size_t i = 0; i < count; ++i) x[i] = op == ncclAvg ? x[i] + 1.0f : 2.0f * x[i] + 2.0f;
  else if (collective == cgcpu::kNcclReduceScatter)  // the mean of x and x + 2, on this rank's shard
    for (size_t i = mine; i < mine + shard; ++i) x[i] += 1.0f;
  else if (collective == cgcpu::kNcclAllGather)  // the other rank's shard, from the other rank
    for (size_t i = other; i < other + shard; ++i) x[i] += 2.0f;
  return 0;
}

static std::vector<float> host(const float* device, int n) {
  std::vector<float> values(n);
  CUDA_OK(cudaMemcpy(values.data(), device, n * sizeof(float), cudaMemcpyDeviceToHost));
  return values;
}

static float* counting(int n, float from) {
  std::vector<float> values(n);
  for (int i = 0; i < n; ++i) values[i] = from + static_cast<float>(i);
  float* p = nullptr;
  CUDA_OK(cudaMalloc(&p, n * sizeof(float)));
  CUDA_OK(cudaMemcpy(p, values.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  return p;
}

// Every element of [from, to) of `values` is i + shift (the buffers start counting from 0).
static bool counts(const std::vector<float>& values, int from, int to, float shift) {
  for (int i = from; i < to; ++i)
    if (values[i] != static_cast<float>(i) + shift) return false;
  return true;
}

static bool carried(size_t index, const void* data, size_t count, int op, int collective) {
  if (g_carried.size() <= index) return false;
  const Carried& c = g_carried[index];
  return c.data == data && c.count == count && c.type == ncclFloat32 && c.op == op && c.collective == collective;
}

static ncclComm_t communicator(int ranks, int rank) {
  ncclUniqueId id;
  ncclGetUniqueId(&id);
  ncclComm_t comm = nullptr;
  CHECK(ncclCommInitRank(&comm, ranks, id, rank) == ncclSuccess, "a communicator of %d", ranks);
  return comm;
}

static int values() {
  cgcpu::set_nccl_transport(transport);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ncclComm_t two = communicator(2, 1);  // this program is rank 1 of 2
  g_rank = 1;
  const int whole = 2 * kShard;

  // In place: the reduce-scatter receives into rank 1's shard, the second half.
  float* x = counting(whole, 0.0f);
  CHECK(ncclReduceScatter(x, x + kShard, kShard, ncclFloat32, ncclAvg, two, stream) == ncclSuccess,
        "in-place reduce-scatter");
  CHECK(g_carried.size() == 1 && carried(0, x, whole, ncclAvg, cgcpu::kNcclReduceScatter),
        "the reduce-scatter carries the whole buffer: %zu calls", g_carried.size());
  std::vector<float> got = host(x, whole);
  CHECK(counts(got, 0, kShard, 0.0f), "rank 0's shard left as it was");
  CHECK(counts(got, kShard, whole, 1.0f), "rank 1's shard the mean of both ranks'");

  // In place: the all-gather sends rank 1's shard; rank 0's (the other's values + 2) arrives.
  float* y = counting(whole, 0.0f);
  CHECK(ncclAllGather(y + kShard, y, kShard, ncclFloat32, two, stream) == ncclSuccess, "in-place all-gather");
  CHECK(g_carried.size() == 2 && carried(1, y, whole, -1, cgcpu::kNcclAllGather),
        "the all-gather carries the whole buffer");
  got = host(y, whole);
  CHECK(counts(got, 0, kShard, 2.0f), "rank 0's shard from rank 0");
  CHECK(counts(got, kShard, whole, 0.0f), "rank 1's own shard as it was");

  // The all-reduce, a sum: the whole buffer, ncclSum.
  float* s = counting(whole, 0.0f);
  CHECK(ncclAllReduce(s, s, whole, ncclFloat32, ncclSum, two, stream) == ncclSuccess, "all-reduce sum");
  CHECK(g_carried.size() == 3 && carried(2, s, whole, ncclSum, cgcpu::kNcclAllReduce), "the sum carried");
  got = host(s, whole);
  bool summed = true;
  for (int i = 0; i < whole; ++i) summed = summed && got[i] == 2.0f * i + 2.0f;
  CHECK(summed, "the sum of x and x + 2");

  // Overlapping buffers that are not the in-place form: refused, nothing carried or written.
  float* z = counting(whole, 0.0f);
  const size_t before = g_carried.size();
  std::fprintf(stderr, "nccl: refusals\n");
  CHECK(ncclReduceScatter(z, z, kShard, ncclFloat32, ncclAvg, two, stream) == ncclInvalidArgument,
        "rank 1 receiving into rank 0's shard");
  CHECK(ncclReduceScatter(z, z + kShard + 1, kShard, ncclFloat32, ncclAvg, two, stream) == ncclInvalidArgument,
        "a receive buffer one element off");
  CHECK(ncclAllGather(z, z, kShard, ncclFloat32, two, stream) == ncclInvalidArgument,
        "rank 1 sending from rank 0's shard");
  CHECK(ncclAllGather(z + kShard - 1, z, kShard, ncclFloat32, two, stream) == ncclInvalidArgument,
        "a send buffer one element off");
  CHECK(g_carried.size() == before, "nothing carried");
  CHECK(counts(host(z, whole), 0, whole, 0.0f), "nothing written");
  std::fprintf(stderr, "nccl: refusals end\n");

  // Disjoint buffers (NCCL's out-of-place form): the same results, the send buffer untouched.
  float* send = counting(whole, 0.0f);
  float* receive = counting(kShard, 1000.0f);
  CHECK(ncclReduceScatter(send, receive, kShard, ncclFloat32, ncclAvg, two, stream) == ncclSuccess,
        "out-of-place reduce-scatter");
  CHECK(counts(host(send, whole), 0, whole, 0.0f), "its send buffer untouched");
  CHECK(counts(host(receive, kShard), 0, kShard, kShard + 1.0f), "rank 1's shard of the mean");
  float* gathered = counting(whole, 5000.0f);
  CHECK(ncclAllGather(receive, gathered, kShard, ncclFloat32, two, stream) == ncclSuccess,
        "out-of-place all-gather");
  got = host(gathered, whole);
  CHECK(counts(got, kShard, whole, 1.0f), "rank 1's place: what it sent");
  CHECK(counts(got, 0, kShard, 5002.0f), "rank 0's place: rank 0's");

  // A failed transport: the call's result.
  g_fail = true;
  CHECK(ncclReduceScatter(x, x + kShard, kShard, ncclFloat32, ncclAvg, two, stream) == ncclRemoteError,
        "a failed reduce-scatter");
  CHECK(ncclAllGather(y + kShard, y, kShard, ncclFloat32, two, stream) == ncclRemoteError, "a failed all-gather");
  g_fail = false;

  // One rank: its shard is the whole buffer, nothing is carried, in place is the identity.
  ncclComm_t one = communicator(1, 0);
  const size_t carried_before = g_carried.size();
  float* w = counting(kShard, 0.0f);
  CHECK(ncclReduceScatter(w, w, kShard, ncclFloat32, ncclAvg, one, stream) == ncclSuccess, "one rank");
  CHECK(ncclAllGather(w, w, kShard, ncclFloat32, one, stream) == ncclSuccess, "one rank");
  CHECK(counts(host(w, kShard), 0, kShard, 0.0f), "the identity");
  float* v = counting(kShard, 7.0f);
  CHECK(ncclAllGather(v, w, kShard, ncclFloat32, one, stream) == ncclSuccess, "one rank, out of place");
  CHECK(counts(host(w, kShard), 0, kShard, 7.0f), "a copy");
  CHECK(g_carried.size() == carried_before, "one rank carries nothing");
  CHECK(ncclReduceScatter(w, w + 1, kShard, ncclFloat32, ncclAvg, one, stream) == ncclInvalidArgument,
        "one rank, one element off");

  // A communicator of two without a transport: ncclInvalidUsage, as for the all-reduce.
  cgcpu::set_nccl_transport(nullptr);
  CHECK(ncclReduceScatter(x, x + kShard, kShard, ncclFloat32, ncclAvg, two, stream) == ncclInvalidUsage,
        "no transport");
  CHECK(ncclAllGather(y + kShard, y, kShard, ncclFloat32, two, stream) == ncclInvalidUsage, "no transport");
  CUDA_OK(cudaStreamSynchronize(stream));
  ncclCommDestroy(two);
  ncclCommDestroy(one);
  FINISH("values");
}

static void announce(const char* name) { std::fprintf(stderr, "nccl: case %s\n", name); }

// Each case: a collective on s1 (rank 1 of 2, in place over x's 2 * kShard floats), then a
// kernel on s2 that nothing orders after it, touching one range of x (or past it).
static int shadow() {
  cgcpu::set_nccl_transport(transport);
  g_touch = false;
  ncclComm_t two = communicator(2, 1);
  cudaStream_t s1, s2;
  CUDA_OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  const int whole = 2 * kShard;
  float* x = counting(3 * kShard, 0.0f);  // the collective's buffer, then kShard floats past it
  float* out = counting(kShard, 0.0f);
  CUDA_OK(cudaDeviceSynchronize());

  announce("scatter-read-write");  // rank 0's shard: the reduce-scatter reads it, a kernel writes it
  CHECK(ncclReduceScatter(x, x + kShard, kShard, ncclFloat32, ncclAvg, two, s1) == ncclSuccess, "rs");
  cgcpu::launch_site("nccl.cu:reduce-scatter");
  CG_LAUNCH(write_range, dim3(grid(kShard)), dim3(kThreads), 0, s2)(x, 0, kShard, 1.0f);
  cgcpu::launch_site("nccl.cu:shard 0 writer");
  CUDA_OK(cudaDeviceSynchronize());

  announce("scatter-read-read");  // rank 0's shard read by both: nothing to report
  CHECK(ncclReduceScatter(x, x + kShard, kShard, ncclFloat32, ncclAvg, two, s1) == ncclSuccess, "rs");
  cgcpu::launch_site("nccl.cu:reduce-scatter");
  CG_LAUNCH(read_range, dim3(grid(kShard)), dim3(kThreads), 0, s2)(out, x, 0, kShard);
  cgcpu::launch_site("nccl.cu:shard 0 reader");
  CUDA_OK(cudaDeviceSynchronize());

  announce("scatter-write-read");  // rank 1's shard: the reduce-scatter writes it, a kernel reads it
  CHECK(ncclReduceScatter(x, x + kShard, kShard, ncclFloat32, ncclAvg, two, s1) == ncclSuccess, "rs");
  cgcpu::launch_site("nccl.cu:reduce-scatter");
  CG_LAUNCH(read_range, dim3(grid(kShard)), dim3(kThreads), 0, s2)(out, x, kShard, whole);
  cgcpu::launch_site("nccl.cu:shard 1 reader");
  CUDA_OK(cudaDeviceSynchronize());

  announce("gather-write-read");  // rank 0's shard: the all-gather writes it, a kernel reads it
  CHECK(ncclAllGather(x + kShard, x, kShard, ncclFloat32, two, s1) == ncclSuccess, "ag");
  cgcpu::launch_site("nccl.cu:all-gather");
  CG_LAUNCH(read_range, dim3(grid(kShard)), dim3(kThreads), 0, s2)(out, x, 0, kShard);
  cgcpu::launch_site("nccl.cu:shard 0 reader");
  CUDA_OK(cudaDeviceSynchronize());

  announce("gather-past");  // past the whole buffer: nothing to report
  CHECK(ncclAllGather(x + kShard, x, kShard, ncclFloat32, two, s1) == ncclSuccess, "ag");
  cgcpu::launch_site("nccl.cu:all-gather");
  CG_LAUNCH(write_range, dim3(grid(kShard)), dim3(kThreads), 0, s2)(x, whole, whole + kShard, 1.0f);
  cgcpu::launch_site("nccl.cu:past writer");
  CUDA_OK(cudaDeviceSynchronize());

  announce("ordered");  // the kernel after an event the collective's stream records: nothing
  cudaEvent_t event;
  CUDA_OK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  CHECK(ncclAllGather(x + kShard, x, kShard, ncclFloat32, two, s1) == ncclSuccess, "ag");
  cgcpu::launch_site("nccl.cu:all-gather");
  CUDA_OK(cudaEventRecord(event, s1));
  CUDA_OK(cudaStreamWaitEvent(s2, event, 0));
  CG_LAUNCH(write_range, dim3(grid(whole)), dim3(kThreads), 0, s2)(x, 0, whole, 1.0f);
  cgcpu::launch_site("nccl.cu:ordered writer");
  CUDA_OK(cudaDeviceSynchronize());
  announce("end");
  ncclCommDestroy(two);
  FINISH("shadow");
}

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "values") == 0) return values();
  if (argc > 1 && std::strcmp(argv[1], "shadow") == 0) return shadow();
  std::printf("usage: %s values|shadow\n", argv[0]);
  return 2;
}
