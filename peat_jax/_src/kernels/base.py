"""The interface a candidate provides to plug into a site: `Kernel`.

A `Kernel` computes a site's outputs from its operands: `impl(*operands, **op_params)` for a
primitive site (the params are the op's, e.g. `dimension_numbers` for `dot_general`), or
`impl(*region_args)` for a composite site. Its reference is the XLA lowering of the same op.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax

from peat_jax._src.errors import PeatError


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A candidate implementation for a kind of site.

    Attributes:
      name: shown in reports and errors.
      impl: `impl(*operands, **op_params) -> output(s)` with the site's output shapes and dtypes
        (one array for a single-output op, a sequence otherwise).
      primitive: the primitive or region name it serves (e.g. `"dot_general"`), or None for any;
        substituting it elsewhere is an error.
      supports: optional `supports(site) -> None | str`: None if it can serve that site, else the
        reason it cannot (checked when the substitution is resolved, before anything runs).
      vjp: optional `vjp(operands, output, cotangent, **op_params) -> operand cotangents` for an
        `impl` that JAX cannot differentiate (a Pallas call, a callback, an FFI call); with it the
        kernel is wrapped in `jax.custom_vjp`. Without it, `impl` must be differentiable (or carry
        its own custom_vjp) wherever a gradient flows through the site.
      region: optional dotted name of the Flax module class or library function whose region
        sites it serves (``"flax.linen.LayerNorm"``): the command line intercepts it and sends
        the kernel there when no --sites is given.
    """

    name: str
    impl: Callable[..., Any]
    primitive: Optional[str] = None
    supports: Optional[Callable[[Any], Optional[str]]] = None
    vjp: Optional[Callable[..., Any]] = None
    region: Optional[str] = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise PeatError("peat.Kernel needs a non-empty name")
        if not callable(self.impl):
            raise PeatError(f"peat.Kernel {self.name!r}: impl must be callable, "
                            f"got {type(self.impl).__name__}")
        if self.vjp is not None and not callable(self.vjp):
            raise PeatError(f"peat.Kernel {self.name!r}: vjp must be callable")

    def check_site(self, site) -> Optional[str]:
        """None if this kernel may be used at `site`, else a one-line reason."""
        if self.primitive is not None and site.primitive != self.primitive:
            return (f"kernel {self.name!r} serves {self.primitive!r} sites, but site #{site.index} "
                    f"is {site.primitive!r}")
        if self.supports is not None:
            return self.supports(site)
        return None

    def __call__(self, *operands, **params):
        if self.vjp is None:
            return self.impl(*operands, **params)
        impl, vjp = self.impl, self.vjp

        @jax.custom_vjp
        def f(*ops):
            return impl(*ops, **params)

        def f_fwd(*ops):
            out = impl(*ops, **params)
            return out, (ops, out)

        def f_bwd(res, g):
            ops, out = res
            return tuple(vjp(ops, out, g, **params))

        f.defvjp(f_fwd, f_bwd)
        return f(*operands)
