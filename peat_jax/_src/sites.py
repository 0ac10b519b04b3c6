"""Op sites: every occurrence of an op in a traced program, and selectors over them."""
from __future__ import annotations

import collections
import dataclasses
import fnmatch
import math
import threading
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import jax
import numpy as np

from peat_jax._src import _interpreter as _ip
from peat_jax._src import _jax
from peat_jax._src import regions as _regions
from peat_jax._src._region_registry import region_of
from peat_jax._src.errors import PeatError


@dataclasses.dataclass(frozen=True)
class Site:
    """One occurrence of an op in a traced program.

    Attributes:
      index: position in the program's depth-first site order (stable for the same function,
        argument shapes and options); what a traced site index refers to.
      primitive: the XLA-level primitive (`dot_general`, `exp`, `pallas_call`, ...), or for a
        composite site the region's name (`softmax`, `LayerNorm`, or the dotted name of an
        intercepted library function, `jax.nn.dot_product_attention`).
      path: the module path from the name stack with transforms stripped (`MLP/fc1`); for a site
        inside a region the region's name is the last component.
      phase: `"fwd"` or `"bwd"` (the site runs in a transposed, i.e. backward, computation).
      in_shapes, in_dtypes, out_shapes, out_dtypes: operand and result types.
      params: the op's parameters (e.g. `dimension_numbers`); for a region `{"region": name}`,
        and for an intercepted library function also `"function"` (its dotted name) and
        `"arguments"` (the call's arguments by name, defaults applied, arrays as
        `jax.ShapeDtypeStruct`: what a kernel's `supports` reads, e.g. `is_causal`).
      composite: True for a region (a fused kernel replaces the whole region).
      scope: primitives of the enclosing containers, outermost first (e.g. `("scan", "remat2")`).
      name_stack: the raw joined name stack (`transpose(jvp(MLP))/head`).
      repeats: how many times the op runs per call: the product of the enclosing `scan` lengths
        (a `while` body counts once: its trip count is not static).
    """

    index: int
    primitive: str
    path: str
    phase: str
    in_shapes: tuple[tuple[int, ...], ...]
    in_dtypes: tuple[np.dtype, ...]
    out_shapes: tuple[tuple[int, ...], ...]
    out_dtypes: tuple[np.dtype, ...]
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    composite: bool = False
    scope: tuple[str, ...] = ()
    name_stack: str = dataclasses.field(default="", compare=False, repr=False)
    repeats: int = 1

    def __str__(self) -> str:
        ins = ", ".join(_fmt_type(s, d) for s, d in zip(self.in_shapes, self.in_dtypes))
        outs = ", ".join(_fmt_type(s, d) for s, d in zip(self.out_shapes, self.out_dtypes))
        kind = f"[{self.primitive}]" if self.composite else self.primitive
        where = f" in {'/'.join(self.scope)}" if self.scope else ""
        return (f"#{self.index} {self.phase} {kind} @ {self.path or '<top>'}{where}: "
                f"({ins}) -> {outs}")


Selector = Union[int, str, Callable[[Site], bool], Sequence[Any]]
"""What picks sites: a site index, a primitive or region name (`"dot_general"`, `"softmax"`), a
predicate on `Site`, or a sequence of these (the union of what each picks); see `select`."""


def _fmt_type(shape, dtype) -> str:
    name = "float0" if dtype == jax.dtypes.float0 else np.dtype(dtype).name  # a cotangent's
    return f"{name}[{','.join(map(str, shape))}]"


def _aval_types(atoms) -> tuple[tuple, tuple]:
    shapes, dtypes = [], []
    for a in atoms:
        aval = a.aval
        shapes.append(tuple(getattr(aval, "shape", ())))
        dt = getattr(aval, "dtype", None)
        dtypes.append(np.dtype(dt) if dt is not None and not _is_extended(dt) else dt)
    return tuple(shapes), tuple(dtypes)


def _is_extended(dt) -> bool:
    return jax.dtypes.issubdtype(dt, jax.dtypes.extended)


