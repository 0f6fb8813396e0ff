"""Every sample the trainer would keep, and none it would drop (issue 43, the export): the demo's prompts under the
window policy at L = 2048 (all_turns, as regenerate auto makes it for them), on real emulator servers, real Parquet,
the real export, judged by copies of SpecForge's own code (tests/support/specforge.py)."""

import asyncio
import json
from collections import Counter
from datetime import timedelta
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest
import yaml

from dflash_assets.fleet.fleet import connected
from dflash_assets.generation.engine import generate_shard
from dflash_assets.generation.shards import build_prompt_shard
from dflash_assets.quality import export_training_set
from dflash_assets.rules import trained_tokens
from dflash_assets.settings import DEMO_PROMPTS, DispatchSettings, GenerationSettings
from tests.support import specforge, specforge_preprocessing
from tests.support.docs import written_by_this_run
from tests.support.forks import start_emulator
from tests.support.quality_data import CONFIG_A, T0, completion, write

L = 2048
ARGS = ["--reasoning-parser", "qwen3", "--decode-tokens-per-s", "0", "--random-seed", "5"]


def run_demo(data, settings: GenerationSettings, lines: int = 1000) -> None:
    """The demo's first `lines` prompts (all of them by default) generated into `data` on two emulator servers."""
    data.mkdir()
    with start_emulator(ARGS) as a, start_emulator(ARGS) as b:

        async def go():
            async with connected([a.url, b.url]) as fleet:
                await build_prompt_shard(DEMO_PROMPTS, 0, "00000", lines, data, fleet, {"enable_thinking": True})
                return await generate_shard(
                    data,
                    "00000",
                    fleet,
                    settings,
                    DispatchSettings(load_sample_s=0, commit_rows=64),
                    log=lambda m: None,
                )

        run = asyncio.run(go())
    assert not run.failed


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo's prompts, every assistant turn regenerated under the window policy at L = 2048, cap 16384."""
    data = tmp_path_factory.mktemp("demo") / "data"
    run_demo(
        data,
        GenerationSettings(max_output_tokens=16384, cap_policy="window", trainer_max_length=L, regenerate="all_turns"),
    )
    return data


@pytest.fixture(scope="module")
def exports(demo, tmp_path_factory):
    out = tmp_path_factory.mktemp("exports")
    return {
        form: export_training_set(demo, out / form, max_length=L, form=form)
        for form in ("auto", "conversations", "pretokenized")
    }


def rows(data) -> list[dict]:
    return (
        duckdb.sql(
            f"select prompt_id, turn, turns, finish_reason, prompt_tokens, completion_tokens from "
            f"read_parquet('{data}/completions/**/*.parquet', union_by_name = true) order by prompt_id, turn"
        )
        .to_arrow_table()
        .to_pylist()
    )


def lines(export) -> list[dict]:
    return [json.loads(line) for line in export.jsonl_path.read_text(encoding="utf-8").splitlines()]


def test_the_default_form_of_all_turns_under_qwen35_is_per_turn_with_train_only_last_turn(exports):
    export = exports["auto"]
    assert export.manifest["form"] == "per_turn"
    assert "drops earlier turns' reasoning" in export.manifest["form_chosen"]
    yaml = (export.manifest_path.parent / "specforge_data.yaml").read_text()
    assert "  train_only_last_turn: true\n" in yaml and '  chat_template: "qwen3.5"\n' in yaml


