"""Accounting, the check registry, scoping, and empty or partial data dirs."""

from collections import Counter, defaultdict

import pytest

from dflash_assets.quality import CHECKS, export_training_set, gate_passed, run_checks
from dflash_assets.settings import QualitySettings
from dflash_assets.store.parts import PartStore
from dflash_assets.store.schema import COMPLETION_SCHEMA
from tests.support.quality_data import CONFIG_A, completion, load, prompt, superseded_configs, write


def expected_accounting(data_dir, config=None):
    """{(shard, config): (prompts, completed, rejected, failed, missing, orphans)} straight from the definition."""
    prompts, rejects = load(data_dir, "prompt_shards"), load(data_dir, "rejects")
    done_rows, failures = load(data_dir, "completions"), load(data_dir, "failures")
    in_scope = lambda r: config is None or r["config_hash"] == config  # noqa: E731
    outcomes = [("done", r) for r in done_rows if in_scope(r)]
    outcomes += [("rejected", r) for r in rejects if r["stage"] != "source" and in_scope(r)]
    outcomes += [("failed", r) for r in failures if in_scope(r)]
    seen = defaultdict(set)
    for _, r in outcomes:
        seen[r["shard"]].add(r["config_hash"])
    shards = {p["shard"] for p in prompts} | {r["shard"] for r in rejects} | set(seen)
    result = {}
    for shard in sorted(shards):
        rows = [p["prompt_id"] for p in prompts if p["shard"] == shard]
        source = sum(r["shard"] == shard and r["stage"] == "source" for r in rejects)
        for cfg in [config] if config else sorted(seen[shard]) or [None]:
            ids = {
                kind: {r["prompt_id"] for k, r in outcomes if (k, r["shard"], r["config_hash"]) == (kind, shard, cfg)}
                for kind in ("done", "rejected", "failed")
            }
            classes = Counter(
                next((k for k in ("done", "rejected", "failed") if pid in ids[k]), "missing") for pid in rows
            )
            orphans = len(ids["done"] - set(rows))
            result[(shard, cfg)] = (
                len(rows) + source,
                classes["done"],
                classes["rejected"] + source,
                classes["failed"],
                classes["missing"],
                orphans,
            )
    return result


def check(data_dir, name, **kwargs):
    (outcome,) = run_checks(data_dir, names=[name], **kwargs)
    return outcome


def pair_line(shard, cfg, figures):
    prompts, completed, rejected, failed, missing, orphans = figures
    where = f"shard `{shard}`, config `{cfg}`" if cfg else f"shard `{shard}`, no config"
    return (
        f"{where}: {prompts:,} prompts = {completed:,} completed + {rejected:,} rejected + {failed:,} failed + "
        f"**{missing:,} missing**"
    )


@pytest.mark.parametrize("config", [None, "a4096", "c8192"])
def test_accounting_adds_up_per_shard_and_config(defects_dir, config):
    expected = expected_accounting(defects_dir, config)
    outcome = check(defects_dir, "accounting", config_hash=config)
    totals = [sum(v[i] for v in expected.values()) for i in range(6)]
    m = outcome.metadata
    assert m["pairs"] == len(expected)
    assert [m[k] for k in ("prompts", "completed", "rejected", "failed", "missing", "orphan_completions")] == totals
    for (shard, cfg), figures in expected.items():
        assert figures[0] == sum(figures[1:5])  # the identity holds by construction...
        if figures[4] or figures[5]:  # ...and every pair with a hole is named with its numbers
            assert pair_line(shard, cfg, figures) in outcome.summary_md
    assert m["failing_pairs"] == sum(1 for f in expected.values() if f[4] or f[5])
    assert not outcome.passed and outcome.blocking


def test_accounting_names_the_shard_nothing_was_generated_for(defects_dir):
    outcome = check(defects_dir, "accounting")
    line = "shard `s3`, no config: 40 prompts = 0 completed + 0 rejected + 0 failed + **40 missing** (100.00%)"
    assert line in outcome.summary_md
    assert "1 completion without a prompt row" in outcome.summary_md  # the orphan in s0


def test_accounting_passes_when_every_prompt_is_accounted_for(clean_dir):
    outcome = check(clean_dir, "accounting")
    assert outcome.passed and outcome.metadata["missing"] == 0 and outcome.metadata["completed"] == 240


def test_training_gate_is_marked_in_the_registry(tmp_path):
    blocking = {spec.name for spec in CHECKS if spec.blocking}
    gate = {
        "truncation_rate",
        "context_overflow",
        "duplicates",
        "accounting",
        "think_markers",
        "empty_content",
        "silent_clamp",
    }
    assert blocking == gate
    assert all(spec.default_severity == ("ERROR" if spec.blocking else "WARN") for spec in CHECKS)
    assert all(spec.description for spec in CHECKS)
    outcomes = run_checks(tmp_path)
    assert [(o.name, o.blocking) for o in outcomes] == [(spec.name, spec.blocking) for spec in CHECKS]


def test_severity_is_configurable_per_check(defects_dir):
    outcome = check(
        defects_dir, "config_consistency", quality=QualitySettings(severity={"config_consistency": "ERROR"})
    )
    assert outcome.severity == "ERROR" and not outcome.passed


def test_a_severity_override_of_the_checks_old_name_applies_to_its_new_name_with_a_warning(defects_dir):
    with pytest.warns(FutureWarning, match="'window_complete', now 'decoded_past_window'"):
        quality = QualitySettings(severity={"window_complete": "ERROR"})
    assert quality.severity == {"decoded_past_window": "ERROR"}
    assert check(defects_dir, "decoded_past_window", quality=quality).severity == "ERROR"


