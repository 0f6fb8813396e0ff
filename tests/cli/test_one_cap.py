"""One cap per config on every screen, the window policy's included: a window-policy run (`dflash demo`'s default)
sizes each request to the window's rest, below the cap its user set; the run's answer, `dflash report --full`,
`dflash configs` and the UI's metadata (the answer, the cap plan and its glance) name the set cap and the share cut
at it that a recount of the Parquet rows gives, and the cap plan counts the cuts the window sized as final. The
answer counts the conversations a cut at the window shortened."""

import re
from pathlib import Path

import dagster as dg
import duckdb
import pytest

from tests.cli.test_answer import after_the_table, recount, said
from tests.support.cli import demo_slice, dflash, home, split_command

pytestmark = pytest.mark.long


@pytest.fixture(scope="module")
def window_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("window-run")
    env = home(tmp, "home") | {
        "DFLASH_PROMPTS": str(demo_slice(tmp, 100)),
        "DFLASH_SHARD_SIZE": "100",
        "DFLASH_NUM_SERVERS": "1",
        "COLUMNS": "100",
    }
    demo = dflash("demo", env=env, cwd=tmp)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    views = {args: dflash(*args, env=env, cwd=tmp) for args in [("report", "--full"), ("configs",)]}
    for args, result in views.items():
        assert result.returncode == 0, f"{args}: {result.stdout}{result.stderr}"
    return env, {"demo": demo.stdout} | {" ".join(args): r.stdout for args, r in views.items()}


def test_every_screen_names_the_set_cap_and_the_share_cut_a_recount_gives(window_run):
    env, out = window_run
    data = Path(env["DFLASH_DATA_DIR"])
    parquet = f"read_parquet('{data}/completions/**/*.parquet', union_by_name = true)"
    ((cap, asked, policies),) = duckdb.sql(
        f"select max(policy_cap), max(max_output_tokens), count(distinct policy_cap) from {parquet}"
    ).fetchall()
    assert policies == 1 and asked < cap  # the window sized every request below the set cap
    expected = recount(data)
    ((shortened,),) = duckdb.sql(  # conversations with no row of their last assistant turn
        f"select count(*) filter (where last < turns) from (select shard, prompt_id, max(turn) as last, "
        f"max(turns) as turns from {parquet} where turns is not null group by all)"
    ).fetchall()
    assert shortened > 0  # the demo's multi-turn prompts: a turn cut at the window ends its conversation
    share = f"{100 * expected['cut at the cap'] / expected['rows']:.2f}%"
    assert expected["cut at the cap"] > 0
    for view in ("demo", "report --full"):
        text = after_the_table(out[view]) if view == "demo" else out[view]
        assert said(text, expected) == expected, view
        assert f"cap {cap:,}, window" in text, view
        assert f"conversations ({shortened} shortened)" in re.sub(r"\s+", " ", text), view
    # the cap plan's row of the config's cap, on the terminal: the share the answer says, measured
    (now,) = [line.split() for line in out["report --full"].splitlines() if "(now)" in line]
    assert now[:4] == [f"{cap:,}", "(now)", share, "measured"], now
    assert f"cap {asked:,}" not in out["report --full"]  # no per-request cap posing as the config's
    (row,) = [line for line in out["configs"].splitlines() if re.match(r"\s*[0-9a-f]{12}\s", line)]
    assert f"{cap} window" in row and f"{share} ({expected['cut at the cap']})" in row, row
    # the UI: the summary's answer, its cap plan and the glance
    instance = dg.DagsterInstance.from_config(env["DAGSTER_HOME"])
    (record,) = instance.fetch_materializations(dg.AssetKey("length_quality_summary"), limit=1).records
    metadata = record.asset_materialization.metadata
    assert said(metadata["answer"].value, expected) == expected
    assert f"cap {cap:,}, window" in metadata["answer"].value
    assert f"conversations ({shortened} shortened)" in metadata["answer"].value
    assert f"{cap:,} (now) cuts {share}" in metadata["cap_plan_at_a_glance"].value
    plan = metadata["cap_plan"].value
    assert f"| {cap:,} (now) | {share} (" in plan and f"at cap {cap:,}, {expected['cut at the cap']} cut" in plan
    assert "per-request caps" in plan and f"to {asked:,})" in plan, plan


def test_a_run_whose_every_row_is_cut_says_so_and_prints_the_continue_command(tmp_path):
    env = home(tmp_path, "home") | {
        "DFLASH_PROMPTS": str(demo_slice(tmp_path, 20)),
        "DFLASH_SHARD_SIZE": "20",
        "DFLASH_NUM_SERVERS": "1",
        "COLUMNS": "100",
    }
    run = dflash("demo", "--cap-policy", "fixed", "--max-output-tokens", "64", env=env, cwd=tmp_path)
    assert run.returncode == 3, run.stdout + run.stderr  # stopped by the blocking check
    expected = recount(Path(env["DFLASH_DATA_DIR"]))
    assert expected["cut at the cap"] == expected["cut inside the window"] == expected["rows"] > 0
    flat = re.sub(r"\s+", " ", after_the_table(run.stdout))
    assert said(flat, expected) == expected
    assert "100.00% cut inside the window, over the limit 5.00%" in flat and "within the limit" not in flat
    assert f"Next: continue the {expected['rows']} cut rows to cap 4,096 from where they stopped" in flat
    (command,) = [line.strip() for line in run.stdout.splitlines() if " dflash continue " in f" {line}"]
    _, words = split_command(command)
    assert words[:4] == ["dflash", "continue", "--to", "4096"] and "--data-dir" in words, command
