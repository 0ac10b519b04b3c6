"""Foreign callables as candidates: a NumPy or PyTorch function run through `jax.pure_callback`.

For cross-framework porting checks: the op as another framework computes it, on the host, in
place of the site. Operands are pytrees of arrays (a Flax region's variables dict included);
the foreign function gets the same pytree of host arrays.

* `numpy_kernel(fn, vjp=None)`: `fn(*numpy_operands)`; bfloat16 (and other dtypes NumPy cannot
  compute in) travel as float32 and come back in the JAX dtype. With `vjp(operands, output,
  cotangent) -> operand cotangents` (NumPy too) it trains.
* `torch_kernel(fn)`: `fn(*torch_tensors)` on CPU tensors of the same dtypes (bfloat16
  included); its backward is computed by `torch.autograd.grad` on a recomputation of `fn`.
  torch is imported when the kernel runs, with a clear error if it is missing.

Output types: `result(*operands) -> ShapeDtypeStruct pytree` if given; otherwise `fn` is run once
per trace on zero-filled operands of the right shapes (a probe) and its output shapes are used,
with float outputs in the dtype the JAX operands promote to when NumPy had to widen them.
Calls use `vmap_method="sequential"`.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from peat_jax._src.errors import PeatError
from peat_jax._src.formats import is_inexact
from peat_jax._src.kernels.base import Kernel


_NUMPY_NATIVE = frozenset(np.dtype(d).name for d in (
    np.float16, np.float32, np.float64, np.complex64, np.complex128, np.bool_,
    np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64))


def _per_signature(make_host: Callable) -> Callable:
    """`make_host(*signature) -> host callback`, returning the same callback object for an
    equal signature (pytree structures, shapes, dtypes): `jax.pure_callback` keys its
    compiled program by the callback, so an eagerly called kernel compiles once per signature
    rather than once per call. An unhashable signature gets a fresh callback."""
    cached = functools.lru_cache(maxsize=64)(make_host)

    def host_for(*signature):
        try:
            return cached(*signature)
        except TypeError:   # unhashable: e.g. a `result` returning arrays
            return make_host(*signature)
    return host_for


def _forward(out_types: Callable, forward_host: Callable) -> Callable:
    """A foreign kernel's `impl`: the operands' leaves through the host callback
    ``forward_host(tree, want)`` (`_per_signature`), `out_types(operands)` its output types."""
    def impl(*operands, **_params):
        types = out_types(operands)
        leaves, tree = jax.tree.flatten(operands)
        want = tuple(jax.tree.leaves(types))
        flat_out = jax.pure_callback(forward_host(tree, want), list(want), *leaves,
                                     vmap_method="sequential")
        return jax.tree.unflatten(jax.tree.structure(types), flat_out)
    return impl


def _float0_or_zeros(x):
    if is_inexact(x.dtype):
        return jnp.zeros(x.shape, x.dtype)
    return np.zeros(x.shape, jax.dtypes.float0)


def _widened(dtype) -> np.dtype:
    """The dtype NumPy computes in for a JAX dtype (bfloat16 and other ml_dtypes -> float32)."""
    d = np.dtype(dtype)
    if d.name in _NUMPY_NATIVE:
        return d
    return np.dtype(np.float32) if is_inexact(d) else d


def _float_result_dtype(leaves) -> Optional[np.dtype]:
    floats = [x.dtype for x in leaves if is_inexact(x.dtype)]
    return np.dtype(jnp.result_type(*floats)) if floats else None


def _check_name(fn, name: Optional[str], what: str) -> str:
    if not callable(fn):
        raise PeatError(f"{what} needs a callable, got {type(fn).__name__}")
    return name if name else getattr(fn, "__name__", what)


# --------------------------------------------------------------------------------------------
# NumPy


def _to_numpy(x) -> np.ndarray:
    a = np.asarray(x)
    w = _widened(a.dtype)
    return a.astype(w) if w != a.dtype else a


def _from_host(x, want: jax.ShapeDtypeStruct) -> np.ndarray:
    a = np.asarray(x)
    if tuple(a.shape) != tuple(want.shape):
        raise PeatError(f"the foreign function returned shape {tuple(a.shape)}, expected "
                        f"{tuple(want.shape)}")
    return a.astype(want.dtype)


def _numpy_result(fn, operands) -> Any:
    """Output types from a probe call on zeros (NumPy dtypes mapped back to JAX's)."""
    zeros = jax.tree.map(lambda x: np.zeros(np.shape(x), _widened(jnp.result_type(x))), operands)
    out = fn(*zeros)
    widened = any(_widened(x.dtype) != np.dtype(x.dtype) for x in jax.tree.leaves(operands))
    back = _float_result_dtype(jax.tree.leaves(operands)) if widened else None

    def typ(o):
        o = np.asarray(o)
        dt = back if (back is not None and is_inexact(o.dtype)) else o.dtype
        return jax.ShapeDtypeStruct(o.shape, dt)

    return jax.tree.map(typ, out)


def numpy_kernel(fn: Callable, vjp: Optional[Callable] = None, name: Optional[str] = None, *,
                 result: Optional[Callable] = None, primitive: Optional[str] = None,
                 supports: Optional[Callable] = None) -> Kernel:
    """A `peat.Kernel` computing a site with a NumPy function on the host.

    Args:
      fn: `fn(*operands) -> output(s)` on NumPy arrays (op params of a primitive site are not
        passed: wrap with `peat.kernels.dot_general(numpy_kernel(np.matmul))` for GEMMs).
      vjp: optional `vjp(operands, output, cotangent) -> tuple of operand cotangents`, NumPy in
        and out (operands as passed to `fn`); without it the kernel is forward-only.
      name: the kernel's name (default: fn's).
      result: optional `result(*operands) -> jax.ShapeDtypeStruct` pytree; default: a probe.
      primitive, supports: as in `peat.Kernel`.

    Returns:
      A Kernel running `fn` through `jax.pure_callback` (and `vjp` likewise in the backward).
    """
    kname = _check_name(fn, name, "numpy_kernel")
    if vjp is not None and not callable(vjp):
        raise PeatError(f"numpy_kernel {kname!r}: vjp must be callable")

    def out_types(operands):
        return result(*operands) if result is not None else _numpy_result(fn, operands)

    @_per_signature
    def forward_host(tree, want):
        def host(*flat):
            args = jax.tree.unflatten(tree, [_to_numpy(x) for x in flat])
            out = jax.tree.leaves(fn(*args))
            return [_from_host(o, w) for o, w in zip(out, want)]
        return host

    @_per_signature
    def backward_host(tree, out_tree, n_in, n_out, fl, want):
        def host(*flat):
            args = jax.tree.unflatten(tree, [_to_numpy(x) for x in flat[:n_in]])
            o = jax.tree.unflatten(out_tree, [_to_numpy(x) for x in flat[n_in:n_in + n_out]])
            ct = jax.tree.unflatten(out_tree, [_to_numpy(x) for x in flat[n_in + n_out:]])
            grads = jax.tree.leaves(vjp(args, o, ct), is_leaf=lambda x: x is None)
            if len(grads) != n_in:
                raise PeatError(f"numpy_kernel {kname!r}: vjp returned {len(grads)} "
                                f"cotangents for {n_in} operands")
            return [np.zeros(w.shape, w.dtype) if grads[i] is None else _from_host(grads[i], w)
                    for i, w in zip(fl, want)]
        return host

    def numpy_vjp(ops, out, g, **_params):
        leaves, tree = jax.tree.flatten(ops)
        out_leaves, out_tree = jax.tree.flatten(out)
        g_leaves = jax.tree.leaves(g)
        n_in, n_out = len(leaves), len(out_leaves)
        fl = tuple(i for i, x in enumerate(leaves) if is_inexact(x.dtype))
        want = tuple(jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype) for i in fl)
        host = backward_host(tree, out_tree, n_in, n_out, fl, want)
        got = jax.pure_callback(host, list(want), *leaves, *out_leaves, *g_leaves,
                                vmap_method="sequential") if want else []
        full = [_float0_or_zeros(x) for x in leaves]
        for i, v in zip(fl, got):
            full[i] = v
        return tuple(jax.tree.unflatten(tree, full))

    return Kernel(kname, _forward(out_types, forward_host), primitive=primitive,
                  supports=supports, vjp=numpy_vjp if vjp is not None else None)


