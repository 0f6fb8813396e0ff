"""The cap plan of a data dir: one config's committed rows (and its length probe's) read with DuckDB, planned by
estimate.py's plan_from_lengths; and which cut rows a continuation probe continues."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import duckdb
import numpy as np

from dflash_assets.quality.outcome import num
from dflash_assets.quality.planning.estimate import (
    DEFAULT_CANDIDATES,
    CapPlan,
    Lengths,
    PlanOptions,
    plan_from_lengths,
    turn_views,
)
from dflash_assets.quality.planning.fit import PlanError
from dflash_assets.quality.planning.probe_estimates import ProbeSample
from dflash_assets.quality.tables import one, register_runaway, runaway_sql
from dflash_assets.rules import CONFIG_CAP_SQL, CUT_SQL, LATEST_ORDER_SQL, WINDOW_SIZED_SQL
from dflash_assets.settings import SAMPLING_PARAMS, RunawaySettings
from dflash_assets.store.schema import COMPLETION_SCHEMA
from dflash_assets.store.storage import connect_duckdb
from dflash_assets.store.stores import parquet_source

__all__ = ["DEFAULT_CANDIDATES", "CapPlan", "PlanError", "cut_rows_for_probe", "honest_cut_rows", "plan_caps"]


SAMPLING = ("model", *SAMPLING_PARAMS, "enable_thinking")  # what must match for a probe to apply
# a runaway stopped while streaming is a cut row that loops, at the length it really cost (rules.RUNAWAY_FINISH)
PLANNED = f"(finish_reason = 'stop' OR {CUT_SQL}) AND completion_tokens IS NOT NULL"
ROW_QUERY = (
    f"SELECT completion_tokens, {CUT_SQL} AS truncated, {{runaway}} AS runaway, prompt_tokens, "
    f"max_output_tokens, {CONFIG_CAP_SQL} AS config_cap, {WINDOW_SIZED_SQL} AS held, server_context_length, turn "
    f"FROM {{src}} WHERE {{where}} AND {PLANNED}"
)
# the sampling of the config's first planned row: what a probe must match (one row, not a string per row)
SAMPLING_QUERY = f"SELECT {', '.join(SAMPLING)} FROM {{src}} WHERE {{where}} AND {PLANNED} LIMIT 1"


def read_probe(
    data_dir: str | Path,
    like: dict | None = None,
    runaway: RunawaySettings = RunawaySettings(),
    notes: list[str] | None = None,
    parent: str | None = None,
) -> ProbeSample | None:
    """The length probe's rows of the config with the largest cap whose SAMPLING matches `like`, for the prompts of
    the probe's current sample; a continuation probe of `parent`'s cut rows first. None when none matches."""
    from dflash_assets.generation.probe import CUT_ROWS_SHARD, PROBE_SHARD, probe_root
    from dflash_assets.store.schema import PROMPT_SCHEMA

    root = probe_root(data_dir)
    with connect_duckdb() as con:
        register_runaway(con, runaway)
        if parent is not None:
            src = parquet_source(con, root, "completions", COMPLETION_SCHEMA, CUT_ROWS_SHARD)
            sample = parquet_source(con, root, "prompt_shards", PROMPT_SCHEMA, CUT_ROWS_SHARD)
            found = con.execute(
                f"SELECT config_hash, max(max_output_tokens) FROM {src} WHERE parent_config_hash = "
                f"$parent GROUP BY 1 ORDER BY 2 DESC, 1",
                {"parent": parent},
            ).fetchall()
            if (
                found
                and (continued := _probe_rows(con, runaway, src, sample, found[0][0], found[0][1], parent)) is not None
            ):
                return continued
        src = parquet_source(con, root, "completions", COMPLETION_SCHEMA, PROBE_SHARD)
        sample = parquet_source(con, root, "prompt_shards", PROMPT_SCHEMA, PROBE_SHARD)
        sampling = ", ".join(f"any_value({k})" for k in SAMPLING)
        configs = con.execute(
            f"SELECT config_hash, max(max_output_tokens), {sampling} FROM {src} GROUP BY 1 ORDER BY 2 DESC, 1"
        ).fetchall()
        matching = [c for c in configs if like is None or tuple(c[2:]) == tuple(like[k] for k in SAMPLING)]
        if not matching:
            if configs and notes is not None:
                notes.append(
                    f"a length probe exists (configs {', '.join(f'`{c[0]}`' for c in configs)}) but none was "
                    f"made with the planned rows' model and sampling: it is not used"
                )
            return None
        return _probe_rows(con, runaway, src, sample, matching[0][0], matching[0][1])


def _probe_rows(
    con: duckdb.DuckDBPyConnection,
    runaway: RunawaySettings,
    src: str,
    sample: str,
    config_hash: str,
    cap: int,
    parent: str | None = None,
) -> ProbeSample | None:
    """The probe's rows of `config_hash` for prompts in its current sample (continued from `parent`'s, when given)."""
    lineage = "AND parent_config_hash = $parent " if parent else ""
    rows = con.execute(
        ROW_QUERY.format(
            runaway=runaway_sql(runaway),
            src=src,
            where=f"config_hash = $config {lineage}AND prompt_id IN (SELECT prompt_id FROM {sample})",
        ),
        {"config": config_hash} | ({"parent": parent} if parent else {}),
    ).fetchnumpy()
    if not len(rows["completion_tokens"]):
        return None
    return ProbeSample.of(rows["completion_tokens"], rows["truncated"], int(cap), rows["runaway"], config_hash, parent)


def honest_cut_rows(
    data_dir: str | Path, config_hash: str | None = None, runaway: RunawaySettings = RunawaySettings()
) -> tuple[str, int, list[tuple[str, str]]]:
    """What a continuation probe samples: the config (default: the latest), its cap and the (shard, prompt_id) of its
    honest cut rows (runaways left out, as the plan leaves them out of the tail)."""
    with connect_duckdb() as con:
        register_runaway(con, runaway)
        src = parquet_source(con, data_dir, "completions", COMPLETION_SCHEMA)
        configs = con.execute(
            f"SELECT config_hash, count(*) FROM {src} GROUP BY 1 ORDER BY {LATEST_ORDER_SQL}"
        ).fetchall()
        if not configs:
            raise PlanError(
                f"no completion rows under {data_dir}: a continuation probe continues a run's cut rows; "
                f"generate the run first, or probe random prompts (mode prompts)"
            )
        config_hash = _chosen(configs, config_hash, [])
        (cap,) = one(
            con, f"SELECT max({CONFIG_CAP_SQL}) FROM {src} WHERE config_hash = $config", {"config": config_hash}
        )
        rows = con.execute(  # a cut the window policy sized is final: no larger cap continues it
            f"SELECT shard, prompt_id FROM {src} WHERE config_hash = $config AND finish_reason = "
            f"'length' AND NOT ({runaway_sql(runaway)}) AND NOT {WINDOW_SIZED_SQL}",
            {"config": config_hash},
        ).fetchall()
    return config_hash, int(cap), [(a, b) for a, b in rows]


def cut_rows_for_probe(
    data_dir: str | Path, runaway: RunawaySettings = RunawaySettings()
) -> tuple[str, int, list[tuple[str, str]]]:
    """The honest cut rows of the config the plan is for: which rows the continuation probe measures is the quality
    layer's call (generation/probe.py run_length_probe continues them)."""
    try:
        return honest_cut_rows(data_dir, runaway=runaway)
    except PlanError as e:
        raise FileNotFoundError(str(e)) from None


