"""Truncation recovery: rows cut at the old cap are continued by token ids to the new cap, not generated again.

The emulator's stand-in model is autoregressive-consistent (a completion is a function of the prompt), so a
continued row must equal, column for column, the row a fresh run at the new cap generates.
"""

import dagster as dg
import duckdb
import pytest

from dflash_assets.defs.continuation.assets import continued_completions
from dflash_assets.defs.metadata import ContinuationKeys, keys
from dflash_assets.defs.partitions import shard_partitions
from dflash_assets.defs.resources import DataDirResource, FleetResource, QualityResource
from dflash_assets.generation.preflight import PreflightError
from dflash_assets.generation.provenance import hashed
from dflash_assets.generation.reasoning import Reasoning
from dflash_assets.settings import DispatchSettings, GenerationSettings
from tests.support import dagster_run
from tests.support.shards import FAST, N, cont, generate, kill_mid_continuation, make_shard, rows


@pytest.fixture(scope="module")
def continued(tmp_path_factory, fleet_urls):
    """A shard generated at 4096 with token ids and continued to 8192; the same shard generated at 8192."""
    a, b = tmp_path_factory.mktemp("continued") / "data", tmp_path_factory.mktemp("scratch") / "data"
    make_shard(a, fleet_urls)
    make_shard(b, fleet_urls)
    parent = generate(a, fleet_urls, 4096)
    run = cont(a, fleet_urls, parent.config_hash, 8192)
    scratch = generate(b, fleet_urls, 8192)
    return a, b, parent, run, scratch


def test_continued_rows_equal_a_fresh_generation_at_the_new_cap(continued):
    a, b, parent, run, scratch = continued
    assert run.config_hash == scratch.config_hash, "the continued config is the new cap's config"
    truncated = [r for r in rows(a, parent.config_hash, "prompt_id, finish_reason, content") if r[1] == "length"]
    assert run.continued == len(truncated) > 0 and run.copied == N - len(truncated)
    # both kinds of cut are covered: inside the thought (content "") and in the answer after </think>
    assert {bool(r[2]) for r in truncated} == {True, False}
    mine, theirs = rows(a, run.config_hash), rows(b, scratch.config_hash)
    assert len(mine) == N
    for m, t in zip(mine, theirs):
        assert m == t, f"continued row {m[0]} differs from the fresh one"
    assert {r[2] for r in mine} == {"stop", "length"}, "some rows run past 8192 too, and stay truncated"


def test_tokens_reused_add_up_to_the_parents_tokens(continued):
    a, _, parent, run, _ = continued
    lineage = duckdb.sql(
        f"select count(*), sum(tokens_reused), sum(completion_tokens - tokens_reused), "
        f"count(*) filter (where parent_config_hash = '{parent.config_hash}') from read_parquet("
        f"'{a}/completions/**/*.parquet') where config_hash = '{run.config_hash}'"
    ).fetchall()[0]
    parents = duckdb.sql(
        f"select sum(completion_tokens) from read_parquet('{a}/completions/**/*.parquet') "
        f"where config_hash = '{parent.config_hash}'"
    ).fetchall()[0][0]
    rows_, reused, generated, with_lineage = lineage
    print(f"\ntokens saved: {reused} reused, {generated} generated ({reused / (reused + generated):.0%} saved)")
    assert reused > 0 and reused == parents == run.tokens_reused
    assert generated == run.output_tokens and rows_ == with_lineage == N
    assert run.new_config_tokens == reused + generated


def test_accounting_of_the_new_config_adds_up(continued):
    _, _, _, run, _ = continued
    assert (run.prompts, run.completed, run.rejected, run.failed, run.left) == (N, N, 0, 0, 0)


def test_a_rerun_of_a_finished_continuation_sends_nothing(continued, fleet_urls):
    a, _, parent, run, _ = continued
    again = cont(a, fleet_urls, parent.config_hash, 8192)
    assert (again.already_done, again.continued, again.copied, again.completed) == (N, 0, 0, N)
    assert len(rows(a, run.config_hash)) == N


def test_a_killed_continuation_resumes_with_no_duplicates_and_nothing_lost(tmp_path, fleet_urls, continued):
    _, b, _, _, scratch = continued
    data = tmp_path / "data"
    make_shard(data, fleet_urls)
    parent = generate(data, fleet_urls, 4096)
    copies = N - parent.length
    # slow decoding, so the kill lands while continuations are in flight
    slow = ["--decode-tokens-per-s", "3000", "--max-running-requests", "2", *FAST[2:]]
    kill_mid_continuation(
        data,
        parent.config_hash,
        8192,
        slow,
        tmp_path / "killed.txt",
        lambda: len(rows(data, scratch.config_hash, "prompt_id")) > copies,
    )
    partial = [r[0] for r in rows(data, scratch.config_hash, "prompt_id")]
    assert copies < len(partial) < N, "the kill should land after the copies, mid-continuation"
    assert len(partial) == len(set(partial)), "a kill -9 left duplicate rows"
    run = cont(data, fleet_urls, parent.config_hash, 8192)
    assert (run.already_done, run.continued) == (len(partial), N - len(partial))
    assert rows(data, run.config_hash) == rows(b, scratch.config_hash), "nothing lost, nothing changed"


