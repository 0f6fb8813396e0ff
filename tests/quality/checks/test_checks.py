"""The length and content checks: every figure recomputed in plain Python from the Parquet files."""

from collections import Counter, defaultdict

import pytest

from dflash_assets.rules import cut_inside_window, overflows
from dflash_assets.settings import QualitySettings, TrainerSettings
from tests.support.quality_data import blank, check, config_of, load, nearest_rank, pct


def rates(rows, key, hit):
    """{group: (rows, hits)} in plain Python."""
    out = defaultdict(lambda: [0, 0])
    for r in rows:
        out[key(r)][0] += 1
        out[key(r)][1] += bool(hit(r))
    return {k: tuple(v) for k, v in out.items()}


# a trainer window larger than every row: each cut lies inside it (tests/generation/test_window_policy.py has the others)
WIDE = QualitySettings(trainer=TrainerSettings(max_length=65536))


def test_truncation_rate_is_judged_per_config_and_per_shard(defects_dir):
    rows = load(defects_dir, "completions")
    length = lambda r: cut_inside_window(r["finish_reason"], r["prompt_tokens"], r["completion_tokens"], 65536)  # noqa: E731
    per_config, per_shard = rates(rows, config_of, length), rates(rows, lambda r: r["shard"], length)
    truncated = sum(map(length, rows))
    outcome = check(defects_dir, "truncation_rate", quality=WIDE)
    assert not outcome.passed and outcome.blocking and outcome.severity == "ERROR"
    m = outcome.metadata
    assert (m["rows"], m["cut_inside_window_rows"], m["truncated_rows"]) == (len(rows), truncated, truncated)
    assert m["cut_inside_window_rate"] == truncated / len(rows)
    assert m["configs_over_threshold"] == sum(h / n > 0.05 for n, h in per_config.values())
    assert m["shards_over_threshold"] == sum(h / n > 0.05 for n, h in per_shard.values())
    worst = max(per_shard.items(), key=lambda kv: kv[1][1] / kv[1][0])
    assert (m["worst_shard"], m["worst_shard_rate"]) == (worst[0], worst[1][1] / worst[1][0])
    for (h, cap), (n, hits) in per_config.items():
        assert f"config `{h}` (max_output_tokens {cap}): {hits:,} of {n:,} rows ({pct(hits / n)})" in outcome.summary_md


def test_truncation_rate_message_names_the_cut_share_and_the_cap(cut_at_cap_dir):
    # a trainer that reads 8192 tokens: the cuts at 4096 lie inside its window
    outcome = check(
        cut_at_cap_dir, "truncation_rate", quality=QualitySettings(trainer=TrainerSettings(max_length=8192))
    )
    assert not outcome.passed
    assert outcome.summary_md.startswith(
        "**18.30%** of 1,000 rows were cut inside the trainer's window max_length 8,192 (finish_reason = 'length', "
        "prompt + completion < 8,192), over the 5.00% threshold; 0 rows (0.00%) were cut at or past it"
    )
    assert "config `a4096` (max_output_tokens 4096): 183 of 1,000 rows (18.30%)" in outcome.summary_md
    assert "shard `s0`: 183 of 1,000 rows (18.30%)" in outcome.summary_md


def test_truncation_rate_threshold_is_configurable(cut_at_cap_dir):
    outcome = check(cut_at_cap_dir, "truncation_rate", quality=QualitySettings(truncation_rate_max=0.20))
    assert outcome.passed
    assert "within the 20.00% threshold" in outcome.summary_md


def test_cap_saturation_sees_p90_equal_p99_equal_cap(cut_at_cap_dir):
    values = [r["completion_tokens"] for r in load(cut_at_cap_dir, "completions")]
    assert nearest_rank(values, 0.9) == nearest_rank(values, 0.99) == 4096  # a saturated cap's shape
    outcome = check(cut_at_cap_dir, "cap_saturation")
    assert not outcome.passed and outcome.severity == "WARN" and not outcome.blocking
    assert outcome.metadata["a4096/4096 p90"] == outcome.metadata["a4096/4096 p99"] == 4096
    assert outcome.metadata["saturated_configs"] == 1
    line = "P90 4,096, P99 4,096 over 1,000 rows, 183 (18.30%) at the cap; **P99 reaches the cap 4,096**"
    assert line in outcome.summary_md
    assert "more than 1.00% of completions stopped at the cap" in outcome.summary_md


