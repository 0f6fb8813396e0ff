"""The length-quality report and the checks as rich tables in a terminal (`dflash report`), never wider than the
console: a table drops its least needed columns (fit), a figure is never cut with an ellipsis.
"""

import re
import sys
import textwrap
from pathlib import Path
from typing import Any

from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table

from dflash_assets.quality.checks.registry import run_checks
from dflash_assets.quality.outcome import num, pct
from dflash_assets.quality.planning.window_plan import window_plan_lines
from dflash_assets.quality.report.answer import CapAnswer, cap_answers
from dflash_assets.quality.report.lengths import PERCENTILE_DEFINITION, LengthStats, length_quality
from dflash_assets.settings import QualitySettings

LENGTH_COLUMNS = (
    "rows",
    "truncated",
    "truncation rate",
    "cut inside window",
    "window-complete",
    "P50",
    "P90",
    "P95",
    "P99",
    "max",
)
OVERFLOW_KEYS = ("completion_rows_over_context", "rejected_prompts_over_context", "rows_over_max_length")


REPORT_WIDTH = 100  # a `dflash` command's width when its output is not a terminal and COLUMNS is not set
# the columns a table drops first when it does not fit, in that order
DROP_FIRST = ("P95", "truncated", "max", "configs", "shards", "window-complete", "P50")
RUN_DROP_FIRST = ("P50", "new", "checks", "P90")  # a run's per-shard table (cli/shards.py): its identity stays


def console_for_output() -> Console:
    """A `dflash` command's console: the terminal's width, or REPORT_WIDTH columns when piped."""
    return Console(width=None if sys.stdout.isatty() else REPORT_WIDTH)


def fit(table: Table, width: int, drop: tuple[str, ...] = DROP_FIRST) -> Table:
    """`table` made to fit `width` columns: figures as wide as their widest cell, free text takes the rest; while
    still too wide, the columns named in `drop` go, in order. Nothing is cut with "…"."""

    def least(column) -> int:
        words = [str(column.header)] + [str(c) for c in column._cells]
        if not column.no_wrap:
            words = [w for text in words for w in text.split()]
        longest_word = max((cell_len(w) for w in str(column.header).split()), default=0)
        return max([cell_len(w) for w in words[1:]] + [longest_word])

    while True:
        header = [str(c.header) for c in table.columns]
        lows = [least(c) for c in table.columns]
        extra = table._extra_width + sum(table._get_padding_width(i) for i in range(len(table.columns)))
        if sum(lows) + extra <= width or not (gone := [n for n in drop if n in header]):
            break
        table.columns.pop(header.index(gone[0]))
        for i, column in enumerate(table.columns):
            column._index = i
    room = width - extra - sum(lows)
    for column, low in zip(table.columns, lows):
        column.overflow = "fold"  # a last resort for free text only: never "…"
        if column.no_wrap:  # a fixed width: its cells whole, its header wrapped at words
            grow = max(0, min(cell_len(str(column.header)) - low, room))
            room -= grow
            column.width, column.no_wrap = low + grow, False
    return table


def verbatim(console: Console, text: str) -> None:
    """A line that holds a command or a path, never wrapped: it is copied whole, however long the path."""
    console.print(text, highlight=False, soft_wrap=True)


# where a command starts in a line of ours: its environment, then `uv run` or `dflash`
COMMAND_START = re.compile(r"(?:[A-Z][A-Z0-9_]*=(?:'[^']*'|\S)+ )*(?:uv run |dflash )")  # a value may be quoted


def say_with_command(console: Console, line: str) -> None:
    """A line of prose wrapped at the console's width, and the command it ends with on a line of its own, whole."""
    at = COMMAND_START.search(line)
    if at is None or at.start() == 0:
        (verbatim if at is not None else _wrapped)(console, line)
        return
    indent = " " * (len(line) - len(line.lstrip()))
    _wrapped(console, line[: at.start()].rstrip())
    verbatim(console, f"{indent}    {line[at.start() :]}")


def _wrapped(console: Console, text: str) -> None:
    """Prose wrapped at words to the console's width, its continuation lines indented under it."""
    hang = " " * (len(text) - len(text.lstrip()) + 4)
    for line in textwrap.wrap(
        text, console.width, subsequent_indent=hang, break_long_words=False, break_on_hyphens=False
    ) or [""]:
        console.print(line, highlight=False, markup=False, soft_wrap=True)


