"""Fleet tuning: /v1/loads sampled under load on the emulator, and the advice each condition should produce."""

import asyncio

from rich.console import Console

from dflash_assets.emulator.process import free_port
from dflash_assets.fleet.client import ServerClient
from dflash_assets.fleet.fleet import open_session
from dflash_assets.fleet.tuning import (
    LoadSample,
    LoadSampler,
    advise,
    parse_loads,
    sparkline,
    summarize,
    tuning_markdown,
    tuning_table,
)
from tests.support.fleet_load import SLOW, load_server


def rules(samples, **kwargs) -> list[str]:
    return [a.rule for a in advise(samples, **kwargs)]


# ---- emulator scenarios -------------------------------------------------------------------------------------


def test_few_slots_and_a_queue_with_empty_kv_advise_raising_max_running_requests(emulator):
    server = emulator(*SLOW, "--max-running-requests", "4", "--enable-metrics")  # mamba usage is in /metrics
    samples = load_server(server.emu.url, in_flight=16)
    [advice] = advise(samples)
    assert advice.rule == "slots_pinned"
    assert advice.evidence["max_running_requests"] == 4 and advice.evidence["pinned_share"] >= 0.9
    assert advice.evidence["waiting_mean"] >= 10 and advice.evidence["token_usage_p95"] < 0.01
    assert advice.evidence["suggested_max_running_requests"] == 16  # four times 4: the most it suggests at once
    assert "Raise --max-running-requests to about 16" in advice.message
    assert "--max-mamba-cache-size to at least 48" in advice.message


def test_a_tiny_kv_pool_with_long_outputs_holds_requests_back_with_slots_free(emulator):
    server = emulator(*SLOW, "--max-total-tokens", "6000", "--decode-tokens-per-s", "1000", "--enable-metrics")
    samples = load_server(server.emu.url, in_flight=16)
    [advice] = advise(samples)
    assert advice.rule == "kv_full"
    assert advice.evidence["blocked_share"] >= 0.9 and advice.evidence["occupancy"] < 0.2
    assert "the KV pool is the limit, not the slots" in advice.message
    assert "or the cap (max_output_tokens)" in advice.message


def test_many_slots_and_few_requests_advise_raising_the_clients_in_flight(emulator):
    server = emulator(*SLOW, "--max-running-requests", "64")  # the 144 default mamba slots cap it at 48
    samples = load_server(server.emu.url, in_flight=4)
    [advice] = advise(samples, client_in_flight=4)
    assert advice.rule == "under_used"
    assert advice.evidence["max_running_requests"] == 48 and advice.evidence["occupancy"] < 0.1
    assert "Raise the client's in-flight per server (it sends 4) to about 50" in advice.message


def test_a_server_kept_full_without_a_queue_is_fine(emulator):
    server = emulator(*SLOW, "--max-running-requests", "8")
    samples = load_server(server.emu.url, in_flight=8)
    [advice] = advise(samples)
    assert advice.rule == "fine" and advice.message.startswith("all fine: ")
    assert advice.evidence["occupancy"] >= 0.9 and advice.evidence["waiting_max"] == 0


def test_a_server_that_does_not_answer_is_reported_unreachable():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there

    async def go():
        async with open_session() as session:
            sampler = LoadSampler([ServerClient(session, url)], interval_s=0.05)
            await sampler.start()
            await asyncio.sleep(0.3)
            return await sampler.stop()

    samples = asyncio.run(go())
    assert samples and all(s.error for s in samples)
    [advice] = advise(samples)
    assert advice.rule == "unreachable" and f"failed in {len(samples)} of {len(samples)} samples" in advice.message


# ---- rules on hand-made samples -------------------------------------------------------------------------------


def series(server="s", n=10, **fields) -> list[LoadSample]:
    return [LoadSample(t=float(i), server=server, **fields) for i in range(n)]


def test_high_token_usage_with_a_queue_is_kv_full_even_with_every_slot_busy():
    samples = series(running=16, waiting=30, max_running=16, token_usage=0.97)
    assert rules(samples) == ["kv_full"]


def test_full_mamba_state_with_a_queue_advises_more_mamba_slots_not_more_running_requests():
    samples = series(running=16, waiting=30, max_running=16, token_usage=0.05, mamba_usage=0.99)
    [advice] = advise(samples)
    assert advice.rule == "mamba_full" and "Raise --max-mamba-cache-size" in advice.message


def test_a_server_given_no_work_is_idle_and_a_short_sample_is_not_judged():
    assert rules(series(running=0, waiting=0, max_running=16, token_usage=0.0)) == ["idle"]
    assert rules(series(n=2, running=16, waiting=30, max_running=16, token_usage=0.01)) == ["too_few_samples"]


def test_each_server_gets_its_own_advice():
    samples = series("a", running=16, waiting=20, max_running=16, token_usage=0.03) + series(
        "b", running=2, waiting=0, max_running=16, token_usage=0.01
    )
    assert [(a.server, a.rule) for a in advise(samples)] == [("a", "slots_pinned"), ("b", "under_used")]


def test_loads_are_summed_over_dp_ranks():
    body = {
        "loads": [
            {
                "dp_rank": 0,
                "num_running_reqs": 3,
                "num_waiting_reqs": 1,
                "num_used_tokens": 100,
                "max_total_num_tokens": 1000,
                "max_running_requests": 4,
                "token_usage": 0.1,
                "gen_throughput": 50.0,
            },
            {
                "dp_rank": 1,
                "num_running_reqs": 4,
                "num_waiting_reqs": 0,
                "num_used_tokens": 300,
                "max_total_num_tokens": 1000,
                "max_running_requests": 4,
                "token_usage": 0.3,
                "gen_throughput": 70.0,
            },
        ]
    }
    s = parse_loads("u", 1.0, body)
    assert (s.running, s.waiting, s.max_running, s.token_usage, s.gen_throughput, s.mamba_usage) == (
        7,
        1,
        8,
        0.2,
        120.0,
        None,
    )  # /v1/loads has no mamba figure in 0.5.23: it comes from /metrics


def test_the_sampler_keeps_a_bounded_number_of_samples_per_server(emulator):
    server = emulator("--reasoning-parser", "qwen3")

    async def go():
        async with open_session() as session:
            sampler = LoadSampler([ServerClient(session, server.emu.url)], interval_s=0.01, max_samples=5)
            for _ in range(12):
                await sampler.sample_once()
            return sampler.samples

    samples = asyncio.run(go())
    assert len(samples) == 5 and all(s.error is None and s.max_running for s in samples)


def test_figures_and_advice_render_as_markdown_and_a_rich_table():
    samples = series("a", running=4, waiting=12, max_running=4, token_usage=0.002) + series(
        "b", running=8, waiting=0, max_running=8, token_usage=0.3
    )
    loads, advice = summarize(samples), advise(samples)
    md = tuning_markdown(loads, advice)
    assert "| a | 10 | 4.0 / 4 of 4 | 100% | 12.0 / 12 | 0.2% |" in md
    assert "- **a** `slots_pinned`: running requests pinned at max_running_requests=4" in md
    assert "- **b** `fine`: all fine" in md
    console = Console(width=200, record=True)
    console.print(tuning_table(loads, advice))
    assert "slots_pinned" in console.export_text()
    assert sparkline([0, 1, 2, 4], top=4, width=4) == "▁▃▅█"
