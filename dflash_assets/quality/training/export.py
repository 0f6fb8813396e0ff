"""The drafter training set: the rows that pass every row-level gate (EXCLUSION_REASONS), in the form the trainer
reads (writers.py), as training_set.jsonl and .parquet, the trainer's settings beside them (trainer_settings.py) and
manifest.json last: each written to a temp name, fsynced, renamed, so a manifest means a complete export. Rows come
in (shard, prompt_id, config_hash) order and nothing time-dependent is written: the same inputs give byte-identical
files. `id` is "<prompt_id>@<config_hash>" (a pre-tokenized all_turns sample: "...#<turn>").

The window that judges a cut row is the one a cap_policy window config recorded, else TrainerSettings.max_length;
the manifest says which. Cut at or past it a row is window-complete and exported (the trainer reads it as it reads
the complete answer), but a runaway stays out: its loop can start inside the window.
"""

import contextlib
import hashlib
import itertools
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_assets.generation.prompts import last_turn_request
from dflash_assets.quality.report.rejects import read_rejects
from dflash_assets.quality.tables import (
    COMPLETION_FLAGS,
    one,
    register_runaway,
    runaway_sql,
    window_flags_sql,
)
from dflash_assets.quality.training.selection import AFTER_END, NOT_WHOLE, Selection, Turn, ending
from dflash_assets.quality.training.split import HELD_OUT, HELD_OUT_FILES, TRAIN, held_out, split_manifest
from dflash_assets.quality.training.trainer_format import (
    DROPS_EARLIER_REASONING,
    FORM,
    TOOL_VALIDATION,
    VALIDATOR,
    chosen_form,
    flags_text,
    has_think_marker,
    tool_row_problem,
    trained_template,
)
from dflash_assets.quality.training.trainer_settings import TRAINER_SETTINGS_FILES, Exported, write_trainer_settings
from dflash_assets.quality.training.writers import (
    WINDOW_CUT_CONTENT,
    Conversation,
    KeptRow,
    Writer,
    Written,
    writer_for,
)
from dflash_assets.rules import OVERFLOW_SQL, STOPPED_EARLY_SQL, fills_window_sql, trainable_sql
from dflash_assets.settings import RunawaySettings, TrainerSettings
from dflash_assets.store.schema import COMPLETION_SCHEMA, FAILURE_SCHEMA, PROMPT_SCHEMA, REJECT_SCHEMA
from dflash_assets.store.storage import connect_duckdb, is_uri, open_storage, release_memory
from dflash_assets.store.stores import parquet_files, parquet_source

# A row is excluded for the first reason that applies, in this order.
EXCLUSION_REASONS = (
    "no_trainable_tokens",  # the prompt fills the window (rules.fills_window_sql): an all-zero loss mask
    "too_few_loss_tokens",  # rules.trainable_sql: the trainer drops the sample (has_consecutive_supervised_tokens)
    "truncated",  # finish_reason 'length' inside the trainer's window (rules.cut_inside_window_sql)
    "runaway",  # stopped while streaming, or cut past the window while looping (generation/runaway.py)
    "not_stop",  # any other finish_reason than 'stop' or 'length' (abort, null)
    "empty_content",  # a stopped row, or a cut one without reasoning either
    "think_marker",  # in an answer, or under last_turn in an earlier answer of the history (trainer_format.py)
    "context_overflow",  # rules.OVERFLOW_SQL: generated under a clamp
    "over_max_length",  # prompt_tokens + completion_tokens > max_length, only with drop_over_max_length
    "no_prompt",  # no prompt_shards row to take the messages from
    "no_token_ids",  # pretokenized form only: the row was generated without store_token_ids
    "recipe_validation",  # text forms: SpecForge's validator with its recipe's flags would stop at the row
    NOT_WHOLE,  # a turn that passed, of a conversation a later turn keeps out (selection.py)
    AFTER_END,  # a turn that passed, after its conversation ended for the trainer (selection.py)
    "duplicate",  # a later copy (created_at, then file order) of a (prompt_id, config_hash) already kept
)
# What a reason means to the trainer, where the name alone does not say it (exclusion_lines).
REASON_NOTES = {
    "no_trainable_tokens": " (the prompt fills the trainer's window: the sample's loss mask would be all zero, and "
    "its answer was decoded for nothing; --cap-policy window rejects such prompts before any request)",
}
ROW_GROUP = 8192
# records go to Arrow CHUNK at a time (a divisor of ROW_GROUP); a row group is written as one table, for stable bytes
CHUNK = 1024
NO_LIMIT = 2**31 - 1  # max_length None: no window, every cut row is cut inside it
SPILL_DIR = ".export_spill"  # DuckDB spills past its memory limit here, in out_dir (removed after)


MODE_NAMES = {True: "thinking", False: "no_thinking"}  # a row's enable_thinking, as the manifest names it

