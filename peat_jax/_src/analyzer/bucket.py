"""Host side: the padded layouts ("buckets") that let small leaves of every shape share one
compiled `device.shape_program`.

A float leaf of at most two dimensions whose 2-D view (R, C) fits in T elements (T: the
largest power of two not above the sample size, so the padded leaf is still its own whole
sample) is analysed as an array of shape (T // C', C'), C' = max(`MIN_COLS`, the power of two
>= C): the leaf in its top-left R x C corner, the rest padding. The candidate and the golden
are padded with the same NaN and the float64 reference with NaN (equal NaNs are neither
mismatched nor finite, so no statistic counts them), the conditioning spread with 0; (R, C)
go in as traced int32 scalars. So a leaf compiles the analyzer once per (C', dtypes, options):
every leaf up to 64 columns and 128 rows shares one program, and a kernel author's next shape
compiles nothing (a shape's own program costs ~1-2 s of CPU; one run on a bucket, a few ms).

`unpad` maps what comes back (in the padded array's coordinates) to the leaf's.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from peat_jax._src.analyzer.contract import LeafStats, view2d


MIN_COLS = 64
"""The narrowest bucket: leaves up to this many columns share one."""


class Bucket(NamedTuple):
    """A leaf's (rows, cols) in its 2-D view and the padded array's (padded_rows,
    padded_cols)."""

    rows: int
    cols: int
    padded_rows: int
    padded_cols: int


def bucket_of(shape, dtype, sample_size: int) -> Optional[Bucket]:
    """The `Bucket` of a leaf of `shape` and float `dtype`, or None when it is analysed as it is
    (more than two dimensions, too large for the sample, or a format without NaN)."""
    if len(shape) > 2 or not np.isnan(np.asarray(np.nan, dtype)):
        return None
    rows, cols, _, _ = view2d(tuple(shape))
    total = 1 << (int(sample_size).bit_length() - 1)
    padded_cols = max(MIN_COLS, 1 << max(cols - 1, 0).bit_length())
    if padded_cols > total or rows > total // padded_cols:
        return None
    return Bucket(rows=rows, cols=cols, padded_rows=total // padded_cols,
                  padded_cols=padded_cols)


def pad(x, bucket: Bucket, fill) -> np.ndarray:
    """`x` (the leaf, any array) in the top-left corner of the bucket's array, `fill` elsewhere
    (host numpy, `x`'s dtype)."""
    x = np.asarray(x)
    out = np.full((bucket.padded_rows, bucket.padded_cols), fill, x.dtype)
    out[:bucket.rows, :bucket.cols] = x.reshape(bucket.rows, bucket.cols)
    return out


def unpad(stats: LeafStats, bucket: Bucket) -> LeafStats:
    """`stats` of a bucket's padded array (host values) in the leaf's own coordinates: the
    row and column profiles cut to the leaf, the worst elements' flat indices the leaf's."""
    st, w = stats.structure, stats.worst
    index = np.asarray(w.index)
    row, col = index // bucket.padded_cols, index % bucket.padded_cols
    leaf_index = np.where(index >= 0, row * bucket.cols + col, index).astype(index.dtype)
    return stats._replace(
        structure=st._replace(profile_cols=np.asarray(st.profile_cols)[:bucket.cols],
                              profile_rows=np.asarray(st.profile_rows)[:bucket.rows]),
        worst=w._replace(index=leaf_index))

