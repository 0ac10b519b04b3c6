"""List and substitute op sites in any JAX function: a Flax linen `apply`, an Equinox model and a
plain-JAX function, forward and backward.

    python3 examples/sites_and_substitution.py

Takes a few seconds on CPU.
"""
from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp

import peat_jax as peat


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.LayerNorm()(nn.Dense(32)(x))
        return nn.Dense(10)(jax.nn.gelu(x))


def main() -> None:
    x = jax.random.normal(jax.random.key(0), (8, 16))
    y = jax.random.randint(jax.random.key(1), (8,), 0, 10)

    # 1. Flax linen: the loss's value_and_grad holds the forward and the backward pass
    model = MLP()
    params = model.init(jax.random.key(2), x)

    def loss(params, x, y):
        logits = model.apply(params, x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

    vg = jax.value_and_grad(loss)
    sites = peat.list_sites(vg, params, x, y, regions=(nn.LayerNorm,))
    print(f"Flax MLP: {len(sites)} sites")
    print(peat.format_sites([s for s in sites if s.primitive in ("dot_general", "LayerNorm")]))

    # a candidate matmul at every backward GEMM, and a fault at one forward site
    kernel = peat.kernels.blocked_matmul(block_k=4)
    v0, g0 = jax.jit(vg)(params, x, y)
    v1, g1 = jax.jit(peat.substitute(vg, {"bwd:dot_general": kernel}))(params, x, y)
    diff = max(float(jnp.max(jnp.abs(a - b)))
               for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)))
    print(f"blocked_matmul at backward GEMMs: loss {float(v1):.6f} (golden {float(v0):.6f}), "
          f"max grad difference {diff:.2e}")
    v2, _ = jax.jit(peat.substitute(vg, {"fwd:MLP/Dense_1": peat.faults.sign_flip()}))(params, x, y)
    print(f"sign flip at the head's forward GEMM: loss {float(v2):.4f}")

    # 2. Equinox: the same calls on an eqx model
    mlp = eqx.nn.MLP(16, 10, 32, 2, key=jax.random.key(3))
    p, static = eqx.partition(mlp, eqx.is_array)

    def eqx_loss(p, x):
        return jnp.mean(jax.vmap(eqx.combine(p, static))(x) ** 2)

    eqx_sites = peat.list_sites(jax.grad(eqx_loss), p, x)
    dots = [s for s in eqx_sites if s.primitive == "dot_general"]
    print(f"Equinox MLP: {len(eqx_sites)} sites, {len(dots)} GEMMs "
          f"({sum(s.phase == 'bwd' for s in dots)} backward)")

    # 3. plain jax, with a site chosen by a traced integer: one compile for the sweep
    def f(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    w = jax.random.normal(jax.random.key(4), (16, 16))
    grad_f = jax.grad(f)
    sw = jax.jit(peat.switched(grad_f, {"dot_general": peat.faults.wrong_scale(2.0)}))
    golden = sw(-1, w, x)
    for s in peat.list_sites(grad_f, w, x):
        if s.primitive == "dot_general":
            d = float(jnp.max(jnp.abs(sw(s.index, w, x) - golden)))
            print(f"  wrong_scale(2) at {s}: max grad change {d:.3g}")
    print(f"  ({sw._cache_size()} compile for the sweep)")


if __name__ == "__main__":
    main()
