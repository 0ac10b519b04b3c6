"""The rounding floor: how far a correct implementation of the reference's algorithm may be from
the truth, measured by Monte Carlo arithmetic on the reference.

The noise floor is one sample of the reference's own rounding (its error against float64): exact
where the reference happens to be exact (a cancellation that its order of operations resolves
to 0), so any other correct rounding there is "beyond the floor". Monte Carlo arithmetic (Parker
1997; Verificarlo's and Verrou's random rounding) measures the spread instead: the reference's
program is evaluated in float64 `ROUNDING_SAMPLES` times with every floating-point result
perturbed at the precision the program computes it in (`monte_carlo`), and rounded to its
output dtype at the end. Each sample is a correct implementation of the same algorithm with other
rounding errors; the per-element spread of the samples around the float64 result is the floor.

The perturbation of one result ``y`` (float64), ``u`` the unit roundoff of the equation's own
dtype in the traced program (float32: ``2**-24``), ``d`` uniform in [-1, 1], drawn per element
and per equation from the sample's fixed stream (`counter_random.uniforms64`):

* an elementwise operation rounds its result: ``y * (1 + u * d)``; a transcendental one
  (`TRANSCENDENTAL`: libraries differ by up to an ULP) ``y * (1 + 2 * u * d)``;
* a sum of K terms t_k (`SUMMING`: a matmul's K, a reduction's extent; an addition or
  subtraction is a sum of 2, whose result may cancel far below its operands) rounds its partial
  sums, at the scale of what it sums, not of its result: ``y + u * sqrt(L) * (d1 * |y| + d2 *
  sqrt(sum t_k**2))`` with L its rounding levels (`_levels`), the partial sums' scale ``|y|`` for
  terms of one sign, ``sqrt(sum t_k**2)`` for terms of either sign; so where the terms cancel
  to (nearly) 0 the floor is rounding at the terms' scale. A pairwise or blocked sum rounds at
  its ~log2 K + 1 levels; one in order, one term after another, K times, at its partial sums'
  scale (their squares sum to about K (y**2 / 3 + sum t_k**2 / 6) in a random order): L = K / 3
  where that is more, for a sum in float32 or float64. In-order sums are common in correct
  kernels: the thread that owns a matmul's output element adds its K products one after another
  (the textbook GPU matmul, a float32 Triton or Pallas loop of FMAs, XLA:CPU's own dot at some
  shapes), and a kernel that walks a long row block by block adds each lane's blocks in order.
  Not a 16-bit sum: every backend accumulates it in float32, and one summed in order in its own
  dtype is the `low_precision_accumulation` fault;
* data movement and selection (`EXACT`: reshape, gather, max, negation, ...) round nothing; a
  cast to a narrower float rounds at the narrower format's unit roundoff.

The samples come in two kinds. In the first `OPERAND_SCALE_SAMPLES` an addition or subtraction
rounds at the scale of its operands, as above (another association order); in the others it
rounds only at the scale of its result, ``y * (1 + u * d)`` (its own rounding in this order).
An addition one of whose operands is a selection of the other (``s - max(s)``: a row's maximum is
one of its own elements) rounds at its result's scale in both kinds: no order of operations mixes
the maximum into the sums that made the row, and every implementation computes ``s - max(s)`` as
0 at the maximum (moved by ``u |s|``, a softmax over logits of 1e18 would overflow ``exp`` in
every sample of the first kind). A non-finite element of a sample excuses nothing (the spread is
over the finite ones, `analyzer.noise.rounding_floor`).

Another algorithm need not share roundings that the reference's program shares. Each sample
follows every value's accumulated rounding (its size, to first order, in quadrature) through
data movement, the linear operations and ``exp`` (where the exponent's rounding is below
`_FIRST_ORDER`), and in every sample:

* an addition or subtraction, and a quotient, add their operands' accumulated roundings drawn
  afresh: the reference's ``dP - rowsum(P * dP)`` over a one-hot P subtracts dP's rounding from
  itself, exactly 0, where an attention backward's ``dP - rowsum(dO * O)`` rounds the two sides
  apart; a softmax's ``e / sum(e)`` cancels at a row's dominant element the rounding e shares
  with its sum, where ``exp(s - lse)`` from a saved log-sum-exp does not;
* unless one operand is a selection of the other (`_SELECTING`: a row's maximum is one of its
  elements, so ``s - max(s)`` is 0 at the maximum in every implementation): such an addition
  rounds at its result's scale only;
* an operand that is a broadcast rounds once per element of what was broadcast (a row's ``m +
  log l`` is one rounding shared by the row), not once per element of the result.

What it can excuse: any difference a correct implementation of the reference's algorithm in the
same precision shows by computing in another order, with another accumulation tree, another
libm, or fused multiply-adds; and another correct formula whose intermediate values round at
the scale of the reference's operands (a softmax through its log-sum-exp, ``exp(s - (m + log
l))``: ``m + log l`` rounds at the scale of m, as ``s - m`` may in another order), or that
computes one quantity twice where the reference reuses it (``rowsum(dO * O)`` for ``rowsum(P *
dP)``). What it cannot: a different algorithm whose rounding is amplified differently (an
unstable formula: the candidate's own float64 run tells those apart, `detector.by_float64`), nor
a narrower precision than the traced program's.
"""
from __future__ import annotations

