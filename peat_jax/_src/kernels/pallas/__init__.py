"""Bundled Pallas kernels as `peat.Kernel`s: interpreted on CPU, compiled on GPU.

Each kernel is a `jax.custom_vjp` whose forward and backward are Pallas calls with a grid and
block specs, so it can live inside a differentiated training step; its Pallas calls are one
jitted function per shapes (`interpret.lowered_once`), so a program that calls it twice on the
same shapes lowers them once. Factories:

* `pallas_matmul(block_m, block_n, block_k)`: any `dot_general` site;
* `pallas_softmax()`: a region `softmax(x)` over the last axis;
* `pallas_layer_norm(eps)`: a region `layer_norm(x, scale, bias)`; `flax_layer_norm(kernel)`
  adapts it to a Flax `nn.LayerNorm` region;
* `pallas_attention(causal)`: a region `attention(q, k, v)`, q/k/v `[batch, seq, heads, dim]`;
* `jax_pallas_layer_norm()`, `jax_pallas_mha(causal)`: jax's own shipped GPU Pallas kernels.

All take `interpret=None` (interpret exactly when the default backend is the CPU) and the
bundled ones `checks=` (the interpreter's race, uninitialised-memory and out-of-bounds checks;
see `peat_jax._src.kernels.pallas.interpret`).

Which backend runs where: on the CPU the Pallas interpreter (plain, or the checked one with
`checks=`); on a GPU the bundled kernels are compiled through Triton, which they ask for
explicitly (`jax.experimental.pallas.triton.CompilerParams`), on NVIDIA (CUDA) and AMD (ROCm)
GPUs alike. Mosaic GPU is not used: on jax 0.10.2 it cannot lower these kernels (`dot_general`,
unannotated `iota`) and it does not serve ROCm. jax's own kernels (`jax_pallas_*`) carry
Triton's parameters themselves. `compiling()` builds `interpret=None` kernels compiled on any
backend, which `peat.lowers_for` uses to lower them for a GPU on a CPU machine.
"""
from peat_jax._src.kernels.pallas.attention import attention, pallas_attention
from peat_jax._src.kernels.pallas.interpret import (InterpretChecks, call, compiling,
                                                    interpret_mode, races_found,
                                                    reset_interpret_state)
from peat_jax._src.kernels.pallas.jax_ops import jax_pallas_layer_norm, jax_pallas_mha
from peat_jax._src.kernels.pallas.layer_norm import flax_layer_norm, layer_norm, pallas_layer_norm
from peat_jax._src.kernels.pallas.matmul import matmul, pallas_matmul
from peat_jax._src.kernels.pallas.softmax import pallas_softmax, softmax

__all__ = [
    "InterpretChecks",
    "attention",
    "call",
    "compiling",
    "flax_layer_norm",
    "interpret_mode",
    "jax_pallas_layer_norm",
    "jax_pallas_mha",
    "layer_norm",
    "matmul",
    "pallas_attention",
    "pallas_layer_norm",
    "pallas_matmul",
    "pallas_softmax",
    "races_found",
    "reset_interpret_state",
    "softmax",
]
