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


def _on_host(out, action):
    """`out` passed through a host callback that first does `action()` (runs when executed)."""
    import numpy as np

    def host(x):
        action()
        return np.asarray(x)

    return jax.pure_callback(host, jax.ShapeDtypeStruct(out.shape, out.dtype), out)


def _chaos(a, b, **params):
    """Correct except at the small vision workload's backward GEMMs: (10, 32) hangs for 1000 s,
    (32, 64) kills its process with SIGSEGV (what an out-of-bounds write in a native kernel does),
    (16, 64) hangs without ever releasing the GIL (a catastrophic regular expression), so not
    even the worker's own watchdog can run."""
    import os
    import re
    import signal
    import time
    out = jax.lax.dot_general(a, b, **params)
    if out.shape == (10, 32):
        return _on_host(out, lambda: time.sleep(1000))
    if out.shape == (32, 64):
        return _on_host(out, lambda: os.kill(os.getpid(), signal.SIGSEGV))
    if out.shape == (16, 64):
        return _on_host(out, lambda: re.match(r"(a+)+$", "a" * 64 + "b"))
    return out


hang_and_segfault_matmul = peat.Kernel("hang_and_segfault", _chaos, primitive="dot_general")


def tf32_matmul():
    """A matmul computing like a TF32 GPU kernel: its inputs rounded to TF32."""
    from peat_jax._src.formats import round_to_format

    def impl(a, b, **params):
        rounded = [x + jax.lax.stop_gradient(round_to_format(x, "tf32") - x) for x in (a, b)]
        return jax.lax.dot_general(*rounded, **params)

    return peat.Kernel("tf32_matmul", impl, primitive="dot_general")


def _racy(a, b, **params):
    """The corpus' split-K with the K grid axis marked "parallel" (two programs accumulate
    into one output block), run by the checked Pallas interpreter, whose race detector prints
    its report to stdout; and a print of its author's, left in."""
    from corpus.bugs import race_split_k

    print("racy_matmul: tracing")
    return race_split_k(a, b)


racy_matmul = peat.Kernel("racy_matmul", _racy, primitive="dot_general",
                          vjp=lambda ops, out, g, **p: (g @ ops[1].T, ops[0].T @ g))


# Ports of library functions, checked against them with `peat check KERNEL --reference REF`.

def softmax(x, axis=-1):
    """jax.nn.softmax as a NumPy user would write it (with jnp)."""
    e = jnp.exp(x - jnp.max(x, axis=axis, keepdims=True))
    return e / jnp.sum(e, axis=axis, keepdims=True)


def softmax_scaled(x, axis=-1):
    """A buggy port: 1% too large."""
    return softmax(x, axis) * jnp.asarray(1.01, x.dtype)


def layer_norm(x, eps=1e-6):
    """A torch-style port of jax.nn.standardize: its eps named `eps`, not `epsilon`."""
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps)


def attention(q, k, v, is_causal=False):
    """jax.nn.dot_product_attention's math on [batch, length, heads, head_dim] operands."""
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / jnp.sqrt(jnp.asarray(q.shape[-1], q.dtype))
    if is_causal:
        mask = jnp.tril(jnp.ones(s.shape[-2:], bool))
        s = jnp.where(mask, s, jnp.finfo(s.dtype).min)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)


def attention_without_mask(q, k, v, is_causal=False):
    """A buggy port: takes is_causal and ignores it."""
    return attention(q, k, v, is_causal=False)


def cross_entropy_integer_labels(logits, labels):
    """optax.softmax_cross_entropy_with_integer_labels, by hand."""
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked


def softmax_spec(seed):
    """A `--config` spec: the example args (drawn from `seed`) and the kwargs."""
    import numpy as np
    x = np.random.default_rng(seed).standard_normal((5, 6), np.float32)
    return {"args": (x,), "kwargs": {"axis": 0}}