import collections
import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from peat_jax._src import _jax
from peat_jax._src.counter_random import mix64, substream, uniforms64
from peat_jax._src.formats import is_floating, unit_roundoff
from peat_jax._src.promote import evaluate
from peat_jax._src.sites import trace_key


ROUNDING_SAMPLES = 10
"""Monte Carlo arithmetic evaluations of the reference per check: `OPERAND_SCALE_SAMPLES` with
additions rounded at the scale of their operands, the rest at the scale of their result
(CADNA uses 3 samples)."""

OPERAND_SCALE_SAMPLES = 6
"""Of the `ROUNDING_SAMPLES`, those whose additions round at the scale of their operands (6
put the per-element maximum near 1.5 standard deviations of the rounding)."""

EXACT = frozenset({
    "reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims", "slice",
    "dynamic_slice", "dynamic_update_slice", "gather", "scatter", "concatenate", "pad",
    "select_n", "rev", "copy", "copy_p", "neg", "abs", "max", "min", "reduce_max", "reduce_min",
    "sign", "floor", "ceil", "round", "stop_gradient", "iota", "clamp", "sort", "cummax",
    "cummin", "select_and_gather_add", "sharding_constraint", "device_put",
    "optimization_barrier", "split", "real", "imag", "nextafter", "broadcast", "zeros_like",
    "squeeze_p", "argmax", "argmin", "convert_element_type",
})
"""Primitives whose float results are exact (data movement, selection, sign): not perturbed."""

SUMMING = frozenset({"dot_general", "reduce_sum", "conv_general_dilated", "cumsum", "add", "sub",
                     "add_any"})
"""Primitives that sum K terms into each result (an addition sums 2): perturbed at the scale of
their terms."""

TRANSCENDENTAL = frozenset({
    "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "asin",
    "acos", "atan", "atan2", "sinh", "cosh", "asinh", "acosh", "atanh", "erf", "erfc", "erf_inv",
    "rsqrt", "cbrt", "pow", "lgamma", "digamma", "igamma", "igammac", "bessel_i0e",
    "bessel_i1e", "cumlogsumexp", "logaddexp",
})
"""Primitives a math library approximates (up to an ULP apart between libraries)."""


