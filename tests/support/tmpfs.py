"""A small filesystem of a test's own, to fill: a tmpfs mounted at a directory under its tmp_path (unique per test,
so safe under pytest-xdist), skipped where it cannot be mounted (not root, no mount), unmounted after."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """`path` (made here) as a tmpfs of `size` ("2m", "256k") for the block; `remount(path, size)` grows it."""
    path.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def remount(path: Path, options: str) -> None:
    """Change a mounted tmpfs: "size=64m" to grow it, "ro" to make it read-only."""
    subprocess.run(["mount", "-o", f"remount,{options}", str(path)], check=True)
