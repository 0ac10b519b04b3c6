"""The house's measures (CONTRIBUTING.md, "The house"), read from the sources: no module over 800
lines, no function over 80, no import of another module's private name, no import cycle, jax's
internals touched in `peat_jax._src._jax` only, and a README of at most 150 lines."""
from __future__ import annotations

import ast
import functools
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "peat_jax"
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_README_LINES = 800, 80, 150
JAX_INTERNALS = ("jax._src", "jax.interpreters", "jaxlib")
"""Imports that reach into jax's internals: `peat_jax._src._jax` is their one home."""


def _name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _modules() -> dict[str, pathlib.Path]:
    return {_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


@functools.cache
def _tree(module: str) -> ast.Module:
    return ast.parse(_modules()[module].read_text())


def _imported_from(module: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` statement of `module` names."""
    if not node.level:
        return node.module or ""
    is_package = _modules()[module].name == "__init__.py"
    base = module if is_package else module.rsplit(".", 1)[0]
    for _ in range(node.level - 1):
        base = base.rsplit(".", 1)[0]
    return f"{base}.{node.module}" if node.module else base


def _module_level_imports(module: str):
    """The import statements `module` runs when it is imported (not those inside functions or
    under ``if TYPE_CHECKING``)."""
    def walk(body):
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                yield from walk(node.body + node.orelse)
            elif isinstance(node, ast.Try):
                yield from walk(node.body + node.orelse + node.finalbody
                                + [n for h in node.handlers for n in h.body])
    return list(walk(_tree(module).body))


def _dependencies(module: str) -> set[str]:
    """The package's modules that importing `module` imports first: each one it names and the
    packages above those (not its own)."""
    modules, named = _modules(), set()
    for node in _module_level_imports(module):
        if isinstance(node, ast.Import):
            named |= {a.name for a in node.names}
        else:
            base = _imported_from(module, node)
            named |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                      for a in node.names}
    deps = set()
    for target in named & modules.keys():
        parts = target.split(".")
        deps |= {".".join(parts[:i]) for i in range(1, len(parts))
                 if not module.startswith(".".join(parts[:i]) + ".")}
        deps.add(target)
    return (deps & modules.keys()) - {module}


def test_no_module_is_over_800_lines():
    long = {m: n for m, p in _modules().items()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them): {long}"


def test_no_function_is_over_80_lines():
    long = [f"{m}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
            for m in _modules() for node in ast.walk(_tree(m))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_no_module_imports_another_modules_private_name():
    """``from peat_jax.x import _y`` only where ``_y`` is a module (`_jax`, `_src`): another
    module's private function or constant is promoted or moved, not reached into."""
    modules = _modules()
    bad = [f"{m}: from {base} import {a.name}"
           for m in modules for node in ast.walk(_tree(m)) if isinstance(node, ast.ImportFrom)
           if (base := _imported_from(m, node)).startswith("peat_jax")
           for a in node.names
           if a.name.startswith("_") and not a.name.startswith("__")
           and f"{base}.{a.name}" not in modules]
    assert not bad, "imports of another module's private name:\n" + "\n".join(bad)


def test_the_package_has_no_import_cycle():
    graph = {m: _dependencies(m) for m in _modules()}
    state: dict[str, int] = {}   # 1: on the current path, 2: done

    def cycle_from(m, path):
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:               # on the current path: a cycle
                return (path + [m])[(path + [m]).index(d):] + [d]
            if d not in state and (found := cycle_from(d, path + [m])):
                return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := cycle_from(m, [])):
            raise AssertionError("import cycle: " + " -> ".join(found))


def test_jax_internals_are_touched_in_one_module():
    home = "peat_jax._src._jax"
    bad = []
    for m in _modules():
        for node in ast.walk(_tree(m)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            bad += [f"{m}: {n}" for n in names if m != home and n.startswith(JAX_INTERNALS)]
    assert not bad, f"jax internals imported outside {home}:\n" + "\n".join(bad)


def test_the_readme_is_a_front_door():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines: the reference goes in docs/"
