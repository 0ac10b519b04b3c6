"""Composite sites: named regions (softmax, layer norm, attention) that a fused kernel can replace.

A region is a pure function of arrays. Marked with `peat.region(name)`, it is traced as a named
forward call and a named backward call (a `jax.custom_vjp` whose backward recomputes the region's
VJP from its inputs), so the region stays addressable in a differentiated program: a candidate
replaces its forward, its backward, or both, and the residuals between them are just the inputs.

Three ways to make one: `peat.region` marks your own function; `peat.flax_regions` makes the calls
of Flax module classes regions; `peat.intercept` makes the calls of a library function you cannot
edit (`jax.nn.dot_product_attention`, `optax.softmax_cross_entropy`) regions named by its dotted
name, by interposing the function while the program is traced.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import importlib
import inspect
import sys
import threading
import types
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np

import jax

from peat_jax._src import _jax
from peat_jax._src._region_registry import (RegionInfo, call_name, is_region_name, region_info,
                                            register)
from peat_jax._src.errors import PeatError

if TYPE_CHECKING:
    from peat_jax._src.kernels import Kernel


def _register(name: str, fn: Callable, in_tree, in_avals: tuple,
              function: Optional["FunctionCall"] = None) -> int:
    key = (name, fn, in_tree, in_avals)  # functions compare by identity, module calls by config
    return register(key, RegionInfo(name, in_tree, in_avals, function=function),
                    functools.partial(_build, fn))


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


# --------------------------------------------------------------------------------------------
# Library functions as regions: peat.intercept

@dataclasses.dataclass(frozen=True)
class Target:
    """What a dotted name given to `peat.intercept` names: a function `fn`, bound as `attr` in
    its module, or a Flax linen module class `module_type` (its calls are regions as under
    `peat.flax_regions`, named by the class)."""

    name: str
    fn: Optional[Callable] = None
    attr: str = ""
    module_type: Optional[type] = None


def resolve_name(name: str) -> Target:
    """The function or Flax module class that the dotted `name` names, imported if need be.

    `"jax.nn.dot_product_attention"`, `"flax.linen.dot_product_attention"`,
    `"optax.softmax_cross_entropy"` name functions; `"flax.linen.LayerNorm"` (or its method
    `"flax.linen.LayerNorm.__call__"`) a Flax module class. Anything else is a one-line
    PeatError (with the closest attribute when the last part is misspelt).
    """
    if not isinstance(name, str):
        raise PeatError(f"peat.intercept takes dotted names such as "
                        f"'jax.nn.dot_product_attention', got {type(name).__name__} {name!r}")
    parts = name.split(".")
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise PeatError(f"cannot intercept {name!r}: give a dotted name module.function, such as "
                        "'jax.nn.dot_product_attention' or 'optax.softmax_cross_entropy'")
    module, i = None, 0
    for i in range(len(parts) - 1, 0, -1):
        modname = ".".join(parts[:i])
        try:
            module = importlib.import_module(modname)
            break
        except ModuleNotFoundError as e:
            if e.name is None or not (modname == e.name or modname.startswith(e.name + ".")):
                raise PeatError(f"cannot intercept {name!r}: importing {modname!r} failed: "
                                f"{e}") from None
        except ImportError as e:
            raise PeatError(f"cannot intercept {name!r}: importing {modname!r} failed: "
                            f"{e}") from None
    if module is None:
        raise PeatError(f"cannot intercept {name!r}: there is no module {parts[0]!r}")
    owner, obj, path = module, module, ".".join(parts[:i])
    for part in parts[i:]:
        if not hasattr(obj, part):
            public = [a for a in dir(obj) if not a.startswith("_")]
            close = difflib.get_close_matches(part, public, n=1)
            hint = f" (did you mean {path + '.' + close[0]!r}?)" if close else ""
            raise PeatError(f"cannot intercept {name!r}: {path!r} has no attribute "
                            f"{part!r}{hint}")
        owner, obj, path = obj, getattr(obj, part), f"{path}.{part}"
    obj = getattr(obj, "_peat_original", obj)  # already interposed (a nested intercept)
    flax_module = getattr(sys.modules.get("flax.linen"), "Module", None)
    if flax_module is not None and isinstance(obj, type) and issubclass(obj, flax_module):
        return Target(name, module_type=obj)
    if (flax_module is not None and isinstance(owner, type) and issubclass(owner, flax_module)
            and parts[-1] == "__call__"):
        return Target(name, module_type=owner)
    if isinstance(owner, types.ModuleType) and callable(obj) and not isinstance(obj, type):
        return Target(name, fn=obj, attr=parts[-1])
    what = ("a class" if isinstance(obj, type) else
            "a method" if isinstance(owner, type) else f"a {type(obj).__name__}")
    raise PeatError(f"cannot intercept {name!r}: it is {what}, not a function of a module or a "
                    "Flax linen module class")


def _active() -> dict:
    """{id(function): (function, site name)} of the functions this thread intercepts now."""
    return getattr(_STATE, "intercepted", {})


def active_key() -> tuple[str, ...]:
    """The names this thread intercepts now (inside `peat.intercept`), in the order given: part
    of what a trace depends on."""
    return getattr(_STATE, "names", ())


@contextlib.contextmanager
def intercept(*names: str):
    """Within this context, calls of these library functions are composite sites.

    E.g. `with peat.intercept("jax.nn.dot_product_attention"): peat.list_sites(step, state,
    batch)`. Each name is a dotted name (`resolve_name`): a function
    (`jax.nn.dot_product_attention`, `flax.linen.dot_product_attention`, `jax.nn.standardize`,
    `optax.softmax_cross_entropy`) or a Flax linen module class (`flax.linen.LayerNorm`, as
    `peat.flax_regions`). A call of an intercepted function is a region named by the dotted
    name (`site.primitive`, and the selector that picks it): its inputs are the call's array
    arguments, positional and keyword (a mask, a bias); the other arguments (`is_causal=True`,
    `scale`, an axis) are part of the region's identity and reach a kernel as given (see
    `FunctionCall.kernel_args`), and its backward is the function's VJP recomputed from the
    inputs. Outside the model nothing changes: the function computes what it computes.

    How: while the context is open, the function is replaced by an interposer in every imported
    module that binds it under its own name (`jax.nn`, the module defining it, and modules that
    imported it by name, e.g. `from flax.linen.attention import dot_product_attention_weights`
    in a model library), and Flax modules whose field holds it (the `attention_fn` of
    `nn.MultiHeadDotProductAttention`) call the interposer during their calls. jax.jit's cache
    is keyed on the intercepted names, so a function jitted and traced before is traced again.
    Everything is restored on exit, also on an exception. Thread safety: the module attributes
    are process-wide, but the interposer makes regions only in the thread that opened the
    context (others call the original function). A binding under another name, a default
    argument or a `functools.partial` made before keeps the original.

    `peat.list_sites`, `peat.substitute`, `peat.inject`, `peat.playback` and `peat.runtime`
    take the same names in `regions=` and open this context while they trace; wrap
    `peat.profile` (or anything else that traces) in it directly.
    """
    targets = [resolve_name(n) for n in names]  # every name checked before anything changes
    if not targets:
        yield
        return
    functions = [t for t in targets if t.fn is not None]
    prev_active, prev_names = _active(), active_key()
    active = dict(prev_active)
    for t in functions:
        active.setdefault(id(t.fn), (t.fn, t.name))
    all_names = tuple(dict.fromkeys(prev_names + tuple(t.name for t in targets)))
    with contextlib.ExitStack() as stack:
        stack.enter_context(flax_regions(*[t.module_type for t in targets
                                           if t.module_type is not None]))
        for t in functions:
            stack.enter_context(_patched(t))
        if functions:
            stack.enter_context(_flax_fields())
        stack.enter_context(_jax.trace_key_context(all_names))
        stack.callback(_set_state, prev_active, prev_names)
        _set_state(active, all_names)
        yield


def _set_state(active: dict, names: tuple) -> None:
    _STATE.intercepted, _STATE.names = active, names


class _Patch:
    """An intercepted function's interposer and the module attributes it replaces, shared by
    every open `intercept` of that function (in any thread)."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.interposer = _interposer(fn)
        self.count = 0
        self.bindings: list[tuple[types.ModuleType, str]] = []

    def bind(self, attrs: Sequence[str]) -> None:
        """Replace the function by the interposer wherever an imported module binds it under
        one of `attrs` (called on every entry: modules imported since are bound too)."""
        for m in list(sys.modules.values()):
            if not isinstance(m, types.ModuleType):
                continue
            try:
                d = vars(m)
            except TypeError:
                continue
            for a in attrs:
                if d.get(a) is self.fn:
                    setattr(m, a, self.interposer)
                    self.bindings.append((m, a))

    def unbind(self) -> None:
        for m, a in self.bindings:
            if vars(m).get(a) is self.interposer:
                setattr(m, a, self.fn)
        self.bindings.clear()


