// cuda_cpu: the tensor memory accelerator's part of the driver API (<cuda.h>: CUtensorMap,
// cuTensorMapEncodeTiled) and the twin of cp.async.bulk.tensor.2d from global to shared memory
// completing on an mbarrier (templates/common.cuh.j2: cg_tma_load_2d), as the CUDA driver API
// and the PTX ISA ("Data Movement: cp.async.bulk.tensor", "Tensor Map") define them.
//
// cuTensorMapEncodeTiled refuses with CUDA_ERROR_INVALID_VALUE what the driver documents as
// invalid: a map not 64-byte aligned, rank outside [1, 5] (interleaved: [3, 5]), a global address
// not 16-byte aligned (32 with the 32-byte interleave), a dimension of 0 or past 2^32, a stride not
// a multiple of 16 (32 with the 32-byte interleave) or past 2^40, a box dimension outside [1, 256]
// or whose inner dimension is not a multiple of 16 bytes, an element stride outside [1, 8] (the
// first is ignored without interleave), the 32-byte interleave without the 32-byte swizzle, a
// swizzle wider than the box's inner dimension in bytes, a NaN fill for an integer type. It stops
// with "not modelled" on what is valid but not modelled here: interleaved layouts, element
// strides other than 1, a swizzled box whose inner dimension is narrower than the swizzle span.
//
// The copy: the box at coordinates (x, y) (innermost first, in elements, may be negative or past
// the tensor) lands densely in dynamic shared memory (the only shared memory the twin addresses:
// a destination elsewhere, not 128-byte aligned, or a box that ends past it is a fault), row
// after row, element (x + i, y + j) at byte (j box0 + i) size; then Swizzle<B, 4, 3> (B = 1, 2, 3
// for 32B, 64B, 128B) moves its 16-byte chunks on the shared address (cg_shared_address, wgmma.h:
// bits 4.. ^= bits 7..), as the swizzled wgmma layouts expect. Elements outside the tensor are
// zero (or, with the NaN fill, all ones but the sign bit: a quiet NaN of the element's width),
// and count towards the bytes the copy completes on the barrier, which is the whole box. The
// global bytes are read when the copy is issued; the shared bytes land when the barrier's phase
// has every arrival, as with cp.async.bulk (mbarrier.h).
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "linkage.h"
#include "mbarrier.h"
#include "wgmma.h"

typedef int CUresult;
constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_INVALID_VALUE = 1;
typedef std::uint32_t cuuint32_t;
typedef std::uint64_t cuuint64_t;

typedef struct CUtensorMap_st {
  alignas(64) cuuint64_t opaque[16];
} CUtensorMap;

typedef enum CUtensorMapDataType_enum {
  CU_TENSOR_MAP_DATA_TYPE_UINT8 = 0,
  CU_TENSOR_MAP_DATA_TYPE_UINT16,
  CU_TENSOR_MAP_DATA_TYPE_UINT32,
  CU_TENSOR_MAP_DATA_TYPE_INT32,
  CU_TENSOR_MAP_DATA_TYPE_UINT64,
  CU_TENSOR_MAP_DATA_TYPE_INT64,
  CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
  CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
  CU_TENSOR_MAP_DATA_TYPE_FLOAT64,
  CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
  CU_TENSOR_MAP_DATA_TYPE_FLOAT32_FTZ,
  CU_TENSOR_MAP_DATA_TYPE_TFLOAT32,
  CU_TENSOR_MAP_DATA_TYPE_TFLOAT32_FTZ
} CUtensorMapDataType;

typedef enum CUtensorMapInterleave_enum {
  CU_TENSOR_MAP_INTERLEAVE_NONE = 0,
  CU_TENSOR_MAP_INTERLEAVE_16B,
  CU_TENSOR_MAP_INTERLEAVE_32B
} CUtensorMapInterleave;

typedef enum CUtensorMapSwizzle_enum {
  CU_TENSOR_MAP_SWIZZLE_NONE = 0,
  CU_TENSOR_MAP_SWIZZLE_32B,
  CU_TENSOR_MAP_SWIZZLE_64B,
  CU_TENSOR_MAP_SWIZZLE_128B
} CUtensorMapSwizzle;

typedef enum CUtensorMapL2promotion_enum {
  CU_TENSOR_MAP_L2_PROMOTION_NONE = 0,
  CU_TENSOR_MAP_L2_PROMOTION_L2_64B,
  CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
  CU_TENSOR_MAP_L2_PROMOTION_L2_256B
} CUtensorMapL2promotion;

typedef enum CUtensorMapFloatOOBfill_enum {
  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE = 0,
  CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA
} CUtensorMapFloatOOBfill;

