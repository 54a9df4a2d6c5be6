// cuda_cpu shim for <mma.h> (nvcuda::wmma): see cgc/backends/cuda_cpu/README.md.
#pragma once
#include "cgcpu/cgcpu.h"
#include "cgcpu/wmma.h"
