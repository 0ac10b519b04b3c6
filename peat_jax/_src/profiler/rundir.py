"""The run directory on disk: manifest, Orbax checkpoints, golden metrics, campaigns.

Layout:
  manifest.json               workload, config, seeds, versions, backend, device kind, and the
                               numerical `environment` (matmul precision, XLA_FLAGS, x64, CUDA)
  checkpoints/<step>/          Orbax checkpoints of the full train state before step <step>
  golden/metrics.jsonl         one JSON object per training step: {"step": i, "loss": ..., ...}
  golden/checkpoints.json      the run each checkpoint belongs to (workload, config, seed,
                               checkpoint interval) and a SHA-256 of each checkpoint's state, so a
                               damaged checkpoint or a manifest from another run is an error, not
                               silently different numbers
  golden/eval.json             held-out metrics of the final golden state
  golden/site_stats/           per-site statistics (profile(stats_every=K)): sites.json and
                               pickle-free <first>-<last>.npz files, each the statistics steps
                               between two checkpoints (at most CHUNK_STEPS of them; see
                               site_stats.py; runs profiled before hold one <step>.npz a step)
  campaigns/<name>/...         playback and runtime results; while a named runtime run is
                               unfinished, runtime.partial.json (its spec and progress) and
                               runtime-state/<step>/ (Orbax checkpoints of its injected state at
                               the last chunk ends), removed when runtime.json is written
  .lock, campaigns/<name>/.lock[.p<i>-of-<n>]
                               while a golden run / a campaign (or one process's share of it) /
                               a named runtime run writes: its holder (pid, host, start time,
                               command), under an advisory flock; see `peat_jax._src.profiler.lock`

Only JSON, Orbax and pickle-free `.npz` are written; nothing is ever unpickled. JSON files are
written atomically (temporary file + rename); JSONL files are appended line by line and a torn
last line (from a kill mid-write) is dropped on reading; a damaged line elsewhere is skipped with a
warning (or is an error with `strict=True`), and is never rewritten. An IO failure while a run
writes (a full disk, a read-only directory) is a one-line PeatError saying what failed and how to
resume (`peat_jax._src.profiler.ioerrors`).
"""
from __future__ import annotations

import json
import os
import pathlib
import platform
import tempfile
import warnings
from typing import IO, Any, Callable, Iterable, Mapping, Optional, Union

import jax

from peat_jax._src import _jax
from peat_jax._src.errors import PeatError
from peat_jax._src.precision import current_matmul_precision


MANIFEST = "manifest.json"
# the manifest keys that say which run a directory holds (not "steps": a run may be extended)
IDENTITY = ("workload", "config", "seed", "checkpoint_every")
FORMAT = 1
PathLike = Union[str, os.PathLike]


