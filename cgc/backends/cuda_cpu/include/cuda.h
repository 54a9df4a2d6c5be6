// cuda_cpu shim for <cuda.h> (the driver API's tensor maps): see cgc/backends/cuda_cpu/README.md.
#pragma once
#include "cgcpu/cgcpu.h"
#include "cgcpu/tensor_map.h"
