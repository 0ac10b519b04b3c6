"""``peat.check_kernel``: a candidate kernel against its reference, forward and backward, on the
example inputs and on adversarial variants of them, with repeats for nondeterminism.

Every comparison is an `analyze` + `detect` (the noise floor from a float64 evaluation of the
reference when that is possible), so no ``atol`` is needed: a candidate returning zeros fails as
``zeroed`` whatever the output's magnitude, and a correct candidate with near-zero outputs passes.
The worst diagnosis is returned, with ``evidence["origin"]`` naming the input variant and the
output (``"forward"``; ``"grad[i]"`` for the gradient with respect to positional argument i;
``"forward (vjp)"``, the output the candidate's VJP computed, where it differs from its plain
call's: a ``jax.custom_vjp`` forward rule computes the output that training sees).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from peat_jax.analyzer import analyze
from peat_jax.detector import (Diagnosis, bitwise_equal, by_float64, data_race,
                               detect, narrowed, only_on_odd_shapes, severity)
from peat_jax.errors import PeatError
from peat_jax.formats import float_format, round_to_format
from peat_jax.judge.conditioning import (CONDITIONING_PERTURBATIONS, conditioning_spread,
                                         perturb_inputs, perturbation_spread)
from peat_jax.judge.conditioning import is_float_leaf as _is_float_leaf
from peat_jax.judge.float64 import float64_evidence, max_difference
from peat_jax.judge.rounding import ROUNDING_SAMPLES, rounding_samples
from peat_jax.kernels.pallas.interpret import races_found, reset_interpret_state
from peat_jax.precision import at_matmul_precision, matmul_precision
from peat_jax.promote import widened
from peat_jax.sites import REDUCING_PRIMITIVES, list_sites, reduction_length, trace_key

__all__ = ["CONDITIONING_PERTURBATIONS", "REFERENCE_SPREAD_FACTOR", "VARIANTS", "VJP_FORWARD",
           "check_kernel", "conditioning_spread", "float64_evidence", "make_variant",
           "perturb_inputs", "perturbation_spread"]

VARIANTS: tuple[str, ...] = ("example", "large", "tiny", "near_overflow", "subnormal", "zeros",
                             "outliers", "odd_shape")
"""Input variants `check_kernel` runs by default (see `make_variant`)."""


# ----------------------------------------------------------------------------------------------
# Input variants (built in NumPy on the host: XLA:CPU would flush subnormals)
# ----------------------------------------------------------------------------------------------

def _np(x) -> np.ndarray:
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


def _variant_leaf(name: str, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    fmt = float_format(x.dtype)
    emax, emin = fmt.max_exponent, fmt.min_exponent
    if name == "large":
        return _pow2_scale(x, emax / 4)
    if name == "tiny":
        return _pow2_scale(x, emin / 4)
    if name == "near_overflow":
        return _pow2_scale(x, emax / 2 - 1)
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
        sizes = {int(d) for x in leaves if _is_float_leaf(x) for d in np.shape(x) if d >= 2}
        if not sizes:
            return None
        for x in leaves:
            if not _is_float_leaf(x) and hasattr(x, "shape") and any(
                    d in sizes for d in np.shape(x)):
                return None
        out = []
        for x in leaves:
            if not _is_float_leaf(x):
                out.append(x)
                continue
            xn = _np(x)
            shape = tuple(_odd_size(int(d)) if d in sizes else int(d) for d in xn.shape)
            std = float(np.std(xn.astype(np.float64))) if xn.size else 1.0
            std = std if std > 0 and math.isfinite(std) else 1.0
            out.append((rng.standard_normal(shape) * std).astype(xn.dtype))
        return jax.tree_util.tree_unflatten(treedef, out)
    out = []
    for x in leaves:
        out.append(_variant_leaf(name, _np(x), rng) if _is_float_leaf(x) else x)
    return jax.tree_util.tree_unflatten(treedef, out)


# ----------------------------------------------------------------------------------------------
# Running the candidate and the reference
# ----------------------------------------------------------------------------------------------

def _to_jax(args):
    """`args` with every NumPy array placed on the default device (`jax.device_put`, which
    compiles nothing: `jnp.asarray` compiles a program per new shape on recent jax)."""
    return jax.tree.map(lambda x: jax.device_put(x) if isinstance(x, np.ndarray) else x, args)


def _float_positions(args) -> tuple[int, ...]:
    """Positional arguments holding at least one float leaf (the differentiable inputs)."""
    return tuple(i for i, a in enumerate(args)
                 if any(_is_float_leaf(x) for x in jax.tree_util.tree_leaves(a)))


def _positions(args: tuple, backward: Union[bool, Sequence[int]]) -> tuple[int, ...]:
    """The positions `check_kernel` differentiates (see its `backward`)."""
    floats = _float_positions(args)
    if isinstance(backward, (bool, np.bool_)):
        return floats if backward else ()
    if isinstance(backward, (int, np.integer)):
        backward = (backward,)
    try:
        wanted = tuple(int(i) for i in backward)
    except (TypeError, ValueError):
        raise PeatError(f"backward must be True, False or a sequence of argument positions, got "
                        f"{backward!r}") from None
    bad = [i for i in wanted if i not in floats]
    if bad:
        raise PeatError(f"backward={tuple(backward)!r}: argument(s) {bad} hold no floats to "
                        f"differentiate; the float arguments are {list(floats)}")
    return tuple(i for i in floats if i in wanted)


def _has_float(tree) -> bool:
    return any(jnp.issubdtype(jnp.result_type(x), jnp.floating)
               for x in jax.tree_util.tree_leaves(tree))


def _cotangent(out, rng: np.random.Generator):
    """A standard normal cotangent for each float leaf of `out` (zeros of float0 for others),
    drawn on the host: a jax draw would compile once per new shape."""
    leaves, treedef = jax.tree_util.tree_flatten(out)
    cts = []
    for x in leaves:
        dt = jnp.result_type(x)
        if jnp.issubdtype(dt, jnp.floating):
            cts.append(jax.device_put(rng.standard_normal(jnp.shape(x), np.float32).astype(dt)))
        else:
            cts.append(np.zeros(jnp.shape(x), jax.dtypes.float0))
    return jax.tree_util.tree_unflatten(treedef, cts)


@dataclasses.dataclass(frozen=True)
class _Pinned:
    """A reference traced, forward and backward, at one matmul precision (`_vjp` keeps the
    precision for the backward pass too: a custom VJP's backward is traced there)."""

    fn: Callable
    precision: str

    def __call__(self, *args):
        with at_matmul_precision(self.precision):
            return self.fn(*args)


VJP_FORWARD = "forward (vjp)"
"""The output a candidate's VJP computed, checked where it differs from its plain call's."""


class _Outputs(NamedTuple):
    """What one callable computed on a run's inputs under one cotangent."""

    forward: Any        # the plain call's output (None when not asked for)
    vjp_forward: Any    # the output jax.vjp computed (a custom VJP's forward rule's)
    grads: tuple        # the gradients, by differentiated position


def _vjp(fn: Callable, args: tuple, positions: Sequence[int], ct,
         plain_forward: bool = False) -> _Outputs:
    """`fn`'s output under `jax.vjp` and its gradients of <fn(*args), ct> with respect to
    args[i] for i in positions; with `plain_forward`, the plain call's output too.

    A jitted `fn` (or a `_Pinned` one) whose arguments and cotangent are all arrays runs as one
    jitted program (`_jitted_vjp`): `jax.vjp` of a jitted function compiles two (the
    linearised forward and the transposed backward), and a plain call one more, per new shape.
    Any other `fn` runs as given, eagerly (jit would reject a callable that branches on values
    or takes Python scalars)."""
    with at_matmul_precision(fn.precision if isinstance(fn, _Pinned) else None):
        if _fusable(fn, args, ct):
            return _jitted_vjp(fn, tuple(positions), plain_forward)(args, ct)
        out, grads = _vjp_traced(fn, args, positions, ct)
        return _Outputs(forward=fn(*args) if plain_forward else None, vjp_forward=out,
                        grads=tuple(grads))


def _vjp_traced(fn: Callable, args: tuple, positions: Sequence[int], ct):
    """`_vjp` as a function of `args` and `ct`, eager or under a trace."""
    def f(*diff):
        full = list(args)
        for i, d in zip(positions, diff):
            full[i] = d
        return fn(*full)

    out, pullback = jax.vjp(f, *[args[i] for i in positions])
    return out, pullback(ct)


def _is_jitted(fn: Callable) -> bool:
    """`fn` (or the callable a `_Pinned` wraps) is a hashable `jax.jit` function (it has
    `lower`; hashable, as `_jitted_vjp` caches by it)."""
    try:
        hash(fn)
    except TypeError:
        return False
    return hasattr(fn.fn if isinstance(fn, _Pinned) else fn, "lower")


def _fusable(fn: Callable, args, ct) -> bool:
    """`_vjp` runs `fn` as one jitted program: `fn` is jitted and its arguments and cotangent
    are all arrays."""
    return _is_jitted(fn) and all(isinstance(x, jax.Array)
                                  for x in jax.tree_util.tree_leaves((args, ct)))


def _vjp_body(fn: Callable, positions: tuple[int, ...], plain_forward: bool) -> Callable:
    """`_vjp(fn, args, positions, ct, plain_forward)` as a traceable function of (args, ct)."""
    def vjp(args, ct):
        out, grads = _vjp_traced(fn, args, positions, ct)
        return _Outputs(forward=fn(*args) if plain_forward else None, vjp_forward=out,
                        grads=tuple(grads))
    return vjp


def _program_name(fn: Callable, suffix: str) -> str:
    return f"{getattr(fn.fn if isinstance(fn, _Pinned) else fn, '__name__', 'fn')}_{suffix}"


@functools.lru_cache(maxsize=16)
def _jitted_vjp(fn: Callable, positions: tuple[int, ...], plain_forward: bool) -> Callable:
    """`_vjp(fn, args, positions, ct, plain_forward)` jitted, by its static arguments, so that
    checks of the same callable share its compilations (the plain call and the forward under
    `jax.vjp` are one computation to the compiler where they are the same). Named
    "<fn's name>_vjp" (compile logs)."""
    vjp = _vjp_body(fn, positions, plain_forward)
    vjp.__name__ = vjp.__qualname__ = _program_name(fn, "vjp")
    return jax.jit(vjp)


@functools.lru_cache(maxsize=16)
def _jitted_pair(fn: Callable, positions: tuple[int, ...]) -> Callable:
    """``(_vjp(fn, *first, plain_forward=True), _vjp(fn, *second, ...))`` as one jitted program
    of ``(first, second)``, each an (args, ct) pair (see `_Pairing`). Named "<fn's
    name>_vjp_pair"."""
    vjp = _vjp_body(fn, positions, True)

    def pair(first, second):
        return vjp(*first), vjp(*second)

    pair.__name__ = pair.__qualname__ = _program_name(fn, "vjp_pair")
    return jax.jit(pair)


PAIR_MAX_ELEMENTS = 1 << 16
"""Largest odd_shape variant (elements of its float inputs) that `check_kernel` compiles with
the example's shapes as one program (`_Pairing`)."""


@dataclasses.dataclass
class _Pairing:
    """The candidate at the example's shapes and at the odd_shape variant's, compiled as one
    program (`_jitted_pair`): jax and XLA build one program of both in 55-75% of the time they
    take to build the two apart (the interpreted Pallas matmul on CPU), and a small kernel's
    check is mostly its builds. Every call of the
    candidate (forward and backward, jitted) at either shape runs that program with the other
    half on fixed inputs of its shapes (`odd`: the odd_shape variant's; `main`: the first call
    at the example's shapes) and keeps its own half: the same computation, at twice the cost to
    run, which is why only small variants pair (`PAIR_MAX_ELEMENTS`). A paired call that raises
    switches pairing off for the rest of the check, and that call runs alone: an error or a race
    is found, and blamed, in the variant it belongs to.

    Attributes:
      odd: (args, ct) of the odd_shape variant.
      main: (args, ct) of the first call at the example's shapes (None before it).
      on: False once a paired call raised.
    """

    odd: tuple
    main: Optional[tuple] = None
    on: bool = True


def _grad_names(positions: Sequence[int]) -> list[str]:
    return [f"grad[{i}]" for i in positions]


def _as64(args):
    def cast(x):
        if _is_float_leaf(x):
            return np.asarray(_np(x), np.float64)
        return x
    return jax.tree.map(cast, args)


def _all_f64(tree) -> bool:
    """True when every float leaf (host arrays) is float64."""
    leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]
    floats = [x for x in leaves if np.issubdtype(x.dtype, np.floating) or x.dtype.kind == "V"
              or x.dtype.name == "bfloat16"]
    return bool(floats) and all(x.dtype == np.float64 for x in floats)


