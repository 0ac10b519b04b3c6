"""``peat.check_kernel``: a candidate kernel against its reference, forward and backward, on the
example inputs and adversarial variants of them (see `api`).

The package's public face is this module; its parts are the house:

* `variants`: the input variants (`make_variant`);
* `programs`: a callable's forward and VJP as one jitted program, two shapes as one;
* `running`: both callables on one variant, repeats, the reference in float64;
* `judging`: each output's comparison against the floors of `peat_jax._src.judge`, and the second
  looks a failing output gets (rounding floor, float64 run, reference spread, narrow format);
* `verdict`: the worst check, with where it came from;
* `api`: `check_kernel`.
"""
from peat_jax._src.check.api import check_kernel as check_kernel
from peat_jax._src.check.programs import PAIR_MAX_ELEMENTS as PAIR_MAX_ELEMENTS
from peat_jax._src.check.programs import VJP_FORWARD as VJP_FORWARD
from peat_jax._src.check.variants import VARIANTS as VARIANTS
from peat_jax._src.check.variants import make_variant as make_variant

__all__ = ["PAIR_MAX_ELEMENTS", "VARIANTS", "VJP_FORWARD", "check_kernel", "make_variant"]
