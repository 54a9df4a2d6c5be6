// The warpgroup-product and tensor-copy twins (cgcpu/wgmma.h, cgcpu/tensor_map.h), driven by
// tests/test_wgmma_twins.py:
//   product CASE OUT   one wgmma.mma_async m64nNk16 on a case the test wrote: the shared image
//                      (laid out in Python from the PTX ISA's canonical layouts), the two
//                      descriptors' fields, each thread's A registers (.rs) and accumulators;
//                      writes each thread's accumulators after the wait, and before it.
//   pipeline           an attention-shaped ring: a producer thread loads 64 x 64 bfloat16 tiles
//                      of K by TMA (128-byte swizzle, the last tile partly past the tensor: zero
//                      filled) into two stages, the consumer warpgroup multiplies a Q tile (TMA
//                      too) by each, four k16 products a tile (the descriptor advanced 32 bytes
//                      along the swizzled row), and frees the stage after its wait; S = Q K^T is
//                      checked against the exact product; prints "pipeline: ok".
//   release-early      the same, but the consumers free each stage before their wait: racecheck
//                      reports the product's reads racing the next tile's copy.
//   groups             two commit groups on one accumulator: wait_group 1 completes the first
//                      only, wait_group 0 the second.
//   swizzles           a box with rows above the tensor (zero filled) by TMA with each swizzle
//                      (32, 64, 128 bytes), multiplied by itself through descriptors of the same
//                      swizzle: the exact X X^T.
//   nan-fill           the NaN fill: the rows above the tensor are NaN, the others the data.
//   static-tile, lanes-differ, base-offset, off-repeat, written-accumulator, tma-overflow,
//   exit-pending, partial-warpgroup
//                      faults: a descriptor of a static __shared__ tile; one lane giving another
//                      descriptor; a matrix base offset (not modelled); a 128-byte-swizzled tile
//                      off its 1024-byte repeat; accumulators written between issue and wait; a
//                      box ending past dynamic shared memory; threads exiting with a product
//                      pending; a product in a block of 96 threads.
//   bad-map            cuTensorMapEncodeTiled's refusals (CUDA_ERROR_INVALID_VALUE), checked.
#include "check.h"

#include <cuda.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <vector>

// cuTensorMapEncodeTiled: the twin's here; on a GPU the driver's, through the runtime, so that
// the program does not link libcuda (scripts/hopper_twins_on_gpu.py builds it with nvcc).
static decltype(&cuTensorMapEncodeTiled) encode_tiled() {
#ifdef CG_PTX_TWINS
  return &cuTensorMapEncodeTiled;
#else
  static void* function = nullptr;
  if (function == nullptr) {
    cudaDriverEntryPointQueryResult found;
    CUDA_OK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault, &found));
    CHECK(found == cudaDriverEntryPointSuccess && function != nullptr, "the driver's cuTensorMapEncodeTiled");
  }
  return reinterpret_cast<decltype(&cuTensorMapEncodeTiled)>(function);
#endif
}

struct Case {
  std::int32_t n, a_in_registers, transpose_a, transpose_b, scale_d, shared_bytes;
  std::int32_t a_offset, a_leading, a_stride, a_swizzle;
  std::int32_t b_offset, b_leading, b_stride, b_swizzle;
};

// The first byte of `memory` on a 1024-byte boundary of the shared address space (the 128-byte
// swizzle's repeat): dynamic shared memory need not start on one. 1024 bytes more are asked.
__device__ unsigned char* aligned_1024(unsigned char* memory) {
  return memory + (1024 - cg_shared_address(memory) % 1024) % 1024;
}

