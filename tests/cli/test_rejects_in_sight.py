"""A user's own source, as sources come: a UTF-8 BOM on its first line, CRLF line ends, a line of 200 KB and 8 bad
lines. The good lines go through (the BOM and CRLF are no reason to reject); the demo names the first rejects with
their lines and reasons and the command that lists them all, which does, pasted as printed; each reject is counted
under its reason on every screen: the demo, `dflash rejects`, the report (the 200 KB prompt as over the context)."""

from __future__ import annotations

import json
import re

from dflash_assets.cli.shards import FIRST_REJECTS
from tests.support.backfill import FAST
from tests.support.cli import dflash, home, run_as_printed

GOOD = 20
BAD = {  # line -> what is wrong with it, as the reason says it
    3: ("{not json", "invalid JSON"),
    6: (json.dumps({"messages": []}), "'messages' is empty"),
    9: ("", "blank line"),
    12: (json.dumps({"prompt": ""}), "empty"),
    15: ('{"prompt": "unterminated', "invalid JSON"),
    18: (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}), "unknown role"),
    21: ("[1, 2]", None),
    24: (json.dumps({"nothing": "here"}), None),
}
LONG_LINE = 27  # a prompt of 200 KB: longer than the emulated servers' context


def source_lines() -> list[str]:
    lines, good = [], 0
    for n in range(1, LONG_LINE + 2):
        if n in BAD:
            lines.append(BAD[n][0])
        elif n == LONG_LINE:
            lines.append(json.dumps({"id": "long", "prompt": "many words " * 20_000}))
        else:
            lines.append(json.dumps({"id": f"g{good}", "prompt": f"a good question {good}"}))
            good += 1
    return lines


def test_a_bom_crlf_a_200kb_line_and_8_bad_lines_each_rejected_named_and_counted_alike_everywhere(tmp_path):
    lines = source_lines()
    src = tmp_path / "mine.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode() + b"\r\n")
    env = home(tmp_path, "home") | {"DFLASH_EMULATOR_ARGS": " ".join(FAST)}
    data = env["DFLASH_DATA_DIR"]
    demo = dflash("demo", "--prompts", str(src), "--shard-size", "100", "--servers", "1", env=env, cwd=tmp_path)
    out = demo.stdout
    assert demo.returncode in (0, 3), out + demo.stderr
    good = len(lines) - len(BAD) - 1
    table = re.search(r"^\s+00000\s+(\d+)\s+(\d+)\s+(\d+)\s", out, re.M)
    assert table and [int(g) for g in table.groups()] == [len(lines), len(BAD) + 1, good], out
    said = re.search(r"rejected (\d+), by reason: (.*?); the first:", " ".join(out.split()))  # prose wraps
    assert said and int(said.group(1)) == len(BAD) + 1, out
    assert "line 1 " not in out and "BOM" not in out, out  # the BOM's line went through
    for n in sorted(BAD)[:FIRST_REJECTS]:  # the first few, each with its line
        assert re.search(rf"shard 00000 line {n} \(source\): ", out), out
    [listing] = [line.strip() for line in out.splitlines() if re.search(r"\bdflash rejects\b", line)]
    every = run_as_printed(listing)
    assert every.returncode == 0, every.stdout + every.stderr
    listed = re.findall(r"shard 00000 line (\d+) \(source\): (.*)", every.stdout)
    assert sorted(int(n) for n, _ in listed) == sorted([*BAD, LONG_LINE]), every.stdout
    for n, reason in listed:
        expected = "longer than the model's context length" if int(n) == LONG_LINE else BAD[int(n)][1]
        assert expected is None or expected in reason, (n, reason)
    assert said.group(2) in every.stdout  # the same counts by reason on both screens
    report = dflash("report", "--full", "--data-dir", data, env=env, cwd=tmp_path)
    assert report.returncode == 0 and said.group(2) in " ".join(report.stdout.split()), report.stdout
    over = re.search(r"^\W*(\d+)\W+(\d+)\W+(\d+)\W*$", report.stdout.split("Overflow", 1)[1], re.M)
    assert over and int(over.group(2)) == 1, report.stdout  # the 200 KB prompt, rejected as over the context
