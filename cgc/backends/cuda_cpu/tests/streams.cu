// Streams, events, the interleaving of concurrent launches and the global-memory shadow
// (README.md, "Streams and events", "The shadow"). tests/test_emulated_concurrency.py builds this plain, in
// the shadow build (CG_CPU_SHADOW) and in the racecheck build, and reads what it prints.
//   clean       a parent stream forks two non-blocking side streams with an event and joins them
//               with two more, three times over (the events reused): kernels and cuBLASLt products
//               (each stream its own workspace) that share only what they read. Checks every
//               value against the host and prints a hash of the outputs; the shadow reports nothing.
//   conflict    pairs of ops on two streams that nothing orders, one writing what the other
//               touches (kernel and kernel, kernel and cuBLASLt, NCCL and kernel, two products on
//               one workspace, two launches' atomics on one counter, in device memory and in a
//               __device__ variable, memsets of fresh memory (the shadow's fills) and a kernel or
//               another memset, a non-blocking stream and the legacy stream), then the same
//               pairs ordered (an event, a host wait, a blocking stream and the legacy stream). Each
//               case's name goes to stderr before it ("streams: case NAME"); the shadow's reports
//               follow it.
//   interleave  two launches of 24 blocks on two streams (or, with "same", one stream): each
//               block's thread 0 takes a ticket; prints which block took each ticket.
//   racecheck   a kernel with a shared-memory race on one side stream beside a clean kernel on
//               another (for the ThreadSanitizer build).
//   fault       a launch on a created stream that deadlocks: the launch returns, the fault is
//               reported (naming its site) when the stream is waited for, and stays.
//   graph       one round of forked work (kernels, a cuBLASLt product whose alpha and aux
//               pointer change after the capture, a memset, a device copy) run eagerly, then
//               captured into a graph (nothing runs during the capture) and replayed three times
//               on its stream and once on another: the same bits as the eager round, a counter
//               that counts the replays; then what a capture refuses (a host wait, an
//               allocation, the legacy stream, a host copy, timing a captured event, a fork never
//               joined), each with CUDA's error. Prints a hash of the outputs.
//   graph-conflict  a captured graph whose two branches write and read one buffer with nothing
//               between them: each replay's pair is reported by the shadow, naming both sites.
#include "check.h"

#include <cublasLt.h>
#include <nccl.h>

#include <cstdint>
#include <vector>

constexpr int kN = 4096;
constexpr int kThreads = 128;

__global__ void scale(float* out, const float* in, float factor, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = in[i] * factor + static_cast<float>(i % 7);
}
__global__ void combine(float* out, const float* a, const float* b, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = a[i] - b[i];
}
// x[from..to) = value
__global__ void write_range(float* x, int from, int to, float value) {
  const int i = from + blockIdx.x * blockDim.x + threadIdx.x;
  if (i < to) x[i] = value;
}
__global__ void read_all(float* out, const float* x, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = x[i] * 2.0f;
}
__global__ void take_ticket(int* order, unsigned* counter, int tag) {
  if (threadIdx.x == 0) order[atomicAdd(counter, 1u)] = tag * 1000 + static_cast<int>(blockIdx.x);
}
__device__ unsigned int g_counter = 0;
__global__ void bump_device_variable() {
  if (threadIdx.x == 0) atomicAdd(&g_counter, 1u);
}
__global__ void racy_shared(int* out) {
  CG_DYNAMIC_SHARED(memory);
  int* words = reinterpret_cast<int*>(memory);
  if (threadIdx.x == 5) words[10] = 1;
  if (threadIdx.x == 9) out[blockIdx.x] = words[10];
}
__global__ void clean_shared(int* out) {
  CG_DYNAMIC_SHARED(memory);
  int* words = reinterpret_cast<int*>(memory);
  words[threadIdx.x] = static_cast<int>(threadIdx.x);
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = words[(threadIdx.x + 1) % blockDim.x];
}
__global__ void deadlock(int* out) {
  if (threadIdx.x < 32) __syncthreads();
  out[threadIdx.x] = 1;
}