def _probe_plan(probe: ProbeSample, options: PlanOptions) -> CapPlan:
    """The plan of a data dir without completion rows: the length probe's rows alone."""
    note = (
        f"no completion rows yet: planned from the length probe alone ({num(probe.rows)} rows at "
        f"cap {num(probe.cap)}, config `{probe.config_hash}`)"
    )
    lengths = Lengths(
        probe.completion_tokens, probe.truncated, probe.cap, runaway=probe.runaway, config_hash=probe.config_hash
    )
    return plan_from_lengths(lengths, options, notes=[note])


def _chosen(configs: list[tuple[str, int]], config_hash: str | None, notes: list[str]) -> str:
    """The config to plan: the one asked for, or the latest (the most recently written), said in the notes."""
    if config_hash is None:
        others = f"; the others: {', '.join(f'`{h}` ({num(c)})' for h, c in configs[1:])}" if configs[1:] else ""
        notes.append(
            f"config `{configs[0][0]}` chosen by default: the latest, the most recently written "
            f"({num(configs[0][1])} rows){others}"
        )
        return configs[0][0]
    if config_hash not in {h for h, _ in configs}:
        raise PlanError(
            f"no rows of config `{config_hash}`; configs present: {', '.join(f'`{h}`' for h, _ in configs)}"
        )
    return config_hash


