"""Walk a closed jaxpr, number its op sites, and re-evaluate it with a rule per selected site.

Everything else in peat_jax talks to it through `Program` (the numbering), `Op` (one visited
equation) and `evaluate`. It reaches jax internals only through `_jax`, and recognises region
calls with `_region_registry.region_of`.

Numbering: equations are visited in program order; an equation that is a site gets the next index
*before* the sites nested inside it (a region is numbered before its body). Sub-jaxprs are visited
in a fixed order: a `cond`'s branches in branch order, a `while`'s cond then body. A site inside a
`scan` or `while` body is one site for every iteration.

Re-evaluation binds every equation that holds no selected site exactly as it was (same primitive,
same params), so that a program with nothing substituted compiles to the same computation. A
container with a selected site inside is rebuilt with the public constructors (`lax.scan`,
`lax.while_loop`, `lax.switch`, `jax.checkpoint`, `jax.shard_map`) or inlined (`jit`,
`closed_call`, custom derivative calls: their custom rule is dropped for the substituted
evaluation and autodiff of the substituted body is used instead).
"""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Optional, Sequence

import jax
from jax import lax

from peat_jax._src import _jax
from peat_jax._src._region_registry import Region, region_of
from peat_jax._src.errors import PeatError

# Compute ops that are sites by default. Pure data movement and plain arithmetic
# (add, mul, reshape, broadcast, ...) are not; pass primitives="all" to list them too.
SITE_PRIMITIVES: frozenset[str] = frozenset({
    # contractions
    "dot_general", "conv_general_dilated", "ragged_dot_general",
    # reductions
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_precision",
    "argmax", "argmin", "cumsum", "cumprod", "cummax", "cumlogsumexp", "reduce_and", "reduce_or",
    # elementwise transcendental and special functions
    "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "asin",
    "acos", "atan", "atan2", "sinh", "cosh", "asinh", "acosh", "atanh", "erf", "erfc", "erf_inv",
    "rsqrt", "sqrt", "cbrt", "pow", "lgamma", "digamma",
    # kernels (opaque bodies)
    "ffi_call", "pallas_call", "triton_kernel_call", "custom_call", "pure_callback",
})

# Primitives whose bodies are kernels, not part of the XLA graph: never descended into.
OPAQUE_PRIMITIVES: frozenset[str] = frozenset({
    "pallas_call", "triton_kernel_call", "ffi_call", "custom_call", "pure_callback",
    "io_callback", "mosaic_gpu_call",
})


_TRANSFORM_RE = re.compile(r"^(?:[A-Za-z_]\w*\()+(.*?)\)*$")
_HIDDEN_SCOPES = frozenset({"rematted_computation", "checkpoint", "remat"})


@dataclasses.dataclass(frozen=True)
class Op:
    """One visited equation that is a site: where it is and what it is."""

    index: int
    eqn: Any                     # jax.extend.core.JaxprEqn
    name_stack: str              # joined with the enclosing equations' stacks
    containers: tuple[str, ...]  # primitives of the enclosing containers, outermost first
    region: Optional[Region]     # (name, is_bwd, region id) for a region call
    repeats: int = 1             # executions per call: product of enclosing scan lengths
    loops: tuple["Loop", ...] = ()  # the enclosing scans, outermost first (set by Program.ops)


class Loop(NamedTuple):
    """An enclosing `scan` of a site: where its body's sites start, and how it iterates.
    Sides stacked by that scan are in `xs` order: iteration i runs `i`-th, or
    `length - 1 - i`-th when `reverse`."""

    base: int      # the index of the first site in the scan's body
    length: int
    reverse: bool


def clean_path(name_stack: str) -> str:
    """Module path from a name stack: transforms stripped (`transpose(jvp(MLP))/head` ->
    `MLP/head`)."""
    parts: list[str] = []
    for comp in name_stack.split("/"):
        m = _TRANSFORM_RE.match(comp)
        comp = m.group(1) if m else comp
        comp = comp.strip("()")
        if comp and comp not in _HIDDEN_SCOPES and (not parts or parts[-1] != comp):
            parts.append(comp)
    return "/".join(parts)


def sub_jaxprs(eqn) -> list[tuple[str, Any]]:
    """The (param name, jaxpr) pairs that `eqn` evaluates, in visiting order (none for an
    opaque kernel)."""
    return _jax.sub_jaxprs(eqn, OPAQUE_PRIMITIVES)


