// The inline-PTX twins (cgcpu/ptx.h), lane by lane. Prints, for tests/test_ptx_twins.py to
// compare with NumPy and with the PTX ISA's layouts written out again in Python:
//   ldmatrix  LANE R0LO R0HI ... R3HI   the registers ldmatrix.x4 gave each lane from a 16 x 16
//   ldmatrix.trans ...                  tile whose element (r, c) is r * 16 + c (exact in bf16)
//   A/B/C/D rows                        random A (16 x 16, bf16), B (16 x 8, bf16), C (16 x 8),
//                                       and D = A B + C from mma.m16n8k16, each lane's A and B
//                                       registers from ldmatrix, C read and D written by the
//                                       accumulator layout
// and checks cp.async itself: a copy lands at the wait that covers its group, not before.
#include "check.h"

#include <cstdint>
#include <vector>

__device__ unsigned bits(__nv_bfloat16 x) {
  unsigned short b;
  std::memcpy(&b, &x, 2);
  return b;
}

__global__ void load_tile(unsigned* out, const __nv_bfloat16* tile_in, int trans) {
  __shared__ __align__(16) __nv_bfloat16 tile[16 * 16];
  const int lane = threadIdx.x;
  for (int i = lane; i < 256; i += 32) tile[i] = tile_in[i];
  __syncwarp();
  unsigned r[4];
  // Matrices 0-3: rows 0-7 / 8-15 of columns 0-7, then of columns 8-15.
  const __nv_bfloat16* row = tile + (lane % 16) * 16 + (lane / 16) * 8;
  if (trans)
    cg_ldmatrix_x4_trans(r, row);
  else
    cg_ldmatrix_x4(r, row);
  for (int i = 0; i < 4; ++i) out[lane * 4 + i] = r[i];
}

__global__ void product(float* d, const __nv_bfloat16* a_in, const __nv_bfloat16* bt_in, const float* c) {
  __shared__ __align__(16) __nv_bfloat16 a[16 * 16];
  __shared__ __align__(16) __nv_bfloat16 bt[8 * 16];  // B transposed: row n holds B[0..15][n]
  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  for (int i = lane; i < 256; i += 32) a[i] = a_in[i];
  for (int i = lane; i < 128; i += 32) bt[i] = bt_in[i];
  __syncwarp();
  unsigned ra[4], rb[4];
  cg_ldmatrix_x4(ra, a + (lane % 16) * 16 + (lane / 16) * 8);
  cg_ldmatrix_x4(rb, bt + (lane % 8) * 16 + ((lane / 8) % 2) * 8);  // b0: k 0-7, b1: k 8-15
  const unsigned b[2] = {rb[0], rb[1]};
  const float cin[4] = {c[g * 8 + 2 * t], c[g * 8 + 2 * t + 1], c[(g + 8) * 8 + 2 * t], c[(g + 8) * 8 + 2 * t + 1]};
  float out[4];
  cg_mma_bf16_16816(out, ra, b, cin);
  d[g * 8 + 2 * t] = out[0];
  d[g * 8 + 2 * t + 1] = out[1];
  d[(g + 8) * 8 + 2 * t] = out[2];
  d[(g + 8) * 8 + 2 * t + 1] = out[3];
}

// Each thread copies 16 bytes, then 4, in two groups; what it sees before and after each wait
// (the 4-byte copy moves one word: the next stays -1).
__global__ void async_copies(int* seen, const int* from) {
  __shared__ __align__(16) int first[32 * 4], second[32 * 4];
  const int i = threadIdx.x;
  for (int e = 0; e < 4; ++e) first[i * 4 + e] = second[i * 4 + e] = -1;
  cg_cp_async_16(first + i * 4, from + i * 4);
  cg_cp_async_commit();
  cg_cp_async_4(second + i * 4, from + 128 + i * 4);
  seen[i * 5 + 0] = first[i * 4];  // before any wait: -1
  cg_cp_async_commit();
  cg_cp_async_wait<1>();
  seen[i * 5 + 1] = first[i * 4];   // the first group has landed
  seen[i * 5 + 2] = second[i * 4];  // the newest may not have: here, not yet (-1)
  cg_cp_async_wait<0>();
  seen[i * 5 + 3] = second[i * 4];
  seen[i * 5 + 4] = second[i * 4 + 1];  // past the 4 bytes: -1
}

static std::uint32_t state = 2024;
static float random_bf16() {
  state = state * 1664525u + 1013904223u;
  const float f = (static_cast<int>(state >> 8) % 8192) / 1024.0f - 4.0f;
  return __bfloat162float(__float2bfloat16_rn(f));
}

