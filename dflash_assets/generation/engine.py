"""Generate the completions of shards (`generate_shards`): plan.py (what is left, preflight), send.py (dispatch with
retries), commit.py (parts, failures, the shard's figures); continuation.py runs the same three for its own plan.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

from dflash_assets.fleet.client import ChatResult
from dflash_assets.fleet.fleet import Fleet
from dflash_assets.generation.commit import ShardOutput, account
from dflash_assets.generation.plan import (
    ShardResult,
    plan_shard,
    reject_row,
)
from dflash_assets.generation.preflight import check_fleet
from dflash_assets.generation.prompts import canonical_json, carries_history
from dflash_assets.generation.provenance import run_settings
from dflash_assets.generation.quarantine import carry_over, quarantine_note
from dflash_assets.generation.request import GenerationRun, config_columns, request_cap, thinks
from dflash_assets.generation.send import Dispatch, Sent, next_turn, turn_sender, watch_of
from dflash_assets.generation.stopping import Stopped
from dflash_assets.generation.tools import answer_message, calls_differ, clean_calls
from dflash_assets.generation.turns import TurnItem, every_turn
from dflash_assets.rules import row_finish, stores_token_ids
from dflash_assets.settings import DispatchSettings, GenerationSettings
from dflash_assets.store.schema import CompletionRow, RejectRow
from dflash_assets.store.storage import Storage, open_storage
from dflash_assets.store.stores import (
    completion_store,
    failure_store,
    prompt_store,
)


def turn_row(
    item: TurnItem, answer: ChatResult, sent: Sent, generation: GenerationSettings, config_hash: str
) -> CompletionRow:
    """The completion row of a conversation's turn (a plan's item or a follow-up) from its chat answer, with everything
    that made it: its request's own cap, the turn as its conversation's rows record it."""
    calls = answer.tool_calls
    row = CompletionRow(
        prompt_id=item.prompt_id,
        shard=item.shard,
        source=item.source,
        config_hash=config_hash,
        finish_reason=row_finish(answer.finish_reason),
        prompt_tokens=answer.prompt_tokens,
        completion_tokens=answer.completion_tokens,
        reasoning_tokens=answer.reasoning_tokens,
        max_output_tokens=request_cap(generation, item.prompt_tokens or 0),
        **config_columns(generation),
        server_context_length=sent.slot.info.context_length,
        server_url=sent.slot.url,
        model=sent.slot.info.model,
        enable_thinking=thinks(generation, item.prompt_id),  # the prompt's mode under a mix
        content=answer.content or "",
        tool_calls_json=canonical_json(clean_calls(calls)) if calls else None,
        reasoning_content=answer.reasoning_content,
        latency_s=sent.latency_s,
        attempt=sent.attempt,
        created_at=datetime.now(UTC),
        prompt_token_ids=answer.prompt_token_ids,
        output_ids=answer.output_ids,
        cached_tokens=answer.cached_tokens,
        loop_start_tokens=answer.loop_start_tokens,
        turn=item.recorded_turn,
        turns=item.recorded_turns,
    )
    if not item.conversation.tools:
        return row
    made = json.loads(row.tool_calls_json) if row.tool_calls_json else []
    message = answer_message(row.content or "", row.tool_calls_json)
    return replace(
        row,
        calls_differ=calls_differ(made, item.conversation.source_calls_of(item.turn)),
        diverged=row.finish_reason == "stop" and item.conversation.ends_after(item.turn, message),
    )


def resolve_regenerate(data_dir: Storage, generation: GenerationSettings) -> GenerationSettings:
    """`regenerate: auto` for a caller that names no prompt source, resolved over every prompt shard built in the
    data dir (the `completions` asset resolves it over the whole source: prompts.source_turns)."""
    if generation.regenerate != "auto":
        return generation
    root = data_dir.root / "prompt_shards"
    parts = [p for p in data_dir.walk(root) if p.suffix == ".parquet"] if data_dir.exists(root) else []
    batches = data_dir.dataset(parts, partitioning=None).to_batches(columns=["messages_json"]) if parts else []
    found = any(carries_history(json.loads(m)) for batch in batches for m in batch.column(0).to_pylist())
    return generation.resolved(found)


async def generate_shards(
    data_dir: str | Path,
    shards: list[str],
    fleet: Fleet,
    run: GenerationRun,
    *,
    log: Callable[[str], None] = print,
    on_answer: Callable[[int, int], None] | None = None,
) -> list[ShardResult]:
    """Generate several shards (a backfill's range) through ONE dispatcher, in order, so the servers' slots do not
    drain at shard boundaries; each shard still has its own lock, parts, rejects, failures and figures.
    """
    storage = open_storage(data_dir)
    generation = run_settings(storage, resolve_regenerate(storage, run.generation), fleet)  # provenance in its hash
    fleet_notes = check_fleet(fleet.infos, generation.enable_thinking)
    if missing := [s for s in shards if not prompt_store(storage, s).parts()]:
        raise FileNotFoundError(
            f"shard(s) {', '.join(missing)} have no prompt_shards file under {storage}; "
            f"materialise prompt_shards for them first"
        )
    config_hash = generation.config_hash(fleet.model)
    with ExitStack() as locks:
        plans = []
        for shard in shards:  # every shard is planned (and preflighted) before anything is sent
            locks.enter_context(completion_store(storage, shard).lock())
            plans.append(await plan_shard(storage, shard, fleet, generation, run.preflight_policy, config_hash, log))
            plans[-1].run.fleet_notes = list(fleet_notes)
        outputs = {p.run.shard: ShardOutput.of(storage, p.run, f"{config_hash}.parquet") for p in plans}
        for p in plans:  # prompts an earlier run quarantined stay failed, unsent, unless asked
            retry = run.dispatch.retry_quarantined
            outputs[p.run.shard].failed += carry_over(failure_store(storage, p.run.shard), config_hash, p, retry)

        def make_row(item: TurnItem, answer: ChatResult, sent: Sent) -> CompletionRow:
            return turn_row(item, answer, sent, generation, config_hash)

        def refuse(item: TurnItem, reason: str, context: int) -> RejectRow:
            return reject_row(item, "server", reason, generation, config_hash, context, item.recorded_turn)

        items = itertools.chain.from_iterable(plan.to_send() for plan in plans)
        token_ids = stores_token_ids(run.dispatch.store_token_ids, generation.cap_policy)
        send = turn_sender(fleet, generation, token_ids, make_row, watch_of(run.dispatch, run.runaway))
        dispatcher = Dispatch(fleet, run.dispatch, outputs, send, refuse, log, follow_up=next_turn, on_answer=on_answer)
        try:
            await dispatcher.run(items, sum(len(p.todo) for p in plans))
        except Stopped:  # a polite stop closes the shards' parts as their end does
            for output in outputs.values():
                output.close()
            raise
        for output in outputs.values():
            output.close()
            output.run.notes += quarantine_note(output.run.shard, output.failed)
            account(output.run, storage, output, generation, every_turn(generation))
    return [p.run for p in plans]


async def generate_shard(
    data_dir: str | Path,
    shard: str,
    fleet: Fleet,
    generation: GenerationSettings,
    dispatch: DispatchSettings = DispatchSettings(),
    *,
    log: Callable[[str], None] = print,
    on_answer: Callable[[int, int], None] | None = None,
    **run,
) -> ShardResult:
    """Generate the completions of one shard (see generate_shards); `run`: GenerationRun's preflight_policy and
    runaway."""
    [result] = await generate_shards(
        data_dir, [shard], fleet, GenerationRun(generation, dispatch, **run), log=log, on_answer=on_answer
    )
    return result
