"""What a trainer must set to read an export as it was meant, written beside its manifest.

- specforge_data.yaml: SpecForge's `data:` block (specforge/config/schema.py DataConfig, a StrictConfigModel: only
  its own keys), to put in the training config: the file (`prompts_path` for the pre-tokenized form, which
  `prompt_builder.prepare_prompt_tasks` reads as is; `train_data_path` for the conversations form, which it renders
  with `chat_template`), `max_length` (the export's window: a larger one would read past what was generated for
  it, and a window-policy conversations file holds a placeholder there), and `train_only_last_turn: true` where the
  file carries the source's earlier answers (SpecForge puts loss on every assistant turn by default).
- speculators_flags.txt: speculators' flags (scripts/prepare_data.py `--data`, `--seq-length`; the trainer's
  `--total-seq-len`, DataArgs.total_seq_len).
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_assets.quality.trainer_format import FORM

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


def write_trainer_settings(
    out: Path, jsonl: Path, form: str, max_length: int | None, chat_template: str, with_history: int = 0
) -> dict[str, object]:
    """Write both files into `out`; returns what the manifest says of them (their paths and SpecForge's keys)."""
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
        + f", then scripts/train.py's\n{flags}\n{train}\n",
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
