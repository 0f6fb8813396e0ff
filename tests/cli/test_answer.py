"""One config, one answer, the same in every view: after a run cut at the cap (`dflash demo --max-output-tokens 4096`),
the report's head, `dflash configs`, the UI's metadata and the pictures say what a recount of the Parquet rows says
by the definitions of rules.FIGURES, and what the export holds is what its files hold; every screen fits 100
columns without "…"."""

import json
import re
from pathlib import Path

import dagster as dg
import duckdb
import pytest
from PIL import Image

from dflash_assets.generation.runaway import is_runaway
from tests.support.cli import demo_slice, dflash, home

pytestmark = pytest.mark.long

CAP, WINDOW = 4096, 4096  # a cap that cuts; the trainer's window by default
HEAD_LINES = 20
# the run's config and answer (6-8 lines), the rejects (their counts, the first three with their lines, the command
# that lists them all: 6 lines), the checks, the UI, the next command
CLOSING_LINES = 21


@pytest.fixture(scope="module")
def cut_at_4096(tmp_path_factory):
    """A run at a 4096 cap on one shard of the demo's prompts, one server; then `dflash report` and `dflash configs`
    as a pipe reads them (100 columns)."""
    tmp = tmp_path_factory.mktemp("cut-at-4096")
    env = home(tmp, "home") | {
        "DFLASH_PROMPTS": str(demo_slice(tmp, 100)),
        "DFLASH_SHARD_SIZE": "100",
        "DFLASH_NUM_SERVERS": "1",
        "COLUMNS": "100",
    }
    demo = dflash("demo", "--cap-policy", "fixed", "--max-output-tokens", str(CAP), env=env, cwd=tmp)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    # backfill of the same config: every row committed, so it only judges and answers, as demo does
    again = ("backfill", "--cap-policy", "fixed", "--max-output-tokens", str(CAP))
    views = {args: dflash(*args, env=env, cwd=tmp) for args in [("report",), ("report", "--full"), ("configs",), again]}
    for args, result in views.items():
        assert result.returncode == 0, f"{args}: {result.stdout}{result.stderr}"
    return env, {"demo": demo.stdout} | {
        " ".join(args[:1] if args == again else args): r.stdout for args, r in views.items()
    }


