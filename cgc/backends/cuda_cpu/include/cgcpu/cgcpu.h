// cuda_cpu: the whole emulator (everything but WMMA and cuBLAS, which <mma.h> and
// <cublas_v2.h> add). Every shim header (cuda_bf16.h, cuda_runtime.h, ...) includes this first,
// so the keywords, threadIdx & co., CG_LAUNCH and CG_DYNAMIC_SHARED are defined before the
// emitted file's own fallbacks (#ifndef CG_LAUNCH, #ifndef CG_DYNAMIC_SHARED) are reached.
// Header-only and ODR-safe: any number of translation units may include it; it defines no main.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(__CUDA_ARCH__)
#error "cgc/backends/cuda_cpu/include is for the host compiler only; nvcc and NVRTC use CUDA's own headers"
#endif
#if __cplusplus < 201703L
#error "cuda_cpu needs C++17 (g++ -std=c++17)"
#endif

#include "keywords.h"
#include "vector_types.h"
#include "types.h"
#include "bf16.h"
#include "device_math.h"
#include "fiber.h"
#include "state.h"
#include "shadow.h"
#include "stream.h"
#include "capture.h"
#include "scheduler.h"
#include "warp.h"
#include "ptx.h"
#include "mbarrier.h"
#include "wgmma.h"
#include "tensor_map.h"
#include "runtime_api.h"
#include "racecheck.h"