def test_every_conversation_with_a_trainable_first_turn_is_exported_up_to_its_last_generated_turn(demo, exports):
    by_prompt: dict[str, list[dict]] = {}
    for r in rows(demo):
        by_prompt.setdefault(r["prompt_id"], []).append(r)
    trainable = {
        p for p, rs in by_prompt.items() if trained_tokens(rs[0]["prompt_tokens"], rs[0]["completion_tokens"], L) >= 2
    }
    # window-complete: its last generated turn was cut at the window, or the next one's history fills it
    ended = Counter(
        len(rs) for rs in by_prompt.values() if rs[-1]["finish_reason"] == "length" or len(rs) < rs[0]["turns"]
    )
    assert any(k > 1 for k in ended), "some multi-turn conversations end at a later turn"
    conversations = {line["id"].split("@")[0]: line for line in lines(exports["conversations"])}
    assert set(conversations) == trainable
    for pid, line in conversations.items():
        assert sum(m["role"] == "assistant" for m in line["conversations"]) == len(by_prompt[pid])
    manifest = exports["conversations"].manifest
    assert manifest["conversations_not_whole"] == 0 and manifest["conversations"]["left_out"] == []
    assert manifest["conversations"]["window_complete"] == {f"ended at turn {k}": n for k, n in sorted(ended.items())}
    # every form holds the same conversations, turn for turn; the kept counts are the rows written
    events = Counter(line["source_id"].split("@")[0] for line in lines(exports["auto"]))
    samples = Counter(line["id"].split("@")[0] for line in lines(exports["pretokenized"]))
    assert events == samples == {pid: len(by_prompt[pid]) for pid in conversations}
    for export in exports.values():
        kept = sum(c["rows"] for c in export.manifest["rows_by_config"].values())
        assert kept == sum(events.values()) == sum(export.manifest["rows_by_source"].values())


def test_decoded_per_trained_token_is_at_most_1_01_in_the_default_form_and_pretokenized(demo, exports):
    decoded = sum(r["completion_tokens"] for r in rows(demo))
    # the default form trains each event's own turn (train_only_last_turn) up to the window: its row's tokens
    per_turn = pq.read_table(exports["auto"].parquet_path).to_pylist()
    trained_per_turn = sum(trained_tokens(r["prompt_tokens"], r["completion_tokens"], L) for r in per_turn)
    trained_ids = sum(sum(line["loss_mask"]) for line in lines(exports["pretokenized"]))
    assert trained_per_turn == trained_ids
    assert decoded / trained_per_turn <= 1.01, decoded / trained_per_turn
    assert decoded / trained_ids <= 1.01, decoded / trained_ids
    conversations = len({r["prompt_id"] for r in rows(demo)})
    written_by_this_run(
        DOC,
        DOC_MARK + "\n",
        "\n\n",
        f"The demo's prompts ({conversations:,} conversations, every turn regenerated) under the window policy at "
        f"L = {L:,}, cap 16,384:\ndecoded {decoded:,} tokens, trained {trained_ids:,} (per_turn and pretokenized "
        f"alike): {decoded / trained_ids:.4f} decoded per trained token.",
    )


DOC = Path(__file__).resolve().parents[3] / "docs" / "trainer-window.md"
DOC_MARK = "<!-- tests/quality/training/test_conversation_export.py's demo run writes this (DFLASH_WRITE_DOCS=1) -->"


def test_specforges_expand_reasoning_conversations_on_our_conversations_export_is_our_per_turn_export(exports):
    expanded, skipped = specforge.expand_file(exports["conversations"].jsonl_path)
    assert skipped == 0
    ours = exports["auto"].jsonl_path.read_text(encoding="utf-8").splitlines()
    assert len(ours) > len(lines(exports["conversations"]))  # multi-turn conversations give several events
    assert ours == expanded


def test_every_pretokenized_sample_passes_specforges_has_consecutive_supervised_tokens(exports):
    samples = lines(exports["pretokenized"])
    assert samples and all(specforge.has_consecutive_supervised_tokens(s["loss_mask"]) for s in samples)
    assert all(len(s["input_ids"]) <= L for s in samples)


def trained_text(export, conversations: list[dict]) -> str:
    """What SpecForge's preprocess_conversations puts loss on in one row, with the template and train_only_last_turn
    written beside the export (one token a character, so the masked tokens decode to the trained text; the char
    window is unbounded: the token window is the export's, tested above)."""
    data = yaml.safe_load((export.manifest_path.parent / "specforge_data.yaml").read_text())["data"]
    tokenizer = specforge_preprocessing.CharTokenizer()
    out = specforge_preprocessing.preprocess_conversations(
        tokenizer,
        [conversations],
        specforge_preprocessing.TEMPLATES[data["chat_template"]],
        max_length=10**9,
        train_only_last_turn=data.get("train_only_last_turn", False),
    )
    ids, mask = out["input_ids"][0][0], out["loss_mask"][0][0]
    return tokenizer.decode([i for i, m in zip(ids, mask) if m])


