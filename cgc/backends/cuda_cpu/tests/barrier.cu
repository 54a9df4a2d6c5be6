// Block barriers: __syncthreads gives a block-wide reduction through shared memory the exact
// sum; without the barrier threads read stale values; divergent barriers are reported.
//   barrier            the checks below (exit 0 when all pass)
//   barrier exit       threads 32-63 return while 0-31 wait at __syncthreads: deadlock fault
//   barrier sites      two __syncthreads call sites in divergent code: fault
#include "check.h"

#include <vector>

constexpr int kThreads = 256;
constexpr int kBlocks = 64;

// Sum of the block's values: every thread writes its value, then thread 0 adds them up.
template <bool kBarrier>
__global__ void block_sum(float* sums, const float* values) {
  __shared__ float slots[kThreads];
  slots[threadIdx.x] = values[blockIdx.x * kThreads + threadIdx.x];
  if (kBarrier) __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int i = 0; i < kThreads; ++i) total += slots[i];
    sums[blockIdx.x] = total;
  }
  if (kBarrier) __syncthreads();
  slots[threadIdx.x] = -1.0f;  // the next block on this worker starts from stale values
}

// Tree reduction, a barrier per level; every thread reads the total afterwards.
__global__ void tree_sum(float* sums, const float* values) {
  __shared__ float slots[kThreads];
  slots[threadIdx.x] = values[blockIdx.x * kThreads + threadIdx.x];
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) slots[threadIdx.x] += slots[threadIdx.x + stride];
    __syncthreads();
  }
  const float total = slots[0];
  __syncthreads();
  if (total != slots[0]) sums[blockIdx.x] = -2.0f;
  if (threadIdx.x == kThreads - 1) sums[blockIdx.x] = total;
}

__global__ void counting(int* out) {
  const int t = threadIdx.x;
  out[0] = __syncthreads_count(t % 3 == 0);
  out[1] = __syncthreads_and(t >= 0);
  out[2] = __syncthreads_and(t != 5);
  out[3] = __syncthreads_or(t == 77);
  out[4] = __syncthreads_or(0);
}

// Every thread of a 3-D grid of 3-D blocks records who it is.
__global__ void indices(int* out) {
  const int block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const int thread = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int threads = blockDim.x * blockDim.y * blockDim.z;
  out[block * threads + thread] = block * 100000 + thread;
  __syncthreads();
}

__global__ void divergent_exit(int* out) {
  if (threadIdx.x >= 32) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}

__global__ void divergent_sites(int* out) {
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1;
}

// Launches a kernel that faults: the launch fails, and the error stays (sticky, as on a GPU).
#define RUN_FAULT(kernel, name, grid, block)                                                       \
  do {                                                                                             \
    int* out = nullptr;                                                                            \
    CUDA_OK(cudaMalloc(&out, 1024 * sizeof(int)));                                                 \
    CG_LAUNCH(kernel, grid, block, 0, nullptr)(out);                                               \
    const cudaError_t launch = cudaGetLastError();                                                 \
    const cudaError_t later = cudaDeviceSynchronize();                                             \
    std::printf("%s: launch %s, then %s\n", name, cudaGetErrorName(launch), cudaGetErrorName(later)); \
    CHECK(launch == cudaErrorLaunchFailure, "launch returned %s", cudaGetErrorName(launch));       \
    CHECK(later == cudaErrorLaunchFailure, "sync returned %s", cudaGetErrorName(later));           \
    FINISH(name);                                                                                  \
  } while (0)

