"""Kernels that the CLI tests name as `cli_kernels:...` (module:attribute)."""
import jax
import jax.numpy as jnp

import peat_jax as peat


def _scaled(a, b, **params):
    return jax.lax.dot_general(a, b, **params) * jnp.asarray(1.5, a.dtype)


wrong_scale_matmul = peat.Kernel("wrong_scale_matmul", _scaled, primitive="dot_general")


def correct_matmul():
    return peat.Kernel("correct_matmul", lambda a, b, **p: jax.lax.dot_general(a, b, **p),
                       primitive="dot_general")