def recount(data: Path) -> dict:
    """The answer's figures of the one config, recounted from the Parquet rows by rules.FIGURES' definitions."""
    rows = duckdb.sql(
        f"select shard, prompt_id, finish_reason, prompt_tokens, completion_tokens, content, reasoning_content "
        f"from read_parquet('{data}/completions/**/*.parquet', union_by_name = true)"
    ).fetchall()
    cut = [r for r in rows if r[2] == "length"]
    loops = [r for r in cut if is_runaway(r[5] if (r[5] or "").strip() else r[6])]
    complete = [r for r in cut if r[3] + r[4] >= WINDOW > r[3] and r not in loops]
    lengths = sorted(r[4] for r in rows)
    rank = lambda q: lengths[-(-int(q * 100) * len(lengths) // 100) - 1]  # noqa: E731 - nearest rank
    return {
        "rows": len(rows),
        "conversations": len({(r[0], r[1]) for r in rows}),
        "cut at the cap": len(cut),
        "cut inside the window": sum(r[3] + r[4] < WINDOW for r in cut),
        "window-complete": len(complete),
        "filling the window": sum(r[3] >= WINDOW for r in rows),
        "P50": rank(0.5),
        "P90": rank(0.9),
        "P99": rank(0.99),
    }


def said(text: str, expected: dict) -> dict:
    """The figures a view's answer says (CapAnswer.headline's words), to compare with `expected`'s."""
    flat = re.sub(r"\s+", " ", text)
    found = {}
    m = re.search(r"([\d,]+) turn rows of ([\d,]+) conversations", flat)
    found["rows"], found["conversations"] = (int(g.replace(",", "")) for g in m.groups()) if m else (None, None)
    for name in ("cut at the cap", "cut inside the window", "window-complete"):
        m = re.search(rf"{name} ([\d.]+)% \(([\d,]+)", flat)
        found[name] = int(m.group(2).replace(",", "")) if m else None
        share = f"{100 * expected[name] / expected['rows']:.2f}"
        assert m and m.group(1) == share, f"{name}: {flat[:600]}"
    m = re.search(r"filling the window ([\d,]+)", flat)
    found["filling the window"] = int(m.group(1).replace(",", "")) if m else None
    for p in ("P50", "P90", "P99"):
        m = re.search(rf"{p} ([\d,]+)", flat)
        found[p] = int(m.group(1).replace(",", "")) if m else None
    return found


def test_every_view_says_the_answer_a_recount_of_the_parquet_rows_says(cut_at_4096):
    from dflash_assets.quality.report.answer import cap_answers

    env, out = cut_at_4096
    data = Path(env["DFLASH_DATA_DIR"])
    expected = recount(data)
    assert expected["cut at the cap"] > 0  # the cap cuts
    (answer,) = cap_answers(data)
    head = out["report"]
    assert said(head, expected) == expected
    assert said(after_the_table(out["demo"]), expected) == expected  # the run's own closing lines
    # the closing lines a run prints (the CLI's demo and backfill print CapAnswer.lines)
    assert said("\n".join(answer.lines("dflash demo")), expected) == expected
    # the UI: the answer is the first metadata row of the summary and of the shard's report
    instance = dg.DagsterInstance.from_config(env["DAGSTER_HOME"])
    for key in ("length_quality_summary", "length_quality_report"):
        (record,) = instance.fetch_materializations(dg.AssetKey(key), limit=1).records
        metadata = record.asset_materialization.metadata
        assert list(metadata)[:2] == ["answer", "cap_plan_at_a_glance"], key
        assert said(metadata["answer"].value, expected) == expected, key
    # each picture's Description
    pictures = sorted((data / "reports").glob("*-*.png"))
    assert {p.name for p in pictures} == {
        f"completion_lengths-{answer.config_hash}.png",
        f"cap_plan-{answer.config_hash}.png",
    }
    for picture in pictures:
        description = Image.open(picture).info["Description"]
        figures = said(description, expected)
        assert {k: figures[k] for k in ("rows", "cut at the cap", "P90")} == {
            k: expected[k] for k in ("rows", "cut at the cap", "P90")
        }, picture.name


def test_what_the_answer_says_of_the_export_is_what_the_training_set_holds(cut_at_4096):
    from dflash_assets.quality.report.answer import cap_answers

    env, out = cut_at_4096
    data = Path(env["DFLASH_DATA_DIR"])
    (answer,) = cap_answers(data)
    folder = data / "training" / answer.config_hash
    lines = sum(  # the train and the held-out files (quality/training/split.py)
        len((folder / name).read_text().splitlines()) for name in ("training_set.jsonl", "held_out_set.jsonl")
    )
    manifest = json.loads((folder / "manifest.json").read_text())
    assert answer.exported is not None and answer.exported.samples == lines == manifest["rows"]
    m = re.search(r"export: ([\d,]+) samples", re.sub(r"\s+", " ", out["report"]))
    assert m and int(m.group(1).replace(",", "")) == lines


def test_dflash_configs_shows_the_share_cut_at_the_cap_beside_the_share_cut_inside_the_window(cut_at_4096):
    env, out = cut_at_4096
    expected = recount(Path(env["DFLASH_DATA_DIR"]))
    lines = out["configs"].splitlines()
    rule = next(i for i, line in enumerate(lines) if "───" in line)
    header = re.sub(r"\s+", " ", " ".join(lines[rule - 3 : rule]))  # a header may wrap at words
    assert "cut at the cap" in header and "cut inside" in header, out["configs"]
    row = next(line for line in out["configs"].splitlines() if re.match(r"\s*[0-9a-f]{12}\s", line))
    at_cap = f"{100 * expected['cut at the cap'] / expected['rows']:.2f}% ({expected['cut at the cap']})"
    inside = f"{100 * expected['cut inside the window'] / expected['rows']:.2f}% ({expected['cut inside the window']})"
    assert at_cap in row and inside in row and row.index(at_cap) < row.index(inside), row


def after_the_table(demo: str) -> str:
    """What `dflash demo` prints after its per-shard table (and the blank line rich ends a table with)."""
    lines = demo.splitlines()
    last_row = max(i for i, line in enumerate(lines) if re.match(r"\s+\d{5}\s", line))
    return "\n".join(line for line in lines[last_row + 1 :] if line.strip())


@pytest.mark.parametrize("view", ["demo", "backfill"])
def test_the_demo_and_backfill_end_with_the_answer_and_the_next_command_in_at_most_21_lines(cut_at_4096, view):
    _, out = cut_at_4096
    closing = after_the_table(out[view]).splitlines()
    assert len(closing) <= CLOSING_LINES, out[view]
    assert closing[-1].strip().startswith(("DAGSTER_HOME=", "dflash ")), closing[-1]  # the next command, whole
    assert "dflash report --full" in out[view]  # the rest is one command away


def test_the_demo_tables_counts_add_up_and_equal_a_recount(cut_at_4096):
    env, out = cut_at_4096
    data = Path(env["DFLASH_DATA_DIR"])
    lines = out["demo"].splitlines()
    rule = next(i for i, line in enumerate(lines) if "───" in line)
    header = lines[rule - 1].split()
    (row,) = [dict(zip(header, line.split())) for line in lines[rule + 1 :] if re.match(r"\s+\d{5}\s", line)]
    figures = {k: int(row[k]) for k in ("prompts", "rejected", "done", "fail", "left")}
    assert figures["prompts"] == figures["rejected"] + figures["done"] + figures["fail"] + figures["left"], row
    parquet = lambda table: f"read_parquet('{data}/{table}/**/*.parquet', union_by_name = true)"  # noqa: E731
    failures = list(data.glob("failures/**/*.parquet"))
    assert figures == {
        "prompts": 100,  # the shard's lines
        "rejected": duckdb.sql(f"select count(*) from {parquet('rejects')}").fetchall()[0][0],
        "done": duckdb.sql(f"select count(distinct prompt_id) from {parquet('completions')}").fetchall()[0][0],
        "fail": duckdb.sql(f"select count(*) from {parquet('failures')}").fetchall()[0][0] if failures else 0,
        "left": 0,
    }


@pytest.mark.parametrize("view", ["demo", "backfill", "report", "report --full", "configs"])
def test_no_line_is_wider_than_100_columns_and_no_figure_is_cut(cut_at_4096, view):
    _, out = cut_at_4096
    lines = out[view].splitlines()

    # a command, a path or a command's environment is printed whole, so it can be copied (console.verbatim): past
    # those, every line (prose, tables) fits in 100 columns
    def prose(line: str) -> str:
        if re.match(r"(?:[A-Z_]+=\S+ )*(?:dflash|uv run) ", line.strip()):
            return ""  # a command on a line of its own
        return " ".join(word for word in line.split(" ") if "/" not in word and "=" not in word)

    assert max(len(prose(line)) for line in lines) <= 100, max(lines, key=lambda line: len(prose(line)))
    assert not [line for line in lines if "…" in line]


def test_the_report_leads_with_the_answer_and_the_next_command_in_at_most_20_lines(cut_at_4096):
    _, out = cut_at_4096
    head = out["report"].splitlines()
    assert len(head) <= HEAD_LINES, out["report"]
    nxt = next(i for i, line in enumerate(head) if line.startswith("next:"))
    # the next command whole, with the data it is of (on the line, or on its own line after it)
    assert " dflash backfill " in f" {head[nxt]} {head[nxt + 1]} " and "--data-dir" in head[nxt] + head[nxt + 1], head
    assert "dflash report --full" in head[-1]
    assert len(out["report --full"].splitlines()) > len(head)  # the tables are one flag away


def test_the_checks_metadata_shows_shares_as_percentages_never_a_raw_float(cut_at_4096):
    env, _ = cut_at_4096
    instance = dg.DagsterInstance.from_config(env["DAGSTER_HOME"])
    key = dg.AssetCheckKey(dg.AssetKey("length_quality_report"), "truncation_rate")
    (record,) = instance.event_log_storage.get_asset_check_execution_history(key, limit=1)
    metadata = record.event.asset_check_evaluation.metadata
    assert metadata["truncation_rate"].value == f"{100 * recount_share(env):.2f}%", metadata
    raw = {k: v.value for k, v in metadata.items() if isinstance(v.value, float)}
    assert raw == {}, raw


def recount_share(env) -> float:
    expected = recount(Path(env["DFLASH_DATA_DIR"]))
    return expected["cut at the cap"] / expected["rows"]


def test_the_shard_reports_by_config_has_each_configs_cap(cut_at_4096):
    env, _ = cut_at_4096
    instance = dg.DagsterInstance.from_config(env["DAGSTER_HOME"])
    (record,) = instance.fetch_materializations(dg.AssetKey("length_quality_report"), limit=1).records
    table = record.asset_materialization.metadata["by_config"].value
    head, _, *rows = table.splitlines()
    column = [c.strip() for c in head.strip("|").split("|")].index("config_cap")
    assert [[c.strip() for c in r.strip("|").split("|")][column] for r in rows] == [str(CAP)]


def test_a_cap_larger_than_any_models_context_is_refused_in_one_line_before_anything_runs(tmp_path):
    env = home(tmp_path, "home")
    result = dflash("demo", "--max-output-tokens", "100000000", env=env, cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "max_output_tokens 100,000,000 is larger than the largest context" in result.stderr
    assert not Path(env["DFLASH_DATA_DIR"]).exists()


def test_the_quality_gate_doc_tables_every_figure_with_its_unit():
    from dflash_assets.rules import FIGURES

    doc = (Path(__file__).parents[2] / "docs" / "quality-gate.md").read_text()
    table = dict(re.findall(r"^\| ([a-z -]+) \| (turn rows|conversations) \|", doc, re.M))
    assert table == {f.name: f.unit for f in FIGURES}
