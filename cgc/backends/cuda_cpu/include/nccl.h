// cuda_cpu shim for <nccl.h>: see cgc/backends/cuda_cpu/README.md.
#pragma once
#include "cgcpu/cgcpu.h"
#include "cgcpu/nccl.h"
