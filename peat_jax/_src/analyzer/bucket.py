"""Host side: the padded layouts ("buckets") that let small leaves of every shape share one
compiled `device.shape_program`.

A float leaf whose 2-D view (R, C: the leading axes flattened into rows) fits in T elements (T:
the largest power of two not above the sample size, so the padded leaf is still its own whole
sample) is analysed as an array of shape (T // C', C'), C' = max(`MIN_COLS`, the power of two
>= C): the leaf's 2-D view in its top-left R x C corner, the rest padding. A leaf of more than
two dimensions is bucketed only where neither its last two axes nor its 2-D view are square: its
transpose check runs per slice of the leading axes, which one program for every shape cannot do
(a square 2-D leaf's runs on the bucket's corner). The candidate and the golden
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
    """A leaf's (rows, cols) in its 2-D view, the padded array's (padded_rows, padded_cols),
    and the leaf's leading axes flattened (`lead`: rows is lead x its axis -2)."""

    rows: int
    cols: int
    padded_rows: int
    padded_cols: int
    lead: int = 1


def bucket_of(shape, dtype, sample_size: int) -> Optional[Bucket]:
    """The `Bucket` of a leaf of `shape` and float `dtype`, or None when it is analysed as it is
    (too large for the sample, a format without NaN, or more than two dimensions with square
    last axes or a square 2-D view)."""
    if not np.isnan(np.asarray(np.nan, dtype)):
        return None
    rows, cols, lead, rows_2 = view2d(tuple(shape))
    if len(shape) > 2 and (rows_2 == cols or rows == cols):
        return None
    total = 1 << (int(sample_size).bit_length() - 1)
    padded_cols = max(MIN_COLS, 1 << max(cols - 1, 0).bit_length())
    if padded_cols > total or rows > total // padded_cols:
        return None
    return Bucket(rows=rows, cols=cols, padded_rows=total // padded_cols,
                  padded_cols=padded_cols, lead=lead)


def pad(x, bucket: Bucket, fill) -> np.ndarray:
    """`x` (the leaf, any array) in the top-left corner of the bucket's array, `fill` elsewhere
    (host numpy, `x`'s dtype)."""
    x = np.asarray(x)
    out = np.full((bucket.padded_rows, bucket.padded_cols), fill, x.dtype)
    out[:bucket.rows, :bucket.cols] = x.reshape(bucket.rows, bucket.cols)
    return out


def unpad(stats: LeafStats, bucket: Bucket) -> LeafStats:
    """`stats` of a bucket's padded array (host values) in the leaf's own coordinates: the
    row and column profiles cut to the leaf (the rows' summed over the leading axes, as
    `structure` sums a leaf's own), the worst elements' flat indices the leaf's."""
    st, w = stats.structure, stats.worst
    index = np.asarray(w.index)
    row, col = index // bucket.padded_cols, index % bucket.padded_cols
    leaf_index = np.where(index >= 0, row * bucket.cols + col, index).astype(index.dtype)
    rows = np.asarray(st.profile_rows)[:bucket.rows]
    return stats._replace(
        structure=st._replace(profile_cols=np.asarray(st.profile_cols)[:bucket.cols],
                              profile_rows=rows.reshape(bucket.lead, -1).sum(0, rows.dtype)),
        worst=w._replace(index=leaf_index))

