"""Arrow's buffers come from jemalloc unless ARROW_DEFAULT_MEMORY_POOL names another pool (read once, before Arrow's
first allocation): its default, mimalloc, keeps the pages each thread freed, and a backfill's resident memory grew
with its rows (benchmarks/RESULTS.md, "The orchestrator's memory")."""

import os
import sys

if sys.platform == "linux":  # pyarrow's Linux wheels have jemalloc
    os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "jemalloc")
