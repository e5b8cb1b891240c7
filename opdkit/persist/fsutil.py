"""Small, generic file-system helpers for long runs on shared file systems.

- ``retry_io``: retry a whole I/O operation on *transient* errors (NFS/Lustre hiccups such as
  ``ECOMM``), fail at once on anything else.
- ``fsync_dir`` / ``fsync_tree`` / ``atomic_write_*``: durable, all-or-nothing writes.
- ``OutputLock``: one run per output directory (``flock`` on ``DIR/.opdkit.lock``); the trainer
  state directory (``runtime.state_dir``, run.sh's ``CKPT_DIR``) gets one of its own.
- ``DeviceLock``: the GPU workload lock, one file per machine (``$OPDKIT_GPU_LOCK``, default
  ``/tmp/opdkit-gpu.lock``): training holds it shared, evaluation exclusively.
- ``list_checkpoints`` / ``step_of``: a run's ``checkpoint-<step>`` directories, by step (what is in them:
  ``opdkit.persist.checkpoints``, which imports torch; these do not, for the stage drivers that only list them).
- ``explain_storage_errors``: a full disk, quota or read-only file system (never retried) becomes
  ``StorageError``, whose message names the directory, the bytes needed and the bytes free.

Standard library only, so it is cheap to import anywhere (including a lock-probing subprocess).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

# errno values that a retry can cure: a shared file system that briefly lost its server.
TRANSIENT_ERRNOS: frozenset[int] = frozenset(
    {errno.EIO, errno.ECOMM, errno.ETIMEDOUT, errno.ESTALE, errno.EAGAIN, errno.EBUSY}
)

# errno values no retry cures and the user must act on: space, quota, a read-only mount.
STORAGE_ERRNOS: dict[int, str] = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                                  errno.EROFS: "read-only file system"}

LOCK_NAME = ".opdkit.lock"


def is_transient(exc: BaseException) -> bool:
    """True for an ``OSError`` whose errno is in ``TRANSIENT_ERRNOS``."""
    return isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS


def retry_io(
    fn: Callable[[], T],
    *,
    retries: int,
    backoff_s: float,
    what: str,
    log: Callable[[str], Any] = print,
) -> T:
    """Call ``fn()``; on a transient ``OSError`` log one line and call it again.

    Waits ``backoff_s * 2**i`` before retry ``i`` (0-based), at most ``retries`` retries, then
    re-raises the last error (with a note saying how many attempts were made). A non-transient
    error (``ENOSPC``, ``EACCES``, a bug, ...) is raised at once. ``fn`` must be safe to call
    again from scratch, i.e. clean up after itself when it fails.
    """
    if retries < 0:
        raise ValueError(f"retries must be >= 0, got {retries}")
    for attempt in range(retries + 1):
        try:
            return fn()
        except OSError as exc:
            if not is_transient(exc):
                raise
            if attempt == retries:
                exc.add_note(f"opdkit: gave up {what} after {attempt + 1} attempts")
                raise
            delay_s = backoff_s * 2**attempt
            log(
                f"transient I/O error while {what}: {exc}; "
                f"retry {attempt + 1}/{retries} in {delay_s:.2f}s"
            )
            time.sleep(delay_s)
    raise AssertionError("unreachable")


class StorageError(OSError):
    """Writing failed for lack of space or a read-only file system (the message says where, and how much)."""


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


@contextlib.contextmanager
def explain_storage_errors(directory: str | os.PathLike, nbytes: int, what: str):
    """Re-raise ``ENOSPC`` / ``EDQUOT`` / ``EROFS`` inside the block as ``StorageError`` naming
    ``directory``, the ``nbytes`` that ``what`` needs and the space free there."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in STORAGE_ERRNOS or isinstance(exc, StorageError):
            raise
        where = Path(directory)
        while not where.exists() and where != where.parent:  # the nearest directory that exists
            where = where.parent
        try:
            st = os.statvfs(where)
            free = f"{_mib(st.f_bavail * st.f_frsize)} free there"
        except OSError:
            free = "free space unknown"
        if exc.errno == errno.EROFS:
            msg = (f"{directory} is on a read-only file system: {what} needs {_mib(nbytes)} written there; "
                   "use an output directory on a writable file system")
        else:
            msg = (f"{STORAGE_ERRNOS[exc.errno]} for {directory}: {what} needs about {_mib(nbytes)}, {free}; "
                   "free some space (or lower publish.keep) and rerun, or use another output directory")
        raise StorageError(exc.errno, msg) from exc


