"""The public face: what `peat_jax` and its namespaces export, and the `Candidate` protocol."""
import importlib
import inspect
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

import peat_jax as peat

NAMESPACES = ["peat_jax", "peat_jax.kernels", "peat_jax.faults", "peat_jax.testing",
              "peat_jax.report"]


@pytest.mark.parametrize("name", NAMESPACES)
def test_every_exported_name_exists_and_comes_from_the_house(name):
    mod = importlib.import_module(name)
    assert mod.__all__ == sorted(mod.__all__, key=lambda s: (s[0].islower(), s))
    for attr in mod.__all__:
        obj = getattr(mod, attr)   # AttributeError names a stale export
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert obj.__module__.startswith("peat_jax._src."), (attr, obj.__module__)
        elif inspect.ismodule(obj):
            assert obj.__name__.startswith("peat_jax"), attr


def test_the_package_holds_only_its_faces_beside_the_house():
    package = pathlib.Path(peat.__file__).parent
    public = sorted(p.name for p in package.iterdir()
                    if p.name != "__pycache__" and not p.name.startswith("_src"))
    assert public == ["__init__.py", "__main__.py", "faults.py", "kernels.py", "report.py",
                      "testing.py"]


def _site(dtype) -> peat.Site:
    return peat.Site(index=3, primitive="dot_general", path="m", phase="fwd",
                     in_shapes=((2, 2), (2, 2)), in_dtypes=(np.dtype(dtype),) * 2,
                     out_shapes=((2, 2),), out_dtypes=(np.dtype(dtype),))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_kernels_and_faults_are_candidates_that_say_where_they_stand(dtype):
    kernel, fault = peat.kernels.pallas_matmul(), peat.faults.wrong_scale(2.0)
    assert isinstance(kernel, peat.Candidate) and isinstance(fault, peat.Candidate)
    assert not isinstance(lambda x: x, peat.Candidate)
    assert fault.check_site(_site(dtype)) is None
    softmax = peat.Kernel("k", lambda x: x, primitive="softmax")
    assert "serves 'softmax' sites" in softmax.check_site(_site(dtype))


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
def test_a_fault_refuses_a_site_without_a_float_output(dtype):
    reason = peat.faults.wrong_scale(2.0).check_site(_site(dtype))
    assert reason is not None and "is not floating" in reason
