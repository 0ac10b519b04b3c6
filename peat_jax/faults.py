"""Modelled pseudo-errors ("faults") applied at an op site as jittable transforms.

A `Fault` turns the golden output of one op into a faulty one:
``fault(reference, operands, key, site=None) -> array``, where ``reference(*operands)`` computes
the correct output (one array). Faults emulate hardware faults (bit flips, stuck bits, garbage
values) and kernel bugs (wrong scale, sign, layout, tile edges, reduced precision), and they
calibrate the detector: each fault's ``name`` is the error-model name of the taxonomy it should be
diagnosed as (see ``docs/design.md``), except ``stuck_at``, which the detector sees as ``bit_flip``.

Conventions shared by every fault:

* Pure and jittable: no Python branching on traced values and no host callbacks, so a fault works
  under `jax.jit`, `jax.vmap` and inside `lax.cond` / `lax.scan`. Under `vmap` the fault sees one
  example, so element indices and masks are per example.
* Seeded: everything random is derived from ``key`` (a `jax.random` key; the caller builds it from
  ``params["seed"]``; ``None`` or an ``int`` are accepted too and mean ``jax.random.key(seed)``).
  The same key gives the same pattern.
* The result has the reference output's shape and dtype. Bit-level faults work on the bit pattern
  with integer-only arithmetic (`lax.bitcast_convert_type` to an unsigned integer of the same
  width), so subnormals are handled exactly.
* Non-float outputs (integer, bool) are returned unchanged, and ``supports(site)`` says so.
* Element choice: ``index=None`` is a seeded random element; an ``int`` is a flat (row-major) index
  into the output (negative counts from the end); a ``tuple`` is a multi-dimensional index.
* ``supports(site)`` returns ``None`` when the fault is usable at the site, else a one-line reason.
  ``apply`` raises `PeatError` (a `ValueError`) for the same reasons when they make the fault
  impossible (an index out of range, a bit the dtype lacks, a shape the layout fault needs), and
  returns the reference unchanged when the fault is merely a no-op there (non-float output,
  precision already that narrow, nothing selected).
* Constructor arguments are validated eagerly; ``params`` holds them as JSON-able values, keyed by
  the constructor's argument names, so ``describe`` can print the call that made the fault.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from peat_jax import taxonomy
from peat_jax.errors import PeatError
from peat_jax.formats import (NARROW_ALIASES, NARROW_FORMATS, already_as_narrow, float_format,
                              from_bits, round_to_format, to_bits)

__all__ = [
    "ALL",
    "Fault",
    "bit_flip",
    "describe",
    "low_precision_accumulation",
    "multi_bit_flip",
    "nan_inf",
    "operand_corruption",
    "permute",
    "random_value",
    "scale",
    "sign_flip",
    "stuck_at",
    "tile_boundary",
    "truncate",
    "zero",
]

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


# ----------------------------------------------------------------------------------------------
# Small helpers: argument validation
# ----------------------------------------------------------------------------------------------

def _fail(msg: str) -> None:
    raise PeatError(msg)


def _check_int(name: str, value, *, minimum: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        _fail(f"{name} must be an int, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        _fail(f"{name} must be >= {minimum}, got {value}")
    return value


def _is_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float, np.floating, np.integer))


def _check_fraction(fraction) -> float:
    if not _is_number(fraction):
        _fail(f"fraction must be a number in [0, 1], got {fraction!r}")
    fraction = float(fraction)
    if not 0.0 <= fraction <= 1.0:
        _fail(f"fraction must be in [0, 1], got {fraction}")
    return fraction


def _check_choice(name: str, value, choices: Sequence) -> Any:
    if value not in choices:
        _fail(f"unknown {name} {value!r}; expected one of {', '.join(map(repr, choices))}")
    return value


def _check_index(index) -> Index:
    """`None`, an int, or a tuple of ints (a list is taken as a tuple)."""
    if index is None:
        return None
    if isinstance(index, (list, tuple)):
        return tuple(_check_int("index entry", i) for i in index)
    return _check_int("index", index)


# ----------------------------------------------------------------------------------------------
# Small helpers: dtypes and bit patterns
# ----------------------------------------------------------------------------------------------

def _is_float(dtype) -> bool:
    return dtype is not None and jnp.issubdtype(jnp.dtype(dtype), jnp.floating)


def _as_key(key, seed: int):
    if key is None:
        return jax.random.key(seed)
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        return jax.random.key(int(key))
    return key


def _count(fraction: float, size: int) -> int:
    """Number of elements a fraction selects: ``round(fraction * size)`` (Python rounding)."""
    return int(round(fraction * size))


def _flat_index(index, shape) -> tuple[Optional[int], Optional[str]]:
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


def _distinct(key, size: int, k: int):
    """`k` distinct seeded flat indices in ``[0, size)`` (int32, shape ``(k,)``).

    One sort of random bits (cheaper to compile than `jax.random.permutation`).
    """
    return jnp.argsort(jax.random.bits(key, (size,), jnp.uint32))[:k].astype(jnp.int32)


def _static_flat(index, shape) -> Optional[int]:
    """The flat index `index` names in `shape` (already checked), or None."""
    return None if index is None else _flat_index(index, shape)[0]


def _pick(key, size: int, count: int, index):
    """`count` distinct flat indices (int32 array of shape ``(count,)``); `index` if given."""
    if index is not None:
        return jnp.asarray([index], jnp.int32)
    if count == 1:
        return jax.random.randint(key, (1,), 0, size, dtype=jnp.int32)
    return _distinct(key, size, count)


def _mask_k(key, size: int, k: int):
    """Flat bool mask with exactly `k` seeded True entries."""
    if k >= size:
        return jnp.ones((size,), bool)
    if k <= 0:
        return jnp.zeros((size,), bool)
    return jnp.zeros((size,), bool).at[_distinct(key, size, k)].set(True)


def _auto_scale(x):
    """Half-width of the garbage range: 4 x max |finite x| (1 if none), capped at the dtype max.

    Returned as a scalar in the compute dtype (float32, or float64 for float64 outputs).
    """
    cdt = float_format(x.dtype).compute_dtype
    a = jnp.abs(x.astype(cdt))
    m = jnp.max(jnp.where(jnp.isfinite(a), a, 0), initial=0)
    s = jnp.where(m > 0, 4 * m, 1)
    return jnp.minimum(s, jnp.asarray(jnp.finfo(x.dtype).max, cdt)).astype(cdt)


def _random_differing(key, orig, s):
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


# ----------------------------------------------------------------------------------------------
# Precision rounding
# ----------------------------------------------------------------------------------------------

def _normalise_precision(name: str, value) -> str:
    return _check_choice(name, NARROW_ALIASES.get(value, value), tuple(NARROW_FORMATS))


# ----------------------------------------------------------------------------------------------
# Building a Fault from a core transform and a check
# ----------------------------------------------------------------------------------------------

class _Ctx(NamedTuple):
    """What a check may look at; every field may be None (unknown)."""

    out_shape: Optional[tuple]
    out_dtype: Any
    in_shapes: Optional[tuple]
    in_dtypes: Optional[tuple]
    site: Any


class _Problem(NamedTuple):
    reason: str
    fatal: bool  # True: apply raises; False: apply returns the reference unchanged


def _dtype_or_none(d):
    try:
        return jnp.dtype(d)
    except TypeError:
        return None


def _ctx_from_site(site) -> _Ctx:
    """What the site's static description tells (unknown fields are None)."""
    if site is None:
        return _Ctx(None, None, None, None, None)
    outs = tuple(getattr(site, "out_shapes", ()) or ())
    odts = tuple(getattr(site, "out_dtypes", ()) or ())
    ins = getattr(site, "in_shapes", None)
    idts = getattr(site, "in_dtypes", None)
    return _Ctx(
        tuple(outs[0]) if outs else None,
        _dtype_or_none(odts[0]) if odts else None,
        tuple(tuple(s) for s in ins) if ins is not None else None,
        tuple(_dtype_or_none(d) for d in idts) if idts is not None else None,
        site,
    )


