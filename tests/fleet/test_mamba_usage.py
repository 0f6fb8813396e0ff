"""Mamba state usage comes from /metrics (it is not in 0.5.23's /v1/loads); slots per request as resolved."""

import re

from dflash_assets.fleet.tuning import MAMBA_SLOTS_PER_REQUEST, MAMBA_USAGE_METRIC, advise
from tests.support.fleet_load import SLOW, load_server
from tests.support.http import read_info
from tests.support.sglang_wheel import sglang_srt

SGLANG = sglang_srt()


def test_mamba_usage_is_a_prometheus_gauge_and_no_field_of_v1_loads_in_0_5_23():
    collector = (SGLANG / "observability/metrics_collector.py").read_text()
    assert f'name="{MAMBA_USAGE_METRIC}"' in collector
    snapshot = (SGLANG / "managers/load_snapshot.py").read_text() + (SGLANG / "entrypoints/v1_loads.py").read_text()
    assert "mamba" not in snapshot.lower()
    configurator = (SGLANG / "mem_cache/kv_cache_configurator.py").read_text()
    assert f"MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO = {MAMBA_SLOTS_PER_REQUEST}" in configurator
    sizing = (SGLANG / "mem_cache/allocation_sizing.py").read_text()
    assert re.search(r"if lazy:\s+return 1\s+return 2 if overlap else 1", sizing)


def test_full_mamba_slots_with_a_queue_are_read_from_metrics_and_advise_more_mamba_slots(emulator):
    # 12 state slots, 3 per request: the fourth running request fills the pool
    server = emulator(*SLOW, "--max-running-requests", "4", "--max-mamba-cache-size", "12", "--enable-metrics")
    samples = load_server(server.emu.url, in_flight=12)
    assert max(s.mamba_usage for s in samples) == 1.0 and all(s.metrics for s in samples)
    [advice] = advise(samples, [read_info(server.emu.url)])
    assert advice.rule == "mamba_full"
    assert "Raise --max-mamba-cache-size (3 slots per running request on this server)" in advice.message


def test_without_metrics_the_mamba_rule_says_it_cannot_judge(emulator):
    server = emulator(*SLOW, "--max-running-requests", "4", "--max-mamba-cache-size", "12")
    samples = load_server(server.emu.url, in_flight=12)
    assert all(s.metrics is False and s.mamba_usage is None for s in samples)
    rules = {a.rule: a for a in advise(samples, [read_info(server.emu.url)])}
    assert "mamba_full" not in rules
    assert "this server runs without --enable-metrics" in rules["mamba_unavailable"].message


def test_slots_per_request_are_what_the_server_resolved(emulator):
    buffered = emulator("--mamba-radix-cache-strategy", "extra_buffer", "--max-mamba-cache-size", "100")
    info = read_info(buffered.emu.url)
    assert (info.mamba_slots_per_request, info.max_running_requests) == (5, 20)  # 3 + 2 tracking slots
    lazy = read_info(emulator("--mamba-radix-cache-strategy", "extra_buffer_lazy").emu.url)
    no_radix = read_info(emulator("--disable-radix-cache").emu.url)
    dense = read_info(emulator("--dense-model").emu.url)
    assert (lazy.mamba_slots_per_request, no_radix.mamba_slots_per_request, dense.mamba_slots_per_request) == (
        4,
        1,
        None,
    )


def test_a_slots_pinned_suggestion_scales_mamba_slots_by_the_servers_own_ratio(emulator):
    server = emulator(
        *SLOW, "--max-running-requests", "4", "--mamba-radix-cache-strategy", "extra_buffer", "--enable-metrics"
    )
    samples = load_server(server.emu.url, in_flight=16)
    [advice] = advise(samples, [read_info(server.emu.url)])
    assert advice.rule == "slots_pinned"
    assert advice.evidence["suggested_max_mamba_cache_size"] == 5 * 16
    assert "--max-mamba-cache-size to at least 80 (5 state slots per running request on this server)" in advice.message
