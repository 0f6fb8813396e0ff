"""regenerate: all_turns on the emulator: every assistant turn of 3-turn conversations, in order, exactly once,
across kill -9, with the same histories as an uninterrupted run; a cut or refused turn ends its conversation."""

import asyncio
import json
import os
import random
import signal
import time

import duckdb
import pytest

from dflash_assets.emulator.prefix_cache import BLOCK
from dflash_assets.fleet.fleet import connected
from dflash_assets.generation.engine import generate_shard
from dflash_assets.generation.shards import build_prompt_shard
from dflash_assets.settings import DispatchSettings, GenerationSettings
from tests.support.cli import dflash, start
from tests.support.forks import start_emulator

CONVERSATIONS = 60
ARGS = [
    "--decode-tokens-per-s",
    "1500",
    "--max-running-requests",
    "6",
    "--reasoning-parser",
    "qwen3",
    "--length-median",
    "300",
    "--length-sigma",
    "0.8",
    "--enable-cache-report",
]
CAP = 1200


def generate_command(data_dir, urls) -> tuple[str, ...]:
    """`dflash generate` of the shard, all turns, with small commits: what the kill -9 test kills and resumes."""
    return (
        "generate",
        "--shard",
        "00000",
        "--urls",
        ",".join(urls),
        "--data-dir",
        str(data_dir),
        "--max-output-tokens",
        str(CAP),
        "--regenerate",
        "all_turns",
        "--commit-rows",
        "3",
        "--commit-seconds",
        "0.2",
        "--load-sample-s",
        "0",
    )


def conversation(i: int) -> dict:
    turns = [{"from": "system", "value": "You are a patient tutor."}] if i % 2 else []
    for k in range(1, 4):
        turns += [
            {"from": "human", "value": f"Conversation {i}, question {k}: explain step {k} of topic {i % 7}."},
            {"from": "gpt", "value": f"The source's own answer {k}, which all_turns replaces."},
        ]
    return {"id": f"c{i:03d}", "conversations": turns}


@pytest.fixture(scope="module")
def fleet_args():
    return ARGS


def build(data_dir, urls, records) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    src = data_dir.parent / f"{data_dir.name}.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))

    async def go():
        async with connected(urls) as fleet:
            await build_prompt_shard(src, 0, "00000", len(records), data_dir, fleet, {"enable_thinking": True})

    asyncio.run(go())


def generate(data_dir, urls, cap=CAP):
    async def go():
        async with connected(urls) as fleet:
            return await generate_shard(
                data_dir,
                "00000",
                fleet,
                GenerationSettings(max_output_tokens=cap, regenerate="all_turns"),
                DispatchSettings(load_sample_s=0),
                log=lambda m: None,
            )

    return asyncio.run(go())


def turn_rows(data_dir) -> list[tuple]:
    for _ in range(20):  # a run's final compaction may delete a part between the listing and the read: read again
        if not list((data_dir / "completions").glob("**/*.parquet")):
            return []
        try:
            return duckdb.sql(
                f"select prompt_id, turn, turns, finish_reason, prompt_tokens, content from "
                f"read_parquet('{data_dir}/completions/**/*.parquet', union_by_name = true) "
                f"order by all"
            ).fetchall()
        except duckdb.IOException:
            time.sleep(0.05)
    raise AssertionError("the completions could not be read")


@pytest.fixture(scope="module")
def clean(tmp_path_factory, fleet_urls):
    data = tmp_path_factory.mktemp("clean") / "data"
    build(data, fleet_urls, [conversation(i) for i in range(CONVERSATIONS)])
    run = generate(data, fleet_urls)
    return data, run, turn_rows(data)


