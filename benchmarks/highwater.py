"""The kernel's own peak of this process's resident memory (VmHWM), and its reset (`/proc/self/clear_refs`, Linux
4.0+): a peak no sampling thread can miss, even one reached inside a call that holds the GIL."""

from pathlib import Path


def peak() -> int:
    """Bytes: the largest resident set since the process started or `reset` was last called."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line")


def reset() -> None:
    """From now on `peak` is the largest resident set from here on (and so is the process's ru_maxrss, which the
    kernel takes from the same mark)."""
    Path("/proc/self/clear_refs").write_text("5")
