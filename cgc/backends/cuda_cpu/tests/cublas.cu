// cublasGemmEx against a straightforward column-major reference (cuBLAS's definition, the
// products added in order of k): all four operation pairs, bfloat16 and float32 inputs,
// float32 and bfloat16 outputs, padded leading dimensions, alpha and beta; beta = 0 never reads
// C; bad arguments are refused.
#include "check.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <vector>

static std::uint32_t state = 777;
static float random_value() {
  state = state * 1664525u + 1013904223u;
  return (static_cast<int>(state >> 9) % 4001 - 2000) / 512.0f;
}

static float load(const std::vector<unsigned char>& memory, cudaDataType_t type, size_t at) {
  if (type == CUDA_R_32F) {
    float f;
    std::memcpy(&f, memory.data() + at * 4, 4);
    return f;
  }
  std::uint16_t b;
  std::memcpy(&b, memory.data() + at * 2, 2);
  return __bfloat162float(__ushort_as_bfloat16(b));
}

static void store(std::vector<unsigned char>& memory, cudaDataType_t type, size_t at, float value) {
  if (type == CUDA_R_32F) {
    std::memcpy(memory.data() + at * 4, &value, 4);
  } else {
    const __nv_bfloat16 b = __float2bfloat16_rn(value);
    std::memcpy(memory.data() + at * 2, &b, 2);
  }
}

