// cuda_cpu shim for <cuda_runtime.h>: see cgc/backends/cuda_cpu/README.md.
#pragma once
#include "cgcpu/cgcpu.h"
