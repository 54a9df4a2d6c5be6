// cuda_cpu shim for <library_types.h>: see cgc/backends/cuda_cpu/README.md.
#pragma once
#include "cgcpu/cgcpu.h"