def _nonfloat_problem(ctx: _Ctx) -> Optional[_Problem]:
    if ctx.out_dtype is not None and not _is_float(ctx.out_dtype):
        return _Problem(f"output dtype {jnp.dtype(ctx.out_dtype).name} is not floating: "
                        "the fault leaves it unchanged", False)
    if ctx.out_shape is not None and math.prod(ctx.out_shape) == 0:
        return _Problem("the output is empty: nothing to change", False)
    return None


def _index_problem(index, ctx: _Ctx) -> Optional[_Problem]:
    if index is None or ctx.out_shape is None:
        return None
    _, reason = _flat_index(index, ctx.out_shape)
    return _Problem(reason, True) if reason else None


def _make(name: str, params: dict, core: Callable,
          check: Callable[[_Ctx], Optional[_Problem]]) -> Fault:
    """A `Fault` from ``core(out, reference, operands, key, site) -> array`` and a check.

    The check runs on static shape information, both in ``supports(site)`` and at trace time in
    ``apply`` (where a fatal problem raises and a non-fatal one returns the reference).
    """
    seed = params.get("seed", 0)

    def apply(reference, operands, key, site=None):
        operands = tuple(operands)
        out = jnp.asarray(reference(*operands))
        ctx = _Ctx(tuple(out.shape), out.dtype,
                   tuple(tuple(jnp.shape(o)) for o in operands),
                   tuple(jnp.result_type(o) for o in operands), site)
        problem = check(ctx)
        if problem is not None:
            if problem.fatal:
                raise PeatError(f"{_describe_params(name, params)}: {problem.reason}")
            return out
        # The fault transforms the reference's output as computed: without the barrier XLA may
        # fold the transform into the op (a transpose of a dot becomes a dot of transposed
        # operands, seen on jax 0.11+), which rounds differently than the op plus the fault.
        out = lax.optimization_barrier(out)
        result = core(out, reference, operands, _as_key(key, seed), site)
        return jnp.reshape(result, out.shape).astype(out.dtype)

    def supports(site):
        problem = check(_ctx_from_site(site))
        return None if problem is None else problem.reason

    return Fault(name=name, apply=apply, params=params, supports=supports)