int main(int argc, char** argv) {
  if (mode_is(argc, argv, "exit")) RUN_FAULT(divergent_exit, "exit", dim3(2), dim3(64));
  if (mode_is(argc, argv, "sites")) RUN_FAULT(divergent_sites, "sites", dim3(1), dim3(32));

  std::vector<float> host(kBlocks * kThreads);
  std::vector<float> expected(kBlocks, 0.0f);
  for (int i = 0; i < kBlocks * kThreads; ++i) {
    host[i] = static_cast<float>((i * 7919) % 1000);  // integers: every order of addition is exact
    expected[i / kThreads] += host[i];
  }
  float *values = nullptr, *sums = nullptr;
  CUDA_OK(cudaMalloc(&values, host.size() * sizeof(float)));
  CUDA_OK(cudaMalloc(&sums, kBlocks * sizeof(float)));
  CUDA_OK(cudaMemcpy(values, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
  std::vector<float> got(kBlocks);

  auto wrong_blocks = [&](void (*kernel)(float*, const float*)) {
    CUDA_OK(cudaMemset(sums, 0, kBlocks * sizeof(float)));
    CG_LAUNCH(kernel, dim3(kBlocks), dim3(kThreads), 0, nullptr)(sums, values);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaMemcpy(got.data(), sums, kBlocks * sizeof(float), cudaMemcpyDeviceToHost));
    int wrong = 0;
    for (int b = 0; b < kBlocks; ++b) wrong += got[b] != expected[b];
    return wrong;
  };

  // With the barrier: exact in thread order and in every shuffled order.
  for (unsigned long long seed = 0; seed <= 20; ++seed) {
    cgcpu::set_schedule_seed(seed);
    const int wrong = wrong_blocks(block_sum<true>);
    CHECK(wrong == 0, "seed %llu: %d blocks wrong with the barrier", seed, wrong);
    const int tree_wrong = wrong_blocks(tree_sum);
    CHECK(tree_wrong == 0, "seed %llu: %d blocks wrong in the tree reduction", seed, tree_wrong);
  }
  // Without it: thread 0 reads slots the other threads have not written yet.
  int seeds_wrong = 0;
  for (unsigned long long seed = 0; seed <= 20; ++seed) {
    cgcpu::set_schedule_seed(seed);
    const int wrong = wrong_blocks(block_sum<false>);
    seeds_wrong += wrong > 0;
    if (seed < 3) std::printf("without the barrier, seed %llu: %d of %d blocks wrong\n", seed, wrong, kBlocks);
  }
  CHECK(seeds_wrong == 21, "only %d of 21 schedules saw stale values without the barrier", seeds_wrong);
  cgcpu::set_schedule_seed(0);

  int* counts = nullptr;
  CUDA_OK(cudaMalloc(&counts, 5 * sizeof(int)));
  CG_LAUNCH(counting, dim3(1), dim3(160), 0, nullptr)(counts);
  CUDA_OK(cudaGetLastError());
  int c[5];
  CUDA_OK(cudaMemcpy(c, counts, sizeof c, cudaMemcpyDeviceToHost));
  CHECK(c[0] == 54, "__syncthreads_count gave %d", c[0]);
  CHECK(c[1] == 1 && c[2] == 0, "__syncthreads_and gave %d, %d", c[1], c[2]);
  CHECK(c[3] == 1 && c[4] == 0, "__syncthreads_or gave %d, %d", c[3], c[4]);

  const dim3 grid(3, 2, 2), block(4, 5, 6);
  const int total = 12 * 120;
  int* ids = nullptr;
  CUDA_OK(cudaMalloc(&ids, total * sizeof(int)));
  CG_LAUNCH(indices, grid, block, 0, nullptr)(ids);
  CUDA_OK(cudaGetLastError());
  std::vector<int> seen(total);
  CUDA_OK(cudaMemcpy(seen.data(), ids, total * sizeof(int), cudaMemcpyDeviceToHost));
  int bad = 0;
  for (int i = 0; i < total; ++i) bad += seen[i] != (i / 120) * 100000 + i % 120;
  CHECK(bad == 0, "%d threads of a 3-D launch saw wrong indices", bad);

  CUDA_OK(cudaFree(values));
  CUDA_OK(cudaFree(sums));
  CUDA_OK(cudaFree(counts));
  CUDA_OK(cudaFree(ids));
  FINISH("barrier");
}