GRADE = """
CREATE TABLE graded AS
WITH c AS (
    SELECT file_index, file_row_number, shard, prompt_id, config_hash, turn, turns, source, max_output_tokens, config_cap,
        prompt_tokens, completion_tokens, created_at, window_complete, judged_window, enable_thinking, diverged,
        window_complete AND content_empty AND NOT reasoning_empty AS window_cut_in_thinking, CASE
            WHEN {fills_window} THEN 'no_trainable_tokens'
            WHEN NOT {trainable} THEN 'too_few_loss_tokens'
            WHEN cut_inside_window THEN 'truncated'
            WHEN finish_reason = 'length' AND runaway OR {stopped_early} THEN 'runaway'
            WHEN finish_reason IS DISTINCT FROM 'stop' AND finish_reason IS DISTINCT FROM 'length' THEN 'not_stop'
            WHEN content_empty AND NOT (window_complete AND NOT reasoning_empty) THEN 'empty_content'
            WHEN think_marker OR turn IS NULL AND EXISTS (
                SELECT 1 FROM history_markers h WHERE h.shard = c0.shard AND h.prompt_id = c0.prompt_id)
                THEN 'think_marker'
            WHEN {overflow} THEN 'context_overflow'
            WHEN $drop_long AND prompt_tokens + completion_tokens > judged_window THEN 'over_max_length'
            WHEN NOT EXISTS (SELECT 1 FROM prompts p WHERE p.shard = c0.shard AND p.prompt_id = c0.prompt_id)
                THEN 'no_prompt'
            WHEN $token_ids AND (prompt_token_ids IS NULL OR output_ids IS NULL) THEN 'no_token_ids'
        END AS reason
    FROM (SELECT *, {window} FROM (SELECT *, {flags}, {runaway} AS runaway,
                                          coalesce(policy_cap, max_output_tokens) AS config_cap
                                   FROM {completions} JOIN files USING (filename))) c0
    WHERE $config IS NULL OR config_hash = $config
)
SELECT * EXCLUDE (reason), CASE
    WHEN reason IS NULL AND row_number() OVER (
        PARTITION BY prompt_id, config_hash, turn, reason IS NULL ORDER BY created_at, file_index, file_row_number) > 1
    THEN 'duplicate' ELSE reason END AS reason
FROM c
"""

# last_turn rows keep the source's earlier assistant answers (last_turn_request): the trainer reads those too
HISTORY_MARKERS = """
INSERT INTO history_markers SELECT shard, prompt_id FROM (
    SELECT shard, prompt_id, arg_min(messages_json, line) AS messages_json FROM {prompts} GROUP BY ALL)
WHERE history_think_marker(messages_json)
"""

# the kept rows of a shard in writing order: only their keys are sorted, so what is sorted is small whatever the text
KEPT_KEYS = """
SELECT file_index, file_row_number, coalesce(prompt_tokens, 0) + coalesce(completion_tokens, 0) AS tokens
FROM graded WHERE reason IS NULL AND shard = $shard
ORDER BY prompt_id, config_hash, turn
"""

# the text of one batch of those keys (`batch`: ord, file_index, file_row_number), in the keys' order
KEPT = """
SELECT g.prompt_id || '@' || g.config_hash AS id, g.prompt_id, g.shard, g.source, g.config_hash,
    g.max_output_tokens, g.prompt_tokens, g.completion_tokens, g.turn, c.turns, p.messages_json, c.content,
    c.reasoning_content, g.window_cut_in_thinking, g.judged_window, {ids}, g.file_index, g.file_row_number, c.enable_thinking,
    c.tool_calls_json, p.tools_json,
    c.reasoning_content IS NULL OR NOT regexp_matches(c.reasoning_content, '[^ \\t\\r\\n]') AS reasoning_empty
FROM batch b
JOIN graded g ON g.file_index = b.file_index AND g.file_row_number = b.file_row_number
JOIN files f ON f.file_index = g.file_index
JOIN {completions} c ON c.filename = f.filename AND c.file_row_number = g.file_row_number
JOIN (SELECT shard, prompt_id, arg_min(messages_json, line) AS messages_json, arg_min(tools_json, line) AS tools_json
      FROM {prompts} WHERE prompt_id IN (SELECT g.prompt_id FROM batch b JOIN graded g USING (file_index, file_row_number))
      GROUP BY ALL) p
    ON p.shard = g.shard AND p.prompt_id = g.prompt_id
ORDER BY b.ord
"""
# the tokens (prompt + completion) of a batch of text: what the export holds at once is about bounded by it
BATCH_TOKENS = 2_000_000


@dataclass(frozen=True)
class TrainingExport:
    jsonl_path: Path
    parquet_path: Path
    manifest_path: Path
    manifest: dict[str, Any]
    held_out_path: Path | None = None  # the held-out JSONL (split.py); None when nothing is held out


def _history_think_marker(messages_json: str) -> bool:
    """Whether an assistant message a last_turn row keeps from the source holds a think marker."""
    return any(
        m["role"] == "assistant" and has_think_marker(m["content"] or "")
        for m in last_turn_request(json.loads(messages_json))
    )


def _commit(tmp: Path, final: Path) -> None:
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)


def _shards(con: duckdb.DuckDBPyConnection, table: str) -> list[str]:
    return [s for (s,) in con.execute(f"SELECT DISTINCT shard FROM {table} ORDER BY shard").fetchall()]


