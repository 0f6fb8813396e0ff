"""The trainer, named once, and every route it is offered proven by its own code (issue 53): the demo's prompts,
every assistant turn regenerated under the window policy (one config with thinking on, one a seeded mix of modes, one
with thinking off; and one with thinking off regenerating the last turn only), exported for each (trainer, form) the tool offers with a held-out share, then read by pinned copies
of SpecForge's (tests/support/specforge*.py) and speculators' (tests/support/speculators.py) data code."""

import json
from collections import Counter
from pathlib import Path

import duckdb
import pytest
import yaml

from dflash_assets.emulator.tokenizer import decode
from dflash_assets.quality import export_training_set
from dflash_assets.quality.training.trainer_settings import trainer_settings_line
from dflash_assets.settings import GenerationSettings, SettingsError, TrainerSettings
from tests.quality.training.test_conversation_export import run_demo, trained_text, turn_text
from tests.support import specforge, specforge_config, specforge_preprocessing, speculators
from tests.support.docs import written_by_this_run

L, SHARE = 2048, 0.1
ONE = GenerationSettings(max_output_tokens=16384, trainer_max_length=L, regenerate="all_turns")
MIX = ONE.model_copy(update={"thinking_share": 0.5, "mode_seed": 3})
OFF = ONE.model_copy(update={"enable_thinking": False})
LAST = OFF.model_copy(update={"regenerate": "last_turn"})  # the source's earlier answers stay in the history
CONFIGS = {"one": ONE, "mix": MIX, "off": OFF, "last": LAST}
NAMES = {"one": "on", "mix": "50% on", "off": "off", "last": "off last_turn"}  # the docs table's thinking column
# every (trainer, form) the tool offers: settings.TRAINER_READS, and auto
TEXT = ("conversations", "per_turn")
ROUTES = [("specforge", f) for f in ("auto", *TEXT, "pretokenized")] + [("speculators", "auto")]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("routes")
    configs = {}
    for name, settings in CONFIGS.items():
        run_demo(root / name, settings, lines=160)
        configs[name] = root / name
    return configs


