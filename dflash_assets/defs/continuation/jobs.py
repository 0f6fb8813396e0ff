"""continue_shards: truncated rows continued to a larger cap."""

import dagster as dg

from dflash_assets.defs.continuation.assets import continued_completions

continue_job = dg.define_asset_job(
    "continue_shards",
    selection=dg.AssetSelection.assets(continued_completions),
    description="Truncated rows continued to a larger cap from where they stopped (token ids), stopped rows copied: "
    "the unbiased way to raise the cap (`dflash continue --to C`).",
)
