// cuda_cpu: the cuBLASLt calls the emitted host programs make, computed on the CPU.
//
// cublasLtMatmul follows cuBLASLt's column-major definition, D = epilogue(alpha op(A) op(B) +
// beta C), with op(X) = X or X^T (CUBLASLT_MATMUL_DESC_TRANSA / TRANSB), A and B bfloat16 or
// float32 (the same type), float32 compute and scale (CUBLAS_COMPUTE_32F, CUDA_R_32F), C and D
// of one type and one shape, float32 or bfloat16; C may be D itself (in place) or another
// matrix; when beta is 0, C is not read. The epilogues are the subset the emitted programs use:
//   CUBLASLT_EPILOGUE_DEFAULT   D = the value;
//   CUBLASLT_EPILOGUE_GELU_AUX  aux = the value (rounded to D's type on its own), D = GELU(value);
//   CUBLASLT_EPILOGUE_DGELU     D = value * GELU'(aux), aux (D's type) the GELU input;
// GELU in its tanh form, on the float value before it is rounded to D's type. The aux matrix
// is laid out as D, with the leading dimension CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD (divisible by
// 8 and no less than D's rows, as cuBLASLt requires). Any other epilogue is
// CUBLAS_STATUS_NOT_SUPPORTED. The arithmetic is cublasGemmEx's twin (cublas.h): each element's
// products added in order of k from 0, in float: deterministic, whatever the thread count.
//
// The heuristic returns up to three algorithms (as many as asked), none needing workspace: the
// first and second add each element's products in order of k from 0 (as two of cuBLASLt's tile
// shapes that make one pass over k: the same bits), the third (where k > 1) sums k's two halves
// apart and adds them (as cuBLASLt's split-K: other bits). Descriptors hold what was set.
// Arguments cuBLASLt refuses are refused with its statuses: no handle (NOT_INITIALIZED), a null
// descriptor or layout, a size that does not match, an attribute of the wrong size, an epilogue
// with no aux pointer or a bad aux ld (INVALID_VALUE), types it has no kernel for (NOT_SUPPORTED).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "cublas.h"
#include "linkage.h"

typedef enum {
  CUBLASLT_MATMUL_DESC_COMPUTE_TYPE = 0,
  CUBLASLT_MATMUL_DESC_SCALE_TYPE = 1,
  CUBLASLT_MATMUL_DESC_POINTER_MODE = 2,
  CUBLASLT_MATMUL_DESC_TRANSA = 3,
  CUBLASLT_MATMUL_DESC_TRANSB = 4,
  CUBLASLT_MATMUL_DESC_TRANSC = 5,
  CUBLASLT_MATMUL_DESC_FILL_MODE = 6,
  CUBLASLT_MATMUL_DESC_EPILOGUE = 7,
  CUBLASLT_MATMUL_DESC_BIAS_POINTER = 8,
  CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER = 11,
  CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD = 12,
  CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE = 22,
} cublasLtMatmulDescAttributes_t;

typedef enum {
  CUBLASLT_EPILOGUE_DEFAULT = 1,
  CUBLASLT_EPILOGUE_RELU = 2,
  CUBLASLT_EPILOGUE_RELU_AUX = 130,
  CUBLASLT_EPILOGUE_BIAS = 4,
  CUBLASLT_EPILOGUE_GELU = 32,
  CUBLASLT_EPILOGUE_GELU_AUX = 160,
  CUBLASLT_EPILOGUE_GELU_BIAS = 36,
  CUBLASLT_EPILOGUE_GELU_AUX_BIAS = 164,
  CUBLASLT_EPILOGUE_DGELU = 192,
  CUBLASLT_EPILOGUE_DGELU_BGRAD = 208,
} cublasLtEpilogue_t;

typedef enum {
  CUBLASLT_MATMUL_PREF_SEARCH_MODE = 0,
  CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES = 6,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES = 7,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES = 8,
} cublasLtMatmulPreferenceAttributes_t;

typedef struct {
  uint64_t data[8];
} cublasLtMatmulAlgo_t;

typedef enum {
  CUBLASLT_ALGO_CONFIG_ID = 0,
  CUBLASLT_ALGO_CONFIG_TILE_ID = 1,
  CUBLASLT_ALGO_CONFIG_SPLITK_NUM = 2,
  CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME = 3,
} cublasLtMatmulAlgoConfigAttributes_t;

