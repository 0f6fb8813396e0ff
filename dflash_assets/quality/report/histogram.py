"""A histogram of completion lengths per config with each cap marked: a spike at the cap is truncation.
(The figure and its PNG: pictures.py.)
"""

from pathlib import Path
from typing import Any
from urllib.parse import quote

import duckdb
import numpy as np
from matplotlib.figure import Figure

from dflash_assets.quality.report.lengths import length_quality_of
from dflash_assets.quality.report.pictures import new_figure, png
from dflash_assets.quality.tables import one, open_quality_db
from dflash_assets.settings import RunawaySettings, TrainerSettings

Series = list[tuple[str, int | None, int, np.ndarray]]  # (config_hash, the config's cap, rows, completion lengths)


def series(data_dir: str | Path, shard: str | None = None) -> Series:
    """A series per config, at its config_cap (tables.py): under the window policy each row asks its own cap."""
    with open_quality_db(data_dir, shard) as con:
        return series_of(con)


def series_of(con: duckdb.DuckDBPyConnection, config_hash: str | None = None) -> Series:
    """`series` of a database open_quality_db opened (the report's, which it shares): of one config, or of each."""
    configs = con.execute(
        "SELECT config_hash, config_cap, count(*) FROM completions WHERE $h IS NULL OR config_hash = $h "
        "GROUP BY ALL ORDER BY ALL",
        {"h": config_hash},
    ).fetchall()
    return [
        (
            h,
            cap,
            rows,
            con.execute(
                "SELECT completion_tokens FROM completions WHERE config_hash IS NOT DISTINCT FROM $h "
                "AND config_cap IS NOT DISTINCT FROM $cap AND completion_tokens IS NOT NULL",
                {"h": h, "cap": cap},
            ).fetchnumpy()["completion_tokens"],
        )
        for h, cap, rows in configs
    ]


def labels(configs: Series) -> list[str]:
    """Each series' legend label, also the PNG's Description (what a reader of the file can check it shows)."""
    return [f"{h} (cap {cap}): {rows:,} rows" for h, cap, rows, _ in configs]


def draw(configs: Series, shard: str | None, bins: int) -> Figure:
    """The histogram of `series`' configs."""
    fig = new_figure(8, 4.5)
    ax = fig.add_subplot()
    caps = sorted({cap for _, cap, _, _ in configs if cap is not None})
    top = max([*caps, *(int(values.max()) for *_, values in configs if len(values)), 1])
    # Edges sit half a token above multiples of top/bins (a power-of-two cap is one of them): a row that hit
    # the cap lands in the bin just left of the cap line, never right of it as if it had overshot.
    edges = np.linspace(0, top, bins + 1) + 0.5
    edges[0] = -0.5
    cap_colors: dict[int, object] = {}
    for (_, cap, _, values), label in zip(configs, labels(configs)):
        # matplotlib's stubs: bins takes any array (not only a Sequence); a step histogram's patches are a list
        _, _, patches = ax.hist(values, bins=edges, histtype="step", linewidth=1.5, label=label)  # type: ignore[arg-type]
        if cap is not None:
            cap_colors.setdefault(cap, patches[0].get_edgecolor())  # type: ignore[index, union-attr]
    for cap in caps:  # dashed, in the colour of the (first) config that has this cap
        ax.axvline(cap + 0.5, color=cap_colors[cap], linestyle="--", linewidth=1, label=f"cap {cap}")
    ax.set_xlabel("completion_tokens")
    ax.set_ylabel("rows")
    which = f"config {configs[0][0]}" if len({h for h, *_ in configs}) == 1 else "each config"
    ax.set_title(f"Completion lengths of {which} ({'shard ' + shard if shard else 'all shards'})")
    if configs:
        ax.legend(loc="best", fontsize="small")
    return fig


INLINE_LIMIT = 1000  # Dagster 1.13's UI shows a Markdown value inline only under 1,000 characters (else a link)
COMPACT_W, COMPACT_H = 240, 90  # the compact picture's size in pixels (an SVG: it scales without blur)


def compact_markdown(configs: Series, window_reach: int | None) -> str:
    """A small SVG of the length survival per config, the caps dashed and the window's reach dotted, as a data URI
    in Markdown under the UI's inline limit (fewer points a curve until it fits)."""
    caps = sorted({cap for _, cap, _, _ in configs if cap is not None})
    top = max([*caps, *(int(v.max()) for *_, v in configs if len(v)), window_reach or 0, 1])
    x = lambda v: round(v / top * (COMPACT_W - 4)) + 2  # noqa: E731
    y = lambda s: round((1 - s) * (COMPACT_H - 4)) + 2  # noqa: E731
    for points in (32, 20, 12, 6):
        grid = np.linspace(0, top, points)
        marks = "".join(f"<path d='M{x(c)} 0V{COMPACT_H}' stroke='#c33' stroke-dasharray='4'/>" for c in caps)
        if window_reach:
            marks += f"<path d='M{x(window_reach)} 0V{COMPACT_H}' stroke='#36c' stroke-dasharray='1 2'/>"
        curves = "".join(
            f"<polyline fill='none' stroke='{color}' points='"
            + " ".join(f"{x(g)},{y(float((values > g).mean()))}" for g in grid)
            + "'/>"
            for (_, _, _, values), color in zip(configs[:3], ("#222", "#888", "#bbb"))
            if len(values)
        )
        svg = (
            f"<svg xmlns='http://www.w3.org/2000/svg' width='{COMPACT_W}' height='{COMPACT_H}'>"
            f"<rect width='100%' height='100%' fill='white' stroke='#ccc'/>{marks}{curves}</svg>"
        )
        md = "![length survival](data:image/svg+xml," + quote(svg, safe="/:=',.") + ")"
        if len(md) < INLINE_LIMIT:
            return md
    return "(too many configs for the compact picture: see completion_lengths)"


def histogram_png(configs: Series, shard: str | None, bins: int = 64, answer: str = "") -> bytes:
    """The histogram's PNG bytes, its legend's labels in the PNG's Description, then the config's `answer`
    (CapAnswer.description) when it draws one config."""
    return png(draw(configs, shard, bins), description="; ".join(labels(configs)) + (f". {answer}" if answer else ""))


def write_histogram(
    configs: Series,
    path: str | Path,
    shard: str | None,
    bins: int = 64,
    answer: str = "",
) -> Path:
    """Write the histogram PNG of `series`' configs to `path` and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(histogram_png(configs, shard, bins, answer))
    return path


def report_and_histogram(
    data_dir: str | Path,
    path: str | Path,
    shard: str | None = None,
    max_length: int = TrainerSettings().max_length,
    runaway: RunawaySettings = RunawaySettings(),
    config_hash: str | None = None,
) -> tuple[dict[str, Any], Path]:
    """`report.length_quality` of `shard` (None: all shards) and of `config_hash` (None: all configs), and its
    histogram of the same config written to `path`, from one read of the rows (the length_quality assets draw both)."""
    with open_quality_db(data_dir, shard, runaway=runaway, max_length=max_length) as con:
        report = length_quality_of(con, shard, max_length, config_hash=config_hash)
        configs = series_of(con, config_hash)
        (prompt,) = one(
            con,
            "SELECT median(prompt_tokens)::BIGINT FROM completions WHERE $h IS NULL OR config_hash = $h",
            {"h": config_hash},
        ) or (None,)
    # the window's reach on the completion axis, for the median prompt: a completion past it is never trained on
    report["compact_histogram"] = compact_markdown(configs, max_length - prompt if prompt is not None else None)
    return report, write_histogram(configs, path, shard)