template <int N>
__global__ void product(float* out, float* before, const unsigned char* image, const unsigned* a_registers,
                        const float* c, Case k) {
  CG_DYNAMIC_SHARED(dynamic);
  unsigned char* memory = aligned_1024(dynamic);  // the case's shared address 0
  for (int i = threadIdx.x; i < k.shared_bytes; i += blockDim.x) memory[i] = image[i];
  __syncthreads();
  const int thread = threadIdx.x;
  float d[N / 2];
  for (int i = 0; i < N / 2; ++i) d[i] = c[thread * (N / 2) + i];
  unsigned a[4];
  for (int i = 0; i < 4; ++i) a[i] = a_registers[thread * 4 + i];
  const unsigned long long b = cg_wgmma_descriptor(memory + k.b_offset, k.b_leading, k.b_stride, k.b_swizzle);
  cg_fence_proxy_async();
  cg_wgmma_fence();
  if (k.a_in_registers) {
    if (k.transpose_b) cg_wgmma_bf16_rs<N, 1>(d, a, b, k.scale_d);
    else cg_wgmma_bf16_rs<N, 0>(d, a, b, k.scale_d);
  } else {
    const unsigned long long ad = cg_wgmma_descriptor(memory + k.a_offset, k.a_leading, k.a_stride, k.a_swizzle);
    if (k.transpose_a && k.transpose_b) cg_wgmma_bf16_ss<N, 1, 1>(d, ad, b, k.scale_d);
    else if (k.transpose_a) cg_wgmma_bf16_ss<N, 1, 0>(d, ad, b, k.scale_d);
    else if (k.transpose_b) cg_wgmma_bf16_ss<N, 0, 1>(d, ad, b, k.scale_d);
    else cg_wgmma_bf16_ss<N, 0, 0>(d, ad, b, k.scale_d);
  }
  cg_wgmma_commit();
  for (int i = 0; i < N / 2; ++i) before[thread * (N / 2) + i] = d[i];  // before the wait: undefined on a GPU
  cg_wgmma_wait<0>();
  cg_wgmma_fence_operand(d);
  for (int i = 0; i < N / 2; ++i) out[thread * (N / 2) + i] = d[i];
}

