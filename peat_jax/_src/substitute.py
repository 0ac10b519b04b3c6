"""Substitution: run a JAX function with a kernel or a fault in place of the op at chosen sites.

Three ways to switch a candidate in, one mechanism:
  * `substitute(fn, subs)`: always on;
  * `switched(fn, subs)`: on at the one site whose index equals a traced integer, so a sweep over
    all sites runs on one compiled executable;
  * `peat.inject(train_step, subs, schedule)` (schedule.py): on at the steps a schedule picks,
    decided on a traced step counter.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from peat_jax._src import _interpreter as _ip
from peat_jax._src import _jax
from peat_jax._src import regions as _regions
from peat_jax._src.errors import PeatError
from peat_jax._src.faults import Fault
from peat_jax._src.formats import is_inexact
from peat_jax._src.kernels import Kernel
from peat_jax._src.sites import Selector, Site, Tracer, Traced, select


@runtime_checkable
class Candidate(Protocol):
    """What stands at a site in place of the reference op.

    peat_jax has two kinds and dispatches on which: a `peat.Kernel` computes the op's outputs from
    its operands (a candidate implementation); a `peat.Fault` transforms the reference output (a
    modelled pseudo-error). Both carry a name for reports and say, before anything runs, whether
    they can stand at a site.
    """

    @property
    def name(self) -> str:
        """Shown in reports and errors."""
        ...

    def check_site(self, site: Site) -> Optional[str]:
        """None if the candidate may stand at `site`, else a one-line reason."""
        ...


Substitution = Mapping[Selector, Candidate]
"""`{selector: candidate}`: each `Selector` picks sites, and its candidate stands at every site it
picks (two selectors that pick one site must give it the same candidate)."""


def _check_candidate(c, selector) -> None:
    if not isinstance(c, (Kernel, Fault)):
        hint = (" (wrap a plain function with peat.Kernel(name, impl) or "
                "peat.kernels.dot_general(matmul))" if callable(c) else "")
        raise PeatError(f"the substitution for selector {selector!r} must be a peat.Kernel or a "
                        f"peat.faults fault, got {type(c).__name__}{hint}")


def resolve(sites: Sequence[Site], substitution: Substitution) -> dict[int, Candidate]:
    """Map each selected site index to its candidate; errors name the selector and the site."""
    if not isinstance(substitution, Mapping):
        raise PeatError("a substitution is a mapping {selector: peat.Kernel or fault}, got "
                        f"{type(substitution).__name__}")
    chosen: dict[int, tuple[Any, Candidate]] = {}
    for selector, cand in substitution.items():
        _check_candidate(cand, selector)
        refused, served = [], 0
        for site in select(sites, selector):
            if site.index in chosen and chosen[site.index][1] is not cand:
                raise PeatError(f"site #{site.index} ({site.primitive} @ {site.path}) is selected "
                                f"by both {chosen[site.index][0]!r} and {selector!r} with "
                                "different candidates; make the selectors disjoint")
            reason = _site_reason(cand, site)
            if reason:
                refused.append((site, reason))
            else:
                chosen[site.index] = (selector, cand)
                served += 1
        _refused(selector, cand, refused, served=served > 0)
    return {i: c for i, (_, c) in sorted(chosen.items())}


def _refused(selector, cand: Candidate, refused: list, served: bool) -> None:
    """The sites `selector` matched that `cand` cannot serve (`refused`: (site, why)): a
    PeatError when it serves none of its sites, else a one-line warning listing them (a
    selector matching many sites, `"dot_general"` over a model whose attention mask is an
    int32 einsum, keeps the others)."""
    if not refused:
        return
    site, why = refused[0]
    first = f"site #{site.index} ({site.primitive} @ {site.path or '<top>'}): {why}"
    if not served:
        more = f" (and {len(refused) - 1} more of its sites)" if len(refused) > 1 else ""
        raise PeatError(f"cannot use {_cand_name(cand)} at {first}{more}; selector "
                        f"{selector!r} leaves it no site to serve")
    others = ", ".join(f"#{s.index}" for s, _ in refused[1:])
    warnings.warn(f"selector {selector!r}: {_cand_name(cand)} skips {len(refused)} site(s) it "
                  f"cannot serve, which run the reference: {first}"
                  + (f"; also {others}" if others else ""), stacklevel=4)


def _cand_name(c: Candidate) -> str:
    return f"kernel {c.name!r}" if isinstance(c, Kernel) else f"fault {c.name!r}"


def _site_reason(cand: Candidate, site: Site) -> Optional[str]:
    if isinstance(cand, Kernel):
        reason = cand.check_site(site)
        call = _function_call(site)
        if reason is None and call is not None:  # an intercepted library function's call
            reason = call.unserved(cand.impl)
        return reason
    return cand.check_site(site)


def _fault_seed(f: Fault) -> int:
    return int(f.params.get("seed", 0) or 0)


_is_differentiating = _jax.is_differentiating


def _run_candidate(cand: Candidate, site: Site, vals: Sequence[Any], reference, key) -> list:
    """The site's outputs computed by `cand`, checked against the site's output types."""
    if isinstance(cand, Fault):
        outs = reference(*vals)
        k = next(i for i, d in enumerate(site.out_dtypes) if is_inexact(d))
        outs[k] = cand.apply(lambda *ops: reference(*ops)[k], tuple(vals), key, site)
    else:
        assert isinstance(cand, Kernel)  # resolve() admits only the two kinds
        try:
            outs = call_kernel(cand, site, vals)
        except PeatError:
            raise
        except Exception as e:  # noqa: BLE001 - re-raised with the site named
            if _is_differentiating(vals):
                raise PeatError(
                    f"kernel {cand.name!r} at site #{site.index} ({site.primitive} @ {site.path}) "
                    f"cannot be differentiated ({type(e).__name__}: {str(e).splitlines()[0]}), but "
                    "a gradient flows through this site: give its impl a jax.custom_vjp or pass "
                    "vjp= to peat.Kernel") from e
            raise PeatError(f"kernel {cand.name!r} raised at site #{site.index} ({site.primitive} "
                            f"@ {site.path}): {type(e).__name__}: {e}") from e
    _check_outputs(cand, site, outs)
    return outs


def _function_call(site: Site):
    """The `regions.FunctionCall` of a site that is an intercepted library function's call."""
    if not site.composite or "region_id" not in site.params:
        return None
    return _regions.region_info(site.params["region_id"]).function


