"""One ending for a stop, whatever the moment and whatever started the run: `dflash demo` stopped at seeded random
moments, on a terminal (a pseudo-terminal: Ctrl-C typed on it) and without one (SIGINT to its process group, twice at
once as `uv run` forwards it, or SIGTERM), from its first instant to its last request.

The moment is drawn, never relied on: the fleet answers a drawn number of requests, fewer than the prompts left, and
holds every later one for good (the emulator's hold_after), so whatever the moment, the run is still going when the
stop lands and only the stop ends it. Every stop must end with 130 / 143 and one last line naming the rows committed and the command that resumes,
no traceback, no run left started; that command, pasted, finishes every prompt once, and its table's `new` counts
the rows it wrote.

DFLASH_TEST_STOPS sets the number of stops of each kind (default 5: 10 stops).
"""

from __future__ import annotations

import json
import os
import pty
import random
import re
import signal
import threading
import time
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.instance.ref import InstanceRef

from tests.cli.test_kill_resume import BOUND_S, accepted_prompt_ids, completion_rows
from tests.support.backfill import FAST
from tests.support.cli import run_as_printed, start
from tests.support.dagster_procs import PROJECT_DAGSTER_YAML
from tests.support.forks import start_emulator
from tests.support.http import set_faults

pytestmark = pytest.mark.long

PROMPTS, SHARD = 8, 4  # two shards
STOPS = int(os.environ.get("DFLASH_TEST_STOPS", "5"))
ARGS = ("demo", "--max-output-tokens", "2048", "--commit-rows", "1")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
ENDING = re.compile(
    r"^dflash demo stopped by (SIGINT \(Ctrl-C\)|SIGTERM): the requests in flight were ended on the servers, "
    r"([\d,]+) completion rows are committed under (\S+) \(kept\); resume with: (.+dflash demo .+)$"
)


class Terminal:
    """A pseudo-terminal: its end for the command, and what the command wrote on it, read as it comes (this process
    keeps the command's end open too: without one, reading the master fails)."""

    def __init__(self) -> None:
        self.master, self.slave = pty.openpty()
        self.name = os.ttyname(self.slave)
        self.chunks: list[bytes] = []
        self.done = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        import select

        while True:
            ready, _, _ = select.select([self.master], [], [], 0.1)
            if ready:
                self.chunks.append(os.read(self.master, 65536))
            elif self.done.is_set():
                return

    def ctrl_c(self) -> None:
        os.write(self.master, b"\x03")  # the terminal's driver sends SIGINT to its foreground process group

    def text(self) -> str:
        """Everything written, once the command has ended."""
        self.done.set()
        self.reader.join(30)
        os.close(self.master)
        os.close(self.slave)
        return b"".join(self.chunks).decode(errors="replace")


def lines_of(text: str) -> list[str]:
    """What a person reads: escape codes gone, a line redrawn in place (\\r) as its last form."""
    plain = ANSI.sub("", text).replace("\r\n", "\n")
    return [line.rsplit("\r", 1)[-1].rstrip() for line in plain.split("\n") if line.rsplit("\r", 1)[-1].strip()]


def unfinished_runs(home: Path) -> list[str]:
    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        return [r.run_id for r in instance.get_runs() if not r.is_finished]


def stop_once(tmp: Path, env: dict, emu_url: str, how: str, answered: int, moment_s: float, i: int) -> dict:
    """The demo, the fleet answering `answered` requests and holding the rest, stopped `moment_s` after its start:
    `how` is ctrl-c (typed on its terminal), sigint-twice (to its group, twice at once), or sigterm."""
    set_faults(emu_url, {"hold_after": answered})
    out = tmp / f"stop-{i}-{how}-{moment_s:.2f}s.txt"  # a stop that hangs is found by its name
    terminal = Terminal() if how == "ctrl-c" else None
    proc = start(*ARGS, out=out, env=env, tty=terminal.name if terminal else None)
    deadline = time.monotonic() + BOUND_S
    while os.getpgid(proc.pid) != proc.pid or (terminal and os.tcgetpgrp(terminal.master) != proc.pid):
        assert time.monotonic() < deadline, "the command did not start"  # its session, and its terminal: a key
        time.sleep(0.01)  # typed before a shell hands the command its terminal reaches the shell, not the command
    time.sleep(moment_s)  # the moment: drawn; the held fleet keeps the run going whatever it is
    if terminal is not None:
        terminal.ctrl_c()
    elif how == "sigint-twice":
        os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C to the group, and uv's forward of it
        os.kill(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGTERM)
    status = proc.wait(timeout=BOUND_S)
    text = terminal.text() if terminal is not None else out.read_text()
    return {"how": how, "moment": round(moment_s, 2), "status": status, "lines": lines_of(text), "text": text}


