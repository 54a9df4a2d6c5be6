// Racecheck: built with -fsanitize=thread, each kernel here is either clean (no report may name
// it) or has one race on purpose (the report must name its kernel, the shared memory and both
// threads). tests/test_racecheck.py reads the "cuda_cpu racecheck:" lines the headers print.
//   clean_*  barriers, __syncwarp, block start and end, a WMMA tile loaded, multiplied and
//            stored back with no __syncwarp between (each element is touched by one lane), and
//            cp.async copies read by ldmatrix after the wait and a __syncthreads
//   racy_*   what each barrier prevents, with the barrier missing
// Without ThreadSanitizer the program runs the same kernels and checks nothing but the results
// of the clean ones.
#include "check.h"

#include <mma.h>

#include <vector>

using namespace nvcuda;

// Two threads write one shared word, no barrier between them (static shared memory).
__global__ void racy_two_writers(int* out) {
  __shared__ int word[4];
  if (threadIdx.x == 3 || threadIdx.x == 17) word[2] = threadIdx.x;
  __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = word[2];
}

// A write and a read of dynamic shared memory by two threads of one warp, no barrier between.
__global__ void racy_dynamic(int* out) {
  CG_DYNAMIC_SHARED(memory);
  int* words = reinterpret_cast<int*>(memory);
  if (threadIdx.x == 5) words[10] = 1;
  if (threadIdx.x == 9) out[blockIdx.x] = words[10];
}

// A shuffle does not order memory: lane 1 reads what lane 0 wrote, with only a shuffle between.
__global__ void racy_shuffle_is_not_a_barrier(int* out) {
  __shared__ int word;
  const int lane = threadIdx.x % 32;
  if (lane == 0) word = 7;
  const int v = __shfl_xor_sync(0xffffffffu, lane, 1);
  if (lane == 1) out[0] = word + v;
}

// A WMMA store is made by the lanes of the warp: a lane reading the tile needs a __syncwarp.
__global__ void racy_wmma_store_then_read(float* out, const __nv_bfloat16* a) {
  __shared__ __align__(32) float tile[16 * 16];
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::fill_fragment(acc, 0.0f);
  wmma::load_matrix_sync(fa, a, 16);
  wmma::load_matrix_sync(fb, a, 16);
  wmma::mma_sync(acc, fa, fb, acc);
  wmma::store_matrix_sync(tile, acc, 16, wmma::mem_row_major);
  out[threadIdx.x] = tile[threadIdx.x * 8 + 1];
}

// A cp.async copy is its issuing thread's write, made at the wait: another thread reading the
// destination after that wait but with no barrier between races with it.
__global__ void racy_cp_async_without_barrier(int* out, const int* from) {
  __shared__ __align__(16) int words[64 * 4];
  cg_cp_async_16(words + threadIdx.x * 4, from + threadIdx.x * 4);
  cg_cp_async_commit();
  cg_cp_async_wait<0>();
  out[threadIdx.x] = words[((threadIdx.x + 32) % 64) * 4];  // another warp's copy
}

// ldmatrix reads the row whose address a lane gives (ptx.h): lane 3 reads row 3, where lane 7
// wrote one element after the __syncwarp: a race.
__global__ void racy_ldmatrix_without_syncwarp(unsigned* out) {
  // (__nv_bfloat16 has a constructor: a static __shared__ array of it would get a thread_local
  // initialisation guard, which the emulator's threads share; the kernels use raw storage.)
  __shared__ __align__(16) unsigned short raw[16 * 16];
  __nv_bfloat16* tile = reinterpret_cast<__nv_bfloat16*>(raw);
  const int lane = threadIdx.x;
  for (int i = lane; i < 256; i += 32) tile[i] = __float2bfloat16_rn(static_cast<float>(i));
  __syncwarp();
  if (lane == 7) tile[3 * 16 + 2] = __float2bfloat16_rn(-1.0f);
  unsigned r[4];
  cg_ldmatrix_x4(r, tile + (lane % 16) * 16 + (lane / 16) * 8);
  out[lane] = r[0];
}

