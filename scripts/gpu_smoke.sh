#!/usr/bin/env bash
# A smoke run on a real GPU: launch one SGLang 0.5.23 server with a small model, drive every branch of the
# pipeline through it and compare what the client recorded with the server's own /server_info and /metrics.
#
#   scripts/gpu_smoke.sh --model-path Qwen/Qwen3-0.6B [--gpu 0] [--port 30555] [--work-dir DIR] [--keep-server]
#
# Needs the `serve` extra (sglang and its CUDA torch) on the host. DFLASH_SGLANG_COMMAND picks how the server
# is started: sglang (default: `sglang serve`), launch_server (`python -m sglang.launch_server`), a full command
# line, or `emulator` (the project's SGLang emulator: how CI runs this script, unchanged). The API key, if any,
# comes from DFLASH_API_KEY. Exit status: 0 all agree, 1 a disagreement (the table says which), 2 no run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${DFLASH_PYTHON:-}
if [[ -z "$PYTHON" ]]; then
  exec uv run --no-sync python scripts/gpu_smoke.py "$@"
fi
exec "$PYTHON" scripts/gpu_smoke.py "$@"
