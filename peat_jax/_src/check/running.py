"""Running the candidate and the reference on one variant's inputs (`run_variant`: forward and
backward under one cotangent), again for repeats, and the reference in float64 (the noise
floor's reference) and under perturbed inputs (the conditioning floor)."""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from peat_jax._src.check.programs import (VJP_FORWARD, Outputs, Pairing, Pinned, all_float64,
                                          as_float64, forward_program, fusable, has_float,
                                          is_jitted, named_outputs, paired_vjp, random_cotangent,
                                          same_structure, to_jax, vjp_outputs)
from peat_jax._src.check.variants import host_array
from peat_jax._src.errors import PeatError
from peat_jax._src.formats import float_format
from peat_jax._src.judge.conditioning import conditioning_spread, is_float_leaf
from peat_jax._src.judge.float64 import NO_WIDER
from peat_jax._src.kernels.pallas.interpret import races_found, reset_interpret_state
from peat_jax._src.promote import widened


def called(fn, args, what: str, variant: str):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        raise PeatError(f"the {what} raised on the {variant!r} inputs: "
                        f"{type(e).__name__}: {e}") from e


class Run(NamedTuple):
    """One input variant and what the candidate and the reference computed on it."""

    variant: str
    args: tuple
    positions: tuple[int, ...]      # positional arguments differentiated (none: forward only)
    cotangent: Any
    candidate: dict[str, Any]       # output ("forward", "grad[i]", VJP_FORWARD) -> value
    reference: dict[str, Any]


RACE = "the Pallas interpreter's race detector found a data race"


def _call_candidate(fn, args, variant: str):
    """`called` of the candidate; `RACE` when it raised because the Pallas interpreter's race
    detector found a data race (the interpreter's state is reset for the next kernel)."""
    try:
        return called(fn, args, "candidate", variant)
    except PeatError:
        if not races_found():
            raise
        reset_interpret_state()
        return RACE


def forward_of(fn, args, what: str, variant: str, shapes_only: bool = False) -> Any:
    """`fn`'s output (`fn` the candidate or the reference; with `shapes_only`, its
    `jax.ShapeDtypeStruct`s, traced, not run); `RACE` when the candidate raised on a data race;
    for the "odd_shape" variant, the reason to skip it (a str) when `fn` rejects the shapes
    instead (a kernel may serve only some shapes)."""
    fn = functools.partial(jax.eval_shape, fn) if shapes_only else forward_program(fn, args)
    if variant != "odd_shape":
        return called(fn, args, what, variant) if what == "reference" \
            else _call_candidate(fn, args, variant)
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        if races_found():
            reset_interpret_state()
            return RACE
        return f"{what} rejects the shapes: {type(e).__name__}"


def _gradients(fn, args, positions, ct, what: str) -> Outputs:
    """`vjp_outputs` of `fn` (the candidate or the reference) under cotangent `ct`; a clear
    error when it is not differentiable."""
    try:
        return vjp_outputs(fn, args, positions, ct)
    except Exception as e:  # noqa: BLE001
        if what == "reference":
            raise PeatError(f"the reference is not differentiable ({type(e).__name__}: {e}); "
                            "pass backward=False") from e
        raise PeatError(f"the candidate's backward failed ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}): it is not differentiable "
                        "or its VJP raises; fix it or give it a jax.custom_vjp, or pass "
                        "backward=False to check the forward alone") from e


def outputs_of(fn, args, positions, ct, what: str, variant: str, like: Any = None,
             vjp_forward: Optional[bool] = None,
             pairing: Optional[Pairing] = None) -> Union[dict[str, Any], str]:
    """`fn`'s outputs (the candidate or the reference) under cotangent `ct`, by name
    (`named_outputs`; `vjp_forward` as there), or a reason to skip the variant (see `forward_of`).

    A jitted `fn` whose arguments and cotangent are all arrays runs forward and backward as one
    program (`vjp_outputs`: one compilation per new shape, not two; with `pairing`, the candidate's
    program at both of its shapes, `Pairing`). Anything else, or a program that raised, goes
    step by step, which says which part failed. `like` (the reference's output): the structure
    the candidate's output must have."""
    o = None
    if positions and fusable(fn, args, ct, plain=True):
        o = paired_vjp(fn, args, positions, ct, pairing)
        try:
            o = o if o is not None else vjp_outputs(fn, args, positions, ct, plain_forward=True,
                                                    jit_plain=True)
        except Exception:  # noqa: BLE001 - the step-by-step path below reports it
            if races_found():
                reset_interpret_state()
                return RACE
    out = o.forward if o is not None else forward_of(fn, args, what, variant)
    if isinstance(out, str):
        return out
    if like is not None and not same_structure(out, like, dtypes=True):
        raise PeatError(f"on the {variant!r} inputs the candidate returned {_typed(out)}, the "
                        f"reference {_typed(like)}: make them return the same structure, shapes "
                        "and dtypes (a NumPy scalar or a float64 constant in one of them "
                        f"promotes its result{_cast_hint(out, like)})")
    if not positions:
        return {"forward": out}
    if o is None:
        o = _gradients(fn, args, positions, ct, what)._replace(forward=out)
    return named_outputs(o, positions, vjp_forward)


