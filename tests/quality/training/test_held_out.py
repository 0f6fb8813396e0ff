"""The held-out split (issue 47): the export writes a train file and a held-out file, whole prompts on one side by a
seeded hash of the prompt id, in every form; real Parquet in, the real export, the files read back as a trainer
reads them. The expected split is computed here from the rule as documented, never by the code under test."""

import hashlib
import json
from collections import Counter
from datetime import timedelta

import pyarrow.parquet as pq
import pytest

from dflash_assets.quality import export_training_set
from dflash_assets.quality.training.split import split_words
from tests.support.quality_data import CONFIG_A, T0, completion, write

SHARE, SEED = 0.1, 7
FORMS = ("conversations", "per_turn", "messages", "pretokenized")
SHARDS, PROMPTS, TURNS = ("00000", "00001"), 60, 2


def chat(shard: str, i: int) -> dict:
    messages = [{"role": "user", "content": f"{shard} question {i} turn {k}"} for k in range(1, TURNS + 1)]
    return dict(
        prompt_id=f"{shard}-p{i:03d}",
        shard=shard,
        line=i + 1,
        source="chat",
        messages_json=json.dumps(messages),
        prompt_tokens=None,
        template_kwargs_json="{}",
    )


def turn(p: dict, k: int) -> dict:
    return completion(
        p | {"prompt_tokens": 10 * k},
        CONFIG_A,
        20,
        content=f"answer {k}",
        turn=k,
        turns=TURNS,
        prompt_token_ids=list(range(10 * k)),
        output_ids=[7] * 20,
        created_at=T0 + timedelta(seconds=10 * p["line"] + k),
    )


