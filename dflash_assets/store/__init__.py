"""The data dir: row schemas, committed parts on local or S3 storage, and the prompt, completion, reject and
failure stores of each shard. The layer `generation/` writes through and `quality/` reads through (no Dagster)."""
