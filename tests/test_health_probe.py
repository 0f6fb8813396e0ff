"""0.5.23's /health is a one-token generation: it answers after a second or more. Probes wait for it."""

import asyncio
import re

from sglang_wheel import sglang_srt
from test_server_failures import FLAGS, build, completions

from dflash_assets.fleet.client import HEALTH_PROBE_TIMEOUT_S, ServerClient
from dflash_assets.fleet.fleet import connect, open_session
from dflash_assets.generation.config import DispatchSettings, GenerationConfig
from dflash_assets.generation.engine import generate_shard

SGLANG = sglang_srt()


def test_health_generates_a_token_by_default_and_polls_after_a_second_in_0_5_23():
    environ = (SGLANG / "environ.py").read_text()
    assert "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION = EnvBool(True)" in environ
    server = (SGLANG / "entrypoints/http_server.py").read_text()
    timeout = int(re.search(r'HEALTH_CHECK_TIMEOUT = int\(os.getenv\("SGLANG_HEALTH_CHECK_TIMEOUT", (\d+)\)\)',
                            server).group(1))
    assert re.search(r"while time.time\(\) < tic \+ HEALTH_CHECK_TIMEOUT:\s+await asyncio.sleep\(1\)", server)
    assert HEALTH_PROBE_TIMEOUT_S > timeout, "a probe outwaits the server's own 503"


def test_the_emulated_health_takes_its_delay(emulator):
    server = emulator("--health-delay", "1")

    async def probe(timeout):
        async with open_session() as session:
            return await ServerClient(session, server.emu.url).healthy(timeout=timeout)

    assert asyncio.run(probe(0.5)) is False, "a probe shorter than the health generation sees a dead server"
    assert asyncio.run(probe(HEALTH_PROBE_TIMEOUT_S)) is True


def test_an_ejected_server_whose_health_takes_seconds_is_readmitted_and_the_run_completes(tmp_path, emulator):
    server = emulator(*FLAGS, "--health-delay", "2.5")
    build(tmp_path, server.emu.url)
    server.post("/_emulator/faults", {"fail_next": 2})  # two 503s eject the only server
    settings = DispatchSettings(max_attempts=5, backoff_base_s=0.01, eject_after=2, no_server_timeout_s=10,
                                commit_rows=5, commit_seconds=0.2, max_in_flight_per_server=1)
    run = asyncio.run(_generate(tmp_path, server.emu.url, settings))
    assert (run.completed, run.failed) == (12, 0)
    assert len(completions(tmp_path)) == 12


async def _generate(tmp_path, url, settings):
    async with await connect([url]) as fleet:
        return await generate_shard(tmp_path / "data", "00000", fleet, GenerationConfig(max_output_tokens=512),
                                    settings, log=lambda m: None)
