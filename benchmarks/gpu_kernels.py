"""Kernels nobody here wrote, as `peat` CLI arguments for benchmarks/gpu_check.sh: jax's own
shipped Pallas GPU ops (`jax.experimental.pallas.ops.gpu`), each with its own Pallas backward,
compiled through Triton on a GPU and interpreted on a CPU (see `peat.kernels.jax_pallas_mha`).

  peat check benchmarks/gpu_kernels.py:causal_mha \\
      --reference benchmarks/gpu_kernels.py:causal_attention --shapes 2x256x4x64 (three times)
  peat playback RUN --kernel benchmarks/gpu_kernels.py:layer_norm --sites flax.linen.LayerNorm
"""
import jax

import peat_jax as peat


def causal_mha() -> peat.Kernel:
    """`ops.gpu.attention.mha`, causal, blocks of 64 (`[batch, seq, heads, head_dim]`)."""
    return peat.kernels.jax_pallas_mha(causal=True, block_q=64, block_k=64)


def causal_attention(q, k, v):
    """The XLA reference `causal_mha` must match."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def layer_norm() -> peat.Kernel:
    """`ops.gpu.layer_norm.layer_norm` at each `flax.linen.LayerNorm` (Flax's eps, 1e-6)."""
    return peat.kernels.flax_layer_norm(peat.kernels.jax_pallas_layer_norm())
