"""IO failures of a run as one line: a full disk, a read-only or unwritable directory, a file
removed under a running process.

`as_oserror` finds the `OSError` behind an exception, also where Orbax and tensorstore wrap it in
their own (a full disk under an Orbax save is a `ValueError` "RESOURCE_EXHAUSTED: Error writing
local file "...": ... No space left on device [os_error_code='28']"); `io_failure` turns it into a
`PeatError` naming what failed, what is kept and the command that resumes. The entry points that
write a run directory apply them through `peat_jax._src.profiler.lock.writing`.
"""
from __future__ import annotations

import errno
import os
import re
import shlex
import sys
from typing import Optional

from peat_jax._src.errors import PeatError


# tensorstore's status messages: "... [os_error_code='28']" and the file in quotes
_OS_CODE = re.compile(r"os_error_code='?(\d+)'?")
_ERRNO = re.compile(r"\[Errno (\d+)\]")
_QUOTED_PATH = re.compile(r"\"(/[^\"]+)\"|'(/[^']+)'")
_TEXT = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
         "Read-only file system": errno.EROFS, "Permission denied": errno.EACCES}


def as_oserror(exc: BaseException) -> Optional[OSError]:
    """The `OSError` behind `exc`: `exc` itself, one in its chain of causes (or in an exception
    group), or one rebuilt from the errno an Orbax / tensorstore message carries; None when
    there is none (a `PeatError` is never one)."""
    seen: set[int] = set()
    todo: list[Optional[BaseException]] = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen or isinstance(e, PeatError):
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    for e in (exc, *_chain(exc)):
        rebuilt = None if isinstance(e, PeatError) else _from_message(str(e))
        if rebuilt is not None:
            return rebuilt
    return None


def _chain(exc: BaseException):
    seen = {id(exc)}
    e = exc.__cause__ or exc.__context__
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _from_message(text: str) -> Optional[OSError]:
    m = _OS_CODE.search(text) or _ERRNO.search(text)
    code = int(m.group(1)) if m else next((c for t, c in _TEXT.items() if t in text), None)
    if not code:
        return None
    paths = [a or b for a, b in _QUOTED_PATH.findall(text)]
    # the innermost file named ("Failed writing: "<file>"") is the one the OS refused
    return OSError(code, os.strerror(code), paths[-1] if paths else None)


def command_line() -> Optional[str]:
    """The `peat ...` command this process runs (without the supervisor's `--worker`), or None
    when it is not the peat command line (a script calling the library)."""
    argv = list(sys.argv)
    if not argv:
        return None
    prog = argv[0].replace("\\", "/")
    if os.path.basename(prog) in ("peat", "peat.exe") or prog.endswith("peat_jax/__main__.py"):
        return shlex.join(["peat", *(a for a in argv[1:] if a != "--worker")])
    return None


def resume_hint(call: str) -> str:
    """How to resume: "run `peat ...` again" on the command line, else "call <call> again"."""
    cmd = command_line()
    return f"run `{cmd}` again" if cmd else f"call {call} again"


def _fix(e: OSError) -> str:
    code = e.errno
    if code in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
        return "free space on its filesystem (or raise the quota)"
    if code == errno.EROFS:
        return "its filesystem is read-only: remount it read-write or copy the run directory " \
               "to a writable place"
    if code in (errno.EACCES, errno.EPERM):
        return "make it writable for this user"
    if code == errno.ENOENT:
        return "it was removed while the run used it: put it back"
    return "fix the cause"


def describe(e: OSError) -> str:
    """"<file>: <strerror> (<ERRNO name>)" on one line."""
    name = errno.errorcode.get(e.errno, str(e.errno)) if e.errno is not None else None
    what = (e.strerror or str(e)).splitlines()[0] if (e.strerror or str(e)) else type(e).__name__
    where = f"{e.filename}: " if e.filename else ""
    return f"{where}{what}" + (f" ({name})" if name else "")


def io_failure(e: OSError, scope: str, kept: str, resume: str) -> PeatError:
    """The one-line PeatError for `e`, which stopped the writing of `scope` (e.g. "campaign 'x'
    of run dir R"): what failed, `kept` (what is intact on disk) and `resume` (`resume_hint`)."""
    return PeatError(f"{scope} stopped: {describe(e)}; {kept}: {_fix(e)}, then {resume} to resume")
