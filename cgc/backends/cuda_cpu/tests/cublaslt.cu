// cublasLtMatmul against a straightforward column-major reference (cuBLASLt's definition, the
// products added in order of k, the epilogue on the float value before rounding): C distinct
// from D, C == D in place, the GELU_AUX and DGELU epilogues with their aux matrix, through the
// calls the emitted program makes (descriptor, layouts, preference, heuristic). A mutated
// epilogue (the reference of another one) must not match; bad arguments are refused.
#include "check.h"

#include <cublasLt.h>
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <vector>

static std::uint32_t state = 4242;
static float random_value() {
  state = state * 1664525u + 1013904223u;
  return (static_cast<int>(state >> 9) % 4001 - 2000) / 1024.0f;
}

static float bf16_round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

static float gelu(float x) {
  return 0.5f * x * (1.0f + std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}
static float gelu_slope(float x) {
  const float t = std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x));
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * x * x);
}

// Values of a column-major matrix held as float (what it holds once stored in `type`).
struct Matrix {
  int rows, cols, ld;
  bool bf16;
  std::vector<float> v;  // already rounded to the type
  Matrix(int r, int c, int l, bool b, bool fill) : rows(r), cols(c), ld(l), bf16(b), v(static_cast<size_t>(l) * c) {
    for (float& x : v) x = fill ? (b ? bf16_round(random_value()) : random_value()) : 0.0f;
  }
  size_t bytes() const { return v.size() * (bf16 ? 2 : 4); }
  void* upload() const {
    void* p;
    CUDA_OK(cudaMalloc(&p, bytes()));
    if (bf16) {
      std::vector<__nv_bfloat16> h(v.size());
      for (size_t i = 0; i < v.size(); ++i) h[i] = __float2bfloat16_rn(v[i]);
      CUDA_OK(cudaMemcpy(p, h.data(), bytes(), cudaMemcpyHostToDevice));
    } else {
      CUDA_OK(cudaMemcpy(p, v.data(), bytes(), cudaMemcpyHostToDevice));
    }
    return p;
  }
  std::vector<float> download(const void* p) const {
    std::vector<float> out(v.size());
    if (bf16) {
      std::vector<__nv_bfloat16> h(v.size());
      CUDA_OK(cudaMemcpy(h.data(), p, bytes(), cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < v.size(); ++i) out[i] = __bfloat162float(h[i]);
    } else {
      CUDA_OK(cudaMemcpy(out.data(), p, bytes(), cudaMemcpyDeviceToHost));
    }
    return out;
  }
};

struct Case {
  cublasOperation_t ta, tb;
  int m, n, k;
  bool bf16_out;
  float beta;
  cublasLtEpilogue_t epilogue;
  bool in_place;  // C == D
};

// D (and aux) after one cublasLtMatmul, and the reference's; `reference_epilogue` is the
// epilogue the reference applies (another than the call's: a mutation that must be caught).
static int run_case(cublasLtHandle_t handle, const Case& c, cublasLtEpilogue_t reference_epilogue) {
  const int a_rows = c.ta == CUBLAS_OP_N ? c.m : c.k, a_cols = c.ta == CUBLAS_OP_N ? c.k : c.m;
  const int b_rows = c.tb == CUBLAS_OP_N ? c.k : c.n, b_cols = c.tb == CUBLAS_OP_N ? c.n : c.k;
  const int ldd = c.m + 3, ldaux = ((c.m + 7) / 8) * 8 + 8;
  Matrix A(a_rows, a_cols, a_rows + 1, true, true), B(b_rows, b_cols, b_rows + 2, true, true);
  Matrix C(c.m, c.n, ldd, c.bf16_out, true), D(c.m, c.n, ldd, c.bf16_out, true);
  Matrix aux(c.m, c.n, ldaux, c.bf16_out, true);
  void *dA = A.upload(), *dB = B.upload(), *dC = C.upload(), *dD = c.in_place ? dC : D.upload(),
       *dAux = aux.upload();
  const cudaDataType_t in = CUDA_R_16BF, out = c.bf16_out ? CUDA_R_16BF : CUDA_R_32F;
  cublasLtMatmulDesc_t desc;
  CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS, "desc");
  CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &c.ta, sizeof c.ta) == 0, "transa");
  CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &c.tb, sizeof c.tb) == 0, "transb");
  CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &c.epilogue, sizeof c.epilogue) == 0,
        "epilogue");
  if (c.epilogue != CUBLASLT_EPILOGUE_DEFAULT) {
    const int64_t ld = ldaux;
    CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof ld) == 0, "aux ld");
    CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &dAux, sizeof dAux) == 0,
          "aux");
  }
  cublasLtMatrixLayout_t la, lb, lc, ld;
  CHECK(cublasLtMatrixLayoutCreate(&la, in, a_rows, a_cols, A.ld) == 0, "layout");
  CHECK(cublasLtMatrixLayoutCreate(&lb, in, b_rows, b_cols, B.ld) == 0, "layout");
  CHECK(cublasLtMatrixLayoutCreate(&lc, out, c.m, c.n, ldd) == 0, "layout");
  CHECK(cublasLtMatrixLayoutCreate(&ld, out, c.m, c.n, ldd) == 0, "layout");
  cublasLtMatmulPreference_t preference;
  CHECK(cublasLtMatmulPreferenceCreate(&preference) == 0, "preference");
  const uint64_t workspace = 1 << 20;
  CHECK(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                             sizeof workspace) == 0, "workspace");
  cublasLtMatmulHeuristicResult_t result;
  int found = 0;
  CHECK(cublasLtMatmulAlgoGetHeuristic(handle, desc, la, lb, lc, ld, preference, 1, &result, &found) == 0 && found == 1,
        "heuristic");
  void* dWorkspace;
  CUDA_OK(cudaMalloc(&dWorkspace, workspace));
  const float alpha = 1.0f;
  const cublasStatus_t status = cublasLtMatmul(handle, desc, &alpha, dA, la, dB, lb, &c.beta, dC, lc, dD, ld,
                                               &result.algo, dWorkspace, workspace, cudaStream_t{});
  CHECK(status == CUBLAS_STATUS_SUCCESS, "cublasLtMatmul returned %d", static_cast<int>(status));
  const std::vector<float> got = D.download(dD), got_aux = aux.download(dAux);
  int wrong = 0;
  for (int j = 0; j < c.n; ++j)
    for (int i = 0; i < ldd; ++i) {
      const size_t at = static_cast<size_t>(j) * ldd + i;
      const float before = c.in_place ? C.v[at] : D.v[at];
      if (i >= c.m) {  // D's padding left alone
        wrong += got[at] != before;
        continue;
      }
      float sum = 0.0f;
      for (int p = 0; p < c.k; ++p) {
        const float a = A.v[c.ta == CUBLAS_OP_N ? static_cast<size_t>(p) * A.ld + i : static_cast<size_t>(i) * A.ld + p];
        const float b = B.v[c.tb == CUBLAS_OP_N ? static_cast<size_t>(j) * B.ld + p : static_cast<size_t>(p) * B.ld + j];
        sum += a * b;
      }
      float value = alpha * sum;
      if (c.beta != 0.0f) value += c.beta * C.v[at];
      const size_t aux_at = static_cast<size_t>(j) * ldaux + i;
      float aux_expected = aux.v[aux_at];  // DEFAULT and DGELU leave aux alone
      if (reference_epilogue == CUBLASLT_EPILOGUE_GELU_AUX) {
        aux_expected = c.bf16_out ? bf16_round(value) : value;
        value = gelu(value);
      } else if (reference_epilogue == CUBLASLT_EPILOGUE_DGELU) {
        value = value * gelu_slope(aux.v[aux_at]);
      }
      const float expected = c.bf16_out ? bf16_round(value) : value;
      if (got[at] != expected || got_aux[aux_at] != aux_expected) {
        if (wrong < 3 && reference_epilogue == c.epilogue)
          std::printf("epilogue %d m%d n%d k%d: D[%d,%d] = %.9g (expected %.9g), aux %.9g (expected %.9g)\n",
                      c.epilogue, c.m, c.n, c.k, i, j, got[at], expected, got_aux[aux_at], aux_expected);
        ++wrong;
      }
    }
  cublasLtMatmulPreferenceDestroy(preference);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatrixLayoutDestroy(ld);
  cublasLtMatmulDescDestroy(desc);
  for (void* p : {dA, dB, dC, dAux, dWorkspace}) CUDA_OK(cudaFree(p));
  if (!c.in_place) CUDA_OK(cudaFree(dD));
  return wrong;
}