# ----------------------------------------------------------------------------------------------
# 1-2. Bit flips
# ----------------------------------------------------------------------------------------------

def _bits_problem(bits: Sequence[int], n_bits: int, ctx: _Ctx) -> Optional[_Problem]:
    if ctx.out_dtype is None or not _is_float(ctx.out_dtype):
        return None
    width = float_format(ctx.out_dtype).bits
    bad = [b for b in bits if b >= width]
    if bad:
        return _Problem(f"bit {bad[0]} does not exist in {jnp.dtype(ctx.out_dtype).name} "
                        f"(bits 0..{width - 1})", True)
    if n_bits > width:
        return _Problem(f"cannot flip {n_bits} distinct bits of a {width}-bit dtype", True)
    return None


def _xor_element(out, idx, mask):
    """`out` with the bit pattern of flat element `idx` XOR-ed with `mask` (unsigned scalar)."""
    u = to_bits(out).reshape(-1)
    u = u.at[idx].set(u[idx] ^ mask)
    return from_bits(u, out.dtype)


def bit_flip(bit: Optional[int] = None, *, bit_class: Optional[str] = None, index: Index = None,
             seed: int = 0) -> Fault:
    """Flip exactly one bit of exactly one output element (taxonomy model ``bit_flip``).

    Args:
      bit: bit position, 0 = least significant bit of the dtype's pattern (float32: 31 sign,
        23..30 exponent, 0..22 mantissa; bfloat16: 15, 7..14, 0..6; float16: 15, 10..14, 0..9).
        Checked against the output dtype at trace time. None: a seeded bit from `bit_class`.
      bit_class: "sign", "exponent", "mantissa", or None (any bit); only when `bit` is None.
      index: the element (None: seeded random; int: flat; tuple: multi-dimensional).
      seed: seed of the key the caller builds.

    Returns:
      A `Fault` whose output equals the reference except one element whose bit pattern differs
      in exactly one bit (an exponent flip may make it inf or NaN).
    """
    if bit is not None:
        bit = _check_int("bit", bit, minimum=0)
        if bit_class is not None:
            _fail("give bit or bit_class, not both")
    _check_choice("bit_class", bit_class, ("sign", "exponent", "mantissa", None))
    index = _check_index(index)
    seed = _check_int("seed", seed)
    params = dict(bit=bit, bit_class=bit_class, index=index, seed=seed)

    def check(ctx):
        return (_nonfloat_problem(ctx) or _index_problem(index, ctx)
                or _bits_problem([] if bit is None else [bit], 1, ctx))

    def core(out, reference, operands, key, site):
        f = float_format(out.dtype)
        k_idx, k_bit = jax.random.split(key)
        idx = _pick(k_idx, out.size, 1, _static_flat(index, out.shape))[0]
        if bit is not None:
            mask = f.uint(1 << bit)
        else:
            lo, hi = f.bit_range(bit_class)
            b = jax.random.randint(k_bit, (), lo, hi, dtype=jnp.int32)
            mask = jnp.left_shift(jnp.ones((), f.uint), b.astype(f.uint))
        return _xor_element(out, idx, mask)

    return _make("bit_flip", params, core, check)


def multi_bit_flip(bits: Optional[Sequence[int]] = None, *, n_bits: int = 2, index: Index = None,
                   seed: int = 0) -> Fault:
    """Flip several distinct bits of one output element (taxonomy model ``multi_bit_flip``).

    Args:
      bits: the bit positions (at least two, distinct); None: `n_bits` seeded distinct positions
        anywhere in the pattern. When given, `n_bits` is taken as ``len(bits)``.
      n_bits: how many bits to flip when `bits` is None (>= 2).
      index: the element (None: seeded random; int: flat; tuple: multi-dimensional).
      seed: seed of the key the caller builds.

    Returns:
      A `Fault` whose output differs from the reference in one element, whose bit pattern XOR the
      original has exactly `n_bits` bits set.
    """
    if bits is not None:
        if isinstance(bits, (int, np.integer)):
            _fail("bits must be a sequence of bit positions; use bit_flip for one bit")
        bits = tuple(_check_int("bit", b, minimum=0) for b in bits)
        if len(set(bits)) != len(bits):
            _fail(f"bits must be distinct, got {bits}")
        if len(bits) < 2:
            _fail(f"multi_bit_flip needs at least two bits, got {bits}; use bit_flip for one")
        n_bits = len(bits)
    n_bits = _check_int("n_bits", n_bits, minimum=2)
    index = _check_index(index)
    seed = _check_int("seed", seed)
    params = dict(bits=bits, n_bits=n_bits, index=index, seed=seed)

    def check(ctx):
        return (_nonfloat_problem(ctx) or _index_problem(index, ctx)
                or _bits_problem(bits or (), n_bits, ctx))

    def core(out, reference, operands, key, site):
        f = float_format(out.dtype)
        k_idx, k_bit = jax.random.split(key)
        idx = _pick(k_idx, out.size, 1, _static_flat(index, out.shape))[0]
        if bits is not None:
            mask = f.uint(sum(1 << b for b in bits))
        else:
            chosen = _distinct(k_bit, f.bits, n_bits).astype(f.uint)
            mask = jnp.sum(jnp.left_shift(jnp.ones((), f.uint), chosen), dtype=f.uint)
        return _xor_element(out, idx, mask)

    return _make("multi_bit_flip", params, core, check)


