"""The input variants `check_kernel` runs a candidate on: the example inputs and adversarial
versions of them (large, tiny, near overflow, subnormal, zeros, outliers, odd shapes), built in
NumPy on the host (XLA:CPU would flush subnormals)."""
from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import jax
import numpy as np

from peat_jax._src.errors import PeatError
from peat_jax._src.formats import float_format
from peat_jax._src.judge.conditioning import is_float_leaf

VARIANTS: tuple[str, ...] = ("example", "large", "tiny", "near_overflow", "subnormal", "zeros",
                             "outliers", "odd_shape")
"""Input variants `check_kernel` runs by default (see `make_variant`)."""


def host_array(x) -> np.ndarray:
    """Host copy keeping the dtype (bfloat16 included, via ml_dtypes)."""
    return np.asarray(jax.device_get(x))


def _pow2_scale(x: np.ndarray, target_log2: float) -> np.ndarray:
    """x times a power of two (exact) such that max|x| is about 2**target_log2."""
    a = np.abs(x.astype(np.float64))
    m = float(a[np.isfinite(a)].max()) if np.isfinite(a).any() and a.size else 0.0
    if m == 0.0:
        return x
    k = int(round(target_log2 - math.log2(m)))
    return (x.astype(np.float64) * 2.0 ** k).astype(x.dtype)


def _near_overflow_log2(fmt) -> float:
    """log2 of max |x| on the "near_overflow" variant: emax/2 - 1, whose squares and products
    reach the dtype's largest values."""
    return fmt.max_exponent / 2 - 1


def near_overflow_log2(args: tuple) -> float:
    """log2 of the least max |x| the "near_overflow" variant gives a float leaf of `args`
    (float32 and bfloat16: 62.5, float16: 6.5); inf without float leaves."""
    return min((_near_overflow_log2(float_format(jax.numpy.result_type(x)))
                for x in jax.tree_util.tree_leaves(args) if is_float_leaf(x)), default=math.inf)


def _variant_leaf(name: str, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    fmt = float_format(x.dtype)
    emax, emin = fmt.max_exponent, fmt.min_exponent
    if name == "large":
        return _pow2_scale(x, emax / 4)
    if name == "tiny":
        return _pow2_scale(x, emin / 4)
    if name == "near_overflow":
        return _pow2_scale(x, _near_overflow_log2(fmt))
    if name == "subnormal":
        return _pow2_scale(x, emin - 2)
    if name == "zeros":
        return np.zeros_like(x)
    if name == "outliers":
        y = x.copy().reshape(-1)
        if y.size:
            k = max(1, y.size // 100)
            idx = rng.choice(y.size, size=k, replace=False)
            factor = 2.0 ** min(10, emax // 4)
            y[idx] = (y[idx].astype(np.float64) * factor).astype(x.dtype)
        return y.reshape(x.shape)
    raise PeatError(f"unknown variant {name!r}; variants are {', '.join(VARIANTS)}")


def _odd_size(d: int) -> int:
    """d + 3, or d + 4 where d + 3 is a multiple of 8 (d = 5, 13, 29, 61, ...: d + 3 would be a
    whole number of 8-, 16-, 32-, 64- or 128-wide blocks); d itself for d < 2. The result is
    never a multiple of 8, so no block size that is (8, 16, ..., 128) tiles it evenly."""
    if d < 2:
        return d
    return d + 3 if (d + 3) % 8 else d + 4


def make_variant(name: str, args: tuple, seed: int = 0) -> Optional[tuple]:
    """The adversarial variant `name` of positional `args` (pytrees); float leaves change, other
    leaves are kept. None when the variant does not apply.

    Variants (each float leaf x, dtype with exponent range [emin, emax]):
      example: the args as given.
      large: x scaled by a power of two to max|x| ~ 2**(emax/4) (float32: ~4e9).
      tiny: max|x| ~ 2**(emin/4) (float32: ~3e-10): near-zero outputs.
      near_overflow: max|x| ~ 2**(emax/2 - 1): products near the dtype's max.
      subnormal: max|x| ~ 2**(emin - 2): (almost) every value subnormal.
      zeros: all zeros.
      outliers: 1% of the elements (at least one) multiplied by 2**min(10, emax/4).
      odd_shape: every dimension size d >= 2 found in the float leaves becomes d + 3 (d + 4
        where d + 3 is a multiple of 8: never a multiple of 8, so no block of 8, 16, ..., 128
        tiles it evenly; equal sizes stay equal, so matching dimensions still match), with
        fresh normal data of each leaf's standard deviation. None when a non-float leaf has
        such a dimension.
    """
    if name == "example":
        return args
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree_util.tree_flatten(args)
    if name == "odd_shape":
        sizes = {int(d) for x in leaves if is_float_leaf(x) for d in np.shape(x) if d >= 2}
        if not sizes:
            return None
        for x in leaves:
            if not is_float_leaf(x) and hasattr(x, "shape") and any(
                    d in sizes for d in np.shape(x)):
                return None
        out = []
        for x in leaves:
            if not is_float_leaf(x):
                out.append(x)
                continue
            xn = host_array(x)
            shape = tuple(_odd_size(int(d)) if d in sizes else int(d) for d in xn.shape)
            std = float(np.std(xn.astype(np.float64))) if xn.size else 1.0
            std = std if std > 0 and math.isfinite(std) else 1.0
            out.append((rng.standard_normal(shape) * std).astype(xn.dtype))
        return jax.tree_util.tree_unflatten(treedef, out)
    out = []
    for x in leaves:
        out.append(_variant_leaf(name, host_array(x), rng) if is_float_leaf(x) else x)
    return jax.tree_util.tree_unflatten(treedef, out)


def variant_names(variants: Union[None, str, Sequence[str]]) -> tuple[str, ...]:
    """The variants to run (default: all of `VARIANTS`), with "example" first if not named."""
    if variants is None:
        names = VARIANTS
    elif isinstance(variants, str):
        names = (variants,)
    else:
        names = tuple(variants)
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        raise PeatError(f"unknown variants {bad}; variants are {', '.join(VARIANTS)}")
    return names if "example" in names else ("example",) + names
