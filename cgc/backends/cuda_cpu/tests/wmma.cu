// WMMA: a 16x16x16 bfloat16 tile product with float accumulation equals a float reference
// exactly (bfloat16 products are exact in float; the reference adds them in order of k, as the
// emulator defines mma_sync), for all four operand layouts and both accumulator layouts; a warp
// that loads, multiplies and stores back over the same shared tile gets the right answer.
//   wmma            the checks
//   wmma misaligned a load from a pointer that is not 32-byte aligned: fault
#include "check.h"

#include <mma.h>

#include <cstdint>
#include <vector>

using namespace nvcuda;

constexpr int T = 16;

template <class LayoutA, class LayoutB>
__global__ void tile_product(float* d, const __nv_bfloat16* a, const __nv_bfloat16* b, const float* c, int c_row) {
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, LayoutA> fa;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, LayoutB> fb;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::load_matrix_sync(fa, a, 24);  // leading dimensions wider than the tile
  wmma::load_matrix_sync(fb, b, 32);
  wmma::load_matrix_sync(acc, c, 16, c_row ? wmma::mem_row_major : wmma::mem_col_major);
  wmma::mma_sync(acc, fa, fb, acc);
  wmma::store_matrix_sync(d, acc, 16, c_row ? wmma::mem_row_major : wmma::mem_col_major);
}

// Two warps; each computes S = A B into shared memory, then S += S_bf16 * I in place (the load
// of S and the store over it are collectives: no lane can store before every lane has loaded).
__global__ void in_place(float* out, const __nv_bfloat16* a, const __nv_bfloat16* b) {
  __shared__ __align__(32) float s[2][T * T];
  __shared__ __align__(32) __nv_bfloat16 sb[2][T * T];
  __shared__ __align__(32) __nv_bfloat16 identity[T * T];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = threadIdx.x; i < T * T; i += blockDim.x) identity[i] = (i / T == i % T) ? 1.0f : 0.0f;
  __syncthreads();
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fb;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::fill_fragment(acc, 0.0f);
  wmma::load_matrix_sync(fa, a + warp * T * T, T);
  wmma::load_matrix_sync(fb, b, T);
  wmma::mma_sync(acc, fa, fb, acc);
  wmma::store_matrix_sync(s[warp], acc, T, wmma::mem_row_major);
  __syncwarp();
  for (int i = lane; i < T * T; i += 32) sb[warp][i] = s[warp][i];
  __syncwarp();
  wmma::load_matrix_sync(acc, s[warp], T, wmma::mem_row_major);
  wmma::load_matrix_sync(fa, sb[warp], T);
  wmma::load_matrix_sync(fb, identity, T);
  wmma::mma_sync(acc, fa, fb, acc);
  wmma::store_matrix_sync(s[warp], acc, T, wmma::mem_row_major);
  __syncwarp();
  for (int i = lane; i < T * T; i += 32) out[warp * T * T + i] = s[warp][i];
}

__global__ void misaligned(float* out, const __nv_bfloat16* a) {
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
  wmma::load_matrix_sync(fa, a + 8, 16);  // 16 bytes past a 256-byte boundary
  out[threadIdx.x] = fa.x[0];
}

static std::uint32_t state = 12345;
static float random_bf16() {  // a random bfloat16 value in [-4, 4), as float
  state = state * 1664525u + 1013904223u;
  const float f = (static_cast<int>(state >> 8) % 8192) / 1024.0f - 4.0f;
  return __bfloat162float(__float2bfloat16_rn(f));
}

#define COMMA ,

