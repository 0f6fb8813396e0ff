"""`dflash probe`: the length probe without Dagster, against the emulator, as a person types it."""

import asyncio
import json
import re

import duckdb
import pytest

from dflash_assets.fleet.fleet import connected
from dflash_assets.generation.shards import build_prompt_shard
from dflash_assets.rules import CONTEXT_MARGIN
from tests.support.cli import dflash, run_as_printed
from tests.support.shards import longest_prompt

FLAGS = [
    "--decode-tokens-per-s",
    "0",
    "--reasoning-parser",
    "qwen3",
    "--length-median",
    "400",
    "--length-sigma",
    "0.9",
    "--loop-share",
    "0.02",
    "--context-length",
    "8192",
]


def build_shards(url: str, src, data, shards: int, per_shard: int) -> None:
    async def build():
        async with connected([url]) as fleet:
            for k in range(shards):
                await build_prompt_shard(src, k, f"{k:05d}", per_shard, data, fleet, {"enable_thinking": True})

    asyncio.run(build())


@pytest.fixture
def prompts(tmp_path, emulator):
    server = emulator(*FLAGS)
    src, data = tmp_path / "p.jsonl", tmp_path / "data"
    src.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "prompt": f"probe test {i}: explain topic {i % 17}."}) + "\n" for i in range(240)
        )
    )
    build_shards(server.emu.url, src, data, 2, 120)
    return server.emu.url, data


def probe_rows(data) -> list[tuple]:
    return duckdb.sql(
        f"SELECT prompt_id, max_output_tokens, config_hash, finish_reason FROM read_parquet("
        f"'{data}/length_probe/completions/**/*.parquet')"
    ).fetchall()


def run_at_1024(url: str, data) -> None:
    """The run a probe follows: both shards generated at a fixed cap of 1024 (rows cut for the probe to measure)."""
    for shard in ("00000", "00001"):
        flags = ["--urls", url, "--data-dir", str(data), "--cap-policy", "fixed", "--max-output-tokens", "1024"]
        gen = dflash("generate", "--shard", shard, *flags)
        assert gen.returncode == 0, gen.stdout + gen.stderr


def test_probe_after_a_run_measures_the_larger_caps_and_says_the_next_command(prompts):
    url, data = prompts
    run_at_1024(url, data)
    home = {"DAGSTER_HOME": str(data.parent / "home")}  # the instance the printed `continue` runs on
    result = dflash("probe", "--urls", url, "--data-dir", str(data), "--min-prompts", "100", env=home)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    rows = probe_rows(data)
    longest = longest_prompt(data / "length_probe" / "prompt_shards")
    cap = 8192 - CONTEXT_MARGIN - longest  # the largest cap the context allows for the sampled prompts
    # the files: 100 sampled prompts, generated at that cap under their own config, beside the run's rows
    assert len(rows) == 100 and {r[1] for r in rows} == {cap} and len({r[2] for r in rows}) == 1
    config = rows[0][2]
    assert (
        f"length probe: 100 of 240 prompts at cap {cap:,}, config {config}: 100 completed + 0 rejected + 0 failed"
        in out
    ), out
    assert f"rows in {data / 'length_probe'}" in out
    # the share cut at larger caps is measured from the run's 240 rows and the probe, no model
    assert "share still cut, from 240 rows at cap 1,024 and the probe (95% intervals):" in out
    for c in ("4,096", "6,144", f"{cap:,}"):
        line = next(line for line in out.splitlines() if line.strip().startswith(c + " "))
        assert line.endswith("measured (probe)"), line
    assert "precision: probe of 100 rows (" in out and "(95%, binomial)" in out
    # the next command raises the cap to the one the report's answer recommends (answer.recommended_cap)
    from dflash_assets.quality.planning.estimate import DEFAULT_CANDIDATES
    from dflash_assets.quality.planning.planner import plan_caps
    from dflash_assets.quality.report.answer import recommended_cap
    from dflash_assets.settings import QualitySettings

    plan = plan_caps(data, candidates=sorted({*DEFAULT_CANDIDATES, cap}))
    rec = recommended_cap(plan, QualitySettings().truncation_rate_max)
    assert rec.basis == "probe" and rec.truncation_rate.value <= 0.05
    continue_to = (
        f"DAGSTER_HOME={home['DAGSTER_HOME']} DFLASH_FLEET_MODE=attach DFLASH_FLEET_URLS={url} dflash continue "
        f"--to {rec.cap} --data-dir {data}"
    )
    assert (
        f"next: dflash report --data-dir {data} (the whole cap plan); to raise the cap to {rec.cap:,}, the "
        f"smallest that cuts 5.00% or fewer ({rec.truncation_rate.value * 100:.2f}%, measured (probe)): {continue_to}"
    ) in out, out
    # both run as printed, in a clean shell elsewhere: the continue on the probe's servers, from the data dir alone
    report = run_as_printed(f"dflash report --data-dir {data}", cwd=data / "length_probe")
    assert report.returncode == 0, report.stdout + report.stderr
    continued = run_as_printed(continue_to, cwd=data / "length_probe")
    assert continued.returncode == 0, continued.stdout + continued.stderr
    # a second run with the same sample and settings resumes: nothing new generated
    again = dflash("probe", "--urls", url, "--data-dir", str(data), "--min-prompts", "100")
    assert "100 completed + 0 rejected + 0 failed; 0 output tokens this run" in again.stdout, again.stdout
    assert len(probe_rows(data)) == 100


