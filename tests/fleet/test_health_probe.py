"""0.5.23's /health is a one-token generation: it answers after a second or more. Probes wait for it."""

import asyncio
import re

from dflash_assets.fleet.client import HEALTH_PROBE_TIMEOUT_S, ServerClient
from dflash_assets.fleet.fleet import open_session
from tests.support.sglang_wheel import sglang_srt

SGLANG = sglang_srt()


def test_health_generates_a_token_by_default_and_polls_after_a_second_in_0_5_23():
    environ = (SGLANG / "environ.py").read_text()
    assert "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION = EnvBool(True)" in environ
    server = (SGLANG / "entrypoints/http_server.py").read_text()
    timeout = int(
        re.search(r'HEALTH_CHECK_TIMEOUT = int\(os.getenv\("SGLANG_HEALTH_CHECK_TIMEOUT", (\d+)\)\)', server).group(1)
    )
    assert re.search(r"while time.time\(\) < tic \+ HEALTH_CHECK_TIMEOUT:\s+await asyncio.sleep\(1\)", server)
    assert HEALTH_PROBE_TIMEOUT_S > timeout, "a probe outwaits the server's own 503"


def test_the_emulated_health_takes_its_delay(emulator):
    server = emulator("--health-delay", "1")

    async def probe(timeout):
        async with open_session() as session:
            return await ServerClient(session, server.emu.url).healthy(timeout=timeout)

    assert asyncio.run(probe(0.5)) is False, "a probe shorter than the health generation sees a dead server"
    assert asyncio.run(probe(HEALTH_PROBE_TIMEOUT_S)) is True
