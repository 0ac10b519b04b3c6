"""Candidate kernels: the interface a candidate provides to plug into a site, and adapters.

A `Kernel` computes a site's outputs from its operands. Adapters turn a plain `matmul(a, b)`
(`dot_general`), an XLA FFI custom call in C++, CUDA or HIP (`ffi_kernel`, `ffi_matmul`), a NumPy
or PyTorch function (`numpy_kernel`, `torch_kernel`) or a Pallas call (`pallas_*`, and
`pallas_call` for a kernel of your own) into one; `references` holds the XLA references of the
bundled region kernels (softmax, layer norm, attention).

Which backend runs where: on the CPU the Pallas interpreter (plain, or the checked one with
`checks=InterpretChecks(...)`); on a GPU the bundled Pallas kernels are compiled through Triton,
on NVIDIA (CUDA) and AMD (ROCm) GPUs alike; `peat.lowers_for` says whether a kernel builds for a
GPU from a CPU machine.
"""
from peat_jax._src.kernels import references as references
from peat_jax._src.kernels.base import Kernel as Kernel
from peat_jax._src.kernels.ffi import build_cuda_library as build_cuda_library
from peat_jax._src.kernels.ffi import build_ffi_library as build_ffi_library
from peat_jax._src.kernels.ffi import build_rocm_library as build_rocm_library
from peat_jax._src.kernels.ffi import ffi_kernel as ffi_kernel
from peat_jax._src.kernels.ffi import ffi_matmul as ffi_matmul
from peat_jax._src.kernels.foreign import numpy_kernel as numpy_kernel
from peat_jax._src.kernels.foreign import torch_kernel as torch_kernel
from peat_jax._src.kernels.matmul import blocked_matmul as blocked_matmul
from peat_jax._src.kernels.matmul import dot_general as dot_general
from peat_jax._src.kernels.matmul import xla_matmul as xla_matmul
from peat_jax._src.kernels.pallas import InterpretChecks as InterpretChecks
from peat_jax._src.kernels.pallas import call as pallas_call
from peat_jax._src.kernels.pallas import flax_layer_norm as flax_layer_norm
from peat_jax._src.kernels.pallas import jax_pallas_layer_norm as jax_pallas_layer_norm
from peat_jax._src.kernels.pallas import jax_pallas_mha as jax_pallas_mha
from peat_jax._src.kernels.pallas import pallas_attention as pallas_attention
from peat_jax._src.kernels.pallas import pallas_layer_norm as pallas_layer_norm
from peat_jax._src.kernels.pallas import pallas_matmul as pallas_matmul
from peat_jax._src.kernels.pallas import pallas_softmax as pallas_softmax
from peat_jax._src.kernels.pallas import reset_interpret_state as reset_interpret_state

__all__ = [
    "InterpretChecks",
    "Kernel",
    "blocked_matmul",
    "build_cuda_library",
    "build_ffi_library",
    "build_rocm_library",
    "dot_general",
    "ffi_kernel",
    "ffi_matmul",
    "flax_layer_norm",
    "jax_pallas_layer_norm",
    "jax_pallas_mha",
    "numpy_kernel",
    "pallas_attention",
    "pallas_call",
    "pallas_layer_norm",
    "pallas_matmul",
    "pallas_softmax",
    "references",
    "reset_interpret_state",
    "torch_kernel",
    "xla_matmul",
]
