// A naive float32 batched matmul as an XLA FFI handler (CPU): out[b] = a[b] @ b[b].
//
// a: f32[..., M, K], b: f32[..., K, N] with equal leading (batch) dims; out: f32[..., M, N].
// Accumulates in float32 in the order k = 0..K-1, one output element at a time (i, k, j loops).
// Built by peat_jax.kernels.ffi.build_ffi_library; exported symbol: NaiveMatmul.
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

std::string ShapeString(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

ffi::Error NaiveMatmulImpl(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                           ffi::ResultBuffer<ffi::F32> out) {
  auto ad = a.dimensions();
  auto bd = b.dimensions();
  auto od = out->dimensions();
  const size_t rank = ad.size();
  if (rank < 2 || bd.size() != rank || od.size() != rank) {
    return ffi::Error::InvalidArgument("NaiveMatmul: a, b and out need the same rank >= 2, got " +
                                       ShapeString(ad) + " x " + ShapeString(bd));
  }
  int64_t batch = 1;
  for (size_t i = 0; i + 2 < rank; ++i) {
    if (ad[i] != bd[i] || ad[i] != od[i]) {
      return ffi::Error::InvalidArgument("NaiveMatmul: batch dims differ: " + ShapeString(ad) +
                                         " x " + ShapeString(bd));
    }
    batch *= ad[i];
  }
  const int64_t m = ad[rank - 2], k = ad[rank - 1], n = bd[rank - 1];
  if (bd[rank - 2] != k || od[rank - 2] != m || od[rank - 1] != n) {
    return ffi::Error::InvalidArgument("NaiveMatmul: incompatible shapes " + ShapeString(ad) +
                                       " x " + ShapeString(bd) + " -> " + ShapeString(od));
  }
  const float* A = a.typed_data();
  const float* B = b.typed_data();
  float* C = out->typed_data();
  for (int64_t g = 0; g < batch; ++g) {
    const float* Ag = A + g * m * k;
    const float* Bg = B + g * k * n;
    float* Cg = C + g * m * n;
    for (int64_t i = 0; i < m * n; ++i) Cg[i] = 0.0f;
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t kk = 0; kk < k; ++kk) {
        const float aik = Ag[i * k + kk];
        for (int64_t j = 0; j < n; ++j) Cg[i * n + j] += aik * Bg[kk * n + j];
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(NaiveMatmul, NaiveMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