static int check_case(cublasHandle_t handle, cublasOperation_t ta, cublasOperation_t tb, cudaDataType_t in,
                      cudaDataType_t out, int m, int n, int k, float alpha, float beta, bool nan_c) {
  const size_t in_size = in == CUDA_R_32F ? 4 : 2, out_size = out == CUDA_R_32F ? 4 : 2;
  const int a_rows = ta == CUBLAS_OP_N ? m : k, a_cols = ta == CUBLAS_OP_N ? k : m;
  const int b_rows = tb == CUBLAS_OP_N ? k : n, b_cols = tb == CUBLAS_OP_N ? n : k;
  const int lda = a_rows + 3, ldb = b_rows + 1, ldc = m + 2;
  std::vector<unsigned char> A(static_cast<size_t>(lda) * a_cols * in_size), B(static_cast<size_t>(ldb) * b_cols * in_size),
      C(static_cast<size_t>(ldc) * n * out_size);
  for (size_t i = 0; i < A.size() / in_size; ++i) store(A, in, i, random_value());
  for (size_t i = 0; i < B.size() / in_size; ++i) store(B, in, i, random_value());
  for (size_t i = 0; i < C.size() / out_size; ++i) store(C, out, i, nan_c ? NAN : random_value());
  void *dA, *dB, *dC;
  CUDA_OK(cudaMalloc(&dA, A.size()));
  CUDA_OK(cudaMalloc(&dB, B.size()));
  CUDA_OK(cudaMalloc(&dC, C.size()));
  CUDA_OK(cudaMemcpy(dA, A.data(), A.size(), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dB, B.data(), B.size(), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dC, C.data(), C.size(), cudaMemcpyHostToDevice));
  const cublasStatus_t status = cublasGemmEx(handle, ta, tb, m, n, k, &alpha, dA, in, lda, dB, in, ldb, &beta, dC, out,
                                             ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  CHECK(status == CUBLAS_STATUS_SUCCESS, "cublasGemmEx returned %d", static_cast<int>(status));
  std::vector<unsigned char> got(C.size());
  CUDA_OK(cudaMemcpy(got.data(), dC, C.size(), cudaMemcpyDeviceToHost));
  int wrong = 0;
  for (int j = 0; j < n; ++j)
    for (int i = 0; i < ldc; ++i) {
      const size_t at = static_cast<size_t>(j) * ldc + i;
      if (i >= m) {  // padding rows of C are left alone
        wrong += std::memcmp(got.data() + at * out_size, C.data() + at * out_size, out_size) != 0;
        continue;
      }
      float sum = 0.0f;
      for (int p = 0; p < k; ++p) {
        const float a = load(A, in, ta == CUBLAS_OP_N ? static_cast<size_t>(p) * lda + i : static_cast<size_t>(i) * lda + p);
        const float b = load(B, in, tb == CUBLAS_OP_N ? static_cast<size_t>(j) * ldb + p : static_cast<size_t>(p) * ldb + j);
        sum += a * b;
      }
      float expected = alpha * sum;
      if (beta != 0.0f) expected += beta * load(C, out, at);
      std::vector<unsigned char> e(out_size);
      store(e, out, 0, expected);
      if (std::memcmp(got.data() + at * out_size, e.data(), out_size) != 0) {
        if (wrong < 3) std::printf("op %d%d in %d out %d m%d n%d k%d: C[%d,%d] = %.9g, expected %.9g\n", ta, tb, in,
                                   out, m, n, k, i, j, load(got, out, at), load(e, out, 0));
        ++wrong;
      }
    }
  CUDA_OK(cudaFree(dA));
  CUDA_OK(cudaFree(dB));
  CUDA_OK(cudaFree(dC));
  return wrong;
}

int main() {
  cublasHandle_t handle;
  CHECK(cublasCreate(&handle) == CUBLAS_STATUS_SUCCESS, "cublasCreate");
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  CHECK(cublasSetStream(handle, stream) == CUBLAS_STATUS_SUCCESS, "cublasSetStream");
  const cublasOperation_t ops[] = {CUBLAS_OP_N, CUBLAS_OP_T};
  const cudaDataType_t ins[] = {CUDA_R_16BF, CUDA_R_32F};
  const cudaDataType_t outs[] = {CUDA_R_32F, CUDA_R_16BF};
  int cases = 0;
  for (cublasOperation_t ta : ops)
    for (cublasOperation_t tb : ops)
      for (cudaDataType_t in : ins)
        for (cudaDataType_t out : outs) {
          if (in == CUDA_R_32F && out == CUDA_R_16BF) continue;  // not a cuBLAS combination
          const int shapes[][3] = {{37, 29, 53}, {8, 5, 130}, {1, 1, 1}, {64, 33, 1}};
          for (const auto& s : shapes) {
            int wrong = check_case(handle, ta, tb, in, out, s[0], s[1], s[2], 1.0f, 0.0f, false);
            CHECK(wrong == 0, "ops %d%d, %d -> %d, %dx%dx%d, alpha 1, beta 0: %d wrong", ta, tb, in, out, s[0], s[1], s[2], wrong);
            wrong = check_case(handle, ta, tb, in, out, s[0], s[1], s[2], -0.75f, 1.5f, false);
            CHECK(wrong == 0, "ops %d%d, %d -> %d, %dx%dx%d, alpha -0.75, beta 1.5: %d wrong", ta, tb, in, out, s[0], s[1], s[2], wrong);
            ++cases;
          }
          const int wrong = check_case(handle, ta, tb, in, out, 19, 23, 17, 2.0f, 0.0f, true);  // C holds NaN
          CHECK(wrong == 0, "ops %d%d, %d -> %d: beta 0 read C (NaN propagated): %d wrong", ta, tb, in, out, wrong);
        }
  std::printf("%d gemm shapes checked\n", cases);

  // Arguments cuBLAS refuses.
  float *a, *c;
  CUDA_OK(cudaMalloc(&a, 64 * 64 * 4));
  CUDA_OK(cudaMalloc(&c, 64 * 64 * 4));
  const float one = 1.0f, zero = 0.0f;
  CHECK(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, 8, 8, 8, &one, a, CUDA_R_32F, 4, a, CUDA_R_32F, 8, &zero, c,
                     CUDA_R_32F, 8, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_INVALID_VALUE,
        "lda < m is refused");
  CHECK(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, -1, 8, 8, &one, a, CUDA_R_32F, 8, a, CUDA_R_32F, 8, &zero, c,
                     CUDA_R_32F, 8, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_INVALID_VALUE,
        "m < 0 is refused");
  CHECK(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, 8, 8, 8, &one, a, CUDA_R_32F, 8, a, CUDA_R_32F, 8, &zero, c,
                     CUDA_R_16BF, 8, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_NOT_SUPPORTED,
        "float32 inputs with a bfloat16 output are not supported");
  CHECK(cublasGemmEx(nullptr, CUBLAS_OP_N, CUBLAS_OP_N, 8, 8, 8, &one, a, CUDA_R_32F, 8, a, CUDA_R_32F, 8, &zero, c,
                     CUDA_R_32F, 8, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_NOT_INITIALIZED,
        "no handle");
  CHECK(cublasDestroy(handle) == CUBLAS_STATUS_SUCCESS, "cublasDestroy");
  CUDA_OK(cudaStreamDestroy(stream));
  CUDA_OK(cudaFree(a));
  CUDA_OK(cudaFree(c));
  FINISH("cublas");
}
