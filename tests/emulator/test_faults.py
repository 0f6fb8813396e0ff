"""Fault injection: 503 bursts, stalls, slow decode, unhealthy, crashes."""

from __future__ import annotations

import urllib.error
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.forks import start_emulator
from tests.support.http import aborted, settled
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(60)

FULL = {"object": "error", "message": "The request queue is full.", "type": "503", "param": None, "code": 503}


def gen(http, n=8, **kw):
    return http.post("/generate", {"text": "go", "sampling_params": {"max_new_tokens": n, "ignore_eos": True}}, **kw)


def test_a_503_burst_hits_the_next_n_requests_then_recovers(emulator):
    http = emulator()
    status, state = http.post("/_emulator/faults", {"fail_next": 2})
    assert status == 200 and state["settings"]["fail_next"] == 2
    assert [gen(http) for _ in range(2)] == [(503, FULL)] * 2
    assert gen(http)[0] == 200
    chat = http.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3})
    assert chat[0] == 200
    assert http.get("/_emulator/faults")[1]["injected"]["fail"] == 2


def test_a_503_rate_of_one_fails_everything_until_cleared(emulator):
    http = emulator("--fault-503-rate", "1.0")
    assert gen(http) == (503, FULL)
    assert http.request("DELETE", "/_emulator/faults")[0] == 200
    assert gen(http)[0] == 200


def test_fault_flags_apply_from_startup(emulator):
    http = emulator("--fault-503-next", "1")
    assert gen(http)[0] == 503 and gen(http)[0] == 200


def test_a_stall_holds_the_next_request_while_later_ones_are_answered(emulator):
    http = emulator()
    http.post("/_emulator/faults", {"stall_seconds": 5, "stall_next": 1})
    with ThreadPoolExecutor(1) as pool:
        stalled = pool.submit(gen, http)
        wait_for(
            "the stall to hold a request", lambda: http.get("/_emulator/faults")[1]["injected"]["stall"], every_s=0.02
        )
        assert gen(http)[0] == 200  # only the next request stalls: this one is answered ...
        assert not stalled.done()  # ... while the stalled one is still held
        status, body = stalled.result(timeout=30)
    assert status == 200 and body["meta_info"]["e2e_latency"] >= 5  # held the whole stall, then answered


def test_a_hold_keeps_requests_in_flight_until_it_is_cleared(emulator):
    http = emulator("--fault-hold")
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(gen, http)
        wait_for(
            "the hold to keep a request", lambda: http.get("/_emulator/faults")[1]["injected"]["hold"], every_s=0.02
        )
        assert not held.done()  # arrived and held: no answer while the hold is set
        assert http.post("/_emulator/faults", {"hold": None})[0] == 200
        assert held.result(timeout=30)[0] == 200
    assert gen(http)[0] == 200  # cleared: later requests are not held


def test_hold_after_serves_the_first_n_then_holds_and_a_held_request_whose_client_goes_is_aborted(emulator):
    http = emulator("--fault-hold-after", "2", "--enable-metrics")
    assert [gen(http)[0] for _ in range(2)] == [200, 200], "the first two are served"
    with pytest.raises(TimeoutError):  # the third is held: its client gives up and goes
        gen(http, timeout=1)
    assert settled(http)["num_running_reqs"] == 0 and aborted(http) == 1, "the held request was aborted"
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(gen, http)
        wait_for("a second held request", lambda: http.get("/_emulator/faults")[1]["injected"]["hold"] == 2)
        assert not held.done()
        assert http.post("/_emulator/faults", {"hold_after": None})[0] == 200
        assert held.result(timeout=30)[0] == 200
    assert gen(http)[0] == 200  # cleared: later requests are not held


def test_a_slow_factor_stretches_decode(emulator):
    http = emulator("--decode-tokens-per-s", "1000")
    fast = gen(http, 200)[1]["meta_info"]["e2e_latency"]
    http.post("/_emulator/faults", {"slow_factor": 3})
    slow = gen(http, 200)[1]["meta_info"]["e2e_latency"]
    assert fast >= 0.19 and slow >= 0.59


def test_unhealthy_turns_health_to_503(emulator):
    http = emulator()
    http.post("/_emulator/faults", {"unhealthy": True})
    assert http.get("/health")[0] == 503 and http.get("/health_generate")[0] == 503
    http.post("/_emulator/faults", {"unhealthy": None})
    assert http.get("/health")[0] == 200


