"""What the commands read from argv: bundled kernel and workload names, `module:attribute`
specs, faults, selectors, schedules."""
from __future__ import annotations

import ast
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import peat_jax as peat
import peat_jax.models as models
from peat_jax._src import kernel_spec, regions
from peat_jax._src.errors import PeatError

# Bundled kernels by name: factory, and the primitive or region its reference lowers to.
KERNELS: dict[str, Callable[[], "peat.Kernel"]] = {
    "pallas_matmul": lambda: peat.kernels.pallas_matmul(),
    "blocked_matmul": lambda: peat.kernels.blocked_matmul(),
    "xla_matmul": lambda: peat.kernels.xla_matmul(),
    "ffi_matmul": lambda: peat.kernels.ffi_matmul(),
    "ffi_matmul_tile_bug": lambda: peat.kernels.ffi_matmul(tile_bug=True),  # fails: tile_boundary
}


# Bundled region kernels that `peat check` runs against their XLA references: factory,
# reference, default operand shapes.
REGION_KERNELS: dict[str, tuple[Callable[[], "peat.Kernel"], Callable, str]] = {
    "pallas_softmax": (lambda: peat.kernels.pallas_softmax(), peat.kernels.references.softmax,
                       "67x45"),
    "pallas_layer_norm": (lambda: peat.kernels.pallas_layer_norm(),
                          peat.kernels.references.layer_norm, "67x45,45,45"),
    "pallas_attention": (lambda: peat.kernels.pallas_attention(),
                         peat.kernels.references.attention, "2x40x2x16,2x40x2x16,2x40x2x16"),
}


def load_attr(spec: str, what: str) -> Any:
    """The object `spec` names (module.path:NAME, path/to/file.py:NAME or a dotted name; see
    `kernel_spec.load`), for a `what` that is not a bundled name."""
    if ":" not in spec and "." not in spec:
        raise PeatError(f"{what} {spec!r} is neither a bundled name nor one of "
                        f"{kernel_spec.SPEC_FORMS}")
    return kernel_spec.load(spec, what)


def named_workload(target: str) -> peat.Workload:
    if target in models.available():
        return models.get(target)
    obj = load_attr(target, "workload")
    if callable(obj) and not isinstance(obj, peat.Workload):
        obj = obj()
    if not isinstance(obj, peat.Workload):
        raise PeatError(f"{target!r} is not a peat.Workload (got {type(obj).__name__}); bundled "
                        f"workloads: {', '.join(models.available())}")
    return obj


def named_kernel(spec: str) -> peat.Kernel:
    if spec in KERNELS:
        return KERNELS[spec]()
    if ":" not in spec and "." not in spec:
        raise PeatError(f"unknown kernel {spec!r}; bundled kernels: {', '.join(KERNELS)}, or give "
                        f"{kernel_spec.SPEC_FORMS}")
    obj = load_attr(spec, "kernel")
    obj = kernel_spec.as_function(obj, spec)    # a factory taking no arguments is called
    if not isinstance(obj, peat.Kernel):
        raise PeatError(f"{spec!r} is not a peat.Kernel (got {type(obj).__name__})")
    return obj


def parse_fault(spec: str) -> peat.Fault:
    """A fault from text such as "bit_flip(bit=30, index=0)" (literal arguments only)."""
    try:
        tree = ast.parse(spec.strip(), mode="eval").body
    except SyntaxError:
        raise PeatError(f"cannot parse fault {spec!r}; write e.g. \"bit_flip(bit=30)\"") from None
    if isinstance(tree, ast.Name):
        tree = ast.Call(func=tree, args=[], keywords=[])
    if not (isinstance(tree, ast.Call) and isinstance(tree.func, ast.Name)):
        raise PeatError(f"fault {spec!r} must be a call like \"wrong_scale(2.0)\"")
    name = tree.func.id
    if name not in peat.faults.ALL:
        raise PeatError(f"unknown fault {name!r}; faults: {', '.join(peat.faults.ALL)}")
    if any(k.arg is None for k in tree.keywords):
        raise PeatError(f"fault {spec!r}: name each keyword argument (no **)")
    try:
        args = [ast.literal_eval(a) for a in tree.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in tree.keywords if k.arg is not None}
    except ValueError:
        raise PeatError(f"fault {spec!r}: arguments must be literals (numbers, strings, "
                        "tuples)") from None
    try:
        return getattr(peat.faults, name)(*args, **kwargs)
    except TypeError as e:
        raise PeatError(f"fault {spec!r}: {e}") from None


def candidate_of(args) -> Any:
    if bool(args.kernel) == bool(args.fault):
        raise PeatError("give exactly one of --kernel and --fault")
    return named_kernel(args.kernel) if args.kernel else parse_fault(args.fault)


def default_sites(cand) -> str:
    """The selector a candidate goes to without --sites: a kernel's own region
    (`flax.linen.LayerNorm`) or primitive (`jax.nn.dot_product_attention` for a kernel of that
    function), else dot_general."""
    return getattr(cand, "region", None) or getattr(cand, "primitive", None) or "dot_general"


def function_names(selector) -> list[str]:
    """The dotted library-function names in a selector (`fwd:` / `bwd:` stripped): those that
    resolve to a function or a Flax module class (a path pattern is left alone)."""
    parts = selector if isinstance(selector, list) else [selector]
    names = []
    for p in parts:
        if not isinstance(p, str):
            continue
        name = p.split(":", 1)[1] if p.startswith(("fwd:", "bwd:")) else p
        if "." in name and not any(c in name for c in "/*?["):
            try:
                regions.resolve_name(name)
            except PeatError:
                continue
            names.append(name)
    return names


def intercepted(args, cand=None, selector=None) -> list[str]:
    """The library functions a command intercepts while it traces (`peat.intercept`): those
    of --intercept, the kernel's own when it serves one (its primitive is a dotted name), and
    those the selector names."""
    names = [n.strip() for text in (getattr(args, "intercept", None) or [])
             for n in text.split(",") if n.strip()]
    for own in (getattr(cand, "region", None), getattr(cand, "primitive", None)):
        if isinstance(cand, peat.Kernel) and isinstance(own, str) and "." in own:
            names.append(own)
    if selector is not None:
        names += function_names(selector)
    return list(dict.fromkeys(names))


def selector_of(text: Optional[str], default: str):
    if text is None:
        return default
    parts = [p.strip() for p in text.split(",") if p.strip()]
    sel = [int(p) if p.lstrip("-").isdigit() else p for p in parts]
    return sel[0] if len(sel) == 1 else sel


def int_list(text: Optional[str], what: str) -> Optional[list[int]]:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PeatError(f"{what} must be comma-separated integers, got {text!r}") from None


def schedule_of(args) -> peat.Schedule:
    given = [x is not None for x in (args.every, args.at_steps, args.probability)]
    if sum(given) != 1:
        raise PeatError("give exactly one schedule: --every N, --at-steps S,... or --probability P")
    if args.every is not None:
        return peat.every(args.every, args.offset)
    if args.at_steps is not None:
        steps = int_list(args.at_steps, "--at-steps")
        assert steps is not None  # args.at_steps is not None
        return peat.at_steps(steps)
    return peat.with_probability(args.probability, seed=args.seed)


def batch_at(wl, step: int):
    return jax.tree.map(jnp.asarray, wl.batch(step))
