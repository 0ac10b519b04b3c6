"""The programs `check_kernel` runs: a callable's forward and VJP as one jitted program per new
shape (`vjp_outputs`), the candidate at two shapes as one program (`Pairing`), and the
cotangents and positions they take."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from peat_jax._src.check.variants import host_array, make_variant
from peat_jax._src.errors import PeatError
from peat_jax._src.judge.conditioning import is_float_leaf
from peat_jax._src.kernels.pallas.interpret import races_found, reset_interpret_state
from peat_jax._src.precision import at_matmul_precision


def to_jax(args):
    """`args` with every NumPy array placed on the default device (`jax.device_put`, which
    compiles nothing: `jnp.asarray` compiles a program per new shape on recent jax)."""
    return jax.tree.map(lambda x: jax.device_put(x) if isinstance(x, np.ndarray) else x, args)


def _float_positions(args) -> tuple[int, ...]:
    """Positional arguments holding at least one float leaf (the differentiable inputs)."""
    return tuple(i for i, a in enumerate(args)
                 if any(is_float_leaf(x) for x in jax.tree_util.tree_leaves(a)))


def differentiated_positions(args: tuple, backward: Union[bool, Sequence[int]]) -> tuple[int, ...]:
    """The positions `check_kernel` differentiates (see its `backward`)."""
    floats = _float_positions(args)
    if isinstance(backward, (bool, np.bool_)):
        return floats if backward else ()
    positions = (backward,) if isinstance(backward, (int, np.integer)) else backward
    try:
        wanted = tuple(int(i) for i in positions)
    except (TypeError, ValueError):
        raise PeatError(f"backward must be True, False or a sequence of argument positions, got "
                        f"{backward!r}") from None
    bad = [i for i in wanted if i not in floats]
    if bad:
        raise PeatError(f"backward={tuple(backward)!r}: argument(s) {bad} hold no floats to "
                        f"differentiate; the float arguments are {list(floats)}")
    return tuple(i for i in floats if i in wanted)


def has_float(tree) -> bool:
    return any(jnp.issubdtype(jnp.result_type(x), jnp.floating)
               for x in jax.tree_util.tree_leaves(tree))


def random_cotangent(out, rng: np.random.Generator):
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
class Pinned:
    """A reference traced, forward and backward, at one matmul precision (`vjp_outputs` keeps the
    precision for the backward pass too: a custom VJP's backward is traced there)."""

    fn: Callable
    precision: str

    @property
    def __name__(self) -> str:
        """The wrapped callable's name (what compile logs name its programs by)."""
        return getattr(self.fn, "__name__", type(self.fn).__name__)

    def __call__(self, *args):
        with at_matmul_precision(self.precision):
            return self.fn(*args)


VJP_FORWARD = "forward (vjp)"
"""The output a candidate's VJP computed, checked where it differs from its plain call's."""


class Outputs(NamedTuple):
    """What one callable computed on a run's inputs under one cotangent."""

    forward: Any        # the plain call's output (None when not asked for)
    vjp_forward: Any    # the output jax.vjp computed (a custom VJP's forward rule's)
    grads: tuple        # the gradients, by differentiated position


def vjp_outputs(fn: Callable, args: tuple, positions: Sequence[int], ct,
         plain_forward: bool = False, jit_plain: bool = False) -> Outputs:
    """`fn`'s output under `jax.vjp` and its gradients of <fn(*args), ct> with respect to
    args[i] for i in positions; with `plain_forward`, the plain call's output too.

    A jitted `fn` (or a `Pinned` one) whose arguments and cotangent are all arrays runs as one
    jitted program (`jitted_vjp`): `jax.vjp` of a jitted function compiles two (the
    linearised forward and the transposed backward), and a plain call one more, per new shape.
    Any other `fn` runs as given, eagerly (jit would reject a callable that branches on values
    or takes Python scalars); with `jit_plain`, a plain one is jitted too where it traces (on
    array arguments; eagerly where tracing or compiling it raises): fused, as in a jitted
    training step, and compiled once per shape rather than op by op."""
    with at_matmul_precision(fn.precision if isinstance(fn, Pinned) else None):
        if fusable(fn, args, ct, plain=jit_plain):
            try:
                return jitted_vjp(fn, tuple(positions), plain_forward)(args, ct)
            except Exception:  # noqa: BLE001 - a plain callable jit rejects runs eagerly below
                if is_jitted(fn):
                    raise
        out, grads = vjp_traced(fn, args, positions, ct)
        return Outputs(forward=fn(*args) if plain_forward else None, vjp_forward=out,
                        grads=tuple(grads))


def vjp_traced(fn: Callable, args: tuple, positions: Sequence[int], ct):
    """`vjp_outputs` as a function of `args` and `ct`, eager or under a trace."""
    def f(*diff):
        full = list(args)
        for i, d in zip(positions, diff):
            full[i] = d
        return fn(*full)

    out, pullback = jax.vjp(f, *[args[i] for i in positions])
    return out, pullback(ct)


def is_jitted(fn: Callable) -> bool:
    """`fn` (or the callable a `Pinned` wraps) is a hashable `jax.jit` function (it has
    `lower`; hashable, as `jitted_vjp` caches by it)."""
    return _hashable(fn) and hasattr(fn.fn if isinstance(fn, Pinned) else fn, "lower")


def _hashable(fn: Callable) -> bool:
    try:
        hash(fn)
    except TypeError:
        return False
    return True


def fusable(fn: Callable, args, ct, plain: bool = False) -> bool:
    """`vjp_outputs` runs `fn` as one jitted program: `fn` is jitted (or, with `plain`, any
    hashable callable) and its arguments and cotangent are all arrays."""
    return (is_jitted(fn) or plain and _hashable(fn)) and \
        all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves((args, ct)))


