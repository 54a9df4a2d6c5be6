// cuda_cpu: the cuBLAS calls the emitted host programs make, computed on the CPU.
//
// cublasGemmEx follows cuBLAS's column-major definition, C = alpha op(A) op(B) + beta C, with
// op(X) = X (CUBLAS_OP_N) or X^T (CUBLAS_OP_T, CUBLAS_OP_C: the types are real), A and B
// bfloat16 or float32, float32 accumulation, C float32 or bfloat16 (rounded to nearest even).
// When beta is 0, C is not read (NaN in C does not propagate), as in cuBLAS. Each element's sum
// adds the products in order of k, starting from 0, in float; then alpha * sum + beta * C. The
// result is deterministic and independent of the number of threads (rows of C are split among
// the workers; each element's arithmetic is fixed). cuBLAS itself accumulates in an order it
// does not specify (README.md). A product is an op of the handle's stream (stream.h): its
// arguments are checked when it is called, the product made when the op runs.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <vector>

#include "bf16.h"
#include "linkage.h"
#include "runtime_api.h"
#include "types.h"

typedef enum {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_NOT_INITIALIZED = 1,
  CUBLAS_STATUS_ALLOC_FAILED = 3,
  CUBLAS_STATUS_INVALID_VALUE = 7,
  CUBLAS_STATUS_ARCH_MISMATCH = 8,
  CUBLAS_STATUS_MAPPING_ERROR = 11,
  CUBLAS_STATUS_EXECUTION_FAILED = 13,
  CUBLAS_STATUS_INTERNAL_ERROR = 14,
  CUBLAS_STATUS_NOT_SUPPORTED = 15,
  CUBLAS_STATUS_LICENSE_ERROR = 16,
} cublasStatus_t;

typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1, CUBLAS_OP_C = 2, CUBLAS_OP_HERMITAN = 2 } cublasOperation_t;

typedef enum {
  CUBLAS_COMPUTE_16F = 64,
  CUBLAS_COMPUTE_16F_PEDANTIC = 65,
  CUBLAS_COMPUTE_32F = 68,
  CUBLAS_COMPUTE_32F_PEDANTIC = 69,
  CUBLAS_COMPUTE_32F_FAST_16F = 74,
  CUBLAS_COMPUTE_32F_FAST_16BF = 75,
  CUBLAS_COMPUTE_32F_FAST_TF32 = 77,
  CUBLAS_COMPUTE_64F = 70,
  CUBLAS_COMPUTE_32I = 72,
} cublasComputeType_t;

typedef enum {
  CUBLAS_GEMM_DFALT = -1,
  CUBLAS_GEMM_DEFAULT = -1,
  CUBLAS_GEMM_DEFAULT_TENSOR_OP = 99,
  CUBLAS_GEMM_DFALT_TENSOR_OP = 99,
} cublasGemmAlgo_t;

typedef enum {
  CUBLAS_DEFAULT_MATH = 0,
  CUBLAS_TENSOR_OP_MATH = 1,
  CUBLAS_PEDANTIC_MATH = 2,
  CUBLAS_TF32_TENSOR_OP_MATH = 3,
} cublasMath_t;

typedef enum { CUBLAS_POINTER_MODE_HOST = 0, CUBLAS_POINTER_MODE_DEVICE = 1 } cublasPointerMode_t;

struct cublasContext {
  cudaStream_t stream;
  cublasMath_t math;
  cublasPointerMode_t pointer_mode;
};
typedef struct cublasContext* cublasHandle_t;

