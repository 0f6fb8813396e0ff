"""One cap per config on every screen, the window policy's included: a window-policy run (`dflash demo`'s default)
sizes each request to the window's rest, below the cap its user set; the run's answer, `dflash report --full`,
`dflash configs` and the UI's metadata (the answer, the cap plan and its glance) name the set cap and the share cut
at it that a recount of the Parquet rows gives, and the cap plan counts the cuts the window sized as final."""

import re
from pathlib import Path

import dagster as dg
import duckdb
import pytest

from tests.cli.test_answer import after_the_table, recount, said
from tests.support.cli import demo_slice, dflash, home

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
    share = f"{100 * expected['cut at the cap'] / expected['rows']:.2f}%"
    assert expected["cut at the cap"] > 0
    for view in ("demo", "report --full"):
        text = after_the_table(out[view]) if view == "demo" else out[view]
        assert said(text, expected) == expected, view
        assert f"cap {cap:,}, window" in text, view
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
    assert f"{cap:,} (now) cuts {share}" in metadata["cap_plan_at_a_glance"].value
    plan = metadata["cap_plan"].value
    assert f"| {cap:,} (now) | {share} (" in plan and f"at cap {cap:,}, {expected['cut at the cap']} cut" in plan
    assert "per-request caps" in plan and f"to {asked:,})" in plan, plan