// The attention kernels' pattern: cp.async, wait, __syncthreads, then ldmatrix of rows other
// threads copied: clean.
__global__ void clean_cp_async_then_ldmatrix(unsigned* out, const __nv_bfloat16* from) {
  __shared__ __align__(16) unsigned short raw[2 * 16 * 16];
  __nv_bfloat16* tile = reinterpret_cast<__nv_bfloat16*>(raw);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  cg_cp_async_16(tile + threadIdx.x * 8, from + threadIdx.x * 8);  // 64 x 16 bytes
  cg_cp_async_commit();
  cg_cp_async_wait<0>();
  __syncthreads();
  unsigned r[4];
  cg_ldmatrix_x4(r, tile + (1 - warp) * 256 + (lane % 16) * 16 + (lane / 16) * 8);
  for (int i = 0; i < 4; ++i) out[threadIdx.x * 4 + i] = r[i];
}

// Static shared memory reused by every block on a worker, with barriers: clean, on 2 workers.
__global__ void clean_block_sum(float* sums, const float* values) {
  __shared__ float slots[128];
  slots[threadIdx.x] = values[blockIdx.x * 128 + threadIdx.x];
  __syncthreads();
  for (int stride = 64; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) slots[threadIdx.x] += slots[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 127) sums[blockIdx.x] = slots[0];
}

// A warp exchange through shared memory with __syncwarp, and a block barrier with the count.
__global__ void clean_exchange(int* out) {
  __shared__ int words[64];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  words[threadIdx.x] = threadIdx.x;
  __syncwarp();
  int v = words[warp * 32 + (lane + 1) % 32];
  __syncwarp();
  words[threadIdx.x] = v + 1;
  const int count = __syncthreads_count(v > 0);
  out[blockIdx.x * 64 + threadIdx.x] = words[(threadIdx.x + 32) % 64] + count;
}

// Load, multiply and store back one shared tile per warp with no __syncwarp between the load and
// the store (the warp_mma pattern of the attention kernels), then __syncwarp before lanes read.
__global__ void clean_wmma_accumulate(float* out, const __nv_bfloat16* a) {
  __shared__ __align__(32) float tiles[2][16 * 16];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = lane; i < 256; i += 32) tiles[warp][i] = 1.0f;
  __syncwarp();
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  for (int k = 0; k < 2; ++k) {
    wmma::load_matrix_sync(acc, tiles[warp], 16, wmma::mem_row_major);
    wmma::load_matrix_sync(fa, a, 16);
    wmma::load_matrix_sync(fb, a, 16);
    wmma::mma_sync(acc, fa, fb, acc);
    wmma::store_matrix_sync(tiles[warp], acc, 16, wmma::mem_row_major);
  }
  __syncwarp();
  for (int i = lane; i < 256; i += 32) out[(blockIdx.x * 2 + warp) * 256 + i] = tiles[warp][i];
}

