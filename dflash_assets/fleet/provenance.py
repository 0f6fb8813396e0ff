"""What made a completion, as the servers say it at connect: SGLang's version, the model path and launch revision,
the weight version, and a fingerprint of the chat template as the server applies it.

SGLang 0.5.23's `/server_info` (http_server.py) gives `version` and `server_args.resolved_dict()` (model_path,
tokenizer_path, revision, chat_template: null unless given), `/model_info` the `weight_version`. No template text
is served, so the template is known by what it renders: the ids of a fixed probe conversation via `/v1/tokenize`,
hashed. Every server of a fleet must say the same; one that differs is refused at connect, naming the difference.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import asdict, dataclass, fields

from dflash_assets.fleet.client import ServerClient, ServerError
from dflash_assets.fleet.gateway import GatewayClient
from dflash_assets.settings import SettingsError

# The conversation whose rendering fingerprints the chat template: no system turn (a template may add one) and an
# earlier answer (a template may drop its reasoning), rendered as a chat completion's prompt is.
PROBE_CONVERSATION = (
    {"role": "user", "content": "What is 17 times 23?"},
    {"role": "assistant", "content": "17 times 23 is 391."},
    {"role": "user", "content": "And 391 divided by 17?"},
)
FINGERPRINT_CHARS = 16  # hex chars of the sha256 of the probe's token ids


class FleetMismatch(SettingsError):
    """Servers of one fleet that say different things about what they serve."""


@dataclass(frozen=True)
class Provenance:
    """What a server says it serves; the same for every server of a fleet, and part of a config's hash."""

    sglang_version: str | None  # /server_info version
    model_path: str | None  # /server_info model_path (the launch's --model-path)
    revision: str | None  # /server_info revision: the launch's --revision, null when not given
    weight_version: str | None  # /model_info weight_version: "default" unless set
    chat_template: str | None  # /server_info chat_template: the launch's --chat-template, null when not given
    template_fingerprint: str | None  # sha256 of the probe conversation's token ids as the server renders it (None:
    # it renders no chat template)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, record: dict) -> Provenance:
        return cls(**{f.name: record.get(f.name) for f in fields(cls)})

    def differences(self, other: Provenance) -> list[str]:
        """`name: this vs other` for every field that differs."""
        mine, theirs = self.as_dict(), other.as_dict()
        return [f"{k} {json.dumps(mine[k])} vs {json.dumps(theirs[k])}" for k in mine if mine[k] != theirs[k]]


def fingerprint(token_ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(token_ids, separators=(",", ":")).encode()).hexdigest()[:FINGERPRINT_CHARS]


async def read_server(client: ServerClient) -> Provenance:
    """What one SGLang server says of itself (a route it does not have leaves its fields null)."""
    server = await client._optional("/server_info") or {}
    model = await client._optional("/model_info") or {}
    # 0.5.23's serving_tokenize refuses `add_generation_prompt` unless the template is Jinja (not a builtin name)
    try:
        ids = list((await client.tokenize_chat({"messages": list(PROBE_CONVERSATION)}))["tokens"])
    except ServerError as e:
        if e.retryable:  # still failing after the retries a prompt's count gets
            raise
        ids = None  # the server renders no chat template (a 400): no fingerprint
    return Provenance(
        sglang_version=server.get("version"),
        model_path=server.get("model_path") or model.get("model_path"),
        revision=server.get("revision"),
        weight_version=model.get("weight_version"),
        chat_template=server.get("chat_template"),
        template_fingerprint=None if ids is None else fingerprint(ids),
    )


async def read_provenance(clients: list[ServerClient]) -> Provenance:
    """The fleet's provenance, read from every server (or gateway worker); one that differs is refused."""
    servers: list[ServerClient] = []
    for client in clients:
        servers.extend(client.workers if isinstance(client, GatewayClient) else [client])
    said = list(await asyncio.gather(*(read_server(s) for s in servers)))
    return agreed([s.url for s in servers], said)


def agreed(urls: list[str], said: list[Provenance]) -> Provenance:
    """The one provenance every server says; FleetMismatch naming the first server that differs."""
    first = said[0]
    for url, provenance in zip(urls[1:], said[1:], strict=True):
        if provenance != first:
            raise FleetMismatch(
                f"server {url} differs from {urls[0]}: {'; '.join(provenance.differences(first))}; every server of "
                f"a fleet must run the same SGLang version, model, revision and chat template (relaunch {url} as "
                f"the others are, or leave it out of the fleet)"
            )
    return first
