"""Quotas by source, drawn in prompt_shards: a count of one source and a share of another, the prompts drawn by the
seeded hash of their id whatever order the shards are built in, and the report's planned = generated per source."""

from __future__ import annotations

import hashlib

import pytest

from dflash_assets.fleet.fleet import on_fleet
from dflash_assets.generation.engine import generate_shards
from dflash_assets.generation.request import GenerationRun
from dflash_assets.generation.shards import SourceRules, build_prompt_shard
from dflash_assets.quality.report.sources import SourceCount, by_source
from dflash_assets.settings import GenerationSettings, QuotaSettings, SettingsError
from dflash_assets.store.stores import prompt_store, reject_store
from tests.support.shards import FAST, SETTINGS, quiet, write_prompts

pytestmark = pytest.mark.timeout(120)

SHARD_SIZE, SHARDS = 25, 4
QUOTAS = QuotaSettings(quotas={"alpha": 10, "beta": 0.5}, quota_seed=7)


def records() -> list[dict]:
    """40 prompts of source alpha and 60 of beta, interleaved."""
    return [
        {
            "id": f"{'a' if i % 5 < 2 else 'b'}{i:03d}",
            "source": "alpha" if i % 5 < 2 else "beta",
            "prompt": f"Prompt number {i} asks about subject {i * 37 % 101} in its own words.",
        }
        for i in range(100)
    ]


def seeded_choice(source: str, count: int, seed: int) -> set[str]:
    """The rule, written out: the `count` ids of the source whose sha256 of 'seed:id' is the smallest."""
    ids = [r["id"] for r in records() if r["source"] == source]
    return set(sorted(ids, key=lambda i: hashlib.sha256(f"{seed}:{i}".encode()).digest())[:count])


def build(data, url, source, quotas: QuotaSettings, order) -> None:
    async def go(fleet):
        for i in order:
            await build_prompt_shard(
                source,
                i,
                f"{i:05d}",
                SHARD_SIZE,
                data,
                fleet,
                {"enable_thinking": True},
                SourceRules(quotas=quotas),
            )

    on_fleet([url], go)


def drawn(data) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for i in range(SHARDS):
        table = prompt_store(data, f"{i:05d}").read(["prompt_id", "source"])
        for pid, source in zip(table["prompt_id"].to_pylist(), table["source"].to_pylist(), strict=True):
            out.setdefault(source, set()).add(pid)
    return out


@pytest.mark.parametrize("order", [range(SHARDS), reversed(range(SHARDS))], ids=["in order", "last shard first"])
def test_the_shards_hold_each_sources_quota_drawn_by_the_seeded_hash(tmp_path, emulator, order):
    source = write_prompts(tmp_path / "prompts.jsonl", records())
    data = tmp_path / "data"
    build(data, emulator(*FAST).emu.url, source, QUOTAS, list(order))
    assert drawn(data) == {"alpha": seeded_choice("alpha", 10, 7), "beta": seeded_choice("beta", 30, 7)}
    reasons = [
        r
        for i in range(SHARDS)
        for r in reject_store(data, f"{i:05d}", "source").read(["reason"])["reason"].to_pylist()
    ]
    assert len(reasons) == 100 - 40
    assert sum("not drawn by the quota of source 'alpha' (10 of its 40 prompts, seed 7)" in r for r in reasons) == 30
    assert sum("not drawn by the quota of source 'beta' (30 of its 60 prompts, seed 7)" in r for r in reasons) == 30


def test_another_seed_draws_other_prompts_and_no_quota_takes_all(tmp_path, emulator):
    source = write_prompts(tmp_path / "prompts.jsonl", records())
    url = emulator(*FAST).emu.url
    build(tmp_path / "seeded", url, source, QuotaSettings(quotas={"alpha": 10}, quota_seed=8), range(SHARDS))
    got = drawn(tmp_path / "seeded")
    assert got["alpha"] == seeded_choice("alpha", 10, 8) != seeded_choice("alpha", 10, 7)
    assert len(got["beta"]) == 60  # no quota: the whole source


def test_the_report_says_planned_equals_generated_per_source(tmp_path, emulator):
    source = write_prompts(tmp_path / "prompts.jsonl", records())
    data, url = tmp_path / "data", emulator(*FAST).emu.url
    build(data, url, source, QUOTAS, range(SHARDS))
    config = GenerationSettings(max_output_tokens=2048).resolved(False)
    runs = on_fleet(
        [url],
        lambda f: generate_shards(
            data, [f"{i:05d}" for i in range(SHARDS)], f, GenerationRun(config, SETTINGS), log=quiet
        ),
    )
    assert by_source(data, runs[0].config_hash) == [SourceCount("alpha", 10, 10), SourceCount("beta", 30, 30)]


@pytest.mark.parametrize("quota", [-1, 2.5])
def test_a_quota_that_is_neither_a_count_nor_a_share_is_refused_naming_it(quota):
    with pytest.raises(SettingsError, match=rf"the quota of source 'alpha' must be a whole count .* got {quota}"):
        QuotaSettings(quotas={"alpha": quota})
