"""Candidate kernels: the interface a candidate provides to plug into a site, and adapters.

A `Kernel` (see `peat_jax._src.kernels.base`) computes a site's outputs from its operands. Adapters
turn a plain `matmul(a, b)` (`dot_general`), an XLA FFI custom call in C++, CUDA or HIP (`ffi`), a
NumPy or PyTorch function (`foreign`) or a Pallas call (`pallas`) into one; `references` holds the
XLA references of the bundled region kernels.
"""
from peat_jax._src.kernels import ffi, foreign, pallas, references
from peat_jax._src.kernels.base import Kernel
from peat_jax._src.kernels.ffi import (build_cuda_library, build_ffi_library, build_rocm_library,
                                       ffi_kernel, ffi_matmul)
from peat_jax._src.kernels.foreign import numpy_kernel, torch_kernel
from peat_jax._src.kernels.matmul import blocked_matmul, dot_general, xla_matmul
from peat_jax._src.kernels.pallas import (InterpretChecks, flax_layer_norm, jax_pallas_layer_norm,
                                          jax_pallas_mha, pallas_attention, pallas_layer_norm,
                                          pallas_matmul, pallas_softmax)

__all__ = [
    "InterpretChecks",
    "Kernel",
    "blocked_matmul",
    "build_cuda_library",
    "build_ffi_library",
    "build_rocm_library",
    "dot_general",
    "ffi",
    "ffi_kernel",
    "ffi_matmul",
    "flax_layer_norm",
    "foreign",
    "jax_pallas_layer_norm",
    "jax_pallas_mha",
    "numpy_kernel",
    "pallas",
    "pallas_attention",
    "pallas_layer_norm",
    "pallas_matmul",
    "pallas_softmax",
    "references",
    "torch_kernel",
    "xla_matmul",
]
