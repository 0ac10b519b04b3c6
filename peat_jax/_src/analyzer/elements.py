"""Device side: the per-element error, noise floor and significance every stage shares.

`leaf_scales` computes the leaf-wide quantities the floor needs (the golden's rms and, with a
float64 reference, its own error per row and column); `elements` computes, for any subset of the
leaf, each element's error, floor and whether it is significant. Every stage recomputes
`elements` on what it reads rather than storing it: XLA fuses it into the stage's own pass.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax.numpy as jnp
import numpy as np
from jax import lax

from peat_jax._src.analyzer.bits import (Decoded, decode, nonneg_key, ranks, take, ulp_distance,
                                         values)
from peat_jax._src.analyzer.contract import Options, view2d
from peat_jax._src.formats import FloatFormat, ulp_of_magnitude, ulp_of_value
from peat_jax._src.sums import vreduce


_THIN = 32
"""Rows / columns shorter than this give no reliable per-column / per-row maximum."""


def i32(m):
    """A mask as int32 (0 / 1), to be counted."""
    return m.astype(jnp.int32)


def sample_index(n: int, size: int) -> Optional[np.ndarray]:
    """Flat indices of the deterministic strided sample (None: the whole leaf). The stride is
    odd, so the sample visits every column of a power-of-two-wide matrix."""
    if n <= size:
        return None
    stride = n // size
    if stride % 2 == 0:
        stride -= 1
    return np.arange(size, dtype=np.int64) * stride


class Scales(NamedTuple):
    """Leaf-wide quantities the per-element floor needs (device values, output units).

    With a float64 reference, `E_row` / `E_col` are the golden's worst absolute error in each row
    / column of the 2-D view; the local scale of an element is the smaller of its row's and its
    column's (`local_scale`). With the rounding spread of the reference's Monte Carlo samples,
    `M_row` / `M_col` are the largest of the golden's and the samples' (`leaf_scales`).
    """

    rms: Any                # rms of the finite golden values (sample)
    abs_floor: Any          # largest absolute part of the floor
    E: Any = None           # the golden's worst absolute error (reference only)
    U: Any = None           # the golden's worst ULP error, ULPs (reference only)
    E_row: Any = None
    E_col: Any = None
    U90: Any = None         # 90th percentile of the golden's ULP error (sample), ULPs
    K: Any = None           # the conditioning spread, (R, C) view, float64 (given only)
    rows: Any = None        # the leaf's rows R and columns C in its 2-D view: ints, or traced
    cols: Any = None        #   int32 when the leaf is padded into a bucket (`analyzer.bucket`)
    M_row: Any = None       # E_row / E_col with the samples' errors (rounding spread only)
    M_col: Any = None


class Local(NamedTuple):
    """The local absolute scales of the floor at some elements (output units, float64)."""

    noise: Any                # E_loc: the golden's own error scale (`local_scale`)
    conditioning: Any = None  # K: the float64 reference's spread under 1-ULP input
    #                           perturbations (None: not given)
    rounding: Any = None      # E_loc over the golden's and the samples' errors (None: no
    #                           rounding spread given)


def _select(flag, a, b):
    """`a` where `flag`, else `b`: a Python branch for a static flag, `jnp.where` for a traced
    one (a bucket's extent is traced)."""
    if isinstance(flag, (bool, np.bool_)):
        return a() if flag else b()
    return jnp.where(flag, a(), b())


def _noise_scale(s: Scales, rows, cols, maxima=None):
    """`Local.noise` at elements (rows, cols) (`local_scale`), or `Local.rounding` when
    `maxima` is ``(s.M_row, s.M_col)``."""
    use_row, use_col = s.cols >= _THIN, s.rows >= _THIN
    E_row, E_col = (s.E_row, s.E_col) if maxima is None else maxima

    def row():
        return E_row[rows]

    def col():
        return E_col[cols]

    def leaf():   # the golden's own, samples or not: one element's rounding in a small
        # leaf is no measure of the others' (a bfloat16 matmul's 16 x 8 output took its
        # samples' largest as every element's scale, and a bfloat16 accumulator passed)
        return jnp.broadcast_to(s.E, jnp.shape(rows))

    return _select(use_row & use_col, lambda: jnp.minimum(row(), col()),
                   lambda: _select(use_row, row, lambda: _select(use_col, col, leaf)))


def local_scale(s: Scales, rows, cols) -> Local:
    """The `Local` scales at elements (rows, cols) of the 2-D view. The golden's own error
    scale is ``min(E_row[row], E_col[col])``; the row maximum alone when columns are shorter
    than 32, the column maximum alone when rows are, the leaf's maximum when both are (the
    maximum of fewer golden errors is too often small by luck). The conditioning spread is
    K's element there; `Local.rounding` the same minimum over `M_row` and `M_col`."""
    return Local(noise=_noise_scale(s, rows, cols),
                 conditioning=None if s.K is None else s.K[rows, cols],
                 rounding=_rounding_scale(s, rows, cols))


def _rounding_scale(s: Scales, rows, cols):
    """`Local.rounding` at elements (rows, cols), or None without samples."""
    return None if s.M_row is None else _noise_scale(s, rows, cols, (s.M_row, s.M_col))


def local_scale_2d(s: Scales, R: int, C: int) -> Optional[Local]:
    """`local_scale` for every element of the (R, C) array (the 2-D view, or a bucket's padded
    array; None without a reference)."""
    if s.E_row is None:
        return None
    rows = jnp.arange(R, dtype=jnp.int32)[:, None]
    cols = jnp.arange(C, dtype=jnp.int32)[None, :]
    rows, cols = jnp.broadcast_to(rows, (R, C)), jnp.broadcast_to(cols, (R, C))
    return Local(noise=_noise_scale(s, rows, cols), conditioning=s.K,
                 rounding=_rounding_scale(s, rows, cols))


def local_scale_flat(s: Scales, idx, n: int, R: int, C: int) -> Optional[Local]:
    """`local_scale` for the flat indices `idx` (None: all n elements) of an (R, C) array."""
    if s.E_row is None:
        return None
    flat = jnp.arange(n, dtype=jnp.int32) if idx is None else jnp.asarray(idx, jnp.int32)
    return local_scale(s, flat // C, flat % C)


def _rms(g, idx, f: FloatFormat):
    """Root mean square of the finite golden values of the sample, output units."""
    gs = values(take(g, idx), f)
    fin = ~decode(take(g, idx), f).nonfinite
    n = jnp.maximum(jnp.sum(i32(fin)), 1)
    # rms = m * sqrt(mean((g / m)**2)) with m = max|g|: squaring tiny values would underflow.
    m = jnp.max(jnp.where(fin, jnp.abs(gs), 0))
    m = jnp.where(m > 0, m, 1)
    return m * jnp.sqrt(jnp.sum(jnp.where(fin, (gs / m) ** 2, 0)) / n)


def leaf_scales(c, g, r, idx, options: Options, f: FloatFormat, k=None,
                extent=None, m=None) -> Scales:
    """The `Scales` of a leaf: `c`, `g` are `Operand`s, `r` the float64 reference or None,
    `k` the conditioning spread (float64, output units; only with `r`) or None, `idx` the
    sample's flat indices; `extent` the (rows, cols) of a bucket's leaf (traced int32; its
    arrays are padded with NaN beyond them), or None for a leaf as it is; `m` the rounding
    spread of the reference's Monte Carlo samples (float64, output units; only with `r`) or
    None.

    With `m`, `M_row` and `M_col` are the largest error in each row and column of the golden
    and of the samples: the golden is one rounding of the reference among them, and a row's
    largest error in one rounding is a lucky draw (a cross-entropy's gradient row holds one
    element near -1, p - 1 at the label, whose rounding sets the row's scale). They raise the
    floor's value only (`_floor`): which elements the conditioning floor governs, and so the
    distribution test's elements, stay as the golden's own errors set them."""
    rms = _rms(g, idx, f)
    R, C, _, _ = view2d(g.shape)
    rows, cols = (R, C) if extent is None else extent
    if r is None:
        return Scales(rms=rms, abs_floor=options.bound_coef * rms, rows=rows, cols=cols)
    rf = r.reshape(R, C).astype(jnp.float64)
    g2 = g.reshape(R, C)
    ok = ~decode(g2, f).nonfinite & jnp.isfinite(rf)
    e_g = jnp.where(ok, jnp.abs(values(g2, f).astype(jnp.float64) - rf), 0.0)
    u_g = e_g / ulp_of_value(rf, f)
    E_row, U_row = vreduce([e_g, u_g], ["max", "max"], (1,))
    E_col = jnp.max(e_g, axis=0)
    E, U = jnp.max(E_row), jnp.max(U_row)
    M_row = M_col = None
    if m is not None:   # the samples' spread where it and the reference are finite
        m64 = m.reshape(R, C).astype(jnp.float64)
        e_m = jnp.where(jnp.isfinite(rf) & jnp.isfinite(m64), jnp.abs(m64), 0.0)
        M_row = jnp.maximum(E_row, jnp.max(e_m, axis=1))
        M_col = jnp.maximum(E_col, jnp.max(e_m, axis=0))
    # 90th percentile of the golden's ULP error over the sample.
    us, oks = take(u_g, idx), take(ok, idx)
    key = jnp.sort(nonneg_key(us, oks))
    n_ok = jnp.sum(i32(oks))
    U90 = lax.bitcast_convert_type(key[ranks(n_ok, (0.9,), us.shape[0])[0]], jnp.float32)
    U90 = jnp.where(n_ok > 0, U90, 0.0).astype(jnp.float64)
    K = None
    if k is not None:   # a spread's magnitude; where it or the reference is not finite, none
        k64 = k.reshape(R, C).astype(jnp.float64)
        K = jnp.where(jnp.isfinite(rf) & jnp.isfinite(k64), jnp.abs(k64), 0.0)
    return Scales(rms=rms, abs_floor=options.noise_factor * E, E=E, U=U, E_row=E_row,
                  E_col=E_col, U90=U90, K=K, rows=rows, cols=cols, M_row=M_row, M_col=M_col)


class Elements(NamedTuple):
    """Per-element quantities shared by every stage (arrays of the input's shape)."""

    dc: Decoded         # the candidate's bit fields
    dg: Decoded         # the golden's
    mismatched: Any     # bit patterns differ (NaN vs NaN is a match)
    finite: Any         # finite in both
    cv: Any             # candidate values, compute dtype
    gv: Any             # golden values, compute dtype
    err_cg: Any         # |c - g|
    err: Any            # the error the floor applies to (|c - r| with a reference, else |c - g|)
    ulp: Any            # ULP of the golden's dtype at the element (at r with a reference)
    floor: Any          # the noise floor, output units
    ratio: Any          # err / floor (inf where not finite in both)
    significant: Any
    unjudged: Any       # candidate finite where the golden and the float64 reference are not
    flushed: Any        # golden subnormal, candidate +-0
    ulp_dist: Any       # ULP distance c vs g (unsigned)
    noise_bits: Any     # bit length of floor / ULP: differing bits below it may be noise
    conditioned: Any    # the conditioning floor is the larger (False without one)
    noise_floor: Any    # the floor without the conditioning floor, output units


class _Floor(NamedTuple):
    err: Any            # the error the floor applies to, output units
    ulp: Any            # the ULP of the golden's dtype there
    floor: Any          # max(noise floor, conditioning floor), output units
    noise_floor: Any    # the noise floor alone
    conditioned: Any    # the conditioning floor is the larger


def _floor(dg: Decoded, cv, err_cg, r, s: Scales, options: Options, f: FloatFormat,
           eloc: Optional[Local]) -> _Floor:
    """The `_Floor` of each element. With a float64 reference the noise floor is
    ``F * max(E_loc, U90 * ulp) + a * ulp`` and, with a conditioning spread K, the floor is
    ``F * max(E_loc, U90 * ulp, K) + a * ulp``: the larger of the noise floor and the
    conditioning floor ``F * K + a * ulp``; with Monte Carlo samples of the reference, E_loc
    takes its row and column maxima over their errors too (`Local.rounding`)."""
    if r is None:
        ulp = ulp_of_magnitude(jnp.abs(dg.mono), f)
        floor = jnp.maximum(options.ulp_allowance * ulp + s.abs_floor,
                            jnp.finfo(f.compute_dtype).tiny)
        return _Floor(err=err_cg, ulp=ulp, floor=floor, noise_floor=floor,
                      conditioned=jnp.zeros(jnp.shape(floor), bool))
    # Only the error against the float64 reference and its floor are float64.
    rf = r.astype(jnp.float64)
    err = jnp.abs(cv.astype(jnp.float64) - rf)
    ulp = ulp_of_value(rf, f)
    tiny = jnp.finfo(jnp.float64).tiny
    local = s.E if eloc is None else eloc.noise
    scale = jnp.maximum(local, s.U90 * ulp)
    noise = jnp.maximum(options.noise_factor * scale + options.ulp_allowance * ulp, tiny)
    cond = None if eloc is None else eloc.conditioning
    if cond is None:
        return _Floor(err=err, ulp=ulp, floor=noise, noise_floor=noise,
                      conditioned=jnp.zeros(jnp.shape(noise), bool))
    conditioned = cond > scale
    if eloc is not None and eloc.rounding is not None:   # the samples' row and column maxima
        scale = jnp.maximum(eloc.rounding, s.U90 * ulp)
    floor = jnp.maximum(options.noise_factor * jnp.maximum(scale, cond) +
                        options.ulp_allowance * ulp, tiny)
    return _Floor(err=err, ulp=ulp, floor=floor, noise_floor=noise, conditioned=conditioned)


def elements(c, g, r, s: Scales, options: Options, f: FloatFormat,
             eloc: Optional[Local] = None) -> Elements:
    """Per-element quantities of `Operand`s `c`, `g` (and the float64 reference `r` or None);
    `eloc` (reference only) holds the local scales of the floor at each element
    (`local_scale`)."""
    dc, dg = decode(c, f), decode(g, f)
    mismatched = (dc.pattern != dg.pattern) & ~(dc.nan & dg.nan)
    finite = ~dc.nonfinite & ~dg.nonfinite
    cv, gv = values(c, f), values(g, f)
    err_cg = jnp.abs(cv - gv)
    fl = _floor(dg, cv, err_cg, r, s, options, f, eloc)
    err, ulp, floor = fl.err, fl.ulp, fl.floor
    over = err > floor
    ratio = jnp.where(finite, err / floor, jnp.inf).astype(f.compute_dtype)
    golden_only_nf = dg.nonfinite & ~dc.nonfinite
    # a finite candidate where the golden is not: judged by the float64 reference, except where
    # that is not finite either (a naive reference's exp(x) past float64's range, inf / inf):
    # nothing judges it there
    unjudged = jnp.zeros_like(golden_only_nf) if r is None else (
        golden_only_nf & ~jnp.isfinite(r.astype(jnp.float64)))
    gold_nf_sig = golden_only_nf if r is None else (
        golden_only_nf & ~unjudged & (over | ~jnp.isfinite(err)))
    significant = mismatched & ((finite & over) | dc.nonfinite | gold_nf_sig)
    q = jnp.clip(jnp.floor(floor / ulp), 0, 2.0 ** 30).astype(jnp.int32)
    return Elements(dc=dc, dg=dg, mismatched=mismatched, finite=finite, cv=cv, gv=gv,
                    err_cg=err_cg, err=err, ulp=ulp, floor=floor, ratio=ratio,
                    significant=significant, unjudged=unjudged,
                    flushed=mismatched & dg.subnormal & dc.zero,
                    ulp_dist=ulp_distance(dc, dg, f),
                    noise_bits=(32 - lax.clz(q)).astype(jnp.int32),
                    conditioned=fl.conditioned, noise_floor=fl.noise_floor)