def call_kernel(k: Kernel, site: Site, vals) -> list:
    """The outputs (a list) kernel `k` computes at `site` on its operands `vals`: with the
    op's params for a primitive site, the region's arguments (and, at its backward site, the
    VJP of `k` under the cotangents) for a composite one; at an intercepted library function's
    call, `k` is called as the function was (`FunctionCall.call_kernel`: its parameters without
    a default positionally, the other arguments the call passed by name). Not checked against
    the site's output types."""
    if not site.composite:
        params = {n: v for n, v in site.params.items()}
        out = k(*vals, **params)
        return list(out) if isinstance(out, (list, tuple)) else [out]
    info = _regions.region_info(site.params["region_id"])
    n_in = info.in_tree.num_leaves
    if info.function is not None:
        operands = list(vals[:n_in])
        if not site.params["backward"]:
            return jax.tree.leaves(info.function.call_kernel(k, operands))
        cot = jax.tree.unflatten(info.out_tree, list(vals[n_in:]))
        return list(info.function.kernel_vjp(k, operands, cot))
    args = jax.tree.unflatten(info.in_tree, list(vals[:n_in]))
    if not site.params["backward"]:
        return jax.tree.leaves(k(*args))
    cot = jax.tree.unflatten(info.out_tree, list(vals[n_in:]))
    _, vjp = jax.vjp(lambda *a: k(*a), *args)
    return jax.tree.leaves(vjp(cot))


def _check_outputs(cand, site: Site, outs) -> None:
    want = list(zip(site.out_shapes, site.out_dtypes))
    got = [(tuple(np.shape(o)), jnp.result_type(o)) for o in outs]
    if len(got) != len(want) or any(gs != ws or np.dtype(gd) != np.dtype(wd)
                                    for (gs, gd), (ws, wd) in zip(got, want)):
        fmt = lambda ts: ", ".join(f"{np.dtype(d).name}{list(s)}" for s, d in ts)  # noqa: E731
        raise PeatError(f"{_cand_name(cand)} returned ({fmt(got)}) at site #{site.index} "
                        f"({site.primitive} @ {site.path or '<top>'}), which needs ({fmt(want)}); "
                        "the candidate must return the site's exact output shapes and dtypes")


# Active(site) -> None (always on) or a traced bool scalar.
Active = Callable[[Site], Optional[jax.Array]]
# OnError(site, exception): told of a candidate that raised while traced at `site`.
OnError = Callable[[Site, Exception], None]


