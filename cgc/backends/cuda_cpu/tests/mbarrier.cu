// The asynchronous-barrier twins (cgcpu/mbarrier.h) in the pattern Hopper kernels use them:
// a producer thread fills a two-stage ring of shared tiles by bulk copies, declaring their
// bytes on each stage's "full" barrier; two consumer warps wait for a stage, sum it, and arrive
// on its "empty" barrier, which the producer waits on before it refills the stage.
// tests/test_ptx_twins.py builds this plain and for racecheck and runs each mode:
//   pipeline    16 tiles through the ring (each stage's barriers through 8 phases); prints
//               "pipeline: ok" when every sum is right.
//   early-read  the consumers read a stage before they wait for it: racecheck reports the read
//               racing the bulk copy.
//   short-tx    the producer declares more bytes than it copies: the phase never completes, a
//               deadlock naming the barrier.
//   over-tx     it declares fewer: a fault, the bytes past what was expected.
//   unaligned   a bulk copy of 24 bytes: a fault.
//   no-init     a wait on a barrier never initialised: a fault.
#include "check.h"

#include <vector>

constexpr int kTile = 256;  // floats a tile (1 KiB)
constexpr int kTiles = 16;
constexpr int kStages = 2;
constexpr int kConsumers = 64;  // two warps

enum Mode { kPipeline, kEarlyRead, kShortTx, kOverTx, kUnaligned, kNoInit };

__global__ void ring(float* sums, const float* tiles, int mode) {
  __shared__ __align__(16) float stage[kStages][kTile];
  __shared__ __align__(8) unsigned long long full[kStages], empty[kStages];
  const int thread = threadIdx.x;
  if (thread == 0 && mode != kNoInit)
    for (int s = 0; s < kStages; ++s) {
      cg_mbarrier_init(&full[s], 1);
      cg_mbarrier_init(&empty[s], kConsumers);
    }
  __syncthreads();
  if (thread == kConsumers) {  // the producer: warp 2's first lane
    for (int t = 0; t < kTiles; ++t) {
      const int s = t % kStages;
      const unsigned round = t / kStages;
      cg_mbarrier_wait(&empty[s], (round & 1u) ^ 1u);  // the round before: at once the first time
      const unsigned bytes = kTile * sizeof(float);
      const unsigned declared = mode == kShortTx ? bytes + 16 : mode == kOverTx ? bytes - 16 : bytes;
      cg_mbarrier_arrive_expect_tx(&full[s], declared);
      cg_bulk_copy_to_shared(stage[s], tiles + t * kTile, mode == kUnaligned ? 24 : bytes, &full[s]);
    }
  } else if (thread < kConsumers) {
    for (int t = 0; t < kTiles; ++t) {
      const int s = t % kStages;
      const unsigned round = t / kStages;
      float early = 0.0f;
      if (mode == kEarlyRead) early = stage[s][thread];
      cg_mbarrier_wait(&full[s], round & 1u);
      float sum = early * 0.0f;
      for (int i = thread; i < kTile; i += kConsumers) sum += stage[s][i];
      sums[t * kConsumers + thread] = sum;
      cg_mbarrier_arrive(&empty[s]);
    }
  }
}

static int run(int mode, const char* name) {
  std::vector<float> host(kTiles * kTile);
  for (int i = 0; i < kTiles * kTile; ++i) host[i] = static_cast<float>((i * 7) % 13) - 6.0f;
  float *tiles = nullptr, *sums = nullptr;
  CUDA_OK(cudaMalloc(&tiles, host.size() * sizeof(float)));
  CUDA_OK(cudaMalloc(&sums, kTiles * kConsumers * sizeof(float)));
  CUDA_OK(cudaMemcpy(tiles, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(sums, 0, kTiles * kConsumers * sizeof(float)));
  CG_LAUNCH(ring, dim3(1), dim3(kConsumers + 32), 0, nullptr)(sums, tiles, mode);
  const cudaError_t status = cudaGetLastError();
  std::printf("%s: launch %s\n", name, cudaGetErrorName(status));
  if (mode != kPipeline && mode != kEarlyRead) return status == cudaSuccess ? 1 : 0;
  CHECK(status == cudaSuccess, "the launch");
  std::vector<float> got(kTiles * kConsumers);
  CUDA_OK(cudaMemcpy(got.data(), sums, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
  int wrong = 0;
  for (int t = 0; t < kTiles; ++t)
    for (int c = 0; c < kConsumers; ++c) {
      float expected = 0.0f;
      for (int i = c; i < kTile; i += kConsumers) expected += host[t * kTile + i];
      wrong += got[t * kConsumers + c] != expected;
    }
  CHECK(wrong == 0, "%d sums wrong", wrong);
  FINISH(name);
}

int main(int argc, char** argv) {
  const char* modes[] = {"pipeline", "early-read", "short-tx", "over-tx", "unaligned", "no-init"};
  for (int m = 0; m < 6; ++m)
    if (mode_is(argc, argv, modes[m])) return run(m, modes[m]);
  std::printf("usage: %s pipeline|early-read|short-tx|over-tx|unaligned|no-init\n", argv[0]);
  return 2;
}
