"""A fleet the run starts (emulated) is kept up while the run lasts: a server whose process ended is relaunched at its
port with the same flags, and the slot picker takes it back (generation/slots.py). Launched servers are relaunched by
the next `dflash fleet up`, attached ones by whoever runs them."""

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def supervised(
    dead: Callable[[], list[str]],
    relaunch: Callable[[str], None],
    say: Callable[[str], None],
    interval_s: float = 1.0,
) -> Iterator[None]:
    """While inside, every `interval_s`, `relaunch(name)` each server `dead()` names, in a thread of its own (a
    relaunch waits for /health); what it does is said with `say`."""
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(interval_s):
            for name in dead():
                if stop.is_set():
                    return
                try:
                    relaunch(name)
                except Exception as e:  # noqa: BLE001 - said, and tried again at the next look
                    say(f"{name}: its process ended and could not be relaunched: {e}")
                else:
                    say(f"{name}: its process ended; relaunched at its port")

    thread = threading.Thread(target=watch, name="fleet-supervisor", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
