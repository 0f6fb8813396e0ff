"""Polling for a condition a test forces (a server up, a step blocked, a row committed), bounded for a slow machine:
the bound is never a timing the test relies on."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    what: str,
    ready: Callable[[], T],
    timeout_s: float = 60.0,
    *,
    every_s: float = 0.2,
    proc: subprocess.Popen | None = None,
    hint: str = "",
    explain: Callable[[], str] | None = None,
) -> T:
    """`ready()`'s first true value, polled every `every_s`; an OSError counts as not ready (not listening yet).
    Fails naming `what` after `timeout_s`, or as soon as `proc` (the process that should make it true) exits, with
    what `explain()` says of the state it was in (the runs and their last events, say)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if value := ready():
                return value
        except OSError:
            pass
        exited = proc is not None and proc.poll() is not None
        if exited or time.monotonic() > deadline:
            why = f"exit {proc.returncode}" if exited else f"not within {timeout_s:g}s"
            said = f"\n{explain()}" if explain is not None else ""
            raise AssertionError(f"{what}: {why}" + (f" ({hint})" if hint else "") + said)
        time.sleep(every_s)
