"""An emulator served from a thread of the test process: fast to start, and a crash fault closes the server instead
of killing the test process."""

from __future__ import annotations

import asyncio
import threading
from typing import Self

from dflash_assets.emulator.process import server_argv


class EmulatorThread:
    """An emulator served from a daemon thread of this process."""

    def __init__(self, args: list[str]):
        from dflash_assets.emulator.config import resolve

        self.cfg = resolve(args)
        self.port: int | None = None
        self.crashed = False
        self._bound = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="emulator", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.cfg.args.host}:{self.port}"

    def _run(self) -> None:
        from dflash_assets.emulator.server import serve

        async def main():
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            await serve(self.cfg, stop=self._stop, on_crash=self._crash, on_bound=self._on_bound)

        try:
            asyncio.run(main())
        except Exception as e:  # surfaced by start()
            self._error = e
            self._bound.set()

    def _on_bound(self, port: int) -> None:
        self.port = port
        self._bound.set()

    def _crash(self) -> None:
        # Stop serving at once; the request that tripped it gets its connection dropped.
        from dflash_assets.emulator.server import InjectedCrash

        self.crashed = True
        if self._stop is not None:
            self._stop.set()
        raise InjectedCrash()

    def start(self, timeout: float = 10.0) -> EmulatorThread:
        self._thread.start()
        if not self._bound.wait(timeout) or self._error is not None:
            raise RuntimeError(f"emulator thread failed to start: {self._error!r}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def run_emulator_in_thread(args: list[str] | tuple[str, ...] = (), *, port: int = 0) -> EmulatorThread:
    """Start an in-process emulator on a free port (default); returns once listening."""
    return EmulatorThread([*server_argv(args), "--port", str(port)]).start()
