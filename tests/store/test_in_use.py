"""Which data an instance works on (store/in_use.py): the environment first, then the instance's record of its data
dir, then the data dir's record of its source and shard size, then the defaults."""

import json

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_assets.settings import Deployment
from dflash_assets.store.in_use import INSTANCE_RECORD, data_in_use, remember_data_dir
from dflash_assets.store.source import ShardSource


def data_dir_of(path, source, shard_size):
    """A data dir whose one prompt shard records `source` cut at `shard_size`, as generation writes it."""
    shard = path / "prompt_shards" / "shard=00000"
    shard.mkdir(parents=True)
    record = ShardSource(str(source), shard_size, lines=3, fingerprint="f").metadata()
    pq.write_table(pa.table({"prompt_id": ["a"]}).replace_schema_metadata(record), shard / "prompts.parquet")
    return path


def test_a_new_instance_and_an_empty_environment_take_the_defaults(tmp_path):
    data = data_in_use({"DAGSTER_HOME": str(tmp_path)})
    assert (data.data_dir, data.prompts, data.shard_size) == (
        Deployment.DATA_DIR.default,
        Deployment.PROMPTS.default,
        Deployment.SHARD_SIZE.default,
    )
    assert data.prompts_from == "the default"


def test_the_instance_brings_its_data_dir_and_the_data_dir_its_source_and_shard_size(tmp_path):
    mine = tmp_path / "mine.jsonl"
    data_dir = data_dir_of(tmp_path / "runs" / "mine", mine, 20)
    home = tmp_path / "home"
    home.mkdir()
    remember_data_dir(home, str(data_dir))
    data = data_in_use({"DAGSTER_HOME": str(home)})
    assert (data.data_dir, data.prompts, data.shard_size) == (str(data_dir), str(mine), "20")
    assert data.prompts_from == "the data dir's source record"
    # the environment wins over both records; another source does not take the data dir's shard size
    other = tmp_path / "other.jsonl"
    given = data_in_use({"DAGSTER_HOME": str(home), Deployment.PROMPTS.name: str(other)})
    assert (given.data_dir, given.prompts, given.shard_size) == (str(data_dir), str(other), "100")
    elsewhere = data_in_use({"DAGSTER_HOME": str(home), Deployment.DATA_DIR.name: str(tmp_path / "new")})
    assert (elsewhere.data_dir, elsewhere.prompts) == (str(tmp_path / "new"), Deployment.PROMPTS.default)


def test_the_instance_records_the_data_dir_a_command_last_worked_on_as_an_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    home = tmp_path / "home"
    home.mkdir()
    remember_data_dir(home, "runs/a")
    remember_data_dir(home, "s3://bucket/b")
    assert json.loads((home / INSTANCE_RECORD).read_text()) == {"data_dir": "s3://bucket/b"}  # a URI as given
    remember_data_dir(home, "runs/a")
    assert data_in_use({"DAGSTER_HOME": str(home)}).data_dir == str(tmp_path / "runs" / "a")
    assert sorted(p.name for p in home.iterdir()) == [INSTANCE_RECORD]  # no partial file left
