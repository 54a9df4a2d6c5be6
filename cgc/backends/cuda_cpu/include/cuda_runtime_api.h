// cuda_cpu shim for <cuda_runtime_api.h>: see cgc/backends/cuda_cpu/README.md.
#pragma once
#include "cgcpu/cgcpu.h"
