"""Between the host and a run: batches onto the device, Orbax's logging kept quiet."""
from __future__ import annotations

import logging
import pathlib
import sys
import threading
import traceback
from typing import Any

import jax
import jax.numpy as jnp


class _ThreadFailures(logging.Filter):
    """Drops Orbax's report of an exception in one of its worker threads (with its traceback):
    the same exception is raised in the thread that waits for the save, whose caller says it
    in one line (a full disk logged one traceback per thread)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "_SignalingThread.run() raised an exception" not in record.getMessage()


_THREAD_FAILURES = _ThreadFailures()


class _ClosedLoopReports:
    """sys.stderr without tensorstore's reports of a write that finished after Orbax closed its
    event loop: when a save fails (a full disk), Orbax's loop stops at the first error and each
    of tensorstore's other writes, finishing later on a thread of its own (not started by
    Python), prints a traceback ending in "RuntimeError: Event loop is closed" (31 of them for
    one full disk). The error itself reaches the caller, who says it in one line. Everything
    else, and anything written by Python's own threads, passes through unchanged."""

    _CLOSED = "RuntimeError: Event loop is closed"

    def __init__(self, stream):
        self.stream = stream
        self._held = threading.local()

    def write(self, text: str) -> int:
        held = getattr(self._held, "lines", None)
        if held is None:
            if not (text.startswith("Traceback (most recent call last):")
                    and isinstance(threading.current_thread(), threading._DummyThread)):
                return self.stream.write(text)
            held = self._held.lines = []
        held.append(text)
        report = "".join(held)
        last = report.rstrip("\n").rsplit("\n", 1)[-1]
        if report.endswith("\n") and last and not last.startswith((" ", "Traceback")):
            self._held.lines = None   # the report's last line, the exception: complete
            if last != self._CLOSED:
                self.stream.write(report)
        return len(text)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def _drop_closed_loop_reports() -> None:
    if not isinstance(sys.stderr, _ClosedLoopReports):
        sys.stderr = _ClosedLoopReports(sys.stderr)


class _AbandonedTensorstoreIO(logging.Filter):
    """Drops asyncio's "exception was never retrieved" report (with its traceback) of a
    tensorstore read or write that Orbax gathered and then abandoned when another one failed
    first (a full disk, a damaged checkpoint): the failure that stopped Orbax reaches the
    caller, who says it in one line; the abandoned ones are the same failure, once per array."""

    _IO = ("while reading array index", "Error writing", "OCDBT database")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("exception was never retrieved" in message
                    and any(s in message for s in self._IO))


ABANDONED_IO = _AbandonedTensorstoreIO()


def drop_abandoned_io_reports() -> None:
    """From now on, for the rest of the process (the reports come when the futures are
    collected, often at exit), drop asyncio's reports of abandoned tensorstore IO."""
    asyncio_log = logging.getLogger("asyncio")
    if ABANDONED_IO not in asyncio_log.filters:
        asyncio_log.addFilter(ABANDONED_IO)


def _orbax_after_shutdown(args) -> bool:
    """The exception of a thread `args` (`threading.ExceptHookArgs`) is Orbax's save writing
    on after the interpreter shut its executors down ("cannot schedule new futures after
    shutdown"): the save that failed first (a full disk) has reached its caller already."""
    return (isinstance(args.exc_value, RuntimeError)
            and "after shutdown" in str(args.exc_value)
            and any("orbax" in pathlib.PurePath(f.filename).parts
                    for f in traceback.extract_tb(args.exc_traceback)))


def drop_orbax_shutdown_reports() -> None:
    """From now on, for the rest of the process (the reports come at exit), drop the
    tracebacks of Orbax's threads that `_orbax_after_shutdown` names; every other thread's
    exception is reported as before."""
    previous = threading.excepthook
    if getattr(previous, "_peat_drops_orbax", False):
        return

    def hook(args):
        if not _orbax_after_shutdown(args):
            previous(args)

    setattr(hook, "_peat_drops_orbax", True)  # installed once (the getattr above)
    threading.excepthook = hook


class quiet:
    """Context manager: Orbax/absl INFO logging silenced for its duration (the level before is
    put back on exit), and Orbax's tracebacks of worker threads whose exception is raised in
    the caller's thread too."""

    def __enter__(self):
        absl = logging.getLogger("absl")
        self._lvl = absl.level
        self._filtered = _THREAD_FAILURES in absl.filters
        absl.setLevel(logging.WARNING)
        absl.addFilter(_THREAD_FAILURES)
        _drop_closed_loop_reports()   # for the rest of the process: the reports come late
        drop_abandoned_io_reports()
        drop_orbax_shutdown_reports()

    def __exit__(self, *exc):
        absl = logging.getLogger("absl")
        absl.setLevel(self._lvl)
        if not self._filtered:
            absl.removeFilter(_THREAD_FAILURES)


def to_device(batch: Any) -> Any:
    """`batch` (a pytree of host arrays) as jax arrays on the default device."""
    return jax.tree.map(jnp.asarray, batch)