# ----------------------------------------------------------------------------------------------
# 3. Random values, 13. NaN / inf
# ----------------------------------------------------------------------------------------------

def _count_problem(count: int, index, ctx: _Ctx) -> Optional[_Problem]:
    if ctx.out_shape is not None and count > math.prod(ctx.out_shape):
        return _Problem(f"count={count} exceeds the {math.prod(ctx.out_shape)} output elements",
                        True)
    return _index_problem(index, ctx)


def _check_count_index(count, index) -> tuple[int, Index]:
    count = _check_int("count", count, minimum=1)
    index = _check_index(index)
    if index is not None and count != 1:
        _fail(f"index selects one element; use count=1 (got count={count})")
    return count, index


def random_value(*, count: int = 1, index: Index = None, seed: int = 0,
                 scale: Optional[float] = None) -> Fault:
    """Replace `count` distinct output elements with random values (taxonomy ``random_value``).

    Args:
      count: number of elements (>= 1; 1 when `index` is given).
      index: the element (None: `count` seeded random elements; int: flat; tuple: multi-dim).
      seed: seed of the key the caller builds.
      scale: the values are uniform in ``[-scale, scale]`` (output units); None: 4 x the largest
        finite |output| (1 if the output is all zero), capped at the dtype's max.

    Returns:
      A `Fault` whose output differs from the reference in exactly `count` elements; each new
      value is guaranteed to differ from the value it replaces.
    """
    count, index = _check_count_index(count, index)
    seed = _check_int("seed", seed)
    if scale is not None:
        if not _is_number(scale) or not math.isfinite(scale) or scale <= 0:
            _fail(f"scale must be a finite number > 0, got {scale!r}")
        scale = float(scale)
    params = dict(count=count, index=index, seed=seed, scale=scale)

    def check(ctx):
        return _nonfloat_problem(ctx) or _count_problem(count, index, ctx)

    def core(out, reference, operands, key, site):
        k_idx, k_val = jax.random.split(key)
        idx = _pick(k_idx, out.size, count, _static_flat(index, out.shape))
        flat = out.reshape(-1)
        s = _auto_scale(out) if scale is None else jnp.minimum(
            jnp.asarray(scale, float_format(out.dtype).compute_dtype), jnp.finfo(out.dtype).max)
        new = _random_differing(k_val, flat[idx], s)
        return flat.at[idx].set(new)

    return _make("random_value", params, core, check)


_NONFINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def nan_inf(value: str = "nan", *, count: int = 1, index: Index = None, seed: int = 0) -> Fault:
    """Set `count` distinct output elements to NaN, +inf or -inf (taxonomy ``nan_inf``).

    Args:
      value: "nan", "inf" or "-inf".
      count: number of elements (>= 1; 1 when `index` is given).
      index: the element (None: `count` seeded random elements; int: flat; tuple: multi-dim).
      seed: seed of the key the caller builds.

    Returns:
      A `Fault` whose output has exactly `count` elements replaced by `value` (elements that were
      already that value stay so).
    """
    _check_choice("value", value, tuple(_NONFINITE))
    count, index = _check_count_index(count, index)
    seed = _check_int("seed", seed)
    params = dict(value=value, count=count, index=index, seed=seed)

    def check(ctx):
        return _nonfloat_problem(ctx) or _count_problem(count, index, ctx)

    def core(out, reference, operands, key, site):
        idx = _pick(key, out.size, count, _static_flat(index, out.shape))
        return out.reshape(-1).at[idx].set(jnp.asarray(_NONFINITE[value], out.dtype))

    return _make("nan_inf", params, core, check)


# ----------------------------------------------------------------------------------------------
# 4. Zeroing, 5. stuck-at bits, 6. scale, 7. sign flip
# ----------------------------------------------------------------------------------------------

def _fraction_problem(fraction: float, ctx: _Ctx) -> Optional[_Problem]:
    if ctx.out_shape is not None and _count(fraction, math.prod(ctx.out_shape)) == 0:
        return _Problem(f"fraction={fraction} selects no element of {math.prod(ctx.out_shape)}: "
                        "nothing to change", False)
    return None