def _site_predicate(primitives: Optional[Union[str, Iterable[str]]]) -> Callable[[Any], bool]:
    if primitives is None:
        names = _ip.SITE_PRIMITIVES
    elif primitives == "all":
        names = None
    else:
        names = frozenset([primitives] if isinstance(primitives, str) else primitives)

    def is_site(eqn) -> bool:
        if region_of(eqn) is not None:
            return True
        name = eqn.primitive.name
        if names is None:
            return not _ip.sub_jaxprs(eqn) or name in _ip.OPAQUE_PRIMITIVES
        return name in names

    return is_site


def _site_of(op: _ip.Op) -> Site:
    eqn = op.eqn
    in_shapes, in_dtypes = _aval_types(eqn.invars)
    out_shapes, out_dtypes = _aval_types(eqn.outvars)
    path = _ip.clean_path(op.name_stack)
    if op.region is not None:
        name, is_bwd, rid = op.region
        phase = "bwd" if (is_bwd or "transpose(" in op.name_stack) else "fwd"
        params = {"region": name, "region_id": rid, "backward": is_bwd}
        call = _regions.region_info(rid).function
        if call is not None:  # a library function's call (peat.intercept)
            params.update(function=call.name, arguments=call.arguments)
        return Site(op.index, name, path, phase, in_shapes, in_dtypes, out_shapes, out_dtypes,
                    params, True, op.containers, op.name_stack, op.repeats)
    phase = "bwd" if "transpose(" in op.name_stack else "fwd"
    return Site(op.index, eqn.primitive.name, path, phase, in_shapes, in_dtypes, out_shapes,
                out_dtypes, dict(eqn.params), False, op.containers, op.name_stack, op.repeats)


# --------------------------------------------------------------------------------------------
# Tracing (cached per argument structure)

_DYNAMIC_SCALARS = (bool, int, float, complex)


def _is_dynamic(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, _DYNAMIC_SCALARS)) or \
        _jax.is_tracer(x)


def _flat_key(leaves: list, treedef) -> Optional[tuple]:
    mask = tuple(_is_dynamic(x) for x in leaves)
    # the abstract mesh too: a trace re-evaluated enters the mesh it was made under, so a
    # function lowered for two GPUs (peat.lowers_for) needs a trace per target
    key = (treedef, mask, tuple(jax.typeof(x) for x, d in zip(leaves, mask) if d),
           tuple(x for x, d in zip(leaves, mask) if not d), jax.sharding.get_abstract_mesh())
    try:
        hash(key)
    except TypeError:
        return None
    return key


def trace_key(tree) -> Optional[tuple]:
    """What a trace of a function of the pytree `tree` depends on, as a hashable key: its
    structure, which leaves are arrays (or scalars traced as arrays), their abstract values
    (shape, dtype, weak type) and the other leaves themselves. None when one of those others
    is unhashable (no key: trace again)."""
    leaves, treedef = jax.tree.flatten(tree)
    return _flat_key(leaves, treedef)


@dataclasses.dataclass
class Traced:
    """A function traced on one argument structure: its program, sites and output tree."""

    program: _ip.Program
    sites: list[Site]
    out_tree: Any
    dynamic_mask: tuple[bool, ...]

    def flat_args(self, args, kwargs) -> list:
        leaves = jax.tree.leaves((args, kwargs))
        return [x for x, d in zip(leaves, self.dynamic_mask) if d]


class Tracer:
    """Traces `fn` once per argument structure and keeps the numbered program."""

    def __init__(self, fn: Callable, *, primitives=None, regions: Sequence[Any] = ()):
        if not callable(fn):
            raise PeatError(f"expected a callable to trace, got {type(fn).__name__}")
        self.fn = fn
        self.primitives = primitives
        self.regions = tuple(regions)
        _regions.check_regions(self.regions)
        self._is_site = _site_predicate(primitives)
        self._cache: dict[Any, Traced] = {}
        self._lock = threading.Lock()

    def trace(self, args: tuple, kwargs: Mapping[str, Any]) -> Traced:
        leaves, in_tree = jax.tree.flatten((args, kwargs))
        key = _flat_key(leaves, in_tree)
        mask = tuple(_is_dynamic(x) for x in leaves) if key is None else key[1]
        if key is not None:  # what this thread intercepts (peat.intercept) shapes the trace too
            key = (key, _regions.active_key())
        avals = tuple(jax.typeof(x) for x, d in zip(leaves, mask) if d)
        with self._lock:
            if key is not None and key in self._cache:
                return self._cache[key]
        dyn_pos = [i for i, d in enumerate(mask) if d]

        def flat_fn(*dyn):
            full = list(leaves)
            for i, x in zip(dyn_pos, dyn):
                full[i] = x
            a, k = jax.tree.unflatten(in_tree, full)
            return self.fn(*a, **k)

        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
        with _regions.tracing(self.regions):
            closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*specs)
        program = _ip.Program(closed, self._is_site)
        sites = [_site_of(op) for op in program.ops()]
        traced = Traced(program, sites, jax.tree.structure(out_shape), mask)
        if key is not None:
            with self._lock:
                self._cache[key] = traced
        return traced


