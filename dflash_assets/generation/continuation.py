"""Continue truncated completions at a larger cap instead of generating them again.

A row cut at the cap (finish_reason "length") already holds thousands of valid tokens. Its prompt and
partial output go back to SGLang's native /generate BY TOKEN IDS (`input_ids = prompt_token_ids +
output_ids`, nothing re-tokenised) with the rest of the new cap and the same sampling; the server generates
only the missing tokens, and the row lands as a completion of the larger-cap config (the config hash a
fresh run at that cap would have) with its lineage: `parent_config_hash`, `tokens_reused`.

Rows of the parent that stopped on their own are complete at any larger cap: they are copied into the new
config (tokens_reused = completion_tokens, nothing generated), so the new config is complete for the shard
and its accounting adds up without sending anything. That is unbiased only because every cut row is
continued from where it stopped: a model continuing an answer already k tokens long ends past k, as the
first draw would have. Truncated rows without token ids (a run without store_token_ids) are continued by
their text instead, through the chat route's assistant prefill (`continue_final_message`, SGLang 0.5.23's
protocol.py): the prompt's messages plus the row's raw output as an unfinished assistant message, the server
re-tokenising that text. Leaving them to a fresh generation at the new cap would mix kept short rows with new,
shorter-on-average draws for the long ones (the set would skew short), so that is never done. The
re-tokenisation is the caveat of the text route: the server's count of the prefill (usage.prompt_tokens minus
the prompt) may differ from the tokens the row was generated as; each continued-by-text run measures it and
says so in its notes.

Growing the trainer's window (`to_window`): a config of the window policy is continued to a larger window L2, each
row to its own new request cap min(cap, L2 - prompt + overshoot): the new config is the one a fresh run at L2
would hash to. A row that stopped stays what it was (copied); a window-complete row is continued by its token ids
from where it stopped, paying only the tokens between the two windows.

Exactly-once like the engine, with the engine's pieces: the committed parts of `completions/shard=K/` are
the only ledger (the new config's done set is read from them on every start), the shard lock, recovery,
compaction and the engine's dispatch loop (retries with backoff, ejection, a 400 never resent, failures).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import pyarrow.compute as pc

from dflash_assets.fleet.client import ServerError
from dflash_assets.fleet.fleet import Fleet
from dflash_assets.fleet.stream import Watch
from dflash_assets.generation.commit import ShardOutput
from dflash_assets.generation.engine import turn_row, window_columns
from dflash_assets.generation.plan import ShardResult, preflight, prompt_batches, reject_row
from dflash_assets.generation.preflight import Budget, check_fleet
from dflash_assets.generation.provenance import parent_settings, record_continued
from dflash_assets.generation.reasoning import PARSERS, THINK_END, Reasoning
from dflash_assets.generation.request import chat_body
from dflash_assets.generation.send import Dispatch, next_turn, turn_item, turn_sender, watch_of
from dflash_assets.generation.slots import Slot
from dflash_assets.generation.turns import FINISHED as OVER
from dflash_assets.generation.turns import Answer, conversations, regenerate_of, rejected_turns, turns_of_row
from dflash_assets.rules import RUNAWAY_FINISH
from dflash_assets.settings import SAMPLING_PARAMS, DispatchSettings, GenerationSettings, RunawaySettings, SettingsError
from dflash_assets.store.configs import latest_order
from dflash_assets.store.parts import PartStore
from dflash_assets.store.schema import COMPLETION_SCHEMA, CompletionRow, FailureRow, RejectRow, as_dicts
from dflash_assets.store.storage import Storage, open_storage
from dflash_assets.store.stores import committed_keys, completion_store, failure_store, prompt_store, reject_store

FINISHED = ("stop", "length", RUNAWAY_FINISH)  # what a continuation may end with; "abort" is retried

PLAN_COLUMNS = {
    name: pc.field(name)
    for name in (
        "prompt_id",
        "finish_reason",
        "completion_tokens",
        "prompt_tokens",
        "model",
        "max_output_tokens",
        "enable_thinking",
        "policy_cap",
        "trainer_max_length",
        "turn",
        "thinking_share",
        "mode_seed",
        *SAMPLING_PARAMS,
    )
} | {
    "n_prompt_ids": pc.list_value_length(pc.field("prompt_token_ids")),  # null when the run stored no ids
    "n_output_ids": pc.list_value_length(pc.field("output_ids")),
}


@dataclass
class ContinuationResult(ShardResult):
    """What continuing one shard did; `prompts == completed + rejected + failed + left` for the new config."""

    parent_config_hash: str = ""
    parent_cap: int = 0
    new_cap: int = 0
    continued: int = 0  # rows continued by this run
    regenerated: int = 0  # turns after a continued one generated by this run (regenerate all_turns)
    copied: int = 0  # stopped rows copied by this run
    without_ids: int = 0  # truncated parent rows without token ids: left to a generation run at the new cap
    left: int = 0  # prompts the new config has no row, reject or failure for: a generation run's work
    tokens_reused: int = 0  # over every row of the new config (this run's and earlier ones)
    new_config_tokens: int = 0  # completion tokens of every row of the new config


def rows_of(
    store: PartStore, config_hash: str, columns=None, wanted: set[str] | None = None, batch_size: int = 256
) -> Iterator[list[dict]]:
    """Committed rows of one config, a batch at a time; parts written before a column existed read it as null."""
    parts = store.parts()
    if not parts or wanted == set():
        return
    where = pc.field("config_hash") == config_hash
    if wanted is not None:
        where = where & pc.field("prompt_id").isin(sorted(wanted))
    dataset = store.storage.dataset(parts, schema=COMPLETION_SCHEMA)
    for batch in dataset.to_batches(columns=columns, filter=where, batch_size=batch_size):
        if batch.num_rows:
            yield batch.to_pylist()


def key(row: dict) -> tuple[str, int | None]:
    """What a row of a config is one of: its prompt's conversation and its turn (null: its only one)."""
    return row["prompt_id"], row["turn"]