template <class T>
static T* device_copy(const std::vector<T>& host) {
  T* p = nullptr;
  CUDA_OK(cudaMalloc(&p, host.size() * sizeof(T)));
  CUDA_OK(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

static void print_matrix(const char* name, const std::vector<float>& m, int rows, int cols) {
  for (int r = 0; r < rows; ++r) {
    std::printf("%s", name);
    for (int c = 0; c < cols; ++c) std::printf(" %.9g", m[r * cols + c]);
    std::printf("\n");
  }
}

int main() {
  // ldmatrix
  std::vector<__nv_bfloat16> tile(256);
  for (int i = 0; i < 256; ++i) tile[i] = __float2bfloat16_rn(static_cast<float>(i));
  __nv_bfloat16* dtile = device_copy(tile);
  unsigned* dregs = nullptr;
  CUDA_OK(cudaMalloc(&dregs, 128 * 4));
  for (int trans = 0; trans < 2; ++trans) {
    CG_LAUNCH(load_tile, dim3(1), dim3(32), 0, nullptr)(dregs, dtile, trans);
    CUDA_OK(cudaGetLastError());
    std::vector<unsigned> regs(128);
    CUDA_OK(cudaMemcpy(regs.data(), dregs, 128 * 4, cudaMemcpyDeviceToHost));
    for (int lane = 0; lane < 32; ++lane) {
      std::printf("%s %d", trans ? "ldmatrix.trans" : "ldmatrix", lane);
      for (int i = 0; i < 4; ++i) {
        const unsigned r = regs[lane * 4 + i];
        __nv_bfloat16 lo, hi;
        const unsigned short l = r & 0xFFFFu, h = r >> 16;
        std::memcpy(&lo, &l, 2);
        std::memcpy(&hi, &h, 2);
        std::printf(" %g %g", __bfloat162float(lo), __bfloat162float(hi));
      }
      std::printf("\n");
    }
  }

  // mma
  std::vector<float> A(256), B(128), C(128);
  for (float& x : A) x = random_bf16();
  for (float& x : B) x = random_bf16();
  for (int i = 0; i < 128; ++i) C[i] = static_cast<float>(i % 37) * 0.125f - 2.0f;
  std::vector<__nv_bfloat16> a(256), bt(128);
  for (int i = 0; i < 256; ++i) a[i] = __float2bfloat16_rn(A[i]);
  for (int k = 0; k < 16; ++k)
    for (int n = 0; n < 8; ++n) bt[n * 16 + k] = __float2bfloat16_rn(B[k * 8 + n]);
  __nv_bfloat16* da = device_copy(a);
  __nv_bfloat16* dbt = device_copy(bt);
  float* dc = device_copy(C);
  float* dd = nullptr;
  CUDA_OK(cudaMalloc(&dd, 128 * 4));
  CG_LAUNCH(product, dim3(1), dim3(32), 0, nullptr)(dd, da, dbt, dc);
  CUDA_OK(cudaGetLastError());
  std::vector<float> D(128);
  CUDA_OK(cudaMemcpy(D.data(), dd, 128 * 4, cudaMemcpyDeviceToHost));
  print_matrix("A", A, 16, 16);
  print_matrix("B", B, 16, 8);
  print_matrix("C", C, 16, 8);
  print_matrix("D", D, 16, 8);

  // cp.async
  std::vector<int> from(256);
  for (int i = 0; i < 256; ++i) from[i] = i;
  int* dfrom = device_copy(from);
  int* dseen = nullptr;
  CUDA_OK(cudaMalloc(&dseen, 160 * 4));
  CG_LAUNCH(async_copies, dim3(1), dim3(32), 0, nullptr)(dseen, dfrom);
  CUDA_OK(cudaGetLastError());
  std::vector<int> seen(160);
  CUDA_OK(cudaMemcpy(seen.data(), dseen, 160 * 4, cudaMemcpyDeviceToHost));
  int wrong = 0;
  for (int i = 0; i < 32; ++i)
    wrong += seen[i * 5] != -1 || seen[i * 5 + 1] != i * 4 || seen[i * 5 + 2] != -1 ||
             seen[i * 5 + 3] != 128 + i * 4 || seen[i * 5 + 4] != -1;
  CHECK(wrong == 0, "cp.async: %d threads saw a copy land before or after its wait", wrong);

  // ex2.approx.ftz.f32 over normal, subnormal and infinite arguments and results
  const float ex2_arguments[] = {0.0f, 1.0f, -1.0f, 0.5f, 10.0f, -126.0f, -126.5f, -127.0f, -149.0f,
                                 -150.0f, 127.5f, 128.0f, 1e-40f, -1e-40f, -INFINITY, INFINITY};
  for (float x : ex2_arguments) std::printf("ex2 %.9g %.9g\n", x, cg_exp2_approx(x));
  FINISH("ptx");
}
