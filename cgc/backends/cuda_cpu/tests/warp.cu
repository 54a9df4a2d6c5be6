// Warp collectives: shuffles (all four kinds, with widths), votes, __syncwarp, partial warps
// and exited lanes, and the faults of misused collectives.
//   warp            the checks below
//   warp deadlock   lanes 0-15 at __syncwarp while 16-31 wait at __syncthreads: deadlock
//   warp mismatch   lanes of one mask at two different collectives: fault
#include "check.h"

#include <cstdint>
#include <vector>

// Butterfly sums: every lane gets the warp's total.
__global__ void butterfly(float* fsum, int* isum) {
  const int lane = threadIdx.x % 32;
  float f = 0.25f * (lane + 1) + threadIdx.x / 32;  // exact in float
  int i = lane * lane + 3;
  for (int offset = 16; offset > 0; offset >>= 1) {
    f += __shfl_xor_sync(0xffffffffu, f, offset);
    i += __shfl_xor_sync(0xffffffffu, i, offset);
  }
  fsum[threadIdx.x] = f;
  isum[threadIdx.x] = i;
}

struct ShuffleOut {
  int broadcast, rotate, segment, up, down, up16, down16, xor8;
};

__global__ void shuffles(ShuffleOut* out) {
  const int lane = threadIdx.x % 32;
  const int v = 1000 * (threadIdx.x / 32) + lane;
  ShuffleOut o;
  o.broadcast = __shfl_sync(0xffffffffu, v, 5);
  o.rotate = __shfl_sync(0xffffffffu, v, lane + 3);   // srcLane past 31 wraps (modulo width)
  o.segment = __shfl_sync(0xffffffffu, v, 2, 8);      // lane 2 of each group of 8
  o.up = __shfl_up_sync(0xffffffffu, v, 3);
  o.down = __shfl_down_sync(0xffffffffu, v, 3);
  o.up16 = __shfl_up_sync(0xffffffffu, v, 5, 16);
  o.down16 = __shfl_down_sync(0xffffffffu, v, 5, 16);
  o.xor8 = __shfl_xor_sync(0xffffffffu, v, 5, 8);
  out[threadIdx.x] = o;
}

__global__ void votes(unsigned* out) {
  const int lane = threadIdx.x % 32;
  out[threadIdx.x * 4 + 0] = __ballot_sync(0xffffffffu, lane % 3 == 0);
  out[threadIdx.x * 4 + 1] = __any_sync(0xffffffffu, lane == 31);
  out[threadIdx.x * 4 + 2] = __all_sync(0xffffffffu, lane < 32);
  out[threadIdx.x * 4 + 3] = __all_sync(0xffffffffu, lane != 7);
}

// Lanes exchange values through shared memory around __syncwarp (independent thread
// scheduling: without it a lane may read its neighbour's slot before the write).
__global__ void exchange(int* out, int rounds) {
  __shared__ int slots[64];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int value = threadIdx.x;
  for (int r = 0; r < rounds; ++r) {
    slots[warp * 32 + lane] = value;
    __syncwarp();
    value = slots[warp * 32 + (lane + 1) % 32];
    __syncwarp();
  }
  out[threadIdx.x] = value;
}

// Half-mask collectives, and lanes that have exited.
__global__ void partial(int* out) {
  const int lane = threadIdx.x % 32;
  if (lane >= 16) {
    out[threadIdx.x] = __shfl_xor_sync(0xffff0000u, lane, 1);  // its own half only
    return;
  }
  __syncwarp(0xffffffffu);  // lanes 16-31 have exited or will: they count as arrived
  const int a = __shfl_xor_sync(0xffffffffu, lane, 1);   // partner 0-15: defined
  const int b = __shfl_xor_sync(0xffffffffu, lane, 16);  // partner exited: undefined (all ones here)
  out[threadIdx.x] = a * 1000 + (b == -1 ? 999 : b);
}