def unwritable(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be written (a file or directory there made, or an existing one written), or None.
    Checked before a command runs, so that a read-only or foreign output place is refused in one line instead
    of failing at the first write (after the models loaded, or after a whole evaluation). Reads only."""
    target = Path(path).absolute()
    where = target
    while not where.exists() and where != where.parent:  # the nearest existing path: missing parts are made there
        where = where.parent
    if where != target and not where.is_dir():
        return f"{where} is not a directory"
    if os.access(where, os.W_OK | (os.X_OK if where.is_dir() else 0)):
        return None
    try:
        read_only = bool(os.statvfs(where).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    return f"{where} is on a read-only file system" if read_only else f"{where} is not writable (its permissions)"


# --- durability -----------------------------------------------------------------------------


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this machine (one of another user's counts: it cannot be signalled)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so that renames and new entries in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some file systems cannot fsync a directory (EINVAL): nothing more we can do there.
        if exc.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike) -> None:
    """fsync every file and directory under ``path`` (children before parents)."""
    for dirpath, _dirnames, filenames in os.walk(path, topdown=False):
        for name in filenames:
            fsync_file(os.path.join(dirpath, name))
        fsync_dir(dirpath)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``path`` all-or-nothing: temp file in the same dir, fsync, ``os.replace``, fsync dir."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int = 2) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=True) + "\n")


# --- one run per output directory; the GPU workload lock ----------------------------------------


class LockHeld(RuntimeError):
    """Another process (or another lock object in this one) holds the lock (exit status 75)."""

    def __init__(self, directory: Path, holder: str, what: str = "output directory"):
        self.directory = directory
        self.holder = holder
        super().__init__(
            f"{what} {directory} is in use by another run ({holder}); wait for it to "
            f"finish or choose another {what}"
        )


class DeviceBusy(LockHeld):
    """The GPU workload lock is taken in the conflicting mode (training: shared, evaluation: exclusive)."""

    def __init__(self, path: Path, holder: str, shared: bool):
        self.directory, self.holder = path, holder
        who = (f"an evaluation holds it ({holder})" if shared else
               "training runs hold it (shared)"
               + (f"; last exclusive holder: {holder}" if holder != "pid unknown" else ""))
        want = "training (shared)" if shared else "an evaluation (exclusive)"
        RuntimeError.__init__(self, f"the GPU workload lock {path} is taken: {who}; {want} cannot start until it is "
                                    "released (training holds it shared, `opdkit eval` exclusively; "
                                    "$OPDKIT_GPU_LOCK names the lock file)")


class _FileLock:
    """Non-blocking ``flock`` on ``path``: exclusive, or shared (any number of shared holders, none
    exclusive). An exclusive holder writes its pid and host into the file (for the error message); the
    file is left in place on release (deleting a lock file races with other lockers). The lock dies with
    the process, so a killed run never leaves a stale lock behind."""

    def __init__(self, path: Path, shared: bool = False):
        self.path = Path(path)
        self.shared = shared
        self._fd: int | None = None

    def _held(self, holder: str) -> LockHeld:
        raise NotImplementedError

    def _open(self) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        except PermissionError:  # another user's lock file: flock works on a read-only handle too
            return os.open(self.path, os.O_RDONLY)

    def acquire(self):
        if self._fd is not None:
            raise RuntimeError(f"the lock {self.path} is already acquired")
        fd = self._open()
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_holder(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise self._held(holder) from exc
            raise OSError(
                exc.errno,
                f"cannot lock {self.path} ({exc.strerror}); this file system may not support "
                f"flock: choose a directory on one that does",
            ) from exc
        if not self.shared:
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"pid={os.getpid()} host={socket.gethostname()}\n".encode(), 0)
            except PermissionError:
                pass  # a read-only handle on another user's file: no record
            except BaseException:
                os.close(fd)  # closing releases the flock
                raise
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        if not self.shared:
            try:
                os.ftruncate(fd, 0)  # still ours: clear the holder record before unlocking
            except OSError:
                pass  # cosmetic only; the lock is released by close() below regardless
        os.close(fd)

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class OutputLock(_FileLock):
    """Exclusive, non-blocking ``flock`` on ``DIR/.opdkit.lock``; raises ``LockHeld`` if taken.

    Creates ``DIR`` if needed and nothing inside it but the lock file. ``what`` names the directory
    in the error ("output directory", "trainer state directory").

        with OutputLock(out_dir):
            ...  # the whole run
    """

    def __init__(self, directory: str | os.PathLike, what: str = "output directory"):
        self.directory = Path(directory)
        self.what = what
        super().__init__(self.directory / LOCK_NAME)

    def _held(self, holder: str) -> LockHeld:
        return LockHeld(self.directory, holder, self.what)


GPU_LOCK_ENV = "OPDKIT_GPU_LOCK"


def device_lock_path() -> Path:
    """The GPU workload lock's file: ``$OPDKIT_GPU_LOCK``, else ``opdkit-gpu.lock`` in the system's
    temporary directory (one per machine: every user's runs and evaluations see it)."""
    return Path(os.environ.get(GPU_LOCK_ENV) or Path(tempfile.gettempdir()) / "opdkit-gpu.lock")


class DeviceLock(_FileLock):
    """The GPU workload lock (docs/design.md, "run.sh"): training holds it ``shared`` (concurrent probes may
    share the machine), ``opdkit eval`` exclusively (it refuses to start while a training process holds
    it, and no training starts while an evaluation runs); a conflict raises ``DeviceBusy`` (exit 75)."""

    def __init__(self, shared: bool, path: str | os.PathLike | None = None):
        super().__init__(Path(path) if path is not None else device_lock_path(), shared)

    def _held(self, holder: str) -> LockHeld:
        return DeviceBusy(self.path, holder, self.shared)


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 256, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return text or "pid unknown"


# --- a run's checkpoint-<step> directories ----------------------------------------------------

_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


def step_of(path: Path) -> int:
    """The step of a ``checkpoint-<step>`` dir."""
    return int(_CKPT_RE.match(path.name)[1])


def list_checkpoints(root) -> list[Path]:
    """``root/checkpoint-<int>`` dirs sorted by step (valid or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if _CKPT_RE.match(p.name) and p.is_dir()), key=step_of)
