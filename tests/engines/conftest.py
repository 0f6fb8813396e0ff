"""The tests that start an engine (Postgres, Redis and Celery workers, the smg gateway, Chromium, moto's S3
server, Dagster's webserver and daemon): each is marked `engines`, so `pytest -m "not engines"` is the fast suite."""

from __future__ import annotations

from pathlib import Path

import pytest

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