typedef enum {
  CUBLASLT_REDUCTION_SCHEME_NONE = 0,
  CUBLASLT_REDUCTION_SCHEME_INPLACE = 1,
  CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE = 2,
  CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE = 4,
} cublasLtReductionScheme_t;

typedef struct {
  cublasLtMatmulAlgo_t algo;
  size_t workspaceSize;
  cublasStatus_t state;
  float wavesCount;
  int reserved[4];
} cublasLtMatmulHeuristicResult_t;

struct cublasLtContext {
  int magic;
};
typedef struct cublasLtContext* cublasLtHandle_t;

struct cublasLtMatmulDescOpaque_t {
  cublasComputeType_t compute;
  cudaDataType_t scale;
  int32_t transa, transb;
  uint32_t epilogue;
  const void* aux;
  int64_t aux_ld;
  int32_t aux_type;  // -1: D's type
};
typedef cublasLtMatmulDescOpaque_t* cublasLtMatmulDesc_t;

struct cublasLtMatrixLayoutOpaque_t {
  cudaDataType_t type;
  uint64_t rows, cols;
  int64_t ld;
};
typedef cublasLtMatrixLayoutOpaque_t* cublasLtMatrixLayout_t;

struct cublasLtMatmulPreferenceOpaque_t {
  uint64_t workspace;
  uint32_t alignment[4];
};
typedef cublasLtMatmulPreferenceOpaque_t* cublasLtMatmulPreference_t;

CGCPU_RUNTIME cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) {
  if (handle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *handle = new cublasLtContext{0x4c74};
  return CUBLAS_STATUS_SUCCESS;
}
CGCPU_RUNTIME cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

CGCPU_RUNTIME cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute,
                                               cudaDataType_t scale) {
  if (desc == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *desc = new cublasLtMatmulDescOpaque_t{compute, scale, CUBLAS_OP_N, CUBLAS_OP_N, CUBLASLT_EPILOGUE_DEFAULT,
                                         nullptr, 0, -1};
  return CUBLAS_STATUS_SUCCESS;
}
CGCPU_RUNTIME cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
  delete desc;
  return CUBLAS_STATUS_SUCCESS;
}

namespace cgcpu {
namespace detail {
// An attribute's value, if `bytes` is its size (cuBLASLt refuses another size).
template <typename T>
inline bool lt_attribute(T* into, const void* buf, size_t bytes) {
  if (buf == nullptr || bytes != sizeof(T)) return false;
  std::memcpy(into, buf, sizeof(T));
  return true;
}
}  // namespace detail
}  // namespace cgcpu

CGCPU_RUNTIME cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                                                     const void* buf, size_t bytes) {
  using cgcpu::detail::lt_attribute;
  if (desc == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  bool ok = false;
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_COMPUTE_TYPE: ok = lt_attribute(&desc->compute, buf, bytes); break;
    case CUBLASLT_MATMUL_DESC_SCALE_TYPE: ok = lt_attribute(&desc->scale, buf, bytes); break;
    case CUBLASLT_MATMUL_DESC_TRANSA: ok = lt_attribute(&desc->transa, buf, bytes); break;
    case CUBLASLT_MATMUL_DESC_TRANSB: ok = lt_attribute(&desc->transb, buf, bytes); break;
    case CUBLASLT_MATMUL_DESC_EPILOGUE: ok = lt_attribute(&desc->epilogue, buf, bytes); break;
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER: ok = lt_attribute(&desc->aux, buf, bytes); break;
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD: ok = lt_attribute(&desc->aux_ld, buf, bytes); break;
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE: ok = lt_attribute(&desc->aux_type, buf, bytes); break;
    default: return CUBLAS_STATUS_NOT_SUPPORTED;  // not one the emitted programs set
  }
  return ok ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
}

CGCPU_RUNTIME cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type, uint64_t rows,
                                                 uint64_t cols, int64_t ld) {
  if (layout == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *layout = new cublasLtMatrixLayoutOpaque_t{type, rows, cols, ld};
  return CUBLAS_STATUS_SUCCESS;
}
CGCPU_RUNTIME cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
  delete layout;
  return CUBLAS_STATUS_SUCCESS;
}