def test_unknown_fault_settings_are_refused(emulator):
    status, body = emulator().post("/_emulator/faults", {"explode": True})
    assert status == 400 and "explode" in body["error"]


def test_crash_after_n_requests_kills_the_process():
    with start_emulator(["--fault-crash-after", "2"]) as emu:
        from tests.support.http import Http

        http = Http(emu.url)
        assert gen(http)[0] == 200 and gen(http)[0] == 200
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            gen(http, timeout=5)
        emu.popen.wait(5)
        assert emu.popen.returncode == 70
        assert "injected crash" in emu.log()


def test_crash_in_an_in_process_emulator_stops_serving(emulator):
    http = emulator()
    http.post("/_emulator/faults", {"crash_after": 0})
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        gen(http, timeout=5)
    wait_for("the crashed emulator to stop serving", lambda: not http.emu._thread.is_alive(), 5, every_s=0.05)
    assert http.emu.crashed and not http.emu._thread.is_alive()


def test_crash_on_a_prompt_kills_the_process_when_a_request_carries_it_and_not_before():
    with start_emulator(["--fault-crash-on", "POISON-7"]) as emu:
        from tests.support.http import Http

        http = Http(emu.url)
        chat = {"messages": [{"role": "user", "content": "a harmless question"}], "max_tokens": 3}
        assert http.post("/v1/chat/completions", chat)[0] == 200 and gen(http)[0] == 200
        poisoned = {"messages": [{"role": "user", "content": [{"type": "text", "text": "say POISON-7 twice"}]}]}
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            http.post("/v1/chat/completions", poisoned | {"max_tokens": 3}, timeout=5)
        emu.popen.wait(5)
        assert emu.popen.returncode == 70 and "injected crash" in emu.log()


def test_crash_on_set_at_run_time_matches_generate_text_and_is_counted(emulator):
    http = emulator()
    status, state = http.post("/_emulator/faults", {"crash_on": "POISON-7"})
    assert status == 200 and state["settings"]["crash_on"] == "POISON-7"
    assert gen(http)[0] == 200  # a prompt without the marker is served
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        http.post("/generate", {"text": ["fine", "POISON-7 here"], "sampling_params": {"max_new_tokens": 2}}, timeout=5)
    wait_for("the crashed emulator to stop serving", lambda: not http.emu._thread.is_alive(), 5, every_s=0.05)
    assert http.emu.crashed


def _abandoned_stream(url: str, rid: str) -> None:
    """A streamed chat request with `rid` whose client reads its first event, then closes the connection."""
    import http.client
    import json
    from urllib.parse import urlsplit

    conn = http.client.HTTPConnection(urlsplit(url).netloc, timeout=10)
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 64, "stream": True, "rid": rid}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    conn.close()


def test_a_half_open_stall_holds_its_slot_after_the_client_goes_until_abort_request_names_its_rid(emulator):
    http = emulator(
        *("--fault-stall-seconds", "3600", "--fault-stall-after-tokens", "2", "--fault-stall-next", "1"),
        *("--fault-half-open", "--enable-metrics"),
    )
    _abandoned_stream(http.emu.url, "held-1")
    assert gen(http)[0] == 200, "a later request is served while the abandoned one stays"
    assert http.get("/v1/loads")[1]["loads"][0]["num_running_reqs"] == 1, "the close was not seen: the slot is held"
    assert http.post("/abort_request", {"rid": "someone-else"}) == (200, "")
    assert http.post("/abort_request", {"rid": "held-1"}) == (200, "")
    assert settled(http)["num_running_reqs"] == 0
    _, stats = http.get("/_emulator/stats")
    assert stats["stalled_rids"] == ["held-1"]
    assert stats["abort_requests"] == [
        {"rid": "someone-else", "abort_all": False, "running": False},
        {"rid": "held-1", "abort_all": False, "running": True},
    ]
    assert aborted(http) == 1
    assert http.post("/abort_request", {"rid": 7})[0] == 400, "an AbortReq's rid is a string"


def test_abort_request_takes_the_admin_key_alone_once_one_is_set(emulator):
    http = emulator("--api-key", "user-key", "--admin-api-key", "admin-key")
    assert http.post("/abort_request", {"rid": "r"}, headers={"Authorization": "Bearer user-key"})[0] == 401
    assert http.post("/abort_request", {"rid": "r"}, headers={"Authorization": "Bearer admin-key"}) == (200, "")
    assert http.get("/v1/models", headers={"Authorization": "Bearer user-key"})[0] == 200
