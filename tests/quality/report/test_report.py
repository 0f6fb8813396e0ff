"""The length-quality report, the histogram and the terminal report."""

import base64
import io
import random
import warnings
from collections import defaultdict

from rich.console import Console

from dflash_assets.cli.console import print_report
from dflash_assets.quality import length_quality
from dflash_assets.quality.report.histogram import series
from tests.support.quality_data import (
    CONFIG_A,
    completion,
    completion_histogram_markdown,
    completion_histogram_png,
    config_of,
    load,
    nearest_rank,
    prompt,
    write,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def expected_stats(rows):
    values = [r["completion_tokens"] for r in rows]
    truncated = sum(r["finish_reason"] == "length" for r in rows)
    return {
        "rows": len(rows),
        "truncated_rows": truncated,
        "truncation_rate": truncated / len(rows),
        **{f"p{q}": nearest_rank(values, q / 100) for q in (50, 90, 95, 99)},
        "max": max(values),
    }


def grouped(rows, key):
    groups = defaultdict(list)
    for r in rows:
        groups[key(r)].append(r)
    return {k: expected_stats(v) for k, v in sorted(groups.items())}


def stats_of(entry):
    return {k: entry[k] for k in ("rows", "truncated_rows", "truncation_rate", "p50", "p90", "p95", "p99", "max")}


def bucket(tokens):
    edges = (512, 1024, 2048, 4096, 8192)
    lows = (0, *edges)
    for lo, hi in zip(lows, edges):
        if tokens < hi:
            return f"{lo}-{hi - 1}"
    return "8192+"


def test_length_quality_figures_overall_and_by_config_shard_source(defects_dir):
    rows = load(defects_dir, "completions")
    report = length_quality(defects_dir)
    assert stats_of(report) == expected_stats(rows)
    assert {(e["config_hash"], e["config_cap"]): stats_of(e) for e in report["by_config"]} == grouped(rows, config_of)
    assert {e["shard"]: stats_of(e) for e in report["by_shard"]} == grouped(rows, lambda r: r["shard"])
    assert {e["source"]: stats_of(e) for e in report["by_source"]} == grouped(rows, lambda r: r["source"])
    assert {e["shard"]: e["configs"] for e in report["by_shard"]} == {"s0": "a4096", "s1": "a4096,b8192"}


def test_length_quality_truncation_by_prompt_length_bucket(defects_dir):
    rows = load(defects_dir, "completions")
    report = length_quality(defects_dir)
    expected = grouped(rows, lambda r: bucket(r["prompt_tokens"]))
    assert {e["bucket"]: stats_of(e) for e in report["by_prompt_length"]} == expected


def test_length_quality_overflow_counts(defects_dir):
    rows, rejects = load(defects_dir, "completions"), load(defects_dir, "rejects")
    over = lambda r: r["prompt_tokens"] + r["max_output_tokens"] > r["server_context_length"]  # noqa: E731
    report = length_quality(defects_dir, max_length=4096)
    assert report["overflow"] == {
        "completion_rows_over_context": sum(map(over, rows)),
        "rejected_prompts_over_context": len(
            {(r["shard"], r["prompt_id"], r["config_hash"]) for r in rejects if r["stage"] != "source" and over(r)}
        ),
        "rows_over_max_length": sum(r["prompt_tokens"] + r["completion_tokens"] > 4096 for r in rows),
        "max_length": 4096,
    }


def test_length_quality_of_one_shard(defects_dir):
    rows = [r for r in load(defects_dir, "completions") if r["shard"] == "s0"]
    report = length_quality(defects_dir, shard="s0")
    assert report["scope"] == {"shard": "s0", "config_hash": None} and report["config_label"] == "all configs"
    assert stats_of(report) == expected_stats(rows)


def test_length_quality_with_18pct_cut_has_p90_equal_p99_equal_cap(cut_at_cap_dir):
    report = length_quality(cut_at_cap_dir)
    assert (report["p90"], report["p99"], report["max"]) == (4096, 4096, 4096)
    assert report["truncation_rate"] == 0.183
    assert "nearest-rank" in report["percentile_definition"]


def test_length_quality_of_an_empty_data_dir(tmp_path):
    report = length_quality(tmp_path)
    assert (report["rows"], report["truncation_rate"], report["p99"]) == (0, 0.0, None)
    assert report["by_config"] == []


def test_the_report_of_a_hundred_thousand_rows_fits_duckdb_held_to_16_mb(tmp_path, monkeypatch):
    """Conversations are counted per conversation first, not by DISTINCT over every row, which DuckDB holds whole: the
    report's three of them ran out of 16 MB at 100,000 rows."""
    rows = []
    for s in range(4):
        ps = [prompt(f"s{s}", i, 100, "code") for i in range(25_000)]
        write(tmp_path, "prompt_shards", f"s{s}", ps)
        shard = [completion(p, CONFIG_A, 50 + i % 3000, turn=1 + i % 2, turns=2) for i, p in enumerate(ps)]
        write(tmp_path, "completions", f"s{s}", shard)
        rows += shard
    monkeypatch.setenv("DFLASH_DUCKDB_MEMORY_LIMIT", "16MB")
    report = length_quality(tmp_path)
    # every prompt is a conversation of two turns; those whose row is turn 1 have no row of their last turn
    assert (report["conversations"], report["shortened_conversations"]) == (100_000, 50_000)
    assert stats_of(report) == expected_stats(rows)
    assert [(s["shard"], s["conversations"], s["shortened_conversations"]) for s in report["by_shard"]] == [
        (f"s{s}", 25_000, 12_500) for s in range(4)
    ]


def test_histogram_png_is_written_and_embedded_as_markdown(defects_dir, tmp_path):
    path = completion_histogram_png(defects_dir, tmp_path / "plots" / "lengths.png")
    assert path == tmp_path / "plots" / "lengths.png"
    assert path.read_bytes().startswith(PNG_MAGIC)
    markdown = completion_histogram_markdown(defects_dir)
    prefix = "![completion lengths](data:image/png;base64,"
    assert markdown.startswith(prefix) and markdown.endswith(")")
    assert base64.b64decode(markdown[len(prefix) : -1]) == path.read_bytes()  # same data, same picture


def test_the_compact_picture_fits_the_uis_inline_limit_and_draws_each_configs_survival_with_its_cap(defects_dir):
    from urllib.parse import unquote
    from xml.etree import ElementTree

    from dflash_assets.quality.report.histogram import INLINE_LIMIT, compact_markdown

    configs = series(defects_dir)
    markdown = compact_markdown(configs, window_reach=3000)
    prefix = "![length survival](data:image/svg+xml,"
    assert markdown.startswith(prefix) and len(markdown) < INLINE_LIMIT
    target = markdown[len(prefix) : -1]
    assert " " not in target and "(" not in target and ")" not in target  # one Markdown link target, unbroken
    svg = ElementTree.fromstring(unquote(markdown[len(prefix) : -1]))
    ns = "{http://www.w3.org/2000/svg}"
    curves = svg.findall(f"{ns}polyline")
    assert len(curves) == min(3, sum(len(v) > 0 for *_, v in configs))
    dashed = [p for p in svg.findall(f"{ns}path") if p.get("stroke-dasharray") == "4"]
    assert len(dashed) == len({cap for _, cap, _, _ in configs if cap is not None})  # a line per cap
    # the first point of each curve is the share of rows longer than 0 tokens: all of them, at the top
    (_, _, _, values), first = configs[0], curves[0].get("points").split()[0]
    assert int(first.split(",")[1]) == round((1 - (values > 0).mean()) * 86) + 2
    # many configs: still under the limit (fewer points a curve), never a broken picture
    assert len(compact_markdown(configs * 4, window_reach=None)) < INLINE_LIMIT


def test_the_cap_plans_time_column_shows_a_time_even_for_seconds():
    from dflash_assets.quality.report.cap_plan import hours_text

    assert [hours_text(h) for h in (2.25, 0.5, 10 / 3600, 0.1 / 3600)] == ["2.2 h", "30 min", "10 s", "under 1 s"]


def test_the_histogram_draws_a_window_policy_config_as_one_series_at_its_cap(tmp_path):
    # under --cap-policy window each row asks the window's rest after its own prompt: 40 prompt lengths, 40 row caps
    rng = random.Random(5)
    window = dict(config_hash="w8192", max_output_tokens=8192, server_context_length=16384, enable_thinking=True)
    ps = [prompt("w0", i, 100 + 37 * i, "sharegpt") for i in range(40)]
    rows = [
        completion(
            p,
            window,
            rng.randint(50, 3000),
            max_output_tokens=8192 - p["prompt_tokens"],
            policy_cap=8192,
            trainer_max_length=8192,
        )
        for p in ps
    ]
    write(tmp_path, "prompt_shards", "w0", ps)
    write(tmp_path, "completions", "w0", rows + [completion(p, CONFIG_A, 4096, "length") for p in ps[:5]])
    drawn = series(tmp_path)
    assert [(h, cap, n) for h, cap, n, _ in drawn] == [("a4096", 4096, 5), ("w8192", 8192, 40)]
    assert sorted(drawn[1][3].tolist()) == sorted(r["completion_tokens"] for r in rows)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a legend of a line per row cap did not fit: "Tight layout not applied"
        assert completion_histogram_png(tmp_path, tmp_path / "lengths.png").read_bytes().startswith(PNG_MAGIC)


def test_everything_the_histogram_draws_lies_inside_the_picture_with_the_widest_counts():
    # the margins are fixed (quality/report/pictures.py): the widest y tick labels are six digits (matplotlib writes a
    # million and more as 1e6 times a short label); the axes' tight box holds what is drawn (title, labels, the
    # tick labels in view)
    import numpy as np

    from dflash_assets.quality.report.histogram import draw

    for rows, widest in ((12, 1), (900_000, 6), (3_000_000, 1)):
        values = np.r_[np.full(rows, 4096), np.arange(1, 4000)]
        fig = draw(
            [("0123456789ab", 4096, len(values), values), ("ba9876543210", 8192, 40, np.arange(40) * 200)], None, 64
        )
        fig.canvas.draw()
        [ax] = fig.axes
        drawn = ax.get_tightbbox(fig.canvas.get_renderer())
        assert max(len(t.get_text()) for t in ax.get_yticklabels()) >= widest
        assert fig.bbox.x0 <= drawn.x0 and drawn.x1 <= fig.bbox.x1, (rows, drawn, fig.bbox)
        assert fig.bbox.y0 <= drawn.y0 and drawn.y1 <= fig.bbox.y1, (rows, drawn, fig.bbox)


def test_print_report_prints_rates_with_two_decimals(cut_at_cap_dir):
    out = io.StringIO()
    report = print_report(cut_at_cap_dir, console=Console(file=out, width=200, color_system=None))
    text = out.getvalue()
    assert report["rows"] == 1000
    for expected in (
        "Length quality, all shards",
        "18.30%",  # truncation rate
        "4,096",  # P90 = P99 = cap
        "By config",
        "a4096",
        "By prompt length",
        "By source",
        "sharegpt",
        "nearest-rank",
        "truncation_rate",
        # a cap of 4096 with the default 4096 window: every cut lies past the window
        "0.00% of 1,000 rows were cut inside the trainer's window max_length 4,096",
    ):
        assert expected in text
    values = [r["completion_tokens"] for r in load(cut_at_cap_dir, "completions")]
    percentiles = [f"{nearest_rank(values, q):,}" for q in (0.5, 0.9, 0.95, 0.99)]
    overall = next(line for line in text.splitlines() if "18.30%" in line and "│" in line)
    # cut inside the 4096 window 0.00%, window-complete 18.30%
    assert [cell.strip() for cell in overall.split("│")[1:-1]] == [
        "1,000",
        "183",
        "18.30%",
        "0.00%",
        "18.30%",
        *percentiles,
        "4,096",
    ]
