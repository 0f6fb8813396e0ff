"""Output-length distributions that are not the planner's lognormal, with their true tails.

Shared by tests/quality/planning/test_planner_off_family.py (few, small draws) and benchmarks/bench_cap_planner.py (the
full sweep). Each family draws lengths and a runaway flag; the truth P(L > c) is computed once from a large
draw (or in closed form where there is one).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

MODEL_MAX = 32768  # where runaways end: the model's maximum output


@dataclass(frozen=True)
class Family:
    name: str
    draw: Callable[[np.random.Generator, int], tuple[np.ndarray, np.ndarray]]  # -> (lengths, runaway)

    def truth(self, caps, n: int = 2_000_000, seed: int = 12345) -> dict[int, float]:
        lengths, _ = self.draw(np.random.default_rng(seed), n)
        return {int(c): float((lengths > c).mean()) for c in caps}


def _rounded(x: np.ndarray) -> np.ndarray:
    return np.clip(np.round(x), 1, MODEL_MAX).astype(np.int64)


def _lognormal(rng, n, median, sigma):
    return median * np.exp(sigma * rng.standard_normal(n))


def bimodal(rng, n):
    """Short answers (45%) plus long reasoning (55%)."""
    long = rng.random(n) < 0.55
    return _rounded(np.where(long, _lognormal(rng, n, 3500, 0.45), _lognormal(rng, n, 300, 0.5))), np.zeros(n, bool)


def weibull(rng, n):
    return _rounded(2709 * rng.weibull(1.55, n)), np.zeros(n, bool)


def gamma(rng, n):
    return _rounded(rng.gamma(2.0, 1205, n)), np.zeros(n, bool)


def lognormal(rng, n):
    return _rounded(_lognormal(rng, n, 1640, 1.0)), np.zeros(n, bool)


def lognormal_runaways(rng, n):
    """The emulator's lognormal, with 8% of generations looping to the model's maximum."""
    loop = rng.random(n) < 0.08
    return np.where(loop, MODEL_MAX, _rounded(_lognormal(rng, n, 1640, 1.0))), loop


FAMILIES = [
    Family("bimodal", bimodal),
    Family("weibull", weibull),
    Family("gamma", gamma),
    Family("lognormal", lognormal),
    Family("lognormal+8% runaways", lognormal_runaways),
]


def censor(lengths: np.ndarray, loop: np.ndarray, cap: int):
    """(completion_tokens, truncated, runaway) as a run at `cap` records them."""
    cut = lengths > cap
    return np.minimum(lengths, cap), cut, loop & cut


def probe_rows(n_prompts: int) -> int:
    """The default probe size: the larger of 500 prompts and 1%."""
    return max(500, math.ceil(0.01 * n_prompts))