CGCPU_RUNTIME cublasStatus_t cublasCreate(cublasHandle_t* handle) {
  if (handle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *handle = new cublasContext{nullptr, CUBLAS_DEFAULT_MATH, CUBLAS_POINTER_MODE_HOST};
  return CUBLAS_STATUS_SUCCESS;
}
CGCPU_RUNTIME cublasStatus_t cublasDestroy(cublasHandle_t handle) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}
CGCPU_RUNTIME cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!cgcpu::detail::stream_valid(stream)) return CUBLAS_STATUS_INVALID_VALUE;
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}
CGCPU_RUNTIME cublasStatus_t cublasGetStream(cublasHandle_t handle, cudaStream_t* stream) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (stream == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *stream = handle->stream;
  return CUBLAS_STATUS_SUCCESS;
}
CGCPU_RUNTIME cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->math = mode;  // recorded; products are float32 whatever the mode
  return CUBLAS_STATUS_SUCCESS;
}
CGCPU_RUNTIME cublasStatus_t cublasSetPointerMode(cublasHandle_t handle, cublasPointerMode_t mode) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->pointer_mode = mode;  // alpha and beta are readable from the host either way
  return CUBLAS_STATUS_SUCCESS;
}
CGCPU_RUNTIME const char* cublasGetStatusString(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "the operation completed successfully";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "the library was not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED: return "the resource allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE: return "an invalid numeric value was used as an argument";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "an absent device architectural feature is required";
    case CUBLAS_STATUS_MAPPING_ERROR: return "an access to GPU memory space failed";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "the GPU program failed to execute";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "an internal operation failed";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "the functionality requested is not supported";
    default: return "unknown error";
  }
}

namespace cgcpu {
namespace detail {

inline bool gemm_type_ok(cudaDataType_t t) { return t == CUDA_R_32F || t == CUDA_R_16BF; }

inline float gemm_load(const void* base, cudaDataType_t type, std::size_t at) {
  if (type == CUDA_R_32F) return static_cast<const float*>(base)[at];
  return bfloat16_bits_to_float(static_cast<const unsigned short*>(base)[at]);
}

// op(X) of a column-major X, as a row-major rows x columns float matrix: X itself when not
// transposed (leading dimension ld), else X^T. Both operands of GemmEx and cublasLtMatmul
// (op(A) m x k, op(B) k x n) are read this way.
CGCPU_NO_TSAN inline std::vector<float> gemm_gather(const void* x, cudaDataType_t type, bool transposed, int rows,
                                      int columns, int ld) {
  std::vector<float> out(static_cast<std::size_t>(rows) * columns);
  for (int i = 0; i < rows; ++i)
    for (int p = 0; p < columns; ++p)
      out[static_cast<std::size_t>(i) * columns + p] =
          gemm_load(x, type, transposed ? static_cast<std::size_t>(i) * ld + p
                                        : static_cast<std::size_t>(p) * ld + i);
  return out;
}

// The element-wise epilogues a product may apply (cuBLASLt's; cublasGemmEx has none).
enum GemmEpilogue { kGemmPlain, kGemmGeluAux, kGemmDgelu };

// GELU, tanh form, and its slope, in float: what cuBLASLt's GELU epilogues compute and the
// emitted kernels' gelu_forward and gelu_slope (common.cuh) spell the same way.
inline float gemm_gelu(float x) {
  return 0.5f * x * (1.0f + std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}
inline float gemm_gelu_slope(float x) {
  const float t = std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x));
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * x * x);
}

struct GemmJob {
  int m, n, k;
  const float* a;  // op(A), m x k, row i at a + i * k
  const float* b;  // op(B), k x n, row p at b + p * n
  void* c;  // the output, D (cuBLASLt's name; cublasGemmEx's C)
  cudaDataType_t c_type;
  int ldc;
  float alpha, beta;
  const void* c_in = nullptr;  // the matrix read for beta (cuBLASLt's C, of D's type): null means c itself
  int ldc_in = 0;
  GemmEpilogue epilogue = kGemmPlain;
  void* aux = nullptr;  // GELU_AUX: written (the value before GELU); DGELU: read (the GELU input)
  int ldaux = 0;
  int split = 0;  // > 0: k summed as [0, split) and [split, k) apart, then added (cuBLASLt's split-K)
};

