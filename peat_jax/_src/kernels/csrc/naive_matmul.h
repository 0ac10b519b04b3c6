// Shared by naive_matmul.cc (CPU) and naive_matmul_gpu.h (CUDA and ROCm): the operand checks,
// the tile size and which output rows each variant writes, so that every build computes the same
// thing.
//
// a: f32[..., M, K], b: f32[..., K, N] with equal leading (batch) dims; out: f32[..., M, N].
#ifndef PEAT_NAIVE_MATMUL_H_
#define PEAT_NAIVE_MATMUL_H_

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace peat {

namespace ffi = xla::ffi;

// The output tile (rows and columns) of the GPU kernel; the seeded bug is defined by it on
// every platform.
constexpr int64_t kTile = 16;

struct MatmulShape {
  int64_t batch = 1, m = 0, k = 0, n = 0;
};

inline std::string ShapeString(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

// Checks the operand and result shapes; on success fills `shape`.
inline ffi::Error CheckMatmulShapes(ffi::Span<const int64_t> ad, ffi::Span<const int64_t> bd,
                                    ffi::Span<const int64_t> od, MatmulShape* shape) {
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
  *shape = MatmulShape{batch, m, k, n};
  return ffi::Error::Success();
}

// The rows of the output a variant writes: all M, or, with the seeded tile bug, only the full
// row tiles (the bound is taken as the tile count times the tile, so the rows of a last
// partial tile are never written and stay zero).
constexpr int64_t RowsWritten(int64_t m, bool tile_bug) {
  return tile_bug ? (m / kTile) * kTile : m;
}

}  // namespace peat

#endif  // PEAT_NAIVE_MATMUL_H_
