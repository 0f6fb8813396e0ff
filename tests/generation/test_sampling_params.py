"""Both routes sample alike: every sampling parameter is sent, so the model's generation_config.json fills none.

0.5.23's chat route fills temperature, top_p, top_k, min_p and repetition_penalty from generation_config.json
when a request leaves them out (protocol.py to_sampling_params); /generate uses SamplingParams' defaults.
"""

import ast
import json

import duckdb

from dflash_assets.settings import SAMPLING_PARAMS, GenerationSettings
from tests.support.sglang_wheel import sglang_srt
from tests.support.shards import cont, generate, make_shard

SGLANG = sglang_srt()
# a model whose generation_config.json asks for a repetition penalty and min_p, as several do
MODEL_DEFAULTS = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "min_p": 0.05}


def test_the_chat_route_fills_these_from_generation_config_in_0_5_23():
    tree = ast.parse((SGLANG / "entrypoints/openai/protocol.py").read_text())
    filled = {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "get_param"
        and isinstance(node.args[0], ast.Constant)
    }
    assert filled == {"temperature", "top_p", "top_k", "min_p", "repetition_penalty"}
    assert filled <= set(SAMPLING_PARAMS)


def test_fresh_and_continued_rows_are_sampled_with_the_config_on_both_routes(tmp_path, emulator):
    server = emulator(
        "--decode-tokens-per-s", "0", "--reasoning-parser", "qwen3", "--generation-config", json.dumps(MODEL_DEFAULTS)
    )
    data = tmp_path / "data"
    make_shard(data, [server.emu.url])
    config = GenerationSettings(max_output_tokens=64)
    parent = generate(data, [server.emu.url], config)
    run = cont(data, [server.emu.url], parent.config_hash, 4096)
    assert run.continued > 0
    _, stats = server.get("/_emulator/stats")
    wanted = config.sampling()
    resolved = [{k: s[k] for k in wanted} for s in stats["sampled"]]
    assert len(resolved) == 40 + run.continued
    assert all(r == wanted for r in resolved), "no request fell back to the model's or the route's defaults"
    recorded = duckdb.sql(
        f"select distinct {', '.join(SAMPLING_PARAMS)} from read_parquet('{data}/completions/**/*.parquet')"
    ).fetchall()
    assert recorded == [tuple(wanted[k] for k in SAMPLING_PARAMS)], "recorded per row, fresh and continued"


def test_every_sampling_parameter_is_in_the_config_hash():
    base = GenerationSettings(regenerate="last_turn")
    for name in SAMPLING_PARAMS:
        value = base.sampling()[name]  # a step of the setting's own type (top_k is an integer)
        changed = base.model_copy(update={name: value + (1 if isinstance(value, int) else 0.01)})
        assert changed.config_hash("m") != base.config_hash("m"), name


def test_continued_text_is_the_servers_decoding_of_the_full_output_ids(tmp_path, emulator):
    server = emulator("--decode-tokens-per-s", "0", "--reasoning-parser", "qwen3")
    data = tmp_path / "data"
    make_shard(data, [server.emu.url])
    parent = generate(data, [server.emu.url], 64)
    run = cont(data, [server.emu.url], parent.config_hash, 4096)
    rows = duckdb.sql(
        f"select output_ids, reasoning_content, content from read_parquet("
        f"'{data}/completions/**/*.parquet') where config_hash = '{run.config_hash}' "
        f"and parent_config_hash is not null and tokens_reused < completion_tokens"
    ).fetchall()
    assert len(rows) == run.continued
    for ids, reasoning, content in rows:
        _, decoded = server.post("/v1/detokenize", {"tokens": ids})
        thought, _, answer = decoded["text"].partition("</think>")
        assert (reasoning or "", content) == (thought, answer)
