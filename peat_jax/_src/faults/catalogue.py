"""The faults' catalogue: one constructor per modelled pseudo-error (the conventions every
fault keeps are in `peat_jax._src.faults`; the machinery in `peat_jax._src.faults.machinery`)."""
from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from peat_jax._src import taxonomy
from peat_jax._src.faults.machinery import (Context, Fault, Index, Problem, auto_scale,
                                            bits_problem, check_choice, check_count_index,
                                            check_fraction, check_index, check_int, count_problem,
                                            distinct, element_count, fail, fraction_problem,
                                            index_problem, is_number, make_fault, mask_k,
                                            nonfloat_problem, normalise_precision, pick,
                                            random_differing, reduction_axes, static_flat,
                                            xor_element)
from peat_jax._src.formats import (already_as_narrow, float_format, from_bits, is_floating,
                                   round_to_format, to_bits)


# ----------------------------------------------------------------------------------------------
# 1-2. Bit flips
# ----------------------------------------------------------------------------------------------

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
        bit = check_int("bit", bit, minimum=0)
        if bit_class is not None:
            fail("give bit or bit_class, not both")
    check_choice("bit_class", bit_class, ("sign", "exponent", "mantissa", None))
    index = check_index(index)
    seed = check_int("seed", seed)
    params = dict(bit=bit, bit_class=bit_class, index=index, seed=seed)

    def check(ctx):
        return (nonfloat_problem(ctx) or index_problem(index, ctx)
                or bits_problem([] if bit is None else [bit], 1, ctx))

    def core(out, reference, operands, key, site):
        f = float_format(out.dtype)
        k_idx, k_bit = jax.random.split(key)
        idx = pick(k_idx, out.size, 1, static_flat(index, out.shape))[0]
        if bit is not None:
            mask = f.uint(1 << bit)
        else:
            lo, hi = f.bit_range(bit_class)
            b = jax.random.randint(k_bit, (), lo, hi, dtype=jnp.int32)
            mask = jnp.left_shift(jnp.ones((), f.uint), b.astype(f.uint))
        return xor_element(out, idx, mask)

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
            fail("bits must be a sequence of bit positions; use bit_flip for one bit")
        bits = tuple(check_int("bit", b, minimum=0) for b in bits)
        if len(set(bits)) != len(bits):
            fail(f"bits must be distinct, got {bits}")
        if len(bits) < 2:
            fail(f"multi_bit_flip needs at least two bits, got {bits}; use bit_flip for one")
        n_bits = len(bits)
    n_bits = check_int("n_bits", n_bits, minimum=2)
    index = check_index(index)
    seed = check_int("seed", seed)
    params = dict(bits=bits, n_bits=n_bits, index=index, seed=seed)

    def check(ctx):
        return (nonfloat_problem(ctx) or index_problem(index, ctx)
                or bits_problem(bits or (), n_bits, ctx))

    def core(out, reference, operands, key, site):
        f = float_format(out.dtype)
        k_idx, k_bit = jax.random.split(key)
        idx = pick(k_idx, out.size, 1, static_flat(index, out.shape))[0]
        if bits is not None:
            mask = f.uint(sum(1 << b for b in bits))
        else:
            chosen = distinct(k_bit, f.bits, n_bits).astype(f.uint)
            mask = jnp.sum(jnp.left_shift(jnp.ones((), f.uint), chosen), dtype=f.uint)
        return xor_element(out, idx, mask)

    return _make("multi_bit_flip", params, core, check)


