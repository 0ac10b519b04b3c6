"""Float64 evidence: what the detector's float64 rules read about a failing output (the
candidate's own run in float64 beside the reference's), and the differences they are made of."""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from peat_jax._src.detector import Float64Evidence

NO_WIDER = ("returns float64 already: its float64 evaluation is the golden itself, no truth to "
            "measure the golden's rounding against")
"""Why a float64 output has no float64 reference: judged by the dtype bound instead (a floor of
0 there calls any other correct rounding an error); `check_kernel` and `judge_site` say so."""


def float64_evidence(candidate, reference, reference64, candidate64) -> Float64Evidence:
    """What `detector.by_float64` reads about one output (arrays or pytrees of one structure):
    the candidate's value, the reference's in the same dtype, the float64 reference's and the
    candidate's run on the same inputs in float64. Errors are max |differences| in output
    units over the elements where the float64 reference is finite (elsewhere nothing judges
    them: the analyzer's unjudged elements); the reference's own error over those where it is
    finite too (its overflow in its dtype would excuse anything). The scale is max |float64
    reference| over its finite elements. The float64 run counts as one (`in_float64`) where
    some value of it lies off the grid of the candidate's dtype, or of float32 for a narrower
    dtype: a bfloat16 kernel that computes in float32 inside (keras' ops do under
    `jax.enable_x64`: they read jax's global flag) returns float32 values from float64 inputs,
    which say nothing of its algorithm in float64."""
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(reference64)]
    finite = [x[np.isfinite(x)] for x in leaves]
    scale = max((float(np.abs(x).max()) for x in finite if x.size), default=0.0)
    dtype = str(jnp.result_type(jax.tree.leaves(candidate)[0]))
    judged = [np.isfinite(x) for x in leaves]
    own = [m & np.isfinite(np.asarray(g, np.float64))
           for m, g in zip(judged, jax.tree.leaves(reference))]
    return Float64Evidence(
        dtype=dtype, error=max_difference(candidate, reference64, judged),
        error64=max_difference(candidate64, reference64, judged), scale=scale,
        reference_error=max_difference(reference, reference64, own),
        in_float64=beyond_grid(candidate64, str(jnp.promote_types(dtype, jnp.float32))))


def beyond_grid(tree, dtype: str) -> bool:
    """Some finite value of `tree` is not representable in `dtype` (a float64 run that
    computed beyond it)."""
    for x in jax.tree.leaves(tree):
        x = np.asarray(x, np.float64)
        x = x[np.isfinite(x)]
        with np.errstate(over="ignore"):
            if np.any(x.astype(dtype).astype(np.float64) != x):
                return True
    return False


def max_difference(a, b, where=None) -> float:
    """max |a - b| over the float leaves of two pytrees (inf where the NaN patterns differ;
    0.0 when they are bitwise equal); `where`: one boolean mask per leaf, the elements compared
    (None: all)."""
    worst = 0.0
    masks = itertools.repeat(None) if where is None else where
    for x, y, m in zip(jax.tree.leaves(a), jax.tree.leaves(b), masks):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if x.shape != y.shape:
            return float("inf")
        if m is not None:
            x, y = x[m], y[m]
        nan_x, nan_y = np.isnan(x), np.isnan(y)
        if np.any(nan_x != nan_y):
            return float("inf")
        with np.errstate(invalid="ignore"):
            d = np.where((x == y) | (nan_x & nan_y), 0.0, np.abs(x - y))
        d = np.where(np.isnan(d), np.inf, d)  # inf vs -inf
        worst = max(worst, float(d.max()) if d.size else 0.0)
    return worst
