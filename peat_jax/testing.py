"""Test helpers for kernel authors: `assert_kernel_matches`, `format_diagnosis`, and the
``peat_check`` pytest fixture (registered by installing peat_jax; ``-p no:peat_jax`` turns it
off)."""
from peat_jax._src.testing import assert_kernel_matches as assert_kernel_matches
from peat_jax._src.testing import format_diagnosis as format_diagnosis

__all__ = ["assert_kernel_matches", "format_diagnosis"]