def zero(fraction: float = 1.0, *, seed: int = 0) -> Fault:
    """Zero exactly ``round(fraction * size)`` seeded output elements (taxonomy ``zeroed``).

    Args:
      fraction: share of the elements to zero, in [0, 1]; 1.0 zeroes all (no randomness).
      seed: seed of the key the caller builds.

    Returns:
      A `Fault` whose output is +0.0 at the selected elements and the reference elsewhere.
    """
    fraction = _check_fraction(fraction)
    seed = _check_int("seed", seed)
    params = dict(fraction=fraction, seed=seed)

    def check(ctx):
        return _nonfloat_problem(ctx) or _fraction_problem(fraction, ctx)

    def core(out, reference, operands, key, site):
        mask = _mask_k(key, out.size, _count(fraction, out.size))
        return jnp.where(mask, jnp.zeros((), out.dtype), out.reshape(-1))

    return _make("zeroed", params, core, check)


def stuck_at(bit: int, value: int = 1, *, fraction: float = 1.0, seed: int = 0) -> Fault:
    """Force bit `bit` to `value` in ``round(fraction * size)`` seeded elements (name ``stuck_at``).

    Emulates a stuck-at fault on one line of a datapath. Only elements whose bit differed change,
    each in exactly that bit, so the detector sees it as ``bit_flip`` (isolated elements, one
    differing bit) or, with many elements, a structured pattern; ``stuck_at`` is not itself a
    taxonomy name.

    Args:
      bit: bit position (0 = LSB of the dtype's pattern), checked against the dtype at trace time.
      value: 0 or 1.
      fraction: share of the elements whose bit is forced, in [0, 1] (1.0: all).
      seed: seed of the key the caller builds.

    Returns:
      A `Fault` whose output has bit `bit` equal to `value` in the selected elements.
    """
    bit = _check_int("bit", bit, minimum=0)
    if isinstance(value, bool) or value not in (0, 1):
        _fail(f"value must be 0 or 1, got {value!r}")
    value = int(value)
    fraction = _check_fraction(fraction)
    seed = _check_int("seed", seed)
    params = dict(bit=bit, value=value, fraction=fraction, seed=seed)

    def check(ctx):
        return (_nonfloat_problem(ctx) or _bits_problem([bit], 1, ctx)
                or _fraction_problem(fraction, ctx))

    def core(out, reference, operands, key, site):
        f = float_format(out.dtype)
        mask = _mask_k(key, out.size, _count(fraction, out.size))
        u = to_bits(out).reshape(-1)
        b = f.uint(1 << bit)
        forced = (u | b) if value else (u & f.uint(~(1 << bit) & ((1 << f.bits) - 1)))
        return from_bits(jnp.where(mask, forced, u), out.dtype)

    return _make("stuck_at", params, core, check)


def scale(factor: float, *, seed: int = 0) -> Fault:
    """Multiply the whole output by `factor` (taxonomy ``wrong_scale``).

    Args:
      factor: a finite number. It is cast to the output dtype and the product is computed in
        that dtype (exact for powers of two, barring overflow / underflow).
      seed: unused (no randomness), kept in params like every fault's.

    Returns:
      A `Fault` whose output is ``reference * factor`` in the output dtype.
    """
    if not _is_number(factor) or not math.isfinite(factor):
        _fail(f"factor must be a finite number, got {factor!r}")
    factor = float(factor)
    seed = _check_int("seed", seed)
    params = dict(factor=factor, seed=seed)

    def check(ctx):
        return _nonfloat_problem(ctx)

    def core(out, reference, operands, key, site):
        return out * jnp.asarray(factor, out.dtype)

    return _make("wrong_scale", params, core, check)


def sign_flip(fraction: float = 1.0, *, seed: int = 0) -> Fault:
    """Negate exactly ``round(fraction * size)`` seeded output elements (taxonomy ``sign_flip``).

    Args:
      fraction: share of the elements to negate, in [0, 1]; 1.0 negates all (no randomness).
      seed: seed of the key the caller builds.

    Returns:
      A `Fault` whose output is ``-reference`` at the selected elements (exact: only the sign bit
      changes; zeros become -0.0, NaN keeps being NaN) and the reference elsewhere.
    """
    fraction = _check_fraction(fraction)
    seed = _check_int("seed", seed)
    params = dict(fraction=fraction, seed=seed)

    def check(ctx):
        return _nonfloat_problem(ctx) or _fraction_problem(fraction, ctx)

    def core(out, reference, operands, key, site):
        mask = _mask_k(key, out.size, _count(fraction, out.size))
        flat = out.reshape(-1)
        return jnp.where(mask, -flat, flat)

    return _make("sign_flip", params, core, check)


# ----------------------------------------------------------------------------------------------
# 8. Reduced precision, 9. low-precision accumulation
# ----------------------------------------------------------------------------------------------

