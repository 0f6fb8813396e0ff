"""What a run asks (generation/request.py): its typed config, made once from a completions config and the quality
settings, and each request's cap and refusal under the window policy."""

import argparse

import pytest

from dflash_assets.generation.request import GenerationRun, request_cap, window_problem
from dflash_assets.settings import DispatchSettings, QualitySettings, RequestSettings, TrainerSettings


def config(**changes) -> argparse.Namespace:
    """A completions config as the asset and the CLI hand it over: every request and dispatch setting."""
    return argparse.Namespace(**(RequestSettings().model_dump() | DispatchSettings().model_dump() | changes))


def test_a_run_is_sized_to_the_trainers_window_and_stores_token_ids_where_the_window_or_the_export_needs_them():
    quality = QualitySettings(trainer=TrainerSettings(max_length=2048))
    windowed = GenerationRun.of(config(), quality)
    assert windowed.generation.trainer_max_length == 2048 and windowed.dispatch.store_token_ids
    assert windowed.runaway == quality.runaway and windowed.preflight_policy == "reject"
    fixed = GenerationRun.of(config(cap_policy="fixed"), quality, "fail")
    assert not fixed.dispatch.store_token_ids and fixed.preflight_policy == "fail"
    pretokenized = QualitySettings(trainer=TrainerSettings(format="pretokenized"))
    assert GenerationRun.of(config(cap_policy="fixed"), pretokenized).dispatch.store_token_ids


def test_regenerate_auto_is_resolved_by_the_sources_history_or_left_to_the_engine():
    assert GenerationRun.of(config(), QualitySettings(), history=True).generation.regenerate == "all_turns"
    assert GenerationRun.of(config(), QualitySettings(), history=False).generation.regenerate == "last_turn"
    assert GenerationRun.of(config(), QualitySettings()).generation.regenerate == "auto"


def test_a_preflight_policy_other_than_reject_or_fail_is_refused_by_name():
    with pytest.raises(ValueError, match="preflight_policy must be 'reject' or 'fail', got 'warn'"):
        GenerationRun.of(config(), QualitySettings(), "warn")


def test_the_window_sizes_each_request_and_refuses_a_prompt_that_leaves_no_room_to_train():
    run = GenerationRun.of(config(max_output_tokens=4096, overshoot=16), QualitySettings())
    window = run.generation.trainer_max_length
    assert request_cap(run.generation, window - 100) == 100 + 16  # the window's rest and the overshoot
    assert request_cap(run.generation, 10) == 4096  # never more than the config's cap
    assert window_problem(run.generation, window - 100) is None
    assert "fills the trainer's window" in window_problem(run.generation, window)
    fixed = GenerationRun.of(config(cap_policy="fixed", max_output_tokens=4096), QualitySettings()).generation
    assert (request_cap(fixed, window - 100), window_problem(fixed, window)) == (4096, None)
