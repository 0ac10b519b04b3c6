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

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import jax
import numpy as np

from peat_jax._src.analyzer import compile_ahead
from peat_jax._src.check.judging import (Check, FormatOutputs, Found, Options, Pending,
                                         analysis_workers, comparisons, confirmed_formats,
                                         done_future, explained_by_format, judged_by_float64,
                                         judged_by_rounding, per_row_scale, race_check,
                                         reference_spread, repeat_checks, within_spread)
from peat_jax._src.check.programs import Pinned, differentiated_positions, pairing_for, to_jax
from peat_jax._src.check.running import RACE, float64_reference, run_variant
from peat_jax._src.check.variants import make_variant, near_overflow_log2, variant_names
from peat_jax._src.check.verdict import verdict
from peat_jax._src.detector import Diagnosis
from peat_jax._src.errors import PeatError
from peat_jax._src.judge.conditioning import is_float_leaf
from peat_jax._src.precision import matmul_precision


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
            if is_float_leaf(x) and np.size(x) == 0:
                raise PeatError(f"check_kernel: example argument {i} has an empty float array "
                                f"(shape {tuple(np.shape(x))}): there is nothing to compare; "
                                f"give inputs whose every dimension is >= 1")
    repeats = int(repeats)
    if repeats < 1:
        raise PeatError(f"repeats must be >= 1, got {repeats}")
    return repeats


def check_kernel(candidate: Callable, reference: Callable, *example_args,
                 allow: Iterable[str] = (), repeats: int = 2,
                 variants: Union[None, str, Sequence[str]] = None, seed: int = 0,
                 backward: Union[bool, Sequence[int]] = True, atol: Optional[float] = None,
                 rtol: Optional[float] = None, reduction_length: Optional[int] = None,
                 noise_factor: float = 4.0, reference_precision: Any = "highest",
                 conditioning: bool = True) -> Diagnosis:
    """Check `candidate` against `reference` (plain callables with the same signature).

    Both run on the example inputs and on adversarial variants of them (`make_variant`); the
    forward outputs and, with `backward`, the VJPs with one random cotangent are compared
    against the noise, conditioning and rounding floors of a float64 evaluation of the
    reference (docs/error_models.md, "check_kernel: where a diagnosis comes from"); the
    candidate runs `repeats` times on the example inputs (``nondeterministic`` when the runs
    differ beyond the dtype bound). A reference that differs from itself runs twice on every
    variant, and a failure within `REFERENCE_SPREAD_FACTOR` (4) times its own run-to-run
    difference passes (``within_reference_spread``). Each callable runs (on the calling thread)
    as one jitted program per shape, as in a training step; op by op where jit rejects it.

    Args:
      candidate, reference: ``fn(*args) -> array or pytree``.
      *example_args: the example inputs (arrays or pytrees).
      allow: models that pass (e.g. ``("reduced_precision",)``).
      repeats: runs of the candidate on the example inputs (>= 1; 1 disables the repeat check).
      variants: variant names (default: all of `VARIANTS`; "example" alone for a quick check);
        "odd_shape" is skipped where the candidate cannot run on it (it serves some shapes).
      seed: seeds the variants and the cotangents.
      backward: also compare gradients: True for every positional argument holding floats,
        or the positions to differentiate (``backward=(0,)`` for a loss of logits and labels:
        data such as labels and masks is not differentiated in training); False: none.
      atol, rtol: an escape hatch: elements within ``atol + rtol * |golden|`` count as equal.
      reduction_length, noise_factor: passed to `analyze` (the dtype bound's K; F).
      reference_precision: the matmul precision the reference (and its float64 evaluation) is
        traced at: "highest" (default: full float32, where a GPU would use TF32), "high",
        "default", jax's other names for them ("float32", "tensorfloat32", "bfloat16") or a
        `jax.lax.Precision`. The candidate runs as written.
      conditioning: also evaluate the float64 reference on 3 perturbations of the inputs at
        their last bit, whose element-wise spread is the conditioning floor (a candidate
        within it passes); False: 3 fewer float64 evaluations per variant.

    Returns:
      The worst `Diagnosis` over all checks. ``evidence["origin"]`` is ``{"variant": ...,
      "output": "forward" | "grad[i]" | "forward (vjp)" | "repeat forward" | ...}`` ("forward
      (vjp)": the output the candidate's VJP computed, where it differs from its plain call's);
      ``evidence["checks"]`` lists every check as ``[variant, output, model]``;
      ``evidence["reference_precision"]`` is the reference's matmul precision; a
      ``reduced_precision`` verdict names the narrow format that fits every failing check
      (``evidence["formats"]``: "inputs rounded to tf32"). A failing output is also judged by
      the candidate run in float64 (``unstable_algorithm``, ``approximation``); a candidate
      stopped by the Pallas interpreter's race detector is ``data_race``; one failing only on
      "odd_shape" is ``tile_boundary``, only on "near_overflow" ``unstable_algorithm`` (which
      passes, noted, where those inputs are beyond any training's: float32, bfloat16).

    Raises:
      PeatError: bad options, a raising candidate or reference, outputs of unlike structure,
        shapes or dtypes.
    """
    repeats = _validated_repeats(candidate, reference, example_args, repeats)
    names = variant_names(variants)
    precision = matmul_precision(reference_precision, "reference_precision")
    reference = Pinned(reference, precision)
    opts = Options(allow=tuple(allow), atol=atol, rtol=rtol, reduction_length=reduction_length,
                    noise_factor=noise_factor, conditioning=bool(conditioning))
    example_args = to_jax(tuple(example_args))
    positions = differentiated_positions(example_args, backward)
    float64 = float64_reference(reference, example_args)
    found = Found()
    pool = ThreadPoolExecutor(analysis_workers(), thread_name_prefix="peat-analyze")
    try:
        # the statistics' programs compile on a worker while the kernels compile here
        pool.submit(_compile_analyses_ahead, reference, example_args, positions, opts)
        pending = _run_variants(pool, candidate, reference, float64.fn, example_args, names,
                                positions, repeats, opts, seed, found)
        checks = [Check(p.variant, p.output, p.diagnosis.result()) for p in pending]
    finally:
        pool.shutdown(cancel_futures=True)   # a raising candidate leaves analyses queued
    checks, no_rounding = _second_looks(checks, candidate, reference, found, opts, seed)
    return verdict(checks, skipped=found.skipped, spread=found.spread, precision=precision,
                   no_float64=found.why64, float64=float64, no_rounding=no_rounding,
                   near_overflow_log2=near_overflow_log2(example_args))


