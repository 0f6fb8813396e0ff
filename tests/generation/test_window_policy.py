"""The window policy: each request asks only what the trainer's window reads (issue 20, part 2).

A real emulator fleet over loopback, real Parquet; the figures asserted are the rows' own."""

import json
import re
from pathlib import Path

import duckdb
import pytest

from dflash_assets.fleet.fleet import on_fleet
from dflash_assets.generation.engine import generate_shard
from dflash_assets.generation.shards import build_prompt_shard
from dflash_assets.rules import window_cap
from dflash_assets.settings import DispatchSettings, GenerationSettings, QualitySettings, TrainerSettings
from dflash_assets.store.stores import prompt_store
from tests.support.forks import start_emulator

FAST = ["--decode-tokens-per-s", "0", "--reasoning-parser", "qwen3", "--random-seed", "7"]
SETTINGS = DispatchSettings(commit_rows=8, commit_seconds=0.2, load_sample_s=0)
L, OVERSHOOT = 512, 16


@pytest.fixture(scope="module")
def fleet_urls():
    with start_emulator(FAST) as a, start_emulator(FAST) as b:
        yield [a.url, b.url]


def make_shard(data_dir, urls, n=30, long_prompts=2, turns=1) -> None:
    """n prompts; the first `long_prompts` of them longer than the window L on their own."""
    src = data_dir.parent / "prompts.jsonl"
    lines = []
    for i in range(n):
        text = ("word " * 700 if i < long_prompts else "") + f"Explain idea {i} step by step."
        messages = []
        for k in range(turns):
            messages += [
                {"role": "user", "content": text if k == 0 else f"And part {k} of idea {i}?"},
                {"role": "assistant", "content": "ok"},
            ]
        lines.append(json.dumps({"id": f"w{i:03d}", "messages": messages[:-1]}) + "\n")
    src.write_text("".join(lines))
    on_fleet(urls, lambda f: build_prompt_shard(src, 0, "00000", n, data_dir, f, {"enable_thinking": True}))


def window_config(**kw) -> GenerationSettings:
    return GenerationSettings(
        max_output_tokens=8192, cap_policy="window", trainer_max_length=L, overshoot=OVERSHOOT, **kw
    ).resolved(False)


def rows(data_dir, where="true"):
    return duckdb.sql(
        f"select prompt_id, finish_reason, prompt_tokens, completion_tokens, max_output_tokens, "
        f"policy_cap, trainer_max_length, output_ids from read_parquet('{data_dir}/completions/**/*.parquet',"
        f" union_by_name = true) where {where} order by prompt_id"
    ).fetchall()


def rejects(data_dir):
    return duckdb.sql(
        f"select prompt_id, reason, max_output_tokens from read_parquet("
        f"'{data_dir}/rejects/**/*.parquet', union_by_name = true) where stage = 'preflight' "
        f"order by prompt_id"
    ).fetchall()


@pytest.fixture(scope="module")
def window_run(tmp_path_factory, fleet_urls):
    """30 prompts, two of them longer than the window, generated under the window policy at L = 512."""
    data = tmp_path_factory.mktemp("window") / "data"
    make_shard(data, fleet_urls)
    run = on_fleet(
        fleet_urls, lambda f: generate_shard(data, "00000", f, window_config(), SETTINGS, log=lambda m: None)
    )
    return data, run


def test_each_request_asks_the_windows_rest_plus_the_overshoot_and_records_it(window_run):
    data, run = window_run
    found = rows(data)
    assert run.prompts == 30 == run.completed + run.rejected + run.failed and run.completed == len(found) == 28
    for _, finish, prompt, completion, cap, policy_cap, recorded_window, ids in found:
        assert cap == min(8192, L - prompt + OVERSHOOT) == window_cap(8192, L, prompt, OVERSHOOT)
        assert (policy_cap, recorded_window) == (8192, L)
        assert completion <= cap and (finish == "length") == (completion == cap)
        assert ids is not None and len(ids) == completion  # token ids stored by default under the window policy
    cut = [r for r in found if r[1] == "length"]
    assert cut, "the emulator's long answers run past a 512-token window"
    assert all(p + c >= L for _, _, p, c, *_ in cut), "every cut lies past the window: window-complete"


