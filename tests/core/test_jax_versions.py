"""The jax releases peat_jax supports: one module owns the internals, layouts it does not know are
clear errors, an untested release warns once, and the container equations of this release are
read and rebuilt bitwise."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import peat_jax as peat
from peat_jax._src import _jax

PACKAGE = pathlib.Path(peat.__file__).resolve().parent


def test_no_module_but_one_touches_jax_internals():
    pattern = re.compile(r"\bjax\._src\b|from jax import _src|\bjax\.core\.|import jax\.core")
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "_src" / "_jax.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if pattern.search(code) and not code.lstrip().startswith(("'", '"', "`")):
                offenders.append(f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}")
    assert not offenders, "jax internals outside peat_jax/_src/_jax.py:\n" + "\n".join(offenders)


def _eqn(primitive: str, **params):
    return types.SimpleNamespace(primitive=types.SimpleNamespace(name=primitive), params=params)


@pytest.mark.parametrize("accessor, primitive, params", [
    (_jax.scan_layout, "scan", {"jaxpr": None, "length": 3, "reverse": False}),
    (_jax.while_layout, "while", {"body_jaxpr": None}),
    (_jax.remat_layout, "checkpoint", {"policy": None}),
    (_jax.cond_branches, "cond", {"index": 0}),
    (_jax.shard_map_layout, "shard_map", {"mesh": None, "in_specs": ()}),
])
def test_an_unknown_equation_layout_is_a_clear_error(accessor, primitive, params):
    with pytest.raises(peat.PeatError) as e:
        accessor(_eqn(primitive, **params))
    msg = str(e.value)
    assert f"`{primitive}`" in msg and jax.__version__ in msg
    assert _jax.TESTED_RANGE[0] in msg and _jax.TESTED_RANGE[1] in msg


def test_scan_layout_is_read_on_this_release():
    def f(c, xs, w):
        return lax.scan(lambda c, x: (jnp.tanh(c * w + x), c.sum()), c, xs)

    closed = jax.make_jaxpr(f)(jnp.ones(3), jnp.ones((5, 3)), 2.0)
    (eqn,) = [e for e in _jax.jaxpr_body(closed).eqns if e.primitive.name == "scan"]
    lay = _jax.scan_layout(eqn)
    assert (lay.num_carry, lay.length, lay.reverse) == (1, 5, False)
    assert lay.num_consts + lay.num_carry + 1 == len(eqn.invars)


@pytest.mark.parametrize("version, tested", [
    ("0.10.2", True), ("0.11.2", True), ("0.12.0.1", True), ("0.10.1", False),
    ("0.13.0", False), ("0.9.2", False), ("0.12.0.dev20261101", True),
])
def test_tested_range(version, tested):
    assert _jax.is_tested_version(version) is tested


def test_an_untested_jax_warns_once_at_import_and_works():
    code = (
        "import warnings, jax, jax.numpy as jnp\n"
        "jax.__version__ = '0.99.0'\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import peat_jax as peat\n"
        "    import peat_jax._src.sites\n"
        "msgs = [str(x.message) for x in w if 'tested with jax' in str(x.message)]\n"
        "print(len(msgs)); print(msgs[0])\n"
        "print(len(peat.list_sites(lambda x: jnp.tanh(x) @ x, jnp.ones((2, 2)))))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    count, msg, sites = r.stdout.splitlines()[:3]
    assert count == "1" and "0.99.0" in msg and ">=0.10.2,<0.13" in msg
    assert sites == "2"


@pytest.mark.parametrize("selector", ["dot_general", "tanh"])
def test_substitution_inside_scan_cond_while_remat_matches_the_program_bitwise(selector):
    """Every container is rebuilt on this release: with an identity-like fault (scale 1.0) the
    re-evaluated program equals the original bit for bit."""
    w = jnp.linspace(-0.5, 0.5, 16).reshape(4, 4)

    def f(w, x):
        c, ys = lax.scan(lambda c, xi: (jnp.tanh(c @ w) + xi, c.sum()), x, jnp.ones((3, 2, 4)))
        c = jax.checkpoint(lambda c: jnp.tanh(c @ w))(c)
        c = lax.cond(c.sum() > 0, lambda c: jnp.tanh(c @ w), lambda c: c, c)
        c = lax.while_loop(lambda s: s[0] < 2, lambda s: (s[0] + 1, jnp.tanh(s[1] @ w)), (0, c))[1]
        return jnp.sum(c) * ys.sum()

    x = jnp.ones((2, 4)) * 0.3
    sub = peat.substitute(f, {selector: peat.faults.wrong_scale(1.0)})
    containers = {c for s in sub.selected(w, x) for c in s.scope}
    assert {"scan", "cond", "while"} <= containers and len(sub.selected(w, x)) >= 4
    np.testing.assert_array_equal(jax.jit(sub)(w, x), jax.jit(f)(w, x))
    doubled = peat.substitute(f, {selector: peat.faults.wrong_scale(2.0)})
    assert float(jax.jit(doubled)(w, x)) != float(jax.jit(f)(w, x))
