"""A data dir belongs to one prompt source, and the instance's shard partitions follow the source.

The accident this guards against: `dflash demo --prompts other.jsonl` on the demo's data dir overwrote prompt_shards/shard=00000
with the other file's prompts and deleted shard=00001, beside completions that were no longer theirs, then failed
"past the end". Here another source is refused before anything is written, a grown source adds a shard, a changed
one is refused, and another source in a new DFLASH_DATA_DIR on the same DAGSTER_HOME runs.
"""

import json
import shutil
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.instance.ref import InstanceRef

from tests.support.backfill import FAST
from tests.support.cli import dflash, home
from tests.support.forks import start_emulator

pytestmark = pytest.mark.long

SHARD_SIZE = 3


def prompts(path: Path, n: int, word: str = "why") -> Path:
    path.write_text("".join(json.dumps({"id": f"{word}{i}", "prompt": f"{word} {i}?"}) + "\n" for i in range(n)))
    return path


def snapshot(*roots: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for root in roots for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def fleet():
    with start_emulator(FAST) as emu:
        yield emu.url


def first_run(root: Path, fleet: str) -> tuple[dict, Path]:
    """A backfill of a two-shard source into a fresh instance and data dir under `root`: the data dir's source."""
    env = home(root, "home") | {
        "DFLASH_FLEET_MODE": "attach",
        "DFLASH_FLEET_URLS": fleet,
        "DFLASH_SHARD_SIZE": str(SHARD_SIZE),
        "DFLASH_PROMPTS": str(prompts(root / "first.jsonl", 2 * SHARD_SIZE)),
    }
    first = dflash("backfill", "--max-output-tokens", "4096", env=env, cwd=env.pop("CWD"))
    assert first.returncode == 0, first.stdout + first.stderr
    return env, Path(env["DFLASH_DATA_DIR"])


@pytest.fixture(scope="module")
def completed(tmp_path_factory, fleet):
    return first_run(tmp_path_factory.mktemp("first"), fleet)


@pytest.fixture
def project(tmp_path, completed):
    """A copy of the completed instance and data dir, on the same source (which the tests leave as it is)."""
    env, data = completed
    copies = {"DAGSTER_HOME": tmp_path / "home", "DFLASH_DATA_DIR": tmp_path / "data"}
    for name, copy in copies.items():
        shutil.copytree(env[name], copy)
    return {**env, **{k: str(v) for k, v in copies.items()}}, copies["DFLASH_DATA_DIR"]


def test_a_second_source_on_a_data_dir_with_completions_is_refused_and_nothing_is_written(tmp_path, project):
    env, data = project
    other = prompts(tmp_path / "other.jsonl", SHARD_SIZE + 1, "how")
    before = snapshot(data, Path(env["DAGSTER_HOME"]))
    for command in ("demo", "backfill"):
        refused = dflash(command, "--prompts", str(other), "--max-output-tokens", "4096", env=env)
        lines = (refused.stdout + refused.stderr).strip().splitlines()
        assert refused.returncode == 2 and len(lines) == 1, refused.stdout + refused.stderr
        assert lines[0] == (
            f"dflash {command}: data dir {data} holds the prompt shards of {env['DFLASH_PROMPTS']}, not of "
            f"{other}: a data dir belongs to one prompt source; set DFLASH_DATA_DIR to a new directory for "
            f"{other} (or give --prompts {env['DFLASH_PROMPTS']} to go on with it)"
        )
    assert snapshot(data, Path(env["DAGSTER_HOME"])) == before, "a refused run wrote or deleted a file"


def test_another_source_in_a_new_data_dir_on_the_same_instance_finds_its_own_shards(tmp_path, project):
    env, data = project
    other = prompts(tmp_path / "other.jsonl", SHARD_SIZE - 1, "how")  # one shard: the instance had two
    run = dflash(
        "backfill",
        "--prompts",
        str(other),
        "--max-output-tokens",
        "4096",
        env={**env, "DFLASH_DATA_DIR": str(tmp_path / "other-data")},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "shards 00000..00000 (1)" in run.stdout and "past the end" not in run.stdout + run.stderr, run.stdout
    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(env["DAGSTER_HOME"])) as instance:
        assert instance.get_dynamic_partitions("shards") == ["00000"]  # they follow the source of the run
    # the first data dir is the first source's, as it was: its second shard and its completions are kept
    assert sorted(p.name for p in (data / "completions").iterdir()) == ["shard=00000", "shard=00001"]


def test_a_grown_source_adds_a_shard_and_a_changed_one_is_refused(tmp_path, fleet):
    env, data = first_run(tmp_path, fleet)
    source = Path(env["DFLASH_PROMPTS"])
    prompts(source, 2 * SHARD_SIZE + 2)  # the same first lines, two more: a third shard
    grown = dflash("backfill", "--max-output-tokens", "4096", env=env)
    assert grown.returncode == 0 and "shards 00000..00002 (3)" in grown.stdout, grown.stdout + grown.stderr
    assert sorted(p.name for p in (data / "completions").iterdir()) == ["shard=00000", "shard=00001", "shard=00002"]
    lines = source.read_text().splitlines(keepends=True)
    lines[SHARD_SIZE] = json.dumps({"id": "changed", "prompt": "another question"}) + "\n"  # shard 00001's first
    source.write_text("".join(lines))
    before = snapshot(data)
    changed = dflash("backfill", "--max-output-tokens", "4096", env=env)
    assert changed.returncode == 2 and len(changed.stdout.strip().splitlines()) == 1, changed.stdout
    assert changed.stdout.startswith(
        f"dflash backfill: data dir {data}: the lines of shard 00001 changed under its completions: {source} as "
        f"recorded ({SHARD_SIZE} lines, fingerprint "
    ), changed.stdout
    assert "restore the file, or set DFLASH_DATA_DIR to a new directory" in changed.stdout
    assert snapshot(data) == before
