"""``peat.check_kernel``: a candidate kernel against its reference, forward and backward, on the
example inputs and adversarial variants of them (see `api`).

The package's public face is this module; its parts are the house:

* `variants`: the input variants (`make_variant`);
* `programs`: a callable's forward and VJP as one jitted program, two shapes as one;
* `running`: both callables on one variant, repeats, the reference in float64;
* `judging`: each output's comparison against the floors of `peat_jax.judge`, and the second
  looks a failing output gets (rounding floor, float64 run, reference spread, narrow format);
* `verdict`: the worst check, with where it came from;
* `api`: `check_kernel`.
"""
from peat_jax.check.api import check_kernel as check_kernel
from peat_jax.check.programs import PAIR_MAX_ELEMENTS as PAIR_MAX_ELEMENTS
from peat_jax.check.programs import VJP_FORWARD as VJP_FORWARD
from peat_jax.check.variants import VARIANTS as VARIANTS
from peat_jax.check.variants import make_variant as make_variant
# the floors' home is peat_jax.judge; these names stay here too (DESIGN.md, users' imports)
from peat_jax.judge.conditioning import CONDITIONING_PERTURBATIONS as CONDITIONING_PERTURBATIONS
from peat_jax.judge.conditioning import conditioning_spread as conditioning_spread
from peat_jax.judge.conditioning import perturb_inputs as perturb_inputs
from peat_jax.judge.conditioning import perturbation_spread as perturbation_spread
from peat_jax.judge.float64 import float64_evidence as float64_evidence
from peat_jax.judge.reference_spread import REFERENCE_SPREAD_FACTOR as REFERENCE_SPREAD_FACTOR

__all__ = ["CONDITIONING_PERTURBATIONS", "PAIR_MAX_ELEMENTS", "REFERENCE_SPREAD_FACTOR",
           "VARIANTS", "VJP_FORWARD", "check_kernel", "conditioning_spread", "float64_evidence",
           "make_variant", "perturb_inputs", "perturbation_spread"]