def make_rules(traced: Traced, chosen: Mapping[int, Candidate], active: Active,
               key_for: Callable[[Site, Candidate], jax.Array], *, taps: int = 0,
               on_error: Optional[OnError] = None) -> dict:
    """Interpreter rules that put `chosen[i]` at site i when `active(site)` holds.

    Args:
      taps: when > 0, each rule also returns, as the interpreter's side of its site, the
        candidate's and the reference's first floating-point output there, flattened to float32
        and zero-padded to `taps` elements (zeros while the candidate is off); inside a `scan`,
        those of the iteration that differs most.
      on_error: when given, a candidate that raises while traced at a site (a wrong output
        shape or dtype included) is isolated: `on_error(site, exception)` is called and the
        site computes the reference. Without it the exception propagates.
    """
    return {idx: _site_rule(traced.sites[idx], cand, active, key_for, taps, on_error)
            for idx, cand in chosen.items()}


def _site_rule(site: Site, cand: Candidate, active: Active, key_for, taps: int,
               on_error: Optional[OnError]):
    k = next((i for i, d in enumerate(site.out_dtypes) if is_inexact(d)), 0)

    def rule(op, invals, reference):
        key = key_for(site, cand) if isinstance(cand, Fault) else None
        on = active(site)

        def cand_branch(*vals):
            return _run_candidate(cand, site, vals, reference, key)

        # both branches strongly typed, so that weak types cannot make lax.cond reject them
        def cand_typed(*vals):
            return [lax.convert_element_type(o, v.aval.dtype)
                    for o, v in zip(cand_branch(*vals), op.eqn.outvars)]

        def ref_typed(*vals):
            return [lax.convert_element_type(o, jnp.result_type(o)) for o in reference(*vals)]

        if taps:
            cand_typed, ref_typed = _tapped(cand_typed, ref_typed, reference, k, taps)
        try:
            if on is None:
                out = cand_typed(*invals) if taps else cand_branch(*invals)
            else:
                out = lax.cond(on, cand_typed, ref_typed, *invals)
        except Exception as e:  # noqa: BLE001 - the candidate failed at this site
            if on_error is None:
                raise
            on_error(site, e)
            out = ref_typed(*invals)
        return _ip.WithSide(*out, _worst_iteration) if taps else out

    return rule


def _tapped(cand_typed, ref_typed, reference, k: int, width: int):
    """The two branches of a rule made to return (outputs, (candidate tap, reference tap)):
    output `k` of each, flattened to float32 and padded to `width`; zeros on the reference
    branch."""
    def cand(*vals):
        ref = reference(*vals)
        got = cand_typed(*vals)
        return got, (_pad(got[k], width), _pad(ref[k], width))

    def ref(*vals):
        outs = ref_typed(*vals)
        # zeros_like: inside `shard_map` they vary over the mesh like the candidate's taps, so
        # that both branches of the switch have one type
        zero = jnp.zeros_like(_pad(outs[k], width))
        return outs, (zero, zero)

    return cand, ref


def _pad(x: jax.Array, n: int) -> jax.Array:
    flat = x.reshape(-1).astype(jnp.float32)
    return jnp.pad(flat, (0, n - flat.size))


def _worst_iteration(stacked):
    """Of a scan's stacked (candidate, reference) taps, the iteration that differs most."""
    c, r = stacked
    err = jnp.max(jnp.where(jnp.isnan(c - r), jnp.inf, jnp.abs(c - r)), axis=1)
    i = jnp.argmax(err)
    return c[i], r[i]


def fault_key(site: Site, cand: Fault) -> jax.Array:
    """The PRNG key of `cand` at `site`: `fold_in(key(seed), site.index)`."""
    return jax.random.fold_in(jax.random.key(_fault_seed(cand)), site.index)


def run_rules(traced: Traced, rules: Mapping[int, Any], args, kwargs, *,
              with_sides: bool = False):
    """`traced`'s function on `args, kwargs` with site i computed by `rules[i]`: its outputs
    (the function's pytree), and with `with_sides` also {site index: side} of the rules that
    returned one."""
    flat = traced.flat_args(args, kwargs)
    outs, sides = _ip.evaluate(traced.program, rules, traced.program.closed_jaxpr.consts, flat,
                               with_sides=True)
    tree = jax.tree.unflatten(traced.out_tree, outs)
    return (tree, sides) if with_sides else tree


