"""The replay of a playback campaign: one compiled train step, switched by a traced site index.

`Replay(traced, chosen, sites, devices).fn(site_index, state, batch)` runs the train step with
the candidate active only at site `site_index` (-1: nowhere, the golden replay) and returns the
new state, the metrics and the site's `Taps`. It is `substitute.make_rules`' switched rule with
taps, so playback replays exactly what `peat.switched` runs. A candidate that raises while
traced at a site is isolated there: the site runs the reference and `Replay.crashed` says why.

`fn(site_index, state, batch, sample)` with a traced `sample` >= 0 runs, on the same executable,
the golden step with the candidate off and the reference output at site `site_index` moved by
the rounding pseudo-error number `sample` (`peat_jax._src.profiler.effect.pseudo_error`, seeded
by `effect.pseudo_seed(sample, site index, output)`): what playback judges a cell's step
against.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from peat_jax._src import _interpreter as _ip
from peat_jax._src import _jax
from peat_jax._src.profiler.effect import pseudo_error, pseudo_error_size, pseudo_seed
from peat_jax._src.sites import Site, Traced
from peat_jax._src.substitute import Candidate, fault_key, make_rules, run_rules


class Taps(NamedTuple):
    """What one replay saw at its site (zeros and `found` False when nothing was tapped: site
    -1, or a site inside `while`/`cond`)."""

    candidate: jax.Array   # float32 [width]: the candidate's output, flattened, zero-padded
    reference: jax.Array   # float32 [width]: the reference op's output on the same operands
    found: jax.Array       # bool scalar: whether the site was tapped


class Replay:
    """One campaign's replay executable and its dispatch over devices.

    Attributes:
      width: the taps' length (the largest first output among the grid's sites).
      devices: the devices a checkpoint's cells are spread over.
      crashed: site index -> error line, for candidates that raised while traced there
        (filled when `fn` is first traced).
    """

    def __init__(self, traced: Traced, chosen: dict[int, Candidate], sites: Sequence[Site],
                 devices: Sequence[Any]):
        self.traced, self.chosen = traced, chosen
        self.width = max((int(np.prod(s.out_shapes[0])) for s in sites), default=1)
        self.devices = list(devices)
        self.crashed: dict[int, str] = {}
        self._jitted = jax.jit(self._run)
        self._compiled = [self._jitted]
        self._capture = jax.jit(self._operands)

    def fn(self, site_index, state, batch, sample=-1):
        """The replay at `site_index` (-1: the golden), with the rounding pseudo-error number
        `sample` there instead of the candidate when `sample` >= 0: (new state, metrics, Taps),
        asynchronously; one executable for every site and sample."""
        return self._jitted(site_index, state, batch, sample)

    @property
    def group_size(self) -> int:
        """Cells run at a time: one per device."""
        return max(1, len(self.devices))

    def groups(self, sites: Sequence[Site]) -> list[list[Site]]:
        """`sites` in groups of `group_size`, in order."""
        n = self.group_size
        return [list(sites[i:i + n]) for i in range(0, len(sites), n)]

    def dispatch(self, group: Sequence[Site], state, batch, sample: int = -1) -> dict[int, Any]:
        """Start the replays of `group` (asynchronously): site index -> (new state, metrics,
        Taps); with `sample` >= 0 the golden step with that rounding pseudo-error at each site
        instead. With several devices an empty group still runs the spread replay once (site -1
        on every device): its compilation, outside any time limit."""
        if len(self.devices) > 1:
            ids = [s.index for s in group] + [-1] * (len(self.devices) - len(group))
            out = self._spread(jnp.asarray(ids, jnp.int32), state, batch, sample)
            home = jax.tree.leaves(state)[0].sharding
            return {s.index: jax.device_put(jax.tree.map(lambda x, j=j: x[j], out), home)
                    for j, s in enumerate(group)}
        return {s.index: self.fn(s.index, state, batch, sample) for s in group}

    def compiles(self) -> int:
        """Executables compiled so far (the golden replay's included)."""
        return sum(_jax.cache_size(f) for f in self._compiled)

    @functools.cached_property
    def _spread(self):
        """The replay over `devices`: site indices [len(devices)] (each device runs its own cell
        with a real switch), state and batch replicated; outputs gain a leading device axis."""
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        mesh = Mesh(np.asarray(self.devices), ("cells",))

        def per_device(site_index, state, batch, sample):
            return jax.tree.map(lambda x: x[None], self._run(site_index[0], state, batch,
                                                             sample))

        fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("cells"), P(), P(), P()),
                                   out_specs=P("cells"), check_vma=False))
        self._compiled.append(fn)
        spread, same = NamedSharding(mesh, P("cells")), NamedSharding(mesh, P())

        def run(ids, state, batch, sample=-1):
            state, batch, sample = jax.device_put((state, batch, jnp.int32(sample)), same)
            return fn(jax.device_put(ids, spread), state, batch, sample)

        return run

    def _run(self, site_index, state, batch, sample):
        sample = jnp.asarray(sample, jnp.int32)
        off = sample < 0   # the candidate runs only when no pseudo-error does
        rules = make_rules(self.traced, self.chosen,
                           lambda site: (site_index == site.index) & off,
                           fault_key, taps=self.width, on_error=self._crash)
        rules = {i: _with_pseudo_error(rule, self.traced.sites[i], jnp.maximum(sample, 0),
                                       (site_index == i) & ~off)
                 for i, rule in rules.items()}
        (new_state, metrics), sides = run_rules(self.traced, rules, (state, batch), {},
                                                with_sides=True)
        return new_state, metrics, _taps_at(sides, site_index, self.width)

    def operands(self, state, batch) -> dict[int, tuple]:
        """The golden step's operands at each grid site that runs once per step (not inside a
        `scan`; a `while` or `cond` body's are not read out), by site index: device arrays,
        from one more compiled program (built on first use; not counted in `compiles`)."""
        return self._capture(state, batch)

    @functools.cached_property
    def eqns(self) -> dict[int, Any]:
        """The jaxpr equation of each site, by site index (what `promote.widened_eqn`
        evaluates in float64)."""
        return {op.index: op.eqn for op in self.traced.program.ops()}

    def _operands(self, state, batch):
        rules = {i: _capturing for i in self.chosen if self.traced.sites[i].repeats == 1}
        _, sides = run_rules(self.traced, rules, (state, batch), {}, with_sides=True)
        return sides

    def _crash(self, site: Site, e: Exception) -> None:
        # isolated: the site's cells are recorded as crashed, the rest of the grid runs
        self.crashed.setdefault(site.index, error_line(e))