constexpr int kGemmRows = 4;  // rows of C computed together, sharing each row of op(B)

// Racecheck checks kernels; a product is the emulator's own computation: not instrumented (for
// speed) and its callees ignored.
CGCPU_NO_TSAN inline void gemm_rows(void* context, std::uint64_t group) {
  TsanIgnore ignore;
  const GemmJob& job = *static_cast<const GemmJob*>(context);
  const int first = static_cast<int>(group) * kGemmRows;
  const int rows = job.m - first < kGemmRows ? job.m - first : kGemmRows;
  const int n = job.n;
  std::vector<float> accumulator(static_cast<std::size_t>(kGemmRows) * n, 0.0f);
  float* acc[kGemmRows];
  const float* arow[kGemmRows];
  for (int r = 0; r < kGemmRows; ++r) {
    acc[r] = accumulator.data() + static_cast<std::size_t>(r) * n;
    arow[r] = job.a + static_cast<std::size_t>(first + (r < rows ? r : 0)) * job.k;
  }
  typedef float Vector __attribute__((vector_size(16)));
  std::vector<float> first_part;  // split-K: the sums over [0, split)
  for (int p = 0; p < job.k; ++p) {
    if (p == job.split && job.split > 0) {
      first_part = accumulator;
      std::fill(accumulator.begin(), accumulator.end(), 0.0f);
    }
    const float* brow = job.b + static_cast<std::size_t>(p) * n;
    float scalar[kGemmRows];
    Vector broadcast[kGemmRows];
    for (int r = 0; r < kGemmRows; ++r) {
      scalar[r] = arow[r][p];
      broadcast[r] = Vector{scalar[r], scalar[r], scalar[r], scalar[r]};
    }
    int j = 0;
    for (; j + 4 <= n; j += 4) {
      Vector bv;
      std::memcpy(&bv, brow + j, sizeof bv);
      for (int r = 0; r < kGemmRows; ++r) {
        Vector cv;
        std::memcpy(&cv, acc[r] + j, sizeof cv);
        const Vector product = broadcast[r] * bv;  // each lane: one rounding, as the scalar code
        cv = cv + product;
        std::memcpy(acc[r] + j, &cv, sizeof cv);
      }
    }
    for (; j < n; ++j)
      for (int r = 0; r < kGemmRows; ++r) {
        const float product = scalar[r] * brow[j];
        acc[r][j] = acc[r][j] + product;
      }
  }
  for (std::size_t at = 0; at < first_part.size(); ++at) accumulator[at] = first_part[at] + accumulator[at];
  const void* c_in = job.c_in != nullptr ? job.c_in : job.c;
  const int ldc_in = job.c_in != nullptr ? job.ldc_in : job.ldc;
  for (int r = 0; r < rows; ++r) {
    const int i = first + r;
    for (int j = 0; j < n; ++j) {
      const std::size_t at = static_cast<std::size_t>(j) * job.ldc + i;
      float value = job.alpha * acc[r][j];
      if (job.beta != 0.0f) {
        const float old = gemm_load(c_in, job.c_type, static_cast<std::size_t>(j) * ldc_in + i);
        const float scaled = job.beta * old;
        value = value + scaled;
      }
      // The epilogue acts on the float value, before it is rounded to D's type; the aux
      // matrix has D's type and is rounded on its own.
      if (job.epilogue != kGemmPlain) {
        const std::size_t aux_at = static_cast<std::size_t>(j) * job.ldaux + i;
        if (job.epilogue == kGemmGeluAux) {
          if (job.c_type == CUDA_R_32F)
            static_cast<float*>(job.aux)[aux_at] = value;
          else
            static_cast<unsigned short*>(job.aux)[aux_at] = float_to_bfloat16_bits(value);
          value = gemm_gelu(value);
        } else {
          value = value * gemm_gelu_slope(gemm_load(job.aux, job.c_type, aux_at));
        }
      }
      if (job.c_type == CUDA_R_32F)
        static_cast<float*>(job.c)[at] = value;
      else
        static_cast<unsigned short*>(job.c)[at] = float_to_bfloat16_bits(value);
    }
  }
}

