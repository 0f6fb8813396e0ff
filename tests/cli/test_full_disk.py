"""The data dir's disk fills during completions: a named stop, not retried, nothing lost, and the same command
finishes once there is room.

The data dir is a tmpfs of its own, mounted for the test under its own tmp_path (root can mount one; elsewhere the
test is skipped), DAGSTER_HOME on the normal disk: only the data dir fills. The demo's first two shards on 1 MB:
it holds their prompt shards and about half of their completions (the whole demo fills 2 MB the same way, at twice
the cost).
"""

from __future__ import annotations

import re
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest
from dagster._core.events import DagsterEventType
from dagster._core.instance.ref import InstanceRef

from tests.cli.test_kill_resume import accepted_prompt_ids, completion_rows
from tests.support.cli import demo_slice, dflash, home
from tests.support.tmpfs import remount, tmpfs

pytestmark = pytest.mark.long


@pytest.fixture
def small_disk(tmp_path):
    with tmpfs(tmp_path / "data", "1m") as path:
        yield path


def done_column(stdout: str) -> dict[str, int]:
    """shard -> the table's `done` figure."""
    return {m[0]: int(m[1]) for m in re.findall(r"^\s*(\d{5})\s+\S+\s+\S+\s+(\d+)\s", stdout, re.MULTILINE)}


def test_a_full_data_dir_stops_the_run_at_once_named_and_the_same_command_finishes_once_there_is_room(
    tmp_path, small_disk
):
    env = home(tmp_path, "home") | {
        "DFLASH_DATA_DIR": str(small_disk),
        "DFLASH_FLEET_MODE": "emulated",
        "DFLASH_NUM_SERVERS": "1",
        "DFLASH_PROMPTS": str(demo_slice(tmp_path, 200)),
    }
    full = dflash("demo", "--cap-policy", "fixed", env=env, cwd=tmp_path, timeout=600)
    out = " ".join(full.stdout.split())  # rich wraps long lines
    assert full.returncode == 1, full.stdout + full.stderr
    committed = completion_rows(small_disk)
    assert 0 < len(committed) < len(accepted_prompt_ids(small_disk)), "the disk was to fill during completions"
    # one line: what ran out, where, what is left, and the next command with the rows it keeps
    # (on the data dir, or the shard's directory when the error names the file: a part's creation can fail too)
    assert re.search(rf"step completions: no space left on device on {small_disk}(/completions/\S+)? \(", out), out
    assert f"free space, then run the same command again ({len(committed)} committed rows are kept)" in out, out
    assert "RetryRequestedFromPolicy" not in out and "Exceeded max_retries" not in out, out
    assert "Traceback" not in full.stdout
    # the table shows what was committed before the stop (the recount in the failure's metadata)
    assert sum(done_column(full.stdout).values()) == len(committed), full.stdout
    assert "done is what their run committed before it stopped" in out, out
    # not retried: the step ran once
    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(env["DAGSTER_HOME"])) as instance:
        [run] = instance.get_runs(filters=dg.RunsFilter(job_name="shard_pipeline"))
        starts = [e for e in instance.all_logs(run.run_id, of_type=DagsterEventType.STEP_START)]
        retries = instance.all_logs(run.run_id, of_type=DagsterEventType.STEP_UP_FOR_RETRY)
        [failure] = instance.all_logs(run.run_id, of_type=DagsterEventType.RUN_FAILURE)
    assert [e.step_key for e in starts].count("completions") == 1 and not retries
    assert "no space left on device on" in failure.dagster_event.event_specific_data.error.message
    # nothing torn: every Parquet file reads back, no unfinished part is left behind
    files = [p for p in small_disk.rglob("*") if p.is_file() and p.name != ".lock"]
    assert not [p for p in files if p.name.endswith(".tmp")], files
    for path in (p for p in files if p.suffix == ".parquet"):
        pq.read_table(path)

    remount(small_disk, "size=64m")
    again = dflash("demo", "--cap-policy", "fixed", env=env, cwd=tmp_path, timeout=600)
    assert again.returncode in (0, 3), again.stdout + again.stderr
    rows = completion_rows(small_disk)
    assert len(rows) == len(set(rows)), "a row was written twice"
    assert {r[0] for r in rows} == accepted_prompt_ids(small_disk), "a prompt was lost"
    assert set(committed) <= set(rows)
    assert Path(small_disk / "training").is_dir(), again.stdout
