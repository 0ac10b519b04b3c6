"""A corpus of code nobody here wrote: kernels and ops from public packages, each checked by
`peat.check_kernel` against a plain XLA reference of its math (`references.py`), kept apart from
`tests/corpus` (kernels written here, by the hands that tuned the floors).

Correct entries (`correct.py`) are implementations that users run in training (lucidrains'
FlashAttention in JAX, jax's own shipped Pallas ops for GPUs and for TPUs (flash attention and
megablox's grouped matmul, in pltpu's interpret mode), jax.nn's stable activations against the
naive formulas users write as references, optax's losses, Flax's and Equinox's layers, PyTorch's
functional ops through `peat.kernels.torch_kernel`, lucidrains' rotary embeddings in PyTorch)
and must pass on every seed. Bug entries (`bugs.py`) are the porting bugs people report
(torch's default layer-norm eps 1e-5 against Flax's 1e-6, interleaved against half-split rotary
embeddings, a missing causal mask, tanh GELU for exact GELU, a loss averaged over padding tokens,
a FlashAttention that turns large logits into NaN, aqtp's int8 matmul left on where the matmul
is float32), each a third-party function called the way the bug calls it, and must fail on
every seed, with its error model where the taxonomy has one.

Every entry runs over `SEEDS` (0..4): the seed draws its inputs (`Entry.args(seed)`) and seeds
`check_kernel`'s variants and cotangents. The packages are pinned in pyproject's `test` extra;
an entry whose package is missing (torch and lucidrains' rotary embeddings exist on Python 3.11
only) is skipped, and says why. Entries are built lazily: importing the corpus imports none of
the third-party packages and compiles nothing.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
from typing import Callable, Optional, Sequence, Union

import needs

__all__ = ["ENTRIES", "SEEDS", "Entry", "by_name", "check", "expectation_met", "in_dtype",
           "missing"]

SEEDS: tuple[int, ...] = (0, 1, 2, 3, 4)
"""The seeds every entry runs over: a correct kernel must pass on each."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One third-party kernel of the corpus.

    Attributes:
      name: unique, snake_case.
      package: the PyPI distribution the candidate comes from (as pinned in the test extra).
      kind: "correct" or "bug".
      candidate, reference: ``fn(*args)``; the candidate is the third-party code (a
        `peat.Kernel` for a PyTorch function), the reference plain jax.numpy.
      args: ``args(seed) -> tuple``: the example inputs drawn from `seed`.
      expected: "passes" (a correct kernel), "fails" (a bug the taxonomy has no model for: any
        failing model), or the failing models accepted (a tuple of names).
      what: one line: what the candidate is, or the bug.
      backward: also compare gradients (`check_kernel`'s `backward`: True, or the positions).
      variants: the `check_kernel` variants: by default all but "odd_shape" (a second compile
        per entry; the block kernels take only multiples of their blocks).
      needs: the modules the entry imports; it is skipped where one is missing.
      model: for a bug expected to merely fail ("fails"), the error model that would name it
        best where the taxonomy has one (`attribution` scores it; the test accepts any failure).
      gap: for a correct entry the detector still flags: why (a known gap, not an expectation;
        the test marks it a strict xfail, so it fails once the gap is closed, and
        bench_detector counts it as a false alarm).
      gap_seeds: the seeds the gap shows on, when not all: the test then asserts the others
        and reports these (their verdicts may differ between jax releases).
    """

    name: str
    package: str
    kind: str
    candidate: Callable
    reference: Callable
    args: Callable[[int], tuple]
    expected: Union[str, tuple]
    what: str
    backward: Union[bool, tuple[int, ...]] = True
    variants: Sequence[str] = ("example", "large", "tiny", "near_overflow", "subnormal", "zeros",
                               "outliers")
    needs: tuple = ()
    model: Optional[str] = None
    gap: str = ""
    gap_seeds: tuple[int, ...] = ()

    @property
    def models(self) -> Optional[tuple]:
        """The models that attribute this bug (the accepted ones, else `model`), or None."""
        if isinstance(self.expected, tuple):
            return self.expected
        return (self.model,) if self.model else None


def missing(entry: Entry) -> Optional[str]:
    """Why the entry cannot run here (a module it needs is not installed), or None."""
    return needs.missing(entry.needs)


def check(entry: Entry, seed: int):
    """`peat.check_kernel` on the entry's inputs for `seed`, as the test and the benchmark run it
    (one repeat: the corpus is about numerics; nondeterminism has its own tests)."""
    import peat_jax as peat
    try:
        from peat_jax._src.kernels import pallas as pk
        pk.reset_interpret_state()
    except (ImportError, AttributeError):       # an older or newer layout: nothing to reset
        pass
    with contextlib.redirect_stdout(io.StringIO()):   # the interpreter may print reports
        return peat.check_kernel(entry.candidate, entry.reference, *entry.args(seed),
                                 variants=tuple(entry.variants), backward=entry.backward,
                                 repeats=1, seed=seed)


def in_dtype(entry: Entry, dtype) -> Entry:
    """`entry` with its float inputs cast to `dtype` (a 16-bit training's activations), and, for
    a candidate that returns a wider dtype there than the reference (flash-attention-jax
    returns float32), its outputs cast to the reference's, as a model that casts back uses it."""
    import jax
    import jax.numpy as jnp

    def cast(tree):
        return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(
            jnp.result_type(x), jnp.floating) else x, tree)

    def cast_like(*args):
        want = jax.eval_shape(entry.reference, *args)
        return jax.tree.map(lambda y, w: y.astype(w.dtype), entry.candidate(*args), want)

    example = cast(entry.args(SEEDS[0]))
    same = jax.tree.map(lambda g, w: g.dtype == w.dtype, jax.eval_shape(entry.candidate, *example),
                        jax.eval_shape(entry.reference, *example))
    candidate = entry.candidate if all(jax.tree.leaves(same)) else jax.jit(cast_like)
    return dataclasses.replace(entry, name=f"{entry.name}_{jnp.dtype(dtype).name}",
                               candidate=candidate, args=lambda seed: cast(entry.args(seed)))


def expectation_met(entry: Entry, diagnosis) -> bool:
    """The verdict is the expected one: a pass for "passes", a failure for "fails", a failure
    with one of the named models otherwise."""
    if entry.expected == "passes":
        return bool(diagnosis.passed)
    if diagnosis.passed:
        return False
    return entry.expected == "fails" or diagnosis.model in entry.expected


def _entries() -> tuple[Entry, ...]:
    from . import bugs, correct
    return correct.ENTRIES + bugs.ENTRIES


ENTRIES: tuple[Entry, ...] = _entries()


def by_name(name: str) -> Entry:
    return next(e for e in ENTRIES if e.name == name)
