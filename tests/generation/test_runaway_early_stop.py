"""Runaways stopped while they run: the runaway rule on the streamed text every runaway_check_tokens tokens.

Two runs of the same shard on fresh emulators where 20% of generations loop past the cap of 8192 tokens: early
stopping on and off. The stopped rows are exactly the loops the checks find in the run without it; they cost a
few hundred tokens instead of the cap; every other row is the same; the checks, the report, the cap planner and
the export count them. On honest long rows (no loops, a high cap) the rule stops nothing.
"""

import json

import duckdb
import pytest

from dflash_assets.emulator import model
from dflash_assets.fleet.fleet import on_fleet
from dflash_assets.generation.engine import generate_shard
from dflash_assets.generation.shards import build_prompt_shard
from dflash_assets.quality import length_quality, run_checks
from dflash_assets.quality.planning.planner import plan_caps
from dflash_assets.quality.tables import register_runaway, runaway_sql
from dflash_assets.quality.training.export import export_training_set
from dflash_assets.settings import DispatchSettings, GenerationSettings, RunawaySettings
from tests.support.forks import start_emulator
from tests.support.http import Http, aborted, settled

pytestmark = pytest.mark.timeout(300)

N, CAP, EVERY = 120, 8192, 256
LOOPS = ["--loop-share", "0.2", "--length-max", str(4 * CAP), "--length-median", "300", "--length-sigma", "0.5"]
# decoded at 4000 tokens/s a request: a loop reaches the cap only after 2 s, the stop comes at EVERY tokens (64 ms),
# so the server is still decoding each stopped stream when its client closes it (an instant server could finish
# first, and then there is nothing to abort)
PACED = ["--decode-tokens-per-s", "4000"]
FLAGS = ["--reasoning-parser", "qwen3", "--stream-interval", "16", "--enable-metrics"]
PROVENANCE = "latency_s, created_at, server_url"


def make_shard(data, url, n=N) -> None:
    src = data.parent / "prompts.jsonl"
    src.write_text(
        "".join(json.dumps({"id": f"r{i:03d}", "prompt": f"Work out problem {i}."}) + "\n" for i in range(n))
    )
    on_fleet([url], lambda f: build_prompt_shard(src, 0, "00000", n, data, f, {"enable_thinking": True}))


def generate(data, url, every: int, cap: int = CAP):
    settings = DispatchSettings(runaway_check_tokens=every, store_token_ids=True, load_sample_s=0)
    return on_fleet(
        [url],
        lambda f: generate_shard(
            data,
            "00000",
            f,
            GenerationSettings(max_output_tokens=cap, cap_policy="fixed"),
            settings,
            log=lambda m: None,
        ),
    )


