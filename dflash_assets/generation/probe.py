"""The length probe: a seeded random sample of the prompts, generated at a high cap, to measure the length tail.

The probe lives in its own data dir beside the run's (`<data_dir>/length_probe/`, the same tables), read by the
planner only; its sample is one prompt shard (`probe`) that the ordinary engine runs. The continuation probe
(ProbeSettings.mode "cut_rows") continues a sample of the run's honest cut rows to the probe's cap instead, so every
probe row informs the tail; its rows (shard `cut_rows`) say by `parent_config_hash` which run's cut rows they are.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from dflash_assets.fleet.fleet import Fleet
from dflash_assets.generation import provenance
from dflash_assets.generation.continuation import continue_shard
from dflash_assets.generation.engine import ShardResult, generate_shard, resolve_regenerate
from dflash_assets.generation.preflight import Budget
from dflash_assets.settings import DispatchSettings, GenerationSettings, ProbeSettings, SettingsError
from dflash_assets.store.schema import PromptRow
from dflash_assets.store.storage import is_uri, open_storage
from dflash_assets.store.stores import committed_ids, completion_batches, completion_store, prompt_batches, prompt_store

PROBE_SHARD = "probe"
CUT_ROWS_SHARD = "cut_rows"  # the continuation probe's: its own shard, so its rows never mix with a random probe's
PROBE_DIR = "length_probe"
MIN_PROMPTS, SHARE, SEED = ProbeSettings().min_prompts, ProbeSettings().share, ProbeSettings().seed  # the defaults


def probe_root(data_dir: str | Path) -> str | Path:
    """Where the probe's tables live: a data dir of its own inside the run's."""
    if is_uri(data_dir):
        return f"{str(data_dir).rstrip('/')}/{PROBE_DIR}"
    return Path(data_dir) / PROBE_DIR


def probe_size(prompts: int, share: float = SHARE, minimum: int = MIN_PROMPTS) -> int:
    """The larger of `minimum` prompts and `share` of them (never more than there are)."""
    return min(prompts, max(minimum, math.ceil(share * prompts)))


def _order(row: PromptRow) -> tuple:
    return row.shard or "", row.line or 0, row.prompt_id


def sample_prompts(rows: list[PromptRow], size: int, seed: int = SEED) -> list[PromptRow]:
    """A seeded random sample of `size` prompt rows, stratified by (shard, source): each stratum gets its
    proportional share (largest remainders), then a seeded draw inside it. The same rows and seed give the
    same sample, in (shard, line) order."""
    strata: dict[tuple, list[PromptRow]] = defaultdict(list)
    for r in sorted(rows, key=_order):
        strata[(r.shard, r.source)].append(r)
    size = min(size, len(rows))
    quotas = {k: size * len(v) / len(rows) for k, v in strata.items()}
    take = {k: math.floor(q) for k, q in quotas.items()}
    for k in sorted(quotas, key=lambda k: (take[k] - quotas[k], k))[: size - sum(take.values())]:
        take[k] += 1
    rng = random.Random(seed)
    chosen = [r for k in sorted(strata) for r in rng.sample(strata[k], take[k])]
    return sorted(chosen, key=_order)


def prompt_shard_keys(data_dir: str | Path) -> list[str]:
    """The shards with a prompt_shards file under `data_dir`, in key order."""
    storage = open_storage(data_dir)
    folders = {p.parent.name for p in storage.walk(storage.root / "prompt_shards") if p.suffix == ".parquet"}
    return sorted(f.removeprefix("shard=") for f in folders if f.startswith("shard="))


def read_prompts(data_dir: str | Path, shards: list[str]) -> list[PromptRow]:
    """Every prompt row of `shards` (the columns the probe needs; the messages are read for the sample only)."""
    columns = ["prompt_id", "shard", "line", "source", "prompt_tokens"]
    return [r for shard in shards for batch in prompt_batches(prompt_store(data_dir, shard), columns) for r in batch]


def high_cap(fleet: Fleet, sample: list[PromptRow], log: Callable[[str], None], probe: str = "length probe") -> int:
    """The largest cap every sampled prompt fits under the fleet's context, by preflight's own rule; said in the
    log, since nobody asked for that number."""
    budget = Budget.of(fleet.infos)
    longest = max((r.prompt_tokens or 0 for r in sample), default=0)
    cap = budget.context_length - budget.margin - longest
    log(
        f"{probe}: cap {cap} = context length {budget.context_length} - {budget.margin} - the longest sampled "
        f"prompt ({longest} tokens)"
    )
    return cap


@dataclass(frozen=True)
class ProbeResult:
    prompts_total: int
    sampled: int
    cap: int
    run: ShardResult
    mode: str = ProbeSettings().mode  # "prompts" (prompts_total = prompts) or "cut_rows" (= cut rows)


def ids_by_shard(sample: list[PromptRow]) -> dict[str, set[str]]:
    """The sampled prompt_ids, grouped by the shard they come from."""
    wanted: dict[str, set[str]] = defaultdict(set)
    for r in sample:
        wanted[r.shard or ""].add(r.prompt_id)
    return wanted


def write_probe_shard(data_dir: str | Path, sample: list[PromptRow], shard: str = PROBE_SHARD) -> None:
    """The sampled prompts, whole rows, as the probe data dir's single prompt shard (replacing an earlier one)."""
    rows = []
    for source, ids in sorted(ids_by_shard(sample).items()):
        rows += [r for batch in prompt_batches(prompt_store(data_dir, source)) for r in batch if r.prompt_id in ids]
    order = {(r.shard, r.prompt_id): i for i, r in enumerate(sample)}
    rows.sort(key=lambda r: order[(r.shard, r.prompt_id)])
    # the probe's shard key replaces the prompt's own; the prompt_id stays, so a row is traced back to its prompt
    probe = [replace(r, shard=shard) for r in rows]
    prompt_store(probe_root(data_dir), shard).replace(probe, "prompts.parquet")