def _with_pseudo_error(rule, site: Site, sample: jax.Array, on: jax.Array):
    """`rule` with its outputs moved by the rounding pseudo-error number `sample` when `on`
    (both traced; `on` only where the candidate is off, so what is moved is the reference):
    each float output perturbed within its rounding floor (`effect.pseudo_error`, size
    `effect.pseudo_error_size(site)`, seeded by the sample, the site and the output). Applied
    once to the rule's result rather than to each call of the reference inside its branches,
    and by a select rather than a `lax.cond`: a few fused element-wise operations per site,
    the reference's values passed bitwise where `on` is false."""
    rho = pseudo_error_size(site)

    def moved(outs):
        return [jnp.where(on, pseudo_error(o, pseudo_seed(sample, site.index, j), rho), o)
                for j, o in enumerate(outs)]

    def moved_rule(op, invals, reference):
        got = rule(op, invals, reference)
        if isinstance(got, _ip.WithSide):
            return dataclasses.replace(got, outs=moved(got.outs))
        return moved(got)

    return moved_rule


def _capturing(op, invals, reference):
    """A rule computing the reference and returning its operands as the site's side."""
    return _ip.WithSide(reference(*invals), tuple(invals), lambda stacked: stacked)


def _taps_at(sides: dict[int, Any], site_index, width: int) -> Taps:
    """The taps of the site `site_index` (traced) among every site's."""
    zero = jnp.zeros((width,), jnp.float32)
    taps = Taps(zero, zero, jnp.zeros((), bool))
    for idx, (c, r) in sides.items():
        hit = site_index == idx
        taps = Taps(jnp.where(hit, c, taps.candidate), jnp.where(hit, r, taps.reference),
                    taps.found | hit)
    return taps


def error_line(e: BaseException) -> str:
    """`Type: first line of the message` of an exception (at most 1000 characters), for a
    crashed cell's record."""
    lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
    if not lines:
        return type(e).__name__
    head = lines[0]
    if len(lines) > 1 and "Traceback (most recent call last)" in str(e):
        # an error raised in a host callback: XLA wraps the callback's traceback; its last line
        # is the callback's own exception
        head = head.split("Traceback (most recent call last)")[0].rstrip(" :") + ": " + lines[-1]
    return f"{type(e).__name__}: {head}"[:1000]
