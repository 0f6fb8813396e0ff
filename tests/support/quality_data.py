"""Data sets for the quality tests: real Parquet files with the pipeline's schemas, known distributions and
injected defects, plus a plain-Python reader so expected figures never come from the SQL under test. The data
sets are built once a session by the fixtures `defects_dir`, `clean_dir` and `cut_at_cap_dir` (tests/conftest.py)."""

import json
import random
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_assets import rules
from dflash_assets.quality import run_checks
from dflash_assets.store.schema import COMPLETION_SCHEMA, FAILURE_SCHEMA, PROMPT_SCHEMA, REJECT_SCHEMA

T0 = datetime(2026, 1, 1, tzinfo=UTC)
CONFIG_A = dict(config_hash="a4096", max_output_tokens=4096, server_context_length=16384, enable_thinking=True)
CONFIG_B = dict(config_hash="b8192", max_output_tokens=8192, server_context_length=16384, enable_thinking=False)
CONFIG_C = dict(config_hash="c8192", max_output_tokens=8192, server_context_length=8192, enable_thinking=True)
SOURCES = ("gsm8k", "sharegpt", "code")
SCHEMAS = {
    "prompt_shards": PROMPT_SCHEMA,
    "rejects": REJECT_SCHEMA,
    "completions": COMPLETION_SCHEMA,
    "failures": FAILURE_SCHEMA,
}


def write(data_dir: Path, table: str, shard: str, rows: list[dict], part: str = "part-0000", stage: str | None = None):
    schema = SCHEMAS[table]
    folder = data_dir / table / f"shard={shard}"
    if stage:
        folder = folder / f"stage={stage}"
    folder.mkdir(parents=True, exist_ok=True)
    name = "prompts" if table == "prompt_shards" else part
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), folder / f"{name}.parquet")


def prompt(shard: str, i: int, tokens: int, source: str) -> dict:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"question {shard}-{i}"}]
    return dict(
        prompt_id=f"{shard}-p{i:04d}",
        shard=shard,
        line=i + 1,
        source=source,
        messages_json=json.dumps(messages),
        prompt_tokens=tokens,
        template_kwargs_json="{}",
    )


def completion(
    p: dict, config: dict, tokens: int, finish: str = "stop", content="An answer.", reasoning="Some thought.", **over
) -> dict:
    row = dict(
        prompt_id=p["prompt_id"],
        shard=p["shard"],
        source=p["source"],
        finish_reason=finish,
        prompt_tokens=p["prompt_tokens"],
        completion_tokens=tokens,
        reasoning_tokens=tokens // 2,
        server_url="http://127.0.0.1:30000",
        model="qwen3-27b",
        temperature=0.6,
        top_p=0.95,
        top_k=20,
        content=content,
        reasoning_content=reasoning if config["enable_thinking"] else None,
        latency_s=1.5,
        attempt=1,
        created_at=T0 + timedelta(seconds=p["line"]),
        **config,
    )
    row.update(over)
    return row


def reject(p: dict | None, shard: str, stage: str, config: dict | None, reason: str, line: int) -> dict:
    return dict(
        shard=shard,
        stage=stage,
        line=line,
        prompt_id=p and p["prompt_id"],
        reason=reason,
        config_hash=config and config["config_hash"],
        prompt_tokens=p and p["prompt_tokens"],
        max_output_tokens=config and config["max_output_tokens"],
        server_context_length=config and config["server_context_length"],
        created_at=T0,
    )