def list_sites(fn: Callable, *args, primitives=None, regions: Sequence[Any] = (),
               **kwargs) -> list[Site]:
    """Every op site of `fn(*args, **kwargs)`, forward and backward, in index order.

    `fn` is any JAX function (a Flax `apply`, a whole train step with `value_and_grad` and an
    optax update, an Equinox model, plain jax); it is traced, not run. Containers (`jit`,
    custom derivatives, `remat`, `scan`, `while`, `cond`) are descended into; kernel bodies
    (`pallas_call`, `ffi_call`) are opaque sites.

    Args:
      primitives: which primitives count as sites: None for the compute ops of
        `peat_jax._src._interpreter.SITE_PRIMITIVES` (contractions, reductions, transcendental ops,
        kernels), an iterable of names, or "all" for every non-container equation. Site indices
        depend on it: use the same value for `substitute`.
      regions: Flax module classes (e.g. `nn.LayerNorm`, `nn.MultiHeadDotProductAttention`) whose
        calls become composite sites (see `peat.flax_regions`), and dotted names of library
        functions (`"jax.nn.dot_product_attention"`, `"optax.softmax_cross_entropy"`) whose calls
        become composite sites named by them (see `peat.intercept`, which also makes them sites
        for any trace inside it). Regions marked with `peat.region` are always sites.

    Returns:
      A list of `Site`, `site.index == position`.
    """
    return list(Tracer(fn, primitives=primitives, regions=regions).trace(args, kwargs).sites)


# --------------------------------------------------------------------------------------------
# Selectors

def _path_matches(path: str, pattern: str) -> bool:
    segs = path.split("/") if path else [""]
    for i in range(len(segs)):
        tail = "/".join(segs[i:])
        if fnmatch.fnmatchcase(tail, pattern):
            return True
        if pattern.endswith("/*") and fnmatch.fnmatchcase(tail, pattern[:-2]):
            return True
        if pattern.endswith("/*") and fnmatch.fnmatchcase(tail, pattern[:-2] + "/*"):
            return True
    return False


def _split_phase(pattern: str) -> tuple[Optional[str], str]:
    for phase in ("fwd", "bwd"):
        if pattern.startswith(phase + ":"):
            return phase, pattern[len(phase) + 1:]
    return None, pattern


def _select_str(sites: Sequence[Site], selector: str) -> list[Site]:
    phase, pattern = _split_phase(selector)
    pool = [s for s in sites if phase is None or s.phase == phase]
    if pattern in ("", "*"):
        return pool
    by_name = [s for s in pool if s.primitive == pattern]
    if by_name:  # a primitive or region name wins over a path component of the same spelling
        return by_name
    if "." in pattern and not any(c in pattern for c in "/*?["):
        # a Flax module class by its dotted name ("flax.linen.LayerNorm", as intercepted): its
        # region sites are named by the class ("LayerNorm")
        cls = pattern.rsplit(".", 1)[1]
        return [s for s in pool if s.composite and s.primitive == cls]
    return [s for s in pool if _path_matches(s.path, pattern)]


