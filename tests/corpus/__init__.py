"""A corpus of kernels as people write them: each entry a candidate, its reference, example
inputs and what `peat.check_kernel` should conclude ("pass", or the expected error model).

Buggy entries carry an author's bug (an index map off by one block, a floor-division grid, a
one-pass variance, ...); correct entries compute the same function another way (online softmax,
Welford layer norm, split-K, Kahan sums, jax's shipped Pallas ops) and must pass. Entries are
built lazily (`Entry.args()`), so importing the corpus compiles nothing.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

__all__ = ["ENTRIES", "Entry", "by_name"]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One kernel of the corpus.

    Attributes:
      name: unique, snake_case.
      kind: "bug" or "correct".
      candidate, reference: ``fn(*args)`` (the candidate may be a `peat.Kernel`).
      args: builds the example arguments.
      expected: "pass" for a correct kernel, else the error model `check_kernel` should name.
      backward: also compare gradients.
      variants: the `check_kernel` variants (None: all).
      needs: the modules the entry needs (`("torch",)`); it is skipped where one is missing.
      race: the bug is a data race, reported by the Pallas interpreter's race detector (a
        `PeatError` from `check_kernel`) rather than by a diagnosis.
      what: one line: the bug, or the other way of computing.
    """

    name: str
    kind: str
    candidate: Callable
    reference: Callable
    args: Callable[[], tuple]
    expected: str
    what: str
    backward: bool = False
    variants: Optional[Sequence[str]] = None
    needs: tuple[str, ...] = ()
    race: bool = False


def _entries() -> tuple[Entry, ...]:
    from . import bugs, correct
    return bugs.ENTRIES + correct.ENTRIES


ENTRIES: tuple[Entry, ...] = _entries()


def by_name(name: str) -> Entry:
    return next(e for e in ENTRIES if e.name == name)