def _json_default(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    return repr(x)


def to_json(obj: Any) -> str:
    """`obj` as compact JSON; NaN/Inf kept as JSON's `NaN`/`Infinity` (Python's json reads them)."""
    return json.dumps(obj, default=_json_default, separators=(",", ":"), sort_keys=False)


def atomic_write(path: PathLike, write: Callable[[IO], None], *, binary: bool = False) -> None:
    """Write `path` by `write(file)` into a temporary file beside it, synced, then renamed over
    it: readers see the old file or the whole new one, never a half file (the temporary file is
    removed if `write` raises)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_json(path: PathLike, obj: Any, *, indent: Optional[int] = 2) -> None:
    """Write `obj` as JSON to `path` (`atomic_write`); `indent=None`: compact (no whitespace)."""
    def write(f):
        json.dump(obj, f, indent=indent, default=_json_default,
                  separators=None if indent is not None else (",", ":"))
        f.write("\n")

    atomic_write(path, write)


def _drop_torn_tail(path: pathlib.Path) -> None:
    """Cut a last line that has no newline (a write killed midway), so appends start clean."""
    if not path.exists():
        return
    with open(path, "rb+") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        data = f.read()
        f.truncate(data.rfind(b"\n") + 1)


def append_jsonl(path: PathLike, records: Iterable[Mapping[str, Any]]) -> None:
    """Append one line per record and fsync, so a finished line survives a kill. A torn last
    line left by an earlier kill is cut first."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _drop_torn_tail(path)
    with open(path, "a") as f:
        for r in records:
            f.write(to_json(r) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: PathLike, *, strict: bool = False) -> list[dict]:
    """The records of a JSONL file. A torn last line (no newline: a write killed midway) is
    dropped silently. A damaged line elsewhere (not a JSON object, or not UTF-8) raises a
    PeatError naming the file and line when `strict`; otherwise it is skipped with a warning
    naming them (a playback campaign then recomputes the cell that line held). The file itself
    is never modified here."""
    path = pathlib.Path(path)
    if not path.exists():
        return []
    out = []
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    last = len(lines) - 1  # the bytes after the final newline: empty, or a torn line
    for i, raw in enumerate(lines):
        if i == last or not raw.strip():
            continue
        try:
            rec = json.loads(raw.decode("utf-8"))
            if not isinstance(rec, dict):
                raise ValueError("not an object")
        except ValueError:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            if strict:
                raise PeatError(f"{path}: line {i + 1} is not a JSON object; the file is damaged: "
                                "move it away to start that record afresh") from None
            warnings.warn(f"{path}: line {i + 1} is not a JSON object (damaged); skipped",
                          stacklevel=2)
            continue
        out.append(rec)
    return out


def rewrite_jsonl(path: PathLike, records: Iterable[Mapping[str, Any]]) -> None:
    """Replace a JSONL file atomically (`atomic_write`)."""
    records = list(records)
    atomic_write(path, lambda f: f.writelines(to_json(r) + "\n" for r in records))


def run_identity(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a manifest that says which run it describes (workload, config, seed,
    checkpoint interval)."""
    return {k: manifest.get(k) for k in IDENTITY}


def environment() -> dict[str, Any]:
    """What the numbers of a run depend on besides its code, for the manifest's
    ``environment``: ``jax_default_matmul_precision`` (canonical name, None when unset: XLA's
    default, TF32 for float32 dots on recent NVIDIA GPUs), ``xla_flags`` (the XLA_FLAGS in
    force, "" when none), ``x64`` (jax_enable_x64), ``backend``, ``device_kind``, and on a GPU
    ``cuda_version`` / ``cudnn_version`` (integers, e.g. 12080; None where jaxlib does not say)
    and ``compute_capability``. Call it inside the run's `jax.default_matmul_precision`."""
    dev = jax.devices()[0]
    env = {"jax_default_matmul_precision": current_matmul_precision(),
           "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "x64": _jax.x64_enabled(),
           "backend": jax.default_backend(),
           "device_kind": getattr(dev, "device_kind", str(dev))}
    if env["backend"] == "gpu":
        env.update(_jax.cuda_versions())
        env["compute_capability"] = getattr(dev, "compute_capability", None)
    return env


def recorded_precision(manifest: Mapping[str, Any]) -> Optional[str]:
    """The matmul precision a golden run trained at (its manifest's environment), for replays:
    None for a run that did not set one (or was written before the manifest recorded it)."""
    return (manifest.get("environment") or {}).get("jax_default_matmul_precision")


def platform_info() -> dict[str, Any]:
    """Package versions, Python's version and the device count, for the manifest's top level
    (which also repeats `environment`'s backend and device kind)."""
    import importlib.metadata as md

    def version(pkg: str) -> Optional[str]:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    return {
        "versions": {p: version(p) for p in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint",
                                             "numpy", "peat_jax")},
        "python": platform.python_version(),
        "device_count": jax.device_count(),
    }


class MissingCheckpoint(PeatError):
    """A checkpoint asked for is not in the run directory (never saved, or removed: also while
    a replay was reading it)."""


class RunDir:
    """Paths and safe reads/writes of one run directory."""

    def __init__(self, path: PathLike, *, create: bool = False):
        self.path = pathlib.Path(path)
        if create:
            try:
                self.path.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise PeatError(f"cannot create run directory {self.path}: {e.strerror}; "
                                "choose a writable location") from None
            if not os.access(self.path, os.W_OK):
                raise PeatError(f"run directory {self.path} is not writable; choose another")
        elif not self.path.is_dir():
            raise PeatError(f"run directory {self.path} does not exist; make one with "
                            "peat.profile(workload, run_dir, ...) (or `peat profile`)")

    manifest_path = property(lambda self: self.path / MANIFEST)
    checkpoints = property(lambda self: self.path / "checkpoints")
    metrics_path = property(lambda self: self.path / "golden" / "metrics.jsonl")
    eval_path = property(lambda self: self.path / "golden" / "eval.json")
    checkpoint_record_path = property(lambda self: self.path / "golden" / "checkpoints.json")
    site_stats = property(lambda self: self.path / "golden" / "site_stats")

    def campaign(self, name: str) -> pathlib.Path:
        if not name or "/" in name or name.startswith("."):
            raise PeatError(f"campaign name {name!r} must be a plain file name")
        return self.path / "campaigns" / name

    def has_manifest(self) -> bool:
        return self.manifest_path.exists()

    def manifest(self) -> dict[str, Any]:
        """The manifest, validated; a clear error if it is missing or damaged."""
        p = self.manifest_path
        if not p.exists():
            raise PeatError(f"{p} is missing: {self.path} is not a peat run directory (or its "
                            "golden run never started); run peat.profile into it first")
        try:
            m = json.loads(p.read_text())
        except (ValueError, OSError) as e:
            raise PeatError(f"{p} is damaged ({e}); restore it or profile into a new "
                            "directory") from None
        for key in IDENTITY:
            if not isinstance(m, dict) or key not in m:
                raise PeatError(f"{p} lacks {key!r}: not a manifest written by peat_jax")
        record = self.checkpoint_record()
        if record is not None and "run" in record:
            ours, theirs = run_identity(m), record["run"]
            for key in IDENTITY:
                if ours[key] != theirs.get(key):
                    raise PeatError(
                        f"{p} does not describe the checkpoints in {self.checkpoints}: {key} "
                        f"differs (manifest: {ours[key]!r}, checkpoints: {theirs.get(key)!r}); "
                        "put back the run's own manifest.json or profile into a new directory")
        return m

    def checkpoint_record(self) -> Optional[dict[str, Any]]:
        """`golden/checkpoints.json`: {"run": identity, "sha256": {step: digest}}, or None for a
        run directory written before it existed. A damaged record is a PeatError."""
        p = self.checkpoint_record_path
        if not p.exists():
            return None
        try:
            rec = json.loads(p.read_text())
            if not (isinstance(rec, dict) and isinstance(rec.get("sha256", {}), dict)):
                raise ValueError("not a checkpoint record")
        except (ValueError, OSError) as e:
            raise PeatError(f"{p} is damaged ({e}); restore it, or delete it to use the "
                            "checkpoints without verifying them") from None
        return rec

    def write_checkpoint_record(self, record: Mapping[str, Any]) -> None:
        atomic_write_json(self.checkpoint_record_path, dict(record))

    def write_manifest(self, manifest: Mapping[str, Any]) -> None:
        atomic_write_json(self.manifest_path, dict(manifest))

    def golden_metrics(self, upto: Optional[int] = None) -> list[dict]:
        """Golden per-step metrics in step order (one record per step), of steps < `upto` if
        given. A step missing before the last one recorded (a damaged line) is a PeatError: a
        golden curve with a hole would misalign every comparison against it."""
        recs = read_jsonl(self.metrics_path)
        by_step = {}
        for r in recs:
            if isinstance(r.get("step"), int) and (upto is None or r["step"] < upto):
                by_step[r["step"]] = r
        steps = sorted(by_step)
        missing = sorted(set(range(steps[-1] + 1)) - set(steps)) if steps else []
        if missing:
            shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
            raise PeatError(f"{self.metrics_path} lacks the golden metrics of step(s) {shown} "
                            "(damaged lines); restore the file or profile into a new directory")
        return [by_step[s] for s in steps]

    def golden_losses(self) -> list[float]:
        return [float(r["loss"]) for r in self.golden_metrics()]