def test_a_prompt_that_fills_the_window_is_a_reject_with_its_reason(window_run):
    data, run = window_run
    found = rejects(data)
    assert run.rejected_preflight == 2 and [r[0] for r in found] == ["w000", "w001"]
    for _, reason, _ in found:
        assert "fills the trainer's window max_length 512: the trainer would read no answer" in reason


def test_the_window_and_the_overshoot_are_in_the_config_hash_and_a_fixed_caps_hash_is_unchanged():
    model = "emulated/qwen3-27b"
    fixed = GenerationSettings(max_output_tokens=8192, cap_policy="fixed").resolved(False)
    assert fixed.config_hash(model) == GenerationSettings(
        max_output_tokens=8192, cap_policy="fixed", trainer_max_length=2048, overshoot=3
    ).resolved(False).config_hash(model)
    hashes = {
        window_config().config_hash(model),
        fixed.config_hash(model),
        window_config().model_copy(update={"trainer_max_length": 1024}).config_hash(model),
        window_config().model_copy(update={"overshoot": 4}).config_hash(model),
    }
    assert len(hashes) == 4


def test_a_bad_cap_policy_is_refused_by_name():
    from dflash_assets.settings import SettingsError

    with pytest.raises(SettingsError, match="cap_policy must be one of fixed, window, got 'windowed'"):
        GenerationSettings(cap_policy="windowed")


def test_all_turns_stops_a_conversation_once_a_turn_fills_the_window(tmp_path, fleet_urls):
    data = tmp_path / "data"
    make_shard(data, fleet_urls, n=12, long_prompts=0, turns=4)
    config = window_config(regenerate="all_turns")
    run = on_fleet(fleet_urls, lambda f: generate_shard(data, "00000", f, config, SETTINGS, log=lambda m: None))
    found = duckdb.sql(
        f"select prompt_id, turn, turns, finish_reason, prompt_tokens + completion_tokens from "
        f"read_parquet('{data}/completions/**/*.parquet') order by prompt_id, turn"
    ).fetchall()
    by_prompt = {}
    for pid, turn, _turns, finish, total in found:
        by_prompt.setdefault(pid, []).append((turn, finish, total))
    assert run.prompts == 12 == run.completed + run.rejected + run.failed
    stopped_early = 0
    for turns in by_prompt.values():
        *earlier, (last_turn, last_finish, last_total) = turns
        assert all(f == "stop" and t < L for _, f, t in earlier), "no turn after one that filled the window"
        if last_turn < 4:  # ended before its last user turn: cut at the window, or it filled the window
            assert last_finish == "length" or last_total >= L
            stopped_early += 1
    assert stopped_early, "some conversation reaches the 512-token window before its fourth turn"
    # a restart finds every conversation over: nothing is sent again
    again = on_fleet(fleet_urls, lambda f: generate_shard(data, "00000", f, config, SETTINGS, log=lambda m: None))
    assert again.already_done == 12 and again.completed == 12


# ---- part 1: the trainer's window, defined once ------------------------------------------------------------------


def test_the_trainers_window_is_one_setting_the_checks_the_resource_and_the_export_share():
    from dflash_assets.defs.resources import QualityResource
    from dflash_assets.settings import QualitySettings, TrainerSettings

    assert TrainerSettings().max_length == 4096 and TrainerSettings().format == "auto"
    assert QualitySettings().trainer == TrainerSettings() == QualitySettings.taken_from(QualityResource()).trainer
    assert GenerationSettings().trainer_max_length == TrainerSettings().max_length
    custom = QualitySettings.taken_from(QualityResource(trainer={"max_length": 2048, "format": "pretokenized"})).trainer
    assert custom == TrainerSettings(max_length=2048, format="pretokenized")
    assert "change it with --trainer-max-length" in TrainerSettings().named()


def test_a_bad_trainer_setting_is_refused_by_name():
    from dflash_assets.settings import SettingsError, TrainerSettings

    with pytest.raises(
        SettingsError,
        match="trainer format must be one of auto, conversations, per_turn, messages, pretokenized, got 'sharegpt'",
    ):
        TrainerSettings(format="sharegpt")
    with pytest.raises(SettingsError, match="trainer max_length must be a positive integer, got 0"):
        TrainerSettings(max_length=0)