def test_every_turn_is_regenerated_in_order_on_the_regenerated_history(clean, fleet_urls):
    data, run, rows = clean
    assert (run.prompts, run.completed, run.rejected, run.failed) == (CONVERSATIONS, CONVERSATIONS, 0, 0)
    by_conversation: dict[str, list[tuple]] = {}
    for r in rows:
        by_conversation.setdefault(r[0], []).append(r)
    cut = {pid: rs[-1][1] for pid, rs in by_conversation.items() if rs[-1][3] == "length"}
    assert 0 < len(cut) < CONVERSATIONS, "the cap should cut some turns (the data must exercise truncation)"
    assert run.truncated_at == cut
    for rs in by_conversation.values():
        turns = [r[1] for r in rs]
        assert turns == list(range(1, len(rs) + 1)) and {r[2] for r in rs} == {3}  # each turn once, in order
        assert len(rs) == 3 or rs[-1][3] == "length"  # a conversation stops only at a cut turn
        assert all(r[3] == "stop" for r in rs[:-1])
        assert all("source's own answer" not in r[5] for r in rs)
    # turn k's prompt is the history with the regenerated answers (content only, no reasoning): recount it
    sample = [rs for rs in by_conversation.values() if len(rs) == 3][:3]
    source = {conversation(i)["id"]: conversation(i) for i in range(CONVERSATIONS)}

    async def recount():
        async with connected(fleet_urls) as fleet:
            out = []
            for rs in sample:
                turns = source[rs[0][0]]["conversations"]
                system = [{"role": "system", "content": t["value"]} for t in turns if t["from"] == "system"]
                users = [{"role": "user", "content": t["value"]} for t in turns if t["from"] == "human"]
                messages = system + [users[0]]
                for k in range(3):
                    out.append(
                        (await fleet.clients[0].count_prompt_tokens(messages, {"enable_thinking": True}), rs[k][4])
                    )
                    if k < 2:
                        messages = messages + [{"role": "assistant", "content": rs[k][5]}, users[k + 1]]
            return out

    counted = asyncio.run(recount())
    assert [expected for expected, _ in counted] == [served for _, served in counted]
    assert run.by_turn[1]["rows"] == CONVERSATIONS and run.by_turn[3]["rows"] == CONVERSATIONS - len(cut)
    # a follow-up turn on the server of the turn before finds that turn's prompt in the prefix cache
    served = duckdb.sql(
        f"select prompt_id, turn, server_url, prompt_tokens, cached_tokens from read_parquet("
        f"'{data}/completions/**/*.parquet') order by all"
    ).fetchall()
    previous = {(pid, turn): (url, tokens) for pid, turn, url, tokens, _ in served}
    same = [
        (cached, previous[(pid, turn - 1)][1])
        for pid, turn, url, _, cached in served
        if turn > 1 and previous[(pid, turn - 1)][0] == url
    ]
    assert len(same) > len(served) // 2, "most follow-ups should stay on their server"
    assert all(cached > before - 5 - BLOCK for cached, before in same)  # the emulator matches whole blocks
    assert sum(v["truncated"] for v in run.by_turn.values()) == len(cut)


def test_kill_9_mid_conversation_keeps_every_turn_exactly_once_with_the_same_histories(tmp_path, clean, fleet_urls):
    data = tmp_path / "data"
    build(data, fleet_urls, [conversation(i) for i in range(CONVERSATIONS)])
    rng = random.Random(15)
    committed, mid_conversation = [], 0
    for _ in range(4):
        before = len(turn_rows(data))
        proc = start(*generate_command(data, fleet_urls), out=tmp_path / "killed.txt")
        # every kill lands after this run committed something (not on a timer: a fast or a loaded machine alike)
        while len(turn_rows(data)) == before and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 0.4))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        now = turn_rows(data)
        keys = [(r[0], r[1]) for r in now]
        assert len(keys) == len(set(keys)), "a kill -9 left a turn twice"
        turns_of: dict[str, list[int]] = {}
        for pid, turn in keys:
            turns_of.setdefault(pid, []).append(turn)
        assert all(ts == list(range(1, len(ts) + 1)) for ts in turns_of.values()), (
            "a turn committed before its predecessor"
        )
        mid_conversation += sum(0 < len(ts) < 3 for ts in turns_of.values())
        committed.append(len(now))
    assert committed == sorted(committed) and committed[-1] < len(clean[2]), "the kills should interrupt the work"
    assert mid_conversation > 0, "some kill should land in the middle of a conversation"
    final = dflash(*generate_command(data, fleet_urls))
    assert final.returncode == 0, final.stdout + final.stderr
    assert f"{CONVERSATIONS} prompts = {CONVERSATIONS} completed + 0 rejected + 0 failed" in final.stdout
    # the same rows, turn for turn, as the uninterrupted run: the same history was sent for every turn
    assert turn_rows(data) == clean[2]


