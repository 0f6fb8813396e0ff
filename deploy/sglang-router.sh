#!/usr/bin/env bash
# The SGLang model gateway (smg 1.13, `pip install smg==1.13.0`) in front of SGLang 0.5.23 servers on several GPU
# nodes; dflash-assets attaches to its one URL. tests/engines/test_gateway.py runs this file, with loopback addresses.
#
#   deploy/sglang-router.sh http://10.0.0.5:30000 http://10.0.0.5:30001 http://10.0.0.6:30000 ...
#   DFLASH_FLEET_MODE=attach DFLASH_FLEET_URLS=http://<gateway host>:30000 dagster dev -w workspace.yaml
#
# Servers: one per GPU on each node, e.g. `dflash fleet up --model-path Qwen/Qwen3-32B --gpus 0,1,2,3 --host 0.0.0.0
# --reasoning-parser qwen3` there. Register them by addresses the orchestrator can reach too: it reads each
# server's context length, input limit and effective max_running_requests, and counts prompt tokens, on the
# servers themselves (the gateway has none of these exactly); generation requests go through the gateway.
#
# Environment: SMG_HOST (127.0.0.1; 0.0.0.0 to serve other hosts), SMG_PORT (30000), SMG_METRICS_PORT (29000),
# SMG_HEALTH_INTERVAL_S (5). Servers started with --api-key behind the gateway are not exercised here.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 WORKER_URL [WORKER_URL ...]" >&2; exit 2; }

args=(
  --worker-urls "$@"
  --host "${SMG_HOST:-127.0.0.1}" --port "${SMG_PORT:-30000}"
  --prometheus-host 127.0.0.1 --prometheus-port "${SMG_METRICS_PORT:-29000}"
  --policy cache_aware
  # Retries are the client's: it retries a failed request with backoff on the gateway, records the attempt on
  # the row and counts failures. A retry inside the gateway too would multiply attempts, unseen.
  --disable-retries
  # A generation can decode for an hour; the gateway must not cut it before the client's own timeout (3600 s).
  --request-timeout-secs 3900
  # A dead server is taken out of rotation within two probes, so the client's retries land on live ones.
  --health-check-interval-secs "${SMG_HEALTH_INTERVAL_S:-5}" --health-failure-threshold 2
  # The gateway only routes; it loads no tokenizer (prompts are counted on the servers).
  --disable-tokenizer-autoload
)
exec smg launch "${args[@]}"