def _select_one(sites: Sequence[Site], selector: Any) -> list[Site]:
    if isinstance(selector, (bool, np.bool_)):
        raise PeatError(f"a site selector cannot be a bool ({selector!r}); use an index, a name, "
                        "a path pattern or a predicate")
    if isinstance(selector, (int, np.integer)):
        return [s for s in sites if s.index == int(selector)]
    if isinstance(selector, str):
        return _select_str(sites, selector)
    if callable(selector):
        return [s for s in sites if selector(s)]
    raise PeatError(f"unsupported site selector {selector!r} of type {type(selector).__name__}: "
                    "use an int index, a primitive or region name, a path pattern like "
                    "'Dense_0/*' (optionally prefixed 'fwd:' or 'bwd:'), a predicate over "
                    "peat.Site, or a list of these")


def select(sites: Sequence[Site], selector: Selector) -> list[Site]:
    """The sites that `selector` picks, in index order; a PeatError listing what exists if none.

    A selector is an int (site index), a str (a primitive or region name such as `"dot_general"`,
    or else a module path pattern such as `"Dense_0/*"` matched against the path and its
    suffixes; prefix `"fwd:"` or `"bwd:"` to restrict the phase), a predicate `Site -> bool`, or
    a list/tuple of selectors (their union).
    """
    if isinstance(selector, (list, tuple, set, frozenset)):
        picked: dict[int, Site] = {}
        for sub in selector:
            for s in select(sites, sub):
                picked[s.index] = s
        return [picked[i] for i in sorted(picked)]
    if isinstance(selector, (int, np.integer)) and not isinstance(selector, bool):
        if not 0 <= int(selector) < len(sites):
            raise PeatError(f"site index {int(selector)} is out of range: this program has "
                            f"{len(sites)} sites (0..{len(sites) - 1}). {summarize(sites)}")
    out = _select_one(sites, selector)
    if not out:
        raise PeatError(f"selector {_describe_selector(selector)} matches no site. "
                        f"{summarize(sites)}{_intercept_hint(selector)}")
    return out


def _intercept_hint(selector) -> str:
    """For a selector that looks like a library function's dotted name: how to make it one."""
    if not isinstance(selector, str):
        return ""
    name = _split_phase(selector)[1]
    if "." not in name or "/" in name or "*" in name:
        return ""
    return (f" A library function is a site only while intercepted: pass regions=({name!r},) "
            f"or trace inside peat.intercept({name!r}) (peat ... --intercept {name}).")


def _describe_selector(selector) -> str:
    if callable(selector) and not isinstance(selector, str):
        return getattr(selector, "__name__", "predicate")
    return repr(selector)


def summarize(sites: Sequence[Site], max_paths: int = 12) -> str:
    """One paragraph naming what sites exist: counts per primitive and phase, and some paths."""
    if not sites:
        return "The program has no sites."
    counts = collections.Counter((s.primitive, s.phase) for s in sites)
    kinds = ", ".join(f"{p} ({ph}) x{n}" for (p, ph), n in sorted(counts.items()))
    paths = sorted({s.path for s in sites if s.path})
    shown = ", ".join(paths[:max_paths]) + (" ..." if len(paths) > max_paths else "")
    return f"Sites that exist: {kinds}. Paths: {shown or '<none>'}."


REDUCING_PRIMITIVES = ("dot_general", "reduce_sum", "conv_general_dilated")
"""The primitives `reduction_length` reads."""


def reduction_length(site: Site) -> Optional[int]:
    """Elements one output element of `site` sums (a matmul's K, a reduction's extent, a
    convolution's window times its input features); None for an op that sums nothing or is
    not one of `REDUCING_PRIMITIVES`."""
    p, shapes = site.params, site.in_shapes
    if site.primitive == "dot_general":
        (lhs_contracting, _), _ = p["dimension_numbers"]
        k = math.prod(shapes[0][d] for d in lhs_contracting)
    elif site.primitive == "reduce_sum":
        k = math.prod(shapes[0][a] for a in p["axes"])
    elif site.primitive == "conv_general_dilated":
        rhs, out_feature = shapes[1], p["dimension_numbers"].rhs_spec[0]
        k = math.prod(rhs) // max(rhs[out_feature], 1)
    else:
        return None
    return int(k) or None


def format_sites(sites: Sequence[Site]) -> str:
    """A plain-text table of sites, one per line."""
    return "\n".join(str(s) for s in sites)
