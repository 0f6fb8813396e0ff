"""The SGLang model gateway (`smg` 1.13) as the tests run it: deploy/sglang-router.sh, the command a user runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dflash_assets.emulator.process import free_port
from tests.support.dagster_procs import ROOT, start_group

SCRIPT = ROOT / "deploy" / "sglang-router.sh"


def start_smg(worker_urls: list[str], log_path: Path, health_interval_s: int = 1) -> tuple[subprocess.Popen, str]:
    """smg in front of `worker_urls` on a free loopback port (its process group, and its URL), probing each worker's
    health every `health_interval_s` (the script says 5 s for a real fleet; 1 marks a worker down, or up, sooner)."""
    port = free_port()
    env = {
        **os.environ,
        "SMG_PORT": str(port),
        "SMG_METRICS_PORT": str(free_port()),
        "SMG_HEALTH_INTERVAL_S": str(health_interval_s),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    return start_group(["bash", str(SCRIPT), *worker_urls], env, log_path), f"http://127.0.0.1:{port}"
