"""Step 3 of generating a shard: commit what came back (completion rows and the server's refusals as Parquet parts;
the failures a whole file per config, rewritten when the shard closes), and close the shard.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace

from dflash_assets.generation.plan import ShardResult, ended_at_window_note
from dflash_assets.generation.slots import Slot
from dflash_assets.generation.turns import FINISHED, Conversation, conversations, rejected_turns
from dflash_assets.rules import stopped_early
from dflash_assets.settings import GenerationSettings
from dflash_assets.store.parts import PartStore
from dflash_assets.store.schema import CompletionRow, FailureRow, RejectRow
from dflash_assets.store.storage import Storage
from dflash_assets.store.stores import completion_store, failure_store, reject_store, suspect_store


def generated_tokens(row: CompletionRow) -> int:
    """Tokens a server generated for this row: a continued row reuses its parent's first tokens_reused."""
    return (row.completion_tokens or 0) - (row.tokens_reused or 0)


@dataclass
class ShardOutput:
    """Where one shard's results go, what has not been committed yet, and the shard's own figures."""

    run: ShardResult
    store: PartStore
    server_rejects: PartStore
    turn_rejects: PartStore | None = None  # preflight rejects of turns refused when sent, committed as parts
    failures: PartStore | None = None  # the failures table, and this run's own file in it (the config's)
    failure_file: str = ""
    suspects: PartStore | None = None  # prompts in flight at a server's death (generation/quarantine.py)
    rows: list[CompletionRow] = field(default_factory=list)
    refused: list[RejectRow] = field(default_factory=list)
    failed: list[FailureRow] = field(default_factory=list)
    in_flight: int = 0  # items of this shard handed to the dispatcher and not answered yet

    @classmethod
    def of(cls, storage: Storage, run: ShardResult, failure_file: str, suspects: bool = True) -> ShardOutput:
        """The shard's parts, rejects, failures (this run's own file in it) and suspects (a generation run's)."""
        shard = run.shard
        return cls(
            run,
            completion_store(storage, shard),
            reject_store(storage, shard, "server"),
            reject_store(storage, shard, "preflight"),
            failure_store(storage, shard),
            failure_file,
            suspect_store(storage, shard) if suspects else None,
        )

    @property
    def pending(self) -> int:
        return len(self.rows) + len(self.refused)

    def answered(self, slot: Slot, row: CompletionRow) -> None:
        """A completion of this shard came back from `slot`'s server: count it for this shard."""
        self.rows.append(row)
        mine = self.run.servers.setdefault(slot.url, {"completed": 0, "output_tokens": 0})
        mine["completed"] += 1
        mine["output_tokens"] += generated_tokens(row)

    def sent(self, now: float) -> None:
        self.in_flight += 1
        self.run.first_sent_at = self.run.first_sent_at or now

    def done(self, now: float, all_sent: bool) -> None:
        """One item of this shard is answered (a row, a refusal or a failure)."""
        self.in_flight -= 1
        self.run.answered_at = now
        if all_sent:
            self.close_sending(now)

    def close_sending(self, now: float) -> None:
        """Nothing more of this shard will be sent; it is finished when its last item is answered."""
        self.run.last_sent_at = self.run.last_sent_at or now
        if self.in_flight == 0 and self.run.finished_at is None:
            self.run.finished_at = now
            self.run.elapsed_s = now - self.run.first_sent_at if self.run.first_sent_at is not None else 0.0

    async def commit(self) -> None:
        batch, rej = self.rows, self.refused
        self.rows, self.refused = [], []
        server = [r for r in rej if r.stage == "server"]
        before_sending = [r for r in rej if r.stage != "server"]
        # rejects first: a crash between the two resends a completed prompt's reject-free row next time,
        # never a rejected prompt twice
        await asyncio.to_thread(self.server_rejects.commit, server)
        if before_sending and self.turn_rejects is not None:
            await asyncio.to_thread(self.turn_rejects.commit, before_sending)
        await asyncio.to_thread(self.store.commit, batch)
        self.run.length += sum(r.finish_reason == "length" for r in batch)
        self.run.runaways_stopped += sum(stopped_early(r.finish_reason) for r in batch)
        self.run.output_tokens += sum(generated_tokens(r) for r in batch)
        self.run.rejected_server += len(server)
        self.run.rejected_preflight += len(before_sending)

    def commit_failures(self) -> None:
        """The shard's failures replace its run's failure file (at its end, and at once when a prompt is
        quarantined: a run that then fails for lack of servers keeps the quarantine)."""
        if self.failures is not None:
            self.failures.replace(self.failed, self.failure_file)

    def close(self) -> None:
        """The shard's run is over: its failures replace the config's failure file, its parts are compacted."""
        self.commit_failures()
        self.run.failed = len(self.failed)
        self.store.compact()
        if self.run.finished_at is None:  # stopped early (an error): the figures up to now
            self.in_flight = 0
            self.close_sending(time.monotonic())


def account(
    run: ShardResult, data_dir: Storage, output: ShardOutput, generation: GenerationSettings, numbered: bool
) -> dict[str, Conversation]:
    """The shard's figures from what is committed, and where each conversation stands, each in one class:
    completed (over, every turn it will have committed), rejected (a turn refused) or failed (a turn whose retries ran
    out in this run). `numbered`: the rows record turn numbers, and the figures by turn are kept."""
    states = {
        pid: replace(c, over="window") if pid in run.ended_at_window else c
        for pid, c in conversations(data_dir, run.shard, run.config_hash, generation).items()
    }
    stores = [reject_store(data_dir, run.shard, s) for s in ("preflight", "server")]
    rejected = rejected_turns(stores, run.config_hash)
    run.completed = sum(c.over in FINISHED for c in states.values())
    stages = [rejected[pid][len(c.answers) + 1] for pid, c in states.items() if c.over == "rejected"]
    run.rejected_preflight, run.rejected_server = stages.count("preflight"), stages.count("server")
    run.failed = len({f.prompt_id for f in output.failed})
    if run.ended_at_window:
        run.notes.append(ended_at_window_note(run, generation.trainer_max_length))
    if not numbered:
        return states
    by_turn: dict[int, dict[str, int]] = {}

    def of_turn(k: int) -> dict[str, int]:
        return by_turn.setdefault(k, {"rows": 0, "truncated": 0, "rejected": 0, "ended_at_window": 0})

    for c in states.values():
        for k in range(1, len(c.answers) + 1):
            of_turn(k)["rows"] += 1
        if c.over in ("truncated", "rejected"):
            of_turn(len(c.answers) + (c.over == "rejected"))[c.over] += 1
        if c.over == "diverged":  # an agentic conversation only (turns.py): counted where it happens
            turn = of_turn(len(c.answers))
            turn["diverged"] = turn.get("diverged", 0) + 1
    for k in run.ended_at_window.values():  # the turn not sent
        of_turn(k)["ended_at_window"] += 1
    run.by_turn = dict(sorted(by_turn.items()))
    run.truncated_at = {pid: len(c.answers) for pid, c in states.items() if c.over == "truncated"}
    return states