def _compile_analyses_ahead(reference, example_args: tuple, positions, opts: Options) -> None:
    """`compile_ahead` for the outputs the checks will analyse: the reference's forward
    outputs and the gradients' (the differentiated arguments' shapes), with a float64
    reference. Best effort: a reference that cannot be traced here says so when it runs."""
    try:
        outputs = jax.eval_shape(reference, *example_args)
        grads = [example_args[i] for i in positions]
        compile_ahead((outputs, grads), reference64=True, conditioning=opts.conditioning,
                      noise_factor=opts.noise_factor)
    except Exception:  # noqa: BLE001 - only a head start; the checks report their own errors
        pass


def _second_looks(checks: list[Check], candidate, reference: Pinned, found: Found,
                  opts: Options, seed: int) -> tuple[list[Check], dict[str, str]]:
    """The checks judged again where they fail, in order: by the rounding floor, a narrow format
    that fits, a per-row scale, the candidate's own float64 run, the reference's run-to-run
    spread, and a narrow format that explains the error; and {variant: why} where the rounding
    floor could not be measured."""
    checks, no_rounding = judged_by_rounding(checks, reference, found, opts, seed)
    emulated = FormatOutputs(reference)
    checks = confirmed_formats(checks, found.runs, emulated)
    checks = per_row_scale(checks, found.runs)
    checks = judged_by_float64(checks, candidate, found.runs, found.refs64, opts)
    checks = [within_spread(c, found.spread.get((c.variant, c.output))) for c in checks]
    checks = explained_by_format(checks, found.runs, emulated)
    return checks, no_rounding


def _run_variants(pool, candidate, reference, reference64, example_args, names, positions,
                  repeats, opts, seed, found: Found) -> list[Pending]:
    """Runs both callables on every variant in turn (filling `found`; `reference64` evaluated
    in float64 is the float64 reference) and queues the analyses of their outputs on `pool`,
    in check order."""
    checks: list[Pending] = []
    pairing = pairing_for(candidate, reference, example_args, names, positions, seed)
    for vi, name in enumerate(names):
        args = make_variant(name, example_args, seed + vi)
        if args is None:
            found.skipped[name] = "not applicable to these arguments"
            continue
        run = run_variant(candidate, reference, name, to_jax(args), positions,
                   np.random.default_rng([seed, vi]), pairing)
        if run is RACE:
            race = race_check(name)
            checks.append(Pending(race.variant, race.output, done_future(race.diagnosis)))
            break
        if isinstance(run, str):
            found.skipped[name] = run
            continue
        found.runs[name] = run
        checks += comparisons(pool, reference, reference64, run, opts, seed + vi, found)
        if repeats > 1 and (name == "example" or found.spread):
            # once the reference differs from itself, every later variant measures how much
            found.spread.update(reference_spread(reference, run))
        if repeats > 1 and name == "example":
            checks += repeat_checks(pool, candidate, run, repeats - 1, opts, pairing)
    return checks
