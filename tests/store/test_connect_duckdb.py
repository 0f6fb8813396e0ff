"""The readers of every row (checks, reports, export) hold DuckDB to DFLASH_DUCKDB_MEMORY_LIMIT: past it, a table
spills to a folder of its own, removed when the connection closes, and the answers are the same. They read with
DFLASH_DUCKDB_THREADS threads (one unless set)."""

from dflash_assets.store.storage import connect_duckdb

ROWS = 400_000  # 200-character strings: about 90 MB, over a 16 MB limit


def test_a_table_over_the_limit_spills_to_its_own_folder_which_goes_when_the_connection_closes(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_DUCKDB_MEMORY_LIMIT", "16MB")
    spill = tmp_path / "spill"
    with connect_duckdb(spill) as con:
        (limit,) = con.execute("SELECT current_setting('memory_limit')").fetchone()
        assert limit == "15.2 MiB", limit  # 16 MB, as DuckDB prints it
        con.execute(f"CREATE TEMP TABLE t AS SELECT i, repeat('x', 200) || i::VARCHAR AS s FROM range({ROWS}) r(i)")
        assert any(p.suffix == ".tmp" for p in spill.iterdir()), "the table went to disk past the limit"
        rows, chars = con.execute("SELECT count(*), sum(length(s)) FROM t").fetchone()
        (used,) = con.execute("SELECT sum(memory_usage_bytes) FROM duckdb_memory()").fetchone()
    assert rows == ROWS and chars == 200 * ROWS + sum(len(str(i)) for i in range(ROWS))
    assert used <= 16 * 2**20, used
    assert not spill.exists(), "DuckDB removed the folder it made"


def test_by_default_each_connection_spills_to_a_folder_of_its_own_in_the_temp_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    with connect_duckdb() as a, connect_duckdb() as b:
        dirs = {c.execute("SELECT current_setting('temp_directory')").fetchone()[0] for c in (a, b)}
    assert len(dirs) == 2 and all(d.startswith(str(tmp_path / "dflash-duckdb-")) for d in dirs), dirs
    assert list(tmp_path.iterdir()) == [], "nothing is left behind"


def test_a_reader_uses_one_thread_unless_the_deployment_says_more(monkeypatch):
    monkeypatch.delenv("DFLASH_DUCKDB_THREADS", raising=False)
    with connect_duckdb() as con:
        assert con.execute("SELECT current_setting('threads')").fetchone() == (1,)
    monkeypatch.setenv("DFLASH_DUCKDB_THREADS", "2")
    with connect_duckdb() as con:
        assert con.execute("SELECT current_setting('threads')").fetchone() == (2,)