int main() {
  int* ints = nullptr;
  float *floats = nullptr, *values = nullptr;
  __nv_bfloat16* a = nullptr;
  CUDA_OK(cudaMalloc(&ints, 1024 * sizeof(int)));
  CUDA_OK(cudaMalloc(&floats, 1024 * sizeof(float)));
  CUDA_OK(cudaMalloc(&values, 64 * 128 * sizeof(float)));
  CUDA_OK(cudaMalloc(&a, 256 * sizeof(__nv_bfloat16)));
  std::vector<float> host(64 * 128);
  for (int i = 0; i < 64 * 128; ++i) host[i] = static_cast<float>(i % 10);
  CUDA_OK(cudaMemcpy(values, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
  std::vector<__nv_bfloat16> ones(256, __nv_bfloat16(0.0f));
  for (int i = 0; i < 16; ++i) ones[i * 16 + i] = __nv_bfloat16(1.0f);  // the identity
  CUDA_OK(cudaMemcpy(a, ones.data(), ones.size() * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));

  CG_LAUNCH(racy_two_writers, dim3(1), dim3(32), 0, nullptr)(ints);
  CG_LAUNCH(racy_dynamic, dim3(1), dim3(32), 64, nullptr)(ints);
  CG_LAUNCH(racy_shuffle_is_not_a_barrier, dim3(1), dim3(32), 0, nullptr)(ints);
  CG_LAUNCH(racy_wmma_store_then_read, dim3(1), dim3(32), 0, nullptr)(floats, a);
  CG_LAUNCH(racy_cp_async_without_barrier, dim3(1), dim3(64), 0, nullptr)(ints, ints + 512);
  CG_LAUNCH(racy_ldmatrix_without_syncwarp, dim3(1), dim3(32), 0, nullptr)(reinterpret_cast<unsigned*>(ints));
  CUDA_OK(cudaGetLastError());

  CG_LAUNCH(clean_block_sum, dim3(64), dim3(128), 0, nullptr)(floats, values);
  CUDA_OK(cudaGetLastError());
  std::vector<float> sums(64);
  CUDA_OK(cudaMemcpy(sums.data(), floats, 64 * sizeof(float), cudaMemcpyDeviceToHost));
  for (int b = 0; b < 64; ++b) {
    float expected = 0.0f;
    for (int i = 0; i < 128; ++i) expected += host[b * 128 + i];
    CHECK(sums[b] == expected, "block %d: %g, expected %g", b, sums[b], expected);
  }
  CG_LAUNCH(clean_exchange, dim3(8), dim3(64), 0, nullptr)(ints);
  CUDA_OK(cudaGetLastError());
  std::vector<int> exchanged(8 * 64);
  CUDA_OK(cudaMemcpy(exchanged.data(), ints, 8 * 64 * sizeof(int), cudaMemcpyDeviceToHost));
  for (int i = 0; i < 8 * 64; ++i) {
    const int other = (i % 64 + 32) % 64;
    const int expected = (other / 32) * 32 + (other % 32 + 1) % 32 + 1 + 63;
    CHECK(exchanged[i] == expected, "block %d thread %d: %d, expected %d", i / 64, i % 64, exchanged[i], expected);
  }
  CG_LAUNCH(clean_wmma_accumulate, dim3(2), dim3(64), 0, nullptr)(floats, a);
  CUDA_OK(cudaGetLastError());
  std::vector<float> tiles(1024);
  CUDA_OK(cudaMemcpy(tiles.data(), floats, 1024 * sizeof(float), cudaMemcpyDeviceToHost));
  for (int i = 0; i < 1024; ++i) {
    const int r = i % 256 / 16, c = i % 16;
    const float expected = 1.0f + (r == c ? 2.0f : 0.0f);  // twice: 1 + I I^T + I I^T
    CHECK(tiles[i] == expected, "element %d: %g, expected %g", i, tiles[i], expected);
  }
  std::vector<__nv_bfloat16> counting(512);
  for (int i = 0; i < 512; ++i) counting[i] = __float2bfloat16_rn(static_cast<float>(i % 256));
  __nv_bfloat16* source = nullptr;
  CUDA_OK(cudaMalloc(&source, 512 * sizeof(__nv_bfloat16)));
  CUDA_OK(cudaMemcpy(source, counting.data(), 512 * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
  CG_LAUNCH(clean_cp_async_then_ldmatrix, dim3(1), dim3(64), 0, nullptr)(reinterpret_cast<unsigned*>(ints), source);
  CUDA_OK(cudaGetLastError());
  std::vector<unsigned> registers(256);
  CUDA_OK(cudaMemcpy(registers.data(), ints, 256 * sizeof(unsigned), cudaMemcpyDeviceToHost));
  for (int thread = 0; thread < 64; ++thread) {  // warp w read tile 1 - w: element (r, c) = r * 16 + c
    const int lane = thread % 32, g = lane / 4, t = lane % 4;
    const unsigned low = registers[thread * 4] & 0xFFFFu;  // register 0: (g, 2t) of rows 0-7
    CHECK(__bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(&low)) == static_cast<float>(g * 16 + 2 * t),
          "thread %d: ldmatrix after cp.async read %u", thread, low);
  }
  FINISH("racecheck");
}
