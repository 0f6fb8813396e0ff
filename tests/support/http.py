"""A tiny synchronous HTTP client for the tests, against local servers (the emulator, the gateway)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request


class Http:
    """A tiny synchronous HTTP client for tests against local servers.
    Every call returns (status, body): JSON-decoded when possible, else text."""

    def __init__(self, base: str, key: str | None = None):
        self.base, self.key = base, key

    def request(self, method: str, path: str, body=None, *, headers=None, raw: bytes | None = None, timeout=30):
        hdrs = {"Content-Type": "application/json"} if body is not None else {}
        if self.key:
            hdrs["Authorization"] = f"Bearer {self.key}"
        hdrs.update(headers or {})
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.base + path, data=data, headers=hdrs, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, payload = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, payload = e.code, e.read()
        text = payload.decode()
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def get(self, path, **kw):
        return self.request("GET", path, **kw)

    def post(self, path, body=None, **kw):
        return self.request("POST", path, body, **kw)

    def sse(self, path, body, **kw) -> tuple[int, list]:
        """POST a streaming request; the `data:` payloads, JSON-decoded ([DONE] stays a str)."""
        status, text = self.post(path, body, **kw)
        if not isinstance(text, str):
            return status, text
        events = [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]
        return status, [e if e == "[DONE]" else json.loads(e) for e in events]


def call(method: str, url: str, body: dict | None = None) -> dict:
    """A JSON request to `url` (a gateway's admin route, an emulator's fault route); its JSON answer, {} when empty."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read()
    return json.loads(text) if text.strip() else {}


def set_faults(url: str, settings: dict) -> dict:
    """Set an emulator's faults (hold, 503s, crashes...) through its fault route; its fault state after."""
    status, body = Http(url).post("/_emulator/faults", settings)
    assert status == 200, body
    return body


def requests_served(http: Http) -> int:
    """Generation requests an emulator received, answered or not (its own counter)."""
    _, faults = http.get("/_emulator/faults")
    return faults["requests_seen"]


def settled(server, deadline_s: float = 30.0) -> dict:
    """The server's load once nothing runs there any more (the aborts of closed streams take effect)."""
    end = time.monotonic() + deadline_s
    while True:
        _, loads = server.get("/v1/loads")
        if sum(r["num_running_reqs"] for r in loads["loads"]) == 0 or time.monotonic() > end:
            return loads["loads"][0]
        time.sleep(0.05)


def aborted(server) -> float:
    _, text = server.get("/metrics")
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("sglang:num_aborted_requests_total")
    )


def read_info(url: str, api_key: str | None = None):
    """What the fleet reads of one server (context length, slots, limits, parser), outside any event loop."""
    from dflash_assets.fleet.fleet import Fleet, on_fleet

    async def first(fleet: Fleet):
        return fleet.infos[0]

    return on_fleet([url], first, api_key)