template <int N>
static int run_product(const Case& k, const std::vector<unsigned char>& image, const std::vector<unsigned>& a,
                       const std::vector<float>& c, const char* out_path) {
  unsigned char* image_d = nullptr;
  unsigned* a_d = nullptr;
  float *c_d = nullptr, *out_d = nullptr, *before_d = nullptr;
  CUDA_OK(cudaMalloc(&image_d, image.size()));
  CUDA_OK(cudaMalloc(&a_d, a.size() * 4));
  CUDA_OK(cudaMalloc(&c_d, c.size() * 4));
  CUDA_OK(cudaMalloc(&out_d, c.size() * 4));
  CUDA_OK(cudaMalloc(&before_d, c.size() * 4));
  CUDA_OK(cudaMemcpy(image_d, image.data(), image.size(), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(a_d, a.data(), a.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(c_d, c.data(), c.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaFuncSetAttribute(product<N>, cudaFuncAttributeMaxDynamicSharedMemorySize, k.shared_bytes + 1024));
  CG_LAUNCH(product<N>, dim3(1), dim3(128), k.shared_bytes + 1024, nullptr)(out_d, before_d, image_d, a_d, c_d, k);
  CUDA_OK(cudaGetLastError());
  std::vector<float> out(c.size()), before(c.size());
  CUDA_OK(cudaMemcpy(out.data(), out_d, out.size() * 4, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(before.data(), before_d, before.size() * 4, cudaMemcpyDeviceToHost));
  std::ofstream file(out_path, std::ios::binary);
  file.write(reinterpret_cast<const char*>(out.data()), out.size() * 4);
  file.write(reinterpret_cast<const char*>(before.data()), before.size() * 4);
  CHECK(file.good(), "writing %s", out_path);
  FINISH("product");
}

static int product_case(const char* in_path, const char* out_path) {
  std::ifstream file(in_path, std::ios::binary);
  Case k;
  file.read(reinterpret_cast<char*>(&k), sizeof k);
  std::vector<unsigned char> image(k.shared_bytes);
  std::vector<unsigned> a(128 * 4);
  std::vector<float> c(128 * (k.n / 2));
  file.read(reinterpret_cast<char*>(image.data()), image.size());
  file.read(reinterpret_cast<char*>(a.data()), a.size() * 4);
  file.read(reinterpret_cast<char*>(c.data()), c.size() * 4);
  CHECK(file.good(), "reading %s", in_path);
  switch (k.n) {
    case 64: return run_product<64>(k, image, a, c, out_path);
#ifdef CG_PTX_TWINS  // the GPU versions are written for N = 64 only
    case 8: return run_product<8>(k, image, a, c, out_path);
    case 16: return run_product<16>(k, image, a, c, out_path);
    case 256: return run_product<256>(k, image, a, c, out_path);
#endif
    default: std::printf("N %d not built\n", k.n); return 2;
  }
}

// ---- the attention-shaped ring ---------------------------------------------------------------
constexpr int kTile = 64, kKeys = 8 * kTile - 24;  // the last key tile: 40 rows, 24 zero-filled
constexpr int kKeyTiles = (kKeys + kTile - 1) / kTile, kStages = 2;
constexpr unsigned kTileBytes = kTile * kTile * 2;

enum RingMode { kRingRight, kRingReleaseEarly };

__global__ void __launch_bounds__(160) ring(float* scores, const __grid_constant__ CUtensorMap q_map,
                                            const __grid_constant__ CUtensorMap k_map, int mode) {
  CG_DYNAMIC_SHARED(dynamic);
  unsigned char* q = aligned_1024(dynamic);        // 64 x 64, 128-byte swizzle, 8 KiB
  unsigned char* stage = q + kTileBytes;           // kStages tiles of K
  __shared__ __align__(8) unsigned long long q_full, full[kStages], empty[kStages];
  const int thread = threadIdx.x;
  if (thread == 0) {
    cg_mbarrier_init(&q_full, 1);
    for (int s = 0; s < kStages; ++s) cg_mbarrier_init(&full[s], 1), cg_mbarrier_init(&empty[s], 128);
  }
  __syncthreads();
  if (thread == 128) {  // the producer: warp 4's first lane
    cg_mbarrier_arrive_expect_tx(&q_full, kTileBytes);
    cg_tma_load_2d(q, &q_map, 0, 0, &q_full);
    for (int t = 0; t < kKeyTiles; ++t) {
      const int s = t % kStages;
      cg_mbarrier_wait(&empty[s], ((t / kStages) & 1u) ^ 1u);
      cg_mbarrier_arrive_expect_tx(&full[s], kTileBytes);
      cg_tma_load_2d(stage + s * kTileBytes, &k_map, 0, t * kTile, &full[s]);
    }
  } else if (thread < 128) {  // the consumer warpgroup
    cg_mbarrier_wait(&q_full, 0);
    const int warp = thread / 32, lane = thread % 32;
    for (int t = 0; t < kKeyTiles; ++t) {
      const int s = t % kStages;
      cg_mbarrier_wait(&full[s], (t / kStages) & 1u);
      float d[32];
      cg_wgmma_fence();
      for (int k = 0; k < kTile / 16; ++k)  // 32 bytes along the swizzled 128-byte rows
        cg_wgmma_bf16_ss<64, 0, 0>(d, cg_wgmma_descriptor(q + 32 * k, 16, 1024, 1),
                                   cg_wgmma_descriptor(stage + s * kTileBytes + 32 * k, 16, 1024, 1), k > 0);
      cg_wgmma_commit();
      if (mode == kRingReleaseEarly) cg_mbarrier_arrive(&empty[s]);
      cg_wgmma_wait<0>();
      cg_wgmma_fence_operand(d);
      if (mode == kRingRight) cg_mbarrier_arrive(&empty[s]);
      for (int i = 0; i < 32; ++i) {
        const int row = 16 * warp + lane / 4 + 8 * ((i / 2) % 2), column = 8 * (i / 4) + 2 * (lane % 4) + i % 2;
        scores[row * (kKeyTiles * kTile) + t * kTile + column] = d[i];
      }
    }
  }
}

static std::uint16_t to_bf16(float f) {  // exact for the small integers used here
  std::uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<std::uint16_t>(bits >> 16);
}

static CUtensorMap tile_map(void* address, cuuint64_t rows) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {kTile, rows}, strides[1] = {kTile * 2};
  const cuuint32_t box[2] = {kTile, kTile}, unit[2] = {1, 1};
  const CUresult made = encode_tiled()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, address, dims, strides, box,
                                               unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                               CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  CHECK(made == CUDA_SUCCESS, "cuTensorMapEncodeTiled: %d", made);
  return map;
}

static int run_ring(int mode, const char* name) {
  std::vector<float> qf(kTile * kTile), kf(kKeys * kTile);
  for (int i = 0; i < kTile * kTile; ++i) qf[i] = static_cast<float>((i * 7 + i / 64) % 9) - 4.0f;
  for (int i = 0; i < kKeys * kTile; ++i) kf[i] = static_cast<float>((i * 5 + i / 64 * 3) % 7) - 3.0f;
  std::vector<std::uint16_t> qb(qf.size()), kb(kf.size());
  for (std::size_t i = 0; i < qf.size(); ++i) qb[i] = to_bf16(qf[i]);
  for (std::size_t i = 0; i < kf.size(); ++i) kb[i] = to_bf16(kf[i]);
  void *q_d = nullptr, *k_d = nullptr;
  float* s_d = nullptr;
  const std::size_t s_count = static_cast<std::size_t>(kTile) * kKeyTiles * kTile;
  CUDA_OK(cudaMalloc(&q_d, qb.size() * 2));
  CUDA_OK(cudaMalloc(&k_d, kb.size() * 2));
  CUDA_OK(cudaMalloc(&s_d, s_count * 4));
  CUDA_OK(cudaMemcpy(q_d, qb.data(), qb.size() * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(k_d, kb.data(), kb.size() * 2, cudaMemcpyHostToDevice));
  const CUtensorMap q_map = tile_map(q_d, kTile), k_map = tile_map(k_d, kKeys);
  const int shared = static_cast<int>((1 + kStages) * kTileBytes) + 1024;
  CUDA_OK(cudaFuncSetAttribute(ring, cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
  CG_LAUNCH(ring, dim3(1), dim3(160), shared, nullptr)(s_d, q_map, k_map, mode);
  const cudaError_t status = cudaGetLastError();
  std::printf("%s: launch %s\n", name, cudaGetErrorName(status));
  CHECK(status == cudaSuccess, "the launch");
  std::vector<float> s(s_count);
  CUDA_OK(cudaMemcpy(s.data(), s_d, s_count * 4, cudaMemcpyDeviceToHost));
  int wrong = 0;
  for (int i = 0; i < kTile; ++i)
    for (int j = 0; j < kKeyTiles * kTile; ++j) {
      float expected = 0.0f;
      if (j < kKeys)
        for (int c = 0; c < kTile; ++c) expected += qf[i * kTile + c] * kf[j * kTile + c];
      wrong += s[static_cast<std::size_t>(i) * kKeyTiles * kTile + j] != expected;
    }
  CHECK(wrong == 0, "%d scores wrong", wrong);
  FINISH(name);
}

// ---- commit groups ---------------------------------------------------------------------------
// A = B = ones (64 x 16, K-major, no swizzle: each row's 16 elements in two core matrices), so
// one product is 16 everywhere.
__global__ void groups(float* out) {
  CG_DYNAMIC_SHARED(dynamic);
  unsigned char* memory = dynamic;
  __nv_bfloat16* ones = reinterpret_cast<__nv_bfloat16*>(memory);
  for (int i = threadIdx.x; i < 64 * 16; i += blockDim.x) ones[i] = __float2bfloat16(1.0f);
  __syncthreads();
  const unsigned long long tile = cg_wgmma_descriptor(memory, 128, 256, 0);  // LBO: the k half; SBO: 8 rows
  float d[32];
  cg_fence_proxy_async();
  cg_wgmma_fence();
  cg_wgmma_bf16_ss<64, 0, 0>(d, tile, tile, 0);  // group 0: d = 16
  cg_wgmma_commit();
  cg_wgmma_bf16_ss<64, 0, 0>(d, tile, tile, 1);  // group 1: d += 16, on the same accumulators
  cg_wgmma_commit();
  cg_wgmma_wait<1>();
  out[threadIdx.x] = d[0];  // group 0's result
  cg_wgmma_wait<0>();
  cg_wgmma_fence_operand(d);
  out[128 + threadIdx.x] = d[31];
}

static int run_groups() {
  float* out = nullptr;
  CUDA_OK(cudaMalloc(&out, 256 * sizeof(float)));
  CG_LAUNCH(groups, dim3(1), dim3(128), 4096, nullptr)(out);
  CUDA_OK(cudaGetLastError());
  std::vector<float> got(256);
  CUDA_OK(cudaMemcpy(got.data(), out, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
  int wrong = 0;
  for (int i = 0; i < 128; ++i) wrong += got[i] != 16.0f || got[128 + i] != 32.0f;
  CHECK(wrong == 0, "%d threads wrong: thread 0 saw %g after wait_group 1, %g after wait_group 0", wrong, got[0],
        got[128]);
  FINISH("groups");
}

// ---- every swizzle through TMA and wgmma -----------------------------------------------------
constexpr int kSwizzleRows = 56;  // the tensor's rows; the box starts 8 above them

template <int Columns>  // bfloat16 columns: 16, 32, 64 for the 32, 64, 128-byte swizzle
__global__ void swizzled_square(float* out, const __grid_constant__ CUtensorMap map, unsigned code) {
  CG_DYNAMIC_SHARED(dynamic);
  unsigned char* tile = aligned_1024(dynamic);
  __shared__ __align__(8) unsigned long long full;
  if (threadIdx.x == 0) {
    cg_mbarrier_init(&full, 1);
    cg_mbarrier_arrive_expect_tx(&full, 64 * Columns * 2);
    cg_tma_load_2d(tile, &map, 0, -8, &full);
  }
  __syncthreads();
  cg_mbarrier_wait(&full, 0);
  float d[32];
  cg_wgmma_fence();
  for (int k = 0; k < Columns / 16; ++k) {  // 32 bytes along the swizzled rows
    const unsigned long long x = cg_wgmma_descriptor(tile + 32 * k, 16, 8 * Columns * 2, code);
    cg_wgmma_bf16_ss<64, 0, 0>(d, x, x, k > 0);
  }
  cg_wgmma_commit();
  cg_wgmma_wait<0>();
  cg_wgmma_fence_operand(d);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = 0; i < 32; ++i)
    out[(16 * warp + lane / 4 + 8 * ((i / 2) % 2)) * 64 + 8 * (i / 4) + 2 * (lane % 4) + i % 2] = d[i];
}

static std::uint16_t to_bf16(float f);

template <int Columns>
static void check_swizzle(CUtensorMapSwizzle swizzle, unsigned code) {
  std::vector<float> x(kSwizzleRows * Columns);
  std::vector<std::uint16_t> bits(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    x[i] = static_cast<float>((i * 11 + i / Columns * 5) % 9) - 4.0f;
    bits[i] = to_bf16(x[i]);
  }
  void* global = nullptr;
  float* out = nullptr;
  CUDA_OK(cudaMalloc(&global, bits.size() * 2));
  CUDA_OK(cudaMalloc(&out, 64 * 64 * sizeof(float)));
  CUDA_OK(cudaMemcpy(global, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice));
  CUtensorMap map;
  const cuuint64_t dims[2] = {Columns, kSwizzleRows}, strides[1] = {Columns * 2};
  const cuuint32_t box[2] = {Columns, 64}, unit[2] = {1, 1};
  CHECK(encode_tiled()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, global, dims, strides, box, unit,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS, "the map");
  const int shared = 64 * Columns * 2 + 1024;
  CUDA_OK(cudaFuncSetAttribute(swizzled_square<Columns>, cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
  CG_LAUNCH(swizzled_square<Columns>, dim3(1), dim3(128), shared, nullptr)(out, map, code);
  CUDA_OK(cudaGetLastError());
  std::vector<float> got(64 * 64);
  CUDA_OK(cudaMemcpy(got.data(), out, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
  auto row = [&](int r, int c) { return r >= 8 && r - 8 < kSwizzleRows ? x[(r - 8) * Columns + c] : 0.0f; };
  int wrong = 0;
  for (int i = 0; i < 64; ++i)
    for (int j = 0; j < 64; ++j) {
      float expected = 0.0f;
      for (int c = 0; c < Columns; ++c) expected += row(i, c) * row(j, c);
      wrong += got[i * 64 + j] != expected;
    }
  CHECK(wrong == 0, "swizzle of %d bytes: %d of X X^T wrong", Columns * 2, wrong);
}

static int run_swizzles() {
  check_swizzle<16>(CU_TENSOR_MAP_SWIZZLE_32B, 3);
  check_swizzle<32>(CU_TENSOR_MAP_SWIZZLE_64B, 2);
  check_swizzle<64>(CU_TENSOR_MAP_SWIZZLE_128B, 1);
  FINISH("swizzles");
}

// ---- the NaN fill ----------------------------------------------------------------------------
__global__ void nan_fill(unsigned* counts, const __grid_constant__ CUtensorMap map) {
  CG_DYNAMIC_SHARED(dynamic);
  unsigned char* tile = aligned_1024(dynamic);
  __shared__ __align__(8) unsigned long long full;
  if (threadIdx.x == 0) {
    cg_mbarrier_init(&full, 1);
    cg_mbarrier_arrive_expect_tx(&full, 64 * 64 * 2);
    cg_tma_load_2d(tile, &map, 0, -8, &full);
    cg_mbarrier_wait(&full, 0);
    const std::uint16_t* element = reinterpret_cast<const std::uint16_t*>(tile);
    for (int i = 0; i < 64 * 64; ++i) {  // the first 8 rows (1024 bytes, whatever the swizzle) are NaN
      const bool nan = element[i] == 0x7FFF;
      counts[i < 8 * 64 ? 0 : 1] += nan;
    }
  }
}

static int run_nan_fill() {
  std::vector<std::uint16_t> bits(56 * 64);
  for (std::size_t i = 0; i < bits.size(); ++i) bits[i] = to_bf16(static_cast<float>(i % 13));
  void* global = nullptr;
  unsigned* counts = nullptr;
  CUDA_OK(cudaMalloc(&global, bits.size() * 2));
  CUDA_OK(cudaMalloc(&counts, 2 * sizeof(unsigned)));
  CUDA_OK(cudaMemset(counts, 0, 2 * sizeof(unsigned)));
  CUDA_OK(cudaMemcpy(global, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice));
  CUtensorMap map;
  const cuuint64_t dims[2] = {64, 56}, strides[1] = {128};
  const cuuint32_t box[2] = {64, 64}, unit[2] = {1, 1};
  CHECK(encode_tiled()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, global, dims, strides, box, unit,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                               CU_TENSOR_MAP_L2_PROMOTION_NONE,
                               CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA) == CUDA_SUCCESS, "the map");
  CUDA_OK(cudaFuncSetAttribute(nan_fill, cudaFuncAttributeMaxDynamicSharedMemorySize, 8192 + 1024));
  CG_LAUNCH(nan_fill, dim3(1), dim3(32), 8192 + 1024, nullptr)(counts, map);
  CUDA_OK(cudaGetLastError());
  unsigned got[2];
  CUDA_OK(cudaMemcpy(got, counts, sizeof got, cudaMemcpyDeviceToHost));
  CHECK(got[0] == 8 * 64 && got[1] == 0, "%u NaN in the rows above the tensor (of 512), %u in its rows", got[0],
        got[1]);
  FINISH("nan-fill");
}

// ---- faults ----------------------------------------------------------------------------------
enum FaultMode {
  kStaticTile, kLanesDiffer, kBaseOffset, kOffRepeat, kWrittenAccumulator, kTmaOverflow, kExitPending,
  kPartialWarpgroup
};

__global__ void fault(int mode, const __grid_constant__ CUtensorMap map) {
  CG_DYNAMIC_SHARED(dynamic);
  unsigned char* tile = aligned_1024(dynamic);
  __shared__ __align__(1024) unsigned char fixed[2048];
  __shared__ __align__(8) unsigned long long full;
  if (mode == kTmaOverflow && threadIdx.x == 0) {  // 8 KiB at 8 KiB before the end of 12 KiB + 1024
    cg_mbarrier_init(&full, 1);
    cg_mbarrier_arrive_expect_tx(&full, 8192);
    cg_tma_load_2d(tile + 8192, &map, 0, 0, &full);
  }
  float d[32] = {};
  unsigned long long a = cg_wgmma_descriptor(tile, 16, 1024, 1), b = a;
  if (mode == kStaticTile) b = cg_wgmma_descriptor(fixed, 16, 1024, 1);
  if (mode == kLanesDiffer && threadIdx.x == 37) b += 2;  // 32 bytes further on
  if (mode == kBaseOffset) b |= 1ull << 49;
  if (mode == kOffRepeat) b = cg_wgmma_descriptor(tile + 128, 16, 1024, 1);
  cg_wgmma_fence();
  cg_wgmma_bf16_ss<64, 0, 0>(d, a, b, 0);
  cg_wgmma_commit();
  if (mode == kWrittenAccumulator && threadIdx.x == 70) d[3] = 1.0f;
  if (mode == kExitPending) return;
  cg_wgmma_wait<0>();
}

static int run_fault(int mode, const char* name, int threads = 128) {
  static std::vector<std::uint16_t> global(64 * 64);
  CUtensorMap map;
  const cuuint64_t dims[2] = {64, 64}, strides[1] = {128};
  const cuuint32_t box[2] = {64, 64}, unit[2] = {1, 1};
  CHECK(encode_tiled()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, global.data(), dims, strides, box, unit,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                               CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS,
        "the map");
  const int shared = 12288 + 1024;
  CUDA_OK(cudaFuncSetAttribute(fault, cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
  CG_LAUNCH(fault, dim3(1), dim3(threads), shared, nullptr)(mode, map);
  std::printf("%s: launch %s\n", name, cudaGetErrorName(cudaGetLastError()));
  return 0;
}

static int bad_maps() {
  alignas(64) static unsigned char global[1 << 16];
  CUtensorMap map;
  const cuuint64_t dims[2] = {64, 64}, strides[1] = {128}, odd_strides[1] = {120};
  const cuuint32_t box[2] = {64, 64}, unit[2] = {1, 1}, wide[2] = {300, 64}, narrow[2] = {4, 64};
  auto encode = [&](void* address, const cuuint64_t* st, const cuuint32_t* bx, CUtensorMapSwizzle swizzle) {
    return encode_tiled()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, address, dims, st, bx, unit,
                                  CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  };
  CHECK(encode(global, strides, box, CU_TENSOR_MAP_SWIZZLE_128B) == CUDA_SUCCESS, "a valid map");
  CHECK(encode(global + 8, strides, box, CU_TENSOR_MAP_SWIZZLE_128B) == CUDA_ERROR_INVALID_VALUE, "unaligned");
  CHECK(encode(global, odd_strides, box, CU_TENSOR_MAP_SWIZZLE_128B) == CUDA_ERROR_INVALID_VALUE, "stride");
  CHECK(encode(global, strides, wide, CU_TENSOR_MAP_SWIZZLE_NONE) == CUDA_ERROR_INVALID_VALUE, "box past 256");
  CHECK(encode(global, strides, narrow, CU_TENSOR_MAP_SWIZZLE_NONE) == CUDA_ERROR_INVALID_VALUE, "8-byte rows");
  CHECK(encode(global, strides, box, CU_TENSOR_MAP_SWIZZLE_64B) == CUDA_ERROR_INVALID_VALUE, "128 bytes > 64B");
  const cuuint32_t first_ignored[2] = {0, 1};  // without interleave the driver ignores elementStrides[0]
  CHECK(encode_tiled()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, global, dims, strides, box, first_ignored,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                               CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS,
        "elementStrides[0] ignored");
  CHECK(encode_tiled()(&map, CU_TENSOR_MAP_DATA_TYPE_INT32, 2, global, dims, strides, box, unit,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                               CU_TENSOR_MAP_L2_PROMOTION_NONE,
                               CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA) == CUDA_ERROR_INVALID_VALUE,
        "a NaN fill of integers");
  FINISH("bad-map");
}

int main(int argc, char** argv) {
  if (mode_is(argc, argv, "product") && argc == 4) return product_case(argv[2], argv[3]);
  if (mode_is(argc, argv, "pipeline")) return run_ring(kRingRight, "pipeline");
  if (mode_is(argc, argv, "release-early")) return run_ring(kRingReleaseEarly, "release-early");
  if (mode_is(argc, argv, "static-tile")) return run_fault(kStaticTile, "static-tile");
  if (mode_is(argc, argv, "lanes-differ")) return run_fault(kLanesDiffer, "lanes-differ");
  if (mode_is(argc, argv, "base-offset")) return run_fault(kBaseOffset, "base-offset");
  if (mode_is(argc, argv, "off-repeat")) return run_fault(kOffRepeat, "off-repeat");
  if (mode_is(argc, argv, "written-accumulator")) return run_fault(kWrittenAccumulator, "written-accumulator");
  if (mode_is(argc, argv, "tma-overflow")) return run_fault(kTmaOverflow, "tma-overflow");
  if (mode_is(argc, argv, "exit-pending")) return run_fault(kExitPending, "exit-pending");
  if (mode_is(argc, argv, "partial-warpgroup")) return run_fault(kPartialWarpgroup, "partial-warpgroup", 96);
  if (mode_is(argc, argv, "groups")) return run_groups();
  if (mode_is(argc, argv, "swizzles")) return run_swizzles();
  if (mode_is(argc, argv, "nan-fill")) return run_nan_fill();
  if (mode_is(argc, argv, "bad-map")) return bad_maps();
  std::printf("usage: %s product CASE OUT | pipeline | release-early | groups | swizzles | nan-fill | "
              "static-tile | lanes-differ | base-offset | off-repeat | written-accumulator | tma-overflow | "
              "exit-pending | partial-warpgroup | bad-map\n", argv[0]);
  return 2;
}