_PATCH_LOCK = threading.Lock()
_PATCHES: dict[int, _Patch] = {}


@contextlib.contextmanager
def _patched(t: Target):
    assert t.fn is not None  # intercept patches the targets that name a function only
    with _PATCH_LOCK:
        p = _PATCHES.get(id(t.fn))
        if p is None:
            p = _PATCHES[id(t.fn)] = _Patch(t.fn)
        p.count += 1
        p.bind(tuple(dict.fromkeys([t.attr, getattr(t.fn, "__name__", t.attr)])))
    try:
        yield p
    finally:
        with _PATCH_LOCK:
            p.count -= 1
            if p.count == 0:
                p.unbind()
                del _PATCHES[id(t.fn)]


def _interposer(fn: Callable) -> Callable:
    def interposed(*args, **kwargs):
        got = _active().get(id(fn))
        if got is None or got[0] is not fn:
            return fn(*args, **kwargs)
        return _function_region(got[1], fn, args, kwargs)

    try:
        functools.update_wrapper(interposed, fn)  # name, doc, and the signature (__wrapped__)
    except (AttributeError, TypeError):
        pass
    setattr(interposed, "_peat_original", fn)  # what resolve_name unwraps
    return interposed


@contextlib.contextmanager
def _flax_fields():
    """Flax modules whose dataclass field holds an intercepted function (the `attention_fn`
    of `nn.MultiHeadDotProductAttention`, bound when the class was defined) hold its
    interposer for the duration of each of their method calls."""
    linen = sys.modules.get("flax.linen")
    if linen is None:
        yield
        return

    def interceptor(next_fun, args, kwargs, context):
        active, mod, swapped = _active(), context.module, []
        if active and dataclasses.is_dataclass(mod):
            for f in dataclasses.fields(mod):
                v = mod.__dict__.get(f.name)
                got = active.get(id(v)) if callable(v) else None
                p = _PATCHES.get(id(v)) if got is not None and got[0] is v else None
                if p is not None:
                    object.__setattr__(mod, f.name, p.interposer)
                    swapped.append((f.name, v))
        try:
            return next_fun(*args, **kwargs)
        finally:
            for n, v in swapped:
                object.__setattr__(mod, n, v)

    with linen.intercept_methods(interceptor):
        yield


