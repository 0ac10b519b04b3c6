"""The regions traced in this process: their ids, what is known of each, and how a traced call of
one is recognised in a jaxpr.

`regions` registers regions (`peat.region`, `peat.flax_regions`, and the calls of library
functions under `peat.intercept`) and names their calls with `call_name`; `_interpreter`
recognises those calls with `region_of`. Both build on this module, which imports neither.
"""
from __future__ import annotations

import dataclasses
import re
import threading
from typing import Any, Callable, Hashable, Optional

import jax


REGION_PREFIX = "peat_region__"
REGION_BWD_PREFIX = "peat_region_bwd__"
_CALL_RE = re.compile(r"peat_region(_bwd)?__(\w+)__r(\d+)$")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# (name, is_backward, region id) of one traced region call
Region = tuple[str, bool, int]


@dataclasses.dataclass
class RegionInfo:
    """What the tracer knows of one region signature: its name and argument/result trees.

    `function` is set for the call of a library function intercepted by `peat.intercept`: a
    `peat_jax._src.regions.FunctionCall`, which rebuilds the call's arguments from the region's (its
    array arguments, in order) and calls a kernel as the library function is called."""

    name: str
    in_tree: Any
    in_avals: tuple
    out_tree: Optional[Any] = None
    out_avals: Optional[tuple] = None
    fwd: Optional[Callable] = None
    bwd: Optional[Callable] = None
    function: Optional[Any] = None


_LOCK = threading.Lock()
_REGISTRY: list[RegionInfo] = []
_INDEX: dict[Hashable, int] = {}


def register(key: Hashable, info: RegionInfo, build: Callable[[int, RegionInfo], None]) -> int:
    """The id of the region registered under `key`; a new key registers `info` and calls
    `build(id, info)` once, under the registry's lock (ids are stable within a process)."""
    with _LOCK:
        rid = _INDEX.get(key)
        if rid is None:
            rid = len(_REGISTRY)
            _REGISTRY.append(info)
            _INDEX[key] = rid
            build(rid, info)
    return rid


def region_info(region_id: int) -> RegionInfo:
    """The registered region with this id."""
    return _REGISTRY[region_id]


def is_region_name(name: Any) -> bool:
    """True for a valid region name: an identifier, so that `call_name` can carry it."""
    return isinstance(name, str) and _NAME_RE.match(name) is not None


def call_name(name: str, region_id: int, backward: bool) -> str:
    """The name of the jitted function whose call `region_of` recognises as this region (a
    dotted name such as `jax.nn.dot_product_attention` is spelled with `_` for `.`)."""
    spelled = re.sub(r"\W", "_", name)
    return f"{REGION_BWD_PREFIX if backward else REGION_PREFIX}{spelled}__r{region_id}"


def region_of(eqn) -> Optional[Region]:
    """(name, is_backward, id) when `eqn` is a whole call of a peat region, else None; the
    name is the region's own, as registered (dots included)."""
    if eqn.primitive.name not in ("jit", "pjit"):
        return None
    m = _CALL_RE.search(str(eqn.params.get("name", "")))
    if m is None:
        return None
    rid = int(m.group(3))
    if rid >= len(_REGISTRY):
        return None
    region = _REGISTRY[rid].name, m.group(1) is not None, rid
    return region if is_whole_region(eqn, region) else None


def _types(atoms) -> tuple:
    return tuple((tuple(a.aval.shape), a.aval.dtype) for a in atoms)


def is_whole_region(eqn, region: Region) -> bool:
    """True when `eqn` is a complete call of the region (not a fragment that partial evaluation
    split off under `remat`/`scan`): its operand and result types are the region's own."""
    _, is_bwd, rid = region
    if rid >= len(_REGISTRY):
        return False
    info = _REGISTRY[rid]
    if info.out_avals is None:
        return False
    ins = tuple((tuple(a.shape), a.dtype) for a in info.in_avals)
    outs = tuple((tuple(a.shape), a.dtype) for a in info.out_avals)
    if is_bwd:
        float0 = jax.dtypes.float0
        ins, outs = ins + outs, tuple(
            (s, d if jax.numpy.issubdtype(d, jax.numpy.inexact) else float0) for s, d in ins)
    try:
        return _types(eqn.invars) == ins and _types(eqn.outvars) == outs
    except AttributeError:
        return False