def table(data, select="*", where="true") -> list[dict]:
    rel = duckdb.sql(
        f"select {select} from read_parquet('{data}/completions/**/*.parquet') where {where} order by prompt_id"
    )
    return [dict(zip(rel.columns, r)) for r in rel.fetchall()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{every: (data dir, run, aborted requests)} for early stopping on (EVERY) and off (0)."""
    out = {}
    for every in (EVERY, 0):
        data = tmp_path_factory.mktemp(f"every{every}") / "data"
        with start_emulator(FLAGS + LOOPS + PACED) as emu:
            make_shard(data, emu.url)
            run = generate(data, emu.url, every)
            server = Http(emu.url)
            settled(server)  # every stopped stream released: its abort is counted
            out[every] = data, run, aborted(server)
    return out


def loops_found_by_the_checks(data) -> set[str]:
    con = duckdb.connect()
    register_runaway(con, RunawaySettings())
    return {
        r[0]
        for r in con.execute(
            f"select prompt_id from read_parquet('{data}/completions/**/*.parquet') where {runaway_sql(RunawaySettings())}"
        ).fetchall()
    }


def test_every_loop_is_stopped_early_and_only_the_loops(runs):
    (stopped_dir, stopped_run, stopped_aborts), (full_dir, _, full_aborts) = runs[EVERY], runs[0]
    truth = {
        r["prompt_id"]
        for r in table(full_dir, "prompt_id, prompt_token_ids")
        if model.plan_completion(
            list(r["prompt_token_ids"]), model.LengthModel(median=300, sigma=0.5, maximum=4 * CAP, loop_share=0.2)
        ).looping
    }
    runaways = table(stopped_dir, where="finish_reason = 'runaway'")
    assert 10 <= len(truth) <= 40
    assert {r["prompt_id"] for r in runaways} == truth == loops_found_by_the_checks(full_dir)
    assert stopped_run.runaways_stopped == len(truth) and stopped_run.completed == N
    for r in runaways:
        # stopped at the first check past the loop's start (events of 16 tokens), the loop found where it began
        assert EVERY <= r["completion_tokens"] < EVERY + 16, r
        assert 0 <= r["loop_start_tokens"] <= 16, r
        assert r["reasoning_content"] and r["content"] == "" and r["output_ids"] is None  # ids come at the end
    assert stopped_aborts == len(truth) and full_aborts == 0, "each stopped stream was aborted by the server"


def test_the_other_rows_are_the_rows_a_run_without_early_stopping_commits(runs):
    (stopped_dir, *_), (full_dir, *_) = runs[EVERY], runs[0]
    where = "finish_reason <> 'runaway'"
    mine = table(stopped_dir, f"* exclude ({PROVENANCE})", where)
    theirs = [
        r for r in table(full_dir, f"* exclude ({PROVENANCE})") if r["prompt_id"] in {m["prompt_id"] for m in mine}
    ]
    assert len(mine) == N - len(table(stopped_dir, where="finish_reason = 'runaway'")) and mine == theirs


def test_runaways_cost_a_few_percent_of_what_they_cost_at_the_cap(runs):
    (stopped_dir, *_), (full_dir, *_) = runs[EVERY], runs[0]
    loops = loops_found_by_the_checks(full_dir)
    full = sum(r["completion_tokens"] for r in table(full_dir) if r["prompt_id"] in loops)
    early = sum(r["completion_tokens"] for r in table(stopped_dir) if r["prompt_id"] in loops)
    assert full == len(loops) * CAP
    assert early / full <= 0.10 * 0.4, f"runaways cost {early / full:.1%} of what they cost at the cap"


def test_checks_and_report_count_the_stopped_runaways(runs):
    (stopped_dir, *_), (full_dir, *_) = runs[EVERY], runs[0]
    n_loops = len(loops_found_by_the_checks(full_dir))
    (outcome,) = run_checks(stopped_dir, names=["runaway_rate"])
    m = outcome.metadata
    assert (m["runaway_rows"], m["runaway_stopped_rows"], m["truncated_rows"]) == (n_loops, n_loops, n_loops)
    assert m["honest_truncated_rows"] == 0
    assert outcome.summary_md.startswith(
        f"**{n_loops / N * 100:.2f}%** of {N} rows ({n_loops}) were cut while repeating themselves (runaways)"
    )
    assert f"{n_loops} of the runaways were stopped while streaming, before the cap" in outcome.summary_md
    report = length_quality(stopped_dir)
    # cut: the model did not end them (no honest row reaches this cap)
    assert (report["runaway_rows"], report["runaway_stopped_rows"], report["truncated_rows"]) == (
        n_loops,
        n_loops,
        n_loops,
    )
    (full,) = run_checks(full_dir, names=["runaway_rate"])
    assert full.metadata["runaway_rows"] == n_loops and full.metadata["runaway_stopped_rows"] == 0


def test_the_cap_planner_charges_a_stopped_runaway_the_tokens_it_cost(runs):
    for every in (EVERY, 0):
        data, *_ = runs[every]
        plan = plan_caps(data, bootstrap=20)
        decoded = sum(r["completion_tokens"] for r in table(data))
        assert plan.runaways == len(loops_found_by_the_checks(runs[0][0]))
        assert plan.at(CAP).output_tokens.value == pytest.approx(decoded), every
    stopped, full = plan_caps(runs[EVERY][0], bootstrap=20), plan_caps(runs[0][0], bootstrap=20)
    # a larger cap costs a runaway that is stopped nothing more; one that is not, the whole larger cap
    assert stopped.at(16384).output_tokens.value == pytest.approx(stopped.at(CAP).output_tokens.value)
    assert full.at(16384).output_tokens.value - full.at(CAP).output_tokens.value == pytest.approx(
        full.runaways * (16384 - CAP)
    )


def test_the_export_leaves_the_stopped_runaways_out(runs, tmp_path):
    (stopped_dir, *_), (full_dir, *_) = runs[EVERY], runs[0]
    n_loops = len(loops_found_by_the_checks(full_dir))
    export = export_training_set(stopped_dir, tmp_path / "export", max_length=None)
    assert export.manifest["excluded"]["runaway"] == n_loops
    kept = duckdb.sql(f"select prompt_id from read_parquet('{export.parquet_path}')").fetchall()
    assert not {k[0] for k in kept} & loops_found_by_the_checks(full_dir)


def test_on_honest_long_rows_the_rule_stops_nothing(tmp_path):
    data = tmp_path / "data"
    honest = ["--length-median", "6000", "--length-sigma", "0.5", "--length-max", "16000"]
    with start_emulator(FLAGS + honest) as emu:
        make_shard(data, emu.url, n=40)
        run = generate(data, emu.url, EVERY, cap=16384)
    rows = table(data, "finish_reason, completion_tokens")
    assert run.completed == 40 and run.runaways_stopped == 0
    assert sum(r["completion_tokens"] for r in rows) > 40 * 3000, "long rows: many checks each"
    assert {r["finish_reason"] for r in rows} <= {"stop", "length"}
