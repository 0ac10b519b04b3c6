"""The floors a candidate is judged against, beside the noise floor the analyzer computes.

`rounding`: the rounding floor, Monte Carlo arithmetic on the reference's float64 shadow (the
spread of correct roundings of the reference's algorithm at the candidate's precision).
"""
from peat_jax._src.judge.rounding import ROUNDING_SAMPLES as ROUNDING_SAMPLES
from peat_jax._src.judge.rounding import monte_carlo as monte_carlo
from peat_jax._src.judge.rounding import rounding_samples as rounding_samples

__all__ = ["ROUNDING_SAMPLES", "monte_carlo", "rounding_samples"]