def test_unknown_check_names_are_refused(defects_dir):
    with pytest.raises(ValueError, match="unknown check names"):
        run_checks(defects_dir, quality=QualitySettings(severity={"truncation": "WARN"}))


def test_clean_data_passes_every_check(clean_dir):
    outcomes = run_checks(clean_dir)
    assert [o.name for o in outcomes if not o.passed] == []
    assert gate_passed(outcomes)


def test_defective_data_fails_the_training_gate(defects_dir):
    assert not gate_passed(run_checks(defects_dir))


def test_shard_scope_reads_only_that_shard(defects_dir):
    rows = [r for r in load(defects_dir, "completions") if r["shard"] == "s1"]
    outcome = check(defects_dir, "truncation_rate", shard="s1")
    assert outcome.metadata["rows"] == len(rows)
    assert outcome.metadata["truncated_rows"] == sum(r["finish_reason"] == "length" for r in rows)


def test_empty_data_dir_gives_outcomes_not_errors(tmp_path):
    outcomes = run_checks(tmp_path)
    assert len(outcomes) == len(CHECKS) and all(o.passed for o in outcomes)
    assert {o.name: o for o in outcomes}["truncation_rate"].metadata["rows"] == 0


def test_missing_rejects_and_failures_tables_are_read_as_empty(tmp_path):
    ps = [prompt("x0", i, 100, "gsm8k") for i in range(10)]
    write(tmp_path, "prompt_shards", "x0", ps)
    write(tmp_path, "completions", "x0", [completion(p, CONFIG_A, 50) for p in ps[:7]])
    outcome = check(tmp_path, "accounting")
    assert not outcome.passed
    assert (outcome.metadata["completed"], outcome.metadata["missing"]) == (7, 3)


def test_parts_a_compaction_already_holds_are_read_once(tmp_path):
    ps = [prompt("x0", i, 100, "gsm8k") for i in range(10)]
    write(tmp_path, "prompt_shards", "x0", ps)
    store = PartStore(tmp_path, "completions", "x0", COMPLETION_SCHEMA)
    store.commit([completion(p, CONFIG_A, 50) for p in ps[:5]])
    store.commit([completion(p, CONFIG_A, 50) for p in ps[5:]])
    parts = {p: p.read_bytes() for p in store.parts()}
    store.compact()
    for path, data in parts.items():  # the crash window: compacted file renamed in, its parts not yet deleted
        path.write_bytes(data)
    outcomes = {o.name: o for o in run_checks(tmp_path)}
    assert outcomes["duplicates"].passed
    assert outcomes["truncation_rate"].metadata["rows"] == 10
    assert export_training_set(tmp_path, tmp_path / "out").manifest["rows"] == 10


def test_an_incomplete_config_that_is_not_the_one_judged_is_superseded_with_its_counts_and_blocks_nothing(tmp_path):
    data_dir = superseded_configs(tmp_path)
    outcomes = run_checks(data_dir, config_hash="b8192")
    (accounting,) = [o for o in outcomes if o.name == "accounting"]
    assert accounting.passed and gate_passed(outcomes), accounting.summary_md
    m = accounting.metadata
    assert (m["superseded_configs"], m["superseded"], m["missing"], m["failing_pairs"]) == (2, "a4096, c8192", 0, 0)
    # each with its own counts (only the shard where it is incomplete) and the config written after it
    assert (
        "config `a4096`, superseded (followed by config `c8192`): over 1 shard 10 prompts = 6 completed + "
        "0 rejected + 0 failed + 4 missing"
    ) in accounting.summary_md, accounting.summary_md
    assert (
        "config `c8192`, superseded (followed by config `b8192`): over 1 shard 10 prompts = 2 completed + "
        "0 rejected + 0 failed + 8 missing"
    ) in accounting.summary_md, accounting.summary_md
    # the judged config's own figures are its own: 20 prompts, all completed, none pooled from the others
    assert (m["pairs"], m["prompts"], m["completed"]) == (2, 20, 20)


def test_a_superseded_config_judged_itself_fails_its_own_accounting_and_a_complete_one_is_not_superseded(tmp_path):
    data_dir = superseded_configs(tmp_path)
    accounting = check(data_dir, "accounting", config_hash="a4096")
    assert not accounting.passed and accounting.metadata["missing"] == 4, accounting.summary_md
    assert pair_line("s1", "a4096", (10, 6, 0, 0, 4, 0)) in accounting.summary_md
    # c8192 is incomplete too and not judged: superseded, followed by b8192; b8192 is complete: not listed
    assert accounting.metadata["superseded"] == "c8192", accounting.summary_md
    assert "config `b8192`, superseded" not in accounting.summary_md
    # judged per shard, a shard where the config is complete is complete, and there nothing is superseded
    s0 = check(data_dir, "accounting", shard="s0", config_hash="b8192")
    assert s0.passed and s0.metadata["superseded_configs"] == 0, s0.summary_md


def test_without_a_config_to_judge_every_config_is_judged_and_none_is_superseded(tmp_path):
    accounting = check(superseded_configs(tmp_path), "accounting")
    assert not accounting.passed and accounting.metadata["superseded_configs"] == 0
    assert accounting.metadata["failing_pairs"] == 2, accounting.summary_md  # a4096 and c8192 in s1
