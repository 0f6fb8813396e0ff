#!/usr/bin/env bash
# An SGLang model gateway in front of servers on several GPU nodes; dflash-assets attaches to it.
# Servers (one per GPU, on each node), e.g. through `dflash fleet up` there:
#   dflash fleet up --model-path Qwen/Qwen3-32B --gpus 0,1,2,3,4,5,6,7 --host 0.0.0.0 --reasoning-parser qwen3
# The gateway (smg 1.13 reads /v1/loads from 0.5.23 workers; sglang-router 0.3.2 lacks that load signal).
# Retries are off: a retried 30-minute generation is GPU time spent twice; the client retries elsewhere itself.
set -euo pipefail
smg launch --worker-urls "$@" --policy cache_aware --host 127.0.0.1 --port 30000 --disable-retries
# or: python -m sglang_router.launch_router --worker-urls "$@" --policy cache_aware --port 30000
# then: DFLASH_FLEET_MODE=attach DFLASH_FLEET_URLS=http://127.0.0.1:30000 dagster dev -w workspace.yaml
