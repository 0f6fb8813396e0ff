"""What `dflash demo`, `dflash backfill` and `dflash report` print when the gate stops a run, read as a person would:
the figures, the plan and the next command on the terminal; the event stream and stack traces in the run's log."""

import contextlib
import http.server
import json
import re
import threading
from pathlib import Path

import dagster as dg
import duckdb
import pytest
from dagster._core.instance.ref import InstanceRef

from tests.support.cli import demo_slice, dflash, home
from tests.support.docs import written_by_this_run

pytestmark = pytest.mark.long

NO_TRACE = ("Traceback", "Stack Trace", "DagsterAssetCheckFailedError", " - ERROR - ")


@pytest.fixture(scope="module")
def demo_at_4096(tmp_path_factory):
    """The README's way to see a too-small cap: the bundled prompts at a fixed 4096-token cap, for a trainer that reads
    8192 tokens (at the default 4096 window the cuts lie past it: tests/generation/test_window_policy.py)."""
    tmp = tmp_path_factory.mktemp("demo4096")
    env = home(tmp, "home")  # each prompt's one completion (the suite's setting): the figures are the same each run
    env["UV_RUN_RECURSION_DEPTH"] = "1"  # started as the README starts it, `uv run dflash demo`
    return env, dflash(
        "demo", "--cap-policy", "fixed", "--max-output-tokens", "4096", "--trainer-max-length", "8192", env=env, cwd=tmp
    )


def test_demo_at_4096_prints_the_share_cut_the_percentiles_at_the_cap_the_plan_and_the_next_command(demo_at_4096):
    env, result = demo_at_4096
    out = result.stdout
    assert result.returncode == 3, out + result.stderr  # stopped by a blocking check
    rows, cut = duckdb.sql(
        f"select count(*), count(*) filter (where finish_reason = 'length' and prompt_tokens + "
        f"completion_tokens < 8192) from read_parquet("
        f"'{env['DFLASH_DATA_DIR']}/completions/**/*.parquet')"
    ).fetchall()[0]
    share = f"{cut / rows * 100:.2f}%"
    assert 0.15 <= cut / rows <= 0.25, share
    flat = re.sub(r"\s+", " ", out)
    assert "Stopped by the blocking check truncation_rate (4 shards): the training set is not written" in flat, out
    assert f"cut inside the window {share} ({cut}, the blocking share)" in flat and f"{rows} turn rows" in flat, out
    assert "P90 4,096 P99 4,096" in flat and "P90 and P99 equal the cap" in flat
    recommended = re.search(r"to the recommended cap ([\d,]+) from where they stopped", flat)
    assert recommended, out
    cap = int(recommended.group(1).replace(",", ""))
    # never past the trainer's window: at 8192 every row reaches it, so its cut rows are window-complete
    assert 4096 < cap <= 8192
    # the next command continues the cut rows (under the demo's regenerate auto, all_turns, the turns after a cut one
    # are then generated in order); the other repeats the run's own settings (the window it was given)
    assert f"dflash continue --to {cap}" in out, out
    assert f"dflash demo --cap-policy fixed --trainer-max-length 8192 --max-output-tokens {cap}" in out, out
    assert "dflash report --full" in out  # the cap plan, every check and reject: one command away
    # the per-shard table has its figures: cut, P90 and P99 of every shard
    for shard in ("00000", "00001", "00002", "00003"):
        line = next(line for line in out.splitlines() if line.strip().startswith(shard))
        assert re.search(r"\d+\.\d\d%\s+\d+\.\d\d%\s+4096\s+4096\s", line), line  # cut, inside, P90, P99
    for trace in NO_TRACE:
        assert trace not in out + result.stderr


def test_the_stack_trace_stays_in_the_runs_event_log(demo_at_4096):
    env, _ = demo_at_4096
    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(env["DAGSTER_HOME"])) as instance:
        run = [r for r in instance.get_runs() if r.job_name == "shard_pipeline"][0]
        failures = [
            e.dagster_event.step_failure_data.error.cls_name
            for e in instance.all_logs(run.run_id)
            if e.dagster_event and e.dagster_event.is_step_failure
        ]
    assert (run.status, failures) == (dg.DagsterRunStatus.FAILURE, ["DagsterAssetCheckFailedError"])