// A product as an op: op(A) and op(B) gathered into float when it starts (they may be written by
// earlier ops of the stream), then rows of D in groups of kGemmRows as its items. Its operands
// are declared to the shadow by start (the arithmetic is not instrumented).
struct GemmWork : Work {
  GemmJob job{};
  const void* a_in = nullptr;
  const void* b_in = nullptr;
  cudaDataType_t in = CUDA_R_32F;
  bool ta = false, tb = false;
  int lda = 0, ldb = 0;
  std::vector<float> a, b;
  struct Range {
    const void* p;
    std::int64_t rows, cols, ld;
    std::size_t element;
    int kind;
  };
  std::vector<Range> ranges;
  const void* workspace = nullptr;
  std::size_t workspace_bytes = 0;

  // op(A) [m, k] and op(B) [k, n] of `type` (gathered when the product runs), and the ranges
  // of them the shadow counts as read: cublasGemmEx's and cublasLtMatmul's alike.
  void operands(const void* A, const void* B, cudaDataType_t type, bool trans_a, bool trans_b,
                int ld_a, int ld_b, int a_rows, int a_cols, int b_rows, int b_cols, int k) {
    a_in = A, b_in = B, in = type, ta = trans_a, tb = trans_b, lda = ld_a, ldb = ld_b;
    const std::size_t element = type == CUDA_R_32F ? 4 : 2;
    if (k > 0) {
      ranges.push_back({A, a_rows, a_cols, ld_a, element, kShadowRead});
      ranges.push_back({B, b_rows, b_cols, ld_b, element, kShadowRead});
    }
  }

  std::uint64_t start(Op&) override {
    if (sticky() != cudaSuccess) return 0;
    for (const Range& r : ranges) shadow_matrix(r.p, r.rows, r.cols, r.ld, r.element, r.kind);
    shadow_scratch(workspace, workspace_bytes);
    TsanIgnore ignore;
    a = gemm_gather(a_in, in, ta, job.m, job.k, lda);
    b = gemm_gather(b_in, in, tb, job.k, job.n, ldb);
    job.a = a.data();
    job.b = b.data();
    return expected_items();
  }
  std::uint64_t expected_items() const override {
    return static_cast<std::uint64_t>((job.m + kGemmRows - 1) / kGemmRows);
  }
  bool item(Op&, std::uint64_t group) override {
    gemm_rows(&job, group);
    return false;
  }
};

// Issues a product on `stream`; on the legacy stream it has run when this returns.
CGCPU_RUNTIME void issue_gemm(cudaStream_t stream, const char* name, std::unique_ptr<GemmWork> work) {
  std::lock_guard<std::recursive_mutex> device(device_mutex());
  enqueue(stream, name, std::move(work));
  if (is_legacy(stream)) run_pending();
}

// Whether a column-major rows x cols matrix with leading dimension ld of `element` bytes lies
// inside one allocation.
CGCPU_RUNTIME bool gemm_operand_ok(const void* p, int rows, int cols, int ld, std::size_t element) {
  if (rows == 0 || cols == 0) return true;
  const std::size_t last = (static_cast<std::size_t>(cols) - 1) * ld + rows;
  return device_range(p, last * element);
}

}  // namespace detail
}  // namespace cgcpu