def _terms(eqn, invals) -> tuple[Any, int]:
    """(root of the sum of the squared terms, K) of a `SUMMING` equation's first output: for an
    addition `hypot` of its operands; otherwise the same op on the squared operands, each
    scaled by a power of two first so that the squares of terms near the float64 range do not
    overflow (exact: the scales come out as one power of two)."""
    name, p = eqn.primitive.name, eqn.params
    shapes = [np.shape(x) for x in invals]
    if name in ("add", "sub", "add_any"):
        return jnp.hypot(invals[0], invals[1]), 2
    exps = [_exponent(x) if is_floating(x) else 0 for x in invals]
    scaled = [jnp.ldexp(x, -e) if is_floating(x) else x for x, e in zip(invals, exps)]
    e = sum(exps)
    if name in ("dot_general", "conv_general_dilated"):
        if name == "dot_general":
            (lc, _), _ = p["dimension_numbers"]
            k = math.prod(shapes[0][d] for d in lc)
        else:
            rhs, out_feature = shapes[1], p["dimension_numbers"].rhs_spec[0]
            k = math.prod(rhs) // max(rhs[out_feature], 1)
        sq = _jax.bind(eqn, [scaled[0] * scaled[0], scaled[1] * scaled[1]],
                       **({"preferred_element_type": jnp.dtype(jnp.float64)}
                          if p.get("preferred_element_type") is not None else {}))[0]
    else:   # reduce_sum, cumsum
        k = (math.prod(shapes[0][a] for a in p["axes"]) if name == "reduce_sum"
             else shapes[0][p["axis"]])
        sq = _jax.bind(eqn, [scaled[0] * scaled[0]])[0]
    return jnp.ldexp(jnp.sqrt(sq), e), max(int(k), 1)


_IN_ORDER_ROUNDOFF = unit_roundoff(np.float32)
"""The coarsest unit roundoff at which a sum may be accumulated in order in its own dtype
(float32's): a 16-bit float's sum is accumulated in float32 by every backend (one accumulated
in its own dtype is the `low_precision_accumulation` fault), so its own rounding is the last."""


def _levels(k: int, u: float) -> float:
    """The rounding levels L of a sum of `k` terms (`SUMMING`) whose result rounds at `u`:
    ``log2 k + 1`` (a pairwise or blocked sum), or, at float32's precision or finer, ``k / 3``
    where that is more (in order, one term after another: its rounding's variance is about
    ``u**2 / 3 * k * (y**2 / 3 + sum t**2 / 6)``, within the model's ``u**2 / 3 * L * (y**2 +
    sum t**2)``)."""
    tree = math.log2(k) + 1
    return max(tree, k / 3) if u <= _IN_ORDER_ROUNDOFF else tree


def _exponent(x):
    """int32: the binary exponent of `x`'s largest finite magnitude (0 for none)."""
    a = jnp.abs(x)
    m = jnp.max(jnp.where(jnp.isfinite(a), a, 0), initial=0)
    return jnp.frexp(m)[1].astype(jnp.int32)


_ADDITIONS = frozenset({"add", "sub", "add_any"})

_MOVED = frozenset({"reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims", "slice",
                    "dynamic_slice", "gather", "rev"})
"""Data movement of a first (float) operand: its accumulated rounding moves with it."""

_KEPT = frozenset({"neg", "copy", "copy_p", "convert_element_type", "reduce_precision",
                   "stop_gradient"})
"""Operations that keep their operand's accumulated rounding as it is."""

_SELECTING = frozenset({"reduce_max", "reduce_min", "argmax", "argmin", "cummax", "cummin"})
"""Reductions whose result is one of their operand's elements: any implementation subtracts a
row's maximum from the row it took it from, so their roundings are shared, not independent."""


def _var_key(v):
    return None if isinstance(v, _jax.Literal) else v


