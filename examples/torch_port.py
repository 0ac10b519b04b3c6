"""A cross-framework porting check: layer norm and GELU written in PyTorch, checked against the
XLA reference forward and backward (adversarial inputs included), then used inside a training step.

    pip install torch==2.13.0      # the `torch` extra
    python3 examples/torch_port.py

The PyTorch functions run through `jax.pure_callback`; their backward is torch.autograd's.
Takes about a minute on 2 CPU cores.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import optax
import torch

import peat_jax as peat


def torch_layer_norm(x, scale, bias):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], scale, bias, eps=1e-6)


def torch_gelu_tanh(x):  # what a port often gets subtly wrong: approximate="none" vs "tanh"
    return torch.nn.functional.gelu(x, approximate="tanh")


def torch_gelu_exact(x):
    return torch.nn.functional.gelu(x, approximate="none")


def jax_gelu(x):  # flax / jax default: the tanh approximation
    return jax.nn.gelu(x, approximate=True)


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(32)(x)
        scale = self.param("ln_scale", nn.initializers.ones, (32,))
        bias = self.param("ln_bias", nn.initializers.zeros, (32,))
        h = peat.region("layer_norm")(peat.kernels.references.layer_norm)(h, scale, bias)
        h = peat.region("gelu")(jax_gelu)(h)
        return nn.Dense(10)(h)


def main() -> None:
    x = jax.random.normal(jax.random.key(0), (16, 32))
    scale = 1.0 + 0.1 * jax.random.normal(jax.random.key(1), (32,))
    bias = 0.1 * jax.random.normal(jax.random.key(2), (32,))

    ln = peat.kernels.torch_kernel(torch_layer_norm, name="torch_layer_norm")
    d = peat.check_kernel(ln, peat.kernels.references.layer_norm, x, scale, bias)
    print(f"torch layer_norm vs XLA: {d.summary}")
    for name, fn in (("gelu(approximate='tanh')", torch_gelu_tanh),
                     ("gelu(approximate='none')", torch_gelu_exact)):
        d = peat.check_kernel(peat.kernels.torch_kernel(fn, name=name), jax_gelu, x)
        print(f"torch {name} vs jax.nn.gelu: {d.summary}")

    # inside training: the torch ops replace the marked regions, forward and backward
    model = Net()
    params = model.init(jax.random.key(3), x)
    y = jax.random.randint(jax.random.key(4), (16,), 0, 10)
    tx = optax.adam(1e-2)

    def train_step(state, batch):
        params, opt = state
        loss, g = jax.value_and_grad(
            lambda p: optax.softmax_cross_entropy_with_integer_labels(model.apply(p, batch[0]),
                                                                      batch[1]).mean())(params)
        upd, opt = tx.update(g, opt, params)
        return (optax.apply_updates(params, upd), opt), {"loss": loss}

    state = (params, tx.init(params))
    ported = jax.jit(peat.substitute(train_step, {
        "layer_norm": peat.Kernel("torch_layer_norm", ln),
        "gelu": peat.Kernel("torch_gelu", peat.kernels.torch_kernel(torch_gelu_tanh))}))
    golden = jax.jit(train_step)
    s0 = s1 = state
    worst = 0.0
    for _ in range(20):
        s0, m0 = golden(s0, (x, y))
        s1, m1 = ported(s1, (x, y))
        worst = max(worst, abs(float(m0["loss"]) - float(m1["loss"])))
    print(f"20 training steps with the torch ops: final loss {float(m1['loss']):.5f} "
          f"(golden {float(m0['loss']):.5f}), max per-step difference {worst:.2e}")


if __name__ == "__main__":
    main()