CutRows = tuple[str, int, list[tuple[str, str]]]  # (the parent config, its cap, (shard, prompt_id) of its cut rows)


def _sample(prompts: list[PromptRow], probe: ProbeSettings) -> list[PromptRow]:
    """The probe's seeded sample of `prompts`: its size, or its share with its minimum."""
    return sample_prompts(prompts, probe.size or probe_size(len(prompts), probe.share, probe.min_prompts), probe.seed)


def _copy_parent_rows(data_dir: str | Path, parent: str, sample: list[PromptRow]) -> None:
    """The sample's parent rows, and the parent's provenance (its hash covers it, and the continuation rebuilds that
    hash), into the probe's cut_rows shard; rows copied before are kept."""
    if (was := provenance.recorded(data_dir, parent)) is not None:
        if provenance.recorded(probe_root(data_dir), parent) is None:
            in_hash = was.pop("in_hash")
            provenance.record(probe_root(data_dir), parent, was, in_hash=in_hash)
    store = completion_store(probe_root(data_dir), CUT_ROWS_SHARD)
    with store.lock():
        store.recover()
        have = committed_ids(store, parent)
        for shard, ids in sorted(ids_by_shard(sample).items()):
            for batch in completion_batches(completion_store(data_dir, shard), parent, wanted=ids - have):
                store.commit([replace(r, shard=CUT_ROWS_SHARD) for r in batch])


async def run_length_probe(
    data_dir: str | Path,
    shards: list[str],
    fleet: Fleet,
    generation: GenerationSettings,
    probe: ProbeSettings,
    dispatch: DispatchSettings = DispatchSettings(),
    log: Callable[[str], None] = print,
    cut_rows: Callable[[], CutRows] | None = None,
) -> ProbeResult:
    """The probe in its mode, for the asset and the CLI alike, at the probe's cap (0: the largest the fleet's context
    allows for the sample), with the run's own sampling. A re-run with the same sample resumes.

    Mode prompts: a seeded sample of the prompts of `shards`, generated through the engine. Mode cut_rows: a seeded
    sample (stratified as `sample_prompts`) of the honest cut rows `cut_rows` gives (the parent config, its cap and
    the rows' keys: planner.cut_rows_for_probe), copied with their parent rows into the probe's `cut_rows` shard and
    continued there by `continue_shard`."""
    if probe.mode == "prompts":
        prompts = read_prompts(data_dir, shards)
        if not prompts:
            raise FileNotFoundError(
                f"no prompt_shards rows under {data_dir} for shard(s) {', '.join(shards) or '-'}: "
                f"materialise prompt_shards first"
            )
        sample = _sample(prompts, probe)
        cap = probe.max_output_tokens or high_cap(fleet, sample, log)
        # it measures lengths: never sized to a window
        generation = generation.model_copy(update={"cap_policy": "fixed", "max_output_tokens": cap})
        generation = resolve_regenerate(open_storage(data_dir), generation)  # the run's mode (its shards)
        write_probe_shard(data_dir, sample)
        log(f"length probe: {len(sample)} of {len(prompts)} prompts (seed {probe.seed}) at cap {cap}")
        run = await generate_shard(probe_root(data_dir), PROBE_SHARD, fleet, generation, dispatch, log=log)
        return ProbeResult(len(prompts), len(sample), cap, run)
    if cut_rows is None:
        raise SettingsError("the length probe's mode cut_rows needs the run's honest cut rows, and none were given")
    parent, parent_cap, cut = cut_rows()
    cut = [(shard, pid) for shard, pid in cut if shard in set(shards)]
    log(
        f"continuation probe of config {parent} (cap {parent_cap}): {len(cut)} honest cut rows in shard(s) "
        f"{', '.join(shards)}"
    )
    if not cut:
        raise SettingsError(
            f"config {parent} has no honest cut rows to continue: nothing for a continuation probe to measure"
        )
    keys = sorted(set(cut))
    prompts_of = {(p.shard, p.prompt_id): p for p in read_prompts(data_dir, sorted({s for s, _ in keys}))}
    eligible = [prompts_of[k] for k in keys if k in prompts_of]
    sample = _sample(eligible, probe)
    cap = probe.max_output_tokens or high_cap(fleet, sample, log, "continuation probe")
    write_probe_shard(data_dir, sample, CUT_ROWS_SHARD)
    _copy_parent_rows(data_dir, parent, sample)
    log(
        f"continuation probe: {len(sample)} of {len(eligible)} honest cut rows of config {parent} "
        f"(seed {probe.seed}) continued to cap {cap}"
    )
    run = await continue_shard(probe_root(data_dir), CUT_ROWS_SHARD, fleet, parent, cap, dispatch, log=log)
    return ProbeResult(len(eligible), len(sample), cap, run, mode="cut_rows")
