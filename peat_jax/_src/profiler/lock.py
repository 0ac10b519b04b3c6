"""One writer at a time: the locks a golden run, a playback campaign and a runtime run hold while
they write into a run directory.

Lock files (one JSON object: the holder's pid, host, start time, command and a token):
  <run_dir>/.lock                      the golden run (`peat.profile`): manifest.json,
                                       checkpoints/ and golden/
  <run_dir>/campaigns/<name>/.lock     a campaign run by one process (`peat.playback`), or a
                                       named runtime run (`peat.runtime(..., name=)`)
  <run_dir>/campaigns/<name>/.lock.p<i>-of-<n>
                                       process i of n of a campaign split over processes
                                       (`peat playback --coordinator`, `host=(i, n)`): each
                                       process writes its own results file, so each holds its
                                       own lock; two shares whose cells overlap (i = j mod
                                       gcd(n, m); the whole campaign overlaps every share)
                                       exclude each other

The lock is an advisory `fcntl.flock` on the file, which the kernel drops when its process dies,
however it dies. Where the filesystem has no flock (some network filesystems), the file itself
is the lock (created with O_CREAT|O_EXCL). A lock file whose holder is gone (flock: no longer
held; O_EXCL: a dead pid on this host) is taken over with a warning on this module's logger
naming the old holder; one that is held is a `LockHeld` error naming its holder; the holder
removes the file when it lets go (and a campaign directory the lock alone created).

A supervisor (`peat playback --cell-timeout`) holds its campaign's lock for the worker processes
it starts: they find the lock's token in their environment (`ENV`, see `RunLock.inherit_env`)
and their parent as its holder.

`writing` holds a lock around a block that writes, and turns the IO failures inside (a full
disk, a read-only directory, a checkpoint removed under a running replay) into one-line
PeatErrors naming what failed, what is kept and the command that resumes
(`peat_jax._src.profiler.ioerrors`); `golden_writer`, `campaign_writer` and `runtime_writer` are the
ones `profile`, `playback` and `runtime` hold.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import errno
import json
import logging
import os
import pathlib
import re
import shlex
import socket
import sys
import time
import uuid
import weakref
from typing import Any, Callable, Iterator, Mapping, Optional, Union

from peat_jax._src.errors import PeatError
from peat_jax._src.profiler.ioerrors import as_oserror, command_line, io_failure, resume_hint
from peat_jax._src.profiler.rundir import MissingCheckpoint, PathLike, RunDir

try:
    import fcntl
except ImportError:  # not on POSIX: the O_EXCL lock file only
    fcntl = None  # type: ignore[assignment]  # typeshed has fcntl always; None off POSIX


log = logging.getLogger(__name__)

LOCK = ".lock"
ENV = "PEAT_HELD_LOCKS"  # JSON {lock file: token} of the locks a parent holds for this process
_NAME = re.compile(r"\.lock(?:\.p(\d+)-of-(\d+))?")
_BUSY = {errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK}
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS}
_TRIES, _PAUSE = 6, 0.05      # a lock seen held is tried again for ~0.25 s (a probe, a start)
_UNREADABLE_STALE_S = 10.0    # an O_EXCL lock file that names no holder for this long is stale


class LockHeld(PeatError):
    """Another process is writing what this one was to write (its lock is held)."""


class _NoFlock(Exception):
    """The filesystem does not support flock."""


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who holds a lock: what its lock file says.

    Attributes:
      pid, host: the holding process and the machine it runs on (`socket.gethostname()`).
      started: when it took the lock (ISO 8601, UTC).
      command: its command line (`peat playback ...`, or the Python command running a script).
      token: a random id of this hold.
      pid_start: the process's start time (Linux: clock ticks since boot), so that a pid reused
        by another process is not taken for the holder; None where unknown.
    """

    pid: int
    host: str
    started: str
    command: str
    token: str
    pid_start: Optional[int] = None

    @classmethod
    def me(cls) -> "Holder":
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        stat = _proc_stat(os.getpid())
        return cls(pid=os.getpid(), host=socket.gethostname(), started=now.replace("+00:00", "Z"),
                   command=_this_command(), token=uuid.uuid4().hex,
                   pid_start=stat[1] if stat else None)

    @classmethod
    def parse(cls, text: str) -> Optional["Holder"]:
        """The holder a lock file's text names, or None (empty: being written; or damaged)."""
        try:
            d = json.loads(text)
            start = d.get("pid_start")
            return cls(pid=int(d["pid"]), host=str(d["host"]), started=str(d.get("started", "?")),
                       command=str(d.get("command", "?")), token=str(d.get("token", "")),
                       pid_start=start if isinstance(start, int) else None)
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    def dumps(self) -> str:
        return json.dumps(dataclasses.asdict(self)) + "\n"

    def alive(self) -> Optional[bool]:
        """Whether the holder still runs: None when that cannot be told (another host)."""
        if self.host != socket.gethostname():
            return None
        return _alive(self.pid, self.pid_start)

    def __str__(self) -> str:
        me = " (this process)" if self.pid == os.getpid() and self.host == socket.gethostname() \
            else ""
        return f"pid {self.pid}{me} on host {self.host} since {self.started} ({self.command})"


