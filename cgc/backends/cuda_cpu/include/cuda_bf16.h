// cuda_cpu shim for <cuda_bf16.h>: see cgc/backends/cuda_cpu/README.md.
#pragma once
#include "cgcpu/cgcpu.h"
