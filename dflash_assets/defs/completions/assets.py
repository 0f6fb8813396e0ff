"""completions: one row per prompt and generation config, generated on the fleet, committed as Parquet."""

import dagster as dg
from pydantic import Field

from dflash_assets.defs.faults import named_stops, preflight_failure
from dflash_assets.defs.metadata import ShardRunKeys
from dflash_assets.defs.partitions import shard_asset
from dflash_assets.defs.pools import holding
from dflash_assets.defs.prompts.assets import prompt_shards
from dflash_assets.defs.resources import (
    FLEET_RETRY,
    DataDirResource,
    FleetResource,
    PromptSourceResource,
    QualityResource,
    Refused,
    run_on_fleet,
)
from dflash_assets.fleet.tuning import advise, summarize, tuning_markdown
from dflash_assets.generation.engine import ShardResult, generate_shards
from dflash_assets.generation.preflight import PreflightError
from dflash_assets.generation.prompts import SourceError, source_turns
from dflash_assets.generation.provenance import run_settings
from dflash_assets.generation.request import GenerationRun
from dflash_assets.settings import DispatchSettings, QualitySettings, RequestSettings
from dflash_assets.store.schema import COMPLETION_SCHEMA
from dflash_assets.store.stores import committed_rows


class CompletionsConfig(Refused, dg.Config, RequestSettings, DispatchSettings):
    """completions' run config: the generation settings (a change is a new config), how hard to drive the fleet,
    and what preflight does with a misfit. The window is the quality resource's trainer.max_length."""

    preflight_policy: str = Field(
        "reject",
        description="'reject': prompts that cannot fit the context go to the rejects table; "
        "'fail': the run fails before any request.",
    )


@shard_asset(
    deps=[prompt_shards],
    group_name="generation",
    kinds={"sglang", "parquet"},
    retry_policy=FLEET_RETRY,
    metadata={
        "dagster/column_schema": dg.TableSchema(
            columns=[dg.TableColumn(f.name, str(f.type)) for f in COMPLETION_SCHEMA]
        )
    },
    description="A completion per prompt of the shard, generated on the SGLang fleet, with full provenance "
    "(config_hash, cap, sampling, server, context length, finish_reason, token counts). A re-run "
    "resumes: prompts already committed for this config are skipped.",
)
def completions(
    context: dg.AssetExecutionContext,
    config: CompletionsConfig,
    fleet: FleetResource,
    data_dir: DataDirResource,
    quality: QualityResource,
    prompt_source: PromptSourceResource,
) -> None:
    # the window is the trainer's, the one; the loops a stream stops are the checks' own
    quality_settings = QualitySettings.taken_from(quality)
    history = _carries_history(context, config, prompt_source)
    run = GenerationRun.of(config, quality_settings, config.preflight_policy, history)
    config_hash: list[str] = []  # the run's, once the fleet has said its model: what a stop recounts

    async def generate(f):
        config_hash.append(run_settings(data_dir.resolved(), run.generation, f).config_hash(f.model))
        return await generate_shards(data_dir.resolved(), context.partition_keys, f, run, log=context.log.info)

    def committed() -> dict[str, int]:
        return committed_rows(data_dir.resolved(), context.partition_keys, config_hash[-1] if config_hash else None)

    with named_stops(context, data_dir, committed, FLEET_RETRY):
        try:
            with holding(context, context.partition_keys):  # the shards' pools and the fleet's
                runs = run_on_fleet(fleet, generate)
        except PreflightError as e:
            raise preflight_failure(e) from None
    for note in runs[0].fleet_notes if runs else []:  # the fleet's, once per run
        context.log.warning(note)
    for shard in runs:
        for note in shard.notes:  # the shard's own
            context.log.warning(note)
        if shard.failed:
            context.log.warning(
                f"shard {shard.shard}: {shard.failed} prompts failed (in the failures table): those that used their "
                f"{run.dispatch.max_attempts} attempts are sent again by the next run, a quarantined one only with "
                f"retry_quarantined (--retry-quarantined)"
            )
        context.add_asset_metadata(shard_metadata(shard, run.generation.max_output_tokens), partition_key=shard.shard)
    context.add_asset_metadata({ShardRunKeys.FLEET_TUNING: dg.MetadataValue.md(_tuning(context, runs[0]))})