def truncate(precision: str = "bf16", *, where: str = "inputs", seed: int = 0) -> Fault:
    """Emulate a narrower number format (taxonomy ``reduced_precision``).

    Rounding is round-to-nearest-even. "tf32" (10 mantissa bits) and "bf16" (7) round the
    mantissa keeping the value's own exponent range (float32's range for float32 values, as TF32
    and bfloat16 have); "fp16" rounds through float16 (10 bits and float16's range: overflow to
    inf, float16 subnormals). A value whose dtype is already that narrow or narrower (e.g. bfloat16
    for "bf16" or "tf32", float16 for "tf32") is left as it is: the fault is then a no-op, and
    ``supports`` says so.

    Args:
      precision: "tf32", "bf16" or "fp16" ("bfloat16" and "float16" are accepted as aliases).
      where: "inputs" rounds the floating operands and calls ``reference`` on them (the products
        of a matmul then see narrow inputs, the accumulation stays wide); "output" rounds the
        reference output.
      seed: unused, kept in params like every fault's.

    Returns:
      A `Fault` whose output has the reference's shape and dtype.
    """
    precision = _normalise_precision("precision", precision)
    _check_choice("where", where, ("inputs", "output"))
    seed = _check_int("seed", seed)
    params = dict(precision=precision, where=where, seed=seed)

    def check(ctx):
        problem = _nonfloat_problem(ctx)
        if problem is not None:
            return problem
        if (where == "output" and ctx.out_dtype is not None
                and already_as_narrow(ctx.out_dtype, precision)):
            return _Problem(f"output dtype {jnp.dtype(ctx.out_dtype).name} is already as narrow as "
                            f"{precision}: no-op", False)
        if where == "inputs" and ctx.in_dtypes is not None:
            floats = [d for d in ctx.in_dtypes if _is_float(d)]
            if not floats:
                return _Problem("no floating operand to round: no-op", False)
            if all(already_as_narrow(d, precision) for d in floats):
                return _Problem(f"every floating operand is already as narrow as {precision}: "
                                "no-op", False)
        return None

    def core(out, reference, operands, key, site):
        if where == "output":
            return round_to_format(out, precision)
        rounded = tuple(round_to_format(o, precision) if _is_float(jnp.result_type(o)) else o
                        for o in operands)
        return reference(*rounded)

    return _make("reduced_precision", params, core, check)


def _reduction_axes(site) -> tuple[Optional[tuple], Optional[str]]:
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


def low_precision_accumulation(dtype: str = "bf16", *, chunk: int = 8, seed: int = 0) -> Fault:
    """Accumulate a reduction in a narrow format (taxonomy ``low_precision_accumulation``).

    The reduction dimension is split into chunks of `chunk` elements (a shorter last chunk when
    the length does not divide). Each chunk's partial result is ``reference`` on the operands
    sliced to that chunk (computed at the reference's own precision), and the partials are added
    in order into a running sum that is rounded to `dtype` after every add (the first partial
    included), then cast to the output dtype. The error is biased and grows with the number of
    chunks, like a kernel that keeps its accumulator in a narrow format.

    dot_general: the lhs and rhs are sliced along their first contracting dimension pair (other
    contracting dimensions are summed inside each partial). reduce_sum: the operand is sliced along
    the last axis in ``site.params["axes"]`` (other reduced axes are summed inside each partial).
    Needs the site; ``supports`` gives a reason for other primitives and for ``site=None``, and
    ``apply`` raises there.

    Args:
      dtype: accumulator format, "bf16", "fp16" or "tf32" (rounded as in `truncate`).
      chunk: reduction elements per partial result (>= 1).
      seed: unused, kept in params like every fault's.

    Returns:
      A `Fault` whose output has the reference's shape and dtype.
    """
    dtype = _normalise_precision("dtype", dtype)
    chunk = _check_int("chunk", chunk, minimum=1)
    seed = _check_int("seed", seed)
    params = dict(dtype=dtype, chunk=chunk, seed=seed)

    def check(ctx):
        problem = _nonfloat_problem(ctx)
        if problem is not None:
            return problem
        axes, reason = _reduction_axes(ctx.site)
        if reason is not None:
            return _Problem(reason, True)
        if ctx.in_shapes is not None:
            if len(ctx.in_shapes) < len(axes):
                return _Problem(f"expected {len(axes)} operand(s), got {len(ctx.in_shapes)}", True)
            for shape, ax in zip(ctx.in_shapes, axes):
                if not -len(shape) <= ax < len(shape):
                    return _Problem(f"reduction axis {ax} is out of range for operand shape "
                                    f"{shape}", True)
        return None

    def core(out, reference, operands, key, site):
        axes, _ = _reduction_axes(site)
        axes = tuple(ax % jnp.ndim(o) for ax, o in zip(axes, operands))
        sliced_ops, rest = operands[:len(axes)], operands[len(axes):]
        length = jnp.shape(sliced_ops[0])[axes[0]]
        cdt = float_format(out.dtype).compute_dtype

        def partial(start, size):
            parts = tuple(lax.dynamic_slice_in_dim(o, start, size, ax)
                          for o, ax in zip(sliced_ops, axes))
            return reference(*parts, *rest).astype(cdt)

        n_full, tail = divmod(length, chunk)
        if n_full == 0:
            return round_to_format(partial(0, tail), dtype)
        acc = round_to_format(partial(0, chunk), dtype)

        def step(i, acc):
            return round_to_format(acc + partial(i * chunk, chunk), dtype)

        acc = lax.fori_loop(1, n_full, step, acc)
        if tail:
            acc = round_to_format(acc + partial(n_full * chunk, tail), dtype)
        return acc

    return _make("low_precision_accumulation", params, core, check)


