"""Modelled pseudo-errors: the catalogue (`catalogue.py`) and the machinery its faults share
(`machinery.py`). The public namespace, with the conventions every fault keeps, is
`peat_jax.faults`."""

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

__all__ = ["ALL", "Fault", "bit_flip", "describe", "low_precision_accumulation",
           "multi_bit_flip", "nan_inf", "operand_corruption", "permuted_layout", "random_value",
           "reduced_precision", "sign_flip", "stuck_at", "tile_boundary", "wrong_scale", "zeroed"]
