"""`analyze`: checks its arguments, runs the device statistics of each leaf on one device and
builds the `Signature` on the host."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from peat_jax._src.analyzer.bucket import bucket_of, pad, unpad
from peat_jax._src.analyzer.build import build_signature, nonfloat_signature
from peat_jax._src.analyzer.contract import Options
from peat_jax._src.analyzer.device import leaf_stats, nonfloat_stats
from peat_jax._src.analyzer.noise import (DEFAULT_NOISE_FACTOR, DTYPE_ULP_ALLOWANCE,
                                          REFERENCE_ULP_ALLOWANCE, analyzed_format,
                                          dtype_noise_bound, rounding_floor)
from peat_jax._src.analyzer.signature import BLOCK_SIZES, DEFAULT_SAMPLE_SIZE, Signature
from peat_jax._src.errors import PeatError


def analyze(candidate, golden, reference64=None, *, reduction_length: Optional[int] = None,
            noise_factor: float = DEFAULT_NOISE_FACTOR, ulp_allowance: Optional[float] = None,
            comparison: str = "golden", sample_size: int = DEFAULT_SAMPLE_SIZE,
            conditioning=None, rounding=None) -> Signature:
    """Statistics of `candidate` against `golden` (arrays or pytrees of the same structure).

    Args:
      candidate: the output of the kernel under test (array or pytree of arrays).
      golden: the reference output, same structure, shapes and dtypes.
      reference64: optional float64 evaluation of the same op (same structure): sets the noise
        floor from the golden's own error (see `NoiseFloor`). Computed under
        `jax.enable_x64`; floats of any dtype are accepted and cast to float64.
      reduction_length: K, the op's reduction length (elements summed into one output
        element; 1 for elementwise ops). Without a float64 reference, the dtype bound's K
        (default: `DEFAULT_REDUCTION_LENGTH`); with one, how far rounding at the tensor's scale
        reaches for the detector (``F * sqrt(K)`` ULPs at the golden's rms, see `NoiseFloor`;
        default: none, F ULPs). `peat.check_kernel` reads it from the reference's program.
      noise_factor: F (default 4).
      ulp_allowance: a, in ULPs of the golden's dtype (default: `REFERENCE_ULP_ALLOWANCE` = 2
        with a float64 reference, `DTYPE_ULP_ALLOWANCE` otherwise).
      comparison: "golden", or "repeat" when `golden` is an earlier run of the same candidate
        (the runs are compared directly, with the dtype bound as the floor).
      sample_size: elements the distribution statistics use per leaf (larger leaves are sampled).
      conditioning: optional conditioning spread, same structure as `golden` (needs
        `reference64`): per element, how far the float64 result moves when the inputs are
        perturbed at the last bit of their dtype (output units, >= 0). The floor becomes the
        larger of the noise floor and the conditioning floor (see `ConditioningFloor`);
        `peat.check_kernel` measures it.
      rounding: optional Monte Carlo samples of the reference (needs `reference64`): the
        golden's structure, each leaf with a leading axis of S samples (float64; see
        `peat_jax._src.judge.rounding`). Their per-element spread around the float64 reference joins
        the conditioning spread, and the distribution test compares the candidate with the
        largest of the golden's and the samples' ULP-error quantiles (`RoundingFloor`,
        ``signature.noise.rounding``).

    Returns:
      A `Signature` (for a pytree: the worst leaf's, with every leaf's in ``.leaves``).

    Raises:
      PeatError: mismatched structures, shapes or dtypes, or an unsupported dtype.
    """
    _check_options(reference64, noise_factor, comparison, sample_size)
    if conditioning is not None and reference64 is None:
        raise PeatError("conditioning needs reference64: the conditioning floor is measured "
                        "against the float64 reference")
    if rounding is not None and reference64 is None:
        raise PeatError("rounding needs reference64: the rounding floor is measured against "
                        "the float64 reference")
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(candidate)
    g_leaves, g_def = jax.tree_util.tree_flatten(golden)
    # jaxlib ships no stubs: mypy cannot see PyTreeDef's __eq__
    if g_def != treedef:  # type: ignore[operator]
        raise PeatError(f"candidate and golden have different structures: {treedef} vs {g_def}")
    r_leaves = _leaves_like("reference64", reference64, g_def, len(g_leaves))
    k_leaves = _leaves_like("conditioning", conditioning, g_def, len(g_leaves))
    m_leaves = _leaves_like("rounding", rounding, g_def, len(g_leaves))
    if not g_leaves:
        raise PeatError("analyze needs at least one array")
    sigs = [_analyze_leaf(jax.tree_util.keystr(kp), c, g, r, k, reduction_length, noise_factor,
                          ulp_allowance, comparison, sample_size, m)
            for (kp, c), g, r, k, m in zip(path_leaves, g_leaves, r_leaves, k_leaves, m_leaves)]
    if len(sigs) == 1 and not path_leaves[0][0]:
        return sigs[0]
    worst = max(sigs, key=_severity)
    return dataclasses.replace(worst, leaves=tuple(sigs))


def compile_ahead(outputs, *, reference64: bool, conditioning: bool,
                  noise_factor: float = DEFAULT_NOISE_FACTOR, max_elements: int = 1 << 20) -> int:
    """Builds the statistics programs that `analyze` will run on leaves shaped like `outputs`
    (a pytree of arrays or `jax.ShapeDtypeStruct`s), by analysing zeros of each distinct shape
    once (small leaves share a bucket's program: one analysis serves them all). A caller that
    knows its outputs' shapes early runs this on a worker thread while its own programs
    compile; `analyze` calls that arrive meanwhile wait for it (jax compiles a program once
    when threads miss its cache together) rather than compile the same programs again.

    Args:
      outputs: what will be analysed (only float leaves count).
      reference64, conditioning: whether those analyses will have a float64 reference and,
        with it, a conditioning spread (each changes the programs).
      noise_factor: as `analyze`'s.
      max_elements: larger leaves are left out (their zeros, float64 ones included, would
        take memory of their own: 20 bytes an element with a reference and a conditioning
        spread).

    Returns:
      The number of analyses run (distinct programs asked for).
    """
    seen = set()
    for x in jax.tree.leaves(outputs):
        shape, dtype = tuple(np.shape(x)), jnp.result_type(x)
        if not jnp.issubdtype(dtype, jnp.floating) or not 0 < math.prod(shape) <= max_elements:
            continue
        bucket = bucket_of(shape, dtype, DEFAULT_SAMPLE_SIZE)
        key = ((bucket.padded_rows, bucket.padded_cols) if bucket else shape, dtype)
        if key in seen:
            continue
        seen.add(key)
        zeros = np.zeros(shape, dtype)
        r = np.zeros(shape, np.float64) if reference64 else None
        analyze(zeros, zeros, r, noise_factor=noise_factor,
                conditioning=r if reference64 and conditioning else None)
    return len(seen)


def _leaves_like(name: str, tree, g_def, n: int) -> list:
    """The leaves of the optional pytree `tree` (n Nones when it is None), which must have the
    golden's structure `g_def` (else a PeatError naming `name`)."""
    if tree is None:
        return [None] * n
    leaves, t_def = jax.tree_util.tree_flatten(tree)
    if t_def != g_def:
        raise PeatError(f"{name} has a different structure from golden: {t_def} vs {g_def}")
    return leaves


def _check_options(reference64, noise_factor, comparison, sample_size) -> None:
    if comparison not in ("golden", "repeat"):
        raise PeatError(f"comparison must be 'golden' or 'repeat', got {comparison!r}")
    if comparison == "repeat" and reference64 is not None:
        raise PeatError("comparison='repeat' compares two runs of the candidate directly, with "
                        "the dtype bound as the floor; pass reference64=None")
    if sample_size < 16:
        raise PeatError(f"sample_size must be >= 16, got {sample_size}")
    if not (noise_factor > 0 and math.isfinite(noise_factor)):
        raise PeatError(f"noise_factor must be a positive finite number, got {noise_factor}")


def _severity(sig: Signature) -> tuple:
    """Sort key of leaf signatures, worst last: new non-finite values (or NaN where the golden
    is infinite: `nan_inf` either way), then the share of significant errors, the largest floor
    ratio, the share of mismatched elements."""
    n = max(sig.counts.elements, 1)
    return (sig.counts.new_nonfinite + sig.counts.nan_for_infinite > 0, sig.counts.significant / n,
            sig.errors.max_floor_ratio if math.isfinite(sig.errors.max_floor_ratio) else 1e300,
            sig.counts.mismatched / n)


def _home(*xs):
    """The device the statistics run on: that of the first single-device jax array among `xs`, else
    this process's first device (in a multi-process run `jax.devices()[0]` may be another process's,
    whose arrays cannot be read here). Every operand is committed to it, so the jitted statistics
    compile once per (shape, dtype, device): a committed and an uncommitted array of the same shape
    would otherwise be two cache entries, i.e. two ~1.5 s compilations."""
    for x in xs:
        if isinstance(x, jax.Array):
            devs = x.sharding.device_set
            if len(devs) == 1:
                return next(iter(devs))
    return jax.local_devices()[0]


def _check_leaf(where: str, c, g, r, k) -> None:
    c_shape, g_shape = tuple(np.shape(c)), tuple(np.shape(g))
    if c_shape != g_shape:
        raise PeatError(f"candidate{where} has shape {c_shape}, golden has {g_shape}")
    c_dt, g_dt = jnp.result_type(c), jnp.result_type(g)
    if c_dt != g_dt:
        raise PeatError(f"candidate{where} has dtype {jnp.dtype(c_dt).name}, golden has "
                        f"{jnp.dtype(g_dt).name}")
    if not jnp.issubdtype(g_dt, jnp.floating):
        return
    analyzed_format(g_dt)
    if math.prod(g_shape) == 0:
        raise PeatError(f"candidate and golden{where} are empty (shape {g_shape}): nothing to "
                        f"analyze; pass arrays with at least one element")
    if r is not None and tuple(np.shape(r)) != g_shape:
        raise PeatError(f"reference64{where} has shape {tuple(np.shape(r))}, golden has "
                        f"{g_shape}")
    if k is not None and tuple(np.shape(k)) != g_shape:
        raise PeatError(f"conditioning{where} has shape {tuple(np.shape(k))}, golden has "
                        f"{g_shape}")


def _nonfloat_leaf(path: str, c, g, comparison: str) -> Signature:
    n_mis, first = (int(v) for v in nonfloat_stats(jnp.asarray(c), jnp.asarray(g)))
    mismatch = None
    if n_mis:
        index = tuple(int(v) for v in np.unravel_index(first, np.shape(c))) if np.ndim(c) else ()
        mismatch = (float(np.asarray(c).reshape(-1)[first]),
                    float(np.asarray(g).reshape(-1)[first]), index)
    return nonfloat_signature(path, tuple(np.shape(c)), str(jnp.result_type(c)), comparison,
                              n_mis, mismatch)


def _leaf_stats(device, options: Options, c, g, r, k, extent=None, m=None):
    """`device.leaf_stats` on `device`, transferred to the host (the reference, the
    conditioning spread and the rounding spread `m` as float64)."""
    c, g = jax.device_put(c, device), jax.device_put(g, device)
    if r is None:
        return leaf_stats(c, g, None, options, extent=extent)
    with jax.enable_x64(True):
        r64 = jax.device_put(jnp.asarray(r, jnp.float64), device)
        # the spread's magnitude is taken in the compiled program: eager jnp ops here would
        # compile programs of their own on a cold start
        k64, m64 = (None if x is None else jax.device_put(
            x if isinstance(x, jax.Array) else np.asarray(x, np.float64), device) for x in (k, m))
        return leaf_stats(c, g, r64, options, k64, extent, m64)


def _with_rounding(where: str, g, r, k, samples):
    """(k, `RoundingFloor`, m): the conditioning spread `k` joined with the rounding spread `m`
    of the Monte Carlo `samples` (the larger per element), or `k` as it is (and None, None)
    without them."""
    if samples is None:
        return k, None, None
    if np.shape(samples)[1:] != np.shape(g) or np.ndim(samples) != np.ndim(g) + 1:
        raise PeatError(f"rounding{where} has shape {tuple(np.shape(samples))}, expected (S, "
                        f"*{tuple(np.shape(g))}): S samples of the golden's shape")
    rounded, floor = rounding_floor(samples, r, jnp.result_type(g))
    spread = rounded if k is None else np.maximum(
        rounded, np.nan_to_num(np.abs(np.asarray(k, np.float64)), nan=0.0, posinf=0.0))
    return spread, floor, rounded


def _analyze_leaf(path, c, g, r, k, reduction_length, noise_factor, ulp_allowance, comparison,
                  sample_size, samples=None) -> Signature:
    where = f" at {path}" if path else ""
    _check_leaf(where, c, g, r, k)
    g_dt = jnp.result_type(g)
    if not jnp.issubdtype(g_dt, jnp.floating):
        return _nonfloat_leaf(path, c, g, comparison)
    k, rounding, m = _with_rounding(where, g, r, k, samples)
    if ulp_allowance is None:
        name = analyzed_format(g_dt).name
        ulp_allowance = DTYPE_ULP_ALLOWANCE[name] if r is None else REFERENCE_ULP_ALLOWANCE
    # the dtype bound's coefficient is a static option of the compiled statistics: with a
    # float64 reference it is unused, and K (only the detector's there) must not recompile them
    _, coef = dtype_noise_bound(g_dt, reduction_length if r is None else None, noise_factor)
    options = Options(noise_factor=float(noise_factor), ulp_allowance=float(ulp_allowance),
                      bound_coef=float(coef), sample_size=int(sample_size), blocks=BLOCK_SIZES)
    device = _home(c, g)
    bucket = bucket_of(np.shape(g), g_dt, options.sample_size)
    if bucket is None:
        stats = _leaf_stats(device, options, c, g, r, k, m=m)
    else:
        nan = np.asarray(np.nan, g_dt)
        stats = unpad(_leaf_stats(
            device, options, pad(c, bucket, nan), pad(g, bucket, nan),
            None if r is None else pad(np.asarray(r, np.float64), bucket, np.nan),
            None if k is None else pad(np.asarray(k, np.float64), bucket, 0.0),
            extent=(np.int32(bucket.rows), np.int32(bucket.cols)),
            m=None if m is None else pad(np.asarray(m, np.float64), bucket, 0.0)), bucket)
    return build_signature(path, tuple(np.shape(g)), g_dt, comparison, stats, options,
                           reduction_length, rounding)
