"""A resource of the data dir's machine ran out: the errnos no retry cures (ENOSPC, EDQUOT, EROFS, EMFILE, ENFILE),
found under whatever wraps them (the chain is walked by __cause__ and __context__). They stop a run at once and say
what ran out, where, and what is left.
"""

from __future__ import annotations

import errno
import os
import resource
from dataclasses import dataclass
from pathlib import Path

# errno -> what ran out, and what frees it
EXHAUSTED: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("no space left on device", "free space"),
    errno.EDQUOT: ("disk quota exceeded", "free space (or raise the quota)"),
    errno.EROFS: ("read-only file system", "make it writable"),
    errno.EMFILE: ("too many open files (this process's limit)", "raise the open-files limit (ulimit -n)"),
    errno.ENFILE: ("too many open files (the system's limit)", "close files or raise fs.file-max"),
}


def exhausted_error(exc: BaseException | None) -> OSError | None:
    """The first OSError in `exc`'s chain (itself, then its causes and contexts) whose errno is an exhaustion."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        e = stack.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in EXHAUSTED:
            return e
        stack += [e.__cause__, e.__context__]
    return None


@dataclass(frozen=True)
class Exhaustion:
    """What ran out where: the line a person reads."""

    errno: int
    path: str  # the directory the error names (the one that could not be written), else the data dir
    left: str  # what is left of it: "0 B free of 2.0 MiB", "1024 of 1024 files open"

    @property
    def what(self) -> str:
        return EXHAUSTED[self.errno][0]

    def line(self, committed_rows: int | None) -> str:
        kept = "the committed rows are kept" if committed_rows is None else f"{committed_rows} committed rows are kept"
        return (
            f"{self.what} on {self.path} ({self.left}): {EXHAUSTED[self.errno][1]}, then run the same command "
            f"again ({kept})"
        )


def exhaustion(exc: BaseException, data_dir: str | os.PathLike) -> Exhaustion | None:
    """The exhaustion under `exc`, if any, measured where it happened: the directory the error names (pyarrow's
    errors name none: then the data dir)."""
    found = exhausted_error(exc)
    if found is None or found.errno is None:  # exhausted_error finds only errnos in EXHAUSTED: never None
        return None
    path = Path(os.fspath(data_dir))
    if isinstance(found.filename, str | bytes):
        named = Path(os.fsdecode(found.filename))
        path = named if named.is_dir() else named.parent  # a file's, or a directory that could not be made
    return Exhaustion(found.errno, str(path), left(found.errno, path))


def left(code: int, path: Path) -> str:
    """What is left, read now: free space (or inodes) of the filesystem holding `path`, or open files."""
    if code == errno.EMFILE:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        try:
            return f"{len(os.listdir('/proc/self/fd'))} of {soft} files open"
        except OSError:  # listing needs a file descriptor too
            return f"all {soft} files open"
    if code == errno.ENFILE:
        try:
            used, _, limit = Path("/proc/sys/fs/file-nr").read_text().split()
            return f"{used} of {limit} files open on the system"
        except (OSError, ValueError):
            return "the system's open files"
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None:
        return "free space unknown"
    st = os.statvfs(existing)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    if code == errno.ENOSPC and free and st.f_files and not st.f_favail:
        return f"0 of {st.f_files} inodes free, {size(free)} free"
    return f"{size(free)} free of {size(total)}"


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
