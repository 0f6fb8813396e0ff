"""parquet_source reads the committed parts of a table as one: parts written before a column existed read it as null
beside parts that have it, and the parts are read by their own columns (not DuckDB's union_by_name, which opens every
file at once)."""

import pyarrow.parquet as pq

from dflash_assets.store.schema import COMPLETION_SCHEMA
from dflash_assets.store.storage import connect_duckdb
from dflash_assets.store.stores import completion_store, parquet_source

NEWER = ("policy_cap", "trainer_max_length")  # columns a data dir from before them lacks


def row(prompt_id: str, shard: str, policy_cap: int | None) -> dict:
    return {
        "prompt_id": prompt_id,
        "shard": shard,
        "config_hash": "c0",
        "finish_reason": "stop",
        "completion_tokens": 10,
        "policy_cap": policy_cap,
        "trainer_max_length": policy_cap and 8192,
    }


def test_parts_with_and_without_a_column_read_as_one_table_the_older_ones_null(tmp_path):
    data = tmp_path / "data"
    for shard, n in (("00000", 3), ("00001", 2)):  # two parts a shard
        store = completion_store(data, shard)
        store.commit([row(f"{shard}-a{i}", shard, 4096) for i in range(n)])
        store.commit([row(f"{shard}-b{i}", shard, 2048) for i in range(n)])
    old = sorted((data / "completions" / "shard=00000").glob("*.parquet"))[0]  # one part from before the columns
    table = pq.read_table(old)
    pq.write_table(table.drop_columns(list(NEWER)), old)
    assert not set(NEWER) & set(pq.read_schema(old).names)

    with connect_duckdb() as con:
        src = parquet_source(con, data, "completions", COMPLETION_SCHEMA)
        assert "union_by_name" not in src and src.count("read_parquet") == 2, src  # a read per set of columns
        rows = con.execute(f"SELECT prompt_id, policy_cap, trainer_max_length, turn FROM {src} ORDER BY 1").fetchall()
        (shard_rows,) = con.execute(
            f"SELECT count(*) FROM {parquet_source(con, data, 'completions', COMPLETION_SCHEMA, '00001')}"
        ).fetchone()
    assert rows == [
        *[(f"00000-a{i}", None, None, None) for i in range(3)],  # the old part: its columns null
        *[(f"00000-b{i}", 2048, 8192, None) for i in range(3)],
        *[(f"00001-a{i}", 4096, 8192, None) for i in range(2)],
        *[(f"00001-b{i}", 2048, 8192, None) for i in range(2)],
    ]
    assert shard_rows == 4


def test_a_table_without_parts_reads_as_its_empty_schema(tmp_path):
    with connect_duckdb() as con:
        src = parquet_source(con, tmp_path / "data", "completions", COMPLETION_SCHEMA)
        assert con.execute(f"SELECT count(*), count(policy_cap) FROM {src}").fetchone() == (0, 0)