def test_cap_saturation_percentiles_are_nearest_rank_per_config(defects_dir):
    per_config = defaultdict(list)
    for r in load(defects_dir, "completions"):
        per_config[config_of(r)].append(r["completion_tokens"])
    m = check(defects_dir, "cap_saturation").metadata
    for (h, cap), values in per_config.items():
        for q in (0.5, 0.9, 0.99):
            assert m[f"{h}/{cap} p{round(q * 100)}"] == nearest_rank(values, q)
    assert m["saturated_configs"] == sum(nearest_rank(v, 0.99) >= cap for (_, cap), v in per_config.items())


def test_cap_saturation_passes_below_the_cap(clean_dir):
    assert check(clean_dir, "cap_saturation").passed


def test_cap_hit_agreement_counts_disagreements_both_ways(defects_dir):
    rows = load(defects_dir, "completions")
    at_cap = [r for r in rows if r["completion_tokens"] >= r["max_output_tokens"] and r["finish_reason"] != "length"]
    under = [r for r in rows if r["finish_reason"] == "length" and r["completion_tokens"] < r["max_output_tokens"]]
    outcome = check(defects_dir, "cap_hit_agreement")
    assert not outcome.passed
    m = outcome.metadata
    assert (m["at_cap_not_length_rows"], m["length_under_cap_rows"]) == (len(at_cap), len(under))
    assert m["mismatch_rows"] == len(at_cap) + len(under)
    assert m["mismatch_rate"] == (len(at_cap) + len(under)) / len(rows)
    assert f"{len(under)} rows finished 'length' below the cap" in outcome.summary_md


def test_context_overflow_counts_completion_rows_and_rejected_prompts(defects_dir):
    rows, rejects = load(defects_dir, "completions"), load(defects_dir, "rejects")
    failures = load(defects_dir, "failures")
    over = lambda r: overflows(r["prompt_tokens"], r["max_output_tokens"], r["server_context_length"])  # noqa: E731
    attempted = defaultdict(set)
    for r in rows + [r for r in rejects if r["stage"] != "source"] + failures:
        attempted[r["config_hash"]].add((r["shard"], r["prompt_id"]))
    rejected_over = defaultdict(set)
    for r in rejects:
        if r["stage"] != "source" and over(r):
            rejected_over[r["config_hash"]].add((r["shard"], r["prompt_id"]))
    outcome = check(defects_dir, "context_overflow")
    assert not outcome.passed and outcome.blocking
    m = outcome.metadata
    assert m["completion_overflow_rows"] == sum(map(over, rows))
    assert m["rejected_overflow_prompts"] == sum(len(v) for v in rejected_over.values())
    assert m["attempted_prompts"] == sum(len(v) for v in attempted.values())
    n = len(attempted["c8192"])
    line = f"config `c8192` (max_output_tokens 8192): {n} of {n} attempted prompts (100.00%) rejected"
    assert line in outcome.summary_md
    b_over = sum(over(r) for r in rows if r["config_hash"] == "b8192")
    b_rows = sum(r["config_hash"] == "b8192" for r in rows)
    assert f"{b_over} of {b_rows} completion rows ({pct(b_over / b_rows)}) were generated with" in outcome.summary_md


def test_context_overflow_passes_when_every_budget_fits(clean_dir):
    outcome = check(clean_dir, "context_overflow")
    assert outcome.passed and outcome.metadata["completion_overflow_rows"] == 0


def test_config_consistency_reports_the_mix_with_counts(defects_dir):
    rows = load(defects_dir, "completions")
    per_config = Counter(map(config_of, rows))
    s1 = Counter(config_of(r) for r in rows if r["shard"] == "s1")
    outcome = check(defects_dir, "config_consistency")
    assert not outcome.passed and outcome.severity == "WARN"
    assert (outcome.metadata["configs"], outcome.metadata["mixed_shards"]) == (len(per_config), 1)
    assert "The data mixes **2 configs** across 2 shards; 1 shard mixes configs inside." in outcome.summary_md
    assert (
        f"shard `s1`: `a4096` (max_output_tokens 4096) {s1[('a4096', 4096)]} rows, "
        f"`b8192` (max_output_tokens 8192) {s1[('b8192', 8192)]} rows"
    ) in outcome.summary_md
    line = f"config `a4096` (max_output_tokens 4096): {per_config[('a4096', 4096)]} rows in 2 shards"
    assert line in outcome.summary_md


def test_config_consistency_passes_with_one_config(clean_dir):
    outcome = check(clean_dir, "config_consistency")
    assert outcome.passed and outcome.metadata["configs"] == 1


