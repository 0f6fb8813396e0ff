"""When the plan has no probe: how to run one, and what it would cost, in the summary's words."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dflash_assets.generation.probe import probe_size
from dflash_assets.quality.outcome import num, pct
from dflash_assets.quality.planning.estimate import CapPlan, predict
from dflash_assets.quality.planning.fit import Distinct
from dflash_assets.quality.planning.probe_estimates import ProbePrecision
from dflash_assets.quality.report.cap_plan import hours_text, tokens_text
from dflash_assets.quality.tables import one
from dflash_assets.rules import CONTEXT_MARGIN
from dflash_assets.store.schema import PROMPT_SCHEMA
from dflash_assets.store.storage import connect_duckdb
from dflash_assets.store.stores import parquet_source


def prompt_count(data_dir: str | Path) -> int:
    with connect_duckdb() as con:
        return one(con, f"SELECT count(*) FROM {parquet_source(con, data_dir, 'prompt_shards', PROMPT_SCHEMA)}")[0]


def probe_tokens_per_prompt(plan: CapPlan, probe_cap: int) -> float:
    """Expected output tokens per prompt at `probe_cap`: the rows up to the current cap as they are, the honest
    cut rows' tail from the fit beyond it, runaways all the way to the probe's cap."""
    now = plan.at(plan.cap).output_tokens.value / plan.prompts
    honest, loops = plan.honest / plan.rows, plan.runaways / plan.rows
    beyond = 0.0
    if plan.fit and honest:
        no = np.array([False])
        one_cut_row = Distinct(np.array([plan.cap]), np.array([True]), no, np.array([1]), plan.cap, no)
        _, tokens = predict(one_cut_row, np.array([probe_cap]), (plan.fit.mu, plan.fit.sigma))
        beyond = float(tokens[0]) - plan.cap
    return now + honest * beyond + loops * (probe_cap - plan.cap)


def expected_precision(plan: CapPlan, size: int) -> str:
    """The sentence on how precisely a random probe of `size` prompts will measure the share cut (at worst,
    whatever the shape of the lengths), and the size that would give ±1 pp."""
    honest = plan.honest / plan.rows
    p = ProbePrecision.expected(plan.cap, honest, size)
    text = (
        f" It will measure the share cut at each larger cap to ±{p.half_width * 100:.2f} pp at worst (95%, "
        f"binomial: about {num(p.rows_above)} of its rows, {pct(honest)} as in the run, will run past the cap "
        f"{num(plan.cap)} without looping)"
    )
    text += "." if p.enough else f"; {num(p.rows_for_target)} prompts would give ±{p.target * 100:g} pp (set `size`)."
    cut_rows = probe_size(plan.honest)  # the continuation probe's default size: of the cut rows
    c = ProbePrecision.expected(plan.cap, honest, cut_rows, continued=True)
    return text + (
        f" With `mode: cut_rows` it continues {num(cut_rows)} of this run's honest cut rows to its cap "
        f"instead (decode only past the cap): every row measures the tail, ±{c.half_width * 100:.2f} pp "
        f"at worst."
    )


def probe_advice(
    plan: CapPlan, data_dir: str | Path, rows: int, tokens_per_s: float | None, servers: int | None
) -> str:
    """A Markdown paragraph: no probe yet, how to run one, its size, cap, predicted tokens, GPU time and
    precision."""
    prompts = prompt_count(data_dir) or rows
    size = probe_size(prompts)
    head = (
        f"**No length probe yet**: the figures beyond the cap {num(plan.cap)} are a model's. Materialise "
        f"`length_probe` (Dagster UI: Assets, length_probe, Materialize; or `dagster asset materialize -m "
        f"dflash_assets.definitions --select length_probe`) to measure them: {num(size)} of {num(prompts)} "
        f"prompts, seeded and stratified across shards and sources"
    )
    worst = max(plan.estimates, key=lambda e: e.cap)
    precision = expected_precision(plan, size) if plan.honest else ""
    if plan.context_length is None or worst.context_needed_max is None:
        return head + ", at the largest cap the fleet's context allows." + precision
    cap = plan.context_length - (worst.context_needed_max - worst.cap)  # context_needed includes the margin
    tokens = size * probe_tokens_per_prompt(plan, cap)
    text = (
        f", at cap {num(cap)} (context {num(plan.context_length)} - {CONTEXT_MARGIN} - the longest prompt). "
        f"Predicted output: about {tokens_text(tokens)} tokens (model-based, at most {tokens_text(size * cap)})"
    )
    if tokens_per_s:
        hours = tokens / tokens_per_s / 3600
        text += f", {hours_text(hours)} on the fleet at its measured {num(round(tokens_per_s))} tok/s" + (
            f", {hours * servers:.2f} GPU-hours on {servers} servers" if servers else ""
        )
    else:
        text += "; no measured fleet throughput yet to turn that into hours"
    return head + text + "." + precision
