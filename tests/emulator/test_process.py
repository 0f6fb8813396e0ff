"""Starting the emulator: the `sglang serve` command line, the subprocess
handle, warmup and the ready line, and the API key staying out of logs."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import time

import pytest

from dflash_assets.emulator import main
from dflash_assets.emulator.config import EXIT_WITH_PARENT, FLAGS, resolve
from dflash_assets.emulator.process import start_emulator
from tests.support.http import Http

pytestmark = pytest.mark.timeout(60)


def test_start_emulator_serves_on_a_free_loopback_port_and_stops():
    with start_emulator(["--served-model-name", "emu"]) as emu:
        assert emu.host == "127.0.0.1" and emu.alive()
        assert Http(emu.url).get("/v1/models")[1]["data"][0]["id"] == "emu"
    assert not emu.alive() and emu.popen.returncode == 0  # SIGTERM is a clean shutdown
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", emu.port)) != 0


def test_the_ready_line_follows_the_startup_delay():
    t = time.monotonic()
    with start_emulator(["--startup-delay", "0.5"]) as emu:
        assert time.monotonic() - t >= 0.5  # start_emulator waited for /health 200
        assert "The server is fired up and ready to roll!" in emu.log()


def test_health_and_ready_are_503_during_warmup_while_other_routes_serve(emulator):
    http = emulator("--startup-delay", "3")  # far longer than the three requests below take
    assert http.get("/health")[0] == 503 and http.get("/ready")[0] == 503
    assert http.get("/v1/models")[0] == 200
    while http.get("/health")[0] == 503:  # warmup ends by itself: /health turns 200 and /ready with it
        time.sleep(0.1)
    assert http.get("/ready")[0] == 200


def test_the_api_key_never_reaches_the_log():
    key = "sk-emulator-secret-4711"
    with start_emulator(["--api-key", key]) as emu:
        Http(emu.url).get("/v1/models")  # a 401
        Http(emu.url, key).post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 3}})
    assert key not in emu.log() and "ready to roll" in emu.log()


def test_an_unknown_flag_exits_2(capsys):
    assert main(["--model-path", "x", "--no-such-flag"]) == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_the_removed_cuda_graph_max_bs_is_an_ambiguous_prefix_exit_2(capsys):
    assert main(["--model-path", "x", "--cuda-graph-max-bs", "8"]) == 2
    assert (
        "ambiguous option: --cuda-graph-max-bs could match --cuda-graph-max-bs-decode, --cuda-graph-max-bs-prefill"
        in (capsys.readouterr().err)
    )


def test_model_path_is_required(capsys):
    assert main([]) == 2
    assert "--model-path" in capsys.readouterr().err


def test_sglang_abbreviations_and_aliases_parse():
    cfg = resolve(["--model", "m", "--tp", "2", "--dp", "2", "--tensor-parallel-size", "4", "--context-length", "32Ki"])
    assert cfg.args.model_path == "m" and cfg.args.tp_size == 4 and cfg.args.dp_size == 2
    assert cfg.context_len == 32768


def test_every_sglang_0_5_23_flag_is_accepted():
    argv = ["--model-path", "m"]
    for names, nargs, dest in FLAGS:
        if dest in ("model_path", "config"):
            continue
        value = {"reasoning_parser": "qwen3", "default_chat_template_kwargs": "{}", "preferred_sampling_params": "{}"}
        argv += [names[0]] if nargs == 0 else [names[0], value.get(dest, "1")]
    cfg = resolve(argv)
    assert cfg.args.tp_size == 1 and cfg.args.enable_metrics


def test_a_context_length_above_the_models_is_refused_unless_allowed(capsys, monkeypatch):
    assert main(["--model-path", "m", "--context-length", "65536"]) == 1
    assert "To allow overriding this maximum, set the env var SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1" in (
        capsys.readouterr().err
    )
    monkeypatch.setenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1")
    assert resolve(["--model-path", "m", "--context-length", "65536"]).context_len == 65536


def test_a_server_stops_when_the_process_it_was_started_for_dies_though_that_is_not_its_parent():
    # the tests' servers are forked by a fork server for the test process: their parent is the fork server, and it is
    # the test process whose death must stop them (EXIT_WITH_PARENT names it)
    starter = subprocess.Popen(["sleep", "600"])
    try:
        with start_emulator([], env={EXIT_WITH_PARENT: str(starter.pid)}) as emu:
            assert emu.alive() and Http(emu.url).get("/v1/models")[0] == 200, "serving while its starter lives"
            starter.kill()
            starter.wait()
            assert emu.popen.wait(10) == 0
            assert f"the process that started it (pid {starter.pid}) is gone; stopping" in emu.log()
    finally:
        starter.kill()
        starter.wait()


def test_a_server_and_its_starter_killed_leave_no_log_behind(tmp_path):
    # the temp log is read through an open file once the server serves: a kill -9 of the starter leaves no file
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    starter = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from dflash_assets.emulator.process import start_emulator\n"
            "emu = start_emulator([])\n"
            "print(emu.pid, flush=True)\n"
            "time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        server = int(starter.stdout.readline())
        assert list(tmp_path.iterdir()) == [], "the log has no name once the server serves"
        starter.kill()
        starter.wait()
        with contextlib.suppress(ProcessLookupError):  # not our child: its pidfd turns readable when it exits
            pidfd = os.pidfd_open(server)
            assert select.select([pidfd], [], [], 20)[0], "the server outlived the process it was started for"
            os.close(pidfd)
    finally:
        starter.kill()
        starter.wait()
    assert list(tmp_path.iterdir()) == []