def latest_parent(data_dir: str | Path | Storage, shard: str, new_cap: int, to_window: int | None = None) -> str | None:
    """`latest`: the most recently written config with rows in the shard (rules.latest_first) among those capped
    below `new_cap`. Below the cap, so a finished continuation is never its own parent. With `to_window`: among the
    window-policy configs of a smaller window."""
    order = latest_order(data_dir, shard)
    if to_window is None:
        return next((h for h, cap in order if cap < new_cap), None)
    table = completion_store(data_dir, shard).read(["config_hash", "trainer_max_length"])
    windows = dict(zip(*table.group_by("config_hash").aggregate([("trainer_max_length", "max")]).to_pydict().values()))
    return next((h for h, _ in order if windows.get(h) is not None and windows[h] < to_window), None)


def _window_settings(plan: list[dict]) -> dict:
    """A window-policy parent's cap, window and overshoot, read off its rows: the overshoot from a row whose request
    was sized by the window (its own cap below the policy's); the fixed policy for a fixed cap."""
    first = plan[0]
    if first.get("policy_cap") is None:
        return {"cap_policy": "fixed"}
    window = first["trainer_max_length"]
    sized = next((r for r in plan if r["max_output_tokens"] < r["policy_cap"] and r["prompt_tokens"] is not None), None)
    overshoot = (
        sized["max_output_tokens"] - (window - sized["prompt_tokens"]) if sized else GenerationSettings().overshoot
    )
    return {
        "max_output_tokens": first["policy_cap"],
        "cap_policy": "window",
        "trainer_max_length": window,
        "overshoot": overshoot,
    }


def _parent_config(plan: list[dict], parent: str, provenance: dict | None = None) -> GenerationSettings:
    """The parent's GenerationSettings, rebuilt from what its rows record (and the `provenance` its hash covers)
    and checked against its hash."""
    first = plan[0]
    recorded = {k: first[k] for k in SAMPLING_PARAMS if first.get(k) is not None}
    generation = GenerationSettings(
        **({"max_output_tokens": first["max_output_tokens"]} | _window_settings(plan)),
        enable_thinking=first["enable_thinking"],
        thinking_share=first.get("thinking_share"),
        mode_seed=first.get("mode_seed") or 0,
        regenerate=regenerate_of(first.get("turn") is not None),
        **recorded,
    ).with_provenance(provenance)
    if generation.config_hash(first["model"]) != parent:  # settings the rows do not record, e.g. chat_template_kwargs
        raise SettingsError(
            f"config {parent} cannot be rebuilt from its rows ({generation}, model {first['model']!r} "
            f"hash to {generation.config_hash(first['model'])}); it cannot be continued"
        )
    return generation