class _Perturb:
    """The `promote.Hook` of one Monte Carlo sample: perturbs every rounded result (see the
    module docstring) with uniforms drawn from `stream` (uint64), one substream per
    equation.

    It also follows, through the linear operations and data movement, the accumulated rounding
    of every value (``accumulated``: its size, in the value's units, combined in quadrature), and
    which values are broadcasts (``broadcasts``: the equation that made each), for the
    operand-scale samples' additions (module docstring)."""

    def __init__(self, stream, operand_scale):
        self.stream = stream
        self.operand_scale = operand_scale   # 1.0: additions round at their operands' scale
        self.count = 0
        self.accumulated: dict = {}
        self.broadcasts: dict = {}
        self.selected: set = set()

    def in_iteration(self, i) -> "_Perturb":
        return _Perturb(substream(self.stream, 1_000_003 + self.count + 7919 * i),
                        self.operand_scale)

    def _uniform(self, shape):
        self.count += 1
        return uniforms64(substream(self.stream, self.count), shape)

    def _operand_uniform(self, v, shape):
        """A uniform per element of an addition's operand `v`, drawn once per element of what
        was broadcast when `v` is a broadcast (its rounding in another order is shared along
        the broadcast dimensions: a row's ``m + log l``)."""
        made = self.broadcasts.get(_var_key(v))
        if made is None or tuple(made.outvars[0].aval.shape) != tuple(shape):
            return self._uniform(shape)
        source = self._uniform(made.invars[0].aval.shape)
        return _jax.bind(made, [source])[0]

    def _rounding_of(self, v):
        return self.accumulated.get(_var_key(v))

    def __call__(self, eqn, invals: Sequence[Any], outs: list) -> list:
        name = eqn.primitive.name
        if name == "broadcast_in_dim" and len(eqn.invars) == 1:
            self.broadcasts[eqn.outvars[0]] = eqn
        if name in _SELECTING or (name in _MOVED | _KEPT | {"max", "min"} and any(
                _var_key(v) in self.selected for v in eqn.invars)):
            self.selected.add(eqn.outvars[0])
        carried = _carried(eqn, invals, [self._rounding_of(v) for v in eqn.invars])
        if name in EXACT and name != "convert_element_type":
            self._keep(eqn, carried, None)
            return outs
        done, own = [], None
        for v, y in zip(eqn.outvars, outs):
            dtype = v.aval.dtype
            if not (is_floating(y) and jnp.issubdtype(dtype, jnp.floating)):
                done.append(y)
                continue
            u = unit_roundoff(dtype)
            if name == "convert_element_type":
                narrower = is_floating(eqn.invars[0].aval) and \
                    unit_roundoff(eqn.invars[0].aval.dtype) < u
                own = u * jnp.abs(y) if narrower else None
                done.append(y * (1 + u * self._uniform(y.shape)) if narrower else y)
            elif name in SUMMING and len(done) == 0:
                y, own = self._summed(eqn, invals, y, u)
                done.append(y)
            else:
                amp = 2 * u if name in TRANSCENDENTAL else u
                own = amp * jnp.abs(y) if len(done) == 0 else None
                if name == "div":
                    y = y + self._quotient_shift(eqn, invals)
                done.append(y * (1 + amp * self._uniform(y.shape)))
        if name in ("exp", "exp2") and self._rounding_of(eqn.invars[0]) is not None:
            carried = _through_exp(name, self._rounding_of(eqn.invars[0]), outs[0])
        self._keep(eqn, carried, own)
        return done

    def _quotient_shift(self, eqn, invals):
        """Another algorithm's shift of ``a / b``: the operands' accumulated roundings drawn
        independently (a softmax normalised by its own sum cancels the rounding the
        numerator shares with the sum; one from a saved log-sum-exp does not), to first
        order; 0 where one operand is a selection of the other, or it is not finite."""
        a, b = invals
        ra, rb = (self._rounding_of(v) for v in eqn.invars)
        if (ra is None and rb is None) or any(_var_key(v) in self.selected
                                              for v in eqn.invars):
            return 0.0
        shift = 0.0
        if ra is not None:
            shift = shift + ra / jnp.abs(b) * self._operand_uniform(eqn.invars[0], np.shape(a))
        if rb is not None:
            shift = shift + jnp.abs(a) * rb / (b * b) * \
                self._operand_uniform(eqn.invars[1], np.shape(b))
        return jnp.where(jnp.isfinite(shift), shift, 0.0)

    def _summed(self, eqn, invals, y, u):
        """(y perturbed, the size of its own rounding) for a `SUMMING` equation's output."""
        root, k = _terms(eqn, invals)
        depth = math.sqrt(_levels(k, u))
        if eqn.primitive.name in _ADDITIONS:
            # another order rounds each operand's part at its own scale; another algorithm
            # need not share the operands' accumulated rounding, which the reference's order
            # may cancel (D = rowsum(dO * O) against the reference's sum of dP * P), unless one
            # operand is a selection of the other (s - max(s)), which rounds at its result's scale
            # only: no order mixes a row's maximum into the sums that made the row
            independent = not any(_var_key(v) in self.selected for v in eqn.invars)
            parts = jnp.zeros_like(y)
            for v, x in zip(eqn.invars, invals):
                if not (independent and is_floating(x)):
                    continue
                scale = self.operand_scale * u * depth * jnp.abs(x)
                carried = self._rounding_of(v)
                if carried is not None:
                    scale = scale + carried
                parts = parts + scale * self._operand_uniform(v, np.shape(x))
            shift = u * depth * jnp.abs(y) * self._uniform(y.shape) + parts
        else:
            shift = u * depth * (jnp.abs(y) * self._uniform(y.shape) +
                                 root * self._uniform(y.shape))
        # a term that is not finite leaves the result as it is (an infinite mask value, an
        # overflow): rounding moves nothing there
        y = y + jnp.where(jnp.isfinite(shift), shift, 0.0)
        return y, u * depth * jnp.hypot(y, root)

    def _keep(self, eqn, carried, own) -> None:
        """Record the first output's accumulated rounding: what its operands carried into it
        and its own, in quadrature; nothing where neither is known or it is not finite."""
        if not eqn.outvars:
            return
        total = carried if own is None else own if carried is None else \
            jnp.sqrt(carried * carried + own * own)
        if total is not None:
            self.accumulated[eqn.outvars[0]] = jnp.where(jnp.isfinite(total), total, 0.0)