def build_defects(data_dir: Path) -> Path:
    """Four shards, three configs, every defect the checks look for (counts are re-derived by `load`)."""
    rng = random.Random(7)
    # s0: config A (cap 4096, thinking). ~18% truncated thinking plus one of every defect.
    ps = [prompt("s0", i, rng.randint(20, 3000), SOURCES[i % 3]) for i in range(200)]
    rows = []
    for i, p in enumerate(ps[:185]):
        if i % 11 == 0:  # truncated thinking: cut at the cap, content empty
            rows.append(completion(p, CONFIG_A, 4096, "length", content="", reasoning="thinking..."))
        else:
            rows.append(completion(p, CONFIG_A, rng.randint(50, 4000)))
    rows[1].update(content="Here <think>oops</think> the answer")  # leaked markers
    rows[2].update(content="answer </think>")
    rows[3].update(content="")  # empty content
    rows[4].update(content=" \n\t ")  # whitespace only counts as empty
    rows[5].update(finish_reason="length", completion_tokens=4096, reasoning_content=None, content="thinking leaked")
    rows[6].update(finish_reason="length", completion_tokens=4096, reasoning_content="", content="more leak")
    rows[7].update(finish_reason="length", completion_tokens=3000)  # cut below the cap: clamp
    rows[8].update(completion_tokens=4096)  # at the cap yet 'stop'
    rows[9].update(finish_reason="abort")
    orphan = completion(prompt("s0", 999, 100, "code"), CONFIG_A, 10)
    write(data_dir, "completions", "s0", rows[:100])
    write(data_dir, "completions", "s0", rows[100:] + [orphan], part="part-0001")
    dup = dict(rows[20], created_at=T0 + timedelta(days=1), content="Second copy.")
    write(data_dir, "completions", "s0", [dup], part="part-0002")
    ps[185:188] = [dict(p, prompt_tokens=13000) for p in ps[185:188]]  # too long for 13000 + 4096 <= 16384
    source_rejects = [reject(None, "s0", "source", None, "malformed JSON", 900 + k) for k in range(3)]
    write(data_dir, "rejects", "s0", source_rejects, stage="source")
    preflight = [reject(p, "s0", "preflight", CONFIG_A, "too long", p["line"]) for p in ps[185:188]]
    write(data_dir, "rejects", "s0", preflight, stage="preflight")
    write(data_dir, "rejects", "s0", [reject(ps[188], "s0", "server", CONFIG_A, "HTTP 400", 189)], stage="server")
    failures = [
        dict(shard="s0", prompt_id=p["prompt_id"], config_hash="a4096", error="503", attempts=3, created_at=T0)
        for p in ps[189:192]
    ]
    write(data_dir, "failures", "s0", failures)
    write(data_dir, "prompt_shards", "s0", ps)  # ps[192:] are missing: no row anywhere

    # s1: mixed configs, a kill -9 and a restart: 90 rows at cap 4096, 60 at cap 8192 (no thinking)
    ps = [prompt("s1", i, rng.randint(20, 6000), SOURCES[i % 3]) for i in range(150)]
    rows = [completion(p, CONFIG_A, rng.choice([4096, rng.randint(100, 4000)])) for p in ps[:90]]
    for r in rows:
        if r["completion_tokens"] == 4096:
            r.update(finish_reason="length", content="", reasoning_content="long thought")
    rows += [completion(p, CONFIG_B, rng.randint(100, 9000)) for p in ps[90:]]
    for r in rows[90:]:
        if r["completion_tokens"] >= 8192:
            r.update(completion_tokens=8192, finish_reason="length")
    rows[95].update(server_context_length=8192, finish_reason="stop", completion_tokens=100)  # fits no budget
    for r in rows[-3:]:  # served by a smaller-context server that clamped silently
        r.update(server_context_length=8192, finish_reason="length", completion_tokens=8192 - r["prompt_tokens"] - 2)
    write(data_dir, "completions", "s1", rows)
    write(data_dir, "prompt_shards", "s1", ps)

    # s2: context 8192 with max_output_tokens 8192: every prompt rejected at preflight
    ps = [prompt("s2", i, rng.randint(20, 500), SOURCES[i % 3]) for i in range(100)]
    preflight = [reject(p, "s2", "preflight", CONFIG_C, "over context", p["line"]) for p in ps]
    write(data_dir, "rejects", "s2", preflight, stage="preflight")
    write(data_dir, "prompt_shards", "s2", ps)

    # s3: sharded, never generated
    write(data_dir, "prompt_shards", "s3", [prompt("s3", i, 100, "gsm8k") for i in range(40)])
    return data_dir


