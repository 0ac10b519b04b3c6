// A naive float32 batched matmul as an XLA FFI handler (CPU): out[b] = a[b] @ b[b].
//
// a: f32[..., M, K], b: f32[..., K, N] with equal leading (batch) dims; out: f32[..., M, N].
// Accumulates in float32 in the order k = 0..K-1, one output element at a time (i, k, j loops).
// Built by peat_jax.kernels.ffi.build_ffi_library; exported symbols: NaiveMatmul, and
// NaiveMatmulTileBug, the same with a seeded bug (the rows of a last partial row tile of
// naive_matmul.h's kTile are never written: they stay zero), as in naive_matmul_gpu.h.
#include <cstdint>

#include "naive_matmul.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

template <bool kTileBug>
ffi::Error NaiveMatmulImpl(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                           ffi::ResultBuffer<ffi::F32> out) {
  peat::MatmulShape s;
  ffi::Error status = peat::CheckMatmulShapes(a.dimensions(), b.dimensions(), out->dimensions(), &s);
  if (!status.success()) return status;
  const int64_t m = s.m, k = s.k, n = s.n, rows = peat::RowsWritten(m, kTileBug);
  const float* A = a.typed_data();
  const float* B = b.typed_data();
  float* C = out->typed_data();
  for (int64_t g = 0; g < s.batch; ++g) {
    const float* Ag = A + g * m * k;
    const float* Bg = B + g * k * n;
    float* Cg = C + g * m * n;
    for (int64_t i = 0; i < m * n; ++i) Cg[i] = 0.0f;
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t kk = 0; kk < k; ++kk) {
        const float aik = Ag[i * k + kk];
        for (int64_t j = 0; j < n; ++j) Cg[i * n + j] += aik * Bg[kk * n + j];
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

// The handlers' signature: a, b -> out.
static auto MatmulBinding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Ret<ffi::Buffer<ffi::F32>>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(NaiveMatmul, NaiveMatmulImpl<false>, MatmulBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(NaiveMatmulTileBug, NaiveMatmulImpl<true>, MatmulBinding());
