"""The window tests' prompts and emulator: one seeded draw per prompt, whatever its cap, so a window row is the
same prompt's fixed-cap row cut short (tests/quality/test_window_export.py, tests/generation/test_continue_window.py)."""

import json

from dflash_assets.fleet.fleet import on_fleet
from dflash_assets.generation.config import DispatchSettings
from dflash_assets.generation.shards import build_prompt_shard

FAST = ["--decode-tokens-per-s", "0", "--reasoning-parser", "qwen3", "--random-seed", "5"]
SETTINGS = DispatchSettings(store_token_ids=True, commit_rows=16, commit_seconds=0.2, load_sample_s=0)
L, N = 512, 60


def make_shard(data_dir, urls) -> None:
    src = data_dir.parent / "prompts.jsonl"
    src.write_text("".join(json.dumps({"id": f"x{i:03d}", "prompt": f"Work through problem {i} in detail."}) + "\n"
                           for i in range(N)))
    on_fleet(urls, lambda f: build_prompt_shard(src, 0, "00000", N, data_dir, f, {"enable_thinking": True}))
