"""Configs side by side in one folder, as the README's order makes them: each run's table, checks and export are of
its own config, the others are listed beside it; `dflash configs`, `dflash export` and `dflash report` compare and
ship any of them."""

import json
import re
from pathlib import Path

import dagster as dg
import duckdb
import pytest
from dagster._core.instance.ref import InstanceRef
from PIL import Image

from tests.support.cli import demo_slice, dflash, home

pytestmark = pytest.mark.long

# the README's order: the demo at its default cap, a 4096 cap, then the command the terminal suggests
README_ORDER = (
    ("--cap-policy", "fixed", "--max-output-tokens", "16384"),  # the demo before the window policy was the default
    ("--cap-policy", "fixed", "--max-output-tokens", "4096"),
    (),  # the default: the window policy
)
CAPS = (16384, 4096, 4096)


def config_rows(data_dir: str) -> dict[str, int]:
    """config_hash -> committed rows, recounted from the Parquet files."""
    found = duckdb.sql(
        f"select config_hash, count(*) from read_parquet('{data_dir}/completions/**/*.parquet', union_by_name = true) "
        f"group by 1"
    ).fetchall()
    return dict(found)


@pytest.fixture(scope="module")
def readme_order(tmp_path_factory):
    """One shard of the demo's prompts on one server, the three runs one after the other in one folder; for each:
    its output and the configs in the data dir after it."""
    tmp = tmp_path_factory.mktemp("readme_order")
    env = home(tmp, "home") | {
        "DFLASH_PROMPTS": str(demo_slice(tmp, 100)),
        "DFLASH_SHARD_SIZE": "100",
        "DFLASH_NUM_SERVERS": "1",
    }
    runs = []
    for flags in README_ORDER:
        result = dflash("demo", "--full", *flags, env=env, cwd=tmp)
        runs.append((result, config_rows(env["DFLASH_DATA_DIR"])))
    return env, runs


def test_each_run_of_the_readmes_order_shows_and_exports_its_own_config_and_lists_the_others(readme_order):
    env, runs = readme_order
    data = Path(env["DFLASH_DATA_DIR"])
    before: dict[str, int] = {}
    made = []
    for (result, configs), cap in zip(runs, CAPS):
        out = result.stdout
        assert result.returncode == 0, out + result.stderr
        (new,) = set(configs) - set(before)  # the config this run made
        made.append(new)
        flat = re.sub(r"\s+", " ", out)
        row = next(line for line in out.splitlines() if line.strip().startswith("00000"))
        cells = row.split()
        assert int(cells[-2]) <= cap, row  # P99 of the run's config is at most its cap
        [(prompts,)] = duckdb.sql(
            f"select count(distinct prompt_id) from read_parquet('{data}/completions/**/*.parquet', "
            f"union_by_name = true) where config_hash = '{new}'"
        ).fetchall()
        assert int(cells[4]) == prompts  # done: the run's config's prompts, not every config's
        # the training set written is of the run's config, with its rows alone
        said = re.search(rf"drafter training set: (\d+) rows of config {new} (?:\(chosen by: run\) )?in (\S+)", flat)
        assert said, out
        manifest = json.loads((data / "training" / new / "manifest.json").read_text())
        assert list(manifest["rows_by_config"]) == [new] and manifest["rows"] == int(said.group(1))
        exported = duckdb.sql(
            f"select distinct config_hash from read_parquet('{data / 'training' / new / 'training_set.parquet'}')"
        ).fetchall()
        assert exported == [(new,)] and said.group(2) == str(data / "training" / new / "training_set.jsonl")
        before = configs
    # each run says whose figures and export they are (the manifest: chosen by the run), and lists the others
    for i, ((result, _), new) in enumerate(zip(runs, made)):
        flat = re.sub(r"\s+", " ", result.stdout)
        manifest = json.loads((data / "training" / new / "manifest.json").read_text())
        assert (manifest["config_hash"], manifest["chosen_by"]) == (new, "run")
        assert f"completions of config {new} by shard" in flat and f"config {new} (chosen by: run)" in flat
        earlier = runs[i - 1][1] if i else {}
        for other in earlier:  # one line each below the table, never pooled into it
            assert f"config {other} (cap " in flat and f"{earlier[other]:,} rows in 1 shard(s), complete" in flat
        assert ("also in this data dir" in flat) == bool(earlier)
    # the window policy rejects the prompts that fill the window: its config has the fewest rows, and is exported
    window = next(h for h in runs[2][1] if h not in runs[1][1])
    assert runs[2][1][window] < min(n for h, n in runs[2][1].items() if h != window)
    # the UI's summary of the last run is of that config and carries the configs table, the latest first
    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(env["DAGSTER_HOME"])) as instance:
        (record,) = instance.fetch_materializations(dg.AssetKey("length_quality_summary"), limit=1).records
    meta = {k: v.value for k, v in record.asset_materialization.metadata.items()}
    assert (meta["config_hash"], meta["config_chosen_by"], meta["rows"]) == (window, "run", runs[2][1][window])
    table = [line for line in meta["configs"].splitlines() if re.match(r"\| [0-9a-f]{12} \|", line)]
    assert [line.split(" | ")[0].strip("| ") for line in table][0] == window and len(table) == 3