def _cast_hint(out, like) -> str:
    """Where `out` differs from `like` in dtypes alone: how to check a kernel that returns its
    wider accumulator (flash-attention-jax returns float32 for bfloat16 inputs) as a model
    that casts it back would use it."""
    if not same_structure(out, like):
        return ""
    if jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(like)):
        return (f"; a kernel that returns a wider dtype by design is checked as the model uses "
                f"it: lambda *a: kernel(*a).astype(jnp.{jnp.result_type(like)})")
    return ("; a kernel that returns wider dtypes by design is checked as the model uses it: "
            "cast its outputs to the reference's in a wrapper")


def _typed(tree) -> str:
    """`tree`'s leaves as dtype[shape] (``bfloat16[16, 64]``), in its structure."""
    return str(jax.tree.map(lambda x: f"{jnp.result_type(x)}{list(np.shape(x))}", tree))


def _output_shapes(reference, args, variant: str) -> Any:
    """The reference's output as `jax.ShapeDtypeStruct`s (traced, not run); for a jitted one
    the reason to skip an "odd_shape" variant it rejects (`forward_of`); None where a plain one
    cannot be traced (it reads a value on the host, or rejects the inputs: run op by op, it says
    which)."""
    if is_jitted(reference):
        return forward_of(reference, args, "reference", variant, shapes_only=True)
    try:
        return jax.eval_shape(reference, *args)
    except Exception:  # noqa: BLE001 - the step-by-step path reports it
        return None


def run_variant(candidate, reference, variant: str, args, positions, rng: np.random.Generator,
         pairing: Optional[Pairing] = None) -> Union[Run, str]:
    """Both callables on one variant's inputs, forward and (for float outputs) backward under
    one random cotangent; or the reason the variant is skipped (see `forward_of`)."""
    o = None
    shapes = _output_shapes(reference, args, variant) if positions and \
        fusable(reference, args, (), plain=True) else None
    if shapes is not None:
        # one program for the reference's forward and backward: its output's shapes alone
        # draw the cotangent
        if isinstance(shapes, str):
            return shapes
        ct = random_cotangent(shapes, rng)
        try:
            o = vjp_outputs(reference, args, positions, ct, plain_forward=True,
                            jit_plain=True) if has_float(shapes) else None
        except Exception:  # noqa: BLE001 - step by step below says which part failed
            o = None
        gold = o.forward if o is not None else forward_of(reference, args, "reference", variant)
        if isinstance(gold, str):
            return gold
    else:
        gold = forward_of(reference, args, "reference", variant)
        if isinstance(gold, str):
            return gold
        ct = random_cotangent(gold, rng)
    positions = positions if has_float(gold) else ()
    cand_outs = outputs_of(candidate, args, positions, ct, "candidate", variant, like=gold,
                         pairing=pairing)
    if isinstance(cand_outs, str):
        return cand_outs
    ref_outs = {"forward": gold}
    if positions:
        if o is None:
            o = _gradients(reference, args, positions, ct, "reference")._replace(forward=gold)
        ref_outs = named_outputs(o, positions, VJP_FORWARD in cand_outs)
    return Run(variant=variant, args=args, positions=positions, cotangent=ct,
                candidate=cand_outs, reference=ref_outs)


def outputs_again(fn, run: Run, what: str,
                   pairing: Optional[Pairing] = None) -> dict[str, Any]:
    """`fn`'s outputs on the run's inputs once more (a repeat): the run's outputs."""
    outs = outputs_of(fn, run.args, run.positions, run.cotangent, what, run.variant,
                    vjp_forward=VJP_FORWARD in run.reference, pairing=pairing)
    if isinstance(outs, str):  # it ran on these inputs before
        raise PeatError(f"the {what} failed on a repeat of the {run.variant!r} inputs: {outs}")
    return outs


def float64_outputs(reference, run: Run, args64=None) -> tuple[dict[str, Any], str]:
    """(outputs, why not) of the reference in float64 (by output name) on the run's inputs (or
    on `args64`, float64 host arrays of the same structure): ({}, why) when it cannot run there
    (it raises, or returns a narrower float: a dtype pinned in it); without the gradients (and
    why) when only they are narrower; ("") when all of them are there."""
    try:
        with jax.enable_x64(True):
            a64 = to_jax(as_float64(run.args) if args64 is None else args64)
            if run.positions:
                ct64 = to_jax(as_float64(run.cotangent))
                # the plain call separately only where the candidate's two forwards differ
                # (where they are bitwise equal they are one computation)
                both = VJP_FORWARD in run.reference
                o = vjp_outputs(reference, a64, run.positions, ct64, plain_forward=both,
                                jit_plain=True)
                outs = named_outputs(o if both else o._replace(forward=o.vjp_forward),
                              run.positions, both)
            else:
                outs = {"forward": forward_program(reference, a64)(*a64)}
            outs = jax.device_get(outs)
    except Exception as e:  # noqa: BLE001 - any failure means "no float64 reference"
        pinned = _narrow_output(reference, as_float64(run.args) if args64 is None else args64)
        if pinned:   # the VJP raised on a float64 cotangent for a narrower output
            return {}, pinned
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return {}, f"raised under float64 ({type(e).__name__}: {first[:160]})"
    forwards = [o for o in ("forward", VJP_FORWARD) if o in outs]
    if not all(all_float64(outs[o]) for o in forwards):
        return {}, _narrow_output(reference, as_float64(run.args) if args64 is None else args64)
    if not all(all_float64(v) for v in outs.values()):
        return ({o: outs[o] for o in forwards},
                "returns gradients narrower than float64 (those outputs only)")
    return outs, ""