def _conversations(con: duckdb.DuckDBPyConnection, storage: Any, ids: str) -> Iterator[Conversation]:
    """The kept rows a conversation at a time, a shard at a time: its keys sorted, its text fetched by BATCH_TOKENS."""
    key = lambda r: (r.prompt_id, r.config_hash, r.turn is None)  # noqa: E731
    for shard in _shards(con, "graded"):
        release_memory()  # the texts of the shard before went through
        query = KEPT.format(
            completions=parquet_source(con, storage, "completions", COMPLETION_SCHEMA, shard, row_position=True),
            prompts=parquet_source(con, storage, "prompt_shards", PROMPT_SCHEMA, shard),
            ids=ids,
        )
        keys = con.sql(KEPT_KEYS, params={"shard": shard}).to_arrow_table()
        rows = (row for batch in _batches(con, keys, query) for row in KeptRow.of(batch))
        yield from (Conversation(tuple(group)) for _, group in itertools.groupby(rows, key=key))


def _batches(con: duckdb.DuckDBPyConnection, keys: pa.Table, query: str) -> Iterator[pa.Table]:
    """`query`'s rows for consecutive slices of `keys`, each of at most BATCH_TOKENS tokens (or a single row)."""
    tokens = list(itertools.accumulate(keys["tokens"].to_pylist(), initial=0))
    start = 0
    while start < keys.num_rows:
        end = start + 1
        while end < keys.num_rows and tokens[end + 1] - tokens[start] <= BATCH_TOKENS:
            end += 1
        batch = keys.select(["file_index", "file_row_number"]).slice(start, end - start)
        con.register("batch", batch.append_column("ord", pa.array(range(start, end), pa.int64())))
        yield con.sql(query).to_arrow_table()
        con.unregister("batch")
        start = end


def _write(
    con: duckdb.DuckDBPyConnection,
    storage: Any,
    ids: str,
    outputs: dict[str, tuple[Path, Path]],
    form: str,
    held: Callable[[str], bool],
    tools: bool = False,
) -> tuple[Written, dict[str, tuple[int, int]]]:
    """Stream the kept conversations through the form's writer into each side's two files (`outputs` by side of
    split.py; `held` decides by prompt id). Returns what was written and each side's (lines, conversations)."""
    done = Written()
    with contextlib.ExitStack() as stack:
        sides = {
            side: _Side(stack.enter_context(open(jsonl, "wb")), parquet, writer_for(form, tools), stack)
            for side, (jsonl, parquet) in outputs.items()
        }
        for conversation in _conversations(con, storage, ids):
            side = sides[HELD_OUT if HELD_OUT in sides and held(conversation.rows[0].prompt_id) else TRAIN]
            lines, turns = done.lines, done.consumed - len(done.refused_rows)
            side.write(conversation, done)
            side.conversations += done.lines > lines
            side.turns += done.consumed - len(done.refused_rows) - turns
        for side in sides.values():
            side.flush()
    done.train_turns = sides[TRAIN].turns
    return done, {name: (side.lines, side.conversations) for name, side in sides.items()} | (
        {} if HELD_OUT in sides else {HELD_OUT: (0, 0)}
    )


class _Side:
    """One side of the split: its JSONL and Parquet files, and its own writer (per_turn counts its file's lines)."""

    def __init__(self, jsonl: Any, parquet: Path, writer: Writer, stack: contextlib.ExitStack) -> None:
        self.jsonl, self.writer = jsonl, writer
        self.parquet = stack.enter_context(pq.ParquetWriter(parquet, writer.schema))
        self.pending: list[dict[str, Any]] = []  # the records not yet in Arrow: fewer than CHUNK
        self.group: list[pa.Table] = []  # the row group being filled, CHUNK rows a table
        self.lines = self.conversations = self.turns = 0

    def write(self, conversation: Conversation, done: Written) -> None:
        samples = self.writer.samples(conversation, done)
        done.conversations += bool(samples)
        for line, record in samples:
            if (
                self.writer.form.column == "conversations"
                and getattr(self.writer, "check", None) is not tool_row_problem
            ):
                done.validated(line)
            self.jsonl.write(self.writer.dumps(line))
            self.pending.append(record)
            done.lines += 1
            self.lines += 1
            if len(self.pending) == CHUNK:
                self.group.append(pa.Table.from_pylist(self.pending, schema=self.writer.schema))
                self.pending = []
                if len(self.group) * CHUNK == ROW_GROUP:
                    self.flush()

    def flush(self) -> None:
        if self.pending:
            self.group.append(pa.Table.from_pylist(self.pending, schema=self.writer.schema))
            self.pending = []
        if self.group:
            self.parquet.write_table(pa.concat_tables(self.group).combine_chunks(), row_group_size=ROW_GROUP)
            self.group = []


def _reassign(con: duckdb.DuckDBPyConnection, rows: list[tuple[int, int, str]]) -> None:
    """Rows left out after grading take their reason in `graded`, so every count of the manifest has them."""
    if rows:
        con.execute(
            "CREATE OR REPLACE TEMP TABLE reassigned (file_index INTEGER, file_row_number BIGINT, reason VARCHAR)"
        )
        con.executemany("INSERT INTO reassigned VALUES (?, ?, ?)", rows)
        con.execute(
            "UPDATE graded SET reason = r.reason FROM reassigned r "
            "WHERE graded.file_index = r.file_index AND graded.file_row_number = r.file_row_number"
        )