template <class LayoutA, class LayoutB>
static void check_layouts(const char* name, bool a_row, bool b_row) {
  // A (16x16) kept in a 16 x 24 (row-major) or 24 x 16 (col-major) buffer, ld 24; B with ld 32.
  std::vector<float> A(T * T), B(T * T), C(T * T);
  for (float& x : A) x = random_bf16();
  for (float& x : B) x = random_bf16();
  for (int i = 0; i < T * T; ++i) C[i] = static_cast<float>(i % 37) * 0.125f - 2.0f;
  std::vector<__nv_bfloat16> a(24 * T, __float2bfloat16_rn(99.0f)), b(32 * T, __float2bfloat16_rn(99.0f));
  for (int i = 0; i < T; ++i)
    for (int k = 0; k < T; ++k) a[a_row ? i * 24 + k : k * 24 + i] = __float2bfloat16_rn(A[i * T + k]);
  for (int k = 0; k < T; ++k)
    for (int j = 0; j < T; ++j) b[b_row ? k * 32 + j : j * 32 + k] = __float2bfloat16_rn(B[k * T + j]);
  __nv_bfloat16 *da = nullptr, *db = nullptr;
  float *dc = nullptr, *dd = nullptr;
  CUDA_OK(cudaMalloc(&da, a.size() * 2));
  CUDA_OK(cudaMalloc(&db, b.size() * 2));
  CUDA_OK(cudaMalloc(&dc, T * T * 4));
  CUDA_OK(cudaMalloc(&dd, T * T * 4));
  CUDA_OK(cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(db, b.data(), b.size() * 2, cudaMemcpyHostToDevice));
  for (int c_row = 0; c_row < 2; ++c_row) {
    std::vector<float> c_memory(T * T);  // C in the memory layout under test
    for (int i = 0; i < T; ++i)
      for (int j = 0; j < T; ++j) c_memory[c_row ? i * T + j : j * T + i] = C[i * T + j];
    CUDA_OK(cudaMemcpy(dc, c_memory.data(), T * T * 4, cudaMemcpyHostToDevice));
    CG_LAUNCH(tile_product<LayoutA COMMA LayoutB>, dim3(1), dim3(32), 0, nullptr)(dd, da, db, dc, c_row);
    CUDA_OK(cudaGetLastError());
    std::vector<float> d(T * T);
    CUDA_OK(cudaMemcpy(d.data(), dd, T * T * 4, cudaMemcpyDeviceToHost));
    int wrong = 0;
    for (int i = 0; i < T; ++i)
      for (int j = 0; j < T; ++j) {
        float sum = C[i * T + j];
        for (int k = 0; k < T; ++k) sum += A[i * T + k] * B[k * T + j];
        const float got = d[c_row ? i * T + j : j * T + i];
        if (got != sum) {
          if (wrong < 3) std::printf("%s c_row=%d: d[%d][%d] = %.9g, expected %.9g\n", name, c_row, i, j, got, sum);
          ++wrong;
        }
      }
    CHECK(wrong == 0, "%s, accumulator %s: %d of 256 elements differ", name, c_row ? "row-major" : "col-major", wrong);
  }
  CUDA_OK(cudaFree(da));
  CUDA_OK(cudaFree(db));
  CUDA_OK(cudaFree(dc));
  CUDA_OK(cudaFree(dd));
}
int main(int argc, char** argv) {
  if (mode_is(argc, argv, "misaligned")) {
    float* out = nullptr;
    __nv_bfloat16* a = nullptr;
    CUDA_OK(cudaMalloc(&out, 32 * 4));
    CUDA_OK(cudaMalloc(&a, 512 * 2));
    CG_LAUNCH(misaligned, dim3(1), dim3(32), 0, nullptr)(out, a);
    const cudaError_t e = cudaGetLastError();
    CHECK(e == cudaErrorLaunchFailure, "misaligned load: %s", cudaGetErrorName(e));
    FINISH("misaligned");
  }
  check_layouts<wmma::row_major, wmma::row_major>("A row, B row", true, true);
  check_layouts<wmma::row_major, wmma::col_major>("A row, B col", true, false);
  check_layouts<wmma::col_major, wmma::row_major>("A col, B row", false, true);
  check_layouts<wmma::col_major, wmma::col_major>("A col, B col", false, false);

  std::vector<float> A(2 * T * T), B(T * T);
  for (float& x : A) x = random_bf16();
  for (float& x : B) x = random_bf16();
  std::vector<__nv_bfloat16> a(A.size()), b(B.size());
  for (size_t i = 0; i < A.size(); ++i) a[i] = A[i];
  for (size_t i = 0; i < B.size(); ++i) b[i] = B[i];
  __nv_bfloat16 *da = nullptr, *db = nullptr;
  float* out = nullptr;
  CUDA_OK(cudaMalloc(&da, a.size() * 2));
  CUDA_OK(cudaMalloc(&db, b.size() * 2));
  CUDA_OK(cudaMalloc(&out, A.size() * 4));
  CUDA_OK(cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(db, b.data(), b.size() * 2, cudaMemcpyHostToDevice));
  for (unsigned long long seed : {0ull, 5ull, 9ull}) {
    cgcpu::set_schedule_seed(seed);
    CG_LAUNCH(in_place, dim3(1), dim3(64), 0, nullptr)(out, da, db);
    CUDA_OK(cudaGetLastError());
    std::vector<float> got(A.size());
    CUDA_OK(cudaMemcpy(got.data(), out, got.size() * 4, cudaMemcpyDeviceToHost));
    int wrong = 0;
    for (int w = 0; w < 2; ++w)
      for (int i = 0; i < T; ++i)
        for (int j = 0; j < T; ++j) {
          float s = 0.0f;
          for (int k = 0; k < T; ++k) s += A[w * T * T + i * T + k] * B[k * T + j];
          float expected = s;  // then S + bf16(S) I, adding the products in order of k
          for (int k = 0; k < T; ++k) expected += __bfloat162float(__float2bfloat16_rn(k == j ? s : 0.0f)) *
                                                  (k == j ? 1.0f : 0.0f);
          wrong += got[w * T * T + i * T + j] != expected;
        }
    CHECK(wrong == 0, "seed %llu: in-place tile update, %d elements wrong", seed, wrong);
  }
  FINISH("wmma");
}
