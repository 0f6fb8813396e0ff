"""A data dir that runs out (space, writability, open files): the part being written is removed, every committed
part reads back, and the error is found under its wrappers and said in one line (store/exhaustion.py); a report that
cannot write its files says the same line (defs/faults.py)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap

import pytest

from dflash_assets.cli.runner import Stops, record_failures
from dflash_assets.defs.partitions import shard_partitions
from dflash_assets.store.exhaustion import exhausted_error, exhaustion
from dflash_assets.store.parts import PartStore
from dflash_assets.store.schema import FAILURE_SCHEMA
from tests.support import dagster_run
from tests.support.dagster_run import run_shard
from tests.support.shards import questions, write_prompts
from tests.support.tmpfs import remount, tmpfs


@pytest.fixture
def small_disk(tmp_path):
    with tmpfs(tmp_path / "data", "256k") as path:
        yield path


def rows(n: int, size: int) -> list[dict]:
    # random text: zstd cannot shrink it, so the file is as large as the rows
    return [{"shard": "00000", "prompt_id": f"p{i}", "error": os.urandom(size).hex()} for i in range(n)]


def store(root) -> PartStore:
    return PartStore(root, "failures", "00000", FAILURE_SCHEMA)


def test_a_part_that_fills_the_disk_is_removed_and_the_stop_says_where_and_what_is_left(small_disk):
    parts = store(small_disk)
    parts.commit(rows(5, 1000))
    with pytest.raises(OSError) as raised:
        parts.commit(rows(50, 10_000))  # ~1 MB of text on 256 KiB
    assert exhausted_error(raised.value).errno == errno.ENOSPC
    assert not [p for p in parts.dir.iterdir() if p.name.endswith(".tmp")], "the unfinished part was left behind"
    assert parts.read().num_rows == 5  # the committed part reads back, whole
    line = exhaustion(raised.value, small_disk).line(5)
    assert line.startswith(f"no space left on device on {small_disk} (") and " free of 256.0 KiB)" in line, line
    assert line.endswith("free space, then run the same command again (5 committed rows are kept)"), line


def test_a_read_only_data_dir_is_named_as_such(small_disk):
    parts = store(small_disk)
    parts.commit(rows(2, 100))
    remount(small_disk, "ro")
    with pytest.raises(OSError) as raised:
        parts.commit(rows(2, 100))
    line = exhaustion(raised.value, small_disk).line(None)
    # the directory that could not be written, and what is left on its filesystem
    assert line.startswith(f"read-only file system on {parts.dir} (") and "make it writable" in line, line
    assert line.endswith("(the committed rows are kept)")
    assert parts.read().num_rows == 2


def test_the_open_files_limit_is_named_with_the_count(tmp_path):
    # in a child: its own RLIMIT_NOFILE, used up, then a commit
    script = textwrap.dedent(f"""
        import resource, sys
        from dflash_assets.store.exhaustion import exhaustion
        from dflash_assets.store.parts import PartStore
        from dflash_assets.store.schema import FAILURE_SCHEMA
        store = PartStore({str(tmp_path)!r}, "failures", "00000", FAILURE_SCHEMA)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        held = []
        try:
            while True:
                held.append(open("/dev/null"))
        except OSError:
            held.pop().close()  # one left: the part's temporary file opens, its write needs more
        try:
            for _ in range(3):
                store.commit([{{"shard": "00000", "prompt_id": "p", "error": "x"}}])
                held.append(open("/dev/null"))
        except OSError as e:
            for f in held:
                f.close()
            print(exhaustion(e, {str(tmp_path)!r}).line(0))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"too many open files (this process's limit) on {tmp_path}/"), done.stdout
    assert "of 64 files open): raise the open-files limit (ulimit -n)" in done.stdout, done.stdout


def test_the_errno_is_found_under_any_wrapper_and_nothing_else_is_taken_for_it():
    full = OSError(errno.ENOSPC, "No space left on device")
    try:
        try:
            raise full
        except OSError:
            raise RuntimeError("the commit failed") from ValueError("wrapped")  # context: the OSError
    except RuntimeError as wrapped:
        assert exhausted_error(wrapped) is full
    assert exhausted_error(RuntimeError("x")) is None
    assert exhausted_error(OSError(errno.ECONNREFUSED, "refused")) is None


@pytest.fixture(scope="module")
def fleet_size() -> int:
    return 1


def test_a_report_that_cannot_write_its_picture_says_the_same_line_and_nothing_later_hides_it(tmp_path, fleet_urls):
    # completions commit on the normal disk; the reports' directory is a read-only filesystem of its own
    write_prompts(tmp_path / "prompts.jsonl", questions(6))
    with tmpfs(tmp_path / "data" / "reports", "256k") as reports, dagster_run.instance() as instance:
        remount(reports, "ro")
        instance.add_dynamic_partitions(shard_partitions.name, ["00000"])
        result = run_shard(instance, dagster_run.resources(tmp_path, fleet_urls, 6), "00000", cap=4096)
        assert not result.success and result.asset_materializations_for_node("completions")
        stops = Stops()
        record_failures(result, "shard 00000", stops)
    first = stops.errors[0]
    assert first.where == "shard 00000, step length_quality_report", stops.errors
    assert first.message.startswith(f"read-only file system on {reports}"), first.message
    assert first.message.endswith("make it writable, then run the same command again (6 committed rows are kept)")
    assert first.says_next and not first.passing