TURNS = """
SELECT shard, prompt_id, config_hash, turn, max(turns) OVER (PARTITION BY shard, prompt_id, config_hash) AS turns,
    reason, coalesce(window_complete, false), coalesce(prompt_tokens, 0), coalesce(completion_tokens, 0),
    judged_window, file_index, file_row_number, coalesce(diverged, false)
FROM graded WHERE turn IS NOT NULL AND reason IS DISTINCT FROM 'duplicate'
ORDER BY shard, prompt_id, config_hash, turn, reason IS NOT NULL, created_at, file_index, file_row_number
"""


def _select(con: duckdb.DuckDBPyConnection, storage: Any, min_loss_tokens: int) -> Selection:
    """Where each all_turns conversation ends for the trainer (selection.py), from its graded, rejected and failed
    turns."""
    refused: dict[tuple[str, str, str], dict[int, tuple[str, int | None]]] = {}
    rejects = parquet_source(con, storage, "rejects", REJECT_SCHEMA)
    for shard, pid, h, turn, reason, prompt_tokens in con.execute(
        f"SELECT shard, prompt_id, config_hash, turn, reason, prompt_tokens FROM {rejects} WHERE turn IS NOT NULL"
    ).fetchall():
        refused.setdefault((shard, pid, h), {})[turn] = (reason, prompt_tokens)
    failed: dict[tuple[str, str, str], set[int]] = {}
    failures = parquet_source(con, storage, "failures", FAILURE_SCHEMA)
    for shard, pid, h, turn in con.execute(
        f"SELECT shard, prompt_id, config_hash, turn FROM {failures} WHERE turn IS NOT NULL"
    ).fetchall():
        failed.setdefault((shard, pid, h), set()).add(turn)
    selection = Selection()
    batches = con.sql(TURNS).to_arrow_reader(ROW_GROUP)
    rows = (values for batch in batches for values in zip(*(column.to_pylist() for column in batch.columns)))
    for key, group in itertools.groupby(rows, key=lambda values: values[:3]):  # (shard, prompt_id, config_hash)
        turns: dict[int, Turn] = {}
        total = 0
        for *_, turn, n, reason, complete, prompt, completion, window, index, position, diverged in group:
            total = n or 0
            graded_turn = Turn(turn, reason, complete, prompt, completion, window, (index, position), diverged)
            turns.setdefault(turn, graded_turn)  # the kept copy first
        end = ending(total, turns, refused.get(key, {}), failed.get(key, set()), min_loss_tokens)
        selection.add(end, turns)
    return selection


def _recipe(done: Written, writer: Writer, trainer: str) -> dict[str, Any]:
    """The validation run of the trainer's own code: SpecForge's validator on its text forms, with the strongest flags
    that pass on every line written (Written.validated), and what it refused. An agentic file is judged by its own
    checks: the validator refuses the tool turns SpecForge's trainer reads."""
    judged = {
        "left_out": dict(sorted(done.refused.items())),
        "recipe_flags": sorted({flags_text(t) for t in done.thinking}),
    }
    if getattr(writer, "check", None) is tool_row_problem:
        return {"validator": None, "note": TOOL_VALIDATION} | judged
    if not writer.form.rendered or writer.form.column != "conversations" or trainer != "specforge":
        return {"validator": None, "note": f"no validator of {trainer}'s runs on the {writer.form.name} form"} | judged
    flags = " ".join("--" + k.replace("_", "-") for k, on in done.validator_flags[0].items() if on)
    return {
        "validator": VALIDATOR,
        "flags": flags,
        "command": f"python scripts/validate_regenerated_data.py --data-path FILE {flags}",
    } | judged


def _trained(done: Written, e: Exported, train_lines: int, said: dict[str, Any]) -> dict[str, Any]:
    """What the trainer will train of the train file: the turns it supervises, those not trained and why, the
    held-out rows and their route."""
    turns = done.train_turns
    one_per_line = e.form == "conversations" and e.last_turn_only  # SpecForge's train_only_last_turn
    supervised = 0 if e.reader is None else train_lines if one_per_line else turns
    why = None
    if e.reader is None:
        why = said["note"]
    elif turns > supervised:
        why = (
            f"chat_template {e.chat_template} renders a conversation's earlier turns without their reasoning, so "
            "only its last turn is trained (train_only_last_turn); form per_turn trains every turn"
        )
    return {
        "trainer": e.reader,
        "turns_exported": turns,
        "turns_supervised": supervised,
        "turns_not_trained": turns - supervised,
        "why_not_trained": why,
        "held_out_rows": done.lines - train_lines,
        "held_out_route": said["held_out_route"],
    }


def _source_answers(done: Written, writer: Writer) -> dict[str, Any]:
    """regenerate last_turn rows whose history keeps the source's own earlier answers: text the target never wrote."""
    written, left_out = done.source_answers["written"], done.source_answers["left_out"]
    if not writer.form.rendered:
        note = "their history is in the prompt ids, with loss 0: the trainer learns only the regenerated answer"
    elif written:
        note = (
            "SpecForge puts loss on every assistant turn (data.train_only_last_turn: false): set "
            "data.train_only_last_turn: true, or it learns the source's answers; regenerate: auto regenerates them"
        )
    else:
        note = "no such row was written" + (
            " (the source's answers have no reasoning_content: the recipe's --expect-reasoning refuses them; "
            "regenerate: auto regenerates every turn)"
            if left_out
            else ""
        )
    return {
        "rows": written + left_out,
        "written": written,
        "left_out": left_out,
        "train_only_last_turn": bool(written) and writer.form.rendered,
        "note": note,
    }


