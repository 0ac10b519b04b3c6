"""A float64 shadow of a JAX function: the same program with every float widened to float64.

`check_kernel` sets its noise floor with the reference evaluated on float64 inputs. A reference
that pins a narrower dtype (``lax.dot_general(..., preferred_element_type=jnp.float32)``, the
usual reference of a mixed-precision kernel, or an ``x.astype(jnp.float32)``) returns float32
there and sets no floor. `widened(fn)` is `fn` re-evaluated from its jaxpr (traced on the given,
float64, inputs) with every float value, constant and literal widened to float64 before each
operation, a `preferred_element_type` that names a float made float64, and every cast to a float
made a cast to float64: the program's arithmetic in float64, the reference's algorithm at a
precision far above its own. Calls (`jit`, custom derivative calls, `checkpoint`) are inlined:
differentiating the result differentiates the widened body. A program with a loop, a branch or a
kernel (`scan`, `while`, `cond`, `pallas_call`, ...) or a bitcast is refused (`PeatError`): its
typed bodies or bit patterns cannot be widened this way.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from peat_jax import _jax
from peat_jax.errors import PeatError

__all__ = ["widened", "widened_eqn"]

_REFUSED = frozenset({"bitcast_convert_type"})


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _widen(x) -> Any:
    """`x` as float64 when it is a narrower float (an array, a tracer or a literal's value)."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or not _is_float(dtype) or dtype == jnp.float64:
        return x
    if isinstance(x, (np.ndarray, np.generic)):
        return np.asarray(x, np.float64)
    return jax.lax.convert_element_type(x, jnp.float64)


def _eval(jaxpr, consts, args) -> list:
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
            outs = _eqn(eqn, invals)
        for v, x in zip(eqn.outvars, outs):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _eqn(eqn, invals) -> list:
    name, params = eqn.primitive.name, eqn.params
    if name in _jax.INLINE_CALLS or name in _jax.REMAT:
        body = _jax.call_body(eqn) if name in _jax.INLINE_CALLS else _jax.remat_layout(eqn).jaxpr
        n_in = len(_jax.jaxpr_body(body).invars)
        return _eval(body, _jax.jaxpr_consts(body), invals[len(invals) - n_in:])
    if name in _REFUSED or _jax.sub_jaxprs(eqn):
        raise PeatError(f"cannot widen a program with {name!r} to float64")
    if name == "convert_element_type" and _is_float(params["new_dtype"]):
        return [jax.lax.convert_element_type(invals[0], jnp.float64)]   # ints too
    pref = params.get("preferred_element_type")
    if pref is not None and _is_float(pref):
        return _jax.bind(eqn, invals, preferred_element_type=jnp.dtype(jnp.float64))
    return _jax.bind(eqn, invals)


@functools.lru_cache(maxsize=16)
def widened(fn: Callable) -> Callable:
    """`fn`'s float64 shadow (see the module docstring), jitted; call it under
    ``jax.enable_x64(True)`` on float64 inputs. Cached by `fn`, so that calls at one shape share
    one compiled program."""
    def shadow(*args):
        closed, out = jax.make_jaxpr(fn, return_shape=True)(*args)
        flat = _eval(closed, _jax.jaxpr_consts(closed), jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(out), flat)

    shadow.__name__ = shadow.__qualname__ = \
        f"{getattr(fn, '__name__', type(fn).__name__)}_float64"
    return jax.jit(shadow)


def widened_eqn(eqn) -> Callable:
    """One equation of a jaxpr (an op site's) as `widened` evaluates it: ``fn(*operands) ->
    list of outputs``, its floats, casts and float `preferred_element_type` widened to float64
    and its calls inlined; jitted. Call it under ``jax.enable_x64(True)`` on float64 operands.
    Raises `PeatError` on the equations `widened` refuses (loops, branches, kernels,
    bitcasts), when called."""
    def shadow(*operands):
        return _eqn(eqn, [_widen(x) for x in operands])

    shadow.__name__ = shadow.__qualname__ = f"{eqn.primitive.name}_float64"
    return jax.jit(shadow)
