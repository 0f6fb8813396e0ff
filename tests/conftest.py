"""Shared fixtures."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import pytest

# 0.5.23's /health runs a one-token generation and answers after >= 1 s; SGLang's own switch turns that off.
# The tests that are about the delay ask for it explicitly (--health-delay); the rest do not pay it per connect.
os.environ.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false")
# The emulator draws anew per request, as a server does. Most tests compare runs row for row or assert that a
# generous cap cuts nothing, so they get each prompt's one completion; a test about sampling asks for
# `--sampling per-request` (tests/test_bump.py, the demo's story in tests/test_cli_terminal.py).
os.environ.setdefault("DFLASH_EMULATOR_SAMPLING", "per-prompt")


def cli_commands(parser=None, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command of `dflash` as a person types it, read from the parser: (), ("demo",), ("fleet", "up"), ..."""
    import argparse

    from dflash_assets.cli import build_parser

    parser = parser or build_parser()
    found = [path]
    for action in parser._actions:  # argparse keeps its subcommands only in this action
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += cli_commands(sub, (*path, name))
    return found


class Http:
    """A tiny synchronous HTTP client for tests against local servers.
    Every call returns (status, body): JSON-decoded when possible, else text."""

    def __init__(self, base: str, key: str | None = None):
        self.base, self.key = base, key

    def request(self, method: str, path: str, body=None, *, headers=None, raw: bytes | None = None, timeout=30):
        hdrs = {"Content-Type": "application/json"} if body is not None else {}
        if self.key:
            hdrs["Authorization"] = f"Bearer {self.key}"
        hdrs.update(headers or {})
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.base + path, data=data, headers=hdrs, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, payload = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, payload = e.code, e.read()
        text = payload.decode()
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def get(self, path, **kw):
        return self.request("GET", path, **kw)

    def post(self, path, body=None, **kw):
        return self.request("POST", path, body, **kw)

    def sse(self, path, body, **kw) -> tuple[int, list]:
        """POST a streaming request; the `data:` payloads, JSON-decoded ([DONE] stays a str)."""
        status, text = self.post(path, body, **kw)
        if not isinstance(text, str):
            return status, text
        events = [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]
        return status, [e if e == "[DONE]" else json.loads(e) for e in events]


@pytest.fixture
def emulator():
    """Start in-process SGLang emulators: `emulator(*flags, key=None) -> Http` (stopped after the test)."""
    from dflash_assets.emulator.process import run_emulator_in_thread

    started = []

    def start(*flags: str, key: str | None = None) -> Http:
        emu = run_emulator_in_thread(list(flags) + (["--api-key", key] if key else []))
        started.append(emu)
        client = Http(emu.url, key)
        client.emu = emu
        return client

    yield start
    for emu in started:
        emu.stop()


@pytest.fixture(scope="session")
def postgres():
    """A throwaway Postgres for the session (tests/services.py); each test module makes its own database."""
    from dagster_procs import ARTIFACTS
    from services import postgres_server

    with postgres_server(ARTIFACTS / "logs" / "postgres.log") as server:
        yield server


@pytest.fixture(scope="session")
def redis_broker():
    """A throwaway redis-server for the session (tests/services.py), the Celery broker and result backend."""
    from dagster_procs import ARTIFACTS
    from services import redis_server

    with redis_server(ARTIFACTS / "logs" / "redis.log") as server:
        yield server
