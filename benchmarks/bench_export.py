"""The export's peak memory as the rows grow (issue 43, item 7): the same synthetic shards (bench_quality.py's
writer: real schemas, zstd, 10,000 rows a shard, text of the demo's sizes) at each row count, every config exported
by `export_training_set` in a fresh process, whose peak RSS (ru_maxrss) is printed side by side.

    uv run python benchmarks/bench_export.py [--rows 100000,1000000] [--shard-rows 10000] [--form conversations]
"""

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_quality import write_shard


def child(data: str, out: str, form: str) -> None:
    """Run in a fresh process: the export, then its peak RSS and rows as one JSON line."""
    from dflash_assets.quality import export_training_set

    start = time.perf_counter()
    export = export_training_set(data, out, config_hash=None, form=form)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    print(json.dumps({"rows": export.manifest["rows"], "peak_mb": peak_mb, "s": time.perf_counter() - start}))


def measure(rows: int, shard_rows: int, form: str, args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="bench_export_") as tmp:
        data = Path(tmp) / "data"
        for s in range(rows // shard_rows):
            write_shard(data, f"{s:05d}", shard_rows, s * shard_rows, rng, args)
        size = sum(f.stat().st_size for f in data.rglob("*.parquet")) / 1e6
        done = subprocess.run(
            [sys.executable, __file__, "--child", str(data), str(Path(tmp) / "out"), form],
            check=True,
            capture_output=True,
            text=True,
        )
        return json.loads(done.stdout.strip().splitlines()[-1]) | {"input_rows": rows, "parquet_mb": size}


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        child(*sys.argv[2:5])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="100000,1000000", help="row counts, comma-separated")
    parser.add_argument("--shard-rows", type=int, default=10_000)
    parser.add_argument("--form", default="conversations")
    parser.add_argument("--content-bytes", type=int, default=400, help="mean bytes of content per row")
    parser.add_argument("--reasoning-bytes", type=int, default=1200, help="mean bytes of reasoning_content per row")
    parser.add_argument("--compression", default="zstd")
    args = parser.parse_args()
    results = [measure(int(n), args.shard_rows, args.form, args) for n in args.rows.split(",")]
    print(f"export ({args.form}) peak RSS by input rows, {args.shard_rows:,} rows a shard:")
    print(f"  {'input rows':>12} {'Parquet MB':>11} {'rows written':>13} {'export s':>9} {'peak RSS MB':>12}")
    for r in results:
        print(
            f"  {r['input_rows']:>12,} {r['parquet_mb']:>11,.0f} {r['rows']:>13,} {r['s']:>9.1f} {r['peak_mb']:>12,.0f}"
        )
    if len(results) > 1:
        print(
            f"  peak at {results[-1]['input_rows']:,} / at {results[0]['input_rows']:,}: "
            f"{results[-1]['peak_mb'] / results[0]['peak_mb']:.2f}x"
        )


if __name__ == "__main__":
    main()