def turn_text(message: dict) -> str:
    """An assistant turn as the trainer trains it after the qwen3.5 header (`<|im_start|>assistant\\n<think>\\n`):
    its reasoning, `</think>`, its answer and the end of turn, rendered as Qwen3's template does."""
    reasoning, content = message.get("reasoning_content") or "", message["content"]
    return f"{reasoning.strip(chr(10))}\n</think>\n\n{content.lstrip(chr(10))}<|im_end|>\n"


def test_specforges_preprocess_conversations_trains_every_assistant_turn_of_the_default_export(exports):
    """The default all_turns form (per_turn): each row's own turn is all its loss, reasoning and answer, so every
    assistant turn of every exported conversation is trained, once."""
    export = exports["auto"]
    assert export.manifest["form"] == "per_turn"
    trained: dict[str, list[str]] = {}
    for event in lines(export):
        trained.setdefault(event["source_id"], []).append(trained_text(export, event["conversations"]))
    conversations = {line["id"]: line["conversations"] for line in lines(exports["conversations"])}
    assert any(sum(m["role"] == "assistant" for m in c) > 1 for c in conversations.values())
    assert trained == {i: [turn_text(m) for m in c if m["role"] == "assistant"] for i, c in conversations.items()}


def test_specforge_trains_only_the_last_turn_of_a_conversations_row_which_is_why_per_turn_is_the_default(exports):
    export = exports["conversations"]
    rows = [line["conversations"] for line in lines(export)]
    answers = [[m for m in row if m["role"] == "assistant"] for row in rows]
    untrained = sum(len(a) - 1 for a in answers)
    assert untrained > 0  # earlier turns exist, and every one of them is left untrained
    for row, a in zip(rows, answers):
        assert trained_text(export, row) == turn_text(a[-1])


def test_at_cap_4096_with_a_4096_window_95_percent_of_the_prompts_leaving_a_trainable_token_are_exported(
    tmp_path_factory,
):
    """The fixed cap at the trainer's window (regenerate as auto makes it for the demo): a turn cut at the cap is cut
    past the window, so its conversation is exported up to it; only a turn cut inside the window or failed keeps
    one out."""
    window = 4096
    data = tmp_path_factory.mktemp("cap4096") / "data"
    run_demo(data, GenerationSettings(max_output_tokens=window, trainer_max_length=window, regenerate="all_turns"))
    first = [r for r in rows(data) if r["turn"] == 1]
    trainable = {
        r["prompt_id"] for r in first if trained_tokens(r["prompt_tokens"], r["completion_tokens"], window) >= 2
    }
    export = export_training_set(data, tmp_path_factory.mktemp("cap4096_out"), max_length=window)
    assert export.manifest["form"] == "per_turn"
    exported = {line["source_id"].split("@")[0] for line in lines(export)}
    assert exported <= trainable
    assert len(trainable) > 300 and len(exported) >= 0.95 * len(trainable), (len(exported), len(trainable))


# ---- each ending, forced: rows written as the engine writes them, judged at a window of W tokens ------------------
W = 64


def chat(pid: str, users: int) -> dict:
    messages = [m for k in range(1, users + 1) for m in ({"role": "user", "content": f"{pid} question {k}"},)]
    return dict(
        prompt_id=pid,
        shard="00000",
        line=int(pid[1:]) + 1,
        source="chat",
        messages_json=json.dumps(messages),
        prompt_tokens=None,
        template_kwargs_json="{}",
    )


