"""Partitions, defined once. A shard is a fixed range of source lines; its keys live in the instance."""

import functools
import warnings

import dagster as dg

from dflash_assets.settings import Deployment

SHARDS = "shards"  # the dynamic partitions' name (the instance keys them by it)
shard_partitions = dg.DynamicPartitionsDefinition(name=SHARDS)

# A backfill runs up to this many shards per run, and completions streams their prompts through one
# dispatcher, so the servers' slots do not drain at every shard boundary (the `sglang_fleet` pool in
# dagster_home/dagster.yaml lets a second run overlap the first one's tail). A backfill policy is part of the
# asset definition, which Dagster fixes when the code location loads (it takes no EnvVar): settings.Deployment
# reads it then, the one place deployment settings are read.
SHARDS_PER_RUN = int(Deployment.SHARDS_PER_RUN.value())
shard_backfill_policy = dg.BackfillPolicy.multi_run(max_partitions_per_run=SHARDS_PER_RUN)
# `@asset(backfill_policy=...)` is marked beta in 1.13 yet is the documented way to shape backfill runs;
# silence exactly that notice so loading the code location stays free of warnings.
warnings.filterwarnings("ignore", message="Parameter `backfill_policy` of function `asset`", category=dg.BetaWarning)


# Every shard-partitioned asset is declared the same way; the fleet's pool is added by the ones that use it.
shard_asset = functools.partial(
    dg.asset, partitions_def=shard_partitions, backfill_policy=shard_backfill_policy, owners=["team:dflash"]
)