# ----------------------------------------------------------------------------------------------
# 3. Random values, 13. NaN / inf
# ----------------------------------------------------------------------------------------------

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
    count, index = check_count_index(count, index)
    seed = check_int("seed", seed)
    if scale is not None:
        if not is_number(scale) or not math.isfinite(scale) or scale <= 0:
            fail(f"scale must be a finite number > 0, got {scale!r}")
        scale = float(scale)
    params = dict(count=count, index=index, seed=seed, scale=scale)

    def check(ctx):
        return nonfloat_problem(ctx) or count_problem(count, index, ctx)

    def core(out, reference, operands, key, site):
        k_idx, k_val = jax.random.split(key)
        idx = pick(k_idx, out.size, count, static_flat(index, out.shape))
        flat = out.reshape(-1)
        s = auto_scale(out) if scale is None else jnp.minimum(
            jnp.asarray(scale, float_format(out.dtype).compute_dtype), jnp.finfo(out.dtype).max)
        new = random_differing(k_val, flat[idx], s)
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
    check_choice("value", value, tuple(_NONFINITE))
    count, index = check_count_index(count, index)
    seed = check_int("seed", seed)
    params = dict(value=value, count=count, index=index, seed=seed)

    def check(ctx):
        return nonfloat_problem(ctx) or count_problem(count, index, ctx)

    def core(out, reference, operands, key, site):
        idx = pick(key, out.size, count, static_flat(index, out.shape))
        return out.reshape(-1).at[idx].set(jnp.asarray(_NONFINITE[value], out.dtype))

    return _make("nan_inf", params, core, check)


# ----------------------------------------------------------------------------------------------
# 4. Zeroing, 5. stuck-at bits, 6. scale, 7. sign flip
# ----------------------------------------------------------------------------------------------

def zeroed(fraction: float = 1.0, *, seed: int = 0) -> Fault:
    """Zero exactly ``round(fraction * size)`` seeded output elements (taxonomy ``zeroed``).

    Args:
      fraction: share of the elements to zero, in [0, 1]; 1.0 zeroes all (no randomness).
      seed: seed of the key the caller builds.

    Returns:
      A `Fault` whose output is +0.0 at the selected elements and the reference elsewhere.
    """
    fraction = check_fraction(fraction)
    seed = check_int("seed", seed)
    params = dict(fraction=fraction, seed=seed)

    def check(ctx):
        return nonfloat_problem(ctx) or fraction_problem(fraction, ctx)

    def core(out, reference, operands, key, site):
        mask = mask_k(key, out.size, element_count(fraction, out.size))
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
    bit = check_int("bit", bit, minimum=0)
    if isinstance(value, bool) or value not in (0, 1):
        fail(f"value must be 0 or 1, got {value!r}")
    value = int(value)
    fraction = check_fraction(fraction)
    seed = check_int("seed", seed)
    params = dict(bit=bit, value=value, fraction=fraction, seed=seed)

    def check(ctx):
        return (nonfloat_problem(ctx) or bits_problem([bit], 1, ctx)
                or fraction_problem(fraction, ctx))

    def core(out, reference, operands, key, site):
        f = float_format(out.dtype)
        mask = mask_k(key, out.size, element_count(fraction, out.size))
        u = to_bits(out).reshape(-1)
        b = f.uint(1 << bit)
        forced = (u | b) if value else (u & f.uint(~(1 << bit) & ((1 << f.bits) - 1)))
        return from_bits(jnp.where(mask, forced, u), out.dtype)

    return _make("stuck_at", params, core, check)


def wrong_scale(factor: float, *, seed: int = 0) -> Fault:
    """Multiply the whole output by `factor` (taxonomy ``wrong_scale``).

    Args:
      factor: a finite number. It is cast to the output dtype and the product is computed in
        that dtype (exact for powers of two, barring overflow / underflow).
      seed: unused (no randomness), kept in params like every fault's.

    Returns:
      A `Fault` whose output is ``reference * factor`` in the output dtype.
    """
    if not is_number(factor) or not math.isfinite(factor):
        fail(f"factor must be a finite number, got {factor!r}")
    factor = float(factor)
    seed = check_int("seed", seed)
    params = dict(factor=factor, seed=seed)

    def check(ctx):
        return nonfloat_problem(ctx)

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
    fraction = check_fraction(fraction)
    seed = check_int("seed", seed)
    params = dict(fraction=fraction, seed=seed)

    def check(ctx):
        return nonfloat_problem(ctx) or fraction_problem(fraction, ctx)

    def core(out, reference, operands, key, site):
        mask = mask_k(key, out.size, element_count(fraction, out.size))
        flat = out.reshape(-1)
        return jnp.where(mask, -flat, flat)

    return _make("sign_flip", params, core, check)


