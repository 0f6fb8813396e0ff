"""Repeats in a prompt source, found before generation across shards: a source with planted exact and near repeats,
every planted repeat rejected (naming the line it repeats), no other prompt dropped, whatever order the shards are
built in; kept and counted with keep_repeats."""

from __future__ import annotations

import random

import pytest

from dflash_assets.fleet.fleet import on_fleet
from dflash_assets.generation.shards import SourceRules, build_prompt_shard
from dflash_assets.settings import RepeatSettings
from dflash_assets.store.stores import prompt_store, reject_store
from tests.support.shards import FAST, write_prompts

pytestmark = pytest.mark.timeout(120)

SHARD_SIZE, SHARDS = 25, 4
WORDS = [f"{a}{b}" for a in ("ka", "lo", "mi", "nu", "pe", "ra", "su", "te", "vo", "zu") for b in range(60)]


def planted_source(rng: random.Random) -> tuple[list[dict], dict[int, int]]:
    """100 lines: distinct prompts, and planted repeats {line: the line it repeats} (1-based), some across shards."""
    texts = [" ".join(rng.choice(WORDS) for _ in range(80)) for _ in range(100)]
    # a hard negative: half of line 5's text, half new: similar, not a repeat
    texts[70] = " ".join(texts[4].split()[:40] + [rng.choice(WORDS) for _ in range(40)])
    records = [{"id": f"p{i:03d}", "prompt": t} for i, t in enumerate(texts)]
    planted = {}

    def plant(line: int, of: int, text: str, messages: list[dict] | None = None) -> None:
        records[line - 1] = {"id": f"r{line:03d}", **({"messages": messages} if messages else {"prompt": text})}
        planted[line] = of

    base = records[2]["prompt"]
    plant(9, 3, base)  # exact, same shard
    plant(60, 3, base)  # exact, another shard
    plant(40, 12, records[11]["prompt"].upper().replace(" ", "  ") + "!")  # case, spacing, punctuation
    words = records[20]["prompt"].split()
    plant(88, 21, " ".join(words[:50] + ["zz"] + words[51:]))  # one word of 80 replaced
    plant(95, 33, records[32]["prompt"] + " " + rng.choice(WORDS))  # one word added
    plant(97, 3, base + " thanks")  # near line 3 (the first of it, not its exact repeat on line 60)
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": records[49]["prompt"]}]
    records[49] = {"id": "p049", "messages": convo}
    plant(99, 50, "", messages=convo)  # the same conversation, system turn included
    return records, planted


def build_all(data, url, source, settings: RepeatSettings, order) -> dict[str, int]:
    async def go(fleet):
        built = {}
        for i in order:
            shard = f"{i:05d}"
            b = await build_prompt_shard(
                source, i, shard, SHARD_SIZE, data, fleet, {"enable_thinking": True}, SourceRules(repeats=settings)
            )
            built[shard] = b.repeats
        return built

    return on_fleet([url], go)


def rejected(data) -> dict[int, str]:
    found = {}
    for i in range(SHARDS):
        table = reject_store(data, f"{i:05d}", "source").read(["line", "reason"])
        found |= dict(zip(table["line"].to_pylist(), table["reason"].to_pylist(), strict=True))
    return found


def kept_lines(data) -> set[int]:
    return {line for i in range(SHARDS) for line in prompt_store(data, f"{i:05d}").read(["line"])["line"].to_pylist()}


@pytest.mark.parametrize("order", [range(SHARDS), reversed(range(SHARDS))], ids=["in order", "last shard first"])
def test_every_planted_repeat_is_found_and_no_other_prompt_is_dropped(tmp_path, emulator, order):
    records, planted = planted_source(random.Random(5))
    source = write_prompts(tmp_path / "prompts.jsonl", records)
    data = tmp_path / "data"
    counts = build_all(data, emulator(*FAST).emu.url, source, RepeatSettings(), list(order))
    reasons = rejected(data)
    assert set(reasons) == set(planted)
    for line, first in planted.items():
        assert reasons[line].startswith(f"line {line}: ") and f" repeat of line {first} " in reasons[line]
    assert "exact repeat of line 3 (the same conversation)" in reasons[60]
    assert "near repeat of line 12 (word-shingle similarity" in reasons[40]
    assert "exact repeat of line 50" in reasons[99]
    assert kept_lines(data) == set(range(1, 101)) - set(planted)
    assert sum(counts.values()) == len(planted)


def test_kept_repeats_are_sent_and_counted(tmp_path, emulator):
    records, planted = planted_source(random.Random(5))
    source = write_prompts(tmp_path / "prompts.jsonl", records)
    data = tmp_path / "data"
    counts = build_all(data, emulator(*FAST).emu.url, source, RepeatSettings(keep_repeats=True), range(SHARDS))
    assert rejected(data) == {} and kept_lines(data) == set(range(1, 101))
    assert counts == {
        f"{i:05d}": sum(1 for line in planted if i * SHARD_SIZE < line <= (i + 1) * SHARD_SIZE) for i in range(SHARDS)
    }


@pytest.mark.parametrize("second_id", ["p1", "p2"], ids=["the id of line 1 again", "an id of its own"])
def test_a_line_whose_id_an_earlier_line_has_is_left_out_of_the_repeats(second_id):
    """A line with an earlier line's id is no prompt (its shard rejects it), so the repeats pass leaves it out
    (found by a hash of the ids, not a dict of every id of the source): the next line with its text is the first of
    that text, and a near copy repeats that one."""
    from dflash_assets.generation.dedupe import find_repeats
    from dflash_assets.generation.prompts import Prompt

    rng = random.Random(7)
    one, two = (" ".join(rng.choice(WORDS) for _ in range(80)) for _ in range(2))
    texts = [("p1", one), (second_id, two), ("p3", two), ("p4", two + " thanks")]
    prompts = [Prompt(i, pid, "s", [{"role": "user", "content": t}]) for i, (pid, t) in enumerate(texts, 1)]
    found = [(r.line, r.first_line, r.kind) for r in find_repeats(prompts, RepeatSettings())]
    first = 3 if second_id == "p1" else 2
    assert found == ([] if first == 3 else [(3, 2, "exact")]) + [(4, first, "near")]