def _this_command() -> str:
    cmd = command_line()
    if cmd is None:
        cmd = shlex.join([os.path.basename(sys.executable or "python"), *sys.argv])
    return cmd if len(cmd) <= 200 else cmd[:197] + "..."


def _proc_stat(pid: int) -> Optional[tuple[str, int]]:
    """(state, start time in clock ticks) of a process from /proc (Linux), or None."""
    try:
        text = pathlib.Path(f"/proc/{pid}/stat").read_text()
        rest = text[text.rfind(")") + 2:].split()
        return rest[0], int(rest[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int, pid_start: Optional[int]) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it exists
        pass
    except OSError:
        return False
    stat = _proc_stat(pid)
    if stat is not None:
        if stat[0] in ("Z", "X"):  # ended, not yet reaped
            return False
        if pid_start is not None and stat[1] != pid_start:  # the pid is another process's now
            return False
    return True


_HELD: "weakref.WeakSet[RunLock]" = weakref.WeakSet()  # released at exit if still held


@atexit.register
def _release_at_exit() -> None:
    for held in list(_HELD):
        with contextlib.suppress(Exception):
            held.release()


def open_file(path: pathlib.Path, flags: int) -> int:
    return os.open(path, flags, 0o644)


def _same_file(fd: int, path: pathlib.Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _read_text(path: pathlib.Path) -> Optional[str]:
    try:
        return path.read_bytes()[:65536].decode("utf-8", "replace")
    except OSError:
        return None


def share_text(share: tuple[int, int]) -> str:
    i, n = share
    return "the whole campaign" if n == 1 else f"process {i} of {n}"


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether shares a = (i, n) and b = (j, m) of one grid may have a cell in common: share i
    of n is the grid's i-th of n equal blocks (cell k of N is its when k * n // N == i, see
    `campaign.Campaign`), the fraction [i / n, (i + 1) / n) of it, whatever N is."""
    (i, n), (j, m) = a, b
    return i * m < (j + 1) * n and j * n < (i + 1) * m


class RunLock:
    """The lock of one thing written in a run directory (see the module's doc).

    Args:
      path: the lock file.
      scope: what it guards, for messages ("run dir R", "campaign 'x' of run dir R").
      share: (i, n) for a campaign's lock: process i of n; (0, 1) for the rest.

    Use as a context manager, or `acquire()` / `release()`.
    """

    def __init__(self, path: PathLike, scope: str, share: tuple[int, int] = (0, 1)):
        self.path = pathlib.Path(os.path.abspath(path))
        self.scope = scope
        self.share = share
        self.holder: Optional[Holder] = None  # while held: this process's (or the parent's)
        self._fd: Optional[int] = None
        self._mode: Optional[str] = None  # "flock", "file" (O_EXCL) or "inherited"
        self._made: list[pathlib.Path] = []

    @property
    def held(self) -> bool:
        return self._mode is not None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> "RunLock":
        """Take the lock; a `LockHeld` naming the holder if another process holds it (or one
        whose share overlaps this one's). A lock left by a process that is gone is taken over,
        with a warning naming it."""
        if self.held:
            raise PeatError(f"the lock of {self.scope} is already held by this RunLock")
        try:
            self._make_dirs()
            if self._inherit():
                return self
            me = Holder.me()
            stale = self._take(me)
            self.holder = me
            self._check_overlaps()
        except BaseException as e:
            if self.held:
                self.release()
            else:
                self._drop_dirs()
            if isinstance(e, OSError) and not e.filename:  # say which file
                raise OSError(e.errno, e.strerror, str(self.path)) from e
            raise
        _HELD.add(self)
        if stale is not None and stale.token != me.token:
            alive = stale.alive()
            why = ("which no longer runs" if alive is False else
                   "which no longer holds it" if self._mode == "flock" else "which is gone")
            log.warning("taking over the lock of %s (%s) from %s, %s", self.scope,
                        self.path, stale, why)
        return self

    def release(self) -> None:
        """Let go of the lock (nothing to do if it is not held): the lock file is removed, and
        the directories the lock created if they are empty."""
        mode, self._mode = self._mode, None
        _HELD.discard(self)
        if self.holder is not None and self.holder.pid != os.getpid():  # a forked child's copy
            mode = "inherited"
        if mode == "flock":
            fd, self._fd = self._fd, None
            assert fd is not None  # a flock-mode lock holds its file open
            try:
                if _same_file(fd, self.path):
                    self.path.unlink()
            except OSError:
                pass
            finally:
                os.close(fd)
        elif mode == "file":
            ours = Holder.parse(_read_text(self.path) or "")
            if ours is not None and self.holder is not None and ours.token == self.holder.token:
                with contextlib.suppress(OSError):
                    self.path.unlink()
        self.holder = None
        self._drop_dirs()

    def inherit_env(self, env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
        """`env` (default: this process's environment) for a child process that works under
        this lock: its own `acquire` of the same lock succeeds while this process holds it."""
        if not self.held or self.holder is None:
            raise PeatError(f"the lock of {self.scope} is not held: nothing to hand down")
        env = dict(os.environ if env is None else env)
        try:
            held = json.loads(env.get(ENV) or "{}")
        except ValueError:
            held = {}
        held = held if isinstance(held, dict) else {}
        held[str(self.path)] = self.holder.token
        env[ENV] = json.dumps(held)
        return env

    # -- taking it --------------------------------------------------------------------------

    def _take(self, me: Holder) -> Optional[Holder]:
        """Take the lock as `me`; the stale holder its file named, if any."""
        flock = fcntl is not None
        holder = None
        for attempt in range(_TRIES):
            if attempt:
                time.sleep(_PAUSE)
            if flock:
                try:
                    got, holder = self._flock(me)
                except _NoFlock:
                    flock = False
                    got, holder = self._exclusive(me)
            else:
                got, holder = self._exclusive(me)
            if got:
                return holder
        raise self._held_error(holder, self.path, flock)

    def _flock(self, me: Holder) -> tuple[bool, Optional[Holder]]:
        try:
            fd, created = open_file(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL), True
        except FileExistsError:
            try:
                fd, created = open_file(self.path, os.O_RDWR), False
            except FileNotFoundError:  # removed by its holder meanwhile
                return False, None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if created and e.errno not in _BUSY:  # an empty file no one else may trust
                with contextlib.suppress(OSError):
                    self.path.unlink()
            os.close(fd)
            if e.errno in _BUSY:
                return False, Holder.parse(_read_text(self.path) or "")
            if e.errno in _NO_FLOCK:
                raise _NoFlock() from None
            raise
        try:
            if not _same_file(fd, self.path):  # removed by its holder as we opened it
                os.close(fd)
                return False, None
            os.lseek(fd, 0, os.SEEK_SET)
            stale = Holder.parse(os.read(fd, 65536).decode("utf-8", "replace"))
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, me.dumps().encode())
            os.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                if _same_file(fd, self.path):
                    self.path.unlink()
            os.close(fd)
            raise
        self._fd, self._mode = fd, "flock"
        return True, stale

    def _exclusive(self, me: Holder) -> tuple[bool, Optional[Holder]]:
        """The lock file as the lock (no flock): created with O_EXCL, taken over from a dead
        holder on this host."""
        stale = None
        for _ in range(2):
            try:
                fd = open_file(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            except FileExistsError:
                text = _read_text(self.path)
                if text is None:  # removed meanwhile
                    continue
                other = Holder.parse(text)
                if other is None:
                    try:
                        age = time.time() - self.path.stat().st_mtime
                    except OSError:
                        continue
                    if age < _UNREADABLE_STALE_S:  # its holder is writing it
                        return False, None
                elif other.alive() is not False:
                    return False, other
                self._steal(text)
                stale = other
                continue
            try:
                os.write(fd, me.dumps().encode())
                os.fsync(fd)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    self.path.unlink()
                raise
            os.close(fd)
            self._mode = "file"
            return True, stale
        return False, Holder.parse(_read_text(self.path) or "")

    def _steal(self, text: str) -> None:
        """Remove a stale lock file whose content is `text`: renamed aside first, so that a lock
        file another process created meanwhile is put back, not removed."""
        aside = self.path.with_name(f"{self.path.name}.stale-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        if _read_text(aside) != text:
            with contextlib.suppress(OSError):
                os.link(aside, self.path)
        with contextlib.suppress(OSError):
            aside.unlink()

    def _inherit(self) -> bool:
        """Whether the parent holds this lock for this process (`inherit_env`)."""
        try:
            held = json.loads(os.environ.get(ENV) or "{}")
        except ValueError:
            return False
        token = held.get(str(self.path)) if isinstance(held, dict) else None
        if not token:
            return False
        h = Holder.parse(_read_text(self.path) or "")
        if h is None or h.token != token or h.pid != os.getppid() \
                or h.host != socket.gethostname():
            return False
        self.holder, self._mode = h, "inherited"
        return True

    def _check_overlaps(self) -> None:
        """LockHeld when another share of the same campaign whose cells overlap this one's is
        held (taken after our own, so of two processes racing at least one sees the other)."""
        for p in sorted(self.path.parent.glob(LOCK + "*")):
            m = _NAME.fullmatch(p.name)
            if m is None or p == self.path:
                continue
            theirs = (int(m[1]), int(m[2])) if m[1] else (0, 1)
            if not _overlap(self.share, theirs):
                continue
            held, holder = self._probe(p)
            if held:
                raise self._held_error(holder, p, self._mode == "flock", theirs)

    def _probe(self, path: pathlib.Path) -> tuple[bool, Optional[Holder]]:
        """Whether the lock file `path` is held, and by whom (None: it does not say yet)."""
        holder = Holder.parse(_read_text(path) or "")
        if self._mode == "flock":
            for attempt in range(_TRIES):
                if attempt:
                    time.sleep(_PAUSE)
                try:
                    fd = os.open(path, os.O_RDONLY)
                except FileNotFoundError:
                    return False, None
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    return False, None
                except OSError as e:
                    if e.errno not in _BUSY:
                        return False, None
                finally:
                    os.close(fd)
            return True, Holder.parse(_read_text(path) or "") or holder
        if holder is None:
            return path.exists(), None
        return holder.alive() is not False, holder

    def _held_error(self, holder: Optional[Holder], path: pathlib.Path, flock: bool,
                    share: Optional[tuple[int, int]] = None) -> LockHeld:
        who = (str(holder) if holder is not None else
               f"another process (its lock file {path} does not name it yet)")
        overlap = ("" if share is None else
                   f", whose share of the grid ({share_text(share)}) overlaps this one's "
                   f"({share_text(self.share)})")
        gone = ""
        if not flock and (holder is None or holder.alive() is None):
            gone = f"; if that process is gone, delete {path}"
        return LockHeld(f"{self.scope} is being written by {who}{overlap}: wait for it to "
                        f"finish, or stop it, then run this again{gone}")

    # -- its directory ----------------------------------------------------------------------

    def _make_dirs(self) -> None:
        missing, d = [], self.path.parent
        while not d.exists() and d != d.parent:
            missing.append(d)
            d = d.parent
        self._made = missing  # deepest first
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def _drop_dirs(self) -> None:
        made, self._made = self._made, []
        for d in made:
            try:
                d.rmdir()
            except FileNotFoundError:  # never made (mkdir failed above it)
                continue
            except OSError:  # not empty: something else is written there now
                break


def golden_lock(run_dir: PathLike) -> RunLock:
    """The lock of the golden run in `run_dir` (`<run_dir>/.lock`)."""
    path = pathlib.Path(run_dir)
    return RunLock(path / LOCK, f"run dir {path}")


def campaign_lock(run_dir: PathLike, name: str, host: Optional[tuple[int, int]] = None
                  ) -> RunLock:
    """The lock of campaign `name` of `run_dir` for share `host` = (index, count) (default:
    `jax.process_index()` of `jax.process_count()`, as `peat.playback` splits its grid): a
    PeatError for a bad name or share."""
    rd = RunDir(run_dir)
    camp = rd.campaign(name)
    if host is None:
        import jax
        host = (jax.process_index(), jax.process_count())
    index: Optional[int]
    count: Optional[int]
    try:
        index, count = host
    except (TypeError, ValueError):
        index = count = None
    if not (isinstance(count, int) and count >= 1 and isinstance(index, int)
            and 0 <= index < count):
        raise PeatError(f"host must be (index, count) with 0 <= index < count, got {host!r}")
    file = LOCK if count == 1 else f"{LOCK}.p{index}-of-{count}"
    return RunLock(camp / file, f"campaign {name!r} of run dir {rd.path}", (index, count))


@contextlib.contextmanager
def writing(lock: RunLock, *, call: str, kept: Union[str, Callable[[], str]],
            missing: str = "", what: Optional[str] = None, root: Optional[PathLike] = None
            ) -> Iterator[RunLock]:
    """Hold `lock` for the block; an IO failure inside it (an OSError, or one Orbax wrapped, see
    `ioerrors.as_oserror`) becomes a one-line PeatError: what failed, `kept` (what is intact on
    disk; a function is called only then) and how to resume (`call`: the library call, named
    when the process is not the peat command line). A checkpoint that disappeared while the
    block ran (`MissingCheckpoint`) says the same, `missing` added to its remedy. `what`: what
    stopped, for the message (default: the lock's scope). `root`: the run directory; an OSError
    of a file outside it (the workload's data) is not a failure of the run directory and goes
    through unchanged (None: every OSError is told)."""
    what = what or lock.scope
    try:
        with lock:
            yield lock
    except LockHeld:
        raise
    except MissingCheckpoint as e:
        raise PeatError(f"{what} stopped: {e}; {_kept(kept)}: put the checkpoint back and "
                        f"{resume_hint(call)} to resume{missing}") from None
    except PeatError:
        raise
    except Exception as e:  # noqa: BLE001 - Orbax wraps OSErrors in its own exceptions
        os_error = _in_run_dir(as_oserror(e), root)
        if os_error is None:
            raise
        raise io_failure(os_error, what, _kept(kept), resume_hint(call)) from None


# errnos that say the disk or the directory refused: an OSError naming no file is taken for
# the run directory's only with one of these (a write or flush names no file)
_DISK = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EROFS, errno.EACCES,
         errno.EPERM, errno.EIO, errno.EFBIG}


def _in_run_dir(e: Optional[OSError], root: Optional[PathLike]) -> Optional[OSError]:
    """`e` where it is a failure of the run directory `root` (its file is in it; or it names no
    file and says the disk or directory refused, told then as `root`'s), else None: the
    workload's own OSErrors (its data files) go through unchanged."""
    if e is None or root is None:
        return e
    root = os.path.abspath(root)
    if e.filename is None:
        return OSError(e.errno, e.strerror, root) if e.errno in _DISK else None
    name = os.path.abspath(os.fsdecode(e.filename))
    return e if name == root or name.startswith(root.rstrip(os.sep) + os.sep) else None


def _kept(kept: Union[str, Callable[[], str]]) -> str:
    if isinstance(kept, str):
        return kept
    try:
        return kept()
    except Exception:  # noqa: BLE001 - a message about a failure must not fail itself
        return "what was written before is kept"


def golden_writer(run_dir: PathLike):
    """`writing` under the golden run's lock, as `peat.profile` holds it."""
    lock = golden_lock(run_dir)
    return writing(lock, call=f"peat.profile(workload, {str(run_dir)!r}, ...)",
                   what=f"the golden run in {run_dir}", root=run_dir,
                   kept="the complete checkpoints and their metrics are kept (a rerun resumes "
                        "from the last one)")


def campaign_writer(run_dir: PathLike, name: Optional[str], substitution: Any = None,
                    host: Optional[tuple[int, int]] = None):
    """`writing` under the lock of a playback campaign (`name`, default: from `substitution`)
    for share `host`, as `peat.playback` holds it; nothing is held for a substitution that is
    not a mapping (playback refuses it before writing anything)."""
    if name is None:
        if not isinstance(substitution, Mapping):
            return contextlib.nullcontext()
        from peat_jax._src.profiler.campaign import campaign_name
        name = campaign_name(substitution)
    lock = campaign_lock(run_dir, name, host)

    def kept() -> str:
        from peat_jax._src.profiler.campaign import merged_records
        n = len(merged_records(lock.path.parent)) if lock.path.parent.is_dir() else 0
        return (f"its {n} finished cell(s) are kept in {lock.path.parent}" if n else
                "no cell of it had finished")

    return writing(lock, call=f"peat.playback({str(run_dir)!r}, ...)", kept=kept, root=run_dir,
                   missing=", or replay only the others (--checkpoints, checkpoints=)")


def runtime_writer(run_dir: PathLike, name: str):
    """`writing` under the lock of the named runtime run `name`, as `peat.runtime` holds it."""
    lock = campaign_lock(run_dir, name, (0, 1))
    return writing(lock, call=f"peat.runtime({str(run_dir)!r}, ..., name={name!r})",
                   what=f"runtime run {name!r} of run dir {run_dir}", root=run_dir,
                   kept="its progress up to the last saved chunk is kept")