# ---- part 3: truncation judged against the window ----------------------------------------------------------------

from dflash_assets.quality import run_checks  # noqa: E402
from dflash_assets.rules import cut_inside_window, trained_tokens, window_complete  # noqa: E402
from tests.support.quality_data import load  # noqa: E402


def window(max_length: int) -> QualitySettings:
    return QualitySettings(trainer=TrainerSettings(max_length=max_length))


def test_at_a_cap_of_4096_with_a_4096_window_every_cut_row_is_window_complete(cut_at_cap_dir):
    rows = load(cut_at_cap_dir, "completions")
    complete = [
        r for r in rows if window_complete(r["finish_reason"], r["prompt_tokens"], r["completion_tokens"], 4096)
    ]
    assert len(complete) == 183 == sum(r["finish_reason"] == "length" for r in rows)
    outcome, warn = run_checks(cut_at_cap_dir, names=["truncation_rate", "decoded_past_window"])
    assert outcome.passed and outcome.blocking
    m = outcome.metadata
    assert (m["max_length"], m["cut_inside_window_rows"], m["window_complete_rows"], m["truncated_rows"]) == (
        4096,
        0,
        183,
        183,
    )
    assert outcome.summary_md.startswith(
        "**0.00%** of 1,000 rows were cut inside the trainer's window max_length 4,096"
    )
    assert "183 rows (18.30%) were cut at or past it: window-complete" in outcome.summary_md
    assert "trainer.max_length; change it with --trainer-max-length" in outcome.summary_md
    # shown, counted with its tokens, and a WARN, never an ERROR
    assert warn.severity == "WARN" and not warn.blocking
    assert warn.metadata["window_complete_rows"] == 183
    assert warn.metadata["window_complete_trained_tokens"] == sum(
        trained_tokens(r["prompt_tokens"], r["completion_tokens"], 4096) for r in complete
    )
    assert warn.metadata["trained_tokens"] == sum(
        trained_tokens(r["prompt_tokens"], r["completion_tokens"], 4096) for r in rows
    )
    # named for what it measures: its text leads with the decoded tokens past the window, then the rows cut past it
    past = sum(r["completion_tokens"] for r in rows) - warn.metadata["trained_tokens"]
    assert warn.name == "decoded_past_window" and warn.metadata["decoded_past_window_tokens"] == past
    assert warn.summary_md.startswith(f"{past:,} of ")
    assert "183 rows (18.30% of 1,000) were cut at or past the window: window-complete" in warn.summary_md


def test_the_same_cut_rows_block_a_trainer_whose_window_reaches_past_the_cap(cut_at_cap_dir):
    rows = load(cut_at_cap_dir, "completions")
    inside = sum(cut_inside_window(r["finish_reason"], r["prompt_tokens"], r["completion_tokens"], 8192) for r in rows)
    (outcome,) = run_checks(cut_at_cap_dir, names=["truncation_rate"], quality=window(8192))
    assert not outcome.passed and outcome.metadata["cut_inside_window_rows"] == inside == 183
    assert "Rows cut inside the window are the hardest prompts" in outcome.summary_md


def test_the_report_and_the_summary_show_both_shares_with_the_window_named(cut_at_cap_dir):
    from dflash_assets.quality.report.lengths import length_quality

    report = length_quality(cut_at_cap_dir, max_length=4096)
    assert report["max_length"] == 4096
    assert (report["cut_inside_window_rows"], report["window_complete_rows"]) == (0, 183)
    assert report["window_complete_rate"] == 0.183 and report["cut_inside_window_rate"] == 0.0
    (config,) = report["by_config"]
    assert (config["cut_inside_window_rows"], config["window_complete_rows"]) == (0, 183)
    wide = length_quality(cut_at_cap_dir, max_length=65536)
    assert (wide["cut_inside_window_rows"], wide["window_complete_rows"]) == (183, 0)