_FIRST_ORDER = 2.0 ** -7
"""The largest rounding of an exponent carried through ``exp`` (to first order, as a relative
rounding of its result); beyond, the sample's own perturbation shows what it does."""


def _through_exp(name, rounding, y):
    """The accumulated rounding `rounding` of an exponent carried into ``y = exp(x)`` (or
    ``exp2``): ``|y| * rounding`` (times log 2), where that is first order."""
    r = rounding * (math.log(2.0) if name == "exp2" else 1.0)
    return jnp.abs(y) * jnp.where(r < _FIRST_ORDER, r, 0.0)


def _carried(eqn, invals, rounding) -> Any:
    """The accumulated rounding of the operands carried into `eqn`'s first output, to first
    order (in quadrature), for data movement and the linear operations; None for any other
    operation (its own rounding starts afresh) or when no operand carries any."""
    name = eqn.primitive.name
    if all(r is None for r in rounding):
        return None
    r = [jnp.zeros_like(x) if a is None and is_floating(x) else a
         for a, x in zip(rounding, invals)]
    sq = lambda x: x * x  # noqa: E731
    if name in _KEPT:
        return r[0]
    if name in _MOVED:
        return None if rounding[0] is None else _jax.bind(eqn, [r[0], *invals[1:]])[0]
    if name == "select_n":
        return _jax.bind(eqn, [invals[0], *[
            jnp.broadcast_to(a, np.shape(x)) for a, x in zip(r[1:], invals[1:])]])[0]
    if name in _ADDITIONS:
        return jnp.sqrt(sq(r[0]) + sq(r[1]))
    if name == "mul":
        return jnp.sqrt(sq(r[0] * invals[1]) + sq(invals[0] * r[1]))
    if name == "div":
        return jnp.sqrt(sq(r[0] / invals[1]) + sq(invals[0] * r[1] / sq(invals[1])))
    if name == "reduce_sum":
        return jnp.sqrt(_jax.bind(eqn, [sq(r[0])])[0])
    if name == "dot_general":
        extra = ({"preferred_element_type": jnp.dtype(jnp.float64)}
                 if eqn.params.get("preferred_element_type") is not None else {})
        total = 0.0
        if rounding[0] is not None:
            total = total + _jax.bind(eqn, [sq(r[0]), sq(invals[1])], **extra)[0]
        if rounding[1] is not None:
            total = total + _jax.bind(eqn, [sq(invals[0]), sq(r[1])], **extra)[0]
        return jnp.sqrt(total)
    return None