CGCPU_RUNTIME cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* preference) {
  if (preference == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *preference = new cublasLtMatmulPreferenceOpaque_t{0, {256, 256, 256, 256}};
  return CUBLAS_STATUS_SUCCESS;
}
CGCPU_RUNTIME cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t preference) {
  delete preference;
  return CUBLAS_STATUS_SUCCESS;
}
CGCPU_RUNTIME cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t preference,
                                                           cublasLtMatmulPreferenceAttributes_t attr,
                                                           const void* buf, size_t bytes) {
  using cgcpu::detail::lt_attribute;
  if (preference == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  bool ok = false;
  switch (attr) {
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES: ok = lt_attribute(&preference->workspace, buf, bytes); break;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES:
      ok = lt_attribute(&preference->alignment[attr - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES], buf, bytes);
      break;
    default: return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  return ok ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
}

namespace cgcpu {
namespace detail {

// Whether the descriptor and layouts make a product this twin (and cuBLASLt) can run: the
// status cuBLASLt returns otherwise. A is op(A): m x k; B: k x n; C and D: m x n.
CGCPU_RUNTIME cublasStatus_t lt_validate(cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                  cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d) {
  if (desc == nullptr || a == nullptr || b == nullptr || c == nullptr || d == nullptr)
    return CUBLAS_STATUS_INVALID_VALUE;
  if (desc->transa < CUBLAS_OP_N || desc->transa > CUBLAS_OP_C || desc->transb < CUBLAS_OP_N ||
      desc->transb > CUBLAS_OP_C)
    return CUBLAS_STATUS_INVALID_VALUE;
  if (desc->compute != CUBLAS_COMPUTE_32F && desc->compute != CUBLAS_COMPUTE_32F_PEDANTIC)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  if (desc->scale != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
  const bool ta = desc->transa != CUBLAS_OP_N, tb = desc->transb != CUBLAS_OP_N;
  const uint64_t m = d->rows, n = d->cols, k = ta ? a->rows : a->cols;
  if ((ta ? a->cols : a->rows) != m || (tb ? b->cols : b->rows) != k || (tb ? b->rows : b->cols) != n)
    return CUBLAS_STATUS_INVALID_VALUE;
  if (c->rows != m || c->cols != n || c->type != d->type || c->ld != d->ld) return CUBLAS_STATUS_INVALID_VALUE;
  const int64_t one = 1;
  if (a->ld < std::max<int64_t>(one, a->rows) || b->ld < std::max<int64_t>(one, b->rows) ||
      d->ld < std::max<int64_t>(one, d->rows))
    return CUBLAS_STATUS_INVALID_VALUE;
  if (m > 0x7fffffff || n > 0x7fffffff || k > 0x7fffffff || a->ld > 0x7fffffff || b->ld > 0x7fffffff ||
      d->ld > 0x7fffffff)
    return CUBLAS_STATUS_NOT_SUPPORTED;  // beyond what the twin's int arithmetic holds
  if (!gemm_type_ok(a->type) || b->type != a->type || !gemm_type_ok(d->type) ||
      (a->type == CUDA_R_32F && d->type != CUDA_R_32F))
    return CUBLAS_STATUS_NOT_SUPPORTED;
  switch (desc->epilogue) {
    case CUBLASLT_EPILOGUE_DEFAULT: return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_EPILOGUE_GELU_AUX:
    case CUBLASLT_EPILOGUE_DGELU:
      if (desc->aux_type != -1 && desc->aux_type != d->type) return CUBLAS_STATUS_NOT_SUPPORTED;
      if (desc->aux_ld < static_cast<int64_t>(m) || desc->aux_ld % 8 != 0 || desc->aux_ld > 0x7fffffff)
        return CUBLAS_STATUS_INVALID_VALUE;
      return CUBLAS_STATUS_SUCCESS;
    default: return CUBLAS_STATUS_NOT_SUPPORTED;
  }
}

}  // namespace detail
}  // namespace cgcpu

CGCPU_RUNTIME cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                                     cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                                     cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                                     cublasLtMatmulPreference_t preference, int requested,
                                                     cublasLtMatmulHeuristicResult_t results[], int* returned) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (preference == nullptr || results == nullptr || returned == nullptr || requested < 1)
    return CUBLAS_STATUS_INVALID_VALUE;
  const cublasStatus_t status = cgcpu::detail::lt_validate(desc, a, b, c, d);
  if (status != CUBLAS_STATUS_SUCCESS) return status;
  const int k = static_cast<int>(desc->transa != CUBLAS_OP_N ? a->rows : a->cols);
  const int offered = k > 1 ? 3 : 2;
  *returned = requested < offered ? requested : offered;
  for (int i = 0; i < *returned; ++i) {
    std::memset(&results[i], 0, sizeof results[i]);
    results[i].algo.data[0] = 0x4c74;  // the twin's
    results[i].algo.data[1] = static_cast<std::uint64_t>(i);  // 2: split-K
    results[i].workspaceSize = 0;
    results[i].state = CUBLAS_STATUS_SUCCESS;
    results[i].wavesCount = 1.0f;
  }
  return CUBLAS_STATUS_SUCCESS;
}

// An algorithm's configuration as cuBLASLt reports it: the twin's third is split-K in two. Test
// hook: CG_CPU_SPLIT_K_UNLABELLED=1 reports it as one pass, so that what stands behind the label
// (the emitted program's comparison of bits) is tested on its own.
CGCPU_RUNTIME cublasStatus_t cublasLtMatmulAlgoConfigGetAttribute(const cublasLtMatmulAlgo_t* algo,
                                                           cublasLtMatmulAlgoConfigAttributes_t attribute, void* buffer,
                                                           size_t bytes, size_t* written) {
  if (algo == nullptr || algo->data[0] != 0x4c74) return CUBLAS_STATUS_INVALID_VALUE;
  const char* unlabelled = std::getenv("CG_CPU_SPLIT_K_UNLABELLED");
  const bool split = algo->data[1] == 2 && !(unlabelled != nullptr && std::strcmp(unlabelled, "1") == 0);
  std::uint32_t value;
  switch (attribute) {
    case CUBLASLT_ALGO_CONFIG_ID: value = static_cast<std::uint32_t>(algo->data[1]); break;
    case CUBLASLT_ALGO_CONFIG_TILE_ID: value = 0; break;
    case CUBLASLT_ALGO_CONFIG_SPLITK_NUM: value = split ? 2 : 1; break;
    case CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME:
      value = split ? CUBLASLT_REDUCTION_SCHEME_INPLACE : CUBLASLT_REDUCTION_SCHEME_NONE;
      break;
    default: return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (written != nullptr) *written = sizeof value;
  if (bytes == 0 && written != nullptr) return CUBLAS_STATUS_SUCCESS;  // a query of the size
  if (buffer == nullptr || bytes != sizeof value) return CUBLAS_STATUS_INVALID_VALUE;
  std::memcpy(buffer, &value, sizeof value);
  return CUBLAS_STATUS_SUCCESS;
}

CGCPU_RUNTIME cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha,
                                     const void* A, cublasLtMatrixLayout_t Adesc, const void* B,
                                     cublasLtMatrixLayout_t Bdesc, const void* beta, const void* C,
                                     cublasLtMatrixLayout_t Cdesc, void* D, cublasLtMatrixLayout_t Ddesc,
                                     const cublasLtMatmulAlgo_t* algo, void* workspace, size_t workspaceBytes,
                                     cudaStream_t stream) {
  using namespace cgcpu::detail;
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (sticky() != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
  if (alpha == nullptr || beta == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  if (!stream_valid(stream)) return CUBLAS_STATUS_INVALID_VALUE;
  if (algo != nullptr && (algo->data[0] != 0x4c74 || algo->data[1] > 2))
    return CUBLAS_STATUS_INVALID_VALUE;  // not the heuristic's
  if (workspaceBytes > 0 && workspace == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  const cublasStatus_t status = lt_validate(desc, Adesc, Bdesc, Cdesc, Ddesc);
  if (status != CUBLAS_STATUS_SUCCESS) return status;
  const bool has_aux = desc->epilogue != CUBLASLT_EPILOGUE_DEFAULT;
  if (has_aux && desc->aux == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  // Captured (capture.h): what the call reads at once copied now, as CUDA bakes it into the
  // graph's node (the descriptor and its aux pointer, the layouts, alpha, beta, the algorithm).
  if (capture_call(stream, [=, d = *desc, a = *Adesc, b = *Bdesc, c = *Cdesc, dd = *Ddesc,
                            alpha_value = *static_cast<const float*>(alpha),
                            beta_value = *static_cast<const float*>(beta),
                            chosen = algo != nullptr ? *algo : cublasLtMatmulAlgo_t{}]() mutable {
        cublasLtMatmul(handle, &d, &alpha_value, A, &a, B, &b, &beta_value, C, &c, D, &dd,
                       algo != nullptr ? &chosen : nullptr, workspace, workspaceBytes, stream);
      }))
    return CUBLAS_STATUS_SUCCESS;
  const bool ta = desc->transa != CUBLAS_OP_N, tb = desc->transb != CUBLAS_OP_N;
  const int m = static_cast<int>(Ddesc->rows), n = static_cast<int>(Ddesc->cols);
  const int k = static_cast<int>(ta ? Adesc->rows : Adesc->cols);
  const int lda = static_cast<int>(Adesc->ld), ldb = static_cast<int>(Bdesc->ld);
  const int ldd = static_cast<int>(Ddesc->ld), ldaux = static_cast<int>(desc->aux_ld);
  if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
  const float alpha_value = *static_cast<const float*>(alpha);
  const float beta_value = *static_cast<const float*>(beta);
  const cudaDataType_t in = Adesc->type, out = Ddesc->type;
  const std::size_t a_size = in == CUDA_R_32F ? 4 : 2, d_size = out == CUDA_R_32F ? 4 : 2;
  const int a_rows = ta ? k : m, a_cols = ta ? m : k, b_rows = tb ? n : k, b_cols = tb ? k : n;
  const bool a_ok = k == 0 || gemm_operand_ok(A, a_rows, a_cols, lda, a_size);
  const bool b_ok = k == 0 || gemm_operand_ok(B, b_rows, b_cols, ldb, a_size);
  const bool c_ok = beta_value == 0.0f || gemm_operand_ok(C, m, n, ldd, d_size);
  const bool d_ok = gemm_operand_ok(D, m, n, ldd, d_size);
  const bool aux_ok = !has_aux || gemm_operand_ok(desc->aux, m, n, ldaux, d_size);
  if (!(a_ok && b_ok && c_ok && d_ok && aux_ok)) {
    std::fprintf(stderr,
                 "cuda_cpu: cublasLtMatmul(m=%d, n=%d, k=%d, lda=%d, ldb=%d, ldd=%d): an operand reaches outside "
                 "its allocation (A %s, B %s, C %s, D %s, aux %s)\n",
                 m, n, k, lda, ldb, ldd, a_ok ? "inside" : "outside", b_ok ? "inside" : "outside",
                 c_ok ? "inside" : "outside", d_ok ? "inside" : "outside", aux_ok ? "inside" : "outside");
    int expected = cudaSuccess;
    sticky_error.compare_exchange_strong(expected, cudaErrorIllegalAddress);
    return CUBLAS_STATUS_EXECUTION_FAILED;
  }
  // The descriptor, layouts, alpha and beta are read now (the caller may change them before the
  // product runs, as cuBLASLt allows); op(A) and op(B) are read when it runs, before D is written
  // (D may be C).
  std::unique_ptr<GemmWork> work(new GemmWork);
  work->job = GemmJob{m, n, k, nullptr, nullptr, D, out, ldd, alpha_value, beta_value};
  work->job.c_in = C;
  work->job.ldc_in = ldd;
  work->job.epilogue = desc->epilogue == CUBLASLT_EPILOGUE_GELU_AUX ? kGemmGeluAux
                       : desc->epilogue == CUBLASLT_EPILOGUE_DGELU  ? kGemmDgelu
                                                                    : kGemmPlain;
  work->job.aux = const_cast<void*>(desc->aux);
  work->job.ldaux = ldaux;
  if (algo != nullptr && algo->data[1] == 2) work->job.split = k / 2;
  work->operands(A, B, in, ta, tb, lda, ldb, a_rows, a_cols, b_rows, b_cols, k);
  if (beta_value != 0.0f) work->ranges.push_back({C, m, n, ldd, d_size, kShadowRead});
  if (desc->epilogue == CUBLASLT_EPILOGUE_DGELU) work->ranges.push_back({desc->aux, m, n, ldaux, d_size, kShadowRead});
  if (desc->epilogue == CUBLASLT_EPILOGUE_GELU_AUX)
    work->ranges.push_back({desc->aux, m, n, ldaux, d_size, kShadowWrite});
  work->ranges.push_back({D, m, n, ldd, d_size, kShadowWrite});
  // cuBLASLt may use all the workspace it is given as scratch: two products at once must not
  // share one (the twin itself needs none).
  if (workspaceBytes > 0 && device_range(workspace, workspaceBytes)) {
    work->workspace = workspace;
    work->workspace_bytes = workspaceBytes;
  }
  issue_gemm(stream, "cublasLtMatmul", std::move(work));
  return CUBLAS_STATUS_SUCCESS;
}
