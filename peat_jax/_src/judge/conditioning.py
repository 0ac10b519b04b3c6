"""The conditioning floor: how far the float64 result moves when the inputs move at their last
bit (the problem's own conditioning, whatever the algorithm). `check_kernel` and playback both
measure it with `conditioning_spread`."""
from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from peat_jax._src.formats import float_format, is_floating, ulp_at


def is_float_leaf(x) -> bool:
    """`x` is an array (or array-like with a shape) of a float dtype, bfloat16 included."""
    return hasattr(x, "shape") and is_floating(x)


CONDITIONING_PERTURBATIONS = 3
"""Random input perturbations the conditioning floor is measured over."""


def perturb_inputs(args, rng: np.random.Generator, mantissa_bits: int = 0):
    """`args` in float64 with every float leaf x (of dtype d) moved to ``x * (1 + u * eps /
    2)``, u uniform in [-1, 1] per element, eps the machine epsilon of d or, when finer, of a
    format with `mantissa_bits` (the outputs' finest: a bfloat16-input, float32-output matmul
    is perturbed at float32's last bit, the precision its result resolves): at most the unit
    roundoff relative, so at most 1 ULP (half an ULP at the bottom of a binade). A zero moves
    by u times d's smallest subnormal, its own last bit: where the function has a kink at 0
    (relu's, or a tie of a max) its gradient is not unique there, and the spread shows it.
    Other leaves are kept. Returns host arrays (float64 for the float leaves)."""
    def one(x):
        if not is_float_leaf(x):
            return x
        xn = np.asarray(jax.device_get(x))
        fmt = float_format(xn.dtype)
        half_eps = 2.0 ** -(max(fmt.mantissa_bits, mantissa_bits) + 1)
        u = rng.uniform(-1.0, 1.0, xn.shape)
        x64 = xn.astype(np.float64)
        return np.where(x64 == 0, u * ulp_at(0.0, fmt), x64 * (1.0 + u * half_eps))
    return jax.tree.map(one, args)


def perturbation_spread(base, moved) -> Any:
    """|moved - base| per element of every float leaf (float64; 0 where either is not
    finite)."""
    def one(b, m):
        b, m = np.asarray(b, np.float64), np.asarray(m, np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            d = np.abs(m - b)
        return np.where(np.isfinite(d), d, 0.0)
    return jax.tree.map(one, base, moved)


def conditioning_spread(evaluate: Callable[[Any], Any], args, base, rng: np.random.Generator,
                        mantissa_bits: int = 0) -> Any:
    """The conditioning floor: per element of every float leaf of `base` (`evaluate` of `args`
    in float64), the largest `perturbation_spread` of `evaluate` over
    `CONDITIONING_PERTURBATIONS` random perturbations of `args` (`perturb_inputs`, at the last
    bit of each leaf's dtype or of a format with `mantissa_bits`, whichever is finer), in the
    outputs' units (float64 host arrays, the structure of `base`). `evaluate` takes host
    float64 arrays and returns what `base` is; it runs under the caller's x64 setting."""
    worst = None
    for _ in range(CONDITIONING_PERTURBATIONS):
        d = perturbation_spread(base, evaluate(perturb_inputs(args, rng, mantissa_bits)))
        worst = d if worst is None else jax.tree.map(np.maximum, worst, d)
    return worst
