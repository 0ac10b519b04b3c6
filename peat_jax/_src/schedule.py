"""Schedules for frequency-based runtime injection, and `inject`.

A schedule is a pure function of a traced step counter that says whether the candidate is active
at that step. `inject` puts the candidate at the selected sites of a train step behind that
decision, so the whole run uses one compiled step function.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from peat_jax._src import _jax
from peat_jax._src.errors import PeatError
from peat_jax._src.faults import Fault
from peat_jax._src.sites import Site
from peat_jax._src.substitute import Substitution, Substituted, fault_key


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """When a substitution is active. `schedule(step)` -> bool scalar (jittable; `step` may be
    traced). `name` and `params` describe it for manifests and reports."""

    name: str
    fires: Callable[[jax.Array], jax.Array]
    params: Mapping[str, Any]

    def __call__(self, step) -> jax.Array:
        return self.fires(jnp.asarray(step, jnp.int32))

    def fired_steps(self, steps: Iterable[int]) -> list[int]:
        """The steps among `steps` at which the schedule fires (evaluated on the host)."""
        steps = np.asarray(list(steps), np.int32)
        if steps.size == 0:
            return []
        mask = np.asarray(jax.vmap(self.fires)(jnp.asarray(steps)))
        return [int(s) for s in steps[mask]]

    def __str__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{self.name}({args})"


def _as_int(x, what: str) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise PeatError(f"{what} must be an int, got {x!r}")
    return int(x)


def every(n: int, offset: int = 0) -> Schedule:
    """Fires when `step % n == offset` (n >= 1, 0 <= offset < n)."""
    n, offset = _as_int(n, "every(n): n"), _as_int(offset, "every(n, offset): offset")
    if n <= 0:
        raise PeatError(f"every(n): n must be >= 1, got {n}")
    if not 0 <= offset < n:
        raise PeatError(f"every(n, offset): offset must be in [0, {n}), got {offset}")
    return Schedule("every", lambda step: (step % n) == offset, {"n": n, "offset": offset})


def at_steps(steps: Iterable[int]) -> Schedule:
    """Fires at exactly the given (non-negative) steps."""
    try:
        chosen = sorted({_as_int(s, "at_steps: each step") for s in steps})
    except TypeError:
        raise PeatError(f"at_steps needs an iterable of ints, got {steps!r}") from None
    if any(s < 0 for s in chosen):
        raise PeatError(f"at_steps: steps must be >= 0, got {[s for s in chosen if s < 0]}")
    table = np.asarray(chosen, np.int32)

    def fires(step):
        if table.size == 0:
            return jnp.zeros((), bool)
        return jnp.any(jnp.asarray(table) == step)

    return Schedule("at_steps", fires, {"steps": chosen})


def with_probability(p: float, seed: int = 0) -> Schedule:
    """Fires at each step independently with probability `p`, reproducibly from `seed`: the draw
    at step s is `bernoulli(fold_in(key(seed), s), p)`."""
    if isinstance(p, bool) or not isinstance(p, (int, float, np.floating, np.integer)):
        raise PeatError(f"with_probability(p): p must be a number in [0, 1], got {p!r}")
    p = float(p)
    if not 0.0 <= p <= 1.0 or p != p:
        raise PeatError(f"with_probability(p): p must be in [0, 1], got {p}")
    seed = _as_int(seed, "with_probability(p, seed): seed")
    base = jax.random.key(seed)

    def fires(step):
        return jax.random.bernoulli(jax.random.fold_in(base, step), p)

    return Schedule("with_probability", fires, {"p": p, "seed": seed})


class _Injected(Substituted):
    """`step_fn(state, batch, step)`: the candidate on where `schedule` fires on `step` (a
    `lax.cond` per site), or always when `schedule` is None (no conditional: the step where a
    host-side switch fires); a fault's key from `step`."""

    def __init__(self, train_step, substitution, schedule: Optional[Schedule], **kw):
        super().__init__(train_step, substitution, **kw)
        self.schedule = schedule

    def __call__(self, state, batch, step):
        step = jnp.asarray(step, jnp.int32)
        if step.ndim != 0:
            raise PeatError(f"the step must be a scalar int, got shape {step.shape}")
        on = None if self.schedule is None else self.schedule(step)
        return self.run((state, batch), {}, lambda site: on, step_fault_key(step))


