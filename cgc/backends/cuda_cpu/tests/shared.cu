// Shared memory: static __shared__ (in a kernel, a device function, a template) is per block,
// even with blocks running at once on several OS threads; dynamic shared memory is per block,
// 128-byte aligned, of the launch's size, and larger than 48 KiB once the kernel allows it.
// Run with CG_CPU_THREADS >= 2 (the test sets 4).
#include "check.h"

#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

constexpr int kThreads = 64;
constexpr int kBlocks = 96;
constexpr int kRounds = 200;

struct BlockReport {
  int errors;
  unsigned long long worker;   // hash of the OS thread that ran the block
  unsigned long long address;  // where the device function's __shared__ slot was
  unsigned long long dynamic;  // where the dynamic shared memory was
  int dynamic_errors;
  int first_byte;
};

__device__ int* block_slot() {
  __shared__ int slot[2];
  return slot;
}

template <int kTag>
__device__ int* tagged_slot() {
  __shared__ int slot;
  return &slot;
}

__device__ unsigned long long worker_hash() {
  return std::hash<std::thread::id>()(std::this_thread::get_id());
}

// Thread 0 stores the block's id in the device function's shared slot; every thread checks it,
// round after round, between barriers; a thread rewrites it now and then. Other blocks on
// other workers do the same with their ids at the same time.
__global__ void static_shared(BlockReport* reports) {
  int* slot = block_slot();
  int* a = tagged_slot<1>();
  int* b = tagged_slot<2>();
  __shared__ int errors;
  if (threadIdx.x == 0) {
    slot[0] = blockIdx.x;
    *a = 1000 + blockIdx.x;
    *b = 2000 + blockIdx.x;
    errors = 0;
  }
  __syncthreads();
  for (int r = 0; r < kRounds; ++r) {
    if (slot[0] != static_cast<int>(blockIdx.x) || *a != 1000 + static_cast<int>(blockIdx.x) ||
        *b != 2000 + static_cast<int>(blockIdx.x))
      ++errors;  // one writer at a time: fibers of a block never run at once
    __syncthreads();
    if (threadIdx.x == static_cast<unsigned>(r % kThreads)) slot[0] = blockIdx.x;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    reports[blockIdx.x].errors = errors;
    reports[blockIdx.x].worker = worker_hash();
    reports[blockIdx.x].address = reinterpret_cast<unsigned long long>(slot);
  }
}

__global__ void dynamic_shared(BlockReport* reports, unsigned long long* pointers, int bytes) {
  CG_DYNAMIC_SHARED(memory);
  __shared__ int errors;
  pointers[blockIdx.x * kThreads + threadIdx.x] = reinterpret_cast<unsigned long long>(memory);
  if (threadIdx.x == 0) {
    errors = 0;
    reports[blockIdx.x].first_byte = memory[0];
    reports[blockIdx.x].dynamic = reinterpret_cast<unsigned long long>(memory);
    reports[blockIdx.x].worker = worker_hash();
  }
  __syncthreads();
  const unsigned char tag = static_cast<unsigned char>(blockIdx.x * 7 + 1);
  for (int i = threadIdx.x; i < bytes; i += kThreads) memory[i] = tag;
  for (int r = 0; r < 20; ++r) {
    __syncthreads();
    for (int i = threadIdx.x; i < bytes; i += kThreads)
      if (memory[(i + r * 97) % bytes] != tag) ++errors;
  }
  __syncthreads();
  if (threadIdx.x == 0) reports[blockIdx.x].dynamic_errors = errors;
}

int main() {
  BlockReport* reports = nullptr;
  CUDA_OK(cudaMalloc(&reports, kBlocks * sizeof(BlockReport)));
  CUDA_OK(cudaMemset(reports, 0, kBlocks * sizeof(BlockReport)));
  CG_LAUNCH(static_shared, dim3(kBlocks), dim3(kThreads), 0, nullptr)(reports);
  CUDA_OK(cudaGetLastError());
  std::vector<BlockReport> r(kBlocks);
  CUDA_OK(cudaMemcpy(r.data(), reports, kBlocks * sizeof(BlockReport), cudaMemcpyDeviceToHost));
  std::vector<unsigned long long> workers;
  for (int b = 0; b < kBlocks; ++b) {
    CHECK(r[b].errors == 0, "block %d saw another block's __shared__ values %d times", b, r[b].errors);
    bool known = false;
    for (unsigned long long w : workers) known = known || w == r[b].worker;
    if (!known) workers.push_back(r[b].worker);
    for (int c = 0; c < b; ++c)  // blocks on different OS threads: different storage
      if (r[c].worker != r[b].worker)
        CHECK(r[c].address != r[b].address, "blocks %d and %d, on two workers, share __shared__", c, b);
  }
  std::printf("static shared: %d blocks on %zu OS threads\n", kBlocks, workers.size());
  CHECK(workers.size() >= 2, "the blocks ran on %zu OS thread(s): the test needs CG_CPU_THREADS >= 2", workers.size());

  // Dynamic shared memory: 5000 bytes (not a multiple of 128), then 100 KiB.
  unsigned long long* pointers = nullptr;
  CUDA_OK(cudaMalloc(&pointers, kBlocks * kThreads * sizeof(unsigned long long)));
  for (int bytes : {5000, 100 * 1024}) {
    if (bytes > 48 * 1024) {
      CG_LAUNCH(dynamic_shared, dim3(kBlocks), dim3(kThreads), bytes, nullptr)(reports, pointers, bytes);
      const cudaError_t refused = cudaGetLastError();
      CHECK(refused == cudaErrorInvalidValue, "%d bytes without the attribute: %s", bytes, cudaGetErrorName(refused));
      CUDA_OK(cudaFuncSetAttribute(dynamic_shared, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    }
    CUDA_OK(cudaMemset(reports, 0, kBlocks * sizeof(BlockReport)));
    CG_LAUNCH(dynamic_shared, dim3(kBlocks), dim3(kThreads), bytes, nullptr)(reports, pointers, bytes);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaMemcpy(r.data(), reports, kBlocks * sizeof(BlockReport), cudaMemcpyDeviceToHost));
    std::vector<unsigned long long> p(kBlocks * kThreads);
    CUDA_OK(cudaMemcpy(p.data(), pointers, p.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
    for (int b = 0; b < kBlocks; ++b) {
      CHECK(r[b].dynamic_errors == 0, "%d bytes, block %d: %d bytes changed under it", bytes, b, r[b].dynamic_errors);
      CHECK(r[b].dynamic % 128 == 0, "%d bytes, block %d: dynamic shared memory at %llx", bytes, b, r[b].dynamic);
      CHECK(r[b].first_byte == 0xFF, "block %d: dynamic shared memory starts as %d (CG_CPU_SHARED_FILL)", b,
            r[b].first_byte);
      for (int t = 0; t < kThreads; ++t)
        CHECK(p[b * kThreads + t] == r[b].dynamic, "block %d thread %d sees another pointer", b, t);
    }
  }
  CUDA_OK(cudaFree(reports));
  CUDA_OK(cudaFree(pointers));
  FINISH("shared");
}
