"""The drafter training export: which rows pass, in what shape, and the same bytes every time."""

import json
from collections import Counter

import pyarrow.parquet as pq
import pytest

from dflash_assets.generation.runaway import is_runaway
from dflash_assets.quality import EXCLUSION_REASONS, export_training_set
from dflash_assets.quality.training.export import WINDOW_CUT_CONTENT
from dflash_assets.quality.training.trainer_format import has_think_marker, row_problem
from tests.support.quality_data import CONFIG_A, blank, completion, load, prompt, write

# every config pooled: rows of both modes, whose text forms a thinking template refuses (a thinking-off row's empty
# think block would be trained); the instruct template masks it
POOLED = "qwen3-instruct"
LATER = ("too_few_loss_tokens", "conversation_not_whole", "after_window_end")  # none in defects_dir: their own tests


def graded(data_dir, config=None, max_length=None, window=4096):
    """[(row, reason or None)] by the export's rules, in plain Python (file order = (path, row) order); `window` is
    the trainer's max_length a cut row is judged against (rules.py), the export's default."""
    prompts = {(p["shard"], p["prompt_id"]) for p in load(data_dir, "prompt_shards")}
    rows = [(i, r) for i, r in enumerate(load(data_dir, "completions")) if config is None or r["config_hash"] == config]
    result = {}
    for i, r in rows:
        text = r["content"] or ""
        cut = r["finish_reason"] == "length"
        tail = r["reasoning_content"] if blank(r["content"]) else r["content"]
        reasons = [
            ("no_trainable_tokens", r["prompt_tokens"] >= window),  # the prompt fills the window
            ("too_few_loss_tokens", min(r["completion_tokens"], window - r["prompt_tokens"]) < 2),
            ("truncated", cut and r["prompt_tokens"] + r["completion_tokens"] < window),
            ("runaway", cut and is_runaway(tail)),
            ("not_stop", r["finish_reason"] not in ("stop", "length")),
            ("empty_content", blank(r["content"]) and not (cut and not blank(r["reasoning_content"]))),
            ("think_marker", has_think_marker(text) or has_think_marker(r["reasoning_content"] or "")),
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
    for i, r in rows:  # SpecForge's recipe: reasoning on every answer with thinking, none without
        if result[i] is None and blank(r["reasoning_content"]) == r["enable_thinking"]:
            result[i] = "recipe_validation"
    return [(r, result[i]) for i, r in rows]


def kept(data_dir, **kwargs):
    return sorted(
        (r for r, reason in graded(data_dir, **kwargs) if reason is None),
        key=lambda r: (r["shard"], r["prompt_id"], r["config_hash"]),
    )


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def export(defects_dir, tmp_path_factory):
    return export_training_set(defects_dir, tmp_path_factory.mktemp("export"), config_hash=None, chat_template=POOLED)


def test_export_keeps_only_rows_that_pass_the_row_gates(defects_dir, export):
    expected = [f"{r['prompt_id']}@{r['config_hash']}" for r in kept(defects_dir)]
    assert [record["id"] for record in read_jsonl(export.jsonl_path)] == expected
    assert export.manifest["rows"] == len(expected)


def test_export_counts_exclusions_by_reason(defects_dir, export):
    grades = graded(defects_dir)
    reasons = Counter(reason for _, reason in grades if reason)
    assert export.manifest["excluded"] == {reason: reasons[reason] for reason in EXCLUSION_REASONS}
    # the data exercises every reason (over_max_length only when dropping long rows is chosen; runaways and rows
    # without token ids: tests/quality/training/test_window_export.py)
    assert all(
        reasons[r] > 0 for r in EXCLUSION_REASONS if r not in ("over_max_length", "runaway", "no_token_ids", *LATER)
    )
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
        cut_in_thinking = row["finish_reason"] == "length" and blank(row["content"])  # window-complete, kept
        assert answer["role"] == "assistant"
        assert answer["content"] == (WINDOW_CUT_CONTENT if cut_in_thinking else row["content"])
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
    again = export_training_set(defects_dir, tmp_path, config_hash=None, chat_template=POOLED)
    for first, second in (
        (export.jsonl_path, again.jsonl_path),
        (export.parquet_path, again.parquet_path),
        (export.manifest_path, again.manifest_path),
    ):
        assert first.read_bytes() == second.read_bytes(), first.name
    rerun = export_training_set(defects_dir, tmp_path, config_hash=None, chat_template=POOLED)  # over its own output
    assert rerun.manifest_path.read_bytes() == export.manifest_path.read_bytes()


def test_export_is_written_atomically_without_leftovers(export):
    assert sorted(p.name for p in export.jsonl_path.parent.iterdir()) == [
        "manifest.json",
        "specforge_data.yaml",
        "training_set.jsonl",
        "training_set.parquet",
    ]
    assert json.loads(export.manifest_path.read_text())["files"]["training_set.jsonl"]["sha256"]


def test_export_of_one_config(defects_dir, tmp_path):
    result = export_training_set(defects_dir, tmp_path, config_hash="b8192")
    expected = [f"{r['prompt_id']}@b8192" for r in kept(defects_dir, config="b8192")]
    assert [r["id"] for r in read_jsonl(result.jsonl_path)] == expected
    assert result.manifest["config_hashes"] == ["b8192"] and result.manifest["config_hash"] == "b8192"


def test_export_keeps_rows_over_max_length_by_default_and_counts_them(defects_dir, export):
    long = [
        r for r, reason in graded(defects_dir) if reason is None and r["prompt_tokens"] + r["completion_tokens"] > 4096
    ]
    assert long, "the fixture has kept rows longer than max_length"
    assert export.manifest["excluded"]["over_max_length"] == 0
    assert export.manifest["over_max_length_kept"] == len(long) and export.manifest["drop_over_max_length"] is False


def test_dropping_rows_over_max_length_is_a_choice_and_is_named_with_its_shares(defects_dir, tmp_path):
    result = export_training_set(
        defects_dir, tmp_path, config_hash=None, chat_template=POOLED, max_length=4096, drop_over_max_length=True
    )
    grades = graded(defects_dir, max_length=4096)
    assert result.manifest["rows"] == len(kept(defects_dir, max_length=4096))
    dropped = [r for r, reason in grades if reason == "over_max_length"]
    entry = next(e for e in result.manifest["exclusions"] if e["reason"] == "over_max_length")
    tokens = sum(r["completion_tokens"] or 0 for r, _ in grades)
    assert entry["rows"] == len(dropped) and entry["share_of_rows"] == round(len(dropped) / len(grades), 4)
    assert entry["share_of_tokens"] == round(sum(r["completion_tokens"] for r in dropped) / tokens, 4)
    by_source = Counter(r["source"] or "?" for r in dropped)
    assert entry["sources"][0]["source"] == sorted(by_source, key=lambda s: (-by_source[s], s))[0]


def test_every_exclusion_is_named_with_its_share_of_rows_and_tokens_and_sources(defects_dir, export):
    from dflash_assets.quality.training.export import exclusion_lines

    grades = graded(defects_dir)
    reasons = Counter(reason for _, reason in grades if reason)
    assert {e["reason"]: e["rows"] for e in export.manifest["exclusions"]} == dict(reasons)
    lines = exclusion_lines(export.manifest)
    for reason, n in reasons.items():
        line = next(line for line in lines if line.startswith(f"{reason}: "))
        assert f"{reason}: {n} rows ({n / len(grades) * 100:.2f}%)" in line and "most from " in line
    assert lines[-1].startswith(f"kept {export.manifest['over_max_length_kept']} rows longer than max_length 4,096")


def test_export_of_an_empty_data_dir_writes_an_empty_set(tmp_path):
    result = export_training_set(tmp_path / "data", tmp_path / "out", config_hash=None, chat_template=POOLED)
    assert result.jsonl_path.read_bytes() == b""
    assert pq.read_table(result.parquet_path).num_rows == 0
    assert result.manifest["rows"] == 0 and set(result.manifest["excluded"].values()) == {0}


def test_export_excludes_what_the_trainers_strict_think_markers_refuses_any_case_in_reasoning_too(tmp_path):
    """SpecForge's validate_regenerated_data.py --strict-think-markers refuses a marker in either text, any case."""
    prompts = [prompt("00000", i, 100, "gsm8k") for i in range(5)]
    rows = [completion(p, CONFIG_A, 200) for p in prompts]
    rows[0].update(content="Answer <THINK>loud</THINK>")  # upper case, in content
    rows[1].update(reasoning_content="thought </think> twice")  # only in reasoning_content
    rows[2].update(content="Fine.", reasoning_content="<Think>mixed")
    rows[3].update(content="A <thinking> tag is not a marker.")  # kept: neither marker
    # a multi-turn source under last_turn: the earlier answer it keeps is an assistant message the trainer reads
    history = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1 </Think>"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "<think>the one regenerated"},
    ]
    prompts.append(prompt("00000", 5, 100, "gsm8k") | {"messages_json": json.dumps(history)})
    rows.append(completion(prompts[5], CONFIG_A, 200))
    prompts.append(
        prompt("00000", 6, 100, "gsm8k")
        | {"messages_json": json.dumps(history[:1] + [{"role": "assistant", "content": "a1"}] + history[2:])}
    )  # only the regenerated (dropped) turn had one
    rows.append(completion(prompts[6], CONFIG_A, 200))
    write(tmp_path / "data", "prompt_shards", "00000", prompts)
    write(tmp_path / "data", "completions", "00000", rows)
    export = export_training_set(tmp_path / "data", tmp_path / "out", max_length=None)
    lines = read_jsonl(export.jsonl_path)
    assert [line["id"] for line in lines] == ["00000-p0003@a4096", "00000-p0004@a4096"]
    assert [(line["id"], row_problem(line)) for line in lines] == [(line["id"], None) for line in lines]
    # the multi-turn row without a marker keeps the source's answer, which has no reasoning: with thinking the
    # recipe's --expect-reasoning would stop at it, so it is left out too, in the validator's words
    assert [(e["reason"], e["rows"], e["share_of_rows"]) for e in export.manifest["exclusions"]] == [
        ("think_marker", 4, round(4 / 7, 4)),
        ("recipe_validation", 1, round(1 / 7, 4)),
    ]
    assert export.manifest["recipe"]["left_out"] == {"assistant message 1 has empty reasoning_content": 1}
    assert export.manifest["source_answers"] | {"note": ""} == {
        "rows": 1,
        "written": 0,
        "left_out": 1,
        "train_only_last_turn": False,
        "note": "",
    }
    # the exported rows, with a marker put back in reasoning, are what the trainer would refuse
    marked = lines[0]["conversations"][:-1] + [lines[0]["conversations"][-1] | {"reasoning_content": "</THINK>"}]
    assert (
        row_problem(lines[0] | {"conversations": marked})
        == "assistant message 2 reasoning_content contains a thinking marker"
    )