def _copied(row: dict, config_hash: str, generation: GenerationSettings) -> CompletionRow:
    """A stopped row is complete at any larger cap: the same completion, recorded under the new config (with the
    cap its request would have had there).

    It keeps the parent's provenance (server, latency, attempt, created_at): it is the same generation."""
    return CompletionRow.of(
        {
            **row,
            "config_hash": config_hash,
            "max_output_tokens": generation.request_cap(row["prompt_tokens"]),
            **window_columns(generation),
            "parent_config_hash": row["config_hash"],
            "tokens_reused": row["completion_tokens"],
        }
    )


def _continued(
    row: dict,
    resp: dict,
    slot: Slot,
    reasoning: Reasoning,
    config_hash: str,
    generation: GenerationSettings,
    attempt: int,
    latency: float,
    text: str,
) -> CompletionRow:
    new_ids = list(resp["output_ids"])
    finish = resp["meta_info"]["finish_reason"] or {}
    if finish.get("type") not in FINISHED:  # an abort without an HTTP error status: try again
        raise ServerError(slot.url, f"/generate finished with {finish!r}")
    ids = row["output_ids"] + new_ids
    # `text` is the whole output (parent's ids + new ids) decoded in one piece by the server, then split as the
    # chat route splits a fresh answer
    thought, content = reasoning.split(text)
    return CompletionRow.of(
        {
            **row,
            "config_hash": config_hash,
            "finish_reason": finish["type"],
            "max_output_tokens": generation.request_cap(row["prompt_tokens"]),
            **window_columns(generation),
            "completion_tokens": len(ids),
            "reasoning_tokens": reasoning.tokens(ids),  # the parent's + the new
            "server_context_length": slot.info.context_length,
            "server_url": slot.url,
            "model": slot.info.model,
            "content": content,
            "reasoning_content": thought,
            "latency_s": latency,
            "attempt": attempt,
            "created_at": datetime.now(UTC),
            "output_ids": ids,
            "parent_config_hash": row["config_hash"],
            "tokens_reused": len(row["output_ids"]),
            "loop_start_tokens": None
            if finish.get("loop_start_tokens") is None
            else len(row["output_ids"]) + finish["loop_start_tokens"],
        }
    )


def _raw_text_without_ids(row: dict, reasoning: Reasoning) -> str:
    """The row's output text before the reasoning split, read from its text: without ids, the thought closed
    when content followed it (Qwen3 writes "\n\n" after </think>, so a closed thought leaves content)."""
    if row["output_ids"] is not None:
        return reasoning.raw_text(row)
    return reasoning.raw_text({**row, "output_ids": list(reasoning.end_ids) if row["content"] else []})


async def _by_text(
    row: dict,
    slot: Slot,
    attempt: int,
    reasoning: Reasoning,
    messages_json: str,
    generation: GenerationSettings,
    config_hash: str,
    drift: list[int],
    watch: Watch | None = None,
) -> CompletionRow:
    """Continue a row without token ids by its text: SGLang's chat route with the raw output as the final,
    unfinished assistant message (`continue_final_message`); the raw continuation comes back unsplit."""

    raw = _raw_text_without_ids(row, reasoning)
    messages = [*json.loads(messages_json), {"role": "assistant", "content": raw}]
    body = chat_body(generation, slot.info.model, messages, prompt_id=row["prompt_id"])  # the row's mode
    body |= {
        "max_completion_tokens": generation.request_cap(row["prompt_tokens"]) - row["completion_tokens"],
        "continue_final_message": True,
        "separate_reasoning": False,
    }
    t0 = time.monotonic()
    resp = await slot.client.chat(body, watch)
    choice, usage = resp["choices"][0], resp.get("usage") or {}
    if choice.get("finish_reason") not in FINISHED:
        raise ServerError(slot.url, f"chat finished with {choice.get('finish_reason')!r}")
    new = usage.get("completion_tokens") or 0
    drift.append((usage.get("prompt_tokens") or 0) - row["prompt_tokens"] - row["completion_tokens"])
    thought, content = reasoning.split(raw + (choice["message"].get("content") or ""))
    closed_before = THINK_END in raw
    new_reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return CompletionRow.of(
        {
            **row,
            "config_hash": config_hash,
            "finish_reason": choice["finish_reason"],
            "max_output_tokens": generation.request_cap(row["prompt_tokens"]),
            **window_columns(generation),
            "completion_tokens": row["completion_tokens"] + new,
            "reasoning_tokens": (row["reasoning_tokens"] or 0) + (0 if closed_before else new_reasoning),
            "server_context_length": slot.info.context_length,
            "server_url": slot.url,
            "model": slot.info.model,
            "content": content,
            "reasoning_content": thought,
            "latency_s": time.monotonic() - t0,
            "attempt": attempt,
            "created_at": datetime.now(UTC),
            "parent_config_hash": row["config_hash"],
            "tokens_reused": row["completion_tokens"],
            "loop_start_tokens": None
            if choice.get("loop_start_tokens") is None
            else row["completion_tokens"] + choice["loop_start_tokens"],
        }
    )