# ----------------------------------------------------------------------------------------------
# 8. Reduced precision, 9. low-precision accumulation
# ----------------------------------------------------------------------------------------------

def reduced_precision(precision: str = "bf16", *, where: str = "inputs", seed: int = 0) -> Fault:
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
    precision = normalise_precision("precision", precision)
    check_choice("where", where, ("inputs", "output"))
    seed = check_int("seed", seed)
    params = dict(precision=precision, where=where, seed=seed)

    def check(ctx):
        problem = nonfloat_problem(ctx)
        if problem is not None:
            return problem
        if (where == "output" and ctx.out_dtype is not None
                and already_as_narrow(ctx.out_dtype, precision)):
            return Problem(f"output dtype {jnp.dtype(ctx.out_dtype).name} is already as narrow as "
                            f"{precision}: no-op", False)
        if where == "inputs" and ctx.in_dtypes is not None:
            floats = [d for d in ctx.in_dtypes if is_floating(d)]
            if not floats:
                return Problem("no floating operand to round: no-op", False)
            if all(already_as_narrow(d, precision) for d in floats):
                return Problem(f"every floating operand is already as narrow as {precision}: "
                                "no-op", False)
        return None

    def core(out, reference, operands, key, site):
        if where == "output":
            return round_to_format(out, precision)
        rounded = tuple(round_to_format(o, precision) if is_floating(jnp.result_type(o)) else o
                        for o in operands)
        return reference(*rounded)

    return _make("reduced_precision", params, core, check)


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
      dtype: accumulator format, "bf16", "fp16" or "tf32" (rounded as in `reduced_precision`).
      chunk: reduction elements per partial result (>= 1).
      seed: unused, kept in params like every fault's.

    Returns:
      A `Fault` whose output has the reference's shape and dtype.
    """
    dtype = normalise_precision("dtype", dtype)
    chunk = check_int("chunk", chunk, minimum=1)
    seed = check_int("seed", seed)
    params = dict(dtype=dtype, chunk=chunk, seed=seed)

    def check(ctx):
        problem = nonfloat_problem(ctx)
        if problem is not None:
            return problem
        axes, reason = reduction_axes(ctx.site)
        if reason is not None:
            return Problem(reason, True)
        if ctx.in_shapes is not None:
            if len(ctx.in_shapes) < len(axes):
                return Problem(f"expected {len(axes)} operand(s), got {len(ctx.in_shapes)}", True)
            for shape, ax in zip(ctx.in_shapes, axes):
                if not -len(shape) <= ax < len(shape):
                    return Problem(f"reduction axis {ax} is out of range for operand shape "
                                    f"{shape}", True)
        return None

    def core(out, reference, operands, key, site):
        axes, _ = reduction_axes(site)
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
    block = check_int("block", block, minimum=1)
    axis = check_int("axis", axis)
    check_choice("where", where, ("last_partial", "edges"))
    check_choice("mode", mode, ("garbage", "zero", "stale"))
    seed = check_int("seed", seed)
    params = dict(block=block, axis=axis, where=where, mode=mode, seed=seed)

    def check(ctx):
        problem = nonfloat_problem(ctx)
        if problem is not None or ctx.out_shape is None:
            return problem
        nd = len(ctx.out_shape)
        if not -nd <= axis < nd:
            return Problem(f"axis {axis} is out of range for output shape {ctx.out_shape}", True)
        n = ctx.out_shape[axis]
        if mode == "stale" and n <= block:
            return Problem(f"mode='stale' needs a block before the corrupted ones "
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
            new = random_differing(key, out, auto_scale(out))
        elif mode == "zero":
            new = jnp.zeros_like(out)
        else:
            src = jnp.clip(jnp.arange(n) - block, 0, n - 1)
            new = jnp.take(out, src, axis=ax)
            mask = mask & (pos >= block)
        return jnp.where(mask, new, out)

    return _make("tile_boundary", params, core, check)


def permuted_layout(kind: str = "transpose", *, block: Optional[int] = None,
                    seed: int = 0) -> Fault:
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
    check_choice("kind", kind, ("transpose", "tile_swap"))
    if kind == "tile_swap":
        if block is None:
            fail("kind='tile_swap' needs block (rows per block)")
        block = check_int("block", block, minimum=1)
    elif block is not None:
        fail("block is only used with kind='tile_swap'")
    seed = check_int("seed", seed)
    params = dict(kind=kind, block=block, seed=seed)

    def check(ctx):
        problem = nonfloat_problem(ctx)
        if problem is not None or ctx.out_shape is None:
            return problem
        shape = ctx.out_shape
        if kind == "transpose":
            if len(shape) < 2 or shape[-1] != shape[-2]:
                return Problem(f"transpose needs the last two axes of equal size, output shape "
                                f"is {shape}", True)
        elif len(shape) < 1 or shape[0] // block < 2:
            return Problem(f"tile_swap needs two full blocks of {block} along axis 0, output "
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
    operand = check_int("operand", operand, minimum=0)
    axis = check_int("axis", axis)
    if index is not None:
        index = check_int("index", index)
    check_choice("mode", mode, ("random", "zero"))
    seed = check_int("seed", seed)
    params = dict(operand=operand, axis=axis, index=index, mode=mode, seed=seed)

    def check(ctx):
        problem = nonfloat_problem(ctx)
        if problem is not None or ctx.in_shapes is None:
            return problem
        if operand >= len(ctx.in_shapes):
            return Problem(f"operand {operand} does not exist ({len(ctx.in_shapes)} operands)",
                            True)
        if ctx.in_dtypes is not None and not is_floating(ctx.in_dtypes[operand]):
            return Problem(f"operand {operand} is not floating "
                            f"({jnp.dtype(ctx.in_dtypes[operand]).name})", True)
        shape = ctx.in_shapes[operand]
        if not -len(shape) <= axis < len(shape):
            return Problem(f"axis {axis} is out of range for operand {operand} of shape "
                            f"{shape}", True)
        n = shape[axis]
        if n == 0:
            return Problem(f"operand {operand} is empty along axis {axis}", True)
        if index is not None and not -n <= index < n:
            return Problem(f"index {index} is out of range for axis {axis} of length {n}", True)
        return None

    def core(out, reference, operands, key, site):
        x = jnp.asarray(operands[operand])
        ax = axis % x.ndim
        n = x.shape[ax]
        k_idx, k_val = jax.random.split(key)
        i = (jnp.asarray(index % n, jnp.int32) if index is not None
             else jax.random.randint(k_idx, (), 0, n, dtype=jnp.int32))
        mask = lax.broadcasted_iota(jnp.int32, x.shape, ax) == i
        new = (random_differing(k_val, x, auto_scale(x)) if mode == "random"
               else jnp.zeros_like(x))
        ops = list(operands)
        ops[operand] = jnp.where(mask, new, x)
        return reference(*ops)

    return _make("operand_corruption", params, core, check)


# ----------------------------------------------------------------------------------------------
# Catalogue and description
# ----------------------------------------------------------------------------------------------

ALL: tuple[str, ...] = (
    "bit_flip", "multi_bit_flip", "random_value", "zeroed", "stuck_at", "wrong_scale",
    "sign_flip", "reduced_precision", "low_precision_accumulation", "tile_boundary",
    "permuted_layout", "operand_corruption",
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


def _make(name: str, params: dict, core: Callable,
          check: Callable[[Context], Optional[Problem]]) -> Fault:
    """`make_fault` with this catalogue's `describe` naming the fault in its errors."""
    return make_fault(name, params, core, check, _describe_params)