def test_dflash_configs_lists_every_config_the_latest_first_with_its_own_rows(readme_order):
    env, runs = readme_order
    made = [next(h for h in runs[i][1] if h not in (runs[i - 1][1] if i else {})) for i in range(3)]
    result = dflash("configs", "--data-dir", env["DFLASH_DATA_DIR"], env=env, cwd=env["CWD"])
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if re.match(r"\s+[0-9a-f]{12}\s", line)]
    assert [r[0] for r in rows] == made[::-1]  # the latest, the most recently written, first
    counts = runs[2][1]
    for r in rows:  # config, cap, policy (and its window), judged at, rows, shards, complete, ...
        fixed = r[0] != made[2]
        assert r[1:3] == [str(CAPS[made.index(r[0])]), "fixed" if fixed else "window"], r
        rest = r[4:] if fixed else r[5:]
        assert rest[:3] == [f"{counts[r[0]]:,}", "1", "yes"], r  # its own rows, its shard, complete
    assert f"latest (the export's default when no run names its own): {made[2]}" in result.stdout


def test_dflash_export_ships_the_config_named_and_stops_at_a_blocking_check(readme_order):
    env, runs = readme_order
    data = Path(env["DFLASH_DATA_DIR"])
    first = next(iter(runs[0][1]))  # the demo's default cap: not the latest
    result = dflash("export", "--config", first, env=env, cwd=env["CWD"])
    assert result.returncode == 0, result.stdout + result.stderr
    manifest = json.loads((data / "training" / first / "manifest.json").read_text())
    assert (manifest["config_hash"], manifest["chosen_by"], list(manifest["rows_by_config"])) == (
        first,
        "explicit",
        [first],
    )
    assert f"rows of config {first} (chosen by: explicit) in {data / 'training' / first / 'training_set.jsonl'}" in (
        re.sub(r"\s+", " ", result.stdout)
    )
    # a config that is not there: one sentence naming the ones that are, exit 2
    missing = dflash("export", "--config", "0123456789ab", env=env, cwd=env["CWD"])
    assert missing.returncode == 2 and "no config 0123456789ab under" in missing.stdout
    assert all(h in re.sub(r"\s+", " ", missing.stdout) for h in runs[2][1])
    # judged for a trainer that reads 8192 tokens, a 4096 cap cuts inside the window: the gate stops it (3)
    at_4096 = next(h for h in runs[1][1] if h not in runs[0][1])
    stopped = dflash("export", "--config", at_4096, "--trainer-max-length", "8192", env=env, cwd=env["CWD"])
    assert stopped.returncode == 3, stopped.stdout + stopped.stderr
    flat = re.sub(r"\s+", " ", stopped.stdout)
    assert f"drafter training set: not written: a blocking check fails on config {at_4096}" in flat
    assert "Stopped by the blocking check truncation_rate (all shards)" in flat
    # every config at once: stopped by the same check, said of the one config it fails on, by that config's rows
    every = dflash("export", "--config", "all", "--trainer-max-length", "8192", env=env, cwd=env["CWD"])
    assert every.returncode == 3, every.stdout + every.stderr
    flat = re.sub(r"\s+", " ", every.stdout)
    said = f"drafter training set (--config all): not written: a blocking check fails on config {at_4096} Stopped by"
    assert said in flat, every.stdout
    assert "Stopped by the blocking check truncation_rate (all shards)" in flat
    n = config_rows(env["DFLASH_DATA_DIR"])[at_4096]
    assert re.search(rf"config {at_4096}: cap 4,096, window [\d,]+, {n:,} turn rows of", flat), every.stdout


