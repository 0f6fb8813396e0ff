"""Fixtures every folder uses: in-process emulators, SGLang 0.5.23's generated API, the quality data sets.

The engines' fixtures (Postgres, Redis) are in tests/engines/conftest.py; plain helpers in tests/support/.
"""

from __future__ import annotations

import gc
import os
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.support import quality_data
from tests.support.http import Http
from tests.support.services import environ
from tests.support.sglang_wheel import generate_api
from tests.support.shards import FAST

# 0.5.23's /health runs a one-token generation and answers after >= 1 s; SGLang's own switch turns that off.
# The tests that are about the delay ask for it explicitly (--health-delay); the rest do not pay it per connect.
os.environ.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false")
# The emulator draws anew per request, as a server does. Most tests compare runs row for row or assert that a
# generous cap cuts nothing, so they get each prompt's one completion; a test about sampling asks for
# `--sampling per-request` (tests/generation/test_continuation_bump.py, the demo at a 4096 cap in tests/cli/test_terminal.py).
os.environ.setdefault("DFLASH_EMULATOR_SAMPLING", "per-prompt")
# A failed generating step is retried by Dagster after DFLASH_RETRY_DELAY_S (10 s, then 20 s), read once, when the
# definitions are imported. In this process they retry at once: what a test asserts of a retry is that it happens and
# what it resumes, never the wait. Set for that import only: a command prints the settings that differ from their
# defaults (and docs/running.md shows what it prints), so the commands the tests start keep the default.
if "DFLASH_RETRY_DELAY_S" not in os.environ:
    with environ({"DFLASH_RETRY_DELAY_S": "0"}):
        import dflash_assets.defs.resources  # noqa: F401


@pytest.hookimpl(trylast=True)  # after `-m` has deselected
def pytest_collection_modifyitems(items):
    """The order in which scripts/test.sh hands whole files to its workers (`--dist loadfile
    --no-loadscope-reorder`): the files marked `long` first, so they start at once, the short ones fill in around
    them and the workers end together; then by number of tests, most first (xdist's own order). In a run with the
    engines only the engines' long file goes first (tests/engines/test_backfill.py, six minutes): the others,
    started with it, starve its servers. Measured on 2 cores: the fast suite by count alone ran a 3-test file of two
    minutes last, alone for 80 s (6:13; long files first: 5:21). The whole suite: 10:00-13:24 by count (ending on
    the backfill file, started at 310 s), 11:39 with the backfill, Celery and Postgres files first, 13:11 with the
    fast suite's long files first."""
    tests_in = Counter(item.path for item in items)
    engines = any(item.get_closest_marker("engines") for item in items)

    def first(item) -> bool:
        return item.get_closest_marker("long") is not None and (not engines or item.get_closest_marker("engines"))

    items.sort(key=lambda item: (not first(item), -tests_in[item.path]))


@pytest.hookimpl(trylast=True)  # after the slowest tests
def pytest_terminal_summary(terminalreporter):
    """How the workers' time was split: per worker, the seconds of its tests (setup, call
    and teardown) and its longest files, so that the order above can be judged on the run's own figures."""
    files: dict[str, Counter] = {}
    for report in (r for reports in terminalreporter.stats.values() for r in reports):
        worker = getattr(getattr(report, "node", None), "gateway", None)
        if worker is not None and getattr(report, "when", None) in ("setup", "call", "teardown"):
            files.setdefault(worker.id, Counter())[report.nodeid.split("::")[0]] += report.duration
    if not files:
        return  # not run by xdist workers
    terminalreporter.write_sep("=", "seconds of tests per worker")
    for worker, seconds in sorted(files.items()):
        longest = ", ".join(f"{path.removeprefix('tests/')} {s:.0f}" for path, s in seconds.most_common(6))
        terminalreporter.write_line(f"{worker}: {sum(seconds.values()):.0f} s in {len(seconds)} files; {longest}")


def pytest_collection_finish(session):
    """What collection imported (Dagster, the test modules) is never garbage: kept out of the collector's passes
    for the rest of the run, as tests/support/fork_preload.py does for the processes forked warm."""
    gc.freeze()


@pytest.fixture
def emulator():
    """Start in-process SGLang emulators: `emulator(*flags, key=None) -> Http` (stopped after the test)."""
    from tests.support.emulator_thread import run_emulator_in_thread

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


@pytest.fixture(scope="module")
def fleet_args() -> list[str]:
    """The flags of the servers `fleet_urls` starts; a module overrides this fixture to start other servers."""
    return FAST


@pytest.fixture(scope="module")
def fleet_size() -> int:
    """How many servers `fleet_urls` starts; a module overrides it for another fleet."""
    return 2


@pytest.fixture(scope="module")
def fleet_urls(fleet_args, fleet_size):
    """The URLs of an emulated fleet started for the module: servers in processes of their own, as `sglang serve`
    runs (forked warm, tests/support/forks.py)."""
    from tests.support.forks import start_emulator

    with ExitStack() as stack:
        yield [stack.enter_context(start_emulator(fleet_args)).url for _ in range(fleet_size)]


@pytest.fixture(scope="module")
def api():
    """SGLang 0.5.23's generated `/generate` contract (sglang/api/v1/api_types.py), loaded from the wheel."""
    return generate_api()


@pytest.fixture(scope="session")
def defects_dir(tmp_path_factory) -> Path:
    return quality_data.build_defects(tmp_path_factory.mktemp("defects"))


@pytest.fixture(scope="session")
def clean_dir(tmp_path_factory) -> Path:
    return quality_data.build_clean(tmp_path_factory.mktemp("clean"))


@pytest.fixture(scope="session")
def cut_at_cap_dir(tmp_path_factory) -> Path:
    return quality_data.build_cut_at_cap(tmp_path_factory.mktemp("cut_at_cap"))