def test_a_turn_that_cannot_fit_the_context_is_rejected_with_its_numbers_and_ends_the_conversation(tmp_path):
    long_third = [
        {"role": "user", "content": "First, briefly."},
        {"role": "assistant", "content": "old"},
        {"role": "user", "content": "Second, briefly."},
        {"role": "assistant", "content": "old"},
        {"role": "user", "content": "Third: " + "a b " * 210},
    ]  # ~850 tokens: fits alone, not with the cap
    records = [{"id": "long", "messages": long_third}, {"id": "short", "messages": long_third[:3]}]
    args = [
        "--context-length",
        "1024",
        "--reasoning-parser",
        "qwen3",
        "--length-median",
        "60",
        "--length-sigma",
        "0.1",
        "--decode-tokens-per-s",
        "50000",
    ]
    with start_emulator(args) as emu:
        build(tmp_path / "data", [emu.url], records)
        run = generate(tmp_path / "data", [emu.url], cap=256)
    assert (run.prompts, run.completed, run.rejected_preflight, run.failed) == (2, 1, 1, 0)
    assert [(r[0], r[1]) for r in turn_rows(tmp_path / "data")] == [
        ("long", 1),
        ("long", 2),
        ("short", 1),
        ("short", 2),
    ]
    [(turn, stage, reason)] = duckdb.sql(
        f"select turn, stage, reason from read_parquet('{tmp_path}/data/rejects/**/*.parquet', "
        "union_by_name = true) where stage <> 'source'"
    ).fetchall()
    assert (turn, stage) == (3, "preflight")
    assert reason.startswith("turn 3 of 3: prompt of ") and "+ max_output_tokens 256 = " in reason
    assert "exceeds the server context length 1024" in reason or "input limit" in reason
    assert run.by_turn[3] == {"rows": 0, "truncated": 0, "rejected": 1, "ended_at_window": 0}
    from dflash_assets.quality import run_checks

    overflow = next(o for o in run_checks(tmp_path / "data") if o.name == "context_overflow")
    assert overflow.metadata["rejected_overflow_by_turn"] == "turn 3: 1"
    assert "overflow rejects by turn: turn 3: 1" in overflow.summary_md


def test_whole_conversations_export_in_the_trainer_format_and_the_checks_pass_per_turn(clean, tmp_path):
    from dflash_assets.generation.prompts import read_shard
    from dflash_assets.quality import export_training_set, run_checks
    from dflash_assets.quality.training.trainer_format import row_problem

    data, run, rows = clean
    export = export_training_set(data, tmp_path / "out", max_length=None, form="conversations")
    lines = [json.loads(line) for line in export.jsonl_path.read_text().splitlines()]
    whole = sorted({r[0] for r in rows} - set(run.truncated_at))
    assert [line["id"].split("@")[0] for line in lines] == whole
    # a conversation cut at turn k > 1 has kept turns before k: left out as not whole; one cut at turn 1 has none
    assert export.manifest["conversations_not_whole"] == sum(k > 1 for k in run.truncated_at.values())
    assert export.manifest["excluded"]["truncated"] == len(run.truncated_at)
    problems = [row_problem(line, expect_reasoning=True, strict_think_markers=True) for line in lines]
    assert problems == [None] * len(whole)
    answers = {(r[0], r[1]): r[5] for r in rows}
    for line in lines:
        pid = line["id"].split("@")[0]
        assistant = [m["content"] for m in line["conversations"] if m["role"] == "assistant"]
        assert assistant == [answers[(pid, k)] for k in (1, 2, 3)]
        users = [m["content"] for m in line["conversations"] if m["role"] == "user"]
        assert users == [
            f"Conversation {int(pid[1:])}, question {k}: explain step {k} of topic {int(pid[1:]) % 7}."
            for k in (1, 2, 3)
        ]
    back = list(read_shard(export.jsonl_path, 0, 1000))
    assert [(p.prompt_id, p.messages) for p in back] == [
        (line["id"], [{"role": m["role"], "content": m["content"]} for m in line["conversations"]]) for line in lines
    ]
    from dflash_assets.quality import length_quality

    report = length_quality(data)
    assert [(t["turn"], t["rows"], t["truncated_rows"]) for t in report["by_turn"]] == [
        (k, run.by_turn[k]["rows"], run.by_turn[k]["truncated"]) for k in (1, 2, 3)
    ]
    assert all(t["p50"] <= t["p90"] <= t["p99"] <= t["max"] for t in report["by_turn"])
    outcomes = {o.name: o for o in run_checks(data)}
    assert outcomes["duplicates"].passed and outcomes["accounting"].passed, (
        outcomes["duplicates"].summary_md,
        outcomes["accounting"].summary_md,
    )


