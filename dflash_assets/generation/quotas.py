"""Quotas by source: so many prompts of each `source` of the prompt source, drawn seeded, decided in prompt_shards.

The draw is over the whole source, not a shard: of a source's prompts (repeats left out), those whose seeded hash of
their prompt id is smallest are taken, so the same prompts are drawn whichever shard is built first, after a kill
and on another machine. A prompt not drawn is a reject of stage `source` saying so.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow as pa

from dflash_assets.generation.dedupe import source_key
from dflash_assets.generation.prompts import FieldMapping, Prompt, read_shard
from dflash_assets.rules import draw_key
from dflash_assets.settings import QuotaSettings
from dflash_assets.store.storage import Storage, open_storage

FOLDER = "quotas"
DRAW_SCHEMA = pa.schema(  # a line left out, then its SourceDraw's fields in order
    [("line", pa.int64()), ("source", pa.string()), ("available", pa.int64()), ("drawn", pa.int64())]
)


@dataclass(frozen=True)
class SourceDraw:
    """What the quota of one source draws."""

    source: str
    available: int  # the source's prompts (repeats left out)
    drawn: int  # how many the quota takes

    def reason(self, line: int, seed: int) -> str:
        return (
            f"line {line}: not drawn by the quota of source {self.source!r} ({self.drawn} of its {self.available} "
            f"prompts, seed {seed})"
        )


def quota_count(quota: float, available: int) -> int:
    """How many of `available` prompts a quota draws (QuotaSettings checked it): a share (below 1) rounded, or a
    count."""
    return round(quota * available) if 0 < quota < 1 else min(int(quota), available)


def draw(prompts: Iterable[Prompt], settings: QuotaSettings) -> tuple[dict[int, SourceDraw], dict[str, SourceDraw]]:
    """(line -> its source's draw, for every line NOT drawn; source -> draw, for every source with a quota)."""
    by_source: dict[str, list[tuple[bytes, int]]] = defaultdict(list)
    for p in prompts:
        if p.source in settings.quotas:
            by_source[p.source].append((draw_key(settings.quota_seed, p.prompt_id), p.line))
    left_out: dict[int, SourceDraw] = {}
    draws: dict[str, SourceDraw] = {}
    for source, quota in settings.quotas.items():
        ranked = sorted(by_source.get(source, []))
        chosen = SourceDraw(source, len(ranked), quota_count(quota, len(ranked)))
        draws[source] = chosen
        left_out |= {line: chosen for _, line in ranked[chosen.drawn :]}
    return left_out, draws


def source_draws(
    source: Path,
    data_dir: str | Path | Storage,
    mapping: FieldMapping | None,
    settings: QuotaSettings,
    skip: Iterable[int] = (),
) -> dict[int, SourceDraw]:
    """line -> its source's draw for every line of the source the quotas leave out ({} without quotas); `skip`:
    lines that are no prompt of the draw (repeats). Drawn once per source and kept in the data dir
    (`quotas/<key>.parquet`) for every shard's build."""
    if not settings.quotas:
        return {}
    skipped = sorted(skip)
    storage = open_storage(data_dir)
    key = source_key(source, mapping, sorted(settings.quotas.items()), settings.quota_seed, skipped)
    path = storage.root / FOLDER / f"{key}.parquet"
    if not storage.exists(path):
        left = set(skipped)
        prompts = (p for p in read_shard(source, 0, 1 << 62, mapping) if isinstance(p, Prompt) and p.line not in left)
        left_out = draw(prompts, settings)[0]
        rows = [{"line": line, **asdict(d)} for line, d in sorted(left_out.items())]
        storage.write_table(pa.Table.from_pylist(rows, schema=DRAW_SCHEMA), path)
    return {line: SourceDraw(*fields) for line, *fields in zip(*storage.read_table(path).to_pydict().values())}