class Substituted:
    """`fn` with a substitution; traced per argument structure, then re-evaluated."""

    __call__: Callable[..., Any]  # each subclass's own signature (fn's; a site index first, ...)

    def __init__(self, fn, substitution, *, primitives=None, regions=(),
                 mode="static") -> None:
        if not isinstance(substitution, Mapping):
            raise PeatError("a substitution is a mapping {selector: peat.Kernel or fault}, got "
                            f"{type(substitution).__name__}")
        for sel, cand in substitution.items():
            _check_candidate(cand, sel)
        self._tracer = Tracer(fn, primitives=primitives, regions=regions)
        self._substitution = dict(substitution)
        self._mode = mode
        self._chosen: dict[int, dict] = {}
        functools.update_wrapper(self, fn, updated=())

    def prepare(self, args, kwargs) -> tuple[Traced, dict[int, Candidate]]:
        traced = self._tracer.trace(args, kwargs)
        chosen = self._chosen.get(id(traced))
        if chosen is None:
            chosen = resolve(traced.sites, self._substitution) if self._substitution else {}
            self._chosen[id(traced)] = chosen
        return traced, chosen

    def sites(self, *args, **kwargs) -> list[Site]:
        """The sites of the wrapped function on these arguments."""
        return list(self._tracer.trace(args, kwargs).sites)

    def selected(self, *args, **kwargs) -> list[Site]:
        """The sites the substitution selects on these arguments, in index order."""
        traced, chosen = self.prepare(args, kwargs)
        return [traced.sites[i] for i in chosen]

    def evaluate(self, args, kwargs, rules_for: Callable[[Traced, dict[int, Candidate]], dict],
                 *, with_sides: bool = False):
        """The wrapped function on `args, kwargs`, re-evaluated with the interpreter rules that
        `rules_for(traced, chosen)` returns ({site index: rule}); its outputs, and with
        `with_sides` also {site index: side} (see `run_rules`)."""
        traced, chosen = self.prepare(args, kwargs)
        rules = rules_for(traced, chosen)
        with _regions.flax_regions(*_regions.module_types(self._tracer.regions)):
            return run_rules(traced, rules, args, kwargs, with_sides=with_sides)

    def run(self, args, kwargs, active: Active, key_for) -> Any:
        return self.evaluate(args, kwargs,
                             lambda traced, chosen: make_rules(traced, chosen, active, key_for))


class _Static(Substituted):
    def __call__(self, *args, **kwargs):
        return self.run(args, kwargs, lambda site: None, fault_key)


class _Switched(Substituted):
    def __call__(self, site_index, *args, **kwargs):
        site_index = jnp.asarray(site_index, jnp.int32)
        if site_index.ndim != 0:
            raise PeatError(f"the site index must be a scalar int, got shape {site_index.shape}")
        return self.run(args, kwargs, lambda site: site_index == site.index, fault_key)


def substitute(fn: Callable, substitution: Substitution, *, primitives=None,
               regions: Sequence[Any] = ()) -> Substituted:
    """`fn` with the op at each selected site computed by a candidate instead.

    Args:
      fn: any JAX function of arrays (pytrees); traced once per argument structure.
      substitution: `{selector: candidate}`; a selector is a site index, a primitive or region
        name, a path pattern (`"Dense_0/*"`, `"bwd:dot_general"`), a predicate over `peat.Site`,
        or a list of these; a candidate is a `peat.Kernel` (computes the op from its operands) or
        a `peat.faults` fault (transforms the reference output).
      primitives, regions: as in `peat.list_sites` (site indices depend on them); a dotted
        name in `regions` (`"jax.nn.dot_product_attention"`) makes that library function's
        calls sites, selected by the same name (see `peat.intercept`).

    Returns:
      A function with `fn`'s signature and outputs, usable under `jit`, `grad` and `vmap`. With an
      empty substitution it computes bitwise what `fn` computes. Its `.sites(*args)` and
      `.selected(*args)` list the sites. Errors (no matching site, a candidate that cannot serve a
      site or returns the wrong shape/dtype) are `peat.PeatError`s raised while tracing.
    """
    return _Static(fn, substitution, primitives=primitives, regions=regions)


def switched(fn: Callable, substitution: Substitution, *, primitives=None,
             regions: Sequence[Any] = ()) -> Callable:
    """`fn'(site_index, *args, **kwargs)`: the candidate active only at the site whose index equals
    `site_index` (a traced int32 scalar; -1 or any unselected index = nothing substituted).

    Every selected site is compiled with a switch, so sweeping `site_index` over the sites reuses
    one executable. Note that the switches alone can change XLA's fusion, and so rounding, by a
    few ULPs: take the golden from the same function with `site_index=-1`.
    """
    return _Switched(fn, substitution, primitives=primitives, regions=regions)