def wider_reference(reference, run: Run) -> tuple[dict[str, Any], str]:
    """(outputs, why not) of the reference in float64 (`float64_outputs`) that are wider than
    the run's own: an output that is float64 already is left out, since its float64 evaluation
    is the golden itself, whose own rounding error it cannot show (a floor of 0 there calls any
    other correct rounding an error); the dtype bound judges it instead, as without a reference
    (`NO_WIDER` says why). Where every output is float64 the reference is not evaluated."""
    same = {o for o, v in run.reference.items() if all_float64(v)}
    if same and same == set(run.reference):
        return {}, NO_WIDER
    ref64, why = float64_outputs(reference, run)
    if not same & set(ref64):
        return ref64, why
    return {o: v for o, v in ref64.items() if o not in same}, why or NO_WIDER


def narrow_dtypes(fn, args64) -> list[str]:
    """The float dtypes narrower than float64 among `fn`'s outputs traced on `args64` (float64
    host arrays): a dtype pinned in it; [] when there are none or it cannot be traced."""
    try:
        with jax.enable_x64(True):
            out = jax.eval_shape(fn, *to_jax(args64))
    except Exception:  # noqa: BLE001 - the caller reports what raised
        return []
    return sorted({x.dtype.name for x in jax.tree_util.tree_leaves(out)
                   if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != jnp.float64})


def _narrow_output(fn, args64) -> str:
    """Why `fn`'s output is no float64 reference when it pins a narrower dtype
    (`narrow_dtypes`); "" when it does not."""
    narrow = narrow_dtypes(fn, args64)
    return (f"returns {', '.join(narrow)} on float64 inputs (a dtype pinned in it: let it "
            f"follow its inputs', e.g. preferred_element_type=jnp.promote_types(x.dtype, "
            f"jnp.float32))") if narrow else ""


class Float64Reference(NamedTuple):
    """What `check_kernel` evaluates in float64 for the float64 reference."""

    fn: Callable     # the reference, or its float64 shadow (`promote.widened`)
    widened: bool    # fn is the shadow
    note: str        # how it was had, or why it could not be widened ("": the reference as is)


def float64_reference(reference: "Pinned", example_args) -> Float64Reference:
    """`reference` itself unless it pins a narrower float (its output on float64 inputs is
    narrower); then its float64 shadow where that traces, else `reference` with why not."""
    args64 = as_float64(example_args)
    narrow = narrow_dtypes(reference, args64)
    if not narrow:
        return Float64Reference(fn=reference, widened=False, note="")
    shadow = Pinned(widened(reference.fn), reference.precision)
    try:
        with jax.enable_x64(True):
            jax.eval_shape(shadow, *to_jax(args64))
    except Exception as e:  # noqa: BLE001 - the variants then say the floor is the dtype bound
        return Float64Reference(fn=reference, widened=False, note=(
            f"it cannot be widened to float64: {type(e).__name__}: {e}"))
    return Float64Reference(fn=shadow, widened=True, note=(
        f"the reference returns {', '.join(narrow)} on float64 inputs: its program widened to "
        "float64 (every float, cast and preferred_element_type; constants computed while "
        "tracing keep their dtype's rounding)"))


def conditioning_spreads(reference, run: Run, ref64: dict[str, Any], seed: int) -> dict[str, Any]:
    """{output: conditioning spread} for the outputs with a float64 reference
    (`conditioning_spread` of the float64 reference, at the last bit of the inputs' dtype or
    of the finest output dtype, whichever is finer); gradients use the same cotangent. Empty
    when the perturbed reference does not run in float64."""
    if not ref64:
        return {}

    def evaluate(moved):
        out, _ = float64_outputs(reference, run, moved)
        if not set(ref64) <= set(out):
            raise _NoFloat64
        return {o: out[o] for o in ref64}

    bits = max((float_format(host_array(x).dtype).mantissa_bits
                for x in jax.tree.leaves(run.reference) if is_float_leaf(x)), default=0)
    try:
        return conditioning_spread(evaluate, run.args, ref64, np.random.default_rng(seed), bits)
    except _NoFloat64:
        return {}


class _NoFloat64(Exception):
    """The perturbed reference did not run in float64 where the unperturbed one did."""
