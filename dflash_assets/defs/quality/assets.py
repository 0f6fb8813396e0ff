"""length_quality_report: what the completions of a shard look like, in figures and a picture."""

import base64
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import dagster as dg
from pydantic import Field

from dflash_assets.defs.completions.assets import completions, run_config_hash
from dflash_assets.defs.faults import named_stops
from dflash_assets.defs.metadata import ReportKeys, ShardRunKeys
from dflash_assets.defs.partitions import shard_asset
from dflash_assets.defs.probe.assets import length_probe
from dflash_assets.defs.resources import DataDirResource, QualityResource
from dflash_assets.quality.outcome import pct, shown
from dflash_assets.quality.report.lengths import ConfigStats
from dflash_assets.quality.report.rejects import read_rejects
from dflash_assets.quality.report.sources import by_source_markdown
from dflash_assets.settings import QualitySettings
from dflash_assets.store.configs import latest_config, latest_order, list_configs
from dflash_assets.store.configs import table as configs_rows
from dflash_assets.store.stores import committed_rows


class ConfigChoice(dg.Config):
    """Which config a figure or an export is of (a data dir holds several side by side)."""

    config_hash: str = Field(
        "",
        description="A config_hash, 'latest' (the most recently written config), 'all' (every config, pooled and "
        "labelled 'all configs'), or '' for the config this run generated (its completions), else the latest.",
    )
    chosen_by: str = Field(
        "",
        description="How the caller chose config_hash, as the manifest says it: 'run' when a command passes the "
        "config it has just generated; '' for what config_hash says (explicit, latest, run).",
    )


def choose_config(context: dg.AssetExecutionContext, root: str | Path, choice: ConfigChoice) -> tuple[str | None, str]:
    """(the config, None for all; how it was chosen: run | latest | explicit)."""
    if choice.config_hash == "all":
        return None, choice.chosen_by or "explicit"
    if choice.config_hash not in ("", "latest"):
        return choice.config_hash, choice.chosen_by or "explicit"
    if choice.config_hash == "" and (run := run_config_hash(context)):
        return run, "run"
    return latest_config(root), choice.chosen_by or "latest"


def configs_markdown(root: str | Path, max_length: int) -> str:
    """The configs of the data dir side by side (store/configs.py), the latest first: `dflash configs`' table."""
    configs = list_configs(root, max_length)
    if not configs:
        return "no configs: no completion rows yet"
    return _markdown(*configs_rows(configs))


def _markdown(columns: list[str], rows: list[list[str]]) -> str:
    head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    return head + "\n".join("| " + " | ".join(row) + " |" for row in rows)


def _table(rows: list[dict], columns: list[str]) -> str:
    return _markdown(columns, [[str(shown(r.get(c))) for c in columns] for r in rows])


PICTURES = (
    "length_survival (below, inline): the share of rows longer than each completion length, per config; the cap "
    "dashed red, the window's reach for the median prompt dotted blue. completion_lengths ([Show Markdown]): the "
    "full histogram of completion lengths per config with each cap marked."
)


def answer_metadata(report: dict, quality: QualitySettings, exports: Path, glance: str, **plan) -> tuple[dict, Any]:
    """The first rows a person reads (quality/report/answer.py) and the cap plan at a glance; and the CapAnswer, or
    None. `plan`: answer_of's plan, plan_error and wp, when the caller planned."""
    from dflash_assets.quality.report.answer import answer_of

    stats = next((s for s in map(ConfigStats.of, report["by_config"]) if s.config_hash == report["config_hash"]), None)
    shard = report["scope"]["shard"]
    answer = answer_of(stats, quality, exports, scope=f"shard {shard}" if shard else "", **plan) if stats else None
    said = answer.markdown() if answer else f"no answer: the figures are of {report['config_label']}"
    return {"answer": dg.MetadataValue.md(said), "cap_plan_at_a_glance": glance}, answer


