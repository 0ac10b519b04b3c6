"""Detector: from a `Signature` to a `Diagnosis` (``peat.detect``).

The package's face is this module. Its parts: `rules` (the catalogue: `RULES`, each rule's
sufficient condition in its docstring, and `detect`), `float64` (the rules over the candidate's
own float64 run, `by_float64`), `by_variant` (the rules over which of `check_kernel`'s input
variants fail: `only_on_odd_shapes`, `only_near_overflow`, `beyond_training_range`,
`swamped_by_outliers`) and `machinery` (the `Diagnosis` and `Rule` types, helpers over a
signature, the phrasing of summaries, `narrowed` and `severity`).
The floors a signature is built with live in `peat_jax._src.judge`.
"""
from peat_jax._src.detector.by_variant import TRAINING_RANGE_LOG2 as TRAINING_RANGE_LOG2
from peat_jax._src.detector.by_variant import beyond_training_range as beyond_training_range
from peat_jax._src.detector.by_variant import only_near_overflow as only_near_overflow
from peat_jax._src.detector.by_variant import only_on_odd_shapes as only_on_odd_shapes
from peat_jax._src.detector.by_variant import swamped_by_outliers as swamped_by_outliers
from peat_jax._src.detector.float64 import FLOAT64_RULES as FLOAT64_RULES
from peat_jax._src.detector.float64 import UNSTABLE_FACTOR as UNSTABLE_FACTOR
from peat_jax._src.detector.float64 import Float64Evidence as Float64Evidence
from peat_jax._src.detector.float64 import by_float64 as by_float64
from peat_jax._src.detector.machinery import Diagnosis as Diagnosis
from peat_jax._src.detector.machinery import Rule as Rule
from peat_jax._src.detector.machinery import format_phrase as format_phrase
from peat_jax._src.detector.machinery import narrowed as narrowed
from peat_jax._src.detector.machinery import severity as severity
from peat_jax._src.detector.rules import CHECK_MODELS as CHECK_MODELS
from peat_jax._src.detector.rules import MODELS as MODELS
from peat_jax._src.detector.rules import PASSING as PASSING
from peat_jax._src.detector.rules import RULES as RULES
from peat_jax._src.detector.rules import bitwise_equal as bitwise_equal
from peat_jax._src.detector.rules import data_race as data_race
from peat_jax._src.detector.rules import detect as detect

__all__ = ["CHECK_MODELS", "Diagnosis", "FLOAT64_RULES", "Float64Evidence", "MODELS", "PASSING",
           "RULES", "Rule", "TRAINING_RANGE_LOG2", "UNSTABLE_FACTOR", "beyond_training_range",
           "bitwise_equal", "by_float64", "data_race",
           "detect", "format_phrase", "narrowed", "only_near_overflow", "only_on_odd_shapes",
           "severity", "swamped_by_outliers"]
