"""A polite stop: SIGINT (Ctrl-C, and the UI's Terminate, which Dagster sends as SIGINT) and SIGTERM stop generating
within seconds, keeping what was answered.

While `stopping()` is entered (in the main thread), the first signal sets the process's stop: the dispatcher sends
nothing new, closes the streams in flight (SGLang aborts a closed stream: `tokenizer_manager.create_abort_task`),
commits what it holds and raises `Stopped`. A second signal within AGAIN_S is the same press (`uv run` forwards it);
a later one exits at once (`os._exit`, as a kill -9). Dagster's own SIGINT handler (`capture_interrupts`) only notes
the signal for the next step boundary: hence a handler of our own around the generating body.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

EXIT_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}  # 128 + the signal's number, as a shell reports it
NAMES = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM"}


class Stopped(Exception):
    """Generation stopped on a signal, after committing what was answered."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {NAMES.get(signal.Signals(signum), str(signum))}")
        self.signum = signum

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS.get(signal.Signals(self.signum), 1)


class Stop:
    """The process's stop: which signal asked for it (None: none did)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.at = 0.0  # time.monotonic() of the request

    def request(self, signum: int) -> None:
        self.signum, self.at = signum, time.monotonic()

    def check(self) -> None:
        """Raise Stopped once a stop was asked for."""
        if self.signum is not None:
            raise Stopped(self.signum)


STOP = Stop()


AGAIN_S = 1.0  # a signal this soon after the first is the same press, delivered twice (a launcher forwards it)


def _handler(signum: int, _frame: FrameType | None) -> None:
    if STOP.signum is not None and time.monotonic() - STOP.at < AGAIN_S:
        return  # `uv run` forwards the terminal's SIGINT to its child, which the terminal sent it too
    if STOP.signum is not None:  # the second press: at once
        sys.stderr.write(f"\n{NAMES.get(signal.Signals(signum), signum)} again: exiting at once\n")
        sys.stderr.flush()
        os._exit(EXIT_STATUS.get(signal.Signals(signum), 1))
    STOP.request(signum)  # the command says what stopped, once it has (one line)


@contextmanager
def stopping() -> Iterator[Stop]:
    """SIGINT and SIGTERM set STOP while the body runs (main thread only; elsewhere nothing changes). After a stop
    the handler stays, so a second signal exits at once wherever the program is."""
    if threading.current_thread() is not threading.main_thread():
        yield STOP
        return
    before = {s: signal.getsignal(s) for s in EXIT_STATUS}
    for s in EXIT_STATUS:
        signal.signal(s, _handler)
    try:
        yield STOP
    finally:
        if STOP.signum is None:
            for s, handler in before.items():
                signal.signal(s, handler)


def stop_line(stopped: Stopped, name: str, resume: str, data_dir: str | None) -> str:
    """What the terminal says of a polite stop of `dflash <name>`, in one line, with `resume`, the command that
    resumes it. `data_dir`: where its rows are committed (None: a command that generates nothing)."""
    from dflash_assets.store.stores import committed_rows

    if data_dir is None:
        return f"dflash {name} {stopped}: nothing was sent to generate; run again with: {resume}"
    try:
        rows = f"{sum(committed_rows(data_dir).values()):,} completion rows are committed under {data_dir}"
    except OSError:
        rows = f"the completion rows committed under {data_dir} are kept"
    return (
        f"dflash {name} {stopped}: the requests in flight were ended on the servers, {rows} (kept); "
        f"resume with: {resume}"
    )