def vjp_body(fn: Callable, positions: tuple[int, ...], plain_forward: bool) -> Callable:
    """`vjp_outputs(fn, args, positions, ct, plain_forward)` as a traceable function of
    (args, ct)."""
    def vjp(args, ct):
        out, grads = vjp_traced(fn, args, positions, ct)
        return Outputs(forward=fn(*args) if plain_forward else None, vjp_forward=out,
                        grads=tuple(grads))
    return vjp


def _program_name(fn: Callable, suffix: str) -> str:
    return f"{getattr(fn, '__name__', 'fn')}_{suffix}"


@functools.lru_cache(maxsize=16)
def named_vjp(fn: Callable, positions: tuple[int, ...], plain_forward: bool) -> Callable:
    """`vjp_body` kept by its arguments and named "<fn's name>_vjp" (compile logs): one object
    per callable, so that what is keyed by it (`jitted_vjp`, the Monte Carlo programs of
    `judge.rounding`) is shared by every check of that callable."""
    vjp = vjp_body(fn, positions, plain_forward)
    vjp.__name__ = vjp.__qualname__ = _program_name(fn, "vjp")
    return vjp


@functools.lru_cache(maxsize=16)
def jitted_vjp(fn: Callable, positions: tuple[int, ...], plain_forward: bool) -> Callable:
    """`vjp_outputs(fn, args, positions, ct, plain_forward)` jitted, by its static arguments,
    so that checks of the same callable share its compilations (the plain call and the forward under
    `jax.vjp` are one computation to the compiler where they are the same). Named
    "<fn's name>_vjp" (compile logs)."""
    return jax.jit(named_vjp(fn, positions, plain_forward))


@functools.lru_cache(maxsize=16)
def _jitted_forward(fn: Callable) -> Callable:
    return jax.jit(fn)


def forward_program(fn: Callable, args: tuple) -> Callable:
    """`fn` to call on `args` for its plain forward: a plain (un-jitted) hashable `fn` on array
    arguments jitted (one program per shape, as `vjp_outputs` with `jit_plain`), run as given
    where tracing or compiling it raises; any other `fn` as it is."""
    if is_jitted(fn) or not fusable(fn, args, (), plain=True):
        return fn
    program = _jitted_forward(fn)

    def forward(*a):
        try:
            return program(*a)
        except Exception:  # noqa: BLE001 - a callable jit rejects runs as given
            return fn(*a)
    return forward


@functools.lru_cache(maxsize=16)
def jitted_pair(fn: Callable, positions: tuple[int, ...]) -> Callable:
    """``(vjp_outputs(fn, *first, plain_forward=True), vjp_outputs(fn, *second, ...))`` as
    one jitted program of ``(first, second)``, each an (args, ct) pair (see `Pairing`). Named "<fn's
    name>_vjp_pair"."""
    vjp = vjp_body(fn, positions, True)

    def pair(first, second):
        return vjp(*first), vjp(*second)

    pair.__name__ = pair.__qualname__ = _program_name(fn, "vjp_pair")
    return jax.jit(pair)


PAIR_MAX_ELEMENTS = 1 << 16
"""Largest odd_shape variant (elements of its float inputs) that `check_kernel` compiles with
the example's shapes as one program (`Pairing`)."""