@pytest.fixture(scope="module")
def stops(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("random-stops")
    home, data, src = tmp / "home", tmp / "data", tmp / "prompts.jsonl"
    home.mkdir()
    (home / "dagster.yaml").write_text(PROJECT_DAGSTER_YAML.read_text())
    src.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"random stop {i}"}) + "\n" for i in range(PROMPTS)))
    env = {
        "DAGSTER_HOME": str(home),
        "DFLASH_DATA_DIR": str(data),
        "DFLASH_FLEET_MODE": "attach",
        "DFLASH_PROMPTS": str(src),
        "DFLASH_SHARD_SIZE": str(SHARD),
        "DFLASH_RETRY_DELAY_S": "3600",  # a stop that waited out the step's retry policy would outlast the bound
    }
    rng = random.Random(54)
    kinds = ["ctrl-c"] * STOPS + [rng.choice(["sigint-twice", "sigterm"]) for _ in range(STOPS)]
    rng.shuffle(kinds)
    with start_emulator([*FAST]) as emu:
        env["DFLASH_FLEET_URLS"] = emu.url
        ended = []
        for i, how in enumerate(kinds):
            # answers for fewer prompts than are left: a request is held whatever the moment, and the run still going
            answered = min(rng.randrange(PROMPTS), PROMPTS - len(completion_rows(data)) - 1)
            ended.append(stop_once(tmp, env, emu.url, how, answered, rng.uniform(0.0, 4.0), i))
            ended[-1]["unfinished"] = unfinished_runs(home)
            ended[-1]["rows"] = len(completion_rows(data))
        set_faults(emu.url, {"hold_after": None})
        before = len(completion_rows(data))
        resume = ENDING.match(ended[-1]["lines"][-1]) if ended[-1]["lines"] else None
        assert resume, ended[-1]["text"]
        again = run_as_printed(resume.group(4))  # pasted as printed, in a clean shell
    yield ended, again, before, completion_rows(data), accepted_prompt_ids(data)


def test_every_stop_ends_in_one_line_with_130_or_143_and_the_command_that_resumes(stops):
    ended, *_ = stops
    assert {e["how"] for e in ended} >= {"ctrl-c"}
    for e in ended:
        said = f"{e['how']} at {e['moment']}s:\n{e['text']}"
        assert e["status"] == (143 if e["how"] == "sigterm" else 130), said
        match = ENDING.match(e["lines"][-1])
        assert match, said
        assert int(match.group(2).replace(",", "")) == e["rows"], said  # the rows it names are the rows there
        assert (match.group(1) == "SIGTERM") == (e["how"] == "sigterm"), said
        assert "Traceback" not in e["text"] and "exiting at once" not in e["text"], said
        assert not e["unfinished"], said  # its run ended (CANCELED), none left started


def test_the_printed_resume_finishes_every_prompt_once_and_counts_what_it_wrote(stops):
    ended, again, before, rows, accepted = stops
    assert again.returncode in (0, 3), again.stdout + again.stderr
    keys = [(prompt_id, turn) for prompt_id, _, turn in rows]
    assert len(keys) == len(set(keys)) and {p for p, _ in keys} == accepted, again.stdout
    new = sum(int(m.group(1)) for m in re.finditer(r"^\s+0000\d\s+\d+\s+\d+\s+\d+\s+(\d+)\s", again.stdout, re.M))
    assert new == len(rows) - before, again.stdout  # `new`: the rows this run wrote, not what an earlier one did


WATCHED = re.compile(r"rows (\d+)/(\d+), [\d,]+ tokens/s, cut \d+ \([\d.]+%\), ETA \d+:\d\d")


@pytest.mark.parametrize("terminal", [True, False], ids=["bar", "log"])
def test_a_run_you_can_watch_shows_rows_pace_cut_and_eta_on_a_terminal_and_off_one(tmp_path, terminal):
    """A run answering 3 requests and holding the rest: its bar (a terminal) or its stderr line (every few seconds
    elsewhere) says the rows answered of those to do, the pace, the cut so far and the ETA; waited for, then stopped."""
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"id": f"w{i}", "prompt": f"watch {i}"}) + "\n" for i in range(PROMPTS)))
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "dagster.yaml").write_text(PROJECT_DAGSTER_YAML.read_text())
    with start_emulator([*FAST]) as emu:
        env = {
            "DAGSTER_HOME": str(tmp_path / "home"),
            "DFLASH_DATA_DIR": str(tmp_path / "data"),
            "DFLASH_FLEET_MODE": "attach",
            "DFLASH_FLEET_URLS": emu.url,
            "DFLASH_PROMPTS": str(src),
            "DFLASH_SHARD_SIZE": str(PROMPTS),
        }
        set_faults(emu.url, {"hold_after": 3})
        screen = Terminal() if terminal else None
        out = tmp_path / "out.txt"
        proc = start(*ARGS, out=out, env=env, tty=screen.name if screen else None)
        shown = (lambda: b"".join(screen.chunks).decode(errors="replace")) if screen else out.read_text
        deadline = time.monotonic() + BOUND_S
        while not (seen := WATCHED.findall(ANSI.sub("", shown()))):
            assert proc.poll() is None and time.monotonic() < deadline, shown()
            time.sleep(0.2)
        if screen:
            screen.ctrl_c()
        else:
            os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=BOUND_S) == 130
        if screen:
            screen.text()
    assert int(seen[-1][1]) == PROMPTS and int(seen[-1][0]) <= 3, seen  # of the 8 to do, the 3 answered at most
