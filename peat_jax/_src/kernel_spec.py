"""What `peat check` is given, as Python objects: kernels and references named on the command
line, operand shapes and dtypes, the kwargs (or example arguments) of `--config`, and example
arguments drawn deterministically from a seed.

Every user error is a `PeatError` with a one-line message saying what was wrong and what to do.
Nothing here runs a check: the CLI hands what these functions return to `peat.check_kernel`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import json
import pathlib
import sys
import types
from typing import Any, Callable, Optional, Sequence

import numpy as np

from peat_jax._src.errors import PeatError
from peat_jax._src.formats import is_floating
from peat_jax._src.kernels import Kernel


SPEC_FORMS = ("module.path:NAME, path/to/file.py:NAME or a dotted name such as jax.nn.softmax")
"""How a kernel, a reference or a `--config` spec may be named (for messages)."""

DTYPES: dict[str, str] = {
    "float32": "float32", "f32": "float32", "fp32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "f16": "float16", "fp16": "float16", "half": "float16",
    "int32": "int32", "i32": "int32", "int16": "int16", "int8": "int8",
    "uint32": "uint32", "uint16": "uint16", "uint8": "uint8",
    "bool": "bool",
}
"""Operand dtype names `parse_dtypes` accepts (and short aliases) -> numpy/ml_dtypes name.
float64 and int64 are left out: jax without `jax_enable_x64` would narrow them silently."""

DEFAULT_INT_BOUND = 8
"""Integer operands are drawn from [0, this) when no float operand has a last axis."""


# --------------------------------------------------------------------------------------------
# Names -> objects

_FILES: dict[pathlib.Path, types.ModuleType] = {}   # module files loaded by path, by real path


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _import(mod: str, what: str, spec: str) -> types.ModuleType:
    try:
        return importlib.import_module(mod)
    except ImportError as e:
        raise PeatError(f"cannot import module {mod!r} for {what} {spec!r}: {_first_line(e)}; "
                        "check the name, and that its directory is on PYTHONPATH") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing
        raise PeatError(f"importing module {mod!r} for {what} {spec!r} raised "
                        f"{_first_line(e)}; fix the module or name another") from None


def _load_file(path_text: str, what: str, spec: str) -> types.ModuleType:
    path = pathlib.Path(path_text).expanduser()
    if not path.is_file():
        raise PeatError(f"no such file {path_text!r} for {what} {spec!r}; give an existing "
                        "path/to/file.py:NAME")
    real = path.resolve()
    if real in _FILES:
        return _FILES[real]
    digest = hashlib.sha1(str(real).encode()).hexdigest()[:10]
    name = f"_peat_file_{real.stem}_{digest}"
    loader_spec = importlib.util.spec_from_file_location(name, real)
    if loader_spec is None or loader_spec.loader is None:  # a .py name linked to another file
        raise PeatError(f"cannot load {path_text!r} for {what} {spec!r} as a Python module; "
                        "give a path/to/file.py:NAME")
    module = importlib.util.module_from_spec(loader_spec)
    # its directory on the path, as `python file.py` would have it: sibling imports work
    if str(real.parent) not in sys.path:
        sys.path.insert(0, str(real.parent))
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001 - SyntaxError, SystemExit, anything at import
        del sys.modules[name]
        if isinstance(e, KeyboardInterrupt):
            raise
        raise PeatError(f"loading {path_text!r} for {what} {spec!r} raised {_first_line(e)}; fix "
                        "the file or name another") from None
    _FILES[real] = module
    return module


def _attrs(obj: Any, attr: str, owner: str, what: str, spec: str) -> Any:
    for part in attr.split("."):
        if not part or not hasattr(obj, part):
            raise PeatError(f"module {owner!r} has no attribute {attr!r} (from {what} {spec!r}); "
                            "check the spelling")
        obj = getattr(obj, part)
    return obj


def _dotted(spec: str, what: str) -> Any:
    parts = spec.split(".")
    if not all(p.isidentifier() for p in parts):
        raise PeatError(f"{what} {spec!r} is not a dotted name; give {SPEC_FORMS}")
    obj = _import(parts[0], what, spec)
    for i, part in enumerate(parts[1:], start=1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        prefix = ".".join(parts[:i + 1])
        if not isinstance(obj, types.ModuleType):
            raise PeatError(f"{'.'.join(parts[:i])!r} has no attribute {part!r} (from {what} "
                            f"{spec!r}); check the spelling")
        try:
            obj = importlib.import_module(prefix)
        except ModuleNotFoundError as e:
            if e.name is not None and prefix.startswith(e.name):
                raise PeatError(f"module {'.'.join(parts[:i])!r} has no attribute {part!r} "
                                f"(from {what} {spec!r}); check the spelling") from None
            raise PeatError(f"cannot import module {prefix!r} for {what} {spec!r}: "
                            f"{_first_line(e)}") from None
        except Exception as e:  # noqa: BLE001
            raise PeatError(f"importing module {prefix!r} for {what} {spec!r} raised "
                            f"{_first_line(e)}") from None
    return obj


def load(spec: str, what: str = "kernel") -> Any:
    """The object that `spec` names, imported or loaded on demand.

    `spec` is one of: ``"module.path:NAME"`` (NAME may be dotted: ``"mod:Class.method"``),
    ``"path/to/file.py:NAME"`` (the file is executed once per process as a module of its own,
    its directory put on `sys.path` so that its sibling imports work), or a dotted name such as
    ``"jax.nn.softmax"`` or ``"optax.softmax_cross_entropy_with_integer_labels"``. `what` names
    the role in messages ("kernel", "reference", "--config").

    Returns:
      The named object, as it is (see `as_function` for turning it into the function to check).

    Raises:
      PeatError: a malformed name, a module that does not import, a missing file or attribute.
    """
    spec = (spec or "").strip()
    if not spec:
        raise PeatError(f"empty {what}: give {SPEC_FORMS}")
    head, sep, attr = spec.rpartition(":")
    if sep and head.endswith(".py"):
        if not attr:
            raise PeatError(f"{what} {spec!r}: name the function after the colon, "
                            "path/to/file.py:NAME")
        return _attrs(_load_file(head, what, spec), attr, head, what, spec)
    if spec.endswith(".py"):
        raise PeatError(f"{what} {spec!r}: name the function in the file, {spec}:NAME")
    if ":" in spec:
        mod, _, attr = spec.partition(":")
        if not mod or not attr:
            raise PeatError(f"{what} {spec!r} must be module.path:NAME")
        return _attrs(_import(mod, what, spec), attr, mod, what, spec)
    if "." in spec:
        return _dotted(spec, what)
    raise PeatError(f"{what} {spec!r} is not a name peat can load; give {SPEC_FORMS}")


def _no_parameters(fn: Callable) -> bool:
    try:
        return not inspect.signature(fn).parameters
    except (TypeError, ValueError):   # builtins and C functions without a signature
        return False


def as_function(obj: Any, spec: str, what: str = "kernel") -> Callable:
    """`obj` (what `load(spec)` returned) as the function to check: a `peat.Kernel` or any other
    callable as it is; a factory taking no arguments at all is called once and must return one.

    Returns:
      A callable taking the operands (and the `--config` kwargs).

    Raises:
      PeatError: `obj` is a module or not callable, or the factory raises or returns a
        non-callable.
    """
    if isinstance(obj, Kernel):
        return obj
    if isinstance(obj, types.ModuleType):
        raise PeatError(f"{what} {spec!r} is a module; name a function in it, e.g. "
                        f"{spec}:NAME or {spec}.NAME")
    if not callable(obj):
        raise PeatError(f"{what} {spec!r} is a {type(obj).__name__}, not a function or a "
                        "peat.Kernel")
    if isinstance(obj, type) or not _no_parameters(obj):
        return obj
    try:
        made = obj()
    except Exception as e:  # noqa: BLE001 - the user's factory
        raise PeatError(f"{what} {spec!r} takes no arguments, so it was called as a factory, "
                        f"and raised {_first_line(e)}") from None
    if not callable(made):
        raise PeatError(f"{what} {spec!r} takes no arguments, so it was called as a factory, "
                        f"and returned a {type(made).__name__}, not a function or peat.Kernel")
    return made


# --------------------------------------------------------------------------------------------
# Shapes, dtypes, variants

def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """Operand shapes from text like ``"64x32,32x16"``: one shape per operand, dimensions
    separated by ``x``; ``()`` or ``scalar`` for a scalar; ``45`` for a vector.

    Returns:
      One tuple of ints per operand, in order.

    Raises:
      PeatError: an empty list, a non-integer dimension or one below 1.
    """
    shapes: list[tuple[int, ...]] = []
    try:
        for part in text.split(","):
            part = part.strip().lower()
            if not part:
                continue
            if part in ("()", "scalar"):
                shapes.append(())
            else:
                shapes.append(tuple(int(d) for d in part.split("x")))
    except ValueError:
        raise PeatError(f"--shapes must look like 64x32,32x16 (one shape per operand; () or "
                        f"scalar for a scalar), got {text!r}") from None
    if not shapes or any(d < 1 for s in shapes for d in s):
        raise PeatError(f"--shapes needs at least one shape, every dimension >= 1 (like "
                        f"64x32,32x16), got {text!r}")
    return shapes


def parse_dtypes(text: Optional[str], n: int) -> list[np.dtype]:
    """Operand dtypes from text like ``"float32"`` (one for all `n` operands) or
    ``"float32,int32"`` (one per operand); None is float32 for all. Names: the keys of
    `DTYPES`.

    Returns:
      `n` numpy dtypes (bfloat16 as ml_dtypes').

    Raises:
      PeatError: an unknown name, or a count that is neither 1 nor `n`.
    """
    import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy's dtype names
    names = [p.strip().lower() for p in (text or "float32").split(",") if p.strip()]
    bad = [p for p in names if p not in DTYPES]
    if bad or not names:
        raise PeatError(f"unknown dtype {bad[0] if bad else text!r} in --dtypes; give one of "
                        f"{', '.join(sorted(set(DTYPES.values())))} for all operands or one per "
                        "operand, comma-separated")
    if len(names) not in (1, n):
        raise PeatError(f"--dtypes gave {len(names)} dtypes for {n} operand(s) (--shapes): give "
                        "one dtype for all operands or one per operand")
    dts = [np.dtype(ml_dtypes.bfloat16) if DTYPES[p] == "bfloat16" else np.dtype(DTYPES[p])
           for p in names]
    return dts * n if len(dts) == 1 else dts


def parse_variants(text: Optional[str]) -> Optional[list[str]]:
    """Variant names from ``"example,large"`` (None: `check_kernel`'s default, all of them);
    `check_kernel` itself rejects unknown names.

    Returns:
      The names in order, or None.

    Raises:
      PeatError: text naming no variant.
    """
    if text is None:
        return None
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names:
        raise PeatError(f"--variants needs variant names, comma-separated (like example,large), "
                        f"got {text!r}")
    return names


# --------------------------------------------------------------------------------------------
# Example arguments


def int_bound(shapes: Sequence[tuple[int, ...]], dtypes: Sequence[np.dtype]) -> int:
    """The default upper bound K of integer operands, drawn from [0, K): the smallest last-axis
    size of the float operands (the class count of logits, so labels index them), or
    `DEFAULT_INT_BOUND` when no float operand has an axis.

    Returns:
      K >= 1.
    """
    sizes = [s[-1] for s, dt in zip(shapes, dtypes) if s and is_floating(dt)]
    return min(sizes) if sizes else DEFAULT_INT_BOUND


def draw_args(shapes: Sequence[tuple[int, ...]], dtypes: Sequence[np.dtype], seed: int,
              int_high: Optional[int] = None) -> tuple[np.ndarray, ...]:
    """Example arguments drawn on the host from ``numpy.random.default_rng(seed)``, one per
    operand in order: float operands standard normal (drawn in float32, then cast), integer
    operands uniform in [0, `int_high`) (default `int_bound`), bool operands True with
    probability 1/2. The same shapes, dtypes and seed give the same arrays.

    Returns:
      A tuple of NumPy arrays (0-d for a scalar shape), ready for `check_kernel`.

    Raises:
      PeatError: `int_high` below 1, or an integer dtype that cannot hold it.
    """
    if len(shapes) != len(dtypes):
        raise PeatError(f"{len(shapes)} shapes but {len(dtypes)} dtypes")
    high = int_bound(shapes, dtypes) if int_high is None else int(int_high)
    if high < 1:
        raise PeatError(f"--int-bound must be >= 1 (integers are drawn from [0, K)), got {high}")
    rng = np.random.default_rng(seed)
    out = []
    for shape, dt in zip(shapes, dtypes):
        if is_floating(dt):
            x = np.asarray(rng.standard_normal(shape, np.float32)).astype(dt)
        elif dt == np.bool_:
            x = np.asarray(rng.random(shape) < 0.5)
        else:
            if high - 1 > np.iinfo(dt).max:
                raise PeatError(f"--int-bound {high} does not fit {dt.name} operands; give a "
                                "smaller --int-bound or a wider dtype")
            x = np.asarray(rng.integers(0, high, size=shape)).astype(dt)
        out.append(x)
    return tuple(out)


def describe_args(args: Sequence[Any]) -> list[dict[str, Any]]:
    """``[{"shape": [...], "dtype": "..."}]`` for each positional argument with a shape (a
    pytree argument: ``{"pytree": "<type>"}``), for reports.

    Returns:
      One JSON-able dict per argument.
    """
    out = []
    for a in args:
        if hasattr(a, "shape") and hasattr(a, "dtype"):
            out.append({"shape": [int(d) for d in a.shape], "dtype": str(a.dtype)})
        elif isinstance(a, (bool, int, float)):
            out.append({"shape": [], "dtype": type(a).__name__})
        else:
            out.append({"pytree": type(a).__name__})
    return out


# --------------------------------------------------------------------------------------------
# --config

@dataclasses.dataclass(frozen=True)
class Config:
    """What `--config` gave: `kwargs` for both the kernel and the reference, and `args` (the
    example arguments) when a Python spec returned them, else None (drawn from --shapes)."""

    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    args: Optional[tuple] = None
    source: str = ""


def _tuples(v: Any) -> Any:
    """JSON arrays as tuples (jax's static arguments, such as axes, must be hashable)."""
    if isinstance(v, list):
        return tuple(_tuples(x) for x in v)
    if isinstance(v, dict):
        return {k: _tuples(x) for k, x in v.items()}
    return v


def _json_kwargs(text: str, where: str, option: str = "--config") -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise PeatError(f"{option} {where} is not valid JSON ({e.msg} at line {e.lineno} column "
                        f"{e.colno}); write an object such as '{{\"is_causal\": true}}'") from None
    if not isinstance(obj, dict):
        raise PeatError(f"{option} {where} must be a JSON object of keyword arguments, such as "
                        f"'{{\"is_causal\": true}}', got a {type(obj).__name__}")
    return _tuples(obj)


def _kwargs_file(path: pathlib.Path, option: str) -> dict[str, Any]:
    """The keyword arguments in the JSON file `path` that `option` names."""
    try:
        body = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise PeatError(f"cannot read {option} file {str(path)!r}: {_first_line(e)}") from None
    return _json_kwargs(body, f"file {str(path)!r}", option)


def parse_kwargs(text: Optional[str], option: str) -> dict[str, Any]:
    """The keyword arguments that `option` (``--kernel-kwargs`` or ``--reference-kwargs``: one
    side only) gives: inline JSON (an object; arrays become tuples) or the path of a file
    holding it; {} for None.

    Raises:
      PeatError: invalid JSON, not an object, or a file that cannot be read.
    """
    if text is None:
        return {}
    stripped = text.strip()
    if stripped.startswith(("{", "[")):
        return _json_kwargs(stripped, "(inline)", option)
    path = pathlib.Path(stripped).expanduser()
    if not path.is_file():
        raise PeatError(f"{option} {text!r} is neither inline JSON nor a JSON file: give "
                        "'{\"eps\": 1e-5}' or path/to/kwargs.json")
    return _kwargs_file(path, option)


def _wants_seed(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
               or p.name == "seed" for p in params)


def _from_spec(text: str, seed: int) -> Config:
    obj = load(text, "--config")
    if callable(obj):
        try:
            obj = obj(seed) if _wants_seed(obj) else obj()
        except Exception as e:  # noqa: BLE001 - the user's spec
            raise PeatError(f"--config {text!r} raised {_first_line(e)} when called") from None
    want = ("return a tuple of example args, or a dict {\"args\": (...), \"kwargs\": {...}}")
    if isinstance(obj, (tuple, list)):
        return Config(kwargs={}, args=tuple(obj), source=text)
    if not isinstance(obj, dict):
        raise PeatError(f"--config {text!r} gave a {type(obj).__name__}; {want}")
    extra = sorted(set(obj) - {"args", "kwargs"})
    if extra or not obj:
        raise PeatError(f"--config {text!r} gave a dict with keys {sorted(obj)}; {want}")
    args, kwargs = obj.get("args"), obj.get("kwargs", {})
    if args is not None and not isinstance(args, (tuple, list)):
        raise PeatError(f"--config {text!r}: \"args\" is a {type(args).__name__}; {want}")
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise PeatError(f"--config {text!r}: \"kwargs\" must be a dict with str keys; {want}")
    return Config(kwargs=dict(kwargs), args=None if args is None else tuple(args), source=text)


def parse_config(text: Optional[str], seed: int = 0) -> Config:
    """The kwargs (and maybe example args) that `--config` gives.

    `text` is one of: inline JSON (``'{"is_causal": true}'``, an object: keyword arguments;
    JSON arrays become tuples); the path of a file holding such JSON; or a Python spec
    ``MOD:SPEC`` (any `load` form) naming a tuple or dict, or a callable returning one, called
    as ``SPEC(seed)`` when it takes an argument (``SPEC()`` otherwise): a tuple (or list) is the
    example args; a dict has ``"args"`` (the example args; leave it out to draw them from
    --shapes) and/or ``"kwargs"``.

    Returns:
      A `Config`; ``Config()`` (no kwargs, no args) for None.

    Raises:
      PeatError: invalid JSON, a missing file, a spec that does not load, raises, or returns
        something else.
    """
    if text is None:
        return Config()
    stripped = text.strip()
    if stripped.startswith("{"):
        return Config(kwargs=_json_kwargs(stripped, "(inline)"), source="inline JSON")
    path = pathlib.Path(stripped).expanduser()
    if path.is_file() and not stripped.endswith(".py"):
        return Config(kwargs=_kwargs_file(path, "--config"), source=stripped)
    if stripped.endswith(".json"):
        raise PeatError(f"no such --config file {stripped!r}; give an existing JSON file, inline "
                        "JSON or MOD:SPEC")
    if ":" in stripped or "." in stripped:
        return _from_spec(stripped, seed)
    raise PeatError(f"--config {text!r} is neither JSON, a JSON file nor a Python spec: give "
                    "'{\"is_causal\": true}', path/to/config.json or module.path:SPEC")