@dataclass(frozen=True)
class ExportRequest:
    """What to export, built once (export_training_set's keywords, documented there)."""

    data_dir: str | Path
    out_dir: str | Path
    config_hash: str | None = None
    max_length: int | None = TrainerSettings().max_length
    form: str = TrainerSettings().format
    drop_over_max_length: bool = False
    runaway: RunawaySettings = field(default_factory=RunawaySettings)
    chat_template: str = TrainerSettings().chat_template
    chosen_by: str = "explicit"
    min_loss_tokens: int = TrainerSettings().min_loss_tokens
    held_out_share: float = 0.0
    held_out_seed: int = TrainerSettings().held_out_seed
    trainer: str = TrainerSettings().name

    @property
    def out(self) -> Path:
        return Path(self.out_dir)

    @property
    def names(self) -> tuple[str, ...]:
        """The data files written: the train file's two, and the held-out file's two when a share is held out."""
        return ("training_set.jsonl", "training_set.parquet", *(HELD_OUT_FILES if self.held_out_share > 0 else ()))

    def held(self, prompt_id: str) -> bool:
        return held_out(prompt_id, self.held_out_share, self.held_out_seed)


@dataclass(frozen=True)
class Chosen:
    """What the config's rows decide: the form and the template the trainer renders it with (and why)."""

    form: str
    form_chosen: str
    template: str
    template_chosen: str
    all_turns: bool
    model: str | None


def export_training_set(data_dir: str | Path, out_dir: str | Path, **options: Any) -> TrainingExport:
    """Write the rows of one config (`config_hash`; None: all configs) that pass every row-level gate, as
    ExportRequest(data_dir, out_dir, **options) asks.

    `chosen_by` says in the manifest how the config was chosen: "run", "latest" (rules.latest_first) or "explicit".
    `form` is one of trainer_format.FORM or "auto" (trainer_format.chosen_form). `max_length` is the trainer's window
    in force (None: no limit); rows that stopped past it are kept unless `drop_over_max_length`. `held_out_share` of
    the prompts go whole to the held-out file (split.py). `data_dir` may be an object-store URI; `out_dir` is local.
    """
    request = ExportRequest(data_dir, out_dir, **options)  # graded, selected and written, then the trainer's file
    paths, tmps = _outputs(request)
    try:
        with connect_duckdb(request.out / SPILL_DIR) as con:
            con.execute(f"ATTACH ':memory:' AS {GRADED_DB} (COMPRESS)")
            con.execute(f"USE {GRADED_DB}")
            storage = open_storage(request.data_dir)  # one filesystem for both tables
            chosen = _grade(con, storage, request)
            done, sides, manifest = _write_and_count(con, storage, request, chosen, tmps)
        for name in request.names:
            _commit(tmps[name], paths[name])
            with open(paths[name], "rb") as f:
                manifest["files"][name] = {"sha256": hashlib.file_digest(f, "sha256").hexdigest()}
        exported = Exported(
            paths["training_set.jsonl"],
            chosen.form,
            manifest["window"]["max_length"],
            chosen.template,
            request.trainer,
            chosen.model,
            last_turn_only=bool(done.source_answers["written"])
            or chosen.all_turns
            and chosen.template in DROPS_EARLIER_REASONING,
        )
        manifest["trainer_settings"] = write_trainer_settings(request.out, exported, manifest["split"])
        manifest["trained"] = _trained(done, exported, sides[TRAIN][0], manifest["trainer_settings"])
        tmps["manifest.json"].write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        _commit(tmps["manifest.json"], paths["manifest.json"])
    finally:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)
        shutil.rmtree(request.out / SPILL_DIR, ignore_errors=True)
        release_memory()  # every kept row's text went through
    return TrainingExport(
        paths["training_set.jsonl"],
        paths["training_set.parquet"],
        paths["manifest.json"],
        manifest,
        paths.get(HELD_OUT_FILES[0]),
    )


def _outputs(request: ExportRequest) -> tuple[dict[str, Path], dict[str, Path]]:
    """The export's files and their temporary names, once out_dir is known local and the form known; an earlier
    export's trainer and held-out files there are removed (another form or window must not leave stale ones)."""
    if is_uri(os.fspath(request.out_dir)):
        raise ValueError(
            f"out_dir {request.out_dir!s} must be a local directory (the training set is written, fsynced and "
            f"renamed there; copy it to an object store afterwards if the trainer reads from one)"
        )
    out = request.out
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in (*request.names, "manifest.json")}
    for name in (*TRAINER_SETTINGS_FILES, *HELD_OUT_FILES):
        (out / name).unlink(missing_ok=True)
    writer_for(chosen_form(request.form, False, request.chat_template, request.trainer)[0])  # an unknown form: refused
    return paths, {name: out / f".{name}.tmp" for name in paths}


