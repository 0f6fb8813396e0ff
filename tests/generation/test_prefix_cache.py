"""Follow-up turns and the servers' prefix cache: the emulator models SGLang's radix cache (cached_tokens,
prefill only for uncached tokens), the slot picker keeps a conversation on its server within a bounded
imbalance, and every all_turns row records cached_tokens."""

import ast
import asyncio
import importlib.util
from pathlib import Path

from dflash_assets.emulator.prefix_cache import BLOCK
from dflash_assets.fleet.client import ServerInfo
from dflash_assets.generation.slots import SlotPicker
from dflash_assets.settings import DispatchSettings

# the wheel's files, found without importing sglang (which would pull torch)
OPENAI = Path(next(iter(importlib.util.find_spec("sglang").submodule_search_locations))) / "srt/entrypoints/openai"


def test_sglang_reports_the_prefix_cache_hit_as_cached_tokens_in_prompt_tokens_details():
    """What the emulator mimics, read from the 0.5.23 wheel: usage.prompt_tokens_details.cached_tokens is the
    meta_info cached_tokens, only with --enable-cache-report."""
    source = (OPENAI / "usage_processor.py").read_text()
    assert 'responses[i]["meta_info"].get("cached_tokens", 0)' in source
    assert "if enable_cache_report:" in source
    tree = ast.parse((OPENAI / "protocol.py").read_text())
    details = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PromptTokensDetails")
    assert "cached_tokens" in [t.target.id for t in details.body if isinstance(t, ast.AnnAssign)]


def chat(http, messages):
    status, body = http.post("/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 64})
    assert status == 200, body
    return body


def test_the_emulator_serves_a_repeated_prefix_from_its_cache_and_prefills_only_the_rest(emulator):
    http = emulator("--enable-cache-report", "--reasoning-parser", "qwen3", "--length-median", "40")
    turn1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a trie? " * 20}]
    first = chat(http, turn1)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    prefilled = http.get("/v1/loads")[1]["loads"][0]["total_prefill_uncached_tokens"]
    assert prefilled == first["usage"]["prompt_tokens"]
    turn2 = turn1 + [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And a radix tree?"},
    ]
    second = chat(http, turn2)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    # turn 1's prompt, up to its generation prompt, is a prefix of turn 2's (the template drops turn 1's thinking,
    # so its output is not), matched in whole blocks
    assert first["usage"]["prompt_tokens"] - 5 - BLOCK < cached <= first["usage"]["prompt_tokens"]
    assert cached % BLOCK == 0
    after = http.get("/v1/loads")[1]["loads"][0]["total_prefill_uncached_tokens"]
    assert after - prefilled == second["usage"]["prompt_tokens"] - cached


def test_without_the_radix_cache_nothing_is_cached(emulator):
    http = emulator("--enable-cache-report", "--disable-radix-cache")
    messages = [{"role": "user", "content": "same prompt twice"}]
    chat(http, messages)
    assert chat(http, messages)["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def picker(max_imbalance: float) -> SlotPicker:
    infos = [
        ServerInfo(
            url=u,
            model="m",
            context_length=4096,
            max_req_input_len=4090,
            max_running_requests=8,
            max_total_num_tokens=100_000,
        )
        for u in ("a", "b")
    ]
    dispatch = DispatchSettings(waiting_margin=2, same_server_max_imbalance=max_imbalance)
    return SlotPicker([object(), object()], infos, dispatch)  # 10 slots each


def test_a_follow_up_stays_on_its_server_unless_that_server_is_clearly_busier():
    async def go():
        slots = picker(0.25)
        first = [(await slots.acquire()).url for _ in range(2)]  # least loaded: one each
        # preferring a: a at 1/10, 2/10, 3/10 against b at 1/10 is within 0.25; at 4/10 it is 0.3 busier: b
        follow_ups = [(await slots.acquire("a")).url for _ in range(4)]
        never = await picker(-1).acquire("b")  # a negative bound: always the least loaded (a, on a tie)
        return first, follow_ups, never.url

    first, follow_ups, never = asyncio.run(go())
    assert first == ["a", "b"] and follow_ups == ["a", "a", "a", "b"] and never == "a"
