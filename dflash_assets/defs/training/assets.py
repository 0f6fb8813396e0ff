"""drafter_training_set: only rows that pass, in the format drafter trainers read. Nothing else goes on."""

import dagster as dg
from pydantic import Field

from dflash_assets.defs.completions.assets import completions
from dflash_assets.defs.faults import named_stops
from dflash_assets.defs.metadata import StepStopKeys, TrainingSetKeys
from dflash_assets.defs.quality.assets import ConfigChoice, choose_config, length_quality_report
from dflash_assets.defs.resources import DataDirResource, QualityResource
from dflash_assets.quality import export_training_set, gate_passed, run_checks
from dflash_assets.quality.training.export import exclusion_lines, trained_words
from dflash_assets.settings import QualitySettings
from dflash_assets.store.configs import latest_order
from dflash_assets.store.stores import committed_rows


class TrainingSetConfig(ConfigChoice):
    """The config to export (config_hash, chosen_by: ConfigChoice; 'all' exports every config, ids
    <prompt_id>@<config_hash>), and how."""

    drop_over_max_length: bool = Field(
        False,
        description="Leave out rows longer than the trainer's max_length. Off by default: they are the "
        "longest answers, trainers cut them at training time, and the max_length_overflow "
        "check (WARN) counts them.",
    )
    form: str = Field(
        "",
        description="'' for the trainer's format (the quality resource's trainer.format); 'conversations': "
        "SpecForge's {id, status, conversations} (what its validate_regenerated_data.py accepts); 'per_turn': "
        "one row per assistant turn (SpecForge's generation events, train_only_last_turn); 'messages': the OpenAI "
        "{id, messages}; 'pretokenized': {id, input_ids, loss_mask} from the stored token ids, cut at the "
        "trainer's window; 'auto': per_turn for all_turns under a template that drops earlier reasoning, else "
        "conversations.",
    )


@dg.asset(
    # downstream of the report, whose blocking checks gate it in a run; across runs it runs the checks itself
    deps=[completions, length_quality_report],
    group_name="training",
    kinds={"duckdb", "parquet"},
    owners=["team:dflash"],
    description="The drafter training set: rows of one config (the run's, else the latest, the most recently "
    "written; or named: config_hash) that pass every row-level gate (window-complete "
    "rows included: cut past the trainer's window, read as whole), as SpecForge-"
    "compatible JSONL ({id, conversations: [..., {role: assistant, content, reasoning_content}]}) or "
    "pre-tokenized {id, input_ids, loss_mask} "
    "plus a Parquet copy and a manifest (counts by config and source, exclusions by reason). It is not "
    "written while a blocking check fails on that config over all shards. Deterministic: the same "
    "inputs give byte-identical files.",
)
def drafter_training_set(
    context: dg.AssetExecutionContext, config: TrainingSetConfig, data_dir: DataDirResource, quality: QualityResource
) -> dg.MaterializeResult:
    root, quality_settings = data_dir.resolved(), QualitySettings.taken_from(quality)
    chosen, chosen_by = choose_config(context, root, config)
    if config.config_hash != "all" and chosen is None:
        raise dg.Failure("there are no completions to export")
    present = [h for h, _ in latest_order(root)]
    if chosen is not None and chosen not in present:
        raise dg.Failure(f"no rows of config {chosen} to export; the configs here: {', '.join(present) or 'none'}")
    # the config exported is the config judged; 'all' judges every config (an incomplete one blocks it)
    outcomes = run_checks(root, config_hash=chosen, quality=quality_settings)
    if not gate_passed(outcomes):
        failing = [o for o in outcomes if o.blocking and not o.passed]
        raise dg.Failure(
            f"not exporting config {chosen or 'all'}: {len(failing)} blocking check(s) fail over all shards: "
            + "; ".join(f"{o.name}: {o.summary_md.splitlines()[0]}" for o in failing),
            metadata={
                StepStopKeys.CAUSE: "check",  # what the terminal reads: a blocking check stopped it (exit 3), not an error
                StepStopKeys.FAILING_CHECKS: dg.MetadataValue.json([o.name for o in failing]),
                **{o.name: dg.MetadataValue.md(o.summary_md) for o in failing},
            },
        )
    with named_stops(context, data_dir, lambda: committed_rows(root, config_hash=chosen)):
        export = export_training_set(
            root,
            data_dir.local_dir() / "training" / (chosen or "all"),
            config_hash=chosen,
            max_length=quality_settings.trainer.max_length,
            form=config.form or quality_settings.trainer.format,
            drop_over_max_length=config.drop_over_max_length,
            runaway=quality_settings.runaway,
            chat_template=quality_settings.trainer.chat_template,
            chosen_by=chosen_by,
            min_loss_tokens=quality_settings.trainer.min_loss_tokens,
            held_out_share=quality_settings.trainer.held_out_share,
            held_out_seed=quality_settings.trainer.held_out_seed,
            trainer=quality_settings.trainer.name,
        )
    manifest = export.manifest
    context.log.info(f"exported {manifest['rows']} rows of config {chosen or 'all'} to {export.jsonl_path}")
    excluded = "\n".join(f"- {line}" for line in exclusion_lines(manifest)) or "nothing was left out"
    return dg.MaterializeResult(
        metadata={
            TrainingSetKeys.ROW_COUNT: manifest["rows"],
            TrainingSetKeys.CONFIG_HASH: chosen or "all",
            TrainingSetKeys.CHOSEN_BY: chosen_by,
            TrainingSetKeys.JSONL: dg.MetadataValue.path(str(export.jsonl_path)),
            "parquet": dg.MetadataValue.path(str(export.parquet_path)),
            "held_out": dg.MetadataValue.path(str(export.held_out_path)) if export.held_out_path else "none",
            "rows_excluded": sum(e["rows"] for e in manifest["exclusions"]),
            "over_max_length_kept": manifest["over_max_length_kept"],
            "window_complete_kept": manifest["window_complete_kept"],
            "trainer": f"max_length {manifest['max_length']}, form {manifest['form']} "
            f"(change: {manifest['trainer']['how_to_change']})",
            TrainingSetKeys.TRAINER_SETTINGS: dg.MetadataValue.path(
                str(export.manifest_path.parent / manifest["trainer_settings"]["file"])
            )
            if manifest["trainer_settings"]["file"]
            else "none: " + manifest["trainer_settings"]["note"],
            "trained": dg.MetadataValue.md(trained_words(manifest)),
            "exclusions": dg.MetadataValue.md(excluded),
            TrainingSetKeys.MANIFEST: dg.MetadataValue.json(manifest),
        }
    )
