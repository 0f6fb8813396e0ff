"""What the fleet records at connect: SGLang's version, the model path, the revision as launched, the weight version
and the chat template's fingerprint, the same for every server; a server that differs is refused before any
request is sent, by name."""

from __future__ import annotations

import asyncio

import pytest

from dflash_assets.fleet.fleet import connected
from dflash_assets.fleet.provenance import PROBE_CONVERSATION, FleetMismatch, Provenance, fingerprint
from tests.support.shards import FAST

pytestmark = pytest.mark.timeout(60)


def connect(urls: list[str]) -> Provenance | None:
    async def go():
        async with connected(urls) as fleet:
            return fleet.provenance

    return asyncio.run(go())


def generation_requests(server) -> float:
    """Requests the server generated for (its /metrics counter, every kind of stream)."""
    lines = server.get("/metrics")[1].splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("sglang:num_requests_total{"))


def test_a_fleet_records_what_its_servers_say_of_themselves(emulator):
    servers = [emulator(*FAST, "--revision", "a1b2c3d", "--weight-version", "w7") for _ in range(2)]
    said = connect([s.emu.url for s in servers])
    probe = servers[0].post("/v1/tokenize", {"messages": list(PROBE_CONVERSATION)})[1]["tokens"]
    assert said == Provenance(
        sglang_version="0.5.23",
        model_path="emulated/qwen3-27b",
        revision="a1b2c3d",
        weight_version="w7",
        chat_template=None,
        template_fingerprint=fingerprint(probe),
    )


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--template-variant", "qwen3.5-default-system"], "template_fingerprint"),
        (["--reported-version", "0.5.24"], 'sglang_version "0.5.24" vs "0.5.23"'),
        (["--revision", "b2c3d4e"], 'revision "b2c3d4e" vs null'),
    ],
)
def test_a_server_that_differs_is_refused_before_any_request_naming_it(emulator, flags, field):
    same, other = emulator(*FAST, "--enable-metrics"), emulator(*FAST, "--enable-metrics", *flags)
    urls = [same.emu.url, other.emu.url, emulator(*FAST).emu.url]
    with pytest.raises(FleetMismatch) as refused:
        connect(urls)
    message = str(refused.value)
    assert message.startswith(f"server {other.emu.url} differs from {same.emu.url}: ") and field in message
    assert "relaunch" in message
    assert generation_requests(same) == generation_requests(other) == 0


def test_servers_that_agree_but_for_the_template_rendering_are_told_apart_only_by_its_fingerprint(emulator):
    a = connect([emulator(*FAST).emu.url])
    b = connect([emulator(*FAST, "--template-variant", "qwen3.5-default-system").emu.url])
    assert a is not None and b is not None
    assert a.differences(b) == [f'template_fingerprint "{a.template_fingerprint}" vs "{b.template_fingerprint}"']


def test_a_transient_tokenize_error_at_connect_is_retried_not_taken_for_another_template(emulator):
    clean, flaky = emulator(*FAST), emulator(*FAST)
    flaky.post("/_emulator/faults", {"tokenize_fail_next": 3})
    assert connect([clean.emu.url, flaky.emu.url]) == connect([clean.emu.url])
    assert flaky.get("/_emulator/faults")[1]["injected"]["tokenize_fail"] == 3
