"""A block of a doc written by a test run: the test's figures are the doc's, never typed."""

import os
from pathlib import Path


def written_by_this_run(doc: Path, start: str, end: str, shown: str) -> None:
    """The text between `start` and the next `end` in `doc` is `shown`: written there with DFLASH_WRITE_DOCS=1, else
    asserted (a stale doc fails with the command that rewrites it)."""
    text = doc.read_text()
    before, mark, after = text.partition(start)
    assert mark, f"{doc.name} has no {start.strip()!r}"
    block, close, rest = after.partition(end)
    if os.environ.get("DFLASH_WRITE_DOCS") == "1":
        doc.write_text(before + mark + shown + close + rest)
    else:
        assert block == shown, f"{doc.name} is stale: run this test with DFLASH_WRITE_DOCS=1"
