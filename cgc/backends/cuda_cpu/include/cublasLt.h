// cuda_cpu shim for <cublasLt.h>: see cgc/backends/cuda_cpu/README.md.
#pragma once
#include "cgcpu/cgcpu.h"
#include "cgcpu/cublaslt.h"
