"""What the route handlers share: one server's config, engine and faults."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from .config import EmulatorSetup
from .engine import Engine
from .faults import Faults, Verdict


@dataclass
class ServerState:
    cfg: EmulatorSetup
    engine: Engine
    faults: Faults
    judge: Callable[[str], Verdict]  # the fault verdict for an arriving generation request, by its prompt's text
    ready: bool = False
    started: float = field(default_factory=time.monotonic)
    startup_time: float = field(default_factory=time.time)


STATE = web.AppKey("emulator_state", ServerState)