int main() {
  cublasLtHandle_t handle;
  CHECK(cublasLtCreate(&handle) == CUBLAS_STATUS_SUCCESS, "cublasLtCreate");
  const cublasOperation_t ops[] = {CUBLAS_OP_N, CUBLAS_OP_T};
  const int shapes[][3] = {{37, 29, 53}, {8, 5, 130}, {1, 1, 1}, {64, 33, 7}};
  int cases = 0;
  for (cublasOperation_t ta : ops)
    for (cublasOperation_t tb : ops)
      for (const auto& s : shapes) {
        const Case list[] = {
            {ta, tb, s[0], s[1], s[2], false, 0.0f, CUBLASLT_EPILOGUE_DEFAULT, false},
            {ta, tb, s[0], s[1], s[2], false, 1.0f, CUBLASLT_EPILOGUE_DEFAULT, false},  // C != D: a residual
            {ta, tb, s[0], s[1], s[2], false, 1.0f, CUBLASLT_EPILOGUE_DEFAULT, true},   // C == D, in place
            {ta, tb, s[0], s[1], s[2], true, 0.0f, CUBLASLT_EPILOGUE_GELU_AUX, false},
            {ta, tb, s[0], s[1], s[2], true, 0.0f, CUBLASLT_EPILOGUE_DGELU, false},
            {ta, tb, s[0], s[1], s[2], false, 0.0f, CUBLASLT_EPILOGUE_GELU_AUX, false},
        };
        for (const Case& c : list) {
          const int wrong = run_case(handle, c, c.epilogue);
          CHECK(wrong == 0, "ops %d%d, %dx%dx%d, epilogue %d, beta %g, in place %d: %d wrong", ta, tb, c.m, c.n, c.k,
                c.epilogue, c.beta, c.in_place, wrong);
          ++cases;
        }
      }
  std::printf("%d cuBLASLt products checked\n", cases);

  // A mutated epilogue: the reference of another epilogue must not match (the check can fail).
  const Case gelu_case{CUBLAS_OP_N, CUBLAS_OP_N, 37, 29, 53, true, 0.0f, CUBLASLT_EPILOGUE_GELU_AUX, false};
  const Case dgelu_case{CUBLAS_OP_T, CUBLAS_OP_N, 37, 29, 53, true, 0.0f, CUBLASLT_EPILOGUE_DGELU, false};
  CHECK(run_case(handle, gelu_case, CUBLASLT_EPILOGUE_DEFAULT) > 0, "GELU_AUX passed as DEFAULT");
  CHECK(run_case(handle, dgelu_case, CUBLASLT_EPILOGUE_DEFAULT) > 0, "DGELU passed as DEFAULT");
  CHECK(run_case(handle, gelu_case, CUBLASLT_EPILOGUE_DGELU) > 0, "GELU_AUX passed as DGELU");
  std::printf("mutated epilogues caught\n");

  // Arguments cuBLASLt refuses.
  cublasLtMatmulDesc_t desc;
  CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) == 0, "desc");
  const int32_t small = 1;
  CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &small, sizeof small) ==
            CUBLAS_STATUS_INVALID_VALUE, "an attribute of the wrong size is refused");
  cublasLtMatrixLayout_t a, b, d;
  CHECK(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, 16, 16, 16) == 0, "layout");
  CHECK(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, 16, 16, 16) == 0, "layout");
  CHECK(cublasLtMatrixLayoutCreate(&d, CUDA_R_16BF, 16, 16, 16) == 0, "layout");
  void* memory;
  CUDA_OK(cudaMalloc(&memory, 16 * 16 * 2 * 4));
  char* base = static_cast<char*>(memory);
  const float one = 1.0f, zero = 0.0f;
  cublasLtMatmulHeuristicResult_t result;
  int found = 0;
  cublasLtMatmulPreference_t preference;
  CHECK(cublasLtMatmulPreferenceCreate(&preference) == 0, "preference");
  CHECK(cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, d, d, preference, 1, &result, &found) == 0, "heuristic");
  auto matmul = [&](cublasLtHandle_t h) {
    return cublasLtMatmul(h, desc, &one, base, a, base + 512, b, &zero, base + 1024, d, base + 1024, d, &result.algo,
                          nullptr, 0, cudaStream_t{});
  };
  CHECK(matmul(handle) == CUBLAS_STATUS_SUCCESS, "a plain product runs");
  CHECK(matmul(nullptr) == CUBLAS_STATUS_NOT_INITIALIZED, "no handle");
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_GELU_AUX;
  CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue) == 0, "set");
  int64_t aux_ld = 16;
  CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof aux_ld) == 0, "set");
  CHECK(matmul(handle) == CUBLAS_STATUS_INVALID_VALUE, "GELU_AUX without an aux pointer is refused");
  void* aux = base + 1536;
  CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux) == 0, "set");
  CHECK(matmul(handle) == CUBLAS_STATUS_SUCCESS, "GELU_AUX with its aux runs");
  aux_ld = 20;  // not a multiple of 8
  CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof aux_ld) == 0, "set");
  CHECK(matmul(handle) == CUBLAS_STATUS_INVALID_VALUE, "an aux ld not divisible by 8 is refused");
  aux_ld = 16;
  CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof aux_ld) == 0, "set");
  epilogue = CUBLASLT_EPILOGUE_RELU;
  CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue) == 0, "set");
  CHECK(matmul(handle) == CUBLAS_STATUS_NOT_SUPPORTED, "an epilogue the twin lacks is not supported");
  cublasLtMatmulPreferenceDestroy(preference);
  cublasLtMatrixLayoutDestroy(a);
  cublasLtMatrixLayoutDestroy(b);
  cublasLtMatrixLayoutDestroy(d);
  cublasLtMatmulDescDestroy(desc);
  CHECK(cublasLtDestroy(handle) == CUBLAS_STATUS_SUCCESS, "cublasLtDestroy");
  CUDA_OK(cudaFree(memory));
  FINISH("cublaslt");
}