_open = _jax.jaxpr_body


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Per-jaxpr numbering: for each equation, its local site offset and how many sites it holds."""

    offsets: tuple[int, ...]   # site index of eqn i relative to the jaxpr's base (before eqn i)
    is_site: tuple[bool, ...]
    counts: tuple[int, ...]    # sites in eqn i's subtree, itself included
    total: int


class Program:
    """A closed jaxpr with its site numbering (for one site predicate)."""

    def __init__(self, closed_jaxpr, is_site: Callable[[Any], bool]):
        self.closed_jaxpr = closed_jaxpr
        self._is_site = is_site
        self._plans: dict[int, _Plan] = {}
        self._keep: list[Any] = []  # keep jaxprs alive so that id() stays unique
        self.num_sites = self.plan(closed_jaxpr.jaxpr).total

    def eqn_is_site(self, eqn) -> bool:
        return self._is_site(eqn)

    def plan(self, jaxpr) -> _Plan:
        jaxpr = _open(jaxpr)
        got = self._plans.get(id(jaxpr))
        if got is not None:
            return got
        offsets, flags, counts = [], [], []
        n = 0
        for eqn in jaxpr.eqns:
            own = bool(self._is_site(eqn))
            sub = sum(self.plan(j).total for _, j in sub_jaxprs(eqn))
            offsets.append(n)
            flags.append(own)
            counts.append(int(own) + sub)
            n += int(own) + sub
        plan = _Plan(tuple(offsets), tuple(flags), tuple(counts), n)
        self._plans[id(jaxpr)] = plan
        self._keep.append(jaxpr)
        return plan

    def ops(self) -> Iterator[Op]:
        """Every site, in index order."""
        yield from self._walk(self.closed_jaxpr.jaxpr, 0, "", (), 1, ())

    def _walk(self, jaxpr, base, stack, containers, repeats, loops) -> Iterator[Op]:
        jaxpr = _open(jaxpr)
        plan = self.plan(jaxpr)
        for i, eqn in enumerate(jaxpr.eqns):
            idx = base + plan.offsets[i]
            eqn_stack = _join(stack, _jax.name_stack(eqn))
            reg = region_of(eqn)
            if plan.is_site[i]:
                yield Op(idx, eqn, eqn_stack, containers, reg, repeats, loops)
                idx += 1
            inner_repeats = repeats * _jax.scan_length(eqn)
            inner_loops = loops
            if eqn.primitive.name == "scan":
                sc = _jax.scan_layout(eqn)
                inner_loops = loops + (Loop(idx, sc.length, sc.reverse),)
            inner_stack = _join(eqn_stack, reg[0]) if reg else eqn_stack
            if reg and reg[1]:
                inner_stack = _join(eqn_stack, f"transpose({reg[0]})")
            for _, sub in sub_jaxprs(eqn):
                yield from self._walk(sub, idx, inner_stack, containers + (eqn.primitive.name,),
                                      inner_repeats, inner_loops)
                idx += self.plan(sub).total


def _join(a: str, b: str) -> str:
    if not a:
        return b
    if not b:
        return a
    return f"{a}/{b}"


# A rule computes the outputs of a selected site: rule(op, invals, reference) -> list of outvals,
# where reference(*invals) binds the original equation and returns its outputs as a list. A rule
# may instead return `WithSide(outs, side, reduce)`: `side` (a small pytree of arrays) is returned
# by `evaluate` under the site's index. Inside a `scan` the per-iteration sides come out stacked
# along a leading axis and `reduce(stacked) -> side` folds them; inside `remat` and inlined calls
# they pass through; inside `shard_map` they come out stacked over the shards and `reduce` folds
# them the same way; inside `while` and `cond` they are dropped (not available).
Rule = Callable[[Op, Sequence[Any], Callable[..., list]], Any]


@dataclasses.dataclass(frozen=True)
class WithSide:
    outs: Sequence[Any]
    side: Any
    reduce: Callable[[Any], Any]


@dataclasses.dataclass
class _Ctx:
    program: "Program"
    rules: Mapping[int, Rule]
    selected: list[int]
    reducers: dict[int, Callable[[Any], Any]]


def evaluate(program: Program, rules: Mapping[int, Rule], consts, args,
             with_sides: bool = False):
    """Re-evaluate `program` on `args`, computing site `i` with `rules[i]` where given.

    Must be called under a trace (jit / make_jaxpr / grad / vmap) or eagerly. Returns the flat
    outputs of the jaxpr, or `(outputs, sides)` with `with_sides` (sides: {site index: side}
    for the rules that returned `WithSide` where it could be carried out).
    """
    ctx = _Ctx(program, rules, sorted(rules), {})
    sides: dict[int, Any] = {}
    outs = _eval(ctx, program.closed_jaxpr.jaxpr, consts, list(args), 0, "", (), sides)
    return (outs, sides) if with_sides else outs


def _has_selected(selected: Sequence[int], lo: int, hi: int) -> bool:
    import bisect
    k = bisect.bisect_left(selected, lo)
    return k < len(selected) and selected[k] < hi


_bind = _jax.bind


def _eval(ctx: _Ctx, jaxpr, consts, args, base, stack, containers, sides) -> list:
    jaxpr = _open(jaxpr)
    plan = ctx.program.plan(jaxpr)
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, _jax.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for i, eqn in enumerate(jaxpr.eqns):
        idx = base + plan.offsets[i]
        invals = [read(v) for v in eqn.invars]
        eqn_stack = _join(stack, _jax.name_stack(eqn))
        with _jax.eqn_context(eqn):
            if not _has_selected(ctx.selected, idx, idx + plan.counts[i]):
                outs = _bind(eqn, invals)
            elif plan.is_site[i] and idx in ctx.rules:
                op = Op(idx, eqn, eqn_stack, containers, region_of(eqn))
                ref = functools.partial(_reference, eqn)
                got = ctx.rules[idx](op, invals, ref)
                if isinstance(got, WithSide):
                    sides[idx] = got.side
                    ctx.reducers[idx] = got.reduce
                    got = got.outs
                outs = list(got)
            else:
                sub_base = idx + int(plan.is_site[i])
                outs = _rebuild(ctx, eqn, invals, sub_base, eqn_stack, containers, sides)
        for v, x in zip(eqn.outvars, outs):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _reference(eqn, *invals) -> list:
    return _bind(eqn, list(invals))


def _rebuild(ctx: _Ctx, eqn, invals, base, stack, containers, sides) -> list:
    """Evaluate a container equation with substitutions inside it."""
    name = eqn.primitive.name
    reg = region_of(eqn)
    inner_stack = _join(stack, reg[0]) if reg else stack
    inner = containers + (name,)

    def run(j, b, vals, sub_sides):
        return _eval(ctx, j, _jax.jaxpr_consts(j), list(vals), b, inner_stack, inner, sub_sides)

    if name in _jax.INLINE_CALLS:
        j = _jax.call_body(eqn)
        n_in = len(_open(j).invars)
        return run(j, base, invals[len(invals) - n_in:], sides)
    if name in _jax.REMAT:
        rm = _jax.remat_layout(eqn)
        j = rm.jaxpr

        def fn(*a) -> tuple[list, dict]:
            inner_sides: dict = {}
            return run(j, base, a, inner_sides), inner_sides

        outs, inner_sides = jax.checkpoint(fn, prevent_cse=rm.prevent_cse,
                                           policy=rm.policy)(*invals)
        sides.update(inner_sides)
        return list(outs)
    if name == "scan":
        sc = _jax.scan_layout(eqn)
        j, nc, nk = sc.jaxpr, sc.num_consts, sc.num_carry
        consts, init, xs = invals[:nc], invals[nc:nc + nk], invals[nc + nk:]

        def body(carry, x) -> tuple[list, tuple[list, dict]]:
            inner_sides: dict = {}
            outs = run(j, base, list(consts) + list(carry) + list(x), inner_sides)
            return outs[:nk], (outs[nk:], inner_sides)

        carry, (ys, stacked) = lax.scan(body, list(init), list(xs), length=sc.length,
                                        reverse=sc.reverse, unroll=sc.unroll)
        for k, v in stacked.items():
            sides[k] = ctx.reducers[k](v)
        return list(carry) + list(ys)
    if name == "shard_map":
        sm = _jax.shard_map_layout(eqn)

        def per_shard(*a) -> tuple[tuple, dict]:
            inner_sides: dict = {}
            outs = run(sm.jaxpr, base, a, inner_sides)
            return tuple(outs), jax.tree.map(lambda x: x[None], inner_sides)

        outs, stacked = _jax.shard_map(per_shard, sm)(*invals)
        for k, v in stacked.items():
            sides[k] = ctx.reducers[k](v)
        return list(outs)
    if name == "while":
        wl = _jax.while_layout(eqn)
        cj, bj, cn, bn = wl.cond_jaxpr, wl.body_jaxpr, wl.cond_nconsts, wl.body_nconsts
        cconsts, bconsts, init = invals[:cn], invals[cn:cn + bn], invals[cn + bn:]
        body_base = base + ctx.program.plan(cj).total
        out = lax.while_loop(lambda c: run(cj, base, list(cconsts) + list(c), {})[0],
                             lambda c: run(bj, body_base, list(bconsts) + list(c), {}),
                             list(init))
        return list(out)
    if name == "cond":
        index, ops = invals[0], invals[1:]
        fns, b = [], base
        for br in _jax.cond_branches(eqn):
            fns.append(functools.partial(lambda j, bb, *a: run(j, bb, a, {}), br, b))
            b += ctx.program.plan(br).total
        return list(lax.switch(index, fns, *ops))
    raise PeatError(
        f"peat_jax cannot substitute inside a `{name}` equation (site index {base}): it has no "
        "rule to rebuild that container; select a site outside it")
