"""What a trainer must set to read an export as it was meant, written beside its manifest.

- specforge_data.yaml: SpecForge's `data:` block (specforge/config/schema.py DataConfig, a StrictConfigModel: only
  its own keys), to put in the training config: the file (`prompts_path` for the pre-tokenized form, which
  `prompt_builder.prepare_prompt_tasks` reads as is; `train_data_path` for the conversations form, which it renders
  with `chat_template`), `max_length` (the export's window: a larger one would read past what was generated for
  it, and a window-policy conversations file holds a placeholder there), and `train_only_last_turn: true` where the
  file carries the source's earlier answers (SpecForge puts loss on every assistant turn by default).
- speculators_flags.txt: speculators' flags (scripts/prepare_data.py `--data`, `--seq-length`; the trainer's
  `--total-seq-len`, DataArgs.total_seq_len).
Neither trainer reads a held-out file as such (split.py writes one), so both files say each one's route to it in
comments, never a key it refuses: SpecForge a6b6b02's DataConfig keeps `eval_data_path` reserved ("Online evaluation
is unsupported; keep empty") and evaluates only offline hidden states (`data.eval_hidden_states_path`, every
`training.eval_interval`); speculators' `--train-data-ratio` holds out the last rows of the one dataset it trains on
(train/data.py, ArrowDataset's split_ratio), so the held-out file goes after the train file in one `--data` and the
ratio is the train file's share of the lines.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_assets.quality.training.split import HELD_OUT, TRAIN
from dflash_assets.quality.training.trainer_format import FORM

SPECFORGE_FILE, SPECULATORS_FILE = "specforge_data.yaml", "speculators_flags.txt"
TRAINER_SETTINGS_FILES = (SPECFORGE_FILE, SPECULATORS_FILE)


def specforge_data(
    jsonl: Path, form: str, max_length: int | None, chat_template: str, with_history: int
) -> dict[str, object]:
    """SpecForge's data keys for this export (DataConfig's names)."""
    rendered = FORM[form].rendered  # a pre-tokenized file is never rendered
    data: dict[str, object] = {FORM[form].specforge_key: str(jsonl.resolve())}
    if max_length is not None:
        data["max_length"] = max_length
    if rendered:
        data["chat_template"] = chat_template
    if (with_history or FORM[form].train_only_last_turn) and rendered:
        data["train_only_last_turn"] = True
    return data


def train_data_ratio(train: int, held: int) -> str:
    """speculators' --train-data-ratio that trains on exactly the first `train` of `train + held` rows: it keeps the
    first int(rows * ratio), so the ratio sits half a row above train / rows (never rounded down a row)."""
    return f"{(train + 0.5) / (train + held):.9f}"


def held_out_comments(split: dict[str, Any] | None, out: Path) -> tuple[list[str], list[str]]:
    """What each trainer's file says of the held-out file (SpecForge's yaml, speculators' flags): its route to it."""
    held = (split or {}).get(HELD_OUT)
    if not held:
        return [], []
    train = split[TRAIN]  # type: ignore[index]
    path = (out / held["jsonl"]).resolve()
    said = (
        f"# held out: {held['rows']} rows ({held['conversations']} conversations) in {path}, never in {train['jsonl']}"
    )
    if not held["rows"]:  # nothing drawn: no route to give
        return [said], [said]
    specforge = [
        said,
        "# SpecForge reads no held-out data file: data.eval_data_path is reserved and must stay empty (online "
        "evaluation is",
        "# unsupported). To evaluate on it, capture its hidden states offline (as for offline training) and set "
        "data.eval_hidden_states_path",
        "# to their directory, with training.eval_interval.",
    ]
    ratio = train_data_ratio(train["rows"], held["rows"])
    speculators = [
        said,
        "# speculators reads no held-out file: --train-data-ratio trains on the first rows of its one dataset and "
        "evaluates on the rest.",
        f"# To evaluate on ours: --data the train file, then the held-out file, in that order, in one file (cat "
        f"{train['jsonl']} {held['jsonl']}),",
        f"# and --train-data-ratio {ratio} (its first {train['rows']} of {train['rows'] + held['rows']} rows), "
        "provided prepare_data keeps every row in order",
        "# (compare its row count with the manifest's).",
    ]
    return specforge, speculators


def write_trainer_settings(
    out: Path,
    jsonl: Path,
    form: str,
    max_length: int | None,
    chat_template: str,
    with_history: int = 0,
    split: dict[str, Any] | None = None,
) -> dict[str, object]:
    """Write both files into `out`; returns what the manifest says of them (their paths and SpecForge's keys).
    `split` (the manifest's, split.py) adds each trainer's route to the held-out file, as comments."""
    specforge_held, speculators_held = held_out_comments(split, out)
    data = specforge_data(jsonl, form, max_length, chat_template, with_history)
    lines = [
        f"# What SpecForge must set to read {jsonl.name} as it was exported (manifest.json beside it): put this",
        "# data: block in the training config (specforge/config/schema.py DataConfig).",
    ]
    if FORM[form].specforge_note:
        lines.append(f"# {FORM[form].specforge_note}")
    if FORM[form].train_only_last_turn:
        lines.append(
            "# train_only_last_turn: each row is one assistant turn (its generation event), with the visible history "
            "before it: only that turn is to be learnt."
        )
    elif "train_only_last_turn" in data:
        lines.append(
            f"# train_only_last_turn: {with_history} conversations carry the source's earlier answers, which the "
            "target model did not write: only the last (regenerated) turn is to be learnt."
        )
    if max_length is None:
        lines.append("# No window: set max_length to your trainer's window.")
    lines += specforge_held
    lines.append("data:")
    lines += [f"  {key}: {json.dumps(value)}" for key, value in data.items()]  # JSON scalars are YAML scalars
    (out / SPECFORGE_FILE).write_text("\n".join(lines) + "\n", encoding="utf-8")
    flags = f"--data {json.dumps(str(jsonl.resolve()))}"
    if max_length is not None:
        flags += f" --seq-length {max_length}"
    train = f"--total-seq-len {max_length}" if max_length is not None else ""
    (out / SPECULATORS_FILE).write_text(
        "# speculators: scripts/prepare_data.py's flags"
        + FORM[form].speculators_note
        + ", then scripts/train.py's\n"
        + "".join(f"{line}\n" for line in speculators_held)
        + f"{flags}\n{train}\n",
        encoding="utf-8",
    )
    # the manifest names them beside it, the file by its name: the same inputs give the same bytes wherever written
    return {
        "specforge": SPECFORGE_FILE,
        "speculators": SPECULATORS_FILE,
        "specforge_data": specforge_data(Path(jsonl.name), form, max_length, chat_template, with_history)
        | {FORM[form].specforge_key: jsonl.name},
        "speculators_flags": f"--seq-length {max_length}" if max_length is not None else "",
    }


def trainer_settings_line(manifest: dict, out: Path) -> str:
    """Where the trainer's settings are (`out`: the export's directory), for the terminal."""
    settings = manifest["trainer_settings"]
    window = settings["specforge_data"].get("max_length")
    chosen = manifest.get("form_chosen", "as set")
    return (
        f"the trainer's settings to read it as it was made (max_length {window}"
        + ("" if chosen == "as set" else f"; form {manifest['form']}, {chosen}")
        + "): SpecForge's data: block in "
        f"{out / settings['specforge']}, speculators' flags in {out / settings['speculators']}"
    )
