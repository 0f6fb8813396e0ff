"""The cap plan counts trained tokens (issue 20, part 5): decoded, trained, decoded per trained and hours per cap
and for the window policy; every figure the rows settle is recomputed here in plain Python from the rules."""

import numpy as np
import pytest

from dflash_assets.quality.planning.estimate import Lengths, PlanOptions
from dflash_assets.quality.planning.window_plan import plan_window, window_plan_lines
from dflash_assets.quality.report.answer import cap_answers
from dflash_assets.quality.report.planner_plot import cap_plan_png
from dflash_assets.rules import percentile, trained_tokens
from dflash_assets.settings import QualitySettings, TrainerSettings
from tests.support.quality_data import load


def cut_at_cap_rows(cut_at_cap_dir):
    rows = load(cut_at_cap_dir, "completions")
    return (
        np.array([r["prompt_tokens"] for r in rows]),
        np.array([r["completion_tokens"] for r in rows]),
        np.array([r["finish_reason"] == "length" for r in rows]),
        np.zeros(len(rows), bool),
    )


def test_with_18pct_cut_at_4096_every_cap_trains_the_same_tokens_and_the_window_policy_decodes_no_more(cut_at_cap_dir):
    p, length, cut, loop = cut_at_cap_rows(cut_at_cap_dir)
    options = PlanOptions((4096, 8192, 16384), tokens_per_s=25_000, servers=7)
    plan = plan_window(Lengths(length, cut, 4096, p, loop), 4096, options, overshoot=16)
    floor = sum(trained_tokens(a, b, 4096) for a, b in zip(p, length))
    assert plan.cut_inside_window == 0 and plan.window_complete == cut.sum() == 183
    now = plan.at(4096)
    assert (now.decoded, now.trained, now.basis) == (length.sum(), floor, "rows")
    assert plan.floor == floor == plan.window.trained
    assert all(e.trained == floor for e in plan.estimates)  # a larger cap buys no trained token
    assert plan.window.decoded == sum(min(b, 4096 - a + 16) for a, b in zip(p, length))
    assert plan.window.per_trained <= 1.02
    assert now.hours == pytest.approx(length.sum() / 25_000 / 3600) and now.gpu_hours == pytest.approx(now.hours * 7)
    assert plan.recommended is plan.window  # never a cap: the cut rows are window-complete
    sentence = plan.raising(4096, 8192)
    assert sentence.startswith("raising the cap from 4,096 to 8,192 adds 0 trained tokens (+0.00%) for ")
    lines = window_plan_lines(plan, "dflash demo --cap-policy window --trainer-max-length 4096")
    assert any(
        "every cut row lies at or past the window" in line
        and "dflash demo --cap-policy window --trainer-max-length 4096" in line
        for line in lines
    )


def test_below_the_current_cap_every_figure_is_read_from_the_rows(cut_at_cap_dir):
    p, length, cut, loop = cut_at_cap_rows(cut_at_cap_dir)
    plan = plan_window(Lengths(length, cut, 4096, p, loop), 8192, PlanOptions((1024, 2048, 4096)))
    for c in (4096,):
        e = plan.at(c)
        written = [(a, b) for a, b, k in zip(p, length, cut) if not k]  # cut inside the 8192 window: left out
        assert e.trained == sum(trained_tokens(a, b, 8192) for a, b in written) and e.basis == "rows"
        assert e.decoded == sum(min(b, c) for b in length)


def test_the_recommendation_never_buys_tokens_past_the_window(cut_at_cap_dir):
    p, length, cut, loop = cut_at_cap_rows(cut_at_cap_dir)
    plan = plan_window(Lengths(length, cut, 4096, p, loop), 8192, PlanOptions((4096, 6144, 8192, 12288, 16384)))
    ceiling = max(8192 - p)
    assert plan.recommended.cap == min(c for c in (8192, 12288, 16384) if c >= ceiling)
    # the cap plan's answer is held under the same ceiling, whatever the truncation threshold asks for
    (answer,) = cap_answers(
        cut_at_cap_dir, QualitySettings(truncation_rate_max=0.0001, trainer=TrainerSettings(max_length=8192))
    )
    assert answer.recommended is not None and answer.recommended.cap <= plan.recommended.cap
    assert answer.window_plan.recommended.cap == plan.recommended.cap


def test_a_runaway_is_decoded_to_any_cap_and_never_trained():
    p = np.array([100, 100])
    length = np.array([900, 1000])
    cut = np.array([False, True])
    loop = np.array([False, True])
    plan = plan_window(Lengths(length, cut, 1000, p, loop), 2048, PlanOptions((1000, 4000)))
    assert plan.at(4000).decoded == 900 + 4000 and plan.at(4000).trained == 900
    assert plan.window.trained == 900 and plan.window.decoded == 900 + min(4000, 2048 - 100 + 16)


def test_a_prompt_that_fills_the_window_is_decoded_at_every_cap_and_never_trained():
    # a 5,000-token prompt under a 4,096 window (the demo has 25 such): its answer is GPU time for nothing
    p = np.array([100, 5000])
    length = np.array([900, 1200])
    cut = np.array([False, False])
    plan = plan_window(Lengths(length, cut, 4096, p), 4096, PlanOptions((4096, 8192)))
    assert plan.at(4096).decoded == 900 + 1200 and plan.at(4096).trained == 900
    assert (plan.filling, plan.filling_decoded) == (1, 1200)
    assert plan.window.decoded == 900 and plan.window.trained == 900  # the window policy rejects it
    assert "prompts that fill the window: 1, their 1,200 decoded tokens counted decoded, none trained" in "\n".join(
        window_plan_lines(plan)
    )


def test_the_picture_marks_the_window(cut_at_cap_dir):
    (answer,) = cap_answers(cut_at_cap_dir, QualitySettings(trainer=TrainerSettings(max_length=8192)))
    plain, marked = cap_plan_png(answer.plan), cap_plan_png(answer.plan, (8192, answer.window_plan.window_at))
    assert plain != marked and marked[:8] == b"\x89PNG\r\n\x1a\n"
    assert answer.window_plan.window_at == 8192 - percentile(cut_at_cap_rows(cut_at_cap_dir)[0], 0.5)
