"""A cap raised from 4096 to 8192, on an emulator that samples like a server (a new draw per request, lengths
correlated with the prompt): continuing the cut rows gives the length distribution of a clean 8192 run, while
keeping the short rows and drawing the long ones afresh skews the set short. (The emulator's sampling itself:
tests/emulator/test_sampling.py.)"""

import math

import duckdb
import numpy as np
import pytest

from tests.support import shards
from tests.support.forks import start_emulator

N = 600
# --random-seed: the draws are the seed's, not the run's, so the KS test below passes or fails by this seed
SERVER = [
    "--decode-tokens-per-s",
    "0",
    "--reasoning-parser",
    "qwen3",
    "--sampling",
    "per-request",
    "--random-seed",
    "7",
]
SETTINGS = shards.SETTINGS.model_copy(update={"commit_rows": 200, "commit_seconds": 5})


PROMPTS = {f"b{i:04d}": f"Work through problem {i} in detail." for i in range(N)}


def lengths(data_dir, config_hash, where="true") -> np.ndarray:
    return np.array(
        [
            r[0]
            for r in duckdb.sql(
                f"select completion_tokens from read_parquet('{data_dir}/completions/**/*.parquet', union_by_name = true) "
                f"where config_hash = '{config_hash}' and {where} order by prompt_id"
            ).fetchall()
        ]
    )


def ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample Kolmogorov-Smirnov D: the largest gap between the two empirical CDFs."""
    grid = np.union1d(a, b)
    fa = np.searchsorted(np.sort(a), grid, side="right") / len(a)
    fb = np.searchsorted(np.sort(b), grid, side="right") / len(b)
    return float(np.abs(fa - fb).max())


def ks_critical(n: int, m: int, alpha: float = 0.001) -> float:
    """The asymptotic critical D at level alpha (0.001: a same-distribution pair fails one run in a thousand)."""
    return math.sqrt(-0.5 * math.log(alpha / 2)) * math.sqrt((n + m) / (n * m))


@pytest.fixture(scope="module")
def bump(tmp_path_factory):
    """Three data dirs over the same prompts: generated at 4096 (token ids stored) and continued to 8192;
    generated clean at 8192; generated again at 8192 (a second, independent draw per prompt)."""
    dirs = [tmp_path_factory.mktemp(name) / "data" for name in ("bumped", "clean", "again")]
    with start_emulator(SERVER) as server:
        for d in dirs:
            shards.make_shard(d, [server.url], PROMPTS)
        parent = shards.generate(dirs[0], [server.url], 4096, SETTINGS)
        run = shards.cont(dirs[0], [server.url], parent.config_hash, 8192, SETTINGS)
        clean, again = (shards.generate(d, [server.url], 8192, SETTINGS) for d in dirs[1:])
    return dirs, parent, run, clean, again


def test_lengths_after_a_4096_to_8192_bump_match_a_clean_8192_run(bump):
    (a, b, _), parent, run, clean, _ = bump
    assert 0.12 <= parent.length / N <= 0.25, parent.length  # about 18% cut at 4096
    assert run.continued == parent.length and run.copied == N - parent.length and run.left == 0
    bumped, fresh = lengths(a, run.config_hash), lengths(b, clean.config_hash)
    assert len(bumped) == len(fresh) == N
    d, critical = ks_statistic(bumped, fresh), ks_critical(N, N)
    assert d < critical, (d, critical)
    over = (bumped > 4096).mean(), (fresh > 4096).mean()
    assert abs(over[0] - over[1]) < 3 * math.sqrt(over[1] * (1 - over[1]) * 2 / N), over
    # every continued row ends past the 4096 tokens it carried, as its first draw did
    continued = lengths(a, run.config_hash, "tokens_reused = 4096 and parent_config_hash is not null")
    assert len(continued) == parent.length and (continued > 4096).all()
    # tokens reused: every stopped row whole, and the 4096 of each continued one
    stopped = lengths(a, parent.config_hash, "finish_reason = 'stop'")
    assert run.tokens_reused == int(stopped.sum()) + 4096 * parent.length


def test_keeping_short_rows_and_redrawing_only_the_cut_ones_skews_the_set_short(bump):
    """The mix the bump must never make, measured: the test above has the power to see it."""
    (a, b, c), parent, _, clean, again = bump
    kept = lengths(a, parent.config_hash, "finish_reason = 'stop'")
    cut_ids = {
        r[0]
        for r in duckdb.sql(
            f"select prompt_id from read_parquet('{a}/completions/**/*.parquet', "
            f"union_by_name = true) where config_hash = '{parent.config_hash}' and "
            f"finish_reason = 'length'"
        ).fetchall()
    }
    redrawn = np.array(
        [
            r[1]
            for r in duckdb.sql(
                f"select prompt_id, completion_tokens from read_parquet('{c}/completions/**/*.parquet')"
            ).fetchall()
            if r[0] in cut_ids
        ]
    )
    mixed, fresh = np.concatenate([kept, redrawn]), lengths(b, clean.config_hash)
    assert len(mixed) == N
    assert (mixed > 4096).mean() < (fresh > 4096).mean() - 0.04, ((mixed > 4096).mean(), (fresh > 4096).mean())
    assert ks_statistic(mixed, fresh) > ks_statistic(lengths(a, clean.config_hash), fresh)


def test_the_emulator_draws_anew_per_request_with_lengths_correlated_with_the_prompt(bump):
    (_, b, c), _, _, clean, again = bump
    first, second = lengths(b, clean.config_hash), lengths(c, again.config_hash)
    assert (first != second).mean() > 0.9, "a server draws anew for each request at temperature > 0"
    correlation = np.corrcoef(np.log(first), np.log(second))[0, 1]
    assert 0.3 < correlation < 0.7, correlation  # the prompt sets half the log-length variance (prompt_share 0.5)
