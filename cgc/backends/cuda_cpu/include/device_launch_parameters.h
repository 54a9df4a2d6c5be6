// cuda_cpu shim for <device_launch_parameters.h>: see cgc/backends/cuda_cpu/README.md.
#pragma once
#include "cgcpu/cgcpu.h"
