"""Arrow's pool is jemalloc in any process that imports dflash_assets first (dflash_assets/__init__.py), and
ARROW_DEFAULT_MEMORY_POOL still chooses: the memory a backfill gives back depends on it (benchmarks/RESULTS.md)."""

import os
import subprocess
import sys

import pytest

PROBE = "import dflash_assets, pyarrow as pa; pa.array([1]); print(pa.default_memory_pool().backend_name)"


def backend(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    done = subprocess.run([sys.executable, "-c", PROBE], env=clean | env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.skipif(sys.platform != "linux", reason="pyarrow's Linux wheels have jemalloc")
def test_arrow_allocates_from_jemalloc_unless_the_environment_names_another_pool():
    assert backend() == "jemalloc"
    assert backend(ARROW_DEFAULT_MEMORY_POOL="mimalloc") == "mimalloc"
    assert backend(ARROW_DEFAULT_MEMORY_POOL="system") == "system"