def test_the_terminal_answer_says_the_cut_rows_do_not_matter_to_this_trainer_and_gives_the_window_command(
    cut_at_cap_dir,
):
    import io

    from rich.console import Console

    from dflash_assets.cli.console import print_answers

    out = io.StringIO()
    print_answers(cut_at_cap_dir, Console(file=out, width=200, color_system=None), full=True)
    text = out.getvalue()
    assert "cut inside the window 0.00% (0, the blocking share)" in text
    assert "window-complete 18.30% (183)" in text
    assert "every cut row lies at or past the trainer's window max_length 4,096" in text
    assert "--cap-policy window --trainer-max-length 4096" in text


# ---- the terminal when the cap cuts inside the window --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_at_cap_4096(tmp_path_factory):
    """`dflash demo --cap-policy fixed --max-output-tokens 4096` on the demo's first shard (a fifth of its rows are cut at 4096, as in
    the whole demo; five of its prompts are longer than the 4096 window), on one server: (result, env)."""
    from tests.support.cli import demo_slice, dflash, home

    tmp_path = tmp_path_factory.mktemp("cut_at_cap")
    env = home(tmp_path, "home") | {
        "DFLASH_PROMPTS": str(demo_slice(tmp_path, 100)),
        "DFLASH_SHARD_SIZE": "100",
        "DFLASH_NUM_SERVERS": "1",
    }
    return dflash("demo", "--full", "--cap-policy", "fixed", "--max-output-tokens", "4096", env=env, cwd=tmp_path), env