def _is_operand(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) or _jax.is_tracer(x)


def _function_region(name: str, fn: Callable, args: tuple, kwargs: dict):
    leaves, tree = jax.tree.flatten((args, kwargs))
    dyn = tuple(i for i, x in enumerate(leaves) if _is_operand(x))
    if not dyn:  # nothing to compute on: not a site
        return fn(*args, **kwargs)
    dset = set(dyn)
    statics = tuple((i, type(x), _hashable(x)) for i, x in enumerate(leaves) if i not in dset)
    operands = [leaves[i] for i in dyn]
    call = FunctionCall(name, fn, leaves, tree, dyn, (fn, tree, dyn, statics, active_key()))
    rid = _register(name, call, jax.tree.structure(tuple(operands)),
                    tuple(jax.typeof(x) for x in operands), function=call)
    fwd = region_info(rid).fwd
    assert fwd is not None  # set by _register's build
    return fwd(*operands)


@functools.lru_cache(maxsize=512)
def _cached_signature(fn) -> Optional[inspect.Signature]:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _signature(fn) -> Optional[inspect.Signature]:
    try:
        return _cached_signature(fn)
    except TypeError:  # unhashable
        return _cached_signature.__wrapped__(fn)


def _accepted(impl) -> Optional[frozenset]:
    """The keyword arguments `impl` takes by name; None for any (a `**kwargs`, or no
    signature to read)."""
    sig = _signature(impl)
    if sig is None or any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    return frozenset(n for n, p in sig.parameters.items()
                     if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


class _Slot:
    """Stands for operand `i` where a call's structure is read without its values."""

    def __init__(self, i: int):
        self.i = i


def _show(v) -> str:
    if isinstance(v, jax.ShapeDtypeStruct):
        return f"{np.dtype(v.dtype).name}[{','.join(map(str, v.shape))}]"
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


class FunctionCall:
    """One call signature of an intercepted library function: the function as a pure function
    of the call's array arguments (`operands`, the region's inputs, in the order of the call's
    flattened arguments), the other arguments fixed. Equal (and hashed) by the function, the
    call's structure and those other arguments, so calls alike share one region.

    Attributes:
      name: the dotted name the function was intercepted by (the site's `primitive`).
      fn: the library function itself.
      arguments: every parameter of the call by name, defaults applied, arrays as
        `jax.ShapeDtypeStruct` (what `site.params["arguments"]` shows a kernel's `supports`).
    """

    def __init__(self, name: str, fn: Callable, leaves: list, tree, dyn: tuple, key):
        self.name, self.fn, self.tree, self.dyn, self.key = name, fn, tree, dyn, key
        dset = set(dyn)
        self._leaves = [None if i in dset else x for i, x in enumerate(leaves)]
        self.signature = _signature(fn)
        self._described = [jax.ShapeDtypeStruct(np.shape(leaves[i]), leaves[i].dtype)
                           for i in dyn]
        self.arguments = self._arguments()

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, FunctionCall) and self.key == other.key

    def rebuild(self, operands: Sequence[Any]) -> tuple[tuple, dict]:
        """(args, kwargs) of the call, as the caller passed them, with these operands."""
        full = list(self._leaves)
        for i, x in zip(self.dyn, operands):
            full[i] = x
        return jax.tree.unflatten(self.tree, full)

    def __call__(self, *operands):
        a, k = self.rebuild(operands)
        return self.fn(*a, **k)

    def _arguments(self) -> dict[str, Any]:
        a, k = self.rebuild(self._described)
        bound = self._bind(a, k)
        if bound is None:
            return {**{f"arg{i}": v for i, v in enumerate(a)}, **k}
        bound.apply_defaults()
        return dict(bound.arguments)

    def _bind(self, a, k) -> Optional[inspect.BoundArguments]:
        if self.signature is None:
            return None
        try:
            return self.signature.bind(*a, **k)
        except TypeError:
            return None

    def _split(self, a, k) -> Optional[tuple[list, dict]]:
        """The call as (parameters without a default, positionally; the others it passes, by
        name); None where the signature cannot say (no signature, a `*args`)."""
        sig = self.signature
        if sig is None or any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values()):
            return None
        bound = self._bind(a, k)
        if bound is None:
            return None
        pos, kw = [], {}
        for n, v in bound.arguments.items():
            p = sig.parameters[n]
            if p.kind is p.VAR_KEYWORD:
                kw.update(v)
            elif p.kind is p.POSITIONAL_ONLY or (p.kind is p.POSITIONAL_OR_KEYWORD
                                                 and p.default is p.empty):
                pos.append(v)
            else:
                kw[n] = v
        return pos, kw

    def _is_default(self, n: str, v) -> bool:
        p = self.signature.parameters.get(n) if self.signature is not None else None
        if p is None or p.default is p.empty:
            return False
        d = p.default
        if v is d:
            return True
        if _is_operand(v) or _is_operand(d) or isinstance(v, (jax.ShapeDtypeStruct, _Slot)):
            return False
        try:
            return type(v) is type(d) and bool(v == d)
        except Exception:  # noqa: BLE001 - an odd __eq__: not the default
            return False

    def kernel_args(self, impl: Callable, operands: Sequence[Any]) -> tuple[list, dict]:
        """How a kernel `impl` is called on this call's arguments: the library function's
        parameters without a default positionally (`query, key, value`), every other argument
        the call passed by name (`mask=..., is_causal=True`), less those `impl` does not take
        whose value is the function's default. Where the signature cannot say: as called."""
        a, k = self.rebuild(operands)
        split = self._split(a, k)
        if split is None:
            return list(a), dict(k)
        pos, kw = split
        accepted = _accepted(impl)
        if accepted is not None:
            kw = {n: v for n, v in kw.items() if n in accepted or not self._is_default(n, v)}
        return pos, kw

    def unserved(self, impl: Callable) -> Optional[str]:
        """Why a kernel `impl` cannot serve this call (an argument it passes, not at the
        function's default, that `impl` does not take), or None."""
        accepted = _accepted(impl)
        split = self._split(*self.rebuild(self._described))
        if accepted is None or split is None:
            return None
        extra = [n for n, v in split[1].items() if n not in accepted and not self._is_default(n, v)]
        if not extra:
            return None
        shown = ", ".join(f"{n}={_show(split[1][n])}" for n in extra)
        return f"the call passes {shown}, which its impl does not take"

    def call_kernel(self, kernel: Kernel, operands: Sequence[Any]):
        """`kernel` (a `peat.Kernel`) called as the library function is, on these operands."""
        pos, kw = self.kernel_args(getattr(kernel, "impl", kernel), operands)
        return kernel(*pos, **kw)

    def kernel_vjp(self, kernel: Kernel, operands: Sequence[Any], cotangent) -> list:
        """The cotangents of the operands under `cotangent` through `kernel`'s call (float0
        zeros for the non-float ones). A kernel with its own `vjp=` differentiates its
        positional operands; its keyword arrays (a mask, a bias) get zero cotangents."""
        operands = list(operands)
        wrt: Sequence[int] = range(len(operands))
        if getattr(kernel, "vjp", None) is not None:
            pos, _ = self.kernel_args(kernel.impl, [_Slot(i) for i in range(len(operands))])
            wrt = [x.i for x in pos if isinstance(x, _Slot)]
        wrt = [i for i in wrt if jax.numpy.issubdtype(operands[i].dtype, jax.numpy.inexact)]

        def f(*xs):
            full = list(operands)
            for i, x in zip(wrt, xs):
                full[i] = x
            return self.call_kernel(kernel, full)

        _, vjp = jax.vjp(f, *[operands[i] for i in wrt])
        got = vjp(cotangent)
        out = [jax.numpy.zeros(x.shape, x.dtype)
               if jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)
               else np.zeros(x.shape, jax.dtypes.float0) for x in operands]
        for i, g in zip(wrt, got):
            out[i] = g
        return out


