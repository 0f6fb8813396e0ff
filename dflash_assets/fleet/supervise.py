"""A fleet the run starts or launches is kept up while the run lasts: a server whose process ended is relaunched at
its port with the same flags (emulated: here; launch: through launcher.up, which waits for its /health up to the
launch health timeout), and the slot picker takes it back (generation/slots.py). Attached ones: whoever runs them."""

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from dflash_assets.fleet.launcher import FleetSpec, ended, up
from dflash_assets.fleet.registry import ServerRecord


@contextmanager
def supervised(
    dead: Callable[[], list[str]], relaunch: Callable[[str, threading.Event], object], say: Callable[[str], None]
) -> Iterator[None]:
    """While inside, every second, `relaunch(name, stop)` each server `dead()` names, in a thread of its own. `stop`
    is set when the block ends: a relaunch waiting for /health gives up, nothing more is relaunched or said."""
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(1.0):
            for name in dead():
                if stop.is_set():
                    return
                try:
                    relaunch(name, stop)
                    said = f"{name}: its process ended; relaunched at its port"
                except Exception as e:  # noqa: BLE001 - said, and tried again at the next look
                    said = f"{name}: its process ended and could not be relaunched: {e}"
                if stop.is_set():
                    return
                say(said)

    thread = threading.Thread(target=watch, name="fleet-supervisor", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextmanager
def launched(spec: FleetSpec, fleet_dir: Path, say: Callable[[str], None]) -> Iterator[list[ServerRecord]]:
    """`launch` mode: the fleet brought to `spec` and kept up while inside by `up` again (it relaunches the dead and
    reuses the rest). The servers outlive the block: `dflash fleet down` stops them."""
    records = up(spec, fleet_dir, on_event=say)
    with supervised(lambda: ended(spec, fleet_dir), lambda _, stop: up(spec, fleet_dir, False, say, stop), say):
        yield records
