"""What jax compiles inside a block, read from its compile log: for tests that hold a program
to one compilation per shape."""
from __future__ import annotations

import contextlib
import logging
import re
from typing import Iterator

import jax


@contextlib.contextmanager
def compiles(all_threads: bool = False) -> Iterator[list[str]]:
    """The names of the programs jax starts to compile inside the block (its compile log:
    "Compiling jit(...)" is logged when a program is lowered, also where the persistent cache
    then holds the executable), in order. `all_threads`: also those compiled by other threads
    meanwhile (jax's global flag; `jax.log_compiles()` sets the calling thread's only)."""
    compiled: list[str] = []

    class Compiles(logging.Handler):
        def emit(self, record):
            m = re.match(r"Compiling jit\((\w+)\)", record.getMessage())
            if m:
                compiled.append(m.group(1))

    log, handler = logging.getLogger("jax"), Compiles()
    log.addHandler(handler)
    was = jax.config.jax_log_compiles
    try:
        if all_threads:
            jax.config.update("jax_log_compiles", True)
            yield compiled
        else:
            with jax.log_compiles(True):
                yield compiled
    finally:
        jax.config.update("jax_log_compiles", was)
        log.removeHandler(handler)