# graded and the prompts live in a compressed database of their own, compressed at its CHECKPOINT after grading:
# every later query reads them there (a million graded rows held DuckDB at its memory limit as temp tables)
GRADED_DB = "graded_rows"


def _grade(con: duckdb.DuckDBPyConnection, storage: Any, request: ExportRequest) -> Chosen:
    """The tables every later step reads (`graded`: each completion row with its exclusion reason), and the
    form and template the config's rows decide."""
    prompts = parquet_source(con, storage, "prompt_shards", PROMPT_SCHEMA)
    con.execute(f"CREATE TABLE prompts AS SELECT DISTINCT shard, prompt_id FROM {prompts}")
    con.create_function("history_think_marker", _history_think_marker, ["VARCHAR"], "BOOLEAN")
    con.execute("CREATE TEMP TABLE history_markers (shard VARCHAR, prompt_id VARCHAR)")
    for shard in _shards(con, "prompts"):  # a shard's messages at a time
        con.execute(HISTORY_MARKERS.format(prompts=parquet_source(con, storage, "prompt_shards", PROMPT_SCHEMA, shard)))
    # (file_index, file_row_number) identify a row from grading to writing and order duplicates
    completions = parquet_source(con, storage, "completions", COMPLETION_SCHEMA, row_position=True)
    con.execute("CREATE TEMP TABLE files (file_index INTEGER, filename VARCHAR)")
    if files := list(enumerate(parquet_files(storage, "completions"))):
        con.executemany("INSERT INTO files VALUES (?, ?)", files)
    all_turns, modes, model = con.execute(
        f"SELECT coalesce(bool_or(turn IS NOT NULL), false), coalesce(list(DISTINCT coalesce(enable_thinking, true)), "
        f"[]), min(model) FROM {completions} WHERE $config IS NULL OR config_hash = $config",
        {"config": request.config_hash},
    ).fetchall()[0]
    template, template_chosen = trained_template(request.chat_template, frozenset(modes))
    form, form_chosen = chosen_form(request.form, all_turns, template, request.trainer, frozenset(modes))
    register_runaway(con, request.runaway)
    window = NO_LIMIT if request.max_length is None else request.max_length
    con.execute(
        GRADE.format(
            flags=COMPLETION_FLAGS,
            completions=completions,
            overflow=OVERFLOW_SQL,
            stopped_early=STOPPED_EARLY_SQL,
            runaway=runaway_sql(request.runaway),
            window=window_flags_sql(window),
            fills_window=fills_window_sql("judged_window"),
            trainable=trainable_sql("judged_window", "$min_loss_tokens"),
        ),
        {
            "config": request.config_hash,
            "min_loss_tokens": request.min_loss_tokens,
            "drop_long": request.drop_over_max_length and request.max_length is not None,
            "token_ids": not FORM[form].rendered,
        },
    )
    con.execute(f"CHECKPOINT {GRADED_DB}")
    return Chosen(form, form_chosen, template, template_chosen, all_turns, model)


def _write_and_count(
    con: duckdb.DuckDBPyConnection, storage: Any, request: ExportRequest, chosen: Chosen, tmps: dict[str, Path]
) -> tuple[Written, dict[str, tuple[int, int]], dict[str, Any]]:
    """Where each conversation ends, the kept conversations written to both sides of the split, and the manifest's
    counts of what was written and left out (its files, trainer and trained come after)."""
    selection = _select(con, storage, request.min_loss_tokens)
    _reassign(con, selection.reassigned)
    rendered = FORM[chosen.form].rendered
    ids = "NULL AS prompt_token_ids, NULL AS output_ids" if rendered else "c.prompt_token_ids, c.output_ids"
    outputs = {TRAIN: (tmps["training_set.jsonl"], tmps["training_set.parquet"])}
    if request.held_out_share > 0:
        outputs[HELD_OUT] = (tmps[HELD_OUT_FILES[0]], tmps[HELD_OUT_FILES[1]])
    prompts = parquet_source(con, storage, "prompt_shards", PROMPT_SCHEMA)
    tools = con.execute(f"SELECT count(*) > 0 FROM {prompts} WHERE tools_json IS NOT NULL").fetchall()[0][0]
    writer = writer_for(chosen.form, tools)
    done, sides = _write(con, storage, ids, outputs, chosen.form, request.held, tools)
    _reassign(con, [(*position, "recipe_validation") for position in done.refused_rows])
    window = _window(con, request.max_length)
    manifest = _manifest(con, request.config_hash, window["max_length"], done.consumed - len(done.refused_rows)) | {
        "form": chosen.form,
        "form_chosen": chosen.form_chosen,
        "chat_template": {"name": chosen.template, "chosen": chosen.template_chosen},
        "rows": done.lines,
        "chosen_by": request.chosen_by,
        "conversations_not_whole": selection.not_whole,
        "conversations": {"exported": done.conversations} | selection.manifest(),
        "min_loss_tokens": request.min_loss_tokens,
        "window": window,
        "recipe": _recipe(done, writer, request.trainer),
        "source_answers": _source_answers(done, writer),
        "split": split_manifest(
            request.held_out_share, request.held_out_seed, sides, "training_set.jsonl", "training_set.parquet"
        ),
    }
    return done, sides, manifest | _kept_counts(con, request, window["max_length"], chosen.form)