CGCPU_RUNTIME cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m,
                                   int n, int k, const void* alpha, const void* A, cudaDataType_t Atype, int lda,
                                   const void* B, cudaDataType_t Btype, int ldb, const void* beta, void* C,
                                   cudaDataType_t Ctype, int ldc, cublasComputeType_t computeType,
                                   cublasGemmAlgo_t algo) {
  using namespace cgcpu::detail;
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (sticky() != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
  if (transa < CUBLAS_OP_N || transa > CUBLAS_OP_C || transb < CUBLAS_OP_N || transb > CUBLAS_OP_C)
    return CUBLAS_STATUS_INVALID_VALUE;
  const bool ta = transa != CUBLAS_OP_N, tb = transb != CUBLAS_OP_N;
  if (m < 0 || n < 0 || k < 0) return CUBLAS_STATUS_INVALID_VALUE;
  const int a_rows = ta ? k : m, a_cols = ta ? m : k;
  const int b_rows = tb ? n : k, b_cols = tb ? k : n;
  if (lda < (a_rows > 1 ? a_rows : 1) || ldb < (b_rows > 1 ? b_rows : 1) || ldc < (m > 1 ? m : 1))
    return CUBLAS_STATUS_INVALID_VALUE;
  if (alpha == nullptr || beta == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  if (computeType != CUBLAS_COMPUTE_32F && computeType != CUBLAS_COMPUTE_32F_PEDANTIC)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  if (!gemm_type_ok(Atype) || Btype != Atype || !gemm_type_ok(Ctype) || (Atype == CUDA_R_32F && Ctype != CUDA_R_32F))
    return CUBLAS_STATUS_NOT_SUPPORTED;
  if (!((algo >= -1 && algo <= 23) || (algo >= 99 && algo <= 115))) return CUBLAS_STATUS_INVALID_VALUE;
  if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
  const float alpha_value = *static_cast<const float*>(alpha);
  const float beta_value = *static_cast<const float*>(beta);
  const std::size_t a_size = Atype == CUDA_R_32F ? 4 : 2, c_size = Ctype == CUDA_R_32F ? 4 : 2;
  const bool reads_a = k > 0, reads_b = k > 0;
  if ((reads_a && !gemm_operand_ok(A, a_rows, a_cols, lda, a_size)) ||
      (reads_b && !gemm_operand_ok(B, b_rows, b_cols, ldb, a_size)) || !gemm_operand_ok(C, m, n, ldc, c_size)) {
    std::fprintf(stderr,
                 "cuda_cpu: cublasGemmEx(m=%d, n=%d, k=%d, lda=%d, ldb=%d, ldc=%d): an operand reaches outside its "
                 "allocation (A %s, B %s, C %s)\n",
                 m, n, k, lda, ldb, ldc,
                 reads_a && !gemm_operand_ok(A, a_rows, a_cols, lda, a_size) ? "outside" : "inside",
                 reads_b && !gemm_operand_ok(B, b_rows, b_cols, ldb, a_size) ? "outside" : "inside",
                 !gemm_operand_ok(C, m, n, ldc, c_size) ? "outside" : "inside");
    int expected = cudaSuccess;
    sticky_error.compare_exchange_strong(expected, cudaErrorIllegalAddress);
    return CUBLAS_STATUS_EXECUTION_FAILED;
  }
  std::unique_ptr<GemmWork> work(new GemmWork);
  work->job = GemmJob{m, n, k, nullptr, nullptr, C, Ctype, ldc, alpha_value, beta_value};
  work->operands(A, B, Atype, ta, tb, lda, ldb, a_rows, a_cols, b_rows, b_cols, k);
  if (beta_value != 0.0f) work->ranges.push_back({C, m, n, ldc, c_size, kShadowRead});
  work->ranges.push_back({C, m, n, ldc, c_size, kShadowWrite});
  issue_gemm(handle->stream, "cublasGemmEx", std::move(work));
  return CUBLAS_STATUS_SUCCESS;
}

CGCPU_RUNTIME cublasStatus_t cublasSgemm(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m,
                                  int n, int k, const float* alpha, const float* A, int lda, const float* B, int ldb,
                                  const float* beta, float* C, int ldc) {
  return cublasGemmEx(handle, transa, transb, m, n, k, alpha, A, CUDA_R_32F, lda, B, CUDA_R_32F, ldb, beta, C,
                      CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}
