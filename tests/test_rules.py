"""The domain's rules hold everywhere they are used: preflight, checks, reports, planner, export, continuation."""

import duckdb
import numpy as np
import pytest

from dflash_assets.fleet.client import ServerInfo
from dflash_assets.generation.continuation import latest_parent
from dflash_assets.generation.preflight import Budget
from dflash_assets.quality import export_training_set, length_quality, run_checks
from dflash_assets.quality.planning.planner import plan_caps
from dflash_assets.quality.report.answer import cap_answers
from dflash_assets.rules import CONTEXT_MARGIN, latest_first, overflows, percentile, percentile_sql
from dflash_assets.store.configs import latest_config
from tests.support.quality_data import CONFIG_A, T0, completion, prompt, write

CONTEXT = 16384
CAP = CONFIG_A["max_output_tokens"]


def test_a_row_at_context_minus_one_is_refused_by_preflight_and_flagged_by_check_report_and_export(tmp_path):
    # SGLang 0.5.23 would have clamped this row's cap by a token without a word: every stage must agree
    fits, clamped = prompt("s0", 0, CONTEXT - CONTEXT_MARGIN - CAP, "code"), prompt("s0", 1, CONTEXT - 1 - CAP, "code")
    write(tmp_path, "prompt_shards", "s0", [fits, clamped])
    write(tmp_path, "completions", "s0", [completion(p, CONFIG_A, 100) for p in (fits, clamped)])
    budget = Budget.of([ServerInfo("http://s", "m", CONTEXT, 8, CONTEXT - 6, None)])
    assert budget.problem(fits["prompt_tokens"], CAP) is None
    assert "exceeds the server context length 16384 minus a safety margin of 2 tokens" in budget.problem(
        clamped["prompt_tokens"], CAP
    )

    (outcome,) = run_checks(tmp_path, names=["context_overflow"])
    assert not outcome.passed and outcome.metadata["completion_overflow_rows"] == 1
    assert length_quality(tmp_path)["overflow"]["completion_rows_over_context"] == 1
    export = export_training_set(tmp_path, tmp_path / "out", config_hash=CONFIG_A["config_hash"], max_length=None)
    assert export.manifest["rows"] == 1 and export.manifest["excluded"]["context_overflow"] == 1


def test_the_overflow_rule_is_one_predicate_for_python_and_numpy():
    assert not overflows(CONTEXT - 2 - CAP, CAP, CONTEXT) and overflows(CONTEXT - 1 - CAP, CAP, CONTEXT)
    prompts = np.array([CONTEXT - 2 - CAP, CONTEXT - 1 - CAP, CONTEXT - CAP])
    assert overflows(prompts, CAP, CONTEXT).tolist() == [False, True, True]


@pytest.mark.parametrize("q, rank", [(0.2, 1), (0.21, 2), (0.5, 3), (0.9, 5), (1.0, 5)])
def test_percentiles_are_nearest_rank_in_python_and_in_sql(q, rank):
    values = [50, 10, 40, 20, 30]  # Pq is the value at 1-based rank ceil(q * n) of the sorted values
    assert percentile(values, q) == sorted(values)[rank - 1]
    sql = duckdb.sql(f"SELECT {percentile_sql('v', [q])}[1] FROM (SELECT unnest({values}) AS v)").fetchall()[0][0]
    assert sql == sorted(values)[rank - 1]


def test_latest_is_the_most_recently_written_config_everywhere_never_the_most_rows(tmp_path):
    ps = [prompt("s0", i, 100, "code") for i in range(6)]
    old = dict(CONFIG_A, config_hash="a-old", max_output_tokens=2048)
    new = dict(CONFIG_A, config_hash="z-new", max_output_tokens=3072)
    write(tmp_path, "prompt_shards", "s0", ps)
    # the old config has more rows, the new one the last row written (created_at: T0 + the prompt's line)
    write(tmp_path, "completions", "s0", [completion(p, old, 50) for p in ps[:4]], part="part-0000")
    write(tmp_path, "completions", "s0", [completion(p, new, 50) for p in ps[4:]], part="part-0001")
    assert latest_config(tmp_path) == "z-new"  # the export's default launched alone
    assert latest_parent(tmp_path, "s0", 4096) == "z-new"  # the continuation's parent_config_hash 'latest'
    assert "config `z-new` chosen by default: the latest" in plan_caps(tmp_path, fit_from=0.0, bootstrap=0).notes[0]
    assert [a.config_hash for a in cap_answers(tmp_path)] == ["z-new", "a-old"]  # `dflash report` leads with it
    # written at the same moment: the larger cap wins, although its hash sorts last
    assert latest_first([("a-small", T0, 2048), ("z-large", T0, 3072)])[0][0] == "z-large"