static float* device_floats(int n, float fill) {
  std::vector<float> host(n, fill);
  float* p = nullptr;
  CUDA_OK(cudaMalloc(&p, n * sizeof(float)));
  CUDA_OK(cudaMemcpy(p, host.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  return p;
}

// A float32 product D[m x n] = A[m x k] B[k x n] (column-major, no transposes) on `stream`,
// through the calls the emitted program makes.
struct Product {
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t a, b, d;
  cublasLtMatmulAlgo_t algo;
  int m, n, k;
};
static Product make_product(cublasLtHandle_t lt, int m, int n, int k, size_t workspace) {
  Product p{};
  p.m = m, p.n = n, p.k = k;
  cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  cublasLtMatrixLayoutCreate(&p.a, CUDA_R_32F, m, k, m);
  cublasLtMatrixLayoutCreate(&p.b, CUDA_R_32F, k, n, k);
  cublasLtMatrixLayoutCreate(&p.d, CUDA_R_32F, m, n, m);
  cublasLtMatmulPreference_t preference;
  cublasLtMatmulPreferenceCreate(&preference);
  const uint64_t bytes = workspace;
  cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &bytes, sizeof bytes);
  cublasLtMatmulHeuristicResult_t result;
  int found = 0;
  CHECK(cublasLtMatmulAlgoGetHeuristic(lt, p.desc, p.a, p.b, p.d, p.d, preference, 1, &result, &found) ==
            CUBLAS_STATUS_SUCCESS && found == 1, "a heuristic");
  cublasLtMatmulPreferenceDestroy(preference);
  p.algo = result.algo;
  return p;
}
static void run_product(cublasLtHandle_t lt, const Product& p, float* d, const float* a, const float* b,
                        void* workspace, size_t bytes, cudaStream_t stream) {
  const float alpha = 1.0f, beta = 0.0f;
  CHECK(cublasLtMatmul(lt, p.desc, &alpha, a, p.a, b, p.b, &beta, d, p.d, d, p.d, &p.algo, workspace, bytes, stream) ==
            CUBLAS_STATUS_SUCCESS, "cublasLtMatmul");
}

static unsigned grid(int n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

static std::uint64_t hash(const std::vector<float>& values) {
  std::uint64_t h = 1469598103934665603ull;
  for (float v : values) {
    std::uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    h = (h ^ bits) * 1099511628211ull;
  }
  return h;
}

static int clean() {
  cublasLtHandle_t lt;
  cublasLtCreate(&lt);
  cudaStream_t parent, side1, side2;
  CUDA_OK(cudaStreamCreate(&parent));
  CUDA_OK(cudaStreamCreateWithFlags(&side1, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&side2, cudaStreamNonBlocking));
  cudaEvent_t fork, join1, join2;
  CUDA_OK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CUDA_OK(cudaEventCreateWithFlags(&join1, cudaEventDisableTiming));
  CUDA_OK(cudaEventCreateWithFlags(&join2, cudaEventDisableTiming));
  constexpr int kM = 32, kK = 16, kCols = kN / kK;  // in as a kK x kCols matrix
  std::vector<float> host_in(kN), host_w(kM * kK);
  for (int i = 0; i < kN; ++i) host_in[i] = static_cast<float>((i * 37) % 101) / 16.0f;
  for (int i = 0; i < kM * kK; ++i) host_w[i] = static_cast<float>((i * 13) % 17 - 8) / 8.0f;
  float* in = device_floats(kN, 0.0f);
  float* w = device_floats(kM * kK, 0.0f);
  CUDA_OK(cudaMemcpy(in, host_in.data(), kN * sizeof(float), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(w, host_w.data(), kM * kK * sizeof(float), cudaMemcpyHostToDevice));
  float* a = device_floats(kN, 0.0f);
  float* b = device_floats(kN, 0.0f);
  float* d1 = device_floats(kM * kCols, 0.0f);
  float* d2 = device_floats(kM * kCols, 0.0f);
  constexpr int kRounds = 3;
  float* out = device_floats(kRounds * kN, 0.0f);
  const size_t workspace_bytes = 1 << 16;
  void *ws1, *ws2;
  CUDA_OK(cudaMalloc(&ws1, workspace_bytes));
  CUDA_OK(cudaMalloc(&ws2, workspace_bytes));
  const Product product = make_product(lt, kM, kCols, kK, workspace_bytes);

  for (int round = 0; round < kRounds; ++round) {
    const float f = 1.5f + round;
    CUDA_OK(cudaEventRecord(fork, parent));
    CUDA_OK(cudaStreamWaitEvent(side1, fork, 0));
    CUDA_OK(cudaStreamWaitEvent(side2, fork, 0));
    {  // the first branch stays on the parent
      cudaStream_t stream = parent;
      CG_LAUNCH(scale, dim3(grid(kN)), dim3(kThreads), 0, stream)(a, in, f, kN);
      cgcpu::launch_site("streams.cu clean: parent scale");
    }
    {
      cudaStream_t stream = side1;
      CG_LAUNCH(scale, dim3(grid(kN)), dim3(kThreads), 0, stream)(b, in, -0.5f, kN);
      cgcpu::launch_site("streams.cu clean: side1 scale");
      run_product(lt, product, d1, w, in, ws1, workspace_bytes, stream);
      cgcpu::launch_site("streams.cu clean: side1 product");
    }
    {
      cudaStream_t stream = side2;
      run_product(lt, product, d2, w, in, ws2, workspace_bytes, stream);
      cgcpu::launch_site("streams.cu clean: side2 product");
    }
    CUDA_OK(cudaEventRecord(join1, side1));
    CUDA_OK(cudaStreamWaitEvent(parent, join1, 0));
    CUDA_OK(cudaEventRecord(join2, side2));
    CUDA_OK(cudaStreamWaitEvent(parent, join2, 0));
    CG_LAUNCH(combine, dim3(grid(kN)), dim3(kThreads), 0, parent)(out + round * kN, a, b, kN);
    cgcpu::launch_site("streams.cu clean: parent combine");
    CG_LAUNCH(combine, dim3(grid(kM * kCols)), dim3(kThreads), 0, parent)(d1, d1, d2, kM * kCols);  // d1 - d2 = 0
    cgcpu::launch_site("streams.cu clean: parent products' difference");
  }
  CUDA_OK(cudaStreamSynchronize(parent));

  std::vector<float> got(kRounds * kN), difference(kM * kCols);
  CUDA_OK(cudaMemcpy(got.data(), out, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(difference.data(), d1, difference.size() * sizeof(float), cudaMemcpyDeviceToHost));
  int wrong = 0;
  for (int round = 0; round < kRounds; ++round)
    for (int i = 0; i < kN; ++i) {
      const float x = host_in[i], extra = static_cast<float>(i % 7);
      const float expected = (x * (1.5f + round) + extra) - (x * -0.5f + extra);
      wrong += got[round * kN + i] != expected;
    }
  for (float v : difference) wrong += v != 0.0f;
  CHECK(wrong == 0, "%d values wrong", wrong);
  std::vector<float> product_values(kM * kCols);
  CUDA_OK(cudaMemcpy(product_values.data(), d2, product_values.size() * sizeof(float), cudaMemcpyDeviceToHost));
  float expected00 = 0.0f;  // D[0, 0] = sum_p W[0, p] in[p, 0]
  for (int p = 0; p < kK; ++p) expected00 += host_w[p * kM] * host_in[p];
  CHECK(product_values[0] == expected00, "product %g, expected %g", product_values[0], expected00);
  got.insert(got.end(), product_values.begin(), product_values.end());
  std::printf("clean hash: %016llx\n", static_cast<unsigned long long>(hash(got)));
  cublasLtDestroy(lt);
  FINISH("clean");
}

static void announce(const char* name) {
  std::fprintf(stderr, "streams: case %s\n", name);
  std::fflush(stderr);
}

static int conflict() {
  cublasLtHandle_t lt;
  cublasLtCreate(&lt);
  ncclComm_t comm;
  ncclUniqueId id;
  ncclGetUniqueId(&id);
  ncclCommInitRank(&comm, 1, id, 0);
  cudaStream_t s1, s2, blocking;
  CUDA_OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreate(&blocking));
  cudaEvent_t event;
  CUDA_OK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  float* x = device_floats(kN, 1.0f);
  float* y = device_floats(kN, 0.0f);
  unsigned* counter;
  int* order;
  CUDA_OK(cudaMalloc(&counter, sizeof(unsigned)));
  CUDA_OK(cudaMemset(counter, 0, sizeof(unsigned)));
  CUDA_OK(cudaMalloc(&order, 64 * sizeof(int)));
  constexpr int kM = 16, kK = 16, kCols = 64;
  float* w = device_floats(kM * kK, 0.5f);
  float* d = device_floats(kM * kCols, 0.0f);
  float* d2 = device_floats(kM * kCols, 0.0f);
  const size_t workspace_bytes = 1 << 12;
  void* shared_workspace;
  CUDA_OK(cudaMalloc(&shared_workspace, workspace_bytes));
  const Product product = make_product(lt, kM, kCols, kK, workspace_bytes);
  // Fresh memory, never touched: a memset of it is one fill in the shadow, not 32768 cells.
  constexpr int kFresh = 16384;  // floats: 64 KiB, 16 pages
  float *fresh, *fresh2, *fresh3;
  CUDA_OK(cudaMalloc(&fresh, kFresh * sizeof(float)));
  CUDA_OK(cudaMalloc(&fresh2, kFresh * sizeof(float)));
  CUDA_OK(cudaMalloc(&fresh3, kFresh * sizeof(float)));
  float* sink = device_floats(kFresh, 0.0f);
  // The host waits: a pageable upload on the legacy stream (device_floats) is not ordered
  // before a non-blocking stream's work otherwise, and the shadow would say so.
  CUDA_OK(cudaDeviceSynchronize());

  // x[64..128) written on s1 while s2 reads all of x: bytes 256..512 of x's allocation.
  announce("kernel-kernel");
  CG_LAUNCH(write_range, dim3(1), dim3(kThreads), 0, s1)(x, 64, 128, 3.0f);
  cgcpu::launch_site("streams.cu:writer");
  CG_LAUNCH(read_all, dim3(grid(kN)), dim3(kThreads), 0, s2)(y, x, kN);
  cgcpu::launch_site("streams.cu:reader");
  CUDA_OK(cudaDeviceSynchronize());

  announce("kernel-product");  // the product reads x (as its B) while a kernel writes it
  CG_LAUNCH(write_range, dim3(grid(kN)), dim3(kThreads), 0, s1)(x, 0, kN, 2.0f);
  cgcpu::launch_site("streams.cu:x writer");
  run_product(lt, product, d, w, x, nullptr, 0, s2);
  cgcpu::launch_site("streams.cu:product");
  CUDA_OK(cudaDeviceSynchronize());

  announce("nccl-kernel");  // an all-reduce of y in place while a kernel reads y
  CHECK(ncclAllReduce(y, y, kN, ncclFloat32, ncclSum, comm, s1) == ncclSuccess, "all-reduce");
  cgcpu::launch_site("streams.cu:all-reduce");
  CG_LAUNCH(read_all, dim3(grid(kN)), dim3(kThreads), 0, s2)(x, y, kN);
  cgcpu::launch_site("streams.cu:y reader");
  CUDA_OK(cudaDeviceSynchronize());

  announce("workspace");  // two products, different outputs, one workspace
  run_product(lt, product, d, w, x, shared_workspace, workspace_bytes, s1);
  cgcpu::launch_site("streams.cu:product 1");
  run_product(lt, product, d2, w, x, shared_workspace, workspace_bytes, s2);
  cgcpu::launch_site("streams.cu:product 2");
  CUDA_OK(cudaDeviceSynchronize());

  announce("atomics");  // two launches taking tickets from one counter
  CG_LAUNCH(take_ticket, dim3(4), dim3(32), 0, s1)(order, counter, 1);
  cgcpu::launch_site("streams.cu:tickets 1");
  CG_LAUNCH(take_ticket, dim3(4), dim3(32), 0, s2)(order + 32, counter, 2);
  cgcpu::launch_site("streams.cu:tickets 2");
  CUDA_OK(cudaDeviceSynchronize());

  announce("device-variable");  // two launches adding to one __device__ counter
  CG_LAUNCH(bump_device_variable, dim3(2), dim3(32), 0, s1)();
  cgcpu::launch_site("streams.cu:bump 1");
  CG_LAUNCH(bump_device_variable, dim3(2), dim3(32), 0, s2)();
  cgcpu::launch_site("streams.cu:bump 2");
  CUDA_OK(cudaDeviceSynchronize());

  announce("memset-kernel");  // a memset of fresh memory while a kernel reads its middle
  CUDA_OK(cudaMemsetAsync(fresh, 0, kFresh * sizeof(float), s1));
  cgcpu::launch_site("streams.cu:memset");
  CG_LAUNCH(read_all, dim3(8), dim3(kThreads), 0, s2)(sink, fresh + 4096, 1024);
  cgcpu::launch_site("streams.cu:fresh reader");
  CUDA_OK(cudaDeviceSynchronize());

  announce("memset-memset");  // two memsets of fresh memory, overlapping in its second half
  CUDA_OK(cudaMemsetAsync(fresh2, 0, kFresh * sizeof(float), s1));
  cgcpu::launch_site("streams.cu:memset 1");
  CUDA_OK(cudaMemsetAsync(fresh2 + kFresh / 2, 1, kFresh / 2 * sizeof(float), s2));
  cgcpu::launch_site("streams.cu:memset 2");
  CUDA_OK(cudaDeviceSynchronize());

  announce("nonblocking-legacy");  // the legacy stream does not wait for a non-blocking stream
  CG_LAUNCH(write_range, dim3(grid(kN)), dim3(kThreads), 0, s1)(x, 0, kN, 4.0f);
  cgcpu::launch_site("streams.cu:non-blocking writer");
  CG_LAUNCH(read_all, dim3(grid(kN)), dim3(kThreads), 0, nullptr)(y, x, kN);
  cgcpu::launch_site("streams.cu:legacy reader");
  CUDA_OK(cudaDeviceSynchronize());

  // ---- the same, ordered: nothing to report ----
  announce("ordered-event");
  CG_LAUNCH(write_range, dim3(grid(kN)), dim3(kThreads), 0, s1)(x, 0, kN, 5.0f);
  cgcpu::launch_site("streams.cu:writer before the event");
  CUDA_OK(cudaEventRecord(event, s1));
  CUDA_OK(cudaStreamWaitEvent(s2, event, 0));
  CG_LAUNCH(read_all, dim3(grid(kN)), dim3(kThreads), 0, s2)(y, x, kN);
  cgcpu::launch_site("streams.cu:reader after the event");
  run_product(lt, product, d, w, y, shared_workspace, workspace_bytes, s2);
  cgcpu::launch_site("streams.cu:product after the event");
  CUDA_OK(cudaEventRecord(event, s2));
  CUDA_OK(cudaStreamWaitEvent(s1, event, 0));
  run_product(lt, product, d2, w, y, shared_workspace, workspace_bytes, s1);
  cgcpu::launch_site("streams.cu:product after the other");
  CUDA_OK(cudaDeviceSynchronize());

  announce("ordered-fill");  // a memset of fresh memory, then (an event) a kernel reading it
  CUDA_OK(cudaMemsetAsync(fresh3, 0, kFresh * sizeof(float), s1));
  cgcpu::launch_site("streams.cu:memset before the event");
  CUDA_OK(cudaEventRecord(event, s1));
  CUDA_OK(cudaStreamWaitEvent(s2, event, 0));
  CG_LAUNCH(read_all, dim3(grid(kFresh)), dim3(kThreads), 0, s2)(sink, fresh3, kFresh);
  cgcpu::launch_site("streams.cu:fresh reader after the event");
  CUDA_OK(cudaDeviceSynchronize());

  announce("ordered-host");  // the host waited for s1 before issuing the reader
  CG_LAUNCH(write_range, dim3(grid(kN)), dim3(kThreads), 0, s1)(x, 0, kN, 6.0f);
  cgcpu::launch_site("streams.cu:writer the host waits for");
  CUDA_OK(cudaStreamSynchronize(s1));
  CG_LAUNCH(read_all, dim3(grid(kN)), dim3(kThreads), 0, s2)(y, x, kN);
  cgcpu::launch_site("streams.cu:reader after the wait");
  CUDA_OK(cudaDeviceSynchronize());

  announce("ordered-legacy");  // the legacy stream waits for a blocking stream, and it for the legacy one
  CG_LAUNCH(write_range, dim3(grid(kN)), dim3(kThreads), 0, blocking)(x, 0, kN, 7.0f);
  cgcpu::launch_site("streams.cu:blocking writer");
  CG_LAUNCH(read_all, dim3(grid(kN)), dim3(kThreads), 0, nullptr)(y, x, kN);
  cgcpu::launch_site("streams.cu:legacy reader after it");
  CG_LAUNCH(write_range, dim3(grid(kN)), dim3(kThreads), 0, blocking)(y, 0, kN, 8.0f);
  cgcpu::launch_site("streams.cu:blocking writer after the legacy reader");
  CUDA_OK(cudaDeviceSynchronize());
  announce("end");

  std::vector<float> host(kN);
  CUDA_OK(cudaMemcpy(host.data(), y, kN * sizeof(float), cudaMemcpyDeviceToHost));
  CHECK(host[0] == 8.0f && host[kN - 1] == 8.0f, "the ordered writes ran in order: %g", host[0]);
  ncclCommDestroy(comm);
  cublasLtDestroy(lt);
  FINISH("conflict");
}

static int interleave(bool same_stream) {
  cudaStream_t s1, s2;
  CUDA_OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  if (same_stream) s2 = s1;
  constexpr int kBlocks = 24;
  unsigned* counter;
  int* order;
  CUDA_OK(cudaMalloc(&counter, sizeof(unsigned)));
  CUDA_OK(cudaMemset(counter, 0, sizeof(unsigned)));
  CUDA_OK(cudaMalloc(&order, 2 * kBlocks * sizeof(int)));
  CG_LAUNCH(take_ticket, dim3(kBlocks), dim3(64), 0, s1)(order, counter, 1);
  CG_LAUNCH(take_ticket, dim3(kBlocks), dim3(64), 0, s2)(order, counter, 2);
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<int> host(2 * kBlocks);
  CUDA_OK(cudaMemcpy(host.data(), order, host.size() * sizeof(int), cudaMemcpyDeviceToHost));
  std::printf("interleave:");
  for (int v : host) std::printf(" %c%d", v / 1000 == 1 ? 'A' : 'B', v % 1000);
  std::printf("\n");
  FINISH("interleave");
}

static int racecheck() {
  cudaStream_t parent, s1, s2;
  CUDA_OK(cudaStreamCreate(&parent));
  CUDA_OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  cudaEvent_t fork, join;
  CUDA_OK(cudaEventCreate(&fork));
  CUDA_OK(cudaEventCreate(&join));
  int *racy_out, *clean_out;
  CUDA_OK(cudaMalloc(&racy_out, 8 * sizeof(int)));
  CUDA_OK(cudaMalloc(&clean_out, 8 * 64 * sizeof(int)));
  CUDA_OK(cudaEventRecord(fork, parent));
  CUDA_OK(cudaStreamWaitEvent(s1, fork, 0));
  CUDA_OK(cudaStreamWaitEvent(s2, fork, 0));
  CG_LAUNCH(racy_shared, dim3(8), dim3(32), 64 * sizeof(int), s1)(racy_out);
  CG_LAUNCH(clean_shared, dim3(8), dim3(64), 64 * sizeof(int), s2)(clean_out);
  CUDA_OK(cudaEventRecord(join, s1));
  CUDA_OK(cudaStreamWaitEvent(parent, join, 0));
  CUDA_OK(cudaEventRecord(join, s2));  // the event again: the wait takes its latest record
  CUDA_OK(cudaStreamWaitEvent(parent, join, 0));
  CG_LAUNCH(clean_shared, dim3(8), dim3(64), 64 * sizeof(int), parent)(clean_out);
  CUDA_OK(cudaStreamSynchronize(parent));
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<int> host(8 * 64);
  CUDA_OK(cudaMemcpy(host.data(), clean_out, host.size() * sizeof(int), cudaMemcpyDeviceToHost));
  CHECK(host[0] == 1 && host[63] == 0 && host[64] == 1, "the clean kernel's values");
  FINISH("racecheck");
}

static int fault() {
  cudaStream_t s1;
  CUDA_OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  int* out;
  CUDA_OK(cudaMalloc(&out, 64 * sizeof(int)));
  CG_LAUNCH(deadlock, dim3(1), dim3(64), 0, s1)(out);
  cgcpu::launch_site("streams.cu:the deadlock");
  CHECK(cudaGetLastError() == cudaSuccess, "a queued launch has not run yet");
  const cudaError_t waited = cudaStreamSynchronize(s1);
  CHECK(waited == cudaErrorLaunchFailure, "the wait returns the fault: %s", cudaGetErrorName(waited));
  CHECK(cudaDeviceSynchronize() == cudaErrorLaunchFailure, "and it stays");
  FINISH("fault");
}

__global__ void bump(unsigned* counter) {
  if (threadIdx.x == 0 && blockIdx.x == 0) *counter += 1u;
}

struct GraphRound {
  cublasLtHandle_t lt;
  cudaStream_t parent, side1, side2;
  cudaEvent_t fork, join1, join2;
  Product product;
  float *in, *w, *a, *b, *d, *copy, *out;
  unsigned* counter;
  void *ws1, *ws2;
  size_t workspace_bytes;
};

// One round: parent and two side streams forked and joined by events.
static void graph_round(GraphRound& g) {
  CUDA_OK(cudaEventRecord(g.fork, g.parent));
  CUDA_OK(cudaStreamWaitEvent(g.side1, g.fork, 0));
  CUDA_OK(cudaStreamWaitEvent(g.side2, g.fork, 0));
  CG_LAUNCH(scale, dim3(grid(kN)), dim3(kThreads), 0, g.parent)(g.a, g.in, 2.5f, kN);
  cgcpu::launch_site("streams.cu graph: parent scale");
  CG_LAUNCH(scale, dim3(grid(kN)), dim3(kThreads), 0, g.side1)(g.b, g.in, -0.5f, kN);
  cgcpu::launch_site("streams.cu graph: side1 scale");
  {  // alpha is a local: the graph keeps its value, not its address
    float alpha = 2.0f;
    const float beta = 0.0f;
    CHECK(cublasLtMatmul(g.lt, g.product.desc, &alpha, g.w, g.product.a, g.in, g.product.b, &beta, g.d,
                         g.product.d, g.d, g.product.d, &g.product.algo, g.ws2, g.workspace_bytes, g.side2) ==
              CUBLAS_STATUS_SUCCESS, "cublasLtMatmul");
    alpha = 1000.0f;
  }
  CUDA_OK(cudaMemsetAsync(g.copy, 0, kN * sizeof(float), g.side2));
  CUDA_OK(cudaMemcpyAsync(g.copy, g.d, g.product.m * g.product.n * sizeof(float), cudaMemcpyDeviceToDevice,
                          g.side2));
  CUDA_OK(cudaEventRecord(g.join1, g.side1));
  CUDA_OK(cudaStreamWaitEvent(g.parent, g.join1, 0));
  CUDA_OK(cudaEventRecord(g.join2, g.side2));
  CUDA_OK(cudaStreamWaitEvent(g.parent, g.join2, 0));
  CG_LAUNCH(combine, dim3(grid(kN)), dim3(kThreads), 0, g.parent)(g.out, g.a, g.b, kN);
  cgcpu::launch_site("streams.cu graph: parent combine");
  CG_LAUNCH(bump, dim3(1), dim3(32), 0, g.parent)(g.counter);
  cgcpu::launch_site("streams.cu graph: parent bump");
}

static std::vector<float> graph_outputs(const GraphRound& g) {
  std::vector<float> values(2 * kN);
  CUDA_OK(cudaMemcpy(values.data(), g.out, kN * sizeof(float), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(values.data() + kN, g.copy, kN * sizeof(float), cudaMemcpyDeviceToHost));
  return values;
}

static unsigned graph_counter(const GraphRound& g) {
  unsigned value = 0;
  CUDA_OK(cudaMemcpy(&value, g.counter, sizeof value, cudaMemcpyDeviceToHost));
  return value;
}

static cudaError_t end_capture(cudaStream_t stream, cudaGraph_t* graph) {
  *graph = reinterpret_cast<cudaGraph_t>(&graph);  // must come back null when refused
  return cudaStreamEndCapture(stream, graph);
}

static int graph() {
  GraphRound g{};
  cublasLtCreate(&g.lt);
  CUDA_OK(cudaStreamCreate(&g.parent));
  CUDA_OK(cudaStreamCreateWithFlags(&g.side1, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&g.side2, cudaStreamNonBlocking));
  CUDA_OK(cudaEventCreateWithFlags(&g.fork, cudaEventDisableTiming));
  CUDA_OK(cudaEventCreateWithFlags(&g.join1, cudaEventDisableTiming));
  CUDA_OK(cudaEventCreateWithFlags(&g.join2, cudaEventDisableTiming));
  constexpr int kM = 32, kK = 16, kCols = kN / kK / 4;
  std::vector<float> host_in(kN), host_w(kM * kK);
  for (int i = 0; i < kN; ++i) host_in[i] = static_cast<float>((i * 37) % 101) / 16.0f;
  for (int i = 0; i < kM * kK; ++i) host_w[i] = static_cast<float>((i * 13) % 17 - 8) / 8.0f;
  g.in = device_floats(kN, 0.0f);
  g.w = device_floats(kM * kK, 0.0f);
  CUDA_OK(cudaMemcpy(g.in, host_in.data(), kN * sizeof(float), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(g.w, host_w.data(), kM * kK * sizeof(float), cudaMemcpyHostToDevice));
  g.a = device_floats(kN, 0.0f);
  g.b = device_floats(kN, 0.0f);
  g.d = device_floats(kM * kCols, 0.0f);
  g.copy = device_floats(kN, 7.0f);
  g.out = device_floats(kN, 0.0f);
  CUDA_OK(cudaMalloc(&g.counter, sizeof(unsigned)));
  CUDA_OK(cudaMemset(g.counter, 0, sizeof(unsigned)));
  g.workspace_bytes = 1 << 16;
  CUDA_OK(cudaMalloc(&g.ws1, g.workspace_bytes));
  CUDA_OK(cudaMalloc(&g.ws2, g.workspace_bytes));
  g.product = make_product(g.lt, kM, kCols, kK, g.workspace_bytes);

  graph_round(g);  // eager
  CUDA_OK(cudaStreamSynchronize(g.parent));
  const std::vector<float> eager = graph_outputs(g);
  CHECK(graph_counter(g) == 1u, "the eager round bumps once");
  float expected00 = 0.0f;  // D[0, 0] = 2 sum_p W[0, p] in[p, 0]
  for (int p = 0; p < kK; ++p) expected00 += host_w[p * kM] * host_in[p];
  CHECK(eager[kN] == 2.0f * expected00, "the product %g, expected %g", eager[kN], 2.0f * expected00);
  CHECK(eager[2 * kN - 1] == 0.0f, "the copy's tail is the memset's");

  // Captured: nothing runs; the side streams join the capture and report it.
  CUDA_OK(cudaMemset(g.out, 0, kN * sizeof(float)));
  CUDA_OK(cudaMemset(g.copy, 0x7f, kN * sizeof(float)));
  CUDA_OK(cudaStreamBeginCapture(g.parent, cudaStreamCaptureModeGlobal));
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  CUDA_OK(cudaStreamIsCapturing(g.side1, &status));
  CHECK(status == cudaStreamCaptureStatusNone, "side1 has not joined yet");
  graph_round(g);
  CUDA_OK(cudaStreamIsCapturing(g.side1, &status));
  CHECK(status == cudaStreamCaptureStatusActive, "side1 joined the capture by its wait");
  cudaGraph_t made = nullptr;
  CUDA_OK(end_capture(g.parent, &made));
  CHECK(made != nullptr, "a graph");
  CUDA_OK(cudaStreamIsCapturing(g.parent, &status));
  CHECK(status == cudaStreamCaptureStatusNone, "the capture ended");
  CHECK(graph_counter(g) == 1u, "nothing ran during the capture");
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, made, 0));
  CUDA_OK(cudaGraphDestroy(made));
  for (int replay = 0; replay < 3; ++replay) CUDA_OK(cudaGraphLaunch(exec, g.parent));
  CUDA_OK(cudaStreamSynchronize(g.parent));
  CHECK(graph_counter(g) == 4u, "three replays bump three times: %u", graph_counter(g));
  const std::vector<float> replayed = graph_outputs(g);
  CHECK(std::memcmp(replayed.data(), eager.data(), eager.size() * sizeof(float)) == 0,
        "a replay gives the eager round's bits");
  cudaStream_t other;
  CUDA_OK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  CUDA_OK(cudaGraphLaunch(exec, other));
  CUDA_OK(cudaStreamSynchronize(other));
  CHECK(graph_counter(g) == 5u, "a replay on another stream, waited for there: %u", graph_counter(g));
  CUDA_OK(cudaGraphExecDestroy(exec));

  // What a capture refuses: the call's error, then the capture's.
  void* scratch = nullptr;
  struct Refusal {
    const char* name;
    cudaError_t call, end;
  };
  std::vector<Refusal> refusals;
  CUDA_OK(cudaStreamBeginCapture(g.parent, cudaStreamCaptureModeGlobal));
  refusals.push_back({"a host wait", cudaStreamSynchronize(g.parent), end_capture(g.parent, &made)});
  CHECK(made == nullptr, "no graph");
  CUDA_OK(cudaStreamBeginCapture(g.parent, cudaStreamCaptureModeGlobal));
  refusals.push_back({"an allocation", cudaMalloc(&scratch, 256), end_capture(g.parent, &made)});
  CUDA_OK(cudaStreamBeginCapture(g.parent, cudaStreamCaptureModeGlobal));
  CG_LAUNCH(bump, dim3(1), dim3(32), 0, 0)(g.counter);
  refusals.push_back({"the legacy stream", cudaGetLastError(), end_capture(g.parent, &made)});
  CUDA_OK(cudaStreamBeginCapture(g.parent, cudaStreamCaptureModeGlobal));
  refusals.push_back({"a host copy",
                      cudaMemcpyAsync(g.in, host_in.data(), sizeof(float), cudaMemcpyHostToDevice, g.parent),
                      end_capture(g.parent, &made)});
  CUDA_OK(cudaStreamBeginCapture(g.parent, cudaStreamCaptureModeGlobal));
  CUDA_OK(cudaEventRecord(g.fork, g.parent));
  refusals.push_back({"waiting for a captured event", cudaEventSynchronize(g.fork), end_capture(g.parent, &made)});
  CUDA_OK(cudaStreamBeginCapture(g.parent, cudaStreamCaptureModeGlobal));
  CUDA_OK(cudaEventRecord(g.fork, g.parent));
  CUDA_OK(cudaStreamWaitEvent(g.side1, g.fork, 0));
  CG_LAUNCH(bump, dim3(1), dim3(32), 0, g.side1)(g.counter);
  refusals.push_back({"a fork never joined", cudaSuccess, end_capture(g.parent, &made)});
  const cudaError_t expected_call[] = {cudaErrorStreamCaptureUnsupported, cudaErrorStreamCaptureUnsupported,
                                       cudaErrorStreamCaptureImplicit, cudaErrorStreamCaptureUnsupported,
                                       cudaErrorStreamCaptureUnsupported, cudaSuccess};
  for (std::size_t i = 0; i < refusals.size(); ++i) {
    const cudaError_t expected_end =
        i + 1 == refusals.size() ? cudaErrorStreamCaptureUnjoined : cudaErrorStreamCaptureInvalidated;
    CHECK(refusals[i].call == expected_call[i] && refusals[i].end == expected_end, "%s: the call %s, the end %s",
          refusals[i].name, cudaGetErrorName(refusals[i].call), cudaGetErrorName(refusals[i].end));
  }
  CHECK(made == nullptr && scratch == nullptr, "nothing made");
  CHECK(cudaStreamBeginCapture(0, cudaStreamCaptureModeGlobal) == cudaErrorStreamCaptureUnsupported,
        "the legacy stream captures nothing");
  cudaGetLastError();
  CUDA_OK(cudaDeviceSynchronize());
  CHECK(graph_counter(g) == 5u, "no refused capture ran anything: %u", graph_counter(g));
  const std::vector<float> after = graph_outputs(g);
  std::printf("graph hash: %016llx\n", static_cast<unsigned long long>(hash(after)));
  cublasLtDestroy(g.lt);
  FINISH("graph");
}

// Two branches of a graph that write and read one buffer, unordered: every replay's pair is a
// conflict for the shadow.
static int graph_conflict() {
  cudaStream_t parent, side;
  CUDA_OK(cudaStreamCreate(&parent));
  CUDA_OK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  cudaEvent_t fork, join;
  CUDA_OK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CUDA_OK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  float* x = device_floats(kN, 1.0f);
  float* y = device_floats(kN, 0.0f);
  CUDA_OK(cudaStreamBeginCapture(parent, cudaStreamCaptureModeGlobal));
  CUDA_OK(cudaEventRecord(fork, parent));
  CUDA_OK(cudaStreamWaitEvent(side, fork, 0));
  CG_LAUNCH(write_range, dim3(grid(256)), dim3(kThreads), 0, side)(x, 0, 256, 3.0f);
  cgcpu::launch_site("streams.cu:graph writer");
  CG_LAUNCH(read_all, dim3(grid(256)), dim3(kThreads), 0, parent)(y, x, 256);
  cgcpu::launch_site("streams.cu:graph reader");
  CUDA_OK(cudaEventRecord(join, side));
  CUDA_OK(cudaStreamWaitEvent(parent, join, 0));
  cudaGraph_t made = nullptr;
  CUDA_OK(cudaStreamEndCapture(parent, &made));
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, made, 0));
  for (int replay = 0; replay < 2; ++replay) {
    std::fprintf(stderr, "streams: replay %d\n", replay);
    CUDA_OK(cudaGraphLaunch(exec, parent));
    CUDA_OK(cudaStreamSynchronize(parent));
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(made));
  FINISH("graph-conflict");
}

int main(int argc, char** argv) {
  if (mode_is(argc, argv, "clean")) return clean();
  if (mode_is(argc, argv, "conflict")) return conflict();
  if (mode_is(argc, argv, "interleave")) return interleave(argc > 2 && std::strcmp(argv[2], "same") == 0);
  if (mode_is(argc, argv, "racecheck")) return racecheck();
  if (mode_is(argc, argv, "fault")) return fault();
  if (mode_is(argc, argv, "graph")) return graph();
  if (mode_is(argc, argv, "graph-conflict")) return graph_conflict();
  std::printf("usage: %s clean|conflict|interleave [same]|racecheck|fault|graph|graph-conflict\n", argv[0]);
  return 2;
}
