"""Partitions, defined once. A shard is a fixed range of source lines; its keys live in the instance."""

import dagster as dg

shard_partitions = dg.DynamicPartitionsDefinition(name="shards")
