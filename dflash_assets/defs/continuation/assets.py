"""continued_completions: truncated rows of a shard continued to a larger cap instead of generated again."""

import dagster as dg
from pydantic import Field

from dflash_assets.defs.completions.assets import completions
from dflash_assets.defs.faults import named_stops, preflight_failure
from dflash_assets.defs.metadata import ContinuationKeys, StepStopKeys
from dflash_assets.defs.partitions import shard_asset
from dflash_assets.defs.pools import holding
from dflash_assets.defs.resources import (
    FLEET_RETRY,
    DataDirResource,
    FleetResource,
    QualityResource,
    Refused,
    run_on_fleet,
)
from dflash_assets.fleet.fleet import Fleet
from dflash_assets.generation.continuation import ToWindow, continue_shard, latest_parent
from dflash_assets.generation.preflight import PreflightError
from dflash_assets.settings import DispatchSettings, QualitySettings, RunawaySettings, SettingsError


class ContinuationConfig(Refused, dg.Config, DispatchSettings):
    """Which config to continue, to which cap. The rows land under the new cap's own config hash."""

    parent_config_hash: str = Field(
        description="The config whose truncated rows are continued, or 'latest': the most recently written "
        "config of the shard among those capped below the new cap (ties: the larger cap)."
    )
    new_max_output_tokens: int = Field(8192, description="The new cap; larger than the parent's.")
    to_window: int = Field(
        0,
        description="Grow the trainer's window instead (0: off): a window-policy config is continued to this "
        "larger window, each row to its own request cap there; rows that stopped stay, window-complete "
        "rows are continued by their token ids (only the tokens between the windows are paid).",
    )


@shard_asset(
    deps=[completions],
    group_name="generation",
    kinds={"sglang", "parquet"},
    retry_policy=FLEET_RETRY,
    description="Completions of the shard at a larger cap, made from a smaller cap's rows: truncated rows are "
    "continued by token ids on the fleet (only the missing tokens are generated), stopped rows are "
    "copied; every row records parent_config_hash and tokens_reused. Truncated rows without token ids "
    "are continued by their text (chat route, continue_final_message), never drawn afresh. Under regenerate "
    "all_turns, the turns after a continued one are generated in order on the history that holds it.",
)
def continued_completions(
    context: dg.AssetExecutionContext,
    config: ContinuationConfig,
    fleet: FleetResource,
    data_dir: DataDirResource,
    quality: QualityResource,
) -> None:
    runaway = QualitySettings.taken_from(quality).runaway

    async def each(connected):  # one connection for the range: connecting waits >= 1 s for every /health
        for shard in context.partition_keys:  # one shard, or a backfill's range of them, one after the other
            context.add_asset_metadata(
                await _continue(context, shard, config, connected, data_dir, runaway), partition_key=shard
            )

    with named_stops(context, data_dir, retry=FLEET_RETRY), holding(context, context.partition_keys):
        run_on_fleet(fleet, each)  # under the shards' pools and the fleet's


async def _continue(
    context: dg.AssetExecutionContext,
    shard: str,
    config: ContinuationConfig,
    fleet: Fleet,
    data_dir: DataDirResource,
    runaway: RunawaySettings,
) -> dict:
    cap, window = config.new_max_output_tokens, config.to_window or None
    parent = config.parent_config_hash
    if parent == "latest":
        latest = latest_parent(data_dir.resolved(), shard, cap, window)
        if latest is None:
            below = f"of the window policy at a window below {window}" if window else f"capped below {cap}"
            raise dg.Failure(f"shard {shard} has no completions {below} to continue", allow_retries=False)
        parent = latest
    try:
        run = await continue_shard(
            data_dir.resolved(),
            shard,
            fleet,
            parent,
            cap if window is None else ToWindow(window),
            DispatchSettings.taken_from(config),
            log=context.log.info,
            runaway=runaway,
        )  # the checks' own rules
    except SettingsError as e:
        raise dg.Failure(str(e), metadata={StepStopKeys.CAUSE: "config"}, allow_retries=False) from None
    except PreflightError as e:
        raise preflight_failure(e) from None
    for note in run.notes:
        context.log.warning(note)
    if run.left:
        context.log.warning(
            f"{run.left} prompts have no row of config {run.config_hash} yet ({run.without_ids} of "
            f"them truncated without token ids): materialise completions for this shard with "
            f"max_output_tokens {run.new_cap}"
            + (f", cap_policy window, trainer_max_length {window}" if window else "")
            + " (same sampling) to generate exactly those"
        )
    accounted = run.completed + run.rejected + run.failed + run.left
    generated = run.new_config_tokens - run.tokens_reused
    return {
        "dagster/row_count": run.completed,
        ContinuationKeys.CONFIG_HASH: run.config_hash,
        "parent_config_hash": run.parent_config_hash,
        "max_output_tokens": run.new_cap,
        **({"trainer_max_length": window} if window else {}),
        "parent_max_output_tokens": run.parent_cap,
        ContinuationKeys.ROWS_CONTINUED: run.continued,
        ContinuationKeys.ROWS_COPIED: run.copied,
        "turns_regenerated": run.regenerated,  # all_turns: the turns after a continued one, generated in order
        "rows_without_ids": run.without_ids,
        ContinuationKeys.STILL_TRUNCATED: run.length,
        ContinuationKeys.TOKENS_REUSED: run.tokens_reused,
        ContinuationKeys.TOKENS_GENERATED: generated,
        ContinuationKeys.SAVED_SHARE: round(run.tokens_reused / run.new_config_tokens, 4)
        if run.new_config_tokens
        else 0.0,
        "accounting": f"{run.prompts} prompts = {run.completed} completed + {run.rejected} rejected + "
        f"{run.failed} failed + {run.left} left" + ("" if accounted == run.prompts else f" (MISMATCH: {accounted})"),
        "elapsed_s": round(run.elapsed_s, 2),
        "servers": dg.MetadataValue.json(run.servers),
    }
