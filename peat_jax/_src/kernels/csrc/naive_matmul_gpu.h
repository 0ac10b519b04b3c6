// The GPU build of the bundled matmul, shared by naive_matmul.cu (CUDA, nvcc) and
// naive_matmul.hip (ROCm, hipcc): a tiled float32 batched matmul as XLA FFI handlers,
// out[b] = a[b] @ b[b].
//
// a: f32[..., M, K], b: f32[..., K, N] with equal leading (batch) dims; out: f32[..., M, N].
// One kTile x kTile thread block per output tile; A and B tiles staged through shared memory
// along K (the last partial tiles zero-padded); float32 accumulation in the order k = 0..K-1
// (the compiler contracts it into FMAs). Launched on the stream XLA passes.
// Exported symbols: NaiveMatmul, and NaiveMatmulTileBug, the same with a seeded bug: the row bound
// is the full-tile count times kTile, so the rows of a last partial row tile are never written
// (the output is zeroed first, so they read as zeros), as in naive_matmul.cc.
//
// The including file first includes its runtime's header and defines, in namespace peat::gpu,
// what differs between the two runtimes: `Stream` (the stream type XLA passes), `Status`,
// `kSuccess`, `MemsetAsync`, `GetLastError`, `ErrorString` and `kRuntime` (the name error
// messages give). The kernel itself (`__global__`, `__shared__`, `<<<...>>>`) is the same source
// for nvcc and hipcc.
#ifndef PEAT_NAIVE_MATMUL_GPU_H_
#define PEAT_NAIVE_MATMUL_GPU_H_

#include <algorithm>
#include <cstdint>
#include <string>

#include "naive_matmul.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kT = static_cast<int>(peat::kTile);
constexpr int64_t kMaxGridYZ = 65535;

// C[g] = A[g] @ B[g] for g = blockIdx.z, blockIdx.z + gridDim.z, ...; rows >= `rows` of C are
// not written.
__global__ void TiledMatmul(const float* __restrict__ A, const float* __restrict__ B,
                            float* __restrict__ C, int64_t batch, int64_t m, int64_t k,
                            int64_t n, int64_t rows) {
  __shared__ float As[kT][kT];
  __shared__ float Bs[kT][kT];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t row = static_cast<int64_t>(blockIdx.y) * kT + ty;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kT + tx;
  for (int64_t g = blockIdx.z; g < batch; g += gridDim.z) {
    const float* Ag = A + g * m * k;
    const float* Bg = B + g * k * n;
    float acc = 0.0f;
    for (int64_t t = 0; t < k; t += kT) {
      As[ty][tx] = (row < m && t + tx < k) ? Ag[row * k + t + tx] : 0.0f;
      Bs[ty][tx] = (t + ty < k && col < n) ? Bg[(t + ty) * n + col] : 0.0f;
      __syncthreads();
      const int len = static_cast<int>(k - t < kT ? k - t : kT);
      for (int i = 0; i < len; ++i) acc += As[ty][i] * Bs[i][tx];
      __syncthreads();
    }
    if (row < rows && col < n) C[g * m * n + row * n + col] = acc;
  }
}

std::string Where() { return std::string("NaiveMatmul (") + peat::gpu::kRuntime + "): "; }

ffi::Error RuntimeError(const char* what, peat::gpu::Status err) {
  return ffi::Error::Internal(Where() + what + ": " + peat::gpu::ErrorString(err));
}

template <bool kTileBug>
ffi::Error NaiveMatmulGpu(peat::gpu::Stream stream, ffi::Buffer<ffi::F32> a,
                          ffi::Buffer<ffi::F32> b, ffi::ResultBuffer<ffi::F32> out) {
  peat::MatmulShape s;
  ffi::Error status = peat::CheckMatmulShapes(a.dimensions(), b.dimensions(), out->dimensions(), &s);
  if (!status.success()) return status;
  if (s.batch == 0 || s.m == 0 || s.n == 0) return ffi::Error::Success();
  const int64_t tiles_m = (s.m + kT - 1) / kT, tiles_n = (s.n + kT - 1) / kT;
  if (tiles_m > kMaxGridYZ) {
    return ffi::Error::InvalidArgument(Where() + "M = " + std::to_string(s.m) + " exceeds " +
                                       std::to_string(kMaxGridYZ * kT) + " rows");
  }
  float* C = out->typed_data();
  if (kTileBug) {
    peat::gpu::Status err =
        peat::gpu::MemsetAsync(C, 0, sizeof(float) * s.batch * s.m * s.n, stream);
    if (err != peat::gpu::kSuccess) return RuntimeError("memset failed", err);
  }
  const dim3 block(kT, kT);
  const dim3 grid(static_cast<unsigned>(tiles_n), static_cast<unsigned>(tiles_m),
                  static_cast<unsigned>(std::min(s.batch, kMaxGridYZ)));
  TiledMatmul<<<grid, block, 0, stream>>>(a.typed_data(), b.typed_data(), C, s.batch, s.m, s.k,
                                          s.n, peat::RowsWritten(s.m, kTileBug));
  peat::gpu::Status err = peat::gpu::GetLastError();
  if (err != peat::gpu::kSuccess) return RuntimeError("kernel launch failed", err);
  return ffi::Error::Success();
}

}  // namespace

// The handlers' signature: the stream, a, b -> out.
static auto MatmulBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<peat::gpu::Stream>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Ret<ffi::Buffer<ffi::F32>>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(NaiveMatmul, NaiveMatmulGpu<false>, MatmulBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(NaiveMatmulTileBug, NaiveMatmulGpu<true>, MatmulBinding());

#endif  // PEAT_NAIVE_MATMUL_GPU_H_