def test_probe_before_any_run_plans_from_its_own_rows_and_says_how_to_generate(prompts):
    url, data = prompts
    probe = ("--urls", url, "--data-dir", str(data), "--size", "60", "--shards", "00001")
    sampling = (
        "--temperature",
        "0.7",
        "--no-enable-thinking",
        "--max-in-flight-per-server",
        "32",
    )  # what generate repeats
    result = dflash("probe", *probe, "--max-output-tokens", "6000", *sampling)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = probe_rows(data)
    assert len(rows) == 60 and {r[1] for r in rows} == {6000}
    assert "length probe: 60 of 120 prompts at cap 6,000" in result.stdout
    assert "share still cut, from the probe's rows alone (95% intervals):" in result.stdout
    assert "dflash continue" not in result.stdout
    # the run at the probe's cap, with the probe's own sampling and dispatch: runs as printed
    [generate] = re.findall(r"dflash generate [^;\n]*", result.stdout)
    cap = re.search(r"--max-output-tokens (\d+)", generate).group(1)
    assert generate.strip() == (
        f"dflash generate --shard 00001 --urls {url} --data-dir {data} --max-output-tokens {cap} "
        "--temperature 0.7 --no-enable-thinking --max-in-flight-per-server 32"
    ), generate
    ran = run_as_printed(generate)
    assert ran.returncode == 0 and "shard 00001 config " in ran.stdout, ran.stdout + ran.stderr


def test_probe_of_the_runs_cut_rows_continues_them_and_measures_from_all_its_rows(prompts):
    from dflash_assets.quality.planning.planner import honest_cut_rows

    url, data = prompts
    before = dflash("probe", "--urls", url, "--data-dir", str(data), "--mode", "cut_rows")
    assert (
        before.returncode == 2
        and "a continuation probe continues a run's cut rows; generate the run first" in before.stderr
    ), before.stdout + before.stderr
    run_at_1024(url, data)
    result = dflash("probe", "--urls", url, "--data-dir", str(data), "--mode", "cut_rows", "--min-prompts", "20")
    assert result.returncode == 0, result.stdout + result.stderr
    out, honest = result.stdout, honest_cut_rows(data)[2]
    rows = duckdb.sql(
        f"SELECT prompt_id, max_output_tokens, parent_config_hash FROM read_parquet("
        f"'{data}/length_probe/completions/shard=cut_rows/*.parquet') WHERE max_output_tokens > 1024"
    ).fetchall()
    (cap,) = {r[1] for r in rows}
    longest = longest_prompt(data / "length_probe" / "prompt_shards", "shard=cut_rows/*.parquet")
    assert cap == 8192 - CONTEXT_MARGIN - longest  # the cap from the context, as the random probe takes it
    assert len(honest) > 20 and len(rows) == 20 and {r[0] for r in rows} <= {pid for _, pid in honest}
    assert f"length probe: 20 of {len(honest)} of the run's honest cut rows, continued to cap {cap:,}" in out, out
    for c in ("4,096", "6,144"):
        line = next(line for line in out.splitlines() if line.strip().startswith(c + " "))
        assert line.endswith("measured (continuation probe of 20 cut rows)"), line
    assert "precision: continuation probe of 20 cut rows (20 honest rows cut at 1,024, continued): " in out, out


@pytest.mark.parametrize(
    "args,message",
    [
        (["--mode", "all"], "--mode takes one of prompts, cut_rows, got 'all'"),
        (["--share", "2"], "share must be in (0, 1], got 2.0"),
        (["--max-output-tokens", "-1"], "max_output_tokens must be >= 0 (0: the largest the context allows), got -1"),
        (["--data-dir", "/nonexistent/nowhere"], "no prompt shards under /nonexistent/nowhere: build them first"),
    ],
)
def test_bad_probe_arguments_give_a_clear_error(args, message):
    result = dflash("probe", "--urls", "http://127.0.0.1:1", *args)
    assert result.returncode == 2 and message in result.stderr, result.stdout + result.stderr


def test_probe_flags_take_their_defaults_from_the_settings():
    from dflash_assets.cli import build_parser
    from dflash_assets.defs.probe.assets import LengthProbeConfig
    from dflash_assets.settings import DispatchSettings, GenerationSettings, ProbeSettings

    args = build_parser().parse_args(["probe", "--urls", "http://x"])
    assert ProbeSettings.taken_from(args) == ProbeSettings() == ProbeSettings.taken_from(LengthProbeConfig())
    assert args.max_output_tokens == 0  # the probe's cap (0: the largest the context allows), not the run's 4096
    # the run's sampling, without the probe's cap (ProbeSettings') in its place
    assert GenerationSettings.taken_from(args, skip=("max_output_tokens",)) == GenerationSettings()
    assert DispatchSettings.taken_from(args) == DispatchSettings()
    assert dflash("probe", "--help").returncode == 0