async def continue_shard(
    data_dir: str | Path,
    shard: str,
    fleet: Fleet,
    parent_config_hash: str,
    new_cap: int,
    dispatch: DispatchSettings = DispatchSettings(),
    *,
    log: Callable[[str], None] = print,
    to_window: int | None = None,
    runaway: RunawaySettings | None = None,
) -> ContinuationResult:
    """Continue the truncated rows of `parent_config_hash` in `shard` to `new_cap`; copy its stopped rows.

    `to_window`: the parent is a window-policy config; continue it to this larger trainer window instead (each row
    to its own request cap there; `new_cap` is then ignored). With `dispatch.stream`, every request is streamed and
    watched (stalls, and loops by the `runaway` rules)."""
    storage = open_storage(data_dir)
    watch = watch_of(dispatch, runaway)
    started = time.monotonic()
    prompts = prompt_store(storage, shard)
    store, failures = completion_store(storage, shard), failure_store(storage, shard)
    server_rejects = reject_store(storage, shard, "server")
    preflight_rejects = reject_store(storage, shard, "preflight")
    if not prompts.parts():
        raise FileNotFoundError(f"shard {shard} has no prompt_shards file under {storage}")
    with store.lock():
        store.recover()
        server_rejects.recover()
        plan = [r for batch in rows_of(store, parent_config_hash, PLAN_COLUMNS) for r in batch]
        if not plan:
            raise SettingsError(f"shard {shard} has no rows of config {parent_config_hash} to continue")
        parent = _parent_config(plan, parent_config_hash, parent_settings(storage, parent_config_hash, fleet))
        if to_window is not None:
            if not parent.windowed:
                raise SettingsError(
                    f"config {parent_config_hash} has a fixed cap ({parent.max_output_tokens}): "
                    f"--to-window continues a config of the window policy; raise a fixed cap with --to"
                )
            if to_window <= parent.trainer_max_length:
                raise SettingsError(
                    f"new window {to_window} must be larger than the parent's window {parent.trainer_max_length}"
                )
            generation = parent.model_copy(update={"trainer_max_length": to_window})
            new_cap = generation.max_output_tokens
        elif new_cap <= parent.max_output_tokens:
            raise SettingsError(f"new cap {new_cap} must be larger than the parent's cap {parent.max_output_tokens}")
        if fleet.model != plan[0]["model"]:
            raise SettingsError(
                f"config {parent_config_hash} was generated by {plan[0]['model']!r} but the fleet "
                f"serves {fleet.model!r}; a continuation must come from the same model"
            )
        if odd := sorted({str(i.reasoning_parser) for i in fleet.infos if i.reasoning_parser not in PARSERS}):
            raise SettingsError(
                f"the fleet runs reasoning parser {', '.join(odd)}; continued text can only be split "
                f"the way {', '.join(str(p) for p in PARSERS)} split it"
            )
        if to_window is None:
            generation = parent.model_copy(update={"max_output_tokens": new_cap})
        config_hash = generation.config_hash(fleet.model)
        record_continued(storage, config_hash, generation, fleet)
        # a file name of our own, so a generation run's rejects and failures of the same config are never replaced
        own_file = f"{config_hash}-from-{parent_config_hash}.parquet"
        run = ContinuationResult(
            shard,
            config_hash,
            fleet.model,
            notes=check_fleet(fleet.infos, generation.enable_thinking),
            parent_config_hash=parent_config_hash,
            parent_cap=parent.max_output_tokens,
            new_cap=new_cap,
        )
        done, refused = committed_keys(store, config_hash), committed_keys(server_rejects, config_hash)
        run.already_done = len(done)
        lines, messages, sources, tools = {}, {}, {}, {}
        for b in prompt_batches(prompts, ["prompt_id", "line", "source", "messages_json", "tools_json"]):
            for r in b:
                lines[r["prompt_id"]] = r["line"]
                messages[r["prompt_id"]] = r["messages_json"]
                sources[r["prompt_id"]] = r["source"]
                tools[r["prompt_id"]] = r["tools_json"]
        run.prompts = len(lines)

        todo = [r for r in plan if key(r) not in done and key(r) not in refused]
        exact = [
            r
            for r in todo
            if r["finish_reason"] == "stop"
            or (r["finish_reason"] == "length" and r["n_prompt_ids"] is not None and r["n_output_ids"] is not None)
        ]
        run.without_ids = sum(r["finish_reason"] == "length" and r["n_output_ids"] is None for r in todo)
        exact += [r for r in todo if r["finish_reason"] == "length" and r["n_output_ids"] is None]  # by text
        # the same rule as a fresh run at the new cap: a copied row must fit it too, or the new config would
        # hold a row its own requests could not have produced (and the context-overflow check would flag it)
        budget = Budget.of(fleet.infos)
        for r in exact:
            r["line"] = lines.get(r["prompt_id"])
            r["prompt_tokens"] = r["n_prompt_ids"] or r["prompt_tokens"]  # exact when the ids are there
        over = {
            key(r): reject_row(r, "preflight", problem, generation, config_hash, shard, budget.context_length)
            for r, problem in preflight(exact, budget, generation)
        }
        preflight_rejects.replace(as_dicts(over.values()), own_file)
        # a cut row whose request would not grow (the window policy's cap reached already) stays as it is: copied
        grows = {
            key(r)
            for r in exact
            if generation.request_cap(r["prompt_tokens"]) > (r["n_output_ids"] or r["completion_tokens"] or 0)
        }
        copies = {key(r) for r in exact if (r["finish_reason"] == "stop" or key(r) not in grows) and key(r) not in over}
        to_continue = {
            key(r) for r in exact if r["finish_reason"] == "length" and key(r) not in over and key(r) in grows
        }
        # a conversation whose cut turn is continued goes on: the turns after it are generated in order, on a history
        # that holds the continued answer; after a kill, from its last committed turn
        cut_at = {r["prompt_id"]: r["turn"] or 1 for r in plan if r["finish_reason"] == "length"}
        states = conversations(storage, shard, config_hash, generation, replanned=False)
        going_on = {
            pid: c
            for pid, c in states.items()
            if pid in cut_at and c.over is None and len(c.answers) >= cut_at[pid] and (pid, c.next_turn) not in refused
        }
        log(
            f"shard {shard}: continuing config {parent_config_hash} (cap {parent.max_output_tokens}) as {config_hash} "
            f"(cap {new_cap}): {len(plan)} parent rows, {len(done)} already done, {len(copies)} stopped rows to copy, "
            f"{len(to_continue)} truncated rows to continue, {len(going_on)} conversations to go on after a continued "
            f"turn, {run.without_ids} truncated without token ids (left to a generation run), {len(over)} rejected in "
            f"preflight"
        )

        for batch in rows_of(
            store, parent_config_hash, wanted={pid for pid, _ in copies}, batch_size=dispatch.commit_rows
        ):
            mine = [r for r in batch if key(r) in copies]
            store.commit(as_dicts(_copied(r, config_hash, generation) for r in mine))
            run.copied += len(mine)

        # the answers before each continued turn: the history of the turns after it
        before: dict[str, dict[int, str]] = {}
        for batch in rows_of(store, parent_config_hash, ["prompt_id", "turn", "content"], {p for p, _ in to_continue}):
            for r in batch:
                if (r["turn"] or 1) < cut_at[r["prompt_id"]]:
                    before.setdefault(r["prompt_id"], {})[r["turn"]] = r["content"] or ""

        # whether a parent's output closed its thought is read from its ids: </think> as the server tokenizes it
        end_ids = await fleet.clients[0].tokenize(THINK_END) if to_continue else []

        def turn_of(pid: str, turn: int, answers: Sequence[Answer], prompt_tokens: int | None = None) -> dict:
            """A conversation's turn to generate, as the engine's plan makes it."""
            conversation = turns_of_row({"messages_json": messages[pid], "tools_json": tools[pid]}, generation)
            return {
                "prompt_id": pid,
                "shard": shard,
                "line": lines[pid],
                "source": sources[pid],
                "conversation": conversation,
                "turn": turn,
                "turns": conversation.count,
                "answers": list(answers),
                "prompt_tokens": prompt_tokens,
            }

        def to_send() -> Iterator[dict]:
            for batch in rows_of(store, parent_config_hash, wanted={pid for pid, _ in to_continue}):
                for row in batch:
                    if key(row) in to_continue:
                        row["line"] = lines.get(row["prompt_id"])  # for a reject row; not a completion column
                        yield row
            for pid, c in going_on.items():
                yield turn_of(pid, len(c.answers) + 1, list(c.answers))

        drift: list[int] = []  # re-tokenisation drift of each row continued by text, in tokens

        def make_row(item: dict, resp: dict, slot: Slot, attempt: int, latency: float) -> CompletionRow:
            row = turn_row(item, resp, slot, generation, config_hash, attempt, latency)
            return replace(row, parent_config_hash=parent_config_hash, tokens_reused=0)  # made by this continuation

        # the turns after a continued one keep their token ids, as the continued one does: the config goes on by them
        regenerate = turn_sender(fleet, generation, True, make_row, watch)

        async def send(row: dict, slot: Slot, attempt: int) -> CompletionRow:
            if "conversation" in row:  # a turn after a continued one
                run.regenerated += 1
                return await regenerate(row, slot, attempt)
            reasoning = Reasoning.of(  # the row's own mode (a seeded mix: each prompt its own)
                slot.info.reasoning_parser, bool(row["enable_thinking"]), end_ids, slot.info.always_thinks
            )
            if row["output_ids"] is None:
                return await _by_text(
                    row, slot, attempt, reasoning, messages[row["prompt_id"]], generation, config_hash, drift, watch
                )
            # the rest of the new cap: new_cap - old_cap for a row cut at its cap, and a row the server clamped
            # short of its cap still ends where a fresh run at the new cap would
            sampling = {
                "max_new_tokens": generation.request_cap(row["prompt_tokens"]) - len(row["output_ids"]),
                **generation.sampling(),
            }
            t0 = time.monotonic()
            resp = await slot.client.generate(
                {"input_ids": row["prompt_token_ids"] + row["output_ids"], "sampling_params": sampling}, watch
            )
            text = await slot.client.detokenize(row["output_ids"] + list(resp["output_ids"]))
            return _continued(row, resp, slot, reasoning, config_hash, generation, attempt, time.monotonic() - t0, text)

        def follow(item: dict, row: CompletionRow) -> dict | None:
            """The turn after a continued (or regenerated) one that stopped, on the history that holds it."""
            if "conversation" not in item:
                answers = [a for _, a in sorted(before.get(row.prompt_id, {}).items())]
                item = turn_of(row.prompt_id, row.turn or 1, answers, row.prompt_tokens)
            return next_turn(item, row)

        def refuse(row: dict, reason: str, context: int) -> RejectRow:
            return reject_row(
                turn_item(row) if "conversation" in row else row,
                "server",
                reason,
                generation,
                config_hash,
                shard,
                context,
            )

        output = ShardOutput(run, store, server_rejects, preflight_rejects, failures, own_file)
        dispatcher = Dispatch(fleet, dispatch, {shard: output}, send, refuse, log, follow_up=follow)
        await dispatcher.run(to_send(), len(to_continue) + len(going_on))
        output.close()
        run.continued = sum(s["completed"] for s in run.servers.values()) - run.regenerated
        if drift:
            off = [d for d in drift if d]
            run.notes.append(
                f"{len(drift)} rows continued by text (no token ids): the server's re-tokenisation of "
                f"their output differed from the generated token count in {len(off)} of them"
                + (f" (by {min(off)} to {max(off)} tokens)" if off else "")
            )
        _account(run, storage, shard, generation, output.failed)
    run.elapsed_s = time.monotonic() - started
    return run


def _account(
    run: ContinuationResult, data_dir: Storage, shard: str, generation: GenerationSettings, failed: list[FailureRow]
) -> None:
    """The new config's figures from what is committed, each conversation in the first class that applies (a
    generation run's rows and rejects of the new config count too: the accounting is the config's, not this run's)."""
    h = run.config_hash
    states = conversations(data_dir, shard, h, generation)
    stores = [reject_store(data_dir, shard, s) for s in ("preflight", "server")]
    rejected = rejected_turns(stores, h)
    run.completed = sum(c.over in OVER for c in states.values())
    stages = [rejected[pid][len(c.answers) + 1] for pid, c in states.items() if c.over == "rejected"]
    run.rejected_preflight, run.rejected_server = stages.count("preflight"), stages.count("server")
    open_ = {pid for pid, c in states.items() if c.over is None}
    run.failed = len({f.prompt_id for f in failed} & open_)
    run.left = run.prompts - run.completed - run.rejected - run.failed
    for batch in rows_of(completion_store(data_dir, shard), h, ["completion_tokens", "tokens_reused"]):
        run.new_config_tokens += sum(r["completion_tokens"] or 0 for r in batch)
        run.tokens_reused += sum(r["tokens_reused"] or 0 for r in batch)
