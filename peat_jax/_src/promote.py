"""A float64 shadow of a JAX function: the same program with every float widened to float64.

`check_kernel` sets its noise floor with the reference evaluated on float64 inputs. A reference
that pins a narrower dtype (``lax.dot_general(..., preferred_element_type=jnp.float32)``, the
usual reference of a mixed-precision kernel, or an ``x.astype(jnp.float32)``) returns float32
there and sets no floor. `widened(fn)` is `fn` re-evaluated from its jaxpr (traced on the given,
float64, inputs) with every float value, constant and literal widened to float64 before each
operation, a `preferred_element_type` that names a float made float64, and every cast to a float
made a cast to float64: the program's arithmetic in float64, the reference's algorithm at a
precision far above its own. Calls (`jit`, custom derivative calls, `checkpoint`) are inlined:
differentiating the result differentiates the widened body; loops and branches (`scan`,
`while`, `cond`) are rebuilt with `lax.scan`, `lax.while_loop` and `lax.switch` around widened
bodies; complex values are widened to complex128. A program with a kernel (`pallas_call`,
`ffi_call`, ...) or a bitcast is refused (`PeatError`): a kernel's body or a bit pattern cannot
be widened this way.

`evaluate` is the same walk with a hook after every leaf equation: the rounding floor
(`peat_jax._src.judge.rounding`) perturbs each result there (Monte Carlo arithmetic); a linear
solve (`jnp.linalg.solve`) is evaluated there by its solve jaxpr.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from peat_jax._src import _jax
from peat_jax._src.errors import PeatError
from peat_jax._src.formats import is_floating


_REFUSED = frozenset({"bitcast_convert_type"})


class Hook(Protocol):
    """What `evaluate` calls after each leaf equation (not after a call, loop or branch, whose
    bodies' equations it calls it for)."""

    def __call__(self, eqn: Any, invals: Sequence[Any], outs: list) -> list:
        """The outputs to use for `eqn` (float64 where they are floats), given its widened
        operands and its widened outputs."""

    def in_iteration(self, i: Any) -> "Hook":
        """The hook for one iteration `i` (a traced int) of a loop body."""


def _wide(dtype) -> Any:
    """float64 for a float dtype, complex128 for a complex one, None for any other."""
    if is_floating(dtype):
        return jnp.dtype(jnp.float64)
    if dtype is not None and jnp.issubdtype(dtype, jnp.complexfloating):
        return jnp.dtype(jnp.complex128)
    return None


def _widen(x) -> Any:
    """`x` as float64 when it is a narrower float, as complex128 when it is a narrower complex
    (an array, a tracer or a literal's value)."""
    dtype = getattr(x, "dtype", None)
    wide = _wide(dtype)
    if wide is None or dtype == wide:
        return x
    if isinstance(x, (np.ndarray, np.generic)):
        return np.asarray(x, wide)
    return jax.lax.convert_element_type(x, wide)


def evaluate(jaxpr, consts, args, hook: Optional[Hook] = None) -> list:
    """The outputs of `jaxpr` (open or closed) on `consts` and `args`, every float widened to
    float64 (see the module docstring), with `hook` applied after every leaf equation. Call it
    under ``jax.enable_x64(True)``, inside a trace or eagerly."""
    jaxpr = _jax.jaxpr_body(jaxpr)
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, _jax.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = _widen(x)
    for v, x in zip(jaxpr.invars, args):
        env[v] = _widen(x)
    for eqn in jaxpr.eqns:
        invals = [_widen(read(v)) for v in eqn.invars]
        with _jax.eqn_context(eqn):
            outs = _eqn(eqn, invals, hook)
        for v, x in zip(eqn.outvars, outs):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _closed(body, hook: Optional[Hook]) -> Callable:
    """A closed sub-jaxpr as a function of its operands, widened."""
    consts = _jax.jaxpr_consts(body)
    return lambda *ops: evaluate(body, consts, ops, hook)


def _scan(eqn, invals, hook: Optional[Hook]) -> list:
    sc = _jax.scan_layout(eqn)
    consts = invals[:sc.num_consts]
    carry = invals[sc.num_consts:sc.num_consts + sc.num_carry]
    xs = invals[sc.num_consts + sc.num_carry:]
    body = _jax.jaxpr_body(sc.jaxpr)
    body_consts = _jax.jaxpr_consts(sc.jaxpr)

    def step(c, x):
        i, c = c[0], c[1:]
        outs = evaluate(body, body_consts, [*consts, *c, *x],
                        None if hook is None else hook.in_iteration(i))
        return [i + 1, *outs[:sc.num_carry]], outs[sc.num_carry:]

    carry_out, ys = lax.scan(step, [jnp.int32(0), *carry], xs, length=sc.length,
                             reverse=sc.reverse)
    return [*carry_out[1:], *ys]


def _while(eqn, invals, hook: Optional[Hook]) -> list:
    wl = _jax.while_layout(eqn)
    cond_consts = invals[:wl.cond_nconsts]
    body_consts = invals[wl.cond_nconsts:wl.cond_nconsts + wl.body_nconsts]
    init = invals[wl.cond_nconsts + wl.body_nconsts:]
    cond = _closed(wl.cond_jaxpr, None)

    def body(c):
        i, c = c[0], c[1:]
        h = None if hook is None else hook.in_iteration(i)
        return [i + 1, *_closed(wl.body_jaxpr, h)(*body_consts, *c)]

    out = lax.while_loop(lambda c: cond(*cond_consts, *c[1:])[0], body, [jnp.int32(0), *init])
    return out[1:]


def _cond(eqn, invals, hook: Optional[Hook]) -> list:
    branches = [_closed(b, hook) for b in _jax.cond_branches(eqn)]
    return list(lax.switch(invals[0], branches, *invals[1:]))


def _linear_solve(eqn, invals, hook: Optional[Hook]) -> list:
    """A ``custom_linear_solve`` evaluated by its solve jaxpr, widened: for `hook`'s (Monte
    Carlo arithmetic's) evaluation only, whose programs run under `vmap`, where the primitive's
    jaxprs, typed by the traced dtype, fail to lower on float64 operands. Its solve holds the
    factorisation behind a `stop_gradient` (the primitive's derivative is the implicit one), so
    `widened`, which is differentiated, keeps the primitive (it lowers outside `vmap`)."""
    if hook is None:
        return _jax.bind(eqn, invals)
    ls = _jax.linear_solve_layout(eqn)
    return _closed(ls.solve, hook)(*invals[ls.start:ls.start + ls.nconsts],
                                   *invals[ls.total:])


_CONTAINERS = {"scan": _scan, "while": _while, "cond": _cond,
               "custom_linear_solve": _linear_solve}


def _eqn(eqn, invals, hook: Optional[Hook] = None) -> list:
    name, params = eqn.primitive.name, eqn.params
    if name in _jax.INLINE_CALLS or name in _jax.REMAT:
        body = _jax.call_body(eqn) if name in _jax.INLINE_CALLS else _jax.remat_layout(eqn).jaxpr
        n_in = len(_jax.jaxpr_body(body).invars)
        return evaluate(body, _jax.jaxpr_consts(body), invals[len(invals) - n_in:], hook)
    if name in _CONTAINERS:
        return _CONTAINERS[name](eqn, invals, hook)
    if name in _REFUSED or _jax.sub_jaxprs(eqn):
        raise PeatError(f"cannot widen a program with {name!r} to float64")
    if name == "convert_element_type" and _wide(params["new_dtype"]) is not None:
        outs = [jax.lax.convert_element_type(invals[0], _wide(params["new_dtype"]))]  # ints too
    else:
        pref = params.get("preferred_element_type")
        if pref is not None and is_floating(pref):
            outs = _jax.bind(eqn, invals, preferred_element_type=jnp.dtype(jnp.float64))
        else:
            outs = _jax.bind(eqn, invals)
    return outs if hook is None else hook(eqn, invals, outs)


@functools.lru_cache(maxsize=16)
def widened(fn: Callable) -> Callable:
    """`fn`'s float64 shadow (see the module docstring), jitted; call it under
    ``jax.enable_x64(True)`` on float64 inputs. Cached by `fn`, so that calls at one shape share
    one compiled program."""
    def shadow(*args):
        closed, out = jax.make_jaxpr(fn, return_shape=True)(*args)
        flat = evaluate(closed, _jax.jaxpr_consts(closed), jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(out), flat)

    shadow.__name__ = shadow.__qualname__ = \
        f"{getattr(fn, '__name__', type(fn).__name__)}_float64"
    return jax.jit(shadow)


def widened_eqn(eqn) -> Callable:
    """One equation of a jaxpr (an op site's) as `widened` evaluates it: ``fn(*operands) ->
    list of outputs``, its floats, casts and float `preferred_element_type` widened to float64
    and its calls, loops and branches widened; jitted. Call it under ``jax.enable_x64(True)`` on
    float64 operands. Raises `PeatError` on the equations `widened` refuses (kernels,
    bitcasts), when called."""
    def shadow(*operands):
        return _eqn(eqn, [_widen(x) for x in operands])

    shadow.__name__ = shadow.__qualname__ = f"{eqn.primitive.name}_float64"
    return jax.jit(shadow)


def traced_eqn(eqn) -> Callable:
    """One equation of a jaxpr as ``fn(*operands) -> list of outputs`` at its own dtypes,
    exactly as traced (not jitted: what Monte Carlo arithmetic, `judge.rounding`, traces)."""
    def op(*operands):
        return _jax.bind(eqn, operands)

    op.__name__ = op.__qualname__ = eqn.primitive.name
    return op
