// The bundled tiled float32 matmul as XLA FFI handlers, ROCm build (hipcc): the kernel and the
// handlers are in naive_matmul_gpu.h (shared with naive_matmul.cu); this file binds them to the
// HIP runtime (XLA passes a hipStream_t on ROCm). Built by
// peat_jax.kernels.ffi.build_rocm_library; exported symbols: NaiveMatmul and NaiveMatmulTileBug
// (the seeded bug of naive_matmul.cc).
#include <hip/hip_runtime.h>

#include <cstddef>

namespace peat::gpu {
using Stream = hipStream_t;
using Status = hipError_t;
constexpr Status kSuccess = hipSuccess;
constexpr const char* kRuntime = "ROCm";
inline Status MemsetAsync(void* p, int value, size_t bytes, Stream s) {
  return hipMemsetAsync(p, value, bytes, s);
}
inline Status GetLastError() { return hipGetLastError(); }
inline const char* ErrorString(Status err) { return hipGetErrorString(err); }
}  // namespace peat::gpu

#include "naive_matmul_gpu.h"
