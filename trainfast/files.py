"""Files trainfast writes into places a user owns: one writer at a time, whole or not at all,
never through a link.

- `only_one(lock)`: a flock'ed lock file (opened with O_NOFOLLOW, so a link planted under its
  name is not followed), held for a pack's build or a run; a second process is told at once.
- `write_whole(path, write)`: into a new file of a random name beside `path` (O_EXCL: nothing
  that is already there, a planted link included, is opened), then renamed over `path` — a link
  at `path` is replaced, its target untouched; a reader never sees half a file; on any failure
  (a full disk) the temporary file is removed.
- `links(folder, names)`: which of those names in `folder` are symbolic links.
- `scratch(kind)`: a folder of one process's temporary files under trainfast's cache, removed
  at the end; one a killed process left behind is removed by the next.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from trainfast.errors import TrainfastError


class Busy(TrainfastError):
    """Another process holds the lock (its message says what it is doing)."""


@contextlib.contextmanager
def only_one(lock: Path, busy: str):
    """Hold `lock` (a file, made if missing, removed at the end) or raise Busy(busy) at once if
    another process holds it. The lock's folder is made. A process that locked a
    file its holder removed meanwhile tries again."""
    try:
        import fcntl
    except ImportError:  # Windows: no flock; two writers there are the user's to avoid
        yield
        return
    lock = Path(lock)
    while True:
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_CREAT | os.O_RDWR | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except OSError as e:
            raise TrainfastError(f"{lock.parent}: cannot write here ({e.strerror or e})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise Busy(busy) from None
        try:
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # its holder removed it as we opened it: take the new one
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock)
        os.close(fd)


def write_whole(path: Path, write) -> None:
    """Call `write(f)` on a binary file that becomes `path` only once it is complete (see the
    module's docstring). An OSError (a full disk, a read-only folder) becomes a TrainfastError
    naming `path`, with nothing left behind and any earlier `path` kept."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise TrainfastError(f"{path}: cannot write ({e.strerror or e})") from None
    try:
        with contextlib.suppress(OSError, AttributeError):  # mkstemp makes 0600: the mode open() would give
            os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
        os.replace(tmp, path)
    except BaseException as e:
        reason = _write_failure(e, path.parent)  # the free space while the partial file still holds it
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if reason:
            raise TrainfastError(f"{path}: cannot write ({reason}); nothing was replaced") from None
        raise


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (/proc/self/status)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)  # elsewhere: set and put back at once
    os.umask(old)
    return old


def _write_failure(e: BaseException, folder: Path) -> str | None:
    """Why writing a file into `folder` failed, in words, where `e` is a failed write: an
    OSError, or the RuntimeError torch.save raises for one ("file write failed"; on a full disk
    its zip writer's "[enforce fail at inline_container.cc:…] unexpected pos N vs M"). None for
    anything else."""
    if isinstance(e, OSError):
        return e.strerror or str(e)
    text = str(e)
    if not (isinstance(e, RuntimeError) and ("write" in text.lower() or "inline_container" in text)):
        return None
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return (text.strip().splitlines() or ["a write fell short"])[0]
    what = "no space left on the device" if free < 2**20 else "a write fell short"
    return f"{what}: {free / 1e6:.1f} MB free there"


def link_whole(src: Path, dst: Path) -> bool:
    """Give the complete file `src` (one write_whole made) the second name `dst`: a hard link
    under a temporary name, renamed over `dst`, so that a reader never sees half a file and a
    link at `dst` is replaced, not written through. A later write_whole of either name puts a
    new file there and leaves the other as it was. False where the file system has no hard
    links (or the link fails for another reason): the caller writes `dst` itself."""
    src, dst = Path(src), Path(dst)
    tmp = dst.parent / f".{dst.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    try:
        os.link(src, tmp)
    except OSError:
        return False
    try:
        os.replace(tmp, dst)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return False
    return True


def write_text(path: Path, text: str) -> None:
    write_whole(path, lambda f: f.write(text.encode("utf-8")))


def stale_temporaries(folder: Path, names) -> list[Path]:
    """The temporary files write_whole (and older trainfast, `.NAME.PID.tmp`) leaves when its
    process is killed mid-write, for these names: regular files only."""
    out = []
    for name in names:
        for p in Path(folder).glob(f".{name}.*.tmp"):
            if p.is_file() and not p.is_symlink():
                out.append(p)
    return out


def links(folder: Path, names) -> list[str]:
    """The names in `folder` that are symbolic links (trainfast writes through none)."""
    return [n for n in names if (Path(folder) / n).is_symlink()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (EPERM), or a platform without the check
        return True
    return True


@contextlib.contextmanager
def scratch(kind: str):
    """A new folder for this process's temporary files, `<cache>/<kind>/<pid>-<random>`, removed
    when the block ends. A folder there whose process is gone (SIGKILL, SIGTERM: nothing ran its
    cleanup) is removed first. Where the cache cannot be written, the system's temporary folder."""
    from trainfast.hardware import cache_dir

    root = cache_dir() / kind
    try:
        root.mkdir(parents=True, exist_ok=True)
        for old in root.iterdir():
            pid = old.name.split("-")[0]
            if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)) and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=root))
    except OSError:
        tmp = Path(tempfile.mkdtemp(prefix=f"trainfast-{kind}-"))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
