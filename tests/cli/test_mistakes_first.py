"""A data dir that cannot be written, and a fleet that cannot work (nothing listens at an attached URL, a server that
is no SGLang, a malformed URL, no emulated server), are said first: before Dagster is imported or any run starts, in
one sentence with the fix, exit 2; nothing is written, and the instance still names the data dir it used before (a run
that did not start is never remembered).

The data dir: a file, a path under a file, a read-only filesystem, a full one, and a new one under a read-only parent.
The filesystems are tmpfs mounts of the test's own (tests/support/tmpfs.py; skipped where none can be mounted).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
from contextlib import ExitStack
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dflash_assets.store.in_use import data_in_use, remember_data_dir
from tests.support.cli import dflash
from tests.support.dagster_procs import PROJECT_DAGSTER_YAML
from tests.support.tmpfs import remount, tmpfs

CASES = {
    "a file": ("file", "is a file: give --data-dir a directory"),
    "under a file": ("file/data", "lies under"),
    "read-only": ("ro", "cannot be written (Read-only file system): give --data-dir a directory you can write to"),
    "full": ("full", "cannot be written (No space left on device): give --data-dir a directory you can write to"),
    "read-only parent": ("ro/new/data", "would be made, cannot be written (Read-only file system)"),
}


@pytest.fixture(scope="module")
def mounts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mistakes-first")
    with ExitStack() as stack:
        ro = stack.enter_context(tmpfs(tmp / "ro", "64k"))
        remount(ro, "ro")
        full = stack.enter_context(tmpfs(tmp / "full", "64k"))
        try:
            with (full / "filler").open("wb") as f:  # every page of it taken
                while True:
                    f.write(b"\0" * 4096)
                    f.flush()
        except OSError:
            pass
        (tmp / "file").write_text("not a directory\n")
        yield tmp


@pytest.mark.parametrize("case", CASES)
def test_a_data_dir_that_cannot_be_written_is_one_sentence_exit_2_before_any_run_and_not_remembered(
    mounts, tmp_path, case
):
    where, said = CASES[case]
    data = mounts / where
    home, before = tmp_path / "home", tmp_path / "before"
    home.mkdir()
    shutil.copy(PROJECT_DAGSTER_YAML, home / "dagster.yaml")
    remember_data_dir(home, str(before))  # the data dir the instance's last run wrote into
    listed = sorted(os.listdir(home))
    env = {"DAGSTER_HOME": str(home), "DFLASH_DATA_DIR": None}
    for command in (("demo",), ("backfill",), ("continue", "--to", "8192")):
        ran = dflash(*command, "--data-dir", str(data), env=env, cwd=tmp_path)
        assert ran.returncode == 2, ran.stdout + ran.stderr
        [line] = ran.stderr.splitlines()  # one sentence, nothing else
        assert line.startswith(f"dflash {command[0]}: ") and said in line, line
        assert str(Path(data).resolve()) in line, line
        assert ran.stdout == "", ran.stdout  # no run started: nothing of Dagster's said
    assert sorted(os.listdir(home)) == listed  # no run recorded, the instance's data dir as it was
    assert data_in_use({"DAGSTER_HOME": str(home)}).data_dir == str(before)
    assert not any(p.name.startswith(".dflash-write-check") for p in mounts.rglob("*"))  # the try left nothing


# what a fresh `dflash` process does: its exit status, whether it imported Dagster, and what it said on stderr
FRESH = (
    "import sys\n"
    "from dflash_assets.cli import main\n"
    "status = main(sys.argv[1:])\n"
    "print('dagster imported' if 'dagster' in sys.modules else 'no dagster', file=sys.stdout)\n"
    "sys.exit(status)\n"
)


@pytest.fixture
def not_sglang():
    """A real HTTP server on loopback that is no SGLang server: GET /health is a 404."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def closed_port() -> int:
    """A loopback port nothing listens on: bound, then closed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_fleet_that_cannot_work_is_one_sentence_exit_2_before_dagster_is_imported_and_not_remembered(
    tmp_path, not_sglang
):
    home, before = tmp_path / "home", tmp_path / "before"
    home.mkdir()
    shutil.copy(PROJECT_DAGSTER_YAML, home / "dagster.yaml")
    remember_data_dir(home, str(before))
    listed = sorted(os.listdir(home))
    closed = f"http://127.0.0.1:{closed_port()}"
    cases = [
        ({"DFLASH_FLEET_MODE": "attach", "DFLASH_FLEET_URLS": closed}, ("demo",), f"nothing listens at {closed}"),
        (
            {"DFLASH_FLEET_MODE": "attach", "DFLASH_FLEET_URLS": not_sglang},
            ("backfill",),
            f"{not_sglang} answers GET /health with HTTP 404, as no SGLang server or gateway does",
        ),
        ({"DFLASH_FLEET_MODE": "attach", "DFLASH_FLEET_URLS": "ftp://x"}, ("continue", "--to", "8192"), "ftp://x"),
        ({}, ("demo", "--servers", "0"), "--servers: takes at least 1 server, got 0"),
    ]
    for fleet, command, said in cases:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")} | fleet | {"DAGSTER_HOME": str(home)}
        data = tmp_path / "new-data"
        ran = subprocess.run(
            [sys.executable, "-c", FRESH, *command, "--data-dir", str(data)],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert ran.returncode == 2, ran.stdout + ran.stderr
        [line] = ran.stderr.splitlines()  # one sentence, nothing else
        assert line.startswith(f"dflash {command[0]}: ") and said in line, line
        assert ran.stdout in ("no dagster\n", ""), ran.stdout  # a usage error exits before the print
        assert not data.exists()
    assert sorted(os.listdir(home)) == listed  # no run recorded, the instance's data dir as it was
    assert data_in_use({"DAGSTER_HOME": str(home)}).data_dir == str(before)