def _same_structure(a, b, dtypes: bool = False) -> bool:
    """Same tree structure and shapes (with `dtypes`, and dtypes: one jitted program serves
    both)."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    return ta == tb and all(np.shape(x) == np.shape(y) and
                            (not dtypes or jnp.result_type(x) == jnp.result_type(y))
                            for x, y in zip(la, lb))


def _call(fn, args, what: str, variant: str):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        raise PeatError(f"the {what} raised on the {variant!r} inputs: "
                        f"{type(e).__name__}: {e}") from e


class _Run(NamedTuple):
    """One input variant and what the candidate and the reference computed on it."""

    variant: str
    args: tuple
    positions: tuple[int, ...]      # positional arguments differentiated (none: forward only)
    cotangent: Any
    candidate: dict[str, Any]       # output ("forward", "grad[i]", VJP_FORWARD) -> value
    reference: dict[str, Any]


_RACE = "the Pallas interpreter's race detector found a data race"


def _call_candidate(fn, args, variant: str):
    """`_call` of the candidate; `_RACE` when it raised because the Pallas interpreter's race
    detector found a data race (the interpreter's state is reset for the next kernel)."""
    try:
        return _call(fn, args, "candidate", variant)
    except PeatError:
        if not races_found():
            raise
        reset_interpret_state()
        return _RACE


def _race_check(variant: str) -> "_Check":
    return _Check(variant, "forward", data_race())


def _forward(fn, args, what: str, variant: str, shapes_only: bool = False) -> Any:
    """`fn`'s output (`fn` the candidate or the reference; with `shapes_only`, its
    `jax.ShapeDtypeStruct`s, traced, not run); `_RACE` when the candidate raised on a data race;
    for the "odd_shape" variant, the reason to skip it (a str) when `fn` rejects the shapes
    instead (a kernel may serve only some shapes)."""
    if shapes_only:
        fn = functools.partial(jax.eval_shape, fn)
    if variant != "odd_shape":
        return _call(fn, args, what, variant) if what == "reference" \
            else _call_candidate(fn, args, variant)
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        if races_found():
            reset_interpret_state()
            return _RACE
        return f"{what} rejects the shapes: {type(e).__name__}"


def _gradients(fn, args, positions, ct, what: str) -> _Outputs:
    """`_vjp` of `fn` (the candidate or the reference) under cotangent `ct`; a clear error when
    it is not differentiable."""
    try:
        return _vjp(fn, args, positions, ct)
    except Exception as e:  # noqa: BLE001
        if what == "reference":
            raise PeatError(f"the reference is not differentiable ({type(e).__name__}: {e}); "
                            "pass backward=False") from e
        raise PeatError(f"the candidate is not differentiable ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}); give it a "
                        "jax.custom_vjp, or pass backward=False") from e


def _named(o: _Outputs, positions: Sequence[int], vjp_forward: Optional[bool]) -> dict[str, Any]:
    """{"forward": ..., VJP_FORWARD: ..., "grad[i]": ...}: VJP_FORWARD when `vjp_forward`,
    or (None) when it differs bitwise from the plain call's output."""
    outs = {"forward": o.forward}
    if vjp_forward or (vjp_forward is None and not _bitwise_equal(o.vjp_forward, o.forward)):
        outs[VJP_FORWARD] = o.vjp_forward
    outs.update(zip(_grad_names(positions), o.grads))
    return outs


def _bitwise_equal(a, b) -> bool:
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    return ta == tb and all(
        np.shape(x) == np.shape(y) and _np(x).dtype == _np(y).dtype
        and _np(x).tobytes() == _np(y).tobytes() for x, y in zip(la, lb))


def _paired_vjp(fn, args, positions, ct, pairing: Optional[_Pairing]) -> Optional[_Outputs]:
    """`_vjp(fn, args, positions, ct, plain_forward=True)` run through `pairing`'s program, or
    None: no pairing (or it is off), `args` of neither of its shapes, or the paired call raised
    (pairing is then switched off, the interpreter's race state reset, and the caller runs `fn`
    alone)."""
    if pairing is None or not pairing.on:
        return None
    here = (args, ct)
    odd = _same_structure(here, pairing.odd, dtypes=True)
    if not odd and pairing.main is None:
        pairing.main = here      # the example's call: the first one
    if pairing.main is None or not (odd or _same_structure(here, pairing.main, dtypes=True)):
        return None
    first, second = (pairing.main, here) if odd else (here, pairing.odd)
    try:
        mine = _jitted_pair(fn, tuple(positions))(first, second)[1 if odd else 0]
    except Exception:  # noqa: BLE001 - the call alone finds and reports it
        pairing.on = False
        if races_found():
            reset_interpret_state()
        return None
    return mine


def _outputs(fn, args, positions, ct, what: str, variant: str, like: Any = None,
             vjp_forward: Optional[bool] = None,
             pairing: Optional[_Pairing] = None) -> Union[dict[str, Any], str]:
    """`fn`'s outputs (the candidate or the reference) under cotangent `ct`, by name (`_named`;
    `vjp_forward` as there), or a reason to skip the variant (see `_forward`).

    A jitted `fn` whose arguments and cotangent are all arrays runs forward and backward as one
    program (`_vjp`: one compilation per new shape, not two; with `pairing`, the candidate's
    program at both of its shapes, `_Pairing`). Anything else, or a program that raised, goes
    step by step, which says which part failed. `like` (the reference's output): the structure
    the candidate's output must have."""
    o = None
    if positions and _fusable(fn, args, ct):
        o = _paired_vjp(fn, args, positions, ct, pairing)
        try:
            o = o if o is not None else _vjp(fn, args, positions, ct, plain_forward=True)
        except Exception:  # noqa: BLE001 - the step-by-step path below reports it
            if races_found():
                reset_interpret_state()
                return _RACE
    out = o.forward if o is not None else _forward(fn, args, what, variant)
    if isinstance(out, str):
        return out
    if like is not None and not _same_structure(out, like):
        raise PeatError(f"on the {variant!r} inputs the candidate returned "
                        f"{jax.tree.map(np.shape, out)}, the reference "
                        f"{jax.tree.map(np.shape, like)}")
    if not positions:
        return {"forward": out}
    if o is None:
        o = _gradients(fn, args, positions, ct, what)._replace(forward=out)
    return _named(o, positions, vjp_forward)


def _run(candidate, reference, variant: str, args, positions, rng: np.random.Generator,
         pairing: Optional[_Pairing] = None) -> Union[_Run, str]:
    """Both callables on one variant's inputs, forward and (for float outputs) backward under
    one random cotangent; or the reason the variant is skipped (see `_forward`)."""
    o = None
    if positions and _is_jitted(reference):
        # one program for the reference's forward and backward: its output's shapes alone
        # draw the cotangent
        gold = _forward(reference, args, "reference", variant, shapes_only=True)
        if isinstance(gold, str):
            return gold
        ct = _cotangent(gold, rng)
        try:
            o = _vjp(reference, args, positions, ct, plain_forward=True) if _has_float(gold) \
                else None
        except Exception:  # noqa: BLE001 - step by step below says which part failed
            o = None
        gold = o.forward if o is not None else _forward(reference, args, "reference", variant)
        if isinstance(gold, str):
            return gold
    else:
        gold = _forward(reference, args, "reference", variant)
        if isinstance(gold, str):
            return gold
        ct = _cotangent(gold, rng)
    positions = positions if _has_float(gold) else ()
    cand_outs = _outputs(candidate, args, positions, ct, "candidate", variant, like=gold,
                         pairing=pairing)
    if isinstance(cand_outs, str):
        return cand_outs
    ref_outs = {"forward": gold}
    if positions:
        if o is None:
            o = _gradients(reference, args, positions, ct, "reference")._replace(forward=gold)
        ref_outs = _named(o, positions, VJP_FORWARD in cand_outs)
    return _Run(variant=variant, args=args, positions=positions, cotangent=ct,
                candidate=cand_outs, reference=ref_outs)


def _outputs_again(fn, run: _Run, what: str,
                   pairing: Optional[_Pairing] = None) -> dict[str, Any]:
    """`fn`'s outputs on the run's inputs once more (a repeat): the run's outputs."""
    outs = _outputs(fn, run.args, run.positions, run.cotangent, what, run.variant,
                    vjp_forward=VJP_FORWARD in run.reference, pairing=pairing)
    if isinstance(outs, str):  # it ran on these inputs before
        raise PeatError(f"the {what} failed on a repeat of the {run.variant!r} inputs: {outs}")
    return outs


def _reference64(reference, run: _Run, args64=None) -> tuple[dict[str, Any], str]:
    """(outputs, why not) of the reference in float64 (by output name) on the run's inputs (or
    on `args64`, float64 host arrays of the same structure): ({}, why) when it cannot run there
    (it raises, or returns a narrower float: a dtype pinned in it); without the gradients (and
    why) when only they are narrower; ("") when all of them are there."""
    try:
        with jax.enable_x64(True):
            a64 = _to_jax(_as64(run.args) if args64 is None else args64)
            if run.positions:
                ct64 = _to_jax(_as64(run.cotangent))
                # the plain call separately only where the candidate's two forwards differ
                # (where they are bitwise equal they are one computation)
                both = VJP_FORWARD in run.reference
                o = _vjp(reference, a64, run.positions, ct64, plain_forward=both)
                outs = _named(o if both else o._replace(forward=o.vjp_forward),
                              run.positions, both)
            else:
                outs = {"forward": reference(*a64)}
            outs = jax.device_get(outs)
    except Exception as e:  # noqa: BLE001 - any failure means "no float64 reference"
        pinned = _narrow_output(reference, _as64(run.args) if args64 is None else args64)
        if pinned:   # the VJP raised on a float64 cotangent for a narrower output
            return {}, pinned
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return {}, f"raised under float64 ({type(e).__name__}: {first[:160]})"
    forwards = [o for o in ("forward", VJP_FORWARD) if o in outs]
    if not all(_all_f64(outs[o]) for o in forwards):
        return {}, _narrow_output(reference, _as64(run.args) if args64 is None else args64)
    if not all(_all_f64(v) for v in outs.values()):
        return ({o: outs[o] for o in forwards},
                "returns gradients narrower than float64 (those outputs only)")
    return outs, ""


def _narrow_dtypes(fn, args64) -> list[str]:
    """The float dtypes narrower than float64 among `fn`'s outputs traced on `args64` (float64
    host arrays): a dtype pinned in it; [] when there are none or it cannot be traced."""
    try:
        with jax.enable_x64(True):
            out = jax.eval_shape(fn, *_to_jax(args64))
    except Exception:  # noqa: BLE001 - the caller reports what raised
        return []
    return sorted({x.dtype.name for x in jax.tree_util.tree_leaves(out)
                   if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != jnp.float64})


def _narrow_output(fn, args64) -> str:
    """Why `fn`'s output is no float64 reference when it pins a narrower dtype
    (`_narrow_dtypes`); "" when it does not."""
    narrow = _narrow_dtypes(fn, args64)
    return (f"returns {', '.join(narrow)} on float64 inputs (a dtype pinned in it: let it "
            f"follow its inputs', e.g. preferred_element_type=jnp.promote_types(x.dtype, "
            f"jnp.float32))") if narrow else ""


class _Float64Reference(NamedTuple):
    """What `check_kernel` evaluates in float64 for the float64 reference."""

    fn: Callable     # the reference, or its float64 shadow (`promote.widened`)
    widened: bool    # fn is the shadow
    note: str        # how it was had, or why it could not be widened ("": the reference as is)


def _float64_reference(reference: "_Pinned", example_args) -> _Float64Reference:
    """`reference` itself unless it pins a narrower float (its output on float64 inputs is
    narrower); then its float64 shadow where that traces, else `reference` with why not."""
    args64 = _as64(example_args)
    narrow = _narrow_dtypes(reference, args64)
    if not narrow:
        return _Float64Reference(fn=reference, widened=False, note="")
    shadow = _Pinned(widened(reference.fn), reference.precision)
    try:
        with jax.enable_x64(True):
            jax.eval_shape(shadow, *_to_jax(args64))
    except Exception as e:  # noqa: BLE001 - the variants then say the floor is the dtype bound
        return _Float64Reference(fn=reference, widened=False, note=(
            f"it cannot be widened to float64: {type(e).__name__}: {e}"))
    return _Float64Reference(fn=shadow, widened=True, note=(
        f"the reference returns {', '.join(narrow)} on float64 inputs: its program widened to "
        "float64 (every float, cast and preferred_element_type; constants computed while "
        "tracing keep their dtype's rounding)"))


def _conditioning(reference, run: _Run, ref64: dict[str, Any], seed: int) -> dict[str, Any]:
    """{output: conditioning spread} for the outputs with a float64 reference
    (`conditioning_spread` of the float64 reference, at the last bit of the inputs' dtype or
    of the finest output dtype, whichever is finer); gradients use the same cotangent. Empty
    when the perturbed reference does not run in float64."""
    if not ref64:
        return {}

    def evaluate(moved):
        out, _ = _reference64(reference, run, moved)
        if set(out) != set(ref64):
            raise _NoFloat64
        return out

    bits = max((float_format(_np(x).dtype).mantissa_bits
                for x in jax.tree.leaves(run.reference) if _is_float_leaf(x)), default=0)
    try:
        return conditioning_spread(evaluate, run.args, ref64, np.random.default_rng(seed), bits)
    except _NoFloat64:
        return {}


class _NoFloat64(Exception):
    """The perturbed reference did not run in float64 where the unperturbed one did."""


# ----------------------------------------------------------------------------------------------
# Comparing
# ----------------------------------------------------------------------------------------------

# A candidate's error within this many times the reference's own run-to-run difference (the
# largest over three runs' pairs) is not blamed on the candidate (check_kernel and playback).
REFERENCE_SPREAD_FACTOR = 4.0


@dataclasses.dataclass(frozen=True)
class _Options:
    """What every comparison of one `check_kernel` call takes."""

    allow: tuple[str, ...]
    atol: Optional[float]
    rtol: Optional[float]
    reduction_length: Optional[int]
    noise_factor: float
    conditioning: bool


@dataclasses.dataclass(frozen=True)
class _Check:
    variant: str
    output: str
    diagnosis: Diagnosis


class _Spread(NamedTuple):
    """One output the reference computes nondeterministically (max |differences|)."""

    reference: float   # the reference against itself, over three runs
    candidate: float   # the candidate against the reference's first run


def _forgive(candidate, golden, atol: Optional[float], rtol: Optional[float]):
    """The escape hatch: candidate elements within atol + rtol * |golden| of the golden are set
    to the golden before the analysis."""
    if atol is None and rtol is None:
        return candidate
    a, r = float(atol or 0.0), float(rtol or 0.0)

    def one(c, g):
        if not jnp.issubdtype(jnp.result_type(g), jnp.floating):
            return c
        c, g = jnp.asarray(c), jnp.asarray(g)
        close = jnp.abs(c.astype(jnp.float32) - g.astype(jnp.float32)) <= \
            a + r * jnp.abs(g.astype(jnp.float32))
        return jnp.where(close, g, c)

    return jax.tree.map(one, candidate, golden)


def _diagnose(cand, gold, ref64, opts: _Options, comparison: str = "golden",
              conditioning=None, reduction_length: Optional[int] = None,
              rounding=None) -> Diagnosis:
    """`detect(analyze(...))` of one output; `reduction_length` (with `ref64` only) is the K
    to use when the caller gave none (`_longest_reduction`). A repeat bitwise equal to the
    first run is ``exact`` without an analysis (as `detect` would say): a deterministic
    kernel's repeats compile no statistics of their own."""
    if comparison == "repeat" and _bitwise_equal(cand, gold):
        return bitwise_equal(sum(np.size(x) for x in jax.tree.leaves(gold)), comparison)
    cand = _forgive(cand, gold, opts.atol, opts.rtol)
    k = opts.reduction_length
    if k is None and ref64 is not None:
        k = reduction_length
    sig = analyze(cand, gold, ref64, reduction_length=k, noise_factor=opts.noise_factor,
                  comparison=comparison, conditioning=conditioning, rounding=rounding)
    return detect(sig, allow=opts.allow)


def _longest_reduction(reference, run: _Run) -> Optional[int]:
    """The most elements any op of the reference's program sums into one output element, on
    the run's inputs, forward and (with gradients) backward (`REDUCING_PRIMITIVES`; a matmul's
    K); None when it sums nothing or cannot be traced."""
    if run.positions:
        def fn(args, ct):
            return _vjp_traced(reference, args, run.positions, ct)
        args = (run.args, run.cotangent)
    else:
        fn, args = reference, run.args
    try:
        sites = list_sites(fn, *args, primitives=REDUCING_PRIMITIVES)
    except Exception:  # noqa: BLE001 - only a refinement of the rounding reach
        return None
    longest = max((reduction_length(s) or 1 for s in sites), default=1)
    return longest if longest > 1 else None


class _Pending(NamedTuple):
    """A check whose analysis runs on a worker thread (`Future` of its `Diagnosis`)."""

    variant: str
    output: str
    diagnosis: Future


@dataclasses.dataclass
class _Found:
    """What running a check's variants finds besides the checks (`_run_variants` fills it).

    Attributes:
      skipped: variant -> why it was skipped.
      spread: (variant, output) -> the reference's run-to-run difference, where it has one.
      runs: variant -> its `_Run`.
      refs64: variant -> the float64 reference's outputs ({} where there is none).
      why64: variant -> why it has no float64 reference (or only some outputs).
      reductions: `_longest_reduction` by the run's shapes (`sites.trace_key`): variants of
        one shape trace the reference's program once.
      conditioning: variant -> {output: conditioning spread} (what `_comparisons` passed).
      reduction: variant -> the K `_comparisons` passed (None: none).
    """

    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    spread: dict[tuple[str, str], _Spread] = dataclasses.field(default_factory=dict)
    runs: dict[str, _Run] = dataclasses.field(default_factory=dict)
    refs64: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    why64: dict[str, str] = dataclasses.field(default_factory=dict)
    reductions: dict[Any, Optional[int]] = dataclasses.field(default_factory=dict)
    conditioning: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    reduction: dict[str, Optional[int]] = dataclasses.field(default_factory=dict)


def _comparisons(pool: ThreadPoolExecutor, reference, reference64: Callable, run: _Run,
                 opts: _Options, seed: int, found: _Found) -> list[_Pending]:
    """Candidate against reference for every output of the run, with the float64 reference
    (`reference64`, the reference or its shadow, evaluated in float64) as the noise floor where
    it exists (kept in ``found.refs64`` for `_judged_by_float64`; where it does not, why in
    ``found.why64``), and its spread under 1-ULP input perturbations as the conditioning floor
    (unless ``opts.conditioning`` is off); analysed on `pool`."""
    ref64, why = _reference64(reference64, run)
    found.refs64[run.variant] = ref64
    if why:
        found.why64[run.variant] = why
    cond = _conditioning(reference64, run, ref64, seed) if opts.conditioning else {}
    k = None
    if ref64 and opts.reduction_length is None:
        shapes = trace_key((run.args, run.cotangent))
        if shapes is None:   # an unhashable static leaf: nothing to key a memo on
            k = _longest_reduction(reference, run)
        else:
            key = (shapes, run.positions)
            if key not in found.reductions:
                found.reductions[key] = _longest_reduction(reference, run)
            k = found.reductions[key]
    found.conditioning[run.variant], found.reduction[run.variant] = cond, k
    return [_Pending(run.variant, output, _submit(
        pool, _diagnose, run.candidate[output], gold, ref64.get(output), opts,
        conditioning=cond.get(output), reduction_length=k))
        for output, gold in run.reference.items()]


def _rounding_outputs(reference, run: _Run, seed: int) -> dict[str, Any]:
    """{output: Monte Carlo samples} of the reference on the run's inputs (`judge.rounding`:
    forward and, with gradients, backward under the run's cotangent), by output name."""
    if not run.positions:
        return {"forward": rounding_samples(reference, run.args, seed)}
    both = VJP_FORWARD in run.reference
    body = _jitted_vjp(reference, run.positions, both) if _is_jitted(reference) else \
        _vjp_body(reference, run.positions, both)
    o = rounding_samples(body, (run.args, run.cotangent), seed)
    return _named(o if both else o._replace(forward=o.vjp_forward), run.positions, both)


def _judged_by_rounding(checks: list[_Check], reference, found: _Found, opts: _Options,
                        seed: int) -> tuple[list[_Check], dict[str, str]]:
    """`checks` with each failing output that has a float64 reference judged again with the
    rounding floor too (`judge.rounding`: `ROUNDING_SAMPLES` Monte Carlo evaluations of the
    reference, once per variant with such an output, on the calling thread), and {variant: why}
    where the reference could not be evaluated that way (the floors without it stand). A
    passing check needs no rounding floor, so a correct kernel pays nothing for it."""
    samples: dict[str, dict[str, Any]] = {}
    why: dict[str, str] = {}
    judged = []
    for c in checks:
        ref64 = found.refs64.get(c.variant, {})
        if c.diagnosis.passed or c.output not in ref64 or c.variant in why:
            judged.append(c)
            continue
        run = found.runs[c.variant]
        if c.variant not in samples:
            try:
                samples[c.variant] = _rounding_outputs(reference, run, seed)
            except Exception as e:  # noqa: BLE001 - the other floors stand; the verdict says why
                first = (str(e).strip().splitlines() or [""])[0]
                why[c.variant] = f"{type(e).__name__}: {first[:160]}"
                judged.append(c)
                continue
        d = _diagnose(run.candidate[c.output], run.reference[c.output], ref64[c.output], opts,
                      conditioning=found.conditioning.get(c.variant, {}).get(c.output),
                      reduction_length=found.reduction.get(c.variant),
                      rounding=samples[c.variant][c.output])
        judged.append(_Check(c.variant, c.output, d))
    return judged, why


def _judged_by_float64(checks: list[_Check], candidate, runs: dict[str, _Run],
                       refs64: dict[str, dict[str, Any]], opts: _Options) -> list[_Check]:
    """`checks` with each failing output that has a float64 reference also judged by the
    candidate's own float64 evaluation (`by_float64`); the candidate runs in float64 once per
    variant with such an output, on the calling thread."""
    cand64: dict[str, dict[str, Any]] = {}
    judged = []
    for c in checks:
        ref64 = refs64.get(c.variant, {})
        if c.diagnosis.passed or c.output not in ref64:
            judged.append(c)
            continue
        run = runs[c.variant]
        if c.variant not in cand64:
            cand64[c.variant], _ = _reference64(candidate, run)
        judged.append(_by_float64(c, run, ref64, cand64[c.variant], opts))
    return judged


def _by_float64(c: _Check, run: _Run, ref64: dict[str, Any], cand64: dict[str, Any],
                opts: _Options) -> _Check:
    """`c` renamed by the detector's float64 rules when the candidate ran in float64 too."""
    o = c.output
    if c.diagnosis.passed or o not in ref64 or o not in cand64:
        return c
    f = float64_evidence(run.candidate[o], run.reference[o], ref64[o], cand64[o])
    return _Check(c.variant, o, by_float64(c.diagnosis, f, allow=opts.allow))


def _repeat_checks(pool: ThreadPoolExecutor, candidate, run: _Run, repeats: int,
                   opts: _Options, pairing: Optional[_Pairing] = None) -> list[_Pending]:
    """`repeats` more runs of the candidate, each against its first run (the dtype bound as the
    floor): ``nondeterministic`` when they differ beyond it; analysed on `pool`."""
    checks = []
    for _ in range(repeats):
        again = _outputs_again(candidate, run, "candidate", pairing)
        checks += [_Pending(run.variant, f"repeat {output}", _submit(
            pool, _diagnose, value, run.candidate[output], None, opts, comparison="repeat"))
            for output, value in again.items()]
    return checks


def _submit(pool: ThreadPoolExecutor, fn: Callable, *args, **kwargs) -> Future:
    """`fn(*args, **kwargs)` on `pool`, under the caller's x64 setting (a ``jax.enable_x64``
    context is the calling thread's only)."""
    x64 = bool(jax.config.jax_enable_x64)

    def under_callers_x64():
        with jax.enable_x64(x64):
            return fn(*args, **kwargs)

    return pool.submit(under_callers_x64)


def _done(value) -> Future:
    """A `Future` that already holds `value`."""
    f: Future = Future()
    f.set_result(value)
    return f


def _analysis_workers() -> int:
    """Threads the analyses of one `check_kernel` run on: XLA compiles each new shape's
    statistics on one thread (1.5-2 s of CPU each), so compiling the outputs' programs side by
    side, while the kernels of the next variant run, uses every core."""
    return max(2, min(8, os.cpu_count() or 2))


def _reference_spread(reference, run: _Run) -> dict[tuple[str, str], _Spread]:
    """{(variant, output): _Spread} for the outputs on which the reference differs from itself
    (an atomics-based reduction, say): empty when a second run matches the first bitwise, else
    the largest difference over three runs' pairs."""
    first = run.reference
    second = _outputs_again(reference, run, "reference")
    if not any(max_difference(second[o], first[o]) > 0 for o in second):
        return {}
    third = _outputs_again(reference, run, "reference")
    spread = {}
    for o in second:
        own = max(max_difference(second[o], first[o]), max_difference(third[o], first[o]),
                  max_difference(third[o], second[o]))
        if own > 0:
            spread[(run.variant, o)] = _Spread(
                reference=own, candidate=max_difference(run.candidate[o], first[o]))
    return spread


def _within_reference_spread(c: _Check, spread: Optional[_Spread]) -> _Check:
    """`c`, or passing as ``numerical_noise`` when it fails by no more than
    `REFERENCE_SPREAD_FACTOR` times the reference's own run-to-run difference."""
    if spread is None or c.diagnosis.passed or \
            spread.candidate > REFERENCE_SPREAD_FACTOR * spread.reference:
        return c
    return _Check(c.variant, c.output, Diagnosis(
        model="numerical_noise", passed=True, confidence=0.5,
        evidence={"rule": "within_reference_spread", "max_abs_error": spread.candidate,
                  "reference_run_to_run": spread.reference, "would_be": c.diagnosis.model},
        summary=(f"passes: max |error| {spread.candidate:.3g} is within "
                 f"{REFERENCE_SPREAD_FACTOR:g}x the reference's own run-to-run difference "
                 f"{spread.reference:.3g} (the reference is nondeterministic)")))


def _with_inputs_rounded(reference: Callable, fmt: str) -> Callable:
    """`reference` fed its float inputs rounded to the narrow format `fmt` (straight through:
    the gradients flow as if unrounded), what a kernel computing in `fmt` would return."""
    def rounded(x):
        if not _is_float_leaf(x):
            return x
        return x + jax.lax.stop_gradient(round_to_format(x, fmt) - x)

    return lambda *args: reference(*jax.tree.map(rounded, args))


def _explained_by_format(checks: list[_Check], runs: dict[str, _Run],
                         reference: Callable) -> list[_Check]:
    """`checks`, with each failing check of another model relabelled ``reduced_precision`` when
    some check names a narrow format F and the candidate's max |error| there is within
    `REFERENCE_SPREAD_FACTOR` times that of the reference fed F-rounded inputs: rounding to F
    explains it (an outlier input rounded to TF32 shifts every output it dominates by one
    constant factor, which the rules alone would call ``wrong_scale``)."""
    formats = _narrowest_formats(checks)
    if not formats:
        return checks
    emulated: dict[tuple[str, str], dict[str, Any]] = {}
    out = []
    for c in checks:
        run = runs.get(c.variant)
        if c.diagnosis.passed or c.diagnosis.model == "reduced_precision" or run is None or \
                c.output not in run.reference:
            out.append(c)
            continue
        error = max_difference(run.candidate[c.output], run.reference[c.output])
        for fmt in formats:
            if (c.variant, fmt) not in emulated:
                emulated[(c.variant, fmt)] = _outputs_again(
                    _with_inputs_rounded(reference, fmt), run, "reference")
            own = max_difference(emulated[(c.variant, fmt)][c.output], run.reference[c.output])
            if 0 < own and error <= REFERENCE_SPREAD_FACTOR * own:
                out.append(_Check(c.variant, c.output, _format_explains(c.diagnosis, fmt, error,
                                                                        own)))
                break
        else:
            out.append(c)
    return out


def _format_explains(d: Diagnosis, fmt: str, error: float, own: float) -> Diagnosis:
    """`d` relabelled ``reduced_precision``: its error is what inputs rounded to `fmt` give (no
    ``max_floor_ratio``: a check the rules named directly is the better one to report)."""
    return Diagnosis(
        model="reduced_precision", passed=False, confidence=0.5,
        evidence={"rule": "explained_by_format", "formats": [fmt], "max_abs_error": error,
                  "format_error": own, "would_be": d.model,
                  "would_be_floor_ratio": d.evidence.get("max_floor_ratio")},
        summary=(f"fails: reduced_precision, inputs rounded to {fmt} explain the error (max "
                 f"|error| {error:.3g}, within {REFERENCE_SPREAD_FACTOR:g}x the reference's own "
                 f"with {fmt} inputs, {own:.3g}; the rules alone said {d.model})"))


def _check_key(c: _Check) -> tuple:
    """Worst last: failing, then model class (`severity`), then a forward failure before the
    gradient failures it usually causes, then the floor ratio."""
    failing, rank, ratio = severity(c.diagnosis)
    return (failing, rank, c.output in ("forward", VJP_FORWARD), ratio)


def _narrowest_formats(checks: Sequence[_Check]) -> tuple[str, ...]:
    """The narrow formats every failing ``reduced_precision`` check fits (each check's own
    values rule formats out by their exponent range: float16 cannot hold the "large" inputs)."""
    sets = [set(c.diagnosis.evidence.get("formats") or ()) for c in checks
            if c.diagnosis.model == "reduced_precision" and not c.diagnosis.passed]
    sets = [x for x in sets if x]
    return tuple(set.intersection(*sets)) if sets else ()


def _verdict(checks: Sequence[_Check], *, skipped: dict[str, str],
             spread: dict[tuple[str, str], _Spread], precision: str,
             no_float64: dict[str, str], float64: _Float64Reference,
             no_rounding: Optional[dict[str, str]] = None) -> Diagnosis:
    """The worst check's diagnosis, its evidence extended with where it came from, every
    check's model, the skipped variants, the reference's matmul precision and its
    nondeterminism, the variants without a float64 reference (and why) and how the float64
    reference was had from a reference that pins a narrower dtype."""
    worst = max(checks, key=_check_key)
    failing = [c for c in checks if not c.diagnosis.passed]
    passing = {c.variant for c in checks} - {c.variant for c in failing}
    d = only_on_odd_shapes(narrowed(worst.diagnosis, _narrowest_formats(checks)),
                           {c.variant for c in failing}, passing)
    ev = dict(d.evidence)
    note = ""
    if spread:
        ev["reference_nondeterministic"] = {f"{o} on {v}": s.reference
                                            for (v, o), s in spread.items()}
        note = (f"; note: the reference itself is nondeterministic (run-to-run max |diff| up to "
                f"{max(s.reference for s in spread.values()):.3g})")
    if float64.note:
        ev["float64_reference"] = float64.note
    if no_float64:
        ev["no_float64_reference"] = dict(no_float64)
        note += (f"; note: the floor is the dtype bound, not a float64 reference, on "
                 f"{len(no_float64)} of {len({c.variant for c in checks})} variants: the "
                 f"reference {next(iter(no_float64.values()))}"
                 + (f"; {float64.note}" if float64.note and not float64.widened else ""))
    if no_rounding:
        ev["no_rounding_floor"] = dict(no_rounding)
        if not d.passed:
            note += (f"; note: no rounding floor on {len(no_rounding)} variants: the reference "
                     f"could not be evaluated under Monte Carlo arithmetic "
                     f"({next(iter(no_rounding.values()))})")
    rounded = _rounded(checks)
    if rounded:
        ev["rounding_checks"] = rounded
        if d.passed:
            note += (f"; {len(rounded)} checks pass within the rounding floor (the spread of "
                     f"{ROUNDING_SAMPLES} correct roundings of the reference, Monte Carlo "
                     "arithmetic) rather than the reference's own error")
    conditioned = _conditioned(checks)
    if conditioned:
        ev["conditioned_checks"] = conditioned
        note += (f"; {len(conditioned)} passing checks are within the problem's conditioning "
                 "rather than the reference's own error")
    ev["origin"] = {"variant": worst.variant, "output": worst.output}
    ev["reference_precision"] = precision
    if d.model in ("reduced_precision", "low_precision_accumulation"):
        note = f"; reference at matmul precision {precision!r}" + note
    ev["checks"] = [[c.variant, c.output, c.diagnosis.model] for c in checks]
    if skipped:
        ev["skipped"] = skipped
    if not d.passed:
        ev["failing_checks"] = sorted({f"{c.output} on {c.variant}" for c in failing})
    where = f" [{worst.output}, {worst.variant} inputs]"
    tail = (f" ({len(failing)} of {len(checks)} checks fail)" if failing
            else f" ({len(checks)} checks)")
    return Diagnosis(model=d.model, passed=d.passed, confidence=d.confidence, evidence=ev,
                     summary=d.summary + where + tail + note)


def _rounded(checks: Sequence[_Check]) -> list[str]:
    """The checks ("output on variant") judged with the rounding floor (they failed without
    it)."""
    return [f"{c.output} on {c.variant}" for c in checks
            if c.diagnosis.evidence.get("rounding_floor") is not None]


def _conditioned(checks: Sequence[_Check]) -> list[str]:
    """The passing checks ("output on variant") that the conditioning floor made pass: elements
    beyond the noise floor within it."""
    return [f"{c.output} on {c.variant}" for c in checks if c.diagnosis.passed and
            (c.diagnosis.evidence.get("conditioning_floor") or {}).get("decisive", 0) > 0]


# ----------------------------------------------------------------------------------------------
# check_kernel
# ----------------------------------------------------------------------------------------------

def _validated_repeats(candidate, reference, example_args: tuple, repeats) -> int:
    """`repeats` as an int, once the call is known to be well-formed (else a PeatError)."""
    if not callable(candidate) or not callable(reference):
        raise PeatError("check_kernel needs callables: check_kernel(candidate, reference, "
                        "*example_args)")
    if not example_args:
        raise PeatError("check_kernel needs example arguments: check_kernel(candidate, "
                        "reference, x, ...)")
    for i, arg in enumerate(example_args):
        for x in jax.tree_util.tree_leaves(arg):
            if _is_float_leaf(x) and np.size(x) == 0:
                raise PeatError(f"check_kernel: example argument {i} has an empty float array "
                                f"(shape {tuple(np.shape(x))}): there is nothing to compare; "
                                f"give inputs whose every dimension is >= 1")
    repeats = int(repeats)
    if repeats < 1:
        raise PeatError(f"repeats must be >= 1, got {repeats}")
    return repeats


def _variant_names(variants: Union[None, str, Sequence[str]]) -> tuple[str, ...]:
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


def check_kernel(candidate: Callable, reference: Callable, *example_args,
                 allow: Iterable[str] = (), repeats: int = 2,
                 variants: Union[None, str, Sequence[str]] = None, seed: int = 0,
                 backward: Union[bool, Sequence[int]] = True,
                 atol: Optional[float] = None,
                 rtol: Optional[float] = None, reduction_length: Optional[int] = None,
                 noise_factor: float = 4.0, reference_precision: Any = "highest",
                 conditioning: bool = True) -> Diagnosis:
    """Check `candidate` against `reference` (plain callables with the same signature).

    For every input variant (`make_variant`): both run on the same inputs; the outputs are
    compared (`analyze` with a float64 evaluation of the reference as the noise floor when the
    reference runs in float64, or its float64 shadow `promote.widened` when it pins a narrower
    dtype; else the dtype bound, and ``evidence["no_float64_reference"]`` and the summary say
    where and why) and diagnosed (`detect`); with
    ``backward=True`` the VJP of both with the same random cotangent is compared for every
    positional argument holding floats. On the example inputs the candidate runs `repeats`
    times (forward and backward) and each run is compared with the first, directly, with the
    dtype bound as the floor (``nondeterministic`` when they differ beyond it). The reference
    also runs twice there: when it differs from itself, it runs twice on every later variant
    too, a failing check whose max |error| is within `REFERENCE_SPREAD_FACTOR` (4) times the
    reference's own run-to-run difference passes as ``numerical_noise`` (evidence rule
    ``within_reference_spread``), and ``evidence["reference_nondeterministic"]`` and the
    summary report it: the reference's nondeterminism is not blamed on the candidate.

    The callables run on the calling thread, as given (jit them for speed: eager, a Pallas
    kernel compiles again at every call); the analyses run on worker threads meanwhile, so the
    analyzer's compilations for new shapes use every core. A jitted candidate whose odd_shape
    variant is small (`PAIR_MAX_ELEMENTS`) is built once for both of its shapes: one program
    computes the example's shapes and the odd variant's (each half bitwise what it computes
    alone), in 55-75% of the build time of two.

    Args:
      candidate, reference: ``fn(*args) -> array or pytree``.
      *example_args: the example inputs (arrays or pytrees).
      allow: models that pass (e.g. ``("reduced_precision",)``).
      repeats: runs of the candidate on the example inputs (>= 1; 1 disables the repeat check).
      variants: variant names (default: all of `VARIANTS`; "example" alone for a quick check).
        A variant the candidate cannot run on is skipped when it is "odd_shape" (the kernel
        accepts only some shapes), an error otherwise.
      seed: seeds the variants and the cotangents.
      backward: also compare gradients: True for every positional argument holding floats,
        or the positions to differentiate (``backward=(0,)`` for a loss of logits and labels:
        data such as labels and masks is not differentiated in training); False: none.
      atol, rtol: NOT the main mechanism: candidate elements within ``atol + rtol * |golden|``
        are treated as equal to the golden before the analysis (an escape hatch for known,
        accepted differences).
      reduction_length, noise_factor: passed to `analyze` (the dtype bound's K; F).
      reference_precision: the matmul precision the reference (and its float64 evaluation) is
        traced at, forward and backward: "highest" (default: full float32, so a kernel that
        claims float32 is held to float32; on GPUs XLA would otherwise compute float32 dots in
        TF32), "high", "default" (what the program would do), jax's other names for them
        ("float32", "tensorfloat32", "bfloat16") or a `jax.lax.Precision`. The candidate runs
        as written.
      conditioning: with a float64 reference, also evaluate it on
        `CONDITIONING_PERTURBATIONS` (3) random perturbations of the inputs at their dtype's
        last bit (`perturb_inputs`; gradients with the same cotangent) and pass the
        element-wise spread to `analyze` as the conditioning floor: a candidate within what the
        problem's conditioning allows passes whatever its algorithm. False: the noise floor
        alone (3 fewer float64 evaluations per variant).

    Returns:
      The worst `Diagnosis` over all checks. ``evidence["origin"]`` is ``{"variant": ...,
      "output": "forward" | "grad[i]" | "forward (vjp)" | "repeat forward" | ...}``
      ("forward (vjp)": the output the candidate's VJP computed, checked where it differs
      from its plain call's); ``evidence["checks"]`` lists
      every check as ``[variant, output, model]``; ``evidence["reference_precision"]`` is the
      reference's matmul precision (also in the summary of a ``reduced_precision`` or
      ``low_precision_accumulation`` verdict). A ``reduced_precision`` verdict names the narrow
      format when one fits every failing check (``evidence["formats"]``: "inputs rounded to tf32").
      A failing output is also judged by the candidate run in float64 (`detector.by_float64`:
      ``unstable_algorithm``, ``approximation``); a candidate stopped by the Pallas
      interpreter's race detector is ``data_race``; a kernel failing only on "odd_shape" is
      ``tile_boundary`` (`detector.only_on_odd_shapes`).

    Raises:
      PeatError: bad options, a candidate or reference that raises, or outputs whose structure
        or shapes differ.
    """
    repeats = _validated_repeats(candidate, reference, example_args, repeats)
    names = _variant_names(variants)
    precision = matmul_precision(reference_precision, "reference_precision")
    reference = _Pinned(reference, precision)
    opts = _Options(allow=tuple(allow), atol=atol, rtol=rtol, reduction_length=reduction_length,
                    noise_factor=noise_factor, conditioning=bool(conditioning))
    example_args = _to_jax(tuple(example_args))
    positions = _positions(example_args, backward)
    float64 = _float64_reference(reference, example_args)
    found = _Found()
    pool = ThreadPoolExecutor(_analysis_workers(), thread_name_prefix="peat-analyze")
    try:
        pending = _run_variants(pool, candidate, reference, float64.fn, example_args, names,
                                positions, repeats, opts, seed, found)
        checks = [_Check(p.variant, p.output, p.diagnosis.result()) for p in pending]
    finally:
        pool.shutdown(cancel_futures=True)   # a raising candidate leaves analyses queued
    checks, no_rounding = _judged_by_rounding(checks, reference, found, opts, seed)
    checks = _judged_by_float64(checks, candidate, found.runs, found.refs64, opts)
    checks = [_within_reference_spread(c, found.spread.get((c.variant, c.output)))
              for c in checks]
    checks = _explained_by_format(checks, found.runs, reference)
    return _verdict(checks, skipped=found.skipped, spread=found.spread, precision=precision,
                    no_float64=found.why64, float64=float64, no_rounding=no_rounding)


def _run_variants(pool, candidate, reference, reference64, example_args, names, positions,
                  repeats, opts, seed, found: _Found) -> list[_Pending]:
    """Runs both callables on every variant in turn (filling `found`; `reference64` evaluated
    in float64 is the float64 reference) and queues the analyses of their outputs on `pool`,
    in check order."""
    checks: list[_Pending] = []
    pairing = _pairing(candidate, reference, example_args, names, positions, seed)
    for vi, name in enumerate(names):
        args = make_variant(name, example_args, seed + vi)
        if args is None:
            found.skipped[name] = "not applicable to these arguments"
            continue
        run = _run(candidate, reference, name, _to_jax(args), positions,
                   np.random.default_rng([seed, vi]), pairing)
        if run is _RACE:
            race = _race_check(name)
            checks.append(_Pending(race.variant, race.output, _done(race.diagnosis)))
            break
        if isinstance(run, str):
            found.skipped[name] = run
            continue
        found.runs[name] = run
        checks += _comparisons(pool, reference, reference64, run, opts, seed + vi, found)
        if repeats > 1 and (name == "example" or found.spread):
            # once the reference differs from itself, every later variant measures how much
            found.spread.update(_reference_spread(reference, run))
        if repeats > 1 and name == "example":
            checks += _repeat_checks(pool, candidate, run, repeats - 1, opts, pairing)
    return checks


def _pairing(candidate, reference, example_args, names, positions, seed) -> Optional[_Pairing]:
    """The check's `_Pairing`, or None: no backward, no odd_shape variant, a candidate that is
    not jitted, a variant with more than `PAIR_MAX_ELEMENTS` float elements or one the
    reference or the candidate cannot trace. The odd variant's inputs and cotangent are those
    `_run_variants` draws for it (same seeds)."""
    if not positions or "odd_shape" not in names or not _is_jitted(candidate):
        return None
    vi = names.index("odd_shape")
    args = make_variant("odd_shape", example_args, seed + vi)
    if args is None or sum(int(np.size(x)) for x in jax.tree_util.tree_leaves(args)
                           if _is_float_leaf(x)) > PAIR_MAX_ELEMENTS:
        return None
    args = _to_jax(args)
    try:
        gold = jax.eval_shape(reference, *args)    # shapes draw the cotangent
    except Exception:  # noqa: BLE001 - the variant's own run reports it
        return None
    if not _has_float(gold):
        return None
    try:   # a candidate that rejects these shapes would fail the pair's trace half way
        jax.eval_shape(candidate, *args)
    except Exception:  # noqa: BLE001 - the variant's own run reports it
        return None
    ct = _cotangent(gold, np.random.default_rng([seed, vi]))
    return _Pairing(odd=(args, ct)) if _fusable(candidate, args, ct) else None