def _n(value: int | None) -> str:
    return "-" if value is None else num(value)


def _length_cells(stats: LengthStats) -> list[str]:
    return [
        _n(stats.rows),
        _n(stats.truncated_rows),
        *(
            pct(stats.share(n))
            for n in (stats.truncated_rows, stats.cut_inside_window_rows, stats.window_complete_rows)
        ),
        *(_n(v) for v in (stats.p50, stats.p90, stats.p95, stats.p99, stats.max)),
    ]


def show(console: Console, table: Table) -> None:
    """Print `table` fitted to the console's width (fit)."""
    console.print(fit(table, console.width))


def _table(title: str, keys: tuple[str, ...], rows: list[list[str]]) -> Table:
    table = Table(title=title, title_justify="left")
    for key in keys:
        # only the free text wraps: figures and names stay whole, the summary takes what width is left
        text = key in {"config", "shard", "configs", "source", "prompt tokens", "check", "summary"}
        table.add_column(key, justify="left" if text else "right", no_wrap=key != "summary")
    for row in rows:
        table.add_row(*row)
    return table


def configs_table(configs: list) -> Table:
    """`dflash configs`: the configs of a data dir (store.configs.list_configs) side by side, the latest first."""
    from dflash_assets.store.configs import table as configs_rows

    table = Table(
        title="Configs of the data dir, the latest (the most recently written) first; rows are turn rows",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    columns, rows = configs_rows(configs)
    for key in columns:
        table.add_column(key, justify="left" if key in ("config", "cap, policy") else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    return fit(table, console_for_output().width, ("last written (UTC)", "judged at", "shards"))


def headline(summary_md: str) -> str:
    """The first paragraph of a check summary without Markdown emphasis."""
    return summary_md.split("\n\n")[0].translate(str.maketrans("", "", "*`"))


def plan_table(answer: CapAnswer) -> Table:
    """The cap plan at the current cap and the larger candidates: share cut, output tokens, context needed."""
    plan = answer.plan
    if plan is None:
        raise ValueError(f"config {answer.config_hash} has no cap plan to tabulate")
    fits = f"fits {num(plan.context_length)}" if plan.context_length else "fits context"
    table = Table(box=None, pad_edge=False, padding=(0, 2), title_justify="left")
    for key in ("cap", "cut at the cap", "output tokens vs now", "context needed", fits):
        table.add_column(key, justify="right" if key != fits else "left", no_wrap=True)
    now = plan.at(plan.cap).output_tokens.value
    for e in plan.estimates:
        if e.cap < plan.cap:
            continue
        r = e.truncation_rate
        cut = pct(r.value) + (" measured" if e.measured else f" ({pct(r.low)}-{pct(r.high)})")
        mark = " <- recommended" if answer.recommended and e.cap == answer.recommended.cap else ""
        table.add_row(
            f"{num(e.cap)}{' (now)' if e.cap == plan.cap else ''}",
            cut,
            f"{e.output_tokens.value / now:.2f}x",
            _n(e.context_needed_max),
            (
                "-"
                if e.prompts_over_context is None  # None with fits_context
                else "yes"
                if e.fits_context
                else f"no: {num(e.prompts_over_context)} prompts over"
            )
            + mark,
        )
    return table


def print_answer(
    answer: CapAnswer, console: Console, command: str = "dflash demo", export_command: str | None = None
) -> None:
    """One config's answer (CapAnswer.lines), then its cap plan."""
    for line in answer.lines(command, export_command):
        say_with_command(console, line)
    print_plan(answer, console)


def print_plan(answer: CapAnswer, console: Console) -> None:
    """The cap plan of one config: the candidate caps' shares cut, and the tokens under the window policy."""
    if answer.plan is None:
        console.print(f"  no cap plan: {answer.plan_error}", highlight=False, markup=False)
        return
    if not answer.truncated:
        return
    show(console, plan_table(answer))
    if answer.window_plan is not None:
        for line in window_plan_lines(
            answer.window_plan, f"--cap-policy window --trainer-max-length {answer.max_length}"
        ):
            console.print(line, highlight=False, markup=False)


HEAD_OTHERS = 4  # the report's head lists at most this many other configs, one line each


def print_answers(
    data_dir: str | Path,
    console: Console | None = None,
    quality: QualitySettings = QualitySettings(),
    full: bool = False,
    command: str = "dflash backfill",
    configs: str = "dflash configs",
    export: str = "dflash export --config HASH",
) -> list[CapAnswer]:
    """`dflash report`'s head: the latest config's answer, every other config in a line (at most HEAD_OTHERS); with
    `full`, every config's answer and cap plan. `command`, `configs`, `export`: the commands as printed."""
    console = console or Console()
    answers = cap_answers(data_dir, quality)
    console.print(
        f"[bold]The answer[/] of {len(answers)} config{'s' if len(answers) != 1 else ''}, the latest first "
        f"(limit: {pct(quality.truncation_rate_max)} cut inside the window; definitions: docs/quality-gate.md)",
        highlight=False,
    )
    for i, answer in enumerate(answers):
        export_command = export.replace("HASH", answer.config_hash)
        if full:
            print_answer(answer, console, command, export_command)
        elif i == 0:
            for line in answer.lines(command, export_command):
                say_with_command(console, line)
        elif i <= HEAD_OTHERS:
            console.print(answer.one_line(), highlight=False, markup=False)
    if not full and len(answers) > 1 + HEAD_OTHERS:
        say_with_command(console, f"{len(answers) - 1 - HEAD_OTHERS} more configs: {configs}")
    return answers


# the report's breakdowns: title, the report's key, (header, column) of the columns that name a row
BREAKDOWNS = (
    (
        "By config (each config's own rows)",
        "by_config",
        (("config", "config_hash"), ("cap", "config_cap"), ("shards", "shards")),
    ),
    ("By shard (all configs)", "by_shard", (("shard", "shard"), ("configs", "configs"))),
    ("By prompt length (all configs)", "by_prompt_length", (("prompt tokens", "bucket"),)),
    ("By source (all configs)", "by_source", (("source", "source"),)),
)


def print_report(
    data_dir: str | Path,
    console: Console | None = None,
    shard: str | None = None,
    quality: QualitySettings = QualitySettings(),
    checks: bool = True,
) -> dict[str, Any]:
    """Print the length-quality summary, breakdowns, overflows and checks as tables; return the report dict."""
    console = console or Console()
    report = length_quality(data_dir, shard, max_length=quality.trainer.max_length, runaway=quality.runaway)
    scope = f"shard {shard}" if shard else "all shards"
    pooled = _length_cells(LengthStats.of(report))
    show(console, _table(f"Length quality, {scope}, all configs pooled", LENGTH_COLUMNS, [pooled]))
    console.print(
        f"Percentiles: {PERCENTILE_DEFINITION}. Cut inside the window / window-complete: judged against "
        f"{quality.trainer.named()}.",
        highlight=False,
    )
    for title, key, named_by in BREAKDOWNS:  # the configs side by side, then the pooled breakdowns
        named = [[_n(row[c]) if isinstance(row[c], int) else str(row[c]) for _, c in named_by] for row in report[key]]
        cells = [n + _length_cells(LengthStats.of(row)) for n, row in zip(named, report[key], strict=True)]
        show(console, _table(title, (*(h for h, _ in named_by), *LENGTH_COLUMNS), cells))
    o = report["overflow"]
    headers = (
        "completion rows over context",
        "rejected prompts over context",
        f"rows over max_length {o['max_length']}",
    )
    show(console, _table("Overflow", headers, [[num(o[k]) for k in OVERFLOW_KEYS]]))
    if checks:
        console.print(checks_table(run_checks(data_dir, shard, quality=quality)))
    return report


def checks_table(outcomes: list) -> Table:
    """The checks' results, blocking ones marked, each with its summary's first paragraph."""
    return _table(
        "Checks (all configs)",
        ("check", "gate", "severity", "result", "summary"),
        [
            [
                o.name,
                "blocking" if o.blocking else "",
                o.severity,
                "PASS" if o.passed else "FAIL",
                headline(o.summary_md),
            ]
            for o in outcomes
        ],
    )