def report_metadata(report: dict, png: bytes, chosen_by: str) -> dict:
    """Whose figures they are, the figures a person reads first, then the breakdowns, then the picture."""
    stats = [
        "rows",
        "conversations",
        "shortened_conversations",
        "cut_at_cap_rate",
        "truncated_rows",
        "runaway_rows",
        "truncation_rate",
        "cut_inside_window_rate",
        "window_complete_rate",
        "p50",
        "p90",
        "p95",
        "p99",
        "max",
    ]
    return {
        ReportKeys.CONFIG_HASH: report["config_hash"] or "all",
        ReportKeys.CHOSEN_BY: chosen_by,
        "figures_of": f"{report['config_label']} ({chosen_by}); every config beside it: by_config",
        "dagster/row_count": report["rows"],
        "rows": report["rows"],
        # Dagster 1.13 shows Markdown inline only under 1,000 characters: the full histogram is one click away
        "pictures": PICTURES,
        "length_survival": dg.MetadataValue.md(report["compact_histogram"]),
        "truncated_rows": report["truncated_rows"],
        ReportKeys.TRUNCATION_RATE: pct(report["truncation_rate"]),
        # against the trainer's window: the blocking share, and the cut rows the trainer reads whole (exported)
        "trainer_max_length": report["max_length"],
        "cut_inside_window_rows": report["cut_inside_window_rows"],
        ReportKeys.CUT_INSIDE_WINDOW_RATE: pct(report["cut_inside_window_rate"]),
        "window_complete_rows": report["window_complete_rows"],
        "window_complete_rate": pct(report["window_complete_rate"]),
        "window_complete_tokens": report["window_complete_tokens"],
        "decoded_tokens": report["decoded_tokens"],
        "trained_tokens": report["trained_tokens"],
        "runaway_rows": report["runaway_rows"],  # of the truncated rows, those cut while looping
        **{k: report[k] for k in ("p50", "p90", "p95", "p99", "max") if report[k] is not None},
        **{k: v for k, v in report["overflow"].items()},
        "by_config": dg.MetadataValue.md(_table(report["by_config"], ["config_hash", "config_cap", *stats])),
        "by_prompt_length": dg.MetadataValue.md(_table(report["by_prompt_length"], ["bucket", *stats])),
        "by_source": dg.MetadataValue.md(_table(report["by_source"], ["source", *stats])),
        **({"by_turn": dg.MetadataValue.md(_table(report["by_turn"], ["turn", *stats]))} if report["by_turn"] else {}),
        "completion_lengths": dg.MetadataValue.md(
            f"![completion lengths](data:image/png;base64,{base64.b64encode(png).decode()})"
        ),
        "percentiles": report["percentile_definition"],
    }


@shard_asset(
    deps=[completions],
    group_name="quality",
    kinds={"duckdb", "parquet"},
    description="Length quality of a shard's completions (DuckDB over its Parquet), of one config: the run's, "
    "else the shard's latest (config_hash says which; by_config lists every config beside it): rows, truncation rate "
    "(finish_reason = 'length'), judged against the trainer's window (cut inside it: blocking; "
    "window-complete: exported), decoded and trained tokens, P50/P90/P95/P99/max completion tokens "
    "by config, prompt length and "
    "source, context overflows, and a histogram of completion lengths with the cap marked.",
)
def length_quality_report(
    context: dg.AssetExecutionContext, data_dir: DataDirResource, quality: QualityResource
) -> None:
    root, reports = data_dir.resolved(), data_dir.local_dir() / "reports"
    quality_settings = QualitySettings.taken_from(quality)
    run = run_config_hash(context)
    for shard in context.partition_keys:
        present = [h for h, _ in latest_order(root, shard)]  # the run's config, else the shard's latest
        config, chosen_by = (run, "run") if run in present else (present[0] if present else None, "latest")
        with named_stops(context, data_dir, lambda: committed_rows(root, context.partition_keys)):
            report, png = _report_and_histogram(root, shard, quality_settings, reports / f"shard={shard}", config)
        glance = "the cap plan is of each config over all its shards: length_quality_summary's cap_plan"
        context.add_asset_metadata(
            partition_key=shard,
            metadata={
                **answer_metadata(report, quality_settings, data_dir.local_dir() / "training", glance)[0],
                **report_metadata(report, png.read_bytes(), chosen_by),
                ReportKeys.REJECTS: dg.MetadataValue.md(read_rejects(root, [shard]).markdown()),
                "histogram_path": dg.MetadataValue.path(str(png)),
            },
        )


def _report_and_histogram(
    root: str | Path, shard: str | None, quality_settings: QualitySettings, reports: Path, config_hash: str | None
):
    from dflash_assets.quality.report.histogram import report_and_histogram  # matplotlib: on use

    return report_and_histogram(
        root,
        reports / "completion_lengths.png",
        shard,
        quality_settings.trainer.max_length,
        quality_settings.runaway,
        config_hash,
    )


