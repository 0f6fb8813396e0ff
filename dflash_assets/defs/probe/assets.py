"""length_probe: a seeded random sample of the prompts generated at a high cap, the measurement the cap plan uses."""

from functools import partial

import dagster as dg

from dflash_assets.defs.faults import preflight_failure
from dflash_assets.defs.pools import holding
from dflash_assets.defs.prompts.assets import prompt_shards
from dflash_assets.defs.resources import DataDirResource, FleetResource, QualityResource, Refused, run_on_fleet
from dflash_assets.generation.preflight import PreflightError
from dflash_assets.generation.probe import probe_root, prompt_shard_keys, run_length_probe
from dflash_assets.quality.planning.planner import cut_rows_for_probe
from dflash_assets.settings import (
    DispatchSettings,
    GenerationSettings,
    ProbeSettings,
    QualitySettings,
    RequestSettings,
    SettingsError,
)


class LengthProbeConfig(Refused, dg.Config, ProbeSettings, RequestSettings, DispatchSettings):
    """The sample and its cap (ProbeSettings first: its max_output_tokens takes the run's place), the sampling of
    the run the plan is for, and how hard to drive the fleet."""


# its own group: materialised alone (`dflash probe`), never training data; the cap plan only reads it
@dg.asset(
    deps=[prompt_shards],
    group_name="probe",
    kinds={"sglang", "parquet"},
    owners=["team:dflash"],
    description="A seeded random sample of the prompts (by default the larger of 500 and 1%, stratified across "
    "shards and sources) generated at a high cap (by default the largest the fleet's context allows): "
    "real completions with their own config hash, kept under <data_dir>/length_probe/, never training "
    "data. The cap plan in length_quality_summary reads it to measure truncation at larger caps "
    "instead of extrapolating a model. With mode cut_rows it continues a seeded sample of the run's "
    "honest cut rows to its cap instead: every probe row then measures the tail.",
)
def length_probe(
    context: dg.AssetExecutionContext,
    config: LengthProbeConfig,
    fleet: FleetResource,
    data_dir: DataDirResource,
    quality: QualityResource,
) -> dg.MaterializeResult:
    root = data_dir.resolved()
    shards = prompt_shard_keys(root)
    if not shards:
        raise dg.Failure("no prompt shards to sample: materialise prompt_shards first")
    # the probe's cap is ProbeSettings.max_output_tokens (0: the largest the context allows), not the run's
    generation = GenerationSettings.taken_from(config, skip=("max_output_tokens",))
    sample, dispatch = ProbeSettings.taken_from(config), DispatchSettings.taken_from(config)
    try:
        with holding(context):  # the fleet's pool
            probe = run_on_fleet(
                fleet,
                lambda f: run_length_probe(
                    root,
                    shards,
                    f,
                    generation,
                    sample,
                    dispatch,
                    log=context.log.info,
                    # mode cut_rows: the honest cut rows, without the runaways the plan leaves out
                    cut_rows=partial(cut_rows_for_probe, root, QualitySettings.taken_from(quality).runaway),
                ),
            )
    except (SettingsError, FileNotFoundError) as e:
        raise dg.Failure(str(e)) from None
    except PreflightError as e:
        raise preflight_failure(e) from None
    run = probe.run
    for note in run.notes:
        context.log.warning(note)
    return dg.MaterializeResult(
        metadata={
            "dagster/row_count": run.completed,
            "mode": probe.mode,
            "prompts_sampled": probe.sampled,
            "prompts_total": probe.prompts_total,  # mode cut_rows: the run's honest cut rows
            "shards": len(shards),
            "seed": config.seed,
            "max_output_tokens": probe.cap,
            "config_hash": run.config_hash,
            "completed": run.completed,
            "rejected": run.rejected,
            "failed": run.failed,
            "truncated_at_probe_cap": run.length,
            "output_tokens": run.output_tokens,
            "tokens_per_s": round(run.output_tokens / run.elapsed_s, 1) if run.elapsed_s else 0.0,
            "path": dg.MetadataValue.path(str(probe_root(root))),
        }
    )