def test_the_cap_plan_shows_each_turn_index_with_its_share_cut_and_percentiles(clean):
    from dflash_assets.quality.planning.planner import plan_caps
    from dflash_assets.quality.report.cap_plan import plan_markdown

    data, run, _ = clean
    plan = plan_caps(data, bootstrap=0)
    tokens = duckdb.sql(
        f"select turn, completion_tokens, finish_reason from read_parquet("
        f"'{data}/completions/**/*.parquet') where finish_reason in ('stop', 'length')"
    ).fetchall()

    def rank(values, q):  # nearest rank: the value at 1-based rank ceil(q * n)
        return sorted(values)[-(-len(values) * int(q * 100) // 100) - 1]

    expected = []
    for k in (1, 2, 3):
        values = [t for turn, t, _ in tokens if turn == k]
        cut = sum(f == "length" for turn, _, f in tokens if turn == k)
        assert (len(values), cut) == (run.by_turn[k]["rows"], run.by_turn[k]["truncated"])
        expected.append(
            (k, len(values), cut, cut / len(values), rank(values, 0.5), rank(values, 0.9), rank(values, 0.99))
        )
    assert [(t.turn, t.rows, t.truncated, t.truncation_rate, t.p50, t.p90, t.p99) for t in plan.by_turn] == expected
    assert sum(t.truncated for t in plan.by_turn) == plan.truncated > 0  # the cap cuts some turns at CAP
    md = plan_markdown(plan)
    assert f"By turn (all_turns), at cap {CAP:,}:" in md
    t1 = plan.by_turn[0]
    assert f"| 1 | {t1.rows} | {t1.truncation_rate * 100:.2f}% | {t1.p50:,} | {t1.p90:,} | {t1.p99:,} |" in md


def test_a_sharegpt_dump_through_dagster_all_turns_with_its_format_and_per_turn_figures(tmp_path):
    """The Dagster layer: the detected format in prompt_shards' metadata, a lone-surrogate line rejected while
    the shard goes on, `regenerate: all_turns` from run config, by_turn in completions' and the report's metadata."""
    import dagster as dg

    from dflash_assets.defs.partitions import shard_partitions
    from dflash_assets.defs.quality.assets import length_quality_summary
    from dflash_assets.defs.resources import QualityResource
    from tests.support import dagster_run
    from tests.support.dagster_run import resources, run_shard
    from tests.support.shards import FAST

    lines = [json.dumps(conversation(i)) for i in range(6)]
    lines.insert(2, '{"id": "broken", "conversations": [{"from": "human", "value": "emoji \\ud83d"}]}')
    (tmp_path / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    with start_emulator(FAST) as emu, dagster_run.instance() as instance:
        instance.add_dynamic_partitions(shard_partitions.name, ["00000"])
        # a window no turn's history fills: every turn is sent (a later turn filling it would end its conversation)
        res = resources(tmp_path, emu.url, shard_size=7) | {"quality": QualityResource(trainer={"max_length": 32768})}
        result = run_shard(instance, res, "00000", cap=16000, regenerate="all_turns")
        summary = (
            dg.materialize(
                [length_quality_summary], instance=instance, resources=res, selection=[length_quality_summary]
            )
            .asset_materializations_for_node("length_quality_summary")[0]
            .metadata
        )
    assert result.success
    shard_meta = result.asset_materializations_for_node("prompt_shards")[0].metadata
    assert (shard_meta["lines"].value, shard_meta["prompts"].value, shard_meta["rejected"].value) == (7, 6, 1)
    assert shard_meta["format"].value == "sharegpt" and shard_meta["prompts_by_format"].value == {"sharegpt": 6}
    meta = result.asset_materializations_for_node("completions")[0].metadata
    assert meta["accounting"].value == "6 prompts = 6 completed + 0 rejected + 0 failed"
    assert meta["dagster/row_count"].value == 18
    assert meta["by_turn"].value == {
        str(k): {"rows": 6, "truncated": 0, "rejected": 0, "ended_at_window": 0} for k in (1, 2, 3)
    }
    assert len(turn_rows(tmp_path / "data")) == 18
    report = result.asset_materializations_for_node("length_quality_report")[0].metadata
    assert "| 3 |" in report["by_turn"].value
    by_turn = summary["cap_plan_by_turn"].value  # the cap plan's by-turn view: 6 rows a turn, none cut at 16000
    assert [line[:17] for line in by_turn.splitlines() if line[:2] == "| " and line[2].isdigit()] == [
        f"| {k} | 6 | 0.00% |" for k in (1, 2, 3)
    ]
    assert "By turn (all_turns), at cap 16,000:" in summary["cap_plan"].value
    checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
    assert checks["duplicates"] and checks["accounting"] and checks["context_overflow"], checks


def test_when_first_turns_do_not_fit_the_run_fails_before_anything_is_sent(tmp_path):
    from dflash_assets.generation.preflight import PreflightError

    args = ["--context-length", "1024", "--reasoning-parser", "qwen3", "--decode-tokens-per-s", "50000"]
    with start_emulator(args) as emu:
        build(tmp_path / "data", [emu.url], [conversation(i) for i in range(5)])
        with pytest.raises(
            PreflightError,
            match=r"5 of 5 prompts do not fit: the servers' context length is 1024 "
            r"tokens and max_output_tokens is 1000",
        ) as err:
            generate(tmp_path / "data", [emu.url], cap=1000)
        assert "Nothing was sent." in str(err.value)
        served = duckdb.sql(
            f"select count(*) from read_parquet('{tmp_path}/data/prompt_shards/**/*.parquet')"
        ).fetchall()[0][0]
    assert served == 5 and not list((tmp_path / "data" / "completions").glob("**/*.parquet"))
