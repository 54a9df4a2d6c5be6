// cuda_cpu: CUDA's declaration keywords for the host compiler (g++ 12, C++17).
// Part of the header set that lets g++ build an emitted .cu file unchanged and run it on
// the CPU with CUDA's semantics (cgc/backends/cuda_cpu/README.md).
#pragma once

// Marks a build of CUDA source by this emulator (never defined by nvcc or NVRTC). Neither
// __CUDACC__ nor __CUDA_ARCH__ nor __CUDACC_RTC__ is defined: the file is host code here.
#define CG_CPU_EMULATION 1

// `#pragma unroll` has no meaning to g++; keep -Wall builds of kernels quiet (g++ 13 and later
// honour this for pragmas; g++ 12 still warns, under -Wall only).
#pragma GCC diagnostic ignored "-Wunknown-pragmas"

#define __host__
#define __device__
#define __global__
#define __forceinline__ __inline__ __attribute__((always_inline))
#define __launch_bounds__(...)
#define __grid_constant__
#define __managed__
#define __constant__
#define __align__(n) __attribute__((aligned(n)))
#define __builtin_align__(n) __attribute__((aligned(n)))
// `__restrict__` is g++'s own keyword already. `__noinline__` is left alone: libstdc++ spells
// its own attribute __attribute__((__noinline__)), which a macro would break.

// Static shared memory: one instance per OS worker thread. A block runs all its CUDA
// threads (fibers) on one worker and a worker runs one block at a time, so a thread_local
// object is exactly "per block". `used` tells g++ that code it cannot see (the other
// fibers, resumed inside the barrier) may read and write the variable, so a value is never
// kept in a register across __syncthreads() even when the variable's address is never taken.
// `extern __shared__` (CUDA's dynamic shared memory) is not supported: use
// CG_DYNAMIC_SHARED(name).
#define __shared__ static thread_local __attribute__((used))
