"""Kill `dflash demo` as a user does, many times, then run it once more: it must finish, lose nothing, duplicate nothing.

    uv run python scripts/kill_demo.py --kills 20 [--seed 1] [--max-delay 25]

Each round starts `dflash demo` (the emulated fleet, decoding slowly, the bundled prompts) in a fresh DAGSTER_HOME and
data dir kept across rounds and SIGKILLs its whole process group: at a seeded random 1..max-delay seconds after the
start, or (every other round) 0..5 s after the round's first new committed part, inside completions. Then one more run
goes to its end. Printed: where each kill landed (rows committed before and after), the last run's exit status,
duplicates of (prompt_id, config_hash, turn), prompts without a row, runs the instance still calls STARTED, and the
emulator processes the killed runs left behind (they stop when their parent dies). Exit status 0 when every figure holds.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import duckdb
import psutil

ROOT = Path(__file__).resolve().parents[1]


def rows(data: Path, table: str, columns: str) -> list[tuple]:
    files = sorted(str(p) for p in (data / table).rglob("*.parquet"))
    return duckdb.sql(f"select {columns} from read_parquet({files!r})").fetchall() if files else []


def wait_for_rows(data: Path, before: int, proc: subprocess.Popen, bound_s: float = 600.0) -> bool:
    """Until more completion rows are committed than `before`; False if the run ends first."""
    deadline = time.monotonic() + bound_s
    while len(rows(data, "completions", "prompt_id")) <= before:
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def demo(env: dict, out) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dflash_assets.cli", "demo"],
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=ROOT,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-delay", type=float, default=25.0, help="latest kill, seconds after the start")
    ap.add_argument("--final-timeout", type=float, default=1800.0)
    ap.add_argument(
        "--emulator-args",
        default="--reasoning-parser qwen3 --decode-tokens-per-s 100",
        help="DFLASH_EMULATOR_ARGS: decoding slow enough that the kills land while it generates",
    )
    args = ap.parse_args()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="kill-demo-"))
    (work / "home").mkdir()
    (work / "home" / "dagster.yaml").write_text((ROOT / "dagster_home" / "dagster.yaml").read_text())
    env = {
        **os.environ,
        "DAGSTER_HOME": str(work / "home"),
        "DFLASH_DATA_DIR": str(work / "data"),
        "DFLASH_EMULATOR_ARGS": args.emulator_args,
    }
    data, left_behind = work / "data", set()
    print(f"kill_demo: {args.kills} kills (seed {args.seed}), in {work}")
    for i in range(args.kills):
        before = len(rows(data, "completions", "prompt_id"))
        with open(work / f"kill{i:02d}.txt", "w") as out:
            proc = demo(env, out)
            started = time.monotonic()
            # every other kill waits for a new committed part first, so that kills land inside completions too,
            # whatever the machine's start-up time; the others land at any moment (start-up, prompt_shards, ...)
            if i % 2 and not wait_for_rows(data, before, proc):
                print(f"  kill {i + 1:2d}: the run ended by itself first ({proc.returncode})")
                continue
            delay = rng.uniform(0.0, 5.0) if i % 2 else rng.uniform(1.0, args.max_delay)
            try:
                proc.wait(timeout=delay)
                print(f"  kill {i + 1:2d}: the run ended by itself first ({proc.returncode})")
                continue
            except subprocess.TimeoutExpired:
                delay = time.monotonic() - started
            children = {p.pid: p for p in psutil.Process(proc.pid).children(recursive=True)}
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        left_behind |= {pid for pid, p in children.items() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE}
        print(
            f"  kill {i + 1:2d} at {delay:5.1f} s{' (after a new part)' if i % 2 else ''}: completion rows {before} -> {len(rows(data, 'completions', 'prompt_id'))}"
        )
    time.sleep(3)  # what a killed run started may take a poll to notice its parent is gone
    leaked = [pid for pid in left_behind if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    started = time.monotonic()
    with open(work / "final.txt", "w") as out:
        final = demo(env, out)
        status = final.wait(timeout=args.final_timeout)
    # a row is a prompt's, or one turn's under all_turns (regenerate auto on the demo's multi-turn prompts)
    completions = rows(data, "completions", "prompt_id, config_hash, turn")
    accepted = {r[0] for r in rows(data, "prompt_shards", "prompt_id")}
    duplicates = len(completions) - len(set(completions))
    missing = accepted - {r[0] for r in completions}
    import dagster as dg
    from dagster._core.instance.ref import InstanceRef

    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(work / "home"))) as instance:
        unfinished = [r.run_id for r in instance.get_runs() if not r.is_finished]
        failed = sum(r.status == dg.DagsterRunStatus.FAILURE for r in instance.get_runs())
    for pid in leaked:  # stop what we found, by pid
        os.kill(pid, signal.SIGKILL)
    print(f"final run: exit {status} in {time.monotonic() - started:.0f} s (0: done, 3: stopped by a blocking check)")
    print(
        f"rows {len(completions)} for {len(accepted)} accepted prompts: duplicates {duplicates}, "
        f"prompts without a row {len(missing)}"
    )
    print(
        f"runs: {failed} failed (the killed ones), {len(unfinished)} still STARTED; emulators left behind by the "
        f"kills: {len(leaked)}"
    )
    ok = status in (0, 3) and not duplicates and not missing and not unfinished and not leaked
    print("kill_demo: PASS" if ok else f"kill_demo: FAIL (see {work})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