def test_report_puts_the_latest_config_first_with_each_configs_own_truncation_share(readme_order):
    env, runs = readme_order
    # judged for a trainer that reads 8192 tokens, so that the fixed caps' cuts lie inside its window (a window-policy
    # config is judged by the window it recorded: rules.row_window_sql)
    result = dflash(
        "report",
        "--full",
        "--data-dir",
        env["DFLASH_DATA_DIR"],
        "--trainer-max-length",
        "8192",
        env=env,
        cwd=env["CWD"],
    )
    assert result.returncode == 0, result.stderr
    flat = re.sub(r"\s+", " ", result.stdout.split("Length quality, all shards")[0])
    said = [
        (h, share, rows)
        for h, rows, share in re.findall(
            r"config ([0-9a-f]{12}): cap [\d,]+, window [\d,]+, ([\d,]+) turn rows of [\d,]+ conversations "
            r"(?:\([\d,]+ shortened\) )?cut at the "
            r"cap ([\d.]+)%",
            flat,
        )
    ]
    latest = next(h for h in runs[2][1] if h not in runs[1][1])
    assert said[0][0] == latest and len(said) == 3
    recount = duckdb.sql(
        f"select config_hash, count(*), count(*) filter (where finish_reason = 'length'), "
        f"count(*) filter (where finish_reason = 'length' and prompt_tokens + completion_tokens < coalesce(trainer_max_length, 8192)) "
        f"from read_parquet('{env['DFLASH_DATA_DIR']}/completions/**/*.parquet', union_by_name = true) group by 1"
    ).fetchall()
    by_hash = {h: (rows, cut, inside) for h, rows, cut, inside in recount}
    for h, share, rows in said:
        n, cut, inside = by_hash[h]
        assert (int(rows.replace(",", "")), share) == (n, f"{cut / n * 100:.2f}")
        own = re.search(rf"config {h}: .*? cut inside the window ([\d.]+%) \((\d+),", flat)
        assert own and own.groups() == (f"{inside / n:.2%}", str(inside)), flat
    # the pictures: every config side by side, then each config's own histogram and cap plan, the latest first
    folder = re.search(r"pictures: (\S+)", result.stdout).group(1)
    pictures = [Path(folder, name) for name in re.findall(r"^  (\S+\.png)$", result.stdout, re.M)]
    assert [p.name for p in pictures] == ["completion_lengths.png"] + [
        name for h, *_ in said for name in (f"completion_lengths-{h}.png", f"cap_plan-{h}.png")
    ], pictures
    shown = {p.name: Image.open(p).text.get("Description", "") for p in pictures if p.name.startswith("completion")}
    assert all(f"{h} (cap " in shown["completion_lengths.png"] for h in by_hash), shown
    for h, (n, _cut, _inside) in by_hash.items():  # each config's histogram is of its rows alone
        own = shown[f"completion_lengths-{h}.png"]
        assert own.startswith(f"{h} (cap ") and f"): {n:,} rows. config {h}: " in own, own
        assert not any(other in own for other in by_hash if other != h), own