@dataclasses.dataclass
class Pairing:
    """The candidate at the example's shapes and at the odd_shape variant's, compiled as one
    program (`jitted_pair`): jax and XLA build one program of both in 55-75% of the time they
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


def pairing_for(candidate, reference, example_args, names, positions, seed) -> Optional[Pairing]:
    """The check's `Pairing`, or None: no backward, no odd_shape variant, a candidate that is
    not jitted, a variant with more than `PAIR_MAX_ELEMENTS` float elements or one the
    reference or the candidate cannot trace. The odd variant's inputs and cotangent are those
    `_run_variants` draws for it (same seeds)."""
    if not positions or "odd_shape" not in names or not is_jitted(candidate):
        return None
    vi = names.index("odd_shape")
    args = make_variant("odd_shape", example_args, seed + vi)
    if args is None or sum(int(np.size(x)) for x in jax.tree_util.tree_leaves(args)
                           if is_float_leaf(x)) > PAIR_MAX_ELEMENTS:
        return None
    args = to_jax(args)
    try:
        gold = jax.eval_shape(reference, *args)    # shapes draw the cotangent
    except Exception:  # noqa: BLE001 - the variant's own run reports it
        return None
    if not has_float(gold):
        return None
    try:   # a candidate that rejects these shapes would fail the pair's trace half way
        jax.eval_shape(candidate, *args)
    except Exception:  # noqa: BLE001 - the variant's own run reports it
        return None
    ct = random_cotangent(gold, np.random.default_rng([seed, vi]))
    return Pairing(odd=(args, ct)) if fusable(candidate, args, ct) else None


def paired_vjp(fn, args, positions, ct, pairing: Optional[Pairing]) -> Optional[Outputs]:
    """`vjp_outputs(fn, args, positions, ct, plain_forward=True)` run through `pairing`'s
    program, or None: no pairing (or it is off), `args` of neither of its shapes, or the paired
    call raised (pairing is then switched off, the interpreter's race state reset, and the
    caller runs `fn` alone)."""
    if pairing is None or not pairing.on:
        return None
    here = (args, ct)
    odd = same_structure(here, pairing.odd, dtypes=True)
    if not odd and pairing.main is None:
        pairing.main = here      # the example's call: the first one
    if pairing.main is None or not (odd or same_structure(here, pairing.main, dtypes=True)):
        return None
    first, second = (pairing.main, here) if odd else (here, pairing.odd)
    try:
        mine = jitted_pair(fn, tuple(positions))(first, second)[1 if odd else 0]
    except Exception:  # noqa: BLE001 - the call alone finds and reports it
        pairing.on = False
        if races_found():
            reset_interpret_state()
        return None
    return mine


def _grad_names(positions: Sequence[int]) -> list[str]:
    return [f"grad[{i}]" for i in positions]


def named_outputs(o: Outputs, positions: Sequence[int],
                  vjp_forward: Optional[bool]) -> dict[str, Any]:
    """{"forward": ..., VJP_FORWARD: ..., "grad[i]": ...}: VJP_FORWARD when `vjp_forward`,
    or (None) when it differs bitwise from the plain call's output."""
    outs = {"forward": o.forward}
    if vjp_forward or (vjp_forward is None and not bitwise_same(o.vjp_forward, o.forward)):
        outs[VJP_FORWARD] = o.vjp_forward
    outs.update(zip(_grad_names(positions), o.grads))
    return outs


def bitwise_same(a, b) -> bool:
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    # jaxlib ships no stubs: mypy cannot see PyTreeDef's __eq__
    return ta == tb and all(  # type: ignore[operator]
        np.shape(x) == np.shape(y) and host_array(x).dtype == host_array(y).dtype
        and host_array(x).tobytes() == host_array(y).tobytes() for x, y in zip(la, lb))


def as_float64(args):
    def cast(x):
        if is_float_leaf(x):
            return np.asarray(host_array(x), np.float64)
        return x
    return jax.tree.map(cast, args)


def all_float64(tree) -> bool:
    """True when every float leaf (host arrays) is float64."""
    leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]
    floats = [x for x in leaves if np.issubdtype(x.dtype, np.floating) or x.dtype.kind == "V"
              or x.dtype.name == "bfloat16"]
    return bool(floats) and all(x.dtype == np.float64 for x in floats)


def same_structure(a, b, dtypes: bool = False) -> bool:
    """Same tree structure and shapes (with `dtypes`, and dtypes: one jitted program serves
    both)."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    # jaxlib ships no stubs: mypy cannot see PyTreeDef's __eq__
    return ta == tb and all(np.shape(x) == np.shape(y) and  # type: ignore[operator]
                            (not dtypes or jnp.result_type(x) == jnp.result_type(y))
                            for x, y in zip(la, lb))