def _carries_history(
    context: dg.AssetExecutionContext, config: CompletionsConfig, prompt_source: PromptSourceResource
) -> bool | None:
    """Whether a prompt of the source carries an earlier assistant turn (regenerate auto); None otherwise."""
    if config.regenerate != "auto":
        return None
    try:
        turns = source_turns(prompt_source.resolved(), prompt_source.mapping(), first_only=True)
    except (SourceError, ValueError) as e:
        raise dg.Failure(str(e), allow_retries=False) from None
    context.log.info(
        f"regenerate auto: {'all_turns' if turns.with_history else 'last_turn'} ("
        + (
            f"prompt {turns.prompts} of the source carries earlier assistant turns: every assistant turn is "
            f"regenerated, in order, so the trainer learns only the target model's answers"
            if turns.with_history
            else "no prompt of the source carries an earlier assistant turn"
        )
        + ")"
    )
    return turns.with_history > 0


def _tuning(context: dg.AssetExecutionContext, run: ShardResult) -> str:
    """The fleet's tuning advice from the run's /v1/loads samples: logged, and its Markdown for the metadata."""
    if not run.load_samples:
        return "no /v1/loads samples (the run was shorter than one interval)"
    limits = {u: s["in_flight_limit"] for u, s in run.servers.items()}
    advice = advise(run.load_samples, run.infos, client_in_flight=limits)
    for item in advice:
        if item.rule != "fine":
            context.log.info(f"fleet tuning, {item.server}: {item.message}")
    return tuning_markdown(summarize(run.load_samples, run.infos), advice)


def shard_metadata(run, config_cap: int) -> dict:
    accounted = run.completed + run.rejected + run.failed
    return {
        # all_turns: a row per turn; completed counts conversations
        ShardRunKeys.ROW_COUNT: sum(t["rows"] for t in run.by_turn.values()) if run.by_turn else run.completed,
        ShardRunKeys.CONFIG_HASH: run.config_hash,
        ShardRunKeys.MODEL: run.model,
        ShardRunKeys.CONFIG_CAP: config_cap,
        ShardRunKeys.PROMPTS: run.prompts,
        ShardRunKeys.COMPLETED: run.completed,
        ShardRunKeys.ALREADY_DONE: run.already_done,
        ShardRunKeys.REJECTED_PREFLIGHT: run.rejected_preflight,
        ShardRunKeys.REJECTED_SERVER: run.rejected_server,
        ShardRunKeys.FAILED: run.failed,
        ShardRunKeys.ACCOUNTING: f"{run.prompts} prompts = {run.completed} completed + {run.rejected} rejected + "
        f"{run.failed} failed" + ("" if accounted == run.prompts else f" (MISMATCH: {accounted})"),
        ShardRunKeys.NEW_ROWS_TRUNCATED: run.length,
        ShardRunKeys.NEW_ROWS_RUNAWAY_STOPPED: run.runaways_stopped,  # loops stopped while streaming ('runaway')
        ShardRunKeys.OUTPUT_TOKENS: run.output_tokens,
        ShardRunKeys.ELAPSED_S: round(run.elapsed_s, 2),
        ShardRunKeys.TOKENS_PER_S: round(run.output_tokens / run.elapsed_s, 1) if run.elapsed_s else 0.0,
        ShardRunKeys.SERVERS: dg.MetadataValue.json(run.servers),
        ShardRunKeys.PROMPTS_FILLING_WINDOW: run.filling_window,
        **(
            {ShardRunKeys.BY_TURN: dg.MetadataValue.json({str(k): v for k, v in run.by_turn.items()})}
            if run.by_turn
            else {}
        ),
    }


def configs_written_by_run(context: dg.AssetExecutionContext | dg.AssetCheckExecutionContext) -> dict[str, str]:
    """shard -> the config_hash this run's `completions` wrote there; empty when it materialised none."""
    written = {}
    for entry in context.instance.all_logs(context.run.run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION):
        m = entry.asset_materialization
        if m and m.asset_key == completions.key and m.partition and ShardRunKeys.CONFIG_HASH in m.metadata:
            written[m.partition] = m.metadata[ShardRunKeys.CONFIG_HASH].value
    return written


def run_config_hash(context: dg.AssetExecutionContext) -> str | None:
    """The config this run generated (None when it materialised no completions)."""
    return next(iter(configs_written_by_run(context).values()), None)
