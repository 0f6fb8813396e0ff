"""The prompt source a data dir belongs to, at the library level (no fleet): what source_refusal refuses and lets by.
The same refusals through `dflash` (exit 2, nothing written): tests/cli/test_one_source.py."""

import json

from dflash_assets.generation.prompts import shard_fingerprint
from dflash_assets.generation.shards import source_refusal
from dflash_assets.store.source import ShardSource, recorded_sources
from dflash_assets.store.stores import prompt_store
from tests.support.quality_data import CONFIG_A, completion, prompt, write

SIZE = 3


def lines(n: int, word: str = "q") -> str:
    return "".join(json.dumps({"id": f"{word}{i}", "prompt": f"{word} {i}"}) + "\n" for i in range(n))


def recorded(tmp_path, n: int = 2 * SIZE):
    """A source of `n` lines cut into shards of SIZE, each shard's record written as build_prompt_shard writes it;
    completions in shard 00000 only."""
    source, data = tmp_path / "source.jsonl", tmp_path / "data"
    source.write_text(lines(n))
    for index, shard in enumerate(("00000", "00001")):
        count, fingerprint = shard_fingerprint(source, index, SIZE)
        rows = [prompt(shard, i, 10, "source") for i in range(count)]
        record = ShardSource(str(source.resolve()), SIZE, count, fingerprint)
        prompt_store(data, shard).replace(rows, "prompts.parquet", record.metadata())
    write(data, "completions", "00000", [completion(prompt("00000", 0, 10, "source"), CONFIG_A, 5)])
    return source, data


def test_each_prompt_shard_records_its_source_in_its_own_file(tmp_path):
    source, data = recorded(tmp_path)
    records = recorded_sources(data)
    assert sorted(records) == ["00000", "00001"]
    assert {(r.path, r.shard_size, r.lines) for r in records.values()} == {(str(source.resolve()), SIZE, SIZE)}
    assert records["00000"].fingerprint != records["00001"].fingerprint
    assert source_refusal(source, SIZE, data) is None


def test_another_path_is_refused_naming_both_and_the_new_data_dir(tmp_path):
    source, data = recorded(tmp_path)
    other = tmp_path / "other.jsonl"
    other.write_text(source.read_text())  # the same lines under another name: still another source
    refusal = source_refusal(other, SIZE, data)
    assert refusal == (
        f"data dir {data} holds the prompt shards of {source.resolve()}, not of {other.resolve()}: a data dir belongs "
        f"to one prompt source; set DFLASH_DATA_DIR to a new directory for {other.resolve()} (or give --prompts "
        f"{source.resolve()} to go on with it)"
    )


def test_a_grown_source_passes_and_a_changed_shard_is_refused_only_under_completions(tmp_path):
    source, data = recorded(tmp_path)
    source.write_text(lines(3 * SIZE + 1))  # the same first lines, four more
    assert source_refusal(source, SIZE, data) is None
    text = source.read_text().splitlines(keepends=True)
    source.write_text("".join(text[:SIZE] + [lines(1, "changed")] + text[SIZE + 1 :]))  # shard 00001: no completions
    assert source_refusal(source, SIZE, data) is None
    source.write_text(lines(1, "changed") + "".join(text[1:]))  # shard 00000: its completions would be orphans
    refusal = source_refusal(source, SIZE, data)
    assert refusal and refusal.startswith(f"data dir {data}: the lines of shard 00000 changed under its completions")
    assert f"({SIZE} lines, fingerprint {recorded_sources(data)['00000'].fingerprint})" in refusal


def test_another_shard_size_under_completions_is_refused_with_the_recorded_one(tmp_path):
    source, data = recorded(tmp_path)
    refusal = source_refusal(source, SIZE + 1, data)
    assert refusal == (
        f"data dir {data}: its shards of {source.resolve()} were cut at DFLASH_SHARD_SIZE {SIZE}, not {SIZE + 1}, and "
        f"shard 00000 has completions; set DFLASH_SHARD_SIZE={SIZE}, or set DFLASH_DATA_DIR to a new directory for "
        f"{source.resolve()} cut at {SIZE + 1}"
    )
