"""The length-quality report and the checks as rich tables in a terminal (`dflash report`)."""

import re
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from dflash_assets.quality.outcome import Thresholds, num, pct
from dflash_assets.quality.registry import run_checks
from dflash_assets.quality.report import PERCENTILE_DEFINITION, length_quality

LENGTH_COLUMNS = ("rows", "truncated", "truncation rate", "P50", "P90", "P95", "P99", "max")
OVERFLOW_KEYS = ("completion_rows_over_context", "rejected_prompts_over_context", "rows_over_max_length")


def _n(value: int | None) -> str:
    return "-" if value is None else num(value)


def _length_cells(row: dict[str, Any]) -> list[str]:
    return [
        _n(row["rows"]),
        _n(row["truncated_rows"]),
        pct(row["truncation_rate"]),
        *(_n(row[k]) for k in ("p50", "p90", "p95", "p99", "max")),
    ]


def _table(title: str, keys: tuple[str, ...], rows: list[list[str]]) -> Table:
    table = Table(title=title, title_justify="left")
    for key in keys:
        # only the free text wraps: figures and names stay whole, the summary takes what width is left
        text = key in {"config", "shard", "configs", "source", "prompt tokens", "check", "summary"}
        table.add_column(key, justify="left" if text else "right", no_wrap=key != "summary")
    for row in rows:
        table.add_row(*row)
    return table


def _headline(summary_md: str) -> str:
    """The first paragraph of a check summary without Markdown emphasis."""
    return re.sub(r"[*`]", "", summary_md.split("\n\n")[0])


def print_report(
    data_dir: str | Path,
    console: Console | None = None,
    shard: str | None = None,
    thresholds: Thresholds = Thresholds(),
    checks: bool = True,
) -> dict[str, Any]:
    """Print the length-quality summary (and the check results) as rich tables; return the report dict."""
    console = console or Console()
    report = length_quality(data_dir, shard, max_length=thresholds.training_max_length)
    scope = f"shard {shard}" if shard else "all shards"
    console.print(_table(f"Length quality, {scope}", LENGTH_COLUMNS, [_length_cells(report)]))
    console.print(f"Percentiles: {PERCENTILE_DEFINITION}.")
    console.print(
        _table(
            "By config",
            ("config", "cap", "shards", *LENGTH_COLUMNS),
            [
                [str(r["config_hash"]), _n(r["max_output_tokens"]), _n(r["shards"]), *_length_cells(r)]
                for r in report["by_config"]
            ],
        )
    )
    console.print(
        _table(
            "By shard",
            ("shard", "configs", *LENGTH_COLUMNS),
            [[str(r["shard"]), str(r["configs"]), *_length_cells(r)] for r in report["by_shard"]],
        )
    )
    console.print(
        _table(
            "By prompt length",
            ("prompt tokens", *LENGTH_COLUMNS),
            [[r["bucket"], *_length_cells(r)] for r in report["by_prompt_length"]],
        )
    )
    console.print(
        _table(
            "By source",
            ("source", *LENGTH_COLUMNS),
            [[str(r["source"]), *_length_cells(r)] for r in report["by_source"]],
        )
    )
    o = report["overflow"]
    console.print(
        _table(
            "Overflow",
            ("completion rows over context", "rejected prompts over context",
             f"rows over max_length {o['max_length']}"),
            [[num(o[k]) for k in OVERFLOW_KEYS]],
        )
    )
    if checks:
        outcomes = run_checks(data_dir, shard, thresholds=thresholds)
        console.print(
            _table(
                "Checks",
                ("check", "gate", "severity", "result", "summary"),
                [[o.name, "blocking" if o.blocking else "", o.severity, "PASS" if o.passed else "FAIL",
                  _headline(o.summary_md)] for o in outcomes],
            )
        )
    return report