def build_clean(data_dir: Path) -> Path:
    """Two shards under one config with nothing wrong: every check passes."""
    rng = random.Random(3)
    for shard in ("c0", "c1"):
        ps = [prompt(shard, i, rng.randint(20, 1500), SOURCES[i % 3]) for i in range(120)]
        write(data_dir, "prompt_shards", shard, ps)
        write(data_dir, "completions", shard, [completion(p, CONFIG_A, rng.randint(50, 2000)) for p in ps])
    return data_dir


def build_cut_at_cap(data_dir: Path) -> Path:
    """1,000 rows, 183 cut at the 4096 cap, so P90 = P99 = 4096."""
    ps = [prompt("s0", i, 200, "sharegpt") for i in range(1000)]
    rows = [
        completion(p, CONFIG_A, 4096, "length", content="", reasoning="...")
        if i % 1000 < 183
        else completion(p, CONFIG_A, 100 + i)
        for i, p in enumerate(ps)
    ]
    write(data_dir, "prompt_shards", "s0", ps)
    write(data_dir, "completions", "s0", rows)
    return data_dir


def superseded_configs(data_dir, shards=("s0", "s1")):
    """Superseded configs in two shards: a4096 killed part-way (6 of 10 prompts of s1 done), then b8192 run to
    the end; c8192 wrote between them and stopped after 2 prompts of s1. Written in that order (created_at)."""
    for shard in shards:
        ps = [prompt(shard, i, 100, "gsm8k") for i in range(10)]
        write(data_dir, "prompt_shards", shard, ps)
        done_a = ps if shard == "s0" else ps[:6]
        rows = [completion(p, CONFIG_A, 50) for p in done_a]
        rows += [completion(p, CONFIG_C, 50, created_at=T0 + timedelta(hours=1)) for p in ps[:2] if shard == "s1"]
        rows += [completion(p, CONFIG_B, 50, created_at=T0 + timedelta(hours=2)) for p in ps]
        write(data_dir, "completions", shard, rows)
    return data_dir


def load(data_dir: Path, table: str) -> list[dict]:
    """Every row of a table, read with pyarrow, no DuckDB involved."""
    files = sorted((data_dir / table).rglob("*.parquet"))
    return [row for f in files for row in pq.read_table(f).to_pylist()]


# The expected figures are computed with the rules' Python predicates (dflash_assets/rules.py), never with the SQL
# under test: a check agreeing with them is the SQL fragment agreeing with its Python twin.
blank = rules.is_blank
nearest_rank = rules.percentile


def config_of(row: dict) -> tuple[str, int]:
    return row["config_hash"], row["max_output_tokens"]


def pct(rate: float) -> str:
    return f"{rate * 100:.2f}%"


def check(data_dir, name, **kwargs):
    """The outcome of the one check `name` on `data_dir`."""
    (outcome,) = run_checks(data_dir, names=[name], **kwargs)
    return outcome


def completion_histogram_png(data_dir, path, shard: str | None = None, bins: int = 64) -> Path:
    """The lengths histogram of the data dir's rows written to `path` (the report assets draw theirs from one read)."""
    from dflash_assets.quality.report.histogram import series, write_histogram

    return write_histogram(series(data_dir, shard), path, shard, bins)


def completion_histogram_markdown(data_dir, shard: str | None = None, bins: int = 64) -> str:
    """The histogram as a Markdown image with a base64 data URI, as Dagster Markdown metadata shows it."""
    import base64

    from dflash_assets.quality.report.histogram import histogram_png, series

    data = base64.b64encode(histogram_png(series(data_dir, shard), shard, bins)).decode("ascii")
    return f"![completion lengths](data:image/png;base64,{data})"
