// Launch errors as on a GPU: more dynamic shared memory than allowed (48 KiB by default, up to
// 227 KiB after cudaFuncSetAttribute) or a block of more than 1024 threads fails the launch,
// cudaGetLastError returns the error once (it is not sticky) and the kernel does not run;
// memory calls check their arguments; a stream's copies and launches are in order.
#include "check.h"

#include <vector>

__global__ void mark(int* flag, int value) {
  CG_DYNAMIC_SHARED(memory);
  if (threadIdx.x == 0 && blockIdx.x == 0) *flag = value + (memory != nullptr ? 0 : 1000);
}

static int read_flag(const int* flag) {
  int v = -1;
  CUDA_OK(cudaMemcpy(&v, flag, sizeof v, cudaMemcpyDeviceToHost));
  return v;
}

int main() {
  int* flag = nullptr;
  CUDA_OK(cudaMalloc(&flag, sizeof(int)));
  CUDA_OK(cudaMemset(flag, 0, sizeof(int)));
  CHECK(cudaGetLastError() == cudaSuccess, "no error to begin with");

  // 48 KiB is allowed without asking; one byte more is not.
  CG_LAUNCH(mark, dim3(1), dim3(32), 48 * 1024, nullptr)(flag, 1);
  CHECK(cudaGetLastError() == cudaSuccess, "48 KiB of dynamic shared memory");
  CHECK(read_flag(flag) == 1, "the kernel ran");
  CG_LAUNCH(mark, dim3(1), dim3(32), 48 * 1024 + 1, nullptr)(flag, 2);
  const cudaError_t too_much = cudaGetLastError();
  CHECK(too_much == cudaErrorInvalidValue, "48 KiB + 1 without cudaFuncSetAttribute: %s", cudaGetErrorName(too_much));
  CHECK(std::strcmp(cudaGetErrorString(too_much), "invalid argument") == 0, "error string %s", cudaGetErrorString(too_much));
  CHECK(cudaGetLastError() == cudaSuccess, "the error is cleared by reading it (not sticky)");
  CHECK(read_flag(flag) == 1, "the refused kernel did not run");

  // Opting in.
  CHECK(cudaFuncSetAttribute(mark, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024 + 1) == cudaErrorInvalidValue,
        "more than 227 KiB cannot be allowed");
  CHECK(cudaGetLastError() == cudaErrorInvalidValue, "a failed call sets the last error too");
  CUDA_OK(cudaFuncSetAttribute(mark, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024));
  CG_LAUNCH(mark, dim3(1), dim3(32), 100 * 1024, nullptr)(flag, 3);
  CHECK(cudaGetLastError() == cudaSuccess, "100 KiB once allowed");
  CHECK(read_flag(flag) == 3, "the kernel ran with 100 KiB");
  CG_LAUNCH(mark, dim3(1), dim3(32), 100 * 1024 + 1, nullptr)(flag, 4);
  CHECK(cudaGetLastError() == cudaErrorInvalidValue, "more than the allowed 100 KiB");
  CHECK(read_flag(flag) == 3, "and it did not run");

  // Block and grid shapes.
  CG_LAUNCH(mark, dim3(1), dim3(1025), 0, nullptr)(flag, 5);
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration, "1025 threads in a block");
  CG_LAUNCH(mark, dim3(1), dim3(32, 32, 2), 0, nullptr)(flag, 5);
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration, "2048 threads in a block");
  CG_LAUNCH(mark, dim3(1), dim3(1, 1, 65), 0, nullptr)(flag, 5);
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration, "blockDim.z = 65");
  CG_LAUNCH(mark, dim3(0), dim3(32), 0, nullptr)(flag, 5);
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration, "an empty grid");
  CG_LAUNCH(mark, dim3(1, 65536), dim3(32), 0, nullptr)(flag, 5);
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration, "gridDim.y = 65536");
  CHECK(read_flag(flag) == 3, "no refused kernel ran");
  CG_LAUNCH(mark, dim3(1), dim3(1024), 0, nullptr)(flag, 6);
  CHECK(cudaGetLastError() == cudaSuccess, "1024 threads");
  CHECK(read_flag(flag) == 6, "ran with 1024 threads");
  CHECK(std::strcmp(cudaGetErrorString(cudaErrorInvalidConfiguration), "invalid configuration argument") == 0,
        "configuration error string");

  // Streams: in order (a created stream's work runs when the host waits for it).
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  std::vector<int> host(256, 7), back(256, 0);
  int* buffer = nullptr;
  CUDA_OK(cudaMalloc(&buffer, 256 * sizeof(int)));
  CUDA_OK(cudaMemcpyAsync(buffer, host.data(), 256 * sizeof(int), cudaMemcpyHostToDevice, stream));
  CG_LAUNCH(mark, dim3(1), dim3(32), 0, stream)(buffer, 9);
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaMemcpyAsync(back.data(), buffer, 256 * sizeof(int), cudaMemcpyDeviceToHost, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  CHECK(back[0] == 9 && back[1] == 7 && back[255] == 7, "copy, launch, copy in order: %d %d %d", back[0], back[1], back[255]);
  CUDA_OK(cudaStreamDestroy(stream));
  CHECK(cudaStreamDestroy(stream) == cudaErrorInvalidResourceHandle, "a stream destroyed twice");
  CG_LAUNCH(mark, dim3(1), dim3(32), 0, stream)(flag, 10);
  CHECK(cudaGetLastError() == cudaErrorInvalidResourceHandle, "a launch on a destroyed stream");

  // Memory calls.
  CHECK(cudaMemcpy(buffer + 200, host.data(), 100 * sizeof(int), cudaMemcpyHostToDevice) == cudaErrorInvalidValue,
        "a copy past the end of an allocation");
  CHECK(cudaMemset(buffer + 250, 0, 7 * sizeof(int)) == cudaErrorInvalidValue, "a memset past the end");
  CHECK(cudaMemcpy(back.data(), buffer, 4, static_cast<cudaMemcpyKind>(7)) == cudaErrorInvalidMemcpyDirection,
        "a bad copy direction");
  CHECK(reinterpret_cast<unsigned long long>(buffer) % 256 == 0, "allocations are 256-byte aligned");
  CHECK(cudaFree(buffer + 1) == cudaErrorInvalidValue, "freeing a pointer that is not an allocation");
  cudaGetLastError();
  CUDA_OK(cudaFree(buffer));
  CUDA_OK(cudaFree(flag));
  CUDA_OK(cudaDeviceSynchronize());
  FINISH("launch");
}
