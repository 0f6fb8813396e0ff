"""prompt_shards: the prompt source, validated and cut into shards with exact token counts."""

import dagster as dg

from dflash_assets.defs.faults import named_stops
from dflash_assets.defs.metadata import PromptShardKeys
from dflash_assets.defs.partitions import shard_asset
from dflash_assets.defs.resources import DataDirResource, FleetResource, PromptSourceResource, run_on_fleet
from dflash_assets.generation.request import template_kwargs
from dflash_assets.generation.shards import SourceRules, build_prompt_shard, source_refusal
from dflash_assets.settings import GenerationSettings, QuotaSettings, RepeatSettings


@shard_asset(
    group_name="generation",
    kinds={"parquet", "sglang"},
    description="One shard of the prompt source: validated prompts with a stable prompt_id and the exact "
    "chat-template prompt_tokens counted by the fleet's /v1/tokenize. Lines that cannot be used go "
    "to the rejects table with a reason; lines = prompts + rejects.",
)
def prompt_shards(
    context: dg.AssetExecutionContext,
    fleet: FleetResource,
    prompt_source: PromptSourceResource,
    data_dir: DataDirResource,
) -> None:
    kwargs = template_kwargs(GenerationSettings())  # the source's prompts are counted in the default mode
    rules = SourceRules(
        prompt_source.mapping(), RepeatSettings.taken_from(prompt_source), QuotaSettings.taken_from(prompt_source)
    )
    bad = [shard for shard in context.partition_keys if not shard.isdigit()]
    if bad:
        raise dg.Failure(f"shard key {bad[0]!r} is not a shard number such as '00003'")
    # before anything is written: a data dir belongs to one prompt source (store/source.py)
    refusal = source_refusal(
        prompt_source.resolved(), prompt_source.shard_size, data_dir.resolved(), list(context.partition_keys)
    )
    if refusal:
        raise dg.Failure(refusal, allow_retries=False, metadata={"cause": "config"})

    async def build_range(connected):
        # one connection for the whole range: connecting waits for every server's /health (>= 1 s on 0.5.23)
        builds = []
        for shard in context.partition_keys:  # one shard, or a backfill's range of them in one run
            builds.append(
                (
                    shard,
                    await build_prompt_shard(
                        prompt_source.resolved(),
                        int(shard),
                        shard,
                        prompt_source.shard_size,
                        data_dir.resolved(),
                        connected,
                        kwargs,
                        rules,
                    ),
                )
            )
            if builds[-1][1].lines == 0:
                break  # past the end of the source: the shards after it are too
        return builds

    with named_stops(context, data_dir):
        builds = run_on_fleet(fleet, build_range)
    for shard, build in builds:
        if build.lines == 0:
            raise dg.Failure(f"shard {shard} is past the end of {prompt_source.path}: it has no lines")
        reasons = "\n".join(f"| {k} | {v} |" for k, v in sorted(build.reasons.items(), key=lambda kv: -kv[1]))
        context.log.info(f"shard {shard}: {build.lines} lines -> {build.prompts} prompts, {build.rejected} rejected")
        context.add_asset_metadata(
            partition_key=shard,
            metadata={
                PromptShardKeys.ROW_COUNT: build.prompts,
                PromptShardKeys.LINES: build.lines,
                PromptShardKeys.PROMPTS: build.prompts,
                PromptShardKeys.REJECTED: build.rejected,
                # lines repeating an earlier line of the source (generation/dedupe.py): rejected unless kept
                "repeats": build.repeats,
                "max_prompt_tokens": build.max_prompt_tokens,
                # the source format detected from the lines' keys (prompts.FORMATS), and how many prompts had each
                "format": next(iter(build.formats), "none"),
                "prompts_by_format": dg.MetadataValue.json(build.formats),
                "rejects_by_reason": dg.MetadataValue.md(
                    "| reason | lines |\n|---|---|\n" + reasons if reasons else "no rejects"
                ),
            },
        )
