// Helpers for the cuda_cpu test programs: CHECK counts failures and prints each one; a test
// program exits 1 if any check failed (FINISH), so every test can fail.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

// nvcc (a test program built for a GPU, scripts/hopper_twins_on_gpu.py): the launch the emitted
// file's host program defines; the emulation defines its own (cgcpu/scheduler.h).
#ifndef CG_LAUNCH
#define CG_LAUNCH(kernel, grid, block, shared, stream) kernel<<<grid, block, shared, stream>>>
#endif

static int g_failures = 0;

#define CHECK(condition, ...)                                              \
  do {                                                                     \
    if (!(condition)) {                                                    \
      ++g_failures;                                                        \
      std::printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #condition);     \
      std::printf(__VA_ARGS__);                                            \
      std::printf("\n");                                                   \
    }                                                                      \
  } while (0)

#define CUDA_OK(call)                                                                              \
  do {                                                                                             \
    const cudaError_t status_ = (call);                                                            \
    if (status_ != cudaSuccess) {                                                                  \
      std::printf("FAIL %s:%d: %s returned %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(status_)); \
      std::exit(1);                                                                                \
    }                                                                                              \
  } while (0)

#define FINISH(name)                                                         \
  do {                                                                       \
    if (g_failures == 0) {                                                   \
      std::printf("%s: ok\n", name);                                         \
      return 0;                                                              \
    }                                                                        \
    std::printf("%s: %d check(s) failed\n", name, g_failures);               \
    return 1;                                                                \
  } while (0)

static bool mode_is(int argc, char** argv, const char* mode) {
  return argc > 1 && std::strcmp(argv[1], mode) == 0;
}
