"""`dflash demo` with no flags: decoded tokens per trained token, as the demo itself prints them (issue 53).

Runs the real command (Dagster, emulated servers, the export) in a fresh DAGSTER_HOME and data dir, once as it is
(regenerate auto: all_turns for the demo's multi-turn prompts) and once with `--regenerate last_turn`, and, for
comparison, with the fixed cap the demo had before the window policy was the default (`--cap-policy fixed
--max-output-tokens 16384`). Prints the figures of the demo's closing answer: "decoded D tokens, trained T".

    uv run python benchmarks/bench_demo_default.py
"""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

RUNS = {
    "dflash demo": [],
    "dflash demo --regenerate last_turn": ["--regenerate", "last_turn"],
    "dflash demo --cap-policy fixed --max-output-tokens 16384": [
        "--cap-policy",
        "fixed",
        "--max-output-tokens",
        "16384",
    ],
}
FIGURE = re.compile(r"decoded ([\d,]+) tokens, trained ([\d,]+) \(([\d.]+) decoded per trained token\)")


def run(flags: list[str], root: Path) -> tuple[int, int]:
    env = {**os.environ, "DAGSTER_HOME": str(root / "home"), "DFLASH_DATA_DIR": str(root / "data")}
    env.pop("DFLASH_PROMPTS", None)
    out = subprocess.run(
        [sys.executable, "-m", "dflash_assets.cli", "demo", *flags],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=1800,
    ).stdout
    found = FIGURE.search(re.sub(r"\s+", " ", out))
    if not found:
        raise SystemExit(f"no decoded/trained figure in the demo's output:\n{out}")
    return int(found.group(1).replace(",", "")), int(found.group(2).replace(",", ""))


def main() -> None:
    print("dflash demo: decoded tokens per trained token (the demo's own figures)")
    print(f"  {'command':<60} {'decoded':>10} {'trained':>10} {'decoded/trained':>16}")
    for label, flags in RUNS.items():
        with tempfile.TemporaryDirectory() as tmp:
            decoded, trained = run(flags, Path(tmp))
        print(f"  {label:<60} {decoded:>10,} {trained:>10,} {decoded / trained:>16.4f}")


if __name__ == "__main__":
    main()
