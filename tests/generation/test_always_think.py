"""Templates that always open <think>: 0.5.23 forces reasoning even with enable_thinking false; so do we."""

import duckdb

from dflash_assets.settings import GenerationSettings
from tests.support.http import read_info
from tests.support.sglang_wheel import sglang_srt
from tests.support.shards import cont, generate, make_shard

SGLANG = sglang_srt()
FLAGS = ["--decode-tokens-per-s", "0", "--reasoning-parser", "qwen3", "--always-think"]
OFF = GenerationSettings(max_output_tokens=64, enable_thinking=False)


def test_0_5_23_forces_reasoning_for_a_template_that_opens_think_in_the_generation_prompt():
    detection = (SGLANG / "parser/template_detection.py").read_text()
    assert 'name="force_reasoning_pattern"' in detection
    assert r'ctx.has_pattern(r"<\|im_start\|>assistant\\n<think>\\n")' in detection
    chat = (SGLANG / "entrypoints/openai/serving_chat.py").read_text()
    assert (
        "self.template_manager.force_reasoning\n                    or self._get_reasoning_from_request(request)"
        in chat
    )


def test_the_client_reads_an_always_thinking_template_from_what_the_server_renders(emulator):
    assert read_info(emulator(*FLAGS).emu.url).always_thinks is True
    assert read_info(emulator(*FLAGS[:-1]).emu.url).always_thinks is False


def test_with_thinking_off_rows_still_reason_and_the_run_says_so(tmp_path, emulator):
    server = emulator(*FLAGS)
    data = tmp_path / "data"
    make_shard(data, [server.emu.url])
    run = generate(data, [server.emu.url], OFF)
    assert run.fleet_notes == [
        f"enable_thinking is off but the chat template of {server.emu.url} opens <think> whatever "
        f"it is told (SGLang then forces reasoning): those rows will reason anyway"
    ]
    reasoned = duckdb.sql(
        f"select count(*) filter (where reasoning_content is not null), count(*) from "
        f"read_parquet('{data}/completions/**/*.parquet')"
    ).fetchall()[0]
    assert reasoned == (40, 40)


def test_continued_rows_are_split_as_the_server_splits_them(tmp_path, emulator):
    server = emulator(*FLAGS)
    data = tmp_path / "data"
    make_shard(data, [server.emu.url])
    parent = generate(data, [server.emu.url], OFF)
    run = cont(data, [server.emu.url], parent.config_hash, 4096)
    rows = duckdb.sql(
        f"select output_ids, reasoning_content, content from read_parquet("
        f"'{data}/completions/**/*.parquet') where config_hash = '{run.config_hash}' "
        f"and tokens_reused < completion_tokens"
    ).fetchall()
    assert len(rows) == run.continued > 0
    for ids, reasoning, content in rows:
        _, decoded = server.post("/v1/detokenize", {"tokens": ids})
        thought, _, answer = decoded["text"].partition("</think>")  # forced: no opening tag in the output
        assert (reasoning, content) == (thought or None, answer)
