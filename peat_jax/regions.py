"""Composite sites: named regions (softmax, layer norm, attention) that a fused kernel can replace.

A region is a pure function of arrays. Marked with `peat.region(name)`, it is traced as a named
forward call and a named backward call (a `jax.custom_vjp` whose backward recomputes the region's
VJP from its inputs), so the region stays addressable in a differentiated program: a candidate
replaces its forward, its backward, or both, and the residuals between them are just the inputs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import Callable, Optional

import jax

from peat_jax import _jax
from peat_jax._region_registry import (RegionInfo, call_name, is_region_name, region_info,
                                       register)
from peat_jax.errors import PeatError

__all__ = ["RegionInfo", "flax_regions", "region", "region_info"]


def _register(name: str, fn: Callable, in_tree, in_avals: tuple) -> int:
    key = (name, fn, in_tree, in_avals)  # functions compare by identity, module calls by config
    return register(key, RegionInfo(name, in_tree, in_avals), functools.partial(_build, fn))


def _build(fn: Callable, rid: int, info: RegionInfo) -> None:
    """Give region `rid` its call: a `jax.custom_vjp` of two jitted functions named by
    `call_name`, the forward and the backward (`fn`'s VJP recomputed from the inputs)."""
    name = info.name

    def fwd_body(*args):
        out = fn(*args)
        leaves, info.out_tree = jax.tree.flatten(out)
        info.out_avals = tuple(jax.typeof(x) for x in leaves)
        return out

    def bwd_body(res, g):
        _, vjp = jax.vjp(fn, *res)
        return vjp(g)

    fwd_body.__name__ = fwd_body.__qualname__ = call_name(name, rid, backward=False)
    bwd_body.__name__ = bwd_body.__qualname__ = call_name(name, rid, backward=True)
    jfwd, jbwd = jax.jit(fwd_body), jax.jit(bwd_body)

    @jax.custom_vjp
    def call(*args):
        return jfwd(*args)

    call.defvjp(lambda *args: (jfwd(*args), args), jbwd)
    info.fwd = call
    info.bwd = jbwd


def region(name: str, fn: Optional[Callable] = None):
    """Mark `fn` as a composite site named `name`; usable as `@peat.region("softmax")`.

    `fn` must take arrays (pytrees of arrays) as positional arguments and return arrays. Outside
    peat_jax the marked function computes exactly what `fn` computes, forward and backward; its
    backward is `fn`'s VJP recomputed from the inputs (like `jax.checkpoint` on the region).
    Under `peat.list_sites` it appears as two composite sites, `phase="fwd"` and `phase="bwd"`.
    """
    if not is_region_name(name):
        raise PeatError(f"region name {name!r} must be an identifier (letters, digits, '_')")
    if fn is None:
        return functools.partial(region, name)
    if not callable(fn):
        raise PeatError(f"peat.region({name!r}) needs a callable, got {type(fn).__name__}")

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if kwargs:
            raise PeatError(f"region {name!r} takes positional array arguments only; bind "
                            "keyword arguments with functools.partial first "
                            f"(got {sorted(kwargs)})")
        leaves, in_tree = jax.tree.flatten(args)
        rid = _register(name, fn, in_tree, tuple(jax.typeof(x) for x in leaves))
        return region_info(rid).fwd(*args)

    return wrapped


# --------------------------------------------------------------------------------------------
# Flax linen modules as regions

_STATE = threading.local()


@contextlib.contextmanager
def _inside_region():
    prev = getattr(_STATE, "inside", False)
    _STATE.inside = True
    try:
        yield
    finally:
        _STATE.inside = prev


def _is_array(x) -> bool:
    return isinstance(x, jax.Array) or _jax.is_tracer(x) or hasattr(x, "__jax_array__") or \
        type(x).__module__ == "numpy"


@contextlib.contextmanager
def flax_regions(*module_types: type):
    """Within this context, calls of these Flax linen module classes are regions.

    E.g. `with peat.flax_regions(nn.LayerNorm, nn.MultiHeadDotProductAttention): ...`. The
    region's name is the class name (`LayerNorm`); its inputs are the module's variables and the
    array arguments of the call (other arguments are closed over). Calls made while the module is
    being initialised are left alone. `peat.list_sites(..., regions=...)` and `peat.substitute(...,
    regions=...)` enter this context while they trace.
    """
    if not module_types:
        yield
        return
    for t in module_types:
        if not isinstance(t, type):
            raise PeatError(f"flax_regions expects Flax module classes, got {t!r}")
    import flax.linen as nn

    def interceptor(next_fun, args, kwargs, context):
        mod = context.module
        if (context.method_name != "__call__" or not isinstance(mod, module_types)
                or getattr(_STATE, "inside", False) or mod.is_initializing()):
            return next_fun(*args, **kwargs)
        leaves, tree = jax.tree.flatten((args, kwargs))
        dyn = tuple(i for i, x in enumerate(leaves) if _is_array(x))
        statics = tuple(_hashable(x) for i, x in enumerate(leaves) if i not in dyn)
        key = (type(mod), _module_fields(mod), tree, dyn, statics)
        fn = _ModuleCall(key, mod.clone(parent=None, name=None), leaves, tree, dyn)
        return region(type(mod).__name__, fn)(dict(mod.variables), *[leaves[i] for i in dyn])

    with nn.intercept_methods(interceptor):
        yield


class _ModuleCall:
    """A module call as a pure function of (variables, *array args); equal for equal configs."""

    def __init__(self, key, unbound, leaves, tree, dyn):
        self.key, self.unbound, self.leaves, self.tree, self.dyn = key, unbound, leaves, tree, dyn

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, _ModuleCall) and self.key == other.key

    def __call__(self, variables, *dyn_leaves):
        full = list(self.leaves)
        for i, x in zip(self.dyn, dyn_leaves):
            full[i] = x
        a, k = jax.tree.unflatten(self.tree, full)
        with _inside_region():
            return self.unbound.apply(variables, *a, **k)


def _hashable(v):
    try:
        hash(v)
        return v
    except TypeError:
        return repr(v)


def _module_fields(mod) -> tuple:
    return tuple((f.name, _hashable(getattr(mod, f.name, None))) for f in dataclasses.fields(mod)
                 if f.name not in ("parent", "name"))