def test_truncated_rows_without_token_ids_are_continued_by_their_text_and_equal_a_fresh_run(tmp_path, fleet_urls):
    data, scratch = tmp_path / "data", tmp_path / "scratch" / "data"
    scratch.parent.mkdir()
    make_shard(data, fleet_urls)
    make_shard(scratch, fleet_urls)
    parent = generate(data, fleet_urls, 4096, DispatchSettings(load_sample_s=0))
    assert parent.length > 0
    run = cont(data, fleet_urls, parent.config_hash, 8192, DispatchSettings(load_sample_s=0))
    assert (run.continued, run.without_ids, run.copied, run.left) == (
        parent.length,
        parent.length,
        N - parent.length,
        0,
    )
    assert any(
        f"{parent.length} rows continued by text" in n and "differed from the generated token count in 0 " in n
        for n in run.notes
    ), run.notes  # the emulator re-tokenises its text exactly
    fresh = generate(scratch, fleet_urls, 8192, DispatchSettings(load_sample_s=0))
    assert fresh.config_hash == run.config_hash
    columns = "prompt_id, finish_reason, completion_tokens, reasoning_tokens, content, reasoning_content"
    assert rows(data, run.config_hash, columns) == rows(scratch, fresh.config_hash, columns), (
        "continued by text, the rows are those a fresh run at the larger cap makes"
    )


def test_a_new_cap_that_does_not_fit_the_context_fails_before_anything_is_sent(tmp_path, emulator):
    server = emulator(*FAST, "--context-length", "6000")
    data = tmp_path / "data"
    make_shard(data, [server.emu.url])
    parent = generate(data, [server.emu.url], 4096)
    with pytest.raises(
        PreflightError,
        match=r"max_output_tokens 8,192 leaves no room for a prompt in the servers' "
        r"context length 6,000",
    ):
        cont(data, [server.emu.url], parent.config_hash, 8192)
    provenance = hashed(data, parent.config_hash)  # what the parent's fleet said, in its hash and the new one's
    assert provenance is not None
    bigger = GenerationSettings(max_output_tokens=8192, cap_policy="fixed").resolved(False).with_provenance(provenance)
    assert len(rows(data, bigger.config_hash(parent.model))) == 0


def test_the_continued_completions_asset_materialises_over_an_emulator(tmp_path, fleet_urls):
    data = tmp_path / "data"
    make_shard(data, fleet_urls)
    parent = generate(data, fleet_urls, 4096)
    res = {
        "fleet": FleetResource(mode="attach", urls=",".join(fleet_urls)),
        "data_dir": DataDirResource(path=str(data)),
        "quality": QualityResource(),
    }
    with dagster_run.instance() as instance:
        instance.add_dynamic_partitions(shard_partitions.name, ["00000"])
        result = dg.materialize(
            [continued_completions],
            partition_key="00000",
            instance=instance,
            resources=res,
            run_config={
                "ops": {
                    "continued_completions": {"config": {"parent_config_hash": "latest", "new_max_output_tokens": 8192}}
                }
            },
        )
    meta = result.asset_materializations_for_node("continued_completions")[0].metadata
    assert meta["parent_config_hash"].value == parent.config_hash
    assert meta["rows_continued"].value == parent.length and meta["rows_copied"].value == N - parent.length
    assert meta["tokens_reused"].value > 0 and 0 < meta["saved_share"].value < 1
    assert meta["accounting"].value == f"{N} prompts = {N} completed + 0 rejected + 0 failed + 0 left"
    bigger = GenerationSettings(max_output_tokens=8192, cap_policy="fixed").resolved(False)
    assert meta["config_hash"].value == bigger.with_provenance(hashed(data, parent.config_hash)).config_hash(
        parent.model
    )
    assert keys(ContinuationKeys) <= set(meta), "every key `dflash continue` reads back (defs/metadata.py) is written"


@pytest.mark.parametrize(
    "parser, thinking, text, ids",
    [
        ("qwen3", True, "cut in the thought", [1, 2]),
        ("qwen3", True, "cut right after it</think>", [1, 7]),  # content "" as when the thought was cut
        ("qwen3", True, "thought</think>\n\nanswer so far", [1, 7, 3]),
        ("qwen3", True, "</think>answer", [7, 3]),  # an empty thought comes back null
        ("qwen3", True, "thought\n<tool_call>{", [1, 4]),  # Qwen3.5 opens a tool call without closing the thought
        ("qwen3", False, "no thinking at all", [3]),
        (None, True, "no parser: <think>raw</think> stays in content", [3, 7]),
    ],
)
def test_the_reasoning_split_is_undone_exactly_wherever_the_cut_fell(parser, thinking, text, ids):
    reasoning = Reasoning.of(parser, thinking, [7])
    thought, content = reasoning.split(text)
    assert reasoning.raw_text(thought, content, ids) == text
    more = reasoning.raw_text(thought, content, ids) + " more</think>end"
    assert reasoning.split(more) == reasoning.split(text + " more</think>end")


def test_sglang_0_5_23_has_the_assistant_prefill_the_text_route_uses():
    """continue_final_message is a ChatCompletionRequest field in the wheel's protocol.py, and serving_chat takes the
    final assistant message out and appends its text as token ids: what the emulator and `_by_text` rely on."""
    import ast

    from tests.support.sglang_wheel import sglang_dir

    openai = sglang_dir() / "srt" / "entrypoints" / "openai"
    tree = ast.parse((openai / "protocol.py").read_text())
    request = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ChatCompletionRequest")
    fields = {n.target.id: n for n in request.body if isinstance(n, ast.AnnAssign)}
    assert ast.unparse(fields["continue_final_message"].annotation) == "bool"
    assert ast.literal_eval(fields["continue_final_message"].value) is False
    serving = (openai / "serving_chat.py").read_text()
    assert "assistant_prefix = last_content\n                    messages = messages[:-1]" in serving
    assert "return prompt_ids + encoded" in serving