# --------------------------------------------------------------------------------------------
# PyTorch


def _torch():
    try:
        import torch
    except ImportError as e:
        raise PeatError("peat.kernels.torch_kernel needs PyTorch: pip install 'peat_jax[torch]' "
                        f"(torch==2.13.0; a CPU build is enough) ({e})") from e
    return torch


def _to_torch(torch, x, requires_grad: bool = False):
    a = np.array(x, copy=True, order="C")  # a writable host copy that torch may own
    if a.dtype == jnp.bfloat16:
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    elif a.dtype.name in _NUMPY_NATIVE:
        t = torch.from_numpy(a)
    else:
        raise PeatError(f"torch_kernel cannot pass dtype {a.dtype.name} to PyTorch")
    if requires_grad:
        t.requires_grad_(True)
    return t


def _from_torch(torch, t) -> np.ndarray:
    if not isinstance(t, torch.Tensor):
        return np.asarray(t)
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(jnp.bfloat16)
    return t.numpy()


def torch_kernel(fn: Callable, name: Optional[str] = None, *, result: Optional[Callable] = None,
                 primitive: Optional[str] = None, supports: Optional[Callable] = None) -> Kernel:
    """A `peat.Kernel` computing a site with a PyTorch function on CPU tensors.

    Args:
      fn: `fn(*tensors) -> tensor(s)` (pytrees of tensors for pytree operands), differentiable
        by torch autograd where a gradient flows.
      name: the kernel's name (default: fn's).
      result: optional `result(*operands) -> jax.ShapeDtypeStruct` pytree; default: a probe on
        zero tensors.
      primitive, supports: as in `peat.Kernel`.

    Returns:
      A Kernel running `fn` through `jax.pure_callback`; its backward recomputes `fn` with
      `requires_grad` inputs and calls `torch.autograd.grad` with the cotangents. Dtypes
      round-trip exactly (bfloat16 as bfloat16).
    """
    kname = _check_name(fn, name, "torch_kernel")

    def out_types(operands):
        if result is not None:
            return result(*operands)
        torch = _torch()
        zeros = jax.tree.map(lambda x: _to_torch(torch, np.zeros(np.shape(x),
                                                                  jnp.result_type(x))), operands)
        with torch.no_grad():
            out = fn(*zeros)
        return jax.tree.map(lambda t: jax.ShapeDtypeStruct(
            tuple(t.shape), _from_torch(torch, torch.zeros((), dtype=t.dtype)).dtype), out)

    @_per_signature
    def forward_host(tree, want):
        def host(*flat):
            torch = _torch()
            args = jax.tree.unflatten(tree, [_to_torch(torch, x) for x in flat])
            with torch.no_grad():
                out = jax.tree.leaves(fn(*args))
            return [_from_host(_from_torch(torch, o), w) for o, w in zip(out, want)]
        return host

    @_per_signature
    def backward_host(tree, n_in, fl, want):
        def host(*flat):
            torch = _torch()
            ts = [_to_torch(torch, x, requires_grad=i in fl) for i, x in enumerate(flat[:n_in])]
            cts = [_to_torch(torch, x) for x in flat[n_in:]]
            with torch.enable_grad():
                outs = jax.tree.leaves(fn(*jax.tree.unflatten(tree, ts)))
                pairs = [(o, c) for o, c in zip(outs, cts)
                         if isinstance(o, torch.Tensor) and o.requires_grad]
                grads = torch.autograd.grad([o for o, _ in pairs],
                                            [ts[i] for i in fl],
                                            grad_outputs=[c.to(o.dtype) for o, c in pairs],
                                            allow_unused=True) if pairs else [None] * len(fl)
            return [np.zeros(w.shape, w.dtype) if gr is None
                    else _from_host(_from_torch(torch, gr), w) for gr, w in zip(grads, want)]
        return host

    def kvjp(ops, out, g, **_params):
        leaves, tree = jax.tree.flatten(ops)
        g_leaves = jax.tree.leaves(g)
        n_in = len(leaves)
        fl = tuple(i for i, x in enumerate(leaves) if is_inexact(x.dtype))
        want = tuple(jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype) for i in fl)
        got = jax.pure_callback(backward_host(tree, n_in, fl, want), list(want), *leaves,
                                *g_leaves, vmap_method="sequential") if want else []
        full = [_float0_or_zeros(x) for x in leaves]
        for i, v in zip(fl, got):
            full[i] = v
        return tuple(jax.tree.unflatten(tree, full))

    return Kernel(kname, _forward(out_types, forward_host), primitive=primitive,
                  supports=supports, vjp=kvjp)
