"""What jax compiles inside a block, read from its compile log: for tests that hold a program
to one compilation per shape."""
from __future__ import annotations

import contextlib
import logging
import re
from typing import Iterator

import jax


@contextlib.contextmanager
def compiles() -> Iterator[list[str]]:
    """The names of the programs jax compiles inside the block (from its compile log), in
    order; a program loaded from the persistent cache is named too."""
    compiled: list[str] = []

    class Compiles(logging.Handler):
        def emit(self, record):
            m = re.match(r"Compiling jit\((\w+)\)", record.getMessage())
            if m:
                compiled.append(m.group(1))

    log, handler = logging.getLogger("jax"), Compiles()
    log.addHandler(handler)
    try:
        with jax.log_compiles(True):
            yield compiled
    finally:
        log.removeHandler(handler)