class MonteCarlo(NamedTuple):
    """A program under Monte Carlo arithmetic (`monte_carlo`)."""

    run: Callable     # jitted: (keys (S, 2) uint32, *flat float leaves) -> flat outputs
    out_tree: Any     # the structure of the traced function's output


_PROGRAMS: "collections.OrderedDict[tuple, MonteCarlo]" = collections.OrderedDict()
_PROGRAMS_KEPT = 16


def monte_carlo(fn: Callable, args: tuple) -> MonteCarlo:
    """`fn` traced on `args` as they are (under the caller's x64 setting: their dtypes set each
    operation's precision, as when the program runs) and evaluated under Monte Carlo arithmetic: one
    float64 evaluation per key with every rounded result perturbed (module docstring) and the
    float outputs rounded to the traced program's output dtypes (returned as float64). Kept by
    (`fn`, `sites.trace_key(args)`), so calls at one shape share a compiled program. Raises
    `PeatError` for a program `promote.evaluate` refuses (a kernel, a bitcast), and what tracing
    `fn` raises."""
    key = trace_key(args)
    cached = None if key is None else _PROGRAMS.get((fn, key))
    if cached is not None:
        return cached
    closed, out = jax.make_jaxpr(fn, return_shape=True)(*args)
    consts, shapes = _jax.jaxpr_consts(closed), jax.tree.leaves(out)

    def one(k, flat):
        # the first OPERAND_SCALE_SAMPLES: additions at their operands' scale; then at their
        # result's
        scale = (k[1] < OPERAND_SCALE_SAMPLES).astype(jnp.float64)
        stream = mix64((k[0].astype(jnp.uint64) << jnp.uint64(32)) | k[1].astype(jnp.uint64))
        outs = evaluate(closed, consts, flat, _Perturb(stream, scale))
        return [x.astype(s.dtype).astype(jnp.float64) if is_floating(s) else x
                for x, s in zip(outs, shapes)]

    def many(keys, *flat):
        return jax.vmap(one, in_axes=(0, None))(keys, list(flat))

    many.__name__ = many.__qualname__ = \
        f"{getattr(fn, '__name__', type(fn).__name__)}_monte_carlo"
    program = MonteCarlo(run=jax.jit(many), out_tree=jax.tree.structure(out))
    if key is not None:
        _PROGRAMS[(fn, key)] = program
        while len(_PROGRAMS) > _PROGRAMS_KEPT:
            _PROGRAMS.popitem(last=False)
    return program


def rounding_samples(fn: Callable, args: tuple, seed: int,
                     samples: int = ROUNDING_SAMPLES) -> Any:
    """`samples` Monte Carlo arithmetic evaluations of ``fn(*args)`` (`monte_carlo`) with keys
    from `seed`: `fn`'s output structure, every float leaf a float64 host array with a leading
    axis of `samples` (output units). Raises what `monte_carlo` raises."""
    program = monte_carlo(fn, args)
    keys = np.stack([np.asarray([seed & 0xFFFFFFFF, i], np.uint32) for i in range(samples)])
    with jax.enable_x64(True):
        flat = jax.device_get(program.run(keys, *jax.tree.leaves(args)))
    return jax.tree.unflatten(program.out_tree, flat)
