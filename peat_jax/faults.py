"""Modelled pseudo-errors ("faults") applied at an op site as jittable transforms.

A `Fault` turns the golden output of one op into a faulty one:
``fault(reference, operands, key, site=None) -> array``, where ``reference(*operands)`` computes
the correct output (one array). Faults emulate hardware faults (bit flips, stuck bits, garbage
values) and kernel bugs (wrong scale, sign, layout, tile edges, reduced precision), and they
calibrate the detector: each fault's ``name`` is the error-model name of the taxonomy it should be
diagnosed as (see ``docs/design.md``), except ``stuck_at``, which the detector sees as ``bit_flip``.

Conventions shared by every fault:

* Pure and jittable: no Python branching on traced values and no host callbacks, so a fault works
  under `jax.jit`, `jax.vmap` and inside `lax.cond` / `lax.scan`. Under `vmap` the fault sees one
  example, so element indices and masks are per example.
* Seeded: everything random is derived from ``key`` (a `jax.random` key; the caller builds it from
  ``params["seed"]``; ``None`` or an ``int`` are accepted too and mean ``jax.random.key(seed)``).
  The same key gives the same pattern.
* The result has the reference output's shape and dtype. Bit-level faults work on the bit pattern
  with integer-only arithmetic (`lax.bitcast_convert_type` to an unsigned integer of the same
  width), so subnormals are handled exactly.
* Non-float outputs (integer, bool) are returned unchanged, and ``supports(site)`` says so.
* Element choice: ``index=None`` is a seeded random element; an ``int`` is a flat (row-major) index
  into the output (negative counts from the end); a ``tuple`` is a multi-dimensional index.
* ``supports(site)`` returns ``None`` when the fault is usable at the site, else a one-line reason.
  ``apply`` raises `PeatError` (a `ValueError`) for the same reasons when they make the fault
  impossible (an index out of range, a bit the dtype lacks, a shape the layout fault needs), and
  returns the reference unchanged when the fault is merely a no-op there (non-float output,
  precision already that narrow, nothing selected).
* Constructor arguments are validated eagerly; ``params`` holds them as JSON-able values, keyed by
  the constructor's argument names, so ``describe`` can print the call that made the fault.
"""
from peat_jax._src.faults.catalogue import ALL as ALL
from peat_jax._src.faults.catalogue import Fault as Fault
from peat_jax._src.faults.catalogue import bit_flip as bit_flip
from peat_jax._src.faults.catalogue import describe as describe
from peat_jax._src.faults.catalogue import low_precision_accumulation as low_precision_accumulation
from peat_jax._src.faults.catalogue import multi_bit_flip as multi_bit_flip
from peat_jax._src.faults.catalogue import nan_inf as nan_inf
from peat_jax._src.faults.catalogue import operand_corruption as operand_corruption
from peat_jax._src.faults.catalogue import permuted_layout as permuted_layout
from peat_jax._src.faults.catalogue import random_value as random_value
from peat_jax._src.faults.catalogue import reduced_precision as reduced_precision
from peat_jax._src.faults.catalogue import sign_flip as sign_flip
from peat_jax._src.faults.catalogue import stuck_at as stuck_at
from peat_jax._src.faults.catalogue import tile_boundary as tile_boundary
from peat_jax._src.faults.catalogue import wrong_scale as wrong_scale
from peat_jax._src.faults.catalogue import zeroed as zeroed

__all__ = [
    "ALL",
    "Fault",
    "bit_flip",
    "describe",
    "low_precision_accumulation",
    "multi_bit_flip",
    "nan_inf",
    "operand_corruption",
    "permuted_layout",
    "random_value",
    "reduced_precision",
    "sign_flip",
    "stuck_at",
    "tile_boundary",
    "wrong_scale",
    "zeroed",
]