namespace cgcpu {
namespace detail {

constexpr cuuint64_t kTensorMapMagic = 0x43474350554D4150ull;  // "CGCPUMAP": made by the twin below

// The map's fields, in its opaque words.
struct TensorMapFields {
  const unsigned char* address;
  unsigned rank, element_bytes, swizzle, nan_fill, float_type;
  cuuint64_t dims[5], strides[5];  // strides in bytes; strides[0] is the element's size
  cuuint32_t box[5];
};

inline unsigned tensor_element_bytes(CUtensorMapDataType type) {
  static const unsigned bytes[] = {1, 2, 4, 4, 8, 8, 2, 4, 8, 2, 4, 4, 4};
  return static_cast<unsigned>(type) < 13 ? bytes[type] : 0;
}

inline void pack_tensor_map(CUtensorMap* map, const TensorMapFields& f) {
  for (cuuint64_t& word : map->opaque) word = 0;
  map->opaque[0] = kTensorMapMagic;
  map->opaque[1] = reinterpret_cast<std::uintptr_t>(f.address);
  map->opaque[2] = f.rank | f.element_bytes << 4 | f.swizzle << 8 | f.nan_fill << 10 | f.float_type << 11;
  for (unsigned i = 0; i < 5; ++i) {
    map->opaque[3 + i] = f.dims[i];
    map->opaque[8 + i] = f.strides[i] | static_cast<cuuint64_t>(f.box[i]) << 48;
  }
}

inline bool unpack_tensor_map(const CUtensorMap* map, TensorMapFields& f) {
  if (map->opaque[0] != kTensorMapMagic) return false;
  f.address = reinterpret_cast<const unsigned char*>(static_cast<std::uintptr_t>(map->opaque[1]));
  const cuuint64_t word = map->opaque[2];
  f.rank = word & 15u;
  f.element_bytes = (word >> 4) & 15u;
  f.swizzle = (word >> 8) & 3u;
  f.nan_fill = (word >> 10) & 1u;
  f.float_type = (word >> 11) & 1u;
  for (unsigned i = 0; i < 5; ++i) {
    f.dims[i] = map->opaque[3 + i];
    f.strides[i] = map->opaque[8 + i] & ((1ull << 48) - 1);
    f.box[i] = static_cast<cuuint32_t>(map->opaque[8 + i] >> 48);
  }
  return true;
}

[[noreturn]] inline void tensor_map_not_modelled(const char* what) {
  std::fprintf(stderr, "cuda_cpu: cuTensorMapEncodeTiled: %s is valid but not modelled by the emulation\n", what);
  std::abort();
}

}  // namespace detail
}  // namespace cgcpu

CGCPU_RUNTIME CUresult cuTensorMapEncodeTiled(CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank,
                                       void* address, const cuuint64_t* dims, const cuuint64_t* strides,
                                       const cuuint32_t* box, const cuuint32_t* element_strides,
                                       CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
                                       CUtensorMapL2promotion, CUtensorMapFloatOOBfill fill) {
  using namespace cgcpu::detail;
  const unsigned size = tensor_element_bytes(type);
  const bool integer = type <= CU_TENSOR_MAP_DATA_TYPE_INT64;
  if (map == nullptr || reinterpret_cast<std::uintptr_t>(map) % 64 != 0 || size == 0 || rank < 1 || rank > 5 ||
      (interleave != CU_TENSOR_MAP_INTERLEAVE_NONE && rank < 3) ||
      reinterpret_cast<std::uintptr_t>(address) % (interleave == CU_TENSOR_MAP_INTERLEAVE_32B ? 32 : 16) != 0 ||
      static_cast<unsigned>(swizzle) > 3 || (fill != CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE && integer))
    return CUDA_ERROR_INVALID_VALUE;
  TensorMapFields f{};
  f.address = static_cast<const unsigned char*>(address);
  f.rank = rank;
  f.element_bytes = size;
  f.swizzle = static_cast<unsigned>(swizzle);
  f.nan_fill = fill != CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE;
  f.float_type = !integer;
  const bool interleaved = interleave != CU_TENSOR_MAP_INTERLEAVE_NONE;
  if (interleave == CU_TENSOR_MAP_INTERLEAVE_32B && swizzle != CU_TENSOR_MAP_SWIZZLE_32B)
    return CUDA_ERROR_INVALID_VALUE;
  for (cuuint32_t i = 0; i < rank; ++i) {
    const bool stride_read = interleaved || i > 0;  // without interleave, elementStrides[0] is ignored
    if (dims[i] == 0 || dims[i] > (1ull << 32) || box[i] == 0 || box[i] > 256 ||
        (stride_read && (element_strides[i] == 0 || element_strides[i] > 8)))
      return CUDA_ERROR_INVALID_VALUE;
    if (i > 0 && interleave == CU_TENSOR_MAP_INTERLEAVE_32B && strides[i - 1] % 32 != 0)
      return CUDA_ERROR_INVALID_VALUE;
    if (i > 0 && (strides[i - 1] % 16 != 0 || strides[i - 1] >= (1ull << 40))) return CUDA_ERROR_INVALID_VALUE;
    f.dims[i] = dims[i];
    f.strides[i] = i == 0 ? size : strides[i - 1];
    f.box[i] = box[i];
  }
  const unsigned inner = box[0] * size, span = swizzle == CU_TENSOR_MAP_SWIZZLE_NONE ? 0 : 16u << swizzle;
  if (!interleaved && (inner % 16 != 0 || (span != 0 && inner > span)))
    return CUDA_ERROR_INVALID_VALUE;
  if (interleaved) tensor_map_not_modelled("an interleaved layout");
  for (cuuint32_t i = 1; i < rank; ++i)
    if (element_strides[i] != 1) tensor_map_not_modelled("an element stride other than 1");
  if (span != 0 && inner != span) tensor_map_not_modelled("a swizzled box narrower than its swizzle span");
  pack_tensor_map(map, f);
  return CUDA_SUCCESS;
}

// cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes: the box of
// the tensor map at (x, y) into `shared` (128-byte aligned), completing its bytes on `bar`. The map
// is a kernel parameter (const __grid_constant__ CUtensorMap), passed by its address.
inline void cg_tma_load_2d(void* shared, const void* tensor_map, int x, int y, unsigned long long* bar,
                           const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  using namespace cgcpu::detail;
  const char* what = "cp.async.bulk.tensor.2d";
  Worker& w = device_worker(what);
  const CUtensorMap* map = static_cast<const CUtensorMap*>(tensor_map);
  {
    FiberIgnore ignore(*w.current);
    TensorMapFields f;
    if (!unpack_tensor_map(map, f))
      fiber_fault(w, "%s (%s:%d): %p is not a tensor map made by cuTensorMapEncodeTiled", what, file, line,
                  static_cast<const void*>(map));
    if (f.rank != 2)
      fiber_fault(w, "%s (%s:%d): the tensor map has rank %u, not 2", what, file, line, f.rank);
    const std::uint32_t base = shared_window_address(w, shared, what, file, line);
    if (base % 128 != 0)
      fiber_fault(w, "%s (%s:%d): the shared destination %p (shared address %u) is not 128-byte aligned", what,
                  file, line, shared, base);
    const unsigned size = f.element_bytes, bytes = f.box[0] * f.box[1] * size;
    if (base - kDynamicSharedAddress + bytes > tls_dynamic_shared_bytes)
      fiber_fault(w, "%s (%s:%d): the box's %u bytes at shared address %u end past the block's %zu bytes of dynamic "
                  "shared memory", what, file, line, bytes, base, tls_dynamic_shared_bytes);
    MbarrierState::Copy copy{shared, nullptr, bytes, std::vector<std::uint32_t>(bytes / 4)};
    unsigned char* staged = reinterpret_cast<unsigned char*>(copy.staged.data());
    const int bits = static_cast<int>(f.swizzle);  // none 0, 32B 1, 64B 2, 128B 3: Swizzle<bits, 4, 3>
    for (cuuint32_t j = 0; j < f.box[1]; ++j)
      for (cuuint32_t i = 0; i < f.box[0]; ++i) {
        const long long gx = static_cast<long long>(x) + i, gy = static_cast<long long>(y) + j;
        const std::uint32_t dense = base + (j * f.box[0] + i) * size;
        unsigned char* to = staged + (swizzled(dense, bits) - base);
        const bool inside = gx >= 0 && gy >= 0 && static_cast<cuuint64_t>(gx) < f.dims[0] &&
                            static_cast<cuuint64_t>(gy) < f.dims[1];
        for (unsigned b = 0; b < size; ++b)
          to[b] = inside ? f.address[static_cast<cuuint64_t>(gy) * f.strides[1] + static_cast<cuuint64_t>(gx) * size + b]
                         : 0;
        if (!inside && f.nan_fill) {  // a quiet NaN of the element's width: all ones but the sign
          for (unsigned b = 0; b < size; ++b) to[b] = 0xFF;
          to[size - 1] = 0x7F;
        }
      }
    mbarrier_state(w, bar, what, file, line).copies.push_back(std::move(copy));
  }
  mbarrier_settle(w, bar, what, file, line);
}
