"""The tests that start an engine (Postgres, Redis and Celery workers, the smg gateway, Chromium, moto's S3
server, Dagster's webserver and daemon): each is marked `engines`, so `pytest -m "not engines"` is the fast suite."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support.backfill import BLOCKED_WITHIN_S, FAST, IN_PROCESS, Stack, completion_rows, launch_backfill
from tests.support.dagster_procs import ARTIFACTS
from tests.support.services import postgres_server, redis_server

HERE = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.engines)


@pytest.fixture(scope="session")
def postgres():
    """A throwaway Postgres for the session (tests/support/services.py); each test module makes its own database."""
    with postgres_server(ARTIFACTS / "logs" / "postgres.log") as server:
        yield server


@pytest.fixture(scope="session")
def redis_broker():
    """A throwaway redis-server for the session (tests/support/services.py), the Celery broker and result backend."""
    with redis_server(ARTIFACTS / "logs" / "redis.log") as server:
        yield server


# a part per row, one request at a time: the first answer is committed alone, the next request is the one held
ONE_AT_A_TIME = {**IN_PROCESS, "ops": {"completions": {"config": {"commit_rows": 1, "max_in_flight_per_server": 1}}}}


def held_after_a_row(stack: Stack, shard: str, title: str, *flags: str) -> tuple[str, list[str]]:
    """A one-shard backfill on a fleet that answers its first request at once and holds every later one (the
    emulator's hold_after): returns once the first row is committed, with the shard's next request certainly in flight
    and held there. The backfill's id and the rows committed."""
    stack.fleet.start(*FAST, "--fault-hold-after", "1", *flags)
    backfill = launch_backfill(stack.server, [shard], title, ONE_AT_A_TIME)
    deadline = time.monotonic() + BLOCKED_WITHIN_S
    while not (stack.fleet.faults()["injected"]["hold"] and (rows := completion_rows(stack.data_dir, shard))):
        assert time.monotonic() < deadline, f"no row of shard {shard} committed and held within {BLOCKED_WITHIN_S}s"
        time.sleep(0.2)
    return backfill, rows