def _kept_counts(con: duckdb.DuckDBPyConnection, request: ExportRequest, max_length: int | None, form: str) -> dict:
    """The manifest's figures of the rows kept and left out, and the trainer's window and form as exported."""
    rejects = read_rejects(request.data_dir, config_hash=request.config_hash)  # the prompts that never became rows
    window_complete, cut_in_thinking = one(
        con,
        "SELECT count(*) FILTER (WHERE window_complete), count(*) FILTER (WHERE window_cut_in_thinking) "
        "FROM graded WHERE reason IS NULL",
    )
    return {
        "drop_over_max_length": request.drop_over_max_length and request.max_length is not None,
        "over_max_length_kept": one(
            con,
            "SELECT count(*) FROM graded WHERE reason IS NULL AND prompt_tokens + completion_tokens > "
            f"judged_window AND judged_window < {NO_LIMIT}",
        )[0],
        "exclusions": _exclusions(con),
        "rejected": rejects.total,
        "rejected_by_stage_and_reason": rejects.by_stage_and_reason(),
        "window_complete_kept": window_complete,
        "window_cut_in_thinking": cut_in_thinking,
        "trainer": {
            "max_length": max_length,
            "format": form,
            "how_to_change": "trainer.max_length and trainer.format of the quality resource (Dagster), or "
            "dflash demo/backfill --trainer-max-length, --trainer-format; the form also by the drafter_training_set "
            "config's form",
            "window_cut_content": WINDOW_CUT_CONTENT if FORM[form].rendered else None,
        },
    }


def _window(con: duckdb.DuckDBPyConnection, max_length: int | None) -> dict[str, Any]:
    """The window the export judged and cut by, and why: the trainer's in force (`max_length`) for fixed-cap
    configs, the recorded one for a window-policy config (said when it is not the setting's); each config's own."""
    by_config = {
        h: (None if w >= NO_LIMIT else int(w))
        for h, w in con.execute("SELECT DISTINCT config_hash, judged_window FROM graded ORDER BY ALL").fetchall()
    }
    windows = set(by_config.values())
    window = windows.pop() if len(windows) == 1 else max_length
    other = {h: w for h, w in by_config.items() if w != max_length}
    note = None
    if other:
        said = ", ".join(f"config {h} at {w:,}" for h, w in other.items())
        setting = f"{max_length:,}" if max_length is not None else "none"
        note = (
            f"exported at the window its requests were sized to (cap_policy window): {said}; the trainer setting in "
            f"force says {setting}. Set the trainer's max_length to {window:,} to read it as it was made"
            if window is not None and len(set(other.values())) == 1 and len(other) == len(by_config)
            else f"configs of several windows, each exported at its own: {said}; the trainer setting says {setting}"
        )
    return {"max_length": window, "trainer_setting": max_length, "by_config": by_config, "note": note}


def _exclusions(con: duckdb.DuckDBPyConnection, top: int = 3) -> list[dict[str, Any]]:
    """Each reason that removed rows: rows and completion tokens (and their shares of all graded rows), and the
    `top` sources it removed most rows from, with the share of each source's rows it took."""
    total_rows, total_tokens = one(con, "SELECT count(*), coalesce(sum(completion_tokens), 0) FROM graded")
    out = []
    for reason, rows, tokens in con.execute(
        "SELECT reason, count(*), coalesce(sum(completion_tokens), 0) FROM graded WHERE reason IS NOT NULL "
        "GROUP BY ALL ORDER BY 2 DESC, 1"
    ).fetchall():
        sources = con.execute(
            "SELECT coalesce(source, '?') AS source, count(*) FILTER (WHERE reason = $r) AS n, count(*) AS of "
            "FROM graded GROUP BY ALL HAVING n > 0 ORDER BY n DESC, source LIMIT $top",
            {"r": reason, "top": top},
        ).fetchall()
        out.append(
            {
                "reason": reason,
                "rows": rows,
                "share_of_rows": round(rows / total_rows, 4),
                "completion_tokens": int(tokens),
                "share_of_tokens": round(tokens / total_tokens, 4) if total_tokens else 0.0,
                "sources": [{"source": s, "rows": n, "share_of_source": round(n / of, 4)} for s, n, of in sources],
            }
        )
    return out


def exclusion_lines(manifest: dict[str, Any]) -> list[str]:
    """The exclusions for people: one line per reason, then the long rows that were kept."""
    return left_out_lines(manifest) + kept_lines(manifest)


