"""Arrow allocates from jemalloc unless ARROW_DEFAULT_MEMORY_POOL names a pool: mimalloc, its default, kept the pages
each thread freed, and a backfill's memory grew with its rows (benchmarks/RESULTS.md)."""

import os
import sys

if sys.platform == "linux":  # pyarrow's Linux wheels have jemalloc
    os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "jemalloc")
