"""A fleet the run starts (emulated) is kept up while the run lasts: a server whose process ended (a prompt that kills
it) is relaunched at its port with the same flags. The slot picker takes it back once it answers /health
(generation/slots.py), and the quarantine counts its next death as a new one (generation/quarantine.py), so a fleet
of one finishes a poisoned run in that run. Launched servers outlive the run and are relaunched by the next run's
`dflash fleet up` (fleet/launcher.py); attached ones are someone else's to relaunch (systemd, Kubernetes)."""

from __future__ import annotations

import threading
from collections.abc import Callable

POLL_S = 1.0


class Supervisor:
    """While it is entered, every `interval_s` asks `dead()` for the servers whose process ended and `relaunch(name)`s
    each, in a thread of its own (a relaunch waits for /health). What it does is said with `say`."""

    def __init__(
        self,
        dead: Callable[[], list[str]],
        relaunch: Callable[[str], None],
        say: Callable[[str], None],
        interval_s: float = POLL_S,
    ) -> None:
        self.dead, self.relaunch, self.say, self.interval_s = dead, relaunch, say, interval_s
        self.relaunched = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="fleet-supervisor", daemon=True)

    def __enter__(self) -> Supervisor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            for name in self.dead():
                if self._stop.is_set():
                    return
                try:
                    self.relaunch(name)
                except Exception as e:  # noqa: BLE001 - said, and tried again at the next look
                    self.say(f"{name}: its process ended and could not be relaunched: {e}")
                else:
                    self.relaunched += 1
                    self.say(f"{name}: its process ended; relaunched at its port")