def left_out_lines(manifest: dict[str, Any]) -> list[str]:
    """One line per reason rows were left out: rows, shares of rows and tokens, the sources it took most from."""
    from dflash_assets.quality.outcome import num, pct

    lines = [f"window: {note}" for note in [manifest.get("window", {}).get("note")] if note]
    for e in manifest.get("exclusions", []):
        worst = ", ".join(
            f"{s['source']} {num(s['rows'])} ({pct(s['share_of_source'])} of its rows)" for s in e["sources"]
        )
        lines.append(
            f"{e['reason']}: {num(e['rows'])} rows ({pct(e['share_of_rows'])}), "
            f"{pct(e['share_of_tokens'])} of completion tokens; most from {worst}"
            + (f"{REASON_NOTES[e['reason']]}" if e["reason"] in REASON_NOTES else "")
        )
    if manifest.get("conversations_not_whole"):
        turns = "; ".join(
            f"turn {e['turn']} {e['why']}: {num(e['conversations'])}" for e in manifest["conversations"]["left_out"]
        )
        lines.append(
            f"conversations_not_whole: {num(manifest['conversations_not_whole'])} conversations (regenerate all_turns) "
            f"left out by a later turn that did not pass (cut inside the window, refused, failed): {turns}"
        )
    recipe = manifest.get("recipe") or {}
    if recipe.get("left_out"):
        words = "; ".join(f"{n} {problem!r}" for problem, n in recipe["left_out"].items())
        lines.append(
            f"recipe_validation: SpecForge's validator with {' or '.join(recipe['recipe_flags'])} would stop at: {words}"
        )
    return lines


def trained_words(manifest: dict[str, Any], short: bool = False) -> str:
    """The manifest's `trained` in a line; `short`: the counts alone."""
    from dflash_assets.quality.outcome import num

    t = manifest.get("trained")
    if not t:
        return ""
    said = (
        f"{t['trainer']} trains {num(t['turns_supervised'])} of its {num(t['turns_exported'])} turns"
        if t["trainer"]
        else f"no trainer reads its {num(t['turns_exported'])} turns"
    )
    if short:
        return said + (f" ({num(t['turns_not_trained'])} not: the manifest says why)" if t["turns_not_trained"] else "")
    if t["turns_not_trained"]:
        said += f"; {num(t['turns_not_trained'])} exported but not trained: {t['why_not_trained']}"
    if t["held_out_rows"]:
        said += f"; held out: {t['held_out_route']}"
    return said


def kept_lines(manifest: dict[str, Any]) -> list[str]:
    """The rows kept that a person should know about: rows with the source's own answers in their history,
    window-complete rows, rows longer than the window."""
    from dflash_assets.quality.outcome import num

    lines = []
    answers = manifest.get("source_answers") or {}
    if answers.get("rows"):
        lines.append(
            f"{num(answers['rows'])} rows keep the source's own earlier answers in their history (regenerate "
            f"last_turn), {num(answers['written'])} written: {answers['note']}"
        )
    ended = (manifest.get("conversations") or {}).get("window_complete")
    if ended:
        lines.append(
            f"kept {num(sum(ended.values()))} window-complete conversations up to the turn the trainer reads last "
            f"(cut at or past the window, or the next turn's history fills it): "
            + ", ".join(f"{num(n)} {k}" for k, n in ended.items())
        )
    if manifest.get("window_complete_kept"):
        lines.append(
            f"kept {num(manifest['window_complete_kept'])} window-complete rows (cut at or past the trainer's "
            f"window max_length {num(manifest['max_length'])}: it reads them as complete answers)"
        )
    if manifest.get("over_max_length_kept"):
        lines.append(
            f"kept {num(manifest['over_max_length_kept'])} rows longer than max_length "
            f"{num(manifest['max_length'])} (the trainer cuts them; drop_over_max_length excludes them)"
        )
    return lines


def _manifest(con: duckdb.DuckDBPyConnection, config_hash: str | None, max_length: int | None, rows: int) -> dict:
    def counts(group: str, where: str) -> list[tuple]:
        return con.execute(f"SELECT {group}, count(*) FROM graded WHERE {where} GROUP BY ALL ORDER BY ALL").fetchall()

    kept = counts("config_hash, config_cap", "reason IS NULL")  # the config's cap (window rows ask their own)
    if sum(n for *_, n in kept) != rows:  # every kept row has a prompt (no_prompt), so this cannot drift silently
        raise RuntimeError(f"export wrote {rows} rows but graded {sum(n for *_, n in kept)} as kept")
    excluded = dict.fromkeys(EXCLUSION_REASONS, 0) | dict(counts("reason", "reason IS NOT NULL"))
    by_config: dict[str, dict[str, int]] = {}
    for h, reason, n in counts("config_hash, reason", "reason IS NOT NULL"):
        by_config.setdefault(str(h), dict.fromkeys(EXCLUSION_REASONS, 0))[reason] = n
    by_config_rows: dict[str, dict[str, Any]] = {}
    for h, cap, n in kept:  # one cap per hash unless the hash misses it (config_consistency reports that)
        entry = by_config_rows.setdefault(str(h), {"max_output_tokens": [], "rows": 0})
        entry["max_output_tokens"].append(cap)
        entry["rows"] += n
    return {
        "config_hash": config_hash,
        "config_hashes": sorted({str(h) for h, _, _ in kept}),
        "max_length": max_length,
        "id_format": "<prompt_id>@<config_hash>",
        "input_rows": one(con, "SELECT count(*) FROM graded")[0],
        "rows": rows,
        "rows_by_config": by_config_rows,
        "rows_by_source": {str(s): n for s, n in counts("source", "reason IS NULL")},
        # the rows kept in each mode (a seeded mix of modes: GenerationSettings.thinking_share)
        "rows_by_mode": {MODE_NAMES[bool(t)]: n for t, n in counts("enable_thinking", "reason IS NULL")},
        "excluded": excluded,
        "excluded_by_config": by_config,
        "files": {},
    }