# --------------------------------------------------------------------------------------------
# regions= as the tracer takes it

def _split_regions(regions: Sequence[Any]) -> tuple[tuple[type, ...], tuple[str, ...]]:
    classes, names = [], []
    for r in regions:
        if isinstance(r, str):
            names.append(r)
        elif isinstance(r, type):
            classes.append(r)
        else:
            raise PeatError(f"regions= takes Flax module classes and dotted names of library "
                            f"functions (e.g. 'jax.nn.dot_product_attention'), got {r!r}")
    return tuple(classes), tuple(names)


def module_types(regions: Sequence[Any]) -> tuple[type, ...]:
    """The Flax module classes among `regions`, those named by a dotted name included."""
    classes, names = _split_regions(regions)
    named = [t.module_type for t in map(resolve_name, names) if t.module_type is not None]
    return tuple(dict.fromkeys(classes + tuple(named)))


def check_regions(regions: Sequence[Any]) -> None:
    """A PeatError for an entry of `regions` that is neither a class nor a name that resolves."""
    for name in _split_regions(regions)[1]:
        resolve_name(name)


@contextlib.contextmanager
def tracing(regions: Sequence[Any]):
    """The context a program is traced in for `regions=`: Flax module classes as
    `flax_regions`, dotted names as `intercept`."""
    classes, names = _split_regions(regions)
    with flax_regions(*classes), intercept(*names):
        yield
