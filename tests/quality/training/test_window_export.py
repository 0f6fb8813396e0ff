"""The export the trainer reads, exactly (issue 20, part 4): the same prompts generated under the window policy
(L = 512) and at a fixed cap of 8192 give the trainer the same first L tokens, in both export forms.

The emulator runs with --random-seed and the suite's per-prompt sampling, so a prompt's completion is one draw
whatever its cap: the window row is the 8192 row cut short. Real servers, real Parquet, the real export.
"""

import json

import duckdb
import pytest

from dflash_assets.emulator import tokenizer as tok
from dflash_assets.fleet.fleet import on_fleet
from dflash_assets.generation.engine import generate_shard
from dflash_assets.generation.prompts import last_turn_request
from dflash_assets.quality import export_training_set
from dflash_assets.quality.training.export import WINDOW_CUT_CONTENT
from dflash_assets.quality.training.trainer_format import row_problem
from dflash_assets.settings import GenerationSettings
from tests.support.forks import start_emulator
from tests.support.window import FAST, SETTINGS, L, N, make_shard


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same prompts twice: the window policy at L = 512, and a fixed cap of 8192."""
    window, fixed = tmp_path_factory.mktemp("window") / "data", tmp_path_factory.mktemp("fixed") / "data"
    with start_emulator(FAST) as a, start_emulator(FAST) as b:
        urls = [a.url, b.url]
        for data, config in (
            (window, GenerationSettings(max_output_tokens=8192, cap_policy="window", trainer_max_length=L)),
            (fixed, GenerationSettings(max_output_tokens=8192, cap_policy="fixed")),
        ):
            make_shard(data, urls)
            run = on_fleet(urls, lambda f: generate_shard(data, "00000", f, config, SETTINGS, log=lambda m: None))  # noqa: B023 (awaited in this iteration)
            assert run.completed == N and not run.rejected and not run.failed
    return window, fixed


def stored(data_dir) -> dict[str, dict]:
    rows = duckdb.sql(f"select * from read_parquet('{data_dir}/completions/**/*.parquet')").fetchall()
    names = duckdb.sql(f"select * from read_parquet('{data_dir}/completions/**/*.parquet') limit 0").columns
    return {r[0]: dict(zip(names, r)) for r in rows}


def exported(data_dir, out, form):
    export = export_training_set(data_dir, out, max_length=L, form=form)
    return export, {r["id"].split("@")[0]: r for r in map(json.loads, export.jsonl_path.read_text().splitlines())}


def test_the_window_policy_decodes_a_fraction_of_the_fixed_caps_tokens(runs):
    window, fixed = stored(runs[0]), stored(runs[1])
    decoded = [sum(r["completion_tokens"] for r in rows.values()) for rows in (window, fixed)]
    assert decoded[0] < decoded[1] / 2
    assert sum(r["finish_reason"] == "length" for r in window.values()) > N / 4  # the window cuts many


def test_every_window_rows_input_ids_are_the_first_l_ids_of_the_8192_row(runs, tmp_path):
    full = stored(runs[1])
    export, samples = exported(runs[0], tmp_path / "w", "pretokenized")
    _, fixed_samples = exported(runs[1], tmp_path / "f", "pretokenized")
    assert export.manifest["rows"] == N == len(samples) and export.manifest["excluded"]["truncated"] == 0
    assert export.manifest["window_complete_kept"] > 0
    for pid, sample in samples.items():
        assert set(sample) == {"id", "input_ids", "loss_mask"}  # SpecForge's prompt_builder: pre-tokenized
        row = full[pid]
        ids = (row["prompt_token_ids"] + row["output_ids"])[:L]
        assert sample["input_ids"] == ids == fixed_samples[pid]["input_ids"], pid
        assert sample["loss_mask"] == ([0] * len(row["prompt_token_ids"]) + [1] * len(row["output_ids"]))[:L]
        assert len(sample["input_ids"]) == min(L, row["prompt_tokens"] + row["completion_tokens"])


def render_as_specforge(record: dict, prompt_messages: list[dict]) -> list[int]:
    """The conversations record as SpecForge's ThinkingParser renders and tokenizes it (parse.py, `apply_chat_template`
    with add_generation_prompt=False over the whole conversation, tokenized with truncation at max_length). Here the
    template and tokenizer are the emulator's, which render thinking and history as Qwen3's template does."""
    assert record["conversations"][:-1] == last_turn_request(prompt_messages)
    return tok.encode(tok.apply_chat_template(record["conversations"], add_generation_prompt=False))[:L]


def as_the_template_writes(ids: list[int]) -> list[int]:
    """The server's ids as Qwen3's template writes them back: reasoning.strip('\\n') + '\\n</think>', so one "\\n"
    before `</think>` where the model's thought did not end with one (the emulator's never does)."""
    if tok.THINK_END_ID not in ids:
        return ids
    at = ids.index(tok.THINK_END_ID)
    return ids if tok.decode(ids[:at]).endswith("\n") else ids[:at] + tok.encode("\n") + ids[at:]


def test_the_conversations_form_rendered_as_specforge_reads_it_gives_the_same_first_l_tokens(runs, tmp_path):
    full = stored(runs[1])
    export, records = exported(runs[0], tmp_path / "w", "conversations")
    _, fixed_records = exported(runs[1], tmp_path / "f", "conversations")
    messages = {
        r[0]: json.loads(r[1])
        for r in duckdb.sql(
            f"select prompt_id, messages_json from read_parquet('{runs[0]}/prompt_shards/**/*.parquet')"
        ).fetchall()
    }
    # the validator never aborts the file: every row passes SpecForge's rules, the ones cut inside their thinking
    # included (their placeholder content lies past the window)
    assert all(row_problem(r) is None for r in records.values())
    in_thinking = [pid for pid, r in records.items() if r["conversations"][-1]["content"] == WINDOW_CUT_CONTENT]
    assert in_thinking and export.manifest["window_cut_in_thinking"] == len(in_thinking)
    for pid, record in records.items():
        tokens = render_as_specforge(record, messages[pid])
        assert tokens == render_as_specforge(fixed_records[pid], messages[pid]), pid
        ids = as_the_template_writes(full[pid]["prompt_token_ids"] + full[pid]["output_ids"])[:L]
        # the server's own ids but for the template's "\n" before </think>: the conversations form is what the
        # trainer's template makes of it (the pre-tokenized form is the ids themselves); a shorter row: then the
        # template's "\n" after <|im_end|>
        assert tokens[: len(ids)] == ids and len(tokens) - len(ids) in (0, 1), pid
        assert WINDOW_CUT_CONTENT not in tok.decode(tokens)  # the placeholder is never inside the window


def test_a_window_export_without_token_ids_names_the_rows_it_cannot_write(runs, tmp_path):
    # the fixed run's rows without ids: copied, ids dropped, so the pretokenized form has nothing to write them from
    data = tmp_path / "data"
    import shutil

    shutil.copytree(runs[1], data)
    for part in data.glob("completions/**/*.parquet"):
        con = duckdb.connect()
        con.execute(
            f"COPY (SELECT * REPLACE (NULL::INT[] AS output_ids) FROM read_parquet('{part}')) TO "
            f"'{part}.new' (FORMAT parquet)"
        )
        con.close()
        part.unlink()
        (part.parent / (part.name + ".new")).rename(part)
    export = export_training_set(data, tmp_path / "out", max_length=L, form="pretokenized")
    assert export.manifest["rows"] == 0 and export.manifest["excluded"]["no_token_ids"] == N


def test_a_runaway_past_the_window_stays_out_with_its_reason(tmp_path):
    data = tmp_path / "data"
    with start_emulator([*FAST, "--loop-share", "0.4"]) as emu:
        make_shard(data, [emu.url])
        config = GenerationSettings(max_output_tokens=8192, cap_policy="window", trainer_max_length=1024)
        on_fleet([emu.url], lambda f: generate_shard(data, "00000", f, config, SETTINGS, log=lambda m: None))
    export = export_training_set(data, tmp_path / "out", max_length=1024, form="pretokenized")
    runaways = export.manifest["excluded"]["runaway"]
    assert runaways > 0 and export.manifest["excluded"]["truncated"] == 0
    assert export.manifest["rows"] + runaways == N
    assert {"reason": "runaway", "rows": runaways} == {
        k: v for k, v in export.manifest["exclusions"][0].items() if k in ("reason", "rows")
    }