def test_report_leads_with_the_answer_per_config(demo_at_4096):
    env, _ = demo_at_4096
    result = dflash(
        "report",
        "--full",
        "--data-dir",
        env["DFLASH_DATA_DIR"],
        "--trainer-max-length",
        "8192",
        env=env,
        cwd=env["CWD"],
    )
    assert result.returncode == 0, result.stderr
    head = result.stdout.split("Length quality, all shards")[0]
    flat = re.sub(r"\s+", " ", head)
    assert re.search(r"config \w+: cap 4,096, .*? cut at the cap \d+\.\d\d% \(\d+ turn rows\)", flat), head
    assert "P90 4,096 P99 4,096 max 4,096: P90 and P99 equal the cap" in flat
    assert "<- recommended" in head and "recommended cap:" in head
    # the pictures are written beside the report and their paths printed
    folder = re.search(r"pictures: (\S+)", head).group(1)
    pictures = [Path(folder, name) for name in re.findall(r"^  (\S+\.png)$", head, re.M)]
    [config] = re.findall(r"config (\w+): cap ", flat)  # one config: its own pictures, no side by side
    assert [p.name for p in pictures] == [f"completion_lengths-{config}.png", f"cap_plan-{config}.png"], pictures
    for picture in pictures:
        assert (
            picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            and picture.parent == Path(env["DFLASH_DATA_DIR"]) / "reports"
        )


