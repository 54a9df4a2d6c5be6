// cuda_cpu shim for <cublas_v2.h>: see cgc/backends/cuda_cpu/README.md.
#pragma once
#include "cgcpu/cgcpu.h"
#include "cgcpu/cublas.h"