def test_the_demo_at_a_4096_cap_with_a_4096_window_exports_every_non_runaway_row_and_says_why(demo_at_cap_4096):
    result, env = demo_at_cap_4096
    out = re.sub(r"\s+", " ", result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    data = env["DFLASH_DATA_DIR"]
    rows, cut = duckdb.sql(
        f"select count(*), count(*) filter (where finish_reason = 'length') from read_parquet("
        f"'{data}/completions/**/*.parquet')"
    ).fetchall()[0]
    manifest = json.loads(next(Path(data).glob("training/*/manifest.json")).read_text())
    past = duckdb.sql(
        f"select count(*) filter (where finish_reason = 'length' and prompt_tokens >= 4096) from read_parquet("
        f"'{data}/completions/**/*.parquet')"
    ).fetchall()[0][0]  # cut, but with no trainable token: left out for that (the test below)
    assert (
        cut
        and manifest["excluded"]["truncated"] == 0
        and manifest["window_complete_kept"] + manifest["excluded"]["runaway"] + past == cut
    )
    assert manifest["trainer"]["max_length"] == 4096 and "--trainer-max-length" in manifest["trainer"]["how_to_change"]
    assert f"{manifest['window_complete_kept']} rows" in out
    assert (
        "were cut at or past the trainer's window max_length 4,096: window-complete, the trainer reads each as "
        "it reads the complete answer, so they are exported" in out
    )
    command = re.search(
        r"Next time, decode only what the trainer reads: (?:[A-Z_]+=\S+ )*dflash (demo(?: --[\w-]+ [\w.]+)+)", out
    )
    assert command, out
    # the command asks for the window policy at this run's cap and window (4096, the default: no flag needed)
    from dflash_assets.cli import build_parser

    again = build_parser().parse_args(command.group(1).split())
    assert (again.cap_policy, again.max_output_tokens, again.trainer_max_length) == ("window", 4096, 4096), out


def test_demo_backfill_and_generate_take_the_cap_policy_and_the_window_from_the_settings():
    from dflash_assets.cli import _completions_config, build_parser, repeated_flags, trainer_flags
    from dflash_assets.cli.runner import Window

    for argv in (["demo"], ["backfill"], ["generate", "--shard", "0", "--urls", "http://x"]):
        args = build_parser().parse_args([*argv, "--cap-policy", "window", "--trainer-max-length", "2048"])
        assert (args.cap_policy, args.trainer_max_length, args.overshoot) == (
            "window",
            2048,
            GenerationSettings().overshoot,
        )
    args = build_parser().parse_args(
        ["demo", "--cap-policy", "window", "--trainer-max-length", "2048", "--trainer-format", "pretokenized"]
    )
    config, trainer = _completions_config("demo", args)
    window = Window.of(config, trainer)
    assert window == Window("window", GenerationSettings().overshoot, trainer)
    assert trainer == TrainerSettings(max_length=2048, format="pretokenized")
    assert "trainer_max_length" not in config  # one window: the quality resource's, which the requests read
    # the next command repeats them (and only what differs from the command's defaults)
    assert repeated_flags("demo", {**config, **trainer_flags(trainer)}) == (
        " --trainer-max-length 2048 --trainer-format pretokenized"
    )  # the window policy is the default: only the fixed cap is repeated
    assert repeated_flags("demo", {**config, "cap_policy": "fixed"}) == " --cap-policy fixed"
    assert repeated_flags("demo", _completions_config("demo", build_parser().parse_args(["demo"]))[0]) == ""
    assert window.resources() == {"quality": {"config": {"trainer": trainer.model_dump()}}}


# ---- no sample without a trainable token (issue 31) ---------------------------------------------------------------


def test_the_defaults_leave_out_the_prompts_that_fill_the_window_and_preflight_says_so_before_any_request(
    demo_at_cap_4096, tmp_path
):
    from dflash_assets.quality import export_training_set

    result, env = demo_at_cap_4096
    data = env["DFLASH_DATA_DIR"]
    rows = f"read_parquet('{data}/completions/**/*.parquet')"
    # a prompt fills the window when its first turn does (regenerate auto: the demo's multi-turn prompts are
    # regenerated turn by turn, each later turn's prompt longer); a row has no trainable token when its own prompt does
    first, past, in_conversations = duckdb.sql(
        f"select count(*) filter (where coalesce(turn, 1) = 1 and prompt_tokens >= 4096), "
        f"count(*) filter (where prompt_tokens >= 4096), "
        f"(select count(*) from {rows} r where (select min(prompt_tokens) from {rows} q where q.prompt_id = "
        f"r.prompt_id) >= 4096) from {rows}"
    ).fetchall()[0]
    assert first >= 5, "the demo's first shard holds prompts longer than the default window"
    # preflight counted them before sending (fixed cap: it sends them) and said what they cost and what refuses them
    assert (
        f"{first} prompts fill the trainer's window: their answers would never be trained on; "
        f"`--cap-policy window` rejects them"
    ) in result.stdout
    # the default form leaves out every row whose own prompt fills the window (a later turn's ends its conversation
    # before it), so every conversation whose first prompt fills it
    manifest = json.loads(next(Path(data).glob("training/*/manifest.json")).read_text())
    assert manifest["excluded"]["no_trainable_tokens"] == past and in_conversations >= first
    assert f"no_trainable_tokens: {past} rows" in re.sub(r"\s+", " ", result.stdout)
    # the pre-tokenized form of the same rows at the defaults: every sample has a token to train on
    export = export_training_set(data, tmp_path / "pretokenized", form="pretokenized")
    samples = [json.loads(line) for line in export.jsonl_path.read_text().splitlines()]
    assert samples and all(1 in s["loss_mask"] for s in samples)
    assert export.manifest["excluded"]["no_trainable_tokens"] == past  # a sample per row: each by its own prompt
    assert export.manifest["rows"] + sum(export.manifest["excluded"].values()) == export.manifest["input_rows"]
    # the trainer's settings beside the manifest, and where they are on the terminal
    spec = (export.manifest_path.parent / "specforge_data.yaml").read_text()
    assert "data:\n" in spec and "  max_length: 4096\n" in spec and f'prompts_path: "{export.jsonl_path}"' in spec
    assert not (export.manifest_path.parent / "speculators_flags.txt").exists()  # the trainer named, only its file
    speculators = export_training_set(data, tmp_path / "speculators", trainer="speculators")
    assert "--seq-length 4096" in (speculators.manifest_path.parent / "speculators_flags.txt").read_text()
    assert speculators.manifest["form"] == "pretokenized"
    assert "specforge_data.yaml" in result.stdout and "start it with: specforge train" in result.stdout


# ---- one window (issue 31): the trainer's, from the request to the export ----------------------------------------


def test_a_window_policy_at_2048_set_in_dagster_alone_is_sized_judged_and_exported_at_2048(tmp_path, fleet_urls):
    import dagster as dg

    from dflash_assets.defs.partitions import shard_partitions
    from dflash_assets.defs.resources import QualityResource
    from dflash_assets.defs.training.assets import drafter_training_set
    from dflash_assets.quality import run_checks
    from tests.support import dagster_run
    from tests.support.shards import questions, write_prompts

    write_prompts(tmp_path / "prompts.jsonl", questions(30))
    # the launchpad: the quality resource's trainer.max_length (the one window) and cap_policy window, nothing else
    res = dagster_run.resources(tmp_path, fleet_urls, 30) | {"quality": QualityResource(trainer={"max_length": 2048})}
    with dagster_run.instance() as instance:
        instance.add_dynamic_partitions(shard_partitions.name, ["00000"])
        run = dg.materialize(
            [*dagster_run.ASSETS, drafter_training_set],
            partition_key="00000",
            instance=instance,
            resources=res,
            raise_on_error=False,
            run_config={"ops": {"completions": {"config": {"max_output_tokens": 8192, "cap_policy": "window"}}}},
        )
        assert run.success
        stored = rows(tmp_path / "data")
        assert {r[6] for r in stored} == {2048}, "the requests were sized to the trainer's window"
        cut = [r for r in stored if r[1] == "length"]
        assert cut and all(r[2] + r[3] == 2048 + GenerationSettings().overshoot for r in cut)
        (truncation,) = [e for e in run.get_asset_check_evaluations() if e.check_name == "truncation_rate"]
        assert truncation.passed and truncation.metadata["max_length"].value == 2048
        manifest = run.asset_materializations_for_node("drafter_training_set")[0].metadata["manifest"].value
        assert manifest["max_length"] == 2048 and manifest["window_complete_kept"] == len(cut)
        assert manifest["excluded"]["truncated"] == 0 and manifest["window"]["note"] is None
        # later, the checks and the export with the quality resource at its default (4096): this config is judged
        # and exported at the window its rows recorded, and says so; never at 4096, where every cut row would lie
        # inside the window and block
        (judged,) = run_checks(tmp_path / "data", quality=QualitySettings(), names=["truncation_rate"])
        assert judged.passed and judged.metadata["max_length"] == 2048
        assert "judged by the window their requests were sized to" in judged.summary_md and "4,096" in judged.summary_md
        again = dg.materialize(
            [drafter_training_set],
            instance=instance,
            resources=dagster_run.resources(tmp_path, fleet_urls, 30),
            raise_on_error=False,
        )
    assert again.success
    manifest = again.asset_materializations_for_node("drafter_training_set")[0].metadata["manifest"].value
    assert manifest["max_length"] == 2048 and manifest["excluded"]["truncated"] == 0
    assert "exported at the window its requests were sized to" in manifest["window"]["note"]
    assert "the trainer setting in force says 4,096" in manifest["window"]["note"]
    spec = next((tmp_path / "data" / "training").glob("*/specforge_data.yaml")).read_text()
    assert "  max_length: 2048\n" in spec


def test_a_prompt_leaving_one_token_of_room_is_rejected_by_preflight_with_the_reason_never_sent(tmp_path, fleet_urls):
    """SpecForge's DFlash rule (min_loss_tokens, default 2): a prompt one token short of the window leaves the
    trainer a single supervised token, a sample it drops, so the window policy never sends it."""
    data = tmp_path / "data"
    make_shard(data, fleet_urls, n=4, long_prompts=1)
    tokens = {r["prompt_id"]: r["prompt_tokens"] for r in prompt_store(data, "00000").read().to_pylist()}
    window = tokens["w000"] + 1  # one token of room for w000; the others leave hundreds
    generation = GenerationSettings.of(
        GenerationSettings(max_output_tokens=8192, cap_policy="window", overshoot=OVERSHOOT).resolved(False),
        TrainerSettings(max_length=window),
    )
    run = on_fleet(fleet_urls, lambda f: generate_shard(data, "00000", f, generation, SETTINGS, log=lambda m: None))
    assert run.rejected_preflight == 1 and run.completed == 3, run
    ((prompt_id, reason, _),) = rejects(data)
    assert prompt_id == "w000" and f"leaves the trainer's window max_length {window} room for fewer than" in reason
    assert "min_loss_tokens 2" in reason
    assert "w000" not in {r[0] for r in rows(data)}  # never sent: no row, only the preflight reject
