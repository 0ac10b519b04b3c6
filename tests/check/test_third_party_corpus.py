"""The third-party corpus (tests/third_party: code nobody here wrote, from public packages): every
correct kernel passes `peat.check_kernel` on every seed 0..4, and every porting bug fails on every
seed, with its error model where the taxonomy has one."""
from __future__ import annotations

import pathlib
import re
import tomllib

import jax.numpy as jnp
import numpy as np
import pytest

from peat_jax._src.check import VARIANTS
import third_party
from third_party import ENTRIES, SEEDS
from peat_jax._src import taxonomy

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _param(e):
    why = third_party.missing(e)
    return pytest.param(e, id=e.name, marks=[pytest.mark.slow] + (
        [pytest.mark.skip(reason=why)] if why else []) + (
        [pytest.mark.xfail(strict=True, reason=f"known gap: {e.gap}")]
        if e.gap and not e.gap_seeds else []))


@pytest.mark.parametrize("entry", [_param(e) for e in ENTRIES])
def test_entry_gives_its_expected_verdict_on_every_seed(entry):
    seeds = [s for s in SEEDS if s not in entry.gap_seeds]
    verdicts = {seed: third_party.check(entry, seed) for seed in seeds}
    wrong = {seed: d for seed, d in verdicts.items() if not third_party.expectation_met(entry, d)}
    if entry.gap_seeds:   # a known gap on these seeds: reported, not asserted
        print(f"{entry.name}: seeds {entry.gap_seeds} not asserted (known gap: {entry.gap})")
    expected = entry.expected if isinstance(entry.expected, str) else " or ".join(entry.expected)
    assert not wrong, f"{entry.name} ({entry.package}), expected {expected}:\n" + "\n".join(
        f"  seed {seed}: {d.summary}" for seed, d in wrong.items())


def test_the_corpus_is_what_the_issue_asks_for():
    names = [e.name for e in ENTRIES]
    assert len(names) == len(set(names))
    assert {e.kind for e in ENTRIES} == {"bug", "correct"}
    correct = [e for e in ENTRIES if e.kind == "correct"]
    assert len(correct) >= 12
    assert all(e.expected == "passes" for e in correct)
    packages = {e.package for e in ENTRIES}
    assert len(packages) >= 3, packages
    for e in ENTRIES:
        if e.kind == "bug":
            assert e.expected == "fails" or (isinstance(e.expected, tuple) and e.expected), e
            assert all(m in taxonomy.MODELS and m not in taxonomy.PASSING
                       for m in e.models or ()), e
        assert set(e.variants) <= set(VARIANTS), e
    wanted = {"faj_flash_attention",           # an lse-based attention backward
              "optax_ce_integer_labels",       # a fused cross-entropy
              "torch_sdpa_causal",             # PyTorch's SDPA
              "jax_pallas_mha_causal"}         # jax's shipped Pallas mha
    assert wanted <= set(names)


def test_every_third_party_package_is_pinned_in_the_test_extra():
    """Each package is a dependency of the project or pinned (==) in the `test` extra."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = meta["dependencies"] + meta["optional-dependencies"]["test"]
    name = lambda req: re.split(r"[ <>=!~;\[]", req, maxsplit=1)[0].lower()  # noqa: E731
    listed = {name(r) for r in deps}
    pinned = {name(r) for r in meta["optional-dependencies"]["test"] if "==" in r}
    for e in ENTRIES:
        assert e.package.lower() in listed, f"{e.package} ({e.name}) is not in pyproject"
    for pkg in {e.package for e in ENTRIES} - {"jax", "flax", "optax", "equinox"}:
        assert pkg.lower() in pinned, f"{pkg} is not pinned (==) in the test extra"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("wider", [False, True])
def test_in_dtype_casts_the_float_inputs_and_a_wider_output_back(dtype, wider):
    """`third_party.in_dtype` (bench_detector's 16-bit pass): float inputs cast, integer ones
    kept; a candidate that returns float32 for 16-bit inputs is cast back to the reference's
    dtype, one that matches it is left as it is."""
    def candidate(x, i):
        return (x.astype(jnp.float32) if wider else x) * 2 + i

    entry = third_party.Entry(
        name="double", package="jax", kind="correct", candidate=candidate,
        reference=lambda x, i: x * 2 + i, what="doubles", expected="passes",
        args=lambda seed: (jnp.full((2, 3), seed + 0.5, jnp.float32), jnp.arange(3)))
    e16 = third_party.in_dtype(entry, dtype)
    x, i = e16.args(1)
    assert e16.name == f"double_{jnp.dtype(dtype).name}"
    assert x.dtype == dtype and i.dtype == jnp.arange(3).dtype
    out = e16.candidate(x, i)
    assert out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out, np.float32), [[3, 4, 5]] * 2)
    assert (e16.candidate is candidate) == (not wider)
