"""The Dagster instance on Postgres: deploy/dagster.yaml, the file a multi-host deployment uses, tested here.

A throwaway Postgres (initdb into a temporary directory, a loopback port, stopped at the end of the session:
the `postgres` fixture) holds runs, event logs and schedules. The webserver and the daemon run on an instance
made from deploy/dagster.yaml, and the backfill of tests/engines/test_backfill.py runs against it with the same checks:
every run succeeds, every partition of every shard asset is materialised, every check evaluated and the
blocking ones passed, each shard's rows exactly once, and never more `completions` steps at once than the
`sglang_fleet` pool allows though steps of other runs waited for it (the contention forced by the held emulator).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.support import backfill
from tests.support.dagster_procs import ARTIFACTS, PROJECT_DAGSTER_YAML, ROOT
from tests.support.services import environ

pytestmark = pytest.mark.timeout(420)

DEPLOY_DAGSTER_YAML = ROOT / "deploy" / "dagster.yaml"


def test_the_postgres_instance_has_the_run_queue_and_pool_of_the_local_one():
    local, deploy = (yaml.safe_load(p.read_text()) for p in (PROJECT_DAGSTER_YAML, DEPLOY_DAGSTER_YAML))
    for section in ("concurrency", "run_monitoring", "telemetry"):
        assert deploy[section] == local[section], section
    assert set(deploy["storage"]) == {"postgres"} and "storage" not in local


@pytest.fixture(scope="module")
def database(postgres):
    settings = postgres.database("backfill")
    with environ(settings):
        yield settings["DAGSTER_PG_DB"]


@pytest.fixture(scope="module")
def stack(database, tmp_path_factory):
    with backfill.open_stack(
        tmp_path_factory.mktemp("backfill-postgres"), DEPLOY_DAGSTER_YAML, ARTIFACTS / "logs" / "backfill-postgres"
    ) as opened:
        yield opened


def test_a_backfill_on_the_postgres_instance_checks_what_the_sqlite_one_does(stack, postgres, database):
    assert type(stack.instance.run_storage).__name__ == "PostgresRunStorage"
    assert type(stack.instance.event_log_storage).__name__ == "PostgresEventLogStorage"
    backfill.check_pool_backfill(stack, ARTIFACTS / "backfill-postgres")  # pool.json beside the SQLite one

    # what the webserver and the daemon wrote is in the database itself, not in files under DAGSTER_HOME
    with postgres.connect(database) as conn, conn.cursor() as cursor:
        cursor.execute("select count(*) from runs where status = 'SUCCESS'")
        runs = cursor.fetchone()[0]
        cursor.execute("select count(*) from event_logs where dagster_event_type = 'ASSET_MATERIALIZATION'")
        materialisations = cursor.fetchone()[0]
    assert runs == len(backfill.POOL_SHARDS)
    assert materialisations == len(backfill.POOL_SHARDS) * len(backfill.SHARD_ASSETS)
    assert not list(Path(stack.instance.root_directory).glob("**/*.db")), "no SQLite storage beside Postgres"
