"""Metadata keys that one part of the Dagster layer writes and another reads back, each spelled once, here. Plain
`str` constants, not an Enum: Dagster's serdes refuses Enum metadata labels.
"""


def keys(group: type) -> set[str]:
    """Every key a group below declares."""
    return {v for k, v in vars(group).items() if k.isupper()}


class ShardRunKeys:
    """What `completions` records per shard, read back by the demo's table and the cap plan's throughput."""

    ROW_COUNT = "dagster/row_count"  # all_turns: a row per turn; COMPLETED counts conversations
    CONFIG_HASH = "config_hash"
    MODEL = "model"
    CONFIG_CAP = "config_cap"  # the config's cap (GenerationSettings.max_output_tokens)
    PROMPTS = "prompts"
    COMPLETED = "completed"
    ALREADY_DONE = "already_done"
    REJECTED_PREFLIGHT = "rejected_preflight"
    REJECTED_SERVER = "rejected_server"
    FAILED = "failed"
    ACCOUNTING = "accounting"
    NEW_ROWS_TRUNCATED = "new_rows_truncated"
    NEW_ROWS_RUNAWAY_STOPPED = "new_rows_runaway_stopped"  # loops stopped while streaming (finish_reason 'runaway')
    OUTPUT_TOKENS = "output_tokens"
    ELAPSED_S = "elapsed_s"
    TOKENS_PER_S = "tokens_per_s"
    SERVERS = "servers"
    BY_TURN = "by_turn"
    FLEET_TUNING = "fleet_tuning"  # the run's /v1/loads advice, on each shard of the run
    PROMPTS_FILLING_WINDOW = "prompts_filling_window"  # cap_policy fixed: prompts sent that fill the trainer's window


class CheckKeys:
    """What each quality check result carries (defs/quality/checks.py), read back by the terminal (cli/)."""

    SCOPE = "scope"  # for people: the shards checked, or "all shards"
    FAILING = "failing"  # for people: "shard 00001, shard 00004", or "none"
    FAILING_SHARDS = "failing_shards"  # for code: a JSON list of the shard keys that fail (a shard-less run: [])
    SUMMARY = "summary"
    JUDGED = "judged"  # for people: the config(s) judged (a shard run: the one its completions wrote)
    VERDICTS = "verdicts"  # for code: a JSON list of {shard, config_hash, passed, superseded}, one per judgement


class PromptShardKeys:
    """What `prompt_shards` records per shard (defs/prompts/assets.py), read back by the demo's table."""

    ROW_COUNT = "dagster/row_count"
    LINES = "lines"
    PROMPTS = "prompts"
    REJECTED = "rejected"


class ReportKeys:
    """What `length_quality_report` records per shard, read back by the demo's table."""

    CONFIG_HASH = "config_hash"  # whose figures the headline is: the run's config, else the shard's latest
    CHOSEN_BY = "config_chosen_by"  # run | latest | explicit
    TRUNCATION_RATE = "truncation_rate"
    REJECTS = "rejects"  # the shard's rejects by stage and reason, and the first with their lines (Markdown)
    CUT_INSIDE_WINDOW_RATE = "cut_inside_window_rate"
    P50, P90, P99 = "p50", "p90", "p99"


class ContinuationKeys:
    """What `continued_completions` records per shard, read back by `dflash continue`'s table."""

    CONFIG_HASH = "config_hash"
    ROWS_CONTINUED = "rows_continued"
    ROWS_COPIED = "rows_copied"
    STILL_TRUNCATED = "still_truncated"
    TOKENS_REUSED = "tokens_reused"
    TOKENS_GENERATED = "tokens_generated"
    SAVED_SHARE = "saved_share"


class TrainingSetKeys:
    """What `drafter_training_set` records (defs/training/assets.py), read back by the demo's last lines."""

    ROW_COUNT = "dagster/row_count"
    CONFIG_HASH = "config_hash"
    CHOSEN_BY = "config_chosen_by"  # run | latest | explicit: how the config was chosen (also in the manifest)
    JSONL = "jsonl"
    MANIFEST = "manifest"
    TRAINER_SETTINGS = (
        "trainer_settings"  # specforge_data.yaml beside the manifest (quality/training/trainer_settings.py)
    )


class StepStopKeys:
    """What a step that stopped on a fault records in its failure, read back by the terminal."""

    CAUSE = "cause"  # "config": a setting to fix; "preflight": the preflight refused the run (nothing was sent);
    # "exhausted": the disk (or open files) ran out; "retried"; "check": a blocking check stopped the export (exit 3)
    REFUSAL = "refusal"  # a config's or the preflight's refusal, in its own words (the numbers and the fix)
    CONTEXT_LENGTH_NEEDED = "context_length_needed"  # the preflight's: the servers' context length that would fit
    RERUN_CURES = "rerun_cures"  # True: the fault can pass (the fleet went away or was slow), the same command again
    FAILING_CHECKS = "failing_checks"  # JSON list of the blocking checks that stopped the export
    COMMITTED_ROWS = "committed_rows"  # the recount of the step's shards when it stopped (the run's config)
    COMMITTED_BY_SHARD = "committed_by_shard"  # JSON {shard: rows}