def test_a_preflight_failure_ends_with_the_context_length_that_would_fit(tmp_path):
    env = home(tmp_path, "home") | {
        "DFLASH_EMULATOR_ARGS": "--reasoning-parser qwen3 --context-length 8192",
        "DFLASH_NUM_SERVERS": "1",
    }  # refused before any request: one server will do
    # a cap that leaves a prompt 1 token: it passes the check before the run, and the preflight refuses every prompt
    result = dflash("demo", "--full", "--cap-policy", "fixed", "--max-output-tokens", "8189", env=env, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr  # bad config: nothing was sent
    out = result.stdout
    assert "Stopped before any request was sent: the preflight refused the run." in out
    assert "the servers' context length is 8192 tokens and max_output_tokens is 8189" in re.sub(r"\s+", " ", out)
    needed = re.search(r"--context-length (\d+) or more", re.sub(r"\s+", " ", out)).group(1)
    assert (
        out.strip().splitlines()[-1]
        == f"Next: restart the servers with --context-length {needed} (or lower --max-output-tokens)."
    )
    for trace in NO_TRACE:
        assert trace not in out + result.stderr


@contextlib.contextmanager
def not_sglang():
    """A loopback HTTP server that answers 200 and an empty object to every GET and POST."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b"{}")

        do_GET = do_POST = _answer

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_demo_at_its_default_cap_exits_0_and_keeps_long_rows_naming_every_exclusion(tmp_path):
    # two shards of the demo's prompts (their long answers are the demo's), on one server; a row per prompt
    # (last_turn: under all_turns a training row is a conversation, whose length is not one row's)
    env = home(tmp_path, "home") | {
        "DFLASH_PROMPTS": str(demo_slice(tmp_path, 200)),
        "DFLASH_SHARD_SIZE": "100",
        "DFLASH_NUM_SERVERS": "1",
    }
    done = dflash("demo", "--full", "--regenerate", "last_turn", env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "Stopped" not in out and "Failed" not in out
    manifest = json.loads(next((tmp_path / "home-data" / "training").glob("*/manifest.json")).read_text())
    rows, long = duckdb.sql(
        f"select count(*), count(*) filter (where prompt_tokens + completion_tokens > 4096) "
        f"from read_parquet('{env['DFLASH_DATA_DIR']}/completions/**/*.parquet')"
    ).fetchall()[0]
    exported = [str(p) for p in (tmp_path / "home-data" / "training").glob("*/*_set.parquet")]  # train, held out
    kept_long = duckdb.sql(
        f"select count(*) from read_parquet({exported}) where prompt_tokens + completion_tokens > 4096"
    ).fetchall()[0][0]
    # the longest answers stay in the training set (but for the few left out for another reason, e.g. cut)
    assert manifest["excluded"]["over_max_length"] == 0 and manifest["over_max_length_kept"] == kept_long
    assert long > 40 and kept_long >= long - sum(e["rows"] for e in manifest["exclusions"])
    assert manifest["rows"] == rows - sum(e["rows"] for e in manifest["exclusions"])
    flat = re.sub(r"\s+", " ", out)
    assert f"drafter training set: {manifest['rows']} rows of config" in flat
    from dflash_assets.quality.training.export import left_out_lines

    assert ("left out, by reason:" if left_out_lines(manifest) else "left out: nothing") in flat
    assert "kept, with a note: " in flat  # above the rows kept, never under "left out"
    for e in manifest["exclusions"]:
        assert f"{e['reason']}: {e['rows']} rows" in flat
    assert f"kept {kept_long} rows longer than max_length 4,096" in flat


def test_exit_status_is_1_when_a_run_fails_with_the_cause_in_a_line(tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"id": f"e{i}", "prompt": f"exit status test {i}"}) + "\n" for i in range(6)))
    args = ["--prompts", str(src), "--shard-size", "3"]
    # attach to a server that says it is healthy but is no SGLang server: the run fails (1), said in a line
    with not_sglang() as url:
        failed = dflash(
            "backfill",
            "--full",
            *args,
            "--max-output-tokens",
            "32000",
            cwd=tmp_path,
            env=home(tmp_path, "dead") | {"DFLASH_FLEET_MODE": "attach", "DFLASH_FLEET_URLS": url},
        )
    assert failed.returncode == 1, failed.stdout + failed.stderr
    flat = re.sub(r"\s+", " ", failed.stdout)
    assert re.search(
        r"Failed: shards 00000\.\.00001, step prompt_shards: \w+: .+ The stack trace is in the event log "
        r"of run [0-9a-f-]{36}",
        flat,
    ), flat
    for trace in NO_TRACE:
        assert trace not in failed.stdout + failed.stderr
    # --verbose prints Dagster's event stream here as well, the stack trace with it
    with not_sglang() as url:
        verbose = dflash(
            "backfill",
            "--full",
            *args,
            "--max-output-tokens",
            "32000",
            "--verbose",
            cwd=tmp_path,
            env=home(tmp_path, "verbose") | {"DFLASH_FLEET_MODE": "attach", "DFLASH_FLEET_URLS": url},
        )
    assert verbose.returncode == 1
    assert "STEP_FAILURE" in verbose.stderr and "Stack Trace" in verbose.stderr and "RUN_START" in verbose.stderr


def rows_before(env) -> int:
    return duckdb.sql(
        f"select count(*) from read_parquet('{env['DFLASH_DATA_DIR']}/completions/**/*.parquet', "
        f"union_by_name = true) where max_output_tokens = 4096"
    ).fetchall()[0][0]


def test_continue_takes_the_cut_rows_on_to_the_recommended_cap_and_says_how_many_tokens_it_reused(
    demo_at_4096, tmp_path
):
    env, demo = demo_at_4096
    # the demo's default config (regenerate auto: all_turns): its cut turns are continued by their token ids and the
    # turns after them generated in order, every (prompt_id, turn) once
    turns = dflash("continue", "--to", "8192", env=env, cwd=env["CWD"])
    assert turns.returncode == 0, turns.stdout + turns.stderr
    turn_rows = f"select prompt_id, turn from read_parquet('{env['DFLASH_DATA_DIR']}/completions/**/*.parquet')"
    new = duckdb.sql(f"{turn_rows} where max_output_tokens = 8192").fetchall()
    cut = dict(
        duckdb.sql(
            f"{turn_rows} where max_output_tokens = 4096 and finish_reason = 'length' and turn < turns"
        ).fetchall()
    )
    assert len(new) == len(set(new)) > 0, "every (prompt_id, turn) once"
    assert any(turn > cut[pid] for pid, turn in new if pid in cut), "the turns after a continued one were generated"
    # a row per prompt (last_turn): one shard of the demo's prompts, a 4096 cap, a trainer reading 8192
    env = home(tmp_path, "home") | {
        "DFLASH_PROMPTS": str(demo_slice(tmp_path, 100)),
        "DFLASH_SHARD_SIZE": "100",
        "DFLASH_NUM_SERVERS": "1",
    }
    demo = dflash(
        "demo",
        "--full",
        "--cap-policy",
        "fixed",
        "--max-output-tokens",
        "4096",
        "--trainer-max-length",
        "8192",
        "--regenerate",
        "last_turn",
        env=env,
        cwd=tmp_path,
    )
    cap = re.search(r"dflash continue --to (\d+)", demo.stdout).group(1)
    result = dflash("continue", "--to", cap, env=env, cwd=env["CWD"])
    assert result.returncode == 0, result.stdout + result.stderr
    rows = duckdb.sql(
        f"select count(*) filter (where max_output_tokens = 4096 and finish_reason = 'length'), "
        f"count(*) filter (where max_output_tokens = {cap}), "
        f"sum(tokens_reused) filter (where max_output_tokens = {cap}), "
        f"sum(completion_tokens) filter (where max_output_tokens = {cap}) "
        f"from read_parquet('{env['DFLASH_DATA_DIR']}/completions/**/*.parquet', union_by_name = true)"
    ).fetchall()[0]
    cut, new_rows, reused, total = rows
    flat = re.sub(r"\s+", " ", result.stdout)
    assert f"tokens reused: {reused:,} of {total:,} ({reused / total * 100:.2f}%)" in flat, result.stdout
    assert new_rows == rows_before(env)
    continued = sum(int(m.group(1)) for m in re.finditer(r"^\s+0000\d\s+(\d+)\s", result.stdout, re.M))
    assert continued == cut, result.stdout  # every cut row taken on
    assert re.search(rf"cap {int(cap):,}, window [\d,]+, \d+ turn rows of \d+ conversations cut at the cap", flat)
    for trace in NO_TRACE:
        assert trace not in result.stdout + result.stderr


RUNNING = Path(__file__).resolve().parents[2] / "docs" / "running.md"
OUTPUT_MARK = "<!-- the output of tests/cli/test_terminal.py's demo_at_4096: DFLASH_WRITE_DOCS=1 writes it here -->"


def as_documented(out: str, tmp: str) -> str:
    """The demo's output as docs/running.md shows it: the test's folder as ~/work, prose cut to the docs' width, a
    long command continued on the next line with a backslash between its words (it runs as printed when pasted)."""
    import textwrap

    from dflash_assets.cli.console import COMMAND_START

    lines = []
    for line in out.replace(tmp, "~/work").rstrip().splitlines():
        if len(line) <= 120:
            lines.append(line)
        elif COMMAND_START.match(line.strip()):
            lines += continued(line, 120)
        else:
            lines += textwrap.wrap(line, 120, subsequent_indent="    ", break_on_hyphens=False)
    return "\n".join(line.rstrip() for line in lines)


def continued(command: str, width: int) -> list[str]:
    """A command as shell lines of at most `width` characters, broken between its words with `\\`."""
    import shlex

    indent = " " * (len(command) - len(command.lstrip()))
    lines, current = [], indent
    for word in command_words(command):
        if current.strip() and len(current) + 1 + len(word) + 2 > width:
            lines.append(current + " \\")
            current = indent + "    "
        current += ("" if not current.strip() else " ") + word
    lines.append(current)
    assert shlex.split(" ".join(line.removesuffix(" \\") for line in lines)) == shlex.split(command), command
    return lines


def command_words(command: str) -> list[str]:
    """The words of a printed command as printed (a quoted value keeps its quotes)."""
    import re

    return re.findall(r"(?:'[^']*'|\S)+", command.strip())


def test_the_running_doc_shows_the_demos_output_as_this_test_run_printed_it(demo_at_4096):
    env, result = demo_at_4096
    written_by_this_run(RUNNING, OUTPUT_MARK + "\n```text\n", "\n```\n", as_documented(result.stdout, env["CWD"]))


README = RUNNING.parents[1] / "README.md"
README_MARK = "<!-- the last lines of tests/cli/test_terminal.py's demo_at_4096: DFLASH_WRITE_DOCS=1 writes them -->"


def test_the_readme_shows_the_demos_closing_lines_as_this_test_run_printed_them(demo_at_4096):
    env, result = demo_at_4096
    shown = as_documented(result.stdout, env["CWD"])
    assert "cut inside the window 16.96%" in shown and "cut inside the window 16.96%" in README.read_text()
    written_by_this_run(README, README_MARK + "\n```text\n", "\n```\n", shown[shown.index("Next: continue the") :])
