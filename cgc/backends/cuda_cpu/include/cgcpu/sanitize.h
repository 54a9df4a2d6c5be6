// The sanitizer build's fences (force-included with -include by cgc's emulated backend when
// it builds with AddressSanitizer): the emitted host program names each allocation that
// several buffers share, and each buffer in it; the allocation is poisoned, then each
// buffer unpoisoned, so the red zones the memory plan leaves between buffers catch an
// access past a buffer even inside the one allocation. Without ASan these are no-ops.
#pragma once
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define CG_SHARED_ALLOCATION(allocation, bytes) ASAN_POISON_MEMORY_REGION((allocation), (bytes))
#define CG_REGION(pointer, bytes) ASAN_UNPOISON_MEMORY_REGION((pointer), (bytes))
#endif
