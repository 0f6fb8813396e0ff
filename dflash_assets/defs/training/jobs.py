"""training_export: the summary report and the drafter training set."""

import dagster as dg

from dflash_assets.defs.quality.assets import length_quality_summary
from dflash_assets.defs.training.assets import drafter_training_set

training_job = dg.define_asset_job(
    "training_export",
    selection=dg.AssetSelection.assets(length_quality_summary, drafter_training_set),
    description="The summary report and the drafter training set (refused while a blocking check fails).",
)