def fleet_throughput(instance: dg.DagsterInstance) -> tuple[float | None, int | None]:
    """(output tokens/s, servers) the fleet measured in its latest completions runs (their metadata), or Nones."""
    records = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=completions.key), limit=20).records
    rates, servers = [], []
    for r in records:
        meta = r.asset_materialization.metadata if r.asset_materialization else {}
        rate = meta[ShardRunKeys.TOKENS_PER_S].value if ShardRunKeys.TOKENS_PER_S in meta else None
        if isinstance(rate, int | float) and rate > 0:
            rates.append(float(rate))
            listed = meta[ShardRunKeys.SERVERS].value if ShardRunKeys.SERVERS in meta else None
            servers.append(len(listed) if isinstance(listed, list | tuple | dict) else 1)
    if not rates:
        return None, None
    return sorted(rates)[len(rates) // 2], max(servers)


@dg.asset(
    deps=[completions, length_probe],
    group_name="quality",
    kinds={"duckdb", "parquet"},
    owners=["team:dflash"],
    description="Length quality over every materialised shard, of one config (the run's, else the latest: its "
    "config_hash says which; 'all' pools them, labelled 'all configs'): the same figures as "
    "length_quality_report, by shard, the configs of the data dir side by side (configs, by_config), the "
    "histogram, and the cap plan: for candidate caps, the truncation rate "
    "(runaways apart), output tokens, time and context length needed, measured by the length probe "
    "where there is one, else from a censored lognormal tail marked as a model, with 95% intervals "
    "and a picture of the observed, probed and fitted survival.",
)
def length_quality_summary(
    context: dg.AssetExecutionContext, config: ConfigChoice, data_dir: DataDirResource, quality: QualityResource
) -> dg.MaterializeResult:
    root, quality_settings = data_dir.resolved(), QualitySettings.taken_from(quality)
    chosen, chosen_by = choose_config(context, root, config)
    stops = lambda: named_stops(context, data_dir, lambda: committed_rows(root))  # noqa: E731 - twice
    with stops():
        report, png = _report_and_histogram(root, None, quality_settings, data_dir.local_dir() / "reports", chosen)
    metadata = {
        **report_metadata(report, png.read_bytes(), chosen_by),
        "configs": dg.MetadataValue.md(configs_markdown(root, quality_settings.trainer.max_length)),
        "histogram_path": dg.MetadataValue.path(str(png)),
        # the prompts each source's quota drew (its repeats left out) beside those the config generated
        "planned_by_source": dg.MetadataValue.md(by_source_markdown(root, chosen)),
        "by_shard": dg.MetadataValue.md(_table(report["by_shard"], BY_SHARD_COLUMNS)),
    }
    first, planned = plan_metadata(context.instance, data_dir, report, chosen, quality_settings, stops)
    return dg.MaterializeResult(metadata=first | metadata | planned)  # the answer and the cap plan at a glance first


BY_SHARD_COLUMNS = [
    "shard",
    "configs",
    "rows",
    "cut_at_cap_rate",
    "cut_inside_window_rate",
    "window_complete_rate",
    "p50",
    "p90",
    "p99",
]


def plan_metadata(
    instance: dg.DagsterInstance,
    data_dir: DataDirResource,
    report: dict,
    chosen: str | None,
    quality_settings: QualitySettings,
    stops: Callable[[], AbstractContextManager],
) -> tuple[dict, dict]:
    """The summary's answer and glance (answer_metadata), and the cap plan of the config the figures are of."""
    from dflash_assets.quality.planning.fit import PlanError
    from dflash_assets.quality.planning.planner import plan_caps
    from dflash_assets.quality.planning.window_plan import window_plan, window_plan_lines
    from dflash_assets.quality.report.cap_plan import plan_glance, plan_markdown, turn_markdown
    from dflash_assets.quality.report.planner_plot import cap_plan_png
    from dflash_assets.quality.report.probe_advice import probe_advice

    root, exports = data_dir.resolved(), data_dir.local_dir() / "training"  # the exports' manifests
    tokens_per_s, servers = fleet_throughput(instance)
    try:
        plan = plan_caps(root, config_hash=chosen, tokens_per_s=tokens_per_s, runaway=quality_settings.runaway)
    except PlanError as e:
        first, _ = answer_metadata(report, quality_settings, exports, f"no cap plan: {e}", plan_error=str(e))
        return first, {"cap_plan": dg.MetadataValue.md(f"no cap plan: {e}")}
    trainer = quality_settings.trainer
    candidates = [e.cap for e in plan.estimates]
    throughput = {"tokens_per_s": tokens_per_s, "servers": servers}
    wp = window_plan(
        root,
        plan.config_hash,
        plan.cap,
        trainer,
        plan.fit,
        quality_settings.runaway,
        candidates=candidates,
        **throughput,
    )
    lines = window_plan_lines(wp, f"cap_policy window, trainer_max_length {wp.max_length}")
    first, answer = answer_metadata(report, quality_settings, exports, plan_glance(plan), plan=plan, wp=wp)
    picture = data_dir.local_dir() / "reports" / "cap_plan.png"
    with stops():
        picture.write_bytes(cap_plan_png(plan, (wp.max_length, wp.window_at), answer.description() if answer else ""))
    advice = "" if plan.probe else "\n\n" + probe_advice(plan, root, report["rows"], tokens_per_s, servers)
    basis = (
        "model (censored lognormal tail) beyond the cap"
        if any(e.basis == "model" for e in plan.estimates)
        else "measured (the rows)"
    )
    return first, {
        "trained_tokens_plan": dg.MetadataValue.md("\n".join(f"- {line.strip()}" for line in lines)),
        "cap_plan": dg.MetadataValue.md(plan_markdown(plan) + advice),
        # all_turns: the same view on its own, for the run page's metadata list
        **({"cap_plan_by_turn": dg.MetadataValue.md("\n".join(turn_markdown(plan)).strip())} if plan.by_turn else {}),
        "cap_plan_source": "measured by the length probe" if plan.probe else basis,
        "cap_plan_picture": dg.MetadataValue.md(
            f"![cap plan](data:image/png;base64,{base64.b64encode(picture.read_bytes()).decode()})"
        ),
    }
