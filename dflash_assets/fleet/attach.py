"""`attach` mode: servers someone else runs (or a gateway in front of many); their URLs checked for shape only."""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit


class AttachError(ValueError):
    pass


def parse_urls(urls: str | Sequence[str]) -> list[str]:
    """Base URLs from a comma/space separated string or a list, checked and normalised (no trailing '/')."""
    items = urls.replace(",", " ").split() if isinstance(urls, str) else [u.strip() for u in urls if u.strip()]
    if not items:
        raise AttachError("attach needs at least one server URL, e.g. http://10.0.0.5:30000")
    out: list[str] = []
    for i, raw in enumerate(items, 1):
        try:
            parts = urlsplit(raw)
            parts.port  # noqa: B018 -- raises on a port that is not a number or out of range
        except ValueError as e:
            raise AttachError(f"server URL #{i} is not a valid URL: {e}") from None
        if parts.username or parts.password:
            # Not echoed: it holds a credential.
            raise AttachError(
                f"server URL #{i} carries credentials; put the API key in the environment "
                f"variable (DFLASH_API_KEY by default), it is sent as a Bearer token"
            )
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise AttachError(
                f"server URL {raw!r} must look like http://host:port (got scheme "
                f"{parts.scheme or 'none'!r}, host {parts.hostname or 'none'!r})"
            )
        if parts.query or parts.fragment:
            raise AttachError(f"server URL {raw!r} must be a base URL, without ?query or #fragment")
        url = raw.rstrip("/")
        if url in out:
            # The same server twice would be counted twice when the dispatcher sizes concurrency.
            raise AttachError(f"server URL {url} is listed twice")
        out.append(url)
    return out
