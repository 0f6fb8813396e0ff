"""A server kept under load: chat requests held open against it while its /v1/loads is sampled."""

import asyncio
import itertools

from dflash_assets.fleet.client import ServerClient
from dflash_assets.fleet.fleet import open_session
from dflash_assets.fleet.tuning import LoadSample, LoadSampler, parse_loads

SLOW = ["--reasoning-parser", "qwen3", "--decode-tokens-per-s", "100"]  # a 1,640-token answer takes 16 s
_ids = itertools.count()


def load_server(url: str, in_flight: int, samples: int = 15) -> list[LoadSample]:
    """Keep `in_flight` chat requests open against `url`, take `samples` /v1/loads samples once all of them have
    arrived (a count of samples, not a span of time: a slow machine takes longer, not fewer); then hang up."""

    async def go():
        async with open_session() as session:
            client = ServerClient(session, url)

            async def keep_one_open():
                while True:
                    await client.chat(
                        {
                            "model": "emulated/qwen3-27b",
                            "max_completion_tokens": 4096,
                            "messages": [{"role": "user", "content": f"question {next(_ids)}"}],
                        }
                    )

            senders = [asyncio.create_task(keep_one_open()) for _ in range(in_flight)]
            sampler = LoadSampler([client])
            while True:  # judge only once every request is at the server, running or waiting
                arrived = parse_loads(url, 0.0, await client.loads())
                if arrived.running + arrived.waiting >= in_flight:
                    break
                await asyncio.sleep(0.05)
            for _ in range(samples):
                await sampler.sample_once()
                await asyncio.sleep(0.05)
            for task in senders:
                task.cancel()
            await asyncio.gather(*senders, return_exceptions=True)
            return sampler.samples

    return asyncio.run(go())
