"""Analyzer: device-side statistics of a candidate output against the golden (``peat.analyze``).

``analyze(candidate, golden, reference64=None)`` compares two arrays (or two pytrees of arrays)
and returns a `Signature`: the numbers the detector (``peat.detect``) decides an error model from.
Everything is computed inside one jitted function per leaf (per shapes, dtypes and options);
only the summary comes back to the host (a few hundred numbers, plus, when errors exist, the
count of significant errors per index of the last two axes), never a full tensor.

Definitions used throughout (per leaf; ``c`` candidate, ``g`` golden, ``r`` float64 reference):

* **mismatched**: the bit patterns differ (two NaNs count as equal, ``+0`` vs ``-0`` mismatch).
  Bit tests are integer-only (`lax.bitcast_convert_type`), never float compares: on XLA:CPU a
  jitted float compare treats subnormals as zero.
* **ULP distance**: floats are mapped to a monotonic integer line (``+x`` -> its magnitude bits,
  ``-x`` -> minus them, so ``+0`` and ``-0`` both map to 0) and the distance is the integer
  difference, in units in the last place of the golden's dtype. Exact, including subnormals and
  infinities (NaNs are excluded).
* **noise floor** (per element, output units): how far the candidate may be from the truth and
  still count as rounding noise; see `NoiseFloor`. An element is **significant** when it is
  mismatched and its error exceeds the floor, or when a non-finite value differs.
* **sample**: histograms, quantiles, bias, ratio and precision statistics are exact for leaves of
  at most ``sample_size`` elements (default 8192); larger leaves use a deterministic strided
  sample of that many elements (odd stride, so it visits every column of a power-of-two-wide
  matrix). Counts, maxima, the worst elements and the spatial structure are always exact over
  the whole leaf.

The package's layout (what runs on the device, what on the host, and the contract between them)
is described in ``README.md`` beside this file.
"""
from __future__ import annotations

from peat_jax._src.analyzer import device
from peat_jax._src.analyzer.api import analyze, compile_ahead
from peat_jax._src.analyzer.noise import (DEFAULT_NOISE_FACTOR, DEFAULT_REDUCTION_LENGTH,
                                          DISTRIBUTION_ALLOWANCE, DISTRIBUTION_MIN_ELEMENTS,
                                          DTYPE_ULP_ALLOWANCE, FLOAT_DTYPES, NOISE_FREE_SHARE,
                                          REFERENCE_ULP_ALLOWANCE, ConditioningFloor, NoiseFloor,
                                          RoundingFloor, dtype_noise_bound)
from peat_jax._src.analyzer.signature import (BLOCK_SIZES, DEFAULT_SAMPLE_SIZE, MAX_PERIOD, N_WORST,
                                              PERMUTATION_MAX_ELEMENTS, QUANTILES, Bits, BlockMatch,
                                              Counts, Errors, Permutation, Precision, Ratio,
                                              Signature, Structure, WorstElement)

__all__ = [
    "BLOCK_SIZES",
    "Bits",
    "BlockMatch",
    "ConditioningFloor",
    "Counts",
    "DEFAULT_NOISE_FACTOR",
    "DEFAULT_REDUCTION_LENGTH",
    "DEFAULT_SAMPLE_SIZE",
    "DISTRIBUTION_ALLOWANCE",
    "DISTRIBUTION_MIN_ELEMENTS",
    "DTYPE_ULP_ALLOWANCE",
    "Errors",
    "FLOAT_DTYPES",
    "MAX_PERIOD",
    "NOISE_FREE_SHARE",
    "N_WORST",
    "NoiseFloor",
    "PERMUTATION_MAX_ELEMENTS",
    "Permutation",
    "Precision",
    "QUANTILES",
    "REFERENCE_ULP_ALLOWANCE",
    "Ratio",
    "RoundingFloor",
    "Signature",
    "Structure",
    "WorstElement",
    "analyze",
    "compile_ahead",
    "device",
    "dtype_noise_bound",
]
