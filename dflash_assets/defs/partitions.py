"""Partitions, defined once. A shard is a fixed range of source lines; its keys live in the instance."""

import functools
import warnings

import dagster as dg

from dflash_assets.settings import Deployment

SHARDS = "shards"  # the dynamic partitions' name (the instance keys them by it)
shard_partitions = dg.DynamicPartitionsDefinition(name=SHARDS)

# A backfill runs up to this many shards per run through one dispatcher, so the servers' slots do not drain at
# every shard boundary. Read when the code location loads (a backfill policy takes no EnvVar).
SHARDS_PER_RUN = int(Deployment.SHARDS_PER_RUN.value())
shard_backfill_policy = dg.BackfillPolicy.multi_run(max_partitions_per_run=SHARDS_PER_RUN)
# `backfill_policy` is beta in 1.13 yet the documented way to shape backfill runs: that notice silenced
warnings.filterwarnings("ignore", message="Parameter `backfill_policy` of function `asset`", category=dg.BetaWarning)


# Every shard-partitioned asset is declared the same way; the fleet's pool is added by the ones that use it.
shard_asset = functools.partial(
    dg.asset, partitions_def=shard_partitions, backfill_policy=shard_backfill_policy, owners=["team:dflash"]
)
