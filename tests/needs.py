"""What a test needs that a leg may lack: one home for the reason a test is skipped."""
from __future__ import annotations

import importlib.util
from typing import Iterable, Optional

import jax
import pytest

# jax's Triton Pallas ops (`jax.experimental.pallas.ops.gpu.{attention,layer_norm,rms_norm,
# softmax}`), deprecated in 0.11 in favour of tokamax, are gone from jax 0.12.1
PALLAS_OPS = "jax.experimental.pallas.ops.gpu"
_WHY = {
    "torch": "the test extra brings it on Python 3.11 only (elsewhere it is a multi-GB CUDA "
             "download); pip install -e '.[torch]'",
    "rotary_embedding_torch": "the test extra brings it on Python 3.11 only",
    PALLAS_OPS: f"jax {jax.__version__} does not ship its Triton Pallas ops: 0.12.1 dropped "
                "them for tokamax",
}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def missing(modules: Iterable[str]) -> Optional[str]:
    """Why a test cannot run here (a module it needs is not installed), or None."""
    for mod in modules:
        if not _installed(mod):
            why = next((w for pkg, w in _WHY.items()
                        if mod == pkg or mod.startswith(pkg + ".")), None)
            return f"{mod} is not installed: {why or 'pip install -e .[test]'}"
    return None


def skip_unless(*modules: str):
    """A pytest mark: skip, saying why, where one of `modules` is not installed."""
    why = missing(modules)
    return pytest.mark.skipif(why is not None, reason=why or "")


def pallas_op(name: str) -> str:
    """The module of jax's shipped Pallas GPU op `name` (`"attention"`, `"layer_norm"`...)."""
    return f"{PALLAS_OPS}.{name}"