# ----------------------------------------------------------------------------------------------
# 10. Tile boundaries, 11. permuted layout, 12. operand corruption
# ----------------------------------------------------------------------------------------------

def tile_boundary(block: int = 32, *, axis: int = -1, where: str = "last_partial",
                  mode: str = "garbage", seed: int = 0) -> Fault:
    """Corrupt the elements at tile boundaries along one axis (taxonomy ``tile_boundary``).

    With ``n = shape[axis]``: where="last_partial" corrupts indices ``>= (n // block) * block``
    (the last partial block; when `block` divides `n`, the last full block; when ``n < block``,
    everything); where="edges" corrupts the first and last index of every block (the last block
    may be partial: its last index is ``n - 1``).

    Args:
      block: tile size along `axis` (> 0).
      axis: the tiled axis of the output.
      where: "last_partial" or "edges".
      mode: "garbage" (seeded random values, each differing from the reference, uniform in 4 x
        the largest finite |output|), "zero" (+0.0), or "stale" (the value one block earlier along
        `axis`, as a kernel reading a stale buffer; positions in the first block have no earlier
        block and are left unchanged, and values equal to their stale copy do not change).
      seed: seed of the key the caller builds.

    Returns:
      A `Fault` whose output differs from the reference only at the selected positions.
    """
    block = _check_int("block", block, minimum=1)
    axis = _check_int("axis", axis)
    _check_choice("where", where, ("last_partial", "edges"))
    _check_choice("mode", mode, ("garbage", "zero", "stale"))
    seed = _check_int("seed", seed)
    params = dict(block=block, axis=axis, where=where, mode=mode, seed=seed)

    def check(ctx):
        problem = _nonfloat_problem(ctx)
        if problem is not None or ctx.out_shape is None:
            return problem
        nd = len(ctx.out_shape)
        if not -nd <= axis < nd:
            return _Problem(f"axis {axis} is out of range for output shape {ctx.out_shape}", True)
        n = ctx.out_shape[axis]
        if mode == "stale" and n <= block:
            return _Problem(f"mode='stale' needs a block before the corrupted ones "
                            f"(axis length {n} <= block {block}): no-op", False)
        return None

    def core(out, reference, operands, key, site):
        ax = axis % out.ndim
        n = out.shape[ax]
        pos = lax.broadcasted_iota(jnp.int32, out.shape, ax)
        if where == "last_partial":
            start = (n // block) * block
            if start == n:
                start = n - block
            mask = pos >= max(start, 0)
        else:
            r = pos % block
            mask = (r == 0) | (r == block - 1) | (pos == n - 1)
        if mode == "garbage":
            new = _random_differing(key, out, _auto_scale(out))
        elif mode == "zero":
            new = jnp.zeros_like(out)
        else:
            src = jnp.clip(jnp.arange(n) - block, 0, n - 1)
            new = jnp.take(out, src, axis=ax)
            mask = mask & (pos >= block)
        return jnp.where(mask, new, out)

    return _make("tile_boundary", params, core, check)


def permute(kind: str = "transpose", *, block: Optional[int] = None, seed: int = 0) -> Fault:
    """Put the right values in the wrong places (taxonomy ``permuted_layout``).

    Args:
      kind: "transpose" swaps the last two axes (they must have equal sizes); "tile_swap" swaps
        two different seeded blocks of `block` rows along axis 0 (only full blocks; at least two
        must exist).
      block: rows per block, required for "tile_swap" (> 0).
      seed: seed of the key the caller builds.

    Returns:
      A `Fault` whose output holds the reference's values, rearranged (a symmetric output is
      unchanged by "transpose", equal blocks by "tile_swap").
    """
    _check_choice("kind", kind, ("transpose", "tile_swap"))
    if kind == "tile_swap":
        if block is None:
            _fail("kind='tile_swap' needs block (rows per block)")
        block = _check_int("block", block, minimum=1)
    elif block is not None:
        _fail("block is only used with kind='tile_swap'")
    seed = _check_int("seed", seed)
    params = dict(kind=kind, block=block, seed=seed)

    def check(ctx):
        problem = _nonfloat_problem(ctx)
        if problem is not None or ctx.out_shape is None:
            return problem
        shape = ctx.out_shape
        if kind == "transpose":
            if len(shape) < 2 or shape[-1] != shape[-2]:
                return _Problem(f"transpose needs the last two axes of equal size, output shape "
                                f"is {shape}", True)
        elif len(shape) < 1 or shape[0] // block < 2:
            return _Problem(f"tile_swap needs two full blocks of {block} along axis 0, output "
                            f"shape is {shape}", True)
        return None

    def core(out, reference, operands, key, site):
        if kind == "transpose":
            return jnp.swapaxes(out, -1, -2)
        nb = out.shape[0] // block
        k1, k2 = jax.random.split(key)
        i = jax.random.randint(k1, (), 0, nb, dtype=jnp.int32)
        j = (i + jax.random.randint(k2, (), 1, nb, dtype=jnp.int32)) % nb
        rows = jnp.arange(out.shape[0], dtype=jnp.int32)
        blk = rows // block
        src = jnp.where(blk == i, rows + (j - i) * block,
                        jnp.where(blk == j, rows + (i - j) * block, rows))
        return jnp.take(out, src, axis=0)

    return _make("permuted_layout", params, core, check)


def operand_corruption(operand: int = 0, *, axis: int = 0, index: Optional[int] = None,
                       mode: str = "random", seed: int = 0) -> Fault:
    """Corrupt one slice of one operand, then compute the op (taxonomy ``operand_corruption``).

    The slice ``index`` along `axis` of operand `operand` (a row when axis=0) is replaced, and
    ``reference`` runs on the corrupted operands, so a whole row / column of the output is wrong
    (for a matmul ``a @ b``: operand 0, axis 0 -> one output row; operand 1, axis 1 -> one column).

    Args:
      operand: which operand (position in ``operands``); it must be floating.
      axis: the operand axis the slice is taken across.
      index: the slice (int, negative counts from the end); None: a seeded random slice.
      mode: "random" (seeded values uniform in 4 x the operand's largest finite |value|, each
        differing from the original) or "zero".
      seed: seed of the key the caller builds.

    Returns:
      A `Fault` whose output has the reference's shape and dtype.
    """
    operand = _check_int("operand", operand, minimum=0)
    axis = _check_int("axis", axis)
    if index is not None:
        index = _check_int("index", index)
    _check_choice("mode", mode, ("random", "zero"))
    seed = _check_int("seed", seed)
    params = dict(operand=operand, axis=axis, index=index, mode=mode, seed=seed)

    def check(ctx):
        problem = _nonfloat_problem(ctx)
        if problem is not None or ctx.in_shapes is None:
            return problem
        if operand >= len(ctx.in_shapes):
            return _Problem(f"operand {operand} does not exist ({len(ctx.in_shapes)} operands)",
                            True)
        if ctx.in_dtypes is not None and not _is_float(ctx.in_dtypes[operand]):
            return _Problem(f"operand {operand} is not floating "
                            f"({jnp.dtype(ctx.in_dtypes[operand]).name})", True)
        shape = ctx.in_shapes[operand]
        if not -len(shape) <= axis < len(shape):
            return _Problem(f"axis {axis} is out of range for operand {operand} of shape "
                            f"{shape}", True)
        n = shape[axis]
        if n == 0:
            return _Problem(f"operand {operand} is empty along axis {axis}", True)
        if index is not None and not -n <= index < n:
            return _Problem(f"index {index} is out of range for axis {axis} of length {n}", True)
        return None

    def core(out, reference, operands, key, site):
        x = jnp.asarray(operands[operand])
        ax = axis % x.ndim
        n = x.shape[ax]
        k_idx, k_val = jax.random.split(key)
        i = (jnp.asarray(index % n, jnp.int32) if index is not None
             else jax.random.randint(k_idx, (), 0, n, dtype=jnp.int32))
        mask = lax.broadcasted_iota(jnp.int32, x.shape, ax) == i
        new = (_random_differing(k_val, x, _auto_scale(x)) if mode == "random"
               else jnp.zeros_like(x))
        ops = list(operands)
        ops[operand] = jnp.where(mask, new, x)
        return reference(*ops)

    return _make("operand_corruption", params, core, check)


# ----------------------------------------------------------------------------------------------
# Catalogue and description
# ----------------------------------------------------------------------------------------------

ALL: tuple[str, ...] = (
    "bit_flip", "multi_bit_flip", "random_value", "zero", "stuck_at", "scale", "sign_flip",
    "truncate", "low_precision_accumulation", "tile_boundary", "permute", "operand_corruption",
    "nan_inf",
)
"""Names of the fault constructors in this module (``getattr(faults, name)``)."""


def _describe_params(name: str, params: Mapping[str, Any]) -> str:
    """The constructor call for a fault `name` with `params`, default-valued arguments left out."""
    # A fault is named after the model it emulates, except stuck_at (not a taxonomy model).
    ctor_name = taxonomy.fault_constructor(name) or (name if name in ALL else None)
    ctor = globals().get(ctor_name) if ctor_name else None
    if ctor is None:
        return f"{name}({', '.join(f'{k}={v!r}' for k, v in params.items())})"
    sig = inspect.signature(ctor)
    shown = []
    for pname, p in sig.parameters.items():
        if pname not in params:
            continue
        value = params[pname]
        if p.default is inspect.Parameter.empty or value != p.default:
            shown.append(f"{pname}={value!r}")
    extra = [f"{k}={v!r}" for k, v in params.items() if k not in sig.parameters]
    return f"{ctor_name}({', '.join(shown + extra)})"


def describe(fault: Fault) -> str:
    """A one-line description of `fault`: the constructor call that makes it, e.g.
    ``"bit_flip(bit=30, index=0)"`` (arguments at their default value are left out)."""
    return _describe_params(fault.name, fault.params)
