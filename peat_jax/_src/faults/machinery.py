"""The faults' machinery, apart from their catalogue (`peat_jax._src.faults`): the `Fault` type,
argument validation, dtype and bit-pattern helpers, the static checks a fault runs on a site
(`Context`, `Problem`) and `make_fault`, which builds a Fault from a core transform and a
check."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from peat_jax._src.errors import PeatError
from peat_jax._src.formats import (NARROW_ALIASES, NARROW_FORMATS, float_format, from_bits,
                                   is_floating, to_bits)

Index = Union[None, int, tuple]


@dataclasses.dataclass(frozen=True, eq=False)
class Fault:
    """A modelled pseudo-error: a jittable transform of an op's golden output.

    Attributes:
      name: the taxonomy error model the fault emulates (what the detector should report).
      apply: ``apply(reference, operands, key, site=None) -> array`` with the reference output's
        shape and dtype.
      params: the settings, JSON-able, keyed by the constructor's argument names (``seed``
        included).
      supports: ``supports(site) -> None`` if usable at ``site``, else a one-line reason.

    Faults compare and hash by identity (two faults built with the same arguments are distinct
    objects, but behave identically).
    """

    name: str
    apply: Callable
    params: Mapping[str, Any]
    supports: Optional[Callable] = None

    def __call__(self, reference, operands, key, site=None):
        """The faulty output: ``apply(reference, operands, key, site)``."""
        return self.apply(reference, operands, key, site)

    def check_site(self, site) -> Optional[str]:
        """None if this fault may be applied at `site`, else a one-line reason."""
        if self.supports is not None:
            return self.supports(site)
        if not any(is_floating(d) for d in site.out_dtypes):
            return "the site has no floating-point output to fault"
        return None


def fail(msg: str) -> None:
    raise PeatError(msg)


def check_int(name: str, value, *, minimum: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        fail(f"{name} must be an int, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        fail(f"{name} must be >= {minimum}, got {value}")
    return value


def is_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float, np.floating, np.integer))


def check_fraction(fraction) -> float:
    if not is_number(fraction):
        fail(f"fraction must be a number in [0, 1], got {fraction!r}")
    fraction = float(fraction)
    if not 0.0 <= fraction <= 1.0:
        fail(f"fraction must be in [0, 1], got {fraction}")
    return fraction


def check_choice(name: str, value, choices: Sequence) -> Any:
    if value not in choices:
        fail(f"unknown {name} {value!r}; expected one of {', '.join(map(repr, choices))}")
    return value


def check_index(index) -> Index:
    """`None`, an int, or a tuple of ints (a list is taken as a tuple)."""
    if index is None:
        return None
    if isinstance(index, (list, tuple)):
        return tuple(check_int("index entry", i) for i in index)
    return check_int("index", index)


def as_key(key, seed: int):
    if key is None:
        return jax.random.key(seed)
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        return jax.random.key(int(key))
    return key


def element_count(fraction: float, size: int) -> int:
    """Number of elements a fraction selects: ``round(fraction * size)`` (Python rounding)."""
    return int(round(fraction * size))


def flat_index(index, shape) -> tuple[Optional[int], Optional[str]]:
    """(flat index, None), or (None, reason) when `index` does not fit `shape`."""
    size = math.prod(shape)
    if isinstance(index, tuple):
        if len(index) != len(shape):
            return None, (f"index {index} has {len(index)} dims, the output has {len(shape)} "
                          f"{tuple(shape)}")
        norm = []
        for i, n in zip(index, shape):
            if not -n <= i < n:
                return None, f"index {index} is out of range for output shape {tuple(shape)}"
            norm.append(i % n)
        return int(np.ravel_multi_index(tuple(norm), tuple(shape))), None
    if not -size <= index < size:
        return None, f"flat index {index} is out of range for an output of {size} elements"
    return index % size, None


def distinct(key, size: int, k: int):
    """`k` distinct seeded flat indices in ``[0, size)`` (int32, shape ``(k,)``).

    One sort of random bits (cheaper to compile than `jax.random.permutation`).
    """
    return jnp.argsort(jax.random.bits(key, (size,), jnp.uint32))[:k].astype(jnp.int32)


def static_flat(index, shape) -> Optional[int]:
    """The flat index `index` names in `shape` (already checked), or None."""
    return None if index is None else flat_index(index, shape)[0]


def pick(key, size: int, count: int, index):
    """`count` distinct flat indices (int32 array of shape ``(count,)``); `index` if given."""
    if index is not None:
        return jnp.asarray([index], jnp.int32)
    if count == 1:
        return jax.random.randint(key, (1,), 0, size, dtype=jnp.int32)
    return distinct(key, size, count)


def mask_k(key, size: int, k: int):
    """Flat bool mask with exactly `k` seeded True entries."""
    if k >= size:
        return jnp.ones((size,), bool)
    if k <= 0:
        return jnp.zeros((size,), bool)
    return jnp.zeros((size,), bool).at[distinct(key, size, k)].set(True)


def auto_scale(x):
    """Half-width of the garbage range: 4 x max |finite x| (1 if none), capped at the dtype max.

    Returned as a scalar in the compute dtype (float32, or float64 for float64 outputs).
    """
    cdt = float_format(x.dtype).compute_dtype
    a = jnp.abs(x.astype(cdt))
    m = jnp.max(jnp.where(jnp.isfinite(a), a, 0), initial=0)
    s = jnp.where(m > 0, 4 * m, 1)
    return jnp.minimum(s, jnp.asarray(jnp.finfo(x.dtype).max, cdt)).astype(cdt)


def random_differing(key, orig, s):
    """Seeded values uniform in ``[-s, s]`` (cast to ``orig.dtype``), each different from `orig`.

    Where a draw rounds to the original value, ``orig -+ s/2`` is used instead, which differs
    because ``|orig| <= s`` there and stays within ``[-s/2, s/2]``; where even that rounds back
    (`s` below the dtype's resolution), the last bit of the original pattern is flipped.
    """
    cdt = float_format(orig.dtype).compute_dtype
    s = jnp.asarray(s, cdt)
    v = (jax.random.uniform(key, orig.shape, cdt, -1.0, 1.0) * s).astype(orig.dtype)
    o = orig.astype(cdt)
    alt = jnp.where(o >= 0, o - s / 2, o + s / 2).astype(orig.dtype)
    ob = to_bits(orig)
    last = from_bits(ob ^ jnp.ones((), ob.dtype), orig.dtype)
    alt = jnp.where((alt == orig) | (to_bits(alt) == ob), last, alt)
    return jnp.where((v == orig) | (to_bits(v) == ob), alt, v)


def normalise_precision(name: str, value) -> str:
    return check_choice(name, NARROW_ALIASES.get(value, value), tuple(NARROW_FORMATS))


class Context(NamedTuple):
    """What a check may look at; every field may be None (unknown)."""

    out_shape: Optional[tuple]
    out_dtype: Any
    in_shapes: Optional[tuple]
    in_dtypes: Optional[tuple]
    site: Any


class Problem(NamedTuple):
    reason: str
    fatal: bool  # True: apply raises; False: apply returns the reference unchanged


def dtype_or_none(d):
    try:
        return jnp.dtype(d)
    except TypeError:
        return None


def ctx_from_site(site) -> Context:
    """What the site's static description tells (unknown fields are None)."""
    if site is None:
        return Context(None, None, None, None, None)
    outs = tuple(getattr(site, "out_shapes", ()) or ())
    odts = tuple(getattr(site, "out_dtypes", ()) or ())
    ins = getattr(site, "in_shapes", None)
    idts = getattr(site, "in_dtypes", None)
    return Context(
        tuple(outs[0]) if outs else None,
        dtype_or_none(odts[0]) if odts else None,
        tuple(tuple(s) for s in ins) if ins is not None else None,
        tuple(dtype_or_none(d) for d in idts) if idts is not None else None,
        site,
    )


def nonfloat_problem(ctx: Context) -> Optional[Problem]:
    if ctx.out_dtype is not None and not is_floating(ctx.out_dtype):
        return Problem(f"output dtype {jnp.dtype(ctx.out_dtype).name} is not floating: "
                        "the fault leaves it unchanged", False)
    if ctx.out_shape is not None and math.prod(ctx.out_shape) == 0:
        return Problem("the output is empty: nothing to change", False)
    return None


def index_problem(index, ctx: Context) -> Optional[Problem]:
    if index is None or ctx.out_shape is None:
        return None
    _, reason = flat_index(index, ctx.out_shape)
    return Problem(reason, True) if reason else None


def make_fault(name: str, params: dict, core: Callable,
               check: Callable[[Context], Optional[Problem]],
               describe: Callable[[str, Mapping[str, Any]], str]) -> Fault:
    """A `Fault` from ``core(out, reference, operands, key, site) -> array`` and a check
    (`describe(name, params)` names the fault in the error of a fatal problem).

    The check runs on static shape information, both in ``supports(site)`` and at trace time in
    ``apply`` (where a fatal problem raises and a non-fatal one returns the reference).
    """
    seed = params.get("seed", 0)

    def apply(reference, operands, key, site=None):
        operands = tuple(operands)
        out = jnp.asarray(reference(*operands))
        ctx = Context(tuple(out.shape), out.dtype,
                   tuple(tuple(jnp.shape(o)) for o in operands),
                   tuple(jnp.result_type(o) for o in operands), site)
        problem = check(ctx)
        if problem is not None:
            if problem.fatal:
                raise PeatError(f"{describe(name, params)}: {problem.reason}")
            return out
        # The fault transforms the reference's output as computed: without the barrier XLA may
        # fold the transform into the op (a transpose of a dot becomes a dot of transposed
        # operands, seen on jax 0.11+), which rounds differently than the op plus the fault.
        out = lax.optimization_barrier(out)
        result = core(out, reference, operands, as_key(key, seed), site)
        return jnp.reshape(result, out.shape).astype(out.dtype)

    def supports(site):
        problem = check(ctx_from_site(site))
        return None if problem is None else problem.reason

    return Fault(name=name, apply=apply, params=params, supports=supports)


def bits_problem(bits: Sequence[int], n_bits: int, ctx: Context) -> Optional[Problem]:
    if ctx.out_dtype is None or not is_floating(ctx.out_dtype):
        return None
    width = float_format(ctx.out_dtype).bits
    bad = [b for b in bits if b >= width]
    if bad:
        return Problem(f"bit {bad[0]} does not exist in {jnp.dtype(ctx.out_dtype).name} "
                        f"(bits 0..{width - 1})", True)
    if n_bits > width:
        return Problem(f"cannot flip {n_bits} distinct bits of a {width}-bit dtype", True)
    return None


def xor_element(out, idx, mask):
    """`out` with the bit pattern of flat element `idx` XOR-ed with `mask` (unsigned scalar)."""
    u = to_bits(out).reshape(-1)
    u = u.at[idx].set(u[idx] ^ mask)
    return from_bits(u, out.dtype)


def count_problem(count: int, index, ctx: Context) -> Optional[Problem]:
    if ctx.out_shape is not None and count > math.prod(ctx.out_shape):
        return Problem(f"count={count} exceeds the {math.prod(ctx.out_shape)} output elements",
                        True)
    return index_problem(index, ctx)


def check_count_index(count, index) -> tuple[int, Index]:
    count = check_int("count", count, minimum=1)
    index = check_index(index)
    if index is not None and count != 1:
        fail(f"index selects one element; use count=1 (got count={count})")
    return count, index


def fraction_problem(fraction: float, ctx: Context) -> Optional[Problem]:
    if ctx.out_shape is not None and element_count(fraction, math.prod(ctx.out_shape)) == 0:
        return Problem(f"fraction={fraction} selects no element of {math.prod(ctx.out_shape)}: "
                        "nothing to change", False)
    return None


def reduction_axes(site) -> tuple[Optional[tuple], Optional[str]]:
    """((operand axis per chunked operand, ...), None) or (None, reason) for the site."""
    if site is None:
        return None, "needs a dot_general or reduce_sum site (site is None)"
    prim = getattr(site, "primitive", None)
    params = getattr(site, "params", None) or {}
    if prim == "dot_general":
        dn = params.get("dimension_numbers")
        if dn is None:
            return None, "dot_general site without dimension_numbers"
        (lc, rc), _ = dn
        if len(lc) == 0:
            return None, "dot_general has no contracting dimension: nothing is accumulated"
        return (int(lc[0]), int(rc[0])), None
    if prim == "reduce_sum":
        axes = tuple(params.get("axes", ()))
        if not axes:
            return None, "reduce_sum site without reduced axes: nothing is accumulated"
        return (int(axes[-1]),), None
    return None, f"only dot_general and reduce_sum sites accumulate; this site is {prim!r}"
