// cuda_cpu: where the host runtime's functions are compiled.
//
// Header-only by default: every CGCPU_RUNTIME function is `inline`, so any number of
// translation units may include the headers and a program needs nothing else (this is how the
// emitted file is built by hand: g++ -I.../include file.cu).
//
// cgc's own builds compile the runtime once instead (for each set of compiler flags), as an
// object linked into every program built with those flags: a program's compile then generates
// only its own code, a third less compile time for the tiny step (docs/emulation.md, "Builds").
//   -DCGCPU_RUNTIME_OBJECT    the object's translation unit: the functions are defined here,
//                             as ordinary external functions.
//   -DCGCPU_SEPARATE_RUNTIME  a program linked with that object: each function is
//                             `gnu_inline` (its body never emitted here; a call is a call of
//                             the object's definition) and never inlined (optimize("O0"):
//                             GCC inlines no function whose options differ from its caller's,
//                             and `noinline` is ignored beside `gnu_inline`), so the program's
//                             compile generates none of them.
// What stays plain `inline`: templates; what kernels call (barriers, collectives, the PTX twins:
// compiled with the kernel, as racecheck's reports need them); the small functions on hot paths
// (an element of a CPU product); and every function that holds state in a static (the
// configuration, the pool, the device, the registries): an inline function's statics are one
// for the whole process (STB_GNU_UNIQUE), however many copies of a library it loads, as in the
// header-only build; an external function's would be each copy's own.
#pragma once

#if defined(CGCPU_RUNTIME_OBJECT) && defined(CGCPU_SEPARATE_RUNTIME)
#error "CGCPU_RUNTIME_OBJECT and CGCPU_SEPARATE_RUNTIME: one translation unit is one or the other"
#endif

#if defined(CGCPU_RUNTIME_OBJECT)
#define CGCPU_RUNTIME
#elif defined(CGCPU_SEPARATE_RUNTIME)
#define CGCPU_RUNTIME inline __attribute__((gnu_inline, optimize("O0")))
#else
#define CGCPU_RUNTIME inline
#endif