// A block of 48 threads: its second warp has 16 lanes.
__global__ void short_warp(int* out) {
  const int lane = threadIdx.x % 32;
  int sum = lane;
  if (lane < 16)
    for (int offset = 8; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0x0000ffffu, sum, offset, 16);
  __syncwarp();  // full mask: the 16 lanes warp 1 lacks count as exited
  out[threadIdx.x] = sum;
}

__global__ void warp_deadlock(int* out) {
  if (threadIdx.x % 32 < 16) {
    __syncwarp();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1;
}

__global__ void mismatch(int* out) {
  int v = threadIdx.x;
  if (threadIdx.x % 2 == 0) {
    v = __shfl_xor_sync(0xffffffffu, v, 1);
  } else {
    v = __shfl_down_sync(0xffffffffu, v, 1);
  }
  out[threadIdx.x] = v;
}

#define RUN_FAULT(kernel, name, grid, block)                                                       \
  do {                                                                                             \
    int* out = nullptr;                                                                            \
    CUDA_OK(cudaMalloc(&out, 1024 * sizeof(int)));                                                 \
    CG_LAUNCH(kernel, grid, block, 0, nullptr)(out);                                               \
    const cudaError_t launch = cudaGetLastError();                                                 \
    CHECK(launch == cudaErrorLaunchFailure, "launch returned %s", cudaGetErrorName(launch));       \
    FINISH(name);                                                                                  \
  } while (0)

static int reference_up(const int* v, int lane, int delta, int width) {
  return lane % width >= delta ? v[lane - delta] : v[lane];
}
static int reference_down(const int* v, int lane, int delta, int width) {
  return lane % width + delta < width ? v[lane + delta] : v[lane];
}

int main(int argc, char** argv) {
  if (mode_is(argc, argv, "deadlock")) RUN_FAULT(warp_deadlock, "deadlock", dim3(1), dim3(64));
  if (mode_is(argc, argv, "mismatch")) RUN_FAULT(mismatch, "mismatch", dim3(1), dim3(32));

  const int n = 128;
  float* fsum = nullptr;
  int* isum = nullptr;
  CUDA_OK(cudaMalloc(&fsum, n * sizeof(float)));
  CUDA_OK(cudaMalloc(&isum, n * sizeof(int)));
  for (unsigned long long seed : {0ull, 7ull}) {
    cgcpu::set_schedule_seed(seed);
    CG_LAUNCH(butterfly, dim3(3), dim3(n), 0, nullptr)(fsum, isum);
    CUDA_OK(cudaGetLastError());
    std::vector<float> f(n);
    std::vector<int> i(n);
    CUDA_OK(cudaMemcpy(f.data(), fsum, n * sizeof(float), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(i.data(), isum, n * sizeof(int), cudaMemcpyDeviceToHost));
    for (int t = 0; t < n; ++t) {
      float fe = 0.0f;
      int ie = 0;
      for (int l = 0; l < 32; ++l) {
        fe += 0.25f * (l + 1) + t / 32;
        ie += l * l + 3;
      }
      CHECK(f[t] == fe, "seed %llu thread %d: float butterfly %g, expected %g", seed, t, f[t], fe);
      CHECK(i[t] == ie, "seed %llu thread %d: int butterfly %d, expected %d", seed, t, i[t], ie);
    }
  }
  cgcpu::set_schedule_seed(0);

  ShuffleOut* so = nullptr;
  CUDA_OK(cudaMalloc(&so, 64 * sizeof(ShuffleOut)));
  CG_LAUNCH(shuffles, dim3(1), dim3(64), 0, nullptr)(so);
  CUDA_OK(cudaGetLastError());
  std::vector<ShuffleOut> s(64);
  CUDA_OK(cudaMemcpy(s.data(), so, 64 * sizeof(ShuffleOut), cudaMemcpyDeviceToHost));
  for (int t = 0; t < 64; ++t) {
    const int warp = t / 32, lane = t % 32;
    int v[32];
    for (int l = 0; l < 32; ++l) v[l] = 1000 * warp + l;
    CHECK(s[t].broadcast == v[5], "thread %d: broadcast %d", t, s[t].broadcast);
    CHECK(s[t].rotate == v[(lane + 3) % 32], "thread %d: rotate %d", t, s[t].rotate);
    CHECK(s[t].segment == v[lane / 8 * 8 + 2], "thread %d: segment %d", t, s[t].segment);
    CHECK(s[t].up == reference_up(v, lane, 3, 32), "thread %d: up %d", t, s[t].up);
    CHECK(s[t].down == reference_down(v, lane, 3, 32), "thread %d: down %d", t, s[t].down);
    CHECK(s[t].up16 == reference_up(v, lane, 5, 16), "thread %d: up16 %d", t, s[t].up16);
    CHECK(s[t].down16 == reference_down(v, lane, 5, 16), "thread %d: down16 %d", t, s[t].down16);
    CHECK(s[t].xor8 == v[lane ^ 5], "thread %d: xor8 %d", t, s[t].xor8);
  }

  unsigned* vo = nullptr;
  CUDA_OK(cudaMalloc(&vo, 64 * 4 * sizeof(unsigned)));
  CG_LAUNCH(votes, dim3(1), dim3(64), 0, nullptr)(vo);
  CUDA_OK(cudaGetLastError());
  std::vector<unsigned> vv(64 * 4);
  CUDA_OK(cudaMemcpy(vv.data(), vo, vv.size() * sizeof(unsigned), cudaMemcpyDeviceToHost));
  unsigned ballot = 0;
  for (int l = 0; l < 32; l += 3) ballot |= 1u << l;
  for (int t = 0; t < 64; ++t) {
    CHECK(vv[t * 4] == ballot, "thread %d: ballot 0x%08x", t, vv[t * 4]);
    CHECK(vv[t * 4 + 1] == 1 && vv[t * 4 + 2] == 1 && vv[t * 4 + 3] == 0, "thread %d: votes %u %u %u", t,
          vv[t * 4 + 1], vv[t * 4 + 2], vv[t * 4 + 3]);
  }

  int* ex = nullptr;
  CUDA_OK(cudaMalloc(&ex, 64 * sizeof(int)));
  for (unsigned long long seed : {0ull, 3ull, 11ull}) {
    cgcpu::set_schedule_seed(seed);
    CG_LAUNCH(exchange, dim3(1), dim3(64), 0, nullptr)(ex, 5);
    CUDA_OK(cudaGetLastError());
    std::vector<int> e(64);
    CUDA_OK(cudaMemcpy(e.data(), ex, 64 * sizeof(int), cudaMemcpyDeviceToHost));
    for (int t = 0; t < 64; ++t)
      CHECK(e[t] == (t / 32) * 32 + (t % 32 + 5) % 32, "seed %llu thread %d: exchanged %d", seed, t, e[t]);
  }
  cgcpu::set_schedule_seed(0);

  CG_LAUNCH(partial, dim3(1), dim3(32), 0, nullptr)(ex);
  CUDA_OK(cudaGetLastError());
  std::vector<int> p(32);
  CUDA_OK(cudaMemcpy(p.data(), ex, 32 * sizeof(int), cudaMemcpyDeviceToHost));
  for (int l = 0; l < 32; ++l) {
    const int expected = l >= 16 ? (l ^ 1) : (l ^ 1) * 1000 + 999;
    CHECK(p[l] == expected, "lane %d: partial %d, expected %d", l, p[l], expected);
  }

  CG_LAUNCH(short_warp, dim3(1), dim3(48), 0, nullptr)(ex);
  CUDA_OK(cudaGetLastError());
  std::vector<int> w(48);
  CUDA_OK(cudaMemcpy(w.data(), ex, 48 * sizeof(int), cudaMemcpyDeviceToHost));
  for (int t = 0; t < 48; ++t) {
    const int lane = t % 32;
    const int expected = lane < 16 ? 120 : lane;  // lanes 16-31 are not in the mask
    CHECK(w[t] == expected, "thread %d: short warp sum %d", t, w[t]);
  }
  FINISH("warp");
}
