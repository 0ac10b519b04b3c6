// The bundled tiled float32 matmul as XLA FFI handlers, CUDA build (nvcc): the kernel and the
// handlers are in naive_matmul_gpu.h (shared with naive_matmul.hip); this file binds them to the
// CUDA runtime. Built by peat_jax.kernels.ffi.build_cuda_library; exported symbols: NaiveMatmul
// and NaiveMatmulTileBug (the seeded bug of naive_matmul.cc).
#include <cuda_runtime.h>

#include <cstddef>

namespace peat::gpu {
using Stream = cudaStream_t;
using Status = cudaError_t;
constexpr Status kSuccess = cudaSuccess;
constexpr const char* kRuntime = "CUDA";
inline Status MemsetAsync(void* p, int value, size_t bytes, Stream s) {
  return cudaMemsetAsync(p, value, bytes, s);
}
inline Status GetLastError() { return cudaGetLastError(); }
inline const char* ErrorString(Status err) { return cudaGetErrorString(err); }
}  // namespace peat::gpu

#include "naive_matmul_gpu.h"