def step_fault_key(step) -> Callable[[Site, Fault], jax.Array]:
    """`key_for(site, fault)` of an injected step: `fold_in(fault_key(site, fault), step)`, i.e.
    `fold_in(fold_in(key(seed), site.index), step)` (`step` a Python or traced int)."""
    def key_for(site: Site, cand: Fault) -> jax.Array:
        return jax.random.fold_in(fault_key(site, cand), step)

    return key_for


def inject(train_step: Callable, substitution: Substitution, schedule: Schedule, *,
           primitives=None, regions: Sequence[Any] = ()) -> Substituted:
    """`step_fn(state, batch, step)`: `train_step` with the candidate active on scheduled steps.

    The schedule is evaluated on `step` (a traced int is fine), so a jitted `step_fn` compiles
    once for the whole run. Each selected site is a `lax.cond` on the schedule's decision; on
    steps where it does not fire the result is what `train_step` computes with those switches in
    place: bitwise the plain step on jax 0.10 / 0.11 in the programs measured, within an ULP or
    two on jax 0.12, whose XLA fuses around the switches differently. (One `lax.cond` around the
    whole step was tried: bitwise everywhere, but 6-12x slower on the CNN workload on XLA:CPU,
    whose convolutions inside a conditional branch do not run at full speed.) A fault's randomness
    is drawn from `fold_in(key(seed), site, step)`, so each firing step gets its own reproducible
    pattern. `primitives` and `regions` (Flax module classes or dotted names of library
    functions, `peat.intercept`) as in `peat.list_sites`.
    """
    if not isinstance(schedule, Schedule):
        raise PeatError(f"inject needs a peat schedule (peat.every / peat.at_steps / "
                        f"peat.with_probability), got {type(schedule).__name__}")
    return _Injected(train_step, substitution, schedule, primitives=primitives, regions=regions)


SWITCHES = ("site", "host")
"""Where a run with runtime injection switches the candidate on and off (`InjectedStep`):
  * "site": one executable, `peat.inject`'s `lax.cond` at each selected site on the traced step;
  * "host": two executables, the plain step and the step with the candidate always on, chosen on
    the host from the schedule (known there before each step)."""


def default_switch(backend: Optional[str] = None) -> str:
    """The switch `peat.runtime` uses on `backend` (default: jax's default backend).

    "site" on XLA:CPU: measured there at 0.98-1.06x the plain step on steps that do not fire,
    where one program with a whole-step branch cost 6.5-12x (the CNN's convolutions inside a
    conditional branch). "host" elsewhere: on an H200 the per-site switches cost 1.39x the plain
    step (vision, large preset), as the conditionals split XLA:GPU's fusions, while a step that
    does not fire under "host" runs the plain step's own executable (bitwise the plain step; the
    price is a second compile)."""
    return "site" if (backend or jax.default_backend()) == "cpu" else "host"


class InjectedStep:
    """A compiled injected step, `step_fn(state, batch, step)`, switched as `switch` says (see
    `SWITCHES`); `wrap(fn)` is applied to each program before it is jitted (it keeps the
    signature). `compiles()` counts the executables compiled so far."""

    _BLOCK = 1024  # steps whose firing is evaluated at once on the host

    def __init__(self, train_step: Callable, substitution: Substitution, schedule: Schedule, *,
                 switch: str, regions: Sequence[Any] = (), wrap: Callable = lambda f: f):
        if switch not in SWITCHES:
            raise PeatError(f"switch must be one of {', '.join(SWITCHES)}, got {switch!r}")
        self.switch = switch
        self.schedule = schedule
        if switch == "site":
            self._programs = [jax.jit(wrap(inject(train_step, substitution, schedule,
                                                  regions=regions)))]
        else:
            always = _Injected(train_step, substitution, None, regions=regions)
            self._programs = [jax.jit(wrap(lambda state, batch, step: train_step(state, batch))),
                              jax.jit(wrap(always))]
        self._fired: dict[int, frozenset[int]] = {}

    def fires(self, step: int) -> bool:
        """Whether the schedule fires at `step` (a Python int), from a host-side table."""
        block = step // self._BLOCK
        if block not in self._fired:
            start = block * self._BLOCK
            self._fired[block] = frozenset(self.schedule.fired_steps(
                range(start, start + self._BLOCK)))
        return step in self._fired[block]

    def __call__(self, state, batch, step: int):
        if self.switch == "site":
            return self._programs[0](state, batch, step)
        return self._programs[self.fires(int(step))](state, batch, step)

    def compiles(self) -> int:
        return sum(_jax.cache_size(p) for p in self._programs)
