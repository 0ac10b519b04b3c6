"""Device side: the stages that run only when significant errors exist (gated by `lax.cond`).

`structure` finds the worst elements and the row / column structure of the significant mask;
`permutation` checks whether the candidate holds the golden's values in other places. Both are
exact over the whole leaf.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from peat_jax._src._jax import x64_enabled
from peat_jax._src.analyzer.bits import decode, from_monotonic, operand_of_bits, values
from peat_jax._src.analyzer.contract import (Options, PermutationStats, StructureStats, WorstStats,
                                             view2d)
from peat_jax._src.analyzer.elements import (Elements, Scales, elements, i32, local_scale,
                                             local_scale_2d)
from peat_jax._src.analyzer.signature import N_WORST, PERMUTATION_MAX_ELEMENTS
from peat_jax._src.formats import FloatFormat, ulp_of_magnitude
from peat_jax._src.sums import vreduce


_FULL_SHARE = (9, 10)   # a row / column with this share of its elements wrong is "full"
_N_FULL_LISTED = 8


def no_detail(shape, f: FloatFormat, x64: bool, xp=np
              ) -> tuple[WorstStats, StructureStats, PermutationStats]:
    """What `structure` and `permutation` return for a leaf of `shape` and format `f` without
    significant errors: the worst elements' and the full rows' and columns' indices (empty
    slots) and the permutation checks -1, the rest 0, in the dtypes the stages compute with
    64-bit types as `x64` says (their sums of int32 follow it). `xp`: `jnp` in the stages'
    gated branches (`lax.cond` holds them to the dtypes and shapes the stages return), NumPy
    for a passing leaf on the host (`device.leaf_stats`: no detail program traced or run)."""
    R, C, _, R2 = view2d(shape)
    k = min(N_WORST, R * C)
    sums = np.int64 if x64 else np.int32

    def zeros(n, dtype, value=0):
        return xp.full(n, value, dtype)

    worst = WorstStats(
        index=zeros(k, np.int32, -1), score=zeros(k, np.float32),
        candidate_bits=zeros(k, f.wide_uint), golden_bits=zeros(k, f.wide_uint),
        candidate=zeros(k, f.compute_dtype), golden=zeros(k, f.compute_dtype),
        noise_bits=zeros(k, np.int32), floor=zeros(k, f.compute_dtype))
    struct = StructureStats(
        profile_cols=zeros(C, np.int32), profile_rows=zeros(R2, sums),
        rows_with_errors=zeros((), sums), cols_with_errors=zeros((), sums),
        full_rows=zeros(_N_FULL_LISTED, np.int32, -1),
        full_cols=zeros(_N_FULL_LISTED, np.int32, -1),
        n_full_rows=zeros((), sums), n_full_cols=zeros((), sums),
        in_full_rows=zeros((), sums), in_full_cols=zeros((), sums),
        rows_constant=zeros((), sums))
    return worst, struct, _not_checked(xp)


def _not_checked(xp) -> PermutationStats:
    """The permutation checks not run: -1 each (int32 scalars of `xp`)."""
    return PermutationStats(*(xp.full((), -1, np.int32) for _ in range(3)))


def _score(el: Elements):
    """Sort key of significant elements: error / floor, non-finite first, others -1."""
    score = jnp.where(el.significant, jnp.where(el.finite, el.ratio, jnp.inf), -1.0).astype(
        jnp.float32)
    return jnp.where(jnp.isnan(score), jnp.inf, score)


def _worst(c2, g2, r2, row_score, s: Scales, options: Options, f: FloatFormat,
           k_rows: int, k: int) -> WorstStats:
    """The top k elements, found among the k rows with the largest worst score (the top k
    elements lie in the top k rows), so no sort of the leaf."""
    R, C = c2.shape
    _, rows = lax.top_k(row_score, k_rows)
    rows = rows.astype(jnp.int32)
    eloc = None
    if s.E_row is not None:
        cols = jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32)[None, :], (k_rows, C))
        eloc = local_scale(s, jnp.broadcast_to(rows[:, None], (k_rows, C)), cols)
    sub = elements(c2.rows(rows), g2.rows(rows), None if r2 is None else r2[rows], s, options,
                   f, eloc)
    score, pos = lax.top_k(_score(sub).reshape(-1), k)

    def at(x):
        return x.reshape(-1)[pos]

    return WorstStats(
        index=(rows[pos // C] * C + pos % C).astype(jnp.int32), score=score,
        candidate_bits=at(sub.dc.pattern), golden_bits=at(sub.dg.pattern),
        candidate=at(sub.cv).astype(f.compute_dtype), golden=at(sub.gv).astype(f.compute_dtype),
        noise_bits=at(sub.noise_bits), floor=at(sub.floor).astype(f.compute_dtype))


def _dense_columns(c2, g2, r2, s: Scales, options: Options, f: FloatFormat):
    """(significant per column, per-row max and min of the ratio c / g over the values with
    |g| >= rms(g), NaN for a row with fewer than two of them: one value shows no constant
    ratio): whole-leaf passes (column reductions are slow on XLA:CPU), run only when the errors
    are too many to be all listed among the worst."""
    R, C = c2.shape
    el = elements(c2, g2, r2, s, options, f, local_scale_2d(s, R, C))
    rsel = el.finite & (jnp.abs(el.gv) >= s.rms) & ~el.dg.zero & ~el.dg.subnormal
    ratio = jnp.where(rsel, el.cv / jnp.where(rsel, el.gv, 1), 0).astype(jnp.float32)
    rmax, rmin, n = vreduce([jnp.where(rsel, ratio, -jnp.inf), jnp.where(rsel, ratio, jnp.inf),
                             i32(rsel)], ["max", "min", "sum"], (1,))
    col_cnt, _ = vreduce([i32(el.significant), i32(el.significant & el.dc.zero)],
                         ["sum", "sum"], (0,))
    return col_cnt, jnp.where(n >= 2, rmax, jnp.nan), rmin


def _sparse_columns(worst: WorstStats, R: int, C: int):
    """`_dense_columns` when every significant element is among the worst: columns counted from
    them, no ratio ranges."""
    listed = (worst.score >= 0).astype(jnp.int32)
    col = jnp.zeros((C,), jnp.int32).at[worst.index % C].add(listed)
    nan = jnp.full((R,), jnp.nan, jnp.float32)
    return col, nan, nan


def _full(n):
    """Errors that make a row / column of n elements "full": ceil(9 n / 10), in integers (n may
    be traced)."""
    num, den = _FULL_SHARE
    return -((-num * n) // den)


def _summary(row_cnt, col_cnt, rmax, rmin, rel_tol, shape, rows, cols) -> StructureStats:
    """The `StructureStats` of per-row / per-column significant counts and ratio ranges of an
    array of `shape` whose first `rows` x `cols` elements are the leaf's (a bucket's padding
    beyond them holds no error)."""
    _, _, lead, R2 = view2d(shape)
    full_r = (row_cnt >= _full(cols)) & (cols >= 2)
    full_c = (col_cnt >= _full(rows)) & (rows >= 2)
    has = row_cnt > 0
    scale = jnp.maximum(jnp.abs(rmax), jnp.abs(rmin))
    const = has & jnp.isfinite(rmax) & (rmax - rmin <= rel_tol * scale) & \
        (jnp.abs(0.5 * (rmax + rmin) - 1) > rel_tol)
    return StructureStats(
        profile_cols=col_cnt, profile_rows=row_cnt.reshape(lead, R2).sum(axis=0),
        rows_with_errors=jnp.sum(i32(has)), cols_with_errors=jnp.sum(i32(col_cnt > 0)),
        full_rows=jnp.nonzero(full_r, size=_N_FULL_LISTED, fill_value=-1)[0].astype(jnp.int32),
        full_cols=jnp.nonzero(full_c, size=_N_FULL_LISTED, fill_value=-1)[0].astype(jnp.int32),
        n_full_rows=jnp.sum(i32(full_r)), n_full_cols=jnp.sum(i32(full_c)),
        in_full_rows=jnp.sum(jnp.where(full_r, row_cnt, 0)),
        in_full_cols=jnp.sum(jnp.where(full_c, col_cnt, 0)),
        rows_constant=jnp.sum(i32(const)))


def structure(c, g, r, s: Scales, options: Options, f: FloatFormat, n_sig, rel_tol,
              row_cnt) -> tuple[WorstStats, StructureStats]:
    """The worst elements and the structure of the significant mask of `Operand`s `c`, `g` (and
    the float64 reference `r` or None); all -1 / zero when `n_sig` (traced) is 0. `row_cnt`:
    the significant elements of each row of the 2-D view (int32 [R], from the whole-leaf pass).

    When the significant elements are few enough to be all listed among the worst, they lie in
    the rows `row_cnt` marks, which alone are read again: no other pass over the leaf. Else
    one pass reduces each row's worst score, and a second counts the columns.
    """
    R, C, _, _ = view2d(c.shape)
    k = min(N_WORST, R * C)

    def run(_):
        c2, g2 = c.reshape(R, C), g.reshape(R, C)
        r2 = None if r is None else r.reshape(R, C)

        def dense_rows(_):
            el = elements(c2, g2, r2, s, options, f, local_scale_2d(s, R, C))
            return vreduce([_score(el)], ["max"], (1,))[0]

        def sparse_rows(_):   # at most k rows hold errors: any order of them finds them all
            return jnp.where(row_cnt > 0, 1.0, -1.0).astype(jnp.float32)

        row_score = lax.cond(n_sig > k, dense_rows, sparse_rows, None)
        worst = _worst(c2, g2, r2, row_score, s, options, f, min(N_WORST, R), k)

        def dense(_):
            return _dense_columns(c2, g2, r2, s, options, f)

        def sparse(_):
            return _sparse_columns(worst, R, C)

        col_cnt, rmax, rmin = lax.cond(n_sig > k, dense, sparse, None)
        return worst, _summary(row_cnt, col_cnt, rmax, rmin, rel_tol, c.shape, s.rows, s.cols)

    def empty(_):
        return no_detail(c.shape, f, x64_enabled(), jnp)[:2]

    return lax.cond(n_sig > 0, run, empty, None)


def permutation(c, g, r, s: Scales, options: Options, f: FloatFormat, n_sig) -> PermutationStats:
    """Sorted-equality and transpose checks of `Operand`s `c`, `g` (gated by `n_sig`; leaves up
    to `PERMUTATION_MAX_ELEMENTS`, -1 otherwise)."""
    not_checked = _not_checked(jnp)
    if c.size > PERMUTATION_MAX_ELEMENTS:
        return not_checked
    if isinstance(s.rows, int):   # the leaf as it is
        square = c.ndim >= 2 and c.shape[-1] == c.shape[-2] and c.shape[-1] > 1
        m = c.shape[-1] if square else 0
    else:                         # a bucket (2-D): a square leaf is the top-left m x m corner
        m = min(c.shape)
        square = (s.rows == s.cols) & (s.cols > 1)
    abs_floor = s.abs_floor if r is None else options.noise_factor * s.E
    cdt = f.compute_dtype if r is None else jnp.float64

    def beyond(a, b):
        """Count of positions where a differs from b beyond a floor set at b."""
        da, db = decode(a, f), decode(b, f)
        fin = ~da.nonfinite & ~db.nonfinite
        ulp = ulp_of_magnitude(jnp.abs(db.mono), f).astype(cdt)
        floor = options.ulp_allowance * ulp + abs_floor
        err = jnp.abs(values(a, f).astype(cdt) - values(b, f).astype(cdt))
        bad = jnp.where(fin, err > floor, (da.pattern != db.pattern) & ~(da.nan & db.nan))
        return jnp.sum(i32(bad))

    def sorted_mono(x):
        d = decode(x.reshape(-1), f)
        return jnp.sort(jnp.where(d.nan, jnp.iinfo(f.wide_int).max, d.mono))

    def as_operand(mono):
        return operand_of_bits(from_monotonic(mono, f), f)

    def run(_):
        mc, mg = sorted_mono(c), sorted_mono(g)
        tr = jnp.asarray(-1, jnp.int32)
        if square is not False:
            corner = (..., slice(0, m), slice(0, m))
            tr = jnp.where(square, beyond(c.sub(corner), g.sub(corner).swapaxes(-1, -2)), tr)
        return PermutationStats(
            beyond_floor=beyond(as_operand(mc), as_operand(mg)).astype(jnp.int32),
            sorted_differ=jnp.sum(i32(mc != mg)).astype(jnp.int32),
            transpose_beyond=jnp.asarray(tr, jnp.int32))

    return lax.cond(n_sig > 0, run, lambda _: not_checked, None)