def window_sized_note(max_output_tokens, sized, cut, cap: int) -> list[str]:
    """What the plan says of the requests the window policy sized below the config's cap (none: nothing)."""
    sized = np.asarray(sized, dtype=bool)
    if not sized.any():
        return []
    asked = np.asarray(max_output_tokens)[sized]
    return [
        f"cap {num(cap)} under the window policy: {num(int(sized.sum()))} requests asked less, the window's rest "
        f"(per-request caps {num(int(asked.min()))} to {num(int(asked.max()))}); their "
        f"{num(int((np.asarray(cut, dtype=bool) & sized).sum()))} cut rows are final under the policy, counted cut "
        f"at every cap at their own length"
    ]


def plan_caps(
    data_dir: str | Path,
    config_hash: str | None = None,
    shard: str | None = None,
    candidates=DEFAULT_CANDIDATES,
    tokens_per_s: float | None = None,
    context_length: int | None = None,
    use_probe: bool = True,
    runaway: RunawaySettings = RunawaySettings(),
    **kwargs,
) -> CapPlan:
    """The cap plan of one config's committed completion rows (all shards, or one), with the length probe's
    rows when there is a probe of the same model and sampling (`use_probe=False` plans without it).

    `config_hash=None` plans the latest config and says so; without completion rows the probe's own are planned.
    `context_length=None`: the smallest server context length of the rows. Other keywords are PlanOptions'.
    """
    notes: list[str] = []
    with connect_duckdb() as con:
        register_runaway(con, runaway)
        src = parquet_source(con, data_dir, "completions", COMPLETION_SCHEMA, shard)
        scope = "($shard IS NULL OR shard = $shard)"
        configs = con.execute(
            f"SELECT config_hash, count(*) FROM {src} WHERE {scope} GROUP BY 1 ORDER BY {LATEST_ORDER_SQL}",
            {"shard": shard},
        ).fetchall()
        if not configs:
            probe = read_probe(data_dir, None, runaway) if use_probe and config_hash is None else None
            if probe is None:
                where = f"shard {shard}" if shard else "any shard"
                raise PlanError(f"no completion rows under {data_dir} for {where}: generate a sample first")
            return _probe_plan(probe, PlanOptions(candidates, tokens_per_s, context_length, **kwargs))
        config_hash = _chosen(configs, config_hash, notes)
        where, params = f"{scope} AND config_hash = $config", {"shard": shard, "config": config_hash}
        rows = con.execute(ROW_QUERY.format(runaway=runaway_sql(runaway), src=src, where=where), params).fetchnumpy()
        first = con.execute(SAMPLING_QUERY.format(src=src, where=where), params).fetchone()
        skipped = dict(configs)[config_hash] - len(rows["completion_tokens"])
    if skipped:
        notes.append(f"{num(skipped)} rows without a 'stop' or 'length' finish left out")
    caps = np.unique(rows["config_cap"])
    if len(caps) > 1:
        notes.append(f"the rows carry several caps ({', '.join(map(num, caps))}); planning at the largest")
    notes += window_sized_note(rows["max_output_tokens"], rows["held"], rows["truncated"], int(caps.max()))
    if context_length is None and len(rows["server_context_length"]):
        context_length = int(np.min(rows["server_context_length"]))
        notes.append(f"context length {num(context_length)}: the smallest the rows' servers had")
    probe = None
    if use_probe and len(rows["completion_tokens"]):
        like = dict(zip(SAMPLING, first or (None,) * len(SAMPLING)))  # None where unrecorded, as any_value gives it
        probe = read_probe(data_dir, like, runaway, notes, parent=config_hash)
    lengths = Lengths(
        rows["completion_tokens"],
        rows["truncated"],
        int(caps.max()),
        rows["prompt_tokens"],
        runaway=rows["runaway"],
        config_hash=config_hash,
        shard=shard,
        held=rows["held"],
    )
    plan = plan_from_lengths(lengths, PlanOptions(candidates, tokens_per_s, context_length, **kwargs), probe, notes)
    return replace(plan, by_turn=turn_views(rows["turn"], rows["completion_tokens"], rows["truncated"]))