def expected_held_out(prompt_id: str, share: float = SHARE, seed: int = SEED) -> bool:
    """The documented rule: the first 8 bytes of sha256('<seed>:<prompt_id>') below share * 2**64."""
    digest = hashlib.sha256(f"{seed}:{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < share * 2**64


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Two shards of two-turn conversations, every turn regenerated (all_turns) with its token ids."""
    data = tmp_path_factory.mktemp("held_out") / "data"
    for shard in SHARDS:
        prompts = [chat(shard, i) for i in range(PROMPTS)]
        write(data, "prompt_shards", shard, prompts)
        write(data, "completions", shard, [turn(p, k) for p in prompts for k in range(1, TURNS + 1)])
    return data


@pytest.fixture(scope="module")
def exports(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("held_out_exports")
    return {
        (form, share): export_training_set(
            data, out / f"{form}-{share}", max_length=4096, form=form, held_out_share=share, held_out_seed=SEED
        )
        for form in FORMS
        for share in (SHARE, 0.0)
    }


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def prompt_id(sample: dict) -> str:
    return sample.get("source_id", sample["id"]).split("@")[0]


def test_train_and_held_out_share_no_prompt_and_hold_every_sample_once(exports):
    everyone = {f"{s}-p{i:03d}" for s in SHARDS for i in range(PROMPTS)}
    planned = {pid for pid in everyone if expected_held_out(pid)}
    assert 0 < len(planned) < len(everyone) // 4  # the seed draws some, not most
    for form in FORMS:
        split, whole = exports[form, SHARE], exports[form, 0.0]
        train, held = lines(split.jsonl_path), lines(split.held_out_path)
        assert {prompt_id(s) for s in held} == planned, form  # exactly the seeded draw, whole prompts
        assert not {prompt_id(s) for s in train} & planned, form
        # every sample of the unsplit export once between the two files, as it was (per_turn's source_row_index
        # indexes its own file: test_per_turn_held_out_rows_index_the_held_out_conversations_file)
        canonical = lambda ss: Counter(  # noqa: E731
            json.dumps({k: v for k, v in s.items() if k != "source_row_index"}, sort_keys=True) for s in ss
        )
        assert canonical(train) + canonical(held) == canonical(lines(whole.jsonl_path)), form
        assert len(train) + len(held) == split.manifest["rows"] == whole.manifest["rows"]
        # the Parquet copies split alike
        parquet = split.parquet_path.parent / split.manifest["split"]["held_out"]["parquet"]
        assert set(pq.read_table(parquet, columns=["prompt_id"]).column(0).to_pylist()) == planned
        assert not set(pq.read_table(split.parquet_path, columns=["prompt_id"]).column(0).to_pylist()) & planned
    # every turn of a held-out conversation is held out with it (per_turn, pretokenized: a sample per turn)
    assert Counter(prompt_id(s) for s in lines(exports["pretokenized", SHARE].held_out_path)) == dict.fromkeys(
        planned, TURNS
    )


def test_per_turn_held_out_rows_index_the_held_out_conversations_file(exports):
    conversations = lines(exports["conversations", SHARE].held_out_path)
    rows = {c["id"]: i for i, c in enumerate(conversations)}
    per_turn = lines(exports["per_turn", SHARE].held_out_path)
    assert per_turn and all(e["source_row_index"] == rows[e["source_id"]] for e in per_turn)


def test_the_split_is_the_same_after_a_re_export_and_another_seed_draws_another(data, exports, tmp_path):
    first = exports["conversations", SHARE]
    again = export_training_set(
        data, tmp_path / "again", max_length=4096, form="conversations", held_out_share=SHARE, held_out_seed=SEED
    )
    assert again.held_out_path.read_bytes() == first.held_out_path.read_bytes()
    assert again.jsonl_path.read_bytes() == first.jsonl_path.read_bytes()
    other = export_training_set(
        data, tmp_path / "other", max_length=4096, form="conversations", held_out_share=SHARE, held_out_seed=SEED + 1
    )
    held = {prompt_id(s) for s in lines(other.held_out_path)}
    assert held == {
        prompt_id(s)
        for s in lines(first.jsonl_path) + lines(first.held_out_path)
        if expected_held_out(prompt_id(s), seed=SEED + 1)
    }
    assert held != {prompt_id(s) for s in lines(first.held_out_path)}


def test_the_manifest_names_both_files_with_their_counts(exports):
    export = exports["pretokenized", SHARE]
    split, out = export.manifest["split"], export.manifest_path.parent
    assert (split["held_out_share"], split["seed"]) == (SHARE, SEED)
    for side, path in (("train", export.jsonl_path), ("held_out", export.held_out_path)):
        assert out / split[side]["jsonl"] == path
        assert split[side]["rows"] == len(lines(path))
        assert split[side]["conversations"] == len({prompt_id(s) for s in lines(path)})
        for name in (split[side]["jsonl"], split[side]["parquet"]):
            assert export.manifest["files"][name]["sha256"] == hashlib.sha256((out / name).read_bytes()).hexdigest()
    words = split_words(export.manifest)  # what the terminal line adds
    assert "training_set.jsonl" in words and "held_out_set.jsonl" in words
    assert f"held out: {split['held_out']['rows']} rows" in words


def test_the_trainer_settings_give_the_trainers_route_to_the_held_out_file_and_never_a_key_it_refuses(exports):
    messages = exports["messages", SHARE]  # no trainer's form: no trainer file, and the manifest says so
    assert not (messages.manifest_path.parent / "specforge_data.yaml").exists()
    assert "no trainer reads the messages form" in messages.manifest["trained"]["held_out_route"]
    for form in (f for f in FORMS if f != "messages"):
        export = exports[form, SHARE]
        out, split = export.manifest_path.parent, export.manifest["split"]
        specforge = (out / "specforge_data.yaml").read_text(encoding="utf-8")
        data_block = specforge.split("\ndata:\n")[1]
        assert "held_out_set.jsonl" in specforge and "eval_hidden_states_path" in specforge
        # no key SpecForge refuses (eval_data_path) or reads as something else than our split
        assert not [key for key in data_block.splitlines() if key.strip().startswith("eval")]
        trained = export.manifest["trained"]
        assert trained["held_out_rows"] == split["held_out"]["rows"] > 0
        assert f"{split['held_out']['rows']} rows" in trained["held_out_route"]
        assert "give it the train file alone" in trained["held_out_route"]
        assert not (out / "speculators_flags.txt").exists()  # the trainer named, only its file


def test_share_zero_writes_one_file_and_clears_an_earlier_held_out_file(data, tmp_path):
    out = tmp_path / "out"
    split = export_training_set(data, out, max_length=4096, form="conversations", held_out_share=SHARE)
    assert split.held_out_path is not None and split.held_out_path.exists()
    whole = export_training_set(data, out, max_length=4096, form="conversations", held_out_share=0)
    assert whole.held_out_path is None
    assert sorted(p.name for p in out.iterdir()) == [
        "manifest.json",
        "specforge_data.yaml",
        "training_set.jsonl",
        "training_set.parquet",
    ]
    assert whole.manifest["split"]["held_out"] is None
    assert whole.manifest["split"]["train"]["rows"] == whole.manifest["rows"] == len(lines(whole.jsonl_path))
    settings = (out / "specforge_data.yaml").read_text()
    assert "held out" not in settings and "held_out_set" not in settings