def turn(p: dict, k: int, turns: int, prompt_tokens: int, completion_tokens: int, finish: str = "stop") -> dict:
    return completion(
        p | {"prompt_tokens": prompt_tokens},
        CONFIG_A,
        completion_tokens,
        finish,
        content=f"answer {k}",
        turn=k,
        turns=turns,
        prompt_token_ids=list(range(prompt_tokens)),
        output_ids=[7] * completion_tokens,
        created_at=T0 + timedelta(seconds=10 * p["line"] + k),
    )


@pytest.fixture(scope="module")
def endings(tmp_path_factory):
    """p0: one token of room; p1: turn 2 of 3 cut past the window; p2: turn 2 cut inside it; p3: turn 2 failed;
    p4: turn 2's history leaves one token of room (sent under a fixed cap)."""
    data = tmp_path_factory.mktemp("endings") / "data"
    p = [chat(f"p{i}", 3 if i in (1, 2) else 2 if i in (3, 4) else 1) for i in range(5)]
    write(data, "prompt_shards", "00000", p)
    write(
        data,
        "completions",
        "00000",
        [
            turn(p[0], 1, 1, W - 1, 17, "length"),
            turn(p[1], 1, 3, 10, 20),
            turn(p[1], 2, 3, 40, 30, "length"),
            turn(p[2], 1, 3, 10, 20),
            turn(p[2], 2, 3, 40, 10, "length"),
            turn(p[3], 1, 2, 10, 20),
            turn(p[4], 1, 2, 10, 50),
            turn(p[4], 2, 2, W - 1, 5),
        ],
    )
    write(
        data,
        "failures",
        "00000",
        [
            dict(
                shard="00000",
                prompt_id="p3",
                config_hash=CONFIG_A["config_hash"],
                error="retries ran out",
                attempts=3,
                created_at=T0,
                turn=2,
            )
        ],
    )
    out = tmp_path_factory.mktemp("endings_out")
    return {
        form: export_training_set(data, out / form, max_length=W, form=form)
        for form in ("conversations", "per_turn", "pretokenized")
    }


def test_a_prompt_leaving_one_token_of_room_is_not_exported_in_any_form_and_is_counted(endings):
    for export in endings.values():
        assert not any(line["id"].startswith("p0@") for line in lines(export))
        assert export.manifest["excluded"]["too_few_loss_tokens"] == 2  # p0, and p4's turn 2
        assert export.manifest["min_loss_tokens"] == 2
    assert all(specforge.has_consecutive_supervised_tokens(s["loss_mask"]) for s in lines(endings["pretokenized"]))


def test_each_conversation_ends_where_the_trainer_stops_reading_and_only_a_bad_turn_keeps_it_out(endings):
    conversations = {line["id"].split("@")[0]: line for line in lines(endings["conversations"])}
    assert {
        pid: [m["content"] for m in c["conversations"] if m["role"] == "assistant"] for pid, c in conversations.items()
    } == {"p1": ["answer 1", "answer 2"], "p4": ["answer 1"]}
    assert [line["id"].split("@")[0] + "#" + line["id"].split("#")[1] for line in lines(endings["per_turn"])] == [
        "p1#turn0",
        "p1#turn1",
        "p4#turn0",
    ]
    assert [line["id"].split("@")[0] + "#" + line["id"].split("#")[1] for line in lines(endings["pretokenized"])] == [
        "p1#1",
        "p1#2",
        "p4#1",
    ]
    for export in endings.values():
        m = export.manifest
        assert m["conversations"]["window_complete"] == {"ended at turn 1": 1, "ended at turn 2": 1}
        assert m["conversations"]["left_out"] == [
            {"turn": 2, "why": "failed", "conversations": 1},
            {"turn": 2, "why": "truncated", "conversations": 1},
        ]
        assert m["conversations_not_whole"] == 2
        assert (m["excluded"]["truncated"], m["excluded"]["conversation_not_whole"]) == (1, 2)  # p2 t2; p2 t1, p3 t1
        assert sum(c["rows"] for c in m["rows_by_config"].values()) == 3 == m["window_complete_kept"] + 2
