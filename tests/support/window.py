"""The window tests' prompts and emulator: one seeded draw per prompt, whatever its cap, so a window row is the
same prompt's fixed-cap row cut short (tests/quality/training/test_window_export.py, tests/generation/test_continue_window.py)."""

from tests.support import shards

FAST = [*shards.FAST, "--random-seed", "5"]
SETTINGS = shards.SETTINGS.model_copy(update={"commit_rows": 16})
L, N = 512, 60
PROMPTS = {f"x{i:03d}": f"Work through problem {i} in detail." for i in range(N)}


def make_shard(data_dir, urls) -> None:
    shards.make_shard(data_dir, urls, PROMPTS)