def test_duplicates_count_extra_rows_per_prompt_and_config(defects_dir):
    rows = load(defects_dir, "completions")
    keys = Counter((r["prompt_id"], r["config_hash"]) for r in rows)
    extra = sum(n - 1 for n in keys.values())
    outcome = check(defects_dir, "duplicates")
    assert not outcome.passed and outcome.blocking
    assert outcome.metadata["duplicate_rows"] == extra == 1
    assert outcome.metadata["duplicated_keys"] == sum(n > 1 for n in keys.values())
    assert "`s0-p0020 x2 (a4096)`" in outcome.summary_md


def test_empty_content_ignores_truncated_thinking(defects_dir):
    rows = load(defects_dir, "completions")
    thinking_cut = lambda r: r["finish_reason"] == "length" and not blank(r["reasoning_content"])  # noqa: E731
    empty = [r for r in rows if blank(r["content"]) and not thinking_cut(r)]
    outcome = check(defects_dir, "empty_content")
    assert not outcome.passed
    assert outcome.metadata["empty_content_rows"] == len(empty) == 2  # "" and whitespace-only
    assert outcome.summary_md.startswith(f"2 of {len(rows)} rows ({pct(2 / len(rows))}) have empty content")


def test_think_markers_leaking_into_content_fail_the_gate(defects_dir):
    rows = load(defects_dir, "completions")
    leaks = [r for r in rows if r["content"] and ("<think>" in r["content"] or "</think>" in r["content"])]
    outcome = check(defects_dir, "think_markers")
    assert not outcome.passed and outcome.blocking
    assert outcome.metadata["think_marker_rows"] == len(leaks) == 2


def test_reasoning_misrouted_counts_only_thinking_rows(defects_dir):
    thinking = [r for r in load(defects_dir, "completions") if r["enable_thinking"]]
    misrouted = [
        r
        for r in thinking
        if r["finish_reason"] == "length" and blank(r["reasoning_content"]) and not blank(r["content"])
    ]
    outcome = check(defects_dir, "reasoning_misrouted")
    assert not outcome.passed and outcome.severity == "WARN"
    assert (outcome.metadata["rows"], outcome.metadata["misrouted_rows"]) == (len(thinking), len(misrouted))
    assert len(misrouted) == 2  # reasoning null, and reasoning ""


def test_reasoning_misrouted_is_not_applicable_without_thinking(defects_dir):
    outcome = check(defects_dir, "reasoning_misrouted", config_hash="b8192")
    assert outcome.passed and "Not applicable" in outcome.summary_md


def test_truncated_thinking_reports_the_share(defects_dir):
    rows = load(defects_dir, "completions")
    cut = [
        r for r in rows if r["finish_reason"] == "length" and not blank(r["reasoning_content"]) and blank(r["content"])
    ]
    outcome = check(defects_dir, "truncated_thinking")
    assert not outcome.passed and outcome.severity == "WARN"
    assert outcome.metadata["truncated_thinking_rate"] == len(cut) / len(rows)
    line = f"{len(cut)} of {len(rows)} rows ({pct(len(cut) / len(rows))}) were cut inside the thinking"
    assert line in outcome.summary_md


def test_max_length_overflow_share_follows_the_trainer_max_length(defects_dir):
    rows = load(defects_dir, "completions")
    for max_length in (4096, 8192):
        over = [r for r in rows if r["prompt_tokens"] + r["completion_tokens"] > max_length]
        trainer = TrainerSettings(max_length=max_length)
        outcome = check(defects_dir, "max_length_overflow", quality=QualitySettings(trainer=trainer))
        assert outcome.metadata["over_max_length_rows"] == len(over)
        assert outcome.metadata["over_max_length_rate"] == len(over) / len(rows)
        assert outcome.passed == (len(over) / len(rows) <= 0.05)
        assert f"exceed the trainer's window max_length {max_length:,}" in outcome.summary_md


def test_no_check_asked_for_gives_no_outcome_and_reads_nothing(defects_dir, tmp_path):
    from dflash_assets.quality import run_checks

    unreadable = tmp_path / "data" / "completions" / "shard=00000"
    unreadable.mkdir(parents=True)
    (unreadable / "part-00000000000000000001-1-aaaaaa.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="is not a readable Parquet file"):  # a check reads the part
        run_checks(tmp_path / "data", names=["duplicates"])
    assert run_checks(tmp_path / "data", names=[]) == []  # none asked for: nothing is read
    assert run_checks(defects_dir, names=[]) == []
    assert [o.name for o in run_checks(defects_dir, names=["duplicates"])] == ["duplicates"]
