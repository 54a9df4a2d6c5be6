// Atomics across blocks that run at once on several OS workers: atomicInc and atomicDec as the
// CUDA Programming Guide defines them (atomicInc: old >= val ? 0 : old + 1; atomicDec:
// old == 0 || old > val ? val : old - 1), a ticket counter taken by every thread of a grid
// (each ticket once), and the last-block pattern of the layer-norm backward (common.cuh):
// each block writes its partial sum, fences, takes a ticket; the block that takes the last
// ticket sums the partials, and the counter is back at zero for the next launch.
#include "check.h"

#include <climits>
#include <vector>

constexpr int kBlocks = 96;
constexpr int kThreads = 64;

__global__ void apply(unsigned* results, unsigned* words, const unsigned* limits, int dec) {
  const int i = threadIdx.x;
  results[i] = dec ? atomicDec(&words[i], limits[i]) : atomicInc(&words[i], limits[i]);
}

__device__ unsigned int g_tickets = 0;

__global__ void every_thread_takes_a_ticket(unsigned* taken, unsigned limit) {
  const unsigned ticket = atomicInc(&g_tickets, limit);
  taken[blockIdx.x * blockDim.x + threadIdx.x] = ticket;
}

__device__ unsigned int g_last_block = 0;

// partials[b] = the sum of block b's values; the last block writes their sum, in block order.
__global__ void last_block_sums(float* total, int* lasts, float* partials, const float* values) {
  __shared__ float slots[kThreads];
  __shared__ bool last;
  slots[threadIdx.x] = values[blockIdx.x * kThreads + threadIdx.x];
  __syncthreads();
  if (threadIdx.x == 0) {
    float sum = 0.0f;
    for (int i = 0; i < kThreads; ++i) sum += slots[i];
    partials[blockIdx.x] = sum;
    __threadfence();
    last = atomicInc(&g_last_block, gridDim.x - 1) == gridDim.x - 1;
    if (last) __threadfence();
  }
  __syncthreads();
  if (!last) return;
  if (threadIdx.x == 0) {
    float sum = 0.0f;
    for (unsigned b = 0; b < gridDim.x; ++b) sum += __ldcg(&partials[b]);
    total[0] = sum;
    atomicAdd(lasts, 1);
  }
}

int main() {
  // ---- the definitions, one word a thread ----
  struct Case { unsigned old, limit, inc, dec; };
  const std::vector<Case> cases = {
      {0, 3, 1, 3}, {2, 3, 3, 1}, {3, 3, 0, 2}, {5, 3, 0, 3}, {0, 0, 0, 0}, {1, 0, 0, 0},
      {7, 10, 8, 6}, {UINT_MAX - 1, UINT_MAX, UINT_MAX, UINT_MAX - 2}, {UINT_MAX, UINT_MAX, 0, UINT_MAX - 1},
      {UINT_MAX, 5, 0, 5}, {1, 1, 0, 0},
  };
  const int n = static_cast<int>(cases.size());
  unsigned *results, *words, *limits;
  CUDA_OK(cudaMalloc(&results, n * sizeof(unsigned)));
  CUDA_OK(cudaMalloc(&words, n * sizeof(unsigned)));
  CUDA_OK(cudaMalloc(&limits, n * sizeof(unsigned)));
  for (int dec = 0; dec < 2; ++dec) {
    std::vector<unsigned> old(n), limit(n), got(n), now(n);
    for (int i = 0; i < n; ++i) old[i] = cases[i].old, limit[i] = cases[i].limit;
    CUDA_OK(cudaMemcpy(words, old.data(), n * sizeof(unsigned), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(limits, limit.data(), n * sizeof(unsigned), cudaMemcpyHostToDevice));
    CG_LAUNCH(apply, dim3(1), dim3(n), 0, nullptr)(results, words, limits, dec);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaMemcpy(got.data(), results, n * sizeof(unsigned), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(now.data(), words, n * sizeof(unsigned), cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; ++i) {
      const unsigned expected = dec ? cases[i].dec : cases[i].inc;
      CHECK(got[i] == cases[i].old, "%s returned %u, not the old value %u", dec ? "atomicDec" : "atomicInc", got[i], cases[i].old);
      CHECK(now[i] == expected, "%s(%u, limit %u) stored %u, not %u", dec ? "atomicDec" : "atomicInc",
            cases[i].old, cases[i].limit, now[i], expected);
    }
  }

  // ---- a ticket a thread, every block at once: each ticket taken once, and the counter wraps
  // back to zero after the last ----
  constexpr int kTaken = kBlocks * kThreads;
  unsigned* taken;
  CUDA_OK(cudaMalloc(&taken, kTaken * sizeof(unsigned)));
  for (int round = 0; round < 3; ++round) {
    CG_LAUNCH(every_thread_takes_a_ticket, dim3(kBlocks), dim3(kThreads), 0, nullptr)(taken, kTaken - 1);
    CUDA_OK(cudaGetLastError());
    std::vector<unsigned> got(kTaken);
    CUDA_OK(cudaMemcpy(got.data(), taken, kTaken * sizeof(unsigned), cudaMemcpyDeviceToHost));
    std::vector<int> seen(kTaken, 0);
    int bad = 0;
    for (unsigned t : got) {
      if (t >= static_cast<unsigned>(kTaken)) ++bad; else ++seen[t];
    }
    int twice = 0;
    for (int s : seen) twice += s != 1;
    CHECK(bad == 0 && twice == 0, "round %d: %d tickets out of range, %d taken other than once", round, bad, twice);
  }
  CHECK(g_tickets == 0, "the counter is %u after whole rounds, not 0", g_tickets);

  // ---- the last block: one a launch, and it sees every block's partial sum ----
  std::vector<float> host(kBlocks * kThreads);
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>(i % 97);  // exact sums
  float expected = 0.0f;
  for (float v : host) expected += v;
  float *values, *partials, *total;
  int* lasts;
  CUDA_OK(cudaMalloc(&values, host.size() * sizeof(float)));
  CUDA_OK(cudaMalloc(&partials, kBlocks * sizeof(float)));
  CUDA_OK(cudaMalloc(&total, sizeof(float)));
  CUDA_OK(cudaMalloc(&lasts, sizeof(int)));
  CUDA_OK(cudaMemcpy(values, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
  for (int launch = 0; launch < 20; ++launch) {
    const float poison = -1.0f;
    const int zero = 0;
    CUDA_OK(cudaMemcpy(total, &poison, sizeof(float), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(lasts, &zero, sizeof(int), cudaMemcpyHostToDevice));
    CG_LAUNCH(last_block_sums, dim3(kBlocks), dim3(kThreads), 0, nullptr)(total, lasts, partials, values);
    CUDA_OK(cudaGetLastError());
    float got;
    int count;
    CUDA_OK(cudaMemcpy(&got, total, sizeof(float), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(&count, lasts, sizeof(int), cudaMemcpyDeviceToHost));
    CHECK(count == 1, "launch %d: %d last blocks", launch, count);
    CHECK(got == expected, "launch %d: the last block summed %g, not %g", launch, got, expected);
  }
  CHECK(g_last_block == 0, "the ticket counter is %u after the launches, not 0", g_last_block);
  FINISH("atomics");
}