@pytest.fixture(scope="module")
def exports(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("exports")
    return {
        (mix, trainer, form): export_training_set(
            data[mix], out / f"{mix}-{trainer}-{form}", max_length=L, form=form, held_out_share=SHARE, trainer=trainer
        )
        for mix in data
        for trainer, form in ROUTES
        if not (mix == "mix" and form in TEXT)  # refused: test_a_text_form_of_a_mix_is_refused...
    }


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def rows(data: Path) -> dict[tuple[str, int], dict]:
    """(prompt_id, turn) -> its completion row's ids and mode."""
    found = duckdb.sql(
        f"select prompt_id, turn, prompt_token_ids, output_ids, enable_thinking, prompt_tokens "
        f"from read_parquet('{data}/completions/**/*.parquet', union_by_name = true)"
    ).fetchall()
    return {(r[0], r[1]): {"prompt": r[2], "output": r[3], "thinking": r[4]} for r in found}


def test_the_trainer_chooses_the_form_and_writes_only_its_own_file(exports):
    expected = {
        "specforge": ("per_turn", "specforge_data.yaml"),
        "speculators": ("pretokenized", "speculators_flags.txt"),
    }
    for trainer, (form, file) in expected.items():
        export = exports["one", trainer, "auto"]
        assert export.manifest["form"] == form
        names = {p.name for p in export.manifest_path.parent.iterdir()}
        assert file in names and not {"specforge_data.yaml", "speculators_flags.txt"} - {file} & names
        assert export.manifest["trainer_settings"]["file"] == file
    # a mix under SpecForge: the server's own ids, since its template would train a thinking-off row's </think>
    assert exports["mix", "specforge", "auto"].manifest["form"] == "pretokenized"
    # thinking off alone: the instruct template, which masks the empty think block, renders whole conversations
    off = exports["off", "specforge", "auto"].manifest
    assert (off["form"], off["chat_template"]["name"]) == ("conversations", "qwen3-instruct")
    assert "every row was generated with thinking off" in off["chat_template"]["chosen"]
    said = trainer_settings_line(off, Path("out"))  # the export's terminal line
    assert "chat_template qwen3-instruct: every row was generated with thinking off" in said
    assert "; chat_template" not in trainer_settings_line(exports["one", "specforge", "auto"].manifest, Path("out"))
    assert exports["one", "specforge", "auto"].manifest["chat_template"] == {"name": "qwen3.5", "chosen": "as set"}
    with pytest.raises(SettingsError, match="trainer speculators does not read the per_turn form"):
        TrainerSettings(name="speculators", format="per_turn")


def test_a_text_form_of_a_mix_is_refused_and_messages_names_no_trainer(data, tmp_path):
    for form in TEXT:
        with pytest.raises(ValueError, match="such a row would be trained on `</think>` and the blank line"):
            export_training_set(data["mix"], tmp_path / form, max_length=L, form=form)
        assert not (tmp_path / form / "training_set.jsonl").exists()
    messages = export_training_set(data["one"], tmp_path / "m", max_length=L, form="messages")
    assert messages.manifest["trainer_settings"]["name"] is None
    assert not {"specforge_data.yaml", "speculators_flags.txt"} & {p.name for p in (tmp_path / "m").iterdir()}
    trained = messages.manifest["trained"]
    assert trained["turns_supervised"] == 0 and trained["turns_not_trained"] == trained["turns_exported"] > 0
    assert "no trainer reads the messages form" in trained["why_not_trained"]


def test_every_pretokenized_turn_is_supervised_once_on_generated_tokens_only(data, exports):
    """Both trainers' pre-tokenized route: speculators' prepare_data passes each sample through (cut at --seq-length),
    SpecForge's online trainer reads it as is; the supervised ids are the server's output ids, never a prompt id (a
    thinking-off row's `</think>` and blank line are in its prompt ids, under loss 0)."""
    for (mix, _, _), export in exports.items():
        if export.manifest["form"] != "pretokenized":
            continue
        by_turn = rows(data[mix])
        samples = lines(export.jsonl_path) + lines(export.held_out_path)
        prepared = speculators._passthrough_pretokenized(
            {k: [s[k] for s in samples] for k in ("input_ids", "loss_mask")}, L
        )
        assert len(prepared["input_ids"]) == len(samples)  # none dropped unsupervised
        seen = set()
        off = 0
        for s, ids, mask in zip(samples, prepared["input_ids"], prepared["loss_mask"]):
            pid, turn = s["id"].split("@")[0], int(s["id"].split("#")[1]) if "#" in s["id"] else None
            row = by_turn[pid, turn]
            assert (pid, turn) not in seen
            seen.add((pid, turn))
            supervised = [i for i, m in zip(ids, mask) if m]
            assert supervised == row["output"][: L - len(row["prompt"])]
            assert ids[: len(row["prompt"])] == row["prompt"] and not any(mask[: len(row["prompt"])])
            assert specforge.has_consecutive_supervised_tokens(mask)
            if not row["thinking"]:
                off += 1
                assert decode(row["prompt"][-4:]).endswith("</think>\n\n")  # the template's, loss 0
        trained = export.manifest["trained"]
        assert trained["turns_supervised"] == trained["turns_exported"] == len(lines(export.jsonl_path))
        assert trained["turns_not_trained"] == 0
        assert (off > 0) == (mix != "one")
        assert export.manifest["source_answers"]["rows"] == 0 or mix == "last"


def test_specforge_trains_every_per_turn_event_once_and_counts_what_a_conversations_row_leaves(exports):
    per_turn, conversations = exports["one", "specforge", "auto"], exports["one", "specforge", "conversations"]
    whole = {
        line["id"]: line["conversations"]
        for p in ("jsonl_path", "held_out_path")
        for line in lines(getattr(conversations, p))
    }
    trained: dict[str, list[str]] = {}
    for path in (per_turn.jsonl_path, per_turn.held_out_path):
        for event in lines(path):
            trained.setdefault(event["source_id"], []).append(trained_text(per_turn, event["conversations"]))
    assert trained == {i: [turn_text(m) for m in c if m["role"] == "assistant"] for i, c in whole.items()}
    # the conversations form trains each row's last turn: the manifest counts the rest, and says why
    t = conversations.manifest["trained"]
    train = lines(conversations.jsonl_path)
    answers = [sum(m["role"] == "assistant" for m in line["conversations"]) for line in train]
    for line in train:
        last = [m for m in line["conversations"] if m["role"] == "assistant"][-1]
        assert trained_text(conversations, line["conversations"]) == turn_text(last)
    assert (t["turns_exported"], t["turns_supervised"]) == (sum(answers), len(train))
    assert (
        t["turns_not_trained"] == sum(answers) - len(train) > 0 and "per_turn trains every turn" in t["why_not_trained"]
    )
    assert per_turn.manifest["trained"]["turns_not_trained"] == 0


def test_specforges_expand_script_on_the_conversations_form_is_the_per_turn_export(exports):
    for path in ("jsonl_path", "held_out_path"):
        expanded, skipped = specforge.expand_file(getattr(exports["one", "specforge", "conversations"], path))
        assert skipped == 0
        assert getattr(exports["one", "specforge", "auto"], path).read_text(encoding="utf-8").splitlines() == expanded
        # the script expands reasoning conversations only: it skips every thinking-off one (our per_turn writes them,
        # and SpecForge's preprocessing trains each of their turns once: test_specforge_trains_each_exported_turn...)
        conversations = getattr(exports["off", "specforge", "conversations"], path)
        assert specforge.expand_file(conversations) == ([], len(lines(conversations)))


def supervised(export, line: dict, template: str | None = None) -> str:
    """What SpecForge's own preprocessing (tests/support/specforge_preprocessing.py) puts loss on in one line, with the
    chat_template and train_only_last_turn the export's specforge_data.yaml sets (or another `template`)."""
    data = yaml.safe_load((export.manifest_path.parent / "specforge_data.yaml").read_text())["data"]
    tokenizer = specforge_preprocessing.CharTokenizer()  # a token a character: the masked ids decode to the text
    out = specforge_preprocessing.preprocess_conversations(
        tokenizer,
        [line["conversations"]],
        specforge_preprocessing.TEMPLATES[template or data["chat_template"]],
        max_length=10**9,  # the token window is the export's (test_every_pretokenized_turn...)
        train_only_last_turn=data.get("train_only_last_turn", False),
    )
    ids, mask = out["input_ids"][0][0], out["loss_mask"][0][0]
    return tokenizer.decode([i for i, m in zip(ids, mask) if m])


def generated(message: dict) -> str:
    """An assistant turn's tokens the target generated, as Qwen3's template renders them after the server's generation
    prompt (`<think>\n` with thinking, `<think>\n\n</think>\n\n` without: prompt tokens), with its end of turn."""
    reasoning, content = message.get("reasoning_content"), message["content"].lstrip("\n")
    return (f"{reasoning.strip(chr(10))}\n</think>\n\n" if reasoning else "") + content + "<|im_end|>\n"


def test_specforge_trains_each_exported_turn_once_and_no_token_the_template_forced(data, exports):
    """Every SpecForge text form of every config it is offered for, read by SpecForge's own preprocessing: a line's
    loss falls on the generated text of its last turn (train_only_last_turn) or of all its turns, nothing else (no
    history answer, no `</think>` a thinking-off row's prompt held); over a file, each exported turn is trained at most
    once, and the turns trained are the manifest's turns_supervised."""
    checked = set()
    for (mix, trainer, _), export in exports.items():
        m = export.manifest
        if trainer != "specforge" or m["form"] not in TEXT:
            continue
        trained, turns = Counter(), 0
        for path in (export.jsonl_path, export.held_out_path):
            for line in lines(path):
                answers = [msg for msg in line["conversations"] if msg["role"] == "assistant"]
                text = supervised(export, line)
                n = 1 if text == generated(answers[-1]) else len(answers)
                assert text == "".join(generated(a) for a in answers[-n:]), line["id"]
                if mix == "off":
                    assert n == (len(answers) if m["form"] == "conversations" else 1)
                if mix in ("off", "last"):
                    assert "</think>" not in text
                    # the configured qwen3.5 would have trained the empty think block the server put in the prompt
                    assert supervised(export, line, "qwen3.5").endswith(f"\n</think>\n\n{generated(answers[-1])}")
                assert n == 1 or mix != "last"  # never a source's answer in the history
                trained.update((line.get("source_id", line["id"]), i) for i in range(len(answers) - n, len(answers)))
                turns += n if path == export.jsonl_path else 0
        assert max(trained.values()) == 1
        assert turns == m["trained"]["turns_supervised"] > 0
        assert m["trained"]["turns_not_trained"] == m["trained"]["turns_exported"] - turns
        if mix != "one":
            assert m["trained"]["turns_not_trained"] == 0
        if mix == "last":  # rows whose history holds the source's answers were written, none of them trained
            assert m["source_answers"]["written"] > 0
        checked.add((mix, m["form"]))
    assert checked == {(mix, form) for mix in ("one", "off", "last") for form in TEXT}


def test_no_held_out_prompt_is_in_a_file_a_trainer_is_given(exports):
    for export in exports.values():
        train, held = lines(export.jsonl_path), lines(export.held_out_path)
        assert held and not {s["id"].split("@")[0] for s in train} & {s["id"].split("@")[0] for s in held}
        out = export.manifest_path.parent
        file = (out / export.manifest["trainer_settings"]["file"]).read_text().splitlines()
        named = "\n".join(line for line in file if not line.startswith("#"))  # the comments say the held-out route
        assert str(export.jsonl_path.resolve()) in named and export.held_out_path.name not in named
        assert export.held_out_path.name not in export.manifest["trainer_settings"]["command"]


def test_specforges_validator_with_the_manifests_flags_passes_every_file_it_names(exports):
    for export in exports.values():
        recipe = export.manifest["recipe"]
        if export.manifest["form"] == "pretokenized":
            assert recipe["validator"] is None
            continue
        for path in (export.jsonl_path, export.held_out_path):
            args = specforge_config.parse_args(["--data-path", str(path), *recipe["flags"].split()])
            assert specforge_config.validate_dataset(
                args.data_path,
                expect_non_reasoning=args.expect_non_reasoning,
                expect_reasoning=args.expect_reasoning,
                strict_think_markers=args.strict_think_markers,
            ) == len(lines(path))
    # per_turn events carry earlier answers without their reasoning: the recipe's --expect-reasoning refuses them
    per_turn = exports["one", "specforge", "auto"]
    assert per_turn.manifest["recipe"]["flags"] == "--strict-think-markers"
    with pytest.raises(ValueError, match="has empty reasoning_content"):
        specforge_config.validate_dataset(per_turn.jsonl_path, expect_reasoning=True, strict_think_markers=True)
    assert exports["one", "specforge", "conversations"].manifest["recipe"]["flags"] == (
        "--expect-reasoning --strict-think-markers"
    )


def test_specforges_data_block_and_command_validate_and_its_online_trainer_evaluates_on_no_file(exports):
    for mix, form in [(mix, form) for mix in ("one", "off") for form in ("auto", *TEXT, "pretokenized")]:
        export = exports[mix, "specforge", form]
        out = export.manifest_path.parent
        block = yaml.safe_load((out / "specforge_data.yaml").read_text())["data"]
        data = specforge_config.DataConfig(**block)  # strict: only SpecForge's keys
        assert Path(data.train_data_path or data.prompts_path) == export.jsonl_path
        assert "held_out" not in json.dumps(block)
        # the command's overrides over a recipe's config give the same data block (the manifest's command is run in
        # the export's directory, the yaml's comment from anywhere: the file's absolute path)
        recipe = specforge_config.Config(data=specforge_config.DataConfig(train_data_path="./cache/recipe.jsonl"))
        command = (
            export.manifest["trainer_settings"]["command"]
            .replace(f"={export.jsonl_path.name}", f"={export.jsonl_path}")
            .split()
        )
        assert " ".join(command) in (out / "specforge_data.yaml").read_text()
        assert command[:4] == ["specforge", "train", "--config", "YOUR_DFLASH_CONFIG.yaml"]
        applied = specforge_config.apply_overrides(recipe, command[4:]).data
        assert {k: getattr(applied, k) for k in block} == block
        for bad, message in (
            ({"eval_data_path": str(export.held_out_path)}, "eval_data_path is unsupported"),
            ({"eval_hidden_states_path": "captured/"}, "requires an offline training data source"),
        ):
            with pytest.raises(ValueError, match=message):
                specforge_config.Config(data={**block, **bad}, training={"eval_interval": 100})
        assert "acceptance on the held-out prompts" in export.manifest["trained"]["held_out_route"]
    # the offline route the manifest gives a text form: captured hidden states beside offline training data
    offline = {"hidden_states_path": "captured/train", "eval_hidden_states_path": "captured/held_out"}
    specforge_config.Config(data=offline, training={"eval_interval": 100})
    assert (
        "data.eval_hidden_states_path with training.eval_interval"
        in (exports["one", "specforge", "conversations"].manifest["trained"]["held_out_route"])
    )


def test_no_held_out_row_reaches_speculators_training_split_by_its_route(exports):
    for mix in ("one", "mix"):
        export = exports[mix, "speculators", "auto"]
        flags = (export.manifest_path.parent / "speculators_flags.txt").read_text()
        command = export.manifest["trainer_settings"]["command"]
        assert f"--data {export.jsonl_path.name} --seq-length {L}" in command
        assert command.replace(f"--data {export.jsonl_path.name}", f"--data {export.jsonl_path}") in flags
        assert str(export.held_out_path) not in flags + command
        train, held = lines(export.jsonl_path), lines(export.held_out_path)
        assert held and not {s["id"].split("@")[0] for s in train} & {s["id"].split("@")[0] for s in held}
        prepared = speculators.prepare([train], L)  # prepare_data --data the train file alone
        trained = speculators.train_split(prepared, 0.9) + speculators.train_split(prepared, 0.9, "val")
        # what it trains and validates on is the train file's samples, each once (two prompts of the same text
        # make the same sample, so they are compared as multisets)
        assert Counter(tuple(r["input_ids"]) for r in trained) == Counter(tuple(s["input_ids"]) for s in train)
        assert export.manifest["trained"]["held_out_rows"] == len(held)
        assert "it validates on a slice of its one dataset" in export.manifest["trained"]["held_out_route"]


def test_speculators_takes_no_validation_file_so_the_held_out_one_goes_to_no_split(exports):
    """speculators c05b95b validates on the tail of its one dataset (DataArgs has one data path; the loaders refuse a
    ratio that leaves either split empty): a held-out file given to prepare_data beside the train file is shuffled
    into both splits, which is why the flags file names the train file alone and the route is acceptance on the
    held-out prompts."""
    assert [f for f in speculators.DataArgs.model_fields if "path" in f or "val" in f] == ["data_path"]
    export = exports["one", "speculators", "auto"]
    train, held = lines(export.jsonl_path), lines(export.held_out_path)
    with pytest.raises(ValueError, match=r"train_data_ratio must be in \(0, 1\), got 1.0"):
        speculators.create_train_val_loaders(data_path=speculators.prepare([train], L), train_data_ratio=1.0)
    ratio = speculators.DataArgs().train_data_ratio
    both = speculators.create_train_val_loaders(data_path=speculators.prepare([train, held], L), train_data_ratio=ratio)
    held_ids = Counter(tuple(s["input_ids"]) for s in held)
    landed = [sum(held_ids[tuple(r["input_ids"])] > 0 for r in split) for split in both]
    assert landed[0] > 0 and sum(landed) == len(held)  # the naive route trains on held-out rows
    route = export.manifest["trained"]["held_out_route"]
    assert "takes no validation file" in route and "acceptance on the held-out prompts" in route


DOC = Path(__file__).resolve().parents[3] / "docs" / "trainer-window.md"
TABLE_MARK = "<!-- the routes table: tests/quality/training/test_trainer_routes.py writes it (DFLASH_WRITE_DOCS=1) -->"


def test_the_docs_routes_table_is_this_test_runs(exports):
    """docs/trainer-window.md's table of routes: each figure as this run's manifests and the trainers' code count it."""
    rows = [
        "|trainer|thinking|form|chat_template|validator flags|train turns|trained|not trained|held out|",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (mix, trainer, form), export in exports.items():
        m, t = export.manifest, export.manifest["trained"]
        flags = m["recipe"].get("flags") or "-"
        template = m["chat_template"]["name"] if m["form"] in TEXT else "-"
        rows.append(
            f"|{trainer}|{NAMES[mix]}|{m['form']}{' (auto)' if form == 'auto' else ''}|{template}|{flags}|"
            f"{t['turns_exported']}|{t['turns_supervised']}|{t['turns_not_trained']}|{t['held_out_rows']}|"
        )
    written_by_this_run(DOC, TABLE_MARK + "\n", "\n\n", "\n".join(rows))
