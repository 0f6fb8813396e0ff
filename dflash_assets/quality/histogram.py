"""A histogram of completion lengths per config with each cap marked: a spike at the cap is truncation.
(The figure and its PNG: pictures.py.)
"""

import base64
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
from matplotlib.figure import Figure

from dflash_assets.quality.pictures import new_figure, png
from dflash_assets.quality.report import length_quality_of
from dflash_assets.quality.tables import open_quality_db
from dflash_assets.settings import RunawaySettings, TrainerSettings


def series(data_dir: str | Path, shard: str | None = None) -> list[tuple[str, int | None, int, np.ndarray]]:
    """(config_hash, the config's cap, rows, completion lengths), a series per config. Under the window policy
    each row asks its own max_output_tokens (the window's rest after its prompt): the config's cap is config_cap
    (tables.py), as the report groups them; a series per row cap would draw a line per prompt length."""
    with open_quality_db(data_dir, shard) as con:
        return series_of(con)


def series_of(con: duckdb.DuckDBPyConnection) -> list[tuple[str, int | None, int, np.ndarray]]:
    """`series` of a database open_quality_db opened (the report's, which it shares)."""
    configs = con.execute(
        "SELECT config_hash, config_cap, count(*) FROM completions GROUP BY ALL ORDER BY ALL"
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


def draw(configs: list[tuple[str, int | None, int, np.ndarray]], shard: str | None, bins: int) -> Figure:
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
    for h, cap, rows, values in configs:
        label = f"{h} (cap {cap}): {rows:,} rows"
        _, _, patches = ax.hist(values, bins=edges, histtype="step", linewidth=1.5, label=label)
        cap_colors.setdefault(cap, patches[0].get_edgecolor())
    for cap in caps:  # dashed, in the colour of the (first) config that has this cap
        ax.axvline(cap + 0.5, color=cap_colors[cap], linestyle="--", linewidth=1, label=f"cap {cap}")
    ax.set_xlabel("completion_tokens")
    ax.set_ylabel("rows")
    ax.set_title(f"Completion lengths ({'shard ' + shard if shard else 'all shards'})")
    if configs:
        ax.legend(loc="best", fontsize="small")
    return fig


def completion_histogram_png(data_dir: str | Path, path: str | Path, shard: str | None = None, bins: int = 64) -> Path:
    """Write the histogram PNG to `path` and return the path."""
    return write_histogram(series(data_dir, shard), path, shard, bins)


def write_histogram(
    configs: list[tuple[str, int | None, int, np.ndarray]], path: str | Path, shard: str | None, bins: int = 64
) -> Path:
    """Write the histogram PNG of `series`' configs to `path` and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png(draw(configs, shard, bins)))
    return path


def report_and_histogram(
    data_dir: str | Path,
    path: str | Path,
    shard: str | None = None,
    max_length: int = TrainerSettings().max_length,
    runaway: RunawaySettings = RunawaySettings(),
) -> tuple[dict[str, Any], Path]:
    """`report.length_quality` of `shard` (None: all shards) and its histogram written to `path`, from one read of
    the rows (the length_quality assets draw both)."""
    with open_quality_db(data_dir, shard, runaway=runaway, max_length=max_length) as con:
        report, configs = length_quality_of(con, shard, max_length), series_of(con)
    return report, write_histogram(configs, path, shard)


def completion_histogram_markdown(data_dir: str | Path, shard: str | None = None, bins: int = 64) -> str:
    """The histogram as a Markdown image with a base64 data URI, for Dagster Markdown metadata."""
    data = base64.b64encode(png(draw(series(data_dir, shard), shard, bins))).decode("ascii")
    return f"![completion lengths](data:image/png;base64,{data})"
