"""The drafter training export: which rows pass, in what shape, and the same bytes every time."""

import json
from collections import Counter

import pyarrow.parquet as pq
import pytest
from test_quality_fixtures import blank, defects_dir, load  # noqa: F401

from dflash_assets.quality import EXCLUSION_REASONS, export_training_set


def graded(data_dir, config=None, max_length=4096):
    """[(row, reason or None)] by the export's rules, in plain Python (file order = (path, row) order)."""
    prompts = {(p["shard"], p["prompt_id"]) for p in load(data_dir, "prompt_shards")}
    rows = [(i, r) for i, r in enumerate(load(data_dir, "completions")) if config is None or r["config_hash"] == config]
    result = {}
    for i, r in rows:
        text = r["content"] or ""
        reasons = [
            ("truncated", r["finish_reason"] == "length"),
            ("not_stop", r["finish_reason"] != "stop"),
            ("empty_content", blank(r["content"])),
            ("think_marker", "<think>" in text or "</think>" in text),
            ("context_overflow", r["prompt_tokens"] + r["max_output_tokens"] > r["server_context_length"]),
            ("over_max_length", max_length is not None and r["prompt_tokens"] + r["completion_tokens"] > max_length),
            ("no_prompt", (r["shard"], r["prompt_id"]) not in prompts),
        ]
        result[i] = next((name for name, hit in reasons if hit), None)
    kept_keys = set()
    for i, r in sorted(rows, key=lambda ir: (ir[1]["created_at"], ir[0])):  # the earliest copy wins
        if result[i] is None:
            key = (r["prompt_id"], r["config_hash"])
            result[i] = "duplicate" if key in kept_keys else None
            kept_keys.add(key)
    return [(r, result[i]) for i, r in rows]


def kept(data_dir, **kwargs):
    return sorted((r for r, reason in graded(data_dir, **kwargs) if reason is None),
                  key=lambda r: (r["shard"], r["prompt_id"], r["config_hash"]))


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def export(defects_dir, tmp_path_factory):
    return export_training_set(defects_dir, tmp_path_factory.mktemp("export"), config_hash=None)


def test_export_keeps_only_rows_that_pass_the_row_gates(defects_dir, export):
    expected = [f"{r['prompt_id']}@{r['config_hash']}" for r in kept(defects_dir)]
    assert [record["id"] for record in read_jsonl(export.jsonl_path)] == expected
    assert export.manifest["rows"] == len(expected)


def test_export_counts_exclusions_by_reason(defects_dir, export):
    grades = graded(defects_dir)
    reasons = Counter(reason for _, reason in grades if reason)
    assert export.manifest["excluded"] == {reason: reasons[reason] for reason in EXCLUSION_REASONS}
    assert all(reasons[r] > 0 for r in EXCLUSION_REASONS)  # the data exercises every reason
    by_config = {}
    for row, reason in grades:
        if reason:
            by_config.setdefault(row["config_hash"], Counter())[reason] += 1
    expected_by_config = {h: {r: c[r] for r in EXCLUSION_REASONS} for h, c in by_config.items()}
    assert export.manifest["excluded_by_config"] == expected_by_config
    kept_rows = kept(defects_dir)
    assert export.manifest["rows_by_source"] == dict(sorted(Counter(r["source"] for r in kept_rows).items()))
    rows_by_config = {h: v["rows"] for h, v in export.manifest["rows_by_config"].items()}
    assert rows_by_config == Counter(r["config_hash"] for r in kept_rows)
    assert export.manifest["input_rows"] == len(grades)
    assert export.manifest["config_hashes"] == ["a4096", "b8192"]


def test_export_writes_specforge_conversations(defects_dir, export):
    prompts = load(defects_dir, "prompt_shards")
    messages = {(p["shard"], p["prompt_id"]): json.loads(p["messages_json"]) for p in prompts}
    for record, row in zip(read_jsonl(export.jsonl_path), kept(defects_dir), strict=True):
        assert set(record) == {"id", "status", "conversations"} and record["status"] == "success"
        *prompt, answer = record["conversations"]
        assert prompt == messages[(row["shard"], row["prompt_id"])]
        assert answer["role"] == "assistant" and answer["content"] == row["content"]
        if blank(row["reasoning_content"]):
            assert "reasoning_content" not in answer
        else:
            assert answer["reasoning_content"] == row["reasoning_content"]


def test_export_keeps_the_earliest_copy_of_a_duplicate(export):
    (record,) = [r for r in read_jsonl(export.jsonl_path) if r["id"] == "s0-p0020@a4096"]
    assert record["conversations"][-1]["content"] == "An answer."  # not the later "Second copy."


def test_export_parquet_copy_holds_the_same_rows(export):
    table = pq.read_table(export.parquet_path).to_pylist()
    records = read_jsonl(export.jsonl_path)
    assert [r["id"] for r in table] == [r["id"] for r in records]
    for row, record in zip(table, records):
        assert [{k: v for k, v in m.items() if v is not None} for m in row["conversations"]] == record["conversations"]


def test_export_is_byte_identical_when_rerun(defects_dir, export, tmp_path):
    again = export_training_set(defects_dir, tmp_path, config_hash=None)
    for first, second in ((export.jsonl_path, again.jsonl_path), (export.parquet_path, again.parquet_path),
                          (export.manifest_path, again.manifest_path)):
        assert first.read_bytes() == second.read_bytes(), first.name
    rerun = export_training_set(defects_dir, tmp_path, config_hash=None)  # over its own output
    assert rerun.manifest_path.read_bytes() == export.manifest_path.read_bytes()


def test_export_is_written_atomically_without_leftovers(export):
    assert sorted(p.name for p in export.jsonl_path.parent.iterdir()) == [
        "manifest.json", "training_set.jsonl", "training_set.parquet"
    ]
    assert json.loads(export.manifest_path.read_text())["files"]["training_set.jsonl"]["sha256"]


def test_export_of_one_config(defects_dir, tmp_path):
    result = export_training_set(defects_dir, tmp_path, config_hash="b8192")
    expected = [f"{r['prompt_id']}@b8192" for r in kept(defects_dir, config="b8192")]
    assert [r["id"] for r in read_jsonl(result.jsonl_path)] == expected
    assert result.manifest["config_hashes"] == ["b8192"] and result.manifest["config_hash"] == "b8192"


def test_export_without_max_length_keeps_long_rows(defects_dir, tmp_path):
    result = export_training_set(defects_dir, tmp_path, config_hash=None, max_length=None)
    assert result.manifest["excluded"]["over_max_length"] == 0
    assert result.manifest["rows"] == len(kept(defects_dir, max_length=None))


def test_export_of_an_empty_data_dir_writes_an_empty_set(tmp_path):
    result = export_training_set(tmp_path / "data", tmp_path / "out", config_hash=None)
    assert result.jsonl_path.read_bytes() == b""
    assert pq.read_table(result.parquet_path).num_rows == 0
    assert result.manifest["rows"] == 0 and set(result.manifest["excluded"].values()) == {0}
